"""``remoteloader``: the operator's command line (gen-data, validate, status, report, keygen, cache)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .. import __version__
from ..core.redact import redact, redact_text
from ..protocol.address import DefaultsHelpFormatter, address_type
from ..spec import SpecError


def _gen_data(args: argparse.Namespace) -> int:
    from .datagen import generate_table

    paths = generate_table(args.out, rows=args.rows, partitions=args.partitions, dense=args.dense, sparse=args.sparse,
                           format=args.format, seed=args.seed, stripe_size=args.stripe_size,
                           row_group_rows=args.row_group_rows, files_per_partition=args.files_per_partition,
                           scored=args.scored, progress=not args.quiet, layout=args.layout)
    print(f"wrote {len(paths)} files under {args.out}")
    return 0


def _flatten(args: argparse.Namespace) -> int:
    from ..storage.flatten import flatten_table

    report = flatten_table(args.src, args.dst, progress=not args.quiet, format=args.format,
                           stripe_size=args.stripe_size)
    keys = ", ".join(f"{m}: {n}" for m, n in report.keys.items())
    print(f"flattened {report.files} files, {report.rows:,} rows into {report.columns} columns ({keys}); "
          f"{'verified ' + format(report.values_verified, ',') + ' values' if report.verified else 'not verified'}; "
          f"{report.bytes_in:,} -> {report.bytes_out:,} bytes in {report.seconds:.1f} s")
    return 0


def _reorder(args: argparse.Namespace) -> int:
    from ..formats import list_table, table_schema
    from ..core.popularity import load_popularity
    from ..storage.reorder import column_order, reorder_table

    window = args.window_days * 86400 if args.window_days else None
    popularity = load_popularity(args.log, window_s=window)
    if not popularity:
        print(f"remoteloader: no job in the popularity log {args.log} (within the window)", file=sys.stderr)
        return 1
    order = column_order(list(table_schema(list_table(args.src))), popularity)
    report = reorder_table(args.src, args.dst, order, stripe_size=args.stripe_size, progress=not args.quiet)
    print(f"reordered {args.src} -> {args.dst}: first columns {', '.join(order[:8])}{' ...' if len(order) > 8 else ''}")
    print(report)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from ..core.binding import bind
    from ..core.plan import plan_base_splits
    from ..core.sizing import format_size, row_bytes
    from ..spec import DatasetSpec

    spec = DatasetSpec.from_file(args.spec)
    bound = bind(spec)
    files = bound.files or []
    splits = plan_base_splits(files, spec.split_rows)
    per_row = row_bytes(bound, files)  # a sample transformed as workers would: what a held split costs
    largest = max((s.raw_rows for s in splits), default=0)
    rows = sum(f.num_rows for f in files)
    nbytes = sum(f.nbytes for f in files)
    share = len(bound.read_columns) / max(1, len(bound.schema))
    report = {
        "table": redact(spec.table.path),  # reports end up in CI logs and tickets
        "fingerprint": spec.fingerprint(),
        "partitions": sorted({f.partition for f in files}),
        "files": len(files),
        "rows": rows,
        "splits": len(splits),
        "columns_read": bound.read_columns,
        "columns_in_table": len(bound.schema),
        "bytes_in_files": nbytes,
        "bytes_to_read_estimate": int(nbytes * share),
        "batches_per_epoch": -(-rows // spec.batch_size),
        "dense_width": bound.pipeline.dense_width,
        "sparse_features": bound.sparse_keys,
        "transformed_bytes_per_row": None if per_row is None else round(per_row, 1),
        "largest_split_bytes": None if per_row is None else int(largest * per_row),
        "files_skipped": [redact(m) for m in bound.skipped],  # on_error: skip, with why
        "files_ignored": [redact(m) for m in bound.ignored],  # under the path, of another format
    }
    if spec.table.follow is not None:
        report["follow"] = _follow_report(spec, files)
    if spec.tables:
        report["mix"] = _mix_report(spec, files, bound.file_tables)
        report["batches_per_epoch"] = report["mix"]["batches_per_epoch"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"spec {args.spec} is valid (fingerprint {report['fingerprint']})")
        print(f"  table        {report['table']}")
        print(f"  partitions   {len(report['partitions'])}: {', '.join(report['partitions'][:5])}"
              f"{' ...' if len(report['partitions']) > 5 else ''}")
        print(f"  files        {report['files']}, {rows:,} rows in {report['splits']} splits")
        print(f"  columns      {len(bound.read_columns)} of {len(bound.schema)}: {', '.join(bound.read_columns)}")
        print(f"  bytes        about {report['bytes_to_read_estimate']:,} of {nbytes:,} "
              f"(projected share of the files)")
        print(f"  batches      {report['batches_per_epoch']} of {spec.batch_size} rows per epoch; "
              f"dense width {report['dense_width']}, sparse {len(bound.sparse_keys)}")
        if per_row is not None:
            print(f"  held         about {format_size(per_row)} a row once transformed: the largest split "
                  f"({largest:,} rows) about {format_size(largest * per_row)} in a worker (a master plans splits "
                  f"within half its --buffer-bytes)")
        for line in report["files_skipped"] + report["files_ignored"]:
            print(f"  not read     {line}")
        if "follow" in report:
            f = report["follow"]
            print(f"  follows      re-listed every {f['every_s']:g} s, "
                  + (f"up to and including partition {f['until']}" if f["until"] else "for ever (no until)")
                  + f"; watermark {f['watermark'] or '(the table root)'}; window 0 is what the listing holds when "
                  "the first epoch starts, each later window what landed since")
            if f["ends_at_once"]:
                print(f"  follows      partition {f['until']} is listed already: the stream ends after window 0")
            if f["after_until"]:
                print(f"  not read     partitions after until: {', '.join(f['after_until'][:5])}"
                      f"{' ...' if len(f['after_until']) > 5 else ''}")
        for i, t in enumerate(report.get("mix", {}).get("tables", ())):
            print(f"  tables[{i}]    {t['path']}: {t['files']} files, {t['rows']:,} rows; weight {t['weight']}: "
                  f"{t['rows_per_batch']} rows a batch, {t['rows_per_epoch']:,} rows ({t['passes']} passes) an "
                  f"epoch on one rank; when done: {t['when_done']}")
        for seg in report.get("mix", {}).get("segments", ()):
            print(f"  batches      {seg['first_batch']}..{seg['first_batch'] + seg['batches'] - 1}: rows of each "
                  f"table {seg['rows']}")
    return 0


def _follow_report(spec, files) -> dict:
    """What a following spec reads now and later (``table.follow``): the partitions after its
    ``until`` already present are never read."""
    from ..formats import in_stream, list_table, reaches

    until = spec.table.follow["until"]
    after = [] if until is None else sorted({f.partition for f in list_table(spec.table.path, spec.table.format,
                                                                              spec.table.partitions)
                                              if not in_stream(f.partition, until)})
    return {"every_s": spec.table.follow["every"], "until": until,
            "watermark": max((f.partition for f in files), key=lambda p: tuple(p.split("/")), default=""),
            "ends_at_once": any(reaches(f.partition, until) for f in files), "after_until": after}


def _mix_report(spec, files: list, file_tables: list[int]) -> dict:
    """A mix's epoch on one rank (core/mix.py), with each table's path and files."""
    from ..core.mix import mix_report

    rows = [sum(f.num_rows for f, t in zip(files, file_tables) if t == i) for i in range(len(spec.tables))]
    report = mix_report(spec.batch_size, [t.weight for t in spec.tables], [t.when_done for t in spec.tables], rows)
    for i, (entry, table) in enumerate(zip(report["tables"], spec.tables)):
        entry.update(path=redact(table.table.path), files=sum(1 for t in file_tables if t == i),
                     columns=dict(table.columns))
    return report


def _ask_status(args: argparse.Namespace, history: bool = False, rpc=None) -> dict:
    """The master's status (``history``: with the run over time); ``rpc``: a client to reuse."""
    import zmq

    from ..protocol import auth as cluster_auth
    from ..protocol.messages import Status
    from ..protocol.rpc import MasterUnavailable, RpcClient

    creds = cluster_auth.from_option(args.auth)  # AuthError is a ValueError: one line, exit 1
    own = rpc is None
    rpc = rpc or RpcClient(zmq.Context.instance(), args.master, args.timeout, auth=creds)
    try:
        return rpc.call(Status(history=history)).status
    except MasterUnavailable as e:
        hint = ("" if creds is not None else
                f" (a master started with --auth answers only peers holding its keys: pass --auth DIR "
                f"or set {cluster_auth.ENV_AUTH})")
        raise MasterUnavailable(f"{e}{hint}") from None
    finally:
        if own:
            rpc.close()


def _watch(args: argparse.Namespace) -> int:
    import zmq

    from ..protocol import auth as cluster_auth
    from ..protocol.rpc import RpcClient
    from .watch import watch

    rpc = RpcClient(zmq.Context.instance(), args.master, args.timeout, auth=cluster_auth.from_option(args.auth))
    try:
        return watch(lambda: _ask_status(args, rpc=rpc), args.master, interval_s=args.interval)
    finally:
        rpc.close()


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    status = _ask_status(args, history=True)
    size = write_report(status, args.out)
    samples = len((status.get("history") or {}).get("time", []))
    print(f"wrote {args.out} ({size / (1 << 20):.1f} MiB, {samples} samples): one page, charts inlined; "
          "open it in a browser, it needs no network")
    return 0


def _status(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(args)
    status = _ask_status(args)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    job = status["job"]
    print(job_header(job))
    jobs = status.get("jobs", [])
    if len(jobs) > 1:  # a shared fleet: a line per job
        print(f"jobs: {len(jobs)} of at most {status.get('max_jobs', '?')}")
        for j in jobs:
            print(job_line(j))
    shared = status.get("shared_work")
    if shared:  # blocks one job took that another computed, and the master's choices that made them meet
        print(f"shared work: {shared.get('hits', 0):,.0f} blocks ({_mib(shared.get('hit_bytes', 0))} MiB) taken from "
              f"another job's, {shared.get('puts', 0):,.0f} kept, {shared.get('expired', 0):,.0f} expired unread; "
              f"splits left to their blocks' worker {shared.get('deferred', 0):,}, waits {shared.get('waited', 0):,}")
    pending = status.get("pending_workers", 0)
    print(f"workers: {len(status['workers'])}" + (f" (+{pending} pending: launched, not started yet)" if pending else ""))
    for w in status["workers"]:
        print(worker_line(w))
    for c in status["clients"]:
        print(f"client {c['id']} rank {c['rank']}: stall {c.get('stall', 0):.1%}  "
              f"{c.get('batches_per_s', 0):.1f} batches/s  queued {c.get('queued', 0)}")
    for i, t in enumerate((job or {}).get("mix", {}).get("tables", ())):
        print(f"tables[{i}] {t['path']}: weight {t['weight']} ({t['rows_per_batch']} rows a batch), "
              f"{t['rows_read']:,} rows read this epoch ({t['share_read']:.1%} of the mix), "
              f"when done: {t['when_done']}")
    of_job = f" (job {job.get('key', job['fingerprint'])})" if job and job.get("oldest_of") else ""
    for rank, r in status["ranks"].items():
        print(f"rank {rank}{of_job}: epoch {r['epoch']}  splits {r['done']}/{r['splits']} done, {r['pending']} pending")
    for j in jobs:
        if j.get("follow"):
            print(follow_line(j))
    for d in status.get("autoscaler", [])[-5:]:
        print(f"autoscaler: {d['action']} {d['count']} -> {d['workers']} workers: {d['reason']}")
    cache = status.get("cache")
    if cache:
        n = cache.get("counters", {})
        print(f"cache: {cache['location']}  mode {cache.get('mode', '?')}  hits {n.get('hits', 0):,.0f}  "
              f"misses {n.get('misses', 0):,.0f}  puts {n.get('puts', 0):,.0f}  corrupt {n.get('corrupt', 0):,.0f}  "
              f"faults {n.get('faults', 0):,.0f}  read {_mib(n.get('bytes_read', 0))} MiB")
        for g in cache.get("groups", []):
            print(f"  group {g['group']} ({', '.join(g['features'])}): {g['mode']}: {g['reason']}")
        for key, policy in cache.get("jobs", {}).items():  # a shared fleet: each job's own policy
            print(f"  job {key}: mode {policy.get('mode', '?')}")
            for g in policy.get("groups", []):
                print(f"    group {g['group']} ({', '.join(g['features'])}): {g['mode']}: {g['reason']}")
    for e in status["errors"]:
        print(f"error ({'skipped' if e['skipped'] else 'fatal'}): {e['message'][:300]}")
    return 0


def job_header(job: Optional[dict]) -> str:
    """``status``'s first line: the job its ``job`` and ``ranks`` entries describe, which on a
    shared fleet is only the oldest of its jobs (every job has its line under ``jobs``)."""
    if not job:
        return "job: none yet"
    line = f"job: {job.get('key', job['fingerprint'])} {job['table']} ({job['rows']:,} rows, {job['splits']} splits)"
    if job.get("oldest_of"):
        line += f"; the oldest of the {job['oldest_of']} jobs this master serves (its ranks below; every job's line follows)"
    return line


def job_line(j: dict) -> str:
    """One job of a shared fleet in ``status``: who it is, how far, and what it gets."""
    def pct(x: object) -> str:
        return "-" if x is None else f"{x:.0%}"

    world = "idle" if j.get("world_size") is None else f"world size {j['world_size']}"
    return (f"  job {j.get('job', j['fingerprint'])} {j['table']}: {world}, {j.get('clients', 0)} clients, "
            f"epoch {'-' if j.get('epoch') is None else j['epoch']} {pct(j.get('progress'))} done, "
            f"{j.get('rows_per_s', 0):,.0f} rows/s (share {pct(j.get('share'))}, weight {j.get('weight', 1):g} "
            f"{j.get('priority', 'normal')}), stall {j.get('stall', 0):.1%}")


def follow_line(j: dict) -> str:
    """A following job's stream in ``status``: its watermark, windows and last re-listing."""
    f = j["follow"]
    window = f.get("window")
    listing = ("" if f.get("listings") is None else
               f"; {f['listings']} listings, the last {f.get('last_listing_age_s')} s ago took "
               f"{f.get('last_listing_s', 0):.3f} s ({f.get('last_listing_cpu_s', 0):.3f} s CPU) for "
               f"{f.get('listed_files', 0):,} files" + (f", failed: {f['error']}" if f.get("error") else ""))
    return (f"follow {j.get('job', j['fingerprint'])}: watermark {f['watermark'] or '-'}"
            + (f" (until {f['until']})" if f.get("until") else "") + f", {f['files']} files; "
            + (f"window {window['epoch']}: {window['rows']:,} rows" if window else "no window yet")
            + f", {f['waiting_rows']:,} rows waiting for the next" + ("; ENDED" if f["ended"] else "") + listing)


def worker_line(w: dict) -> str:
    """One worker in ``status``: what it holds against the byte budget it enforces (its
    ``--buffer-bytes``), and its pieces as a count (read-ahead pieces may pass the buffer's
    nominal capacity in pieces: that is no limit, the bytes are)."""
    if w.get("held_bytes") is not None:
        held = (f"held {_mib(w['held_bytes'])}/{_mib(w.get('budget_bytes'))} MiB (ahead {_mib(w.get('ahead_bytes'))}) "
                f"in {w['buffered']} pieces")
    else:  # a worker that reports no bytes (an older one)
        held = f"buffered {w['buffered']}/{w.get('capacity', '?')} pieces"
    return (f"  {w['id']}  {w['addr']}  pid {w['pid']}{'  DRAINING' if w.get('draining') else ''}  {held}  "
            f"assigned {w['assigned']}  {w.get('rows_per_s', 0):,.0f} rows/s  busy {w.get('busy', 0):.0%}  "
            f"cpu {w.get('cpu', 0):.0%}")


def _mib(nbytes: Optional[float]) -> str:
    return "?" if nbytes is None else f"{nbytes / (1 << 20):,.1f}"


def _keygen(args: argparse.Namespace) -> int:
    from ..protocol import auth as cluster_auth

    directory = cluster_auth.keygen(args.directory)
    print(f"wrote the cluster key pair to {directory} (mode 0700; files 0600). Copy the whole directory to every "
          f"machine of the cluster and pass --auth {directory} (or set {cluster_auth.ENV_AUTH}) to "
          "remoteloader-master, remoteloader-worker, remoteloader status and RemoteDataLoader(auth=...)")
    return 0


def _size(text: str) -> int:
    from ..core.sizing import parse_size  # here: it imports the transforms, slow for every other command

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cache_store(args: argparse.Namespace):
    """The store at ``args.uri``, held to the same rules as a master's or worker's (this
    user's, writable by nobody else) unless ``--shared``; never made if missing. Every name
    goes through ``core/cache/fs.py``: a planted link is skipped and counted, never followed."""
    from ..core.cache.segments import BlockSigner
    from ..core.cache.store import BlockStore
    from ..protocol import auth as cluster_auth

    return BlockStore(args.uri, BlockSigner.for_credentials(cluster_auth.from_option(args.auth)),
                      shared=args.shared, create=False)


def _skipped_line(skipped: int) -> None:
    if skipped:
        print(f"{skipped} entries skipped (symlinks, non-regular files, or other users' in a private cache): "
              "never followed, read or deleted")


def _cache_ls(args: argparse.Namespace) -> int:
    import datetime

    from ..core.sizing import format_size

    store = _cache_store(args)
    entries = store.entries()
    print(f"{'split':<40} {'segments':>8} {'blocks':>7} {'bytes':>12}  last used (UTC)")
    for e in entries:
        used = datetime.datetime.fromtimestamp(e.last_used, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{e.split_key:<40} {e.segments:>8} {e.blocks:>7} {e.bytes:>12,}  {used}")
    print(f"{len(entries)} splits, {sum(e.segments for e in entries)} segments, {sum(e.blocks for e in entries)} "
          f"blocks, {format_size(sum(e.bytes for e in entries))}")
    _skipped_line(store.skipped)
    return 0


def _cache_gc(args: argparse.Namespace) -> int:
    from ..core.sizing import format_size

    result = _cache_store(args).gc(args.max_bytes)
    print(f"deleted {result.deleted_splits} splits ({format_size(result.deleted_bytes)}) and "
          f"{result.deleted_temps} stale temp files; {format_size(result.remaining_bytes)} left "
          f"(bound {format_size(args.max_bytes)})")
    _skipped_line(result.skipped)
    return 0


def _cache_verify(args: argparse.Namespace) -> int:
    result = _cache_store(args).verify(delete=args.delete)
    for path, reason in result.corrupt:
        print(f"CORRUPT{' (deleted)' if path in result.deleted else ''}  {path}: {reason}")
    for path, reason in result.unverifiable:
        print(f"unverifiable  {path}: {reason}")
    hint = " (pass --auth DIR to check keyed segments)" if result.unverifiable and not args.auth else ""
    print(f"{result.segments} segments, {result.blocks} blocks verified; {len(result.corrupt)} corrupt, "
          f"{len(result.unverifiable)} unverifiable{hint}")
    _skipped_line(result.skipped)
    return 1 if result.corrupt else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remoteloader", description="remoteloader's command line: synthetic data, "
                                "table rewrites, spec checks and a running master's status.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_[:1].upper() + help_[1:] + ".",
                              formatter_class=DefaultsHelpFormatter)

    g = command("gen-data", "write a synthetic Hive-partitioned recommendation table")
    g.add_argument("--out", required=True, metavar="DIR", help="directory of the table (created)")
    g.add_argument("--rows", type=int, required=True, help="rows in the whole table")
    g.add_argument("--partitions", type=int, default=1, help="Hive partitions (ds=...) the rows are spread over")
    g.add_argument("--files-per-partition", type=int, default=1, help="files in each partition")
    g.add_argument("--dense", type=int, default=13, help="dense (float) features")
    g.add_argument("--sparse", type=int, default=26, help="sparse (id list) features")
    g.add_argument("--scored", type=int, default=0, help="scored sparse features (id list + score list)")
    g.add_argument("--format", choices=("orc", "parquet"), default="orc", help="file format")
    g.add_argument("--seed", type=int, default=0, help="random seed (the same seed writes the same table)")
    g.add_argument("--stripe-size", type=int, default=64 << 20, help="ORC stripe size in bytes")
    g.add_argument("--row-group-rows", type=int, default=128 * 1024, help="Parquet row-group size in rows")
    g.add_argument("--layout", choices=("flat", "map"), default="flat",
                   help="flat: one column per feature; map: production map columns (float_features, ...)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(run=_gen_data)

    f = command("flatten", "rewrite a map-column table with one column per feature")
    f.add_argument("src", help="directory of the map-column table")
    f.add_argument("dst", help="directory of the flattened table (created)")
    f.add_argument("--format", choices=("orc", "parquet"), help="output format (without it: the source's)")
    f.add_argument("--stripe-size", type=int, help="output stripe size in bytes (without it: the source's stripes)")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.set_defaults(run=_flatten)

    r = command("reorder", "rewrite a table with popular columns first and together")
    r.add_argument("src", help="directory of the table")
    r.add_argument("dst", help="directory of the reordered table (created)")
    r.add_argument("--log", required=True, metavar="FILE",
                   help="popularity log (popularity.jsonl beside the master's journal)")
    r.add_argument("--window-days", type=float, help="only jobs of the last N days (without it: all)")
    r.add_argument("--stripe-size", type=int, help="output stripe size in bytes (large stripes: fewer requests; "
                   "without it: the source's stripes)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(run=_reorder)

    v = command("validate", "check a spec against its table and show what it would read")
    v.add_argument("spec", help="dataset spec (YAML/JSON)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(run=_validate)

    s = command("status", "show a running master's workers, progress and errors")
    s.add_argument("--master", required=True, type=address_type(), metavar="tcp://HOST:PORT",
                   help="the master's address, as it printed it")
    s.add_argument("--json", action="store_true", help="print the master's whole status as JSON")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the master's answer")
    s.add_argument("--auth", metavar="DIR",
                   help="key directory of a master started with --auth (without it: $REMOTELOADER_AUTH, else none)")
    s.add_argument("--watch", action="store_true", help="a live view, redrawn every --interval s (Ctrl-C exits)")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between redraws of --watch")
    s.set_defaults(run=_status)

    rp = command("report", "write one self-contained HTML page of a running master's history (charts; no network "
                 "needed to open it)")
    rp.add_argument("--master", required=True, type=address_type(), metavar="tcp://HOST:PORT",
                    help="the master's address, as it printed it")
    rp.add_argument("--out", required=True, metavar="FILE", help="the page to write (e.g. run.html)")
    rp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the master's answer")
    rp.add_argument("--auth", metavar="DIR",
                    help="key directory of a master started with --auth (without it: $REMOTELOADER_AUTH, else none)")
    rp.set_defaults(run=_report)

    k = command("keygen", "write a cluster key directory for --auth (CURVE keys; 0700/0600)")
    k.add_argument("directory", metavar="DIR", help="directory to write (created; refuses to overwrite a key)")
    k.set_defaults(run=_keygen)

    c = command("cache", "list, bound or check a feature-block cache (a directory or filesystem URI)")
    actions = c.add_subparsers(dest="cache_command", required=True, metavar="ACTION")

    def cache_action(name: str, help_: str, run) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help_, description=help_[:1].upper() + help_[1:] + ".",
                               formatter_class=DefaultsHelpFormatter)
        a.add_argument("uri", metavar="URI", help="the cache location (the --cache of masters and workers)")
        a.add_argument("--auth", metavar="DIR", help="key directory of a cluster run with --auth, so its keyed "
                       "blocks verify (without it: $REMOTELOADER_AUTH, else none)")
        a.add_argument("--shared", action="store_true",
                       help="the location is shared with other users (the --cache-shared of masters and workers): "
                            "it need not be this user's or closed to others. Without it a local location must be "
                            "this user's (or root's) and writable by nobody else")
        a.set_defaults(run=run)
        return a

    cache_action("ls", "list the cached splits: segments, blocks, bytes, last use", _cache_ls)
    cg = cache_action("gc", "delete the least recently used splits until the cache fits a byte bound", _cache_gc)
    cg.add_argument("--max-bytes", required=True, type=_size, metavar="BYTES",
                    help="bytes the cache may hold (or a number with K, M, G or T, e.g. 10G)")
    cv = cache_action("verify", "read and check every block; exit 1 if any is corrupt", _cache_verify)
    cv.add_argument("--delete", action="store_true", help="delete the corrupt segments")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except SpecError as e:  # errors name tables and files: no credential of a URI goes with them
        print(f"remoteloader: {redact_text(str(e))}", file=sys.stderr)
        return 2
    except (ConnectionError, RuntimeError, ValueError) as e:
        print(f"remoteloader: {redact_text(str(e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
