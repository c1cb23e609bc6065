"""The three console scripts: --version, --help with defaults, one-line errors for bad input."""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import urllib.request
from importlib.metadata import version
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from remoteloader.master.__main__ import build_parser as master_parser
from remoteloader.protocol.address import AddressError, validate_address
from remoteloader.protocol.rpc import RpcClient
from remoteloader.tools.cli import build_parser as tools_parser
from remoteloader.worker.__main__ import build_parser as worker_parser
from tests.conftest import spec_dict

BIN = Path(sys.executable).parent
SCRIPTS = ("remoteloader", "remoteloader-master", "remoteloader-worker")


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *expected: str) -> str:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    for text in expected:
        assert text in last, last
    return last


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_version(script):
    out = run(script, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{script} {version('remoteloader')}"


def _parsers() -> list[argparse.ArgumentParser]:
    parsers = [master_parser(), worker_parser()]
    tools = tools_parser()
    parsers.append(tools)
    for action in tools._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.extend(action.choices.values())
    return parsers


@pytest.mark.parametrize("parser", _parsers(), ids=lambda p: p.prog)
def test_every_option_has_help_and_a_visible_default(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help and action.help.strip(), (parser.prog, action.dest)
    text = parser.format_help()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or any(action.default is x for x in (None, False, "", argparse.SUPPRESS)):
            continue  # no default to show: the help says what happens without the option
        assert f"(default: {action.default})" in " ".join(text.split()), (parser.prog, action.dest)


@pytest.mark.parametrize("args,expected", [
    (("remoteloader-master", "--help"), ["(default: tcp://127.0.0.1:5555)", "(default: 5.0)", "(default: stall)"]),
    (("remoteloader-worker", "--help"), ["(default: 127.0.0.1)", "(default: 16)", "(default: 60.0)"]),
    (("remoteloader", "gen-data", "--help"), ["(default: 13)", "(default: orc)"]),
    (("remoteloader", "status", "--help"), ["(default: 5.0)"]),
])
@pytest.mark.slow
def test_help_shows_defaults(args, expected):
    out = run(*args)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for item in expected:
        assert item in text, (item, out.stdout)


@pytest.mark.parametrize("args,flag,why", [
    (("remoteloader-master", "--bind", "127.0.0.1:5555"), "--bind", "no scheme"),
    (("remoteloader-master", "--bind", "tcp://127.0.0.1:65536"), "--bind", "outside 0..65535"),
    (("remoteloader-worker", "--master", "tcp://127.0.0.1"), "--master", "no port"),
    (("remoteloader-worker", "--master", "tcp://127.0.0.1:0"), "--master", "outside 1..65535"),
    (("remoteloader-worker", "--master", "tcp://127.0.0.1:1", "--bind-host", "no such/host"), "--bind-host",
     "invalid host"),
    (("remoteloader", "status", "--master", "localhost:5555"), "--master", "no scheme"),
    (("remoteloader", "status", "--master", "udp://127.0.0.1:5555"), "--master", "only tcp"),
])
@pytest.mark.slow
def test_bad_address_is_one_line_and_exit_2(args, flag, why):
    assert_one_line_error(run(*args), 2, f"argument {flag}:", why)


@pytest.mark.slow
def test_master_bind_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = run("remoteloader-master", "--bind", f"tcp://127.0.0.1:{port}", timeout=60)
    assert_one_line_error(out, 2, f"--bind tcp://127.0.0.1:{port}", "in use")


@pytest.mark.slow
def test_unreachable_master_status_is_one_line():
    out = run("remoteloader", "status", "--master", "tcp://127.0.0.1:9", "--timeout", "0.5")
    assert_one_line_error(out, 1, "did not answer")


@pytest.mark.slow
def test_bad_spec_is_one_line(tmp_path, tables):
    spec = spec_dict(tables["orc"])
    spec["features"]["dense"].append({"name": "ghost", "column": "no_such_column"})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert_one_line_error(run("remoteloader", "validate", str(path)), 2, "no_such_column")
    assert_one_line_error(run("remoteloader-master", "--bind", "tcp://127.0.0.1:0", "--spec", str(path)), 2,
                          "no_such_column")


@pytest.mark.parametrize("addr,bind", [
    ("tcp://127.0.0.1:5555", False), ("tcp://master.example:1", False), ("tcp://[::1]:65535", False),
    ("tcp://127.0.0.1:0", True), ("tcp://*:5555", True), ("tcp://0.0.0.0:0", True), ("ipc:///tmp/rl-x/master", False),
])
def test_valid_addresses(addr, bind):
    assert validate_address(addr, bind=bind) == addr


@pytest.mark.parametrize("addr,bind,why", [
    ("127.0.0.1:5555", False, "no scheme"), ("ipc://tmp/x", False, "must be absolute"), ("tcp://:5555", False, "empty host"),
    ("tcp://host", False, "no port"), ("tcp://host:http", False, "not a number"), ("tcp://host:-1", False, "number"),
    ("tcp://host:0", False, "outside 1..65535"), ("tcp://*:5555", False, "only be bound"),
    ("tcp://::1:5555", False, "brackets"), ("tcp://a b:1", False, "not allowed"), (None, False, "not a string"),
    ("tcp://host:65536", True, "outside 0..65535"),
])
def test_invalid_addresses_name_the_flag(addr, bind, why):
    with pytest.raises(AddressError, match=why) as caught:
        validate_address(addr, "--master", bind=bind)
    assert str(caught.value).startswith("--master: invalid address") and "\n" not in str(caught.value)


def test_rpc_client_checks_its_address_before_zeromq_does():
    with pytest.raises(ValueError, match="master address: invalid address 'localhost:5555': no scheme"):
        RpcClient(zmq.Context.instance(), "localhost:5555", 1.0)


def test_loader_with_a_bad_master_address_is_a_value_error(tables):
    from remoteloader import RemoteDataLoader

    with pytest.raises(ValueError, match="invalid address 'localhost:5555'"):
        RemoteDataLoader(spec_dict(tables["orc"]), master="localhost:5555")


@pytest.mark.slow
def test_master_console_script_serves_metrics(tmp_path):
    proc = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", "tcp://127.0.0.1:0", "--workers", "0",
                             "--metrics-port", "0", "--metrics-host", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "metrics on http://127.0.0.1:" in line, line
        url = line.rsplit(" ", 1)[1].strip()
        assert "listening on" in proc.stdout.readline()
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    names = {f.name: f.type for f in text_string_to_metric_families(body)}
    assert names["remoteloader_build_info"] == "gauge"
    assert names["remoteloader_workers"] == "gauge"
    assert names["remoteloader_master_request_seconds"] == "histogram"
    assert names["process_cpu_seconds"] == "counter"


def test_ray_actor_forwards_every_argument_but_its_own():
    from remoteloader.master.__main__ import _without
    argv = ["--ray-actor", "m", "--bind", "tcp://127.0.0.1:5555", "--ray-max-restarts=3", "--ray-stop",
            "--journal", "/j", "--ray-address", "127.0.0.1:6379"]
    assert _without(argv, {"--ray-actor": 1, "--ray-max-restarts": 1, "--ray-stop": 0}) == [
        "--bind", "tcp://127.0.0.1:5555", "--journal", "/j", "--ray-address", "127.0.0.1:6379"]


@pytest.mark.parametrize("args, why", [
    (("--ray-actor", "m", "--bind", "tcp://127.0.0.1:5555"), "--ray-actor needs --ray-address"),
    (("--ray-actor", "m", "--ray-address", "127.0.0.1:1", "--bind", "tcp://127.0.0.1:0"), "needs a fixed --bind port"),
])
@pytest.mark.slow
def test_ray_actor_needs_an_address_and_a_fixed_port(args, why):
    out = run("remoteloader-master", *args)
    assert out.returncode == 2 and why in out.stderr


def test_ray_actor_hands_the_master_absolute_paths(tmp_path, monkeypatch):
    from remoteloader.master.__main__ import _absolute_paths
    monkeypatch.chdir(tmp_path)
    assert _absolute_paths(["--spec", "s.yaml", "--journal=j", "--bind", "tcp://127.0.0.1:5555", "--auth", "/k"]) == [
        "--spec", str(tmp_path / "s.yaml"), f"--journal={tmp_path / 'j'}", "--bind", "tcp://127.0.0.1:5555",
        "--auth", "/k"]


def test_max_message_bytes_takes_sizes_up_to_the_frame_limit(capsys):
    assert worker_parser().parse_args(["--master", "tcp://127.0.0.1:1"]).max_message_bytes == 16 << 20
    assert worker_parser().parse_args(["--master", "tcp://127.0.0.1:1", "--max-message-bytes", "4M"]
                                      ).max_message_bytes == 4 << 20
    assert master_parser().parse_args([]).max_message_bytes is None  # the workers' own default
    assert master_parser().parse_args(["--max-message-bytes", "1G"]).max_message_bytes == 1 << 30
    for parser, argv in ((worker_parser(), ["--master", "tcp://127.0.0.1:1"]), (master_parser(), [])):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--max-message-bytes", "2G"])
        assert "above 1.0 GiB" in capsys.readouterr().err


def test_status_counts_what_a_worker_holds_against_its_byte_budget_not_pieces_against_a_capacity():
    from remoteloader.tools.cli import worker_line

    w = {"id": "w-1", "addr": "ipc:///x", "pid": 7, "buffered": 50, "capacity": 16, "assigned": 2,
         "held_bytes": 12 << 20, "budget_bytes": 256 << 20, "ahead_bytes": 4 << 20}
    line = worker_line(w)
    assert "held 12.0/256.0 MiB (ahead 4.0) in 50 pieces" in line and "50/16" not in line
    older = {k: v for k, v in w.items() if not k.endswith("_bytes")}
    assert "buffered 50/16 pieces" in worker_line(older)
