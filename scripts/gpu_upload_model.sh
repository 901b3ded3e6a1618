#!/usr/bin/env bash
# Split the real GGUF (253 MB) into parts that fit one device call's 64 MiB carry next to the
# working tree (~16 MB), into the git-ignored .carry/model/. Here:
#     bash scripts/gpu_upload_model.sh
# It also copies the tokenizer cache of the model (the device image's transformers 5.17 lacks
# transformers.integrations.gguf.convert_gguf_tokenizer, which workbench/tokenizer.py imports;
# with the cache file present the tokenizer is never rebuilt) into .carry/tok/.
# Then, on the device tool, one call per part, each right after the other (the machine goes back
# after 30 s idle and /tmp with it); each upload call took 0.2-0.6 s of command time:
#     run(carry=[".carry/model/part0"], command="cat .carry/model/part0 > /tmp/model.gguf")
#     run(carry=[".carry/model/part1"], command="cat .carry/model/part1 >> /tmp/model.gguf")
#     ... part2 .. part4 likewise
#     run(carry=[".carry/model/part5", ".carry/tok", ".whl"], timeout_s=580,
#         command="cat .carry/model/part5 >> /tmp/model.gguf; bash scripts/gpu_run.sh")
# (a 50 MB part + the ~16 MB working tree fits the 64 MiB carry; part5 is the 3 MB tail).
# gpu_run.sh checks the sha256 before anything else.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-$HOME/.cache/slotlab/models/gemma-3-270m-q4_k_m.gguf}
mkdir -p .carry/model
rm -f .carry/model/part*
split -b 50000000 -d -a 1 "$SRC" .carry/model/part
SHA=$(sha256sum "$SRC" | cut -d' ' -f1)
mkdir -p .carry/tok
cp "${SLOTLAB_CACHE:-$HOME/.cache/slotlab}/tokenizers/$SHA.json" .carry/tok/
ls -l .carry/model .carry/tok
