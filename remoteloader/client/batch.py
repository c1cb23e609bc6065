"""What the training loop receives: a torchrec-shaped ``Batch``.

``Batch.dense_features`` is float32 ``[B, D]``, ``Batch.sparse_features`` a
``KeyedJaggedTensor`` (key-major like torchrec's: all rows of key 0, then key 1, ...),
``Batch.labels`` float32 ``[B]``, ``Batch.passthrough`` a dict of raw columns, and
``Batch.weights`` the per-row sampling weights when the spec asks for them.

The same flat tensors travel on the wire (see ``wire.py``), so building a ``Batch``
from received frames is a handful of zero-copy views.

``Batch.to_torchrec()`` gives what torchrec's models and train pipelines take: a
``TorchrecBatch`` whose ``sparse_features`` is a ``torchrec`` KJT of the id-list
features (no weights) and ``id_score_list_features`` a weighted KJT of the id-score
features. Both batch classes are torchrec ``Pipelineable`` (``to``, ``record_stream``,
``pin_memory``): registered with that ABC at import when torchrec is already loaded, else
by the first ``to_torchrec()`` (remoteloader never imports torchrec by itself).
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from .. import jagged


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
    ``scored`` (one flag per key, when known) says which keys are id-score features.
    """

    def __init__(self, keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: Optional[torch.Tensor] = None, stride: Optional[int] = None,
                 scored: Optional[Sequence[bool]] = None) -> None:
        self._keys = list(keys)
        self._values = values
        self._lengths = lengths
        self._weights = weights
        if stride is None:
            stride = lengths.numel() // len(self._keys) if self._keys else 0
        self._stride = int(stride)
        self._length_per_key: Optional[list[int]] = None
        if scored is not None and len(scored) != len(self._keys):
            raise ValueError(f"{len(scored)} scored flags for {len(self._keys)} sparse keys")
        self._scored: Optional[list[bool]] = None if scored is None else [bool(x) for x in scored]
        self._numpy: Optional[jagged.Jagged] = None  # _jagged(), once asked for

    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def scored_keys(self) -> Optional[list[str]]:
        """The id-score (scored) keys, when the batch was built knowing them; else ``None``."""
        return None if self._scored is None else [k for k, s in zip(self._keys, self._scored) if s]

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
        lengths, values = jagged.key_ranges(k, self._stride, self.offset_per_key())
        return JaggedTensor(self._values[values], self._lengths[lengths],
                            None if self._weights is None else self._weights[values])

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def to(self, device: Any, non_blocking: bool = False) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            None if self._weights is None else self._weights.to(device, non_blocking=non_blocking),
            self._stride,
            self._scored,
        )

    def pin_memory(self) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys, self._values.pin_memory(), self._lengths.pin_memory(),
            None if self._weights is None else self._weights.pin_memory(), self._stride, self._scored,
        )

    def record_stream(self, stream: Any) -> None:
        self._values.record_stream(stream)
        self._lengths.record_stream(stream)
        if self._weights is not None:
            self._weights.record_stream(stream)

    def to_torchrec(self) -> Any:
        """The same data as ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor``, weights
        as they are (1.0 for unscored ids in a mixed batch): ``Batch.to_torchrec()`` splits
        id-list from id-score features."""
        return _torchrec_kjt()(keys=self._keys, values=self._values, lengths=self._lengths,
                               weights=self._weights, stride=self._stride)

    def id_score_mask(self, id_score_keys: Optional[Sequence[str]] = None) -> list[bool]:
        """Per key, whether it is an id-score feature: ``id_score_keys`` when given, else the
        flags the batch was built with, else (older senders) keys whose weights are not all 1.0."""
        if id_score_keys is not None:
            chosen = set(id_score_keys)
            unknown = sorted(chosen - set(self._keys))
            if unknown:
                raise KeyError(f"id_score_keys {unknown} are not sparse features (features: {', '.join(self._keys)})")
            mask = [k in chosen for k in self._keys]
            if any(mask) and self._weights is None:
                raise ValueError(f"id_score_keys {sorted(chosen)}: this batch carries no weights (no scored feature)")
            return mask
        if self._scored is not None:
            return list(self._scored)
        if self._weights is None:
            return [False] * len(self._keys)
        _warn_detected_scores()
        if not self._keys:
            return []
        # output_size: no pass to count the values (a device sync on GPU; on CPU a parallel
        # region, milliseconds per call with busy cores) when their number is known.
        key_of_value = torch.repeat_interleave(
            torch.arange(len(self._keys), device=self._weights.device),
            torch.tensor(self.length_per_key(), device=self._weights.device), output_size=self._weights.numel())
        not_one = torch.zeros(len(self._keys), dtype=torch.int64, device=self._weights.device)
        not_one.index_add_(0, key_of_value, (self._weights != 1.0).to(torch.int64))
        return [bool(x) for x in (not_one > 0).tolist()]

    def _select_torchrec(self, mask: Sequence[bool], weighted: bool) -> Any:
        """The keys where ``mask`` is True as a torchrec KJT: whole key ranges picked by boolean
        indexing over values and lengths (columnar, no loop over rows)."""
        keys = [k for k, m in zip(self._keys, mask) if m]
        length_per_key = [n for n, m in zip(self.length_per_key(), mask) if m]
        if all(mask):
            values, lengths, weights = self._values, self._lengths, self._weights
        else:
            device = self._lengths.device
            pick = torch.tensor(list(mask), dtype=torch.bool, device=device)
            lengths = self._lengths.reshape(len(self._keys), self._stride)[pick].reshape(-1)
            per_value = torch.repeat_interleave(pick, torch.tensor(self.length_per_key(), device=device),
                                                output_size=self._values.numel())
            values = self._values[per_value]
            weights = self._weights[per_value] if weighted and self._weights is not None else None
        if not weighted:
            weights = None
        offset_per_key = [0]
        for n in length_per_key:
            offset_per_key.append(offset_per_key[-1] + n)
        return _torchrec_kjt()(keys=keys, values=values, lengths=lengths, weights=weights, stride=self._stride,
                               length_per_key=length_per_key, offset_per_key=offset_per_key)

    def _jagged(self) -> jagged.Jagged:
        """The same arrays as numpy views (CPU tensors only), made once: a piece of a mixed
        batch is merged from once for each batch it serves, and the views keep its ``ends``."""
        if self._numpy is None:
            self._numpy = jagged.Jagged(len(self._keys), self._stride, self._lengths.numpy(), self._values.numpy(),
                                        None if self._weights is None else self._weights.numpy())
        return self._numpy

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, values={self._values.numel()})"


_readonly_warning_due = True  # until torch has been handed a read-only array once (it warns only once)


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

    def record_stream(self, stream: Any) -> None:
        """torchrec's ``Multistreamable``: mark every tensor as used by ``stream`` (CUDA)."""
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)
        for t in (*self.passthrough.values(), self.weights, self.padding):
            if t is not None:
                t.record_stream(stream)

    def to_torchrec(self, id_score_keys: Optional[Sequence[str]] = None) -> "TorchrecBatch":
        """This batch as torchrec models take it (needs torchrec installed).

        Id-list features go to ``sparse_features`` (a torchrec KJT without weights), id-score
        features to ``id_score_list_features`` (a torchrec KJT with their scores, or ``None``
        when the spec has none): an ``EmbeddingBagCollection`` reads the first, one with
        ``is_weighted=True`` the second. Which keys are id-score comes from the spec's
        compiled pipeline when the batch was built with it, or from ``id_score_keys``.
        Tensors are shared, not copied, when no split is needed.
        """
        _torchrec_kjt()  # a clear ImportError without torchrec; registers the Pipelineable classes
        kjt = self.sparse_features
        mask = kjt.id_score_mask(id_score_keys)
        return TorchrecBatch(
            dense_features=self.dense_features,
            sparse_features=kjt._select_torchrec([not m for m in mask], weighted=False),
            labels=self.labels,
            id_score_list_features=kjt._select_torchrec(mask, weighted=True) if any(mask) else None,
            weights=self.weights,
            padding=self.padding,
            passthrough=dict(self.passthrough),
        )

    @classmethod
    def from_numpy(cls, arrays: Mapping[str, Any], sparse_keys: Sequence[str],
                   sparse_scored: Optional[Sequence[bool]] = None) -> "Batch":
        """Tensors viewing the arrays' memory (no copy): received frames, or Arrow buffers
        in local mode. They may be read-only; remoteloader never writes them."""
        global _readonly_warning_due
        if _readonly_warning_due and not all(a.flags.writeable for a in arrays.values()):
            # torch warns (once per process) that it cannot protect a read-only buffer; entering
            # catch_warnings for every batch would cost more than the batch's own conversion.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
            _readonly_warning_due = False
        else:
            tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
        return cls.from_tensors(tensors, sparse_keys, sparse_scored)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], sparse_keys: Sequence[str],
                     sparse_scored: Optional[Sequence[bool]] = None) -> "Batch":
        """``sparse_scored``: per sparse key, whether it is an id-score feature (the compiled
        pipeline's ``sparse_scored``); ``None`` when the sender did not say."""
        rows = int(tensors["labels"].shape[0])
        kjt = KeyedJaggedTensor(sparse_keys, tensors["sparse.values"], tensors["sparse.lengths"],
                                tensors.get("sparse.weights"), stride=rows, scored=sparse_scored)
        passthrough = {k[3:]: v for k, v in tensors.items() if k.startswith("pt.")}
        return cls(tensors["dense"], kjt, tensors["labels"], passthrough, tensors.get("weights"))


# Where a merge writes: given each output tensor's (shape, dtype), in ``batch_tensors``'
# order, the tensors to fill (new ones by default; a pinned slab's views when staging).
Alloc = Callable[[Sequence[tuple[tuple[int, ...], torch.dtype]]], Sequence[torch.Tensor]]


def concat_rows(pieces: Sequence[tuple[Batch, int, int]], alloc: Optional[Alloc] = None) -> Batch:
    """Rows ``[start, stop)`` of each batch (on the CPU), in order, as one batch, written once
    into the tensors ``alloc`` gives (new ones by default): one ``np.concatenate`` per tensor
    over views of the pieces' rows (a mixed batch takes a slice of each of ``mix_splits``
    pieces for every tensor: the Python per slice, not the bytes, was most of its cost).
    Single-threaded numpy copies: a torch copy would start an intra-op thread team beside the
    training thread's."""
    first = pieces[0][0]
    if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == len(first):
        return _copy_of(first, alloc)  # a whole batch: its tensors as they are, no key ranges to find
    kjt = first.sparse_features
    plan = jagged.plan_concat([(b.sparse_features._jagged(), start, stop) for b, start, stop in pieces])
    rows = plan.total_rows

    def per_row(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        return (rows, *t.shape[1:]), t.dtype

    padded = any(b.padding is not None for b, _, _ in pieces)
    shapes = [per_row(first.dense_features), per_row(first.labels), ((plan.total_values,), kjt._values.dtype),
              ((plan.keys * rows,), kjt._lengths.dtype)]
    if kjt._weights is not None:
        shapes.append(((plan.total_values,), kjt._weights.dtype))
    shapes.extend(per_row(t) for t in first.passthrough.values())
    if first.weights is not None:
        shapes.append(per_row(first.weights))
    if padded:
        shapes.append(((rows,), torch.bool))
    out = alloc(shapes) if alloc is not None else [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    it = iter(out)
    dense, labels, values, lengths = next(it), next(it), next(it), next(it)
    weights = next(it) if kjt._weights is not None else None
    jagged.concat_into(plan, lengths.numpy(), values.numpy(), None if weights is None else weights.numpy())
    _rows_into(dense, [(b.dense_features, start, stop) for b, start, stop in pieces])
    _rows_into(labels, [(b.labels, start, stop) for b, start, stop in pieces])
    passthrough = {}
    for name in first.passthrough:
        passthrough[name] = _rows_into(next(it), [(b.passthrough[name], start, stop) for b, start, stop in pieces])
    row_weights = None
    if first.weights is not None:
        row_weights = _rows_into(next(it), [(b.weights, start, stop) for b, start, stop in pieces])
    padding = None
    if padded:
        padding = _rows_into(next(it), [(_padding_of(b), start, stop) for b, start, stop in pieces])
    merged = KeyedJaggedTensor(kjt.keys(), values, lengths, weights, stride=rows, scored=kjt._scored)
    return Batch(dense, merged, labels, passthrough, row_weights, padding)


def _padding_of(batch: Batch) -> torch.Tensor:
    """Which rows of ``batch`` are padding (none, when it says nothing)."""
    return batch.padding if batch.padding is not None else torch.zeros(len(batch), dtype=torch.bool)


def _copy_of(batch: Batch, alloc: Optional[Alloc]) -> Batch:
    """``batch`` copied into the tensors ``alloc`` gives, one copy per tensor."""
    sources = batch_tensors(batch)
    shapes = [(tuple(t.shape), t.dtype) for t in sources]
    out = alloc(shapes) if alloc is not None else [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    for dst, src in zip(out, sources):
        copy_tensor(dst, src)
    it = iter(out)
    dense, labels, values, lengths = next(it), next(it), next(it), next(it)
    kjt = batch.sparse_features
    weights = next(it) if kjt._weights is not None else None
    passthrough = {name: next(it) for name in batch.passthrough}
    row_weights = next(it) if batch.weights is not None else None
    padding = next(it) if batch.padding is not None else None
    sparse = KeyedJaggedTensor(kjt.keys(), values, lengths, weights, stride=kjt._stride, scored=kjt._scored)
    return Batch(dense, sparse, labels, passthrough, row_weights, padding)


def _rows_into(dst: torch.Tensor, sources: Sequence[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """Rows ``[start, stop)`` of each source, one after another, into ``dst``: one
    ``np.concatenate`` over numpy views."""
    try:
        np.concatenate([src.numpy()[start:stop] for src, start, stop in sources], out=dst.numpy(), casting="no")
    except (TypeError, RuntimeError):  # a dtype numpy lacks
        torch.cat([src[start:stop] for src, start, stop in sources], out=dst)
    return dst


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One copy on this thread only (numpy's, which releases the GIL for large arrays)."""
    try:
        np.copyto(dst.numpy(), src.numpy(), casting="no")
    except (TypeError, RuntimeError):  # a dtype numpy lacks
        dst.copy_(src)


def batch_tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor of ``batch``, in the order ``concat_rows`` allocates them."""
    kjt = batch.sparse_features
    out = [batch.dense_features, batch.labels, kjt._values, kjt._lengths]
    if kjt._weights is not None:
        out.append(kjt._weights)
    out.extend(batch.passthrough.values())
    out.extend(t for t in (batch.weights, batch.padding) if t is not None)
    return out


@dataclass
class TorchrecBatch:
    """A batch for torchrec (``Batch.to_torchrec()``), shaped like ``torchrec.datasets.utils.Batch``
    plus the id-score features: ``sparse_features`` and ``id_score_list_features`` are
    ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor``; the second has the scores as weights
    and is ``None`` when there is no id-score feature. torchrec ``Pipelineable``."""

    dense_features: torch.Tensor
    sparse_features: Any  # torchrec KJT: id-list features, no weights
    labels: torch.Tensor
    id_score_list_features: Optional[Any] = None  # torchrec KJT: id-score features, scores as weights
    weights: Optional[torch.Tensor] = None  # per-row sampling weights (sampling.weight: true)
    padding: Optional[torch.Tensor] = None  # bool [B], rows repeated for even_batches: pad
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _map(self, fn: Any) -> "TorchrecBatch":
        return TorchrecBatch(
            fn(self.dense_features), fn(self.sparse_features), fn(self.labels),
            None if self.id_score_list_features is None else fn(self.id_score_list_features),
            None if self.weights is None else fn(self.weights),
            None if self.padding is None else fn(self.padding),
            {k: fn(v) for k, v in self.passthrough.items()},
        )

    def to(self, device: Any, non_blocking: bool = False) -> "TorchrecBatch":
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def pin_memory(self) -> "TorchrecBatch":
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: Any) -> None:
        for t in (self.dense_features, self.sparse_features, self.labels, self.id_score_list_features,
                  self.weights, self.padding, *self.passthrough.values()):
            if t is not None:
                t.record_stream(stream)


def _torchrec_kjt() -> Any:
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT
    except ImportError as e:
        raise ImportError("to_torchrec() needs torchrec: pip install 'remoteloader[torchrec]' && "
                          "pip install --no-deps torchrec==1.8.0 (the CPU-only set `make install` uses)") from e
    _register_pipelineable()
    return TorchrecKJT


_pipelineable_registered = False


def _register_pipelineable() -> None:
    """Make ``Batch`` and ``TorchrecBatch`` virtual subclasses of torchrec's ``Pipelineable``
    (an ABC), which its train pipelines check with ``isinstance``. Importing remoteloader
    never imports torchrec: this runs from ``to_torchrec()``, or at import if torchrec is loaded."""
    global _pipelineable_registered
    if _pipelineable_registered:
        return
    from torchrec.streamable import Pipelineable
    Pipelineable.register(Batch)
    Pipelineable.register(TorchrecBatch)
    _pipelineable_registered = True


_detection_warned = False


def _warn_detected_scores() -> None:
    global _detection_warned
    if not _detection_warned:
        _detection_warned = True
        warnings.warn("remoteloader: this batch does not say which sparse features are id-score features; "
                      "to_torchrec() takes those whose weights are not all 1.0 (pass id_score_keys= to fix it)",
                      RuntimeWarning, stacklevel=4)


if "torchrec.streamable" in sys.modules:  # torchrec already loaded: register now
    _register_pipelineable()
