"""pgcdc_dev.testrun: the slowest tests of a run's JUnit reports, and Spark drivers told apart in /proc."""

from __future__ import annotations

from pathlib import Path

from pgcdc_dev import testrun

_REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.unit.test_a" name="test_fast" time="0.5"/>
<testcase classname="tests.integration.test_b" name="test_slow[x]" time="120.25"/>
<testcase classname="tests.integration.test_c" name="test_middle" time="30"/>
</testsuite></testsuites>
"""


def test_the_slowest_tests_come_first_across_reports(tmp_path: Path) -> None:
    (tmp_path / "pg15.xml").write_text(_REPORT)
    (tmp_path / "pg18.xml").write_text(_REPORT.replace('time="30"', 'time="200"'))
    (tmp_path / "spark.txt").write_text("7\n")
    out = testrun.report(
        [tmp_path / "pg15.xml", tmp_path / "pg18.xml", tmp_path / "absent.xml"], 2, tmp_path / "spark.txt", None
    )
    lines = out.splitlines()
    assert lines[0] == "the 2 slowest of 6 tests:"
    assert lines[1].split() == ["200.0s", "pg18:", "tests.integration.test_c::test_middle"]
    assert lines[2].endswith("tests.integration.test_b::test_slow[x]"), lines[2]  # 120.25 s, in either report
    assert lines[-1] == "Spark applications started: 7; by what started them:"


def _process(proc: Path, pid: int, cmdline: bytes, started: int, parent: int = 0) -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "cmdline").write_bytes(cmdline)
    fields = ["S", str(parent), *["0"] * 17, str(started), "0"]  # state, parent, fields 5-21, starttime (22), vsize
    (entry / "stat").write_text(f"{pid} (java with spaces) {' '.join(fields)}\n")


def test_only_spark_drivers_are_counted_by_pid_and_start_time(tmp_path: Path) -> None:
    driver = b"java\x00-cp\x00jars/*\x00org.apache.spark.deploy.SparkSubmit\x00pyspark-shell\x00"
    _process(tmp_path, 100, driver, 5000)
    _process(tmp_path, 101, b"java\x00org.apache.spark.deploy.worker.Worker\x00", 5001)
    _process(tmp_path, 102, b"java\x00kafka.Kafka\x00", 5002)
    launcher = b"java\x00-cp\x00jars/*\x00org.apache.spark.launcher.Main\x00org.apache.spark.deploy.SparkSubmit\x00"
    _process(tmp_path, 103, launcher, 4999)  # spark-class's JVM that prints the driver's command
    (tmp_path / "self").mkdir()
    assert testrun.spark_drivers(tmp_path) == {(100, 5000)}


def test_a_driver_is_put_down_to_what_ran_spark_submit_not_to_its_scripts(tmp_path: Path) -> None:
    verify = b"python\x00-m\x00pgcdc\x00verify\x00--config\x00/tmp/pytest-3/test_toast0/cdc.toml\x00"
    _process(tmp_path, 40, verify, 10)
    _process(
        tmp_path, 50, b"bash\x00/venv/lib/pyspark/bin/spark-class\x00org.apache.spark.deploy.SparkSubmit\x00", 11, 40
    )
    _process(tmp_path, 100, b"java\x00org.apache.spark.deploy.SparkSubmit\x00", 12, 50)
    assert testrun.started_by(100, tmp_path) == "python -m pgcdc verify --config /tmp/pytest-3/test_toast0/cdc.toml"
    assert testrun.started_by(40, tmp_path) == "?"  # its parent (pid 0) is gone


def test_applications_are_counted_by_the_test_that_started_them() -> None:
    lines = [
        "python -m pgcdc sinks run --config /tmp/pytest-of-root/pytest-3/test_pipeline_survives_kills_a0/cdc.toml",
        "python -m pgcdc sinks run --config /tmp/pytest-of-root/pytest-3/test_pipeline_survives_kills_a0/cdc.toml",
        "python -m pgcdc verify --config /tmp/pytest-of-root/pytest-3/popen-gw1/test_toast0/cdc.toml",
        "python -m pytest -m integration -n 2",
    ]
    assert testrun.launchers(lines, 2) == [(2, "test_pipeline_survives_kills_a"), (1, "test_toast")]
