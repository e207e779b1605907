"""Run a few per-op decode steps of the Llama-3.2-1B shape and exit: the workload for an external profiler.

Nsight Compute (where the machine lets it read the counters) on the decode attention, for example:
  ncu --clock-control none -k regex:attention_split --launch-skip 64 --launch-count 4 \\
      --section SpeedOfLight --section WarpStateStats --section SourceCounters -o attn \\
      python3 scripts/perop_steps.py --context 1024 --steps 8
The KV cache is filled synthetically to the context (as bench decode does above its smallest context); the
steps run the captured decode graph exactly as the per-op generation loop does. With --prefill N: instead of
decode steps, a prefill of N random tokens ending at the context (chunks of ops.PREFILL_M, each replaying
its graph as GpuBackend.prefill does; HIPENGINE_NO_GRAPH=1 launches them eagerly), e.g. on the matrix-core
prefill kernels:
  ncu --clock-control none -k regex:"matmul_mma|attention_prefill" --launch-skip 16 --launch-count 8 ... \
      python3 scripts/perop_steps.py --context 1152 --prefill 256
With --monokernel: the same decode steps in the monokernel instead, one launch per --launches (each launch
generates --steps tokens from the same position), e.g. the last of three launches of 32 tokens:
  ncu --clock-control none --cache-control none -k regex:monokernel_decode --launch-skip 2 --launch-count 1 ... \
      python3 scripts/perop_steps.py --monokernel --context 1024 --steps 32 --launches 3
"""
from __future__ import annotations

import argparse

import numpy as np

from hipengine.bench.decode import _fill_kv, _per_op_from_state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=0, help="prefill this many tokens instead of decoding")
    ap.add_argument("--monokernel", action="store_true", help="decode in the monokernel (one launch per --launches)")
    ap.add_argument("--launches", type=int, default=1, help="--monokernel: launches of --steps tokens each")
    args = ap.parse_args()
    if not 0 <= args.prefill < args.context:
        ap.error("--prefill: 0 .. context - 1 tokens")
    if not 0 < args.steps < args.context:
        ap.error("--steps: 1 .. context - 1 tokens")
    if args.monokernel and args.prefill:
        ap.error("--monokernel decodes; --prefill runs the per-op prefill")
    if args.launches < 1:
        ap.error("--launches: at least 1")
    from hipengine.backend import SamplingParams
    from hipengine.gpu.executor import GpuBackend
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.presets import preset_model

    be = (MonokernelBackend if args.monokernel else GpuBackend)(preset_model(args.shape, 0), max_context=args.context)
    try:
        _fill_kv(be)
        if args.prefill:
            be.pos = args.context - args.prefill
            ids = np.random.default_rng(0).integers(0, be.config.vocab_size, args.prefill)
            logits = be.prefill(ids)
            print(f"prefill of {args.prefill} tokens up to context {args.context}: arg-max {int(np.argmax(logits))}")
            return 0
        if args.monokernel:
            params = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
            for _ in range(args.launches):
                be.pos = args.context - args.steps
                toks = list(be.generate_from_state(1, 0, params))
            print(f"{args.launches} monokernel launches of {len(toks)} tokens at context {args.context}")
            return 0
        be.pos = args.context - args.steps
        toks, _ = _per_op_from_state(be, 1, args.steps)
        print(f"{len(toks)} tokens at context {args.context}")
    finally:
        be.close()
    return 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
