"""GpuBackend: the per-op GPU executor (one kernel launch per op, decode captured into a graph).

Device state
  weights   per layer: wqkv [q+2kv, d] (wq|wk|wv stacked, so one launch fuses QKV + bias + RoPE + KV append),
            wo, w_gate, w_up, w_down in bf16 (fp16 when the loader hands fp16 arrays or the model is a GGUF,
            whose weights come from fp16 scales); norms and biases fp32.
  kv cache  bf16, or fp16 for fp16-weight (GGUF) models [layers][kv_heads][max_context][head_dim] (K and V
            separate), see attention_decode.hip and port.h's he_kv.
  state     pos (int32, the position the next token is written at), token, history (prompt + generated
            ids, for the repetition penalty), all in device memory so the captured decode graph has
            constant arguments.
Decode (one step): embedding -> per layer [matvec_qkv (norm prologue, RoPE, append) -> attention split +
combine (one kernel when its grid is large: ops.attention_one_kernel) -> O-proj + residual -> gate/up (norm
prologue, SiLU·mul) -> down + residual] -> LM head (final norm prologue). Prefill runs chunks of up to
prefill_m (128) tokens, each projection one matrix-core matmul (Ops.prefill_matmul), so each weight is read once
per chunk. Sampling runs on the device
(sampling.hip); each token reaches the host through mapped memory while the next steps are already
enqueued (_generate_per_op).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Callable, Iterator

import numpy as np

from ..backend import Backend, SamplingParams
from ..errors import DeviceError, RequestError, UnsupportedError
from . import ops as O
from .runtime import DeviceBuffer, get_runtime


# _generate_per_op: decode steps the host enqueues beyond the tokens it has read (enough to keep the GPU
# busy across a slow host iteration; each is a wasted step after an end-of-sequence id or a cancel).
RUN_AHEAD = 3
EMIT_CHECK_S = 2.0  # no token for this long: synchronise the stream (raises a kernel's error), then check


def kv_defines(kv_f16: bool) -> dict | None:
    """Compile-time defines of every kernel that touches the KV cache (port.h's he_kv element type)."""
    return {"HE_KV_F16": 1} if kv_f16 else None


class GpuBackend(Backend):
    prefill_m = O.PREFILL_M  # prompt tokens per prefill chunk (rows of the chunk buffers)

    def __new__(cls, *args, **kwargs):  # monokernel=True on a GPU with cooperative launch: decode and
        # generate_ids run in the monokernel (hipengine/gpu/monokernel.py, a subclass); prefill stays per-op.
        # Engine.load asks for it by default (per-op where it cannot run); this class defaults to per-op.
        if cls is GpuBackend and kwargs.get("monokernel", args[3] if len(args) > 3 else False):
            try:
                coop = getattr(get_runtime(kwargs.get("device", 0)), "cooperative_launch", False)
            except Exception:  # no GPU etc.: __init__ raises the real error
                coop = False
            if coop:
                from .monokernel import MonokernelBackend as cls
        return super().__new__(cls)

    def __init__(self, loaded, max_context: int | None = None, tp: int = 1, monokernel: bool = False,
                 allreduce: str = "custom", device: int = 0):
        if tp != 1:
            raise UnsupportedError(f"tensor parallelism (tp={tp}) is not implemented in the GPU executor yet; "
                                   "use tp=1")
        # monokernel selects the subclass in __new__; kept for introspection (and TP ranks, always per-op).
        self.monokernel, self.allreduce = monokernel, allreduce
        cfg = self.config = loaded.config
        self.max_context = int(max_context or min(cfg.max_position_embeddings, 4096))
        if self.max_context <= 0:
            raise RequestError(f"max_context must be positive, got {self.max_context}")
        if cfg.head_dim % 8 or cfg.hidden_size % 8 or cfg.intermediate_size % 8:
            raise UnsupportedError("GPU executor needs hidden, intermediate and head_dim divisible by 8")
        if cfg.num_heads // cfg.num_kv_heads > O.ATTN_MAX_GROUP:
            raise UnsupportedError(f"GPU attention supports up to {O.ATTN_MAX_GROUP} query heads per KV head")
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_context:
            raise UnsupportedError("sliding-window attention is not implemented on the GPU; use "
                                   f"--max-context {cfg.sliding_window} or the CPU backend")
        self.rt = rt = get_runtime(device)
        # GGUF weights were dequantized from fp16 scales (Q4_1, Q8_0, K-quants): fp16 keeps 3 more mantissa bits
        # than bf16, which the default model needed to stay within 2e-2 of the fp32 reference (bf16: 4e-2).
        # Only when every matrix fits fp16's range (checked once; GGUF weights are already materialised).
        self.prefer_f16 = getattr(loaded, "source", None) == "gguf" and all(
            float(np.max(np.abs(w))) < 65000.0 for w in loaded.weights.values() if getattr(w, "ndim", 0) == 2)
        # Those models keep the KV cache in fp16 too (kernels built with HE_KV_F16=1): on the default model a
        # bf16 cache alone puts the logits 2.7e-2 from the fp32 reference, an fp16 one 2.7e-3 (measured on the
        # CPU by rounding the reference's cache, docs/perf-log.md). bf16 elsewhere: its range is fp32's.
        self.kv_f16 = self.prefer_f16
        # The MLP as one stage on both decode paths (ops/mlp.hip; opt-in: HIPENGINE_FUSED_MLP=1, ops.fused_mlp).
        # Not on tensor-parallel ranks (their down-proj output is a partial sum for the all-reduce) nor with the
        # monokernel's LL exchange at tp = 1 (mk_tp builds keep the two stages).
        self.fused_mlp = (O.fused_mlp() and self.fused_mlp_ok()
                          and O.mlp_supported(cfg.hidden_size, rt.warp_size))
        # The O-proj by KV-head group (ops/matvec_group.hip), by the monokernel's rule at this cache size so both
        # decode paths compute the same sums (hipengine/gpu/monokernel.py o_group_decide; a subclass that builds the
        # monokernel decides again with its own reasons, the same way).
        from .monokernel import o_group_decide

        self.o_group = o_group_decide(cfg, rt.num_sms, rt.warp_size, self.max_context, self.fused_mlp,
                                      None if self.o_group_ok() else "tensor parallelism")
        self.ops = O.Ops(rt, defines=kv_defines(self.kv_f16))
        self._check_fits(loaded)
        self.stream = rt.stream()
        self._bufs = []
        self._upload_weights(loaded.weights)
        self._alloc_state()
        self._graph = None
        self._capturing = False  # True while the decode graph is captured (_decode_graph)
        self._prefill_graphs: dict = {}  # captured full prefill chunks (_prefill_chunk)
        self.pos = 0

    # ---- setup ----------------------------------------------------------------------------------------------
    def fused_mlp_ok(self) -> bool:
        """Whether this backend's decode may run the fused MLP (tp = 1 ranks that own the whole residual)."""
        return True

    def o_group_ok(self) -> bool:
        """Whether this backend's decode may run the grouped O-proj (tp = 1 ranks that own the whole residual)."""
        return True

    def _extra_weight_bytes(self) -> int:
        """Device bytes a subclass keeps beside the weights (the monokernel's screened LM head)."""
        return 0

    def _check_fits(self, loaded) -> None:
        cfg = self.config
        # decode_bytes_per_token counts the LM head; an untied model also holds the embedding table; the fused
        # MLP keeps W_down transposed beside the prefill's row-major copy
        w_bytes = cfg.decode_bytes_per_token(2.0) + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2)
        if self.fused_mlp:
            w_bytes += cfg.num_layers * cfg.hidden_size * cfg.intermediate_size * 2
        w_bytes += self._extra_weight_bytes()
        kv_bytes = 2 * cfg.num_layers * cfg.kv_dim * self.max_context * 2
        state = self._state_bytes()
        need = w_bytes + kv_bytes + state + 64 * 2**20
        free, total = self.rt.mem_info()
        if need > free:
            raise DeviceError(f"model needs {need / 2**30:.2f} GiB on GPU {self.rt.device_index} "
                              f"({w_bytes / 2**30:.2f} weights + {kv_bytes / 2**30:.2f} KV cache + "
                              f"{state / 2**30:.2f} buffers at max_context {self.max_context}) but only "
                              f"{free / 2**30:.2f} GiB is free; lower --max-context or use a larger GPU / tp")

    def _state_sizes(self) -> dict:
        """Bytes of the buffers _alloc_state adds to the weights and the KV cache, by name: a prefill chunk's
        activations and logits, the attention partials, the matrix-core scratch, the history. One table for
        the allocation and for _check_fits, which counts them before anything is allocated."""
        cfg, M, C = self.config, self.prefill_m, self.max_context
        d, qd, kvd, F = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
        nsplit, _ = O.attention_plan(C, cfg.num_kv_heads, self.rt.num_sms, head_dim=cfg.head_dim)
        floats = {
            "x": M * d,  # residual stream [M, d]
            "xn": M * max(d, F),  # normed input / MLP hidden [M, *]
            "qkv": M * (qd + 2 * kvd), "q": M * qd, "att": M * qd, "h": M * F,
            "partial": O.Ops.partial_floats(M, cfg.num_heads, cfg.head_dim, nsplit),
            "logits": M * cfg.vocab_size,
            "mm_part": O.mma_part_floats(self.rt.num_sms, M),  # the matrix-core prefill's split-K scratch
            "z": cfg.vocab_size,
            "tokens": M, "history": C,  # int32
        }
        return {k: 4 * v for k, v in floats.items()}

    def _state_bytes(self) -> int:
        return sum(self._state_sizes().values())

    def _buf(self, nbytes: int):
        b = self.rt.malloc(max(int(nbytes), 4))
        self._bufs.append(b)
        return b

    def _up(self, arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        b = self._buf(arr.nbytes)
        self.rt.copy_htod(b, arr)
        return b

    def _up_w(self, arrays: list[np.ndarray]):
        """Upload one or more weights stacked along rows as bf16/fp16 bits; returns (buffer, is_f16)."""
        f16 = self.prefer_f16 or all(a.dtype == np.float16 for a in arrays)
        parts = [(np.ascontiguousarray(a, dtype=np.float16).view(np.uint16) if f16 else O.to_bf16(a)) for a in arrays]
        bits = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return self._up(bits), f16

    def _upload_weights(self, weights) -> None:
        cfg = self.config
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            L = {}
            # one tensor at a time: the lazy preset weights are generated, converted and dropped in turn
            L["wqkv"], L["f16"] = self._up_w([weights[p + "wq"], weights[p + "wk"], weights[p + "wv"]])
            L["wo"], _ = self._up_w([weights[p + "wo"]])
            L["w_gate"], _ = self._up_w([weights[p + "w_gate"]])
            L["w_up"], _ = self._up_w([weights[p + "w_up"]])
            w_down = weights[p + "w_down"]
            L["w_down"], _ = self._up_w([w_down])
            # the fused MLP reads W_down transposed ([F, d]: its row j, column j of W_down, is d contiguous weights)
            L["w_down_t"] = self._up_w([np.asarray(w_down).T])[0] if self.fused_mlp else None
            del w_down
            L["attn_norm"] = self._up(f32(weights[p + "attn_norm"]))
            L["ffn_norm"] = self._up(f32(weights[p + "ffn_norm"]))
            L["bqkv"] = (self._up(np.concatenate([f32(weights[p + n]) for n in ("bq", "bk", "bv")]))
                         if cfg.attention_bias else None)
            if cfg.qk_norm:
                L["q_norm"], L["k_norm"] = self._up(f32(weights[p + "q_norm"])), self._up(f32(weights[p + "k_norm"]))
            self.layers.append(L)
        embed = weights["embed"]
        self.embed_vocab = int(embed.shape[0])  # rows of the embedding (a TP rank's head may score fewer)
        self.embed, self.embed_f16 = self._up_w([embed])
        if cfg.tie_word_embeddings:
            self.lm_head, self.head_f16 = self.embed, self.embed_f16
        else:
            self.lm_head, self.head_f16 = self._up_w([weights["lm_head"]])
        self.final_norm = self._up(f32(weights["final_norm"]))
        cos, sin = O.rope_tables(cfg.rope_inv_freq(), self.max_context)
        self.cos, self.sin = self._up(cos), self._up(sin)

    def _alloc_state(self) -> None:
        cfg, C = self.config, self.max_context
        per_layer = cfg.num_kv_heads * C * cfg.head_dim * 2
        # K and V in one allocation (V from the next 256-byte boundary after K), so that one access-policy window
        # covers the whole cache (HIPENGINE_L2_PERSIST_KV, below); k_cache / v_cache are views of it
        n = cfg.num_layers * per_layer
        k_bytes = -(-n // 256) * 256
        self.kv_cache = self._buf(k_bytes + n)
        self.k_cache = DeviceBuffer(self.kv_cache.ptr, n, self.rt)
        self.v_cache = DeviceBuffer(self.kv_cache.ptr + k_bytes, n, self.rt)
        self.kv_layer_bytes = per_layer
        # the cache's lines persisting in L2 for this stream's kernels (NVIDIA; 0 bytes set aside elsewhere or off),
        # and no window of an earlier backend or cache size left behind in this process when off
        if O.l2_persist_kv():
            self.l2_kv_bytes = self.rt.l2_persist(self.stream, self.kv_cache.ptr, self.kv_cache.nbytes)
        else:
            self.rt.l2_persist_reset()
            self.l2_kv_bytes = 0
        self.nsplit, self.chunk = O.attention_plan(C, cfg.num_kv_heads, self.rt.num_sms, head_dim=cfg.head_dim)
        for name, nbytes in self._state_sizes().items():  # x, xn, qkv, q, att, h, partial, logits, mm_part, ...
            setattr(self, name, self._buf(nbytes))
        # the fused MLP's fixed-point residual addend [d] int64 (ops/mlp.hip): zero between steps
        self.x_fx = self._buf(cfg.hidden_size * 8)
        self.rt.copy_htod(self.x_fx, np.zeros(cfg.hidden_size, np.int64))
        self.attn_count = self._buf(cfg.num_kv_heads * 4)  # decode attention's arrival counters (Ops.attention)
        self.rt.copy_htod(self.attn_count, np.zeros(cfg.num_kv_heads, np.uint32))
        self.mm_count = self._buf(self.rt.num_sms * 4)  # the matrix-core prefill's arrival counters
        self.rt.copy_htod(self.mm_count, np.zeros(self.rt.num_sms, np.uint32))
        self.cand = self._buf(2 * self.ops.argmax_blocks() * 4)  # grid-wide greedy candidates (Ops.argmax)
        self.pos_buf = self._buf(4)
        self.hist_len = self._buf(4)

    # ---- one decode step (also what the graph captures) -------------------------------------------------
    def _kc(self, i):
        return self.k_cache.ptr + i * self.kv_layer_bytes

    def _vc(self, i):
        return self.v_cache.ptr + i * self.kv_layer_bytes

    def _proj_out(self):
        """(output, residual) of the O-proj and down projections: x += W·a in place here. A tensor-parallel
        rank (tp_executor) returns its partial-sum buffer instead; the all-reduce then adds it into x."""
        return self.x, self.x

    def _decode_launches(self, s) -> None:
        for _ in self._decode_steps(s):
            pass  # tp=1: nothing to reduce at the partial-sum points

    def _decode_steps(self, s):
        """Enqueue one decode step; yields (rows = 1) right after each O-proj / down projection, the points
        where a tensor-parallel driver all-reduces the partial sums before the next layer reads x."""
        cfg, ops = self.config, self.ops
        out, res = self._proj_out()
        d, qd, kvd, hd, F = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.intermediate_size
        eps = cfg.rms_norm_eps
        # fused MLP: its output is the fixed-point addend fx, which the next norms add to x and the O-proj folds in
        fx = self.x_fx if self.fused_mlp else None
        ops.embedding(self.embed, self.tokens, 1, self.embed_vocab, d, self.x, self.embed_f16, stream=s, x_fx=fx)
        for i, L in enumerate(self.layers):
            f16 = L["f16"]
            if cfg.qk_norm:
                ops.matvec_qkv(L["wqkv"], self.x, self.qkv, self._kc(i), self._vc(i), self.cos, self.sin,
                               self.pos_buf, max_ctx=self.max_context, q_dim=qd, kv_dim=kvd, hd=hd, inn=d,
                               gamma=L["attn_norm"], eps=eps, bias=L["bqkv"], rope=False, f16=f16, stream=s,
                               x_fx=fx)
                ops.qk_norm_rope(self.qkv, self.q, self._kc(i), self._vc(i), self.cos, self.sin, self.pos_buf,
                                 T=1, nh=cfg.num_heads, nkv=cfg.num_kv_heads, hd=hd, max_ctx=self.max_context,
                                 q_norm=L["q_norm"], k_norm=L["k_norm"], eps=eps, stream=s)
            else:
                ops.matvec_qkv(L["wqkv"], self.x, self.q, self._kc(i), self._vc(i), self.cos, self.sin,
                               self.pos_buf, max_ctx=self.max_context, q_dim=qd, kv_dim=kvd, hd=hd, inn=d,
                               gamma=L["attn_norm"], eps=eps, bias=L["bqkv"], rope=True, f16=f16, stream=s,
                               x_fx=fx)
            ops.attention(self.q, self._kc(i), self._vc(i), self.partial, self.att, self.pos_buf, T=1,
                          nh=cfg.num_heads, nkv=cfg.num_kv_heads, hd=hd, max_ctx=self.max_context,
                          nsplit=self.nsplit, chunk=self.chunk, count=self.attn_count,
                          early=self._capturing, stream=s)
            if self.o_group:  # x + the O-proj's output, whole, in fixed point (ops/matvec_group.hip)
                ops.matvec_group_o(L["wo"], self.att, self.x, self.x_fx, d, qd, cfg.num_kv_heads, f16=f16, stream=s)
            else:
                ops.matvec(L["wo"], self.att, out, d, qd, residual=res, f16=f16, stream=s, role="o", res_fx=fx)
            yield 1
            if self.o_group:  # gate/up reads that residual alone; down adds it, writes x and clears it
                ops.matvec_gate_up_fx(L["w_gate"], L["w_up"], self.x_fx, self.h, F, d, gamma=L["ffn_norm"], eps=eps,
                                      f16=f16, stream=s)
                ops.matvec_fx_res(L["w_down"], self.h, self.x_fx, self.x, d, F, f16=f16, stream=s)
            elif fx is not None:
                ops.mlp_fused(L["w_gate"], L["w_up"], L["w_down_t"], self.x, fx, d, F, gamma=L["ffn_norm"], eps=eps,
                              f16=f16, stream=s)
            else:
                ops.matvec_gate_up(L["w_gate"], L["w_up"], self.x, self.h, F, d, gamma=L["ffn_norm"], eps=eps,
                                   f16=f16, stream=s)
                ops.matvec(L["w_down"], self.h, out, d, F, residual=res, f16=f16, stream=s, role="down")
            yield 1
        ops.matvec(self.lm_head, self.x, self.logits, cfg.vocab_size, d, gamma=self.final_norm, eps=eps,
                   f16=self.head_f16, stream=s, role="lm_head", x_fx=fx)

    def _capture(self, launches: Callable[[], None]):
        """A graph of what launches() enqueues on self.stream; if it raises, the capture ends and nothing is
        kept (a partial graph must never be replayed)."""
        self.rt.begin_capture(self.stream)
        try:
            launches()
        except BaseException:
            try:
                self.rt.end_capture(self.stream).destroy()
            except Exception:
                pass
            raise
        return self.rt.end_capture(self.stream)

    def _decode_graph(self):
        if self._graph is None and os.environ.get("HIPENGINE_NO_GRAPH") != "1":
            self._decode_launches(self.stream)  # compile + warm every kernel outside the capture
            self.stream.synchronize()
            self._capturing = True  # launches inside the graph may read the position early (Ops.attention)
            try:
                self._graph = self._capture(lambda: self._decode_launches(self.stream))
            finally:
                self._capturing = False
        return self._graph

    def _run_decode(self) -> None:
        g = self._decode_graph()
        if g is None:
            self._decode_launches(self.stream)
        else:
            g.launch(self.stream)

    def _set_int(self, buf, value: int) -> None:
        self.rt.copy_htod(buf, np.array([value], np.int32), stream=self.stream)

    # ---- Backend API ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.pos = 0
        if self.o_group:  # the grouped O-proj adds into zeros (down clears them; an aborted step may not have)
            self.rt.memset(self.x_fx, 0, 8 * self.config.hidden_size, stream=self.stream)

    def decode(self, token_id: int) -> np.ndarray:
        if self.pos >= self.max_context:
            raise RequestError(f"context of {self.max_context} tokens is full")
        self._set_int(self.tokens, int(token_id))
        self._set_int(self.pos_buf, self.pos)
        self._run_decode()
        self.pos += 1
        return self._read_logits(1)[0]

    def _read_logits(self, rows: int) -> np.ndarray:
        self.stream.synchronize()
        return self.rt.download(self.logits, (rows, self.config.vocab_size), np.float32)

    def prefill(self, token_ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        if ids.size == 0:
            raise RequestError("empty prompt")
        if self.pos + ids.size > self.max_context:
            raise RequestError(f"prompt of {ids.size} tokens at position {self.pos} exceeds the context of "
                               f"{self.max_context} tokens")
        out = []
        for c0 in range(0, ids.size, self.prefill_m):
            chunk = ids[c0:c0 + self.prefill_m]
            last = c0 + self.prefill_m >= ids.size
            logits = "all" if all_logits else "last" if last else ""
            self._prefill_chunk(chunk, logits=logits)
            if logits:
                out.append(self._read_logits(chunk.size if all_logits else 1))
        res = np.concatenate(out, axis=0)
        return res if all_logits else res[-1]

    def _prefill_chunk(self, ids: np.ndarray, logits: str) -> None:
        """One prefill chunk; logits "" (none), "last" (the chunk's last row, into logits row 0) or "all" (row
        t of the chunk into row t). The chunk's layers replay a captured graph of their launches — they take
        their position and tokens from device memory — so the host pays one launch instead of ~9 per layer.
        Graphs exist per size class (_prefill_bucket: 16, 32, 64 tokens and prefill_m): a shorter chunk is
        padded to its class with copies of its last token, whose rows change nothing the real rows compute
        (rows are independent in the projections and norms, and attention is causal: the padding's K/V land
        past the chunk, where the next decode steps overwrite them before anything reads them). The first
        chunk of each kind runs eagerly (compiling and warming its kernels) and is then captured; "last" is
        one launch after the graph (_last_logits). Eager throughout with HIPENGINE_NO_GRAPH=1, or where the
        padding would pass the end of the cache."""
        M = int(ids.size)
        Mb = self._prefill_bucket(M)
        if os.environ.get("HIPENGINE_NO_GRAPH") == "1" or self.pos + Mb > self.max_context:
            for _ in self._prefill_steps(ids, logits):
                pass
            return
        inner = "all" if logits == "all" else ""
        # what the launches depend on besides the buffers: the chunk, and the A/B knobs read at launch time
        key = (Mb, inner, *(os.environ.get(k) for k in O.MMA_KNOBS))
        self._prefill_inputs(ids if Mb == M else np.concatenate([ids, np.repeat(ids[-1:], Mb - M)]))
        g = self._prefill_graphs.get(key)
        if g is not None:
            g.launch(self.stream)
        else:
            def launches() -> None:
                for _ in self._prefill_layers(Mb, inner):
                    pass

            launches()  # compile + warm, and this chunk's work
            self._prefill_graphs[key] = self._capture(launches)
        if logits == "last":
            self._last_logits(M)
        self.pos += M

    def _prefill_bucket(self, M: int) -> int:
        """The size class of an M-token chunk (M ≤ prefill_m): its graph's chunk size."""
        return next((b for b in (16, 32, 64) if M <= b < self.prefill_m), self.prefill_m)

    def _last_logits(self, M: int) -> None:
        """Logits of row M - 1 of the chunk just run (what sampling needs), into logits row 0: the decode
        step's LM head, final norm fused."""
        cfg = self.config
        self.ops.matvec(self.lm_head, self.x.ptr + (M - 1) * cfg.hidden_size * 4, self.logits, cfg.vocab_size,
                        cfg.hidden_size, gamma=self.final_norm, eps=cfg.rms_norm_eps, f16=self.head_f16,
                        stream=self.stream, role="lm_head")

    def _prefill_steps(self, ids: np.ndarray, logits: str):
        """One prefill chunk, eagerly; yields its row count at the partial-sum points, as _decode_steps."""
        self._prefill_inputs(ids)
        yield from self._prefill_layers(int(ids.size), logits)
        self.pos += int(ids.size)

    def _prefill_inputs(self, ids: np.ndarray) -> None:
        """The chunk's tokens and first position, into the device buffers its launches read."""
        self.rt.copy_htod(self.tokens, ids.astype(np.int32), stream=self.stream)
        self._set_int(self.pos_buf, self.pos)

    def _prefill_layers(self, M: int, logits: str):
        """The launches of one M-token chunk (its inputs already on the device); yields M at the partial-sum
        points. Captured as is into the prefill graphs."""
        cfg, ops, s = self.config, self.ops, self.stream
        out, res = self._proj_out()
        mode = 1 if res is not None else 0  # 1: Y += X Wᵀ (in place on x); 0: Y = X Wᵀ (a bare partial sum)
        d, qd, kvd, hd, F = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.intermediate_size
        eps = cfg.rms_norm_eps
        mm = functools.partial(ops.prefill_matmul, part=self.mm_part, count=self.mm_count, stream=s)
        ops.embedding(self.embed, self.tokens, M, self.embed_vocab, d, self.x, self.embed_f16, stream=s)
        for i, L in enumerate(self.layers):
            f16 = L["f16"]
            ops.rmsnorm(self.x, L["attn_norm"], eps, d, self.xn, rows=M, stream=s)
            mm(L["wqkv"], self.xn, self.qkv, M, qd + 2 * kvd, d, mode=0, bias=L["bqkv"], f16=f16)
            ops.qk_norm_rope(self.qkv, self.q, self._kc(i), self._vc(i), self.cos, self.sin, self.pos_buf, T=M,
                             nh=cfg.num_heads, nkv=cfg.num_kv_heads, hd=hd, max_ctx=self.max_context,
                             q_norm=L.get("q_norm"), k_norm=L.get("k_norm"), eps=eps, stream=s)
            ops.attention(self.q, self._kc(i), self._vc(i), self.partial, self.att, self.pos_buf, T=M,
                          nh=cfg.num_heads, nkv=cfg.num_kv_heads, hd=hd, max_ctx=self.max_context,
                          nsplit=self.nsplit, chunk=self.chunk, stream=s)
            mm(L["wo"], self.att, out, M, d, qd, mode=mode, f16=f16)
            yield M
            ops.rmsnorm(self.x, L["ffn_norm"], eps, d, self.xn, rows=M, stream=s)
            mm(L["w_gate"], self.xn, self.h, M, F, d, mode=2, W2=L["w_up"], f16=f16)
            mm(L["w_down"], self.h, out, M, d, F, mode=mode, f16=f16)
            yield M
        if logits == "all":
            ops.rmsnorm(self.x, self.final_norm, eps, d, self.xn, rows=M, stream=s)
            mm(self.lm_head, self.xn, self.logits, M, cfg.vocab_size, d, mode=0, f16=self.head_f16)
        elif logits == "last":
            self._last_logits(M)
        elif logits:
            raise ValueError(f"logits: '', 'last' or 'all', not {logits!r}")

    def generate_ids(self, prompt_ids, params: SamplingParams,
                     should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
        """Like sampling.host_generate, but the token is chosen on the device (sampling.hip) and handed to the
        host through mapped memory (_generate_per_op). The RNG is Philox keyed by (seed, position), so a
        seeded request replays."""
        prompt = self.check_prompt(prompt_ids)
        if should_stop():
            return
        self.reset()
        self.prefill(prompt)  # the last prompt row's logits are in row 0 of the logits buffer
        self.rt.copy_htod(self.history, prompt.astype(np.int32), stream=self.stream)
        yield from self._generate_per_op(0, int(prompt.size), params, should_stop, embed_first=False)

    def generate_from_state(self, token: int, hist_len: int, params: SamplingParams,
                            should_stop: Callable[[], bool] = lambda: False,
                            embed_first: bool = True) -> Iterator[int]:
        """Generate from the current KV cache and position: sample from the logits already in the buffer (after
        prefill), or first run a decode step of ``token`` (benchmarks at long context). The history buffer
        holds ``hist_len`` ids (the repetition penalty's). MonokernelBackend overrides it with its kernel."""
        yield from self._generate_per_op(token, hist_len, params, should_stop, embed_first)

    def _generate_per_op(self, token: int, hist_len: int, params: SamplingParams,
                         should_stop: Callable[[], bool] = lambda: False,
                         embed_first: bool = True) -> Iterator[int]:
        """generate_from_state on the per-op path (also what GpuBackend.generate_ids runs on a
        MonokernelBackend, for the benchmarks' per-op figures).

        The host stays off the GPU's critical path: it enqueues each step — the captured decode graph, then
        decode_advance, sample and emit_token (or, opted in, argmax_step: the three in two launches) — up to
        RUN_AHEAD steps beyond the tokens it has read, and reads the tokens from mapped memory as they land (no
        synchronisation per token). It stops on an end-of-sequence id, max_tokens, a full context or
        should_stop(); the steps already enqueued then run to their end (at most RUN_AHEAD, their tokens
        unread) and self.pos is where the device stopped."""
        if params.max_tokens < 1:
            return
        eos = set() if params.ignore_eos else {int(e) for e in self.config.eos_token_ids}
        seed = params.resolved_seed()
        s, ops, V = self.stream, self.ops, self.config.vocab_size
        words = self._emit_words()
        self._set_int(self._emit_count, 0)
        self._set_int(self.hist_len, hist_len)
        self._set_int(self.pos_buf, self.pos)
        if embed_first:
            self._set_int(self.tokens, int(token))
        pre = 0 if embed_first else 1  # tokens emitted before the first step
        # decode steps allowed: one per further token, and the last one writes K/V at max_context - 1
        steps = max(0, min(params.max_tokens - pre, self.max_context - self.pos))
        p0 = self.pos

        # plain greedy: the grid-wide arg-max (the one-block sampler would add ~30 µs per token on H200)
        greedy = not params.temperature > 0 and params.repetition_penalty == 1.0

        def sample_and_emit():
            if greedy:
                ops.argmax(self.logits, V, self.tokens, self.cand, stream=s)
            else:  # step counter for the RNG = the position the sampled token will occupy (pos_buf)
                ops.sample(self.logits, V, self.history, self.hist_len, self.pos_buf, self.tokens, self.z,
                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           min_p=params.min_p, repetition_penalty=params.repetition_penalty, seed=seed, stream=s)
            ops.emit_token(self.tokens, self._emit_count, self._emit_host, self._emit_cap, stream=s)

        fused = greedy and O.fused_pick()

        def step_end():  # the position advances, the next token is picked and handed to the host
            if fused:  # the same three effects in two launches (Ops.argmax_step)
                ops.argmax_step(self.logits, V, self.tokens, self.cand, self.history, self.hist_len, self.pos_buf,
                                self.max_context, self._emit_count, self._emit_host, self._emit_cap, stream=s)
                return
            ops.decode_advance(self.tokens, self.history, self.hist_len, self.pos_buf, self.max_context, stream=s)
            sample_and_emit()

        launched = read = 0
        try:
            if not embed_first:
                sample_and_emit()
            while read < pre + steps:
                while launched < steps and launched + pre < read + RUN_AHEAD:
                    self._run_decode()  # the token and the position are already on the device
                    step_end()
                    launched += 1
                self._wait_tokens(words, read + 1)
                tok = int(words[1 + read])
                read += 1
                yield tok
                if tok in eos or should_stop():
                    break
        finally:
            s.synchronize()  # the steps still enqueued (at most RUN_AHEAD) finish; their tokens are dropped
            self.pos = p0 + launched

    def _emit_words(self) -> np.ndarray:
        """The mapped token buffer of _generate_per_op (int32 view: [0] count, [1 + i] token i), sized for
        max_context + 1 tokens; reset to count 0 (no kernel is running here: the last request synchronised)."""
        cap = self.max_context + 1
        if getattr(self, "_emit_cap", 0) < cap:
            if getattr(self, "_emit_host", None) is not None:
                self._emit_host.free()
            self._emit_host = self.rt.host_alloc_mapped(4 * (1 + cap))
            self._emit_count = self._buf(4)
            self._emit_cap = cap
        words = self._emit_host.array.view(np.int32)
        words[0] = 0
        return words

    def _wait_tokens(self, words: np.ndarray, n: int) -> None:
        """Until the device has emitted n tokens. A stream that faulted raises on synchronize; one that went
        idle without emitting them is a bug, reported instead of waiting forever."""
        if int(words[0]) >= n:
            return
        t0 = time.monotonic()
        while int(words[0]) < n:
            if time.monotonic() - t0 > EMIT_CHECK_S:
                self.stream.synchronize()  # raises DeviceError if a kernel failed
                if int(words[0]) < n:
                    raise DeviceError(f"the decode loop ended after {int(words[0])} of {n} tokens without an "
                                      "error from the GPU")
            time.sleep(20e-6)

    def _drop_graphs(self) -> None:
        """Destroy the captured decode and prefill graphs (they hold the current buffers' addresses)."""
        graphs = [getattr(self, "_graph", None), *getattr(self, "_prefill_graphs", {}).values()]
        self._graph, self._prefill_graphs = None, {}
        for g in graphs:
            if g is not None:
                try:
                    g.destroy()
                except Exception:
                    pass

    def close(self) -> None:
        self._drop_graphs()
        if getattr(self, "l2_kv_bytes", 0):
            try:
                self.rt.l2_persist_reset(self.stream)
            except Exception:
                pass
            self.l2_kv_bytes = 0
        for b in getattr(self, "_bufs", []):
            try:
                b.free()
            except Exception:
                pass
        self._bufs = []
        if getattr(self, "_emit_host", None) is not None:
            try:
                self._emit_host.free()
            except Exception:
                pass
            self._emit_host, self._emit_cap = None, 0

    def __del__(self):
        self.close()
