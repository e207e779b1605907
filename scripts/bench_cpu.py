#!/usr/bin/env python3
"""Decode tok/s of the default model (or --model / --shape) on the CPU path (numpy reference).

Method: one warm-up generation (first-touch of the weights), then 3 timed greedy generations of 64 tokens
(EOS ignored) from the same prompt; prints TTFT and decode tok/s of each, and the median last.

    python scripts/bench_cpu.py [--model PATH | --shape NAME] [--tokens 64] [--runs 3] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="BLAS threads (batch-1 matvecs are often fastest with 1 on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        # Must be set before numpy loads OpenBLAS/MKL.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from hipengine.engine import Engine, GenerationStats
    from hipengine.errors import HipEngineError

    try:
        t0 = time.perf_counter()
        eng = Engine.load(args.model, device="cpu", shape=args.shape, progress=False)
        load_s = time.perf_counter() - t0
        prompt = PROMPT if eng.tokenizer.has_text else list(range(1, 17))
        eng.generate(prompt, max_tokens=4, ignore_eos=True)  # warm-up
        rows = []
        for _ in range(args.runs):
            st = GenerationStats()
            eng.generate(prompt, max_tokens=args.tokens, ignore_eos=True, stats=st)
            rows.append(st)
    except HipEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    print(f"model {eng.model_name} | load {load_s:.1f} s | prompt {rows[0].prompt_tokens} tokens | "
          f"{args.tokens} generated | BLAS threads {threads} | {os.cpu_count()} CPUs")
    print(f"{'run':>4} {'TTFT ms':>10} {'decode tok/s':>13}")
    for i, st in enumerate(rows):
        print(f"{i + 1:>4} {st.ttft_s * 1e3:>10.1f} {st.decode_tok_s:>13.2f}")
    print(f"median decode tok/s: {statistics.median(r.decode_tok_s for r in rows):.2f}  "
          f"(TTFT {statistics.median(r.ttft_s for r in rows) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
