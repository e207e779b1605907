"""Prefill (time to first token) on one GPU: the per-op prefill of the Llama-3.2-1B shape (random weights)
for prompts of several lengths, on the matrix-core path (chunks of GpuBackend.prefill_m tokens,
Ops.prefill_matmul -> matmul_mma_m*) and on the path before it (8-token chunks, matmul_small_m), alternated
in one process.

Per prompt length and path: wall time of GpuBackend.prefill (enqueue + the final logits download: what
TTFT pays before sampling) and the device time between events recorded around it, medians of --runs after a
warm-up; the layers' projection FLOPs (2 · layer weights · tokens) over the device time; and the
last row's logits against the reference path (max |diff| / max |logit|, same arg-max).
Usage: PYTHONPATH=. python3 scripts/bench_prefill.py [--lengths 64,1024,4096] [--runs 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np

from hipengine.bench import git_commit
from hipengine.gpu import ops as O


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,512,1024,4096")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]

    from hipengine.gpu.executor import GpuBackend
    from hipengine.presets import preset_model

    model = preset_model("llama-3.2-1b", 0)
    cfg = model.config
    be = GpuBackend(model, max_context=max(lengths) + 64, monokernel=False)
    rt = be.rt
    # (name, chunk tokens, HIPENGINE_PREFILL_MMA)
    paths = [("mma", GpuBackend.prefill_m, "1"), ("small_m", O.MAX_M, "0")]
    if not O.mma_supported(rt.arch):
        paths = paths[1:]
    layer_params = cfg.num_layers * (cfg.hidden_size * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden_size
                                     + 3 * cfg.hidden_size * cfg.intermediate_size)
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n in lengths:
            prompt = rng.integers(0, cfg.vocab_size, n)
            res = {}
            for rep in range(2):  # the paths alternated twice
                for name, chunk, env in paths:
                    os.environ["HIPENGINE_PREFILL_MMA"] = env
                    be.prefill_m = chunk
                    walls, devs, logits = [], [], None
                    for r in range(a.runs + 1):
                        be.reset()
                        e0, e1 = rt.event(), rt.event()
                        rt.synchronize()
                        t0 = time.perf_counter()
                        e0.record(be.stream)
                        lg = be.prefill(prompt)
                        e1.record(be.stream)
                        e1.synchronize()
                        wall = time.perf_counter() - t0
                        if r:  # run 0 warms up (compiles)
                            walls.append(wall)
                            devs.append(e0.elapsed_ms(e1) / 1e3)
                        logits = lg
                    d = res.setdefault(name, {"wall_ms": [], "device_ms": [], "chunk": chunk})
                    d["wall_ms"].append(statistics.median(walls) * 1e3)
                    d["device_ms"].append(statistics.median(devs) * 1e3)
                    d["logits"] = logits
            flops = 2.0 * layer_params * n  # the layers' projections (the LM head runs on the last chunk only)
            ref = res[paths[-1][0]]["logits"]
            for name, d in res.items():
                lg = d.pop("logits")
                row = {"tokens": n, "path": name, "chunk": d["chunk"], "wall_ms": d["wall_ms"],
                       "device_ms": d["device_ms"], "wall_ms_best": min(d["wall_ms"]),
                       "device_ms_best": min(d["device_ms"]),
                       "tflops_device": flops / (min(d["device_ms"]) / 1e3) / 1e12,
                       "logits_rel_diff_vs_" + paths[-1][0]: float(np.abs(lg - ref).max() / np.abs(ref).max()),
                       "argmax_same": int(np.argmax(lg)) == int(np.argmax(ref))}
                rows.append(row)
                print(f"{n:6d} tokens {name:8s} chunk {d['chunk']:3d}: wall {row['wall_ms_best']:8.2f} ms, device "
                      f"{row['device_ms_best']:8.2f} ms ({row['tflops_device']:6.1f} TFLOP/s of layer projections); "
                      f"logits vs {paths[-1][0]}: {row['logits_rel_diff_vs_' + paths[-1][0]]:.2e}, "
                      f"argmax same {row['argmax_same']}", flush=True)
    finally:
        os.environ.pop("HIPENGINE_PREFILL_MMA", None)
        be.close()
    out = {"bench": "prefill", "shape": "llama-3.2-1b", "weights": "random (hipengine.presets)",
           "gpu": rt.name, "arch": rt.arch, "commit": git_commit(),
           "date": datetime.now(timezone.utc).isoformat(), "runs": a.runs,
           "method": "per-op GpuBackend.prefill of a random prompt; medians of runs after a warm-up, paths "
                     "alternated twice (both medians listed); wall = enqueue + logits download, device = events "
                     "around it", "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
