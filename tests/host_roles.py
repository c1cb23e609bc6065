"""Programs the cross-host tests (tests/test_hosts.py) run inside a host's network namespace,
as ``python -m tests.host_roles ROLE ...``:

* ``trainer``: one rank's epoch through ``RemoteDataLoader(spec, master=..., auth=...)``; each
  batch's row ids go to ``--out`` as one JSON line as soon as it arrives (the test watches
  the file to act mid-epoch), then ``{"batches": N, "len": len(loader)}``. With
  ``--pause-after K --go FILE`` it stops after K batches until FILE exists, so that the test
  cuts a link at a known point of the epoch, whatever the machine's speed.
* ``intruder``: a peer without keys at workers' data sockets (``--worker``, repeated): to
  each, a credit for a made-up session and a message that is not one; prints
  ``{"replied": [bool per worker]}``: whether anything came back within ``--wait`` s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def trainer(args: argparse.Namespace) -> None:
    from remoteloader import RemoteDataLoader

    with open(args.out, "a", buffering=1) as out, \
            RemoteDataLoader(args.spec, master=args.master, auth=args.auth, rank=args.rank,
                             world_size=args.world_size, timeout=args.timeout) as loader:
        batches = 0
        for batch in loader:
            out.write(json.dumps(batch.passthrough["row_id"].tolist()) + "\n")
            batches += 1
            if batches == args.pause_after:
                deadline = time.monotonic() + args.timeout  # a guard against a test that never says go
                while not os.path.exists(args.go) and time.monotonic() < deadline:
                    time.sleep(0.02)
        out.write(json.dumps({"batches": batches, "len": len(loader)}) + "\n")


def intruder(args: argparse.Namespace) -> None:
    import zmq

    from remoteloader.protocol import messages as M
    from remoteloader.protocol import wire

    ctx = zmq.Context()
    socks = []
    for addr in args.worker:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        credit = M.Credit(session="s-intruder", token="00" * 64, seq=1, pieces=64, bytes=1 << 30)
        sock.send_multipart(wire.encode(credit))
        sock.send_multipart([b"not a message"])
        socks.append(sock)
    time.sleep(args.wait)
    print(json.dumps({"replied": [bool(sock.poll(0)) for sock in socks]}), flush=True)
    ctx.destroy(linger=0)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.host_roles")
    roles = p.add_subparsers(dest="role", required=True)
    t = roles.add_parser("trainer")
    t.add_argument("--spec", required=True)
    t.add_argument("--master", required=True)
    t.add_argument("--auth")
    t.add_argument("--rank", type=int, default=0)
    t.add_argument("--world-size", type=int, default=1)
    t.add_argument("--out", required=True)
    t.add_argument("--pause-after", type=int, default=0)
    t.add_argument("--go")
    t.add_argument("--timeout", type=float, default=60.0)
    i = roles.add_parser("intruder")
    i.add_argument("--worker", action="append", required=True)
    i.add_argument("--wait", type=float, default=2.0)
    args = p.parse_args(argv)
    {"trainer": trainer, "intruder": intruder}[args.role](args)


if __name__ == "__main__":
    main(sys.argv[1:])
