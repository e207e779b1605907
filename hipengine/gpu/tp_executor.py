"""TpGpuBackend: tensor-parallel decode on the per-op GPU path, one process driving GPUs 0..tp-1.

Each rank is a ``GpuBackend`` built from the ``ShardPlan`` slices of the model (its query/KV heads, its FFN
columns, its vocabulary range of the LM head; embedding and norms replicated), so every launch is the
single-GPU executor's own code. What tensor parallelism adds lives at the two partial-sum points of each
layer, where ``GpuBackend._decode_steps`` / ``_prefill_steps`` yield:

* rank 0 writes its O-proj / down output in place on the residual stream (x + W₀·a, exactly as at tp=1);
  every other rank writes its bare partial sum W_r·a into a scratch buffer ``y``;
* the driver then all-reduces {x₀, y₁, .., y_{tp-1}} into every rank's x. The residual rides along in
  rank 0's term, so no separate add is needed, and because the all-reduce sums in a fixed rank order every
  rank ends up with a bitwise-identical x (the next layer's inputs agree across GPUs, as they must).

The all-reduce is the custom one over peer-mapped memory (``allreduce="custom"``; device-side epochs, so it
can live inside captured graphs) or NCCL/RCCL (``allreduce="nccl"``). Decode is one captured graph per rank
(``capture_graphs``: every rank's stream captured at once while one thread issues the layers in lockstep);
prefill runs eagerly per rank in 8-token chunks with the same lockstep.

LM head: vocab-parallel. Greedy decoding (no repetition penalty) picks on the device per rank (the sampling
kernel at temperature 0 over the rank's slice) and exchanges only (logit, global index) pairs, merged on
the host with ties to the lower index (``merge_argmax``) — the same token np.argmax picks over the full
vocabulary. Temperature / top-k / top-p / min-p / repetition-penalty sampling gathers the full logits to the
host (correctness first: tp x vocab/tp floats per token) and applies the device sampler's exact rule
(``host_sample``: same thresholds, same Philox draw keyed by (seed, position)), so a seeded request samples
what the tp=1 device sampler would from the same logits.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..backend import Backend, SamplingParams
from ..comm.shard import ShardPlan, merge_argmax
from ..errors import DeviceError, RequestError, UnsupportedError
from . import ops as O
from .executor import GpuBackend

# Host-side check of the custom all-reduce's status words (a timed-out kernel reports instead of hanging):
# every this many decode steps and at the end of every request. Each check is one small read per rank.
STATUS_CHECK_EVERY = 64


class _RankWeights(Mapping):
    """Rank r's canonical weights as lazy views (ShardPlan.slice_of), read one tensor at a time so a lazy
    preset mapping is generated, sliced, uploaded and dropped in turn. The LM head is always a separate
    slice (for a tied model a slice of ``embed``): the rank's embedding stays full-vocabulary."""

    def __init__(self, plan: ShardPlan, weights: Mapping, rank: int):
        self.plan, self.weights, self.rank = plan, weights, rank

    def __getitem__(self, name: str) -> np.ndarray:
        if name == "lm_head" and self.plan.config.tie_word_embeddings:
            return self.weights["embed"][self.plan.slice_of("lm_head", self.rank)]
        return self.weights[name][self.plan.slice_of(name, self.rank)]

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


@dataclass
class _RankModel:
    """What GpuBackend reads of a LoadedModel: the rank's config and weights."""

    config: object
    weights: Mapping


class TpRank(GpuBackend):
    """One rank: the single-GPU executor on its shard, writing partial sums where tp=1 adds in place."""

    prefill_m = O.MAX_M  # 8-token prefill chunks: the all-reduce's largest message (TpGpuBackend.prefill_m)

    def __init__(self, model: _RankModel, rank: int, max_context: int, device: int):
        self.rank = rank
        super().__init__(model, max_context=max_context, tp=1, device=device)

    def fused_mlp_ok(self) -> bool:
        return False  # the down-proj's output is this rank's partial sum for the all-reduce

    def o_group_ok(self) -> bool:
        return False  # the O-proj's output is this rank's partial sum for the all-reduce

    def _alloc_state(self) -> None:
        super()._alloc_state()
        # rank > 0: the partial-sum buffer [prefill_m, hidden] that the all-reduce adds into x
        self.y = self._buf(self.prefill_m * self.config.hidden_size * 4) if self.rank else None

    def _proj_out(self):
        return (self.x, self.x) if self.rank == 0 else (self.y, None)


def _rank_config(plan: ShardPlan, rank: int):
    # The head is uploaded as its own slice, so the rank config is untied (GpuBackend would otherwise point
    # the head at the full embedding table).
    return plan.rank_config(rank).replace(tie_word_embeddings=False)


class TpGpuBackend(Backend):
    rank_cls = TpRank  # the tensor-parallel monokernel (tp_monokernel.py) builds its ranks from a subclass
    prefill_m = TpRank.prefill_m  # GpuBackend.prefill's chunk, as every rank's

    def __init__(self, loaded, max_context: int | None = None, tp: int = 2, monokernel: bool = True,
                 allreduce: str = "custom", devices: list[int] | None = None):
        if allreduce not in ("custom", "nccl"):
            raise RequestError(f"allreduce must be custom or nccl, got {allreduce!r}")
        cfg = self.config = loaded.config
        # Unsplittable shapes fail here, in one line, before any GPU is touched.
        self.plan = ShardPlan(cfg, tp)
        self.tp, self.allreduce = tp, allreduce
        # This class is the per-op TP path; Engine picks TpMonokernelBackend (a subclass) for the monokernel.
        self.monokernel = monokernel
        self.devices = list(range(tp)) if devices is None else list(devices)
        if len(self.devices) != tp:
            raise RequestError(f"tp={tp} needs {tp} devices, got {self.devices}")
        self.max_context = int(max_context or min(cfg.max_position_embeddings, 4096))
        self.ranks: list[TpRank] = []
        self.comm = None
        self._graphs = None
        try:
            for r, dev in enumerate(self.devices):
                model = _RankModel(_rank_config(self.plan, r), _RankWeights(self.plan, loaded.weights, r))
                try:
                    self.ranks.append(self.rank_cls(model, r, self.max_context, dev))
                except (DeviceError, UnsupportedError) as e:  # say which shard of which GPU could not run
                    raise type(e)(f"tp={tp}, rank {r} (GPU {dev}): {e}") from None
            self.streams = [rk.stream for rk in self.ranks]
            self.rts = [rk.rt for rk in self.ranks]
            nbytes = self.prefill_m * cfg.hidden_size * 4  # the largest all-reduce: one prefill chunk of x (fp32)
            if allreduce == "custom":
                from ..comm.allreduce import CustomAllReduce

                self.comm = CustomAllReduce(self.devices, max_bytes=nbytes, streams=self.streams,
                                            device_epochs=True)
            else:
                from ..comm import nccl

                self.comm = nccl.NcclComm(self.devices)
        except BaseException:
            self.close()
            raise
        self.vocab_offsets = [s.vocab[0] for s in self.plan.ranks]

    # ---- positions (every rank advances in step) ---------------------------------------------------------
    @property
    def pos(self) -> int:
        return self.ranks[0].pos

    @pos.setter
    def pos(self, value: int) -> None:
        for rk in self.ranks:
            rk.pos = value

    # ---- the lockstep driver ----------------------------------------------------------------------------
    def _lockstep(self, gens: list) -> None:
        """Advance every rank's step generator to its next partial-sum point, all-reduce, repeat."""
        while True:
            rows = [next(g, None) for g in gens]
            if rows[0] is None:
                if any(r is not None for r in rows):
                    raise DeviceError("tensor-parallel ranks disagree on their launch sequence")
                return
            if len(set(rows)) != 1:
                raise DeviceError(f"tensor-parallel ranks reached a partial-sum point with rows {rows}")
            self._allreduce(rows[0])

    def _allreduce(self, rows: int) -> None:
        """x_r <- x_0 + y_1 + ... + y_{tp-1} on every rank (rank 0's x already holds residual + its part)."""
        n = rows * self.config.hidden_size
        ins = [rk._proj_out()[0] for rk in self.ranks]
        outs = [rk.x for rk in self.ranks]
        if self.allreduce == "custom":
            self.comm.allreduce(ins, outs, n * 4, "float32")
        else:
            self.comm.allreduce(ins, outs, n, "float32", streams=self.streams)

    def _issue_decode(self) -> None:
        self._lockstep([rk._decode_steps(rk.stream) for rk in self.ranks])

    def _decode_graphs(self):
        if self._graphs is None and os.environ.get("HIPENGINE_NO_GRAPH") != "1":
            from ..comm.allreduce import capture_graphs

            self._issue_decode()  # compile + warm every kernel outside the capture (same step twice: idempotent)
            self._sync()
            for rk in self.ranks:
                rk._capturing = True  # GpuBackend._decode_graph: the position may be read early in the graph
            try:
                self._graphs = capture_graphs(self.rts, self.streams, self._issue_decode)
            finally:
                for rk in self.ranks:
                    rk._capturing = False
        return self._graphs

    def _run_decode(self) -> None:
        graphs = self._decode_graphs()
        if graphs is None:
            self._issue_decode()
        else:
            for g, s in zip(graphs, self.streams):
                g.launch(s)

    def _sync(self) -> None:
        for s in self.streams:
            s.synchronize()

    def check(self) -> None:
        """Raise DeviceError if a custom all-reduce timed out on any rank (NCCL reports through its calls)."""
        if self.allreduce == "custom" and self.comm is not None:
            self.comm.check()
        else:
            self._sync()

    # ---- what GpuBackend.prefill calls (it is reused as is, below) --------------------------------------
    def _prefill_chunk(self, ids: np.ndarray, logits: str) -> None:
        self._lockstep([rk._prefill_steps(ids, logits) for rk in self.ranks])

    def _read_logits(self, rows: int) -> np.ndarray:
        """[rows, vocab] float32: every rank's vocabulary slice, side by side."""
        self.check()
        return np.concatenate([rk.rt.download(rk.logits, (rows, rk.config.vocab_size), np.float32)
                               for rk in self.ranks], axis=1)

    prefill = GpuBackend.prefill  # chunks, positions and logits rows exactly as at tp=1

    # ---- Backend API ------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.pos = 0

    def decode(self, token_id: int) -> np.ndarray:
        if self.pos >= self.max_context:
            raise RequestError(f"context of {self.max_context} tokens is full")
        self._set_token(int(token_id))
        self._run_decode()
        self.pos += 1
        return self._read_logits(1)[0]

    def _set_token(self, token: int) -> None:
        """The next step's token (global id: the embedding is replicated) and position, on every rank."""
        for rk in self.ranks:
            rk._set_int(rk.tokens, token)
            rk._set_int(rk.pos_buf, rk.pos)

    def _device_argmax(self) -> int:
        """Greedy pick of the last decode step: per rank the grid-wide arg-max over its slice (first index on
        ties), then (logit, global index) pairs merged with ties to the lower index."""
        for rk in self.ranks:
            rk.ops.argmax(rk.logits, rk.config.vocab_size, rk.tokens, rk.cand, stream=rk.stream)
        cands = []
        idx, val = np.zeros(1, np.int32), np.zeros(1, np.float32)
        for rk, off in zip(self.ranks, self.vocab_offsets):
            # stream-ordered reads into pageable memory return once done: no separate synchronize
            rk.rt.copy_dtoh(idx, rk.tokens, stream=rk.stream)
            rk.rt.copy_dtoh(val, rk.logits.ptr + 4 * int(idx[0]), stream=rk.stream)
            cands.append((float(val[0]), off + int(idx[0])))
        return merge_argmax(cands)

    def generate_ids(self, prompt_ids, params: SamplingParams,
                     should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
        prompt = self.check_prompt(prompt_ids)
        eos = set() if params.ignore_eos else {int(e) for e in self.config.eos_token_ids}
        seed = params.resolved_seed()
        device_greedy = params.temperature <= 0 and params.repetition_penalty == 1.0
        if should_stop():
            return
        self.reset()
        logits = self.prefill(prompt)  # the last prompt position's full logits (host)
        history = prompt.tolist()
        if device_greedy:
            for rk in self.ranks:
                rk._set_int(rk.hist_len, 0)  # no penalty: the rank's sampler ignores its history buffer
        for n in range(params.max_tokens):
            if logits is None:
                tok = self._device_argmax()
            else:
                tok = host_sample(logits, history, params, seed, self.pos)
            yield tok
            if tok in eos or n + 1 >= params.max_tokens or self.pos >= self.max_context or should_stop():
                break
            history.append(tok)
            self._set_token(tok)
            self._run_decode()
            self.pos += 1
            if (n + 1) % STATUS_CHECK_EVERY == 0:
                self.check()
            logits = None if device_greedy else self._read_logits(1)[0]
        self.check()

    def decode_from(self, token: int, n: int) -> Iterator[int]:
        """Greedy decode of n tokens from the current position and KV cache, starting from ``token``
        (benchmarks: the loop of generate_ids without its prefill)."""
        for rk in self.ranks:
            rk._set_int(rk.hist_len, 0)
        for _ in range(n):
            self._set_token(int(token))
            self._run_decode()
            self.pos += 1
            token = self._device_argmax()
            yield token
        self.check()

    def resize_context(self, max_context: int) -> None:
        """New KV cache, RoPE tables and attention plan on every rank (weights kept); graphs recaptured.
        The old state buffers are freed at close()."""
        self._drop_graphs()
        self.max_context = int(max_context)
        for rk in self.ranks:
            rk.max_context = self.max_context
            cos, sin = O.rope_tables(rk.config.rope_inv_freq(), self.max_context)
            rk.cos, rk.sin = rk._up(cos), rk._up(sin)
            rk._alloc_state()
        self.pos = 0

    def _drop_graphs(self) -> None:
        for g in self._graphs or []:
            try:
                g.destroy()
            except Exception:
                pass
        self._graphs = None

    def close(self) -> None:
        self._drop_graphs()
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception:
                pass
            self.comm = None
        for rk in self.ranks:
            rk.close()
        self.ranks = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def host_sample(logits: np.ndarray, history: list[int], params: SamplingParams, seed: int, step: int) -> int:
    """The device sampler's rule (sampling.hip, oracle ``ops.ref_sample_keep``) on host logits: penalty,
    temperature, top-k/top-p/min-p kept set, then the first kept index (in index order) whose running kept
    mass exceeds u·(kept mass), u = Philox(seed, step). Greedy: argmax, first index on ties."""
    z, keep, arg = O.ref_sample_keep(logits, history, params.temperature, params.top_k, params.top_p,
                                     params.min_p, params.repetition_penalty)
    if params.temperature <= 0:
        return int(arg)
    e = np.where(keep, np.exp(z - z.max()), 0.0)
    cum = np.cumsum(e)
    u = O.sample_uniform(int(seed) & 0xFFFFFFFFFFFFFFFF, int(step))
    return int(min(np.searchsorted(cum, u * cum[-1], side="right"), np.flatnonzero(keep)[-1]))



def bench_decode(args) -> int:
    """``hipengine bench decode --tp N``: TTFT and decode tok/s of the tensor-parallel monokernel
    (TpMonokernelBackend) and of the per-op TP path on the same uploaded shards (``--no-monokernel``: the
    per-op path only), by the method of hipengine.bench.decode (real prompt at the smallest context,
    synthetic KV fill above it; median of RUNS fresh requests, host clock per token). Roofline per GPU:
    HBM read of GPU 0 / the largest rank's bytes per step (its weight shard + its KV heads; communication
    not counted)."""
    import statistics
    import sys
    import time

    from ..bench import decode as D
    from ..bench import git_commit, utc_now
    from ..bench.probe import measure_hbm_read_bandwidth
    from ..errors import HipEngineError
    from .monokernel import read_profile, reset_profile
    from .runtime import get_runtime

    try:
        contexts = sorted(set(args.context or D.DEFAULT_CONTEXTS))
        loaded, name = D._load(args)
        ShardPlan(loaded.config, args.tp)  # refuse before touching a GPU
        rt = get_runtime(0)
        print(f"measuring HBM read bandwidth on {rt.name} ...", file=sys.stderr)
        hbm = measure_hbm_read_bandwidth(rt)
        allreduce = getattr(args, "allreduce", "custom")
        t0 = time.perf_counter()
        if args.no_monokernel:
            be = TpGpuBackend(loaded, max_context=contexts[0], tp=args.tp, allreduce=allreduce)
            paths = ["per-op"]
        else:
            from .tp_monokernel import TpMonokernelBackend

            be = TpMonokernelBackend(loaded, max_context=contexts[0], tp=args.tp, allreduce=allreduce)
            paths = ["monokernel", "per-op"]
        print(f"loaded {name} on {args.tp} GPUs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        params = SamplingParams(max_tokens=D.GEN, temperature=0.0, ignore_eos=True)
        rng = np.random.default_rng(0)
        rows = []
        try:
            for C in contexts:
                be.resize_context(max(C, getattr(args, "max_context", None) or C))
                real = C == contexts[0]
                prompt = rng.integers(0, loaded.config.vocab_size, C - D.GEN)
                if not real:
                    for rk in be.ranks:
                        D._fill_kv(rk)
                b = max(be.plan.rank_config(k).decode_bytes_per_token(2.0, context=C) for k in range(args.tp))
                same = []
                for path in paths:
                    label = f"{path}-tp{args.tp}" + ("" if path == "monokernel" else f"-{allreduce}")

                    def once():
                        mk = path == "monokernel"
                        if real:
                            g = be.generate_ids(prompt, params) if mk else \
                                TpGpuBackend.generate_ids(be, prompt, params)
                            return D._timed(g)
                        be.pos = C - D.GEN
                        g = be.generate_from_state_greedy(int(prompt[-1]), D.GEN) if mk else \
                            be.decode_from(int(prompt[-1]), D.GEN)
                        return D._timed(g)

                    profiled = path == "monokernel" and be.ranks[0].prof_buf is not None  # bench --profile
                    if profiled:
                        for rk in be.ranks:
                            reset_profile(rk)
                    toks, ttfts, rates = D.timed_runs(once, D.RUNS, D.GEN, f"{label} at context {C}")
                    tok_s = statistics.median(rates)
                    rows.append({"context": C, "max_context": be.max_context, "path": label,
                                 "prompt": "real" if real else "synthetic-kv",
                                 "ttft_ms": statistics.median(ttfts) * 1e3 if real else None, "tok_s": tok_s,
                                 "tok_s_runs": rates, "bytes_per_token_per_gpu": b, "roofline_tok_s": hbm / b,
                                 "pct_hbm": 100.0 * tok_s * b / hbm})
                    same.append(toks)
                    print(f"  context {C:6d} {label} {tok_s:8.1f} tok/s", file=sys.stderr)
                    if profiled:  # every rank's block 0 (the ranks wait on each other: compare their waits)
                        rows[-1]["stage_profile"] = [read_profile(rk) for rk in be.ranks]
                        for r, prof in enumerate(rows[-1]["stage_profile"]):
                            print(f"  rank {r}:\n" + D.profile_table(prof, loaded.config.num_layers), file=sys.stderr)
                if len(same) == 2:  # recorded, not raised: a divergence is a finding to report
                    for r in rows[-2:]:
                        r["identical_to_other_path"] = same[0] == same[1]
        finally:
            be.close()
    except HipEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = {"benchmark": "decode", "model": name, "gpu": rt.name, "arch": rt.arch, "tp": args.tp,
              "allreduce": allreduce, "commit": git_commit(), "date": utc_now(), "hbm_read_gbps": hbm / 1e9,
              "runs": D.RUNS, "gen_tokens": D.GEN, "results": rows}
    if getattr(args, "plot", None):
        D.plot(result, args.plot)
    D.emit(result, args.json, f"{name} on {args.tp}x {rt.name}, HBM read {hbm / 1e9:.0f} GB/s per GPU (measured now)",
           path_width=22)
    return 0
