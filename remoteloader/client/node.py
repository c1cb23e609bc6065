"""The client's node contract, in the shape of torchdata's ``nodes.BaseNode``.

The client is a chain of small nodes (piece stream -> assembler -> stager -> loader); each
owns its state and no other object reads or writes it. A node yields with ``next()``, says
where it is with ``get_state()`` (small plain data), and ``reset(state)`` puts it back there
(``reset(None)``: at its beginning). ``reset(get_state())`` at any step leaves a node that
continues exactly as the original would have.
"""
from __future__ import annotations

from typing import Any, Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class Node(Generic[T], Iterator[T]):
    def reset(self, state: Optional[dict] = None) -> None:
        """Back to ``state`` (from ``get_state()``), or to the beginning."""
        raise NotImplementedError(type(self))

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError(type(self))

    def next(self) -> T:
        """The next item, or ``StopIteration``."""
        raise NotImplementedError(type(self))

    def __iter__(self) -> "Node[T]":
        return self

    def __next__(self) -> T:
        return self.next()
