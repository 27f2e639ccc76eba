"""The benchmark scenarios (``./dev bench``): one module each, with ``run(argv) -> Result``, and the machinery
they share (``_capture_bench``, ``_debezium``, ``_sink_refs``). The harness that runs them, records their
results and draws the tables lives in the development package, ``pgcdc_dev.bench``; each scenario also runs
alone, from the checkout: ``./dev python -m bench.insert_heavy --help``."""
