"""The table layer: list a Hive-partitioned ORC/Parquet table into files and read units
(stripes / row groups), and read one split with only the projected columns straight into
the worker's columns.

Modules: ``types`` (DataFile, Unit, TableError, IOStats), ``fs`` (paths and URIs),
``slowfs`` (simulated slow storage), ``table`` (listing, footers, schema), ``split``
(reading a unit range), ``prefetch`` (coalesced reads), ``orc_layout`` (ORC byte layout),
``maps`` (features inside map columns), ``convert`` (Arrow to columns), ``orc`` /
``parquet`` (format specifics), ``writer`` (writing files). See docs/storage.md.
"""
from .convert import arrow_to_column, column_kind
from .fs import open_filesystem
from .maps import flat_name, virtual_column_kind
from .prefetch import DEFAULT_COALESCE_GAP, clear_tail_cache
from .slowfs import PROFILES, SLOW_IO
from .split import read_split, read_units
from .table import Relisting, Skipped, in_stream, list_table, reaches, read_schema, relist, table_schema
from .types import DataFile, IOStats, TableError, Unit

__all__ = [
    "DEFAULT_COALESCE_GAP",
    "PROFILES",
    "SLOW_IO",
    "DataFile",
    "IOStats",
    "TableError",
    "Unit",
    "arrow_to_column",
    "clear_tail_cache",
    "column_kind",
    "flat_name",
    "Relisting",
    "Skipped",
    "in_stream",
    "list_table",
    "reaches",
    "relist",
    "open_filesystem",
    "read_schema",
    "read_split",
    "read_units",
    "table_schema",
    "virtual_column_kind",
]
