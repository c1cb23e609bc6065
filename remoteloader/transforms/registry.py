"""Operator lookup by name: built-ins, ``register_op``, then installed entry points.

A spec names an op and its parameters, never code. A user op is installed on the
workers as a package declaring, e.g. in its pyproject.toml::

    [project.entry-points."remoteloader.transforms"]
    my_op = "my_package.ops:MyOp"

The entry point resolves to an ``Op`` instance, or a class instantiated without
arguments. Built-in names cannot be shadowed, so an installed package can never change
what an existing spec means.
"""
from __future__ import annotations

import importlib.metadata
import threading
from typing import Any

from .base import Op, TransformError
from .dense_ops import OPS as _DENSE
from .elementwise_ops import OPS as _ELEMENTWISE
from .pair_ops import OPS as _PAIR
from .sparse_ops import OPS as _SPARSE

ENTRY_POINT_GROUP = "remoteloader.transforms"

BUILTINS: dict[str, Op] = {op.name: op for op in (*_ELEMENTWISE, *_SPARSE, *_DENSE, *_PAIR)}
_registered: dict[str, Op] = {}
_lock = threading.Lock()


def register_op(name: str, op: Any, replace: bool = False) -> Op:
    """Make ``op`` (an ``Op`` instance or class) available under ``name`` in this process."""
    op = _instantiate(name, op)
    with _lock:
        if name in BUILTINS:
            raise ValueError(f"op {name!r} is built in and cannot be replaced")
        if name in _registered and not replace:
            raise ValueError(f"op {name!r} is already registered (pass replace=True to replace it)")
        _registered[name] = op
    return op


def unregister_op(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def get_op(name: str) -> Op:
    """The op called ``name``; raises ``KeyError`` with the known names if there is none."""
    op = BUILTINS.get(name) or _registered.get(name)
    if op is not None:
        return op
    op = _from_entry_point(name)
    if op is None:
        raise KeyError(f"unknown op {name!r} (built in: {', '.join(sorted(BUILTINS))}"
                       + (f"; registered: {', '.join(sorted(_registered))}" if _registered else "") + ")")
    return op


def known_ops() -> list[str]:
    return sorted({*BUILTINS, *_registered})


def _from_entry_point(name: str) -> Op | None:
    # Looked up only for names that are neither built in nor registered, and only at
    # compile time; a found op is cached like a registered one.
    matches = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        return None
    ep = matches[0]
    try:
        obj = ep.load()
    except Exception as e:  # an installed but broken plug-in: say which one
        raise TransformError(f"op {name!r}: loading entry point {ep.value!r} failed: {e}") from e
    op = _instantiate(name, obj)
    with _lock:
        return _registered.setdefault(name, op)


def _instantiate(name: str, obj: Any) -> Op:
    if isinstance(obj, type):
        obj = obj()
    for attr in ("validate", "output_kind", "apply"):
        if not callable(getattr(obj, attr, None)):
            raise TransformError(f"op {name!r}: {obj!r} has no {attr}() method (see remoteloader.transforms.Op)")
    return obj
