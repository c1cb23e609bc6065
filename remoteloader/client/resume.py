"""Loader checkpoints: the positions a loader saves, and what a loaded one resumes.

Two forms, both small plain data (``torch.save``, ``torch.load(weights_only=True)`` and
``torch.distributed.checkpoint`` keep them as they are):

* **The job's position** (under ``torch.distributed``): every rank gathers every rank's
  part at ``state_dict()`` and returns the same dict, ``{"version", "spec", "plan",
  "epoch", "done", "world_size", "batch_size"}``. Its keys do not depend on the world
  size, so DCP saves it once and a job of any world size loads it
  (``dcp.load({"model": m, "loader": loader})``). In deterministic order, on the same
  world size and batch size, it resumes in place (``consumed_in``): same plan, same
  sequence; otherwise the master replans the rest of the epoch.
* **A rank's part** (without a process group: ``{"rank_<r>": part}``, one per process):
  the same fields plus ``rank``, ``world_size``, ``batch_size``, what this rank's
  training loop consumed since the epoch (re)started, per split (``consumed``:
  ``[split id, pieces, rows of a partly used tail, base split, first row, rows consumed,
  padding]``) and ``batches_yielded``.

Both name their job (``job``, the loader's job name: "" for none), so that a checkpoint
resumes its own job on a shared fleet (``RemoteDataLoader.load_state_dict``).

``done`` names rows as ``[[base split, lo, hi], ...]`` ranges of a base split after its
per-epoch shuffle, which depend on neither the world size nor the batch size: any job
can take over the rows nobody consumed (the master plans the rest of the epoch without
them). A mix of tables names them by (base split, pass) instead (``core.mix.rows_key``: the
base split's id in a table's first pass), as a restarted table reads a base split once per
pass. ``spec`` holds each spec key that decides which rows an epoch holds, so that a
resume on an incompatible spec is refused naming the key; ``batch_size`` may change.
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from ..core.mix import BatchCounts
from ..protocol.messages import check_job_name
from ..spec import DatasetSpec

if TYPE_CHECKING:
    from .epoch import SplitPlan

STATE_VERSION = 5  # 5: positions name their job (``job``: the loader's job name, "" for none); 4: the job's
# position names the world size and batch size it was saved at; 3: the job's position; parts name the
# spec by key (2 had one fingerprint)
READ_VERSIONS = (3, 4, 5)  # a version-3 job position resumes as any position of another world size; before 5,
# a position names no job (it resumes as the loading loader's)
# Every spec key but batch_size (positions are row ranges) and autoscale (how many
# workers, not which rows). Always all of them, so the state's keys are fixed (DCP).
SPEC_KEYS = ("table", "features", "shuffle", "seed", "drop_last", "even_batches", "split_rows", "sampling",
             "on_error")
_JOB_KEYS = ("version", "spec", "plan", "epoch", "done")
_PART_KEYS = _JOB_KEYS + ("rank", "world_size", "batch_size", "consumed", "batches_yielded")
_SHOWN_CHARS = 40  # a spec value longer than this is kept as a digest


def spec_keys(spec: DatasetSpec) -> dict[str, str]:
    """The spec's row-deciding keys, each as its JSON text (or a digest when long)."""
    values = spec.to_dict()
    if spec.tables:  # a mix's tables (weights, columns, when_done) decide its rows as one table's key does
        values["table"] = values.pop("tables")
    out = {}
    for key in SPEC_KEYS:
        text = json.dumps(values.get(key), sort_keys=True, separators=(",", ":"))
        out[key] = text if len(text) <= _SHOWN_CHARS else "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def part(spec: DatasetSpec, plan: str, rank: int, world_size: int, epoch: int, done: list,
         consumed: list, batches_yielded: int) -> dict:
    """One rank's position (see the module docstring for the fields)."""
    out = {"version": STATE_VERSION, "spec": spec_keys(spec), "plan": plan, "epoch": epoch, "done": done,
           "rank": rank, "world_size": world_size, "batch_size": spec.batch_size, "consumed": consumed,
           "batches_yielded": batches_yielded}
    return _with_mix(out, spec.mix_splits)


def _with_mix(position: dict, mix_splits: int) -> dict:
    """``mix_splits`` is named only when batches mix splits: the lanes cut the epoch's
    splits, so split ids and consumed prefixes are of that plan (a position of before
    the key, and every K = 1 one, keeps its keys)."""
    if mix_splits != 1:
        position["mix_splits"] = mix_splits
    return position


def mix_of(position: Mapping) -> int:
    """The ``mix_splits`` a position was saved with."""
    return int(position.get("mix_splits", 1))


def state_of(mine: dict, fingerprint: str) -> dict:
    """What ``state_dict()`` returns: the job's position under ``torch.distributed``
    (a collective: every rank must call it, as DCP does), else this rank's part."""
    parts = _gather(mine, fingerprint)
    return job_position(parts) if parts is not None else {f"rank_{mine['rank']}": mine}


# Gathers so far in this process, per spec fingerprint: every rank of a job makes the same
# calls in the same order (as it orders its collectives), so the count names one call job-wide.
_gathers: collections.Counter = collections.Counter()


def _gather(mine: dict, fingerprint: str) -> Optional[dict[int, dict]]:
    """Every rank's part, when this loader's ranks are the default process group."""
    import torch.distributed as dist

    from .ranks import RankStore, default_store

    store = default_store()
    if store is None:
        return None
    if (dist.get_rank(), dist.get_world_size()) != (mine["rank"], mine["world_size"]):
        return None  # the loader was given another rank layout than the group's: nothing to gather over
    seq = _gathers[fingerprint]
    _gathers[fingerprint] += 1
    try:
        return RankStore(store).gather_parts(fingerprint, seq, mine["rank"], mine["world_size"], mine)
    except RuntimeError:
        _gathers[fingerprint] -= 1  # not a call job-wide: the ranks' next call must still match
        raise


def job_position(parts: Mapping[int, Mapping]) -> dict:
    """The position of the whole job from every rank's part: what all ranks consumed."""
    first = next(iter(parts.values()))
    for key in ("spec", "plan", "epoch", "world_size", "batch_size"):
        common(parts, key)
    if len({mix_of(p) for p in parts.values()}) != 1:
        raise ValueError(f"the ranks' states disagree on 'mix_splits': {sorted({mix_of(p) for p in parts.values()})}")
    job = _common_job(parts)
    return _with_mix({"version": STATE_VERSION, "spec": dict(first["spec"]), "plan": first["plan"],
                      "epoch": first["epoch"], "done": merged_done(parts), "world_size": first["world_size"],
                      "batch_size": first["batch_size"], "job": "" if job is None else job}, mix_of(first))


def _common_job(parts: Mapping[int, Mapping]) -> Optional[str]:
    """The job every part names (None: parts of before job names)."""
    jobs = {p.get("job") for p in parts.values()}
    if len(jobs) != 1:
        raise ValueError(f"the ranks' states disagree on 'job': {sorted(map(repr, jobs))}")
    return next(iter(jobs))


def saved_job(state: Any) -> Optional[str]:
    """The job name ``state`` (the job's position, or rank parts) was saved by; None for a
    state of before job names. A ValueError for a name that is none."""
    if isinstance(state, Mapping) and "version" in state:
        job = state.get("job")
    else:
        job = _common_job(rank_parts(state))
    if job is None:
        return None
    try:
        return check_job_name(job)
    except ValueError as e:
        raise ValueError(f"the checkpoint's {e}") from None


def common(parts: Mapping[int, Mapping], key: str) -> Any:
    """A value every part must agree on."""
    values = {repr(p[key]) for p in parts.values()}
    if len(values) != 1:
        raise ValueError(f"the ranks' states disagree on {key!r}: {sorted(values)}")
    return next(iter(parts.values()))[key]


def merged_done(parts: Mapping[int, Mapping]) -> list[list[int]]:
    """Every row the ranks consumed in the epoch, as merged ``[base, lo, hi]`` ranges."""
    ranges = [tuple(r) for r in common(parts, "done")]
    for p in parts.values():
        for _, _, _, base, lo, rows, padding in p["consumed"]:
            if rows and not padding:  # a repeated row's own copy is counted where it was read
                ranges.append((base, lo, lo + rows))
    merged: list[list[int]] = []
    for base, lo, hi in sorted(ranges):
        if merged and merged[-1][0] == base and merged[-1][2] >= lo:
            if merged[-1][2] > lo:
                raise ValueError(f"the ranks' states overlap in base split {base}: rows consumed twice?")
            merged[-1][2] = hi
        else:
            merged.append([base, lo, hi])
    return merged


@dataclass(frozen=True)
class Resume:
    """What a loaded state resumes: the next ``iter()`` of ``epoch`` starts from it."""

    epoch: int
    plan: str  # the split plan the position is of (the job's must be the same)
    done: list  # rows consumed before, [[base, lo, hi], ...]: the master plans the epoch without them
    consumed: dict[int, tuple[int, int]]  # split id -> (pieces, tail rows): this rank's own splits, same plan
    part: dict  # this rank's position until the epoch starts (``state_dict()`` right after loading)
    # A job's position on the same world size and batch size, in deterministic order: the
    # epoch keeps its plan and `done` becomes this rank's consumed splits (``consumed_in``),
    # so the rank's sequence continues exactly where it stopped.
    in_place: bool = False


def resume_of(state: Any, spec: DatasetSpec, rank: int, world_size: int) -> Resume:
    """What ``state`` (the job's position, or rank parts) resumes for this rank of this loader.

    A rank's own part with the same world size and batch size continues its own splits
    (the master re-produces them from what was consumed). Otherwise the rows every rank
    consumed (``done``) are left out and the rest of the epoch is planned anew for this
    job: that needs the job's position, or the parts of every rank.
    """
    if isinstance(state, Mapping) and "version" in state:
        position = _checked(state, _JOB_KEYS, "the checkpoint", spec)
        return _elastic(position, spec, rank, world_size)
    parts = rank_parts(state)
    for p in parts.values():
        _checked(p, _PART_KEYS, f"the state of rank {p['rank']}", spec)
    old_world = common(parts, "world_size")
    same_batches = common(parts, "batch_size") == spec.batch_size
    # A part's split ids are of its plan, which the lanes of its mix_splits cut.
    same_plan = all(mix_of(p) == spec.mix_splits for p in parts.values())
    if old_world == world_size and rank in parts and same_batches and same_plan:
        mine = dict(parts[rank])
        consumed = {int(c[0]): (int(c[1]), int(c[2])) for c in mine["consumed"]}
        return Resume(int(mine["epoch"]), mine["plan"], mine["done"], consumed, mine)
    if sorted(parts) == list(range(old_world)):
        return _elastic(job_position(parts), spec, rank, world_size)
    need = "its own part (same world size)" if same_batches and same_plan else \
        f"a batch_size of {spec.batch_size} instead of {common(parts, 'batch_size')}" if not same_batches else \
        f"mix_splits {spec.mix_splits} instead of {sorted({mix_of(p) for p in parts.values()})}"
    raise ValueError(f"state_dict holds ranks {sorted(parts)} of a {old_world}-rank job: rank {rank} of "
                     f"{world_size} needs {need} or all {old_world} parts")


def _elastic(position: Mapping, spec: DatasetSpec, rank: int, world_size: int) -> Resume:
    """Resume by leaving out every row the old job consumed (any world size, any batch size);
    in deterministic order on the same world size and batch size, in place instead."""
    done = [[int(b), int(lo), int(hi)] for b, lo, hi in position["done"]]
    in_place = (spec.splits_in_flight is not None and position.get("world_size") == world_size
                and position.get("batch_size") == spec.batch_size and mix_of(position) == spec.mix_splits)
    mine = part(spec, position["plan"], rank, world_size, int(position["epoch"]), done, [], 0)
    # In place, the plan is the epoch's own: its rows consumed are named in this rank's
    # splits when the epoch starts (consumed_in).
    return Resume(mine["epoch"], mine["plan"], done, {}, mine, in_place=in_place)


def consumed_in(done: list, splits: Mapping[int, "SplitPlan"], batch_size: int) -> dict[int, tuple[int, int]]:
    """This rank's consumed state, ``(pieces, rows of a partly used tail)`` per split, from
    the job's ``done`` row ranges, for ``splits`` (by id) of the plan the position was saved
    in: each split's consumed rows are a prefix of it. A mix of tables' repeated rows (a pass's
    padding, mid-lane) are placed by the batches consumed (``_mixed_padding_consumed``)."""
    out = _real_consumed_in(done, splits, batch_size)
    if any(s.lane is not None and s.padding for s in splits.values()):
        out.update(_mixed_padding_consumed(out, splits, batch_size))
    return out


def _mixed_padding_consumed(real: Mapping[int, tuple[int, int]], splits: Mapping[int, "SplitPlan"],
                            batch_size: int) -> dict[int, tuple[int, int]]:
    """A mix of tables: the padding splits the training loop consumed. ``done`` names real rows
    only (a repeated row is counted where it was read first), and each pass's padding lies
    inside its table's lane, in the batch its lane key says (``core.mix.BatchCounts``). The rank
    consumed whole batches: the fewest whose real rows of every table hold those it consumed
    (exact unless the last of them held repeated rows only: a batch no larger than the number
    of tables, each table's share its pass's padding row)."""
    tables = 1 + max(s.lane[0] for s in splits.values())
    counts = BatchCounts([(s.lane, s.rows) for s in splits.values()], tables)
    real_rows = [0] * tables
    for sid, (pieces, tail) in real.items():
        s = splits[sid]
        real_rows[s.lane[0]] += s.rows_consumed(pieces, tail, batch_size)
    padding = {sid: s.lane[1] // s.lane[2] for sid, s in splits.items() if s.padding}  # its batch (one row)
    by_table = [sorted(b for sid, b in padding.items() if splits[sid].lane[0] == t) for t in range(tables)]

    def covers(batches: int) -> bool:
        return all(counts.rows_before(batches, t) - bisect.bisect_left(by_table[t], batches) >= real_rows[t]
                   for t in range(tables))

    lo, hi = 0, counts.batches
    while lo < hi:  # the fewest batches that cover: covering is monotone in the batches
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if covers(mid) else (mid + 1, hi)
    return {sid: divmod(splits[sid].rows, batch_size) for sid, b in padding.items() if b < lo}


def _real_consumed_in(done: list, splits: Mapping[int, "SplitPlan"], batch_size: int) -> dict[int, tuple[int, int]]:
    by_base: dict[int, list[tuple[int, int]]] = {}
    for base, lo, hi in done:
        by_base.setdefault(int(base), []).append((int(lo), int(hi)))
    out = {}
    for sid, split in splits.items():
        if split.padding:
            continue  # a repeated row is in `done` where it was first read
        start, end = split.row_lo, split.row_lo + split.rows
        overlap = sorted((max(lo, start), min(hi, end)) for lo, hi in by_base.get(split.base, ()) if lo < end and hi > start)
        if not overlap:
            continue
        if overlap[0][0] != start or len(overlap) != 1:
            raise ValueError(f"split {sid}: the rows consumed of it are not a prefix ({overlap}): "
                             "the position is not of this plan")
        out[sid] = divmod(overlap[0][1] - start, batch_size)
    return out


def rank_parts(state: Any) -> dict[int, dict]:
    """The per-rank parts in ``state`` (one loader's ``state_dict()``, or several merged)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"not a RemoteDataLoader state: expected a dict, got {type(state).__name__}")
    parts = {}
    for key, p in state.items():
        if not (isinstance(key, str) and key.startswith("rank_") and key[5:].isdigit()):
            raise ValueError(f"not a RemoteDataLoader state: unexpected key {key!r} (expected rank_<n> or version)")
        parts[int(key[5:])] = p
    if not parts:
        raise ValueError("not a RemoteDataLoader state: no rank_<n> entry")
    for rank, p in parts.items():
        if not isinstance(p, Mapping) or p.get("rank") != rank:
            raise ValueError(f"state rank_{rank} is not that rank's position")
    return parts


def _checked(position: Mapping, keys: tuple, what: str, spec: DatasetSpec) -> Mapping:
    """``position`` if this remoteloader reads it and it is of a compatible spec."""
    if position.get("version") not in READ_VERSIONS:
        raise ValueError(f"{what}: version {position.get('version')!r}, this remoteloader reads versions "
                         f"{', '.join(map(str, READ_VERSIONS))}")
    missing = [k for k in keys if k not in position]
    if missing:
        raise ValueError(f"{what}: missing {missing}")
    mine = spec_keys(spec)
    saved_spec = position["spec"] if isinstance(position["spec"], Mapping) else {}
    for key in SPEC_KEYS:
        saved = saved_spec.get(key)
        if saved != mine[key]:
            raise ValueError(f"{what} is of another dataset spec: {key!r} was {saved}, this loader's is "
                             f"{mine[key]} (of the spec, only batch_size may change on resume)")
    return position


def read_rank_states(checkpoint_id: Union[str, os.PathLike], key: str = "dataloader") -> dict:
    """The loader state saved under ``key`` in a ``torch.distributed.checkpoint`` directory.

    Read in one process, without a process group: the job's position (saved under
    ``torch.distributed``), or every rank's part. ``dcp.load`` with the loader itself
    does the same under a process group; this serves a process that has none.
    """
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint_id)).read_metadata()
    template = _template(metadata, key)
    if not template:
        raise ValueError(f"{checkpoint_id}: no loader state under {key!r}")
    state = {key: template}
    dcp.load(state, checkpoint_id=str(checkpoint_id), no_dist=True)
    return state[key]


def _template(metadata: Any, prefix: str) -> dict:
    """A dict with the saved keys under ``prefix`` (DCP fills the values in)."""
    out: dict = {}
    for name in metadata.state_dict_metadata:
        if name.startswith(prefix + "."):
            node, path = out, name[len(prefix) + 1:].split(".")
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = None
    return out
