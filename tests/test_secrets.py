"""No secret of a table URI leaks to other local users or into renderings (red team finding 2),
key directories follow ssh's StrictModes (finding 6), and the metrics endpoint follows the
bind rule (finding 7).

The table URIs here carry a fake credential, ``?secret=<MARKER>``, which pyarrow's local
filesystem ignores, so a real table is read through a URI that must never be shown.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from remoteloader import RemoteDataLoader
from remoteloader.core.popularity import load_popularity, record_projection
from remoteloader.core.redact import MASK, redact, redact_text
from remoteloader.master.journal import Journal
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.master.updates import ClientLeft
from remoteloader.protocol import auth
from remoteloader.spec import DatasetSpec
from tests.conftest import BIN, ROWS, launched_workers, master_status, spec_dict, wait_gone
from tests.wire_helpers import ask

MARKER = "S2-NOT-TO-BE-SEEN"


def secret_uri(table: Path) -> str:
    return f"file://{table}?secret={MARKER}"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- redact -------------------------------------------------------------------------------------
@pytest.mark.parametrize("uri, shown", [
    ("s3://AKIA:wJalr@bucket/t", "s3://***@bucket/t"),
    ("s3://AKIA:wJ/al+r@bucket/t/ds=1", "s3://***@bucket/t/ds=1"),  # AWS secrets may hold an unencoded '/'
    ("s3://bucket/t?endpoint_override=h:9000&secret_key=x", "s3://bucket/t?endpoint_override=h:9000&secret_key=***"),
    ("https://h/t.orc?X-Amz-Credential=a%2Fb&X-Amz-Signature=f00&v=1",
     "https://h/t.orc?X-Amz-Credential=***&X-Amz-Signature=***&v=1"),
    ("abfs://acct/c/t?client_secret=s&Token=t&pwd=p#frag", "abfs://acct/c/t?client_secret=***&Token=***&pwd=***#frag"),
    ("slow+file:///t?profile=hdd&sig=abc", "slow+file:///t?profile=hdd&sig=***"),
    ("file:///data/a@b/t", "file:///data/a@b/t"),  # an '@' in a path is no userinfo
    ("/data/t?secret=x", "/data/t?secret=x"),  # a local path: no query to read
])
def test_redact_masks_userinfo_and_secret_query_values(uri, shown):
    assert redact(uri) == shown


def test_redact_text_finds_every_uri_in_an_error():
    error = (f"split 3 ({secret_uri(Path('/t'))}/ds=1/part-0.orc, units 0..2): cannot read "
             f"'s3://K:S@b/x?token=T' (see 'file:///plain')")
    shown = redact_text(error)
    assert MARKER not in shown and "K:S" not in shown and "=T'" not in shown
    assert shown.endswith("cannot read 's3://***@b/x?token=***' (see 'file:///plain')")


# -- state files: private, and the popularity log redacted ---------------------------------------
def test_journal_directory_is_0700_and_its_files_0600(tmp_path):
    loose = tmp_path / "journal"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)  # a directory made by hand (or by an older version)
    journal = Journal(loose)
    journal.append(ClientLeft("s-1", "bye"))
    journal.sync()
    journal.quarantine(0, b"junk", "test")
    journal.compact(ClientLeft("s-2", "bye"))
    journal.append(ClientLeft("s-3", "bye"))
    journal.close()
    assert mode(loose) == 0o700
    assert {p.name: mode(p) for p in loose.iterdir()} == {"journal.bin": 0o600, "journal.quarantine": 0o600}
    fresh = Journal(tmp_path / "a" / "fresh")
    fresh.append(ClientLeft("s-1", "bye"))
    fresh.close()
    assert mode(tmp_path / "a" / "fresh") == 0o700 and mode(tmp_path / "a" / "fresh" / "journal.bin") == 0o600


def test_popularity_log_is_private_and_names_tables_redacted(tmp_path):
    log = tmp_path / "new-dir" / "popularity.jsonl"
    record_projection(str(log), secret_uri(Path("/t")), ["label", "float_1"], now=100.0)
    assert mode(log.parent) == 0o700 and mode(log) == 0o600
    text = log.read_text()
    assert MARKER not in text and f"secret={MASK}" in text
    # The reorder tool still finds the table's jobs, by the URI as given.
    assert load_popularity(str(log), table=secret_uri(Path("/t"))) == {"label": 1, "float_1": 1}


def test_status_names_the_table_redacted(tables):
    service = MasterService(MasterConfig(), None)
    service.submit(DatasetSpec.from_dict(spec_dict(secret_uri(tables["orc"]), batch_size=100)))
    service.state.errors.append({"epoch": 0, "rank": 0, "split_id": 1, "rows": 9, "skipped": True,
                                 "message": f"split 1 ({service.state.job.files[0].path}): damaged"})
    status = json.dumps(service.status())
    assert MARKER not in status and f"secret={MASK}" in status
    # The authenticated get_spec still gives workers the table they must read.
    assert ask(service, {"t": "get_spec"})[1]["spec"]["table"]["path"] == secret_uri(tables["orc"])


# -- real processes: no command line, status, metrics page or log shows the secret ---------------
def _cmdlines(root: psutil.Process) -> dict[int, str]:
    return {p.pid: "\0".join(p.cmdline()) for p in [root, *root.children(recursive=True)]}


def _until(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.mark.slow
def test_a_master_with_a_secret_table_uri_shows_it_nowhere(tables, tmp_path):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec_dict(secret_uri(tables["orc"]), batch_size=100)))
    journal, stderr = tmp_path / "journal", tmp_path / "master.err"
    with open(stderr, "w") as err:
        master = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", "tcp://127.0.0.1:0", "--workers", "1",
                                   "--spec", str(spec_file), "--journal", str(journal), "--metrics-port", "0",
                                   "--log-level", "INFO"], stdout=subprocess.PIPE, stderr=err, text=True)
    pids = [master.pid]
    try:
        addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
        port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", stderr.read_text()).group(1)
        status = _until(lambda: (lambda s: s if s["workers"] else None)(master_status(addr)))
        worker = _until(lambda: launched_workers(master.pid))[0]
        pids += [worker.pid, worker.ppid()]  # and its fork server
        # The worker was told the tables it may read in its environment (its owner's alone).
        assert json.loads(worker.environ()["REMOTELOADER_ALLOW_TABLE"]) == [secret_uri(tables["orc"])]
        cmdlines = _cmdlines(psutil.Process(master.pid))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    finally:
        master.terminate()
        master.wait(30)
        wait_gone(pids)
    assert len(cmdlines) == 3 and not [pid for pid, line in cmdlines.items() if MARKER in line], cmdlines
    assert status["job"]["table"] == f"file://{tables['orc']}?secret={MASK}"
    assert "remoteloader_job_info{" in metrics and MARKER not in metrics and str(tables["orc"]) not in metrics
    assert MARKER not in stderr.read_text()  # the master's and its worker's logs
    files = {p.name: mode(p) for p in journal.iterdir()}
    assert mode(journal) == 0o700 and {"journal.bin", "popularity.jsonl"} <= set(files)
    assert set(files.values()) == {0o600}, files
    assert MARKER not in (journal / "popularity.jsonl").read_text()


@pytest.mark.slow
def test_the_embedded_default_keeps_the_table_uri_off_command_lines(tables, capfd, monkeypatch):
    monkeypatch.delenv("REMOTELOADER_QUIET", raising=False)
    loader = RemoteDataLoader(spec_dict(secret_uri(tables["orc"]), batch_size=500), num_workers=1)
    try:
        rows = 0
        for batch in loader:
            if not rows:
                cmdlines = _cmdlines(psutil.Process(os.getpid()))
            rows += len(batch)
    finally:
        loader.close()
    assert rows == ROWS  # the master and its worker were allowed the table, from their environment
    children = {pid: line for pid, line in cmdlines.items() if pid != os.getpid()}
    assert len(children) >= 2 and not [pid for pid, line in children.items() if MARKER in line], children
    banner = capfd.readouterr().err
    assert "starting an embedded master" in banner and MARKER not in banner and f"secret={MASK}" in banner


# -- key directories: ssh's StrictModes ---------------------------------------------------------
@pytest.fixture
def keys(tmp_path) -> Path:
    return Path(auth.keygen(tmp_path / "keys"))


@pytest.mark.parametrize("where, what", [
    ("public_keys", "allowed client keys directory"),
    (".", "auth directory"),
    ("public_keys/planted.key", "allowed client key"),
    ("cluster.key_secret", "cluster key"),
])
def test_a_key_directory_others_can_write_is_refused_naming_the_path(keys, where, what):
    auth.load(keys)  # as keygen wrote it: fine
    target = keys / where
    if where == "public_keys/planted.key":
        target.write_text("a key another user planted")
        os.chmod(target, 0o600)
        auth.load(keys)  # private: still fine
    os.chmod(target, mode(target) | 0o020)  # group-writable
    with pytest.raises(auth.AuthError) as refused:
        auth.load(keys)
    assert f"{keys if where == '.' else target} is" in str(refused.value)
    assert what in str(refused.value) and "writable by group or others" in str(refused.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_another_user_owns_is_refused(keys):
    planted = keys / "public_keys" / "planted.key"
    planted.write_text("a key another user planted")
    os.chmod(planted, 0o600)
    os.chown(planted, 12345, 12345)
    with pytest.raises(auth.AuthError, match=f"{re.escape(str(planted))} is owned by uid 12345"):
        auth.load(keys)


# -- the metrics endpoint follows the bind rule -------------------------------------------------
@pytest.mark.slow
def test_a_non_loopback_metrics_host_needs_insecure():
    refused = subprocess.run([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                              "--metrics-port", "0", "--metrics-host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--metrics-host 0.0.0.0 is not a loopback address" in refused.stderr and "--insecure" in refused.stderr
