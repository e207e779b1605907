"""Host tables of the screened greedy LM head (kernels_hip/ops/head_screen.hip, the method and its error bound).

``screen_tables(rows)`` takes the head's rows exactly as the device holds them (bf16 / fp16 values as float32,
[vocab, d]) and returns the int8 copy the device streams instead of them, the per-row scale and bound
coefficient, and the one bound on the dequantised rows' norms:

  s_i = max|w_i| / 127 (float32), q_i = round(w_i / s_i) (int8), e_i = w_i − s_i q_i (exact in float64),
  c1_i = (||e_i||₂ + 2⁻¹⁶ (||w_i||₂ + ||s_i q_i||₂)) · (1 + 2⁻²⁰) rounded up to float32,
  c2   = max_i ||s_i q_i||₂ · (1 + 2⁻¹⁵) · (1 + 2⁻²⁰).

``screen_bounds(tables, xs)`` is the device's per-row interval [A − B, A + B] in numpy (float64 where the
device's value is exact, float32 where it rounds), for the CPU tests that check the bound itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError

MAX_D = 8192  # a lane's int32 dot product stays below 2**31 (ops/head_screen.hip)
CHUNK_ROWS = 4096


@dataclass
class ScreenTables:
    q: np.ndarray      # int8 [V4, d], rows past vocab zero
    meta: np.ndarray   # float32 [V4 / 4, 8]: s of rows 4u..4u+3, then c1 of the same rows
    c2: float
    vocab: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.meta.nbytes


def check_shape(vocab: int, d: int) -> None:
    if d % 16 or d > MAX_D:
        raise UnsupportedError(f"the screened LM head needs a hidden size that is a multiple of 16 and at most "
                               f"{MAX_D}, got {d}")
    if vocab < 1:
        raise UnsupportedError("the screened LM head needs a vocabulary")


def smem_bytes(d: int, vocab: int, num_sms: int, block_warps: int) -> int:
    """Shared memory the screened head needs per block (ops/head_screen.hip he_screen_slots) on a grid of at least num_sms
    blocks: the staged input, its int16 copy, and 4 slots per unit for each warp's share of the units."""
    units = (vocab + 3) // 4
    grid_warps = num_sms * block_warps
    return 4 * (d + d // 2 + block_warps * 4 * ((units + grid_warps - 1) // grid_warps))


def table_bytes(vocab: int, d: int) -> int:
    """Device bytes of the tables (the int8 rows and the per-unit scale / c1 table), all of them read each step."""
    v4 = (vocab + 3) // 4 * 4
    return v4 * d + 8 * v4


def head_values(bits: np.ndarray, f16: bool) -> np.ndarray:
    """The device's bf16 / fp16 bit patterns [rows, d] (uint16) as float32 values."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    if f16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round_up_f32(v: np.ndarray) -> np.ndarray:
    """float64 → float32, never below the float64 value."""
    f = v.astype(np.float32)
    low = f.astype(np.float64) < v
    f[low] = np.nextafter(f[low], np.float32(np.inf))
    return f


def screen_tables(rows: np.ndarray | None = None, *, bits: np.ndarray | None = None, f16: bool = False) -> ScreenTables:
    """Tables for the head's rows: `rows` as float32 values [vocab, d], or their device `bits` (uint16, bf16
    unless f16), converted a chunk at a time."""
    src = rows if rows is not None else bits
    vocab, d = (int(n) for n in src.shape)
    check_shape(vocab, d)
    v4 = (vocab + 3) // 4 * 4
    q = np.zeros((v4, d), np.int8)
    s = np.zeros(v4, np.float32)
    c1 = np.zeros(v4, np.float32)
    c2 = 0.0
    for r0 in range(0, vocab, CHUNK_ROWS):
        r1 = min(vocab, r0 + CHUNK_ROWS)
        w32 = np.asarray(rows[r0:r1], np.float32) if rows is not None else head_values(bits[r0:r1], f16)
        if not np.all(np.isfinite(w32)):
            raise UnsupportedError("the LM head has non-finite weights; the screened head cannot bound them")
        # float32 throughout (float64 would be twice the memory traffic): sums of squares are inflated by
        # their worst-case rounding (1 + d·2⁻²³) and e = w − s q, rounded, by u·||s q|| (2⁻²²), so each
        # norm below stays an upper bound of the exact one
        amax = np.abs(w32).max(axis=1)
        sc = (amax.astype(np.float64) / 127.0).astype(np.float32)
        safe = np.where(sc > 0, sc, np.float32(1))
        qi = np.rint(w32 / safe[:, None])
        np.clip(qi, -127, 127, out=qi)
        qi[sc == 0] = 0
        deq = qi * sc[:, None]
        e = w32 - deq
        grow = 1.0 + d * 2.0 ** -23
        sq = lambda a: np.sqrt(np.einsum("ij,ij->i", a, a).astype(np.float64)) * grow  # noqa: E731
        nw, nq = sq(w32), sq(deq)
        ne = sq(e) + 2.0 ** -22 * nq
        q[r0:r1] = qi.astype(np.int8)
        s[r0:r1] = sc
        c1[r0:r1] = _round_up_f32((ne + 2.0 ** -16 * (nw + nq)) * (1 + 2.0 ** -20))
        c2 = max(c2, float(nq.max(initial=0.0)))
    meta = np.concatenate([s.reshape(-1, 4), c1.reshape(-1, 4)], axis=1).astype(np.float32)
    c2f = float(_round_up_f32(np.array([c2 * (1 + 2.0 ** -15) * (1 + 2.0 ** -20)]))[0])
    return ScreenTables(q=q, meta=np.ascontiguousarray(meta), c2=c2f, vocab=vocab)


def quantize_x(xs: np.ndarray) -> tuple[np.ndarray, float, float, float]:
    """The device's int16 copy of the staged input and its (s_x, N, Δ) (he_screen_quantize), in float32
    arithmetic where the device's is float32."""
    xs = np.asarray(xs, np.float32)
    amax = np.float32(np.abs(xs).max(initial=0.0))
    sx = np.float32(amax / np.float32(32767.0))
    inv = np.float32(np.float32(32767.0) / amax) if amax > 0 else np.float32(0.0)
    x16 = np.clip(np.rint(xs * inv), -32767, 32767).astype(np.int32)
    r = (xs - sx * x16.astype(np.float32)).astype(np.float32)
    n = np.float32(np.sqrt(np.float32((xs.astype(np.float64) ** 2).sum())) * np.float32(1 + 2.0 ** -12))
    dn = np.float32(np.sqrt(np.float32((r.astype(np.float64) ** 2).sum())) * np.float32(1 + 2.0 ** -12)
                    + np.float32(2.0 ** -20) * n)
    return x16, float(sx), float(n), float(dn)


def screen_bounds(t: ScreenTables, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row's [A − B, A + B] as the device computes it (exact integer dot products; float32 after)."""
    x16, sx, n, dn = quantize_x(xs)
    dots = (t.q[:t.vocab].astype(np.int64) @ x16.astype(np.int64)).astype(np.float32)
    s = t.meta[:, :4].reshape(-1)[:t.vocab]
    c1 = t.meta[:, 4:].reshape(-1)[:t.vocab]
    a = (s * np.float32(sx)) * dots
    b = (c1 * np.float32(n) + np.float32(t.c2) * np.float32(dn)) * np.float32(1 + 2.0 ** -10) \
        + np.float32(2.0 ** -20) * np.abs(a)
    return (a - b).astype(np.float32), (a + b).astype(np.float32)


def candidates(t: ScreenTables, xs: np.ndarray) -> np.ndarray:
    """Rows that may hold the arg-max of the head's logits at input xs (ascending)."""
    lo, hi = screen_bounds(t, xs)
    return np.nonzero(hi >= lo.max())[0]
