"""A reference quantizer for llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) in numpy.

The gguf package dequantizes these types but does not quantize them; the tests and
benchmarks/scale.py need real blocks of real-shaped matrices to write K-quant GGUF files, so this
writes them: a plain per-sub-block min/max (Q4_K, Q5_K) or absolute-maximum (Q6_K) fit, not
llama.cpp's iterative search, packed in llama.cpp's layout (ggml-common.h, see
gateway/zerolayer/models/gguf_blocks.py). What a test checks against is the gguf package's
dequantization of these bytes, never this module's idea of the weights. The daemon itself never
quantizes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    np.divide(a, b, out=out, where=b != 0)
    return out


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (the inverse of get_scale_min_k4)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _q45(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n, 256] -> (d dmin as [n, 4] bytes, 12 scale bytes [n, 12], q [n, 8, 32] in 0..levels)."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels  # per sub-block
    mins = -lo  # >= 0, stored positive: w = d * sc * q - dmin * m
    d = _f16(scale.max(axis=-1) / 63)
    dmin = _f16(mins.max(axis=-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(scale, np.broadcast_to(df, scale.shape))), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(mins, np.broadcast_to(dminf, mins.shape))), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    offset = (dminf * m)[..., None]
    q = np.rint(_divide(sub + offset, np.broadcast_to(step, sub.shape)))
    q = np.clip(q, 0, levels).astype(np.uint8)
    head = np.concatenate([d[:, None], dmin[:, None]], axis=1).view(np.uint8)
    return head, _pack_scales(sc, m), q


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    head, scales, q = _q45(x, 15)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk 2p in the low nibbles of bytes 32p.., 2p + 1 high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, scales, qs], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    head, scales, q = _q45(x, 31)
    low = q & 15
    pairs = low.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: bit c of qh byte l is chunk c's weight l
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for c in range(8):
        qh |= high[:, c] << c
    return np.concatenate([head, scales, qh, qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31  # per 16 weights
    d = _f16(scale.max(axis=-1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(scale, np.broadcast_to(df, scale.shape))), -128, 127)
    sc = sc.astype(np.int8)
    step = (df * sc)[..., None]
    q = np.rint(_divide(sub, np.broadcast_to(step, sub.shape)))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, group, l
    ql = np.empty((q.shape[0], 2, 64), dtype=np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
    qh = qh | ((q[:, :, 3] >> 4) << 6)
    tail = d[:, None].view(np.uint8)
    return np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), tail], axis=1
    )


_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """[N, K] float (K a multiple of 256) -> [N, K / 256 * block bytes] uint8 blocks of ``kind``,
    the bytes a GGUF file stores for the matrix."""
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} weights, not {cols}")
    blocks = _QUANTIZERS[kind](np.asarray(w, dtype=np.float32).reshape(-1, QK_K))
    assert blocks.shape[1] == BYTES[kind]
    return np.ascontiguousarray(blocks.reshape(rows, cols // QK_K * BYTES[kind]))


def random_blocks(kind: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """[rows, blocks * bytes] random bytes with every float16 scale set to a finite value of
    either sign (quants, 6-bit scales and mins take every bit pattern)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks, BYTES[kind]), dtype=np.uint8)
    n = rows * blocks
    halves = _f16(rng.uniform(-1, 1, (n, 2)) * 2.0 ** rng.integers(-20, 0, (n, 2)))
    if kind == "Q6_K":
        raw[:, 208:210] = halves[:, :1].view(np.uint8)
    else:
        raw[:, 0:4] = halves.view(np.uint8)
    return raw.reshape(rows, blocks * BYTES[kind])
