"""Storage co-design tools: feature flattening, popularity-driven feature reordering
(and restriping), over the table layer in ``remoteloader.formats``. See docs/storage.md."""
from .flatten import FlattenReport, flatten_table
from ..core.popularity import load_popularity, record_projection
from .reorder import ReorderReport, column_order, reorder_table

__all__ = ["FlattenReport", "ReorderReport", "column_order", "flatten_table", "load_popularity",
           "record_projection", "reorder_table"]
