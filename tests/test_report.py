"""``remoteloader report`` (tools/report.py) from a canned status, ``status --watch``
(tools/watch.py) rendered without a terminal, and both against an in-process master."""
from __future__ import annotations

import re
import time

import pytest

from remoteloader.master.history import History
from remoteloader.tools import cli
from remoteloader.tools.report import CHARTS, build_report, figures

from .conftest import spec_dict
from .report_data import canned_status

# A script or stylesheet the browser would fetch: none may point at the network.
_FETCHED = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", re.I)


def test_the_page_has_every_chart_with_data_and_fetches_nothing():
    status = canned_status()
    page = build_report(status, generated_at=1_767_000_700.0)
    assert page.startswith("<!DOCTYPE html>")
    for name in CHARTS:
        assert f"id=\"chart-{name}\"" in page
    assert not _FETCHED.search(page), _FETCHED.search(page).group(0)
    assert "cdn" not in " ".join(re.findall(r"<script\b[^>]*>", page, re.I)).lower()
    # plotly.js is inline: its text holds no "</script" that would end the element early.
    assert page.count("</script>") == page.lower().count("<script")
    for name, fig in figures(status).items():
        assert fig.data, name
        assert all(len(t.y) > 0 for t in fig.data if t.y is not None), name
    workers = figures(status)["workers"]
    marks = [t for t in workers.data if t.name.startswith("autoscaler")]
    assert [t.name for t in marks] == ["autoscaler: add", "autoscaler: remove"]
    assert "stall 31.0%" in marks[0].text[0]
    cache = figures(status)["cache"]
    assert list(cache.data[0].x) == ["epoch 0", "epoch 1", "epoch 2", "epoch 3"] and cache.data[0].y[0] == 0


def test_the_page_escapes_what_the_master_says():
    page = build_report(canned_status(seconds=100, reason="<img src=x onerror=alert(1)>"))
    status_json = page.rsplit("id='status-data'>", 1)[1]
    assert "<img src=x" not in page.split("<script", 1)[0]
    assert "<img" not in status_json.split("</script>", 1)[0]
    assert "&lt;img src=x onerror=alert(1)&gt;" in page


def test_an_empty_history_still_makes_a_page():
    page = build_report({"job": None, "workers": [], "clients": [], "ranks": {}, "autoscaler": [], "errors": [],
                         "history": History().to_dict()})
    assert "no trainer connected" in page and "no epoch while the history was kept" in page


def test_watch_view_shows_workers_stall_throughput_and_reasons():
    from rich.console import Console

    from remoteloader.tools.watch import Trends, render

    status = canned_status()
    trends = Trends()
    for _ in range(3):
        trends.add(status)
    console = Console(record=True, width=200, color_system=None)
    console.print(render(status, "tcp://127.0.0.1:5555", trends, now=0))
    text = console.export_text()
    assert "w-0aa0f3c2d91" in text and "190.0 / 256" in text          # workers, held against budget
    assert "ranks" in text and re.search(r"\n.\s*0 .*%", text)           # stall per rank
    assert "123,000 rows/s" in text                                       # throughput
    assert "stall 14.2% > 10% for 30 s" in text and "idle: workers busy" in text  # the autoscaler's reasons
    console = Console(record=True, width=120, color_system=None)
    console.print(render(None, "tcp://127.0.0.1:5555", error="did not answer"))
    assert "master unreachable: did not answer" in console.export_text()


def test_watch_redraws_keeps_going_when_the_master_is_away_and_ctrl_c_exits_cleanly():
    from rich.console import Console

    from remoteloader.tools.watch import watch

    calls = []

    def fetch():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("master at tcp://127.0.0.1:1 did not answer 'status' within 1 s")
        if len(calls) == 3:
            raise KeyboardInterrupt
        return canned_status(seconds=20)

    console = Console(record=True, width=160, color_system=None, force_terminal=False)
    assert watch(fetch, "tcp://127.0.0.1:1", interval_s=0.01, console=console) == 0
    assert len(calls) == 3
    assert watch(lambda: canned_status(seconds=5), "m", interval_s=0.01, console=console, iterations=2) == 0


def test_command_line_parses_watch_and_report():
    args = cli.build_parser().parse_args(["status", "--master", "tcp://127.0.0.1:5555", "--watch", "--interval", "2"])
    assert args.watch and args.interval == 2.0
    args = cli.build_parser().parse_args(["report", "--master", "tcp://127.0.0.1:5555", "--out", "run.html",
                                          "--auth", "/k"])
    assert args.out == "run.html" and args.auth == "/k" and args.run is cli._report


def test_report_of_an_in_process_master_after_an_epoch_has_data(tables, inprocess, tmp_path, capsys):
    master = inprocess(2)
    loader = master.loader(spec_dict(tables["orc"], batch_size=100))
    try:
        assert sum(len(b) for b in loader) > 0  # one epoch
        args = cli.build_parser().parse_args(["status", "--master", master.addr])
        deadline = time.monotonic() + 30
        while True:  # a sample a second: wait for one that saw the epoch's workers and rank
            history = cli._ask_status(args, history=True)["history"]
            if (max(history["workers"], default=0) == 2 and "0" in history["stall"]
                    and any(history["rows_per_s"]) and any(history["budget_bytes"])) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert max(history["workers"]) == 2 and any(history["rows_per_s"]) and any(history["held_bytes"])
        assert history["stall"]["0"] and [e["epoch"] for e in history["cache_epochs"]] == [0]
        out = tmp_path / "run.html"
        assert cli.main(["report", "--master", master.addr, "--out", str(out)]) == 0
        assert f"wrote {out}" in capsys.readouterr().out
        page = out.read_text()
        assert not _FETCHED.search(page) and all(f"id=\"chart-{n}\"" in page for n in CHARTS)
        assert "\"rank 0\"" in page and "\"produced (workers)\"" in page
        assert "history" not in cli._ask_status(args)  # plain status stays small
        # The live view, through one RPC client kept across redraws.
        import zmq
        from rich.console import Console

        from remoteloader.protocol.rpc import RpcClient
        from remoteloader.tools.watch import watch

        rpc = RpcClient(zmq.Context.instance(), master.addr, 5.0)
        console = Console(record=True, width=200, color_system=None)
        try:
            assert watch(lambda: cli._ask_status(args, rpc=rpc), master.addr, 0.05, console, iterations=2) == 0
        finally:
            rpc.close()
        text = console.export_text()
        assert "workers: 2" in text and "rows/s" in text and "master unreachable" not in text
    finally:
        loader.close()

