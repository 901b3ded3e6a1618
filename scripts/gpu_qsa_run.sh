#!/usr/bin/env bash
# The QSA device call (issue 22): scripts/gpu_mechanisms.sh's qsa stage without the kernel profile,
# its timeout BENCH_S (the name runs 85 and 86 used). After scripts/gpu_upload_model.sh's parts are
# in /tmp/bundle.tar:
#   bash scripts/gpu_qsa_run.sh
# or, with no bundle, on random weights in Gemma 3 270M's shapes (the gguf wheel carried in .whl/):
#   NO_BUNDLE=1 bash scripts/gpu_qsa_run.sh
# CONTEXTS, SLOTS, KT_S, KT_MORE, TR_S as gpu_mechanisms.sh takes them.
QSA_S=${BENCH_S:-280} PROFILE_STEPS=${PROFILE_STEPS:-0} STAGES=qsa exec bash "$(dirname "$0")/gpu_mechanisms.sh"
