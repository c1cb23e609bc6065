"""Where one rank's loader is (torchdata StatefulDataLoader protocol): owned by the loader alone.

``Position`` holds the next epoch, a loaded position waiting for its epoch, the run being
iterated and the split plan the position is of. The loader's ``state_dict``,
``load_state_dict``, ``set_epoch`` and each ``iter()`` go through it; the state's forms and
what a loaded one resumes are ``resume``'s.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..core.plan import rank_shares
from ..protocol.messages import JobInfo
from ..spec import DatasetSpec
from . import resume
from .epoch import EpochPlan, EpochRun
from .session import RunStart, acks_of


class Position:
    def __init__(self, spec: DatasetSpec, rank: int, world_size: int, job: str = "") -> None:
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.job = job  # the loader's job name: saved in its parts, so a checkpoint resumes its own job
        self.next_epoch = 0
        self.pending: Optional[resume.Resume] = None  # loaded; the next iter() of its epoch starts from it
        self.run: Optional[EpochRun] = None  # the epoch being iterated
        self.plan: Optional[str] = None  # the split plan the position is of (the job's, once welcomed)

    # -- the loader's calls -----------------------------------------------------------------------
    def take_epoch(self) -> int:
        """The epoch an ``iter()`` starts: the next one, or the one ``set_epoch`` chose."""
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return epoch

    def choose(self, epoch: int) -> None:
        """``set_epoch``: a loaded position is only resumed by its own epoch, and choosing
        another would drop it without a word."""
        if self.pending is not None and self.pending.epoch != epoch:
            raise ValueError(f"set_epoch({epoch}) after load_state_dict of a position in epoch "
                             f"{self.pending.epoch}: call set_epoch({self.pending.epoch}) to resume it (a loader "
                             f"without loaded state starts epoch {epoch} from its beginning)")
        self.next_epoch = epoch

    def begin(self, epoch: int) -> tuple[RunStart, Optional[resume.Resume]]:
        """What the run of ``epoch`` starts from, and the loaded position it resumes (if any)."""
        pending, self.pending = self.pending, None
        if pending is None or pending.epoch != epoch:
            return RunStart(epoch, [], []), None
        if pending.in_place:  # the epoch's plan as it was: its consumed rows are named once planned
            return RunStart(epoch, [], []), pending
        return RunStart(epoch, pending.done, acks_of(pending.consumed)), pending

    def consumed_at_start(self, resumed: Optional[resume.Resume], plan: EpochPlan) -> dict[int, tuple[int, int]]:
        """This rank's consumed state when its run of ``plan`` starts: (pieces, tail rows) per split."""
        if resumed is None:
            return {}
        if resumed.in_place:
            return resume.consumed_in(resumed.done, plan.splits, self.spec.batch_size)
        return resumed.consumed

    def check_plan(self, job_plan: str, expected: Optional[str] = None) -> None:
        """The job's split plan must be the one the position is of."""
        expected = expected if expected is not None else self.plan
        if expected is not None and job_plan != expected:
            raise RuntimeError(f"the table's split plan changed ({expected} -> {job_plan}): files were added or "
                               "removed, so the epoch in progress cannot be continued exactly")
        self.plan = job_plan

    def part(self, plan: str) -> dict:
        """This rank's part (``resume``): what its training loop consumed, and its job's name.
        Batches prefetched but not yet yielded are not in it: after a load they are delivered again."""
        return dict(self._consumed_part(plan), job=self.job)

    def _consumed_part(self, plan: str) -> dict:
        run = self.run
        if run is not None and not run.assembler.exhausted:
            return resume.part(self.spec, plan, self.rank, self.world_size, run.epoch, run.plan.done,
                               run.consumed(self.spec.batch_size), run.yielded)
        if self.pending is not None and self.pending.epoch == self.next_epoch:
            return self.pending.part  # loaded, not started: saved again as loaded
        return resume.part(self.spec, plan, self.rank, self.world_size, self.next_epoch, [], [], 0)

    def rows_ahead(self, job: JobInfo) -> int:
        """The rows this rank's iteration of the epoch under way (else the next) yields: a
        whole epoch's, or a resumed epoch's rest, as the master plans it (``core.plan``: the
        rows not ``done`` shared out over the ranks). A deterministic resume in place
        continues the job's own plan, whose rows this rank consumed the position does not
        name: it counts the job's consumed rows as spread evenly over the ranks, as a DDP job
        saved at one step (by ``dcp.save``) has them."""
        if self.run is not None:
            return self.run.rows
        if self.spec.table.follow is not None:
            # A stream: the master fixes its next window when a rank starts it (or workers read ahead into it).
            raise TypeError("len() of a loader that follows its table (table.follow) is its window's, known once "
                            "its epoch has started (its first batch taken): a window covers what landed since the last")
        pending = self.pending
        if pending is None or pending.epoch != self.next_epoch:
            return job.rank_rows
        spec = self.spec
        done = sum(hi - lo for _, lo, hi in pending.done)
        if pending.in_place:
            return max(0, job.rank_rows - done // self.world_size)
        consumed = sum(c[5] for c in pending.part.get("consumed", ()))  # a rank's own part: its rows consumed
        if spec.tables:
            if done:
                # The rest of each table's passes is dealt anew and the batches composed from what each
                # rank has left (core/mix.py): the master's plan, known once the epoch has started.
                raise TypeError("len() of a mix of tables resumed on another world size or batch_size is its "
                                "resumed epoch's, known once that epoch has started (its first batch taken)")
            return job.rank_rows - consumed  # its own part: the rank's epoch as planned, less what it consumed
        shares = rank_shares(job.total_rows - done, self.world_size, spec.batch_size, spec.drop_last,
                             spec.even_batches)
        return shares.rows[self.rank] + shares.padding[self.rank] - consumed

    def load(self, state: Any, job_plan: Callable[[], Optional[str]]) -> None:
        """Continue from ``state``: the job's position, this rank's part (same world size and
        batch size), or every rank's parts. Unless a rank continues its own part, the rows
        the old job consumed are left out and the rest of the epoch is spread over this
        job's ranks, each row delivered once, whatever the world size and batch size.
        ``job_plan()`` is asked for once the state is known to fit this spec."""
        loaded = resume.resume_of(state, self.spec, self.rank, self.world_size)
        plan = job_plan()
        self.check_plan(plan if plan is not None else loaded.plan, loaded.plan)
        self.pending, self.next_epoch = loaded, loaded.epoch

    # -- node contract ----------------------------------------------------------------------------
    def get_state(self) -> dict:
        """This rank's part, ``{"rank_<r>": part}`` (what ``state_dict()`` is without a process group)."""
        if self.plan is None:
            raise RuntimeError("the position has no split plan yet (the loader has not met the master)")
        return {f"rank_{self.rank}": self.part(self.plan)}

    def reset(self, state: Optional[dict] = None) -> None:
        self.run = None
        if state is None:
            self.next_epoch, self.pending = 0, None
        else:
            self.load(state, lambda: self.plan)
