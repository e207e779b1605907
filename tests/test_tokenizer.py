"""Tokenizer: GGUF-built ids and chat templates identical to transformers; round trips; streaming detokenizer."""
from __future__ import annotations

import json

import pytest

from hipengine.errors import RequestError, UnsupportedError
from hipengine.tokenizer import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, Tokenizer)

TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n\n\tprint(fib(10))",
    "日本語のテキストと中文混合，한국어도 조금.",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 ✨",
    "   leading   and trailing   \n\n\n  \t ",
    "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
    "numbers 1234567 3.14159 1e-5 -42 0x1F",
    "Ünïcödé àçcénts ß ø Ωμέγα Привет",
    "a\r\nb\tc  d   e    f",
    "don't I'll we're they've SHE'S",
    " ",
    "",
    "{\"json\": [1, 2, {\"k\": null}]}",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
    [{"role": "user", "content": "日本語で答えて 😀"}, {"role": "assistant", "content": "はい"}],
]


@pytest.fixture(scope="module")
def gguf_pair(default_model_path):
    """(our Tokenizer from the GGUF metadata, transformers' tokenizer from the same GGUF)."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(default_model_path)))
    theirs = transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent),
                                                        gguf_file=default_model_path.name)
    return ours, theirs


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(gguf_pair, text):
    ours, theirs = gguf_pair
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("msgs", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(gguf_pair, msgs, gen):
    ours, theirs = gguf_pair
    assert ours.render_chat(msgs, add_generation_prompt=gen) == theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=gen)


def test_gguf_special_tokens(gguf_pair):
    ours, theirs = gguf_pair
    im_end = ours.token_to_id("<|im_end|>")
    assert ours.eos_id == im_end == theirs.convert_tokens_to_ids(theirs.eos_token)
    assert ours.is_special(im_end)
    assert im_end in ours.end_of_turn_ids()
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    assert ours.decode([im_end], skip_special_tokens=True) == ""


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_decode_round_trip(gguf_pair, text):
    ours, theirs = gguf_pair
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("text", ["emoji 😀🎉👍🏽 family 👨‍👩‍👧 done", "日本語のテキスト、中文。", "mixed é ß 😀 ok"])
def test_streaming_detokenizer_never_breaks_utf8(gguf_pair, text):
    ours, _ = gguf_pair
    ids = ours.encode(text)
    det = ours.detokenizer()
    pieces = [det.add(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Emoji span several byte-level tokens, so some steps must have held text back.
    if any(ord(c) > 0xFFFF for c in text):
        assert "" in pieces[:-1]


# ---- HF directory -----------------------------------------------------------
def _byte_tokenizer_dir(tmp_path, bos_in_post=False, add_bos=False):
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>", "<|eot|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = HFTok(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    if bos_in_post:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": add_bos,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot|>"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}))
    return tmp_path


@pytest.mark.parametrize("bos_in_post,add_bos", [(False, False), (False, True), (True, False)])
def test_hf_dir_bos_once(tmp_path, bos_in_post, add_bos):
    tok = Tokenizer.from_hf_dir(_byte_tokenizer_dir(tmp_path, bos_in_post, add_bos))
    ids = tok.encode("hi")
    want_bos = bos_in_post or add_bos
    assert ids[:1] == ([1] if want_bos else [ids[0]]) and ids.count(1) == (1 if want_bos else 0)
    assert tok.encode("hi", add_special_tokens=False).count(1) == 0
    assert tok.decode(ids) == "hi"
    assert tok.eos_id == 2
    assert tok.end_of_turn_ids() == {3}  # <|eot|> ends a turn in the template
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "<s>user: x<|eot|>assistant:"


def test_template_helpers(tmp_path):
    tok = Tokenizer.from_hf_dir(_byte_tokenizer_dir(tmp_path))
    tok.chat_template = ("{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                         "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ tools is none }}")
    out = tok.render_chat([{"role": "user", "content": "é"}])
    assert out == '[{"role": "user", "content": "é"}]|4|True'
    with pytest.raises(RequestError, match="no bad roles"):
        tok.render_chat([{"role": "bad", "content": ""}])
    with pytest.raises(RequestError):
        tok.render_chat("not a list")


def test_template_is_sandboxed(tmp_path):
    tok = Tokenizer.from_hf_dir(_byte_tokenizer_dir(tmp_path))
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(RequestError):
        tok.render_chat([{"role": "user", "content": "x"}])


# ---- GGUF "llama" (SentencePiece) vocabulary --------------------------------
class _Field:
    def __init__(self, v):
        self.v = v

    def contents(self):
        return self.v


class _FakeReader:
    def __init__(self, **kv):
        self.fields = {k.replace("__", "."): _Field(v) for k, v in kv.items()}


def _spm_reader(add_space_prefix=True):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    pieces = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
              "he": -3.0, "ll": -3.5, "hell": -4.0, "hello": -4.5, "▁hello": -5.0, "or": -3.0, "▁w": -3.0,
              "▁wor": -6.0, "ld": -3.0, "▁world": -7.0}
    scores = [0.0] * len(tokens)
    for p, s in pieces.items():
        tokens.append(p)
        types.append(TOKEN_NORMAL)
        scores.append(s)
    kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.add_space_prefix": add_space_prefix}
    r = _FakeReader()
    r.fields = {k: _Field(v) for k, v in kv.items()}
    return r, tokens


def test_gguf_sentencepiece_vocab():
    r, tokens = _spm_reader()
    tok = Tokenizer.from_gguf(r)
    ids = tok.encode("hello world")
    assert ids[0] == 1  # llama.cpp adds BOS to SentencePiece vocabularies by default
    assert [tokens[i] for i in ids[1:]] == ["▁hello", "▁world"]
    # é is not in the vocabulary: byte fallback to its two UTF-8 bytes, and back on decode.
    ids = tok.encode("hello é", add_special_tokens=False)
    assert [tokens[i] for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hello é"
    assert tok.decode(tok.encode("hello world")) == "hello world"
    det = tok.detokenizer()
    assert "".join(det.add(i) for i in tok.encode("world hello é")) + det.flush() == "world hello é"


def test_gguf_unknown_tokenizer_model():
    r, _ = _spm_reader()
    r.fields["tokenizer.ggml.model"] = _Field("rwkv")
    with pytest.raises(UnsupportedError, match="rwkv"):
        Tokenizer.from_gguf(r)


def test_ids_only_tokenizer():
    tok = Tokenizer.ids_only(100)
    assert not tok.has_text
    assert tok.decode([5, 7]) == "<5><7>"
    assert tok.detokenizer().add(9) == "<9>"
    with pytest.raises(RequestError, match="token ids"):
        tok.encode("hello")


def test_end_of_turn_is_the_token_after_the_reply(tmp_path):
    tok = Tokenizer.from_hf_dir(_byte_tokenizer_dir(tmp_path))
    # Llama-3 shape: a header-closing special token precedes the content, the turn-closing one follows it.
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}</s>\n\n{{ m['content'] | trim }}<|eot|>"
                         "{% endfor %}{% if add_generation_prompt %}<s>assistant</s>\n\n{% endif %}")
    assert tok.end_of_turn_ids() == {3}
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no special token after
    assert tok.end_of_turn_ids() == set()
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    assert tok.end_of_turn_ids() == set()
