"""The PDL kernels' machine code keeps step data behind the wait (sm_90 through NVRTC + nvdisasm; no GPU).

A kernel launched with programmatic dependent launch runs before the kernel ahead of it has finished, so a
load issued before griddepcontrol.wait (SASS: ACQBULK) may read what that kernel is still writing. By design
only two kinds of load come that early: weights (the matvec stream's first batches, he_load16_stream:
LDG.E.NA.128.CONSTANT) and the position / K/V rows the host lets the attention read early inside the decode
graph (coherent loads: LDG.E..., under the kernel's early flag). A NON-coherent load of anything else
(LDG.E.CONSTANT of a word, or any .CONSTANT load that is not the weight stream's) before the wait is the
compiler hoisting an ld.global.nc across it: step data read through a `const __restrict__` pointer or a
plain `*p` the compiler proved read-only (docs/perf-log.md v41; port.h he_ld_step). CI installs nvdisasm
(the test extra); elsewhere the test skips without it.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

KDIR = Path(__file__).resolve().parents[1] / "kernels_hip"
WEIGHT_STREAM = "LDG.E.NA.128.CONSTANT"


def _nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(cand)
    return None


def _nvrtc():
    try:
        from hipengine.gpu import backend_cuda as bc
    except Exception:  # noqa: BLE001 - cuda-bindings missing: the test does not apply
        return None
    return bc if bc.nvrtc_available() else None


BUILDS = [  # (unit, defines): every PDL op module, the attention one in both softmax builds
    ("ops/attention_decode.hip", {"HE_ATTN_LPR": 8, "HE_ATTN_HD": 64, "HE_ATTN_WARP_MAX": 1}),
    ("ops/attention_decode.hip", {"HE_ATTN_LPR": 8, "HE_ATTN_HD": 64, "HE_ATTN_WARP_MAX": 0}),
    ("ops/attention_prefill.hip", {"HE_AP_HD": 64}), ("ops/attention_prefill.hip", {"HE_AP_HD": 128}),
    ("ops/embedding.hip", None), ("ops/matvec.hip", None), ("ops/matvec.hip", {"HE_MATVEC_UNROLL": 8}),
    ("ops/prefill.hip", None), ("ops/qk_norm.hip", None), ("ops/rmsnorm.hip", None), ("ops/sampling.hip", None),
    ("comm/allreduce.hip", None),
]


def _functions(sass: str) -> dict:
    out, fn = {}, None
    for line in sass.splitlines():
        if line.startswith("//---------------------"):
            m = re.search(r"\.text\.(\S+)", line)
            fn = m.group(1) if m else None
            if fn:
                out[fn] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if fn and m:
            out[fn].append(m.group(1))
    return out


@pytest.mark.parametrize("unit,defines", BUILDS, ids=lambda x: str(x) if not isinstance(x, dict) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_no_noncoherent_step_load_before_the_wait(tmp_path, unit, defines):
    bc, exe = _nvrtc(), _nvdisasm()
    if bc is None or exe is None:
        pytest.skip("needs NVRTC (cuda-bindings + nvidia-cuda-nvrtc) and nvdisasm (nvidia-cuda-nvdisasm)")
    from hipengine.gpu import compiler

    path, text = compiler.resolve_source(unit)
    cubin, _ = bc.nvrtc_compile(text, path.name, bc.nvrtc_options("sm_90", path.parent, defines))
    (tmp_path / "k.cubin").write_bytes(cubin)
    sass = subprocess.run([exe, "-c", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stdout
    fns = _functions(sass)
    assert fns, "nvdisasm printed no functions"
    bad, waited = [], 0
    for fn, ins in fns.items():
        at = next((i for i, x in enumerate(ins) if "ACQBULK" in x.split()), None)
        if at is None:
            continue
        waited += 1
        for x in ins[:at]:
            op = next((t for t in x.split() if t.startswith("LDG")), None)
            if op and "CONSTANT" in op and op != WEIGHT_STREAM:
                bad.append(f"{fn}: {x}")
    assert waited, f"{unit}: no kernel with griddepcontrol.wait found"
    assert not bad, f"{unit}: non-coherent loads before griddepcontrol.wait:\n" + "\n".join(bad[:8])
