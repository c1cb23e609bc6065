"""The embedded default's console (issue 38, traps): the master's and its workers' logs go to
a private log file, not the trainer's console; the banner says the kernels compile only when
they will; a master that fails at start is quoted from its log."""
from __future__ import annotations

import os
import stat

import pytest

from remoteloader.client import embedded, placement
from remoteloader.client.embedded import EmbeddedCluster, new_log_file
from remoteloader.core import procs
from remoteloader.spec import load_spec
from tests.conftest import spec_dict


def test_log_files_are_private_and_only_the_newest_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv(embedded.ENV_EMBEDDED_LOG, raising=False)
    old = os.umask(0o022)
    try:
        made = [new_log_file() for _ in range(embedded.LOGS_KEPT + 5)]
    finally:
        os.umask(old)
    directory = os.path.dirname(made[0])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in made if os.path.exists(p))
    assert len(os.listdir(directory)) <= embedded.LOGS_KEPT
    monkeypatch.setenv(embedded.ENV_EMBEDDED_LOG, "stderr")
    assert new_log_file() is None
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    monkeypatch.setenv(embedded.ENV_EMBEDDED_LOG, str(shared))
    with pytest.raises(RuntimeError, match="mode 0700"):
        new_log_file()


def test_the_banner_says_the_kernels_compile_only_when_nothing_is_cached(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("REMOTELOADER_QUIET", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    started = []
    monkeypatch.setattr(placement, "EmbeddedCluster", lambda *a, **k: started.append(k))
    spec = load_spec(spec_dict(tmp_path / "t"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "empty"))
    placement._start_embedded(spec, 1, None)
    first = capfd.readouterr().err
    (tmp_path / "cached" / "m").mkdir(parents=True)
    (tmp_path / "cached" / "m" / "kernels.f-1.py311.nbi").write_bytes(b"")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cached"))
    placement._start_embedded(spec, 1, None)
    later = capfd.readouterr().err
    assert "compiles the transform kernels" in first and "compiles" not in later
    assert f"their log: {started[-1]['log_file']}" in later and started[-1]["log_file"].startswith(str(tmp_path))
    assert procs.kernels_cached()


def test_a_master_that_fails_at_start_is_quoted_from_its_log_not_spilled_on_the_console(tmp_path, monkeypatch,
                                                                                        capfd):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv(embedded.ENV_EMBEDDED_LOG, raising=False)
    log = new_log_file()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2 at start; the end of its log .*--no-such-flag"):
        EmbeddedCluster(1, extra_args=("--no-such-flag",), log_file=log)
    assert "--no-such-flag" not in capfd.readouterr().err  # in the log, not on the trainer's console
    assert "--no-such-flag" in open(log).read()
