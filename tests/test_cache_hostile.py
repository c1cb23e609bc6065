"""The block cache as shared, hostile storage (issue 37, findings 1, 5, 7 and 8): links
planted in the cache are never followed, what the cache makes is private whatever the
umask, a location someone else made or may write is refused unless shared on purpose (and
then only with --auth), and --cache-max-bytes is a bound.

Another local user is simulated as tests/test_ipc_local.py does: the hostile layout made
directly (files and directories handed to uid 65534 with ``os.chown``; root-owned targets
outside the cache), and reads attempted as uid 65534 with ``setpriv`` (system tools only)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from remoteloader.columns import DenseColumn
from remoteloader.core.cache import store as store_module
from remoteloader.core.cache.janitor import CacheJanitor
from remoteloader.core.cache.location import CacheRefused, open_cache, user_cache_dir
from remoteloader.core.cache.segments import BlockSigner, encode_segment
from remoteloader.core.cache.store import BlockStore
from remoteloader.core.cache.writer import BlockWriter
from remoteloader.protocol import auth
from remoteloader.tools import cli

NOBODY = 65534
PLAIN = BlockSigner.plain()
SPLIT = "ab12cd"
BLOCK = {"k": DenseColumn(np.arange(300, dtype=np.float32))}
ENV_CACHE_SHARED = "REMOTELOADER_CACHE_SHARED"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to another uid")


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch):
    for name in (auth.ENV_AUTH, "REMOTELOADER_CACHE", "REMOTELOADER_ALLOW_CACHE", ENV_CACHE_SHARED):
        monkeypatch.delenv(name, raising=False)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (not following links): type, size, mode, mtime, content."""
    out = {str(root): ("d", os.lstat(root).st_mode, os.lstat(root).st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            data = Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[p] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mode, st.st_mtime_ns, data)
    return out


def regular_files(root: Path) -> list[str]:
    """The regular files under ``root``, never through a link."""
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names
            if stat.S_ISREG(os.lstat(os.path.join(d, f)).st_mode)]


def private_target(tmp_path: Path) -> Path:
    """A root-owned 0700 directory outside the cache with two subdirectories and a 0600 file."""
    outside = tmp_path / "outside"
    for sub in ("alpha-precious", "beta-precious"):
        (outside / sub).mkdir(parents=True)
        (outside / sub / "data.txt").write_bytes(b"keep me\n" * 10)
    (outside / "secret").write_bytes(b"x" * 1200)
    for p in [outside, *outside.rglob("*")]:
        p.chmod(0o700 if p.is_dir() else 0o600)
    return outside


def cache_with_a_split(root: Path, signer: BlockSigner = PLAIN) -> BlockStore:
    store = BlockStore(str(root), signer)
    store.write(SPLIT, BLOCK)
    return store


# -- finding 1: links planted in the cache ----------------------------------------------------


def test_gc_ls_and_the_janitor_never_follow_a_link_planted_in_the_cache(tmp_path, capsys):
    outside = private_target(tmp_path)
    root = tmp_path / "cache"
    cache_with_a_split(root).close()
    (root / "v1" / "zz").symlink_to(outside)  # a whole prefix directory
    (root / "v1" / "ab" / "ab99").symlink_to(outside)  # a split directory
    os.symlink(outside / "secret", root / "v1" / "ab" / SPLIT / "000000000000001-x.seg")  # a segment
    os.symlink(outside / "secret", root / "v1" / "ab" / SPLIT / ".tmp-000000000000001-x.seg")  # a stale temp file
    old = time.time() - 7200
    os.utime(root / "v1" / "ab" / SPLIT / ".tmp-000000000000001-x.seg", (old, old), follow_symlinks=False)
    before = snapshot(outside)

    assert cli.main(["cache", "ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "precious" not in out and "zz" not in out and "1 splits, 1 segments, 1 blocks" in out
    assert "entries skipped" in out
    assert cli.main(["cache", "gc", str(root), "--max-bytes", "10G"]) == 0  # far under the bound
    assert "deleted 0 splits" in capsys.readouterr().out
    janitor = CacheJanitor(BlockStore(str(root), PLAIN), 0)  # the --cache-max-bytes janitor: everything goes
    deadline = time.monotonic() + 10
    while any(p.endswith(".seg") for p in regular_files(root)):
        assert time.monotonic() < deadline, "the janitor never ran"
        time.sleep(0.05)
    janitor.close()
    assert cli.main(["cache", "gc", str(root), "--max-bytes", "1"]) == 0
    assert cli.main(["cache", "verify", str(root), "--delete"]) == 0
    assert snapshot(outside) == before  # nothing outside the cache touched, listed or deleted
    for link in (root / "v1" / "zz", root / "v1" / "ab" / "ab99"):  # the links themselves stay, never followed
        assert link.is_symlink()


def test_a_planted_used_marker_never_changes_a_file_outside_the_cache(tmp_path, monkeypatch):
    outside = private_target(tmp_path)
    target = outside / "secret"
    hard = tmp_path / "hard-target"
    hard.write_bytes(b"y" * 1200)
    hard.chmod(0o600)
    monkeypatch.setattr(store_module, "TOUCH_INTERVAL_S", 0.0)
    keyed = BlockSigner.keyed(b"cluster secret")
    for signer in (PLAIN, keyed):
        root = tmp_path / f"cache-{signer.scheme}"
        store = cache_with_a_split(root, signer)
        split_dir = root / "v1" / "ab" / SPLIT
        # A symlinked marker beside a good segment, and beside only a forged one.
        (split_dir / "used").symlink_to(target)
        forged = root / "v1" / "ef" / "ef56"
        forged.mkdir(parents=True)
        (forged / "000000000000001-f.seg").write_bytes(b"".join(encode_segment("ef56", BLOCK, PLAIN)))
        (forged / "used").symlink_to(target)
        # A hard-linked marker (the same file as one outside the cache).
        hard_dir = root / "v1" / "cd" / "cd78"
        hard_dir.mkdir(parents=True)
        (hard_dir / "000000000000001-h.seg").write_bytes(b"".join(encode_segment("cd78", BLOCK, signer)))
        os.link(hard, hard_dir / "used")
        before = snapshot(outside), hard.stat().st_mtime_ns, hard.read_bytes()
        for _ in range(2):
            assert store.lookup(SPLIT, ["k"]).hits == 1
            assert store.lookup("cd78", ["k"]).hits == 1
            assert store.lookup("ef56", ["k"]).hits == (signer is PLAIN)
        assert (snapshot(outside), hard.stat().st_mtime_ns, hard.read_bytes()) == before
        assert target.stat().st_size == 1200 and (split_dir / "used").is_symlink()
        assert store.skipped >= 2
        store.close()


def test_the_used_marker_is_written_only_after_a_block_verifies(tmp_path):
    root = tmp_path / "cache"
    store = BlockStore(str(root), BlockSigner.keyed(b"cluster secret"))
    split_dir = root / "v1" / "ef" / "ef56"
    split_dir.mkdir(parents=True)
    (split_dir / "000000000000001-f.seg").write_bytes(b"".join(encode_segment("ef56", BLOCK, PLAIN)))
    (split_dir / "000000000000002-g.seg").write_bytes(b"RLSEG001" * 4)
    got = store.lookup("ef56", ["k"])
    assert got.hits == 0 and got.corrupt >= 1
    assert not (split_dir / "used").exists()  # nothing in the directory vouched for: not touched
    store.write("ef56", BLOCK)
    assert store.lookup("ef56", ["k"]).hits == 1 and (split_dir / "used").exists()
    store.close()


def test_a_linked_segment_is_never_read_verified_or_deleted(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    good = outside / "good.seg"
    good.write_bytes(b"".join(encode_segment(SPLIT, BLOCK, PLAIN)))  # verifies, but is not the cache's
    bad = outside / "bad.seg"
    bad.write_bytes(b"not a segment at all" * 10)
    root = tmp_path / "cache"
    store = BlockStore(str(root), PLAIN)
    store.write("cd78", BLOCK)
    split_dir = root / "v1" / "ab" / SPLIT
    split_dir.mkdir(parents=True)
    (split_dir / "000000000000009-a.seg").symlink_to(good)
    (split_dir / "000000000000001-b.seg").symlink_to(bad)
    os.mkfifo(split_dir / "000000000000005-c.seg")  # a reader must not hang on it either
    got = store.lookup(SPLIT, ["k"])
    assert got.hits == 0 and got.missing == {"k"}
    report = store.verify(delete=True)
    assert report.segments == 1 and report.corrupt == [] and report.deleted == [] and report.skipped >= 3
    assert good.exists() and bad.exists() and (split_dir / "000000000000001-b.seg").is_symlink()
    store.close()


# -- finding 5: what the cache makes is private -----------------------------------------------


def _modes(top: Path) -> dict[str, int]:
    return {str(p): stat.S_IMODE(p.lstat().st_mode) for p in [top, *top.rglob("*")]}


@ROOT_ONLY
@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_the_default_cache_is_private_whatever_the_umask(monkeypatch, umask):
    home = Path(tempfile.mkdtemp(prefix="rl-xdg-"))  # /tmp, 0755: where others can reach, like a home
    try:
        home.chmod(0o755)
        monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
        old = os.umask(umask)
        try:
            store = open_cache(user_cache_dir(), None, None)
            store.write(SPLIT, BLOCK)
            assert store.lookup(SPLIT, ["k"]).hits == 1  # and the used marker
            store.close()
        finally:
            os.umask(old)
        made = home / "cache"
        modes = _modes(made)
        assert len(modes) == 8, modes  # cache, remoteloader, blocks, v1, ab, ab12cd, one segment, used
        for path, mode in modes.items():
            assert mode == (0o700 if os.path.isdir(path) else 0o600), (path, oct(mode))
        segment = next(p for p in regular_files(made) if p.endswith(".seg"))
        peek = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                               "cat", str(segment)], capture_output=True, timeout=30)
        assert peek.returncode != 0 and b"Permission denied" in peek.stderr
        listing = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                                  "ls", str(made / "remoteloader" / "blocks")], capture_output=True, timeout=30)
        assert listing.returncode != 0
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_an_older_default_cache_is_tightened(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o002)  # what older versions made under a user-private-group umask
    try:
        BlockStore(str(tmp_path / "xdg" / "remoteloader" / "blocks"), PLAIN).write(SPLIT, BLOCK)
        for p in [tmp_path / "xdg" / "remoteloader", *(tmp_path / "xdg" / "remoteloader").rglob("*")]:
            p.chmod(0o775 if p.is_dir() else 0o664)
    finally:
        os.umask(old)
    store = open_cache(user_cache_dir(), None, None)
    for level in ("remoteloader", "remoteloader/blocks", "remoteloader/blocks/v1"):
        assert stat.S_IMODE((tmp_path / "xdg" / level).stat().st_mode) == 0o700, level
    assert store.lookup(SPLIT, ["k"]).hits == 1
    store.close()


# -- finding 7: who may make and write the location -------------------------------------------


def forged_location(path: Path, owner: int) -> None:
    """What another user leaves: the layout with a segment whose rows repeat one id."""
    split_dir = path / "v1" / "ab" / SPLIT
    split_dir.mkdir(parents=True)
    (split_dir / "000000000000001-f.seg").write_bytes(
        b"".join(encode_segment(SPLIT, {"k": DenseColumn(np.zeros(300, np.float32))}, PLAIN)))
    for p in [path, *path.rglob("*")]:
        os.chown(p, owner, owner)
        p.chmod(0o777 if p.is_dir() else 0o666)


@ROOT_ONLY
def test_a_location_another_user_made_first_is_refused(tmp_path, capsys):
    from remoteloader.master.__main__ import main as master_main
    from remoteloader.worker.__main__ import main as worker_main

    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)
    location = shared_tmp / "rl-cache"
    forged_location(location, NOBODY)
    with pytest.raises(CacheRefused, match=f"{location} is owned by uid {NOBODY}.*--cache-shared"):
        open_cache(str(location), None, None)
    assert worker_main(["--master", "tcp://127.0.0.1:9", "--cache", str(location)]) == 2
    assert master_main(["--bind", "tcp://127.0.0.1:0", "--workers", "0", "--cache", str(location)]) == 2
    err = capsys.readouterr().err
    assert err.count(f"cache location {location} is owned by uid {NOBODY}") == 2, err
    # A link another user planted where the location should be: refused too.
    (shared_tmp / "rl-link").symlink_to(tmp_path)
    os.chown(shared_tmp / "rl-link", NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(CacheRefused, match="is a symlink owned by uid"):
        open_cache(str(shared_tmp / "rl-link"), None, None)


def test_a_location_others_may_write_is_refused_and_sharing_needs_auth(tmp_path):
    location = tmp_path / "open"
    location.mkdir()
    location.chmod(0o1777)
    with pytest.raises(CacheRefused, match=r"writable by group or others \(mode 1777\).*chmod go-w"):
        open_cache(str(location), None, None)
    with pytest.raises(CacheRefused, match="--cache-shared .* needs --auth"):
        open_cache(str(location), None, None, shared=True)
    assert cli.main(["cache", "ls", str(location)]) == 1  # the operator's command holds it to the same rule
    keys = auth.load(auth.keygen(tmp_path / "keys"))
    store = open_cache(str(location), None, keys, shared=True)
    store.write(SPLIT, BLOCK)
    assert store.lookup(SPLIT, ["k"]).hits == 1
    assert stat.S_IMODE((location / "v1").stat().st_mode) == 0o770  # the location's group, never others
    store.close()


@ROOT_ONLY
def test_forged_blocks_of_another_user_are_never_served(tmp_path):
    # A private location of this user's that another user wrote in before it was closed:
    # their entries are skipped, never served (the CRC of a plain segment anyone can compute).
    private = tmp_path / "private"
    forged_location(private, NOBODY)
    os.chown(private, 0, 0)
    private.chmod(0o700)
    store = open_cache(str(private), None, None)
    got = store.lookup(SPLIT, ["k"])
    assert got.hits == 0 and store.skipped >= 1
    with pytest.raises(OSError):  # v1 is another user's: never written through (the writer counts a fault)
        store.write(SPLIT, BLOCK)
    assert store.lookup(SPLIT, ["k"]).hits == 0
    store.close()
    # Shared on purpose, with --auth: another user's plain segments are corrupt, a miss.
    location = tmp_path / "shared"
    forged_location(location, NOBODY)
    location.chmod(0o1777)
    keys = auth.load(auth.keygen(tmp_path / "keys"))
    store = open_cache(str(location), None, keys, shared=True)
    got = store.lookup(SPLIT, ["k"])
    assert got.hits == 0 and got.corrupt == 1
    store.close()


# -- finding 8: --cache-max-bytes is a bound --------------------------------------------------


def _size(root: Path) -> int:
    return sum(os.lstat(p).st_size for p in regular_files(root))


def test_writes_evict_least_recently_used_splits_to_stay_under_the_bound(tmp_path):
    root = tmp_path / "cache"
    one = len(b"".join(encode_segment("aa00", BLOCK, PLAIN)))
    bound = int(one * 2.5)
    store = open_cache(str(root), None, None, max_bytes=bound)
    splits = [f"{i:02x}{i:02x}" for i in range(1, 7)]
    for i, split in enumerate(splits):
        assert store.write(split, BLOCK) == one
        assert _size(root) <= bound, i
        if i == 1:
            time.sleep(0.05)  # past the file system's clock granularity
            assert store.lookup(splits[0], ["k"]).hits == 1  # read: now more recently used than splits[1]
        if i == 2:  # splits[1] made room for splits[2]
            assert {Path(p).parent.name for p in regular_files(root) if p.endswith(".seg")} == {splits[0], splits[2]}
        time.sleep(0.05)
    left = {Path(p).parent.name for p in regular_files(root) if p.endswith(".seg")}
    assert left == set(splits[-2:]), left
    big = {"big": DenseColumn(np.zeros(bound, np.float32))}
    assert store.write("ffff", big) == 0 and store.counters.dropped == 1  # can never fit: dropped, counted
    assert _size(root) <= bound and not (root / "v1" / "ff").exists()
    store.close()


def test_concurrent_writers_keep_the_bound(tmp_path):
    root = tmp_path / "cache"
    one = len(b"".join(encode_segment("aa00", BLOCK, PLAIN)))
    bound = one * 3
    stores = [BlockStore(str(root), PLAIN, max_bytes=bound) for _ in range(3)]  # as three worker processes
    writers = [BlockWriter(s) for s in stores]

    def write(w: BlockWriter, base: int) -> None:
        for i in range(8):
            w.submit(f"{base:02x}{i:02x}", BLOCK)

    threads = [threading.Thread(target=write, args=(w, n + 1)) for n, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        assert w.flush(30)
        w.close(5)
    assert _size(root) <= bound and sum(s.counters.puts for s in stores) == 24
    for s in stores:
        s.close()


def test_the_janitor_runs_its_first_pass_at_start(tmp_path):
    root = tmp_path / "cache"
    store = BlockStore(str(root), PLAIN)
    for i in range(4):
        store.write(f"{i:02x}{i:02x}", BLOCK)
    bound = _size(root) // 2
    janitor = CacheJanitor(store, bound)  # every 300 s, and once at start
    try:
        deadline = time.monotonic() + 5
        while _size(root) > bound and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _size(root) <= bound
    finally:
        janitor.close()
        store.close()


@pytest.mark.slow
def test_a_job_with_cache_max_bytes_leaves_the_cache_under_the_bound(tables, cluster, tmp_path):
    from remoteloader import RemoteDataLoader
    from tests.conftest import spec_dict

    cache = tmp_path / "cache"
    spec = spec_dict(tables["orc"], cache={"mode": "write-all"})
    master = cluster.master("--cache", str(cache), "--cache-max-bytes", "100K", workers=2)
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        rows = sorted(r for b in loader for r in b.passthrough["row_id"].tolist())
    master.stop()  # the workers' writes are finished
    assert rows == sorted(set(rows)) and rows
    assert 0 < _size(cache) <= 100 << 10
