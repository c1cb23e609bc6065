"""Fair share of the workers between a master's jobs: which job's split a worker gets next.

Stride scheduling over jobs: each job has a pass, the rows of the splits handed out to it
over its weight; a worker is offered the jobs in the order of their passes (lowest first),
so while every job has work, each gets rows in proportion to its weight, and a job with
nothing to hand out (all its splits in flight, or its ranks' buffers full: its trainers'
demand is met) leaves its turn to the others without banking it. Rows handed out are what
trainers consume, up to what the workers buffer (credit).

A priority class scales the weight by ``PRIORITY_FACTOR`` per class: a high-priority job
gets 8 rows for each of a normal job of the same weight while both want more, so its
demand is met first unless it wants nearly the whole fleet; a low-priority job always gets
some (never starved to zero). The order is a scheduling decision, not state: it is not
journaled, and a restarted master starts every job even.
"""
from __future__ import annotations

from typing import Sequence

PRIORITY_FACTOR = 8.0
PRIORITY_CLASSES = {"low": -1, "normal": 0, "high": 1}


def effective_weight(weight: float, priority: str) -> float:
    """A job's weight with its priority class applied."""
    return weight * PRIORITY_FACTOR ** PRIORITY_CLASSES[priority]


class JobShares:
    def __init__(self) -> None:
        self._pass: dict[str, float] = {}
        self._weight: dict[str, float] = {}  # as the last order() was given them
        # The pass of the job served last: every job with work had at least this pass then,
        # so a job below it had nothing to hand out, and is not owed the turns it left.
        self._virtual = 0.0

    def order(self, weights: dict[str, float]) -> list[str]:
        """The jobs of ``weights`` (job -> effective weight) in the order a worker is offered
        them: lowest pass first (ties: as listed, the oldest job first). A new job, or one
        that had nothing to hand out, starts from the pass served last, so it neither waits
        for the others nor takes the workers until it has caught up on turns it could not use."""
        for job, weight in weights.items():
            self._weight[job] = weight
            self._pass[job] = max(self._pass.get(job, 0.0), self._virtual)
        return sorted(weights, key=self._pass.__getitem__)

    def served(self, job: str, rows: int, behind: Sequence[str] = ()) -> None:
        """A split of ``rows`` rows was handed out to ``job``, ahead of the jobs ``behind``,
        which had work but were passed over for a moment (their next split left to another
        worker, master/shared_work.py): they keep their turns."""
        start = self._pass.get(job, self._virtual)
        self._virtual = min([start] + [self._pass[j] for j in behind if j in self._pass])
        self._pass[job] = start + rows / self._weight.get(job, 1.0)

    def forget(self, job: str) -> None:
        self._pass.pop(job, None)
        self._weight.pop(job, None)
