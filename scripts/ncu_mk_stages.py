"""Where the monokernel's warps stall, stage by stage: Nsight Compute's per-instruction stall samples (the
source page of `scripts/device_session.sh ncumk`, CSV) mapped to decode.hip's call sites.

The kernel is one function of ~19,000 SASS instructions, nearly all inlined, so ncu's own source view says
little. This script rebuilds the same monokernel on this machine with NVRTC and `-lineinfo` (the environment's
build knobs — HIPENGINE_MK_DEFINES, HIPENGINE_MK_PROFILE, ... — must be the device run's), disassembles it with
nvdisasm, checks that its instructions are the profiled ones (same count, same opcodes), and charges every
instruction to the statement of monokernel_decode it was inlined from: the matvec stages (`he_mv_finish`),
their weight fills (`he_mv_fill_next`), the attention, the grid waits, token selection. Per stage: its share of
all samples (of warp time) and the stall reasons inside it; also the share of no-instruction stalls that fall
on the first instruction of a 128-byte line (instruction-cache misses), and the instructions with the most
samples. docs/perf-log.md, session 24, is the first use.

Usage: python3 scripts/ncu_mk_stages.py NCU_SOURCE.csv [--root TREE] [--context 1024] [--json OUT] [--top 20]
(--root: the source tree the device ran, e.g. `git archive` of its commit; default this checkout)
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hipengine.errors import DeviceError, RequestError, UnsupportedError, run_script

# decode.hip statements (regex on the call site's source line) -> stage names
STAGES = [
    (r"he_mv_finish<[^(]*\(gu,|he_mlp_", "mlp"),  # the fused MLP's stage (MK_FUSED_MLP builds, ops/mlp.hip)
    (r"he_mv_finish<.*\(mk_qkv_(flow_)?op", "qkv"), (r"he_mv_finish<.*\(mk_o_op", "o_proj"),
    (r"he_mv_finish<.*\(mk_gate_up_op", "gate_up"), (r"he_mv_finish<.*\(mk_down_op", "down"),
    (r"he_mv_finish<.*\(mk_head_op", "lm_head"), (r"he_mv_begin\(", "stream_begin"),
    (r"he_mv_fill_next\(mk_qkv_op", "fill_qkv"), (r"he_mv_fill_next\(mk_o_op", "fill_o"),
    (r"he_mv_fill_next\(mk_gate_up_op", "fill_gate_up"), (r"he_mv_fill_next\(mk_down_op", "fill_down"),
    (r"he_mv_fill_next\(mk_head_op", "fill_lm_head"), (r"mk_attention(_flow)?(<\w+>)?\(", "attention"),
    (r"mk_combine\(", "combine"), (r"he_block_wait_geq\(", "wait_attention_count"),
    (r"(barrier|wait)\(kProfQkv\)", "wait_qkv"), (r"(barrier|wait)\(kProfO\)", "wait_o"),
    (r"(barrier|wait)\(kProfGateUp\)", "wait_gate_up"), (r"(barrier|wait)\(kProfDown\)", "wait_down"),
    (r"(barrier|wait)\(kProfHead\)", "wait_lm_head"), (r"barrier\(kProfAttn\)", "wait_attention"),
    (r"he_grid_wait\(|barrier\(kProfSelect\)", "wait_select"), (r"arrive\(", "arrive"),
    (r"mk_argmax_grid|he_sample_block|he_embedding_row|p\.eos|p\.ring|kMkHost|stop", "token_select"),
    (r"he_qk_norm_rope_head", "qk_norm"),
]


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia.cu13 as cu13  # the nvidia-cuda-nvdisasm wheel
        return str(next(Path(p) / "bin" / "nvdisasm" for p in cu13.__path__ if (Path(p) / "bin" / "nvdisasm").exists()))
    except (ImportError, StopIteration):
        raise UnsupportedError("nvdisasm not found: pip install nvidia-cuda-nvdisasm") from None


# Run with PYTHONPATH = the profiled tree, so that its own package and kernels build (the environment's build
# knobs apply as on the device): the monokernel at `context`, sm_90, -lineinfo, written to argv[2].
BUILD = """
import inspect, sys
from hipengine.gpu import backend_cuda as bc, compiler, monokernel as M
n = int(sys.argv[1])
# llama-3.2-1b's stream rows (hidden size, q_dim, ffn): perop_steps.py's shape (trees before v67 lack `rows`)
rows = {"rows": (2048, 2048, 8192)} if "rows" in inspect.signature(M.compile_args).parameters else {}
kw = M.compile_args("nvidia", False, 4, head_dim=64, q_regs=M.q_regs_build(n), max_context=n, arch="sm_90", **rows)
path, text = compiler.resolve_source(M.SOURCE)
opts = bc.nvrtc_options("sm_90", path.parent, kw.get("defines"), kw.get("options")) + ["-lineinfo"]
open(sys.argv[2], "wb").write(bc.nvrtc_compile(text, path.name, opts)[0])
"""


def build_listing(root: Path, context: int) -> tuple[list[tuple[str, int, str]], list[str]]:
    """[(file, outer line, instruction text)] per instruction of monokernel_decode, and decode.hip's lines."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "mk.cubin"
        env = {**os.environ, "PYTHONPATH": str(root)}
        r = subprocess.run([sys.executable, "-c", BUILD, str(context), str(cubin)], env=env, cwd=root,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise DeviceError(f"building the monokernel of {root} failed: {r.stderr.strip().splitlines()[-1:]}")
        sass = subprocess.run([nvdisasm(), "-gi", "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    body = sass.split(".text.monokernel_decode:")[1].split("\t.section")[0]
    out, outer = [], ("?", 0)
    for line in body.splitlines():
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)(.*)', line)
        if m:
            if "inlined at" not in m.group(3):
                outer = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*)", line)
        if m:
            out.append((outer[0], outer[1], m.group(1)))
    return out, (root / "kernels_hip" / "monokernel" / "decode.hip").read_text().splitlines()


def stage_of(fname: str, line: int, src: list[str], kernel_start: int) -> str:
    if fname != "decode.hip":
        return "attention" if fname == "attention_decode.hip" else fname
    if line < kernel_start:
        return "prologue"
    text = src[line - 1] if 0 < line <= len(src) else ""
    for pat, name in STAGES:
        if re.search(pat, text):
            return name
    return f"other:{line}"


def opcode(s: str) -> str:
    s = re.sub(r"^@!?U?P\w+\s+", "", s.strip())
    return s.split()[0].split(".")[0] if s else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    try:
        rows = list(csv.reader(open(a.csv)))
        start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    except (OSError, StopIteration):
        raise RequestError(f"{a.csv}: not an Nsight Compute source page (ncu --page source --csv)") from None
    hdr, data = rows[start], [r for r in rows[start + 1:] if len(r) >= len(rows[start])]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    listing, src = build_listing(Path(a.root), a.context)
    if len(listing) != len(data):
        raise RequestError(f"the rebuilt kernel has {len(listing)} instructions, the profile {len(data)}: "
                         "not the profiled build (tree, context or build knobs differ)")
    mism = sum(opcode(r[1]) != opcode(x[2]) for r, x in zip(data, listing))
    if mism > len(data) // 100:
        raise RequestError(f"{mism} opcodes differ between the rebuilt kernel and the profile: not the same build")
    kstart = next(i + 1 for i, s in enumerate(src) if "monokernel_decode(" in s and "__global__" in s)
    per = collections.defaultdict(collections.Counter)
    total, slot0, execd, tops = collections.Counter(), 0, 0, []
    base = int(data[0][0], 16)
    for r, (f, ln, txt) in zip(data, listing):
        st = stage_of(f, ln, src, kstart)
        c = {h[6:]: int(r[ix[h]] or 0) for h in reasons}
        per[st].update(c)
        total.update(c)
        if (int(r[0], 16) - base) % 128 == 0:
            slot0 += c.get("no_inst", 0)
        execd += int(r[ix["Instructions Executed"]] or 0) > 0
        n = sum(c.values())
        if n:
            tops.append((n, int(r[0], 16) - base, st, txt.strip()[:70], max(c, key=c.get)))
    T = sum(total.values()) or 1
    for st in [s for s in per if s.startswith("other:") and sum(per[s].values()) < 0.001 * T]:
        per["other"].update(per.pop(st))  # statements with < 0.1% of the samples, together
    res = {"csv": a.csv, "samples": T, "instructions": len(data), "executed_instructions": execd,
           "stall_pct": {k: round(100 * v / T, 2) for k, v in total.most_common() if v},
           "no_inst_on_line_start_pct": round(100 * slot0 / max(total["no_inst"], 1), 1),
           "stages": {s: {"share_pct": round(100 * sum(c.values()) / T, 2),
                          **{f"{k}_pct": round(100 * v / max(sum(c.values()), 1), 1) for k, v in c.most_common(4) if v}}
                      for s, c in sorted(per.items(), key=lambda kv: -sum(kv[1].values()))},
           "top_instructions": [{"offset": hex(o), "share_pct": round(100 * n / T, 2), "stage": s, "sass": t,
                                 "reason": why} for n, o, s, t, why in sorted(tops, reverse=True)[:a.top]]}
    print(f"{T} samples; {execd} of {len(data)} instructions executed; stalls: " +
          ", ".join(f"{k} {v}%" for k, v in list(res["stall_pct"].items())[:8]))
    print(f"no-instruction stalls on a 128-byte line's first instruction: {res['no_inst_on_line_start_pct']}%")
    for s, v in res["stages"].items():
        print(f"  {s:22s} " + "  ".join(f"{k} {x}" for k, x in v.items()))
    for t in res["top_instructions"]:
        print(f"  {t['offset']:>8s} {t['share_pct']:5.2f}% {t['stage']:18s} {t['reason']:10s} {t['sass']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    run_script(main)
