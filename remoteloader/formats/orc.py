"""ORC: stripes are the read units.

pyarrow's ORCFile does not expose per-stripe row counts or byte ranges, so the stripe
list comes from pyorc, which parses only the file tail (one read) and reads no stripe
data; decoding goes through pyarrow, one ``read_stripe`` per stripe.
"""
from __future__ import annotations

from typing import Sequence

import pyarrow as pa
import pyarrow.orc as paorc
import pyorc

from .types import Unit

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
    def __init__(self, source: pa.NativeFile):
        self._file = paorc.ORCFile(source)

    @property
    def schema(self) -> pa.Schema:
        return self._file.schema

    def read(self, first_unit: int, stop_unit: int, columns: Sequence[str]) -> pa.Table:
        batches = [self._file.read_stripe(i, columns=list(columns)) for i in range(first_unit, stop_unit)]
        return pa.Table.from_batches(batches)
