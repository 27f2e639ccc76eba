"""The benchmarks' pure parts: measures and their targets, the Markdown table, the README block, run_all."""

from __future__ import annotations

import json
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from pgcdc_dev.bench import charts as _charts
from pgcdc_dev.bench import render, run_all
from pgcdc_dev.bench.report import Measure, Result, combine, markdown_rows, write_result


@pytest.fixture(autouse=True)
def warmed(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """run_all's broker warm-up, recorded instead of run: these tests have no broker."""
    calls: list[float] = []

    def warm_broker(seconds: float) -> dict[str, Any]:
        calls.append(seconds)
        return {"seconds": seconds}

    monkeypatch.setattr(run_all, "warm_broker", warm_broker)
    # Nor does a scenario here wait for a quiet machine (a CHECKPOINT, then up to 30 s for the CPU to fall
    # below 15 %): they measure nothing, and beside the test run's services each wait took the whole 30 s.
    monkeypatch.setattr(run_all, "settle", lambda checkpoint=None: "not settled: nothing is measured")
    return calls


X = "\N{MULTIPLICATION SIGN}"  # the table's own characters, spelled out for the linter
DASH = "\N{EN DASH}"

# --- Measure -------------------------------------------------------------------------------------------------------


def test_a_rate_is_ours_over_the_reference() -> None:
    m = Measure("capture rows/s", "rows/s", 40_000, 100_000, "pg_recvlogical", target_ratio=0.8)
    assert m.ratio == pytest.approx(0.4)
    assert m.target == f"≥ 0.8{X} pg_recvlogical"
    assert m.met is False
    assert Measure("r", "rows/s", 90_000, 100_000, "ref", target_ratio=0.8).met is True
    assert Measure("r", "rows/s", 80_000, 100_000, "ref", target_ratio=0.8).met is True  # the target is ≥


def test_a_cost_is_the_reference_over_ours() -> None:
    """Bigger is better for every ratio: half the reference's cost is a ratio of 2."""
    m = Measure("µs per row", "µs", 10, 20, "pg_recvlogical", higher_is_better=False, target_ratio=1.5)
    assert m.ratio == pytest.approx(2.0)
    assert m.met is True
    assert Measure("cost", "µs", 40, 20, "ref", higher_is_better=False, target_ratio=1).met is False


def test_no_ratio_without_a_usable_reference() -> None:
    assert Measure("r", "rows/s", 10).ratio is None
    assert Measure("r", "rows/s", 10, 0, "ref").ratio is None  # no division by zero
    assert Measure("r", "rows/s", 0, 10, "ref", higher_is_better=False).ratio is None
    # a ratio target that cannot be evaluated is neither met nor missed
    assert Measure("r", "rows/s", 10, None, "ref", target_ratio=0.8).met is None


def test_absolute_limits() -> None:
    latency = Measure("p99 latency", "ms", 80, limit=100, higher_is_better=False)
    assert latency.ratio is None
    assert latency.target == "< 100 ms"
    assert latency.met is True
    assert Measure("p99 latency", "ms", 100, limit=100, higher_is_better=False).met is False  # strictly below
    rss = Measure("peak RSS", "MB", 300, limit=256, higher_is_better=False)
    assert rss.met is False
    floor = Measure("rows/s", "rows/s", 5000, limit=1000)
    assert floor.target == "> 1000 rows/s"
    assert floor.met is True


def test_no_target_means_nothing_to_meet() -> None:
    m = Measure("events", "events", 12)
    assert m.target == ""
    assert m.met is None


def test_json_carries_the_derived_fields() -> None:
    doc = Measure("r", "rows/s", 1, 3, "ref", target_ratio=0.5).as_json()
    assert doc["ratio"] == 0.333
    assert doc["target"] == f"≥ 0.5{X} ref"
    assert doc["met"] is False
    assert doc["target_ratio"] == 0.5
    assert doc["limit"] is None


# --- the Markdown table ---------------------------------------------------------------------------------------------


def _doc(scenario: str, *measures: Measure, **extra: Any) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "date": "2026-11-23 10:00 UTC",
        "machine": {"cpus": 2, "cpu": "Test CPU", "memory_gb": 7.8},
        "params": {},
        "measures": [m.as_json() for m in measures],
        "series": {},
        "notes": [],
        **extra,
    }


def test_markdown_rows() -> None:
    table = markdown_rows(
        [
            _doc(
                "insert-heavy",
                Measure("capture rows/s", "rows/s", 38_157, 136_586, "pg_recvlogical", target_ratio=0.8),
                Measure("peak RSS", "MB", 85, limit=256, higher_is_better=False),
            ),
            _doc("latency", Measure("samples", "events", 3)),
        ]
    )
    lines = table.splitlines()
    assert lines[0] == "| scenario | measure | pgcdc | reference | ratio | target | met |"
    assert lines[1] == "|---|---|---:|---:|---:|---|:-:|"
    assert lines[2] == (
        f"| insert-heavy | capture rows/s | 38,157 rows/s | 136,586 (pg_recvlogical) | 0.28{X} "
        f"| ≥ 0.8{X} pg_recvlogical | **no** |"
    )
    assert lines[3] == f"| insert-heavy | peak RSS | 85 MB | {DASH} | {DASH} | < 256 MB | yes |"
    assert lines[4] == f"| latency | samples | 3 events | {DASH} | {DASH} |  |  |"
    assert len(lines) == 5


def test_write_result_writes_a_document_render_recognises(tmp_path: Path) -> None:
    path = write_result(Result("x", {"rows": 1}, [Measure("r", "rows/s", 1, 2, "ref", target_ratio=1)]), tmp_path)
    assert path == tmp_path / "x.json"
    doc = json.loads(path.read_text())
    assert render.is_result_doc(doc)
    assert not render.is_result_doc({"rows": 1000000, "cdc_rows_per_s": 38157})  # the older files' format
    assert not render.is_result_doc({"scenario": "x", "measures": [{"name": "r"}]})


# --- the README block -----------------------------------------------------------------------------------------------

README = f"""# pgcdc

## Benchmarks

Prose that stays.

{render.START}
| old | table |
{render.END}

More prose.

## Tests
"""


def test_the_readme_block_is_replaced_and_nothing_else() -> None:
    new = render.replace_between_markers(README, "Measured today.\n\n| new |")
    assert "| old | table |" not in new
    assert f"{render.START}\n\nMeasured today.\n\n| new |\n\n{render.END}" in new
    before, after = README.split(render.START, maxsplit=1)[0], README.split(render.END)[1]
    assert new.startswith(before)
    assert new.endswith(after)


def test_replacing_is_idempotent() -> None:
    once = render.replace_between_markers(README, "| new |\n")
    assert render.replace_between_markers(once, "| new |\n") == once
    assert render.replace_between_markers(once, "\n\n| new |") == once  # surrounding blank lines do not pile up


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("# pgcdc\n\n## Benchmarks\n\nno markers\n", "is missing"),
        (f"{render.START}\n", f"{render.END!r} is missing"),
        (f"{render.START}\n{render.END}\n{render.START}\n", "occurs 2 times"),
        (f"{render.END}\n{render.START}\n", "comes before"),
    ],
)
def test_a_readme_without_proper_markers_is_refused(text: str, says: str) -> None:
    with pytest.raises(render.MarkersError, match="cannot place the benchmark results") as err:
        render.replace_between_markers(text, "| new |")
    assert says in str(err.value)


def test_render_refuses_a_readme_without_markers_before_writing_anything(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    write_result(Result("x", {}, [Measure("r", "rows/s", 1, 2, "ref", target_ratio=1)]), tmp_path)
    with pytest.raises(render.MarkersError):
        render.render(tmp_path, readme, quiet=True)
    assert readme.read_text() == "# no markers\n"
    assert not (tmp_path / render.SUMMARY_MD).exists()


def test_render_writes_summary_charts_and_readme(tmp_path: Path) -> None:
    results = tmp_path / "bench" / "results"
    readme = tmp_path / "README.md"
    readme.write_text(README)
    write_result(
        Result(
            "latency",
            {"seconds": 1},
            [
                Measure("p99 latency", "ms", 120, limit=100, higher_is_better=False),
                Measure("cost", "µs", 26, 13, "ref", higher_is_better=False, target_ratio=0.8),
            ],
            series={"latency_ms": [1.0, 2.0, 5.0, 40.0], "freshness_s": {"cache": [1.0, 2.0]}},
        ),
        results,
    )
    (results / "capture_throughput.json").write_text('{"rows": 1}\n')  # an older format: skipped
    out = render.render(results, readme, quiet=True)
    assert sorted(p.name for p in out.charts) == sorted(_charts.CHARTS)
    assert all(p.stat().st_size > 0 for p in out.charts)
    text = readme.read_text()
    assert "Measured 2026-" in text
    assert " CPU" in text
    assert "| latency | p99 latency | 120 ms |" in text
    assert "![" in text
    assert "(bench/results/ratios.png)" in text
    assert "Prose that stays." in text
    assert "More prose." in text
    summary = (results / render.SUMMARY_MD).read_text()
    assert "Missed targets" in summary
    assert "(ratios.png)" in summary
    # rendering again from the same files changes nothing in the README
    render.render(results, readme, quiet=True)
    assert readme.read_text() == text


def test_render_writes_the_front_summary_the_headline_figures(tmp_path: Path) -> None:
    results, page, front = tmp_path / "bench" / "results", tmp_path / "docs" / "benchmarks.md", tmp_path / "README.md"
    page.parent.mkdir()
    page.write_text(README)
    front.write_text(f"# pgcdc\n\n{render.FRONT_START}\nold\n{render.FRONT_END}\n\n## More\n")
    latency = Measure("p99 latency", "ms", 120, limit=100, higher_is_better=False)
    write_result(Result("latency", {}, [latency]), results)
    capture = [
        Measure("capture rows/s", "rows/s", 900, 1000, "pg_recvlogical", target_ratio=0.8),
        Measure("capture rows/s", "rows/s", 900, 300, "Debezium", target_ratio=2),
    ]
    write_result(Result("insert-heavy", {}, capture), results)
    write_result(Result("pgbench", {}, [Measure("tps", "tx/s", 500)]), results)
    render.render(results, page, quiet=True, front=front)
    text = front.read_text()
    assert f"| Capture, insert-heavy WAL | 900 rows/s | 1,000 rows/s (pg_recvlogical): 0.90{X} |" in text
    assert f"| Capture, insert-heavy WAL | 900 rows/s | 300 rows/s (Debezium): 3.00{X} |" in text
    assert "| Commit to Kafka, p99 at 2,000 txn/s | 120 ms | target < 100 ms |" in text
    assert text.index("pg_recvlogical") < text.index("Commit to Kafka")  # in HEADLINES' order
    assert "tps" not in text  # not a headline
    assert "[docs/benchmarks.md](docs/benchmarks.md)" in text
    assert "old" not in text
    assert text.endswith("## More\n")
    assert "| latency | p99 latency | 120 ms |" in page.read_text()


def test_a_chart_with_nothing_to_show_is_removed(tmp_path: Path) -> None:
    (tmp_path / _charts.LATENCY).write_bytes(b"stale")
    docs = [_doc("x", Measure("r", "rows/s", 1, 2, "ref", target_ratio=1))]
    written = _charts.render_charts(docs, tmp_path)
    assert [p.name for p in written] == [_charts.RATIOS]
    assert not (tmp_path / _charts.LATENCY).exists()


def test_latency_series_are_found_by_name_and_shape() -> None:
    doc = _doc(
        "s",
        series={
            "latency_ms": [1, 2.5],
            "freshness_ms": {"search": [6.0], "bad": ["x"]},
            "samples": {"t_s": [0.1, 0.2], "latency_ms": [3.0, 4.0]},  # capture_latency's shape
            "latency_histogram_ms": {"upper_ms": [1.0, 2.0], "count": [5.0, 1.0]},  # binned: not samples
            "lag": {"cache": {"t_s": [0.0], "records": [3]}},
            "lag_load_window_s": [0.0, 60.0],
            "rows_per_s": [1, 2],
            "latency_empty_ms": [],
        },
    )
    found = _charts.latency_series([doc])
    assert found == {
        "ms": [
            ("s: latency_ms", [1.0, 2.5]),
            ("s: freshness_ms search", [6.0]),
            ("s: samples latency_ms", [3.0, 4.0]),
        ]
    }


def test_a_failed_scenario_hides_its_stale_result_until_re_run(tmp_path: Path) -> None:
    write_result(Result("a", {}, [Measure("r", "rows/s", 1, 2, "ref", target_ratio=1)]), tmp_path)
    stale = tmp_path / "a.json"
    summary = {"started_epoch": stale.stat().st_mtime + 1, "scenarios": [{"scenario": "a", "status": "failed"}]}
    (tmp_path / render.SUMMARY_JSON).write_text(json.dumps(summary))
    state = render.current(tmp_path)
    assert state.docs == []
    assert state.failed == ["a"]
    assert "| a | **failed**" in render.results_table(state.docs, state.failed)
    summary["started_epoch"] = stale.stat().st_mtime - 1  # written after that run: shown again
    (tmp_path / render.SUMMARY_JSON).write_text(json.dumps(summary))
    state = render.current(tmp_path)
    assert [d["scenario"] for d in state.docs] == ["a"]
    assert state.failed == []


# --- run_all --------------------------------------------------------------------------------------------------------


def test_quick_flags_a_scenario_does_not_accept_are_dropped() -> None:
    argv = ["--rows", "1000", "--seconds", "5", "--megabytes=64", "--offset", "-3", "--flag"]
    kept, dropped = run_all.filter_argv(argv, {"--rows", "--offset", "--flag"})
    assert kept == ["--rows", "1000", "--offset", "-3", "--flag"]
    assert dropped == ["--seconds", "--megabytes"]
    assert run_all.filter_argv(argv, None) == (argv, [])  # unknown: everything passes
    assert run_all.filter_argv(["--rows", "1"], set()) == ([], ["--rows"])


def test_the_options_a_module_accepts() -> None:
    source = textwrap.dedent(
        """
        import argparse
        def run(argv=None):
            p = argparse.ArgumentParser()
            p.add_argument("--rows", "-r", type=int)
            p.add_argument("name")
            g = p.add_mutually_exclusive_group()
            g.add_argument("--seconds", type=float)
        """
    )
    assert run_all.options_in_source(source) == {"--rows", "-r", "--seconds"}
    assert run_all.options_in_source("def run(argv=None): pass\n") is None

    import argparse

    with_parser = types.ModuleType("with_parser")
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes")
    with_parser.PARSER = parser  # type: ignore[attr-defined]
    assert run_all.accepted_options(with_parser) == {"-h", "--help", "--megabytes"}

    def build_parser() -> argparse.ArgumentParser:
        return parser

    with_factory = types.ModuleType("with_factory")
    with_factory.build_parser = build_parser  # type: ignore[attr-defined]
    assert run_all.accepted_options(with_factory) == {"-h", "--help", "--megabytes"}


def test_quick_argv_warns_about_what_it_drops(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    module = types.ModuleType("fake_scenario")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows")
    module.PARSER = parser  # type: ignore[attr-defined]
    monkeypatch.setitem(run_all.QUICK_ARGV, "fake", ["--rows", "10", "--seconds", "2"])
    assert run_all.quick_argv("fake", module) == ["--rows", "10"]
    assert "does not accept --seconds" in capsys.readouterr().err


def test_the_quick_table_names_known_scenarios() -> None:
    assert set(run_all.QUICK_ARGV) <= set(run_all.SCENARIOS)
    for argv in run_all.QUICK_ARGV.values():
        assert argv
        assert run_all._is_option(argv[0])


def test_selecting_scenarios() -> None:
    everything = list(run_all.SCENARIOS)
    assert run_all.select(None, None) == everything
    assert run_all.select("latency,insert-heavy", None) == ["insert-heavy", "latency"]  # in run order
    assert run_all.select("capture_latency", None) == ["latency"]  # a module name works too
    assert run_all.select(None, "sinks,snapshot") == [n for n in everything if n not in {"sinks", "snapshot"}]
    with pytest.raises(SystemExit, match="unknown scenario"):
        run_all.select("nope", None)
    assert run_all.parse_extra(["insert-heavy=--rows 5", "insert_heavy=--x"]) == {
        "insert-heavy": ["--rows", "5", "--x"]
    }
    with pytest.raises(SystemExit, match="NAME=ARGS"):
        run_all.parse_extra(["--rows 5"])


def test_a_failing_scenario_is_recorded_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    suffix = tmp_path.name.replace("-", "_")
    modules = _scenario_package(tmp_path, monkeypatch)
    (modules / f"fails_{suffix}.py").write_text("def run(argv=None):\n    raise RuntimeError('broken on purpose')\n")
    (modules / f"works_{suffix}.py").write_text(
        textwrap.dedent(
            """
            import argparse
            from pgcdc_dev.bench.report import Measure, Result

            def run(argv=None):
                p = argparse.ArgumentParser()
                p.add_argument("--rows", type=int, default=100)
                args = p.parse_args(argv)
                return Result(
                    "works",
                    {"rows": args.rows},
                    [Measure("rows/s", "rows/s", 50, 100, "ref", target_ratio=0.8)],
                    series={"latency_ms": [1.0, 2.0, 3.0]},
                )
            """
        )
    )
    scenarios = {"fails": f"fails_{suffix}", "missing": f"missing_{suffix}", "works": f"works_{suffix}"}
    monkeypatch.setattr(run_all, "SCENARIOS", scenarios)
    monkeypatch.setattr(run_all, "QUICK_ARGV", {"works": ["--rows", "7", "--seconds", "1"]})
    results = tmp_path / "results"

    code = run_all.main(["--quick", "--no-readme", "--results", str(results)])

    assert code == 1  # a scenario failed; the missed target alone would not fail the run
    err = capsys.readouterr().err
    assert "broken on purpose" in err  # the traceback
    assert "does not accept --seconds" in err
    summary = json.loads((results / render.SUMMARY_JSON).read_text())
    assert {s["scenario"]: s["status"] for s in summary["scenarios"]} == {
        "fails": "failed",
        "missing": "failed",
        "works": "ok",
    }
    assert summary["scenarios"][2]["argv"] == ["--rows", "7"]
    assert [d["scenario"] for d in summary["documents"]] == ["works"]
    assert summary["documents"][0]["params"] == {"rows": 7}
    assert summary["machine"]["cpus"]
    assert summary["total_seconds"] >= 0
    md = (results / render.SUMMARY_MD).read_text()
    assert "| fails | **failed**" in md
    assert "| works | rows/s |" in md
    assert (results / _charts.RATIOS).exists()
    assert (results / _charts.LATENCY).exists()

    # --render-only rebuilds the same from the files
    (results / render.SUMMARY_MD).unlink()
    assert run_all.main(["--render-only", "--no-readme", "--results", str(results)]) == 0
    assert (results / render.SUMMARY_MD).read_text() == md


def _scenario_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package of scenario modules in ``tmp_path`` that run_all imports instead of the checkout's bench/."""
    name = f"scenarios_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # pytest's, undone after the test: where the package is found
    monkeypatch.setattr(run_all, "SCENARIO_PACKAGE", name)
    monkeypatch.setattr(run_all, "SCENARIO_DIR", package)
    return package


def _only_scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, measure: str) -> None:
    """Makes run_all's one scenario ``name``: a module whose run() reports ``measure`` (source)."""
    package = _scenario_package(tmp_path, monkeypatch)
    (package / "only.py").write_text(
        "from pgcdc_dev.bench.report import Measure, Result\n"
        f"def run(argv=None):\n    return Result({name!r}, {{}}, [{measure}])\n"
    )
    monkeypatch.setattr(run_all, "SCENARIOS", {name: "only"})


def test_a_run_where_every_scenario_works_exits_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _only_scenario(tmp_path, monkeypatch, "ok", "Measure('p99', 'ms', 500, limit=100, higher_is_better=False)")
    assert run_all.main(["--no-readme", "--results", str(tmp_path / "results")]) == 0  # a missed target is shown
    assert "**no**" in (tmp_path / "results" / render.SUMMARY_MD).read_text()


def test_a_scenario_module_from_elsewhere_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another package called like the scenarios' (an installed `bench`, say) would silently run something else."""
    monkeypatch.setattr(run_all, "SCENARIO_PACKAGE", "json")  # json.decoder: a module, but not from bench/
    with pytest.raises(ImportError, match="not in"):
        run_all.import_scenario("decoder")


def test_a_missing_scenario_module_says_where_to_run_from() -> None:
    with pytest.raises(ImportError, match="run the benchmarks from the checkout"):
        run_all.import_scenario("no_such_scenario")


def _run_doc(ours: float, reference: float | None, *, p99: float = 40.0, extra: bool = False) -> dict[str, Any]:
    measures = [
        Measure("rows/s", "rows/s", ours, reference, "ref", target_ratio=0.8),
        Measure("p99", "ms", p99, limit=50, higher_is_better=False),
    ]
    if extra:
        measures.append(Measure("only sometimes", "s", 1.0))
    return {
        "scenario": "s",
        "date": "d",
        "params": {"rows": 10},
        "measures": [m.as_json() for m in measures],
        "series": {"x": [ours]},
        "notes": ["n"],
    }


def test_repeated_runs_report_medians_of_their_own_ratios() -> None:
    # Ratios 0.9, 0.5, 0.85: the median ratio is 0.85, not ours' median over the references' median (0.9/1.0).
    runs = [_run_doc(90, 100, p99=60), _run_doc(100, 200, p99=45, extra=True), _run_doc(85, 100, p99=48)]
    doc = combine(runs)
    rate, p99, extra = doc["measures"]
    assert (rate["ours"], rate["reference"], rate["ratio"]) == (90, 100, 0.85)
    assert rate["ratio_range"] == [0.5, 0.9]
    assert rate["runs"] == 3
    assert rate["met"] is True
    assert (p99["ours"], p99["ours_range"], p99["met"]) == (48, [45, 60], True)
    assert (extra["name"], extra["runs"], extra["ours"]) == ("only sometimes", 1, 1.0)
    assert doc["params"] == {"rows": 10, "repeat": 3}
    assert doc["series"] == {"x": [85]}
    assert len(doc["repeats"]) == 3
    assert "median of 3 runs" in doc["notes"][-1]
    assert combine(runs[:1]) == runs[0]  # one run is left as it is
    # two runs: the mean of the middle pair; a median under the target is missed even if one run met it
    two = combine([_run_doc(90, 100), _run_doc(60, 100)])["measures"][0]
    assert (two["ratio"], two["met"]) == (0.75, False)
    rows = markdown_rows([doc])
    assert f"0.85{X} [0.50{DASH}0.90]" in rows
    assert f"48 ms [45{DASH}60]" in rows

    # Same name against two references (insert-heavy): two measures, never one median over both.
    def twice(ours: float, second_ref: str) -> dict[str, Any]:
        doc = _run_doc(ours, 100)
        other = Measure("rows/s", "rows/s", ours, 25, second_ref, target_ratio=2).as_json()
        return {**doc, "measures": [*doc["measures"], other]}

    first, _, second = combine([twice(80, "Debezium"), twice(70, "Debezium 3"), twice(90, "Debezium")])["measures"]
    assert (first["ratio"], first["ratio_range"]) == (0.8, [0.7, 0.9])
    assert (second["ratio"], second["ratio_range"]) == (3.2, [2.8, 3.6])
    assert second["reference_name"] == "Debezium or Debezium 3"  # every reference a median stands on is named
    assert second["target"] == f"≥ 2{X} Debezium or Debezium 3"
    with pytest.raises(ValueError, match="different scenarios"):
        combine([runs[0], {**runs[1], "scenario": "other"}])


def test_repeat_runs_each_scenario_n_times_and_writes_the_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suffix = tmp_path.name.replace("-", "_")
    modules = _scenario_package(tmp_path, monkeypatch)
    # Each run reports the next ratio from a file-backed counter: 0.6, 0.9, 0.7 -> median 0.7.
    (modules / f"rep_{suffix}.py").write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from pgcdc_dev.bench.report import Measure, Result

            COUNT = Path({str(tmp_path / "count")!r})

            def run(argv=None):
                n = int(COUNT.read_text()) if COUNT.exists() else 0
                COUNT.write_text(str(n + 1))
                return Result("rep", {{}}, [Measure("rows/s", "rows/s", [60, 90, 70][n], 100, "ref", target_ratio=0.8)])
            """
        )
    )
    monkeypatch.setattr(run_all, "SCENARIOS", {"rep": f"rep_{suffix}"})
    results = tmp_path / "results"
    assert run_all.main(["--repeat", "3", "--no-readme", "--results", str(results)]) == 0
    assert (tmp_path / "count").read_text() == "3"
    measure = json.loads((results / "rep.json").read_text())["measures"][0]
    assert (measure["ratio"], measure["ratio_range"], measure["met"]) == (0.7, [0.6, 0.9], False)
    md = (results / render.SUMMARY_MD).read_text()
    assert f"0.70{X} [0.60{DASH}0.90]" in md
    assert "median of the runs' own ratios" in md
    with pytest.raises(SystemExit):
        run_all.main(["--repeat", "0", "--no-readme", "--results", str(results)])

    # A scenario whose second run fails is failed, and its first run's figures are not left to be shown.
    (modules / f"flaky_{suffix}.py").write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from pgcdc_dev.bench.report import Measure, Result

            RUNS = Path({str(tmp_path / "flaky")!r})

            def run(argv=None):
                if RUNS.exists():
                    raise RuntimeError("second run broke")
                RUNS.write_text("1")
                return Result("flaky", {{}}, [Measure("rows/s", "rows/s", 90, 100, "ref", target_ratio=0.8)])
            """
        )
    )
    monkeypatch.setattr(run_all, "SCENARIOS", {"flaky": f"flaky_{suffix}"})
    assert run_all.main(["--repeat", "2", "--no-readme", "--results", str(results)]) == 1
    assert not (results / "flaky.json").exists()
    assert "| flaky | **failed**" in (results / render.SUMMARY_MD).read_text()


def test_the_readme_line_says_how_the_broker_was_warmed() -> None:
    docs = [{"date": "2026-11-24 13:19 UTC", "machine": {"cpus": 2}}]
    windows = [{"at_s": 5.0, "records_per_s": 1, "broker_us_per_record": 0.451}, {"broker_us_per_record": 0.29}]
    warmed = {"broker_warmup": {"seconds": 60.2, "records": 40_660_000, "windows": windows}}
    ran = [{"scenario": "insert-heavy"}, {"scenario": "snapshot"}]
    line = render.measured_line(docs, {"command": "./dev bench", **warmed, "scenarios": ran})
    assert line.endswith(
        " Before the latest run (insert-heavy, snapshot) the Kafka broker was warmed for 60 s (40,660,000 records"
        " produced; its CPU per record 0.45 µs in the first seconds, 0.29 in the last)."
    )
    assert "warmed" not in render.measured_line(docs, {"command": "./dev bench --warm-broker 0", "broker_warmup": None})


def test_the_broker_is_warmed_unless_quick_or_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warmed: list[float]
) -> None:
    _only_scenario(
        tmp_path, monkeypatch, "insert-heavy", "Measure('rows/s', 'rows/s', 90, 100, 'ref', target_ratio=0.8)"
    )
    results = tmp_path / "results"
    assert run_all.main(["--no-readme", "--results", str(results)]) == 0
    assert run_all.main(["--quick", "--no-readme", "--results", str(results)]) == 0  # --quick: no warm-up
    assert run_all.main(["--warm-broker", "0", "--no-readme", "--results", str(results)]) == 0
    assert run_all.main(["--quick", "--warm-broker", "3", "--no-readme", "--results", str(results)]) == 0
    assert warmed == [run_all.DEFAULT_WARM_BROKER_S, 3]
    assert json.loads((results / render.SUMMARY_JSON).read_text())["broker_warmup"] == {"seconds": 3}
