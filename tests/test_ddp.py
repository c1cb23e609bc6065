"""A DDP job as torchrun runs it (one process per rank, gloo on loopback): 20,001 rows on 2 ranks
train every step without a hang, checkpoint with torch.distributed.checkpoint mid-epoch, and
the epoch finishes on 3 ranks with every row exactly once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from remoteloader.tools.datagen import generate_table

ROWS = 20_001
ROOT = str(Path(__file__).parent.parent)

SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from remoteloader import RemoteDataLoader, read_rank_states

table, store, ckpt, out, stop_at, resume = sys.argv[1:7]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# A FileStore and gloo on the loopback interface: nothing listens beyond this machine.
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
spec = {"table": {"path": table}, "batch_size": 1000, "shuffle": True, "split_rows": 3000,
        "features": {"label": "label", "dense": ["float_0"], "passthrough": ["row_id"]}}
loader = RemoteDataLoader(spec, num_workers=2, timeout=120)
if resume == "1":
    loader.load_state_dict(read_rank_states(ckpt))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rows, steps = [], 0
for batch in loader:
    keep = torch.ones(len(batch), dtype=torch.bool) if batch.padding is None else ~batch.padding
    err = (model(batch.dense_features).squeeze(1) - batch.labels) ** 2
    loss = (err * keep).sum() / max(int(keep.sum()), 1)
    opt.zero_grad()
    loss.backward()                       # an all-reduce: a rank with a batch less would hang here
    opt.step()
    rows += batch.passthrough["row_id"][keep].tolist()
    steps += 1
    if steps == int(stop_at):
        dcp.save({"dataloader": loader}, checkpoint_id=ckpt)
        break
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rows": rows, "steps": steps, "len": len(loader)}, f)
dist.barrier()  # rank 0 owns the embedded cluster: it must outlive the others' epoch
loader.close()
dist.destroy_process_group()
"""


def run_ranks(script: Path, world: int, args: list[str], timeout: float = 240) -> None:
    """One process per rank as torchrun starts them (RANK, WORLD_SIZE; gloo on loopback); each
    must exit 0 within ``timeout``, and every one is stopped by its pid."""
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "PYTHONPATH": ROOT,
               "GLOO_SOCKET_IFNAME": "lo"}
        env.pop("REMOTELOADER_MASTER", None)
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=ROOT))
    try:
        assert [p.wait(timeout=timeout) for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_script_job(tmp_path: Path, script_text: str, table: Path, world: int, name: str, stop_at: int,
                   resume: bool, *extra: str) -> list[dict]:
    """A job of ``world`` ranks running ``script_text`` (argv: table, store, checkpoint, out dir,
    stop_at, resume, then ``extra``); each rank's ``rank<r>.json``."""
    script, out = tmp_path / f"{name}.py", tmp_path / name  # one per job: jobs may run side by side
    script.write_text(script_text)
    out.mkdir()
    run_ranks(script, world, [str(table), str(tmp_path / f"{name}.store"), str(tmp_path / "ckpt"), str(out),
                              str(stop_at), "1" if resume else "0", *extra])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def run_job(tmp_path: Path, table: Path, world: int, stop_at: int, resume: bool, name: str) -> list[dict]:
    return run_script_job(tmp_path, SCRIPT, table, world, name, stop_at, resume)


@pytest.mark.slow
def test_ddp_job_checkpoints_with_dcp_and_finishes_the_epoch_on_three_ranks(tmp_path):
    table = tmp_path / "table"
    generate_table(str(table), rows=ROWS, partitions=2, dense=2, sparse=1, format="parquet", seed=3,
                   row_group_rows=1000, files_per_partition=2, progress=False)
    first = run_job(tmp_path, table, world=2, stop_at=4, resume=False, name="job1")
    assert [o["len"] for o in first] == [11, 11]             # 20,001 rows: 10,001 + 10,000 and one padded row
    assert [o["steps"] for o in first] == [4, 4]
    second = run_job(tmp_path, table, world=3, stop_at=0, resume=True, name="job2")
    steps = {o["steps"] for o in second}
    assert len(steps) == 1                                     # 12,001 rows left: the same count on each rank
    rows = Counter(r for o in first + second for r in o["rows"])
    assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1


LIFECYCLE_SCRIPT = """
import json, logging, os, sys, time
import torch.distributed as dist
from remoteloader import RemoteDataLoader

table, store, out = sys.argv[1:4]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
logging.basicConfig(level=logging.WARNING)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
spec = {"table": {"path": table}, "batch_size": 500, "split_rows": 1000,
        "features": {"label": "label", "dense": ["float_0"], "passthrough": ["row_id"]}}
loader = RemoteDataLoader(spec, num_workers=2, timeout=60)
rows, steps = [], 0
for batch in loader:
    rows += batch.passthrough["row_id"].tolist()
    steps += 1
    if rank == 1 and steps == len(loader):
        time.sleep(1.5)  # still in the epoch (its end handshake is next) while rank 0 closes
loader.close()  # rank 0: stops the embedded master, but only once rank 1's loader has closed too
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rows": rows, "steps": steps}, f)
dist.barrier()  # rank 0's next collective: the one a stranded rank 1 would never reach
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_rank_zero_closing_first_never_strands_a_rank_still_ending_its_epoch(tmp_path):
    table = tmp_path / "table"
    generate_table(str(table), rows=4000, partitions=1, dense=1, sparse=1, format="parquet", seed=5,
                   row_group_rows=1000, files_per_partition=2, progress=False)
    script, out = tmp_path / "rank.py", tmp_path / "out"
    script.write_text(LIFECYCLE_SCRIPT)
    out.mkdir()
    # Far below the loaders' timeout (60 s) and the owner's close bound (60 s): a rank waiting
    # on either would fail this wait, not pass slowly.
    run_ranks(script, 2, [str(table), str(tmp_path / "store"), str(out)], timeout=45)
    outs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert outs[0]["steps"] == outs[1]["steps"]
    rows = Counter(r for o in outs for r in o["rows"])
    assert sorted(rows) == list(range(4000)) and max(rows.values()) == 1
