"""The trainer's side: ``RemoteDataLoader`` and what it is made of.

``loader`` (the DataLoader-like front), ``fetch`` (requests to the rank's workers),
``assembly`` (pieces into exact batches, exactly once), ``embedded`` (the local master
and workers started when no master is given, rank discovery), ``batch`` (the
torchrec-shaped ``Batch``), ``resume`` (rank-keyed checkpoint state, elastic resume)
and ``local`` (the same spec as an in-process ``IterableDataset``, the baseline and fallback).
"""
from .batch import Batch, JaggedTensor, KeyedJaggedTensor, TorchrecBatch
from .loader import RemoteDataLoader
from .local import LocalDataset
from .resume import read_rank_states

__all__ = ["Batch", "JaggedTensor", "KeyedJaggedTensor", "LocalDataset", "RemoteDataLoader", "TorchrecBatch",
           "read_rank_states"]
