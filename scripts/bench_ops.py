"""Per-op benchmarks on one GPU: matvecs of the Llama-3.2-1B shapes, split attention at 1K/8K/32K context,
and the per-op engine's decode tok/s, each as GB/s and as a fraction of the HBM read bandwidth measured in
the same run.

Method: validate once (the op tests do the full job; here a spot check), warm up, capture `reps` launches into
a graph (launch overhead from Python would otherwise dominate a 2 µs kernel), time graph replays with device
events, report the median. Weight / KV buffers rotate over copies totalling > 240 MB so the 60 MB L2 never
holds them. Each figure is taken as the engine launches (programmatic dependent launch where the runtime has
it: consecutive kernels overlap, Ops.pdl) and with plain stream order (`*_no_pdl`). "floor": the same chain of
dependent launches with no weights (ops/probe.hip probe_chain) at the matvecs' grids — the boundary a launch
pays however few bytes it reads.
Usage: PYTHONPATH=. python3 scripts/bench_ops.py [--json out.json] [--skip-decode]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping

import numpy as np

from hipengine.bench import git_commit
from hipengine.gpu import ops as O
from hipengine.gpu.runtime import get_runtime

MATVEC_THREADS = O.MATVEC_THREADS

ROTATE_BYTES = 240 * 2**20


def timed(rt, stream, launch, reps=20, trials=7) -> float:
    """Median seconds per launch: `reps` launches captured in one graph, replayed `trials` times."""
    for _ in range(3):
        launch(0)
    stream.synchronize()
    rt.begin_capture(stream)
    try:
        for i in range(reps):
            launch(i)
    finally:
        g = rt.end_capture(stream)
    g.launch(stream)
    stream.synchronize()
    e0, e1, times = rt.event(), rt.event(), []
    for _ in range(trials):
        e0.record(stream)
        g.launch(stream)
        e1.record(stream)
        e1.synchronize()
        times.append(e0.elapsed_ms(e1) / 1e3 / reps)
    g.destroy()
    return float(np.median(times))


def hbm_read_bw(rt, stream) -> tuple[float, str]:
    try:
        from hipengine.bench.probe import measure_hbm_read_bandwidth

        return float(measure_hbm_read_bandwidth(rt)), "hipengine.bench.probe"
    except Exception:
        pass
    n_vec = (2 * 2**30) // 16
    src = rt.malloc(n_vec * 16)
    rt.memset(src, 1, n_vec * 16)
    out = rt.malloc(4)
    fn = rt.compile("ops/probe.hip").function("probe_read")
    from ctypes import c_uint64, c_void_p

    t = timed(rt, stream, lambda i: rt.launch(fn, rt.num_sms * 4, 256, [c_void_p(src.ptr), c_uint64(n_vec),
                                                                        c_void_p(out.ptr)], stream=stream),
              reps=5, trials=5)
    src.free()
    return n_vec * 16 / t, "probe_read (2 GiB)"


def timed_pdl(rt, ops, stream, launch, **kw) -> tuple[float, float]:
    """(seconds per launch as the engine launches it — programmatic dependent launch where the runtime has it,
    Ops.pdl —, seconds with plain stream order): consecutive launches of a graph overlap only with the first."""
    t = timed(rt, stream, launch, **kw)
    if not ops.pdl:
        return t, t
    ops.pdl = False
    try:
        return t, timed(rt, stream, launch, **kw)
    finally:
        ops.pdl = True


def copies_for(nbytes: int) -> int:
    return max(1, math.ceil(ROTATE_BYTES / nbytes))


def bench_matvecs(rt, ops, stream, hbm) -> list[dict]:
    rng = np.random.default_rng(0)
    shapes = [("qkv 2048->3072 (fused norm+RoPE+append)", "qkv", 3072, 2048),
              ("matvec 2048->3072", "mv", 3072, 2048),
              ("o-proj 2048->2048 (+residual)", "mv_res", 2048, 2048),
              ("gate/up 2048->2x8192 (SiLU*mul)", "gate_up", 8192, 2048),
              ("down 8192->2048 (+residual)", "mv_res", 2048, 8192),
              ("down 8192->2048 (+residual), two-row units", "mv_res2", 2048, 8192),
              ("lm head 2048->128256", "mv", 128256, 2048)]
    x = rt.upload(rng.standard_normal(8192).astype(np.float32))
    g = rt.upload(np.ones(8192, np.float32))
    y = rt.malloc(128256 * 4)
    kc = rt.malloc(8 * 256 * 64 * 2)
    vc = rt.malloc(8 * 256 * 64 * 2)
    cos, sin = O.rope_tables(1.0 / (500000.0 ** (np.arange(0, 64, 2) / 64)), 256)
    cos_b, sin_b, pos = rt.upload(cos), rt.upload(sin), rt.upload(np.array([7], np.int32))
    rows_out = []
    for name, kind, rows, inn in shapes:
        nmat = 2 if kind == "gate_up" else 1
        wbytes = rows * inn * 2 * nmat
        n = copies_for(wbytes)
        bufs = [rt.malloc(rows * inn * 2 * nmat) for _ in range(n)]
        for b in bufs:
            rt.memset(b, 0x3C, b.nbytes)  # bf16 0x3C3C ≈ 0.0115: finite values
        # spot check against numpy on the first copy (all weights equal -> y = w * sum(x))
        def launch(i, bufs=bufs, kind=kind, rows=rows, inn=inn):
            w = bufs[i % len(bufs)]
            if kind == "qkv":
                ops.matvec_qkv(w, x, y, kc, vc, cos_b, sin_b, pos, max_ctx=256, q_dim=2048, kv_dim=512, hd=64,
                               inn=inn, gamma=g, eps=1e-5, rope=True, stream=stream)
            elif kind == "gate_up":
                ops.matvec_gate_up(w, w.ptr + rows * inn * 2, x, y, rows, inn, gamma=g, eps=1e-5, stream=stream)
            elif kind in ("mv_res", "mv_res2"):  # mv_res2: the two-row kernel where Ops picks matvec_rows1
                ops.matvec(w, x, y, rows, inn, residual=y, stream=stream, rows1=False if kind == "mv_res2" else None)
            else:
                ops.matvec(w, x, y, rows, inn, stream=stream)

        if kind == "mv":
            launch(0)
            stream.synchronize()
            got = rt.download(y, rows, np.float32)
            wv = float(O.from_bf16(np.array([0x3C3C], np.uint16))[0])
            xs = rt.download(x, inn, np.float32).astype(np.float64).sum()
            assert np.allclose(got, wv * xs, rtol=1e-3, atol=1e-3), f"{name}: wrong result"
        t, t_plain = timed_pdl(rt, ops, stream, launch)
        moved = wbytes + inn * 4 + rows * 4
        rows_out.append(dict(op=name, rows=rows, inn=inn, us=t * 1e6, gbps=moved / t / 1e9,
                             pct_hbm=100 * moved / t / hbm, pdl=ops.pdl, us_no_pdl=t_plain * 1e6,
                             pct_hbm_no_pdl=100 * moved / t_plain / hbm))
        for b in bufs:
            b.free()
    return rows_out


MLP_VARIANTS = [(0, "mlp fused 2048->8192->2048 (fixed-point adds)"), (1, "  block sums stored instead of added"),
                (2, "  gate/up alone (its stream, no down rows)")]


def bench_mlp(rt, ops, stream, hbm) -> list[dict]:
    """The fused MLP (ops/mlp.hip) of llama-3.2-1b and its parts (HE_MLP_VARIANT builds): where its time goes."""
    d, F = 2048, 8192
    x = rt.upload(np.random.default_rng(1).standard_normal(d).astype(np.float32))
    g = rt.upload(np.ones(d, np.float32))
    y = rt.malloc(rt.num_sms * d * 4 + 4096)
    rt.memset(y, 0, y.nbytes)
    wbytes = 3 * d * F * 2
    bufs = [rt.malloc(wbytes) for _ in range(copies_for(wbytes))]
    for b in bufs:
        rt.memset(b, 0x3C, b.nbytes)
    out = []
    for var, name in MLP_VARIANTS:
        def launch(i, var=var):
            w = bufs[i % len(bufs)]
            ops.mlp_fused(w, w.ptr + d * F * 2, w.ptr + 2 * d * F * 2, x, y, d, F, gamma=g, eps=1e-5, stream=stream,
                          variant=var)
        t, t_plain = timed_pdl(rt, ops, stream, launch)
        moved = (2 if var == 2 else 3) * d * F * 2
        out.append(dict(op=name, variant=var, us=t * 1e6, gbps=moved / t / 1e9, pct_hbm=100 * moved / t / hbm,
                        pdl=ops.pdl, us_no_pdl=t_plain * 1e6, pct_hbm_no_pdl=100 * moved / t_plain / hbm))
    for b in bufs:
        b.free()
    return out


# (grid, input length, RMSNorm prologue) of the per-op decode matvecs on 132 SMs (Ops._grid): O-proj and two-row
# down 1,024 units / 8 warps, QKV 1,536 / 8 and gate/up at the 2-blocks-per-SM cap (both with the norm), the
# one-row down 2,048 / 8.
FLOOR_SHAPES = [(128, 2048, False), (192, 2048, True), (264, 2048, True), (128, 8192, False), (256, 8192, False)]


def bench_floor(rt, ops, stream) -> list[dict]:
    """The per-op matvec launch's dependent boundary without weights (ops/probe.hip probe_chain): back-to-back
    launches, each staging the previous one's output, as the engine launches them (programmatic dependent
    launch where the runtime has it) and in plain stream order. However few bytes a kernel of that grid reads,
    a chain of them costs at least this per launch; its weight stream can hide behind it only where the next
    kernel's blocks are resident early (the decode kernels' PDL trigger)."""
    fn = rt.compile("ops/probe.hip").function("probe_chain")
    # at most two blocks per SM, as the matvecs (128 registers x 256 threads: half the register file): padded
    # shared memory, so that launches do not become resident several kernels deep while they wait
    two_per_sm = rt.max_shared_per_block // 2 - 8192
    n_max = max(n for _, n, _ in FLOOR_SHAPES)
    a = rt.upload(np.ones(n_max, np.float32))
    b = rt.upload(np.ones(n_max, np.float32))
    g = rt.upload(np.ones(n_max, np.float32))
    rows = []
    from ctypes import c_int32
    try:
        for grid, n, norm in FLOOR_SHAPES:
            def launch(i, grid=grid, n=n, norm=norm):
                src, dst = (a, b) if i % 2 == 0 else (b, a)
                rt.launch(fn, grid, MATVEC_THREADS, [O._p(src), O._p(g if norm else None), O._p(dst), c_int32(n)],
                          shared=max(n * 4, two_per_sm), stream=stream, pdl=ops.pdl)
            t, t_plain = timed_pdl(rt, ops, stream, launch)
            name = f"dependent launch, no weights ({grid} x {MATVEC_THREADS}, x[{n}]{', norm' if norm else ''})"
            rows.append(dict(op=name, grid=grid, inn=n, norm=norm, us=t * 1e6, pdl=ops.pdl, us_no_pdl=t_plain * 1e6))
    finally:
        for buf in (a, b, g):
            buf.free()
    return rows


def bench_attention(rt, ops, stream, hbm) -> list[dict]:
    nh, nkv, hd = 32, 8, 64  # Llama-3.2-1B
    out_rows = []
    q = rt.upload(np.random.default_rng(0).standard_normal(nh * hd).astype(np.float32))
    out = rt.malloc(nh * hd * 4)
    for ctx in (1024, 8192, 32768):
        nsplit, chunk = O.attention_plan(ctx, nkv, rt.num_sms)
        part = rt.malloc(O.Ops.partial_floats(1, nh, hd, nsplit) * 4)
        cache_bytes = nkv * ctx * hd * 2
        n = copies_for(2 * cache_bytes)
        caches = [(rt.malloc(cache_bytes), rt.malloc(cache_bytes)) for _ in range(n)]
        for kb, vb in caches:
            rt.memset(kb, 0x3C, cache_bytes)
            rt.memset(vb, 0x3C, cache_bytes)
        pos = rt.upload(np.array([ctx - 1], np.int32))

        def launch(i, caches=caches, part=part, nsplit=nsplit, chunk=chunk, ctx=ctx, pos=pos):
            kb, vb = caches[i % len(caches)]
            ops.attention(q, kb, vb, part, out, pos, T=1, nh=nh, nkv=nkv, hd=hd, max_ctx=ctx, nsplit=nsplit,
                          chunk=chunk, stream=stream)

        t, t_plain = timed_pdl(rt, ops, stream, launch)
        moved = 2 * cache_bytes
        # the decode form: one kernel, the last split block of each KV head combines (Ops.attention `count`);
        # early K/V loads are safe here: the position and the caches never change inside the timed graphs
        count = rt.upload(np.zeros(nkv, np.uint32))
        t_fused = timed(rt, stream, lambda i, caches=caches, part=part, nsplit=nsplit, chunk=chunk, ctx=ctx,
                        pos=pos, count=count: ops.attention(
                            q, *caches[i % len(caches)], part, out, pos, T=1, nh=nh, nkv=nkv, hd=hd, max_ctx=ctx,
                            nsplit=nsplit, chunk=chunk, count=count, early=True, one_kernel=True, stream=stream),
                        trials=5)
        count.free()
        # the two kernels apart: where a short context's time goes
        from ctypes import c_int32

        defs = O.attention_defines(hd, ctx)
        comb = ops.fn("attention_decode", "attention_combine", defs)
        fresh = O.Ops._combine_fresh(q, *caches[0], nkv, ctx, "HE_ATTN_FRESH_COMBINE" in defs)
        t_comb = timed(rt, stream, lambda i, part=part, nsplit=nsplit, pos=pos, fresh=fresh: rt.launch(
            comb, (nh, 1), 128, [O._p(part), O._p(pos), c_int32(nsplit), c_int32(nh), c_int32(hd), O._p(out),
                                 c_int32(0), *fresh], stream=stream), trials=5)
        out_rows.append(dict(op=f"attention ctx {ctx} (split {nsplit}x{chunk})", us=t * 1e6, gbps=moved / t / 1e9,
                             pct_hbm=100 * moved / t / hbm, pdl=ops.pdl, us_no_pdl=t_plain * 1e6,
                             pct_hbm_no_pdl=100 * moved / t_plain / hbm, combine_us=t_comb * 1e6,
                             one_kernel_us=t_fused * 1e6, pct_hbm_one_kernel=100 * moved / t_fused / hbm))
        for kb, vb in caches:
            kb.free()
            vb.free()
        part.free()
    return out_rows


class LazyRandomWeights(Mapping):
    """Random weights generated per tensor on access (never the whole model in host fp32 at once)."""

    def __init__(self, cfg, seed=0):
        from hipengine.backend import weight_shapes

        self.shapes, self.seed = weight_shapes(cfg), seed
        self.tied = cfg.tie_word_embeddings

    def __getitem__(self, name):
        if self.tied and name == "lm_head":
            name = "embed"
        shape = self.shapes[name]
        rng = np.random.default_rng(abs(hash((self.seed, name))) % 2**32)
        if len(shape) == 1:
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * (1.0 / math.sqrt(shape[1]))).astype(np.float32)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def llama_1b_model():
    try:
        from hipengine.presets import preset_model

        return preset_model("llama-3.2-1b", 0), "hipengine.presets"
    except Exception:
        from hipengine.config import ModelConfig
        from hipengine.loader import LoadedModel

        cfg = ModelConfig(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                          num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          max_position_embeddings=131072, tie_word_embeddings=True, name="llama-3.2-1b (bench)")
        return LoadedModel(cfg, LazyRandomWeights(cfg), None, "preset"), "bench_ops random weights"


def bench_decode(rt, hbm) -> dict:
    from hipengine.backend import SamplingParams
    from hipengine.gpu.executor import GpuBackend

    model, src = llama_1b_model()
    t0 = time.perf_counter()
    be = GpuBackend(model, max_context=1024, monokernel=False)
    load_s = time.perf_counter() - t0
    try:
        be.reset()
        be.prefill(np.arange(16) + 100)
        be.rt.copy_htod(be.pos_buf, np.array([be.pos], np.int32))

        def step_time() -> float:  # same position each step: the timing of a <=1K-context step
            if be._graph is not None:  # rebuilt: the launches' pdl flag is part of the captured graph
                be._graph.destroy()
                be._graph = None
            g, s, steps = be._decode_graph(), be.stream, 200
            for _ in range(5):
                g.launch(s)
            s.synchronize()
            e0, e1 = rt.event(), rt.event()
            e0.record(s)
            for _ in range(steps):
                g.launch(s)
            e1.record(s)
            e1.synchronize()
            return e0.elapsed_ms(e1) / 1e3 / steps

        pdl = be.ops.pdl
        step_s = step_time()
        be.ops.pdl = False
        step_plain = step_time()
        be.ops.pdl = pdl
        step_time()  # the engine's own graph again for generate_ids below
        # end-to-end greedy generation: device argmax + one int read back per token
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        list(be.generate_ids(np.arange(8) + 100, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             lambda: False))
        t0 = time.perf_counter()
        toks = list(be.generate_ids(np.arange(8) + 100, params, lambda: False))
        gen_s = (time.perf_counter() - t0) / len(toks)
    finally:
        be.close()
    bytes_tok = model.config.decode_bytes_per_token(2.0, context=17)
    return dict(op="decode llama-3.2-1b per-op graph", weights=src, load_s=load_s, us=step_s * 1e6,
                tok_s=1 / step_s, gbps=bytes_tok / step_s / 1e9, pct_hbm=100 * bytes_tok / step_s / hbm,
                roofline_tok_s=hbm / bytes_tok, generate_tok_s=1 / gen_s, pdl=pdl, us_no_pdl=step_plain * 1e6,
                tok_s_no_pdl=1 / step_plain)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip-decode", action="store_true")
    a = ap.parse_args(argv)
    rt = get_runtime(0)
    ops, stream = O.Ops(rt), rt.stream()
    hbm, hbm_src = hbm_read_bw(rt, stream)
    res = dict(gpu=rt.name, arch=rt.arch, sms=rt.num_sms, hbm_read_gbps=hbm / 1e9, hbm_source=hbm_src,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    res["commit"] = git_commit()  # $HIPENGINE_COMMIT first: the device's copy of the tree has a stale .git
    res["matvec"] = bench_matvecs(rt, ops, stream, hbm)
    res["mlp"] = bench_mlp(rt, ops, stream, hbm)
    res["attention"] = bench_attention(rt, ops, stream, hbm)
    res["floor"] = bench_floor(rt, ops, stream)
    if not a.skip_decode:
        try:
            res["decode"] = bench_decode(rt, hbm)
        except Exception as e:  # report, keep the op figures
            res["decode"] = dict(error=f"{type(e).__name__}: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{rt.name}: HBM read {hbm / 1e9:.0f} GB/s ({hbm_src})")
    print(f"{'op':48s} {'us':>9s} {'GB/s':>8s} {'%HBM':>6s}")
    for r in res["matvec"] + res["mlp"] + res["attention"]:
        extra = f"  plain launches: {r['us_no_pdl']:.2f} us, {r['pct_hbm_no_pdl']:.1f}%" if r["pdl"] else ""
        if "combine_us" in r:
            extra += f"  (combine alone {r['combine_us']:.1f} us; one kernel {r['one_kernel_us']:.2f} us)"
        print(f"{r['op']:48s} {r['us']:9.2f} {r['gbps']:8.0f} {r['pct_hbm']:6.1f}{extra}")
    for r in res["floor"]:
        extra = f"  plain launches: {r['us_no_pdl']:.2f} us" if r["pdl"] else ""
        print(f"{r['op']:48s} {r['us']:9.2f} {'':>8s} {'':>6s}{extra}")
    d = res.get("decode", {})
    if "tok_s" in d:
        print(f"decode 1B per-op graph: {d['tok_s']:.0f} tok/s ({d['pct_hbm']:.1f}% of HBM roofline "
              f"{d['roofline_tok_s']:.0f}; plain launches {d['tok_s_no_pdl']:.0f}); generate_ids greedy "
              f"{d['generate_tok_s']:.0f} tok/s")
    elif d:
        print(f"decode: {d.get('error')}")
    return 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
