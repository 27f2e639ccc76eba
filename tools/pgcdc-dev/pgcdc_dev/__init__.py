"""pgcdc's development tooling, apart from the product: the local services, how tests and benchmarks find
services, and the benchmark harness.

- ``pgcdc_dev.services``: PostgreSQL, Kafka, the registry, OpenSearch, Redis, Spark, an S3 server, without
  Docker (``./dev services …`` runs it; stdlib only);
- ``pgcdc_dev.discovery``: where a test or a benchmark finds each service (a ``CDC_TEST_*`` variable,
  testcontainers, or the local services; stdlib only);
- ``pgcdc_dev.cluster``: pgcdc shipped to a Spark cluster (a PEX file, spark-submit) and the S3 server's buckets;
- ``pgcdc_dev.codecs``: the capture's row codecs, built without a database, for tests and micro-benchmarks;
- ``pgcdc_dev.bench``: the benchmark harness (``./dev bench``): results, tables, charts, CPU accounting, the
  broker's warm-up, and the runner of the scenarios in the checkout's ``bench/``.

Tests and benchmarks both use this package; neither imports the other. It is installed (editable) by ``./dev``
from a checkout, whose root it knows as :data:`CHECKOUT`.
"""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[3]
"""The pgcdc checkout this package is installed from (editable): tools/pgcdc-dev/pgcdc_dev/ is three levels down."""
