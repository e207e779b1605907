#!/usr/bin/env bash
# The one script a device call runs (H200): GPU op tests, engine tests, op benchmarks; logs + JSON under $OUT,
# a short table printed last. Usage on the device: bash scripts/gpu_check.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/hipengine_out}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; git rev-parse HEAD 2>/dev/null; date -u) \
  >"$OUT/env.txt" 2>&1
t0=$(date +%s)
python3 -m pytest -m gpu tests/test_ops_gpu.py -q -rfE -p no:cacheprovider >"$OUT/pytest_ops.log" 2>&1
ops_rc=$?
python3 -m pytest -m gpu tests/test_gpu_engine.py -q -rfE -p no:cacheprovider -k "not 1b" >"$OUT/pytest_engine.log" 2>&1
eng_rc=$?
t1=$(date +%s)
python3 scripts/bench_ops.py --json "$OUT/bench_ops.json" >"$OUT/bench.log" 2>&1
bench_rc=$?
t2=$(date +%s)
b1_rc=skipped
if [ "${1:-}" != "quick" ]; then
  timeout 150 python3 -m pytest -m gpu tests/test_gpu_engine.py -q -rfE -p no:cacheprovider -k "1b" \
    >"$OUT/pytest_1b.log" 2>&1
  b1_rc=$?
fi
t3=$(date +%s)
echo "==== failures (ops) ===="; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest_ops.log" | head -40
echo "==== failures (engine) ===="; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest_engine.log" | head -20
[ -f "$OUT/pytest_1b.log" ] && { echo "==== 1b ===="; tail -5 "$OUT/pytest_1b.log"; }
echo "==== bench (rc $bench_rc) ===="; tail -16 "$OUT/bench.log"
echo "==== summary ===="
echo "ops tests: rc=$ops_rc  $(tail -1 "$OUT/pytest_ops.log")"
echo "engine tests: rc=$eng_rc  $(tail -1 "$OUT/pytest_engine.log")"
echo "1B preset test: rc=$b1_rc  $([ -f "$OUT/pytest_1b.log" ] && tail -1 "$OUT/pytest_1b.log")"
echo "times: tests $((t1 - t0))s bench $((t2 - t1))s 1b $((t3 - t2))s"
