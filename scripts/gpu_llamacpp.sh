#!/usr/bin/env bash
# llama.cpp built with CUDA, measured beside the Triton path on the same H200 (issue 4): its
# `llama-batched-bench` (flash attention on, unified KV cache) from the llama-cpp-python sdist's
# vendored llama.cpp. On the device machine, from the repo root, after a bundle built with
#     LLAMA=1 bash scripts/gpu_upload_model.sh        (adds .whl/llama_cpp_python-*.tar.gz)
# has been appended to /tmp/bundle.tar (see gpu_upload_model.sh):
#     OUT=$OUT bash scripts/gpu_llamacpp.sh           (~4.5 min of build, then the runs)
# Writes $OUT/llamacpp.jsonl (one JSON object per prompt length x parallel sequences, as
# llama-batched-bench prints them) and the build/run logs; `scripts/gpu_bench.py parquet` turns
# the rows into `llamacpp_cuda_fa_kvu` bench rows (speed_tg = aggregate decode tok/s).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/bundle/model.gguf ] || { mkdir -p /tmp/bundle && tar -C /tmp/bundle -xf /tmp/bundle.tar; } || exit 1
MODEL=${MODEL:-/tmp/bundle/model.gguf}
SDIST=$(ls /tmp/bundle/llama/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)
[ -n "$SDIST" ] || { echo "no llama-cpp-python sdist in the bundle (LLAMA=1 bash scripts/gpu_upload_model.sh)"; exit 1; }
SRC=/tmp/llsrc; BUILD=/tmp/llbuild; mkdir -p "$SRC"
tar -xzf "$SDIST" -C "$SRC" --strip-components=1 || exit 1
t0=$(date +%s)
# only the benchmark target: ggml with CUDA for sm_90 and the llama library under it
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF > "$OUT/llamacpp_build.log" 2>&1 &&
timeout "${LL_BUILD_S:-420}" cmake --build "$BUILD" --target llama-batched-bench -j "$(nproc)" >> "$OUT/llamacpp_build.log" 2>&1 ||
    { tail -30 "$OUT/llamacpp_build.log"; exit 1; }
echo "llama-batched-bench built in $(( $(date +%s) - t0 )) s"
NPL=${LL_NPL:-1,4,16,32}
MAXPL=$(echo "$NPL" | tr , '\n' | sort -n | tail -1)
for PP in ${LL_PP:-128 2048}; do
    # -c: every sequence's prompt + 128 generated tokens in the unified cache
    "$BUILD/bin/llama-batched-bench" -m "$MODEL" -c $(( (PP + 128) * MAXPL + 256 )) -b 2048 -ub 512 \
        -npp "$PP" -ntg 128 -npl "$NPL" -fa on -kvu -ngl 99 --output-format jsonl \
        2>> "$OUT/llamacpp_run.log" | grep '^{' >> "$OUT/llamacpp.jsonl"
done
cat "$OUT/llamacpp.jsonl"
