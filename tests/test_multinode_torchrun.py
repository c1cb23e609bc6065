"""torchrun across nodes on the embedded default, each node a network namespace of its own
(``tests/hostnet.py``): 2 nodes x 2 ranks with no key directory, no standing master and no
environment beyond torchrun's own read every row once, save a DCP checkpoint mid-epoch, and a
job on 1 node loads it and finishes the epoch, every row exactly once across both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from remoteloader.tools.datagen import generate_table
from tests.hostnet import Host

ROOT = str(Path(__file__).parent.parent)
ROWS = 4_001
PORT = "29500"  # torchrun's rendezvous, free in namespaces made for this test
JOB_S = 150  # one job's bound (it takes a fraction of it)

SCRIPT = """
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from remoteloader import RemoteDataLoader
from remoteloader.protocol.messages import Status

table, ckpt, out, stop_at, resume = sys.argv[1:6]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
spec = {"table": {"path": table}, "batch_size": 100, "shuffle": True, "split_rows": 500,
        "features": {"label": "label", "dense": ["float_0"], "passthrough": ["row_id"]}}
loader = RemoteDataLoader(spec, num_workers=2, timeout=60)
if resume == "1":
    dcp.load({"loader": loader}, checkpoint_id=ckpt)
rows, steps = [], 0
for batch in loader:
    keep = torch.ones(len(batch), dtype=torch.bool) if batch.padding is None else ~batch.padding
    rows += batch.passthrough["row_id"][keep].tolist()
    steps += 1
    dist.all_reduce(torch.zeros(1))       # a rank with a batch less than the others would hang here
    if steps == int(stop_at):
        dcp.save({"loader": loader}, checkpoint_id=ckpt)
        break
record = {"rows": rows, "steps": steps, "master": loader.master,
          "keys": sorted(n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("rl-job-keys-"))}
if rank == 0:  # who the master serves, once every node's workers have registered (the others wait below)
    deadline = time.monotonic() + 30
    while True:
        status = loader.session.rpc.call(Status()).status
        if len(status["workers"]) >= 2 * int(os.environ["GROUP_WORLD_SIZE"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    record["workers"] = [[w.get("node", ""), w["addr"]] for w in status["workers"]]
    record["clients"] = {c["rank"]: c.get("node", "") for c in status["clients"]}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
dist.barrier()
loader.close()
dist.destroy_process_group()
"""


def interface_of(host: Host) -> str:
    """The network interface holding the host's address (gloo is told to use it)."""
    listing = host.run(["ip", "-o", "-4", "addr", "show"], timeout=10, capture_output=True, text=True).stdout
    return next(line.split()[1] for line in listing.splitlines() if f" {host.addr}/" in line)


def torchrun(hosts: list[Host], script: Path, tmp: Path, name: str, stop_at: int, resume: bool) -> list[dict]:
    """One torchrun agent per host (node rank = its place in ``hosts``), 2 ranks each, meeting
    at the first host; every rank's record. Nothing but torchrun's own variables reaches them."""
    out, temp = tmp / name, tmp / f"{name}-tmp"
    out.mkdir()
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    env.update(PYTHONPATH=ROOT, TMPDIR=str(temp), REMOTELOADER_EMBEDDED_LOG=str(tmp / "logs"))
    procs = []
    for k, host in enumerate(hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--node-rank", str(k),
                "--master-addr", hosts[0].addr, "--master-port", PORT, "--nproc-per-node", "2", str(script),
                str(tmp / "table"), str(tmp / "ckpt"), str(out), str(stop_at), "1" if resume else "0"]
        log = open(tmp / f"{name}-node{k}.log", "w")
        procs.append(host.popen(argv, env={**env, "GLOO_SOCKET_IFNAME": interface_of(host)}, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT))
        log.close()
    try:
        codes = [p.wait(timeout=JOB_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "".join((tmp / f"{name}-node{k}.log").read_text()[-3000:] for k in range(len(hosts)))
    assert codes == [0] * len(hosts), logs
    assert not [n for n in os.listdir(temp) if n.startswith("rl-job-keys-")]  # every rank removed its key copy
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 * len(hosts))]


def test_torchrun_on_two_nodes_reads_every_row_once_and_its_checkpoint_loads_on_one(tmp_path, hostnet):
    """``hostnet`` (conftest.py) skips, saying why, where namespaces cannot be made; it marks the test slow."""
    generate_table(str(tmp_path / "table"), rows=ROWS, partitions=2, dense=1, sparse=1, format="parquet", seed=5,
                   row_group_rows=500, files_per_partition=2, progress=False)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    h1, h2 = hostnet(2).hosts.values()
    first = torchrun([h1, h2], script, tmp_path, "two-nodes", stop_at=3, resume=False)
    # rank 0's master on TCP at node 0's address, keyed: each rank held its own copy of the job's keys
    assert {r["master"].rsplit(":", 1)[0] for r in first} == {f"tcp://{h1.addr}"}
    assert len(first[0]["keys"]) == 4
    # each node's workers registered from that node's address, named for it; each rank declared its node
    assert sorted((node, addr.rsplit(":", 1)[0]) for node, addr in first[0]["workers"]) == \
        [("node-0", f"tcp://{h1.addr}")] * 2 + [("node-1", f"tcp://{h2.addr}")] * 2
    assert first[0]["clients"] == {"0": "node-0", "1": "node-0", "2": "node-1", "3": "node-1"}
    assert [r["steps"] for r in first] == [3] * 4
    rest = torchrun([h1], script, tmp_path, "one-node", stop_at=0, resume=True)
    assert all(r["master"].startswith("ipc://") and not r["keys"] for r in rest)  # one node: ipc, no keys
    assert rest[0]["steps"] == rest[1]["steps"]
    rows = Counter(row for r in first + rest for row in r["rows"])
    assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1
