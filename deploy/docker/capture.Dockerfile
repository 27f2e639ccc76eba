# syntax=docker/dockerfile:1
# The capture service, `cdc run`: PostgreSQL's logical replication stream to Avro on Kafka.
#   docker build -f deploy/docker/capture.Dockerfile -t pgcdc-capture .
# The C extension (cdc/_native.pyx, the capture's hot path) is compiled in the build stage; the image that runs
# has no compiler. It runs as an unprivileged user and reads its configuration from /etc/pgcdc/pgcdc.toml and
# CDC_* variables (docs/configuration.md).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Build tools of the distribution's own release; nothing of this stage reaches the final image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY pgcdc_common/ pgcdc_common/
COPY cdc/ cdc/
COPY decoders/ decoders/
COPY schemas/ schemas/
COPY sinks/ sinks/
COPY pgcdc/ pgcdc/
# Every wheel the service needs, so that the final stage installs offline. The extension is optional in
# setup.py (a plain install without a compiler still works): here its absence is an error.
RUN pip wheel --no-cache-dir --wheel-dir /wheels . \
    && python -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/pgcdc-*.whl')[0]).namelist(); sys.exit(not any(n.startswith('cdc/_native') and n.endswith('.so') for n in names))"

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 pgcdc \
    && useradd --system --uid 10001 --gid pgcdc --no-create-home --home-dir /nonexistent pgcdc
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels /wheels/pgcdc-*.whl \
    && rm -rf /wheels
USER 10001:10001
# Metrics, the live dashboard and /healthz listen on every interface of the container: publish the port on
# 127.0.0.1 only, or behind your network's controls.
ENV CDC_METRICS__HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1
EXPOSE 9464
# Healthy while the capture snapshots or streams (/healthz answers 503 in any other state).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2)"]
ENTRYPOINT ["cdc"]
CMD ["run", "--config", "/etc/pgcdc/pgcdc.toml"]
