"""The client's nodes, each alone, with a save/load round trip at every step (as torchdata tests
its nodes): ``reset(get_state())`` taken after any number of items continues exactly as the
node it was taken from, so the items before the save and after the load are the whole
sequence, each once.

Nodes: the assembler (arrival and deterministic order), the credit window, the loader's
position, the stager (over an in-memory upstream), and the epoch stream (over an
in-process cluster: its reset starts a new run at the master).
"""
from __future__ import annotations

import random

import pytest
import torch

from remoteloader.client import staging
from remoteloader.client.assembly import EpochAssembler, Ready
from remoteloader.client.batch import batch_tensors
from remoteloader.client.credit import CreditWindow
from remoteloader.client.epoch import EpochPlan, EpochRun, SplitPlan
from remoteloader.client.node import Node
from remoteloader.client.position import Position
from remoteloader.client.stream import EpochStream, StreamConfig
from remoteloader.spec import load_spec
from tests.conftest import ROWS, spec_dict
from tests.assembly_helpers import run
from tests.test_assembly import pieces_for
from tests.test_pinning import FakePinning, assert_equal

SPLITS = [13, 4, 9, 16, 7, 1, 11]  # rows per split; batches of 4: whole pieces and tails of every length
BATCH = 4


def drain(assembler: EpochAssembler, arrivals: list, stop_after: int | None = None) -> list[list[int]]:
    """Row ids of each batch the assembler yields from ``arrivals`` (``test_assembly.run``)."""
    return [b.passthrough["row_id"].tolist() for b in run(assembler, arrivals, stop_after)]


def shuffled(pieces: list, seed: int) -> list:
    """Each split's pieces in order, the splits interleaved at random (as several workers send them)."""
    rng = random.Random(seed)
    queues = {}
    for sid, p, b in pieces:
        queues.setdefault(sid, []).append((sid, p, b))
    out = []
    while queues:
        sid = rng.choice(sorted(queues))
        out.append(queues[sid].pop(0))
        if not queues[sid]:
            del queues[sid]
    return out


@pytest.mark.parametrize("cycle", [None, 3])
def test_the_assembler_round_trips_its_state_at_every_step(cycle):
    pieces = pieces_for(SPLITS, BATCH)
    arrivals = shuffled(pieces, seed=5)

    def fresh() -> EpochAssembler:
        return EpochAssembler(list(enumerate(SPLITS)), BATCH, False, cycle=cycle)

    whole = drain(fresh(), arrivals)
    for step in range(len(whole) + 1):
        first = fresh()
        before = drain(first, arrivals, stop_after=step) if step else []
        state = first.get_state()
        again = fresh()
        again.reset(state)
        assert again.get_state() == state
        # The master has every piece from the first one not consumed produced again.
        after = drain(again, shuffled(pieces, seed=step))
        rows = [r for batch in before + after for r in batch]
        assert sorted(rows) == list(range(sum(SPLITS))), f"step {step}: not every row once"
        if cycle is not None:  # deterministic order: the very same sequence
            assert before + after == whole, f"step {step}"
    restarted = fresh()
    drain(restarted, arrivals, stop_after=3)
    restarted.reset(None)  # back to the epoch's start: every piece is expected again
    assert drain(restarted, arrivals) == whole


def test_the_credit_window_round_trips_what_it_learned_at_every_step():
    clock = [0.0]
    events = [("fit", 3), ("arrived", (2, 5000)), ("starved", None), ("queued", 2), ("arrived", (1, 9000)),
              ("tick", 6.0), ("queued", 1), ("starved", None), ("arrived", (4, 20000)), ("tick", 6.0), ("queued", 3)]

    def apply(window: CreditWindow, event) -> None:
        kind, arg = event
        if kind == "fit":
            window.fit(arg)
        elif kind == "arrived":
            window.arrived(*arg)
        elif kind == "starved":
            window.starved()
        elif kind == "queued":
            window.queued(arg)
        else:
            clock[0] += arg

    def fresh() -> CreditWindow:
        return CreditWindow(2, 1 << 20, period_s=5.0, clock=lambda: clock[0])

    for step in range(len(events) + 1):
        clock[0] = 0.0
        original = fresh()
        for event in events[:step]:
            apply(original, event)
        state = original.get_state()
        copy = fresh()
        copy.reset(state)
        assert copy.get_state() == state
        for event in events[step:]:
            apply(original, event)
            apply(copy, event)
            assert copy.get_state() == original.get_state(), f"step {step}: {event}"


def plan_of(epoch: int) -> EpochPlan:
    return EpochPlan(epoch, [], {sid: SplitPlan(rows, base=sid, row_lo=0, padding=False)
                                 for sid, rows in enumerate(SPLITS)})


def test_the_position_round_trips_at_every_step_of_an_epoch():
    spec = load_spec(spec_dict("/nonexistent", batch_size=BATCH))
    pieces = pieces_for(SPLITS, BATCH)
    whole = drain(EpochAssembler(list(enumerate(SPLITS)), BATCH, False), pieces)
    for step in range(len(whole) + 1):
        position = Position(spec, 0, 1)
        position.check_plan("plan-a")
        epoch = position.take_epoch()
        start, resumed = position.begin(epoch)
        assert resumed is None
        run = EpochRun(plan_of(epoch), EpochAssembler(list(enumerate(SPLITS)), BATCH, False))
        position.run = run
        before = drain(run.assembler, pieces, stop_after=step) if step else []
        run.yielded = len(before)
        state = position.get_state()
        loaded = Position(spec, 0, 1)
        loaded.check_plan("plan-a")
        loaded.reset(state)
        assert loaded.get_state() == state  # loaded, not started: saved again as loaded
        start, resumed = loaded.begin(loaded.take_epoch())
        if step == len(whole):  # the epoch is over: the position is the next one's start
            assert state["rank_0"]["epoch"] == start.epoch == epoch + 1 and not resumed.consumed
            continue
        assert state["rank_0"]["epoch"] == epoch and state["rank_0"]["batches_yielded"] == step
        assert start.epoch == epoch and resumed is not None
        consumed = loaded.consumed_at_start(resumed, plan_of(epoch))
        rest = EpochAssembler(list(enumerate(SPLITS)), BATCH, False, consumed=consumed)
        after = drain(rest, pieces)
        rows = [r for batch in before + after for r in batch]
        assert sorted(rows) == list(range(sum(SPLITS))), f"step {step}"
    with pytest.raises(RuntimeError, match="split plan changed"):
        other = Position(spec, 0, 1)
        other.check_plan("plan-b")
        other.reset(state)


class ListStream(Node[Ready]):
    """An in-memory upstream for the stager: an assembler fed a fixed list of pieces, whose
    state is its assembler's (what an epoch stream's is, less the master)."""

    def __init__(self, pieces: list) -> None:
        self.pieces = pieces
        self.assembler = EpochAssembler(list(enumerate(SPLITS)), BATCH, False)

    @property
    def on_ready(self):
        return self.assembler.on_ready

    @on_ready.setter
    def on_ready(self, hook) -> None:
        self.assembler.on_ready = hook

    def reset(self, state=None) -> None:
        self.assembler.reset(state)
        self._todo = [p for p in self.pieces]

    def get_state(self) -> dict:
        return self.assembler.get_state()

    def next(self) -> Ready:
        while (ready := self.assembler.next_ready()) is None:
            if not self._todo:
                raise StopIteration
            sid, p, b = self._todo.pop(0)
            if self.assembler.wants(sid, p):
                self.assembler.add(sid, p, b)
        self.assembler.consume(ready)
        return ready

    def close(self) -> None:
        pass


@pytest.fixture
def fake_pins(monkeypatch):
    monkeypatch.setattr(staging, "alloc_pinned", FakePinning())


def test_the_stager_node_round_trips_its_upstream_s_state_at_every_step(fake_pins):
    pieces = pieces_for(SPLITS, BATCH)
    plain = ListStream(pieces)
    plain.reset()
    reference = [r.batch for r in plain]
    pool = staging.SlabPool(4 << 20)
    for step in range(len(reference) + 1):
        node = staging.StagedBatches(ListStream(pieces), pool, None, timeout=10)
        before = [next(node) for _ in range(step)]
        state = node.get_state()
        node.close()
        again = staging.StagedBatches(ListStream(pieces), pool, None, timeout=10)
        again.reset(state)
        after = list(again)
        again.close()
        assert len(before) + len(after) == len(reference)
        for got, want in zip(before + after, reference):
            assert_equal(got, want)
            assert all(pool.owns(t) for t in batch_tensors(got))
        del before, after


def test_the_epoch_stream_round_trips_through_a_new_run_at_the_master(tables, inprocess):
    cluster = inprocess(workers=2)
    spec = spec_dict(tables["orc"], batch_size=256)
    loader = cluster.loader(spec)
    loader._hello()
    for step in (0, 3, 9):
        start, _ = loader.position.begin(0)
        plan = EpochPlan.of(start, loader.session.start_epoch(start))
        run = EpochRun(plan, EpochAssembler([(sid, s.rows) for sid, s in plan.splits.items()], 256, False))
        config = StreamConfig(0, loader.master, 30.0, None)
        stream = EpochStream(loader._ctx, loader.session, run, config, loader.credit, loader.stats, [])
        before = []
        for _ in range(step):
            ready = next(stream)
            before.append(ready.batch.passthrough["row_id"].clone())
        state = stream.get_state()
        assert state["yielded"] == step
        stream.reset(state)  # a new run of the epoch, from what was consumed
        assert stream.get_state() == state
        after = [ready.batch.passthrough["row_id"].clone() for ready in stream]
        stream.close()
        rows = torch.cat(before + after).tolist()
        assert sorted(rows) == list(range(ROWS)), f"step {step}: not every row once"
    with pytest.raises(ValueError, match="epoch 7"):
        stream.reset({**state, "epoch": 7})
    loader.close()
