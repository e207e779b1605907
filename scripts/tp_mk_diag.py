"""Where does the tensor-parallel monokernel part from the per-op TP path? One-step logits along the per-op
path's greedy tokens (TpMonokernelBackend.decode vs TpGpuBackend.decode on the same shards), and the same at
tp = 1 with the LL exchange on (MonokernelBackend.decode vs GpuBackend.decode). Prints max |difference| per
step; bitwise equality is the expectation for both."""
import sys

import numpy as np

from hipengine.backend import SamplingParams
from hipengine.presets import preset_model


def compare(be, per_op_decode, prompt, toks, what):
    be.reset(); be.prefill(prompt)
    a = [per_op_decode(be, t) for t in toks]
    be.reset(); be.prefill(prompt)
    b = [be.decode(t) for t in toks]
    for i, (x, y) in enumerate(zip(a, b)):
        d = np.abs(x - y)
        print(f"{what} step {i}: max|diff| {d.max():.3g} at {int(d.argmax())} (rank slice {int(d.argmax()) // (x.size // 2)}), "
              f"equal {np.array_equal(x, y)}, argmax {int(x.argmax())} vs {int(y.argmax())}", flush=True)


def main():
    model = preset_model("llama-3.2-1b", 0)
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, 16)
    which = sys.argv[1:] or ["tp2", "tp1ll"]  # (the stage profile: hipengine bench decode --tp 2 --profile)
    if "tp2" in which:
        from hipengine.gpu.tp_executor import TpGpuBackend
        from hipengine.gpu.tp_monokernel import TpMonokernelBackend
        be = TpMonokernelBackend(model, max_context=256, tp=2)
        toks = list(TpGpuBackend.generate_ids(be, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
        print("per-op tp2 tokens", toks)
        compare(be, TpGpuBackend.decode, prompt, toks, "tp2")
        be.close()
    if "tp1ll" in which:
        import os
        os.environ["HIPENGINE_MK_LL"] = "1"
        from hipengine.gpu.executor import GpuBackend
        from hipengine.gpu.monokernel import MonokernelBackend
        be = MonokernelBackend(model, max_context=256)
        toks = list(GpuBackend.generate_ids(be, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
        compare(be, GpuBackend.decode, prompt, toks, "tp1-ll")
        be.close()


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
