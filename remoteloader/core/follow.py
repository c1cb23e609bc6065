"""Following a growing table: what a re-listing adds, as data (no thread, no clock).

A following job's table grows by *growths*: each re-listing that finds files not listed
before plans them as new base splits, numbered after the job's (files, splits and the
canonical row positions that sampling hashes all continue where the job's end), so the
job's lists only ever grow and every earlier id keeps its meaning. The master journals a
growth whole (``TableGrew``); ``master/follow.py`` runs the re-listing off the master's
loop. Which partitions are read is ``table.follow.until``'s (``in_stream``, ``reaches``).
"""
from __future__ import annotations

__all__ = ["Growth", "in_stream", "plan_growth", "reaches"]

from dataclasses import dataclass, field, replace
from typing import Sequence

from ..formats import DataFile, Relisting, TableError, in_stream, reaches, read_schema, relist
from .binding import BoundDataset, stored_columns
from .plan import BaseSplit, plan_base_splits
from .sampling import sampled_splits


@dataclass
class Growth:
    """Files found by one re-listing, planned as splits that continue the job's lists."""

    first_file: int  # index of files[0] in the job's file list (its length before)
    first_split: int  # id of splits[0] (the job's split count before)
    files: list[DataFile]
    splits: list[BaseSplit]  # ``file`` indexes the job's whole file list
    problems: list[str] = field(default_factory=list)  # files changed, removed, unreadable or of another schema
    ended: bool = False  # ``until`` was reached: nothing after this growth is read


def plan_growth(bound: BoundDataset, known: Sequence[DataFile], splits: Sequence[BaseSplit], split_rows: int,
                reported: set[str]) -> tuple[Growth, Relisting]:
    """List the table again and plan what is new, against the job's ``known`` files and
    ``splits``. ``reported``: problems told before (each is told once; this adds to it).
    A new file whose read columns differ from the job's schema is left out and reported,
    as binding leaves one out (``on_error: skip``) or refuses it (``fail``)."""
    spec = bound.spec
    until = spec.table.follow["until"]
    listing = relist(spec.table.path, known[0].format, spec.table.partitions, {f.path: f for f in known},
                     keep=lambda partition: in_stream(partition, until))
    problems = listing.changed + listing.removed + [f"{u} (not read)" for u in listing.skipped.unreadable]
    columns = stored_columns(bound)
    files = []
    for f in listing.new:
        try:
            schema = read_schema(f)
        except TableError as e:
            problems.append(f"{f.path}: {e} (not read)")
            continue
        bad = next((c for c in columns if schema.get(c) != bound.schema[c]), None)
        if bad is None:
            files.append(f)
        else:
            problems.append(f"{f.path}: column {bad!r} is {schema.get(bad, 'missing')}, {bound.schema[bad]} in the "
                            "rest of the table (not read)")
    fresh = [p for p in problems if p not in reported]
    reported.update(fresh)
    # Positions continue the job's before sampling, which hashes them (as a worker will).
    position = max((s.position + s.raw_rows for s in splits), default=0)
    planned = [replace(s, position=position + s.position) for s in plan_base_splits(files, split_rows)]
    shifted = [replace(s, id=len(splits) + i, file=len(known) + s.file)
               for i, s in enumerate(sampled_splits(bound, files, planned))]
    ended = any(reaches(f.partition, until) for f in (*known, *files))
    return Growth(len(known), len(splits), files, shifted, fresh, ended), listing
