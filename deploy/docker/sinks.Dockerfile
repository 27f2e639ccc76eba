# syntax=docker/dockerfile:1
# The derived views, `cdc sinks run` (search, cache, warehouse and any installed plugin), on Apache's Spark image.
#   docker build -f deploy/docker/sinks.Dockerfile -t pgcdc-sinks .
# The image's Spark runs the sinks in local mode by default (sinks.spark_master); the same image serves as a
# cluster's driver and executors under spark-submit (docs/sinks.md, "On a cluster").
ARG SPARK_IMAGE=apache/spark:4.2.0-scala2.13-java17-ubuntu
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.5

FROM ${UV_IMAGE} AS uv

FROM ${SPARK_IMAGE}
USER 0
COPY --from=uv /uv /usr/local/bin/uv
# pgcdc needs Python 3.11 or newer; the image's Ubuntu has an older one, so uv installs a standalone CPython
# (and the virtualenv the sinks and Spark's Python workers run in).
ENV UV_PYTHON_INSTALL_DIR=/opt/pgcdc/python \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/pgcdc/venv \
    PATH=/opt/pgcdc/venv/bin:$PATH \
    PYSPARK_PYTHON=/opt/pgcdc/venv/bin/python
RUN uv venv --python 3.11 /opt/pgcdc/venv
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY pgcdc_common/ pgcdc_common/
COPY cdc/ cdc/
COPY decoders/ decoders/
COPY schemas/ schemas/
COPY sinks/ sinks/
COPY pgcdc/ pgcdc/
# pyspark from the package index is the image's Spark version (pyproject.toml pins it); with SPARK_HOME set
# it launches the image's Spark.
# The base image's Spark must be that pyspark: a mismatch stops the build, saying which base to use.
RUN uv pip install ".[sinks]" \
    && python -c "import glob, os, sys, pyspark; v = pyspark.__version__; sys.exit(None if glob.glob(os.path.join(os.environ['SPARK_HOME'], 'jars', f'spark-core_*-{v}.jar')) else f'the base image Spark (SPARK_HOME={os.environ[\"SPARK_HOME\"]}) is not the pyspark {v} that pyproject.toml pins: build with --build-arg SPARK_IMAGE=apache/spark:{v}-scala2.13-java17-ubuntu')"
# Spark's Kafka source, spark-avro and Delta, resolved once here by the sinks' own session builder (the
# coordinates sinks.connectors and delta-spark derive from the pyspark and delta-spark just installed, so no
# version is written here), into the directory that sinks.spark_jars names: the container needs no Maven at run
# time. Jars the image's Spark already has are left out.
RUN python -c "from sinks.app import build_session, stop_session; stop_session(build_session('pgcdc-image', [], master='local[1]', conf={'spark.jars.ivy': '/tmp/ivy'}))" \
    && mkdir -p /opt/pgcdc/jars \
    && for jar in /tmp/ivy/jars/*.jar; do \
         name="$(basename "$jar")"; \
         [ -e "/opt/spark/jars/${name#*_}" ] || cp "$jar" "/opt/pgcdc/jars/${name#*_}"; \
       done \
    && rm -rf /tmp/ivy /src /root/.cache/pgcdc \
    && mkdir -p /var/lib/pgcdc \
    && chown 185:185 /var/lib/pgcdc
# 185 is the image's own unprivileged user, `spark`.
USER 185:185
WORKDIR /var/lib/pgcdc
# HOME: Spark's and pgcdc's caches (the JVM's class-data archive) go to the state volume.
ENV HOME=/var/lib/pgcdc \
    CDC_SINKS__METRICS_HOST=0.0.0.0 \
    CDC_SINKS__SPARK_JARS=/opt/pgcdc/jars \
    PYTHONUNBUFFERED=1
EXPOSE 9465
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9465/metrics', timeout=2)"]
ENTRYPOINT ["cdc"]
CMD ["sinks", "run", "--config", "/etc/pgcdc/pgcdc.toml"]
