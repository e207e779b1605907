#!/usr/bin/env bash
# The one script a 2-GPU device call runs for tensor-parallel decode (issue 5, TpGpuBackend):
#   1. tests/test_tp_executor.py: the CPU emulation tests, then (multigpu) TP=2 greedy == TP=1 for 256 tokens
#      on a random llama-3.2-1b preset, custom all-reduce and NCCL, with the TP=2 decode rate printed;
#   2. the single-GPU per-op executor's GPU tests (its decode/prefill gained the partial-sum hooks TP uses);
#   3. bench decode --tp 2 --no-monokernel (custom all-reduce, then NCCL) and the TP=1 per-op baseline.
# Timeouts sum to 540 s (fits one 600 s device call). Full logs and JSON go under $OUT (the device tool
# brings them back); a short table prints last.
#   usage (device): bash scripts/tp_check.sh        env: TP (default 2), PYTHON (default python3)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/tp_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TP="${TP:-2}"
SHAPE="${SHAPE:-llama-3.2-1b}"

nvidia-smi topo -m >"$OUT/topo.txt" 2>&1 || rocm-smi --showtopo >"$OUT/topo.txt" 2>&1 || true

# 1. TP tests (-s: the multigpu test prints its tok/s and any divergence with its logit gap)
timeout 200 "$PY" -m pytest tests/test_tp_executor.py -q -rs -s -p no:cacheprovider >"$OUT/pytest_tp.log" 2>&1
tp_rc=$?

# 2. the per-op executor on one GPU (regression for the hooks)
timeout 100 "$PY" -m pytest tests/test_gpu_engine.py -m gpu -q -rs -p no:cacheprovider \
  >"$OUT/pytest_gpu_engine.log" 2>&1
eng_rc=$?

# 3. decode benchmarks: TP=N custom, TP=N NCCL, TP=1 per-op baseline (same method, same shape)
timeout 100 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --no-monokernel \
  --json "$OUT/decode_tp${TP}_custom.json" >"$OUT/bench_tp_custom.log" 2>&1
custom_rc=$?
timeout 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --no-monokernel --allreduce nccl \
  --context 1024 --json "$OUT/decode_tp${TP}_nccl.json" >"$OUT/bench_tp_nccl.log" 2>&1
nccl_rc=$?
timeout 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --no-monokernel --context 1024 \
  --json "$OUT/decode_tp1_perop.json" >"$OUT/bench_tp1.log" 2>&1
tp1_rc=$?

echo "=================== tp_check (TP=$TP, $SHAPE) ==================="
echo "--- pytest tests/test_tp_executor.py (rc=$tp_rc) ---"
grep -E "^(FAILED|ERROR)|TP=[0-9]+ \(|diverges" "$OUT/pytest_tp.log" | head -20
tail -n 1 "$OUT/pytest_tp.log"
echo "--- pytest tests/test_gpu_engine.py -m gpu (rc=$eng_rc) ---"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu_engine.log" | head -10
tail -n 1 "$OUT/pytest_gpu_engine.log"
echo "--- bench decode (rc custom=$custom_rc nccl=$nccl_rc tp1=$tp1_rc) ---"
for f in bench_tp_custom bench_tp_nccl bench_tp1; do
  echo "[$f]"; tail -n 5 "$OUT/$f.log"  # the table is the last lines (or the error)
done
