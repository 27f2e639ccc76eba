"""The local state dir's checkpoint manager is named for the installed Spark: the class must be in its jars."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pyspark

from sinks._spark import _local_checkpoint_manager


def test_the_class_named_for_the_installed_spark_is_in_its_sql_jar() -> None:
    name = _local_checkpoint_manager(pyspark.__version__)
    (jar,) = (Path(pyspark.__file__).parent / "jars").glob("spark-sql_*.jar")
    with zipfile.ZipFile(jar) as classes:
        assert name.replace(".", "/") + ".class" in classes.namelist()


def test_spark_4_1_moved_it_into_the_checkpointing_package() -> None:
    assert _local_checkpoint_manager("4.0.0").endswith("streaming.FileSystemBasedCheckpointFileManager")
    assert _local_checkpoint_manager("4.2.0").endswith("streaming.checkpointing.FileSystemBasedCheckpointFileManager")
