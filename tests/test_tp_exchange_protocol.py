"""The tensor-parallel monokernel's exchange protocol (kernels_hip/monokernel/tp_exchange.h) as a CPU model.

Ranks x blocks run as threads through decode.hip's stage order at tp > 1:

  select:  every block arg-maxes its slice, the last to arrive leads; leaders exchange candidates (region C)
           and merge them; every block advances the candidate epoch          -- grid barrier --
  layer l: (l > 0) gather D(l-1) -- QKV -- grid barrier -- attention -- push O(l) rows
           -- gather O(l) -- gate/up -- grid barrier -- push D(l) rows          (no barrier after O or D)
  head:    gather D(last) -- LM head -- grid barrier

LL words are (epoch, value) tuples written with one assignment (the 8-byte store); a reader polls a word
until it holds exactly the epoch it expects, as mk_ll_wait does. Regions are never double-buffered: the model
checks the slot-reuse argument in tp_exchange.h's header under random delays, for 2, 4 and 8 ranks, by
verifying every gathered value (integer partials: exact sums) and that all ranks pick the same tokens. The
mutations show the model can fail: the first version's bug (only the leading block advanced the candidate
epoch) and a missing gate/up -> down barrier (region O overwritten before a slow block gathered it) both
end in a reported timeout or a wrong value.
"""
import random
import threading
import time

import pytest

from hipengine.gpu.monokernel import ll_words

O_, D_, C_ = 0, 1, 2  # MkLlRegion


class ExchangeModel:
    def __init__(self, world, blocks=4, d=6, layers=3, steps=3, seed=0, leader_only_epoch=False,
                 no_gate_up_barrier=False, slow_rowless=0.0, timeout=10.0):
        self.world, self.B, self.d, self.L, self.steps = world, blocks, d, layers, steps
        self.leader_only_epoch, self.no_gate_up_barrier, self.timeout = leader_only_epoch, no_gate_up_barrier, timeout
        # Row r belongs to block r % blocks, as matvec units go to warps: with blocks > d some blocks push no
        # row at all (the 1B shape's O-proj: 1,024 units for 1,056 warps). Nothing waits for such a block's
        # gather except the grid barriers; slow_rowless (s) delays rank 0's such gathers to show that.
        self.slow_rowless = slow_rowless
        self.mem = [[(0, 0)] * ll_words(world, d) for _ in range(world)]  # zeroed before the launch
        self.bars = [threading.Barrier(blocks, timeout=timeout) for _ in range(world)]
        self.arrive = [0] * world
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.errors, self.tokens = [], [[] for _ in range(world)]

    def off(self, region, src):  # mk_ll_off
        return region * self.world * self.d + src * (2 if region == C_ else self.d)

    def delay(self):
        with self.lock:
            t = self.rng.random()
        if t < 0.3:
            time.sleep(t * 1e-3)

    def wait_word(self, rank, idx, epoch):
        t0 = time.monotonic()
        while True:
            e, v = self.mem[rank][idx]
            if e == epoch:
                return v
            if time.monotonic() - t0 > self.timeout:
                raise TimeoutError(f"rank {rank} word {idx} stuck at epoch {e}, waiting for {epoch}")
            time.sleep(0)

    @staticmethod
    def partial(region, s, r, step, layer):  # rank s's value for row r: small integers, exact sums
        return (region + 1) * 100000 + s * 1000 + r * 31 + step * 7 + layer * 3

    def push(self, rank, b, region, epoch, step, layer):  # MkMvOut::epi for this block's rows
        for r in range(b, self.d, self.B):
            self.delay()
            for dst in range(self.world):
                self.mem[dst][self.off(region, rank) + r] = (epoch, self.partial(region, rank, r, step, layer))

    def gather(self, rank, b, region, epoch, step, layer):  # mk_ll_gather: every row, every source, rank order
        if self.slow_rowless and b >= self.d and rank == 0:  # rank 0's row-less blocks lag; its peers do not
            time.sleep(self.slow_rowless)
        for r in range(self.d):
            got = sum(self.wait_word(rank, self.off(region, s) + r, epoch) for s in range(self.world))
            want = sum(self.partial(region, s, r, step, layer) for s in range(self.world))
            if got != want:
                raise AssertionError(f"rank {rank} region {region} row {r} epoch {epoch}: {got} != {want}")

    def candidate(self, rank, step):  # this rank's best (logit, global index): ties exercise the rule
        return (step * 5 + rank * 3) % 4, rank * 1000 + step

    def block(self, rank, b):
        ep_o = ep_d = ep_c = 0
        bar = self.bars[rank]
        for step in range(self.steps):
            # select: the last block to arrive leads (mk_argmax_grid + he_arrive_last)
            self.delay()
            with self.lock:
                self.arrive[rank] += 1
                leads = self.arrive[rank] == self.B
                if leads:
                    self.arrive[rank] = 0
            if not self.leader_only_epoch:
                ep_c += 1
            if leads:
                if self.leader_only_epoch:
                    ep_c += 1
                val, idx = self.candidate(rank, step)
                for dst in range(self.world):
                    self.mem[dst][self.off(C_, rank)] = (ep_c, val)
                    self.mem[dst][self.off(C_, rank) + 1] = (ep_c, idx)
                best = None
                for s in range(self.world):  # rank order; ties to the smaller index
                    v = self.wait_word(rank, self.off(C_, s), ep_c)
                    i = self.wait_word(rank, self.off(C_, s) + 1, ep_c)
                    if best is None or v > best[0] or (v == best[0] and i < best[1]):
                        best = (v, i)
                self.tokens[rank].append(best[1])
            bar.wait()
            for layer in range(self.L):
                if layer > 0:
                    self.gather(rank, b, D_, ep_d, step, layer - 1)
                self.delay()  # QKV
                bar.wait()
                self.delay()  # attention, then the heads-combined counter
                ep_o += 1
                self.push(rank, b, O_, ep_o, step, layer)
                self.gather(rank, b, O_, ep_o, step, layer)
                self.delay()  # gate/up
                if not self.no_gate_up_barrier:
                    bar.wait()
                ep_d += 1
                self.push(rank, b, D_, ep_d, step, layer)
            self.gather(rank, b, D_, ep_d, step, self.L - 1)
            self.delay()  # LM head
            bar.wait()

    def run(self):
        def worker(rank, b):
            try:
                self.block(rank, b)
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(e).__name__}: {e}")
                self.bars[rank].abort()

        ts = [threading.Thread(target=worker, args=(r, b)) for r in range(self.world) for b in range(self.B)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return self


def _want_tokens(m):
    return [max((m.candidate(s, t) for s in range(m.world)), key=lambda c: (c[0], -c[1]))[1] for t in range(m.steps)]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("blocks,slow", [(4, 0.0), (8, 2e-3)])  # 8 blocks, 6 rows: two push nothing
def test_exchange_protocol_exact_sums_and_same_tokens(world, seed, blocks, slow):
    m = ExchangeModel(world, blocks=blocks, seed=seed, slow_rowless=slow).run()
    assert m.errors == []
    assert all(t == _want_tokens(m) for t in m.tokens)


def test_leader_only_candidate_epoch_is_caught():
    """session 4's first build: only the leading block advanced ep_c; the leader changes from token to token."""
    caught = 0
    for seed in range(6):
        m = ExchangeModel(2, blocks=4, steps=6, seed=seed, leader_only_epoch=True, timeout=0.3).run()
        caught += bool(m.errors)
    assert caught >= 3


def test_missing_gate_up_barrier_is_caught():
    """The gate/up -> down barrier is what keeps region O from being reused under a block that pushes no
    row: without it a peer, fed by every row-owning block's D(l), writes O(l+1) while that block still
    gathers O(l), which then never sees its epoch."""
    m = ExchangeModel(2, blocks=8, layers=3, seed=0, no_gate_up_barrier=True, slow_rowless=0.05, timeout=0.3).run()
    assert any("waiting for" in e or "!=" in e for e in m.errors), m.errors
    ok = ExchangeModel(2, blocks=8, layers=3, seed=0, slow_rowless=0.05, timeout=0.3).run()
    assert ok.errors == []
