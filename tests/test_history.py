"""The master's bounded history (master/history.py): bounded, O(1) a tick, the right values,
and what the service records into it and returns with ``status`` (``history: true``)."""
from __future__ import annotations

from collections import deque

from remoteloader.master.history import History
from remoteloader.protocol import messages as M


def test_history_is_bounded_and_keeps_the_latest_samples():
    h = History(capacity=10, max_decisions=3, max_epochs=4)
    for i in range(25):
        h.record(100.0 + i, workers=i, stall={0: 0.1}, epoch=i, cache_hits=i, cache_misses=0)
        h.decisions(100.0 + i, [{"time": float(i), "action": "add", "count": 1, "workers": i + 1, "reason": f"r{i}"}])
    d = h.to_dict()
    assert len(h) == 10 and d["time"] == [100.0 + i for i in range(15, 25)] and d["workers"] == list(range(15, 25))
    assert len(d["stall"]["0"]) == 10
    assert [x["reason"] for x in d["decisions"]] == ["r22", "r23", "r24"]
    assert [e["epoch"] for e in d["cache_epochs"]] == [21, 22, 23, 24]


def test_every_series_is_a_bounded_ring_so_a_tick_never_walks_the_history():
    """O(1) a sample, checked by structure, not by the clock (tests never assert on timings):
    every container the history keeps is a ring with a bound, or a bounded map, and a full
    history's record drops exactly the oldest sample."""
    h = History(capacity=100)
    for i in range(250):
        h.record(float(i), workers=1 + i % 3, stall={0: 0.1, 1: 0.2}, epoch=i // 50, cache_hits=i)
    rings = [v for v in vars(h).values() if isinstance(v, deque)]
    assert rings and all(r.maxlen is not None for r in rings)
    assert len(h) == 100
    times = h.to_dict()["time"]
    assert len(times) == 100 and times[0] == 150.0 and times[-1] == 249.0  # the oldest dropped, one per record


def test_values_stall_per_rank_gaps_decisions_and_cache_per_epoch():
    h = History()
    h.record(1.0, workers=1, held_bytes=10.0, budget_bytes=100.0, rows_per_s=5.0, stall={0: 0.5}, epoch=0,
             cache_hits=0, cache_misses=4)
    h.record(2.0, workers=2, pending=1, held_bytes=30.0, budget_bytes=200.0, rows_per_s=7.5, client_rows_per_s=7.0,
             stall={0: 0.25, 1: 0.75}, epoch=0, cache_hits=1, cache_misses=6)
    h.record(3.0, workers=2, draining=1, stall={1: 0.0}, epoch=1, cache_hits=9, cache_misses=6)
    log = [{"time": 10.0, "action": "hold", "count": 0, "workers": 1, "reason": "balanced"},
           {"time": 11.0, "action": "add", "count": 1, "workers": 2, "reason": "stall 50%"}]
    h.decisions(2.0, log)
    h.decisions(3.0, log + [{"time": 12.0, "action": "remove", "count": 1, "workers": 1, "reason": "idle"}])
    d = h.to_dict()
    assert d["time"] == [1.0, 2.0, 3.0] and d["workers"] == [1, 2, 2]
    assert d["pending"] == [0, 1, 0] and d["draining"] == [0, 0, 1]
    assert d["held_bytes"] == [10.0, 30.0, 0.0] and d["budget_bytes"] == [100.0, 200.0, 0.0]
    assert d["rows_per_s"] == [5.0, 7.5, 0.0] and d["client_rows_per_s"] == [None, 7.0, None]
    assert d["stall"] == {"0": [0.5, 0.25, None], "1": [None, 0.75, 0.0]}
    assert d["stall_max"] == [0.5, 0.75, 0.0] and d["stall_mean"] == [0.5, 0.5, 0.0]
    # Holds are left out; a decision already seen is not kept twice.
    assert [(x["time"], x["action"], x["workers"], x["reason"]) for x in d["decisions"]] == [
        (2.0, "add", 2, "stall 50%"), (3.0, "remove", 1, "idle")]
    assert d["cache_epochs"] == [{"epoch": 0, "hits": 1, "misses": 6}, {"epoch": 1, "hits": 8, "misses": 0}]


def test_the_service_samples_once_a_second_and_status_returns_it_only_when_asked(service):
    service.tick()
    service.now[0] += 0.25
    service.tick()  # within the second: no second sample
    assert len(service.history) == 1
    service.now[0] += 1.0
    service.tick()
    assert len(service.history) == 2
    assert "history" not in service.status()
    reply = service.handle({"t": "status", "history": True})
    assert isinstance(reply, M.StatusReply)
    history = reply.status["history"]
    assert history["time"] == [1000.0, 1001.25] and history["workers"] == [0, 0]
    assert history["capacity"] == 3600 and history["interval_s"] == 1.0
    assert "history" not in service.handle({"t": "status"}).status
