"""Driving an ``EpochAssembler`` by hand in tests: pieces in a given arrival order, batches out."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional


def run(assembler: Any, arrivals: Iterable, stop_after: Optional[int] = None) -> list:
    """The batches the assembler yields from ``arrivals`` ((split id, piece, batch)), the
    first ``stop_after`` of them if given."""
    out = []
    for sid, p, b in arrivals:
        if assembler.wants(sid, p):
            assembler.add(sid, p, b)
        while (r := assembler.next_ready()) is not None:
            assembler.consume(r)
            out.append(r.batch)
            if len(out) == stop_after:
                return out
    while (r := assembler.next_ready()) is not None:
        assembler.consume(r)
        out.append(r.batch)
    return out


def drain(assembler: Any, arrivals: Iterable, stop_after: Optional[int] = None,
          state: Callable[[Any], Any] = lambda a: a.get_state()) -> tuple[list[list[int]], Any]:
    """Row ids of each batch ``run`` yields, and ``state(assembler)`` after them; unless
    stopped after ``stop_after`` batches, the assembler must then be exhausted."""
    batches = run(assembler, arrivals, stop_after)
    if stop_after is None or len(batches) < stop_after:
        assert assembler.exhausted
    return [b.passthrough["row_id"].tolist() for b in batches], state(assembler)
