"""TpMonokernelBackend: tensor-parallel decode in the monokernel, one process driving GPUs 0..tp-1.

Every rank runs the single-GPU monokernel (kernels_hip/monokernel/decode.hip) on its ``ShardPlan`` shard —
its query/KV heads, its FFN columns, its slice of the LM head — and the ranks exchange, inside the kernel,
what tensor parallelism needs and nothing else (kernels_hip/monokernel/tp_exchange.h):

* the O-proj and down-proj partial sums: each row is pushed by the matvec epilogue as an 8-byte LL word
  {value, epoch} into every rank's exchange region, and the next stage's blocks gather and sum the d
  values in rank order (rank 0's term carries the residual, as in the per-op TP path, so the two paths
  agree bit for bit). This replaces two of the four grid barriers of each layer;
* one greedy candidate per rank (logit, global token id, cancel bit): every rank picks the same token
  and takes the same stop decision, so the kernels run in lockstep for the whole generation loop.

The host launches every rank's kernel (cooperative launch, one stream per GPU) after preparing all of them
(the exchange regions are zeroed before any kernel starts), then streams tokens from rank 0's mapped ring.
A rank whose peer never delivers reports "tensor-parallel peer exchange timeout" instead of hanging.

What stays on the per-op TP path (TpGpuBackend, the parent class): prefill, and sampled generation
(temperature / top-k / top-p / min-p / repetition penalty), which needs the whole vocabulary's logits on one
device. Greedy generation — the latency case — and single decode steps run in the monokernel.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..backend import SamplingParams
from ..errors import DeviceError, UnsupportedError
from .monokernel import MK_STATUS, MonokernelBackend
from .tp_executor import TpGpuBackend, TpRank


class TpMkRank(TpRank, MonokernelBackend):
    """One rank: the monokernel on its shard (and, through TpRank, the per-op executor for prefill), built
    with the LL exchange (MK_TP=1). Its _prepare zeroes the exchange region; TpMonokernelBackend prepares every
    rank before starting any."""

    mk_tp = True


class TpMonokernelBackend(TpGpuBackend):
    rank_cls = TpMkRank

    def __init__(self, loaded, max_context: int | None = None, tp: int = 2, monokernel: bool = True,
                 allreduce: str = "custom", devices: list[int] | None = None):
        from ..comm.shard import ShardPlan
        from .runtime import get_runtime

        ShardPlan(loaded.config, tp)  # an unsplittable shape is refused before any GPU is touched
        for dev in (list(range(tp)) if devices is None else devices):  # before any weight is uploaded
            if not getattr(get_runtime(dev), "cooperative_launch", False):
                raise UnsupportedError(f"GPU {dev} has no cooperative launch: the monokernel cannot run there; "
                                       "use --no-monokernel")
        super().__init__(loaded, max_context=max_context, tp=tp, monokernel=True, allreduce=allreduce,
                         devices=devices)
        try:
            self._init_exchange()
        except BaseException:
            self.close()
            raise

    def _init_exchange(self) -> None:
        rts, world = self.rts, self.tp
        for i, a in enumerate(rts):
            for j, b in enumerate(rts):
                if i != j and not a.can_access_peer(b):
                    raise UnsupportedError(f"GPU {self.devices[i]} cannot access GPU {self.devices[j]}'s memory "
                                           "(no peer access): the tensor-parallel monokernel needs it; use "
                                           "--no-monokernel")
        for i, a in enumerate(rts):
            for j, b in enumerate(rts):
                if i != j:
                    a.enable_peer_access(b)
        for rk in self.ranks:
            rk.alloc_exchange(world)
        bases = [rk.ll_buf.ptr for rk in self.ranks]
        for r, rk in enumerate(self.ranks):
            rk.tp_world, rk.tp_rank, rk.vocab_off = world, r, self.vocab_offsets[r]
            rk.set_exchange_table(bases)
        for rt in rts:
            rt.synchronize()
        self.W = self.ranks[0].W
        self.timeout_ns = self.ranks[0].timeout_ns

    # ---- what MonokernelBackend._stream / generate_from_state use ---------------------------------------
    @property
    def host_words(self):
        return self.ranks[0].host_words

    @property
    def ring(self):
        return self.ranks[0].ring

    def _where(self) -> str:
        return "GPUs " + ", ".join(str(rt.device_index) for rt in self.rts)

    def _launch(self, mode: int, token: int, pos: int, hist_len: int, params: SamplingParams | None = None,
                eos: list[int] = (), seed: int = 0) -> None:
        if params is not None and (params.temperature > 0 or params.repetition_penalty != 1.0):
            raise UnsupportedError("the tensor-parallel monokernel decodes greedily; sampled generation runs on "
                                   "the per-op TP path (generate_ids routes it there)")
        for rk in self.ranks:
            rk._prepare(mode, token, pos, hist_len, params, eos, seed)
        for rk in self.ranks:  # every region zeroed and every parameter block in place: start them all
            rk._start()

    def _cancel(self) -> None:
        for rk in self.ranks:  # each rank reads its own word; the token exchange ORs them (same stop everywhere)
            rk.host_words[rk.W["cancel"]] = 1
        self.cancel_seen_at = int(self.host_words[self.W["write_idx"]])

    def _finish(self) -> None:
        for rk in self.ranks:
            rk.stream.synchronize()
        statuses = [int(rk.host_words[rk.W["status"]]) for rk in self.ranks]
        bad = [(r, s) for r, s in enumerate(statuses) if s != 1]
        if bad:
            what = "; ".join(f"rank {r} (GPU {self.devices[r]}): {MK_STATUS.get(s, f'unknown status {s}')}"
                             for r, s in bad)
            raise DeviceError(f"tensor-parallel monokernel failed: {what} (after "
                              f"{int(self.host_words[self.W['write_idx']])} tokens); "
                              "set HIPENGINE_MK_TIMEOUT_S higher or use --no-monokernel")

    # The single-GPU host protocol, run over this class's _launch / _finish / _cancel (every rank) and rank 0's
    # ring: one decode step (the full logits: every rank's slice) and the streaming generation loop.
    decode = MonokernelBackend.decode
    generate_from_state = MonokernelBackend.generate_from_state
    _stream = MonokernelBackend._stream

    # ---- Backend API ------------------------------------------------------------------------------------
    def generate_ids(self, prompt_ids, params: SamplingParams,
                     should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
        if params.temperature > 0 or params.repetition_penalty != 1.0:
            # sampling needs the whole vocabulary's logits in one place: the per-op TP path (host sampler)
            yield from TpGpuBackend.generate_ids(self, prompt_ids, params, should_stop)
            return
        prompt = self.check_prompt(prompt_ids)
        if should_stop():
            return
        self.reset()
        self.prefill(prompt)  # the last prompt row's logits are in row 0 of every rank's logits buffer
        for rk in self.ranks:
            rk.rt.copy_htod(rk.history, prompt.astype(np.int32), stream=rk.stream)
        yield from self.generate_from_state(0, int(prompt.size), params, should_stop, embed_first=False)

    def generate_from_state_greedy(self, token: int, n: int) -> Iterator[int]:
        """Greedy decode of n tokens from the current position and KV cache, starting with a decode step of
        ``token`` (benchmarks at long context; the monokernel counterpart of decode_from)."""
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        yield from self.generate_from_state(int(token), 0, params)

    def resize_context(self, max_context: int) -> None:
        """New KV cache, RoPE tables, attention plan and launch set-up on every rank (weights, exchange
        regions and peer mappings kept); the per-op path's graphs are recaptured on next use."""
        self._drop_graphs()
        self.max_context = int(max_context)
        for rk in self.ranks:
            MonokernelBackend.resize_context(rk, self.max_context)
        self.pos = 0
