#!/usr/bin/env bash
# scripts/monokernel_check.sh [quick|full|bench|sweep] — everything one device call needs for the monokernel
# (issue 4): GPU tests, the decode benchmark, logs under $OUT, a short table last.
#   quick : tiny-model tests (identity vs per-op, sampling, cancel, timeout) + 1B identity + bench at 1K
#   full  : every monokernel GPU test + bench decode at 1K/8K/32K with JSON + PNG
#   bench : bench decode at 1K/8K/32K only
#   all   : tests + bench (1K/8K/32K, JSON + PNG) + sweep, each step time-boxed (one call does it all)
#   sweep : 1K decode tok/s for a few launch configurations (blocks/SM, register cap, prefetch on/off)
# Compiled kernels come from $HIPENGINE_CACHE (default ./.mkcache, filled on the CPU machine by
# hipengine.gpu.monokernel.precompile() and carried), so the call does not spend device time in NVRTC.
set -uo pipefail
MODE=${1:-quick}
OUT=${OUT:-/tmp/mk_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export HIPENGINE_CACHE=${HIPENGINE_CACHE:-$PWD/.mkcache}
PY=${PY:-python3}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
rc=0
run() {  # run NAME CMD... : log to $OUT/NAME.log, remember failures
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "$name rc=$r $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  [ $r -ne 0 ] && rc=1
  return 0
}
sweep() {  # 1K decode tok/s per runtime configuration; the best one goes to /tmp/mk_best.env for the bench
    cat > /tmp/mk_sweep.py <<'PYEOF'
from hipengine.bench.decode import measure
from hipengine.gpu.monokernel import MonokernelBackend
from hipengine.presets import preset_model
be = MonokernelBackend(preset_model("llama-3.2-1b", 0), max_context=1024)
best = None
for fine, pf, sleep in ((1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 0, 100), (1, 0, 100), (2, 0, 400), (0, 0, 0)):
    be.fine, be.prefetch, be.poll_sleep_ns = fine, pf, sleep
    r = measure(be, [1024], ["monokernel"], runs=3, log=lambda m: None)[0]
    print(f"blocks/SM={be.blocks_per_sm} fine={fine} prefetch={pf} poll_sleep_ns={sleep}: {r['tok_s']:.1f} tok/s",
          flush=True)
    if best is None or r["tok_s"] > best[0]:
        best = (r["tok_s"], fine, pf, sleep)
be.close()
open("/tmp/mk_best.env", "w").write(f"export HIPENGINE_MK_FINE={best[1]} HIPENGINE_MK_PREFETCH={best[2]} "
                                    f"HIPENGINE_MK_POLL_SLEEP_NS={best[3]}\n")
print("best:", best)
PYEOF
    run sweep timeout ${SWEEP_TIMEOUT:-300} $PY /tmp/mk_sweep.py
    [ -f /tmp/mk_best.env ] && . /tmp/mk_best.env && cat /tmp/mk_best.env
}
case "$MODE" in
  quick|first)
    run tests $PY -m pytest tests/test_monokernel_gpu.py -q -x -rs --timeout 240
    [ "$MODE" = first ] && sweep
    run bench1k $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --json "$OUT/bench_1k.json"
    ;;
  all)  # one call, everything, each step time-boxed so the call returns inside its limit
    SWEEP_TIMEOUT=80 sweep
    run tests timeout 170 $PY -m pytest tests/test_monokernel_gpu.py -q -rs --timeout 120
    run bench timeout 150 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 \
        --context 32768 --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"
    ;;
  tune)  # sweep, then the bench with the best configuration (no tests)
    SWEEP_TIMEOUT=80 sweep
    run bench timeout 150 $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 \
        --context 32768 --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"
    ;;
  full)
    run tests $PY -m pytest tests/test_monokernel_gpu.py -q -rs --timeout 400
    run bench $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 --context 32768 \
        --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"
    ;;
  bench)
    run bench $PY -m hipengine bench decode --shape llama-3.2-1b --context 1024 --context 8192 --context 32768 \
        --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png"
    ;;
  sweep) sweep ;;
  *) echo "unknown mode $MODE (quick|full|bench|sweep)"; exit 2 ;;
esac
echo "==== logs (tails) ===="
for f in "$OUT"/*.log; do echo "--- $f"; tail -n 25 "$f"; done
echo "==== summary ===="
cat "$OUT/summary.txt"
exit $rc
