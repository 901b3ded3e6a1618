#!/usr/bin/env bash
# The GPU session's main call (see docs/GPU_NOTES.md): run on the device machine from the repo root,
# after scripts/gpu_upload_model.sh's parts have been appended to /tmp/bundle.tar (model,
# tokenizer cache, wheels).
#   bash scripts/gpu_run.sh            (writes JSON and logs under $OUT)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SLOTLAB_CACHE=/tmp/slotlab-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
mkdir -p /tmp/bundle && tar -C /tmp/bundle -xf /tmp/bundle.tar || exit 1
MODEL=${MODEL:-/tmp/bundle/model.gguf}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/bundle/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# workbench.kernels is kernels/ (pyproject's package-dir); this copy of the tree is not installed
ln -sfn ../kernels workbench/kernels
mkdir -p $SLOTLAB_CACHE/tokenizers; cp /tmp/bundle/tok/*.json $SLOTLAB_CACHE/tokenizers/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
# (the upload chain appends every part, the last one included: scripts/gpu_upload_model.sh)
echo "$SHA  $MODEL" | sha256sum -c || { ls -l "$MODEL"; exit 1; }
stamp kernel_tests
timeout ${KT_S:-150} python3 -m pytest -q -x -p no:cacheprovider ${KT_ARGS:-tests/kernels} 2>&1 | tail -5
if [ "${HB_S:-0}" -gt 0 ]; then  # the head alone, each form and tiling (scripts/head_bench.py)
  stamp head_bench
  timeout $HB_S python3 scripts/head_bench.py --model "$MODEL" --out "$OUT" ${HB_ARGS:-} 2>&1 | tail -${HB_TAIL:-3}
fi
# BASE=1: the same decode benchmark from an earlier commit's tree (.carry/base.tar, made here with
# `git archive <commit> workbench kernels scripts pyproject.toml > .carry/base.tar` and carried
# beside the last part), before and after this tree's, on this lease: A/B/A, into $OUT/extra/
base_bench() {
  mkdir -p /tmp/base "$OUT/extra/base$1" && tar -C /tmp/base -xf .carry/base.tar && ln -sfn ../kernels /tmp/base/workbench/kernels
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base STAGES=default timeout ${BASE_S:-150} python3 scripts/gpu_bench.py main \
      --model "$MODEL" --out "$OUT/extra/base$1" 2>&1 | grep -E "BENCH|stage|FAILED" | cut -c1-400)
}
if [ "${BASE:-0}" = 1 ] && [ -f .carry/base.tar ]; then stamp base_a; base_bench 1; fi
stamp main
# gpu_bench.py's stages (its main_stage lists them); GPU_BENCH_OPTIONS='name=value,...' (TritonOptions)
# is the base every stage's own options go over
export STAGES=${STAGES:-default,cublas,exact,exact 32,engine,profile}
timeout ${MAIN_S:-330} python3 scripts/gpu_bench.py main --model "$MODEL" --out "$OUT" 2>&1 | tee "$OUT/main.log"
stamp workbench_bench
# the project's own benchmark command, through Engine (greedy tokens from the device argmax);
# WB_OPTIONS='head_matmul=dense,pdl=false,...': its --triton-options (TritonOptions; a bad name or
# value is one line and exit 2, before any work; the run's params record them as triton_options)
echo "workbench bench, triton options: ${WB_OPTIONS:-default}"
timeout ${WB_S:-120} python3 -m workbench.cli bench --backend triton --triton-options "${WB_OPTIONS:-}" \
    --model "$MODEL" --concurrency ${WB_C:-1,4,16,32} \
    --prompt-len 128 --gen 128 --repeats 2 --data-dir /tmp/wbruns 2>&1 | tail -12
if [ "${BASE:-0}" = 1 ] && [ -f .carry/base.tar ]; then stamp base_b; base_bench 2; fi
if [ "${PREFIX_S:-0}" -gt 0 ]; then  # prefix-cache hits: a shared 2,048-token system prompt, cold vs hit TTFT
  stamp prefix_bench
  timeout $PREFIX_S python3 -m workbench.cli bench --backend triton --model "$MODEL" --concurrency ${PREFIX_C:-1,4,16} \
      --prompt-len 2112 --gen 16 --shared-prefix-len 2048 --repeats 3 --data-dir /tmp/wbruns 2>&1 | tail -8
fi
if [ "${CLIFF_S:-0}" -gt 0 ]; then  # the paging-cliff ablation (scripts/paging_cliff_run.py: the notebook's cells), into the run store
  stamp paging_cliff
  timeout $CLIFF_S python3 scripts/paging_cliff_run.py --data-dir /tmp/wbruns -p backend=triton -p model="$MODEL" \
      ${CLIFF_ARGS:-} 2>&1 | tee "$OUT/paging_cliff.log" | tail -${CLIFF_TAIL:-40}
fi
if [ "${DY_S:-0}" -gt 0 ]; then  # the draft-yield ablation (scripts/draft_yield_run.py: the notebook's cells), into the run store
  stamp draft_yield
  timeout $DY_S python3 scripts/draft_yield_run.py --data-dir /tmp/wbruns -p backend=triton -p model="$MODEL" \
      ${DY_ARGS:-} 2>&1 | tee "$OUT/draft_yield.log" | tail -${DY_TAIL:-40}
fi
if [ -n "${EXTRA_CMD:-}" ]; then  # one more command (e.g. scripts/capacity.py on the engine), its log in extra/
  stamp extra_cmd
  mkdir -p "$OUT/extra"; timeout ${EXTRA_S:-120} bash -c "$EXTRA_CMD" > "$OUT/extra/extra_cmd.log" 2>&1; echo "rc $?"
  tail -${EXTRA_TAIL:-20} "$OUT/extra/extra_cmd.log"
fi
(cd /tmp/wbruns && tar czf "$OUT/wbruns.tgz" .) 2>/dev/null
stamp hf
timeout ${HF_S:-100} python3 scripts/gpu_bench.py hf ${HF_ARGS:-} --model "$MODEL" --out "$OUT" 2>&1 | tee "$OUT/hf.log" | grep -v Warning
stamp test_triton_runner
timeout ${TR_S:-60} python3 -m pytest -q -p no:cacheprovider ${TR_ARGS:-tests/test_triton_runner.py} 2>&1 | tail -${TR_TAIL:-5}
stamp table
python3 scripts/gpu_bench.py table "$OUT"
[ -d "$OUT/extra" ] && (cd "$OUT" && tar czf extra.tgz extra && rm -rf extra)
