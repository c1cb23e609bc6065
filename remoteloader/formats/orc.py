"""ORC: stripes are the read units.

pyarrow's ORCFile does not expose per-stripe row counts or byte ranges, so the stripe
list of a listing comes from pyorc, which parses only the file tail (one read) and reads
no stripe data. Split reads plan their byte ranges from the file's own layout
(``orc_layout``: tail, stripe footers, streams), fetch them coalesced, and decode through
pyarrow from memory, one ``read_stripe`` per stripe.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.orc as paorc
import pyorc

from . import orc_layout
from .prefetch import PrefetchedFile, fetch_tail, merge_ranges
from .types import TableError, Unit

# One request holds most tails, wide tables' too (a 500-column footer is about 20 KiB), and
# covers the 16 KiB the ORC reader reads first (DIRECTORY_SIZE_GUESS) when it decodes.
TAIL_GUESS = 64 << 10
# Everything a damaged or foreign file can make the libraries raise.
READ_ERRORS = (OSError, ValueError, pa.ArrowException, pyorc.errors.ORCError)


def units(source: pa.NativeFile) -> tuple[int, tuple[Unit, ...]]:
    """(rows, stripes) from the file tail."""
    reader = pyorc.Reader(source)
    stripes = []
    for i in range(reader.num_of_stripes):
        stripe = reader.read_stripe(i)
        stripes.append(Unit(i, stripe.row_offset, len(stripe), stripe.bytes_length))
    return len(reader), tuple(stripes)


class Reader:
    def __init__(self, source: Union[pa.NativeFile, pa.PythonFile]):
        self._file = paorc.ORCFile(source)

    @property
    def schema(self) -> pa.Schema:
        return self._file.schema

    def read(self, first_unit: int, stop_unit: int, columns: Sequence[str]) -> pa.Table:
        batches = [self._file.read_stripe(i, columns=list(columns)) for i in range(first_unit, stop_unit)]
        return pa.Table.from_batches(batches)


def read_tail(file: PrefetchedFile, name: str) -> orc_layout.Tail:
    """The file's layout (``.columns``: top-level column -> column ids), its bytes fetched."""
    return fetch_tail(file, name, TAIL_GUESS, orc_layout.tail_length, orc_layout.parse_tail)


def prefetched_reader(file: PrefetchedFile, tail: orc_layout.Tail, first_unit: int, stop_unit: int,
                      columns: Sequence[str], coalesce_gap: int) -> Reader:
    """Fetch what reading ``columns`` of stripes [first_unit, stop_unit) needs after the
    tail: the stripe footers, then every data stream of the columns' subtrees (and of the
    root struct), each group merged by ``coalesce_gap``; return a reader decoding from it."""
    if stop_unit > len(tail.stripes):
        raise TableError(f"the file has {len(tail.stripes)} stripes (file changed?)")
    stripes = tail.stripes[first_unit:stop_unit]
    footers = [(s.footer_offset, s.footer_offset + s.footer_length) for s in stripes]
    file.fetch(merge_ranges(footers, coalesce_gap))
    file.stats.bytes_needed += sum(s.footer_length for s in stripes)
    ids = np.array(sorted({0}.union(*(tail.columns[c] for c in columns if c in tail.columns))))
    ranges = []
    for stripe, (start, end) in zip(stripes, footers):
        streams = orc_layout.parse_stripe_footer(file.view(start, end), stripe, tail.compression, tail.block_size)
        keep = (np.isin(streams.column, ids) & ~np.isin(streams.kind, orc_layout.INDEX_STREAMS)
                & (streams.length > 0))
        ranges += zip(streams.offset[keep].tolist(), (streams.offset[keep] + streams.length[keep]).tolist())
    file.stats.bytes_needed += sum(end - start for start, end in ranges)
    file.fetch(merge_ranges(ranges, coalesce_gap))
    return Reader(pa.PythonFile(file, mode="r"))
