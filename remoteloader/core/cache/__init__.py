"""The feature-block cache: transformed (and raw) columns of base splits, shared across
epochs and jobs (docs/cache.md).

``keys`` names a block by content (the split's file identity and rows, the feature's
whole transform closure); ``segments`` is the on-storage format (blocks + an index
footer, each block checksummed or MACed); ``store`` reads and writes segments through
pyarrow filesystems; ``writer`` writes in the background without slowing a split.
"""
