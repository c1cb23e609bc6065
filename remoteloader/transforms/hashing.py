"""The shared 64-bit hash primitives of transforms.md and the kernels built only on them.

``mix64`` is Thomas Wang's 64-bit mix (folly ``twang_mix64``), ``combine`` the CityHash
128-to-64 fold (folly ``hash_128_to_64``). All arithmetic is on uint64 so that ``+``,
``*`` and ``<<`` wrap and ``>>`` is logical, exactly as the definitions say; every
constant is typed uint64 because numba would otherwise promote a uint64/int64 mix to
float64. ``floormod`` relies on numba's int64 ``%``, which has Python (floor) semantics.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

_C = np.uint64(0x9DDFEA08EB382D69)
_S3, _S4, _S8, _S14, _S21, _S24, _S28, _S31, _S47 = (np.uint64(s) for s in (3, 4, 8, 14, 21, 24, 28, 31, 47))


@njit(inline="always")
def mix64(k):  # uint64 -> uint64
    k = ~k + (k << _S21)
    k = k ^ (k >> _S24)
    k = k + (k << _S3) + (k << _S8)
    k = k ^ (k >> _S14)
    k = k + (k << np.uint64(2)) + (k << _S4)
    k = k ^ (k >> _S28)
    k = k + (k << _S31)
    return k


@njit(inline="always")
def combine(u, l):  # (uint64, uint64) -> uint64
    a = (l ^ u) * _C
    a = a ^ (a >> _S47)
    b = (u ^ a) * _C
    b = b ^ (b >> _S47)
    return b * _C


@njit(inline="always")
def signed_mod(h, max_value):  # uint64 -> int64: signed(h), then floormod(., max_value) when max_value > 0
    v = numba.int64(h)
    if max_value > 0:
        v = v % max_value
    return v


@njit(cache=True, nogil=True)
def sigrid_hash_kernel(values, salt, max_value):
    """floormod(signed(combine(salt, mix64(x))), max_value) for every x; int64 in and out."""
    out = np.empty(values.shape[0], dtype=np.int64)
    if max_value == 1:
        out[:] = 0
        return out
    s = numba.uint64(salt)
    for i in range(values.shape[0]):
        out[i] = numba.int64(combine(s, mix64(numba.uint64(values[i])))) % max_value
    return out


@njit(cache=True, nogil=True)
def ngram_kernel(values, offsets, n, max_value):
    """Hash every window of ``n`` consecutive ids of a row; ``max_value <= 0`` means none."""
    rows = offsets.shape[0] - 1
    out_offsets = np.zeros(rows + 1, dtype=np.int64)
    for r in range(rows):
        out_offsets[r + 1] = out_offsets[r] + max(offsets[r + 1] - offsets[r] - n + 1, 0)
    out = np.empty(out_offsets[rows], dtype=np.int64)
    for r in range(rows):
        o = out_offsets[r]
        for i in range(offsets[r], offsets[r + 1] - n + 1):
            h = numba.uint64(values[i])
            for j in range(1, n):
                h = combine(h, numba.uint64(values[i + j]))
            out[o] = signed_mod(h, max_value)
            o += 1
    return out, out_offsets


@njit(cache=True, nogil=True)
def cartesian_kernel(a_values, a_offsets, b_values, b_offsets, max_value):
    """Per row, signed(combine(x, y)) for x of a (outer) and y of b (inner)."""
    rows = a_offsets.shape[0] - 1
    out_offsets = np.zeros(rows + 1, dtype=np.int64)
    for r in range(rows):
        out_offsets[r + 1] = out_offsets[r] + (a_offsets[r + 1] - a_offsets[r]) * (b_offsets[r + 1] - b_offsets[r])
    out = np.empty(out_offsets[rows], dtype=np.int64)
    for r in range(rows):
        o = out_offsets[r]
        b0, b1 = b_offsets[r], b_offsets[r + 1]
        for i in range(a_offsets[r], a_offsets[r + 1]):
            x = numba.uint64(a_values[i])
            for j in range(b0, b1):
                out[o] = signed_mod(combine(x, numba.uint64(b_values[j])), max_value)
                o += 1
    return out, out_offsets


@njit(cache=True, nogil=True)
def sampling_u_kernel(positions, seed):
    """u = (mix64(combine(seed, r)) >> 11) / 2**53 for every row position r."""
    out = np.empty(positions.shape[0], dtype=np.float64)
    s = numba.uint64(seed)
    for i in range(positions.shape[0]):
        out[i] = numba.float64(mix64(combine(s, numba.uint64(positions[i]))) >> np.uint64(11)) * (1.0 / 9007199254740992.0)
    return out
