"""Secrets that ride in table URIs stay out of what others can read.

A table URI may carry credentials: userinfo (``s3://KEY:SECRET@bucket/t``, which spec
loading refuses) or query values (an Azure ``client_secret``, a presigned URL's
``X-Amz-Signature``). The master and its workers need the URI as given to read the
table, so it travels only where it must: over the authenticated ``get_spec``, in the
journal and in a launched process's environment (``/proc/PID/environ`` is its owner's
alone), never on a command line (``/proc/PID/cmdline`` is anyone's). Every rendering
for people (status, metrics, logs, errors, the loader's banner, the popularity log)
goes through ``redact`` / ``redact_text`` first; files that keep state are private to
their owner (directories 0700, files 0600).
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Sequence
from urllib.parse import unquote

MASK = "***"
# Query keys whose values are masked: any key containing one of these words (over-masking a
# harmless value costs a less useful status line; under-masking leaks a credential).
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "pwd", "signature", "sig", "credential")
_SECRET_PREFIXES = ("x-amz-", "x-goog-")  # every parameter of a presigned S3 / GCS URL
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]*")

# The tables a launched master or worker may read, as a JSON list: URIs hold ':' (so no
# os.pathsep list) and an unambiguous format cannot widen a list by a crafted path.
ENV_ALLOW_TABLE = "REMOTELOADER_ALLOW_TABLE"


def is_secret_key(name: str) -> bool:
    """Does a URI query parameter of this name carry a credential?"""
    name = unquote(name).lower()
    return name.startswith(_SECRET_PREFIXES) or any(word in name for word in _SECRET_WORDS)


def _redact_param(param: str) -> str:
    name, eq, value = param.partition("=")
    return f"{name}={MASK}" if eq and value and is_secret_key(name) else param


def _without_userinfo(head: str) -> str:
    """``scheme://`` plus authority and path, with any ``user:secret@`` masked. A secret key
    may hold an unencoded '/', so the userinfo ends at the last '@' when what precedes it
    has a ':' or no '/' (a path like ``/data/a@b`` keeps its '@')."""
    scheme, sep, rest = head.partition("://")
    userinfo, at, host_and_path = rest.rpartition("@")
    if at and ("/" not in userinfo or ":" in userinfo):
        return f"{scheme}{sep}{MASK}@{host_and_path}"
    return head


def redact(uri: str) -> str:
    """``uri`` fit to show: userinfo and secret-looking query values masked (a local path
    is returned as it is)."""
    if "://" not in uri:
        return uri
    head, q, query = uri.partition("?")
    if q:
        query, hash_, fragment = query.partition("#")
        query = "&".join(_redact_param(p) for p in query.split("&")) + hash_ + fragment
    return _without_userinfo(head) + q + query


def redact_text(text: str) -> str:
    """``text`` (an error, a log line) with every URI in it redacted."""
    return _URI.sub(lambda m: redact(m.group(0)), text)


class RedactingFormatter(logging.Formatter):
    """Log lines (tracebacks included) with every URI redacted: errors name tables and files."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def log_to_stderr(level: str, fmt: str) -> None:
    """``logging.basicConfig`` for a remoteloader process, through ``RedactingFormatter``."""
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])


# -- off the command line: allowlists through the environment ----------------------------------
def allowlist_env(prefixes: Sequence[str]) -> dict[str, str]:
    """The environment entry that hands ``prefixes`` to a launched master or worker."""
    return {ENV_ALLOW_TABLE: json.dumps(list(prefixes))}


def allowlist_from_env() -> list[str]:
    """The prefixes ``allowlist_env`` handed to this process ([] without the variable);
    ValueError (naming the variable, not its value) if it is not a JSON list of strings."""
    value = os.environ.get(ENV_ALLOW_TABLE)
    if not value:
        return []
    try:
        prefixes = json.loads(value)
    except ValueError:
        prefixes = None
    if not isinstance(prefixes, list) or not all(isinstance(p, str) and p for p in prefixes):
        raise ValueError(f"${ENV_ALLOW_TABLE} must be a JSON list of table path or URI prefixes")
    return prefixes


# -- private files ----------------------------------------------------------------------------
def private_dir(path: str | os.PathLike) -> None:
    """Make ``path`` a directory only its owner may enter (0700): created so, or tightened
    if it is ours and looser (a journal directory from an older version, or made by hand)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, 0o700)
    elif st.st_mode & 0o077:
        logging.getLogger(__name__).warning("%s is not ours and group or others may enter it: its files are "
                                            "still 0600", path)


def open_private(path: str | os.PathLike, flags: int) -> int:
    """``os.open`` of a file only its owner may read (0600): created so, or tightened if it
    is ours and looser."""
    fd = os.open(path, flags | os.O_CREAT, 0o600)
    st = os.fstat(fd)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.fchmod(fd, 0o600)
    return fd
