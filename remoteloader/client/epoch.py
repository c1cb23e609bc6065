"""One epoch run of a rank, typed: the plan the master sent, and the run being iterated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..core.mix import MAX_PASSES, rows_key
from ..spec import MAX_TABLES
from .session import RunStart, acks_of

if TYPE_CHECKING:
    from ..protocol.messages import Epoch, EpochSplitInfo
    from .assembly import EpochAssembler


@dataclass(frozen=True)
class SplitPlan:
    """One of the rank's splits: ``rows`` rows of base split ``base`` from row ``row_lo`` (of
    its per-epoch shuffle); ``padding``: rows repeated so that every rank gets as many batches."""

    rows: int
    base: int
    row_lo: int
    padding: bool
    lane: Optional[tuple[int, ...]] = None  # tables mixed by weight: its lane key (core/mix.py)

    def rows_consumed(self, pieces: int, tail_rows: int, batch_size: int) -> int:
        return min(self.rows, pieces * batch_size + tail_rows)


@dataclass(frozen=True)
class EpochPlan:
    """The rank's splits of one epoch run as the master planned them."""

    epoch: int
    done: list  # rows consumed before an elastic resume, [[base, lo, hi], ...] (sent in start_epoch)
    splits: dict[int, SplitPlan]  # split id -> its plan, in plan order

    @classmethod
    def of(cls, start: RunStart, reply: "Epoch") -> "EpochPlan":
        return cls(start.epoch, start.done, {s.split_id: _split_plan(s) for s in reply.splits})

    @property
    def lanes(self) -> Optional[dict[int, tuple[int, ...]]]:
        """Tables mixed by weight: each split's lane key; None: no mix of tables."""
        lanes = {sid: s.lane for sid, s in self.splits.items() if s.lane is not None}
        return lanes or None

    @property
    def padding_ids(self) -> list[int]:
        return [sid for sid, s in self.splits.items() if s.padding]


def _split_plan(s: "EpochSplitInfo") -> SplitPlan:
    """A split of a mix of tables names its rows by (base split, pass) (``core.mix.rows_key``):
    a restarted table reads a base split once per pass, in a row order of its own, so the rows
    a position names say which pass consumed them, whatever the world size."""
    if s.lane is not None:
        pass_ = s.table[1] if s.table is not None else 0
        # The client sizes its books of each table by these keys: bounded before any is used.
        if not (s.lane[0] < MAX_TABLES and s.lane[2] >= 1 and pass_ < MAX_PASSES
                and (s.table is None or s.table[0] == s.lane[0])):
            raise ValueError(f"the master's plan: split {s.split_id}: lane key {s.lane} (table, pass "
                             f"{s.table}) is out of bounds (at most {MAX_TABLES} tables, {MAX_PASSES} passes, "
                             "a row a batch at least)")
        return SplitPlan(s.rows, rows_key(s.base_split, pass_), s.row_lo, bool(s.padding), tuple(s.lane))
    return SplitPlan(s.rows, s.base_split, s.row_lo, bool(s.padding))


@dataclass
class EpochRun:
    """The epoch being iterated: its plan, the assembler, and how many batches the training
    loop has taken."""

    plan: EpochPlan
    assembler: "EpochAssembler"
    rows: int = 0  # the rows this run yields (its splits' rows less those consumed before it started)
    yielded: int = 0

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def resume_point(self) -> RunStart:
        return RunStart(self.plan.epoch, self.plan.done, acks_of(self.assembler.consumed_state()))

    def consumed(self, batch_size: int) -> list[list[int]]:
        """What the training loop consumed, as a rank part's ``consumed`` rows (``resume``)."""
        out = []
        for sid, (pieces, tail_rows) in sorted(self.assembler.consumed_state().items()):
            split = self.plan.splits[sid]
            out.append([sid, pieces, tail_rows, split.base, split.row_lo,
                        split.rows_consumed(pieces, tail_rows, batch_size), int(split.padding)])
        return out
