#!/usr/bin/env bash
# scripts/device_session.sh [iter|tune|quick|full|final] — one device call that builds, checks and times the monokernel work
# (issue 4) and the per-op kernels (issue 3), every step time-boxed so the call ends inside the 600 s limit.
#   iter  : stage profile + bench at 1K, launch-configuration sweep, GPU op + monokernel tests, bench_ops
#   tune  : the sweep first; its fastest runtime knobs for the profile (1K/8K), the monokernel, op and 1B tests
#   quick : op tests, stage profile + bench at 1K/8K, monokernel tests, bench_ops
#   full  : quick's tests + profile, the 1B preset's 512-position check, the decode bench at 1K/8K/32K
#   final : monokernel + per-op bench at 1K/8K/32K (JSON + PNG), monokernel tests
#   exp   : the sweep's variants $ONLY (compile-time experiments) at 1K/8K/32K after the trees $AB_TREES, then the
#           monokernel tests and the stage profile built with $EXP_DEFINES, in the environment $EXP_ENV
#   pdl   : GPU op tests, engine tests (programmatic dependent launch == stream order), bench_ops with and without
#           it (+ the per-op decode), the decode bench at 1K/8K/32K (JSON + PNG)
#   record: op, engine and monokernel GPU tests, bench_ops (+ per-op decode), the decode bench at 1K/8K/32K
#   gen   : engine and monokernel GPU tests, then the decode bench at 1K/8K/32K (JSON + PNG)
#   perop : op + engine tests, the per-op decode bench at 1K/8K/32K
#   abperop: per-op trees $AB_PEROP_TREES (commits $AB_PEROP_COMMITS) alternated, 1K/8K/32K; op tests, bench_ops
#   abenv : per-op A/B of environment settings $AB_ENVS on this tree, 1K/8K/32K; kernel timelines ($AB_PROFILE_ENVS)
#   abboth: A/B of environment settings $AB_ENVS on both paths (decode bench, tokens compared), timelines, tests
#   sweepops: mk_sweep $ONLY at $AB_CONTEXTS (re-checks of knobs, no new kernel), then bench_ops (and per $OPS_ENVS word)
#   mkdefault: a monokernel default changed: mk_sweep $ONLY at $AB_CONTEXTS, monokernel tests, the bench of record
#   abmk  : monokernel variants (mk_sweep $ONLY) at $AB_CONTEXTS, stage profiles at 1K per word of $AB_PROFILE_ENVS
#   recordmk: a shared default changed: op, engine, monokernel tests, the bench of record, timeline, mk_sweep $ONLY
#   recordenv: after a change of per-op defaults: op tests, engine + monokernel tests, the decode bench of record,
#              the per-op timeline, then per-op A/B runs of $AB_ENVS while the call has time
#   recordperop: op + engine tests, the decode bench (both paths), bench_ops, the per-op timeline (per-op changes)
#   recordall: op, engine and monokernel tests, the decode bench (both paths), bench_ops, the per-op timeline
#              (a change of a body both paths share)
#   ncu   : Nsight Compute on per-op decode kernels at 1K ($NCU_KERNELS regex), CSV pages
#   ncuprefill: Nsight Compute on the matrix-core prefill kernels (a 256-token prefill), CSV pages
#   ncumk : Nsight Compute on the monokernel at 1K (the third launch of 32 tokens, caches not flushed: the steady
#           state of the generation loop), then on the per-op chain's kernels with caches not flushed; CSV pages
#           (scripts/ncu_mk_stages.py maps the monokernel's to its stages, here, after the call); NCUMK_PROFILE=1:
#           the stage profile at 1K/8K instead of the per-op chain
#   tests : engine + monokernel GPU tests
#   prefill: the matrix-core prefill's op tests, the op and engine GPU tests, the prefill benchmark (TTFT of 64 to
#            4K-token prompts, matrix cores against the 8-token FMA path, alternated in one process)
#   paths : prefill paths ($PREFILL_PATHS: chunk[:VAR=VALUE...]) side by side: op tests, the prefill benchmark per
#           path, the 1B preset's check in $PRESET_ENV when given; every op, engine, monokernel test unless
#           $PATHS_NO_TAIL
#   prefillrecord: after a prefill change (decode kernels unchanged): op, engine and monokernel tests,
#            the prefill benchmark with its op breakdown, the decode bench of record (TTFT included), and the
#            1B preset's 512-position check in the time that is left (the call stays under 575 s)
#   abp   : trees $AB_TREES (commits $AB_COMMITS) A/B on both paths at 1K/8K/32K, then op, engine, monokernel tests
#   ab    : the sweep's variants ($ONLY: indices) at 1K/8K/32K after the trees in $AB_TREES (space-separated,
#           e.g. `git archive` of earlier commits under .carry/: same measurement, tokens compared; and at 1K in
#           a $AB_MAXCTX-token cache when given), op tests, monokernel tests, stage profile at 1K/8K
# Logs and JSON land in $OUT; kernels come from $HIPENGINE_CACHE (precompiled here with
# `python scripts/precompile_mk.py`, carried as .mkcache) so little device time goes to NVRTC.
set -uo pipefail
MODE=${1:-iter}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export HIPENGINE_CACHE=${HIPENGINE_CACHE:-$PWD/.mkcache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
PY=${PY:-python3}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
SUMMARY=$(mktemp)  # outside $OUT: the device tool returns a limited number of files
rc=0
run() {  # run NAME SECONDS CMD... : log to $OUT/NAME.log, time-boxed, failures remembered
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "$name rc=$r $((SECONDS - t0))s" | tee -a "$SUMMARY"
  [ $r -ne 0 ] && rc=1
  return 0
}
# Nsight Compute report $OUT/NAME.ncu-rep -> its details and per-SASS-line source pages as CSV (the report goes)
ncu_pages() {
  "$N" -i "$OUT/$1.ncu-rep" --page details --csv > "$OUT/$1_details.csv" 2>&1
  "$N" -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1_source.csv" 2>&1
  rm -f "$OUT/$1.ncu-rep"
}
# The steps, each time-boxed; the modes below are sequences of them.
ops_tests() { run ops_tests 90 $PY -m pytest tests/test_ops_gpu.py -q -x -rs; }
profile() { run profile1k 200 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 \
              --profile --json "$OUT/profile_1k.json"; }
sweep() { run sweep 150 $PY scripts/mk_sweep.py --json "$OUT/sweep_1k.json"; }
# The sweep's fastest runtime knobs become the environment of every later step (written to $OUT/best.env).
sweep_best() {
  run sweep 200 $PY scripts/mk_sweep.py --json "$OUT/sweep_1k.json" --best-env "$OUT/best.env"
  [ -f "$OUT/best.env" ] && { cat "$OUT/best.env"; . "$OUT/best.env"; }
}
mk_tests() { run mk_tests 240 $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs; }
ab_sweep() { run ab_sweep 270 $PY scripts/mk_sweep.py --contexts 1024,8192,32768 ${ONLY+--only "$ONLY"} \
               $(for t in ${AB_TREES:-}; do echo --baseline-tree "$t"; done) --json "$OUT/ab_sweep.json"
             # and at $AB_MAXCTX (a serving cache size, e.g. the Engine's 4096) with a 1K context, when given
             [ -n "${AB_MAXCTX:-}" ] && run ab_sweep_maxctx 120 $PY scripts/mk_sweep.py --contexts 1024 \
               --max-context "$AB_MAXCTX" ${ONLY+--only "$ONLY"} \
               $(for t in ${AB_TREES:-}; do echo --baseline-tree "$t"; done) --json "$OUT/ab_sweep_maxctx.json"; }
# env_runs PREFIX SECONDS "WORDS" CMD...: CMD once per word of WORDS (VAR=V[,VAR=V] or - for none), each in its own
# process with that environment, logged as PREFIX_i and writing --json $OUT/PREFIX_i.json
env_runs() {
  local prefix=$1 limit=$2 words=$3 i=0 e
  shift 3
  for e in $words; do
    [ "$e" = - ] && e=""
    echo "${prefix}_$i: ${e:-default}" | tee -a "$SUMMARY"
    run "${prefix}_$i" "$limit" env ${e//,/ } "$@" --json "$OUT/${prefix}_$i.json"
    i=$((i + 1))
  done
}
# mk_sweep_ab NAME SECONDS: mk_sweep's variants $ONLY at $AB_CONTEXTS after the trees $AB_TREES (when given: e.g.
# `git archive` of HEAD under .carry/, the record build), in one process, tokens compared with the first
mk_sweep_ab() { run "$1" "$2" $PY scripts/mk_sweep.py --contexts "$(echo ${AB_CONTEXTS:-1024 8192 32768} | tr ' ' ,)" \
                  --only "$ONLY" $(for t in ${AB_TREES:-}; do echo --baseline-tree "$t"; done) --json "$OUT/$1.json"; }
preset1b() { run preset1b 150 $PY -m pytest tests/test_gpu_engine.py -q -rs -s -k "1b_preset"; }
bench_ops() { run bench_ops 80 $PY scripts/bench_ops.py --skip-decode --json "$OUT/bench_ops.json"; }
# engine_tests [SECONDS]: the GPU engine tests. same_bits [SECONDS [VAR=VALUE ...]]: the monokernel's same-bits and
# 1B-preset tests, in that environment (an experiment's build: HIPENGINE_MK_DEFINES=...)
engine_tests() { run engine_tests ${1:-120} $PY -m pytest tests/test_gpu_engine.py -q -rs -k "not 1b_preset"; }
same_bits() {
  local limit=${1:-120}
  [ $# -gt 0 ] && shift
  run same_bits "$limit" env "$@" $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs \
    -k "q_flow or o_group_same_bits or 1b_preset"
}
bench_ops_decode() { run bench_ops 170 $PY scripts/bench_ops.py --json "$OUT/bench_ops.json"; }
# bench [SECONDS]: the decode bench of record at $BENCH_CONTEXTS (default 1K/8K/32K), both paths, JSON + PNG
bench() { run bench ${1:-260} $PY -m hipengine bench decode --shape llama-3.2-1b \
            $(for c in ${BENCH_CONTEXTS:-1024 8192 32768}; do echo --context "$c"; done) \
            --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"; }
# prof1k NAME SECONDS [VAR=VALUE ...]: the monokernel's 1K stage profile (its profile build) in that environment, logged as
# NAME, written to $OUT/NAME.json
prof1k() {
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" env "$@" $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --profile \
    --json "$OUT/$name.json"
  # the per-layer table by block role (scripts/profile_table.py), into the logs the call's output ends with
  [ -s "$OUT/$name.json" ] && $PY scripts/profile_table.py "$OUT/$name.json" > "$OUT/${name}_table.log" 2>&1
  return 0
}
case "$MODE" in
  iter) profile; sweep; mk_tests; ops_tests; bench_ops ;;
  tune) sweep_best; profile; mk_tests; ops_tests; preset1b ;;  # the sweep's fastest knobs, then profile + tests
  quick) ops_tests; profile; mk_tests; bench_ops ;;        # a change's correctness + where the time goes
  full) ops_tests; profile; mk_tests; preset1b; bench ;;   # + the 1B 512-position check + the decode bench
  final) bench; mk_tests ;;
  pdl) ops_tests; engine_tests; bench_ops_decode; bench ;;
  gen) engine_tests; mk_tests; bench ;;
  record) ops_tests; engine_tests; mk_tests; bench_ops_decode; bench ;;  # every GPU test + the figures of record  # a change of the generation loops: engine + monokernel tests, the bench
  ab) ab_sweep; ops_tests; mk_tests; profile ;;
  abp)  # an A/B of kernel trees on both paths: the trees $AB_TREES (space-separated dirs, e.g. `git archive`s
         # under .carry/, alternated as given: "a b a b") with commits $AB_COMMITS (same order): the monokernel
         # (mk_sweep, each tree in its own process, tokens compared) and the per-op decode bench, both at
         # 1K/8K/32K (the per-op runs over $AB_PEROP_TREES / $AB_PEROP_COMMITS when given); then op, engine and
         # monokernel GPU tests of this tree
    run abp_mk 320 $PY scripts/mk_sweep.py --contexts 1024,8192,32768 --only "" \
      $(for t in $AB_TREES; do echo --baseline-tree "$t"; done) --json "$OUT/abp_mk.json"
    read -r -a commits <<< "${AB_PEROP_COMMITS:-${AB_COMMITS:-}}"
    i=0
    for t in ${AB_PEROP_TREES:-$AB_TREES}; do
      run "abp_perop_$i" 80 env -C "$t" HIPENGINE_COMMIT="${commits[$i]:-unknown}" PYTHONPATH=. $PY -m hipengine \
        bench decode --shape llama-3.2-1b --context 1024 --context 8192 --context 32768 --no-monokernel \
        --json "$OUT/abp_perop_$i.json"
      i=$((i + 1))
    done
    ops_tests; engine_tests; mk_tests ;;
  abperop)  # per-op trees only: $AB_PEROP_TREES (alternated as given) with commits $AB_PEROP_COMMITS, the per-op
            # decode bench at 1K/8K/32K each in its own process; then op tests and bench_ops of this tree
    # $AB_PEROP_ENVS: one word per tree, VAR=VALUE[,VAR=VALUE] set for that run, or - for none
    read -r -a commits <<< "${AB_PEROP_COMMITS:-}"
    read -r -a envs <<< "${AB_PEROP_ENVS:-}"
    i=0
    for t in $AB_PEROP_TREES; do
      e=${envs[$i]:--}; [ "$e" = - ] && e=""
      echo "abperop_$i: $t ${commits[$i]:-unknown} $e" | tee -a "$SUMMARY"
      run "abperop_$i" 90 env -C "$t" ${e//,/ } HIPENGINE_COMMIT="${commits[$i]:-unknown}" PYTHONPATH=. $PY -m hipengine \
        bench decode --shape llama-3.2-1b --context 1024 --context 8192 --context 32768 --no-monokernel \
        --json "$OUT/abperop_$i.json"
      i=$((i + 1))
    done
    run ops_tests 150 $PY -m pytest tests/test_ops_gpu.py -q -x -rs
    bench_ops ;;
  abenv)  # per-op A/B of environment settings on this tree: $AB_ENVS, one word per run (VAR=V[,VAR=V] or -),
          # each the per-op decode bench at $AB_CONTEXTS (default 1K/8K/32K) in its own process; then a kernel
          # timeline at 1K per word of $AB_PROFILE_ENVS (scripts/profile_perop.py), bench_ops (no decode) per
          # word of $AB_BENCH_OPS_ENVS, and the op tests ($AB_TESTS: a -k expression run FIRST instead)
    [ -n "${AB_TESTS:-}" ] && run ops_tests_k 120 $PY -m pytest tests/test_ops_gpu.py -q -x -rs -k "$AB_TESTS"
    env_runs abenv 90 "${AB_ENVS:--}" $PY -m hipengine bench decode --shape llama-3.2-1b \
      $(for c in ${AB_CONTEXTS:-1024 8192 32768}; do echo --context "$c"; done) --no-monokernel
    env_runs prof 60 "${AB_PROFILE_ENVS:--}" $PY scripts/profile_perop.py --context 1024
    env_runs bench_ops 80 "${AB_BENCH_OPS_ENVS:-}" $PY scripts/bench_ops.py --skip-decode
    [ -z "${AB_TESTS:-}" ] && ops_tests ;;
  abboth)  # A/B of environment settings on both paths: op tests ($AB_TESTS: a -k expression) in the first word's
           # environment, then per word of $AB_ENVS the decode bench of both paths (tokens compared) at $AB_CONTEXTS,
           # a per-op kernel timeline at 1K per word of $AB_PROFILE_ENVS, then engine tests in $AB_TEST_ENV
    w0=${AB_ENVS%% *}; [ "$w0" = - ] && w0=""
    run ops_tests_k 150 env ${w0//,/ } $PY -m pytest tests/test_ops_gpu.py -q -x -rs ${AB_TESTS:+-k "$AB_TESTS"}
    env_runs abboth 120 "${AB_ENVS:--}" $PY -m hipengine bench decode --shape llama-3.2-1b \
      $(for c in ${AB_CONTEXTS:-1024 8192 32768}; do echo --context "$c"; done)
    env_runs prof 60 "${AB_PROFILE_ENVS:-}" $PY scripts/profile_perop.py --context 1024
    left=$((570 - SECONDS)); [ $left -gt 40 ] && run engine_tests $left env ${AB_TEST_ENV:-} $PY -m pytest \
      tests/test_gpu_engine.py -q -rs -k "not 1b_preset" ;;
  mkdefault)  # a monokernel-only default changed: mk_sweep's variants $ONLY at $AB_CONTEXTS (the A/B), the monokernel
              # tests, the decode bench of record at $BENCH_CONTEXTS (both paths, tokens compared)
    mk_sweep_ab mk_sweep 120; mk_tests; bench ;;
  sweepops)  # re-checks without a new build: mk_sweep's variants $ONLY at $AB_CONTEXTS (one process), then bench_ops,
             # then bench_ops once more per word of $OPS_ENVS (VAR=V[,VAR=V]), each its own process
    mk_sweep_ab mk_sweep 330; bench_ops
    [ -n "${OPS_ENVS:-}" ] && env_runs bench_ops_env 80 "$OPS_ENVS" $PY scripts/bench_ops.py --skip-decode ;;
  abmk)  # monokernel variants: op tests ($AB_TESTS: a -k expression), mk_sweep's variants $ONLY at $AB_CONTEXTS (one
         # process, tokens compared with the first), then the monokernel's stage profile at 1K per word of
         # $AB_PROFILE_ENVS (VAR=V[,VAR=V] or -)
    run ops_tests_k 150 $PY -m pytest tests/test_ops_gpu.py -q -x -rs ${AB_TESTS:+-k "$AB_TESTS"}
    mk_sweep_ab mk_sweep 330
    env_runs mkprof 80 "${AB_PROFILE_ENVS:-}" $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 \
      --profile ;;
  recordmk)  # after a change of a default both paths share: op tests ($AB_TESTS: a -k expression), engine and
             # monokernel tests, the decode bench of record at $BENCH_CONTEXTS (both paths, tokens compared), the
             # per-op timeline at 1K, mk_sweep's variants $ONLY at $AB_CONTEXTS, the 1B preset's 512-position check
             # in the time left (the call stays under 575 s)
    run ops_tests_k 150 $PY -m pytest tests/test_ops_gpu.py -q -x -rs ${AB_TESTS:+-k "$AB_TESTS"}
    engine_tests; mk_tests; bench
    run profile_perop 60 $PY scripts/profile_perop.py --context 1024 --json "$OUT/profile_perop.json"
    [ -n "${ONLY:-}" ] && run mk_sweep 200 $PY scripts/mk_sweep.py --contexts \
      "$(echo ${AB_CONTEXTS:-1024 8192 32768} | tr ' ' ,)" --only "$ONLY" --json "$OUT/mk_sweep.json"
    left=$((575 - SECONDS)); [ $left -gt 30 ] && run preset1b $left $PY -m pytest tests/test_gpu_engine.py -q -rs -s \
      -k "1b_preset" ;;
  recordenv)  # after a change of per-op defaults: op tests ($AB_TESTS: a -k expression), engine + monokernel tests,
              # the decode bench of record at $BENCH_CONTEXTS (both paths, tokens compared), the per-op timeline
              # at 1K, then per-op A/B runs of $AB_ENVS at $AB_CONTEXTS while the call has time (under 575 s)
    run ops_tests_k 120 $PY -m pytest tests/test_ops_gpu.py -q -x -rs ${AB_TESTS:+-k "$AB_TESTS"}
    engine_tests; mk_tests; bench
    run profile_perop 60 $PY scripts/profile_perop.py --context 1024 --json "$OUT/profile_perop.json"
    [ $SECONDS -lt 460 ] && env_runs abenv 90 "${AB_ENVS:--}" $PY -m hipengine bench decode --shape llama-3.2-1b \
      $(for c in ${AB_CONTEXTS:-1024 8192}; do echo --context "$c"; done) --no-monokernel ;;
  recordperop)  # the figures of record after a per-op change (monokernel SASS unchanged): op + engine tests, the
                # decode bench of both paths (tokens compared), bench_ops, the per-op kernel timeline at 1K
    ops_tests; engine_tests; bench; bench_ops
    run profile_perop 60 $PY scripts/profile_perop.py --context 1024 --json "$OUT/profile_perop.json" ;;
  recordall)  # the figures of record after a change both paths share: every GPU test of one GPU, the decode
              # bench of both paths (tokens compared), bench_ops, the per-op kernel timeline at 1K
    ops_tests; engine_tests; mk_tests; bench; bench_ops
    run profile_perop 60 $PY scripts/profile_perop.py --context 1024 --json "$OUT/profile_perop.json" ;;
  ncu)  # Nsight Compute on the per-op decode kernels at 1K ($NCU_KERNELS: a regex; default the attention), the
        # details and per-SASS-line (stall samples) pages as CSV; scripts/perop_steps.py is the workload
    N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    run ncu 300 "$N" --clock-control none -k "regex:${NCU_KERNELS:-attention_split|attention_combine}" \
      --launch-skip 64 --launch-count 6 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis -o "$OUT/ncu" -f \
      $PY scripts/perop_steps.py --context 1024 --steps 8
    ncu_pages ncu ;;
  ncuprefill)  # Nsight Compute on the matrix-core prefill kernels ($NCU_KERNELS regex) of a 256-token prefill at
               # position 896 (scripts/perop_steps.py --prefill), eager launches; details + per-SASS-line CSV
    N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    run ncu 420 env HIPENGINE_NO_GRAPH=1 "$N" --clock-control none \
      -k "regex:${NCU_KERNELS:-matmul_mma_m128|attention_prefill}" --launch-skip 5 --launch-count 5 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats \
      --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis -o "$OUT/ncu" -f \
      $PY scripts/perop_steps.py --context 1152 --prefill 256
    ncu_pages ncu ;;
  ncumk)  # Nsight Compute on the monokernel (stall reasons and executed instructions per SASS line) at 1K, and on
          # the per-op decode kernels ($NCU_KERNELS regex), both with --cache-control none: what the instruction
          # cache and L2 hold is the generation loop's own state, not a flushed one
    N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    run ncumk 240 "$N" --clock-control none --cache-control none -k regex:monokernel_decode --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      --section LaunchStats --section InstructionStats -o "$OUT/ncumk" -f \
      $PY scripts/perop_steps.py --monokernel --context 1024 --steps 32 --launches 3
    ncu_pages ncumk
    if [ -n "${NCUMK_PROFILE:-}" ]; then
      profile  # the stage profile at 1K/8K instead of the per-op chain
    else
      run ncuperop 200 "$N" --clock-control none --cache-control none \
        -k "regex:${NCU_KERNELS:-matvec|attention_split|attention_combine}" --launch-skip 96 --launch-count 12 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters -o "$OUT/ncuperop" -f \
        $PY scripts/perop_steps.py --context 1024 --steps 8
      ncu_pages ncuperop
    fi ;;
  tests)  # engine + monokernel GPU tests of this tree
    engine_tests; mk_tests ;;
  prefillrecord)
    ops_tests; engine_tests; mk_tests
    run bench_prefill 120 $PY scripts/bench_prefill.py --lengths ${PREFILL_LENGTHS:-64,1024,4096} --runs 3 \
      --breakdown --paths "${PREFILL_PATHS:-128}" --json "$OUT/bench_prefill.json"
    bench
    left=$((575 - SECONDS)); [ $left -gt 30 ] && run preset1b $left $PY -m pytest tests/test_gpu_engine.py -q -rs -s \
      -k "1b_preset" ;;
  paths)  # prefill paths compared ($PREFILL_PATHS: CHUNK[:WARPS],..., scripts/bench_prefill.py --paths): the
          # matrix-core op tests and the attention's, the prefill benchmark with one op breakdown per path, then
          # every op, engine and monokernel test
    run mma_tests 120 $PY -m pytest tests/test_ops_gpu.py -q -x -rs -k "prefill_matmul_mma or test_attention"
    run bench_prefill 240 $PY scripts/bench_prefill.py --lengths ${PREFILL_LENGTHS:-1024,4096} --runs 3 --breakdown \
      --paths "${PREFILL_PATHS:-128,64}" --json "$OUT/bench_prefill.json"
    # the 1B preset's 512 teacher-forced positions in the environment $PRESET_ENV (VAR=V ..., e.g. a path's)
    [ -n "${PRESET_ENV:-}" ] && run preset1b_env 150 env $PRESET_ENV $PY -m pytest tests/test_gpu_engine.py -q -rs -s \
      -k "1b_preset"
    [ -z "${PATHS_NO_TAIL:-}" ] && { ops_tests; engine_tests; mk_tests; } ;;
  prefill)  # the matrix-core prefill (prefill.hip matmul_mma_m*): its op tests first, every op and engine test,
            # then scripts/bench_prefill.py (JSON)
    run mma_tests 60 $PY -m pytest tests/test_ops_gpu.py -q -x -rs -k prefill_matmul_mma
    run ops_tests 150 $PY -m pytest tests/test_ops_gpu.py -q -x -rs
    engine_tests
    run bench_prefill 150 $PY scripts/bench_prefill.py --lengths ${PREFILL_LENGTHS:-64,512,1024,4096} --breakdown \
      --json "$OUT/bench_prefill.json" ;;
  perop)  # a per-op change: op + engine tests, then the per-op decode bench at 1K/8K/32K
    ops_tests; engine_tests
    run perop 150 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 \
      --context 32768 --no-monokernel --json "$OUT/perop.json" ;;
  # (Spent session modes, folded in session 56 — their mk_sweep indices have since changed meaning; docs/perf-log.md
  # has each call: fusedmlp / mlpparts (session 30), screen (32), packed (33), screenrec (34), paced (35), ogroup (36),
  # ogrecord (39), rows1fx / rows1rec (40), qflow / qflow2 / qflow3 / qflowrec (41), final42 / plan (42), s43, h200rec
  # (43-44), s44b, s47, s50.)
  bench) bench ;;  # the decode bench of record alone (1K/8K/32K, JSON + PNG)
  abtrees) ab_sweep ;;  # the A/B alone (e.g. an order-controlled repeat: AB_TREES="a b a b" ONLY="")
  exp)  # compile-time experiments: the sweep's variants $ONLY at $AB_CONTEXTS (1K/8K/32K) after the trees $AB_TREES,
        # then the monokernel tests (their builds may compile here: 200 s) and the stage profile of the build
        # $EXP_DEFINES (HIPENGINE_MK_DEFINES syntax) with the environment $EXP_ENV (NAME=VALUE ..., e.g.
        # HIPENGINE_MK_FINE=2) — the expected winner
    mk_sweep_ab exp_sweep 300
    run exp_mk_tests 200 env HIPENGINE_MK_DEFINES="${EXP_DEFINES:-}" ${EXP_ENV:-} $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs
    run exp_profile 80 env HIPENGINE_MK_DEFINES="${EXP_DEFINES:-}" ${EXP_ENV:-} $PY -m hipengine bench decode --shape llama-3.2-1b \
      --context 1024 --profile --json "$OUT/exp_profile.json" ;;
  # (s43q — session 43's MK_QKV_POS A/B, mk_sweep 0/38 and its same-bits test — removed with it.)
  # (s44 — session 44's MK_O_RES_EARLY / MK_BAL A/B, mk_sweep 0/37/38/39 at 1K, same-bits, bench, profile — removed with them.)
  benchtests)  # the decode bench of record (1K / 8K / 32K, both paths), then the GPU engine tests while the call
               # (${BENCHTESTS_S:-240} s) has time: a changed default's record and checks in one short call.
    bench ${BENCH_S:-150}
    left=$((${BENCHTESTS_S:-240} - SECONDS)); [ $left -gt 30 ] && engine_tests $left ;;
  benchonly)  # the decode bench of record alone (1K / 8K / 32K, both paths, JSON + PNG) in this environment: a follow-up
              # call on a warm machine
    bench ${BENCH_S:-150} ;;
  s53h)  # session 53's health call: every single-GPU test file on today's kernels — the monokernel's full GPU tests (not
          # run whole since session 39), the op tests, the head screen's, the runtime's and the default model's — then
          # the engine tests while the call (${S53H_S:-540} s) has time; S53H_BENCH=1 (an H200: issue 4's figure) runs
          # the decode bench of record first. Builds: the bench's from .carry/c53.tar.xz; the tests compile their own.
    [ "${S53H_BENCH:-0}" = 1 ] && bench ${BENCH_S:-150}
    mk_tests
    ops_tests
    run screen_tests 90 $PY -m pytest tests/test_head_screen.py tests/test_runtime_gpu.py -q -rs
    left=$((${S53H_S:-540} - SECONDS)); [ $left -gt 60 ] && run default_model $((left < 90 ? left : 90)) \
      $PY -m pytest tests/test_gpu_default_model.py -q -rs
    left=$((${S53H_S:-540} - SECONDS)); [ $left -gt 40 ] && engine_tests $left ;;
  s57)  # session 57's call: on an H200 (or with S57_BENCH=1) the decode bench of record first and the monokernel's 1K stage
         # profile; then mk_sweep at 1K alternated — 0 the default, 42 the KV cache persisting in L2
         # (HIPENGINE_L2_PERSIST_KV=1, new), 41 the default with 64 KiB + 128 B of shared memory unused (the carve-out
         # alone), 43 the carve-out preferring the most L1 (HIPENGINE_MK_CARVEOUT=0, new), and on an H200 also 40 / 39 (the MK_START_L2 masks before session 52: the next layer's whole QKV pair;
         # none — never measured on an H200) and 37 (the attention plan at one block per SM, the 1K plan before session
         # 44); then, while the call has time, the 1K profile with the persisting KV cache and its GPU test.
         # Builds: precompile_mk.py 1b-f3 1b-1k-profile 1b-1k-sl0 1b-1k-sl4.
    if [ "${S57_BENCH:-}" = 1 ] || { [ -z "${S57_BENCH:-}" ] && echo "$GPU_NAME" | grep -q H200; }; then
      bench ${BENCH_S:-150}
      prof1k profile_1k 70
      ONLY=${ONLY:-0,42,43,40,39,37,41,0,42,43,40,39,37,41}
    fi
    ONLY=${ONLY:-0,42,43,41,0,42,43,41,0,42} AB_CONTEXTS=${AB_CONTEXTS:-1024} mk_sweep_ab mk_sweep $((480 - SECONDS))
    [ $SECONDS -lt 490 ] && prof1k profile_1k_l2kv 60 HIPENGINE_L2_PERSIST_KV=1
    left=$((575 - SECONDS)); [ $left -gt 30 ] && run l2_test $left $PY -m pytest tests/test_monokernel_gpu.py -q -rs \
      -k l2_persisting ;;
  # (s56 — session 56's first call: MK_O_SMEM and the probe without O bytes at 1K, mk_sweep 0 / 41 / 42 twice (−5.5%,
  # +2.1%), the three 1K profiles, its same bits and the engine tests — done; MK_O_SMEM removed.)
  # (s55 — session 55's first call: MK_QKV_LATE at 1K, mk_sweep 0 / 41-44 twice (−5.5 to −6.6%), its same bits, both
  # 1K profiles and the engine tests — done; MK_QKV_LATE removed.)
  # (s54 — session 54's first call: MK_KV_L2 at 1K, mk_sweep 0 / 41 three times (−0.8%), both 1K profiles, its same bits
  # and the engine tests — done; MK_KV_L2 removed.)
  # (s53 — session 53's first call: the bench of record on session 52's default, mk_sweep 0 / 40-42 at 1K (masks 4, 3 / 3,
  # 7 / 5 against 7 / 7: −0.3, +0.1, −0.6%), the 1K profile and the engine tests — done. s53h — every single-GPU test
  # file on those kernels; the op tests need a call of their own.)
  # (s52 — session 52's first call: MK_START_L2_HALF, mk_sweep 0 / 40-42 (6 / 2, 7 / 3, 7 / 7) twice at 1K / 8K / 32K,
  # the bench (after the A/B on an H100) and the engine tests — done: 7 / 7 became the short build's default.)
  # (s51 — session 51's first call: the bench of record on MK_START_L2=4, mk_sweep 0 / 39-44 (bits 8 and 16, the half
  # pairs of masks 7 and 5), the 1K profile and the engine tests — done.)
  # (s50c — session 50's MK_START_L2 A/B: mk_sweep 0 / masks 1, 2, 4, 7 and the profiles of the default and of 7 —
  # done: mask 4 became the default; s51, then s52 followed.)
  # (s50b — session 50's MK_ARRIVE_L2 A/B, mk_sweep 0/39-43 and its profile — removed with it.)
  # (s49 — session 49's MK_PART_LL A/B: mk_sweep 0/39 at 1K / 8K / 32K, its same-bits tests and both 1K profiles — removed
  # with it. s48 — session 48's first measurement of the fresh combine, then opt-in (on ae9e953: the bench on an H200,
  # mk_sweep 0/38, its same-bits and op tests, its profile, engine tests) — done in session 49: s50 is its successor.)
  # (ospare — session 42's MK_O_SPARE A/B: same-bits tests, mk_sweep 0/17/35 at 1K/2K, two profiles — removed with it.)
  *) echo "unknown mode $MODE (iter|tune|quick|full|final|pdl|gen|record|ab|abp|abperop|abenv|abboth|mkdefault|sweepops|abmk|recordmk|recordenv|recordperop|recordall|ncu|ncuprefill|ncumk|tests|prefillrecord|paths|prefill|perop|bench|abtrees|exp|benchtests|benchonly|s53h|s57)"
     exit 2 ;;
esac
echo "==== logs (tails) ===="
for f in "$OUT"/*.log; do echo "--- $f"; tail -n 30 "$f"; done
echo "==== summary ===="
cat "$SUMMARY"
# everything in one file: the device tool returns only a few files per call
tar czf /tmp/device_session_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/device_session_all.tgz "$OUT/all.tgz"
exit $rc
