"""A multi-node torchrun job's per-job key set, held in a private key directory for one loader.

Rank 0 makes a fresh CURVE key pair for the job's embedded master, its workers and its ranks,
and publishes it in torch.distributed's store, which every rank already trusts to meet (the
store is not authenticated: whoever can read it can join the job, as they can join torch's
own collectives; docs/security.md). Each rank writes it into a key directory of its own
(``auth.write_key_directory``: a fresh 0700 temporary directory, 0600 files), which the
loader, and on a node's first rank that node's workers, load like any ``--auth`` directory.
The loader removes it at close, or at garbage collection or exit if never closed.
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any

import zmq

from ..protocol import auth


class JobKeys:
    """One loader's copy of the job's key set; ``directory`` is an ``--auth`` key directory."""

    def __init__(self, public: bytes, secret: bytes) -> None:
        self.public, self.secret = public, secret
        self.directory = tempfile.mkdtemp(prefix="rl-job-keys-")  # 0700, a fresh unpredictable name
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, True)
        try:
            auth.write_key_directory(self.directory, public, secret)
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls) -> "JobKeys":
        """A fresh key set for a new job (rank 0)."""
        return cls(*zmq.curve_keypair())

    @classmethod
    def received(cls, published: Any) -> "JobKeys":
        """The key set rank 0 published (``published()``); AuthError for anything but two Z85 keys."""
        if not isinstance(published, dict) or not all(isinstance(published.get(k), str) for k in ("public", "secret")):
            raise auth.AuthError("the job's key set in torch.distributed's store is not {public, secret}")
        return cls(published["public"].encode(), published["secret"].encode())

    def published(self) -> dict[str, str]:
        """The key set as plain data for the store."""
        return {"public": self.public.decode(), "secret": self.secret.decode()}

    def close(self) -> None:
        """Remove the directory (idempotent)."""
        self._remove()
