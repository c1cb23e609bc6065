"""remoteloader: a DataLoader whose DLRM preprocessing runs on remote workers.

Public names are imported lazily so that worker and master processes, which import
this package too, do not pay for torch.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "RemoteDataLoader": "remoteloader.client",
    "LocalDataset": "remoteloader.local",
    "DatasetSpec": "remoteloader.spec",
    "SpecError": "remoteloader.spec",
    "Batch": "remoteloader.batch",
    "KeyedJaggedTensor": "remoteloader.batch",
    "JaggedTensor": "remoteloader.batch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'remoteloader' has no attribute {name!r}")
