"""``remoteloader status --watch``: a live terminal view of a running master, with ``rich``.

Every ``interval_s`` it asks the master for its plain status (small: no history) and
redraws workers, stall per rank, throughput and the autoscaler's latest reasons; the
sparklines are this view's own memory of its last ``SPARK`` readings, so a watch costs the
master no more than a ``status`` a second. An unreachable master is shown as such and
asked again; Ctrl-C ends the view and restores the terminal (exit status 0).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

SPARK = 40  # readings a sparkline shows
_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values, top: Optional[float] = None) -> str:
    vals = list(values)
    if not vals:
        return ""
    top = max(vals) if top is None else top
    if top <= 0:
        return _BARS[0] * len(vals)
    return "".join(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))] for v in vals)


class Trends:
    """The view's memory of recent readings: rows/s and each rank's stall."""

    def __init__(self, n: int = SPARK) -> None:
        self.n = n
        self.rows: deque[float] = deque(maxlen=n)
        self.stall: dict[int, deque[float]] = {}

    def add(self, status: dict) -> None:
        self.rows.append(sum(w.get("rows_per_s", 0) or 0 for w in status.get("workers", [])))
        seen: dict[int, float] = {}
        for c in status.get("clients", []):
            rank = int(c.get("rank", 0))
            seen[rank] = max(seen.get(rank, 0.0), float(c.get("stall", 0) or 0))
        for rank, stall in seen.items():
            self.stall.setdefault(rank, deque(maxlen=self.n)).append(stall)
        for rank in [r for r in self.stall if r not in seen]:
            del self.stall[rank]


def render(status: Optional[dict], master: str, trends: Optional[Trends] = None, error: Optional[str] = None,
           now: Optional[float] = None):
    """The view of one status (a rich renderable); ``error``: why the last ask failed."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    trends = trends or Trends()
    stamp = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    head = Text.assemble(("remoteloader ", "bold"), (master, "cyan"), f"  {stamp}  ", ("Ctrl-C to exit", "dim"))
    parts: list = [head]
    if error:
        parts.append(Text(f"master unreachable: {error}", style="bold red"))
    if status is None:
        parts.append(Text("waiting for the master's first answer ...", style="dim"))
        return Group(*parts)
    job = status.get("job")
    parts.append(Text(f"job {job['fingerprint']}  {job['table']}  {job['rows']:,} rows, {job['splits']} splits"
                      + (f"  (the oldest of {job['oldest_of']} jobs)" if job.get("oldest_of") else "")
                      if job else "job: none yet (the master waits for the first client's spec)"))

    workers = status.get("workers", [])
    pending = status.get("pending_workers", 0)
    wt = Table(title=f"workers: {len(workers)}" + (f" (+{pending} launched, not started)" if pending else ""),
               title_justify="left", expand=False)
    for col in ("worker", "address", "held / budget MiB", "pieces", "assigned", "rows/s", "busy", "cpu", ""):
        wt.add_column(col, justify="right" if col in ("pieces", "assigned", "rows/s", "busy", "cpu") else "left")
    for w in workers:
        held = (f"{(w.get('held_bytes') or 0) / (1 << 20):,.1f} / {(w.get('budget_bytes') or 0) / (1 << 20):,.0f}"
                if w.get("held_bytes") is not None else "?")
        wt.add_row(str(w.get("id", ""))[:16], str(w.get("addr", "")), held, str(w.get("buffered", 0)),
                   str(w.get("assigned", 0)), f"{w.get('rows_per_s', 0):,.0f}", f"{w.get('busy', 0):.0%}",
                   f"{w.get('cpu', 0):.0%}", Text("draining", style="yellow") if w.get("draining") else "")
    parts.append(wt)

    ranks = status.get("ranks", {})
    clients = {}
    for c in status.get("clients", []):
        clients.setdefault(int(c.get("rank", 0)), c)
    rt = Table(title="ranks", title_justify="left")
    for col in ("rank", "epoch", "splits done", "pending", "stall", "starved", "batches/s", "stall, recent"):
        rt.add_column(col, justify="left" if col in ("rank", "stall, recent") else "right")
    for rank in sorted({int(r) for r in ranks} | set(clients)):
        r, c = ranks.get(str(rank), {}), clients.get(rank, {})
        stall = float(c.get("stall", 0) or 0)
        style = "red" if stall >= 0.2 else "yellow" if stall >= 0.05 else "green"
        rt.add_row(str(rank), str(r.get("epoch", "")), f"{r.get('done', 0)}/{r.get('splits', 0)}",
                   str(r.get("pending", "")), Text(f"{stall:.1%}", style=style) if c else "-",
                   f"{c.get('starved', 0):.1%}" if c else "-", f"{c.get('batches_per_s', 0):.1f}" if c else "-",
                   Text(sparkline(trends.stall.get(rank, ()), top=1.0), style=style))
    parts.append(rt if rt.row_count else Text("ranks: no trainer yet", style="dim"))

    rows = sum(w.get("rows_per_s", 0) or 0 for w in workers)
    parts.append(Text.assemble(("throughput ", "bold"), f"{rows:,.0f} rows/s  ", (sparkline(trends.rows), "cyan")))

    decisions = status.get("autoscaler", [])[-5:]
    if decisions:
        lines = Text()
        for i, d in enumerate(decisions):
            color = {"add": "green", "remove": "red"}.get(d.get("action"), "white")
            lines.append(f"{d.get('action', '?'):>6} {d.get('count', 0)} -> {d.get('workers', '?')} workers: ",
                         style=color)
            lines.append(str(d.get("reason", "")) + ("\n" if i < len(decisions) - 1 else ""))
        parts.append(Panel(lines, title="autoscaler, latest reasons", title_align="left"))
    cache = status.get("cache")
    if cache:
        n = cache.get("counters", {})
        parts.append(Text(f"cache {cache.get('location')}: hits {n.get('hits', 0):,.0f}  misses "
                          f"{n.get('misses', 0):,.0f}  puts {n.get('puts', 0):,.0f}"))
    errors = status.get("errors", [])
    if errors:
        e = errors[-1]
        parts.append(Text(f"{len(errors)} errors; last ({'skipped' if e.get('skipped') else 'fatal'}): "
                          f"{str(e.get('message', ''))[:200]}", style="red"))
    return Group(*parts)


def watch(fetch: Callable[[], dict], master: str, interval_s: float = 1.0, console=None,
          unavailable: tuple = (ConnectionError,), iterations: Optional[int] = None) -> int:
    """Redraw ``render(fetch())`` every ``interval_s`` until Ctrl-C (or ``iterations``
    redraws, for tests). An error in ``unavailable`` is shown and the master asked again."""
    from rich.live import Live

    trends, status, error, done = Trends(), None, None, 0
    try:
        with Live(render(None, master), console=console, refresh_per_second=4, transient=False) as live:
            while iterations is None or done < iterations:
                started = time.monotonic()
                try:
                    status, error = fetch(), None
                    trends.add(status)
                except unavailable as e:
                    error = str(e)
                live.update(render(status, master, trends, error))
                done += 1
                if iterations is not None and done >= iterations:
                    break
                time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    return 0
