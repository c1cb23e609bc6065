"""A small Python way to write feature entries; it produces exactly the declarative form.

    Feature.sparse("pages", column="idlist_3").firstx(20).sigrid_hash(max_value=1000).to_dict()
    == {"name": "pages", "column": "idlist_3",
        "transforms": [{"op": "firstx", "x": 20}, {"op": "sigrid_hash", "max_value": 1000}]}

Builders are immutable (each call returns a new one), so a common prefix can be shared.
Only the parameters you pass are written; defaults stay implicit, as in hand-written YAML.
Each step's parameters are checked right away with the op's own validation (kinds are
checked when the whole spec is compiled against the table).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from .base import ParamError, TransformError
from .registry import get_op


@dataclass(frozen=True)
class Feature:
    name: str
    kind: str  # "dense" | "sparse": which list of the spec the entry goes in
    column: Optional[str] = None
    inputs: tuple[str, ...] = ()
    scores: Optional[str] = None
    default: Optional[float] = None
    transforms: tuple[dict, ...] = ()

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def dense(cls, name: str, column: Optional[str] = None, *, inputs: Sequence[str] = (),
              default: Optional[float] = None) -> "Feature":
        return cls._new(name, "dense", column, inputs, None, default)

    @classmethod
    def sparse(cls, name: str, column: Optional[str] = None, *, inputs: Sequence[str] = (),
               scores: Optional[str] = None) -> "Feature":
        return cls._new(name, "sparse", column, inputs, scores, None)

    @classmethod
    def _new(cls, name: str, kind: str, column: Optional[str], inputs: Sequence[str], scores: Optional[str],
             default: Optional[float]) -> "Feature":
        if (column is None) == (not inputs):
            raise TransformError(f"feature {name!r}: needs exactly one of column= or inputs=", feature=name)
        return cls(name, kind, column, tuple(inputs), scores, default)

    # -- generic step --------------------------------------------------------------------
    def op(self, op: str, **params: Any) -> "Feature":
        """Append ``{op: op, **params}`` (any built-in or registered op)."""
        try:
            get_op(op).validate(params)
        except KeyError as e:
            raise TransformError(f"feature {self.name!r} step {len(self.transforms)} ({op}): {e.args[0]}",
                                 feature=self.name, step=len(self.transforms), param="op") from None
        except ParamError as e:
            raise TransformError(f"feature {self.name!r} step {len(self.transforms)} ({op}): parameter "
                                 f"{e.param!r}: {e}", feature=self.name, step=len(self.transforms),
                                 param=e.param) from None
        return replace(self, transforms=self.transforms + ({"op": op, **params},))

    def _step(self, op: str, **params: Any) -> "Feature":
        return self.op(op, **{k: v for k, v in params.items() if v is not None})

    # -- one method per built-in op, parameter names exactly as in the spec -----------------
    def sigrid_hash(self, max_value: int, salt: Optional[int] = None) -> "Feature":
        return self._step("sigrid_hash", salt=salt, max_value=max_value)

    def bucketize(self, borders: Sequence[float], as_sparse: Optional[bool] = None) -> "Feature":
        return self._step("bucketize", borders=list(borders), as_sparse=as_sparse)

    def firstx(self, x: int) -> "Feature":
        return self._step("firstx", x=x)

    def clamp(self, min: float, max: float) -> "Feature":  # noqa: A002 - the spec's names
        return self._step("clamp", min=min, max=max)

    def boxcox(self, lambda1: float, lambda2: Optional[float] = None) -> "Feature":
        return self._step("boxcox", lambda1=lambda1, lambda2=lambda2)

    def logit(self, eps: Optional[float] = None) -> "Feature":
        return self._step("logit", eps=eps)

    def onehot(self, borders: Sequence[float]) -> "Feature":
        return self._step("onehot", borders=list(borders))

    def map_id(self, mapping: Mapping[int, int], default: Optional[int] = None) -> "Feature":
        return self._step("map_id", mapping=dict(mapping), default=default)

    def positive_modulus(self, modulus: int) -> "Feature":
        return self._step("positive_modulus", modulus=modulus)

    def enumerate(self, start: Optional[int] = None) -> "Feature":
        return self._step("enumerate", start=start)

    def id_list_intersect(self) -> "Feature":
        return self._step("id_list_intersect")

    def compute_score(self, kind: str) -> "Feature":
        return self._step("compute_score", kind=kind)

    def cartesian(self, max_value: Optional[int] = None) -> "Feature":
        return self._step("cartesian", max_value=max_value)

    def ngram(self, n: int, max_value: Optional[int] = None) -> "Feature":
        return self._step("ngram", n=n, max_value=max_value)

    def get_local_hour(self, tz_offset_seconds: Optional[int] = None,
                       tz_offset_column: Optional[str] = None) -> "Feature":
        return self._step("get_local_hour", tz_offset_seconds=tz_offset_seconds, tz_offset_column=tz_offset_column)

    def fill_null(self, value: Optional[float] = None) -> "Feature":
        return self._step("fill_null", value=value)

    # -- output ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The feature entry exactly as written in a spec's ``dense:`` or ``sparse:`` list."""
        return self.to_spec().to_dict()

    def to_spec(self) -> Any:
        """The ``remoteloader.spec.FeatureSpec`` this entry parses to."""
        from ..spec import FeatureSpec

        return FeatureSpec(name=self.name, kind=self.kind, column=self.column, inputs=self.inputs,
                           scores=self.scores, transforms=tuple(dict(t) for t in self.transforms),
                           default=None if self.default is None else float(self.default))


def features_to_dict(features: Sequence[Feature]) -> dict:
    """``{"dense": [...], "sparse": [...]}`` for a spec's ``features:`` section."""
    return {"dense": [f.to_dict() for f in features if f.kind == "dense"],
            "sparse": [f.to_dict() for f in features if f.kind == "sparse"]}
