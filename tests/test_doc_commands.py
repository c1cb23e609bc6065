"""Every command line the README and docs show still parses: each flag exists and takes the
value shown (issue 38: docs that drift). A line is parsed by the command's own argparse
parser; placeholders (``...``) are dropped and optional parts (``[--json]``) kept."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from remoteloader.master.__main__ import build_parser as master_parser
from remoteloader.tools.cli import build_parser as cli_parser
from remoteloader.worker.__main__ import build_parser as worker_parser

ROOT = Path(__file__).parent.parent
PARSERS = {"remoteloader": cli_parser, "remoteloader-master": master_parser, "remoteloader-worker": worker_parser}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def command_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each remoteloader command in the file's code blocks."""
    out, in_code, pending, start = [], False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code, pending = not in_code, ""
            continue
        if not in_code:
            continue
        text = (pending + " " + line.strip()) if pending else line.strip()
        start = start if pending else n
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        pending = ""
        for command in text.split(";"):
            command = re.sub(r"\s#.*$", "", command).strip()
            words = command.split()
            # An invocation, not a program's output ("remoteloader status: error: ...").
            if words and words[0] in PARSERS and not (len(words) > 1 and words[1].endswith(":")):
                out.append((start, command))
    return out


CASES = [(f"{path.relative_to(ROOT)}:{n}", command) for path in DOCS for n, command in command_lines(path)]


def test_the_docs_show_command_lines_to_check():
    assert len(CASES) >= 15 and {c.split(" ", 1)[0] for _, c in CASES} == set(PARSERS)


@pytest.mark.parametrize("where,command", CASES, ids=[w for w, _ in CASES])
def test_a_documented_command_line_parses(where, command):
    words = [w.strip("[]") for w in shlex.split(command) if w not in ("...", "|")]
    try:
        PARSERS[words[0]]().parse_args(words[1:])
    except SystemExit as e:  # --help, --version: 0; an unknown flag or a bad value: 2
        assert e.code == 0, f"{where}: {command!r} does not parse"
