"""The all-reduce flag/epoch protocol, on the CPU: ranks x blocks as threads, memory as dicts.

The correct protocol survives 10,000 back-to-back rounds (mixed one-shot/two-shot, two message sizes, random
delays) for world sizes 2, 4, 8 with exact integer sums and no deadlock; the two classic bugs are caught."""
import ctypes

import pytest

from hipengine.comm.allreduce import (MAX_RANKS, ArLayout, ArPeerTable, ProtocolModel, reached,
                                      status_message)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_10000_rounds_no_race_no_deadlock(world):
    # blocks=2, tile=2: sizes 4 and 7 give 2 and 4 tiles, so both blocks work, chunks span blocks, and the
    # last tile of size 7 is partial; for world 8 some ranks own empty chunks.
    m = ProtocolModel(world, nblocks=2, tile_elems=2, delay_p=0.02, seed=world)
    errors = m.run(4000 // (world // 2), sizes_elems=(4, 7, 1))  # the 10,000-round runs are below
    assert errors == []


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ll_rounds(world):
    # LL: the epoch inside every word; mixed with the flag-based algorithms (separate epoch counters)
    m = ProtocolModel(world, nblocks=2, tile_elems=2, delay_p=0.02, seed=21 + world)
    assert m.run(3000 // world, sizes_elems=(4, 7, 1), algos=("ll", "oneshot", "ll", "twoshot")) == []


def test_ll_single_buffer_race_is_caught():
    hook = lambda r, vb, e, point: 0.05 if (r == 1 and e == 1 and point == "sum") else 0
    m = ProtocolModel(2, nblocks=1, tile_elems=2, double_buffer=False, delay_p=0, delay_hook=hook, timeout_s=1)
    assert m.run(4, sizes_elems=(2,), algos=("ll",)) != []


@pytest.mark.parametrize("world", [2, 8])
def test_device_epochs_mixed_rounds(world):
    # the _graph kernels' per-block counters: blocks skipped for small messages advance on no rank
    m = ProtocolModel(world, nblocks=2, tile_elems=2, delay_p=0.02, seed=11 + world, device_epochs=True)
    assert m.run(3000 // (world // 2), sizes_elems=(4, 7, 1)) == []


@pytest.mark.parametrize("world", [2, 4, 8])
def test_full_10000_rounds_oneshot(world):
    m = ProtocolModel(world, nblocks=1, tile_elems=1, delay_p=0.01, seed=7)
    assert m.run(10_000, sizes_elems=(1,), algos=("oneshot",)) == []


def test_single_buffer_race_is_caught():
    # Rank 1 stalls after seeing round 1's flags, before summing; rank 0 meanwhile starts round 2 and, with
    # one buffer, overwrites the slot rank 1 is about to read.
    hook = lambda r, vb, e, point: 0.05 if (r == 1 and e == 1 and point == "read") else 0
    m = ProtocolModel(2, nblocks=1, tile_elems=1, double_buffer=False, delay_p=0, delay_hook=hook, timeout_s=1)
    errors = m.run(4, sizes_elems=(1,), algos=("oneshot",))
    assert any("got" in e for e in errors), errors
    # the same schedule with parity buffers is fine
    m = ProtocolModel(2, nblocks=1, tile_elems=1, delay_p=0, delay_hook=hook, timeout_s=1)
    assert m.run(4, sizes_elems=(1,), algos=("oneshot",)) == []


def test_chunk_relative_slots_race_is_caught():
    # The first kernel version addressed reduce-scatter slots inside the chunk; when the message size
    # changes, a slot's writer block changes and the per-block ordering argument no longer holds.
    m = ProtocolModel(2, nblocks=2, tile_elems=2, chunk_relative=True, delay_p=0.05, seed=2, timeout_s=2)
    assert any("got" in e for e in m.run(3000, sizes_elems=(4, 7, 1), algos=("twoshot",))), "race not found"


def test_flag_reset_race_is_caught_as_timeout():
    # Boolean flags cleared by the reader: rank 0's round-2 "ready" lands before rank 1 clears round 1's,
    # the clear erases it, and rank 1 waits forever -> the timeout reports instead of hanging.
    hook = lambda r, vb, e, point: 0.05 if (r == 1 and e == 1 and point == "consume") else 0
    m = ProtocolModel(2, nblocks=1, tile_elems=1, reset_flags=True, delay_p=0, delay_hook=hook, timeout_s=0.5)
    errors = m.run(4, sizes_elems=(1,), algos=("oneshot",))
    assert any("timed out waiting for rank 0" in e for e in errors), errors


def test_epoch_compare_is_wrap_safe():
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(0, 0xFFFFFFFF) and reached(3, 0xFFFFFFFE) and not reached(0xFFFFFFFF, 2)
    assert not reached(0, 1)  # fresh flags (0) never satisfy the first round (epoch 1)


def test_layout_and_table():
    L = ArLayout(world=4, nblocks=8, tile_bytes=4096, max_bytes=1 << 20)
    assert L.off_os >= L.flags_bytes and L.off_rs > L.off_os and L.off_ag > L.off_rs
    assert L.off_ll == L.off_ag + 2 * L.slot_bytes and L.total_bytes == L.off_ll + 4 * 4 * L.slot_bytes
    assert L.grid(4096) == 1 and L.grid(16 * 1024) == 4 and L.grid(1 << 20) == 8
    # every tile is owned by exactly one virtual block
    tiles = sorted(t for vb in range(8) for t in L.tiles_of_block(vb, 100_000))
    assert tiles == list(range(L.ntiles(100_000)))
    t = L.table(2, [0x1000 * (i + 1) for i in range(4)], 0xBEEF0, 10**9)
    raw = bytes(t)
    assert len(raw) == 144 and ctypes.sizeof(ArPeerTable) == 144
    assert int.from_bytes(raw[64:72], "little") == 0xBEEF0  # offsetof(status) == 64, as static_asserted
    assert int.from_bytes(raw[72:76], "little") == 2 and MAX_RANKS == 8
    assert "rank 3" in status_message(0x10000 | (2 << 8) | 3) and "all-gather" in status_message(0x10203)


def test_nccl_table_and_missing_library(monkeypatch, tmp_path):
    import os

    from hipengine.comm import nccl
    from hipengine.errors import DeviceError

    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # set at import, before any library load
    for name in ("ncclGetUniqueId", "ncclCommInitAll", "ncclAllReduce", "ncclGroupStart", "ncclGroupEnd",
                 "ncclCommDestroy", "ncclGetErrorString", "ncclGetVersion"):
        assert name in nccl.PROTOTYPES
    assert ctypes.sizeof(nccl.ncclUniqueId) == 128 and nccl.DTYPES["bfloat16"] == 9
    assert nccl.raw_stream(None) == 0 and nccl.raw_stream(type("S", (), {"handle": 1234})()) == 1234
    monkeypatch.setenv("HIPENGINE_NCCL_LIB", str(tmp_path / "libnccl.so.2"))
    monkeypatch.setattr(nccl, "_LIB", None)
    with pytest.raises(DeviceError, match="cannot load"):
        nccl.lib()
    monkeypatch.delenv("HIPENGINE_NCCL_LIB")
    try:
        nccl.library_path()
    except DeviceError as e:
        assert "\n" not in str(e) and "nvidia-nccl-cu13" in str(e)


def test_auto_pick_follows_measurements():
    from hipengine.comm.allreduce import CustomAllReduce

    c = object.__new__(CustomAllReduce)  # pick() needs only the world size
    c.world = 2
    assert c.pick(4096) == "ll" and c.pick(512 * 1024) == "ll" and c.pick(4 << 20) == "oneshot"
    c.world = 8
    assert c.pick(16 * 1024) == "ll" and c.pick(4 << 20) == "twoshot"
