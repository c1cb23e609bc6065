"""Fixed-step simulation of the autoscaling control loop, driving the real policy code.

Model (all rates in rows/s):
* Worker i runs flat out at ``cap[i]`` (drawn once per worker index, log-normal
  around ``worker_rate``) while its bounded buffer has room; a full buffer throttles
  it. New workers start after ``startup_s`` (jittered); drained workers stop
  producing and leave once their buffer is consumed, so nothing is lost.
* Trainers want ``demand(t)`` rows/s with AR(1) jitter; each step they take what
  the buffers hold, in proportion to what each worker has, and stall for the rest.
* Bottlenecks beyond the workers: ``storage_cap`` (all workers share a read
  bandwidth: more workers just wait longer, and waiting burns no CPU) and
  ``client_cap`` (trainers cannot ingest faster: buffers fill while trainers stall).
* ``cpu_busy`` is the CPU a flat-out worker shows: 0.95 CPU-bound, ~0.3 I/O-bound.
* Measurements reported to the policy are noisy (``rate_noise``, ``cpu_noise``).

Every step is a handful of numpy operations over all workers, so 1000 workers for
a simulated hour run in seconds; the policy sees one ``Observation`` per ``tick_s``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import numpy as np

from remoteloader.master.autoscale import ClientSignal, Decision, Observation, Policy, WorkerSignal

STARTING, ACTIVE, DRAINING = 0, 1, 2


@dataclass(frozen=True)
class Scenario:
    name: str
    demand: tuple[tuple[float, float], ...]   # (from time s, rows/s), first entry at 0
    duration_s: float = 3600.0
    worker_rate: float = 10_000.0   # mean flat-out rows/s per worker
    rate_cv: float = 0.1            # spread of per-worker throughput
    startup_s: float = 10.0
    startup_jitter: float = 0.3     # +-30%
    batch_rows: int = 1024
    buffer_batches: int = 8
    clients: int = 8
    demand_jitter: float = 0.05     # per trainer (aggregate jitter shrinks as 1/sqrt(clients))
    jitter_tau_s: float = 2.0
    cpu_busy: float = 0.95
    cpu_idle: float = 0.03
    storage_cap: Optional[float] = None
    client_cap: Optional[float] = None
    rate_noise: float = 0.05
    cpu_noise: float = 0.03
    initial_workers: int = 1
    drain_s: float = 30.0           # a drained worker is stopped after this even if not empty
    dt: float = 0.25
    tick_s: float = 1.0
    seed: int = 0
    max_workers: int = 2000         # bound the benchmark gives every policy

    def demand_at(self, t: float) -> float:
        rate = self.demand[0][1]
        for start, r in self.demand:
            if t >= start:
                rate = r
        return rate

    def achievable(self, demand: float) -> float:
        """Best consumption any worker count can give: demand, unless something else caps it."""
        return min(demand, self.storage_cap or math.inf, self.client_cap or math.inf)

    def phases(self) -> list[tuple[float, float]]:
        starts = [s for s, _ in self.demand] + [self.duration_s]
        return [(a, b) for a, b in zip(starts, starts[1:]) if b > a]


def worker_capacities(sc: Scenario, n: int) -> np.ndarray:
    """Flat-out rate of workers 0..n-1; worker k always gets the same one for a seed."""
    sigma = math.sqrt(math.log(1 + sc.rate_cv ** 2))
    z = np.random.default_rng([sc.seed, 1]).standard_normal(n)
    return sc.worker_rate * np.exp(sigma * z - sigma ** 2 / 2)


def oracle_workers(sc: Scenario, demand: Optional[float] = None) -> int:
    """Smallest fixed count whose workers (in launch order) supply the best achievable peak rate."""
    need = sc.achievable(demand if demand is not None else max(r for _, r in sc.demand))
    cum = np.cumsum(worker_capacities(sc, 100_000))
    return int(np.searchsorted(cum, need)) + 1


def fewest_workers(sc: Scenario, launched: int, demand: float) -> int:
    """Smallest count that can cover `demand` when keeping the fastest of the first `launched`
    workers: the floor for a policy that drains its slowest workers first."""
    cum = np.cumsum(np.sort(worker_capacities(sc, launched))[::-1])
    return min(int(np.searchsorted(cum, sc.achievable(demand))) + 1, launched)


@dataclass
class SimResult:
    scenario: str
    policy: str
    oracle_workers: int
    time_to_stall_free: Optional[float]   # worst phase: from its start until avoidable stall stays <= 1%; None: never
    stall_after: float                    # mean avoidable stall from that point on (relapses included)
    worker_seconds: float                 # starting + active + draining workers, integrated
    decisions: int                        # add/remove actions applied
    direction_changes: int                # add<->remove switches
    final_workers: int
    launched: int                         # workers ever launched (ids w0 .. w{launched-1})
    trace: dict[str, np.ndarray] = field(repr=False)
    actions: list[Decision] = field(repr=False)


class _Fleet:
    """Compact per-worker arrays; rebuilt only when workers come or go."""

    FIELDS = ("ids", "names", "cap", "buf", "state", "until", "acc")

    def __init__(self, sc: Scenario, rng: np.random.Generator) -> None:
        self.sc, self.rng = sc, rng
        self.caps = worker_capacities(sc, 1024)
        self.next_id = 0
        self.ids = np.empty(0, int)
        self.names = np.empty(0, object)
        self.cap = np.empty(0)
        self.buf = np.empty(0)
        self.state = np.empty(0, int)
        self.until = np.empty(0)    # ready time while starting, stop time while draining
        self.acc = np.empty(0)      # rows produced since the last tick
        self._changed()

    def _changed(self) -> None:
        """Refresh what the step loop reads often: next start, next forced stop, production."""
        starting, draining = self.state == STARTING, self.state == DRAINING
        self.starting_until = float(self.until[starting].min()) if starting.any() else math.inf
        self.draining_until = float(self.until[draining].min()) if draining.any() else math.inf
        self.draining = bool(draining.any())
        self._prod: Optional[np.ndarray] = None

    def production(self, storage_cap: Optional[float]) -> np.ndarray:
        """Flat-out rows/s of each worker right now (0 unless active; shared storage scales all down)."""
        if self._prod is None:
            prod = np.where(self.state == ACTIVE, self.cap, 0.0)
            total = float(prod.sum())
            if storage_cap is not None and total > storage_cap:
                prod *= storage_cap / total
            self._prod = prod
        return self._prod

    def add(self, k: int, now: float, ready: bool = False) -> None:
        while self.next_id + k > len(self.caps):
            self.caps = worker_capacities(self.sc, 2 * len(self.caps))
        ids = np.arange(self.next_id, self.next_id + k)
        self.next_id += k
        delay = 0.0 if ready else self.sc.startup_s * (1 + self.rng.uniform(-1, 1, k) * self.sc.startup_jitter)
        new = {"ids": ids, "names": np.array([f"w{i}" for i in ids.tolist()], dtype=object),
               "cap": self.caps[ids], "buf": np.zeros(k), "state": np.full(k, ACTIVE if ready else STARTING),
               "until": now + delay * np.ones(k), "acc": np.zeros(k)}
        for f in self.FIELDS:
            setattr(self, f, np.concatenate([getattr(self, f), new[f]]))
        self._changed()

    def promote(self, now: float) -> None:
        self.state[(self.state == STARTING) & (self.until <= now)] = ACTIVE
        self._changed()

    def drain(self, ids: Sequence[str], k: int, now: float) -> None:
        """Drain the named workers; make up any shortfall by cancelling launches, then newest first."""
        want = np.isin(self.names, list(ids)) & (self.state == ACTIVE)
        short = k - int(want.sum())
        for st in (STARTING, ACTIVE):
            if short <= 0:
                break
            cand = np.flatnonzero((self.state == st) & ~want)[::-1][:short]
            want[cand] = True
            short -= len(cand)
        cancel = want & (self.state == STARTING)    # a launch not yet up is simply cancelled
        self.state[want] = DRAINING
        self.until[want] = now + self.sc.drain_s
        self._keep(~cancel)

    def retire(self, now: float) -> None:
        """Drained workers leave once no whole batch is left (or at their deadline)."""
        gone = (self.state == DRAINING) & ((self.buf < self.sc.batch_rows) | (self.until <= now))
        self._keep(~gone)

    def _keep(self, keep: np.ndarray) -> None:
        for f in self.FIELDS:
            setattr(self, f, getattr(self, f)[keep])
        self._changed()


_NEW = object.__new__


def _signals(cls: type, *columns: list) -> tuple:
    """Signals (WorkerSignal, ClientSignal) from columns. Calling a frozen dataclass costs
    ~2.5 us per object (its __init__ goes through object.__setattr__), the largest cost of
    a 1000-worker tick; filling the slots directly gives equal, still frozen objects at
    half the cost."""
    slots = [cls.__dict__.get(f.name) for f in fields(cls)]
    if not all(hasattr(s, "__set__") for s in slots):
        return tuple(map(cls, *columns))
    n = len(columns[0])
    objs = [_NEW(cls) for _ in range(n)]
    # Fields past the given columns take their defaults.
    columns = (*columns, *([f.default] * n for f in fields(cls)[len(columns):]))
    for slot, values in zip(slots, columns):
        deque(map(slot.__set__, objs, values), maxlen=0)
    return tuple(objs)


def simulate(sc: Scenario, policy: Policy, name: str = "") -> SimResult:
    rng = np.random.default_rng([sc.seed, 2])
    fleet = _Fleet(sc, rng)
    fleet.add(sc.initial_workers, 0.0, ready=True)
    bcap = float(sc.batch_rows * sc.buffer_batches)
    steps = max(1, round(sc.tick_s / sc.dt))
    dt = sc.tick_s / steps
    a = math.exp(-dt / sc.jitter_tau_s)
    jit_sd = sc.demand_jitter / math.sqrt(sc.clients)
    jitter, t, ws = 0.0, 0.0, 0.0
    n_ticks = int(round(sc.duration_s / sc.tick_s))
    tr = {k: np.zeros(n_ticks) for k in ("t", "active", "starting", "draining", "demand", "consumed", "stall", "floor")}
    actions: list[Decision] = []
    ccap = sc.client_cap if sc.client_cap is not None else math.inf
    client_ids = [f"c{k}" for k in range(sc.clients)]

    for tick in range(n_ticks):
        wanted = got = possible = 0.0
        for _ in range(steps):
            t += dt
            if fleet.starting_until <= t:
                fleet.promote(t)
            prod = fleet.production(sc.storage_cap)   # cached between fleet changes
            avail = fleet.buf + prod * dt
            jitter = a * jitter + math.sqrt(1 - a * a) * jit_sd * rng.standard_normal()
            want = max(0.0, sc.demand_at(t) * (1 + jitter)) * dt
            ask = min(want, ccap * dt)
            have = float(avail.sum())
            if have <= ask:                   # trainers take everything and still wait
                fleet.acc += prod * dt
                fleet.buf = np.zeros_like(avail)
                got += have
            else:                             # take in proportion to what each worker holds
                take = avail * (ask / have)
                new_buf = np.minimum(avail - take, bcap)
                fleet.acc += new_buf - fleet.buf + take   # less than prod*dt when a buffer was full
                fleet.buf = new_buf
                got += ask
            wanted += want
            possible += min(want, ccap * dt, sc.storage_cap * dt if sc.storage_cap is not None else math.inf)
            ws += len(fleet.ids) * dt
            if fleet.draining_until <= t or (fleet.draining and have <= ask):
                fleet.retire(t)

        # Report to the policy, as heartbeats would.
        act = fleet.state == ACTIVE
        produced = fleet.acc[act] / sc.tick_s
        rates = np.maximum(0.0, produced * (1 + sc.rate_noise * rng.standard_normal(len(produced))))
        util = np.minimum(1.0, produced / fleet.cap[act])
        cpu = np.maximum(0.0, sc.cpu_idle + sc.cpu_busy * util + sc.cpu_noise * rng.standard_normal(len(util)))
        buffered = (fleet.buf[act] // sc.batch_rows).astype(int)
        fleet.acc[:] = 0.0
        workers = _signals(WorkerSignal, fleet.names[act].tolist(), rates.tolist(), buffered.tolist(),
                           [sc.buffer_batches] * len(rates), cpu.tolist())
        stall = 1.0 - got / wanted if wanted > 0 else 0.0
        cstall = np.clip(stall * (1 + 0.05 * rng.standard_normal(sc.clients))
                         + np.abs(0.0005 * rng.standard_normal(sc.clients)), 0.0, 1.0)
        cbps = got / sc.tick_s / sc.batch_rows / sc.clients * (1 + 0.02 * rng.standard_normal(sc.clients))
        clients = _signals(ClientSignal, client_ids, cstall.tolist(), cbps.tolist())
        pending = int((fleet.state == STARTING).sum())
        d = policy.observe(Observation(t, workers, clients, pending))
        if d is not None and d.count > 0:
            if d.action == "add":
                fleet.add(min(d.count, max(0, sc.max_workers - len(fleet.ids))), t)
            elif d.action == "remove":
                fleet.drain(d.remove, d.count, t)
            actions.append(d)

        for key, val in (("t", t), ("active", int(act.sum())), ("starting", pending),
                         ("draining", int((fleet.state == DRAINING).sum())), ("demand", wanted / sc.tick_s),
                         ("consumed", got / sc.tick_s), ("stall", stall),
                         ("floor", 1.0 - possible / wanted if wanted > 0 else 0.0)):
            tr[key][tick] = val

    return _result(sc, name or type(policy).__name__, tr, actions, ws, int((fleet.state != DRAINING).sum()),
                   fleet.next_id)


def _result(sc: Scenario, name: str, tr: dict[str, np.ndarray], actions: list[Decision],
            ws: float, final: int, launched: int) -> SimResult:
    """Per demand phase: stall-free from the first tick after which the avoidable stall (10 s
    average) stays <= 1% for a minute; the stall after that point counts relapses too."""
    excess = np.maximum(0.0, tr["stall"] - tr["floor"])     # the stall more workers could have avoided
    k = max(1, round(10.0 / sc.tick_s))
    smooth = np.convolve(excess, np.ones(k) / k)[:len(excess)]
    m = max(1, round(60.0 / sc.tick_s))
    worst: Optional[float] = 0.0
    after_sum = after_len = 0.0
    for start, end in sc.phases():
        idx = np.flatnonzero((tr["t"] > start) & (tr["t"] < end))
        if not len(idx):
            continue
        ok = smooth[idx] <= 0.01
        run = np.convolve(ok, np.ones(min(m, len(ok))), mode="valid") >= min(m, len(ok)) - 0.5
        if run.any():
            first = int(np.argmax(run))
            worst = None if worst is None else max(worst, float(tr["t"][idx[first]] - start) if first else 0.0)
        else:
            first = len(idx) // 2                 # never stall-free: report the second half
            worst = None
        after_sum += float(excess[idx[first:]].sum())
        after_len += len(idx) - first
    signs = [1 if d.action == "add" else -1 for d in actions]
    return SimResult(sc.name, name, oracle_workers(sc), worst, after_sum / after_len if after_len else 0.0,
                     ws, len(actions), sum(1 for x, y in zip(signs, signs[1:]) if x != y), final, launched,
                     tr, actions)
