"""What the policy sees and says: heartbeat signals in, decisions out.

``Observation`` is one control tick's view of the workers and trainers; a ``Policy``
answers it with a ``Decision`` (or None). Plain frozen data, so the simulator can
build them as cheaply as the master does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


@dataclass(frozen=True, slots=True)
class WorkerSignal:
    worker_id: str
    rows_per_s: float      # rows produced per second over the last window
    buffered: int          # batches waiting in its bounded buffer
    capacity: int          # buffer capacity in batches
    cpu: float             # 0..1 utilization of its process (noisy, may exceed 1 slightly)
    # Share of wall time it spent producing (reading, transforming, cutting) over the last
    # window, 0..1: the rest it waited for room, credit or a split. rows_per_s / busy is
    # its flat-out rate. None: not reported (the buffer fill stands in).
    busy: Optional[float] = None


@dataclass(frozen=True, slots=True)
class ClientSignal:
    client_id: str
    stall_fraction: float  # share of wall time blocked waiting for a batch over the window, 0..1
    batches_per_s: float   # consumption rate
    # Share of wall time blocked while no worker of its partition held a batch for it (a
    # part of stall_fraction: the part more workers would shorten). None: not reported.
    starved_fraction: Optional[float] = None
    # Rows consumed per second (what the trainer took, whatever its credit window holds).
    # None: not reported (consumption is then inferred from worker rows and buffers).
    rows_per_s: Optional[float] = None


@dataclass(frozen=True, slots=True)
class Observation:
    time: float                        # seconds, monotonic (simulated time in the simulator)
    workers: tuple[WorkerSignal, ...]  # workers that report
    clients: tuple[ClientSignal, ...]
    pending_workers: int = 0           # launched but not reporting yet


@dataclass(frozen=True)
class Decision:
    time: float
    action: str            # "add" | "remove" | "hold"
    count: int             # workers to add or remove (0 for hold)
    workers: int           # worker count targeted after this decision
    reason: str            # human-readable, with the numbers that triggered it
    remove: tuple[str, ...] = ()   # ids to drain for "remove", least useful first


class Policy(Protocol):
    decisions: list[Decision]

    def observe(self, observation: Observation) -> Optional[Decision]: ...
