#!/usr/bin/env bash
# The QSA device call (issue 22): after scripts/gpu_upload_model.sh's parts are in /tmp/bundle.tar,
#   bash scripts/gpu_qsa_run.sh
# or, with no bundle, on random weights in Gemma 3 270M's shapes (the gguf wheel carried in .whl/):
#   NO_BUNDLE=1 bash scripts/gpu_qsa_run.sh
# the decode benchmark (scripts/qsa_decode_bench.py: dense vs QSA, graphed, at long context), then
# the QSA kernels' tests and the Triton runner's QSA tests natively; logs tarred into $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SLOTLAB_CACHE=/tmp/slotlab-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
if [ -n "${NO_BUNDLE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  MODEL_ARGS="--shapes gemma3-270m"
else
  mkdir -p /tmp/bundle && tar -C /tmp/bundle -xf /tmp/bundle.tar || exit 1
  MODEL=/tmp/bundle/model.gguf
  echo "$SHA  $MODEL" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/bundle/whl/*.whl || exit 1
  MODEL_ARGS="--model $MODEL"
  mkdir -p $SLOTLAB_CACHE/tokenizers; cp /tmp/bundle/tok/*.json $SLOTLAB_CACHE/tokenizers/ 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD
ln -sfn ../kernels workbench/kernels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp qsa_decode_bench
timeout ${BENCH_S:-280} python3 scripts/qsa_decode_bench.py $MODEL_ARGS --out "$OUT" \
    --contexts ${CONTEXTS:-8192,32512} --concurrency ${SLOTS:-1,16} > "$OUT/logs/bench.log" 2>&1; echo "rc $?"
grep "L=" "$OUT/logs/bench.log"; tail -3 "$OUT/logs/bench.log"
stamp qsa_kernel_tests
timeout ${KT_S:-90} python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_qsa_kernels.py ${KT_MORE:-} > "$OUT/logs/kt.log" 2>&1; tail -2 "$OUT/logs/kt.log"
stamp qsa_runner_tests
timeout ${TR_S:-100} python3 -m pytest -q -p no:cacheprovider tests/test_qsa.py -k "triton or sparse_rows_match" > "$OUT/logs/tr.log" 2>&1; tail -3 "$OUT/logs/tr.log"
stamp done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
