"""Table-level row sampling (``sampling: {rate, seed, label_value?, weight}``).

A row's fate depends only on its position in the table's canonical order and the seed,
never on how rows are split across workers, so every run and every worker agrees.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from .base import is_int, is_number
from .hashing import sampling_u_kernel

_KEYS = ("rate", "seed", "label_value", "weight")


def validate_sampling(params: Mapping[str, Any]) -> dict:
    """Check a ``sampling`` mapping; returns ``{rate, seed, label_value, weight}`` normalized.

    Raises ``ValueError`` whose message starts with ``sampling.<key>``.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"sampling: expected a mapping, got {type(params).__name__}")
    for key in params:
        if key not in _KEYS:
            raise ValueError(f"sampling.{key}: unknown key (allowed: {', '.join(_KEYS)})")
    for key in ("rate", "seed"):
        if key not in params:
            raise ValueError(f"sampling.{key}: required key is missing")
    rate = params["rate"]
    if not is_number(rate) or not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"sampling.rate: must be a number in (0, 1], got {rate!r}")
    seed = params["seed"]
    if not is_int(seed) or not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"sampling.seed: must be a 64-bit integer, got {seed!r}")
    label_value = params.get("label_value")
    if label_value is not None and (not is_number(label_value) or math.isnan(float(label_value))):
        raise ValueError(f"sampling.label_value: must be a number, got {label_value!r}")
    weight = params.get("weight", False)
    if not isinstance(weight, bool):
        raise ValueError(f"sampling.weight: must be true or false, got {weight!r}")
    return {"rate": float(rate), "seed": int(seed), "label_value": None if label_value is None else float(label_value),
            "weight": weight}


def sampling_keep(positions: np.ndarray, rate: float, seed: int, labels: Optional[np.ndarray] = None,
                  label_value: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
    """(keep mask, per-row weight) for rows at these canonical positions.

    A sampled row is kept when ``u < rate`` with ``u = (mix64(combine(seed, r)) >> 11) / 2**53``.
    With ``label_value`` only rows whose label equals it are sampled; the others are kept.
    The weight is ``1/rate`` (float32) for sampled-and-kept rows and 1.0 for all others.
    """
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    seed64 = int(seed) & (2**64 - 1)
    u = sampling_u_kernel(positions, np.uint64(seed64))
    sampled = np.ones(positions.shape[0], dtype=bool)
    if label_value is not None:
        if labels is None:
            raise ValueError("sampling.label_value is set but no labels were given")
        sampled = np.asarray(labels) == label_value
    keep = ~sampled | (u < rate)
    weight = np.ones(positions.shape[0], dtype=np.float32)
    weight[sampled & keep] = np.float32(1.0 / rate)
    return keep, weight
