"""Process set-up: child processes that never outlive their parent, and where compiled
kernels are cached."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def kernel_cache_dir() -> str:
    """Where remoteloader's processes keep numba's compiled kernels: ``$NUMBA_CACHE_DIR``
    if set, else a per-user directory, so every process after the first on a machine
    loads them instead of compiling (also when the package is installed read-only)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("NUMBA_CACHE_DIR") or os.path.join(base, "remoteloader", "numba")


def kernels_cached() -> bool:
    """Whether compiled kernels are in the cache already (an index of numba's there), so a
    start loads them rather than compiling: what a first start on a machine lacks."""
    root = kernel_cache_dir()
    for _, _, names in os.walk(root):
        if any(n.endswith(".nbi") for n in names):
            return True
    return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process ``sig`` when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)


def set_process_name(name: str) -> None:
    """The name ``ps -e``, ``top`` and psutil's ``name()`` show (Linux, at most 15 bytes):
    a forked process keeps its parent's command line, but not its parent's name."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; always reaps the child."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
