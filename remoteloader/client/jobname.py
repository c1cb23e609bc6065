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
spec (and this process's n-th loader of it) is the job's, a default takes it, and a name given
that differs is an error naming both, never two half jobs that each lose the other's rows.
"""
from __future__ import annotations

import collections
import hashlib
import os
import uuid
from typing import Optional

from ..protocol.messages import check_job_name
from .ranks import default_store

ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
STORE_KEY = "remoteloader/job/{fingerprint}/{seq}"

# Loaders of each spec made so far in this process: every rank makes its loaders in the same
# order, so the count names one loader job-wide (as for ``resume._gathers``).
_made: collections.Counter = collections.Counter()


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


def resolve_job_name(job: Optional[str], fingerprint: str, rank: int, world_size: int) -> tuple[str, bool]:
    """(the loader's job name, whether it was given): see the module docstring."""
    given = job is not None
    name = check_job_name(job) if given else run_id_name()
    store = _group_store(rank, world_size)
    if store is None:
        return name, given
    key = STORE_KEY.format(fingerprint=fingerprint, seq=_made[fingerprint])
    _made[fingerprint] += 1
    proposed = name if (given or name) else uuid.uuid4().hex[:16]
    agreed = store.compare_set(key, "", proposed).decode()
    if given and agreed != name:
        raise ValueError(f"job {name!r}: rank {rank}'s loader names another job than {agreed!r}, the name another "
                         f"rank of this torch.distributed job gave its loader of the same spec: every rank must "
                         "pass the same job=")
    return check_job_name(agreed), given


def _group_store(rank: int, world_size: int) -> Optional[object]:
    """The default process group's store, when this loader's ranks are that group's."""
    store = default_store()
    if store is None:
        return None
    import torch.distributed as dist

    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        return None  # the loader was given another rank layout than the group's
    return store
