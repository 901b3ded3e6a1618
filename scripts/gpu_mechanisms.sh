#!/usr/bin/env bash
# The mechanisms' device calls (issues 20-22), on the real model: after scripts/gpu_upload_model.sh's
# parts are in /tmp/bundle.tar (the bundle is unpacked once a lease; later calls on the same warm
# machine reuse it):
#   STAGES=qsa,tests bash scripts/gpu_mechanisms.sh
#   STAGES=pflash,yield bash scripts/gpu_mechanisms.sh
# NO_BUNDLE=1: random weights in Gemma 3 270M's shapes for the qsa and verify stages (the gguf wheel
# in .whl/, or in WHL_DIR: a folder holding it alone fits one call's carry).
# Stages, each under its own timeout (seconds in QSA_S, TESTS_S, SPECTESTS_S, PFLASH_S, YIELD_S, FAMILY_S):
#   qsa     scripts/qsa_decode_bench.py: dense vs QSA graphed decode at long context, with a kernel
#           profile of each row (PROFILE_STEPS; 0: none); then the QSA kernels' tests (KT_MORE: more
#           test files) and the Triton runner's QSA tests
#   tests   natively: the token-tree tests on the Triton runner, the CUDA compression scorer's test,
#           scored eviction's (the mass in the graphs), the verify graph families' 
#   pflash  the paging-cliff ablation with PFlash on 32K-token prompts and an 8K-token pool
#   yield   the draft-yield ablation, n-gram k=8 on every workload, token trees (12 nodes) against chains
#           (YIELD_WORKLOADS, YIELD_KS, YIELD_TREES, YIELD_C: the concurrencies, YIELD_PIPES: the pipeline's
#           starting slots, 0 off)
#   family  FAMILY_WORKLOADS, space-separated WORKLOAD[@C[@SPEC]] (default essay: 16 slots, n-gram k=8),
#           against AR (scripts/spec_overhead.py, FAMILY_REPEATS (3) alternating timed passes after a warm-up: goodput,
#           steps run ahead, graphs captured inside a pass, each step's time by phase; every step's
#           telemetry to logs/spec_steps_*.parquet); FAMILY_VARIANT=verify_graph_family=false: a third arm
#           (TritonOptions), FAMILY_SPEC_VARIANT=pipeline=0: one more (SpecConfig fields); FAMILY_PROFILE=1:
#           cProfile of the last arm's timed passes (logs/host_*.prof, top functions in the log)
#   pipeline  scripts/pipeline_bench.py: AR, speculation in whole steps and the pipeline (SpecConfig.pipeline)
#           at PIPE_SLOTS slots, scripted drafts keeping PIPE_KEPT of PIPE_K (random weights with NO_BUNDLE)
#   spectests  natively: the speculation tests on the Triton runner (run-ahead at the guard's k = 0, the
#           pipeline's halves launched in turn)
#   verify  scripts/verify_step_bench.py: a verify step's device and wall time by rows per slot and by
#           runner option variants (VERIFY_VARIANTS, ';'-separated; VERIFY_ROWS; VERIFY_CONTEXT positions a slot; VERIFY_SLOTS), a kernel profile, the variants' bits;
#           then the attention kernels' tests natively (runs among them)
# Logs and the run store are tarred into $OUT (at most three files).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SLOTLAB_CACHE=/tmp/slotlab-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
if [ -n "${NO_BUNDLE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL_DIR:-.whl}/*.whl || exit 1
  MODEL_ARGS="--shapes gemma3-270m"
else
  if [ ! -f /tmp/bundle/model.gguf ]; then
    mkdir -p /tmp/bundle && tar -C /tmp/bundle -xf /tmp/bundle.tar || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/bundle/whl/*.whl || exit 1
  fi
  MODEL=/tmp/bundle/model.gguf
  echo "$SHA  $MODEL" | sha256sum -c || exit 1
  MODEL_ARGS="--model $MODEL"
  mkdir -p $SLOTLAB_CACHE/tokenizers; cp /tmp/bundle/tok/*.json $SLOTLAB_CACHE/tokenizers/ 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD
ln -sfn ../kernels workbench/kernels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
mkdir -p /tmp/wbruns
for stage in ${STAGES//,/ }; do
  stamp "$stage"
  case $stage in
    qsa)
      timeout ${QSA_S:-300} python3 scripts/qsa_decode_bench.py $MODEL_ARGS --out "$OUT" --profile ${PROFILE_STEPS:-8} --prefill-probe ${PREFILL_ROWS:-512} \
          --contexts ${CONTEXTS:-8192,32512} --concurrency ${SLOTS:-1,16} > "$OUT/logs/qsa_bench.log" 2>&1; echo "rc $?"
      grep "L=" "$OUT/logs/qsa_bench.log"; tail -3 "$OUT/logs/qsa_bench.log"
      timeout ${KT_S:-90} python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_qsa_kernels.py ${KT_MORE:-} \
          > "$OUT/logs/qsa_kernel_tests.log" 2>&1; tail -2 "$OUT/logs/qsa_kernel_tests.log"
      timeout ${TR_S:-100} python3 -m pytest -q -p no:cacheprovider tests/test_qsa.py -k "triton or sparse_rows_match" \
          > "$OUT/logs/qsa_runner_tests.log" 2>&1; tail -3 "$OUT/logs/qsa_runner_tests.log" ;;
    tests)
      timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_spec_trees.py tests/test_compression.py \
          tests/test_scored_eviction.py tests/test_chunk_graphs.py tests/kernels/test_attention.py \
          -k "triton or cuda or segment_mass or family" > "$OUT/logs/native_tests.log" 2>&1; tail -4 "$OUT/logs/native_tests.log" ;;
    pipeline)
      timeout ${PIPE_S:-300} python3 scripts/pipeline_bench.py $MODEL_ARGS --out "$OUT/logs" --slots ${PIPE_SLOTS:-16} \
          --k ${PIPE_K:-8} --kept ${PIPE_KEPT:-7} --prompt ${PIPE_PROMPT:-256} --gen ${PIPE_GEN:-256} \
          > "$OUT/logs/pipeline_bench.log" 2>&1; echo "rc $?"
      tail -16 "$OUT/logs/pipeline_bench.log" | cut -c1-300 ;;
    spectests)
      timeout ${SPECTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_speculation.py \
          tests/test_chunk_graphs.py tests/test_pipeline.py -k "triton or k0_steps or family or launch" > "$OUT/logs/spec_native_tests.log" 2>&1
      tail -4 "$OUT/logs/spec_native_tests.log" ;;
    pflash)
      timeout ${PFLASH_S:-240} python3 scripts/paging_cliff_run.py --data-dir /tmp/wbruns -p backend=triton -p model="$MODEL" \
          -p concurrencies=${PFLASH_C:-1,4,8,16} -p resident_pools=8192 -p prompt_lens=32000 -p pflash_modes=on \
          -p gen_tokens=64 -p preemptions=swap,recompute > "$OUT/logs/pflash_cliff.log" 2>&1; echo "rc $?"
      tail -${PFLASH_TAIL:-16} "$OUT/logs/pflash_cliff.log" | cut -c1-400 ;;
    yield)
      timeout ${YIELD_S:-300} python3 scripts/draft_yield_run.py --data-dir /tmp/wbruns -p backend=triton -p model="$MODEL" \
          -p workloads=${YIELD_WORKLOADS:-code-edit,agentic,extraction,essay} -p proposers=ngram -p ks=${YIELD_KS:-8} \
          -p trees=${YIELD_TREES:-0,12} -p concurrencies=${YIELD_C:-1,4,16} -p pipelines=${YIELD_PIPES:-0} -p timed_passes=3 \
          > "$OUT/logs/draft_yield_trees.log" 2>&1; echo "rc $?"
      tail -${YIELD_TAIL:-24} "$OUT/logs/draft_yield_trees.log" | cut -c1-400 ;;
    family)
      for run in ${FAMILY_WORKLOADS:-essay}; do  # each WORKLOAD[@CONCURRENCY[@SPEC]], space-separated
        IFS=@ read -r w c sp <<< "$run"; c=${c:-16}; sp=${sp:-ngram:8}; tag="${w}_c${c}_${sp/:/}"
        timeout ${FAMILY_S:-200} python3 scripts/spec_overhead.py --model "$MODEL" --workload $w --concurrency $c \
            --spec $sp --repeats ${FAMILY_REPEATS:-3} --phases ${FAMILY_VARIANT:+--variant $FAMILY_VARIANT} \
            ${FAMILY_SPEC_VARIANT:+--spec-variant $FAMILY_SPEC_VARIANT} \
            --steps-out "$OUT/logs/spec_steps_$tag.parquet" ${FAMILY_PROFILE:+--profile-out "$OUT/logs/host_$tag.prof"} \
            > "$OUT/logs/spec_overhead_$tag.log" 2>&1; echo "$tag rc $?"
        grep -E "pass [0-9]|steps:|rror" "$OUT/logs/spec_overhead_$tag.log" | cut -c1-300
      done ;;
    verify)
      timeout ${VERIFY_S:-240} python3 scripts/verify_step_bench.py $MODEL_ARGS --out "$OUT/logs" \
          --variants "${VERIFY_VARIANTS:-default;attention_runs=true}" --rows ${VERIFY_ROWS:-1,2,3,5,8} --context ${VERIFY_CONTEXT:-512} --slots ${VERIFY_SLOTS:-16} > "$OUT/logs/verify_step.log" 2>&1; echo "rc $?"
      grep -v "^VERIFY_STEP" "$OUT/logs/verify_step.log" | tail -60 | cut -c1-200
      python3 -c "import json; [print(r) for r in json.load(open('$OUT/logs/verify_step.json'))]" 2>&1 | cut -c1-220
      timeout ${KT_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_qmma.py \
          > "$OUT/logs/qmma_tests.log" 2>&1; tail -3 "$OUT/logs/qmma_tests.log" ;;
    *) echo "unknown stage $stage: allowed qsa, tests, spectests, pflash, yield, family, verify" ;;
  esac
done
stamp done
(cd /tmp/wbruns && tar czf "$OUT/wbruns.tgz" .) 2>/dev/null
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
