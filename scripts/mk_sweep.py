"""Monokernel launch-configuration sweep at one context (default 1K) on the llama-3.2-1b preset.

Each variant is (environment for the build, runtime attributes); a variant with a new build constructs a new
MonokernelBackend (the compile cache makes repeats cheap). Prints one line per variant and writes JSON
(--json) with the commit, GPU and every figure, so the defaults in hipengine/gpu/monokernel.py can cite it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hipengine.bench import git_commit, utc_now
from hipengine.bench.decode import measure
from hipengine.presets import preset_model


VARIANTS = [  # name, build env, runtime attrs
    ("default (1 blk/SM, unroll 4, fine 3)", {}, {}),
    ("fine 2 (barrier + one head per block)", {}, {"fine": 2}),
    ("poll sleep 100 ns", {}, {"poll_sleep_ns": 100}),
    ("LL exchange for O/down (no barrier after them)", {"HIPENGINE_MK_LL": "1"}, {}),
    ("default again (drift check)", {}, {}),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated variant indices")
    ap.add_argument("--best-env", default=None, help="write the fastest variant's runtime knobs as shell exports")
    args = ap.parse_args()
    from hipengine.gpu.monokernel import MonokernelBackend, grid_info

    model = preset_model("llama-3.2-1b", 0)
    rows, be, be_env = [], None, None
    picks = [int(i) for i in args.only.split(",")] if args.only else range(len(VARIANTS))
    for i in picks:
        name, env, attrs = VARIANTS[i]
        if be is None or env != be_env:
            if be is not None:
                be.close()
            for k in ("HIPENGINE_MK_UNROLL", "HIPENGINE_MK_MIN_BLOCKS", "HIPENGINE_MK_LL"):
                os.environ.pop(k, None)
            os.environ.update(env)
            t0 = time.perf_counter()
            be, be_env = MonokernelBackend(model, max_context=args.context), env
            base = {"fine": be.fine, "poll_sleep_ns": be.poll_sleep_ns}
            print(f"built {name}: {time.perf_counter() - t0:.1f} s, {grid_info(be)}", flush=True)
        for k, v in {**base, **attrs}.items():
            setattr(be, k, v)
        r = measure(be, [args.context], ["monokernel"], runs=args.runs, log=lambda m: None)[0]
        rows.append({"variant": name, "env": env, "attrs": attrs, "tok_s": r["tok_s"], "tok_s_runs": r["tok_s_runs"],
                     "grid": grid_info(be)})
        print(f"{name:55s} {r['tok_s']:8.1f} tok/s  runs {[round(x, 1) for x in r['tok_s_runs']]}", flush=True)
    if be is not None:
        be.close()
    if args.best_env and rows:
        best = max(rows, key=lambda r: r["tok_s"])
        names = {"fine": "HIPENGINE_MK_FINE", "poll_sleep_ns": "HIPENGINE_MK_POLL_SLEEP_NS"}
        with open(args.best_env, "w") as f:
            f.write(f"# fastest: {best['variant']} ({best['tok_s']:.1f} tok/s)\n")
            for k, v in {**best["env"], **best["attrs"]}.items():
                f.write(f"export {names.get(k, k)}={v}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "monokernel sweep", "model": "llama-3.2-1b preset (bf16)", "context": args.context,
                       "commit": git_commit(), "date": utc_now(), "gpu": os.environ.get("GPU_NAME", ""),
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
