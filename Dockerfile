# fisherlens image for the app and the workers (docker-compose.yml).
# GPU workers: the default torch wheel from PyPI bundles CUDA. CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FISHERLENS_HOME=/data \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app

# A C compiler for the series kernel (compute/sparsity/series_kernel.py: built once per machine on first use,
# -march=native; without it the numpy path runs, same numbers, about 3x slower per checkpoint).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "torch>=2.4" --index-url "$TORCH_INDEX_URL"; \
    else pip install "torch>=2.4"; fi

# Dependencies first (cached layer), then the source.
COPY pyproject.toml README.md ./
RUN mkdir -p app compute storage && touch app/__init__.py compute/__init__.py storage/__init__.py \
    && pip install . && pip uninstall -y fisherlens
COPY app app
COPY compute compute
COPY storage storage
COPY frontend_assets frontend_assets
# the measured throughput the per-job time ceiling uses (app/limits.py; THROUGHPUT_FILE overrides)
COPY benchmarks/results/throughput.json benchmarks/results/throughput.json
RUN pip install --no-deps -e .

RUN useradd --create-home --uid 1000 fisherlens && mkdir -p /data /models && chown fisherlens /data
USER fisherlens
VOLUME ["/data"]
EXPOSE 7860

CMD ["fisherlens", "up", "--no-worker", "--host", "0.0.0.0", "--port", "7860"]
