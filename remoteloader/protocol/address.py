"""ZeroMQ endpoint addresses, checked before ZeroMQ sees them.

A mistyped address (``localhost:5555``, ``tcp://host``, ``tcp://host:99999``) would
otherwise surface as a bare ``zmq.error.ZMQError: Invalid argument`` from deep inside a
socket call. ``validate_address`` turns it into one line that names the flag or the
argument at fault. The command lines use it as an ``argparse`` type (and share the help
formatter below); ``RpcClient`` calls it when it is made.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

MAX_PORT = 65535


class AddressError(ValueError):
    """An endpoint that is not ``tcp://HOST:PORT``."""


def validate_address(addr: object, flag: Optional[str] = None, *, bind: bool = False) -> str:
    """Return ``addr`` if it is ``tcp://HOST:PORT``; raise ``AddressError`` naming ``flag`` otherwise.

    ``HOST`` is a name, an IPv4 address or a bracketed IPv6 address (``[::1]``); for a
    bind it may also be ``*`` (every interface) or an interface name, and ``PORT`` may be
    0 ("any free port"). A connect needs a port in 1..65535.
    """
    where = f"{flag}: " if flag else ""
    example = "tcp://127.0.0.1:0" if bind else "tcp://127.0.0.1:5555"

    def fail(why: str) -> AddressError:
        return AddressError(f"{where}invalid address {addr!r}: {why} (expected tcp://HOST:PORT, e.g. {example})")

    if not isinstance(addr, str):
        raise fail("not a string")
    scheme, sep, rest = addr.partition("://")
    if not sep:
        raise fail("no scheme")
    if scheme != "tcp":
        raise fail(f"scheme {scheme!r} is not supported, only tcp")
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise fail("no port")
    if not host:
        raise fail("empty host")
    if host.startswith("[") != host.endswith("]") or (host.startswith("[") and len(host) < 3):
        raise fail("unbalanced brackets around an IPv6 host")
    if ":" in host and not host.startswith("["):
        raise fail("an IPv6 host must be in brackets, e.g. tcp://[::1]:5555")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise fail(f"host {host!r} contains a character not allowed in a host")
    if host == "*" and not bind:
        raise fail("'*' (every interface) can only be bound, not connected to")
    if not (port.isascii() and port.isdigit()):
        raise fail(f"port {port!r} is not a number")
    number = int(port)
    lowest = 0 if bind else 1
    if not lowest <= number <= MAX_PORT:
        raise fail(f"port {number} is outside {lowest}..{MAX_PORT}")
    return addr


def address_type(bind: bool = False) -> Callable[[str], str]:
    """An ``argparse`` ``type=``: a bad address exits with status 2 and a one-line message."""

    def parse(value: str) -> str:
        try:
            return validate_address(value, bind=bind)
        except AddressError as e:  # argparse prefixes "argument --flag: "
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "bind address" if bind else "address"
    return parse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default; where there is none (``None``, a switch that is
    off, an empty string) the option's help says what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == "":
            return action.help or ""
        return super()._get_help_string(action) or ""
