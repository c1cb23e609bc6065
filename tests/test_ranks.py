"""Several ranks with no master address: rank 0 starts the embedded cluster, the others
find it through torch.distributed's store (as under torchrun)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROWS

SCRIPT = """
import json, os, sys
import torch.distributed as dist
from remoteloader import RemoteDataLoader
from tests.conftest import spec_dict

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# A FileStore and gloo on the loopback interface: nothing listens beyond this machine.
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], world), rank=rank, world_size=world)
loader = RemoteDataLoader(spec_dict(sys.argv[1]), num_workers=2, timeout=120)
assert (loader.rank, loader.world_size) == (rank, world)
rows, batches = [], 0
for batch in loader:
    rows += batch.passthrough["row_id"].tolist()
    batches += 1
out = {"rows": rows, "len": len(loader), "batches": batches}
dist.barrier()  # rank 0 owns the cluster: it must outlive the others' epoch
loader.close()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_torchrun_style_ranks_share_one_embedded_cluster(tables, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    root = str(Path(__file__).parent.parent)
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": root, "GLOO_SOCKET_IFNAME": "lo"}
        env.pop("REMOTELOADER_MASTER", None)
        procs.append(subprocess.Popen([sys.executable, str(script), str(tables["orc"]), str(tmp_path / "store")],
                                      stdout=subprocess.PIPE, text=True, env=env, cwd=root))
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    a, b = (set(o["rows"]) for o in outs)
    assert not a & b and a | b == set(range(ROWS))
    assert all(o["len"] == o["batches"] for o in outs)
