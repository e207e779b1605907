"""Vendor-neutral half of kernel compilation: where sources live, what their hash is, where binaries are cached.

Both backends (hiprtc for AMD, NVRTC for NVIDIA) and ``hipengine kernels check`` (clang-19 + NVRTC) go through
``cached_build``: the key covers the source *and every local header it pulls in* (``#include "..."``,
transitively), the target arch, the full option list and the compiler's identity, so editing ``port.h``
invalidates every kernel that includes it while an unrelated edit does not. Binaries land in
``$HIPENGINE_CACHE`` (default ``~/.cache/hipengine``), written atomically so concurrent processes (pytest
workers, TP ranks) never read a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ..errors import DeviceError
from .runtime import KERNELS_DIR

# Only quoted includes are ours; <system> headers come from the toolchain and are covered by its version.
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)

# Bump when the meaning of cached files changes (layout of the key, extra post-processing).
_CACHE_FORMAT = "1"


def cache_dir() -> Path:
    root = os.environ.get("HIPENGINE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hipengine"


def include_dirs() -> list[Path]:
    """Directories searched for quoted includes, after the including file's own directory."""
    return [KERNELS_DIR]


def resolve_source(source: str | Path) -> tuple[Path | None, str]:
    """(path or None, source text). ``source`` is a path (relative paths are under kernels_hip/) or, when it
    contains a newline, the kernel text itself (tests and probes compile small inline kernels)."""
    if isinstance(source, str) and "\n" in source:
        return None, source
    path = Path(source)
    if not path.is_absolute():
        path = KERNELS_DIR / path
    if not path.is_file():
        raise DeviceError(f"kernel source not found: {path}")
    return path, path.read_text()


def _find_include(name: str, including_dir: Path | None) -> Path | None:
    candidates = ([including_dir] if including_dir else []) + include_dirs()
    for d in candidates:
        p = d / name
        if p.is_file():
            return p.resolve()
    return None


def local_includes(text: str, directory: Path | None) -> list[Path]:
    """Every local header reachable from ``text`` (transitively), in a stable order, each once."""
    seen: dict[Path, None] = {}
    stack = [(text, directory)]
    while stack:
        body, d = stack.pop()
        for name in _INCLUDE_RE.findall(body):
            p = _find_include(name, d)
            # Unresolvable quoted includes are left to the compiler to report; they cannot affect the key.
            if p is None or p in seen:
                continue
            seen[p] = None
            stack.append((p.read_text(), p.parent))
    return sorted(seen)


def source_hash(text: str, directory: Path | None) -> str:
    h = hashlib.sha256()
    h.update(text.encode())
    for p in local_includes(text, directory):
        h.update(b"\0" + str(p.relative_to(KERNELS_DIR) if p.is_relative_to(KERNELS_DIR) else p).encode())
        h.update(b"\0" + p.read_bytes())
    return h.hexdigest()


def define_options(defines: dict | None) -> list[str]:
    """``{"BLOCK": 256, "USE_X": True}`` -> ``["-DBLOCK=256", "-DUSE_X=1"]`` (sorted: the key must not depend
    on dict order)."""
    out = []
    for k, v in sorted((defines or {}).items()):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
            raise DeviceError(f"invalid preprocessor define name {k!r}")
        if v is None:
            out.append(f"-D{k}")
        elif isinstance(v, bool):
            out.append(f"-D{k}={int(v)}")
        else:
            out.append(f"-D{k}={v}")
    return out


def cache_key(text: str, directory: Path | None, arch: str, options: list[str], compiler_id: str) -> str:
    h = hashlib.sha256()
    for part in (_CACHE_FORMAT, compiler_id, arch, "\0".join(options), source_hash(text, directory)):
        h.update(part.encode() + b"\x01")
    return h.hexdigest()[:32]


def cached_build(text: str, directory: Path | None, arch: str, options: list[str], compiler_id: str,
                 build: Callable[[], bytes], suffix: str = ".bin") -> bytes:
    """Return the cached binary for this (source+includes, arch, options, compiler) or build and store it.
    ``HIPENGINE_NO_CACHE=1`` bypasses the cache (always builds, stores nothing)."""
    if os.environ.get("HIPENGINE_NO_CACHE") == "1":
        return build()
    key = cache_key(text, directory, arch, options, compiler_id)
    d = cache_dir() / arch
    path = d / f"{key}{suffix}"
    try:
        data = path.read_bytes()
        if data:
            return data
    except OSError:
        pass
    data = build()
    try:
        d.mkdir(parents=True, exist_ok=True)
        # Write to a temp file in the same directory then rename: readers see nothing or the whole file.
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=suffix)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full cache directory only costs a recompile next time
    return data


def show_warnings(name: str, log: str, tool: str) -> None:
    """Print a fresh compile's warnings to stderr (cached builds stay quiet: they were shown when built).
    ``hipengine kernels check`` turns the same warnings into failures."""
    if log and "warning" in log.lower():
        print(f"hipengine: {tool} warnings in {name}:\n{first_lines(log)}", file=sys.stderr)


def first_lines(log: str, n: int = 20) -> str:
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    more = f"\n... ({len(lines) - n} more lines)" if len(lines) > n else ""
    return "\n".join(lines[:n]) + more
