"""The trainer's side: ``RemoteDataLoader`` and what it is made of.

``loader`` (the DataLoader-like front), ``session`` (hello, the one rejoin path, the
master calls), ``stream`` (one epoch run: ``fetch`` credit and pieces from the rank's
workers, ``assembly`` into exact batches, exactly once, ``control`` heartbeats and acks),
``checkpoint`` and ``resume`` (positions, elastic resume), ``placement``, ``embedded`` and
``ranks`` (which master: the local master and workers started when none is given, rank
discovery and the torchrun close), ``batch`` (the torchrec-shaped ``Batch``) and ``local``
(the same spec as an in-process ``IterableDataset``, the baseline and fallback).
"""
from typing import Any

from .batch import Batch, JaggedTensor, KeyedJaggedTensor, TorchrecBatch
from .loader import RemoteDataLoader
from .resume import read_rank_states

__all__ = ["Batch", "JaggedTensor", "KeyedJaggedTensor", "LocalDataset", "RemoteDataLoader", "TorchrecBatch",
           "read_rank_states"]


def __getattr__(name: str) -> Any:
    # LocalDataset runs the transforms in this process: it alone needs numba, which a trainer
    # reading from workers would otherwise load for nothing (0.5 s or more of its start).
    if name == "LocalDataset":
        from .local import LocalDataset

        return LocalDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
