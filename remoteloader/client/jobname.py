"""A loader's job name (``RemoteDataLoader(spec, job=...)``): which loaders of one spec are one job.

On a shared fleet (a master without ``--spec``) a job is its spec *and* its name: two loaders of
the same spec under two names are two jobs, each getting every row once (a sweep's trials);
the ranks of one job must share the name. A master of one job ignores it. The name is:

1. ``job`` as given (``check_job_name``: 1 to 40 letters, digits, ``.``, ``_``, ``-``);
2. else torchrun's run id (``TORCHELASTIC_RUN_ID``, set for every rank of a launch and kept
   by its elastic restarts) when set and not ``none``;
3. else, under torch.distributed, a fresh name the first rank to get there publishes in the
   process group's store (one launch, one store: a restarted process reads the same one);
4. else none (``""``): the job is its spec alone, as before names.

Under torch.distributed the ranks agree through the store: the first name published for this
spec (and this process's n-th open loader of it, its slot) is the job's, a default takes it,
and a name given that differs (``job=""`` included) is an error naming both, never two half
jobs that each lose the other's rows. A slot is free again once its loader closes (or is
collected): a loader made again after the last one closed is the same job, as before names,
on every rank and in a restarted process alike; two loaders of one spec open at once are two.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import os
import uuid
from typing import NamedTuple, Optional

from ..protocol.messages import check_job_name
from .ranks import default_store

ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
STORE_KEY = "remoteloader/job/{fingerprint}/{seq}"
# What the store holds for a job given no name (``job=""``): the store's compare_set takes an
# empty value for "not set yet", so "" published would be overwritten by the next rank's default.
STORE_UNNAMED = "-"  # no job name starts with "-"

# Slots of each spec's open loaders in this process (a slot is free again at close): every
# rank opens and closes its loaders in the same order, so a slot names one loader job-wide.
_open: collections.defaultdict = collections.defaultdict(set)


class JobName(NamedTuple):
    name: str
    given: bool  # passed as job=, not a default
    slot: Optional[int]  # its slot of the spec's open loaders, when agreed through the store (``release``)


def release(fingerprint: str, slot: Optional[int]) -> None:
    """The loader holding ``slot`` of ``fingerprint``'s closed: the next one made takes its slot."""
    if slot is not None:
        _open[fingerprint].discard(slot)


def run_id_name() -> str:
    """torchrun's run id as a job name ("" when unset or ``none``); one that is no valid name
    (too long, other characters) is named by its digest."""
    run_id = os.environ.get(ENV_RUN_ID, "")
    if not run_id or run_id == "none":
        return ""
    try:
        return check_job_name(run_id)
    except ValueError:
        return "run-" + hashlib.sha256(run_id.encode()).hexdigest()[:16]


def resolve_job_name(job: Optional[str], fingerprint: str, rank: int, world_size: int) -> JobName:
    """The loader's job name, whether it was given, and its slot: see the module docstring.
    The caller ``release``s the slot when the loader closes."""
    given = job is not None
    name = check_job_name(job) if given else run_id_name()
    store = _group_store(rank, world_size)
    if store is None:
        return JobName(name, given, None)
    held = _open[fingerprint]
    slot = next(i for i in itertools.count() if i not in held)
    key = STORE_KEY.format(fingerprint=fingerprint, seq=slot)
    proposed = name if (given or name) else uuid.uuid4().hex[:16]
    agreed = store.compare_set(key, "", proposed or STORE_UNNAMED).decode()
    agreed = "" if agreed == STORE_UNNAMED else agreed
    if given and agreed != name:
        raise ValueError(f"job {name!r}: rank {rank}'s loader names another job than {agreed!r}, the name another "
                         f"rank of this torch.distributed job gave its loader of the same spec: every rank must "
                         "pass the same job=")
    held.add(slot)
    return JobName(check_job_name(agreed), given, slot)


def _group_store(rank: int, world_size: int) -> Optional[object]:
    """The default process group's store, when this loader's ranks are that group's."""
    store = default_store()
    if store is None:
        return None
    import torch.distributed as dist

    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        return None  # the loader was given another rank layout than the group's
    return store
