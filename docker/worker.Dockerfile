# syntax=docker/dockerfile:1
# The GPU worker (`dhisparse worker`): engine, KV hierarchy, Triton kernels. Build from the
# repository root:
#   docker build -f docker/worker.Dockerfile -t dhisparse-worker .   (or: make images)
# The torch wheel brings its own CUDA libraries; the CUDA base image brings the settings the
# NVIDIA container runtime reads. Pick TORCH_INDEX_URL for the nodes' driver (cu130 needs a
# driver >= 580; use .../whl/cu128 with a CUDA 12.8 base image for older drivers).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

FROM ${CUDA_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the CUDA index and pinned (it brings the matching triton); the project's own
# `torch>=...` requirement is then already met, and the constraint keeps pip from replacing it.
RUN python3.12 -m venv /opt/venv \
 && /opt/venv/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && /opt/venv/bin/pip freeze | grep -iE '^(torch|triton)==' > /tmp/constraints.txt
WORKDIR /src
COPY pyproject.toml ./
COPY dhisparse ./dhisparse
COPY services ./services
RUN /opt/venv/bin/pip install -c /tmp/constraints.txt ".[triton]" \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher per kernel signature at run time: it needs a C compiler
# and Python's headers in the running image, not only at build time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 dhisparse \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dhisparse dhisparse \
 && mkdir -p /var/cache/dhisparse \
 && chown 10001:10001 /var/cache/dhisparse
COPY --from=build /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/dhisparse/healthcheck.py
# The shipped trained model pair (target + drafters), served by default.
COPY models/glm-dsa-mini /opt/dhisparse/models/glm-dsa-mini
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=True \
    TRITON_HOME=/var/cache/dhisparse \
    TRITON_CACHE_DIR=/var/cache/dhisparse/triton \
    XDG_CACHE_HOME=/var/cache/dhisparse \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/dhisparse/inductor \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DHISPARSE_WORKER_HOST=0.0.0.0 \
    DHISPARSE_WORKER_PORT=50051 \
    DHISPARSE_WORKER_METRICS_PORT=9101 \
    DHISPARSE_WORKER_DEVICE=cuda \
    DHISPARSE_WORKER_MODEL=/opt/dhisparse/models/glm-dsa-mini
# Numeric, so that Kubernetes' runAsNonRoot can verify it (the store runs as the same user).
USER 10001:10001
WORKDIR /home/dhisparse
EXPOSE 50051 9101
# The gRPC port opens only once the model is loaded; Health reports whether the engine lives.
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
  CMD ["python", "/opt/dhisparse/healthcheck.py", "worker"]
ENTRYPOINT ["dhisparse", "worker"]
