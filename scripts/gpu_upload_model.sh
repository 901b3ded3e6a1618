#!/usr/bin/env bash
# Split the real GGUF (253 MB) into parts that fit one device call's 64 MiB carry next to the
# working tree (~16 MB), into the git-ignored .carry/model/. Here:
#     bash scripts/gpu_upload_model.sh
# Then, on the device tool, one call per part, each right after the other (the machine goes back
# after 30 s idle and /tmp with it):
#     run(carry=[".carry/model/part0", ".whl"], command="cat .carry/model/part0 > /tmp/model.gguf; ...")
#     run(carry=[".carry/model/part1"], command="cat .carry/model/part1 >> /tmp/model.gguf; ls -l /tmp/model.gguf")
#     ... part2 .. part4 likewise
#     run(carry=[".carry/model/part5", ".whl"], command="OUT=$OUT bash scripts/gpu_run.sh", timeout_s=600)
# gpu_run.sh appends part5 (the small tail) and checks the sha256 before anything else.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-$HOME/.cache/slotlab/models/gemma-3-270m-q4_k_m.gguf}
mkdir -p .carry/model
rm -f .carry/model/part*
split -b 50000000 -d -a 1 "$SRC" .carry/model/part
ls -l .carry/model
