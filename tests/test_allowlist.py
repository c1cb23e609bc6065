"""The table allowlist checks what will be opened: decoded paths, resolved symlinks, no
encoded escapes (the red team's percent-encoding bypass, issue 23)."""
from __future__ import annotations

from pathlib import Path

import pytest

from remoteloader.core.allowlist import TableAllowlist
from remoteloader.formats import TableError, list_table, open_filesystem
from remoteloader.tools.datagen import generate_table

S3 = "endpoint_override=minio:9000"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """``allowed/`` (the prefix) holding ``t/`` and a symlink ``out`` to ``secret/``, which
    holds a mode-0600 table ``t`` outside the allowlist."""
    root = tmp_path_factory.mktemp("allow")
    (root / "allowed" / "t").mkdir(parents=True)
    generate_table(str(root / "secret" / "t"), rows=1000, dense=1, sparse=1, seed=3, progress=False)
    for f in (root / "secret" / "t").rglob("*.orc"):
        f.chmod(0o600)
    (root / "allowed" / "out").symlink_to(root / "secret")
    (root / "allowed" / "alias").symlink_to(root / "allowed" / "t")
    (root / "entry").symlink_to(root / "allowed")
    return root


def _refused(tree: Path) -> list[tuple[str, str]]:
    a, slow = tree / "allowed", f"slow+file://{tree / 'allowed'}?profile=hdd"
    return [
        (str(a), f"file://{a}/%2e%2e/secret/t"),                    # the red team's URI
        (str(a), f"file://{a}/%2E%2E/secret/t"),
        (str(a), f"file://{a}/..%2fsecret/t"),                      # an encoded separator
        (str(a), f"file://{a}/.%2e/secret/t"),
        (str(a), f"file://{a}/out/t"),                              # a symlink out
        (str(a), f"{a}/out/t"),
        (str(a), f"{a}/../secret/t"),
        (slow, f"slow+file://{a}/%2e%2e/secret/t?profile=hdd"),
        (slow, f"slow+file://{a}/out/t?profile=hdd"),               # slow+ prefixes resolve symlinks too
        (f"s3://bucket/t?{S3}", f"s3://bucket/t/%2e%2e/private?{S3}"),
        (f"s3://bucket/t?{S3}", f"s3://bucket/t/../private?{S3}"),
        (f"s3://bucket/t?{S3}", f"s3://bucket/t/./x?{S3}"),
        (f"s3://bucket/t?{S3}", f"s3://bucket/t%2fx?{S3}"),
        (f"s3://bucket/t?{S3}", f"s3://bucket/t2?{S3}"),
        (f"s3://bucket/t?{S3}", "s3://bucket/t/x?endpoint_override=evil:1"),   # another endpoint
        (str(a), f"slow+file://{a}/t?profile=hdd"),                  # another filesystem than the prefix's
    ]


def test_paths_that_lead_outside_a_prefix_are_refused(tree):
    for prefix, path in _refused(tree):
        assert not TableAllowlist([prefix]).allows(path), (prefix, path)


def test_paths_under_a_prefix_are_allowed(tree):
    a = tree / "allowed"
    for prefix, path in [
        (str(a), f"{a}/t"),
        (str(a), f"file://{a}/t"),
        (str(a), f"file://{a}/a%20b"),                              # other escapes decode as pyarrow does
        (str(a), f"{a}/alias"),                                     # a symlink that stays inside
        (str(tree / "entry"), f"{a}/t"),                            # a prefix through a symlink
        (f"file://{a}", f"{a}/t"),
        (f"slow+file://{a}?profile=hdd", f"slow+file://{a}/t/ds=1/part-0.orc?profile=hdd"),
        (f"s3://bucket/t?{S3}", f"s3://bucket/t/ds=1/part-0.orc?{S3}"),
        ("s3://bucket/", "s3://bucket/any/key"),
    ]:
        assert TableAllowlist([prefix]).allows(path), (prefix, path)


@pytest.mark.parametrize("uri", ["file://{a}/%2e%2e/secret/t", "file://{a}/..%2Fsecret/t",
                                 "slow+file://{a}/%2e%2e/secret/t?profile=hdd", "file://{a}/./t"])
def test_the_opener_refuses_encoded_escapes_and_dot_segments(tree, uri):
    """Even with no allowlist, nothing opens a URI whose decoded path leaves where it points."""
    uri = uri.format(a=tree / "allowed")
    with pytest.raises(TableError, match=r"percent-encoded|'\.' or '\.\.' segment"):
        open_filesystem(uri)
    with pytest.raises(TableError):
        list_table(uri)


def test_the_opener_opens_the_decoded_path_the_allowlist_checked(tree):
    a = tree / "allowed"
    assert open_filesystem(f"file://{a}/a%20b")[1] == f"{a}/a b"       # as pyarrow decodes it
    assert len(list_table(f"file://{tree / 'secret'}/t")) == 1          # the tree's secret table is readable
