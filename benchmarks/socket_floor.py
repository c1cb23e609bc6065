"""The least a socket transport costs its receiver on this host: another process sends
16 MiB chunks as fast as it can, and this one ``recv_into``s them into one reused buffer,
doing nothing else (no framing, no decoding, no allocation, no page faults). Reported per
kind (a Unix stream socket, as ipc; TCP over 127.0.0.1): GB/s and the receiver's CPU s/GB
(user + system of this process). Whatever a client does over a socket costs at least this;
a shared-memory arena (``protocol/arena.py``) skips it.

Run alone: ``.venv/bin/python -m benchmarks.socket_floor [--gb 2]``; ``benchmarks/ingest.py``
prints it beside its table.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import numpy as np

CHUNK = 16 << 20


def receive_cost(kind: str, gb: float = 2.0) -> dict:
    """{"gb_s", "cpu_s_gb"} of receiving ``gb`` GB over a ``kind`` ("unix" or "tcp") socket."""
    total = int(gb * 1e9) // CHUNK * CHUNK
    if kind == "unix":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            a = socket.create_connection(listener.getsockname())
            b, _ = listener.accept()
    pid = os.fork()
    if pid == 0:  # the sender
        try:
            b.close()
            payload = memoryview(np.ones(CHUNK, np.uint8))
            for _ in range(total // CHUNK):
                a.sendall(payload)
        finally:
            os._exit(0)
    a.close()
    buf = memoryview(np.empty(CHUNK, np.uint8))
    got = 0
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        while got < total:
            n = b.recv_into(buf[got % CHUNK:], CHUNK - got % CHUNK)
            if n == 0:
                break
            got += n
    finally:
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        b.close()
        os.waitpid(pid, 0)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"gb_s": got / 1e9 / wall, "cpu_s_gb": cpu / (got / 1e9)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0)
    args = p.parse_args()
    for kind in ("unix", "tcp"):
        r = receive_cost(kind, args.gb)
        print(f"{kind}: {r['gb_s']:.2f} GB/s, receiver {r['cpu_s_gb']:.3f} CPU s/GB")


if __name__ == "__main__":
    main()
