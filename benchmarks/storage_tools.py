"""The offline tools' growth: ``flatten`` and ``reorder`` of one file at growing row counts.

Issue 38: both grew about 4x per doubling of the rows (``flatten`` of one file: 3.0 s at
15k rows, 13.6 s at 30k, 56 s at 60k). The bar: 4x the rows in at most 5x the time.

For each row count, one map-column file (``remoteloader gen-data --layout map``, 13 dense
and 26 sparse features, as the README shows; ~1.9 kB per row, ~36k rows per 64 MiB
stripe) is flattened (``flatten_table``, verified, as ``remoteloader flatten`` does),
and the flattened file is reordered as the README's ``remoteloader reorder ...
--stripe-size 67108864`` does (popular columns first; ~47k rows per output stripe),
verified. Each run is a fresh process (its peak RSS is reported); inputs are generated
once under ``--data`` and reused (240k rows: ~0.45 GB map file + ~0.35 GB flattened).

``--before DIR`` runs every case a second time on another copy of the package, e.g.
the code before a change (``git archive COMMIT remoteloader | tar -x -C DIR``), side by side;
``--timeout`` (``--before-timeout``) stops a run that takes longer (reported as ``>N``).

Each case runs ``--repeat`` times (default 2; a run past ``--repeat-below`` seconds is
not repeated) and the fastest counts: the VM these numbers come from is shared.

Run: ``.venv/bin/python -m benchmarks.storage_tools [--rows 15000 60000 240000]
[--before DIR] [--timeout 300] [--data data/bench_storage_tools]``. After: about 2.5
minutes on a shared 2-core VM, plus about 1.5 minutes to generate the inputs the first
time. Shrink: ``--rows 15000 60000`` (one ratio), ``--repeat 1``, ``--sparse 8`` (narrower
rows), ``--no-reorder``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
REORDER_STRIPE_SIZE = 64 << 20  # the README's --stripe-size 67108864

# Runs in a fresh interpreter (so ``--before`` can put another package first on its path).
_CHILD = r"""
import json, resource, shutil, sys, time
tool, src, dst, stripe_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
shutil.rmtree(dst, ignore_errors=True)
import remoteloader
from remoteloader.formats import list_table, table_schema
start = time.perf_counter()
if tool == "flatten":
    from remoteloader.storage import flatten_table
    report = flatten_table(src, dst, progress=False)
else:
    from remoteloader.storage import column_order, reorder_table
    columns = list(table_schema(list_table(src)))
    # Popularity: every third feature column read by many jobs, the rest by none.
    order = column_order(columns, {c: 1 + i % 7 for i, c in enumerate(columns[3::3])})
    report = reorder_table(src, dst, order, stripe_size=stripe_size or None, progress=False)
seconds = time.perf_counter() - start
units = [len(f.units) for f in list_table(dst)]
shutil.rmtree(dst, ignore_errors=True)
print(json.dumps({"seconds": seconds, "rows": report.rows, "units": sum(units), "verified": report.verified,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "package": remoteloader.__file__}))
"""


def generate(data: Path, rows: int, dense: int, sparse: int) -> tuple[Path, Path]:
    """(the map-column table, it flattened), made once per parameter set."""
    base = data / f"r{rows}-d{dense}-s{sparse}"
    maps, flat = base / "maps", base / "flat"
    if not (base / "done").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        cli = [sys.executable, "-m", "remoteloader.tools.cli"]
        subprocess.run(cli + ["gen-data", "--out", str(maps), "--rows", str(rows), "--layout", "map",
                              "--dense", str(dense), "--sparse", str(sparse), "--quiet"], check=True, cwd=ROOT)
        subprocess.run(cli + ["flatten", str(maps), str(flat), "--quiet"], check=True, cwd=ROOT)
        (base / "done").write_text("")
    return maps, flat


def run(tool: str, src: Path, dst: Path, package: Optional[str], timeout: float) -> Optional[dict]:
    """One timed run in a fresh process; None if it ran past ``timeout``."""
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = os.pathsep.join([package, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    stripe = REORDER_STRIPE_SIZE if tool == "reorder" else 0
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, tool, str(src), str(dst), str(stripe)], env=env,
                             cwd="/", capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        shutil.rmtree(dst, ignore_errors=True)
        return None
    except subprocess.CalledProcessError as e:
        sys.exit(f"{tool} failed:\n{e.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _seconds(r: Optional[dict], timeout: float) -> str:
    return f">{timeout:.0f}" if r is None else f"{r['seconds']:.1f}"


def _rate(r: Optional[dict]) -> str:
    return "-" if r is None else f"{r['rows'] / r['seconds']:,.0f}"


def _ratio(big: Optional[dict], small: Optional[dict], timeout: float) -> str:
    if small is None:
        return "-"
    if big is None:
        return f">{timeout / small['seconds']:.1f}"
    return f"{big['seconds'] / small['seconds']:.2f}"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[15000, 60000, 240000], help="rows per file")
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--sparse", type=int, default=26)
    p.add_argument("--data", default=str(ROOT / "data" / "bench_storage_tools"), help="inputs are kept here")
    p.add_argument("--before", metavar="DIR", help="also run each case with the remoteloader package in DIR")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is stopped")
    p.add_argument("--before-timeout", type=float, help="the same for --before's runs (default: --timeout)")
    p.add_argument("--repeat", type=int, default=2, help="runs per case, the fastest counts")
    p.add_argument("--repeat-below", type=float, default=60.0, help="...but only runs faster than this many seconds")
    p.add_argument("--no-reorder", action="store_true")
    args = p.parse_args(argv)

    data = Path(args.data)
    tools = ["flatten"] + ([] if args.no_reorder else ["reorder"])
    versions = [("after", None)] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    timeouts = {"after": args.timeout, "before": args.before_timeout or args.timeout}
    results: dict[tuple[str, str, int], Optional[dict]] = {}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    for rows in args.rows:
        maps, flat = generate(data, rows, args.dense, args.sparse)
        for tool in tools:
            for name, package in versions:
                best: Optional[dict] = None
                for _ in range(args.repeat):  # best of --repeat: the VM is shared
                    r = run(tool, maps if tool == "flatten" else flat, data / f"out-{name}", package, timeouts[name])
                    extra = "" if r is None else f", {r['units']} stripes out, peak RSS {r['rss_mb']:.0f} MB"
                    print(f"  {tool} {rows:,} rows ({name}): {_seconds(r, timeouts[name])} s{extra}", flush=True)
                    if r is None:
                        best = None
                        break
                    best = r if best is None or r["seconds"] < best["seconds"] else best
                    if r["seconds"] > args.repeat_below:
                        break
                results[(name, tool, rows)] = best

    print(f"\n{args.dense} dense + {args.sparse} sparse features per row; one file per table; "
          f"load average {load:.1f} at the start; {time.perf_counter() - t0:.0f} s in all\n")
    names = [n for n, _ in versions]
    head = ["tool", "rows"] + [f"{c} ({n})" for n in names for c in ("s", "rows/s", "x time for 4x rows")]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(head) - 2))
    for tool in tools:
        for i, rows in enumerate(args.rows):
            cells = [tool, f"{rows:,}"]
            for name in names:
                r = results[(name, tool, rows)]
                smaller = [x for x in args.rows[:i] if rows == 4 * x]
                ratio = _ratio(r, results[(name, tool, smaller[0])], timeouts[name]) if smaller else ""
                cells += [_seconds(r, timeouts[name]), _rate(r), ratio]
            print("| " + " | ".join(cells) + " |")
    print("\nbar (issue 38): 4x the rows in at most 5x the time")


if __name__ == "__main__":
    main()
