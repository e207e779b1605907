"""How many LM-head rows an exact screen would have to recompute at a given weight precision (CPU, float32).

The greedy LM head's screen (ops/head_screen.hip) streams a quantised copy of the head and recomputes in bf16 only
the rows whose interval [A − B, A + B] can hold the arg-max, with B = ||w_i − ŵ_i||₂ · ||x||₂ (Cauchy–Schwarz; the
device adds small float32 terms, left out here). This script runs the default model (or --model) on a paragraph
of real text and prints, per quantisation of the head's rows, the median bound and how many rows are candidates
at each position: a format gains only where the candidates stay a handful (docs/perf-log.md, session 55).

    python scripts/screen_bits.py [--model PATH] [--text STR]
"""
from __future__ import annotations

import argparse

import numpy as np

from hipengine.loader import default_model_path, load_model
from hipengine.reference import ReferenceBackend
from hipengine.tokenizer import Tokenizer

TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. Its legal system, roads and language shaped Europe. In science, the periodic table "
        "organizes elements by atomic number; water boils at one hundred degrees Celsius at sea level. ") * 2


def quantised(w: np.ndarray, levels: int, group: int | None = None) -> np.ndarray:
    """Rows (or groups of `group` columns) scaled by max|w| / levels and rounded: what the screen would stream."""
    v, d = w.shape
    g = w.reshape(v, 1 if group is None else d // group, -1)
    s = np.abs(g).max(2, keepdims=True) / levels
    return (np.rint(g / np.where(s == 0, 1, s)) * s).reshape(v, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default=TEXT)
    a = ap.parse_args()
    m = load_model(a.model or default_model_path())
    ids = np.array(Tokenizer.for_model(m).encode(a.text))
    rb = ReferenceBackend(m, max(len(ids), 16))
    xs = rb.final_hidden(ids)  # (T, d): the head's inputs
    w = rb.lm_head
    print(f"{len(ids)} positions, head {w.shape[0]} x {w.shape[1]}")
    for name, levels, group in [("int8 per row (the screen)", 127, None), ("int6 per row", 31, None),
                                ("int4 per row", 7, None), ("int4 per 32 columns", 7, 32),
                                ("int4 per 16 columns", 7, 16)]:
        wq = quantised(w, levels, group)
        a_ = xs @ wq.T
        b_ = np.linalg.norm(w - wq, axis=1)[None, :] * np.linalg.norm(xs, axis=1, keepdims=True)
        n = ((a_ + b_) >= (a_ - b_).max(1, keepdims=True)).sum(1)
        print(f"{name:26s} bound median {np.median(b_):6.2f}   candidates median {np.median(n):6.0f}  "
              f"p90 {np.percentile(n, 90):6.0f}  max {n.max()}")


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
