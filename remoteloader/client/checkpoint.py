"""The loader's checkpoint (torchdata StatefulDataLoader protocol): its position, and loading one.

The loader's ``state_dict``/``load_state_dict`` delegate here. What this reads of the loader:
``rank``, ``world_size``, ``batch_size``, ``_hello()`` (the job: ``fingerprint``, ``plan``),
``_current`` (the ``EpochRun`` being iterated: ``epoch``, ``done``, ``splits``,
``assembler.consumed_state()``, ``assembler.exhausted``), ``_batches_yielded``,
``_next_epoch``; it sets ``_pending`` (a position the next ``iter()`` of its epoch starts
from), ``_next_epoch`` and ``_plan``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from . import resume

if TYPE_CHECKING:
    from .loader import RemoteDataLoader


def state_dict(loader: "RemoteDataLoader") -> dict:
    """What the training loop has consumed: small plain data, keyed by rank.

    ``{"rank_<r>": position}``: under ``torch.distributed.checkpoint`` every rank's
    part has its own key, so all of them are kept; ``torch.save`` per rank works too,
    and so does ``torch.load(..., weights_only=True)``. Batches prefetched but not yet
    yielded are not in it: after ``load_state_dict`` they are delivered again.
    """
    return {f"rank_{loader.rank}": _position(loader)}


def _position(loader: "RemoteDataLoader") -> dict:
    job = loader._hello()
    if loader._current is not None and not loader._current.assembler.exhausted:
        run = loader._current
        consumed = []
        for sid, (pieces, tail_rows) in sorted(run.assembler.consumed_state().items()):
            rows, base, row_lo, padding = run.splits[sid]
            consumed.append([sid, pieces, tail_rows, base, row_lo,
                             min(rows, pieces * loader.batch_size + tail_rows), int(padding)])
        epoch, done, yielded = run.epoch, run.done, loader._batches_yielded
    elif loader._pending is not None and loader._pending["epoch"] == loader._next_epoch:
        return dict(loader._pending["state"], rank=loader.rank, world_size=loader.world_size)
    else:
        epoch, done, consumed, yielded = loader._next_epoch, [], [], 0
    return {"version": resume.STATE_VERSION, "fingerprint": job["fingerprint"], "plan": job["plan"],
            "rank": loader.rank, "world_size": loader.world_size, "epoch": epoch, "done": done,
            "consumed": consumed, "batches_yielded": yielded}


def load_state_dict(loader: "RemoteDataLoader", state: dict) -> None:
    """Continue from ``state``: the next ``iter()`` resumes its epoch where it stopped.

    ``state`` holds this rank's part (``state_dict()`` of the same rank, same world
    size), or the parts of every rank of a job with another world size (elastic
    resume, e.g. from ``read_rank_states``): the rows they had not consumed are then
    spread over this job's ranks, each delivered once.
    """
    parts = resume.rank_parts(state)
    job = loader._hello()
    for part in parts.values():
        resume.check_part(part, job["fingerprint"])
        check_plan(loader, job, part["plan"])
    old_world = resume.common(parts, "world_size")
    epoch = resume.common(parts, "epoch")
    if old_world == loader.world_size and loader.rank in parts:
        mine = parts[loader.rank]
        consumed = {int(c[0]): (int(c[1]), int(c[2])) for c in mine["consumed"]}
        loader._pending = {"epoch": epoch, "done": mine["done"], "consumed": consumed, "state": mine}
    elif sorted(parts) == list(range(old_world)):
        done = resume.merged_done(parts)
        position = {"version": resume.STATE_VERSION, "fingerprint": job["fingerprint"], "plan": job["plan"],
                    "epoch": epoch, "done": done, "consumed": [], "batches_yielded": 0}
        loader._pending = {"epoch": epoch, "done": done, "consumed": {}, "state": position}
    else:
        raise ValueError(f"state_dict holds ranks {sorted(parts)} of a {old_world}-rank job: rank {loader.rank} of "
                         f"{loader.world_size} needs its own part (same world size) or all {old_world} parts")
    loader._next_epoch = epoch


def check_plan(loader: "RemoteDataLoader", job: dict, plan: Optional[str] = None) -> None:
    expected = plan if plan is not None else loader._plan
    if expected is not None and job["plan"] != expected:
        raise RuntimeError(f"the table's split plan changed ({expected} -> {job['plan']}): files were added or "
                           "removed, so the epoch in progress cannot be continued exactly")
    loader._plan = job["plan"]
