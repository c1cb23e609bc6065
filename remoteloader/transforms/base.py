"""What every operator shares: the compile-time column kind, the ``Op`` interface, errors.

An operator is compiled in two phases. At spec-load time (master and worker alike) it
checks its parameters (``validate``) and the kinds of its inputs (``output_kind``), so a
bad spec fails before any data is read. At run time ``apply`` transforms whole columns;
it never sees one row at a time. Built-in and user operators (registered through the
``remoteloader.transforms`` entry point group) implement exactly this interface.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..columns import Column, DenseColumn, SparseColumn

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class TransformError(ValueError):
    """A spec whose features cannot be compiled or run.

    ``feature``/``step``/``param`` say where; the message always names them too.
    """

    def __init__(self, message: str, feature: Optional[str] = None, step: Optional[int] = None,
                 param: Optional[str] = None) -> None:
        super().__init__(message)
        self.feature, self.step, self.param = feature, step, param


class ParamError(ValueError):
    """Raised by an op's checks; the pipeline adds the feature and step index."""

    def __init__(self, param: Optional[str], message: str) -> None:
        super().__init__(message)
        self.param = param


class KindError(ValueError):
    """An op applied to a column kind it does not accept (e.g. ``logit`` on a sparse list)."""


@dataclass(frozen=True)
class Kind:
    """The shape of a column between two steps, known at compile time.

    kind: "dense" (one value per row) or "sparse" (a list of int64 ids per row).
    dtype: dense only, "int" (int64) or "float" (float64 while transforming, float32 in
    the batch). width: dense columns per row (``onehot`` widens). scored: sparse only,
    whether the lists carry one float32 weight per id.
    """

    kind: str
    dtype: str = "int"
    width: int = 1
    scored: bool = False

    def __str__(self) -> str:
        if self.kind == "sparse":
            return "scored sparse" if self.scored else "sparse"
        return f"dense {self.dtype}" + (f" [width {self.width}]" if self.width != 1 else "")

    @property
    def is_int(self) -> bool:
        """Integer ids: any sparse list, or a dense int64 column."""
        return self.kind == "sparse" or self.dtype == "int"


SPARSE = Kind("sparse")
SCORED = Kind("sparse", scored=True)
DENSE_INT = Kind("dense", "int")
DENSE_FLOAT = Kind("dense", "float")


class Op:
    """Interface of a column-wise operator (subclass it, or duck-type it).

    Only ``name`` and the parameters ever appear in a spec; the op object itself lives
    on each worker (built in, or installed there and found through an entry point).
    """

    name: str = ""
    arity: int = 1  # number of input columns; 2 for the pair ops (inputs: [a, b])
    # Row-local: each output row depends only on the same row of the inputs (and of the
    # extra columns), so apply(take(x, i)) == take(apply(x), i) byte for byte for any
    # index array i. The feature-block cache relies on it: it stores transformed blocks in
    # the table's row order and turns an epoch's shuffle into a gather on read. An operator
    # whose output row depends on other rows of the batch (batch statistics, a row's
    # position, the batch length) must set this to False; features using it are never
    # cached. A duck-typed op without the attribute counts as row-local.
    row_local: bool = True

    def validate(self, params: Mapping[str, Any]) -> dict:
        """Check the parameters (without ``op``) and return them normalized with defaults.

        Raise ``ParamError(param, why)``. Must not depend on the input kind.
        """
        check_keys(params, ())
        return {}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        """The output kind for these input kinds; raise ``KindError`` (or ``ParamError``)."""
        raise NotImplementedError

    def extra_columns(self, params: dict) -> dict[str, tuple[str, ...]]:
        """Other table columns this step reads: name -> allowed schema types."""
        return {}

    def prepare(self, params: dict, inputs: tuple[Kind, ...]) -> Any:
        """Precompute what the kernel needs (lookup tables, thresholds) once per compile."""
        return params

    def apply(self, state: Any, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        """Transform whole columns. Inputs are never mutated; return new columns."""
        raise NotImplementedError


# -- parameter checks: each names the parameter it rejects ---------------------------------
def check_keys(params: Mapping[str, Any], allowed: Sequence[str], required: Sequence[str] = ()) -> None:
    for key in params:
        if key not in allowed:
            raise ParamError(str(key), f"unknown parameter (allowed: {', '.join(allowed) or 'none'})")
    for key in required:
        if key not in params:
            raise ParamError(key, "required parameter is missing")


def is_int(v: Any) -> bool:
    # bool is an Integral in Python; `max_value: true` is still a mistake.
    return isinstance(v, Integral) and not isinstance(v, (bool, np.bool_))


def is_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, (bool, np.bool_))


def int_param(params: Mapping[str, Any], key: str, default: Any = ..., lo: Optional[int] = INT64_MIN,
              hi: Optional[int] = INT64_MAX, what: str = "an int") -> int:
    if key not in params:
        if default is ...:
            raise ParamError(key, "required parameter is missing")
        return default
    v = params[key]
    if not is_int(v):
        raise ParamError(key, f"must be {what}, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ParamError(key, f"must be {what}, got {v}")
    return v


def float_param(params: Mapping[str, Any], key: str, default: Any = ..., allow_nan: bool = False) -> float:
    if key not in params:
        if default is ...:
            raise ParamError(key, "required parameter is missing")
        return default
    v = params[key]
    if not is_number(v):
        raise ParamError(key, f"must be a number, got {v!r}")
    if not allow_nan and math.isnan(float(v)):
        raise ParamError(key, "must not be NaN")
    return v  # kept as written (int or float): integer ops need the exact int


def bool_param(params: Mapping[str, Any], key: str, default: bool) -> bool:
    v = params.get(key, default)
    if not isinstance(v, (bool, np.bool_)):
        raise ParamError(key, f"must be true or false, got {v!r}")
    return bool(v)


# -- kind checks ---------------------------------------------------------------------------
def need(inputs: tuple[Kind, ...], *, sparse: bool = False, dense_int: bool = False, dense_float: bool = False,
         what: str = "") -> Kind:
    """The single input kind, if it is one of the accepted ones; else a ``KindError``."""
    k = inputs[0]
    if k.kind == "dense" and k.width != 1:
        raise KindError(f"its input is {k}, the output of onehot, which must be a feature's last step")
    if (k.kind == "sparse" and sparse) or (k.kind == "dense" and (dense_int if k.dtype == "int" else dense_float)):
        return k
    if not what:
        dense = ("a dense column" if dense_int and dense_float else "an integer dense column" if dense_int
                 else "a float dense column" if dense_float else "")
        what = " or ".join(w for w in ("a sparse list" if sparse else "", dense) if w)
    raise KindError(f"needs {what} as input, got {k}")


# -- applying an element-wise kernel to either column shape --------------------------------
def with_values(col: Column, values: np.ndarray, keep_weights: bool = True) -> Column:
    """The same rows with new per-element values (dense: per row; sparse: per id)."""
    if isinstance(col, SparseColumn):
        return SparseColumn(values, col.offsets, col.weights if keep_weights else None)
    return DenseColumn(values)


def int_values(col: Column) -> np.ndarray:
    return np.ascontiguousarray(col.values, dtype=np.int64)


def float_values(col: Column) -> np.ndarray:
    return np.ascontiguousarray(col.values, dtype=np.float64)
