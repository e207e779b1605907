"""bf16 weights held losslessly in 13 bits each (kernels_hip/ops/matvec_packed.hip: the layout and why the sums
are the bf16 stream's, bit for bit).

A group of matrices that share a staged input (gate and up; down alone) gets one exponent offset D: every
weight is kept as w' = w · 2^-D with its exponent E' = E - D in [64, 95], so only E'4..E'0 (5 bits), the sign
and the mantissa (8 bits with E'0) are stored. Weights outside that window — below 2^-31 of the group's largest
binade, zeros, subnormals, inf / nan — cannot be; their rows are reported, and the device recomputes the units
holding them from the bf16 rows (exactly). ``unpack`` mirrors the device's decode in numpy (the tests' oracle).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError

E_LO, E_HI = 64, 95  # the stored exponents: E'7..E'5 == 010
SEL_LO, SEL_HI = 0x5140, 0x7362  # he_prmt selectors of a sweep's pairs (0, 1) / (2, 3) of an L word


def batch_cols(warp: int) -> int:
    """Columns per batch: 4 sweeps of warp * 8 (kMatvecBatch at unroll 4)."""
    return 32 * warp


def row_bytes(inn: int) -> int:
    return inn // 8 * 13


def check_shape(inn: int, warp: int) -> None:
    if inn % batch_cols(warp):
        raise UnsupportedError(f"packed weights need rows of a multiple of {batch_cols(warp)} columns "
                               f"(warp {warp}); this row has {inn}")


def offset_for(*mats: np.ndarray) -> int:
    """D for a group of bf16 matrices (uint16 bits): their largest finite binade maps to E' = 95; never below 0
    (a negative D would scale the staged input down, which is not exact for its smallest values)."""
    e_max = 0
    for m in mats:
        e = (m >> 7) & 0xFF
        e = e[e < 255]
        if e.size:
            e_max = max(e_max, int(e.max()))
    return max(e_max - E_HI, 0)


@dataclass
class Packed:
    data: np.ndarray  # uint8 [rows, row_bytes(in)]
    row_esc: np.ndarray  # bool [rows]: the row holds a weight the window cannot
    d: int  # the offset D


def pack(bits: np.ndarray, d: int, warp: int) -> Packed:
    """Pack a bf16 matrix [rows, in] (uint16 bits) with offset D for a warp of `warp` lanes."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    rows, inn = bits.shape
    check_shape(inn, warp)
    W, nb = warp, inn // batch_cols(warp)
    # [rows, nb, k, lane, j] -> [rows, nb, lane, k, j]: lane l's weight t = 8k + j is column nb*B + 8W*k + 8l + j
    b = bits.reshape(rows, nb, 4, W, 8).transpose(0, 1, 3, 2, 4)
    e = ((b >> 7) & 0xFF).astype(np.int16)
    ep = e - d
    esc = (ep < E_LO) | (ep > E_HI) | (e == 255)
    ep = np.where(esc, E_LO, ep).astype(np.uint16)
    low = (((ep & 1) << 7) | (b & 0x7F)).astype(np.uint8)  # [rows, nb, W, 4, 8]
    nib = ((ep >> 1) & 0xF).astype(np.uint8)
    sign = (b >> 15).astype(np.uint32)
    low = low.reshape(rows, nb, W, 32)
    la, lb = low[..., :16], low[..., 16:]
    kb = nib[..., :4] | (nib[..., 4:] << 4)  # [rows, nb, W, 4 (word k), 4 (byte i)]: j = i low, j = i + 4 high
    kb = kb.reshape(rows, nb, W, 16)
    t = np.arange(32)
    shift = (15 - t // 2 + 16 * (t % 2)).astype(np.uint32)
    s = (sign.reshape(rows, nb, W, 32) << shift).sum(axis=-1, dtype=np.uint32)
    sb = s.astype("<u4").view(np.uint8).reshape(rows, nb, W, 4)
    out = np.concatenate([la.reshape(rows, nb, 16 * W), lb.reshape(rows, nb, 16 * W),
                          kb.reshape(rows, nb, 16 * W), sb.reshape(rows, nb, 4 * W)], axis=-1)
    return Packed(np.ascontiguousarray(out.reshape(rows, row_bytes(inn))), esc.reshape(rows, -1).any(axis=1), d)


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """he_prmt (selectors 0-7): byte i of the result is byte (sel >> 4i) & 7 of b:a."""
    v = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros(a.shape, np.uint64)
    for i in range(4):
        k = (sel >> (4 * i)) & 7
        out |= ((v >> np.uint64(8 * k)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(np.uint32)


def unpack(data: np.ndarray, inn: int, warp: int) -> np.ndarray:
    """The device's decode (he_mvp_sweep) in numpy: the bf16 bits of w' for every weight (escaped ones are
    whatever the window's fill decodes to)."""
    rows = data.shape[0]
    W, nb = warp, inn // batch_cols(warp)
    blk = data.reshape(rows, nb, 52 * W)
    la = blk[..., :16 * W].reshape(rows, nb, W, 16)
    lb = blk[..., 16 * W:32 * W].reshape(rows, nb, W, 16)
    kp = blk[..., 32 * W:48 * W].reshape(rows, nb, W, 16)
    sp = blk[..., 48 * W:].reshape(rows, nb, W, 4)
    words = lambda x: np.ascontiguousarray(x).view("<u4")  # noqa: E731  [.., 4 words]
    L = np.concatenate([words(la), words(lb)], axis=-1)  # 8 words: sweep k's are 2k, 2k + 1
    K, S = words(kp), words(sp)[..., 0]
    out = np.zeros((rows, nb, W, 4, 8), np.uint16)
    for k in range(4):
        l0, l1, kw = L[..., 2 * k], L[..., 2 * k + 1], K[..., k]
        sk = (S << np.uint32(4 * k)).astype(np.uint32)
        ke = (kw & np.uint32(0x0F0F0F0F)) | np.uint32(0x20202020)
        ko = ((kw >> np.uint32(4)) & np.uint32(0x0F0F0F0F)) | np.uint32(0x20202020)
        pairs = [(l0, ke, SEL_LO), (l0, ke, SEL_HI), (l1, ko, SEL_LO), (l1, ko, SEL_HI)]
        for i, (lw, kx, sel) in enumerate(pairs):
            q = _prmt(lw, kx, sel) | ((sk << np.uint32(i)) & np.uint32(0x80008000))
            out[..., k, 2 * i] = (q & 0xFFFF).astype(np.uint16)
            out[..., k, 2 * i + 1] = (q >> 16).astype(np.uint16)
    return out.transpose(0, 1, 3, 2, 4).reshape(rows, inn)


def scaled(bits: np.ndarray, d: int) -> np.ndarray:
    """The bf16 bits of w · 2^-D where the window holds w (what unpack returns there)."""
    bits = bits.astype(np.uint16)
    e = ((bits >> 7) & 0xFF).astype(np.int32) - d
    return ((bits & 0x807F) | (np.clip(e, 0, 255).astype(np.uint16) << 7)).astype(np.uint16)


def unit_bitmap(unit_esc: np.ndarray) -> np.ndarray:
    """uint32 words, bit u % 32 of word u // 32 = unit u holds a weight outside the window."""
    n = unit_esc.size
    bits = np.zeros((n + 31) // 32 * 32, np.uint32)
    bits[:n] = unit_esc.astype(np.uint32)
    return (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def gate_up_units(esc_gate: np.ndarray, esc_up: np.ndarray) -> np.ndarray:
    """HeMvGateUp's unit u = gate row u and up row u."""
    return esc_gate | esc_up


def plain_units(esc: np.ndarray) -> np.ndarray:
    """HeMvPlain's unit u = rows 2u and 2u + 1 (an odd last unit repeats its row)."""
    n = (esc.size + 1) // 2
    pad = np.concatenate([esc, esc[-1:]]) if esc.size % 2 else esc
    return pad.reshape(n, 2).any(axis=1)[:n]
