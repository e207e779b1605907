"""The monokernel's host-side streaming protocol on the CPU: a thread plays the device (ring entry, then the
write index; the cancel word checked once per token; status last), so ring reading, cancel, abandoned
streams and error statuses are tested without a GPU. The GPU tests run the real kernel."""
import threading
import time

import numpy as np
import pytest

from hipengine.backend import SamplingParams
from hipengine.errors import DeviceError
from hipengine.gpu import monokernel as mk


class FakeDevice(mk.MonokernelBackend):
    """MonokernelBackend minus the GPU: host words and ring are plain numpy memory; _launch starts a thread."""

    def __init__(self, tokens, fail_after=None, step_s=2e-4):
        self.tokens_to_emit, self.fail_after, self.step_s = list(tokens), fail_after, step_s
        words = np.zeros(len(mk.MK_HOST_WORDS) + 4096, np.uint32)
        self.host_words, self.ring = words[:len(mk.MK_HOST_WORDS)], words[len(mk.MK_HOST_WORDS):].view(np.int32)
        self.W = {w: i for i, w in enumerate(mk.MK_HOST_WORDS)}
        self.timeout_ns, self.pos = int(1e9), 0
        self.config = type("C", (), {"eos_token_ids": (7,)})()
        self.rt = type("R", (), {"device_index": 0})()

    def _launch(self, mode, token, pos, hist_len, params=None, eos=(), seed=0):
        self.host_words[:] = 0
        hw, W = self.host_words, self.W

        def device():
            n, finish, status = 0, 0, 1
            for tok in self.tokens_to_emit:
                time.sleep(self.step_s)
                if self.fail_after is not None and n == self.fail_after:
                    status = 2
                    break
                self.ring[n] = tok
                n += 1
                hw[W["write_idx"]] = n
                if tok in eos:
                    finish = 1
                elif n >= params.max_tokens:
                    finish = 2
                elif hw[W["cancel"]]:
                    finish = 3
                if finish:
                    break
            hw[W["n_out"]], hw[W["pos"]], hw[W["finish"]] = n, pos + n, finish
            hw[W["status"]] = status

        self.thread = threading.Thread(target=device)
        self.thread.start()

    def _finish(self):
        self.thread.join()
        super()._finish()


@pytest.fixture(autouse=True)
def _no_stream(monkeypatch):
    # _finish synchronises the stream first; the fake has none
    monkeypatch.setattr(mk.MonokernelBackend, "stream", type("S", (), {"synchronize": lambda self: None})(),
                        raising=False)


def test_streams_every_token_in_order():
    dev = FakeDevice(range(10, 60))
    got = list(dev.generate_from_state(0, 0, SamplingParams(max_tokens=50, ignore_eos=True)))
    assert got == list(range(10, 60)) and dev.last_finish == "length"


def test_eos_is_emitted_then_stops():
    dev = FakeDevice([3, 4, 7, 9, 9])
    assert list(dev.generate_from_state(0, 0, SamplingParams(max_tokens=50))) == [3, 4, 7]
    assert dev.last_finish == "stop"


def test_cancel_stops_yielding_and_the_device():
    dev = FakeDevice(range(100, 600))
    seen = []
    for t in dev.generate_from_state(0, 0, SamplingParams(max_tokens=500, ignore_eos=True),
                                     should_stop=lambda: len(seen) >= 3):
        seen.append(t)
    assert seen == [100, 101, 102] and dev.last_finish == "cancelled"
    assert dev.last_n_out <= dev.cancel_seen_at + 2


def test_abandoned_generator_cancels_the_kernel():
    dev = FakeDevice(range(100, 600))
    g = dev.generate_from_state(0, 0, SamplingParams(max_tokens=500, ignore_eos=True))
    assert next(g) == 100
    g.close()
    assert dev.last_finish == "cancelled" and dev.last_n_out < 500


def test_device_error_status_raises():
    dev = FakeDevice(range(10), fail_after=4)
    with pytest.raises(DeviceError, match="grid barrier timeout"):
        list(dev.generate_from_state(0, 0, SamplingParams(max_tokens=10, ignore_eos=True)))


def test_status_names_cover_sync_h_codes():
    assert set(mk.MK_STATUS) == {0, 1, 2, 3, 4, 5} and mk.MK_FINISH[3] == "cancelled"


# ---- the tensor-parallel host side (hipengine/gpu/tp_monokernel.py) without GPUs ---------------------------
class FakeRank:
    """One rank's launch surface: records prepare/start order; its kernel emits `tokens` from a thread."""

    def __init__(self, log, r, tokens, status=1):
        self.log, self.r, self.tokens, self.status = log, r, tokens, status
        words = np.zeros(len(mk.MK_HOST_WORDS) + 64, np.uint32)
        self.host_words, self.ring = words[:len(mk.MK_HOST_WORDS)], words[len(mk.MK_HOST_WORDS):].view(np.int32)
        self.W = {w: i for i, w in enumerate(mk.MK_HOST_WORDS)}
        self.thread = None
        self.stream = type("S", (), {"synchronize": lambda s: self.thread and self.thread.join()})()

    def _prepare(self, mode, token, pos, hist_len, params, eos, seed):
        self.log.append(("prepare", self.r))
        self.host_words[:] = 0
        self.params = params

    def _start(self):
        self.log.append(("start", self.r))
        hw, W = self.host_words, self.W

        def device():
            n = 0
            for tok in self.tokens:
                time.sleep(2e-4)
                if hw[W["cancel"]]:
                    hw[W["finish"]] = 3
                    break
                self.ring[n] = tok
                n += 1
                hw[W["write_idx"]] = n
            else:
                hw[W["finish"]] = 2
            hw[W["n_out"]], hw[W["pos"]] = n, 10 + n
            hw[W["status"]] = self.status

        self.thread = threading.Thread(target=device)
        self.thread.start()


def _fake_tp(statuses=(1, 1), tokens=range(20, 28)):
    from hipengine.gpu.tp_monokernel import TpMonokernelBackend

    log = []
    be = object.__new__(TpMonokernelBackend)
    be.ranks = [FakeRank(log, r, list(tokens), s) for r, s in enumerate(statuses)]
    be.rts = [type("R", (), {"device_index": r})() for r in range(len(statuses))]
    be.devices = list(range(len(statuses)))
    be.W, be.timeout_ns = be.ranks[0].W, int(1e9)
    be.config = type("C", (), {"eos_token_ids": (7,)})()
    for rk in be.ranks:
        rk.pos = 10
    return be, log


def test_tp_launch_prepares_every_rank_before_starting_any():
    be, log = _fake_tp()
    got = list(be.generate_from_state(3, 0, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert got == list(range(20, 28)) and be.last_finish == "length"
    assert log == [("prepare", 0), ("prepare", 1), ("start", 0), ("start", 1)]
    assert [rk.pos for rk in be.ranks] == [18, 18]  # every rank advances to the position rank 0 reports


def test_tp_cancel_reaches_every_rank():
    be, _ = _fake_tp(tokens=range(100, 140))
    g = be.generate_from_state(0, 0, SamplingParams(max_tokens=40, ignore_eos=True))
    assert next(g) == 100
    g.close()
    assert all(rk.host_words[rk.W["cancel"]] == 1 for rk in be.ranks) and be.last_finish == "cancelled"


def test_tp_peer_timeout_names_the_rank():
    be, _ = _fake_tp(statuses=(1, 5))
    with pytest.raises(DeviceError, match=r"rank 1 \(GPU 1\): tensor-parallel peer exchange timeout"):
        list(be.generate_from_state(0, 0, SamplingParams(max_tokens=8, ignore_eos=True)))


def test_tp_monokernel_refuses_to_launch_sampling():
    from hipengine.errors import UnsupportedError

    be, log = _fake_tp()
    with pytest.raises(UnsupportedError, match="per-op TP path"):
        list(be.generate_from_state(0, 0, SamplingParams(max_tokens=8, temperature=0.7)))
    assert log == []


def test_extra_defines_parse_and_reach_the_build(monkeypatch):
    """HIPENGINE_MK_DEFINES: NAME=VALUE items (VALUE defaults to 1) go into the monokernel's defines; a
    malformed item is one clear error, not a compiler failure later."""
    from hipengine.errors import UnsupportedError

    monkeypatch.setenv("HIPENGINE_MK_DEFINES", "MK_FOO=2, MK_BAR")
    assert mk.extra_defines() == {"MK_FOO": 2, "MK_BAR": 1}
    assert mk.compile_args("nvidia", False, 4)["defines"]["MK_FOO"] == 2
    monkeypatch.setenv("HIPENGINE_MK_DEFINES", "")
    assert mk.extra_defines() == {}
    for bad in ("not a name=1", "MK_FOO=abc"):
        monkeypatch.setenv("HIPENGINE_MK_DEFINES", bad)
        with pytest.raises(UnsupportedError, match="HIPENGINE_MK_DEFINES"):
            mk.extra_defines()


def test_smem_pad_is_bytes_or_one_clear_error(monkeypatch):
    """HIPENGINE_MK_SMEM_PAD: unset or empty is 0, a number of bytes is that, anything else one clear error."""
    from hipengine.errors import UnsupportedError

    monkeypatch.delenv("HIPENGINE_MK_SMEM_PAD", raising=False)
    assert mk.smem_pad() == 0
    monkeypatch.setenv("HIPENGINE_MK_SMEM_PAD", "65664")
    assert mk.smem_pad() == 65664
    for bad in ("-1", "64K", "1.5"):
        monkeypatch.setenv("HIPENGINE_MK_SMEM_PAD", bad)
        with pytest.raises(UnsupportedError, match="HIPENGINE_MK_SMEM_PAD"):
            mk.smem_pad()


def test_fine_follows_the_split_plan(monkeypatch):
    """mk_fine: fine = 3 (the last split block combines its group) while the split plan's (kv head, split)
    items fit in one round of the grid, 2 (a grid barrier, one head per block) when they take two; llama-3.2-1b
    on 132 SMs: 8 x 16 = 128 items up to 32K (its one-round plan, mk_plan), 8 x 48 = 384 at 48K (with the
    per-op plan, HIPENGINE_MK_ONE_ROUND=0: 8 x 32 = 256 from 12K); smollm2-135m (3 KV heads) in a 4K cache:
    3 x 43 = 129. The LL exchange builds keep 3; HIPENGINE_MK_FINE forces either, and anything else is one
    clear error."""
    from hipengine.errors import UnsupportedError

    monkeypatch.delenv("HIPENGINE_MK_FINE", raising=False)
    monkeypatch.delenv("HIPENGINE_MK_MIN_BLOCKS", raising=False)
    monkeypatch.delenv("HIPENGINE_MK_ONE_ROUND", raising=False)
    assert [mk.mk_fine(c, 8, 132) for c in (1024, 8192, 12288, 16384, 32768, 49152)] == [3, 3, 3, 3, 3, 2]
    assert mk.mk_plan(32768, 8, 132) == (16, 2048)
    monkeypatch.setenv("HIPENGINE_MK_ONE_ROUND", "0")
    assert [mk.mk_fine(c, 8, 132) for c in (1024, 4096, 8192, 12288, 16384, 32768)] == [3, 3, 3, 2, 2, 2]
    assert mk.mk_plan(32768, 8, 132) == (32, 1024)
    monkeypatch.setenv("HIPENGINE_MK_ONE_ROUND", "yes")
    with pytest.raises(UnsupportedError, match="HIPENGINE_MK_ONE_ROUND"):
        mk.mk_plan(1024, 8, 132)
    monkeypatch.delenv("HIPENGINE_MK_ONE_ROUND")
    assert mk.mk_fine(4096, 3, 132) == 3
    assert mk.mk_fine(32768, 8, 132, tp=True) == 3
    monkeypatch.setenv("HIPENGINE_MK_FINE", "3")
    assert mk.mk_fine(32768, 8, 132) == 3
    monkeypatch.setenv("HIPENGINE_MK_FINE", "2")
    assert mk.mk_fine(1024, 8, 132) == 2
    for bad in ("1", "x"):
        monkeypatch.setenv("HIPENGINE_MK_FINE", bad)
        with pytest.raises(UnsupportedError, match="HIPENGINE_MK_FINE"):
            mk.mk_fine(1024, 8, 132)


def test_long_context_build_choice(monkeypatch):
    """KV caches from LONG_CONTEXT tokens get the build with the attention split's q in registers
    (HE_ATTN_Q_REGS), at any tp, on NVIDIA; HIPENGINE_MK_QREGS forces either way."""
    monkeypatch.delenv("HIPENGINE_MK_QREGS", raising=False)
    assert not mk.q_regs_build(mk.LONG_CONTEXT - 1)
    assert mk.q_regs_build(mk.LONG_CONTEXT) and mk.q_regs_build(32768)
    assert not mk.q_regs_build(32768, "amd")  # not measured there yet
    monkeypatch.setenv("HIPENGINE_MK_QREGS", "1")
    assert mk.q_regs_build(1024)
    monkeypatch.setenv("HIPENGINE_MK_QREGS", "0")
    assert not mk.q_regs_build(32768)
    assert mk.compile_args("nvidia", False, 4, q_regs=True)["defines"]["HE_ATTN_Q_REGS"] == 1
    assert "HE_ATTN_Q_REGS" not in mk.compile_args("nvidia", False, 4)["defines"]


def test_start_l2_masks_follow_the_build(monkeypatch):
    """decode.hip's MK_START_L2 / MK_START_L2_HALF: the short-context build at tp = 1 on NVIDIA asks for every layer
    stage's half pair (7 / 7, measured there); the long-context build, tensor parallelism, the bf16 two-stage MLP
    builds (which cannot take bits 1 and 2) and AMD keep decode.hip's default (no define); a sweep's own MK_START_L2 is
    taken alone, so the kernel's default half (none) goes with it and the subset assert holds."""
    monkeypatch.delenv("HIPENGINE_MK_DEFINES", raising=False)
    monkeypatch.delenv("HIPENGINE_MK_LL", raising=False)

    def masks(*a, **k):
        d = mk.compile_args(*a, **k)["defines"]
        return d.get("MK_START_L2"), d.get("MK_START_L2_HALF")

    assert masks("nvidia", False, 4, max_context=1024) == (7, 7)
    assert masks("nvidia", False, 4, q_regs=True, max_context=32768) == (None, None)
    assert masks("nvidia", False, 4, tp=True) == (None, None)
    assert masks("nvidia", False, 4, mlp_packed=True) == (None, None)
    assert masks("nvidia", False, 4, fused_mlp=True) == (None, None)
    assert masks("amd", False, 4) == (None, None)
    monkeypatch.setenv("HIPENGINE_MK_DEFINES", "MK_START_L2=0")
    assert masks("nvidia", False, 4) == (0, None)
    monkeypatch.setenv("HIPENGINE_MK_DEFINES", "MK_START_L2=6,MK_START_L2_HALF=2")
    assert masks("nvidia", False, 4) == (6, 2)


def test_attention_build_follows_the_cache_size(monkeypatch):
    """The split keeps the warp's running max below ops.ATTN_WARP_MAX_CTX tokens of KV cache and the lane
    group's from there; the monokernel takes the per-op module's attention defines for the same cache, so
    the paths stay bit-identical; HIPENGINE_ATTN_WARP_MAX forces either build; a bad value is one error."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    monkeypatch.delenv("HIPENGINE_ATTN_WARP_MAX", raising=False)
    for n, want in ((1024, 1), (ops.ATTN_WARP_MAX_CTX - 1, 1), (ops.ATTN_WARP_MAX_CTX, 0), (32768, 0)):
        d = mk.compile_args("nvidia", False, 4, head_dim=64, max_context=n)["defines"]
        assert d["HE_ATTN_WARP_MAX"] == want and d["HE_ATTN_HD"] == 64 and d["HE_ATTN_LPR"] == 8
        assert {k: d[k] for k in ops.attention_defines(64, n)} == ops.attention_defines(64, n)
    monkeypatch.setenv("HIPENGINE_ATTN_WARP_MAX", "0")
    assert ops.attention_defines(128, 1024)["HE_ATTN_WARP_MAX"] == 0
    monkeypatch.setenv("HIPENGINE_ATTN_WARP_MAX", "maybe")
    with pytest.raises(UnsupportedError, match="HIPENGINE_ATTN_WARP_MAX"):
        ops.attn_warp_max(1024)


def test_attention_mma_build_follows_the_target(monkeypatch):
    """The matrix-core split (HE_ATTN_MMA) is built only for a target with port.h's matrix-core tiles and a
    head_dim that is a multiple of 16, by ops.ATTN_MMA_DEFAULT or HIPENGINE_ATTN_MMA=0|1; the monokernel takes
    the per-op module's choice (same defines: bit-identical paths) and sizes its shared memory for that body."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    for raw in ("1", "0"):
        monkeypatch.setenv("HIPENGINE_ATTN_MMA", raw)
        on = raw == "1"
        for arch, hd, want in (("sm_90", 64, on), ("sm_80", 128, on), ("gfx942", 64, on), ("sm_75", 64, False),
                               ("gfx1100", 64, False), ("sm_90", 24, False), ("gfx942", 256, False),
                               (None, 64, False)):
            assert ops.attn_mma(arch, hd) is want, (arch, hd)
            assert ("HE_ATTN_MMA" in ops.attention_defines(hd, 1024, arch)) is want
        d = mk.compile_args("nvidia", False, 4, head_dim=64, max_context=1024, arch="sm_90")["defines"]
        assert d.get("HE_ATTN_MMA", 0) == int(on)
        assert {k: d[k] for k in ops.attention_defines(64, 1024, "sm_90")} == ops.attention_defines(64, 1024, "sm_90")
    # shared memory: q hi/lo tiles, then per warp a 16-key K tile and a Vᵀ tile (attention_decode.hip)
    assert ops.attention_shared_bytes(4, 64, 32, True) == 2 * 4 * 72 * 2 + 8 * (16 * 72 + 64 * 24) * 2
    assert ops.attention_shared_bytes(4, 64, 32, False) == (4 * 64 + 8 * 4 * 66) * 4
    assert ops.attention_shared_bytes(8, 128, 64, True) < 227 * 1024
    monkeypatch.setenv("HIPENGINE_ATTN_MMA", "yes")
    with pytest.raises(UnsupportedError, match="HIPENGINE_ATTN_MMA"):
        ops.attn_mma("sm_90", 64)


def test_precompile_covers_every_cache_class(monkeypatch):
    """precompile fills the cache with the per-op attention module and the monokernel of each cache-size class
    (either side of LONG_CONTEXT and of ops.ATTN_WARP_MAX_CTX), each build once: NVRTC is not called here."""
    from hipengine.gpu import backend_cuda as bc, compiler, ops

    seen = []
    monkeypatch.setattr(compiler, "cached_build",
                        lambda text, d, arch, key_opts, *a: seen.append((text, tuple(key_opts))))
    monkeypatch.setattr(bc, "nvrtc_id", lambda: "test")
    monkeypatch.delenv("HIPENGINE_ATTN_WARP_MAX", raising=False)
    mk.precompile("sm_90", groups=(4,))
    assert len(seen) == len(set(seen))
    keys = [k for _, k in seen]
    for n in (1024, 32768):
        want = {f"-D{k}={v}" for k, v in ops.attention_defines(64, n).items()}
        assert any(want <= set(k) and not any("MK_ATTN_G" in o for o in k) for k in keys), n  # per-op module
        assert any(want <= set(k) and "-DMK_ATTN_G=4" in k for k in keys), n                  # monokernel


def test_compile_args_lean_builds(monkeypatch):
    """The stream drops its predicated paths only when every row it reads is a whole number of pairs (2 batches
    of unroll · warp · 8 columns: 2,048 on NVIDIA, 4,096 on AMD's wave64); the q/k-norm stage and the fine = 2
    combine are compiled into the builds that run them only; HIPENGINE_MV_WHOLE_PAIRS=0 turns the first off."""
    from hipengine.gpu import ops

    monkeypatch.delenv("HIPENGINE_MV_WHOLE_PAIRS", raising=False)
    monkeypatch.delenv("HIPENGINE_MK_UNROLL", raising=False)
    d = lambda *a, **k: mk.compile_args(*a, **k)["defines"]  # noqa: E731
    assert d("nvidia", False, 4, rows=(2048, 2048, 8192))["HE_MV_WHOLE_PAIRS"] == 1
    assert "HE_MV_WHOLE_PAIRS" not in d("nvidia", False, 4, rows=(2048, 1024, 4096))   # tp = 2 ranks' O-proj
    assert "HE_MV_WHOLE_PAIRS" not in d("amd", False, 4, rows=(2048, 2048, 8192))      # wave64: 4,096-column pairs
    assert d("amd", False, 4, rows=(4096, 4096, 12288))["HE_MV_WHOLE_PAIRS"] == 1
    assert d("nvidia", False, 4, rows=(4096, 4096, 14336))["HE_MV_WHOLE_PAIRS"] == 1  # llama-3.1-8b
    assert "HE_MV_WHOLE_PAIRS" not in d("nvidia", False, 4)
    assert "HE_MV_WHOLE_PAIRS" not in d("nvidia", False, 4, rows=(1536, 1536, 8960))   # qwen2.5-1.5b
    monkeypatch.setenv("HIPENGINE_MV_WHOLE_PAIRS", "0")
    assert "HE_MV_WHOLE_PAIRS" not in d("nvidia", False, 4, rows=(2048, 2048, 8192))
    assert ops.whole_pairs(2048, 4, 32) == {}
    monkeypatch.delenv("HIPENGINE_MV_WHOLE_PAIRS")
    assert ops.whole_pairs(8192, 8, 32) == {"HE_MV_WHOLE_PAIRS": 1} and ops.whole_pairs(2048, 8, 32) == {}
    assert "MK_QK_NORM" not in d("nvidia", False, 4) and d("nvidia", False, 4, qk_norm=True)["MK_QK_NORM"] == 1
    assert "MK_FINE2" not in d("nvidia", False, 4) and d("nvidia", False, 4, fine=2)["MK_FINE2"] == 1


def test_o_group_shape_rule_and_build(monkeypatch):
    """The grouped O-proj (HIPENGINE_MK_OGROUP, decode.hip MK_O_GROUP): which shapes it can serve (a group's G·hd
    columns 8 x a power of two from 16 lanes to the warp, whole tiles of a block's rows, a block per (group, tile)),
    and the define compile_args adds; off by default."""
    from hipengine.gpu import monokernel as M
    from hipengine.gpu import ops as O

    assert O.o_group_misfit(4, 64, 2048, 8, 132, 32) is None      # llama-3.2-1b on an H200: 128 blocks of 132
    assert O.o_group_misfit(4, 64, 2048, 8, 304, 64) is None      # ... on an MI300X (wave64: 2 rows per load)
    assert "192 columns" in O.o_group_misfit(3, 64, 576, 3, 132, 32)
    assert "more blocks" in O.o_group_misfit(4, 64, 2048, 8, 120, 32)
    assert "whole tiles" in O.o_group_misfit(4, 64, 2000, 8, 132, 32)
    monkeypatch.delenv("HIPENGINE_MK_OGROUP", raising=False)
    assert not M.o_group_on()
    monkeypatch.setenv("HIPENGINE_MK_OGROUP", "1")
    assert M.o_group_on()
    kw = M.compile_args("nvidia", False, 4, head_dim=64, max_context=1024, arch="sm_90", rows=(2048, 2048, 8192),
                        o_group=True)
    assert kw["defines"]["MK_O_GROUP"] == 1
    assert "MK_O_GROUP" not in M.compile_args("nvidia", False, 4, head_dim=64, max_context=1024)["defines"]


def test_q_flow_rule_and_build(monkeypatch):
    """MK_QFLOW (HIPENGINE_MK_QFLOW, decode.hip: the attention splits poll the QKV stage's LL words): which builds it
    can serve (the grouped O-proj, tp = 1, no q/k norms, the matrix-core split), the define compile_args adds (only
    with the grouped O-proj), one clear error when asked for where it cannot serve, off when not asked."""
    from types import SimpleNamespace

    from hipengine.errors import UnsupportedError
    from hipengine.gpu import monokernel as M

    cfg = SimpleNamespace(qk_norm=False, head_dim=64)
    monkeypatch.delenv("HIPENGINE_ATTN_MMA", raising=False)
    monkeypatch.setenv("HIPENGINE_MK_QFLOW", "1")
    assert M.q_flow_decide(cfg, "sm_90", o_group=True, tp=False)
    for why, args in [("tensor parallelism", (cfg, "sm_90", True, True)),
                      ("plain O-proj", (cfg, "sm_90", False, False)),
                      ("q/k-norm", (SimpleNamespace(qk_norm=True, head_dim=64), "sm_90", True, False)),
                      ("FMA attention split", (cfg, None, True, False))]:
        assert why in M.q_flow_why_not(*args)
        with pytest.raises(UnsupportedError, match="HIPENGINE_MK_QFLOW=1"):
            M.q_flow_decide(*args)
    monkeypatch.setenv("HIPENGINE_MK_QFLOW", "0")
    assert not M.q_flow_decide(cfg, "sm_90", o_group=True, tp=False)
    monkeypatch.delenv("HIPENGINE_MK_QFLOW")
    assert M.q_flow_decide(cfg, "sm_90", o_group=True, tp=False) == M.Q_FLOW_DEFAULT
    kw = dict(head_dim=64, max_context=1024, arch="sm_90", rows=(2048, 2048, 8192))
    assert M.compile_args("nvidia", False, 4, o_group=True, q_flow=True, **kw)["defines"]["MK_QFLOW"] == 1
    assert "MK_QFLOW" not in M.compile_args("nvidia", False, 4, o_group=True, **kw)["defines"]
    assert "MK_QFLOW" not in M.compile_args("nvidia", False, 4, o_group=False, q_flow=True, **kw)["defines"]
    fewer = M.barriers_per_token(SimpleNamespace(num_layers=16, qk_norm=False), q_flow=True)
    assert fewer == M.barriers_per_token(SimpleNamespace(num_layers=16, qk_norm=False)) - 16


def test_l2_persist_kv_switch_or_one_clear_error(monkeypatch):
    """HIPENGINE_L2_PERSIST_KV: off unless 1, 0 / 1 only, anything else one clear error; a runtime without the control
    (the base class: AMD) sets nothing aside and its reset is a no-op."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops as O
    from hipengine.gpu.runtime import Runtime

    monkeypatch.delenv("HIPENGINE_L2_PERSIST_KV", raising=False)
    assert O.l2_persist_kv() is False
    monkeypatch.setenv("HIPENGINE_L2_PERSIST_KV", "1")
    assert O.l2_persist_kv() is True
    monkeypatch.setenv("HIPENGINE_L2_PERSIST_KV", "0")
    assert O.l2_persist_kv() is False
    monkeypatch.setenv("HIPENGINE_L2_PERSIST_KV", "yes")
    with pytest.raises(UnsupportedError, match="HIPENGINE_L2_PERSIST_KV"):
        O.l2_persist_kv()
    assert Runtime.l2_persist(object(), None, 0, 1 << 20) == 0
    assert Runtime.l2_persist_reset(object()) is None


def test_carveout_is_a_percentage_or_one_clear_error(monkeypatch):
    """HIPENGINE_MK_CARVEOUT: unset or empty is -1 (the driver's choice), 0-100 is that percentage, anything else one
    clear error; AMD's Function has nothing to prefer."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu.backend_hip import Function

    monkeypatch.delenv("HIPENGINE_MK_CARVEOUT", raising=False)
    assert mk.carveout() == -1
    for ok in ("0", "100", "25"):
        monkeypatch.setenv("HIPENGINE_MK_CARVEOUT", ok)
        assert mk.carveout() == int(ok)
    for bad in ("-1", "101", "max", "0.5"):
        monkeypatch.setenv("HIPENGINE_MK_CARVEOUT", bad)
        with pytest.raises(UnsupportedError, match="HIPENGINE_MK_CARVEOUT"):
            mk.carveout()
    assert Function(None, None, "k").prefer_carveout(0) is None
