"""What the training loop receives: a torchrec-shaped ``Batch``.

``Batch.dense_features`` is float32 ``[B, D]``, ``Batch.sparse_features`` a
``KeyedJaggedTensor`` (key-major like torchrec's: all rows of key 0, then key 1, ...),
``Batch.labels`` float32 ``[B]``, ``Batch.passthrough`` a dict of raw columns, and
``Batch.weights`` the per-row sampling weights when the spec asks for them.

The same flat tensors travel on the wire (see ``wire.py``), so building a ``Batch``
from received frames is a handful of zero-copy views.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch


class _Jagged:
    """torchrec's accessors over ``_values`` (ids), ``_lengths`` (per row) and ``_weights``."""

    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: Optional[torch.Tensor]

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return _offsets(self._lengths)

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("no weights here: only scored sparse features carry them")
        return self._weights

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights


@dataclass
class JaggedTensor(_Jagged):
    """One sparse feature of a batch: ids of all rows concatenated, and ids per row."""

    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: Optional[torch.Tensor] = None

    def to_dense(self) -> list[torch.Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class KeyedJaggedTensor(_Jagged):
    """torchrec's KeyedJaggedTensor layout, without needing torchrec installed.

    ``lengths()`` has ``len(keys) * stride()`` entries, key-major; ``values()`` holds the
    ids in the same order; ``weights_or_none()`` one float per id for scored features
    (1.0 for the ids of unscored keys when the batch mixes both), else ``None``.
    """

    def __init__(self, keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: Optional[torch.Tensor] = None, stride: Optional[int] = None) -> None:
        self._keys = list(keys)
        self._values = values
        self._lengths = lengths
        self._weights = weights
        if stride is None:
            stride = lengths.numel() // len(self._keys) if self._keys else 0
        self._stride = int(stride)
        self._length_per_key: Optional[list[int]] = None

    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def length_per_key(self) -> list[int]:
        if self._length_per_key is None:
            per_key = self._lengths.view(len(self._keys), self._stride).sum(dim=1) if self._keys else self._lengths[:0]
            self._length_per_key = [int(x) for x in per_key.tolist()]
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"no sparse feature {key!r} (features: {', '.join(self._keys)})") from None
        lo, hi = self.offset_per_key()[k], self.offset_per_key()[k + 1]
        return JaggedTensor(
            self._values[lo:hi],
            self._lengths[k * self._stride : (k + 1) * self._stride],
            None if self._weights is None else self._weights[lo:hi],
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def to(self, device: Any, non_blocking: bool = False) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            None if self._weights is None else self._weights.to(device, non_blocking=non_blocking),
            self._stride,
        )

    def pin_memory(self) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys, self._values.pin_memory(), self._lengths.pin_memory(),
            None if self._weights is None else self._weights.pin_memory(), self._stride,
        )

    def to_torchrec(self) -> Any:
        """The same data as ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor``."""
        try:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT
        except ImportError as e:
            raise ImportError("to_torchrec() needs torchrec installed (pip install torchrec)") from e
        return TorchrecKJT(keys=self._keys, values=self._values, lengths=self._lengths,
                           weights=self._weights, stride=self._stride)

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, values={self._values.numel()})"


@dataclass
class Batch:
    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: Optional[torch.Tensor] = None
    # bool [B]: True for rows repeated only to give every rank the same number of batches
    # (even_batches: pad); None when the batch has none. Mask them out of the loss.
    padding: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def as_padding(self) -> "Batch":
        """The same rows, all marked as padding."""
        return dataclasses.replace(self, padding=torch.ones(len(self), dtype=torch.bool))

    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.passthrough.items()},
            None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
            None if self.padding is None else self.padding.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        return Batch(
            self.dense_features.pin_memory(),
            self.sparse_features.pin_memory(),
            self.labels.pin_memory(),
            {k: v.pin_memory() for k, v in self.passthrough.items()},
            None if self.weights is None else self.weights.pin_memory(),
            None if self.padding is None else self.padding.pin_memory(),
        )

    @classmethod
    def from_numpy(cls, arrays: Mapping[str, Any], sparse_keys: Sequence[str]) -> "Batch":
        """Tensors viewing the arrays' memory (no copy): received frames, or Arrow buffers
        in local mode. They may be read-only; remoteloader never writes them."""
        with warnings.catch_warnings():  # torch warns that it cannot protect a read-only buffer
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
        return cls.from_tensors(tensors, sparse_keys)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], sparse_keys: Sequence[str]) -> "Batch":
        rows = int(tensors["labels"].shape[0])
        kjt = KeyedJaggedTensor(sparse_keys, tensors["sparse.values"], tensors["sparse.lengths"],
                                tensors.get("sparse.weights"), stride=rows)
        passthrough = {k[3:]: v for k, v in tensors.items() if k.startswith("pt.")}
        return cls(tensors["dense"], kjt, tensors["labels"], passthrough, tensors.get("weights"))


def concat_rows(pieces: Sequence[tuple[Batch, int, int]]) -> Batch:
    """Rows ``[start, stop)`` of each batch, in order, as one new batch.

    The per-key loop runs over features x pieces (a few dozen slices), never over rows.
    """
    first = pieces[0][0]
    keys = first.sparse_features.keys()
    scored = first.sparse_features.weights_or_none() is not None
    values, lengths, weights = [], [], []
    for k in range(len(keys)):
        for b, start, stop in pieces:
            kjt = b.sparse_features
            stride = kjt.stride()
            key_lengths = kjt.lengths()[k * stride : (k + 1) * stride]
            base = kjt.offset_per_key()[k]
            lo = base + int(key_lengths[:start].sum())
            hi = lo + int(key_lengths[start:stop].sum())
            lengths.append(key_lengths[start:stop])
            values.append(kjt.values()[lo:hi])
            if scored:
                weights.append(kjt.weights()[lo:hi])
    rows = sum(stop - start for _, start, stop in pieces)
    empty_i64 = first.sparse_features.values()[:0]
    kjt = KeyedJaggedTensor(
        keys,
        torch.cat(values) if values else empty_i64,
        torch.cat(lengths) if lengths else first.sparse_features.lengths()[:0],
        torch.cat(weights) if scored else None,
        stride=rows,
    )

    def rows_of(get):
        return torch.cat([get(b)[start:stop] for b, start, stop in pieces])

    return Batch(
        rows_of(lambda b: b.dense_features),
        kjt,
        rows_of(lambda b: b.labels),
        {name: rows_of(lambda b, n=name: b.passthrough[n]) for name in first.passthrough},
        None if first.weights is None else rows_of(lambda b: b.weights),
        _padding_of(pieces),
    )


def _padding_of(pieces: Sequence[tuple[Batch, int, int]]) -> Optional[torch.Tensor]:
    if all(b.padding is None for b, _, _ in pieces):
        return None
    return torch.cat([b.padding[start:stop] if b.padding is not None else torch.zeros(stop - start, dtype=torch.bool)
                      for b, start, stop in pieces])
