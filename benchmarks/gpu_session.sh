#!/usr/bin/env bash
# One prepared GPU session (issue 30): the GPU tests, the engine benchmark on CUDA and the
# researcher-scale Fisher job on CUDA, each under its own time limit so that one slow part still
# returns the others. Run from the repository root on a machine with a CUDA device:
#     OUT=/some/folder bash benchmarks/gpu_session.sh [scale sizes]
# Python packages the machine lacks may lie as wheels in .whl/ (installed into /tmp/site first).
set -uo pipefail
OUT=${OUT:-/tmp/fisherlens-gpu}; mkdir -p "$OUT"
SIZES=${1:-llama-50m,qwen3-1.7b,qwen3-8b}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; free -g | head -2; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
echo "== pytest -m gpu tests/gpu"
timeout ${PYTEST_S:-120} python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider -o addopts="-ra" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
echo "== bench_fisher on cuda ($((SECONDS - t0)) s)"
timeout ${FISHER_S:-75} python3 benchmarks/bench_fisher.py --models qwen3-20m --device cuda --dtype bfloat16 \
  --repeats 3 --out "$OUT/bench_fisher_cuda.json" > "$OUT/bench_fisher.log" 2>&1; tail -15 "$OUT/bench_fisher.log"
echo "== bench_scale_gpu $SIZES ($((SECONDS - t0)) s)"
timeout ${SCALE_S:-330} python3 benchmarks/bench_scale_gpu.py --sizes "$SIZES" --timeout ${SIZE_S:-200} \
  --out "$OUT/bench_scale_gpu.json" 2>&1 | tee "$OUT/bench_scale_gpu.log" | grep -v Warning
echo "== done in $((SECONDS - t0)) s"
