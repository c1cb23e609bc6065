"""The table layer: list a Hive-partitioned ORC/Parquet table into files and read units
(stripes / row groups), and read one split with only the projected columns straight into
the worker's columns.

Modules: ``types`` (DataFile, Unit, TableError), ``fs`` (paths and URIs), ``table``
(listing, footers, schema), ``split`` (reading a unit range), ``convert`` (Arrow to
columns), ``orc`` / ``parquet`` (format specifics).
"""
from .convert import arrow_to_column, column_kind
from .fs import open_filesystem
from .split import read_split
from .table import list_table, read_schema, table_schema
from .types import DataFile, TableError, Unit

__all__ = [
    "DataFile",
    "TableError",
    "Unit",
    "arrow_to_column",
    "column_kind",
    "list_table",
    "open_filesystem",
    "read_schema",
    "read_split",
    "table_schema",
]
