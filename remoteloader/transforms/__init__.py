"""Feature transforms: the exact operators of transforms.md as column-wise compiled kernels.

Public API:

* ``compile_features(dense, sparse, schema) -> FeaturePipeline``; ``pipeline.run(columns)
  -> FeatureOutput(dense float32 [rows, width], sparse [SparseColumn])``.
* ``sampling_keep`` / ``validate_sampling``: the table-level row sampling.
* ``Feature``: the builder producing the declarative feature entries.
* ``Op``, ``Kind``, ``register_op``: the extension point (also entry point group
  ``remoteloader.transforms``).
* ``TransformError``: every compile or run error, naming feature, step and parameter.

Module map: ``hashing`` (mix64/combine kernels), ``elementwise_ops``, ``sparse_ops``,
``dense_ops``, ``pair_ops`` (op classes with their kernels), ``registry``, ``pipeline``
(the DAG), ``sampling``, ``builder``, ``base`` (shared interface).
"""
from .base import Kind, KindError, Op, ParamError, TransformError
from .builder import Feature, features_to_dict
from .pipeline import FeatureOutput, FeaturePipeline, compile_features
from .registry import ENTRY_POINT_GROUP, get_op, known_ops, register_op, unregister_op
from .sampling import sampling_keep, validate_sampling

__all__ = [
    "ENTRY_POINT_GROUP", "Feature", "FeatureOutput", "FeaturePipeline", "Kind", "KindError", "Op", "ParamError",
    "TransformError", "compile_features", "features_to_dict", "get_op", "known_ops", "register_op",
    "sampling_keep", "unregister_op", "validate_sampling",
]
