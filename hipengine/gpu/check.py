"""``hipengine kernels check``: compile every kernel compilation unit for gfx942 and sm_90, no GPU needed.

* gfx942 (MI300X): Debian's clang-19 in HIP mode, device-only, without HIP headers or device libraries
  (port.h supplies the few builtins), then ``llvm-readelf-19 --notes`` must show the gfx942 target and
  ``.wavefront_size: 64`` for every kernel — proof the code object is wave64 CDNA code, not just "compiled".
* sm_90 (H100/H200): NVRTC through cuda-bindings, CUBIN (real SASS, so ptxas runs too).

Warnings are errors for both (clang -Wall -Werror, close to what NVRTC warns about by default; any "warning"
in the NVRTC log fails the unit). Units are kernels_hip/{ops,comm,monokernel}/*.hip; headers are checked
through the units that include them. Successful results are cached under the compile cache, keyed by
source+includes, target, options and compiler, so an unchanged tree re-checks in well under a second.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeviceError
from . import compiler
from .runtime import KERNELS_DIR

TARGETS = ("gfx942", "sm_90")
UNIT_DIRS = ("ops", "comm", "monokernel")
CLANG = "clang++-19"
READELF = "llvm-readelf-19"


@dataclass
class Result:
    file: str
    target: str
    ok: bool
    seconds: float
    registers: str = ""
    message: str = ""
    cached: bool = False
    skipped: bool = False


def units(root: Path = KERNELS_DIR) -> list[Path]:
    return sorted(p for d in UNIT_DIRS for p in (root / d).glob("*.hip"))


def _clang_options() -> list[str]:
    return ["-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "--no-gpu-bundle-output", "-nogpuinc",
            "-nogpulib", "-O3", "-Wall", "-Werror", "-std=c++17", f"-I{KERNELS_DIR}"]


def _tool_version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0] if out else tool
    except (OSError, subprocess.SubprocessError):
        return tool


def _check_gfx942(path: Path, text: str) -> tuple[str, str]:
    """Compile and verify one unit. Returns (registers summary, message); raises DeviceError on failure."""
    with tempfile.TemporaryDirectory(prefix="hipengine-check-") as tmp:
        out = Path(tmp) / (path.stem + ".co")
        cmd = [CLANG, *_clang_options(), "-c", str(path), "-o", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise DeviceError(compiler.first_lines(p.stderr or p.stdout or f"{CLANG} exited {p.returncode}", 25))
        notes = subprocess.run([READELF, "--notes", str(out)], capture_output=True, text=True)
        if notes.returncode != 0:
            raise DeviceError(f"{READELF} --notes failed: {notes.stderr.strip()}")
    n = notes.stdout
    if "gfx942" not in n:
        raise DeviceError("code object does not name gfx942 in its notes")
    kernels = re.findall(r"^\s*\.name:\s+(\S+)", n, re.M)
    waves = re.findall(r"\.wavefront_size:\s+(\d+)", n)
    if "__global__" in text or "HE_KERNEL" in text:
        if not waves:
            raise DeviceError("no kernel found in the code object's notes")
    if any(w != "64" for w in waves):
        raise DeviceError(f"wavefront sizes {sorted(set(waves))} in the notes, expected 64 (CDNA3 is wave64)")
    vgpr = [int(v) for v in re.findall(r"\.vgpr_count:\s+(\d+)", n)]
    sgpr = [int(v) for v in re.findall(r"\.sgpr_count:\s+(\d+)", n)]
    spills = sum(int(v) for v in re.findall(r"\.vgpr_spill_count:\s+(\d+)", n))
    regs = f"v{max(vgpr)}/s{max(sgpr)}" if vgpr and sgpr else ""
    msg = f"{len(kernels)} kernels" + (f", {spills} VGPR spills" if spills else "")
    return regs, msg


def _check_sm90(path: Path, text: str) -> tuple[str, str]:
    from . import backend_cuda

    opts = backend_cuda.nvrtc_options("sm_90", path.parent, None, ["--ptxas-options=-v"])
    _, log = backend_cuda.nvrtc_compile(text, path.name, opts)
    warnings = [ln for ln in log.splitlines() if re.search(r"\bwarning\b", ln, re.I)]
    if warnings:
        raise DeviceError("warnings (treated as errors):\n" + compiler.first_lines(log, 25))
    regs = [int(v) for v in re.findall(r"Used (\d+) registers", log)]
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    msg = f"{len(regs)} kernels" + (f", {spills} B spill stores" if spills else "")
    return (str(max(regs)) if regs else ""), msg


def _compiler_id(target: str) -> str | None:
    """Identity of the toolchain for ``target`` (part of the cache key), or None if it is missing."""
    if target == "gfx942":
        if not (shutil.which(CLANG) and shutil.which(READELF)):
            return None
        return _tool_version(CLANG)
    from . import backend_cuda

    return backend_cuda.nvrtc_id() if backend_cuda.nvrtc_available() else None


def _rel(path: Path) -> str:
    return str(path.relative_to(KERNELS_DIR)) if path.is_relative_to(KERNELS_DIR) else str(path)


def check_unit(path: Path, target: str, compiler_id: str, use_cache: bool = True) -> Result:
    rel = _rel(path)
    text = path.read_text()
    opts = _clang_options() if target == "gfx942" else ["sm_90", "-std=c++17", "--ptxas-options=-v"]
    key = compiler.cache_key(text, path.parent, target, [o for o in opts if not o.startswith("-I")], compiler_id)
    cache_file = compiler.cache_dir() / "check" / f"{key}.json"
    if use_cache:
        try:
            d = json.loads(cache_file.read_text())
            return Result(rel, target, True, 0.0, d.get("registers", ""), d.get("message", ""), cached=True)
        except (OSError, ValueError):
            pass
    t0 = time.perf_counter()
    try:
        regs, msg = (_check_gfx942 if target == "gfx942" else _check_sm90)(path, text)
    except DeviceError as e:
        return Result(rel, target, False, time.perf_counter() - t0, message=str(e))
    res = Result(rel, target, True, time.perf_counter() - t0, regs, msg)
    if use_cache:  # only successes are cached: a failure must be re-reported every run
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"registers": regs, "message": msg}))
            os.replace(tmp, cache_file)
        except OSError:
            pass
    return res


def check_all(targets=TARGETS, files: list[Path] | None = None, jobs: int = 2, use_cache: bool = True,
              skip_missing: bool = False) -> list[Result]:
    files = units() if files is None else files
    results: list[Result] = []
    work = []
    for target in targets:
        if target not in TARGETS:
            raise DeviceError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
        cid = _compiler_id(target)
        if cid is None:
            what = (f"{CLANG}/{READELF} not found (apt-get install clang-19 llvm-19)" if target == "gfx942"
                    else "NVRTC not found (pip install cuda-bindings nvidia-cuda-nvrtc)")
            if not skip_missing:
                raise DeviceError(f"cannot check {target}: {what}; pass --skip-missing to skip this target")
            results += [Result(_rel(f), target, True, 0.0, message=f"skipped: {what}",
                               skipped=True) for f in files]
            continue
        work += [(f, target, cid) for f in files]
    # Two workers: CI has two cores; clang runs as a subprocess and NVRTC releases the GIL while compiling.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results += list(pool.map(lambda w: check_unit(*w, use_cache=use_cache), work))
    order = {t: i for i, t in enumerate(TARGETS)}
    return sorted(results, key=lambda r: (r.file, order.get(r.target, 9)))


def format_table(results: list[Result]) -> str:
    rows = [("file", "target", "result", "seconds", "registers", "notes")]
    for r in results:
        status = "skip" if r.skipped else ("ok" if r.ok else "FAIL")
        secs = "cached" if r.cached else f"{r.seconds:.2f}"
        note = r.message.splitlines()[0] if r.message else ""
        rows.append((r.file, r.target, status, secs, r.registers, note if r.ok else "see below"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def run(args) -> int:
    targets = tuple(getattr(args, "arch", None) or TARGETS)
    skip_missing = bool(getattr(args, "skip_missing", False)) or os.environ.get("HIPENGINE_CHECK_SKIP_MISSING") == "1"
    use_cache = not getattr(args, "no_cache", False)
    jobs = int(getattr(args, "jobs", 2) or 2)
    files = units()
    if not files:
        print(f"no kernel units found under {KERNELS_DIR}/{{{','.join(UNIT_DIRS)}}}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    results = check_all(targets, files, jobs=jobs, use_cache=use_cache, skip_missing=skip_missing)
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\n--- {r.file} [{r.target}] FAILED ---\n{r.message}", file=sys.stderr)
    n_ok = sum(r.ok and not r.skipped for r in results)
    print(f"\n{n_ok} ok, {len(failed)} failed, {sum(r.skipped for r in results)} skipped "
          f"({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


def add_arguments(ap) -> None:
    """The options of ``hipengine kernels check`` (shared by the CLI and ``python -m hipengine.gpu.check``)."""
    ap.add_argument("--arch", action="append", default=None, help="only these targets (gfx942, sm_90)")
    ap.add_argument("--skip-missing", action="store_true", help="skip a target whose compiler is not installed")
    ap.add_argument("--no-cache", action="store_true", help="recompile everything")
    ap.add_argument("--jobs", type=int, default=2)


def main(argv: list[str] | None = None) -> int:
    """``python -m hipengine.gpu.check`` (the same as ``hipengine kernels check`` plus the extra options)."""
    ap = argparse.ArgumentParser(prog="python -m hipengine.gpu.check", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except DeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
