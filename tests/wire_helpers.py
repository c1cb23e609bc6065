"""Master requests and replies as plain maps, the way tests write and read them."""
from __future__ import annotations

from typing import Any, Sequence

import msgspec

from remoteloader.master.service import MasterService
from remoteloader.protocol import messages as M
from remoteloader.protocol import wire


def ask(service: MasterService, request: dict) -> tuple[str, dict]:
    """``service.handle`` of a request written as a map (checked like a received header):
    the reply's type and its fields."""
    reply = service.handle(request)
    fields = msgspec.to_builtins(reply)
    del fields["t"], fields["v"]
    return M.tag(reply), fields


def as_map(message: M.Message) -> dict:
    """A message as the map it travels as (``t`` and ``v`` included)."""
    return msgspec.to_builtins(message)


def encode(t: str, frames: Sequence[Any] = (), **fields: Any) -> list:
    """``wire.encode`` of a message written as its type and fields (records may be given
    as Structs or as plain data); checked like a received one."""
    return wire.encode(M.from_fields(t, msgspec.to_builtins(fields)), frames)


def decode(parts: Sequence[Any]) -> tuple[dict, list]:
    """``wire.decode``, the header as a map."""
    message, frames = wire.decode(parts)
    return as_map(message), frames
