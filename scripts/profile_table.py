"""The monokernel's stage profile as per-layer tables by block role: where a layer's time goes, block by block.

Reads the JSON that `hipengine bench decode --profile --json OUT` (or device_session.sh's profile steps) writes
and prints, per file, the table `bench decode --profile` prints at the end of its stage profile
(hipengine/bench/decode.py layer_marks): the medians over each range of blocks that play the same role in the
layer (more QKV units, fewer, an attention split after them), in µs per layer from the layer's start —

    QKV done | attention left (the grouped O-proj's group counter seen) | O work done | O barrier exit (the
    window) | gate/up | down | the layer

— then the attention split's own marks (from the split's start: first q poll back, q ready, tiles scored, warp
states merged, split done) and, per step, the LM head and the token selection. With two or more files, each later
file's change against the first (on the first file's block ranges). These are the tables docs/perf-log.md has
quoted since session 47.

    python scripts/profile_table.py A.json [B.json ...] [--layers N] [--groups 0-59,60-67,68-131] [--context C]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hipengine.bench.decode import LAYER_MARKS, block_roles, layer_marks, role_table
from hipengine.errors import HipEngineError


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


def render(name: str, doc: dict, res: dict, rows: list[dict], n_layers: int) -> str:
    sp = res["stage_profile"]
    t = sp["blocks"]["total_us"]
    head, sel = (float(np.median(np.asarray(t.get(k, [0.0]), float))) for k in ("lm_head", "select"))
    return "\n".join([
        f"{name}: {doc.get('gpu', '?')}, commit {doc.get('commit', '?')}, context {res.get('context')}, {n_layers} "
        f"layers; step {sp.get('us_per_step', 0):.1f} µs ({res.get('tok_s', 0):.1f} tok/s, a profile build); HBM read "
        f"{doc.get('hbm_read_gbps', 0):.0f} GB/s",
        role_table(rows),
        f"  per step (medians over the grid): LM head {head:.1f} µs, token selection {sel:.1f} µs"])


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
            groups = block_roles(blocks)
        rows = layer_marks(blocks, groups, n_layers)
        print(render(Path(path).name, doc, res, rows, n_layers))
        print()
        if first is None:
            first = (Path(path).name, rows, groups)
        else:
            print(f"{Path(path).name} against {first[0]} (µs per layer, + is slower):")
            if [r["blocks"] for r in rows] != [r["blocks"] for r in first[1]]:
                print("    (the block ranges differ: no comparison)\n")
                continue
            for r, r0 in zip(rows, first[1]):
                print(f"    {r['blocks']:9s} {r0['role']:18s}" + "".join(f"{r[k] - r0[k]:+10.2f}" for k, _ in LAYER_MARKS))
            print()
    return 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
