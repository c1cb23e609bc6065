"""EpochAssembler: exactly-once batches from pieces arriving in any order, with duplicates."""
from __future__ import annotations

import random

import torch

from remoteloader.client.assembly import EpochAssembler
from remoteloader.client.batch import Batch, KeyedJaggedTensor
from remoteloader.core.plan import pieces_of
from tests.assembly_helpers import run


def make_batch(row_ids):
    n = len(row_ids)
    ids = torch.tensor(row_ids, dtype=torch.int64)
    lengths = (ids % 3).to(torch.int32)
    # output_size: without it, torch counts the values in a parallel region that costs
    # milliseconds per call on two busy cores (seconds over these tests' 2,000 batches).
    values = torch.repeat_interleave(ids, lengths.long(), output_size=int(lengths.sum()))
    kjt = KeyedJaggedTensor(["a"], values, lengths, stride=n)
    return Batch(ids.float().unsqueeze(1), kjt, torch.zeros(n), {"row_id": ids})


def pieces_for(split_rows, batch_size):
    """(split_id, piece, Batch) for splits of the given sizes; row ids are globally unique."""
    out, first = [], 0
    for sid, rows in enumerate(split_rows):
        for p in range(pieces_of(rows, batch_size)):
            lo, hi = p * batch_size, min(rows, (p + 1) * batch_size)
            out.append((sid, p, make_batch(list(range(first + lo, first + hi)))))
        first += rows
    return out


def check_rows(batches, total, batch_size, drop_last=False):
    rows = [int(x) for b in batches for x in b.passthrough["row_id"]]
    assert len(rows) == len(set(rows))
    if drop_last:
        assert len(rows) == total // batch_size * batch_size
    else:
        assert sorted(rows) == list(range(total))
    assert all(len(b) == batch_size for b in batches[:-1])
    for b in batches:  # sparse rows stay aligned with their row ids after merging
        assert b.sparse_features["a"].lengths().tolist() == [x % 3 for x in b.passthrough["row_id"].tolist()]


def test_random_order_with_duplicates_yields_each_row_once():
    rng = random.Random(1)
    for trial in range(30):
        bs = rng.randint(1, 40)
        split_rows = [rng.randint(1, 120) for _ in range(rng.randint(1, 8))]
        arrivals = pieces_for(split_rows, bs)
        # Per split, pieces come in order, but splits interleave; some pieces come twice
        # (a re-processed split) and must be ignored.
        per_split = {}
        for a in arrivals:
            per_split.setdefault(a[0], []).append(a)
        stream = []
        queues = {k: list(v) + (list(v[: rng.randint(0, len(v))]) if rng.random() < 0.5 else []) for k, v in per_split.items()}
        while queues:
            k = rng.choice(list(queues))
            stream.append(queues[k].pop(0))
            if not queues[k]:
                del queues[k]
        asm = EpochAssembler(list(enumerate(split_rows)), bs, drop_last=trial % 3 == 0)
        batches = run(asm, stream)
        check_rows(batches, sum(split_rows), bs, drop_last=trial % 3 == 0)
        assert asm.exhausted


def test_resume_from_consumed_state_delivers_the_rest_exactly():
    rng = random.Random(2)
    for _ in range(30):
        bs = rng.randint(2, 30)
        split_rows = [rng.randint(1, 90) for _ in range(rng.randint(1, 6))]
        arrivals = pieces_for(split_rows, bs)
        rng.shuffle(arrivals)
        arrivals.sort(key=lambda a: a[1])  # keep per-split order
        asm = EpochAssembler(list(enumerate(split_rows)), bs, drop_last=False)
        first, stop_after = [], rng.randint(0, len(arrivals))
        for sid, p, b in arrivals[:stop_after]:
            asm.add(sid, p, b)
            while (r := asm.next_ready()) is not None:
                asm.consume(r)
                first.append(r.batch)
        state = asm.consumed_state()  # held-back tails are not consumed: they come again
        resumed = EpochAssembler(list(enumerate(split_rows)), bs, drop_last=False, consumed=state)
        second = run(resumed, arrivals)
        check_rows(first + second, sum(split_rows), bs)


def test_acks_report_whole_pieces_only():
    asm = EpochAssembler([(0, 25)], 10, drop_last=False)
    for sid, p, b in pieces_for([25], 10):
        asm.add(sid, p, b)
    r = asm.next_ready()
    asm.consume(r)
    assert asm.take_acks() == [[0, 1]]
    assert asm.take_acks() == []
