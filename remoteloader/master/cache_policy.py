"""The block cache's ``auto`` mode: per group of features, compute, cache the transformed
blocks, or cache the source columns, from what workers measured (docs/cache.md).

Features that share a table column form one **group** (the connected parts of the
feature/column graph): a column is read once for all its features, so skipping its read
is a decision about all of them together. For a group, per row of the table:

* compute: decoding its columns plus transforming its features (measured by workers),
  plus its share of what no column or feature is charged with (mostly the shuffle's
  gather of the columns read), shared out by decoded bytes;
* transformed: reading its features' blocks (their bytes over the cache's read rate),
  and gathering them (that share, scaled by the blocks' bytes over the columns');
* source: reading its columns' raw blocks, then transforming and gathering as usual.

A mode other than compute pays a write once (bytes over the write rate) and saves
``compute - read`` on every later read of the row: the job's remaining epochs (from
``cache.expected_epochs``) and other jobs that read the same columns lately (the
popularity log). The policy takes the mode that saves most, if it saves at least
``MIN_GAIN`` of what it would cost to compute those reads, while the cache's bytes stay
within the budget (best saving per byte first). With a slow cache or a light spec,
reading costs more than computing, and it answers compute.

``PlanCheck`` then holds the plan to its prediction: once the job reads what the plan
cached, a job whose split seconds per row are worse than before the change (by
``REVERT_MARGIN``) reverts the groups the plan changed, and they stay compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..transforms import FeaturePipeline

MODES = ("compute", "transformed", "source")
MIN_GAIN = 0.05  # a mode must save this share of the compute cost of the reads it serves
REVERT_MARGIN = 1.10  # split seconds a row this much above the baseline revert a plan
MIN_ROWS = 20_000  # rows measured before deciding, and again before judging a plan


@dataclass(frozen=True)
class FeatureGroup:
    name: str  # its first feature, in the spec's dependency order
    features: tuple[str, ...]
    columns: tuple[str, ...]


def feature_groups(pipeline: FeaturePipeline) -> list[FeatureGroup]:
    """Row-local features grouped by shared table columns; other features are never cached."""
    features = [f for f in pipeline.feature_names if pipeline.row_local(f)]
    parent = {f: f for f in features}

    def root(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    columns = {f: pipeline.columns_for([f]) for f in features}
    owner: dict[str, str] = {}
    for f in features:
        for c in columns[f]:
            if c in owner:
                parent[root(f)] = root(owner[c])
            else:
                owner[c] = f
    members: dict[str, list[str]] = {}
    for f in features:
        members.setdefault(root(f), []).append(f)
    return [FeatureGroup(fs[0], tuple(fs), tuple(sorted(set().union(*(columns[f] for f in fs)))))
            for fs in members.values()]


@dataclass
class Measured:
    """Costs summed over workers: name -> [rows, seconds, bytes]; the cache's rates in bytes/s."""

    columns: dict[str, list[float]] = field(default_factory=dict)
    features: dict[str, list[float]] = field(default_factory=dict)
    read_bps: Optional[float] = None
    write_bps: Optional[float] = None
    rows: float = 0.0  # of whole splits, with their seconds: what no column or feature is charged
    split_s: float = 0.0  # (the shuffle's gather of the columns read, cutting pieces) comes from these

    def unattributed_per_row(self) -> float:
        """Split seconds a row that no column or feature was charged with."""
        if self.rows < MIN_ROWS:
            return 0.0
        charged = sum(e[1] / e[0] for table in (self.columns, self.features) for e in table.values() if e[0])
        return max(0.0, self.split_s / self.rows - charged)

    def per_row(self, table: str, names: Sequence[str]) -> Optional[tuple[float, float]]:
        """(seconds, bytes) a row for ``names`` together; None until each has MIN_ROWS rows."""
        entries = [(self.columns if table == "columns" else self.features).get(n) for n in names]
        if any(e is None or e[0] < MIN_ROWS for e in entries):
            return None
        return sum(e[1] / e[0] for e in entries), sum(e[2] / e[0] for e in entries)


@dataclass(frozen=True)
class Choice:
    group: str
    mode: str
    reason: str
    # Seconds a row: computing the group, and what the chosen mode costs a read of it.
    compute_s: float = 0.0
    mode_s: float = 0.0
    nbytes: int = 0  # cache bytes the mode takes for the whole table
    final: bool = True  # False: not enough measured to decide yet (compute meanwhile, nothing journaled)


def choose(groups: Sequence[FeatureGroup], measured: Measured, reads: Mapping[str, float], table_rows: int,
           budget_bytes: Optional[int], reverted: frozenset = frozenset()) -> list[Choice]:
    """A mode per group. ``reads``: how many more times each group's rows are expected to
    be read after this pass (remaining epochs plus other jobs)."""
    candidates: list[tuple[float, Choice]] = []
    out: dict[str, Choice] = {}
    # The rest of a split's time (mostly the shuffle's gather of what was read) is shared out
    # by the groups' decoded bytes; a group read as transformed blocks gathers those instead.
    source_bytes = {g.name: (measured.per_row("columns", g.columns) or (0.0, 0.0))[1] for g in groups}
    rest = measured.unattributed_per_row() / max(sum(source_bytes.values()), 1e-12)
    for g in groups:
        decode = measured.per_row("columns", g.columns)
        transform = measured.per_row("features", g.features)
        if g.name in reverted:
            out[g.name] = Choice(g.name, "compute", "reverted: caching it made the job slower")
            continue
        if decode is None or transform is None:
            out[g.name] = Choice(g.name, "compute", "not measured yet", final=False)
            continue
        if not measured.read_bps or not measured.write_bps:
            out[g.name] = Choice(g.name, "compute", "the cache's read and write rates are not measured yet",
                                 final=False)
            continue
        gather_s = rest * decode[1]
        compute_s = decode[0] + transform[0] + gather_s
        r = reads.get(g.name, 0.0)
        if r <= 0:
            out[g.name] = Choice(g.name, "compute", "no later read expected (expected_epochs, popularity)",
                                 compute_s=compute_s)
            continue
        shrink = min(1.0, transform[1] / decode[1]) if decode[1] else 1.0
        options = {"transformed": (transform[1] / measured.read_bps + gather_s * shrink, transform[1]),
                   "source": (decode[1] / measured.read_bps + transform[0] + gather_s, decode[1])}
        best = None
        for mode, (read_s, nbytes) in options.items():
            gain = r * (compute_s - read_s) - nbytes / measured.write_bps
            if best is None or gain > best[0]:
                best = (gain, mode, read_s, nbytes)
        gain, mode, read_s, nbytes = best
        if gain < MIN_GAIN * r * compute_s:
            out[g.name] = Choice(g.name, "compute", f"reading costs {read_s * 1e6:.2f} us a row against "
                                 f"{compute_s * 1e6:.2f} to compute: caching would not pay", compute_s, read_s)
            continue
        total = int(nbytes * table_rows)
        candidates.append((gain / max(total, 1), Choice(
            g.name, mode, f"saves {gain * 1e6:.2f} us a row over {r:g} more reads "
                          f"(compute {compute_s * 1e6:.2f}, read {read_s * 1e6:.2f})", compute_s, read_s, total)))
    left = budget_bytes
    for _, c in sorted(candidates, key=lambda item: -item[0]):
        if left is not None and c.nbytes > left:
            out[c.group] = Choice(c.group, "compute", f"{c.mode} would take {c.nbytes:,} bytes, over the cache "
                                  "budget left", c.compute_s, c.mode_s)
            continue
        left = None if left is None else left - c.nbytes
        out[c.group] = c
    return [out[g.name] for g in groups]


@dataclass
class PlanCheck:
    """A plan in force and the job's split seconds a row before it, to judge it by."""

    changed: tuple[str, ...]  # groups the plan moved off compute
    epoch: int  # the epoch it took effect in (it writes then; later epochs read)
    baseline_s: float  # split seconds a row before the change
    mark: tuple[float, float] = (0.0, 0.0)  # (rows, split seconds) when the first reading epoch began

    def verdict(self, epoch: int, rows: float, split_s: float) -> Optional[str]:
        """A reason to revert, once enough rows of a reading epoch were measured; None otherwise."""
        if epoch <= self.epoch:
            return None
        if self.mark == (0.0, 0.0):
            self.mark = (rows, split_s)
            return None
        n, s = rows - self.mark[0], split_s - self.mark[1]
        if n < MIN_ROWS:
            return None
        observed = s / n
        if observed > self.baseline_s * REVERT_MARGIN:
            return (f"reverted: {observed * 1e6:.2f} us a row with the cache against {self.baseline_s * 1e6:.2f} "
                    "before it")
        return None
