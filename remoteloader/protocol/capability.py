"""Capabilities the master issues, so that members act only as what the master admitted
them as (docs/security.md, "Capabilities between members").

* A **session token** (``welcome.token``): the master's Ed25519 signature of the client
  session id and the session's X25519 public key (``hello.key``, protocol 10), so a token
  cannot be replayed with another key (protocol/seal.py). A worker serves a run's pieces
  only to a connection whose ``credit`` carries a token that verifies under the master's
  public key (``registered.verify_key``).
* A **worker token** (``registered.token``): HMAC-SHA256 of the worker id under a key of
  the master's. Every request naming a worker id (heartbeat, get_split, the split reports,
  drain, bye) must carry it.

Why not a key derived from the cluster secret: every member holds that secret (one key
pair is every component's), so a token derived from it is one any member can compute.
These keys come from a seed only the master holds: random, and with ``--journal`` kept
beside the journal (0600) so that the sessions and workers a restarted master replays
keep tokens that verify. Workers get only the public half, so a member that registers as
a worker learns nothing that signs. Tokens travel like every other field: inside CURVE
with keys, in clear without (then anyone on the path can read and replay them).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections import OrderedDict
from typing import Optional, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SEED_FILE = "capability.key"  # in the master's journal directory
SEED_BYTES = 32
MAX_WORKER_TOKENS = 1 << 14  # worker ids whose token the master keeps computed


def session_message(session: str, key: str = "") -> bytes:
    """What a session token signs: the session id and the session's public key (hex)."""
    return b"remoteloader session\x00" + session.encode() + b"\x00" + key.encode()


def _derive(seed: bytes, purpose: bytes) -> bytes:
    """One key per purpose (HKDF-Expand, one block): a token of one kind never verifies as another."""
    return hmac.new(seed, b"remoteloader capability " + purpose + b"\x01", hashlib.sha256).digest()


class MasterKeys:
    """The master's signing key and worker-token key, from one seed."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"a capability seed is {SEED_BYTES} bytes, got {len(seed)}")
        self._signer = Ed25519PrivateKey.from_private_bytes(_derive(seed, b"session"))
        self._worker_key = _derive(seed, b"worker")
        self._worker_tokens: dict[str, bytes] = {}
        self.verify_key: str = self._signer.public_key().public_bytes_raw().hex()

    @classmethod
    def ephemeral(cls) -> "MasterKeys":
        """For a master without a journal: its sessions and workers die with it anyway."""
        return cls(secrets.token_bytes(SEED_BYTES))

    @classmethod
    def stored(cls, directory: Union[str, os.PathLike]) -> "MasterKeys":
        """The seed in ``directory`` (the journal's), made there (0600) on first use."""
        path = os.path.join(os.fspath(directory), SEED_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            with open(path, "rb") as f:
                seed = f.read()
            if len(seed) != SEED_BYTES:
                raise ValueError(f"{path}: not a capability seed ({len(seed)} bytes); remove it to make a new one "
                                 "(every client and worker then joins again)") from None
            return cls(seed)
        seed = secrets.token_bytes(SEED_BYTES)
        with os.fdopen(fd, "wb") as f:
            f.write(seed)
            f.flush()
            os.fsync(f.fileno())
        return cls(seed)

    def session_token(self, session: str, key: str = "") -> str:
        return self._signer.sign(session_message(session, key)).hex()

    def worker_token(self, worker_id: str) -> str:
        return hmac.new(self._worker_key, worker_id.encode(), hashlib.sha256).hexdigest()

    def worker_token_ok(self, worker_id: str, token: str) -> bool:
        # Checked on every heartbeat and split request: the HMAC of a known worker id is
        # computed once (a bounded memo: ids are the master's own, made at registration).
        expected = self._worker_tokens.get(worker_id)
        if expected is None:
            if len(self._worker_tokens) >= MAX_WORKER_TOKENS:
                self._worker_tokens.clear()
            expected = self._worker_tokens[worker_id] = self.worker_token(worker_id).encode()
        return hmac.compare_digest(expected, token.encode("utf-8", "replace"))


class SessionTokens:
    """A worker's check of ``credit.token``: which connections proved they act for a session.

    Each (connection, session) pays one signature check, on its first credit; the verdict
    is cached, so later credit costs a dict lookup. Only proofs are cached (bounded,
    oldest out first): made-up tokens cost a check each and leave nothing behind.
    """

    MAX_PROVEN = 1 << 14

    def __init__(self) -> None:
        self._key: Optional[Ed25519PublicKey] = None
        self._proven: OrderedDict[tuple[bytes, str, str], None] = OrderedDict()

    def set_master(self, verify_key: str) -> None:
        """The public key of the master this worker registered with (a plain reference
        swap: the pusher thread reads it)."""
        try:
            self._key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(verify_key))
        except ValueError as e:
            raise ValueError(f"the master's verify_key is not an Ed25519 public key: {e}") from None

    def allows(self, identity: bytes, session: str, token: str, key: str = "") -> bool:
        """Whether ``token`` is the master's signature of ``session`` with ``key``."""
        proof = (identity, session, key)
        if proof in self._proven:
            return True
        master = self._key
        if master is None:  # not registered yet: no run of ours can be credited
            return False
        try:
            master.verify(bytes.fromhex(token), session_message(session, key))
        except (ValueError, InvalidSignature):
            return False
        self._proven[proof] = None
        if len(self._proven) > self.MAX_PROVEN:
            self._proven.popitem(last=False)
        return True
