"""A canned status with a history, as ``status`` with ``history: true`` returns it: a 10-minute
run of two ranks on a fleet the autoscaler grows from one worker to three and trims to
two, with a block cache that misses in epoch 0 and hits after. Built with the master's own
``History``, fed as the service's tick would; no master needed."""
from __future__ import annotations

import math

from remoteloader.master.history import History

MIB = 1 << 20
START = 1_767_000_000.0  # a fixed wall-clock start: the page is the same every run


def canned_status(seconds: int = 600, reason: str = "") -> dict:
    h = History()
    steps = {60: ("add", 1, 2, "stall 31.0% > 10% for 30 s: 2 ranks starved, workers busy 97%"),
             150: ("add", 1, 3, "stall 14.2% > 10% for 30 s: workers busy 95%, buffers 3% full"),
             480: ("remove", 1, 2, "idle: workers busy 28%, buffers 96% full, stall 0.1% for 60 s")}
    workers, decisions = 1, []
    hits = misses = 0.0
    for i in range(seconds):
        now = START + i
        if i in steps:
            action, count, workers, why = steps[i]
            decisions.append({"time": 5000.0 + i, "action": action, "count": count, "workers": workers,
                              "reason": reason or why, "remove": []})
        demand = 150_000.0 if i < 450 else 105_000.0  # the trainers slow down (an eval phase)
        rows = min(demand, workers * 62_000.0 * (0.97 + 0.03 * math.sin(i / 7)))
        short = max(0.0, 1 - rows / demand)
        stall = {0: min(1.0, short * 0.9 + 0.01 * (1 + math.sin(i / 5))),
                 1: min(1.0, short * 1.1 + 0.01 * (1 + math.cos(i / 6)))}
        epoch = i // 150
        per_s = rows / 4096 * 12  # blocks looked up per second
        if epoch == 0:
            misses += per_s
        else:
            hits += per_s * 0.93
            misses += per_s * 0.07
        h.record(now, workers=workers, draining=1 if 480 <= i < 495 else 0, pending=1 if i in (60, 61, 150) else 0,
                 held_bytes=workers * (180 + 40 * math.sin(i / 11)) * MIB * (1 - short),
                 budget_bytes=workers * 256.0 * MIB, rows_per_s=rows, client_rows_per_s=rows * 0.99,
                 stall=stall, epoch=epoch, cache_hits=hits, cache_misses=misses)
        h.decisions(now, decisions[-10:])
    last = h.to_dict()
    return {
        "job": {"fingerprint": "3f9a0c1b2d4e", "table": "s3://***@bucket/ads?token=***", "files": 8, "splits": 40,
                "rows": 2_000_000, "world_size": 2, "split_bytes": 29 * MIB},
        "workers": [{"id": f"w-{n}aa0f3c2d91e", "addr": f"tcp://10.0.0.{n + 10}:6000", "pid": 4100 + n,
                     "buffered": 12, "assigned": 3, "draining": False, "last_seen_s": 0.4,
                     "held_bytes": int(190 * MIB), "budget_bytes": 256 * MIB, "ahead_bytes": 0, "capacity": 16,
                     "rows_per_s": 61_500.0, "busy": 0.71, "cpu": 0.74} for n in range(2)],
        "clients": [{"id": f"s-00000000000{r}", "rank": r, "stall": last["stall"][str(r)][-1],
                     "starved": 0.0, "batches_per_s": 18.0, "queued": 4} for r in range(2)],
        "pending_workers": 0,
        "autoscaler": [{k: v for k, v in d.items()} for d in decisions],
        "cache": {"location": "/var/cache/rl", "counters": {"hits": hits, "misses": misses}},
        "ranks": {str(r): {"epoch": 3, "session": f"s-00000000000{r}", "seq": 3, "splits": 20, "done": 13,
                           "pending": 4, "finished": False} for r in range(2)},
        "errors": [],
        "history": last,
    }
