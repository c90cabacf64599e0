# syntax=docker/dockerfile:1
# The node's host KV store (`dhisparse kv-host-store`): owns the arena file under /dev/shm.
# Build from the repository root:
#   docker build -f docker/kv-host-store.Dockerfile -t dhisparse-kv-host-store .
# Run with a /dev/shm large enough for the arena, shared with the node's workers, e.g.
#   docker run --ipc=shareable --shm-size=64g ... ; workers: --ipc=container:<store>
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY dhisparse ./dhisparse
COPY services ./services
# The store never imports torch or triton (tests/deploy/test_docker.py checks it): install the
# project's dependencies without them (read from pyproject.toml), then the project itself.
RUN python -m venv /opt/venv \
 && python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if re.split(r'[\s<>=!~;\[]', d)[0] not in ('torch', 'triton')))" > /tmp/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-deps . \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 dhisparse \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dhisparse dhisparse
COPY --from=build /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/dhisparse/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=True \
    DHISPARSE_KV_STORE_HOST=0.0.0.0 \
    DHISPARSE_KV_STORE_PORT=50061 \
    DHISPARSE_KV_STORE_METRICS_PORT=9102
# Numeric, so that Kubernetes' runAsNonRoot can verify it. Workers run as the same user: the
# arena file the store creates must be writable by them.
USER 10001:10001
WORKDIR /home/dhisparse
EXPOSE 50061 9102
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "/opt/dhisparse/healthcheck.py", "kv-host-store"]
ENTRYPOINT ["dhisparse", "kv-host-store"]
