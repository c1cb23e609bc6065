"""Loader checkpoints: the rank-keyed state, and merging every rank's part for an elastic resume.

A loader's ``state_dict()`` is ``{"rank_<r>": position}``. A position names the epoch,
the rows consumed before the current job segment (``done``, ``[[base split, lo, hi],
...]``, non-empty only after an elastic resume) and what this rank's training loop has
consumed since, per split: ``[split id, pieces, rows of a partly used tail, base split,
first row, rows consumed, padding]``. Row numbers are those of a base split after its per-epoch
shuffle, which do not depend on the world size: that is what lets a job with another
world size take over the rows nobody consumed.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Union

STATE_VERSION = 2
_KEYS = ("version", "fingerprint", "plan", "rank", "world_size", "epoch", "done", "consumed", "batches_yielded")


def rank_parts(state: Any) -> dict[int, dict]:
    """The per-rank positions in ``state`` (one loader's ``state_dict()``, or several merged)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"not a RemoteDataLoader state: expected a dict, got {type(state).__name__}")
    parts = {}
    for key, part in state.items():
        if not (isinstance(key, str) and key.startswith("rank_") and key[5:].isdigit()):
            raise ValueError(f"not a RemoteDataLoader state: unexpected key {key!r} (expected rank_<n>)")
        parts[int(key[5:])] = part
    if not parts:
        raise ValueError("not a RemoteDataLoader state: no rank_<n> entry")
    for rank, part in parts.items():
        if not isinstance(part, Mapping) or part.get("rank") != rank:
            raise ValueError(f"state rank_{rank} is not that rank's position")
    return parts


def check_part(part: Mapping, fingerprint: str) -> None:
    if part.get("version") != STATE_VERSION:
        raise ValueError(f"state of rank {part.get('rank')}: version {part.get('version')!r}, "
                         f"this remoteloader reads version {STATE_VERSION}")
    missing = [k for k in _KEYS if k not in part]
    if missing:
        raise ValueError(f"state of rank {part['rank']}: missing {missing}")
    if part["fingerprint"] != fingerprint:
        raise ValueError(f"state of rank {part['rank']} is of another dataset spec "
                         f"(fingerprint {part['fingerprint']}, this loader's {fingerprint})")


def common(parts: Mapping[int, Mapping], key: str) -> Any:
    """A value every part must agree on."""
    values = {repr(p[key]) for p in parts.values()}
    if len(values) != 1:
        raise ValueError(f"the ranks' states disagree on {key!r}: {sorted(values)}")
    return next(iter(parts.values()))[key]


def merged_done(parts: Mapping[int, Mapping]) -> list[list[int]]:
    """Every row the old job's ranks consumed in the epoch, as merged ``[base, lo, hi]`` ranges."""
    ranges = [tuple(r) for r in common(parts, "done")]
    for part in parts.values():
        for _, _, _, base, lo, rows, padding in part["consumed"]:
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


def read_rank_states(checkpoint_id: Union[str, os.PathLike], key: str = "dataloader") -> dict:
    """Every rank's loader state from a ``torch.distributed.checkpoint`` directory.

    ``key`` is the loader's key in the saved state dict. For an elastic resume: each
    rank of the new job calls this and hands the result to ``load_state_dict``.
    """
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint_id)).read_metadata()
    prefix = key + "."
    ranks = sorted({name[len(prefix):].split(".", 1)[0] for name in metadata.state_dict_metadata
                    if name.startswith(prefix + "rank_")})
    if not ranks:
        raise ValueError(f"{checkpoint_id}: no loader state under {key!r}")
    template = {key: {rank: _template(metadata, prefix + rank) for rank in ranks}}
    dcp.load(template, checkpoint_id=str(checkpoint_id), no_dist=True)
    return template[key]


def _template(metadata: Any, prefix: str) -> dict:
    """A dict with the saved keys under ``prefix`` (DCP fills the values in)."""
    out: dict = {}
    for name in metadata.state_dict_metadata:
        if name.startswith(prefix + "."):
            node, parts = out, name[len(prefix) + 1:].split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = None
    return out
