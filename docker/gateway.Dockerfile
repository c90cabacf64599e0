# syntax=docker/dockerfile:1
# The OpenAI-compatible HTTP gateway (`dhisparse gateway`). Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t dhisparse-gateway .   (or: make images)
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY dhisparse ./dhisparse
COPY services ./services
# The gateway never imports torch, triton or xgrammar (the workers compile grammars;
# tests/deploy/test_docker.py checks it), so the project's dependencies are installed without
# them (xgrammar would pull torch in), read from pyproject.toml so that the list cannot drift;
# then the project itself, without its dependencies.
RUN python -m venv /opt/venv \
 && python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if re.split(r'[\s<>=!~;\[]', d)[0] not in ('torch', 'triton', 'xgrammar')))" > /tmp/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-deps . \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 dhisparse \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dhisparse dhisparse
COPY --from=build /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/dhisparse/healthcheck.py
# The shipped model's tokenizer, chat template and generation defaults (no weights): the
# chart's default model source, read by the gateway as from a mounted model directory.
COPY models/glm-dsa-mini/config.json models/glm-dsa-mini/generation_config.json \
     models/glm-dsa-mini/tokenizer.json models/glm-dsa-mini/tokenizer_config.json \
     models/glm-dsa-mini/chat_template.jinja /opt/dhisparse/models/glm-dsa-mini/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=True \
    DHISPARSE_GATEWAY_HOST=0.0.0.0 \
    DHISPARSE_GATEWAY_PORT=8000
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/dhisparse
EXPOSE 8000
# /health is 200 while at least one worker is healthy; /metrics is on the same port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/opt/dhisparse/healthcheck.py", "gateway"]
ENTRYPOINT ["dhisparse", "gateway"]
