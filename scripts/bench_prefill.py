"""Prefill (time to first token) on one GPU: the per-op prefill of the Llama-3.2-1B shape (random weights)
for prompts of several lengths, on the matrix-core path (chunks of GpuBackend.prefill_m tokens,
Ops.prefill_matmul -> matmul_mma_m*) and on the path before it (8-token chunks, matmul_small_m), alternated
in one process.

Per prompt length and path: wall time of GpuBackend.prefill (enqueue + the final logits download: what
TTFT pays before sampling) and the device time between events recorded around it, medians of --runs after a
warm-up; the layers' projection FLOPs (2 · layer weights · tokens) over the device time; and the
last row's logits against the 8-token FMA path's (max |diff| / max |logit|, same arg-max).
With --breakdown: one chunk at position 960 of a 1K prompt, op by op on the matrix-core path (each
projection of layer 0 alone, launched 16 times back to back in a graph = one chunk's worth; norms, RoPE and
attention the same): device µs per chunk, GB/s of weights and TFLOP/s per projection; and the whole chunk
(GpuBackend._prefill_chunk: its captured graph).
--paths CHUNK[:VAR=VALUE...],...: the matrix-core paths to compare — chunk tokens (at most ops.PREFILL_M) and
the A/B knobs of ops.MMA_KNOBS to set (HIPENGINE_MMA_WARPS=4, HIPENGINE_PREFILL_SPLIT=0; unset: the default
per projection); each is a path of its own in the TTFT rows and gets its own breakdown (a chunk at position
960).
Usage: PYTHONPATH=. python3 scripts/bench_prefill.py [--lengths 64,1024,4096] [--runs 5] [--breakdown]
       [--paths 128,64,128:HIPENGINE_MMA_WARPS=4] [--no-fma] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import numpy as np

from hipengine.bench import git_commit
from hipengine.gpu import ops as O


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,512,1024,4096")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--paths", default=str(O.PREFILL_M), help="CHUNK[:VAR=VALUE...],... matrix-core paths")
    ap.add_argument("--no-fma", action="store_true",
                    help="skip the 8-token FMA path (long prompts); logits are then compared with the last path")
    ap.add_argument("--json")
    a = ap.parse_args()
    specs = []
    for p in a.paths.split(","):
        chunk, *sets = p.split(":")
        env = dict(kv.split("=", 1) for kv in sets)
        if not chunk.isdigit() or not 16 <= int(chunk) <= O.PREFILL_M or any(k not in KNOBS for k in env):
            ap.error(f"--paths {p!r}: CHUNK (16 .. {O.PREFILL_M}) then VAR=VALUE of {', '.join(KNOBS[1:])}")
        specs.append((int(chunk), env))
    lengths = [int(x) for x in a.lengths.split(",")]

    from hipengine.gpu.executor import GpuBackend
    from hipengine.presets import preset_model

    model = preset_model("llama-3.2-1b", 0)
    cfg = model.config
    be = GpuBackend(model, max_context=max(lengths) + 64, monokernel=False)
    rt = be.rt
    # (name, chunk tokens, environment): the matrix-core paths, then the FMA path (the logits' reference)
    mma_paths = [("mma-c" + ":".join([str(c)] + [f"{k.removeprefix('HIPENGINE_').lower()}={v}"
                                                 for k, v in env.items()]), c, {"HIPENGINE_PREFILL_MMA": "1", **env})
                 for c, env in specs] if O.mma_supported(rt.arch) else []
    fma = [("small_m", O.MAX_M, {"HIPENGINE_PREFILL_MMA": "0"})]
    paths = mma_paths + ([] if a.no_fma and mma_paths else fma)
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
                    set_env(env)
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
        breakdown = None
        if a.breakdown and O.mma_supported(rt.arch):
            breakdown = {}
            for name, chunk, env in mma_paths:
                set_env(env)
                print(f"breakdown, {name}:", flush=True)
                breakdown[name] = chunk_breakdown(be, 960, chunk)
    finally:
        set_env({})
        be.close()
    out = {"bench": "prefill", "shape": "llama-3.2-1b", "weights": "random (hipengine.presets)",
           "gpu": rt.name, "arch": rt.arch, "commit": git_commit(),
           "date": datetime.now(timezone.utc).isoformat(), "runs": a.runs,
           "method": "per-op GpuBackend.prefill of a random prompt; medians of runs after a warm-up, paths "
                     "alternated twice (both medians listed); wall = enqueue + logits download, device = events "
                     "around it", "rows": rows, "breakdown": breakdown}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


KNOBS = O.MMA_KNOBS  # the prefill's A/B knobs (ops.py; the executor keys its chunk graphs by them)


def set_env(env: dict) -> None:
    """The A/B knobs of one path: those in env set, the others unset."""
    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update({k: str(v) for k, v in env.items()})


def chunk_breakdown(be, pos: int, M: int = 64, reps: int = 5) -> dict:
    """Device µs of one M-token chunk at `pos`, op by op (layer 0's weights launched once per layer)."""
    cfg, ops, rt, s = be.config, be.ops, be.rt, be.stream
    d, qd, kvd, hd, F = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.intermediate_size
    L, nl = be.layers[0], cfg.num_layers
    be.prefill_m = M
    be.reset()
    be.prefill(np.arange(pos) % cfg.vocab_size)  # fills the cache up to pos
    be.rt.copy_htod(be.tokens, (np.arange(M) % cfg.vocab_size).astype(np.int32))
    be._set_int(be.pos_buf, pos)
    mm = dict(part=be.mm_part, count=be.mm_count, stream=s)
    f16 = L["f16"]

    def timed(fn) -> float:  # nl launches captured in a graph (no host launch cost), replayed
        fn()
        rt.begin_capture(s)
        try:
            for _ in range(nl):
                fn()
        finally:
            g = rt.end_capture(s)
        out = []
        for _ in range(reps):
            e0, e1 = rt.event(), rt.event()
            e0.record(s)
            g.launch(s)
            e1.record(s)
            e1.synchronize()
            out.append(e0.elapsed_ms(e1) * 1e3)
        g.destroy()
        return statistics.median(out)

    projections = {
        "qkv": (lambda: ops.prefill_matmul(L["wqkv"], be.xn, be.qkv, M, qd + 2 * kvd, d, mode=0, bias=L["bqkv"],
                                           f16=f16, **mm), (qd + 2 * kvd) * d),
        "o": (lambda: ops.prefill_matmul(L["wo"], be.att, be.x, M, d, qd, mode=1, f16=f16, **mm), d * qd),
        "gate_up": (lambda: ops.prefill_matmul(L["w_gate"], be.xn, be.h, M, F, d, mode=2, W2=L["w_up"], f16=f16,
                                               **mm), 2 * F * d),
        "down": (lambda: ops.prefill_matmul(L["w_down"], be.h, be.x, M, d, F, mode=1, f16=f16, **mm), d * F),
    }
    out = {"position": pos, "tokens": M, "us_per_chunk": {}, "weight_gbps": {}, "tflops": {}, "builds": {}}
    rows = {"qkv": (qd + 2 * kvd, 0, d, M), "o": (d, 1, qd, M), "gate_up": (F, 2, d, M), "down": (d, 1, F, M)}
    for k, (fn, n) in projections.items():
        out["builds"][k] = O.mma_build(rt, *rows[k])._asdict()
        us = timed(fn)
        out["us_per_chunk"][k] = us
        out["weight_gbps"][k] = 2 * n * nl / us / 1e3
        out["tflops"][k] = 2 * n * M * nl / us / 1e6
    out["us_per_chunk"]["rmsnorm x2"] = timed(lambda: [ops.rmsnorm(be.x, L["attn_norm"], cfg.rms_norm_eps, d, be.xn,
                                                                   rows=M, stream=s) for _ in range(2)])
    out["us_per_chunk"]["qk_norm_rope"] = timed(lambda: ops.qk_norm_rope(
        be.qkv, be.q, be._kc(0), be._vc(0), be.cos, be.sin, be.pos_buf, T=M, nh=cfg.num_heads, nkv=cfg.num_kv_heads,
        hd=hd, max_ctx=be.max_context, q_norm=None, k_norm=None, eps=cfg.rms_norm_eps, stream=s))
    out["us_per_chunk"]["attention"] = timed(lambda: ops.attention(
        be.q, be._kc(0), be._vc(0), be.partial, be.att, be.pos_buf, T=M, nh=cfg.num_heads, nkv=cfg.num_kv_heads,
        hd=hd, max_ctx=be.max_context, nsplit=be.nsplit, chunk=be.chunk, stream=s))
    e0, e1 = rt.event(), rt.event()
    chunks = []
    for _ in range(reps):
        be.pos = pos
        e0.record(s)
        be._prefill_chunk(np.arange(M) % cfg.vocab_size, logits="")
        e1.record(s)
        e1.synchronize()
        chunks.append(e0.elapsed_ms(e1) * 1e3)
    out["us_per_chunk"]["whole chunk (layers)"] = statistics.median(chunks)
    for k, v in out["us_per_chunk"].items():
        extra = (f"  {out['weight_gbps'][k]:7.0f} GB/s of weights, {out['tflops'][k]:6.1f} TFLOP/s"
                 if k in out["weight_gbps"] else "")
        print(f"  chunk at {pos}: {k:22s} {v:9.1f} us{extra}", flush=True)
    return out


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
