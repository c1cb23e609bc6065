"""remoteloader: a DataLoader whose DLRM preprocessing runs on remote workers.

Public names are imported lazily so that worker and master processes, which import
this package too, do not pay for torch.

Package map (the architecture): ``core`` (shared by every role: split plan, spec
binding, split processor), ``protocol`` (wire format, rpc), ``formats`` (ORC/Parquet
reading), ``transforms`` (feature kernels), ``master``, ``worker``, ``client`` (the three
roles, which never import each other), ``storage`` and ``tools`` (offline tools, never
imported at run time). ``spec`` and ``columns`` are the vocabulary all of them share.
"""
from __future__ import annotations

import os
from typing import Any

from .core.procs import kernel_cache_dir

# Every entry point (a training script's loader, LocalDataset, master, worker, tools) imports
# this package before any module of it imports numba, which reads its cache directory then:
# so compiled kernels land in one per-user cache (or the user's $NUMBA_CACHE_DIR), never in
# the source tree.
os.environ["NUMBA_CACHE_DIR"] = kernel_cache_dir()


def _version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("remoteloader")
    except PackageNotFoundError:
        return "0.1.0"


__version__ = _version()

_EXPORTS = {
    "RemoteDataLoader": "remoteloader.client.loader",
    "LocalDataset": "remoteloader.client.local",
    "DatasetSpec": "remoteloader.spec",
    "SpecError": "remoteloader.spec",
    "load_spec": "remoteloader.spec",
    "Batch": "remoteloader.client.batch",
    "KeyedJaggedTensor": "remoteloader.client.batch",
    "JaggedTensor": "remoteloader.client.batch",
    "read_rank_states": "remoteloader.client.resume",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'remoteloader' has no attribute {name!r}")
