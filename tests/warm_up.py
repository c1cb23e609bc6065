"""Fill the caches every process of the suite reads, once, before the xdist workers start.

On a clean clone nothing is cached: no bytecode for the environment (``make install``
leaves it to be written at first import) and no compiled kernel for this checkout. Left
alone, the xdist workers and the first masters, workers and trainers they start all
compile the same modules and kernels at once, each for itself. ``conftest.py`` runs the
two parts below side by side (one per core) instead:

- ``imports``: the modules that many test processes import (torch and its distributed
  checkpoint, each role's entry point, the CLI), so their bytecode is written once;
- ``kernels``: one epoch of ``conftest.spec_dict`` on ORC and on Parquet through an
  in-process cluster, so the kernels that masters, workers and loaders run on the
  tests' tables are compiled into the cache once.

Run as ``python -m tests.warm_up imports|kernels`` from the repository root.
"""
from __future__ import annotations

import importlib
import sys
import tempfile


# Imported by many test processes at once: trainers and torchrun ranks, masters, workers
# (forked from their server), ``remoteloader status``.
SHARED_MODULES = ("torch", "torch.distributed.checkpoint", "remoteloader.master.__main__",
                  "remoteloader.worker.forkserver", "remoteloader.worker.__main__", "remoteloader.tools.cli")


def warm_imports() -> None:
    for name in SHARED_MODULES:
        importlib.import_module(name)


def warm_kernels() -> None:
    from tests.cluster import InProcessCluster
    from tests.conftest import spec_dict, table_of

    with tempfile.TemporaryDirectory(prefix="rl-warm-") as root:
        for fmt in ("orc", "parquet"):
            cluster = InProcessCluster(workers=1)  # a master serves one spec
            try:
                with cluster.loader(spec_dict(table_of(root, fmt))) as loader:
                    assert sum(len(batch) for batch in loader) > 0
            finally:
                cluster.stop()


PARTS = {"imports": warm_imports, "kernels": warm_kernels}  # one process each, side by side

if __name__ == "__main__":
    PARTS[sys.argv[1]]()
