"""The monokernel's stage profile as per-layer tables by block role: where a layer's time goes, block by block.

Reads the JSON that `hipengine bench decode --profile --json OUT` (or device_session.sh's profile steps) writes
and prints, per file, the medians over each range of blocks that play the same role in the layer (more QKV units,
fewer, an attention split after them), in µs per layer from the layer's start:

    QKV done | attention left (the grouped O-proj's group counter seen) | O work done | O barrier exit (the
    window) | gate/up | down | the layer

then the attention split's own marks (from the split's start: first q poll back, q ready, tiles scored, warp
states merged, split done) and, per step, the LM head, the token selection and the step. With two or more files,
a last table gives each file's change against the first. These are the tables docs/perf-log.md has quoted since
session 47, read the same way (each block row is cumulative within its stage: work <= sync <= arrive <= total).

    python scripts/profile_table.py A.json [B.json ...] [--layers N] [--groups 0-59,60-67,68-131] [--context C]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hipengine.errors import HipEngineError

SPLIT_MARKS = [("attn_q_first", "q first"), ("attn_q_ready", "q ready"), ("attn_loop", "scored"),
               ("attn_merge", "merged"), ("attn_split", "split done")]


def load(path: str, context: int | None) -> tuple[dict, dict]:
    """(the file's header, the result row with a stage profile: the first, or the one at `context`)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise HipEngineError(f"{path}: cannot read a JSON document ({e})") from None
    rows = [r for r in doc.get("results", []) if isinstance(r, dict) and "blocks" in (r.get("stage_profile") or {})]
    if context is not None:
        rows = [r for r in rows if r.get("context") == context]
    if not rows:
        where = f" at context {context}" if context is not None else ""
        raise HipEngineError(f"{path}: no result with a per-block stage profile{where} (bench decode --profile writes one)")
    return doc, rows[0]


def layers_of(doc: dict, given: int | None) -> int:
    if given is not None:
        if given < 1:
            raise HipEngineError(f"--layers {given}: give the model's number of layers (1 or more)")
        return given
    from hipengine.presets import PRESETS

    cfg = PRESETS.get(str(doc.get("model")))
    if cfg is None:
        raise HipEngineError(f"model {doc.get('model')!r} is not a preset: give --layers")
    return cfg.num_layers


def roles(blocks: dict) -> list[tuple[int, int, str]]:
    """Contiguous block ranges of one role: whether the block ran an attention split, and whether its QKV took the
    longer or the shorter of the grid's two QKV times (more units per warp, or fewer)."""
    qkv = np.asarray(blocks["total_us"]["qkv"], float)
    split = np.asarray(blocks["work_us"].get("attn_split", np.zeros_like(qkv)), float) > 0
    lo, hi = qkv.min(), qkv.max()
    long_ = qkv > (lo + hi) / 2 if hi - lo > 0.2 * hi else np.zeros_like(split)
    sig = [(bool(a), bool(b)) for a, b in zip(long_, split)]
    out, start = [], 0
    for i in range(1, len(sig) + 1):
        if i == len(sig) or sig[i] != sig[start]:
            lg, sp = sig[start]
            out.append((start, i - 1, ("QKV long" if lg else "QKV short") + (" + split" if sp else "")))
            start = i
    return out


def parse_groups(text: str, nblocks: int) -> list[tuple[int, int, str]]:
    out = []
    for part in text.split(","):
        try:
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise HipEngineError(f"--groups: {part!r} is not a block range like 68-131") from None
        if not 0 <= lo <= hi < nblocks:
            raise HipEngineError(f"--groups: {part!r} is outside the profile's blocks 0-{nblocks - 1}")
        out.append((lo, hi, "given"))
    return out


def table(blocks: dict, groups: list[tuple[int, int, str]], n_layers: int) -> list[dict]:
    """Per group: the medians (µs per layer) of the marks the module docstring lists."""
    w, t = blocks["work_us"], blocks["total_us"]

    def med(col: dict, key: str, lo: int, hi: int) -> float:
        v = col.get(key)
        return float(np.median(np.asarray(v[lo:hi + 1], float))) / n_layers if v else 0.0

    out = []
    for lo, hi, role in groups:
        # (the attention stage, then fine = 2 builds' combine stage behind its own barrier; absent elsewhere)
        qkv, attn = med(t, "qkv", lo, hi), med(t, "attention", lo, hi) + med(t, "combine", lo, hi)
        row = {"blocks": f"{lo}-{hi}", "role": role, "qkv": qkv, "attn_left": qkv + attn,
               "o_work": qkv + attn + med(w, "o_proj", lo, hi), "window": qkv + attn + med(t, "o_proj", lo, hi),
               "gate_up": med(t, "gate_up", lo, hi), "down": med(t, "down", lo, hi)}
        row["layer"] = row["window"] + row["gate_up"] + row["down"]
        row["split"] = {k: med(w, k, lo, hi) for k, _ in SPLIT_MARKS}
        out.append(row)
    return out


COLS = [("qkv", "QKV done"), ("attn_left", "attn left"), ("o_work", "O work"), ("window", "O exit"),
        ("gate_up", "gate/up"), ("down", "down"), ("layer", "layer")]


def render(name: str, doc: dict, res: dict, rows: list[dict], n_layers: int) -> str:
    sp = res["stage_profile"]
    lines = [f"{name}: {doc.get('gpu', '?')}, commit {doc.get('commit', '?')}, context {res.get('context')}, "
             f"{n_layers} layers; step {sp.get('us_per_step', 0):.1f} µs ({res.get('tok_s', 0):.1f} tok/s, a profile "
             f"build); HBM read {doc.get('hbm_read_gbps', 0):.0f} GB/s",
             "µs per layer from the layer's start, medians over each block range:",
             f"  {'blocks':9s} {'role':18s}" + "".join(f"{h:>10s}" for _, h in COLS)]
    for r in rows:
        lines.append(f"  {r['blocks']:9s} {r['role']:18s}" + "".join(f"{r[k]:10.2f}" for k, _ in COLS))
    splits = [r for r in rows if r["split"]["attn_split"] > 0]
    if splits:
        lines.append("the attention split, µs per layer from its start:")
        lines.append(f"  {'blocks':9s} {'':18s}" + "".join(f"{h:>11s}" for _, h in SPLIT_MARKS))
        for r in splits:
            lines.append(f"  {r['blocks']:9s} {r['role']:18s}" + "".join(f"{r['split'][k]:11.2f}" for k, _ in SPLIT_MARKS))
    t = sp["blocks"]["total_us"]
    head, sel = (float(np.median(np.asarray(t.get(k, [0.0]), float))) for k in ("lm_head", "select"))
    lines.append(f"per step (medians over the grid): LM head {head:.1f} µs, token selection {sel:.1f} µs")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="profile JSON files (bench decode --profile --json)")
    ap.add_argument("--layers", type=int, default=None, help="layers per step (default: the preset's)")
    ap.add_argument("--groups", default=None, help="block ranges, e.g. 0-59,60-67,68-131 (default: by role)")
    ap.add_argument("--context", type=int, default=None, help="the result at this context (default: the first)")
    a = ap.parse_args()
    first = None
    for path in a.files:
        doc, res = load(path, a.context)
        n_layers = layers_of(doc, a.layers)
        blocks = res["stage_profile"]["blocks"]
        nb = len(blocks["total_us"]["qkv"])
        if a.groups:
            groups = parse_groups(a.groups, nb)
        elif first is not None and first[2][-1][1] == nb - 1:
            groups = first[2]  # the first file's ranges, so the rows compare like with like
        else:
            groups = roles(blocks)
        rows = table(blocks, groups, n_layers)
        print(render(Path(path).name, doc, res, rows, n_layers))
        print()
        if first is None:
            first = (Path(path).name, rows, groups)
        else:
            print(f"{Path(path).name} against {first[0]} (µs per layer, + is slower):")
            if [r["blocks"] for r in rows] != [r["blocks"] for r in first[1]]:
                print("  (the block ranges differ: no comparison)\n")
                continue
            for r, r0 in zip(rows, first[1]):
                print(f"  {r['blocks']:9s} {r0['role']:18s}" + "".join(f"{r[k] - r0[k]:+10.2f}" for k, _ in COLS))
            print()
    return 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
