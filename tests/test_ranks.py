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


# -- state_dict() under torch.distributed: a gather through the store, bounded ------------------------
def test_state_dict_parts_are_gathered_through_the_store_as_json():
    import threading
    from torch.distributed import HashStore

    from remoteloader.client.ranks import RankStore

    store = RankStore(HashStore())
    parts = [{"rank": r, "consumed": [[r, 1, 2]], "spec": {"seed": "0"}} for r in range(3)]
    got: dict = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, store.gather_parts("fp", 0, r, 3, parts[r])))
               for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(got[r] == dict(enumerate(parts)) for r in range(3))


def test_a_rank_calling_state_dict_alone_gets_an_error_naming_the_collective_not_a_hang():
    from torch.distributed import HashStore

    from remoteloader.client.ranks import PART_KEY, RankStore

    store = HashStore()
    with pytest.raises(RuntimeError, match=r"collective.*ranks \[1\] did not call it.*on all ranks"):
        RankStore(store).gather_parts("fp", 0, 0, 2, {"rank": 0}, timeout=0.3)
    assert not store.check([PART_KEY.format(fingerprint="fp", seq=0, rank=0)])  # withdrawn: no later call reads it


ALONE = """
import json, os, sys
import torch.distributed as dist
from remoteloader import RemoteDataLoader
from remoteloader.client import ranks
from tests.conftest import spec_dict

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], world), rank=rank, world_size=world)
ranks.GATHER_TIMEOUT_S = 3.0
loader = RemoteDataLoader(spec_dict(sys.argv[1]), num_workers=1, timeout=120)
it = iter(loader)
next(it)
out = {}
if rank == 0:  # the trap: `if rank == 0: torch.save(loader.state_dict(), ...)`
    try:
        loader.state_dict()
        out["alone"] = "returned"
    except RuntimeError as e:
        out["alone"] = str(e)
dist.barrier()
out["together"] = loader.state_dict()  # every rank: the job's position, the same on each
with open(os.path.join(sys.argv[3], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.barrier()
it.close()
loader.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_state_dict_on_rank_zero_alone_raises_within_its_bound_and_every_rank_can_then_save(tables, tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(ALONE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "MASTER_ADDR": "127.0.0.1",
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script), str(tables["orc"]), str(tmp_path / "store"),
                               str(tmp_path)], env={**env, "RANK": str(r)}) for r in range(2)]
    try:
        for p in procs:
            assert p.wait(180) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "a collective" in outs[0]["alone"] and "ranks [1] did not call it within 3 s" in outs[0]["alone"]
    assert outs[0]["together"] == outs[1]["together"] and outs[0]["together"]["version"]
