"""Tokenizer: the ``tokenizers`` library, built from a Hugging Face directory or from GGUF metadata.

Three sources:
  * HF directory: ``tokenizer.json`` (+ ``tokenizer_config.json`` for chat template, bos/eos, add_bos_token).
  * GGUF ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` + ``merges``; the split regex
    is chosen by ``tokenizer.ggml.pre`` (the regex the vocabulary's merges were learned with).
  * GGUF ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE from ``tokens`` + ``scores`` (merges
    ranked by the score of the merged piece, as llama.cpp does), ``▁`` for spaces, byte fallback.
Presets have no tokenizer: ``Tokenizer.ids_only`` accepts token ids only and decodes each id as "<id>".
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

from .errors import ModelError, RequestError, UnsupportedError

# GGUF token types (llama.cpp ``llama_token_type``).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes per ``tokenizer.ggml.pre``. GPT-2's own regex is what ``ByteLevel(use_regex=True)`` applies,
# so "gpt2"/"default" need no Split. SmolLM's merges were learned with digits split one by one first.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_LIKE = {"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", None}


def _byte_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet byte-level vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _token_text(tok) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Tokenizer:
    """Text <-> token ids, chat template rendering and the special-token facts the engine stops on."""

    def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False, chat_template: str | None = None, vocab_size: int | None = None,
                 bos_added_by_post_processor: bool = False):
        self.backend = backend  # tokenizers.Tokenizer, or None for ids-only (presets)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._bos_in_post = bos_added_by_post_processor
        self.vocab_size = vocab_size if vocab_size is not None else (
            backend.get_vocab_size(with_added_tokens=True) if backend is not None else 0)
        self._special_ids = set()
        if backend is not None:
            self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.bos_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_id = self.token_to_id(eos_token) if eos_token else None

    # ---- construction -------------------------------------------------------
    @classmethod
    def ids_only(cls, vocab_size: int) -> "Tokenizer":
        return cls(None, vocab_size=vocab_size)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelError(f"{path}: no tokenizer.json (hipengine needs the fast-tokenizer file)")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exceptions on malformed files
            raise ModelError(f"{tj}: cannot parse tokenizer: {str(e).splitlines()[0]}") from None
        cfg = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text())
            except ValueError as e:
                raise ModelError(f"{tc}: invalid JSON: {e}") from None
        template = cfg.get("chat_template")
        ct = path / "chat_template.jinja"
        if template is None and ct.is_file():
            template = ct.read_text()
        if isinstance(template, list):  # list of {"name", "template"}: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        # Llama-3 style tokenizer.json adds BOS in its post-processor; others rely on add_bos_token.
        bos_id = backend.token_to_id(bos) if bos else None
        in_post = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        add_bos = bool(cfg.get("add_bos_token", False)) or in_post
        return cls(backend, bos_token=bos, eos_token=eos, add_bos=add_bos, chat_template=template,
                   bos_added_by_post_processor=in_post)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ModelError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelError("GGUF file has an empty tokenizer.ggml.tokens")
        types = list(_field(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if model == "gpt2":
            backend = _gguf_byte_level_bpe(tokens, types, list(_field(reader, "tokenizer.ggml.merges") or []),
                                           _field(reader, "tokenizer.ggml.pre"))
            add_bos_default = False
        elif model == "llama":
            scores = list(_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
            backend = _gguf_sentencepiece_bpe(tokens, types, scores,
                                              bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)))
            add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise UnsupportedError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        bos_id, eos_id = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
        name = lambda i: tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None  # noqa: E731
        return cls(backend, bos_token=name(bos_id), eos_token=name(eos_id),
                   add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
                   chat_template=_field(reader, "tokenizer.chat_template"), vocab_size=len(tokens))

    @classmethod
    def for_model(cls, loaded) -> "Tokenizer":
        """The tokenizer that goes with a LoadedModel (hipengine.loader)."""
        source = getattr(loaded, "source", None)
        if source == "gguf" and getattr(loaded, "gguf_reader", None) is not None:
            return cls.from_gguf(loaded.gguf_reader)
        if source == "hf":
            return cls.from_hf_dir(loaded.path)
        return cls.ids_only(loaded.config.vocab_size)

    # ---- ids <-> text -------------------------------------------------------
    @property
    def has_text(self) -> bool:
        return self.backend is not None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token) if self.backend is not None else None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.backend is None:
            raise RequestError("this model has no tokenizer (a --shape preset): give the prompt as token ids")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and not self._bos_in_post and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self.backend is None:
            return "".join(f"<{i}>" for i in ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)

    # ---- chat ---------------------------------------------------------------
    def end_of_turn_ids(self) -> set[int]:
        """The special token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>,
        <end_of_turn>): generation stops there even when the config's eos is a different token. Found by
        rendering a probe conversation and reading the token that follows the assistant's text."""
        if not self.chat_template or self.backend is None:
            return set()
        marker = "hipengine probe reply"
        try:
            text = self.render_chat([{"role": "user", "content": "hipengine probe question"},
                                     {"role": "assistant", "content": marker}], add_generation_prompt=False)
        except Exception:  # a template that rejects the probe simply contributes no end-of-turn token
            return set()
        at = text.rfind(marker)
        if at < 0:
            return set()
        after = self.backend.encode(text[at + len(marker):].lstrip(" "), add_special_tokens=False).ids
        return {after[0]} if after and after[0] in self._special_ids else set()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise RequestError("this model has no chat template; use generate with a plain prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages must be a list of {'role': ..., 'content': ...} objects")
        return _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


class IncrementalDetokenizer:
    """Streaming ids -> text that never emits broken UTF-8.

    Decoding one id at a time is wrong for byte-level and SentencePiece vocabularies (a multi-byte
    character can span tokens; SentencePiece drops the leading space of a lone piece). So we decode a
    short window that starts a few tokens back, and emit only the text beyond what that window already
    produced; while the window ends in U+FFFD (an incomplete byte sequence) we hold everything back.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids up to here have been emitted as text

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self.tok.backend is None:
            self.read = len(self.ids)
            return f"<{int(token_id)}>"
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            # The emitted ids become the next window's left context, which fixes their spacing.
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (possibly an incomplete character)."""
        if self.tok.backend is None or self.read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


# ---- GGUF builders ----------------------------------------------------------
def _gguf_byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str | None):
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    if not merges:
        raise ModelError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelError(f"GGUF tokenizer merge {m!r} is not 'left right'")
        pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _PRE_SPLITS
                     and pre.startswith("llama"))
    tok = HFTokenizer(bpe)
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _GPT2_LIKE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise UnsupportedError(f"unsupported GGUF pre-tokenizer {pre!r} "
                               f"(supported: {', '.join(sorted(k for k in set(_PRE_SPLITS) | _GPT2_LIKE if k))})")
    tok.decoder = decoders.ByteLevel()
    alphabet = set(_byte_unicode().values())
    # Control tokens are special (never split, skipped on decode); a "control" token spelled outside the
    # byte alphabet is a converter mislabel and stays an ordinary vocabulary entry.
    return _with_added_tokens(tok, tokens, types, lambda t, ty: ty == TOKEN_CONTROL and set(t) <= alphabet)


def _gguf_sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    # SentencePiece BPE merges the adjacent pair whose merged piece has the highest score; a BPE merge list
    # ranked by that score reproduces it. Every split of a normal token into two vocabulary pieces is a merge.
    ranked = []
    for t, ty, sc in zip(tokens, types, scores):
        if ty not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-sc, vocab[t], vocab[a], vocab[b], a, b))
    ranked.sort()
    merges = [(r[4], r[5]) for r in ranked]
    unk = next((t for t, ty in zip(tokens, types) if ty == TOKEN_UNKNOWN), None)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return _with_added_tokens(tok, tokens, types, lambda t, ty: ty in (TOKEN_CONTROL, TOKEN_UNKNOWN))


def _with_added_tokens(tok, tokens: list[str], types: list[int], is_special):
    """Register GGUF special tokens (never split, skipped on decode) and user-defined ones (never split)."""
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if is_special(t, ty)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


# ---- chat templates ---------------------------------------------------------
_ENV = None


def _jinja_env():
    global _ENV
    if _ENV is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise RequestError(f"chat template: {msg}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # HF's tojson keeps non-ASCII characters as they are (json.dumps would escape them).
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


def _render(template: str, **ctx) -> str:
    from jinja2 import TemplateError

    ctx.setdefault("tools", None)
    ctx.setdefault("documents", None)
    try:
        return _jinja_env().from_string(template).render(**ctx)
    except TemplateError as e:
        raise RequestError(f"chat template failed to render: {e}") from None


def ids_from(values: Iterable) -> list[int]:
    """A prompt given as ids: validated ints."""
    try:
        ids = [int(v) for v in values]
    except (TypeError, ValueError):
        raise RequestError("a token-id prompt must be a list of integers") from None
    return ids
