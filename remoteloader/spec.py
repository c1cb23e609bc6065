"""The dataset spec: the declarative contract between a training job and the service.

A spec says which table to read (path, format, partitions = row filter), which features
to keep (feature projection = column filter), how to transform each one, and how to
batch. It is plain data (YAML/JSON or Python), so it can cross the wire, be compared
by fingerprint, and be journaled. Nothing executable is ever part of it.

Validation here is structural (keys, types, ranges) and every error names the key, e.g.
``features.dense[2].transforms``. Validation against the table's files and schema, and
of transform parameters, happens when a spec is bound to its table (``dataset.py``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union
from urllib.parse import urlsplit

import yaml


class SpecError(ValueError):
    """A spec that cannot be used; the message starts with the offending key."""


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    kind: str  # "dense" | "sparse"
    column: Optional[str] = None
    inputs: tuple[str, ...] = ()
    scores: Optional[str] = None
    transforms: tuple[dict, ...] = ()
    default: Optional[float] = None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.column is not None:
            out["column"] = column_ref_to_dict(self.column)
        else:
            out["inputs"] = list(self.inputs)
        if self.scores is not None:
            out["scores"] = self.scores
        if self.default is not None:
            out["default"] = self.default
        out["transforms"] = [dict(t) for t in self.transforms]
        return out


@dataclass(frozen=True)
class TableSpec:
    path: str
    format: Optional[str] = None
    partitions: Optional[tuple[str, ...]] = None
    # {every: seconds between re-listings, until: the last partition read, or None}: the job
    # follows its growing table (master/follow.py, docs/spec.md "Following a growing table").
    follow: Optional[dict] = None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"path": self.path}
        if self.format is not None:
            out["format"] = self.format
        if self.partitions is not None:
            out["partitions"] = list(self.partitions)
        if self.follow is not None:  # absent when not following: a fixed table's fingerprint is unchanged
            out["follow"] = dict(self.follow)
        return out


@dataclass(frozen=True)
class MixedTable:
    """One table of a mix (spec ``tables``): its weight in every batch, the job's column names
    it has under other names, and what the job does when it runs out (core/mix.py)."""

    table: TableSpec
    weight: float = 1
    columns: tuple[tuple[str, str], ...] = ()  # (the job's column, the table's column), sorted
    when_done: str = "drop"  # stop | restart | drop

    def to_dict(self) -> dict:
        out = {**self.table.to_dict(), "weight": self.weight, "when_done": self.when_done}
        if self.columns:
            out["columns"] = dict(self.columns)
        return out

    def stored(self, name: str) -> str:
        """The table's name of the job's column ``name`` (a map column's key keeps its key)."""
        renames = dict(self.columns)
        suffix = next((s for s in (".ids", ".scores") if name.endswith(s)), "")
        m = MAP_REF.match(name[:len(name) - len(suffix)])
        if m is None:
            return renames.get(name, name)
        return f"{renames.get(m.group(1), m.group(1))}[{m.group(2)}]{suffix}"


@dataclass(frozen=True)
class DatasetSpec:
    table: TableSpec  # with ``tables``: the first of them
    label: Optional[str] = None
    dense: tuple[FeatureSpec, ...] = ()
    sparse: tuple[FeatureSpec, ...] = ()
    passthrough: tuple[str, ...] = ()
    batch_size: int = 1024
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    even_batches: str = "pad"  # pad | drop | off: equal batch counts on every rank (docs/spec.md)
    split_rows: int = 64 * 1024
    sampling: Optional[dict] = None
    on_error: str = "fail"
    autoscale: Optional[dict] = None  # {min_workers, max_workers}: let the master size the worker pool
    cache: Optional[dict] = None  # {mode, expected_epochs}: the block cache (docs/cache.md); None: mode auto
    order: Optional[dict] = None  # {deterministic, cycle}: a rank's batch order as a pure function (guarantees.md)
    share: Optional[dict] = None  # {weight, priority}: this job's share of a shared fleet (docs/operations.md)
    mix_splits: int = 1  # K: every full batch draws its rows from K lanes of the rank's splits (core/schedule.py)
    tables: tuple[MixedTable, ...] = ()  # tables mixed by weight (core/mix.py); empty: one table, ``table``

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "DatasetSpec":
        """Load YAML or JSON. A relative table path is relative to the spec file."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise SpecError(f"spec file {str(p)!r}: {e.strerror or e}") from None
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"spec file {str(p)!r} is {len(raw)} bytes (at most {MAX_SPEC_BYTES})")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(f"spec file {str(p)!r} is not UTF-8 text (byte {e.start})") from None
        kind = "JSON" if p.suffix == ".json" else "YAML"
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.load(text, Loader=_SpecLoader)  # noqa: S506
        except (ValueError, yaml.YAMLError) as e:
            raise SpecError(f"spec file {str(p)!r} is not valid {kind}: {e}") from None
        except RecursionError:
            raise SpecError(f"spec file {str(p)!r}: {kind} nested too deeply") from None
        try:
            return cls.from_dict(data, base_dir=p.resolve().parent)
        except RecursionError:
            raise SpecError(f"spec file {str(p)!r}: nested too deeply") from None

    @classmethod
    def from_dict(cls, data: Any, base_dir: Union[str, os.PathLike, None] = None) -> "DatasetSpec":
        """Build from the declarative form; ``base_dir`` anchors a relative local table path."""
        return _parse(data, Path(base_dir) if base_dir is not None else Path.cwd())

    def to_dict(self) -> dict:
        """The canonical declarative form; ``from_dict(to_dict())`` gives an equal spec."""
        out: dict[str, Any] = {
            # A mix names its tables instead; a spec of one table keeps its form (and fingerprint).
            **({"tables": [t.to_dict() for t in self.tables]} if self.tables else {"table": self.table.to_dict()}),
            "features": {
                "label": self.label,
                "dense": [f.to_dict() for f in self.dense],
                "sparse": [f.to_dict() for f in self.sparse],
                "passthrough": list(self.passthrough),
            },
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "even_batches": self.even_batches,
            "split_rows": self.split_rows,
            "on_error": self.on_error,
        }
        if self.sampling is not None:
            out["sampling"] = dict(self.sampling)
        if self.autoscale is not None:
            out["autoscale"] = dict(self.autoscale)
        if self.cache is not None:
            out["cache"] = dict(self.cache)
        if self.order is not None:
            out["order"] = dict(self.order)
        if self.share is not None:
            out["share"] = dict(self.share)
        if self.mix_splits != 1:  # absent at its default: a spec of before the key keeps its fingerprint
            out["mix_splits"] = self.mix_splits
        return out

    @property
    def table_paths(self) -> list[tuple[str, str]]:
        """(key, path) of every table the spec reads: what an allowlist must check."""
        if self.tables:
            return [(f"tables[{i}].path", t.table.path) for i, t in enumerate(self.tables)]
        return [("table.path", self.table.path)]

    @property
    def share_weight(self) -> float:
        """This job's weight among a shared fleet's jobs (1 if unsaid)."""
        return float((self.share or {}).get("weight", 1))

    @property
    def priority(self) -> str:
        """This job's priority class on a shared fleet: low, normal (if unsaid) or high."""
        return (self.share or {}).get("priority", "normal")

    @property
    def cache_mode(self) -> str:
        """The block cache's mode for this job (``auto`` without a ``cache`` section)."""
        return self.cache["mode"] if self.cache is not None else "auto"

    @property
    def expected_epochs(self) -> int:
        """How many epochs the job expects to read its rows (the cache policy's hint; 1 if unsaid)."""
        return (self.cache or {}).get("expected_epochs", 1)

    @property
    def cycle(self) -> Optional[int]:
        """The interleave cycle of a deterministic order (without mixing: its lanes are the
        schedule then); None: no cycle."""
        if self.mix_splits > 1 or self.tables:
            return None
        return self.order["cycle"] if self.order is not None and self.order["deterministic"] else None

    @property
    def splits_in_flight(self) -> Optional[int]:
        """How many of a rank's splits its batches need at once: the ``mix_splits`` lanes when
        batches mix splits, else a deterministic order's cycle; None: batches come in arrival
        order, from one split at a time. Workers' shares and split sizes are planned for it."""
        if self.tables:  # a mix of tables reads one split of each table (its lane) at once
            return len(self.tables)
        return self.mix_splits if self.mix_splits > 1 else self.cycle

    def fingerprint(self) -> str:
        """Identity of the job: two clients may share a master only with equal fingerprints."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "DatasetSpec":
        spec = replace(self, **changes)
        _check_batching(spec)
        return spec


def spec_differences(mine: Any, theirs: Any, limit: int = 4, _path: str = "", _depth: int = 0) -> list[str]:
    """Where two specs' ``to_dict()`` forms differ, as ``key: A here, B there`` lines (dotted
    keys, values as JSON cut to 40 characters), at most ``limit``; a list differs as a whole."""
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping) and _depth < 6:
        out: list[str] = []
        for key in sorted(set(mine) | set(theirs), key=str):
            if len(out) >= limit:
                break
            out += spec_differences(mine.get(key), theirs.get(key), limit - len(out),
                                    f"{_path}.{key}" if _path else str(key), _depth + 1)
        return out
    if mine == theirs:
        return []

    def shown(value: Any) -> str:
        text = json.dumps(value, sort_keys=True, default=str)
        return text if len(text) <= 40 else text[:37] + "..."

    return [f"{_path or '(the spec)'}: {shown(mine)} here, {shown(theirs)} there"]


# -- parsing ---------------------------------------------------------------------------
_TOP_KEYS = {"table", "features", "batch_size", "shuffle", "seed", "drop_last", "even_batches", "split_rows", "sampling", "on_error",
             "autoscale", "cache", "order", "share", "mix_splits", "tables"}
_MIXED_TABLE_KEYS = {"path", "format", "partitions", "weight", "columns", "when_done"}
WHEN_DONE = ("stop", "restart", "drop")
MAX_TABLES = 64
MAX_TABLE_WEIGHT = 1e6
_SHARE_KEYS = {"weight", "priority"}
PRIORITIES = ("low", "normal", "high")
MAX_SHARE_WEIGHT = 1000
_AUTOSCALE_KEYS = {"min_workers", "max_workers"}
_CACHE_KEYS = {"mode", "expected_epochs"}
CACHE_MODES = ("auto", "off", "read", "write-all")
_ORDER_KEYS = {"deterministic", "cycle"}
DEFAULT_CYCLE = 4
MAX_CYCLE = 1024
MAX_MIX_SPLITS = 1024  # as many lanes as a cycle has splits: each is a split in flight per rank
_TABLE_KEYS = {"path", "format", "partitions", "follow"}
_FOLLOW_KEYS = {"every", "until"}
MIN_FOLLOW_EVERY_S = 0.05  # a re-listing lists every file: more often would only burn the master's CPU
MAX_FOLLOW_EVERY_S = 7 * 86400
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_FEATURE_GROUP_KEYS = {"label", "dense", "sparse", "passthrough"}
_FEATURE_KEYS = {"dense": {"name", "column", "inputs", "transforms", "default"},
                 "sparse": {"name", "column", "inputs", "scores", "transforms"}}
FORMATS = ("orc", "parquet")
ON_ERROR = ("fail", "skip")
MAX_SPEC_BYTES = 16 << 20


class _SpecLoader(yaml.SafeLoader):
    """Safe YAML without aliases: ``*name`` can expand a few hundred bytes into gigabytes
    ("billion laughs"), and a spec never needs one."""

    MAX_DEPTH = 64  # a spec nests a few levels; refusing early beats recursing a thousand deep

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a spec", mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > self.MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {self.MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
EVEN_BATCHES = ("pad", "drop", "off")


def _mapping(value: Any, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise SpecError(f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def _no_unknown(value: Mapping, allowed: set, key: str) -> None:
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        where = f"{key}." if key else ""
        raise SpecError(f"{where}{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})")


def _typed(value: Any, types: tuple, key: str, what: str) -> Any:
    # bool is an int in Python; a spec that says `batch_size: true` is still wrong.
    if isinstance(value, bool) and bool not in types:
        raise SpecError(f"{key}: expected {what}, got a boolean")
    if not isinstance(value, types):
        raise SpecError(f"{key}: expected {what}, got {type(value).__name__} {value!r}")
    return value


def _name(value: Any, key: str) -> str:
    _typed(value, (str,), key, "a non-empty string")
    if not value:
        raise SpecError(f"{key}: expected a non-empty string")
    return value


def _parse(data: Any, base_dir: Path) -> DatasetSpec:
    top = _mapping(data, "spec")
    _no_unknown(top, _TOP_KEYS, "")
    if "table" in top and "tables" in top:
        raise SpecError("tables: give either table (one table) or tables (a mix), not both")
    if "table" not in top and "tables" not in top:
        raise SpecError("table: required key is missing")
    if "features" not in top:
        raise SpecError("features: required key is missing")

    tables = _parse_tables(top["tables"], base_dir) if "tables" in top else ()
    table = tables[0].table if tables else _parse_table(top["table"], base_dir)
    feats = _mapping(top["features"], "features")
    _no_unknown(feats, _FEATURE_GROUP_KEYS, "features")
    label = feats.get("label")
    if label is not None:
        _name(label, "features.label")
    dense = tuple(_parse_feature(f, "dense", f"features.dense[{i}]") for i, f in enumerate(_list(feats.get("dense", []), "features.dense")))
    sparse = tuple(_parse_feature(f, "sparse", f"features.sparse[{i}]") for i, f in enumerate(_list(feats.get("sparse", []), "features.sparse")))
    passthrough = tuple(_name(c, f"features.passthrough[{i}]") for i, c in enumerate(_list(feats.get("passthrough", []), "features.passthrough")))
    if not dense and not sparse and label is None and not passthrough:
        raise SpecError("features: the selection is empty (no label, dense, sparse or passthrough feature)")
    seen: dict[str, str] = {}
    for group, fs in (("dense", dense), ("sparse", sparse)):
        for i, f in enumerate(fs):
            if f.name in seen:
                raise SpecError(f"features.{group}[{i}].name: feature {f.name!r} is defined twice (also in {seen[f.name]})")
            seen[f.name] = f"features.{group}[{i}]"

    spec = DatasetSpec(
        table=table,
        label=label,
        dense=dense,
        sparse=sparse,
        passthrough=passthrough,
        batch_size=_typed(top.get("batch_size", 1024), (int,), "batch_size", "a positive integer"),
        shuffle=_typed(top.get("shuffle", False), (bool,), "shuffle", "true or false"),
        seed=_typed(top.get("seed", 0), (int,), "seed", "an integer"),
        drop_last=_typed(top.get("drop_last", False), (bool,), "drop_last", "true or false"),
        even_batches=_even_batches(top.get("even_batches", "pad")),
        split_rows=_typed(top.get("split_rows", 64 * 1024), (int,), "split_rows", "a positive integer"),
        sampling=dict(_mapping(top["sampling"], "sampling")) if top.get("sampling") is not None else None,
        on_error=_typed(top.get("on_error", "fail"), (str,), "on_error", "'fail' or 'skip'"),
        autoscale=_parse_autoscale(top.get("autoscale")),
        cache=_parse_cache(top.get("cache")),
        order=_parse_order(top.get("order")),
        share=_parse_share(top.get("share")),
        mix_splits=_typed(top.get("mix_splits", 1), (int,), "mix_splits", "a positive integer"),
        tables=tables,
    )
    _check_batching(spec)
    return spec


def _check_batching(spec: DatasetSpec) -> None:
    if spec.batch_size <= 0:
        raise SpecError(f"batch_size: must be positive, got {spec.batch_size}")
    if spec.split_rows <= 0:
        raise SpecError(f"split_rows: must be positive, got {spec.split_rows}")
    if spec.even_batches not in EVEN_BATCHES:
        raise SpecError(f"even_batches: must be one of {', '.join(EVEN_BATCHES)} (or true/false), got {spec.even_batches!r}")
    if spec.on_error not in ON_ERROR:
        raise SpecError(f"on_error: must be one of {', '.join(ON_ERROR)}, got {spec.on_error!r}")
    if spec.seed < 0 or spec.seed >= 2**63:
        raise SpecError(f"seed: must be in [0, 2**63), got {spec.seed}")
    if not 1 <= spec.mix_splits <= MAX_MIX_SPLITS:
        raise SpecError(f"mix_splits: {spec.mix_splits} is not between 1 and {MAX_MIX_SPLITS}")
    if spec.mix_splits > spec.batch_size:
        raise SpecError(f"mix_splits: {spec.mix_splits} lanes cannot each give a row to a batch of "
                        f"batch_size {spec.batch_size}")
    if spec.tables:
        _check_mix(spec)
    if spec.mix_splits > 1 and spec.order is not None and spec.order["cycle"] != DEFAULT_CYCLE:
        raise SpecError(f"order.cycle: {spec.order['cycle']} is not used with mix_splits {spec.mix_splits} (its "
                        "lanes are the schedule): leave order.cycle out")


def weighted_shares(batch_size: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Rows of a batch for each weight: ``floor(B * W(<=j) / W) - floor(B * W(<j) / W)``, W(<=j)
    the cumulative weight, computed exactly; each is within one row of ``B * w / W``."""
    exact = [Fraction(w) for w in weights]
    total, cum, out, prev = sum(exact), Fraction(0), [], 0
    for w in exact:
        cum += w
        upto = (batch_size * cum) // total
        out.append(int(upto - prev))
        prev = upto
    return tuple(out)


def _check_mix(spec: DatasetSpec) -> None:
    """What makes a mix of tables unusable whatever the tables hold."""
    if spec.mix_splits != 1:
        raise SpecError(f"mix_splits: {spec.mix_splits} is not used with tables (each table is a lane of every "
                        "batch): leave mix_splits out")
    if spec.order is not None and spec.order["cycle"] != DEFAULT_CYCLE:
        raise SpecError(f"order.cycle: {spec.order['cycle']} is not used with tables (their lanes are the schedule): "
                        "leave order.cycle out")
    if all(t.when_done == "restart" for t in spec.tables):
        raise SpecError("tables: every table has when_done: restart, so an epoch would never end (give one "
                        "when_done: stop or drop)")
    for i, rows in enumerate(weighted_shares(spec.batch_size, [t.weight for t in spec.tables])):
        if rows == 0:
            raise SpecError(f"tables[{i}].weight: {spec.tables[i].weight} gives the table no row of a batch of "
                            f"batch_size {spec.batch_size}")


def _parse_tables(value: Any, base_dir: Path) -> tuple[MixedTable, ...]:
    """``tables: [{path, format, partitions, weight, columns, when_done}, ...]``: tables mixed by weight."""
    items = _list(value, "tables")
    if not 1 <= len(items) <= MAX_TABLES:
        raise SpecError(f"tables: {len(items)} tables (between 1 and {MAX_TABLES})")
    out = []
    for i, item in enumerate(items):
        key = f"tables[{i}]"
        t = _mapping(item, key)
        if "follow" in t:
            raise SpecError(f"{key}.follow: a mix's tables are fixed tables (following a growing table is "
                            "table.follow, for a job of one table)")
        _no_unknown(t, _MIXED_TABLE_KEYS, key)
        table = _parse_table({k: v for k, v in t.items() if k in _TABLE_KEYS}, base_dir, key)
        weight = _typed(t.get("weight", 1), (int, float), f"{key}.weight", "a positive number")
        if not 0 < weight <= MAX_TABLE_WEIGHT:
            raise SpecError(f"{key}.weight: must be in (0, {MAX_TABLE_WEIGHT:g}], got {weight!r}")
        when_done = _typed(t.get("when_done", "drop"), (str,), f"{key}.when_done", " or ".join(WHEN_DONE))
        if when_done not in WHEN_DONE:
            raise SpecError(f"{key}.when_done: must be one of {', '.join(WHEN_DONE)}, got {when_done!r}")
        columns = _mapping(t.get("columns", {}), f"{key}.columns")
        renames = {_name(k, f"{key}.columns"): _name(v, f"{key}.columns.{k}") for k, v in columns.items()}
        stored = [v for v in renames.values()]
        twice = next((v for v in stored if stored.count(v) > 1), None)
        if twice is not None:
            raise SpecError(f"{key}.columns: the table's column {twice!r} is given two job names")
        out.append(MixedTable(table, weight, tuple(sorted(renames.items())), when_done))
    return tuple(out)


def _even_batches(value: Any) -> str:
    """``true`` means ``pad`` (the default), ``false`` means ``off``."""
    if isinstance(value, bool):
        return "pad" if value else "off"
    return _typed(value, (str,), "even_batches", f"one of {', '.join(EVEN_BATCHES)}, or true/false")


def _parse_autoscale(value: Any) -> Optional[dict]:
    if value is None:
        return None
    a = _mapping(value, "autoscale")
    _no_unknown(a, _AUTOSCALE_KEYS, "autoscale")
    out = {k: _typed(a[k], (int,), f"autoscale.{k}", "a positive integer") for k in sorted(a)}
    if any(v < 1 for v in out.values()):
        raise SpecError("autoscale: min_workers and max_workers must be at least 1")
    if out.get("min_workers", 1) > out.get("max_workers", 1 << 30):
        raise SpecError("autoscale.min_workers: larger than autoscale.max_workers")
    return out


def _parse_share(value: Any) -> Optional[dict]:
    """``share: {weight, priority}``: how much of a shared fleet this job gets while the
    fleet is short (docs/operations.md, "A shared fleet")."""
    if value is None:
        return None
    s = _mapping(value, "share")
    _no_unknown(s, _SHARE_KEYS, "share")
    out: dict[str, Any] = {}
    if "weight" in s:
        weight = _typed(s["weight"], (int, float), "share.weight", "a positive number")
        if not 0 < weight <= MAX_SHARE_WEIGHT:
            raise SpecError(f"share.weight: must be in (0, {MAX_SHARE_WEIGHT}], got {weight!r}")
        out["weight"] = weight
    if "priority" in s:
        if s["priority"] not in PRIORITIES:
            raise SpecError(f"share.priority: must be one of {', '.join(PRIORITIES)}, got {s['priority']!r}")
        out["priority"] = s["priority"]
    return out


def _parse_cache(value: Any) -> Optional[dict]:
    """``cache: {mode, expected_epochs}``: whether this job may use the block cache and how
    often it expects to read its rows (the policy's reuse hint). Where the cache lives is the
    operator's choice (``--cache``), never the spec's."""
    if value is None:
        return None
    c = _mapping(value, "cache")
    _no_unknown(c, _CACHE_KEYS, "cache")
    mode = _typed(c.get("mode", "auto"), (str,), "cache.mode", " or ".join(map(repr, CACHE_MODES)))
    if mode not in CACHE_MODES:
        raise SpecError(f"cache.mode: {mode!r} is not one of {', '.join(CACHE_MODES)}")
    out: dict[str, Any] = {"mode": mode}
    if "expected_epochs" in c:
        epochs = _typed(c["expected_epochs"], (int,), "cache.expected_epochs", "a positive integer")
        if epochs < 1:
            raise SpecError("cache.expected_epochs: must be at least 1")
        out["expected_epochs"] = epochs
    return out


def _parse_order(value: Any) -> Optional[dict]:
    """``order: {deterministic, cycle}``: with ``deterministic: true`` a rank's batches come in
    an order that is a pure function of the table, spec, seed, epoch and world size, an
    interleave of ``cycle`` splits at a time (a property of the job, never of the workers)."""
    if value is None:
        return None
    o = _mapping(value, "order")
    _no_unknown(o, _ORDER_KEYS, "order")
    deterministic = _typed(o.get("deterministic", False), (bool,), "order.deterministic", "true or false")
    cycle = _typed(o.get("cycle", DEFAULT_CYCLE), (int,), "order.cycle", "a positive integer")
    if not 1 <= cycle <= MAX_CYCLE:
        raise SpecError(f"order.cycle: {cycle} is not between 1 and {MAX_CYCLE}")
    return {"deterministic": deterministic, "cycle": cycle}


def _list(value: Any, key: str) -> Sequence:
    if not isinstance(value, (list, tuple)):
        raise SpecError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def _parse_table(value: Any, base_dir: Path, key: str = "table") -> TableSpec:
    if isinstance(value, str):
        value = {"path": value}
    t = _mapping(value, key)
    _no_unknown(t, _TABLE_KEYS, key)
    if "path" not in t:
        raise SpecError(f"{key}.path: required key is missing")
    path = _name(t["path"], f"{key}.path")
    if "://" in path:
        _no_userinfo(path, key)
    elif not os.path.isabs(path):
        path = str((base_dir / path).resolve())
    fmt = t.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise SpecError(f"{key}.format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    parts = t.get("partitions")
    if parts is not None:
        parts = tuple(_name(p, f"{key}.partitions[{i}]").strip("/") for i, p in enumerate(_list(parts, f"{key}.partitions")))
        if not parts:
            raise SpecError(f"{key}.partitions: the list is empty, so no row would be selected (omit the key to read all partitions)")
    return TableSpec(path=path, format=fmt, partitions=parts, follow=_parse_follow(t.get("follow")))


def _parse_follow(value: Any) -> Optional[dict]:
    """``table.follow: {every, until}``: re-list the table every ``every`` (seconds, or a
    string such as ``500ms``, ``60s``, ``5m``, ``1h``) and read what lands, up to and
    including partition ``until`` (a partition path such as ``ds=2026-01-03``; the stream
    ends once it is present), or for ever (``until`` absent or null)."""
    if value is None:
        return None
    f = _mapping(value, "table.follow")
    _no_unknown(f, _FOLLOW_KEYS, "table.follow")
    if "every" not in f:
        raise SpecError("table.follow.every: required key is missing (how often the table is listed again, e.g. 60s)")
    every = f["every"]
    if isinstance(every, str):
        m = _DURATION.match(every)
        if m is None:
            raise SpecError(f"table.follow.every: {every!r} is not a duration (e.g. 500ms, 60s, 5m, 1h)")
        every = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    every = float(_typed(every, (int, float), "table.follow.every", "a duration (seconds, or e.g. '60s')"))
    if not MIN_FOLLOW_EVERY_S <= every <= MAX_FOLLOW_EVERY_S:
        raise SpecError(f"table.follow.every: {every:g} s is not between {MIN_FOLLOW_EVERY_S:g} s and "
                        f"{MAX_FOLLOW_EVERY_S:g} s")
    until = f.get("until")
    if until is not None:
        until = _name(until, "table.follow.until").strip("/")
        if not until or any(not p or p in (".", "..") for p in until.split("/")):
            raise SpecError(f"table.follow.until: {f['until']!r} is not a partition path (e.g. ds=2026-01-03)")
    return {"every": every, "until": until}


def _no_userinfo(uri: str, key: str = "table") -> None:
    """A URI's ``user:secret@`` would go wherever the table path goes (every message, log
    and status line), so it is refused, and the error never repeats it."""
    try:
        netloc = urlsplit(uri).netloc
    except ValueError as e:
        raise SpecError(f"{key}.path: not a valid URI ({e})") from None
    if "@" in netloc:
        raise SpecError(f"{key}.path: a table URI must not carry credentials (user:secret@ before the host); "
                        "give them through the storage's standard credential chain instead: the environment "
                        "(e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), a profile (~/.aws/credentials, "
                        "AWS_PROFILE) or the instance's role")


MAP_REF = re.compile(r"^(.+)\[(-?\d+)\]$")


def _column_ref(value: Any, key: str) -> str:
    """A column name, or ``{map: COLUMN, key: K}`` for one key of a map column, which is
    held as the virtual column name ``COLUMN[K]`` (what the readers understand)."""
    if isinstance(value, Mapping):
        _no_unknown(value, {"map", "key"}, key)
        if "map" not in value or "key" not in value:
            raise SpecError(f"{key}: a map column reference needs both 'map' and 'key'")
        _name(value["map"], f"{key}.map")
        _typed(value["key"], (int,), f"{key}.key", "an integer map key")
        return f"{value['map']}[{value['key']}]"
    return _name(value, key)


def column_ref_to_dict(name: str) -> Any:
    """The declarative form of a column reference (inverse of ``_column_ref``)."""
    m = MAP_REF.match(name)
    return {"map": m.group(1), "key": int(m.group(2))} if m else name


def _str_keys(value: Any) -> Any:
    """Mapping keys as strings, as JSON has them: a YAML ``{1: 10}`` and a JSON ``{"1": 10}``
    are the same spec (and fingerprint), and the spec crosses the wire as msgpack."""
    if isinstance(value, Mapping):
        return {str(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_str_keys(v) for v in value]
    return value


def _parse_feature(value: Any, kind: str, key: str) -> FeatureSpec:
    if isinstance(value, str):  # shorthand: a bare column name is a feature of the same name
        value = {"name": value, "column": value}
    f = _mapping(value, key)
    _no_unknown(f, _FEATURE_KEYS[kind], key)
    name = _name(f.get("name"), f"{key}.name")
    column, inputs = f.get("column"), f.get("inputs")
    if (column is None) == (inputs is None):
        raise SpecError(f"{key}: feature {name!r} needs exactly one of 'column' or 'inputs'")
    if column is not None:
        column = _column_ref(column, f"{key}.column")
        inputs_t: tuple[str, ...] = ()
    else:
        inputs_t = tuple(_name(x, f"{key}.inputs[{i}]") for i, x in enumerate(_list(inputs, f"{key}.inputs")))
        if not inputs_t:
            raise SpecError(f"{key}.inputs: feature {name!r} has an empty input list")
    steps = []
    for i, step in enumerate(_list(f.get("transforms", []), f"{key}.transforms")):
        s = _mapping(step, f"{key}.transforms[{i}]")
        if not isinstance(s.get("op"), str):
            raise SpecError(f"{key}.transforms[{i}].op: each step needs an 'op' name")
        steps.append(_str_keys(s))
    default = f.get("default")
    if default is not None:
        default = float(_typed(default, (int, float), f"{key}.default", "a number"))
    scores = f.get("scores")
    if scores is not None:
        _name(scores, f"{key}.scores")
    return FeatureSpec(name=name, kind=kind, column=column, inputs=inputs_t, scores=scores,
                       transforms=tuple(steps), default=default)


def load_spec(spec: Union[DatasetSpec, Mapping[str, Any], str, os.PathLike]) -> DatasetSpec:
    """A spec given as a ``DatasetSpec``, its dict form, or the path of a YAML/JSON file."""
    if isinstance(spec, DatasetSpec):
        return spec
    if isinstance(spec, Mapping):
        return DatasetSpec.from_dict(spec)
    return DatasetSpec.from_file(Path(spec))
