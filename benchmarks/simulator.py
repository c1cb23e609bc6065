"""Fixed-step simulation of the autoscaling control loop, driving the real policy code.

Model (all rates in rows/s), as a real cluster streams under credit:
* Worker i runs flat out at ``cap[i]`` (drawn once per worker index, log-normal
  around ``worker_rate``) while it has somewhere to put what it makes: room in its
  own small buffer (``buffer_batches``) or credit from a client to push to. With
  neither it waits (a full buffer and full client windows throttle it). New workers
  start after ``startup_s`` (jittered); drained workers stop producing and leave once
  their buffer is consumed, so nothing is lost.
* Credit streaming: each client holds a credit window of ``window_batches`` batches.
  Workers push into it as soon as it has room (pieces in flight are instant at this
  time scale); the trainer consumes from its window only. A window that is empty when
  the trainer wants a batch is a **stall**; the stall is **starved** when no worker
  holds a piece for the client either (the fleet's buffers are empty too), and not
  starved when workers hold pieces the trainer could not take (``client_cap``).
  Pieces at workers serve any client (the master spreads splits so every trainer's
  queue fills evenly).
* Trainers want ``demand(t)`` rows/s split evenly over ``clients``, each with its own
  AR(1) jitter (so the aggregate jitter shrinks as 1/sqrt(clients)).
* Trainers may leave (``away``: from, until): all their sessions end, the pieces held
  for them (credit windows, worker buffers) are thrown away, and until they come back
  no client is connected (the policy sees none) and workers have nothing to produce.
* Bottlenecks beyond the workers: ``storage_cap`` (all workers share a read
  bandwidth: more workers just wait longer, and waiting burns no CPU, though the
  worker counts as busy) and ``client_cap`` (trainers cannot ingest faster: windows
  and buffers fill while trainers stall, not starved).
* What the policy sees, as heartbeats report it: per worker the rows/s it produced,
  ``buffered`` = whole batches waiting *in the worker* (not those already in client
  windows), ``cpu`` (``cpu_busy`` when flat out: 0.95 CPU-bound, ~0.3 I/O-bound) and
  ``busy`` = the share of the tick's wall time it spent producing (produced / its
  flat-out rate under the current storage share); per client its stall, starved
  share (always reported, as real clients do), batches/s and rows/s. Measurements are noisy
  (``rate_noise``, ``cpu_noise``, ``busy_noise``).
* Control ticks as the live master makes them: each tick comes at least ``tick_s``
  after the last one, ``tick_drift_s`` late plus uniform ``[0, tick_jitter_s]``
  (``Scenario.exact()`` gives exactly ``tick_s``). Each tick is cut into equal steps
  of about ``dt``; tick timing has its own random stream, so a scenario with and
  without jitter sees the same noise draws.

Every step is a handful of numpy operations over all workers and clients, so 1000
workers for a simulated hour run in seconds; the policy sees one ``Observation`` per tick.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields, replace
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
    buffer_batches: int = 8         # each worker's own buffer
    window_batches: int = 16        # each client's credit window
    clients: int = 8
    demand_jitter: float = 0.05     # per trainer (aggregate jitter shrinks as 1/sqrt(clients))
    jitter_tau_s: float = 2.0
    cpu_busy: float = 0.95
    cpu_idle: float = 0.03
    storage_cap: Optional[float] = None
    client_cap: Optional[float] = None
    rate_noise: float = 0.05        # relative, on reported rows/s
    cpu_noise: float = 0.03         # absolute, on reported CPU
    busy_noise: float = 0.02        # absolute, on the reported busy share (clipped to 0..1)
    initial_workers: int = 1
    drain_s: float = 30.0           # a drained worker is stopped after this even if not empty
    dt: float = 0.25
    tick_s: float = 1.0
    tick_jitter_s: float = 0.01     # each tick up to this much later than tick_s after the last (uniform)
    tick_drift_s: float = 0.002     # ... and always this much later: the loop's own latency
    seed: int = 0
    max_workers: int = 2000         # bound the benchmark gives every policy
    away: Optional[tuple[float, float]] = None  # (from, until) s: no trainer connected (all sessions ended)

    def demand_at(self, t: float) -> float:
        rate = self.demand[0][1]
        for start, r in self.demand:
            if t >= start:
                rate = r
        return rate

    def achievable(self, demand: float) -> float:
        """Best consumption any allowed worker count can give: demand, unless something else
        caps it (storage, the trainers' ingest, or ``max_workers`` workers flat out)."""
        return min(demand, self.storage_cap or math.inf, self.client_cap or math.inf, self.max_supply())

    def max_supply(self) -> float:
        """Rows/s of the first ``max_workers`` workers flat out."""
        return float(worker_capacities(self, self.max_workers).sum())

    def phases(self) -> list[tuple[float, float]]:
        """Demand phases; trainers leaving and coming back start phases too."""
        starts = sorted({s for s, _ in self.demand} | {x for x in (self.away or ()) if 0 < x < self.duration_s})
        starts.append(self.duration_s)
        return [(a, b) for a, b in zip(starts, starts[1:]) if b > a]

    def away_at(self, t: float) -> bool:
        """No trainer connected at ``t``."""
        return self.away is not None and self.away[0] <= t < self.away[1]

    def exact(self) -> "Scenario":
        """The same scenario with ticks exactly ``tick_s`` apart (no jitter, no drift)."""
        return replace(self, tick_jitter_s=0.0, tick_drift_s=0.0)


def jobs_demand(jobs: Sequence[tuple[float, float, float]]) -> tuple[tuple[float, float], ...]:
    """The demand of concurrent jobs on one shared fleet (issue 39), each ``(from s, until s,
    rows/s)``, as one ``Scenario.demand``: what the fleet's autoscaler sizes for is the sum
    of the jobs' demands (it sees every job's trainers), and a job that ends takes its
    demand with it. The model's trainers stay interchangeable: the jobs' trainers together."""
    edges = sorted({0.0} | {t for start, end, _ in jobs for t in (start, end)})
    return tuple((t, sum(rate for start, end, rate in jobs if start <= t < end)) for t in edges)


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
    # Per tick: t (time of the observation), dt (tick length), active, starting, draining,
    # demand, consumed (rows/s), stall, starved (true shares, not the noisy reports),
    # floor (unavoidable stall), buffered (rows in workers), windows (rows in client windows).
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


TRACE = ("t", "dt", "active", "starting", "draining", "demand", "consumed", "stall", "starved", "floor",
         "buffered", "windows")


def simulate(sc: Scenario, policy: Policy, name: str = "") -> SimResult:
    rng = np.random.default_rng([sc.seed, 2])
    tick_rng = np.random.default_rng([sc.seed, 3])   # tick timing apart: jitter changes no other draw
    fleet = _Fleet(sc, rng)
    fleet.add(sc.initial_workers, 0.0, ready=True)
    bcap = float(sc.batch_rows * sc.buffer_batches)
    wcap = float(sc.batch_rows * sc.window_batches)
    nc = sc.clients
    jit = np.zeros(nc)                    # each trainer's demand jitter (AR(1))
    win = np.zeros(nc)                    # rows in each client's credit window
    t, ws = 0.0, 0.0
    tr: dict[str, list] = {k: [] for k in TRACE}
    actions: list[Decision] = []
    ccap = sc.client_cap / nc if sc.client_cap is not None else math.inf
    scap = min(sc.storage_cap if sc.storage_cap is not None else math.inf, sc.max_supply())
    client_ids = [f"c{k}" for k in range(nc)]

    while t < sc.duration_s - 1e-9:
        # The live master ticks at least tick_s after the last tick, a little late.
        length = sc.tick_s + sc.tick_drift_s
        if sc.tick_jitter_s > 0:
            length += tick_rng.uniform(0.0, sc.tick_jitter_s)
        steps = max(1, round(length / sc.dt))
        dt = length / steps
        a = math.exp(-dt / sc.jitter_tau_s)
        wanted = np.zeros(nc)
        got = np.zeros(nc)
        starved = np.zeros(nc)
        possible = 0.0
        for _ in range(steps):
            t += dt
            if fleet.starting_until <= t:
                fleet.promote(t)
            if sc.away_at(t):
                # No session: what was held for the trainers that left is thrown away, and no
                # split is handed out (a master with no client has no run). Workers wait.
                win[:] = 0.0
                fleet.buf = np.zeros_like(fleet.buf)
                ws += len(fleet.ids) * dt
                if fleet.draining:
                    fleet.retire(t)
                continue
            prod = fleet.production(sc.storage_cap)   # cached between fleet changes
            avail = fleet.buf + prod * dt             # what each worker can hand out this step
            jit = a * jit + math.sqrt(1 - a * a) * sc.demand_jitter * rng.standard_normal(nc)
            want = np.maximum(0.0, sc.demand_at(t) / nc * (1 + jit)) * dt
            ask = np.minimum(want, ccap * dt)         # what the trainers can ingest
            pull = ask + (wcap - win)                 # consumption plus the credit the windows have open
            have, total_pull = float(avail.sum()), float(pull.sum())
            if have <= total_pull:                    # workers push all they have and still owe credit
                delivered = pull * (have / total_pull) if total_pull > 0 else pull * 0.0
                fleet.acc += prod * dt
                fleet.buf = np.zeros_like(avail)
                short_of_workers = True
            else:                                     # every credit is filled; the rest stays in the workers
                delivered = pull
                take = avail * (total_pull / have)
                new_buf = np.minimum(avail - take, bcap)
                fleet.acc += new_buf - fleet.buf + take   # less than prod*dt when a worker had nowhere to put it
                fleet.buf = new_buf
                short_of_workers = False
            consumed = np.minimum(ask, win + delivered)
            win = win + delivered - consumed
            wanted += want
            got += consumed
            if short_of_workers:                      # the window ran dry and no worker held a piece
                starved += ask - consumed
            possible += min(float(want.sum()), ccap * nc * dt, scap * dt)
            ws += len(fleet.ids) * dt
            if fleet.draining_until <= t or (fleet.draining and short_of_workers):
                fleet.retire(t)

        # Report to the policy, as heartbeats would.
        act = fleet.state == ACTIVE
        produced = fleet.acc[act] / length
        rates = np.maximum(0.0, produced * (1 + sc.rate_noise * rng.standard_normal(len(produced))))
        util = np.minimum(1.0, produced / fleet.cap[act])
        cpu = np.maximum(0.0, sc.cpu_idle + sc.cpu_busy * util + sc.cpu_noise * rng.standard_normal(len(util)))
        flat = fleet.production(sc.storage_cap)[act]
        busy = np.minimum(1.0, np.divide(produced, flat, out=np.zeros_like(produced), where=flat > 0))
        busy = np.clip(busy + sc.busy_noise * rng.standard_normal(len(busy)), 0.0, 1.0)
        buffered = (fleet.buf[act] // sc.batch_rows).astype(int)
        fleet.acc[:] = 0.0
        workers = _signals(WorkerSignal, fleet.names[act].tolist(), rates.tolist(), buffered.tolist(),
                           [sc.buffer_batches] * len(rates), cpu.tolist(), busy.tolist())
        total_wanted = float(wanted.sum())
        stall = 1.0 - float(got.sum()) / total_wanted if total_wanted > 0 else 0.0
        cstall = np.divide(wanted - got, wanted, out=np.zeros(nc), where=wanted > 0)
        cstarved = np.divide(starved, wanted, out=np.zeros(nc), where=wanted > 0)
        noise = 1 + 0.05 * rng.standard_normal(nc)
        rstall = np.clip(cstall * noise + np.abs(0.0005 * rng.standard_normal(nc)), 0.0, 1.0)
        rstarved = np.clip(cstarved * noise, 0.0, rstall)
        crows = got / length * (1 + 0.02 * rng.standard_normal(nc))
        clients = _signals(ClientSignal, client_ids, rstall.tolist(), (crows / sc.batch_rows).tolist(),
                           rstarved.tolist(), crows.tolist()) if not sc.away_at(t) else ()
        pending = int((fleet.state == STARTING).sum())
        d = policy.observe(Observation(t, workers, clients, pending))
        if d is not None and d.count > 0:
            if d.action == "add":
                fleet.add(min(d.count, max(0, sc.max_workers - len(fleet.ids))), t)
            elif d.action == "remove":
                fleet.drain(d.remove, d.count, t)
            actions.append(d)

        for key, val in (("t", t), ("dt", length), ("active", int(act.sum())), ("starting", pending),
                         ("draining", int((fleet.state == DRAINING).sum())), ("demand", total_wanted / length),
                         ("consumed", float(got.sum()) / length), ("stall", stall),
                         ("starved", float(starved.sum()) / total_wanted if total_wanted > 0 else 0.0),
                         ("floor", 1.0 - possible / total_wanted if total_wanted > 0 else 0.0),
                         ("buffered", float(fleet.buf.sum())), ("windows", float(win.sum()))):
            tr[key].append(val)

    trace = {k: np.asarray(v, dtype=float) for k, v in tr.items()}
    return _result(sc, name or type(policy).__name__, trace, actions, ws, int((fleet.state != DRAINING).sum()),
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
