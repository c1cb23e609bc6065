"""``make demo``: generate a small table and train a small DLRM through RemoteDataLoader.

Nothing else needs to run: the loader starts its embedded master and local workers,
and stops them when the ``with`` block ends.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from .. import RemoteDataLoader
from .datagen import generate_table

HASH_SIZE = 20_000


def demo_spec(table: str, dense: int, sparse: int, batch_size: int) -> dict:
    return {
        "table": {"path": table},
        "features": {
            "label": "label",
            "dense": [{"name": f"d{i}", "column": f"float_{i}", "transforms": [{"op": "clamp", "min": 0.0, "max": 1e6}]}
                      for i in range(dense)],
            "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                        "transforms": [{"op": "firstx", "x": 20}, {"op": "sigrid_hash", "salt": i, "max_value": HASH_SIZE}]}
                       for i in range(sparse)],
        },
        "batch_size": batch_size,
        "shuffle": True,
    }


class DLRM(nn.Module):
    """Embedding bags for the sparse features, an MLP for the dense ones, an MLP on top."""

    def __init__(self, dense: int, keys: list[str], dim: int = 16) -> None:
        super().__init__()
        self.keys = keys
        self.bags = nn.ModuleDict({k: nn.EmbeddingBag(HASH_SIZE, dim, mode="sum", sparse=True) for k in keys})
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (len(keys) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch) -> torch.Tensor:
        parts = [self.bottom(torch.log1p(batch.dense_features))]
        for k in self.keys:
            jt = batch.sparse_features[k]
            parts.append(self.bags[k](jt.values(), jt.offsets()[:-1]))
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="remoteloader.demo", description=__doc__)
    p.add_argument("--data", default="data/demo")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--sparse", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--workers", type=int, default=None, help="local workers (default: CPU count)")
    args = p.parse_args(argv)

    table = Path(args.data)
    if not table.exists():
        print(f"generating {args.rows:,} rows into {table} ...")
        generate_table(str(table), rows=args.rows, partitions=2, dense=args.dense, sparse=args.sparse + 4,
                       format="orc", seed=0)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # leave the other cores to the workers: this is a 2-core demo
    torch.sparse.check_sparse_tensor_invariants.disable()  # Adagrad's own sparse updates are well formed
    spec = demo_spec(str(table.resolve()), args.dense, args.sparse, args.batch_size)
    with RemoteDataLoader(spec, num_workers=args.workers) as loader:
        model = DLRM(args.dense, loader.sparse_keys)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)  # handles the bags' sparse gradients
        loss_fn = nn.BCEWithLogitsLoss()
        print(f"{len(loader)} batches of {args.batch_size} rows per epoch; training {args.steps} steps")
        step, rows, start, window_loss = 0, 0, time.perf_counter(), 0.0
        epoch = 0
        while step < args.steps:
            for batch in loader:
                loss = loss_fn(model(batch), batch.labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                rows += len(batch)
                window_loss += loss.item()
                if step % 50 == 0:
                    elapsed = time.perf_counter() - start
                    print(f"epoch {epoch} step {step:4d}  loss {window_loss / 50:.4f}  {rows / elapsed:,.0f} rows/s")
                    window_loss = 0.0
                if step >= args.steps:
                    break
            epoch += 1
        elapsed = time.perf_counter() - start
        print(f"done: {step} steps, {rows:,} rows in {elapsed:.1f} s ({rows / elapsed:,.0f} rows/s, training included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
