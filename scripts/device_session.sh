#!/usr/bin/env bash
# scripts/device_session.sh [iter|quick|final] — one device call that builds, checks and times the monokernel work
# (issue 4) and the per-op kernels (issue 3), every step time-boxed so the call ends inside the 600 s limit.
#   iter  : stage profile + bench at 1K, launch-configuration sweep, GPU op + monokernel tests, bench_ops
#   quick : op tests, stage profile + bench at 1K/8K, monokernel tests, bench_ops
#   final : monokernel + per-op bench at 1K/8K/32K (JSON + PNG), monokernel tests
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
case "$MODE" in
  iter)
    run profile1k 130 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 --profile \
        --json "$OUT/profile_1k.json"
    run sweep 150 $PY scripts/mk_sweep.py --json "$OUT/sweep_1k.json"
    run mk_tests 150 $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs
    run ops_tests 90 $PY -m pytest tests/test_ops_gpu.py -q -x -rs
    run bench_ops 80 $PY scripts/bench_ops.py --skip-decode --json "$OUT/bench_ops.json"
    ;;
  quick)  # correctness of a change + where the time goes, no sweep
    run ops_tests 90 $PY -m pytest tests/test_ops_gpu.py -q -x -rs
    run profile1k 130 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 --profile \
        --json "$OUT/profile_1k.json"
    run mk_tests 150 $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs
    run bench_ops 80 $PY scripts/bench_ops.py --skip-decode --json "$OUT/bench_ops.json"
    ;;
  v8)  # quick + the 1B preset's 512-position check + the final decode bench, one call
    run ops_tests 90 $PY -m pytest tests/test_ops_gpu.py -q -x -rs
    run profile1k 130 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 --profile \
        --json "$OUT/profile_1k.json"
    run mk_tests 150 $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs
    run preset1b 150 $PY -m pytest tests/test_gpu_engine.py -q -rs -s -k "1b_preset"
    run bench 200 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 \
        --context 32768 --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"
    ;;
  final)
    run bench 200 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 \
        --context 32768 --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"
    run mk_tests 150 $PY -m pytest tests/test_monokernel_gpu.py -q -rs
    ;;
  *) echo "unknown mode $MODE (iter|quick|final)"; exit 2 ;;
esac
echo "==== logs (tails) ===="
for f in "$OUT"/*.log; do echo "--- $f"; tail -n 30 "$f"; done
echo "==== summary ===="
cat "$SUMMARY"
exit $rc
