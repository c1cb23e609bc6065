"""docs/protocol.md's message, record and error-code tables, generated from ``messages``.

``python -m remoteloader.protocol.docs docs/protocol.md`` rewrites what lies between
``BEGIN`` and ``END``; tests/test_wire.py fails while the page differs from the types.
"""
from __future__ import annotations

import sys
from pathlib import Path

import msgspec.inspect as mi

from . import messages as M

BEGIN, END = "<!-- generated: messages -->", "<!-- /generated -->"


def _type(t: mi.Type) -> str:
    if isinstance(t, mi.IntType):
        return "int" + (f" ≥ {t.ge}" if t.ge is not None else "") + (
            f" ≤ {t.le}" if t.le is not None and t.le < M.MAX_INT else "")
    if isinstance(t, mi.FloatType):
        return "number ≥ 0" if t.ge == 0 else "number"
    if isinstance(t, mi.StrType):
        return "str" + (f" (≤ {t.max_length})" if t.max_length is not None else "")
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.ListType):
        bounds = [f"≥ {t.min_length}" if t.min_length else "", f"≤ {t.max_length}" if t.max_length else ""]
        bounds_text = ", ".join(b for b in bounds if b)
        return f"[{_type(t.item_type)}, ...]" + (f" ({bounds_text})" if bounds_text else "")
    if isinstance(t, mi.StructType):
        return f"`{t.cls.__name__}`"
    if isinstance(t, mi.EnumType):
        return " \\| ".join(f"`{m.value}`" for m in t.cls)
    if isinstance(t, mi.LiteralType):
        return " \\| ".join(f"`{v}`" for v in t.values)
    if isinstance(t, mi.DictType):
        return "map"
    if isinstance(t, mi.UnionType):
        return " or ".join("nil" if isinstance(x, mi.NoneType) else _type(x) for x in t.types)
    return "any"


def _fields(cls: type) -> str:
    info = mi.type_info(cls)
    out = []
    for f in info.fields:
        if f.name == "v":
            continue
        text = _type(f.type)
        if not f.required and f.default is None:  # left out rather than sent as nil
            text = text.removesuffix(" or nil")
        out.append(f"`{f.name}`{'' if f.required else '?'}: {text}")
    return "; ".join(out)


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").replace("``", "`").split())


def generated() -> str:
    """The tables, as they must stand between the markers."""
    lines = ["Generated from `remoteloader/protocol/messages.py` (`python -m remoteloader.protocol.docs "
             "docs/protocol.md`); a field marked `?` may be left out.", "",
             "| type | direction | fields | what |", "|---|---|---|---|"]
    for cls in M.MESSAGE_TYPES:
        lines.append(f"| `{M.tag(cls)}` | {cls.DIRECTION} | {_fields(cls)} | {_doc(cls)} |")
    lines += ["", "Records (nested in messages; *list* ones travel as a list of their fields, in order):", "",
              "| record | as | fields | what |", "|---|---|---|---|"]
    for cls in M.RECORD_TYPES:
        shape = "list" if cls.__struct_config__.array_like else "map"
        lines.append(f"| `{cls.__name__}` | {shape} | {_fields(cls)} | {_doc(cls)} |")
    lines += ["", "Error codes (`error.code`):", "", "| code | meaning |", "|---|---|"]
    for code in M.ErrorCode:
        lines.append(f"| `{code.value}` | {M.ERROR_MEANINGS[code]} |")
    return "\n".join(lines)


def current(page: str) -> str:
    """What stands between the markers of ``page``."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[start:end].strip("\n")


def rewrite(path: Path) -> None:
    page = path.read_text()
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    path.write_text(page[:start] + "\n" + generated() + "\n" + page[end:])


if __name__ == "__main__":
    rewrite(Path(sys.argv[1]))
