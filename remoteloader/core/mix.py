"""Tables mixed by weight (spec ``tables: [...]``): which rows of which table each batch holds.

Each table is read in **passes**: a pass is one epoch of that table alone, its splits
shuffled and dealt to the ranks as ``plan_epoch`` deals a single table's (``batch_size`` 1, so
with ``even_batches`` pad or drop every rank gets the same rows per pass). On each rank every
table is a **lane** (``core/schedule.py``): its passes' splits one after the other.

A batch takes ``weighted_shares(batch_size, weights)`` rows of the tables in the mix: each
share is within one row of its exact share ``batch_size * w / sum(w)`` (the shares are cut at
cumulative weights, so they add up to ``batch_size``). When a table runs out (its pass ends),
its ``when_done`` decides:

* ``restart``: its next pass follows at once, in the same batch if need be; it never runs out;
* ``drop``: it leaves the mix; the others' shares grow by their weights from the next batch;
* ``stop``: the epoch ends with this batch.

The epoch also ends when no table that can run out (``stop`` or ``drop``) is left. The batch
in which a table runs out holds what the table had left; if the epoch goes on, the other
tables in the mix (in table order) make up the rest of it, so every batch but the epoch's
last is full. So every batch holds each table's share within one row, except the one batch
in which a table runs out (then ``rows left`` of it, the rest from the others) and the epoch's
last, short batch.

``composition`` is that rule as **segments**: runs of batches with the same rows from each
table, at most two per table that runs out. A pure function of the batch size, weights,
policies and the rank's rows per pass, hence of the spec, table, seed, epoch and world size.
The lanes are cut where segments begin, so each split lies in one segment and its pieces get
the lanes' closed-form key (``lane_piece_key``) with the segment's rows per batch as the share.

A resume on another world size or batch size gives ``plan_mixed_epoch`` the rows consumed,
named by (base split, pass) (``rows_key``): each pass with rows consumed is dealt again to the
new ranks without them, and the epoch composed from what each rank has left, so every row of a
pass is read once and the batches keep their shares (not the unbroken epoch's sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..spec import DatasetSpec, SpecError, weighted_shares
from .plan import BaseSplit, EpochSplit, Intervals, plan_epoch

PASS_STREAM = 1 << 48  # epoch_rng streams of passes' split orders: above any base split's (base id + 1)
MAX_PASSES = 1 << 16  # a restarted table whose pass is far smaller than the epoch: refused, not looped
PASS_KEY = 1 << 32  # positions name rows of pass p of base split b as b + p * PASS_KEY (``rows_key``)


@dataclass(frozen=True)
class Segment:
    """``batches`` batches from ``first_batch`` on, each with ``counts[t]`` rows of table t."""

    first_batch: int
    batches: int
    counts: tuple[int, ...]


def composition(batch_size: int, weights: Sequence[float], policies: Sequence[str],
                rows: Sequence[int]) -> list[Segment]:
    """A rank's epoch of the mix: ``rows[t]`` rows of table t in each of its passes."""
    tables = range(len(weights))
    finite = [policies[t] != "restart" for t in tables]
    if not any(finite):
        raise ValueError("every table restarts: the epoch would never end")
    # A restarted table with no row for this rank (fewer rows than ranks) is not in its mix.
    mix, left = [t for t in tables if finite[t] or rows[t]], list(rows)
    out: list[Segment] = []
    batch = 0

    def emit(n: int, counts: list[int]) -> None:
        nonlocal batch
        out.append(Segment(batch, n, tuple(counts)))
        batch += n
        for t in tables:
            if finite[t]:
                left[t] -= n * counts[t]

    while True:
        ended = {t for t in mix if finite[t] and left[t] == 0}
        if ended:
            if _ends_epoch(ended, mix, finite, policies):
                return out
            mix = [t for t in mix if t not in ended]
        shares = dict(zip(mix, weighted_shares(batch_size, [weights[t] for t in mix])))
        counts = [shares.get(t, 0) for t in tables]
        full = min(left[t] // shares[t] for t in mix if finite[t])
        if full:
            emit(full, counts)
            continue
        # The batch in which a table runs out: what it has left, the rest from the others.
        counts = [min(counts[t], left[t]) if finite[t] else counts[t] for t in tables]
        if not _ends_epoch({t for t in mix if finite[t] and left[t] == counts[t]}, mix, finite, policies):
            short = batch_size - sum(counts)
            for t in mix:
                extra = min(short, left[t] - counts[t]) if finite[t] else short
                counts[t] += extra
                short -= extra
        emit(1, counts)


def _ends_epoch(ended: set, mix: Sequence[int], finite: Sequence[bool], policies: Sequence[str]) -> bool:
    """Whether tables running out end the epoch: one that stops, or the last that can run out."""
    return any(policies[t] == "stop" for t in ended) or all(t in ended for t in mix if finite[t])


def table_rows(segments: Sequence[Segment], tables: int) -> list[int]:
    """Rows of each table the epoch reads."""
    return [sum(s.batches * s.counts[t] for s in segments) for t in range(tables)]


@dataclass(frozen=True)
class MixedPlan:
    """One rank's epoch of the mix: its splits (lanes cut at segments) and the segments."""

    splits: list[EpochSplit]
    segments: list[Segment]


def plan_mixed_epoch(base: Sequence[BaseSplit], base_table: Sequence[int], weights: Sequence[float],
                     policies: Sequence[str], epoch: int, seed: int, shuffle: bool, world_size: int,
                     batch_size: int, even: str, done: Optional[Intervals] = None) -> dict[int, MixedPlan]:
    """Every rank's mixed epoch: split ids are unique in the epoch (rank by rank), each split
    carries its ``table`` (table, pass) and ``lane`` (table, offset, rows per batch).

    ``done`` (rows consumed before a resume, keyed by ``rows_key``) leaves out those rows: each
    pass with rows consumed is dealt again without them (``plan_epoch(done=...)``), and the
    epoch is composed anew from what the ranks have left, so every pass stays exactly once."""
    by_table: list[list[BaseSplit]] = [[] for _ in weights]
    table_of: dict[int, int] = {}
    for b, t in zip(base, base_table):
        by_table[t].append(b)
        table_of[b.id] = t
    consumed: dict[tuple[int, int], dict[int, Sequence[tuple[int, int]]]] = {}  # (table, pass) -> its done
    for key, ranges in (done or {}).items():
        b, p = base_and_pass(key)
        consumed.setdefault((table_of[b], p), {})[b] = ranges
    # The last pass of each table with rows consumed: passes after it are whole.
    resumed = [max((p for tt, p in consumed if tt == t), default=-1) for t in range(len(weights))]
    passes_memo: dict[tuple[int, int], list[list[EpochSplit]]] = {}

    def table_pass(t: int, p: int) -> list[list[EpochSplit]]:
        """Each rank's splits of pass ``p`` of table ``t``, in plan order (padding last)."""
        if (t, p) not in passes_memo:
            ranks: list[list[EpochSplit]] = [[] for _ in range(world_size)]
            for s in plan_epoch(by_table[t], epoch, seed, shuffle, world_size, 1, False, even,
                                done=consumed.get((t, p)), stream=pass_stream(t, p)):
                ranks[s.rank].append(replace(s, table=(t, p)))
            passes_memo[t, p] = ranks
        return passes_memo[t, p]

    plans: dict[int, MixedPlan] = {}
    next_id = 0
    for rank in range(world_size):
        # Rows of a pass on this rank: what a table that can run out has left of its one pass,
        # and a restarted table's whole pass (it only decides whether the table is in the mix).
        per_pass = [sum(s.rows for s in table_pass(t, 0 if policies[t] != "restart" else resumed[t] + 1)[rank])
                    for t in range(len(weights))]
        segments = composition(batch_size, weights, policies, per_pass)
        mine: list[EpochSplit] = []
        for t, want in enumerate(table_rows(segments, len(weights))):
            if per_pass[t] and want // per_pass[t] > MAX_PASSES:  # refused before planning so many passes
                raise ValueError(f"tables[{t}]: {want // per_pass[t]} passes of {per_pass[t]} rows in one epoch "
                                 f"(at most {MAX_PASSES})")
            lane: list[EpochSplit] = []
            rows, p = 0, 0
            while rows < want:
                if p >= MAX_PASSES:
                    raise ValueError(f"tables[{t}]: more than {MAX_PASSES} passes of {per_pass[t]} rows in one epoch")
                chunk = table_pass(t, p)[rank]
                lane += chunk
                rows += sum(s.rows for s in chunk)
                p += 1
            for s in _cut_lane(lane, want, t, segments):
                mine.append(replace(s, id=next_id))
                next_id += 1
        plans[rank] = MixedPlan(mine, segments)
    return plans


def rows_key(base: int, pass_: int) -> int:
    """How positions name base split ``base``'s rows in a table's pass ``pass_`` (``done``
    ranges ``[key, lo, hi]``): the base split's id in pass 0, as for one table, and
    ``base + pass * PASS_KEY`` in a restarted table's later passes (each a row space of its own:
    a base split is read once per pass, in a row order of its own)."""
    return base + pass_ * PASS_KEY


def base_and_pass(key: int) -> tuple[int, int]:
    """The (base split, pass) a ``rows_key`` names."""
    return key % PASS_KEY, key // PASS_KEY


def check_passes(spec: DatasetSpec, rows: Sequence[int]) -> None:
    """Refuse a mix whose restarted table would be read in more than ``MAX_PASSES // 4`` passes
    an epoch (each a plan of its own), from the tables' ``rows``: the passes are the same on any
    world size but for rounding, which the margin covers. Errors name the weight."""
    shares = weighted_shares(spec.batch_size, [t.weight for t in spec.tables])
    for t, mixed in enumerate(spec.tables):
        if mixed.when_done != "restart":
            continue
        longest = max(rows[f] / shares[f] for f, other in enumerate(spec.tables) if other.when_done != "restart")
        passes = longest * shares[t] / rows[t]
        if passes > MAX_PASSES // 4:
            raise SpecError(f"tables[{t}].weight: the table ({rows[t]:,} rows, {shares[t]} a batch) would be read "
                            f"about {passes:,.0f} times an epoch (at most {MAX_PASSES // 4:,}): lower its weight")


def pass_stream(table: int, pass_: int) -> int:
    """The ``epoch_rng`` stream of a table's pass's split order."""
    return PASS_STREAM + (table << 24) + pass_


def row_stream(base: int, source: Optional[Sequence[int]]) -> int:
    """The ``epoch_rng`` stream of a base split's row shuffle: ``base + 1`` as for one table, and
    for a table's later passes a stream of their own, so a restarted table is shuffled anew."""
    pass_ = source[1] if source else 0
    return base + 1 + (pass_ << 32)


def _cut_lane(lane: Sequence[EpochSplit], want: int, table: int, segments: Sequence[Segment]) -> list[EpochSplit]:
    """The lane's first ``want`` rows, cut where a segment with rows of the table begins; each
    piece's ``lane`` key (table, offset, share) is of its segment (``lane_piece_key``)."""
    bounds = []  # (first row of the lane, first batch, rows per batch) of each segment of the table
    row = 0
    for seg in segments:
        if seg.counts[table]:
            bounds.append((row, seg.first_batch, seg.counts[table]))
            row += seg.batches * seg.counts[table]
    out: list[EpochSplit] = []
    start = 0
    for s in lane:
        lo = s.row_lo
        while lo < s.row_hi and start < want:
            k = max(i for i, b in enumerate(bounds) if b[0] <= start)
            seg_row, seg_batch, share = bounds[k]
            end = min(bounds[k + 1][0] if k + 1 < len(bounds) else want, want)
            take = min(s.row_hi - lo, end - start)
            out.append(replace(s, row_lo=lo, row_hi=lo + take,
                               lane=(table, start - seg_row + seg_batch * share, share)))
            lo += take
            start += take
    return out


class BatchCounts:
    """Rows of each lane in each batch, from the splits' ``lane`` keys alone (what a client
    is told of its plan): a split with key (t, o, c) and n rows gives c rows to each of batches
    ``o // c`` to ``(o + n - 1) // c`` (its segment's, which start at a batch's first row)."""

    def __init__(self, lanes: Sequence[tuple[Sequence[int], int]], tables: int) -> None:
        """``lanes``: (lane key, rows) of the rank's splits."""
        spans: list[list[list[int]]] = [[] for _ in range(tables)]
        for (t, offset, share), rows in lanes:
            spans[t].append([offset // share, (offset + rows - 1) // share + 1, share])
        self._runs: list[list[list[int]]] = []
        for table in spans:  # runs of batches with the same rows of the table (its segments)
            runs: list[list[int]] = []
            for first, stop, share in sorted(table):
                if runs and runs[-1][2] == share and first <= runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], stop)
                else:
                    runs.append([first, stop, share])
            self._runs.append(runs)

    def counts(self, batch: int) -> list[int]:
        return [next((c for a, b, c in runs if a <= batch < b), 0) for runs in self._runs]

    @property
    def batches(self) -> int:
        """Batches with rows of any lane."""
        return max((b for runs in self._runs for _, b, _ in runs), default=0)

    def rows_before(self, batch: int, table: int) -> int:
        """Rows of lane ``table`` in batches ``[0, batch)``."""
        return sum(c * max(0, min(b, batch) - a) for a, b, c in self._runs[table])


def mix_report(batch_size: int, weights: Sequence[float], policies: Sequence[str], rows: Sequence[int]) -> dict:
    """What one rank's epoch of the mix reads when its passes hold ``rows`` rows of each table
    (``remoteloader validate``: the whole tables on one rank): each table's rows a batch, rows
    and passes an epoch, and the runs of batches with the same rows of each table."""
    segments = composition(batch_size, weights, policies, rows)
    read = table_rows(segments, len(weights))
    shares = weighted_shares(batch_size, weights)
    return {
        "batches_per_epoch": sum(s.batches for s in segments),
        "tables": [{"weight": w, "when_done": p, "rows": n, "rows_per_batch": share, "rows_per_epoch": r,
                    "passes": round(r / n, 3) if n else 0}
                   for w, p, n, share, r in zip(weights, policies, rows, shares, read)],
        "segments": [{"first_batch": s.first_batch, "batches": s.batches, "rows": list(s.counts)} for s in segments],
    }
