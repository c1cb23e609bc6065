"""Checkpoints that follow the job: a DDP job as torchrun runs it (one process per rank, gloo on
loopback) saves model and loader with ``dcp.save({"model": m, "loader": loader})`` mid-epoch on
2 ranks, and ``dcp.load`` of the same dict, with no other code, finishes the epoch on 3 ranks and
on 1 rank (with another batch size): every row exactly once, the same batch count on every rank."""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from remoteloader import read_rank_states
from remoteloader.tools.datagen import generate_table
from tests.test_ddp import run_script_job

ROWS = 6_001

SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from remoteloader import RemoteDataLoader

table, store, ckpt, out, stop_at, resume, batch_size = sys.argv[1:8]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
spec = {"table": {"path": table}, "batch_size": int(batch_size), "shuffle": True, "split_rows": 1000,
        "features": {"label": "label", "dense": ["float_0"], "passthrough": ["row_id"]}}
loader = RemoteDataLoader(spec, num_workers=2, timeout=120)
torch.manual_seed(0)                      # both jobs start from the same weights: the load must replace them
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
if resume == "1":
    dcp.load({"model": model, "loader": loader}, checkpoint_id=ckpt)   # the natural pattern, nothing else
weight = model.module.weight.item()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rows, steps = [], 0
for batch in loader:
    keep = torch.ones(len(batch), dtype=torch.bool) if batch.padding is None else ~batch.padding
    loss = (((model(batch.dense_features).squeeze(1) - batch.labels) ** 2) * keep).sum() / max(int(keep.sum()), 1)
    opt.zero_grad()
    loss.backward()                       # an all-reduce: a rank with a batch less would hang here
    opt.step()
    rows += batch.passthrough["row_id"][keep].tolist()
    steps += 1
    if steps == int(stop_at):
        weight = model.module.weight.item()
        dcp.save({"model": model, "loader": loader}, checkpoint_id=ckpt)
        break
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rows": rows, "steps": steps, "weight": weight}, f)
dist.barrier()  # rank 0 owns the embedded cluster: it must outlive the others' epoch
loader.close()
dist.destroy_process_group()
"""


def run_job(tmp_path: Path, table: Path, world: int, name: str, stop_at: int = 0, resume: bool = True,
            batch_size: int = 250) -> list[dict]:
    return run_script_job(tmp_path, SCRIPT, table, world, name, stop_at, resume, str(batch_size))


@pytest.mark.slow
def test_dcp_of_model_and_loader_resumes_exactly_once_on_three_ranks_and_on_one(tmp_path):
    table = tmp_path / "table"
    generate_table(str(table), rows=ROWS, partitions=2, dense=1, sparse=1, format="parquet", seed=5,
                   row_group_rows=500, files_per_partition=2, progress=False)
    first = run_job(tmp_path, table, world=2, name="save", stop_at=3, resume=False)
    assert [o["steps"] for o in first] == [3, 3]
    consumed = Counter(r for o in first for r in o["rows"])
    # One world-size-free position, saved once: the rows both ranks consumed, no key per rank.
    position = read_rank_states(tmp_path / "ckpt", key="loader")
    assert position["epoch"] == 0 and not any(k.startswith("rank_") for k in position)
    assert sum(hi - lo for _, lo, hi in position["done"]) == len(consumed) == 3 * 2 * 250
    # The two resumes are independent jobs (each its own ranks, store and embedded cluster; the
    # checkpoint is only read): they run side by side, each checked on its own.
    resumes = ((3, 250), (1, 400))
    with ThreadPoolExecutor(len(resumes)) as pool:
        rests = list(pool.map(lambda w: run_job(tmp_path, table, world=w[0], name=f"load{w[0]}", batch_size=w[1]),
                              resumes))
    for rest in rests:
        assert len({o["steps"] for o in rest}) == 1                     # equal batch counts on the new ranks
        assert {o["weight"] for o in rest} == {first[0]["weight"]}      # the model came back too
        rows = consumed + Counter(r for o in rest for r in o["rows"])
        assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1
