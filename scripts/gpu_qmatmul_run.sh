#!/usr/bin/env bash
# The qmatmul study on the device tool (docs/GPU_NOTES.md, "Decode-shaped qmatmul"): no model, random
# GGUF-layout weights of Gemma 3 270M's shapes. Run from the repo root, carrying .whl (gguf's wheel):
#   run(carry=[".whl"], timeout_s=250, command="bash scripts/gpu_qmatmul_run.sh")   (STUDY_FINAL=1: table configs only)
# In one call: the native test file tests/kernels/test_qmatmul.py (in the background, while the study
# compiles and checks its candidates; nothing is timed before it ends), then
# `scripts/bench_kernels_gpu.py --qmatmul-study $OUT`: config sweep of the packed path, per-kernel
# raw / packed / cuBLAS bf16 at M = 1, 4, 16, and one decode step's 82 launches, all as CUDA-graph replays.
# Writes $OUT/qmatmul_h200.json (updated as it goes) and logs; prints a short table last.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
ln -sfn ../kernels workbench/kernels  # workbench.kernels is kernels/ (pyproject's package-dir)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/nvidia_smi.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
rm -f /tmp/qm_tests_done
( timeout "${TEST_S:-170}" python3 -m pytest -q -p no:cacheprovider $XD tests/kernels/test_qmatmul.py \
    > "$OUT/pytest_qmatmul.log" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest_qmatmul.log"; touch /tmp/qm_tests_done ) &
timeout "${STUDY_S:-330}" python3 scripts/bench_kernels_gpu.py --qmatmul-study "$OUT" --wait-for /tmp/qm_tests_done \
    > "$OUT/study.log" 2>&1
echo "study rc=$? ($(( $(date +%s) - t0 )) s)"
wait
grep -E "^(weights|compiled|  CHECK|tests done|copy|sweep|kernel table|step|prefill)" "$OUT/study.log" | tail -30
echo "== native tests/kernels/test_qmatmul.py:"; tail -4 "$OUT/pytest_qmatmul.log"
sed -n '/^== qmatmul on/,$p' "$OUT/study.log"
