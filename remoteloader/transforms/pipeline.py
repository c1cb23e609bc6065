"""Compiling a spec's features into a DAG of column-wise steps, and running it on a batch.

Each feature reads a table column, or names ``inputs`` (table columns or other features,
after their own transforms). Names of features shadow table columns. ``compile_features``
checks everything that can be checked without data (ops, parameters, kinds, the graph)
and fixes a topological order; ``FeaturePipeline.run`` then computes every feature once,
so a feature used by several others is an intermediate computed a single time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..columns import Column, DenseColumn, SparseColumn
from .base import DENSE_FLOAT, DENSE_INT, SCORED, SPARSE, Kind, KindError, Op, ParamError, TransformError
from .dense_ops import fill_dense_nulls, whole
from .registry import get_op

# Table column types (the reader's schema) and the kind a feature sees.
_COLUMN_KINDS = {"float": DENSE_FLOAT, "int": DENSE_INT, "id_list": SPARSE}
PAIR_OPS = ("id_list_intersect", "compute_score", "cartesian")


@dataclass
class FeatureOutput:
    dense: np.ndarray  # float32 [rows, dense_width], features in spec order
    sparse: list[SparseColumn]  # spec order; int64 values/offsets, float32 weights when scored


@dataclass
class _Step:
    index: int
    op_name: str
    op: Op
    state: Any
    extra: tuple[str, ...] = ()
    params: Any = None  # as validated (normalized): what the step's cache key names


@dataclass
class _Node:
    name: str
    declared: str  # "dense" | "sparse"
    sources: tuple[tuple[str, str], ...]  # ("column" | "feature", name), in input order
    scores: Optional[str] = None
    null_value: Any = 0.0  # what a null dense table value becomes; None: the first step is fill_null
    steps: list[_Step] = field(default_factory=list)
    out: Kind = DENSE_FLOAT


def _err(feature: str, message: str, step: Optional[int] = None, op: Optional[str] = None,
         param: Optional[str] = None) -> TransformError:
    where = f"feature {feature!r}"
    if step is not None:
        where += f" step {step} ({op})"
    if param is not None:
        where += f": parameter {param!r}"
    return TransformError(f"{where}: {message}", feature=feature, step=step, param=param)


def compile_features(dense: Sequence[Any], sparse: Sequence[Any], schema: Mapping[str, str]) -> "FeaturePipeline":
    """Validate the features against the table schema and build the pipeline.

    ``dense``/``sparse`` are ``FeatureSpec``s (anything with the same attributes).
    Raises ``TransformError`` naming the feature, the step index and the parameter.
    """
    specs: dict[str, tuple[Any, str]] = {}
    for declared, group in (("dense", dense), ("sparse", sparse)):
        for f in group:
            if f.name in specs:
                raise _err(f.name, "is defined twice")
            specs[f.name] = (f, declared)

    nodes: dict[str, _Node] = {}
    for name, (f, declared) in specs.items():
        column, inputs = getattr(f, "column", None), tuple(getattr(f, "inputs", ()) or ())
        if (column is None) == (not inputs):
            raise _err(name, "needs exactly one of 'column' or 'inputs'")
        sources = []
        for src in ((column,) if column is not None else inputs):
            if column is None and src in specs:  # features shadow table columns
                sources.append(("feature", src))
            elif src in schema:
                sources.append(("column", src))
            elif column is not None:
                raise _err(name, f"column {src!r} is not in the table (columns: {', '.join(sorted(schema))})")
            else:
                raise _err(name, f"input {src!r} is neither a feature of the spec nor a table column")
        nodes[name] = _Node(name, declared, tuple(sources), getattr(f, "scores", None))

    order = _topological_order(nodes)
    for name in order:
        _compile_node(nodes[name], specs[name][0], nodes, schema)
    return FeaturePipeline([nodes[n] for n in order], [nodes[f.name] for f in dense],
                           [nodes[f.name] for f in sparse], schema)


def _topological_order(nodes: dict[str, _Node]) -> list[str]:
    """Dependencies first, otherwise spec order; a cycle is an error naming its features."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for kind, dep in nodes[name].sources:
            if kind != "feature":
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise TransformError(f"features form a cycle: {' -> '.join(cycle)}", feature=name)
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2
        order.append(name)

    for name in nodes:  # depth is bounded by the number of features, which is small
        if name not in state:
            visit(name)
    return order


def _compile_node(node: _Node, spec: Any, nodes: dict[str, _Node], schema: Mapping[str, str]) -> None:
    name = node.name
    transforms = tuple(getattr(spec, "transforms", ()) or ())
    default = getattr(spec, "default", None)
    first_op = transforms[0].get("op") if transforms and isinstance(transforms[0], Mapping) else None

    kinds: list[Kind] = []
    for src_kind, src in node.sources:
        if src_kind == "feature":
            k = nodes[src].out
            if k.kind == "dense" and k.width != 1:
                raise _err(name, f"input {src!r} is a onehot feature ({k}); it cannot feed another feature")
        else:
            ctype = schema[src]
            if ctype not in _COLUMN_KINDS:
                hint = " (a float_list column can only be the scores of a sparse feature)" if ctype == "float_list" else ""
                raise _err(name, f"column {src!r} has type {ctype!r}, which a feature cannot read{hint}")
            k = _COLUMN_KINDS[ctype]
            if k.kind == "dense":
                if first_op == "fill_null":
                    if default is not None:
                        raise _err(name, "give either 'default' or a first fill_null step, not both", param="default")
                    node.null_value = None
                else:
                    node.null_value = 0.0 if default is None else default
                    if k.dtype == "int" and not whole(node.null_value):
                        k = DENSE_FLOAT  # a fractional default turns the int column into floats
        kinds.append(k)

    if default is not None and not any(k.kind == "dense" for k in kinds):
        raise _err(name, "'default' applies to dense inputs only (a null list is an empty list)", param="default")
    if node.scores is not None:
        if node.declared != "sparse" or len(node.sources) != 1 or node.sources[0][0] != "column":
            raise _err(name, "'scores' needs a sparse feature reading an id_list 'column'", param="scores")
        stype = schema.get(node.scores)
        if stype is None:
            raise _err(name, f"scores column {node.scores!r} is not in the table", param="scores")
        if stype != "float_list" or kinds[0] != SPARSE:
            raise _err(name, f"scores column {node.scores!r} must be a float_list and column "
                             f"{node.sources[0][1]!r} an id_list (got {stype} and {schema[node.sources[0][1]]})",
                       param="scores")
        kinds[0] = SCORED

    if len(kinds) > 1 and (not transforms or _op_name(transforms[0]) not in PAIR_OPS):
        raise _err(name, f"has {len(kinds)} inputs, so its first step must be one of {', '.join(PAIR_OPS)}")

    current = tuple(kinds)
    for i, t in enumerate(transforms):
        op_name = _op_name(t)
        if op_name is None:
            raise _err(name, "each step needs an 'op' name", step=i, op="?", param="op")
        try:
            op = get_op(op_name)
        except KeyError as e:
            raise _err(name, str(e.args[0]), step=i, op=op_name, param="op") from None
        arity = getattr(op, "arity", 1)
        if arity != 1 and (i != 0 or len(current) != arity):
            raise _err(name, f"takes {arity} inputs, so it must be the first step of a feature with "
                             f"inputs: [a, b] (this feature has {len(node.sources)} input(s))", step=i, op=op_name)
        if op_name == "fill_null" and i != 0:
            raise _err(name, "must be the first step (later steps never see nulls)", step=i, op=op_name)
        params = {k: v for k, v in t.items() if k != "op"}
        try:
            norm = op.validate(params)
            out = op.output_kind(norm, current)
            extra = getattr(op, "extra_columns", lambda p: {})(norm)
            for col, allowed in extra.items():
                if schema.get(col) not in allowed:
                    found = "is not in the table" if col not in schema else f"has type {schema[col]!r}"
                    raise ParamError(_param_naming(params, col), f"column {col!r} {found} (needs {' or '.join(allowed)})")
            prepare = getattr(op, "prepare", None)
            state = prepare(norm, current) if prepare is not None else norm
        except ParamError as e:
            raise _err(name, str(e), step=i, op=op_name, param=e.param) from None
        except KindError as e:
            raise _err(name, str(e), step=i, op=op_name) from None
        if not isinstance(out, Kind):
            raise _err(name, f"output_kind() returned {out!r}, not a Kind", step=i, op=op_name)
        node.steps.append(_Step(i, op_name, op, state, tuple(extra), norm))
        current = (out,)

    node.out = current[0]
    if node.out.kind != node.declared:
        reads = ", ".join(f"column {src!r} ({schema[src]})" if kind == "column" else f"feature {src!r}"
                          for kind, src in node.sources)
        how = ("a dense feature needs a dense column or a step such as compute_score" if node.declared == "dense"
               else "a sparse feature needs an id_list or a step such as bucketize with as_sparse: true")
        raise _err(name, f"is declared {node.declared} but ends as {node.out} (it reads {reads}); {how}")


def _op_name(step: Any) -> Optional[str]:
    if not isinstance(step, Mapping) or not isinstance(step.get("op"), str):
        return None
    return step["op"]


def _param_naming(params: Mapping[str, Any], column: str) -> Optional[str]:
    return next((k for k, v in params.items() if v == column), None)


class FeaturePipeline:
    """A compiled feature set; ``run`` turns one batch of table columns into tensors' arrays."""

    def __init__(self, order: list[_Node], dense: list[_Node], sparse: list[_Node],
                 schema: Mapping[str, str]) -> None:
        self._order = order
        self._nodes = {node.name: node for node in order}
        self._dense = dense
        self._sparse = sparse
        cols: set[str] = set()
        for node in order:
            cols.update(src for kind, src in node.sources if kind == "column")
            if node.scores is not None:
                cols.add(node.scores)
            for step in node.steps:
                cols.update(step.extra)
        self.input_columns: list[str] = sorted(cols)
        self.dense_names: list[str] = [n.name for n in dense]
        self.dense_widths: list[int] = [n.out.width for n in dense]
        self.dense_width: int = sum(self.dense_widths)
        self.sparse_names: list[str] = [n.name for n in sparse]
        self.sparse_scored: list[bool] = [n.out.scored for n in sparse]
        self._schema = {c: schema[c] for c in self.input_columns}

    def __repr__(self) -> str:
        return (f"FeaturePipeline(dense={self.dense_names}, sparse={self.sparse_names}, "
                f"input_columns={self.input_columns})")

    def run(self, columns: Mapping[str, Column]) -> FeatureOutput:
        rows = self._rows(columns)
        return self.assemble(self.run_nodes(columns), rows)

    def run_nodes(self, columns: Mapping[str, Column], given: Optional[Mapping[str, Column]] = None,
                  seconds: Optional[dict[str, float]] = None) -> dict[str, Column]:
        """Every feature's column, computing only those not ``given`` (cached blocks) and the
        features they need; ``columns`` must hold ``columns_for`` of the rest. With
        ``seconds``, each computed feature's transform time is added to it."""
        done: dict[str, Column] = dict(given or {})
        for node in self._order:
            if node.name in done:
                continue
            start = time.perf_counter()
            inputs = [done[src] if kind == "feature" else self._read(node, src, columns)
                      for kind, src in node.sources]
            col = inputs[0]
            for step in node.steps:
                extra = {c: columns[c] for c in step.extra}
                col = step.op.apply(step.state, inputs if step.op.arity != 1 else [col], extra)
            done[node.name] = col
            if seconds is not None:
                seconds[node.name] = seconds.get(node.name, 0.0) + time.perf_counter() - start
        return done

    def assemble(self, done: Mapping[str, Column], rows: int) -> FeatureOutput:
        """The batch's arrays from every feature's column: the dense matrix and the sparse lists."""
        dense = np.empty((rows, self.dense_width), dtype=np.float32)
        at = 0
        for node in self._dense:
            values = done[node.name].values
            w = node.out.width
            if values.shape[0] != rows:
                raise TransformError(f"feature {node.name!r} produced {values.shape[0]} rows, expected {rows}",
                                     feature=node.name)
            with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes +-inf
                dense[:, at:at + w] = values.reshape(rows, w)
            at += w
        sparse = []
        for node in self._sparse:
            col = done[node.name]
            sparse.append(SparseColumn(
                np.ascontiguousarray(col.values, dtype=np.int64), np.ascontiguousarray(col.offsets, dtype=np.int64),
                None if col.weights is None or not node.out.scored else np.ascontiguousarray(col.weights, np.float32)))
        return FeatureOutput(dense, sparse)

    # -- what the block cache needs to know of the graph -------------------------------
    @property
    def feature_names(self) -> list[str]:
        """Every feature, dependencies first."""
        return [node.name for node in self._order]

    def columns_for(self, features: Iterable[str], given: Iterable[str] = ()) -> set[str]:
        """The table columns that computing ``features`` reads, when the features in
        ``given`` are at hand (cached): a column only cached features read is not needed."""
        have, need, todo = set(given), set(), [f for f in features if f not in set(given)]
        seen: set[str] = set()
        while todo:
            node = self._nodes[todo.pop()]
            if node.name in seen:
                continue
            seen.add(node.name)
            for kind, src in node.sources:
                if kind == "column":
                    need.add(src)
                elif src not in have:
                    todo.append(src)
            if node.scores is not None:
                need.add(node.scores)
            for step in node.steps:
                need.update(step.extra)
        return need

    def row_local(self, feature: str) -> bool:
        """Whether every step of ``feature`` and of the features it reads is row-local
        (each output row a function of its input row alone): only those may be cached."""
        node = self._nodes[feature]
        return (all(getattr(step.op, "row_local", True) for step in node.steps)
                and all(self.row_local(src) for kind, src in node.sources if kind == "feature"))

    def closure(self, feature: str, stored: Callable[[str], str] = str) -> dict:
        """Everything ``feature``'s values depend on, in canonical form: its sources (table
        columns with their types, or other features' closures, recursively), scores, null
        default and each step's op and normalized parameters. The block cache's feature key.
        ``stored``: a column's name in the table read (a mix's ``tables[i].columns`` renaming),
        so that the key names the stored column whatever the job calls it."""
        node = self._nodes[feature]
        sources = [["column", stored(src), self._schema[src]] if kind == "column" else
                   ["feature", self.closure(src, stored)] for kind, src in node.sources]
        return {
            "declared": node.declared,
            "sources": sources,
            "scores": None if node.scores is None else [stored(node.scores), self._schema[node.scores]],
            "null_value": node.null_value,
            "steps": [{"op": step.op_name, "version": getattr(step.op, "version", 1), "params": step.params,
                       "extra": [[stored(c), self._schema[c]] for c in step.extra]} for step in node.steps],
            "out": [node.out.kind, node.out.dtype, node.out.width, node.out.scored],
        }

    def _rows(self, columns: Mapping[str, Column]) -> int:
        rows = None
        for name in self.input_columns:
            if name not in columns:
                raise TransformError(f"column {name!r} is missing from the batch")
            n = len(columns[name])
            if rows is not None and n != rows:
                raise TransformError(f"column {name!r} has {n} rows, other columns have {rows}")
            rows = n
        if rows is None:  # no feature reads a column: take the batch size from anything given
            rows = next((len(c) for c in columns.values()), 0)
        return rows

    def _read(self, node: _Node, name: str, columns: Mapping[str, Column]) -> Column:
        col = columns[name]
        expected = SparseColumn if self._schema[name] in ("id_list", "float_list") else DenseColumn
        if not isinstance(col, expected):
            raise TransformError(f"column {name!r} ({self._schema[name]}): expected a {expected.__name__}, "
                                 f"got {type(col).__name__}")
        if isinstance(col, DenseColumn):
            if col.values.ndim != 1:
                raise TransformError(f"column {name!r} must be one value per row, got shape {col.values.shape}")
            if node.null_value is None:  # the first step is fill_null: leave the nulls to it
                return col
            return fill_dense_nulls(col, node.null_value)
        values = np.ascontiguousarray(col.values, dtype=np.int64)
        offsets = np.ascontiguousarray(col.offsets, dtype=np.int64)
        weights = None
        if node.scores is not None:
            scores = columns[node.scores]
            if not isinstance(scores, SparseColumn):
                raise TransformError(f"feature {node.name!r}: scores column {node.scores!r} is not a list column")
            if not np.array_equal(scores.offsets, offsets):
                la, lb = np.diff(offsets), np.diff(np.asarray(scores.offsets, dtype=np.int64))
                if la.shape != lb.shape:
                    raise TransformError(f"feature {node.name!r}: column {name!r} has {la.shape[0]} rows but scores "
                                         f"column {node.scores!r} has {lb.shape[0]}", feature=node.name)
                r = int(np.flatnonzero(la != lb)[0])
                raise TransformError(f"feature {node.name!r}: row {r}: column {name!r} has {la[r]} ids but scores column "
                                     f"{node.scores!r} has {lb[r]} scores", feature=node.name)
            weights = np.ascontiguousarray(scores.values, dtype=np.float32)
        # A null list already has length 0, which is what transforms.md makes of it.
        return SparseColumn(values, offsets, weights)
