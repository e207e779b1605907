#!/usr/bin/env bash
# The default model (98 MB GGUF) on the GPU machine. One device call carries at most 64 MiB, so the file
# travels in two halves on two back-to-back calls (the warm machine keeps /tmp between them):
#   call 1: carry .carry/p1 (first half)   -> bash scripts/device_default_model.sh stage
#   call 2: carry .carry/p2 .whl (gguf)    -> bash scripts/device_default_model.sh run
# Halves are made here with: split -b 49181216 -d <gguf> (parts gguf.part00 / gguf.part01).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${1:-}" = stage ]; then
  cp .carry/p1/gguf.part00 /tmp/ && ls -la /tmp/gguf.part00
  exit
fi
cat /tmp/gguf.part00 .carry/p2/gguf.part01 > /tmp/smollm2.gguf || exit 1
echo "a1231443440b107ff29f02bdb38c9d0a  /tmp/smollm2.gguf" | md5sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. HIPENGINE_DEFAULT_MODEL=/tmp/smollm2.gguf PYTHONUNBUFFERED=1
export HIPENGINE_COMMIT=${HIPENGINE_COMMIT:-unknown}
python3 -m pytest tests/test_gpu_default_model.py -v -s 2>&1 | tee "$OUT/default_model_gpu_pytest.log"
# The README's main job, on the GPU (monokernel decode by default; --no-monokernel: the per-op path).
python3 -m hipengine generate "The capital of France is" --device gpu --max-tokens 64 2>&1 | tee "$OUT/generate_gpu.log"
python3 -m hipengine generate "The capital of France is" --device gpu --no-monokernel --max-tokens 64 2>&1 | tee -a "$OUT/generate_gpu.log"
# Monokernel vs per-op greedy ids on the default model (issue 4 acceptance), at two KV-cache sizes (the
# attention split plan differs: 32 splits of 32 positions at 1024, 64 of 64 at 4096).
python3 - <<'PY' 2>&1 | tee "$OUT/monokernel_vs_perop_default.log"
import numpy as np
from hipengine.backend import SamplingParams
from hipengine.gpu.executor import GpuBackend
from hipengine.loader import default_model_path, load_model
from hipengine.tokenizer import Tokenizer
m = load_model(default_model_path(), progress=False); tok = Tokenizer.for_model(m)
sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
for ctx in (1024, 4096):
    per, mk = GpuBackend(m, max_context=ctx, monokernel=False), GpuBackend(m, max_context=ctx, monokernel=True)
    for prompt in ["The capital of France is", "def quicksort(arr):", "Once upon a time, in a small village,"]:
        ids = np.array(tok.encode(prompt), np.int64)
        per.reset(); a = list(per.generate_ids(ids, sp, lambda: False))
        mk.reset(); b = list(mk.generate_ids(ids, sp, lambda: False))
        diff = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        print(f"max_context {ctx} {type(mk).__name__} {prompt!r}: 256 tokens identical={a == b} "
              f"first diffs (step, per-op, monokernel)={diff[:5]}")
    per.close(); mk.close()
PY
# Optional extra work in the same call (e.g. the final benchmark): EXTRA="bash scripts/device_session.sh final"
if [ -n "${EXTRA:-}" ]; then eval "$EXTRA"; fi
