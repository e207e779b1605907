#!/usr/bin/env bash
# scripts/tp_check.sh [mk|final|perop|pdl|...] — the one script a 2-GPU device call runs for tensor-parallel decode (issue 5).
#   mk (default): the tensor-parallel monokernel (TpMonokernelBackend)
#     1. tests/test_tp_monokernel.py: TP=2 monokernel == per-op TP path for 256 greedy tokens (random
#        llama-3.2-1b), and at 4K from a synthetic cache; cancel; 300 requests; sampling route; peer timeout;
#     2. the multigpu test of tests/test_tp_executor.py: per-op TP=2 == TP=1 for 256 tokens (custom, NCCL);
#     3. bench decode --tp 2 at 1K/8K/32K: monokernel and per-op TP on the same shards (JSON + PNG);
#     4. tests/test_monokernel_gpu.py: the single-GPU monokernel (its kernel gained the TP paths).
#   final: the TP monokernel's tests and per-op TP == TP=1, then bench decode --tp 2 and the TP=1 bench at 1K/8K/32K
#     and at 1K in a 4K cache.
#   plan: the TP monokernel's tests, bench --tp 2 at 1K/8K/32K, the same at 1K with HIPENGINE_ATTN_SPLIT_CAP=0
#     (the attention plan before the split cap: an A/B in one call), TP=1 monokernel tests, per-op TP == TP=1.
#   serve: as plan, but the second bench is 1K in a 4,096-token cache (the Engine's default) instead of the A/B.
#   ab: this tree against $AB_TREE ($AB_COMMIT): single-GPU tests, stage profile and per-SM probe on both GPUs
#     at once, then the all-reduce suite and TP=2 1K in a 4K cache for each tree.
#   ab2: the TP monokernel's tests, then the TP=1 A/B over $AB_TREES ($AB_MAXCTX cache too) with the stage
#     profile and bench probe on GPU 0 while GPU 1 runs the op tests.
#   exp: a compile-time experiment ($EXP_DEFINES) as a candidate default: sweep A/B ($ONLY) on GPU 0 beside the TP=1
#     bench on GPU 1, then the TP monokernel's tests and TP=2 benches, all built with it.
#   arab: an all-reduce / LL change against $AB_TREE: all-reduce + TP monokernel tests, all-reduce suite and TP=2
#     decode at 1K for each tree.
#   abtp: TP=2 decode at 1K/8K, this tree against $AB_TREE ($AB_COMMIT), alternated twice.
#   pdl: all-reduce, per-op TP and TP monokernel GPU tests, then bench decode --tp 2 (1K/8K/32K, both paths) and
#     the all-reduce suite (programmatic dependent launch, v29).
#   perop: the per-op TP path alone (all of tests/test_tp_executor.py, the per-op engine's GPU tests, bench
#     --no-monokernel with the custom all-reduce and with NCCL, the TP=1 per-op baseline).
# Every step is time-boxed (sums < 600 s: one device call). Kernels come from $HIPENGINE_CACHE (precompiled
# here with `python scripts/precompile_mk.py session`, carried as .mkcache). Logs and JSON go under $OUT.
#   usage (device): HIPENGINE_COMMIT=<sha> bash scripts/tp_check.sh [mk|final|perop]   env: TP (2), PYTHON
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HIPENGINE_CACHE=${HIPENGINE_CACHE:-$PWD/.mkcache}
MODE=${1:-mk}
OUT="${OUT:-/tmp/tp_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TP="${TP:-2}"
SHAPE="${SHAPE:-llama-3.2-1b}"
SUMMARY=$(mktemp)
run() {  # run NAME SECONDS CMD... : log to $OUT/NAME.log, time-boxed
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$SUMMARY"
}
# ab_run NAME SECONDS CMD... : CMD in this tree (log NAME_new) and in $AB_TREE as commit $AB_COMMIT (NAME_base);
# @TAG@ in the arguments becomes "new" / "base" (output file names)
ab_run() {
  local name=$1 limit=$2; shift 2
  run "${name}_new" "$limit" "${@//@TAG@/new}"
  run "${name}_base" "$limit" env -C "$AB_TREE" HIPENGINE_COMMIT="$AB_COMMIT" PYTHONPATH=. "${@//@TAG@/base}"
}

nvidia-smi topo -m >"$OUT/topo.txt" 2>&1 || rocm-smi --showtopo >"$OUT/topo.txt" 2>&1 || true
case "$MODE" in
  mk)
    run pytest_tp_mk 150 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    run pytest_tp_eq 120 "$PY" -m pytest tests/test_tp_executor.py -m multigpu -q -rs -s -p no:cacheprovider
    run bench_tp_mk 200 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" \
      --json "$OUT/decode_tp${TP}_mk.json" --plot "$OUT/decode_tp${TP}_mk.png"
    run pytest_mk1 100 "$PY" -m pytest tests/test_monokernel_gpu.py -q -rs -x -p no:cacheprovider
    ;;
  final)  # the figures of record: both TP paths' GPU tests, then TP=2 and TP=1 decode benches (JSON + PNG) at
          # 1K/8K/32K and at 1K in a 4K cache (the Engine's default)
    run pytest_tp_mk 150 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    run pytest_tp_eq 120 "$PY" -m pytest tests/test_tp_executor.py -m multigpu -q -rs -s -p no:cacheprovider
    run bench_tp_mk 150 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" \
      --json "$OUT/decode_tp${TP}_mk.json" --plot "$OUT/decode_tp${TP}_mk.png"
    run bench_tp_cache4k 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --context 1024 \
      --max-context 4096 --json "$OUT/decode_tp${TP}_cache4k.json"
    run bench_tp1 120 "$PY" -m hipengine bench decode --shape "$SHAPE" --context 1024 --context 8192 \
      --context 32768 --json "$OUT/decode_tp1.json" --plot "$OUT/decode_tp1.png"
    run bench_tp1_cache4k 50 "$PY" -m hipengine bench decode --shape "$SHAPE" --context 1024 --max-context 4096 \
      --json "$OUT/decode_tp1_cache4k.json"
    ;;
  pdl)  # programmatic dependent launch (v29): the all-reduce, per-op TP and TP monokernel GPU tests, then TP=2
        # decode at 1K/8K/32K (both paths) and the all-reduce suite
    run pytest_ar 80 "$PY" -m pytest tests/test_allreduce_gpu.py -q -rs -x -p no:cacheprovider
    run pytest_tp 150 "$PY" -m pytest tests/test_tp_executor.py -q -rs -s -p no:cacheprovider
    run pytest_tp_mk 120 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    run bench_tp 150 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" \
      --json "$OUT/decode_tp${TP}.json" --plot "$OUT/decode_tp${TP}.png"
    run bench_ar 60 "$PY" -m hipengine bench allreduce --tp "$TP" --sizes 1K..64K --json "$OUT/allreduce.json"
    ;;
  perop)
    run pytest_tp 200 "$PY" -m pytest tests/test_tp_executor.py -q -rs -s -p no:cacheprovider
    run pytest_gpu_engine 100 "$PY" -m pytest tests/test_gpu_engine.py -m gpu -q -rs -p no:cacheprovider
    run bench_tp_custom 100 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --no-monokernel \
      --json "$OUT/decode_tp${TP}_custom.json"
    run bench_tp_nccl 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --no-monokernel \
      --allreduce nccl --context 1024 --json "$OUT/decode_tp${TP}_nccl.json"
    run bench_tp1 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --no-monokernel --context 1024 \
      --json "$OUT/decode_tp1_perop.json"
    ;;
  plan)  # the attention split plan at TP (16 splits where 32 cost a second combine batch): tests + A/B at 1K
    run pytest_tp_mk 140 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    run bench_tp_mk 140 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" \
      --json "$OUT/decode_tp${TP}_mk.json" --plot "$OUT/decode_tp${TP}_mk.png"
    run bench_tp_nocap 70 env HIPENGINE_ATTN_SPLIT_CAP=0 "$PY" -m hipengine bench decode --shape "$SHAPE" \
      --tp "$TP" --context 1024 --json "$OUT/decode_tp${TP}_nocap.json"
    run pytest_mk1 80 "$PY" -m pytest tests/test_monokernel_gpu.py -q -rs -x -p no:cacheprovider
    run pytest_tp_eq 110 "$PY" -m pytest tests/test_tp_executor.py -m multigpu -q -rs -s -p no:cacheprovider
    ;;
  serve)  # the figures of record at TP plus a serving cache size: tests, bench at 1K/8K/32K, 1K in a 4K cache
    run pytest_tp_mk 140 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    run bench_tp_mk 140 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" \
      --json "$OUT/decode_tp${TP}_mk.json" --plot "$OUT/decode_tp${TP}_mk.png"
    run bench_tp_cache4k 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --context 1024 \
      --max-context 4096 --json "$OUT/decode_tp${TP}_cache4k.json"
    run pytest_mk1 80 "$PY" -m pytest tests/test_monokernel_gpu.py -q -rs -x -p no:cacheprovider
    run pytest_tp_eq 110 "$PY" -m pytest tests/test_tp_executor.py -m multigpu -q -rs -s -p no:cacheprovider
    ;;
  ab)  # this tree against $AB_TREE (`git archive` of a base commit under .carry/, commit in $AB_COMMIT): the
       # single-GPU steps on both GPUs at once (op attention tests + the per-block stage profile on GPU 0; the
       # monokernel tests + bench probe's per-SM read on GPU 1), then the 2-GPU A/B, each tree in its own
       # process: the all-reduce suite (1K..64K) and TP=2 decode at 1K in a 4K cache (the Engine's default).
    ( export CUDA_VISIBLE_DEVICES=0
      run pytest_ops_attn 90 "$PY" -m pytest tests/test_ops_gpu.py -q -rs -x -k attention -p no:cacheprovider
      run profile_1k 150 "$PY" -m hipengine bench decode --shape "$SHAPE" --context 1024 --profile \
        --json "$OUT/profile_1k.json" ) &
    ( export CUDA_VISIBLE_DEVICES=1
      run pytest_mk1 150 "$PY" -m pytest tests/test_monokernel_gpu.py -q -rs -x -p no:cacheprovider
      run probe 90 "$PY" -m hipengine bench probe --json "$OUT/probe.json" ) &
    wait
    ab_run ar 70 "$PY" -m hipengine bench allreduce --tp "$TP" --sizes 1K..64K --json "$OUT/allreduce_@TAG@.json"
    ab_run tp_cache4k 90 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --context 1024 \
      --max-context 4096 --json "$OUT/decode_tp${TP}_cache4k_@TAG@.json"
    ;;
  ab2)  # the TP=1 side of the same A/B, the TP monokernel's tests first (both GPUs), then GPU 0: the per-block
        # stage profile, bench probe, and the monokernel A/B over the trees in $AB_TREES (scripts/mk_sweep.py:
        # each tree in its own process, "base new base new" controls order) at 1K/8K/32K and at 1K in a
        # $AB_MAXCTX cache; GPU 1 meanwhile: the op tests.
    run pytest_tp_mk 140 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    ( export CUDA_VISIBLE_DEVICES=0
      run profile_1k 60 "$PY" -m hipengine bench decode --shape "$SHAPE" --context 1024 --profile \
        --json "$OUT/profile_1k.json"
      run probe 40 "$PY" -m hipengine bench probe --json "$OUT/probe.json"
      run ab_trees 240 "$PY" scripts/mk_sweep.py --contexts 1024,8192,32768 --only "" \
        $(for t in $AB_TREES; do echo --baseline-tree "$t"; done) --json "$OUT/ab_trees.json"
      run ab_trees_maxctx 120 "$PY" scripts/mk_sweep.py --contexts 1024 --max-context "${AB_MAXCTX:-32768}" \
        --only "" $(for t in $AB_TREES; do echo --baseline-tree "$t"; done) --json "$OUT/ab_trees_maxctx.json" ) &
    ( export CUDA_VISIBLE_DEVICES=1
      run pytest_ops 100 "$PY" -m pytest tests/test_ops_gpu.py -q -rs -x -p no:cacheprovider ) &
    wait
    ;;
  arab)  # an all-reduce / LL change, this tree against $AB_TREE ($AB_COMMIT): the all-reduce and TP monokernel
         # GPU tests, then the all-reduce suite and TP=2 decode at 1K for each tree (v27 was measured this way)
    run pytest_ar 90 "$PY" -m pytest tests/test_allreduce_gpu.py -q -rs -x -p no:cacheprovider
    run pytest_tp_mk 120 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -x -p no:cacheprovider
    ab_run ar 60 "$PY" -m hipengine bench allreduce --tp "$TP" --sizes 1K..64K --json "$OUT/allreduce_@TAG@.json"
    ab_run tp 80 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --context 1024 \
      --json "$OUT/decode_tp${TP}_@TAG@.json"
    ;;
  abtp)  # a short TP A/B: TP=2 decode (both TP paths) at 1K and 8K for this tree and $AB_TREE ($AB_COMMIT),
          # alternated twice (new, base, new, base) — e.g. session 9's open question, 6de4381 against v34+
    for k in 1 2; do
      ab_run "tp$k" 80 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --context 1024 --context 8192 \
        --json "$OUT/decode_tp${TP}_ab${k}_@TAG@.json"
    done ;;
  exp)  # a compile-time experiment ($EXP_DEFINES, HIPENGINE_MK_DEFINES syntax) measured as a candidate default:
        # GPU 0 the monokernel sweep's variants $ONLY at 1K/8K/32K (A/B in one process) while GPU 1 runs the TP=1
        # bench with it; then the TP monokernel's tests and TP=2 benches with it (1K/8K/32K, 1K in a 4K cache)
    ( export CUDA_VISIBLE_DEVICES=0
      run exp_sweep 200 "$PY" scripts/mk_sweep.py --contexts 1024,8192,32768 --only "$ONLY" \
        --json "$OUT/exp_sweep.json" ) &
    ( export CUDA_VISIBLE_DEVICES=1 HIPENGINE_MK_DEFINES="$EXP_DEFINES"
      run exp_bench_tp1 120 "$PY" -m hipengine bench decode --shape "$SHAPE" --context 1024 --context 8192 \
        --context 32768 --json "$OUT/exp_decode_tp1.json" --plot "$OUT/exp_decode_tp1.png"
      run exp_bench_tp1_cache4k 50 "$PY" -m hipengine bench decode --shape "$SHAPE" --context 1024 \
        --max-context 4096 --json "$OUT/exp_decode_tp1_cache4k.json" ) &
    wait
    export HIPENGINE_MK_DEFINES="$EXP_DEFINES"
    run pytest_tp_mk 150 "$PY" -m pytest tests/test_tp_monokernel.py -q -rs -s -x -p no:cacheprovider
    run exp_bench_tp 150 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" \
      --json "$OUT/exp_decode_tp${TP}.json" --plot "$OUT/exp_decode_tp${TP}.png"
    run exp_bench_tp_cache4k 70 "$PY" -m hipengine bench decode --shape "$SHAPE" --tp "$TP" --context 1024 \
      --max-context 4096 --json "$OUT/exp_decode_tp${TP}_cache4k.json"
    ;;
  *) echo "unknown mode $MODE (mk|final|pdl|perop|plan|serve|ab|ab2|arab|abtp|exp)"; exit 2 ;;
esac

# The test outcomes as JSON beside the benchmark JSON (commit from $HIPENGINE_COMMIT, as the benches take it).
"$PY" - "$OUT" "$MODE" <<'PYEOF' || true
import glob, json, os, re, sys
from hipengine.bench import git_commit, utc_now
out, mode = sys.argv[1], sys.argv[2]
res = {"benchmark": f"tp_check {mode}: GPU test outcomes", "commit": git_commit(), "date": utc_now(), "logs": {}}
for f in sorted(glob.glob(os.path.join(out, "pytest_*.log"))):
    text = open(f, errors="replace").read()
    res["logs"][os.path.basename(f)] = {
        "summary": (re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", text, re.M) or [""])[-1],
        "printed": sorted(set(re.findall(r"^(TP=\d.*tok/s.*)$", text, re.M)))}
json.dump(res, open(os.path.join(out, f"tp_tests_{mode}.json"), "w"), indent=1)
PYEOF

echo "=================== tp_check $MODE (TP=$TP, $SHAPE) ==================="
for f in "$OUT"/*.log; do
  echo "--- $(basename "$f")"
  grep -E "^(FAILED|ERROR)|TP=[0-9]+ |diverges|tok/s|Error|error:" "$f" | head -20
  tail -n 8 "$f"
done
echo "==== summary ===="
cat "$SUMMARY"
# everything in one file: the device tool returns only a few files per call
tar czf /tmp/tp_check_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/tp_check_all.tgz "$OUT/all.tgz"
