"""A reader racing the warehouse sink's first batch finds no table yet, not an error.

Delta creates a table's ``_delta_log`` directory before version 0 is committed into it. ``cdc verify`` (and a
rebuild's check) started beside a sink that is writing its first batch sees that directory; the warehouse
must answer "nothing yet" so the comparison waits, as it does before the directory exists.
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

from sinks import SinkContext, TableRef
from sinks._warehouse import WarehouseSink
from sinks.config import SinksConfig, SinkSettings, WarehouseConfig
from tests.integration._sinks_helpers import SPARK_WORKER

pytestmark = SPARK_WORKER


_ROW = {"type": "record", "name": "r", "fields": [{"name": "id", "type": "int"}]}


def test_a_log_directory_with_no_commit_reads_as_no_table(spark: SparkSession, tmp_path: Path) -> None:
    settings = SinkSettings(
        sinks=SinksConfig(state_dir=str(tmp_path / "state"), warehouse=WarehouseConfig(path=str(tmp_path / "wh")))
    )
    sink = WarehouseSink()
    sink.open(SinkContext("warehouse", settings, {}, 1, spark))
    ref = TableRef("p.public.t", "public.t", ("id",), _ROW)
    (tmp_path / "wh" / "g1" / "public.t" / "_delta_log").mkdir(parents=True)
    assert sink.read_frame(ref, 1) is None
    assert list(sink.read_table(ref, 1)) == []

    spark.createDataFrame([(1,)], "id int").write.format("delta").save(sink.path("public.t", 1))
    read = sink.read_frame(ref, 1)
    assert read is not None
    assert [r["id"] for r in read[0].collect()] == [1]
