"""How fast sealed data frames can be on this host, and what that bounds (issue 26).

Seals and opens frames through remoteloader's own ``Sealer`` / ``Opener`` (AES-256-GCM or
ChaCha20-Poly1305 via ``cryptography``) on one thread and on two at once, beside
``openssl speed`` of the same cipher when the ``openssl`` command is present. Two threads
near twice one thread's rate say the AEAD call releases the GIL (a worker's pusher thread
then does not stall its producer). With the per-core rate R and a job moving B bytes/s,
sealing and opening cost 2B/R core-seconds per second: on a host whose cores run the
workers and the trainer alike (this benchmark machine), that is the share of rows/s a
sealed job gives up against plain frames, whatever the code around it does.

    .venv/bin/python -m benchmarks.seal_rate [--frame-kib 400] [--seconds 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time

import numpy as np

from remoteloader.protocol.seal import TO_CLIENT, Opener, Sealer


def pair() -> tuple[Sealer, Opener]:
    shared = os.urandom(32)
    return Sealer(shared, "s-bench", "w-bench", TO_CLIENT), Opener(shared, "s-bench", "w-bench", TO_CLIENT)


def seal_rate(frame: np.ndarray, seconds: float) -> float:
    """Bytes/s sealed on this thread."""
    sealer, _ = pair()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sealer.seal_frames(lambda g, c: b"header %d %d" % (g, c), [frame])
        done += frame.nbytes
    return done / (time.perf_counter() - start)


def open_rate(frame: np.ndarray, seconds: float) -> float:
    """Bytes/s opened on this thread, counting only the time inside ``Opener.open`` (the
    messages are sealed in batches between, each with a fresh counter, as on the wire)."""
    done, spent = 0, 0.0
    while spent < seconds:
        sealer, opener = pair()  # a new key per batch: counters never repeat under one
        batch = [sealer.seal_frames(lambda g, c: b"%d %d" % (g, c), [frame]) for _ in range(64)]
        for message in batch:
            first = int(message[0].split()[1])
            start = time.perf_counter()
            opener.open(message[0], 0, first, message[1:], [frame.nbytes])
            spent += time.perf_counter() - start
            done += frame.nbytes
    return done / spent


def on_threads(fn, frame: np.ndarray, seconds: float, threads: int) -> float:
    """Bytes/s of ``fn`` on ``threads`` threads at once, each timing itself by the wall clock."""
    rates = [0.0] * threads

    def run(i: int) -> None:
        rates[i] = fn(frame, seconds)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(rates)


def openssl_rate(frame_bytes: int, seconds: int) -> float | None:
    if shutil.which("openssl") is None:
        return None
    out = subprocess.run(["openssl", "speed", "-elapsed", "-seconds", str(seconds), "-bytes", str(frame_bytes),
                          "-evp", "aes-256-gcm"], capture_output=True, text=True).stdout
    line = [x for x in out.splitlines() if x.startswith("AES-256-GCM")]
    return float(line[-1].split()[-1].rstrip("k")) * 1e3 if line else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frame-kib", type=int, default=400)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args()
    frame = np.frombuffer(os.urandom(a.frame_kib << 10), dtype=np.uint8)
    sealer, _ = pair()
    print(f"cipher {sealer.cipher}, {a.frame_kib} KiB frames, {os.cpu_count()} cores")
    rows = [("seal, 1 thread", on_threads(seal_rate, frame, a.seconds, 1)),
            ("seal, 2 threads together", on_threads(seal_rate, frame, a.seconds, 2)),
            ("open, 1 thread", open_rate(frame, a.seconds))]
    ssl = openssl_rate(min(frame.nbytes, 16384), max(1, int(a.seconds)))
    if ssl is not None:
        rows.append(("openssl speed aes-256-gcm (16 KiB blocks), 1 core", ssl))
    print("| what | GB/s |\n|---|---:|")
    for what, rate in rows:
        print(f"| {what} | {rate / 1e9:.2f} |")
    seal1, open1 = rows[0][1], rows[2][1]
    print(f"sealing on two threads at once: {rows[1][1] / seal1:.2f}x one thread's rate (2x: the GIL is released)")
    for gbps in (0.25, 0.45, 1.0):
        cores = gbps * 1e9 * (1 / seal1 + 1 / open1)
        print(f"a job moving {gbps:.2f} GB/s spends {cores:.2f} cores sealing and opening")


if __name__ == "__main__":
    main()
