"""The tensor-parallel monokernel (TpMonokernelBackend, kernels_hip/monokernel/tp_exchange.h) on 2+ GPUs.

Each rank's monokernel runs the per-op TP path's op bodies on the same shard and sums the ranks' partials in
the same order (rank 0's term carries the residual), so greedy output must equal the per-op TP path token
for token — both paths run on one TpMonokernelBackend instance (one weight upload) — and the per-op TP
path is itself checked against TP=1 in test_tp_executor.py.
"""
import threading

import numpy as np
import pytest

from hipengine.backend import SamplingParams

pytestmark = pytest.mark.multigpu


@pytest.fixture(scope="module")
def be():
    from hipengine.gpu.tp_monokernel import TpMonokernelBackend
    from hipengine.presets import preset_model

    b = TpMonokernelBackend(preset_model("llama-3.2-1b", 0), max_context=1024, tp=2)
    yield b
    b.close()


PROMPT = np.random.default_rng(1).integers(0, 128256, 16)


def _per_op(be, prompt, params):
    from hipengine.gpu.tp_executor import TpGpuBackend

    return list(TpGpuBackend.generate_ids(be, prompt, params, lambda: False))


def test_tp2_monokernel_equals_per_op_tp_256(be):
    import time

    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    want = _per_op(be, PROMPT, params)
    list(be.generate_ids(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))  # warm
    stamps, got = [], []
    for t in be.generate_ids(PROMPT, params):
        stamps.append(time.perf_counter())
        got.append(t)
    print(f"\nTP=2 monokernel {(len(stamps) - 1) / (stamps[-1] - stamps[0]):.1f} tok/s")
    assert len(got) == 256 and be.last_finish == "length"
    assert got == want, f"first divergence at token {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_tp2_monokernel_decode_logits_identical(be):
    """One-step logits (every rank's slice) equal the per-op TP path's bit for bit, for input tokens from both
    ranks' vocabulary slices (the embedding is replicated: every id embeds on every rank)."""
    from hipengine.gpu.tp_executor import TpGpuBackend

    toks = [5, 70000, 128000, 64127, 64128]
    be.reset()
    be.prefill(PROMPT)
    a = [TpGpuBackend.decode(be, t) for t in toks]
    be.reset()
    be.prefill(PROMPT)
    b = [be.decode(t) for t in toks]
    for t, x, y in zip(toks, a, b):
        assert np.array_equal(x, y), f"token {t}: max |diff| {float(np.abs(x - y).max()):.3g}"


def test_tp2_monokernel_long_context_equals_per_op(be):
    """From a synthetic KV cache at 4K (the benchmark's set-up): monokernel == per-op decode_from."""
    be.resize_context(4096)
    try:
        for rk in be.ranks:
            per = rk.kv_layer_bytes * rk.config.num_layers
            rk.rt.memset(rk.k_cache, 0x3C, per)
            rk.rt.memset(rk.v_cache, 0x3C, per)
        be.pos = 4096 - 64
        a = list(be.decode_from(int(PROMPT[-1]), 64))
        be.pos = 4096 - 64
        b = list(be.generate_from_state_greedy(int(PROMPT[-1]), 64))
        assert a == b and be.pos == 4096
    finally:
        be.resize_context(1024)


def test_tp2_monokernel_cancel_within_one_token(be):
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    out, flag = [], threading.Event()

    def stop():
        if len(out) >= 5:
            flag.set()
        return flag.is_set()

    for t in be.generate_ids(PROMPT, params, stop):
        out.append(t)
    assert len(out) == 5 and be.last_finish == "cancelled"
    # each rank reads its own cancel word once per token and the token exchange ORs them
    assert be.last_n_out <= be.cancel_seen_at + 2, (be.last_n_out, be.cancel_seen_at)


def test_tp2_monokernel_many_requests_and_sampling_route(be):
    """300 consecutive short greedy requests give the same tokens (no hang, no stale exchange word); a seeded
    sampled request (per-op TP route) replays."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = list(be.generate_ids(PROMPT, params))
    for _ in range(300):
        assert list(be.generate_ids(PROMPT, params)) == first
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    a = list(be.generate_ids(PROMPT, sp))
    assert a == list(be.generate_ids(PROMPT, sp)) and len(a) == 16


def test_tp2_monokernel_lone_rank_reports_peer_timeout_and_recovers(be):
    """Only rank 0 launched: its peer's words never come; the kernel reports instead of hanging, and the
    next request runs normally (every launch re-zeroes the exchange regions)."""
    from hipengine.errors import DeviceError

    r0 = be.ranks[0]
    saved = r0.timeout_ns
    r0.timeout_ns = int(0.5e9)
    try:
        r0._prepare(1, 5, 0, 0, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), [], 0)
        r0._start()
        with pytest.raises(DeviceError, match="peer exchange timeout"):
            r0._finish()
    finally:
        r0.timeout_ns = saved
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert list(be.generate_ids(PROMPT, params)) == _per_op(be, PROMPT, params)
