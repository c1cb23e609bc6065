"""Coalesced reads against a real S3-protocol server on loopback (moto in server mode),
counting the range GETs the server receives."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import numpy as np
import pyarrow.fs as pafs
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from remoteloader.tools.datagen import generate_table
from remoteloader.formats import IOStats, arrow_to_column, clear_tail_cache, list_table, open_filesystem, read_split

werkzeug_app = pytest.importorskip("moto.moto_server.werkzeug_app")
serving = pytest.importorskip("werkzeug.serving")

ROWS, STRIPE_ROWS = 900, 300


class Server:
    """moto's S3 on 127.0.0.1, logging (method, path, Range header) of every request."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        app = werkzeug_app.DomainDispatcherApplication(werkzeug_app.create_backend_app)

        def logging_app(environ, start_response):
            with self._lock:
                self.log.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE", "")))
            return app(environ, start_response)

        class Quiet(werkzeug_app.MotoRequestHandler):
            def log_request(self, *args, **kwargs) -> None:  # no access log on stderr
                pass

        self._server = serving.make_server("127.0.0.1", 0, logging_app, threaded=True, request_handler=Quiet)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def range_gets(self) -> int:
        with self._lock:
            return sum(1 for method, _, range_ in self.log if method == "GET" and range_)

    def reset(self) -> None:
        with self._lock:
            self.log.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[tuple[Server, str]]:
    """A moto S3 server with ``bucket`` made, and the URI query that reaches it."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
            env.setenv(key, value)
        server = Server()
        try:
            endpoint = f"127.0.0.1:{server.port}"
            pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                              allow_bucket_creation=True).create_dir(bucket)
            yield server, f"endpoint_override={endpoint}&scheme=http&region=us-east-1"
        finally:
            server.stop()


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[Server, str]]:
    with moto_s3("tables") as served:
        yield served


@pytest.fixture(scope="module", params=["orc", "parquet"])
def table(request, s3) -> tuple[str, Server, str]:
    server, query = s3
    uri = f"s3://tables/{request.param}?{query}"
    # 50 feature columns (55 with the scores of the scored features).
    generate_table(uri, ROWS, dense=20, sparse=25, scored=5, format=request.param, stripe_rows=STRIPE_ROWS, seed=3,
                   progress=False)
    return request.param, server, uri


def plain_range_gets(server: Server, fmt: str, path: str, unit: int, columns: list[str]) -> tuple[int, object]:
    """Range GETs of plain pyarrow reading one stripe / row group (the file opened before)."""
    fs, inner = open_filesystem(path)
    with fs.open_input_file(inner) as source:
        reader = paorc.ORCFile(source) if fmt == "orc" else pq.ParquetFile(source, pre_buffer=False)
        server.reset()
        data = reader.read_stripe(unit, columns=columns) if fmt == "orc" else reader.read_row_group(unit, columns=columns)
        return server.range_gets(), data


def test_coalesced_reads_cost_a_few_requests_per_stripe(table):
    fmt, server, uri = table
    files = list_table(uri)
    assert files[0].path.startswith("s3://tables/") and "endpoint_override=" in files[0].path
    f = files[0]
    assert len(f.units) == ROWS // STRIPE_ROWS
    names = ["row_id", "label", "ts", *[f"float_{i}" for i in range(20)], *[f"idlist_{i}" for i in range(25)],
             *[c for i in range(5) for c in (f"idscore_{i}", f"idscore_{i}_scores")]]
    tenth = ["label", "float_3", "idlist_4", "idlist_17", "float_11", "idscore_2", "idscore_2_scores"]
    clear_tail_cache()
    # A 10% projection on every stripe, every column on one (plain reads of all are slow).
    for columns, units in ((tenth, range(len(f.units))), (names, [1])):
        for unit in units:
            plain, expected = plain_range_gets(server, fmt, f.path, unit, columns)
            server.reset()
            stats = IOStats()
            got = read_split(f, unit, unit + 1, columns, io_stats=stats)
            coalesced = server.range_gets()
            assert coalesced == stats.requests  # every request of ours is one range GET
            tail = 1 if unit == 0 else 0  # then cached for the file's other splits
            # ORC: stripe footer + one merged range; Parquet: one merged range.
            assert coalesced <= tail + (2 if fmt == "orc" else 1)
            # Plain pyarrow: one GET per column stream (ORC: ~1.5 per column, plus the footer).
            assert plain >= len(columns) + (1 if fmt == "orc" else 0)
            if columns is names and fmt == "orc":
                assert plain >= 70
            for name in ("label", "idlist_4"):
                np.testing.assert_array_equal(got[name].values, arrow_to_column(expected.column(name)).values)
    # Uncoalesced: one GET per stream / chunk, like plain pyarrow.
    server.reset()
    stats = IOStats()
    read_split(f, 1, 2, tenth, coalesce_gap=0, io_stats=stats)
    assert server.range_gets() == stats.requests == plain_range_gets(server, fmt, f.path, 1, tenth)[0]


def test_slow_s3(table):
    fmt, server, uri = table
    files = list_table(f"slow+{uri}&profile=object_store")
    assert files[0].path.startswith("slow+s3://tables/")
    clear_tail_cache()
    server.reset()
    got = read_split(files[0], 0, 1, ["label", "idlist_3"])
    assert len(got["label"]) == STRIPE_ROWS and server.range_gets() >= 1
