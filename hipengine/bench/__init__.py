"""Benchmarks: ``probe`` (the machine's ceilings), ``decode`` (tok/s against the roofline), ``allreduce``.

Each module has ``run(args) -> int`` for the CLI and writes JSON results that name the commit, the GPU and
the date (committed under benchmarks/results/). Helpers shared by all of them live here.
"""
from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """HEAD of the source tree being measured; $HIPENGINE_COMMIT where the tree is a copy without .git (the
    device machine), else "unknown"."""
    import os

    if os.environ.get("HIPENGINE_COMMIT"):
        return os.environ["HIPENGINE_COMMIT"]
    try:
        p = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
