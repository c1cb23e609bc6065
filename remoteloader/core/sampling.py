"""Row counts after table-level sampling, computed once per job when it is planned.

Sampling keeps a row by a hash of its canonical position (and, with ``label_value``,
its label), so the kept count of every split is known before any worker runs: ``len()``
is exact and the plan can cut ranks on sampled rows. Only the label column is read,
and only when ``label_value`` needs it.
"""
from __future__ import annotations

from typing import Sequence

from ..formats import DEFAULT_COALESCE_GAP, DataFile
from ..transforms import validate_sampling
from .binding import BoundDataset
from .plan import BaseSplit, plan_base_splits, with_sampled_rows
from .processor import read_checked, sampling_mask


def sampled_splits(bound: BoundDataset, files: Sequence[DataFile], splits: Sequence[BaseSplit],
                   coalesce_gap: int = DEFAULT_COALESCE_GAP) -> list[BaseSplit]:
    """``splits`` with the rows that sampling keeps; unchanged when the spec does not sample."""
    spec = bound.spec
    if spec.sampling is None:
        return list(splits)
    sampling = validate_sampling(spec.sampling)
    kept = []
    for s in splits:
        f = files[s.file]
        columns = {}
        if sampling["label_value"] is not None:
            # A mixed table's label may have another name there (tables[i].columns).
            stored = spec.tables[bound.file_tables[s.file]].stored(spec.label) if spec.tables else spec.label
            read = read_checked(f, s.first_unit, s.stop_unit, [stored], s.raw_rows,
                                f"split {s.id} ({f.path}, units {s.first_unit}..{s.stop_unit - 1})", coalesce_gap)
            columns = {spec.label: read[stored]}
        kept.append(int(sampling_mask(sampling, spec.label, columns, s.position, s.raw_rows)[0].sum()))
    return with_sampled_rows(splits, kept)


def plan_job_splits(bound: BoundDataset) -> list[BaseSplit]:
    """A bound job's base splits, with their row counts after sampling."""
    files = bound.files or []
    return sampled_splits(bound, files, plan_base_splits(files, bound.spec.split_rows))
