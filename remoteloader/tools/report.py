"""``remoteloader report``: one self-contained HTML page of a run, from the master's history.

The page is built from what ``status`` returns with ``history: true`` (the master's
bounded history, ``master/history.py``): stall per rank over time, the worker count with
the autoscaler's decisions marked, the bytes workers hold against their budget, the block
cache's hits and misses per epoch, and rows per second. Charts are plotly's, with
plotly.js inlined in the page (about 5 MB): opening it needs no network, no CDN and no
server, so it can be mailed or attached to a ticket. Every text from the master is
escaped; the table path is the redacted one ``status`` gives.
"""
from __future__ import annotations

import datetime
import html
import json
from typing import Any, Optional

CHARTS = ("stall", "workers", "held", "cache", "rows")  # one div "chart-<name>" each, in this order
MAX_RANK_LINES = 16  # more ranks: their max and mean, and the worst few ranks


def _times(history: dict) -> list:
    return [datetime.datetime.fromtimestamp(t, datetime.timezone.utc) for t in history.get("time", [])]


def _layout(fig: Any, title: str, y_title: str, **extra: Any) -> Any:
    extra.setdefault("hovermode", "x unified")
    fig.update_layout(title={"text": title, "x": 0.01, "xanchor": "left"}, template="plotly_white", height=330,
                      margin={"l": 60, "r": 20, "t": 50, "b": 40}, yaxis_title=y_title,
                      legend={"orientation": "h", "y": -0.18}, **extra)
    return fig


def _empty(fig: Any, why: str) -> Any:
    fig.add_annotation(text=why, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5, font={"size": 14})
    return fig


def _mib(values: list) -> list:
    return [None if v is None else v / (1 << 20) for v in values]


def stall_chart(history: dict) -> Any:
    import plotly.graph_objects as go

    x, fig = _times(history), go.Figure()
    stall: dict = history.get("stall", {})
    ranks = sorted(stall, key=int)
    if len(ranks) > MAX_RANK_LINES:  # a line a rank stops being readable: the spread, and the worst ranks
        fig.add_trace(go.Scatter(x=x, y=[v * 100 for v in history.get("stall_max", [])], name="worst rank",
                                 mode="lines", line={"width": 2}))
        fig.add_trace(go.Scatter(x=x, y=[v * 100 for v in history.get("stall_mean", [])], name="mean of ranks",
                                 mode="lines", line={"dash": "dash"}))

        def mean(r: str) -> float:
            vals = [v for v in stall[r] if v is not None]
            return sum(vals) / len(vals) if vals else 0.0
        ranks = sorted(sorted(ranks, key=mean, reverse=True)[:5], key=int)
    for rank in ranks:
        fig.add_trace(go.Scatter(x=x, y=[None if v is None else v * 100 for v in stall[rank]], name=f"rank {rank}",
                                 mode="lines", connectgaps=False))
    _layout(fig, "Stall per rank: share of the training loop's time spent waiting for data", "stall %",
            yaxis={"rangemode": "tozero"})
    return _empty(fig, "no trainer connected while the history was kept") if not ranks else fig


def workers_chart(history: dict) -> Any:
    import plotly.graph_objects as go

    x, fig = _times(history), go.Figure()
    fig.add_trace(go.Scatter(x=x, y=history.get("workers", []), name="workers", mode="lines",
                             line={"shape": "hv", "width": 2}))
    if any(history.get("draining", [])):
        fig.add_trace(go.Scatter(x=x, y=history["draining"], name="draining", mode="lines", line={"shape": "hv"}))
    if any(history.get("pending", [])):
        fig.add_trace(go.Scatter(x=x, y=history["pending"], name="launched, not started", mode="lines",
                                 line={"shape": "hv", "dash": "dot"}))
    for action, symbol, color in (("add", "triangle-up", "#2ca02c"), ("remove", "triangle-down", "#d62728")):
        marks = [d for d in history.get("decisions", []) if d["action"] == action]
        if marks:
            fig.add_trace(go.Scatter(
                x=[datetime.datetime.fromtimestamp(d["time"], datetime.timezone.utc) for d in marks],
                y=[d["workers"] for d in marks], mode="markers", name=f"autoscaler: {action}",
                marker={"symbol": symbol, "size": 13, "color": color, "line": {"width": 1, "color": "#333"}},
                text=[f"{d['action']} {d['count']} -> {d['workers']}: {d['reason']}" for d in marks],
                hovertemplate="%{text}<extra></extra>"))
    _layout(fig, "Workers, with the autoscaler's decisions (hover a mark for its reason)", "workers",
            yaxis={"rangemode": "tozero", "dtick": 1 if max(history.get("workers", [0]) or [0]) <= 12 else None})
    return _empty(fig, "no sample yet") if not x else fig


def held_chart(history: dict) -> Any:
    import plotly.graph_objects as go

    x, fig = _times(history), go.Figure()
    fig.add_trace(go.Scatter(x=x, y=_mib(history.get("held_bytes", [])), name="held (all workers)", mode="lines",
                             fill="tozeroy"))
    fig.add_trace(go.Scatter(x=x, y=_mib(history.get("budget_bytes", [])), name="budget (sum of --buffer-bytes)",
                             mode="lines", line={"dash": "dash", "color": "#d62728"}))
    _layout(fig, "Bytes the workers hold against their budget", "MiB", yaxis={"rangemode": "tozero"})
    return _empty(fig, "no sample yet") if not x else fig


def cache_chart(history: dict) -> Any:
    import plotly.graph_objects as go

    epochs = history.get("cache_epochs", [])
    labels = [f"epoch {e['epoch']}" for e in epochs]
    fig = go.Figure([go.Bar(x=labels, y=[e["hits"] for e in epochs], name="hits", marker_color="#2ca02c"),
                     go.Bar(x=labels, y=[e["misses"] for e in epochs], name="misses", marker_color="#ff7f0e")])
    _layout(fig, "Block cache: hits and misses per epoch", "blocks", barmode="group", hovermode="closest")
    if not epochs:
        return _empty(fig, "no epoch while the history was kept")
    if not any(e["hits"] or e["misses"] for e in epochs):
        return _empty(fig, "no cache lookup: no block cache (--cache), or the spec caches nothing")
    return fig


def rows_chart(history: dict) -> Any:
    import plotly.graph_objects as go

    x, fig = _times(history), go.Figure()
    fig.add_trace(go.Scatter(x=x, y=history.get("rows_per_s", []), name="produced (workers)", mode="lines"))
    taken = history.get("client_rows_per_s", [])
    if any(v is not None for v in taken):
        fig.add_trace(go.Scatter(x=x, y=taken, name="taken (trainers)", mode="lines", line={"dash": "dot"}))
    _layout(fig, "Throughput", "rows/s", yaxis={"rangemode": "tozero"})
    return _empty(fig, "no sample yet") if not x else fig


def figures(status: dict) -> dict[str, Any]:
    """The page's charts, by name (``CHARTS``), from a status with ``history``."""
    history = status.get("history") or {}
    return {"stall": stall_chart(history), "workers": workers_chart(history), "held": held_chart(history),
            "cache": cache_chart(history), "rows": rows_chart(history)}


_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1200px;
       color: #222; padding: 0 16px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
.meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 0.9em; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; }
th { background: #f4f4f4; }
.chart { border: 1px solid #e4e4e4; border-radius: 6px; margin: 12px 0; padding: 4px; }
"""


def _table(header: list[str], rows: list[list]) -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary(status: dict) -> str:
    history = status.get("history") or {}
    job = status.get("job")
    times = history.get("time", [])
    parts = []
    if job:
        parts.append(f"job {job.get('fingerprint')} on {job.get('table')}: {job.get('rows', 0):,} rows in "
                     f"{job.get('splits', 0)} splits, world size {job.get('world_size')}")
    else:
        parts.append("no job yet")
    if times:
        start = datetime.datetime.fromtimestamp(times[0], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        parts.append(f"{len(times)} samples from {start} UTC over {times[-1] - times[0]:,.0f} s "
                     f"(the master keeps the last {history.get('capacity', len(times))}, one every "
                     f"{history.get('interval_s', 1):g} s)")
    out = "<p class='meta'>" + "<br>".join(html.escape(p) for p in parts) + "</p>"
    workers = [[w.get("id", "")[:16], w.get("addr", ""), f"{(w.get('held_bytes') or 0) / (1 << 20):,.1f}",
                f"{(w.get('budget_bytes') or 0) / (1 << 20):,.1f}", f"{w.get('rows_per_s', 0):,.0f}",
                f"{w.get('busy', 0):.0%}", "draining" if w.get("draining") else ""] for w in status.get("workers", [])]
    out += _table(["worker", "address", "held MiB", "budget MiB", "rows/s", "busy", ""], workers)
    clients = [[c.get("rank"), f"{c.get('stall', 0):.1%}", f"{c.get('starved', 0):.1%}",
                f"{c.get('batches_per_s', 0):.1f}"] for c in sorted(status.get("clients", []), key=lambda c: c.get("rank", 0))]
    out += _table(["rank", "stall", "starved", "batches/s"], clients)
    decisions = [[d.get("action"), d.get("count"), d.get("workers"), d.get("reason")]
                 for d in status.get("autoscaler", [])[-5:]]
    out += _table(["autoscaler", "count", "workers after", "latest reasons"], decisions)
    return out


def build_report(status: dict, title: Optional[str] = None, generated_at: Optional[float] = None) -> str:
    """The page (a str of HTML), from a status dict with ``history`` (``status`` with
    ``history: true``). Needs no master: tests give it a canned dict."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    when = datetime.datetime.fromtimestamp(generated_at, datetime.timezone.utc) if generated_at is not None else \
        datetime.datetime.now(datetime.timezone.utc)
    title = title or "remoteloader: a picture of the fleet"
    divs = []
    config = {"displaylogo": False, "responsive": True}
    for name, fig in figures(status).items():
        divs.append(f"<div class='chart' data-chart='{name}'>" +
                    pio.to_html(fig, full_html=False, include_plotlyjs=False, include_mathjax=False,
                                div_id=f"chart-{name}", config=config) + "</div>")
    # plotly.js inline: the page opens with no network. "</script" never occurs in it (checked by the tests).
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            f"<h1>{html.escape(title)}</h1>"
            f"<p class='meta'>generated {when.strftime('%Y-%m-%d %H:%M:%S')} UTC by remoteloader report</p>"
            f"{_summary(status)}{''.join(divs)}"
            f"<script type='application/json' id='status-data'>{_json_for_script(status)}</script>"
            "</body></html>\n")


def _json_for_script(status: dict) -> str:
    """The status (less its history's long series) as JSON safe inside a script element."""
    brief = {k: v for k, v in status.items() if k != "history"}
    return json.dumps(brief, default=str).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_report(status: dict, path: str) -> int:
    """Write the page to ``path``; returns its size in bytes."""
    page = build_report(status)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return len(page.encode("utf-8"))
