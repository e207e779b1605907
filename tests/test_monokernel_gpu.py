"""The monokernel (kernels_hip/monokernel/decode.hip) against the per-op GPU path on the same weights.

Both paths run the same __device__ op bodies with the same block size and, at the caches tested here for
identity (up to 8K), the same attention split plan (the monokernel's one-round plan, monokernel.mk_plan,
equals the per-op one there), so greedy output must be identical token for token (not just close). The
per-op path is GpuBackend.generate_ids called on the MonokernelBackend instance itself: one weight upload, two
decode paths.
"""
import threading

import numpy as np
import pytest

from hipengine.backend import SamplingParams

pytestmark = pytest.mark.gpu


def _per_op(be, prompt, params):
    from hipengine.gpu.executor import GpuBackend

    return list(GpuBackend.generate_ids(be, prompt, params, lambda: False))


def _mono(be, prompt, params, should_stop=lambda: False):
    return list(be.generate_ids(prompt, params, should_stop))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model("llama", tmp_path_factory.mktemp("mk_tiny"), seed=5, max_position_embeddings=1024)
    be = MonokernelBackend(load_model(path, progress=False), max_context=1024)
    yield be
    be.close()


def test_long_context_build_greedy_identical(tmp_path):
    """A KV cache of LONG_CONTEXT tokens selects the long-context build (q in registers in the split); it
    must still give the per-op path's tokens, and resizing below the threshold returns to the short build."""
    from hipengine.gpu.monokernel import LONG_CONTEXT, MonokernelBackend
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model("llama", tmp_path, seed=7, max_position_embeddings=LONG_CONTEXT)
    be = MonokernelBackend(load_model(path, progress=False), max_context=LONG_CONTEXT)
    try:
        assert be.q_regs
        prompt = np.array([5, 17, 99, 42, 7, 250, 31, 8, 64], np.int64)
        params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
        assert _mono(be, prompt, params) == _per_op(be, prompt, params)
        be.resize_context(1024)
        assert not be.q_regs
        assert _mono(be, prompt, params) == _per_op(be, prompt, params)
    finally:
        be.close()


def test_own_split_plan_at_a_long_cache(tmp_path, monkeypatch):
    """An 8-KV-head model in a 16K cache: the monokernel takes its one-round split plan (mk_plan — 16 splits of
    1,024 on 132 SMs) where the per-op path takes two rounds (32 of 512), so the attention sums differ and the
    decode logits agree to rounding, not bit for bit; with HIPENGINE_MK_ONE_ROUND=0 the monokernel takes the
    per-op plan and its logits are the per-op path's bits again."""
    from hipengine.gpu.executor import GpuBackend
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    monkeypatch.delenv("HIPENGINE_MK_ONE_ROUND", raising=False)
    path, _ = save_tiny_model("llama", tmp_path, seed=13, max_position_embeddings=16384, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=64)
    be = MonokernelBackend(load_model(path, progress=False), max_context=16384)
    try:
        assert be.mk_nsplit <= be.nsplit
        if be.rt.num_sms == 132:
            assert (be.mk_nsplit, be.mk_chunk, be.fine) == (16, 1024, 3) and (be.nsplit, be.chunk) == (32, 512)
        ids = np.random.default_rng(3).integers(3, be.config.vocab_size, 2500)

        def steps(decode):
            be.reset()
            be.prefill(ids)
            return [decode(t) for t in (4, 5, 6)]

        want = steps(lambda t: GpuBackend.decode(be, t))
        for x, y in zip(want, steps(be.decode)):
            assert np.isfinite(y).all() and np.abs(y - x).max() <= 1e-2 * np.abs(x).max()
        monkeypatch.setenv("HIPENGINE_MK_ONE_ROUND", "0")
        be.resize_context(16384)
        assert (be.mk_nsplit, be.mk_chunk) == (be.nsplit, be.chunk)
        for x, y in zip(want, steps(be.decode)):
            assert np.array_equal(x, y)
    finally:
        be.close()


@pytest.mark.parametrize("fine", ["2", "3"])
def test_both_combine_schemes_greedy_identical(tmp_path, monkeypatch, fine):
    """Both attention -> O-proj schemes (mk_fine picks one per split plan; HIPENGINE_MK_FINE forces it) give
    the per-op path's tokens, at a 4K and a 1K cache."""
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    monkeypatch.setenv("HIPENGINE_MK_FINE", fine)
    path, _ = save_tiny_model("llama", tmp_path, seed=11, max_position_embeddings=4096)
    be = MonokernelBackend(load_model(path, progress=False), max_context=4096)
    try:
        assert be.fine == int(fine)
        prompt = np.array([3, 41, 7, 99, 250, 12], np.int64)
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        assert _mono(be, prompt, params) == _per_op(be, prompt, params)
        be.resize_context(1024)
        assert be.fine == int(fine)
        assert _mono(be, prompt, params) == _per_op(be, prompt, params)
    finally:
        be.close()


def test_tiny_greedy_identical_256(tiny):
    prompt = np.array([5, 17, 99, 42, 7, 250, 31, 8, 64], np.int64)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    want = _per_op(tiny, prompt, params)
    got = _mono(tiny, prompt, params)
    assert len(got) == 256 and tiny.last_finish == "length"
    assert got == want, f"first divergence at token {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_tiny_decode_logits_identical(tiny):
    from hipengine.gpu.executor import GpuBackend

    ids = np.array([3, 9, 27, 81, 243, 11], np.int64)
    tiny.reset()
    tiny.prefill(ids)
    a = [GpuBackend.decode(tiny, t) for t in (4, 5, 6)]
    tiny.reset()
    tiny.prefill(ids)
    b = [tiny.decode(t) for t in (4, 5, 6)]
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_l2_persisting_kv_cache_same_tokens(tmp_path, monkeypatch):
    """HIPENGINE_L2_PERSIST_KV=1: the KV cache (K and V in one allocation) under a persisting L2 window on NVIDIA —
    a cache policy: the monokernel's greedy tokens equal the per-op path's and the default's; closing the backend
    gives the set-aside back."""
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model("llama", tmp_path, seed=5, max_position_embeddings=1024)
    model = load_model(path, progress=False)
    prompt = np.array([5, 17, 99, 42, 7, 250, 31, 8, 64], np.int64)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    be = MonokernelBackend(model, max_context=1024)
    want = _mono(be, prompt, params)
    be.close()
    monkeypatch.setenv("HIPENGINE_L2_PERSIST_KV", "1")
    be = MonokernelBackend(model, max_context=1024)
    try:
        assert be.v_cache.ptr - be.k_cache.ptr >= be.k_cache.nbytes
        assert be.v_cache.ptr + be.v_cache.nbytes <= be.kv_cache.ptr + be.kv_cache.nbytes
        if be.rt.vendor == "nvidia":
            assert be.l2_kv_bytes > 0
        got = _mono(be, prompt, params)
        assert got == want
        assert _per_op(be, prompt, params) == want
    finally:
        be.close()
    assert getattr(be.rt, "l2_aside", 0) == 0


def test_seeded_sampling_reproducible(tiny):
    prompt = np.array([5, 6, 7, 8], np.int64)
    p = SamplingParams(max_tokens=64, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                       seed=1234, ignore_eos=True)
    first = _mono(tiny, prompt, p)
    assert first == _mono(tiny, prompt, p)
    other = _mono(tiny, prompt, SamplingParams(**{**p.__dict__, "seed": 99}))
    assert other != first  # 64 sampled tokens: a different seed must change something


def test_eos_stops(tiny):
    prompt = np.array([5, 17, 99], np.int64)
    free = _mono(tiny, prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    eos_tok = free[5]
    tiny.config = tiny.config.replace(eos_token_ids=(eos_tok,))
    try:
        got = _mono(tiny, prompt, SamplingParams(max_tokens=16))
    finally:
        tiny.config = tiny.config.replace(eos_token_ids=())
    assert got == free[:free.index(eos_tok) + 1] and tiny.last_finish == "stop"


def test_cancel_within_one_token(tiny):
    prompt = np.array([5, 17, 99], np.int64)
    seen = []
    stop = threading.Event()

    def should_stop():
        if len(seen) >= 5:
            stop.set()
        return stop.is_set()

    for t in tiny.generate_ids(prompt, SamplingParams(max_tokens=900, ignore_eos=True), should_stop):
        seen.append(t)
    assert len(seen) == 5 and tiny.last_finish == "cancelled"
    # the device checks the cancel word once per token: at most the token in flight when the host wrote
    # it, plus the one whose check raced the write
    assert tiny.last_n_out <= tiny.cancel_seen_at + 2, (tiny.last_n_out, tiny.cancel_seen_at)


def test_abandoned_stream_cancels(tiny):
    gen = tiny.generate_ids(np.array([1, 2, 3], np.int64), SamplingParams(max_tokens=900, ignore_eos=True))
    next(gen)
    gen.close()  # consumer walked away: the kernel must be stopped, not left generating 900 tokens
    assert tiny.last_finish == "cancelled" and tiny.last_n_out < 900


def test_timeout_is_device_error_and_recovers(tiny):
    from hipengine.errors import DeviceError

    saved = tiny.timeout_ns
    tiny.timeout_ns = 1  # every barrier that is not already open gives up at once
    try:
        with pytest.raises(DeviceError, match="timeout|aborted"):
            _mono(tiny, np.array([1, 2, 3], np.int64), SamplingParams(max_tokens=64, ignore_eos=True))
    finally:
        tiny.timeout_ns = saved
    got = _mono(tiny, np.array([1, 2, 3], np.int64), SamplingParams(max_tokens=8, ignore_eos=True))
    assert got == _per_op(tiny, np.array([1, 2, 3], np.int64), SamplingParams(max_tokens=8, ignore_eos=True))


def test_1000_consecutive_requests(tiny):
    rng = np.random.default_rng(7)
    for i in range(1000):
        prompt = rng.integers(3, tiny.config.vocab_size, int(rng.integers(1, 17)))
        params = SamplingParams(max_tokens=int(rng.integers(1, 9)), temperature=0.0, ignore_eos=True)
        got = _mono(tiny, prompt, params)
        want = _per_op(tiny, prompt, params)
        assert got == want, f"request {i}: {got} != {want}"


def test_qwen3_qk_norm_greedy_identical(tmp_path):
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model("qwen3", tmp_path / "q3", seed=2, max_position_embeddings=512)
    be = MonokernelBackend(load_model(path, progress=False), max_context=512)
    try:
        prompt = np.array([4, 8, 15, 16, 23, 42], np.int64)
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        assert _mono(be, prompt, params) == _per_op(be, prompt, params)
    finally:
        be.close()


def test_llama_3_2_1b_preset_greedy_identical_256():
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.presets import preset_model

    be = MonokernelBackend(preset_model("llama-3.2-1b", 0), max_context=1024)
    try:
        prompt = np.random.default_rng(1).integers(0, be.config.vocab_size, 32)
        params = SamplingParams(max_tokens=256, ignore_eos=True)
        want = _per_op(be, prompt, params)
        got = _mono(be, prompt, params)
        assert got == want, f"first divergence at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    finally:
        be.close()


def test_stage_profile_build(tmp_path, monkeypatch):
    """HIPENGINE_MK_PROFILE=1 builds the stage profile (sums kept in shared memory, added to the buffer when the
    launch ends): its tokens are the production build's, and every figure is a consistent share of the step."""
    from hipengine.gpu.monokernel import MonokernelBackend, read_profile, reset_profile
    from hipengine.loader import load_model
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model("llama", tmp_path, seed=11, max_position_embeddings=512)
    model = load_model(path, progress=False)
    prompt = np.array([3, 14, 15, 92, 65], np.int64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = MonokernelBackend(model, max_context=512)
    try:
        want = _mono(plain, prompt, params)
    finally:
        plain.close()
    monkeypatch.setenv("HIPENGINE_MK_PROFILE", "1")
    be = MonokernelBackend(model, max_context=512)
    try:
        reset_profile(be)
        assert _mono(be, prompt, params) == want
        prof = read_profile(be)
        assert prof["steps"] >= len(want) - 1 and prof["ghz"] > 0.1 and prof["us_per_step"] > 0
        work, total = prof["work_us"], prof["total_us"]
        # the fused MLP (ops/mlp.hip) is one stage, profiled as "down"; gate/up has no stage of its own there
        for k in ("qkv", "down", "lm_head") + (() if be.fused_mlp else ("gate_up",)):
            assert 0 < work[k] <= total[k] + 1e-6, k
        assert sum(total[k] for k in ("select", "qkv", "attention", "combine", "o_proj", "gate_up", "down",
                                      "lm_head")) <= prof["us_per_step"] * 1.05
        rows = prof["blocks"]
        assert len(rows["sm"]) == be.grid
        if be.blocks_per_sm == 1:
            assert len(set(rows["sm"])) == be.grid  # one block per SM: each SM once
        assert all(len(v) == be.grid for v in rows["total_us"].values())
    finally:
        be.close()


def _decode_same_bits(be, ids, greedy: int, seed: int, check=lambda: True):
    """After a prefill of `ids`, four one-step monokernel launches give the per-op path's logits bit for bit (each a
    launch of its own); `check()` holds after both paths' steps; then `greedy` tokens of a random 32-token prompt
    (`seed`) are the same on both paths."""
    from hipengine.gpu.executor import GpuBackend

    be.reset()
    be.prefill(ids)
    want = [GpuBackend.decode(be, t) for t in (5, 6, 7, 8)]
    assert check()
    be.reset()
    be.prefill(ids)
    got = [be.decode(t) for t in (5, 6, 7, 8)]
    for a, b in zip(got, want):
        assert np.all(np.isfinite(a)) and np.array_equal(a, b), np.max(np.abs(a - b))
    assert check()
    prompt = np.random.default_rng(seed).integers(0, be.config.vocab_size, 32)
    params = SamplingParams(max_tokens=greedy, ignore_eos=True)
    mono, per_op = _mono(be, prompt, params), _per_op(be, prompt, params)
    assert len(mono) == greedy and mono == per_op


def test_o_group_same_bits_as_per_op(monkeypatch):
    """The grouped O-proj (decode.hip MK_O_GROUP; the per-op path's ops.matvec_group_o and its readers; one rule for
    both paths, monokernel.o_group_decide): both add the same eight fixed-point shares per row, so the monokernel's
    logits equal the per-op path's bit for bit, the fixed-point buffer is clear after every step, and the greedy
    tokens are the same."""
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.presets import preset_model

    monkeypatch.setenv("HIPENGINE_MK_OGROUP", "1")
    be = MonokernelBackend(preset_model("llama-3.2-1b", 0), max_context=1024)
    try:
        assert be.o_group
        x_fx_clear = lambda: not be.rt.download(be.x_fx, (be.config.hidden_size,), np.int64).any()  # noqa: E731
        _decode_same_bits(be, np.random.default_rng(3).integers(0, be.config.vocab_size, 40), 64, 4, x_fx_clear)
    finally:
        be.close()


@pytest.mark.parametrize("max_context", [1024, 8192])
def test_q_flow_same_bits_as_per_op(monkeypatch, max_context):
    """MK_QFLOW (decode.hip: the QKV values as LL words, the attention splits poll them, no grid barrier between QKV
    and attention): the same loads and sums as the default build, so the monokernel's logits equal the per-op path's
    bit for bit — over several launches (the words' epochs restart at every launch) — and 256 greedy tokens are the
    same. The 1K case's newest row is in its warp's first tile, the 8K case's
    prompt (2,060 tokens: splits of 160 rows, the newest at row 140-143 of its split) puts it in a later tile."""
    from hipengine.gpu.monokernel import MonokernelBackend, grid_info
    from hipengine.presets import preset_model

    monkeypatch.setenv("HIPENGINE_MK_QFLOW", "1")
    be = MonokernelBackend(preset_model("llama-3.2-1b", 0), max_context=max_context)
    try:
        assert be.q_flow and grid_info(be)["q_flow"]
        n = 700 if max_context == 1024 else 2060
        _decode_same_bits(be, np.random.default_rng(5).integers(0, be.config.vocab_size, n), 256, 6)
    finally:
        be.close()
