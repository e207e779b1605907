"""Per-kernel timeline of the per-op decode step on NVIDIA: where one token's time goes, kernel by kernel.

The per-op step is one captured graph of ~100 kernels launched with programmatic dependent launch, so
consecutive kernels overlap: a kernel's blocks become resident and request their first weights while the
kernel before it still runs. Its own duration therefore says little; what it costs the step is its
*increment*: the time from the previous kernel's end to its own end. The increments add up to the step.

Method: the Llama-3.2-1B shape (random weights), the KV cache filled to each context, the per-op decode loop
(GpuBackend._generate_per_op: graph, decode_advance, arg-max, emit) timed without a profiler (median of
RUNS runs), then one run traced with the PyTorch profiler (CUPTI kernel activity: first block start and
last block end of every kernel, graph nodes included). The traced step time is reported next to the
untraced one, so the tracing's own cost is visible. Kernels are labelled by their place in the step
(qkv, attn, combine, o, gate_up, down per layer; lm_head, argmax, ... per step).

Usage (device): PYTHONPATH=. python3 scripts/profile_perop.py [--context 1024 ...] [--json OUT]
Needs torch (its profiler); the device image has it. Environment knobs of the per-op path apply
(HIPENGINE_PDL=0, HIPENGINE_ATTN_ONE_KERNEL=..., HIPENGINE_MATVEC_BLOCKS_PER_SM=...).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import numpy as np

from hipengine.bench import git_commit, utc_now
from hipengine.bench.decode import _decode_rate, _fill_kv, _per_op_from_state

RUNS = 3
GEN = 64
LAYER_ROLES = {"matvec_qkv": "qkv", "matvec_gate_up": "gate_up",  # (+ the grouped O-proj's kernels: matvec_group.hip)
               "matvec_group_o": "o", "matvec_gate_up_fx": "gate_up", "matvec_fx_res": "down",
               "matvec_rows1_fx_res": "down"}


def label(names: list[str]) -> list[str]:
    """Role of every kernel in launch order: matvec after attention is the O-proj, after gate/up the
    down-proj, after a down-proj the LM head; attention kernels are attn (split or one kernel) / combine."""
    out, prev = [], ""
    for n in names:
        if n in LAYER_ROLES:
            r = LAYER_ROLES[n]
        elif n.startswith("attention_split") or n.startswith("attention_decode"):
            r = "attn"
        elif n.startswith("attention_combine"):
            r = "combine"
        elif n in ("matvec", "matvec_rows1"):
            r = {"attn": "o", "combine": "o", "gate_up": "down", "down": "lm_head"}.get(prev, "matvec")
        else:
            r = n
        out.append(r)
        prev = r
    return out


def kernel_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        tr = json.load(f)
    ev = [e for e in tr.get("traceEvents", []) if e.get("cat") == "kernel" and "ts" in e]
    ev.sort(key=lambda e: float(e["ts"]))
    return [{"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e.get("dur", 0.0))}
            for e in ev]


def analyse(events: list[dict], n_layers: int) -> dict:
    """Per role: median duration, increment (end - previous end), start - previous end (negative: overlap)."""
    roles = label([e["name"] for e in events])
    steps = [i for i, r in enumerate(roles) if r == "embedding"]
    if len(steps) < 3:
        raise RuntimeError(f"trace holds {len(steps)} decode steps (embedding kernels); need at least 3")
    # whole steps only, the first and last dropped (warm-up and the loop's tail)
    lo, hi = steps[1], steps[-1]
    per = defaultdict(lambda: {"dur": [], "inc": [], "gap": []})
    step_us = []
    for a, b in zip(steps[1:-1], steps[2:]):
        step_us.append(events[b]["end"] - events[a]["end"])
    for i in range(lo, hi):
        e, p = events[i], events[i - 1]
        d = per[roles[i]]
        d["dur"].append(e["end"] - e["start"])
        d["inc"].append(e["end"] - p["end"])
        d["gap"].append(e["start"] - p["end"])
    nsteps = len(step_us)
    a, b = steps[2], steps[3]  # one whole step, raw: kernel, role, start and end from the step's first start
    t0 = events[a]["start"]
    sample = [[events[i]["name"], roles[i], round(events[i]["start"] - t0, 3), round(events[i]["end"] - t0, 3)]
              for i in range(a, b)]
    table = {}
    for r, d in per.items():
        table[r] = {"count_per_step": len(d["inc"]) / nsteps,
                    "dur_us": statistics.median(d["dur"]), "inc_us": statistics.median(d["inc"]),
                    "inc_mean_us": float(np.mean(d["inc"])), "start_minus_prev_end_us": statistics.median(d["gap"]),
                    "inc_total_per_step_us": float(np.sum(d["inc"])) / nsteps}
    return {"steps": nsteps, "step_us_median": statistics.median(step_us), "roles": table, "sample_step": sample}


def profile_context(loaded, C: int, log) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hipengine.gpu.executor import GpuBackend

    be = GpuBackend(loaded, max_context=C)
    try:
        _fill_kv(be)
        tok = 1
        rates = []
        for r in range(RUNS + 1):
            be.pos = C - GEN
            _, stamps = _per_op_from_state(be, tok, GEN)
            if r:
                rates.append(_decode_rate(stamps))
        torch.cuda.init()
        with tempfile.TemporaryDirectory() as td:
            path = os.path.join(td, "trace.json")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                be.pos = C - GEN
                _, stamps = _per_op_from_state(be, tok, GEN)
            traced_rate = _decode_rate(stamps)
            prof.export_chrome_trace(path)
            res = analyse(kernel_events(path), be.config.num_layers)
    finally:
        be.close()
    res.update({"context": C, "tok_s_untraced": statistics.median(rates), "tok_s_runs": rates,
                "tok_s_traced": traced_rate})
    log(f"context {C}: {res['tok_s_untraced']:.1f} tok/s untraced ({1e6 / res['tok_s_untraced']:.1f} us/token), "
        f"traced {traced_rate:.1f}; traced step {res['step_us_median']:.1f} us over {res['steps']} steps")
    log(f"  {'role':12s} {'n/step':>6s} {'dur':>7s} {'inc':>7s} {'start-prev_end':>14s} {'inc/step':>9s}")
    for r, d in sorted(res["roles"].items(), key=lambda kv: -kv[1]["inc_total_per_step_us"]):
        log(f"  {r:12s} {d['count_per_step']:6.0f} {d['dur_us']:7.2f} {d['inc_us']:7.2f} "
            f"{d['start_minus_prev_end_us']:14.2f} {d['inc_total_per_step_us']:9.1f}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, action="append")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        import torch.profiler  # noqa: F401  (CUPTI kernel tracing)
    except ImportError:
        print("error: scripts/profile_perop.py needs PyTorch for its profiler (the device image has it; "
              "pip install torch)", file=sys.stderr)
        return 2
    from hipengine.gpu.runtime import get_runtime
    from hipengine.presets import preset_model

    rt = get_runtime(0)
    log = lambda m: print(m, flush=True)  # noqa: E731
    env = {k: v for k, v in os.environ.items() if k.startswith("HIPENGINE_") and k != "HIPENGINE_CACHE"}
    out = {"benchmark": "profile_perop", "shape": args.shape, "gpu": rt.name, "arch": rt.arch,
           "commit": os.environ.get("HIPENGINE_COMMIT") or git_commit(), "date": utc_now(), "env": env,
           "gen_tokens": GEN, "results": []}
    for C in args.context or [1024]:
        out["results"].append(profile_context(preset_model(args.shape, 0), C, log))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
