"""``hipengine bench decode (--shape NAME | --model PATH) [--context N ...] [--tp N] [--no-monokernel]
[--json OUT] [--plot OUT.png]``: TTFT and decode tok/s against the roofline measured in the same run.

Method (docs/perf-log.md records what each figure meant at the time):
  * roofline: HBM read bandwidth measured now (hipengine.bench.probe) / bytes one decode step must read
    (every weight once + the KV cache at that context: ModelConfig.decode_bytes_per_token).
  * context C: the decode steps run with the KV cache filled to C - GEN positions and end at C. At the
    smallest context the prompt is real (C - GEN random token ids prefilled through the per-op path) and
    TTFT is that request's time to its first token. Larger contexts fill the KV cache synthetically (a
    constant bf16 pattern): prefilling 32K tokens costs minutes, and decode time does not depend on values.
  * decode tok/s = (GEN - 1) / (time of the last token - time of the first), host clock at the moment each
    token reaches the host (the monokernel's mapped ring; the per-op path's per-token read-back): what a
    streaming client sees. Median of RUNS runs; every run is a fresh request.
  * both paths run on the same uploaded weights: the monokernel (default) and the per-op path
    (GpuBackend.generate_ids, CUDA/HIP graph per step), which is the baseline; --no-monokernel runs only it.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..backend import SamplingParams
from ..errors import HipEngineError, RequestError, UnsupportedError
from . import git_commit, utc_now

RUNS = 5
GEN = 128  # tokens decoded per run
DEFAULT_CONTEXTS = (1024, 8192, 32768)
KV_FILL_BYTE = 0x3C  # bf16 0x3c3c ~ 0.0115: finite, harmless attention inputs


def _load(args):
    if bool(args.shape) == bool(args.model):
        raise UnsupportedError("bench decode needs exactly one of --shape NAME or --model PATH")
    if args.shape:
        from ..presets import preset_model

        return preset_model(args.shape, 0), args.shape
    from ..loader import load_model

    return load_model(args.model, progress=False), Path(args.model).name


def _timed(gen) -> tuple[list[int], list[float]]:
    toks, stamps = [], []
    for t in gen:
        stamps.append(time.perf_counter())
        toks.append(t)
    return toks, stamps


def _decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")


def timed_runs(once, runs: int, gen: int, what: str) -> tuple[list[int], list[float], list[float]]:
    """Run ``once() -> (tokens, arrival stamps)`` runs + 1 times; run 0 warms up (compiles, captures graphs).
    Every timed run must reproduce run 0's greedy tokens. Returns (tokens, TTFTs s, decode tok/s rates)."""
    first, ttfts, rates = None, [], []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        toks, stamps = once()
        if len(toks) != gen:
            raise HipEngineError(f"{what}: produced {len(toks)} tokens, expected {gen}")
        if r == 0:
            first = toks
            continue
        if toks != first:
            raise HipEngineError(f"{what}: greedy output changed between runs")
        ttfts.append(stamps[0] - t0)
        rates.append(_decode_rate(stamps))
    return first, ttfts, rates


def _per_op_from_state(be, token: int, n: int) -> tuple[list[int], list[float]]:
    """The per-op path's decode loop (GpuBackend.generate_ids after its prefill) from a filled KV cache:
    graph step, device sampling, tokens read from mapped memory while the next steps run."""
    from ..gpu.executor import GpuBackend

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return _timed(GpuBackend._generate_per_op(be, token, 0, params))


def _fill_kv(be) -> None:
    per = be.kv_layer_bytes * be.config.num_layers
    be.rt.memset(be.k_cache, KV_FILL_BYTE, per)
    be.rt.memset(be.v_cache, KV_FILL_BYTE, per)


def profile_table(prof: dict, n_layers: int) -> str:
    """The monokernel's stage profile (read_profile) as text: µs per decode step and per layer."""
    out = [f"  stage profile, block 0, {prof['steps']} steps, {prof['us_per_step']:.1f} us/step "
           f"(SM clock {prof['ghz']:.2f} GHz): stage, work us, work+wait us per step, per layer"]
    for k, tot in prof["total_us"].items():
        per = n_layers if k not in ("select", "lm_head") else 1  # attn_split: work only (part of attention)
        out.append(f"    {k:10s} {prof['work_us'][k]:8.1f} {tot:8.1f} {tot / per:8.2f}")
    blocks = prof.get("blocks", {})
    if blocks.get("work_us"):
        out.append(f"  every block, us per step from the stage start, median (max) over {len(blocks['sm'])} blocks: "
                   "work mark, block's slowest warp, barrier arrival issued, exit; slowest SM by work")
        for k, col in blocks["work_us"].items():
            cells = []
            for c in ("work_us", "sync_us", "arrive_us", "total_us"):
                a = np.asarray(blocks.get(c, {}).get(k, [0.0]))
                cells.append(f"{np.median(a):7.1f} ({a.max():7.1f})")
            a = np.asarray(col)
            out.append(f"    {k:10s} " + " ".join(cells) + f"  SM {blocks['sm'][int(a.argmax())]}")
        if blocks.get("total_us", {}).get("qkv"):  # (a step's layers ran: always, for a decode bench)
            out.append(role_table(layer_marks(blocks, block_roles(blocks), n_layers)))
    return "\n".join(out)


# ---- the per-block rows read as a layer's critical path (also scripts/profile_table.py) -------------------------
SPLIT_MARKS = [("attn_q_first", "q first"), ("attn_q_ready", "q ready"), ("attn_loop", "scored"),
               ("attn_merge", "merged"), ("attn_split", "split done")]
LAYER_MARKS = [("qkv", "QKV done"), ("attn_left", "attn left"), ("o_work", "O work"), ("window", "O exit"),
               ("gate_up", "gate/up"), ("down", "down"), ("layer", "layer")]


def block_roles(blocks: dict) -> list[tuple[int, int, str]]:
    """Contiguous block ranges of one role in the layer: whether the block ran an attention split, and whether its
    QKV took the longer or the shorter of the grid's QKV times (more units per warp, or fewer)."""
    qkv = np.asarray(blocks["total_us"]["qkv"], float)
    split = np.asarray(blocks["work_us"].get("attn_split", np.zeros_like(qkv)), float) > 0
    lo, hi = qkv.min(), qkv.max()
    long_ = qkv > (lo + hi) / 2 if hi - lo > 0.2 * hi else np.zeros_like(split)
    sig = [(bool(a), bool(b)) for a, b in zip(long_, split)]
    out, start = [], 0
    for i in range(1, len(sig) + 1):
        if i == len(sig) or sig[i] != sig[start]:
            lg, sp = sig[start]
            out.append((start, i - 1, ("QKV long" if lg else "QKV short") + (" + split" if sp else "")))
            start = i
    return out


def layer_marks(blocks: dict, groups: list[tuple[int, int, str]], n_layers: int) -> list[dict]:
    """Per block range (lo, hi, role): medians over its blocks, µs per layer from the layer's start — QKV done, the
    attention stage left (the grouped O-proj's group counter seen), the O-proj's work done, the O barrier's exit
    (the QKV → attention → O-proj window), gate/up, down and the layer — and the attention split's marks from its
    start. Each block row is cumulative within its stage (work <= sync <= arrive <= total)."""
    w, t = blocks["work_us"], blocks["total_us"]

    def med(col: dict, key: str, lo: int, hi: int) -> float:
        v = col.get(key)
        return float(np.median(np.asarray(v[lo:hi + 1], float))) / n_layers if v else 0.0

    out = []
    for lo, hi, role in groups:
        # (the attention stage, then fine = 2 builds' combine stage behind its own barrier; absent elsewhere)
        qkv, attn = med(t, "qkv", lo, hi), med(t, "attention", lo, hi) + med(t, "combine", lo, hi)
        row = {"blocks": f"{lo}-{hi}", "role": role, "qkv": qkv, "attn_left": qkv + attn,
               "o_work": qkv + attn + med(w, "o_proj", lo, hi), "window": qkv + attn + med(t, "o_proj", lo, hi),
               "gate_up": med(t, "gate_up", lo, hi), "down": med(t, "down", lo, hi)}
        row["layer"] = row["window"] + row["gate_up"] + row["down"]
        row["split"] = {k: med(w, k, lo, hi) for k, _ in SPLIT_MARKS}
        out.append(row)
    return out


def role_table(rows: list[dict]) -> str:
    """layer_marks' rows as text."""
    out = ["  the layer by block role, µs per layer from the layer's start (medians over each block range):",
           f"    {'blocks':9s} {'role':18s}" + "".join(f"{h:>10s}" for _, h in LAYER_MARKS)]
    for r in rows:
        out.append(f"    {r['blocks']:9s} {r['role']:18s}" + "".join(f"{r[k]:10.2f}" for k, _ in LAYER_MARKS))
    splits = [r for r in rows if r["split"]["attn_split"] > 0]
    if splits:
        out.append("  the attention split, µs per layer from its start:")
        out.append(f"    {'blocks':9s} {'':18s}" + "".join(f"{h:>11s}" for _, h in SPLIT_MARKS))
        for r in splits:
            out.append(f"    {r['blocks']:9s} {r['role']:18s}" + "".join(f"{r['split'][k]:11.2f}" for k, _ in SPLIT_MARKS))
    return "\n".join(out)


def measure(be, contexts, paths, runs: int = RUNS, gen: int = GEN, log=print,
            max_context: int | None = None) -> list[dict]:
    """Decode tok/s per context and path. max_context: size the KV cache (and the attention plan) for that
    many tokens instead of for each context (a serving configuration: the Engine's default is 4096)."""
    from ..gpu import ops as O
    from ..gpu.executor import GpuBackend
    from ..gpu.monokernel import read_profile, reset_profile

    cfg = be.config
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    rows = []
    rng = np.random.default_rng(0)
    smallest = min(contexts)
    for C in sorted(contexts):
        be.resize_context(max(C, max_context or C))
        real = C == smallest
        prompt = rng.integers(0, cfg.vocab_size, C - gen)
        if not real:
            _fill_kv(be)
        for path in paths:
            def once():
                if real:
                    g = be.generate_ids(prompt, params) if path == "monokernel" else \
                        GpuBackend.generate_ids(be, prompt, params, lambda: False)
                    return _timed(g)
                be.pos = C - gen
                if path == "monokernel":
                    return _timed(be.generate_from_state(int(prompt[-1]), 0, params))
                return _per_op_from_state(be, int(prompt[-1]), gen)

            profiled = path == "monokernel" and getattr(be, "prof_buf", None) is not None
            if profiled:
                reset_profile(be)
            first, ttfts, rates = timed_runs(once, runs, gen, f"{path} at context {C}")
            rows.append({"context": C, "max_context": be.max_context, "path": path,
                         # the attention build this cache size takes (both paths; ops.attn_warp_max) and the
                         # monokernel's long-context build (q_regs_build): the JSON's "monokernel" block is
                         # the last context's
                         "attn_warp_max": O.attn_warp_max(be.max_context),
                         "attn_mma": O.attn_mma(be.rt.arch, cfg.head_dim),
                         "q_regs": bool(getattr(be, "q_regs", False)),
                         # the attention split plan (nsplit, chunk) this path took: the monokernel's one-round
                         # plan and the per-op one differ at some caches (monokernel.mk_plan), and then so may
                         # the tokens (other split sums, other rounding)
                         "split_plan": list(_split_plan(be, path)),
                         # L2 bytes set aside for the KV cache's persisting lines (HIPENGINE_L2_PERSIST_KV; 0: none)
                         "l2_kv_bytes": int(getattr(be, "l2_kv_bytes", 0)),
                         "prompt": "real" if real else "synthetic-kv",
                         "ttft_ms": statistics.median(ttfts) * 1e3 if real else None,
                         "tok_s": statistics.median(rates), "tok_s_runs": rates, "tokens": first})
            log(f"  context {C:6d} {path:10s} {rows[-1]['tok_s']:8.1f} tok/s")
            if profiled:
                prof = rows[-1]["stage_profile"] = read_profile(be)
                log(profile_table(prof, cfg.num_layers))
        same = [r for r in rows if r["context"] == C]
        if len(same) == 2:  # recorded, not raised: a divergence is a finding to report next to the figures
            for r in same:
                r["identical_to_other_path"] = same[0]["tokens"] == same[1]["tokens"]
    return rows


def _split_plan(be, path: str) -> tuple[int, int]:
    if path == "monokernel" and hasattr(be, "mk_nsplit"):
        return be.mk_nsplit, be.mk_chunk
    return be.nsplit, be.chunk


def run(args) -> int:
    try:
        return _run(args)
    except HipEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    from ..gpu.monokernel import MonokernelBackend, grid_info
    from ..gpu.runtime import get_runtime
    from .probe import measure_hbm_read_bandwidth

    contexts = sorted(set(args.context or DEFAULT_CONTEXTS))
    mc = getattr(args, "max_context", None)
    if mc is not None and mc < contexts[-1]:
        raise RequestError(f"--max-context {mc} is smaller than --context {contexts[-1]}: "
                           "the KV cache must hold the context")
    if getattr(args, "profile", False):  # the stage-profiling build of the monokernel (a few % slower)
        os.environ["HIPENGINE_MK_PROFILE"] = "1"
    if getattr(args, "tp", 1) != 1:  # tensor parallelism measures itself (same method)
        from ..gpu.tp_executor import bench_decode

        return bench_decode(args)
    loaded, name = _load(args)
    rt = get_runtime(0)
    print(f"measuring HBM read bandwidth on {rt.name} ...", file=sys.stderr)
    hbm = measure_hbm_read_bandwidth(rt)
    t0 = time.perf_counter()
    be = MonokernelBackend(loaded, max_context=min(contexts))
    print(f"loaded {name} in {time.perf_counter() - t0:.1f} s; grid {grid_info(be)}", file=sys.stderr)
    paths = ["per-op"] if args.no_monokernel else ["monokernel", "per-op"]
    try:
        rows = measure(be, contexts, paths, log=lambda m: print(m, file=sys.stderr), max_context=mc)
        info = grid_info(be)
    finally:
        be.close()
    cfg = loaded.config
    for r in rows:
        b = cfg.decode_bytes_per_token(2.0, context=r["context"])
        r["bytes_per_token"] = b
        r["roofline_tok_s"] = hbm / b
        # the screened LM head (monokernel, greedy) reads its int8 copy instead of the bf16 rows: achieved
        # bandwidth counts the bytes actually read (the few rows recomputed exactly are left out: ~4 KB each)
        read = b
        if r["path"] == "monokernel" and info.get("head_screen"):
            from ..gpu.head_screen import table_bytes

            read = b - 2 * cfg.vocab_size * cfg.hidden_size + table_bytes(cfg.vocab_size, cfg.hidden_size)
            r["lm_head_screen"] = True
        if r["path"] == "monokernel" and info.get("mlp_packed"):  # gate, up and down at 13 bits per weight
            from ..gpu.packed import row_bytes

            mlp = 3 * cfg.num_layers * cfg.hidden_size * cfg.intermediate_size
            read = read - 2 * mlp + mlp // cfg.hidden_size * row_bytes(cfg.hidden_size)
            r["mlp_packed"] = True
        r["bytes_read_per_token"] = read
        r["achieved_gbps"] = r["tok_s"] * read / 1e9
        r["pct_hbm"] = 100.0 * r["tok_s"] * read / hbm
        r.pop("tokens")
    result = {"benchmark": "decode", "model": name, "gpu": rt.name, "arch": rt.arch, "sms": rt.num_sms,
              "commit": git_commit(), "date": utc_now(), "hbm_read_gbps": hbm / 1e9, "runs": RUNS,
              "gen_tokens": GEN, "monokernel": info, "results": rows}
    if args.plot:
        plot(result, args.plot)
    emit(result, args.json, f"{name} on {rt.name}, HBM read {hbm / 1e9:.0f} GB/s (measured now)")
    return 0


def emit(result: dict, json_out: str | None, title: str, path_width: int = 10) -> None:
    """Write the JSON (when asked) and print the short table: context, path, TTFT, tok/s, roofline, % HBM."""
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=1))
    print(title)
    print(f"{'context':>8} {'path':>{path_width}} {'TTFT ms':>8} {'tok/s':>8} {'roofline':>9} {'% HBM':>6}")
    for r in result["results"]:
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        print(f"{r['context']:>8} {r['path']:>{path_width}} {ttft:>8} {r['tok_s']:>8.1f} "
              f"{r['roofline_tok_s']:>9.1f} {r['pct_hbm']:>5.1f}%")


def plot(result: dict, out: str) -> None:
    """tok/s against context per path, with the roofline (measured HBM read / bytes per token) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ctx = sorted({r["context"] for r in rows})
    roof = {r["context"]: r["roofline_tok_s"] for r in rows}
    ax.plot(ctx, [roof[c] for c in ctx], "k--", label=f"roofline ({result['hbm_read_gbps']:.0f} GB/s HBM read)")
    for path in dict.fromkeys(r["path"] for r in rows):  # "monokernel", "per-op" (tp: "monokernel-tp2", ...)
        style = "o-" if path.startswith("monokernel") else "s-"
        pts = sorted((r["context"], r["tok_s"]) for r in rows if r["path"] == path)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=path)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [f"{c // 1024}K" for c in ctx])
    ax.set_xlabel("context (tokens in the KV cache)")
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title(f"{result['model']} bf16 on {result['gpu']} ({result['commit'][:8]})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
