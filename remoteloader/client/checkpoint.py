"""The loader's checkpoint (torchdata StatefulDataLoader protocol): its position, and loading one.

The loader's ``state_dict``/``load_state_dict``/``set_epoch`` delegate here; the state's
forms and what a loaded one resumes are ``resume``'s. What this reads of the loader:
``spec``, ``rank``, ``world_size``, ``batch_size``, ``_hello()`` (the job: ``plan``),
``_current`` (the ``EpochRun`` being iterated: ``epoch``, ``done``, ``splits``,
``assembler.consumed_state()``, ``assembler.exhausted``), ``_batches_yielded``,
``_next_epoch``; it sets ``_pending`` (a position the next ``iter()`` of its epoch starts
from: ``epoch``, ``done``, ``consumed``, ``state``), ``_next_epoch`` and ``_plan``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..protocol.messages import JobInfo
from . import resume

if TYPE_CHECKING:
    from .loader import RemoteDataLoader


def state_dict(loader: "RemoteDataLoader") -> dict:
    """What the training loop has consumed: small plain data.

    Under ``torch.distributed`` (a process group of the loader's ranks) it is the job's
    position, the same dict on every rank and free of the world size: DCP saves it once,
    and ``dcp.load({"model": m, "loader": loader})`` resumes it on any world size. It is
    a collective then: every rank calls it (DCP does). Without a process group it is
    this rank's part, ``{"rank_<r>": position}``. Batches prefetched but not yet yielded
    are not in it: after ``load_state_dict`` they are delivered again.
    """
    return resume.state_of(_part(loader))


def _part(loader: "RemoteDataLoader") -> dict:
    plan = loader._hello().plan
    run = loader._current
    if run is not None and not run.assembler.exhausted:
        consumed = []
        for sid, (pieces, tail_rows) in sorted(run.assembler.consumed_state().items()):
            rows, base, row_lo, padding = run.splits[sid]
            consumed.append([sid, pieces, tail_rows, base, row_lo,
                             min(rows, pieces * loader.batch_size + tail_rows), int(padding)])
        return resume.part(loader.spec, plan, loader.rank, loader.world_size, run.epoch, run.done, consumed,
                           loader._batches_yielded)
    if loader._pending is not None and loader._pending["epoch"] == loader._next_epoch:
        return loader._pending["state"]  # loaded, not started: saved again as loaded
    return resume.part(loader.spec, plan, loader.rank, loader.world_size, loader._next_epoch, [], [], 0)


def load_state_dict(loader: "RemoteDataLoader", state: Any) -> None:
    """Continue from ``state``: the next ``iter()`` resumes its epoch where it stopped.

    ``state`` is the job's position (``state_dict()`` under ``torch.distributed``, or
    ``read_rank_states``), this rank's part (same world size and batch size), or the
    parts of every rank of a job. Unless a rank continues its own part, the rows the
    old job consumed are left out and the rest of the epoch is spread over this job's
    ranks, each row delivered once, whatever the world size and batch size.
    """
    loaded = resume.resume_of(state, loader.spec, loader.rank, loader.world_size)
    check_plan(loader, loader._hello(), loaded.plan)
    loader._pending = {"epoch": loaded.epoch, "done": loaded.done, "consumed": loaded.consumed,
                       "state": loaded.part, "in_place": loaded.in_place}
    loader._next_epoch = loaded.epoch


def check_epoch(loader: "RemoteDataLoader", epoch: int) -> None:
    """``set_epoch``'s check: a loaded position is only resumed by its own epoch, and
    choosing another would drop it without a word."""
    pending = loader._pending
    if pending is not None and pending["epoch"] != epoch:
        raise ValueError(f"set_epoch({epoch}) after load_state_dict of a position in epoch {pending['epoch']}: "
                         f"call set_epoch({pending['epoch']}) to resume it (a loader without loaded state "
                         f"starts epoch {epoch} from its beginning)")


def check_plan(loader: "RemoteDataLoader", job: JobInfo, plan: Optional[str] = None) -> None:
    expected = plan if plan is not None else loader._plan
    if expected is not None and job.plan != expected:
        raise RuntimeError(f"the table's split plan changed ({expected} -> {job.plan}): files were added or "
                           "removed, so the epoch in progress cannot be continued exactly")
    loader._plan = job.plan
