"""Fuzzing the edges: generated messages never crash the master or a worker, never reach
the master's journal invalid, and afterwards both still serve a full, exact epoch."""
from __future__ import annotations

import msgpack
import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remoteloader.core.plan import SplitTask
from remoteloader.core.processor import SplitProcessor
from remoteloader.master.journal import Journal
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.protocol import messages as M
from remoteloader.protocol import wire
from remoteloader.spec import DatasetSpec
from remoteloader import RemoteDataLoader
from tests.conftest import ROWS, master_status, spec_dict
from tests.wire_helpers import ask

# Values a peer might send: the right types with hostile values, and the wrong types.
# Weighted towards values that reach past the first checks (epoch 0, split 1, a known client).
ints = st.one_of(st.sampled_from([0, 0, 1, 2, -1]), st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1))
# "$W" stands for the id of a worker that really registered, "$C" for the session of a client that said hello.
texts = st.one_of(st.sampled_from(["$C", "$W"]), st.sampled_from(["w-x", "tcp://127.0.0.1:1", ""]),
                  st.text(max_size=40))
leaves = st.one_of(ints, texts, st.floats(allow_nan=True), st.booleans(), st.none())
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(texts, inner, max_size=4)), max_leaves=12)


_TYPES = {mi.IntType: (int,), mi.StrType: (str,), mi.EnumType: (str,), mi.ListType: (list,), mi.DictType: (dict,),
          mi.StructType: (dict,)}
_BY_TAG = {M.tag(c): c for c in M.MESSAGE_TYPES}


def schema(t: str) -> dict[str, tuple[tuple, bool]]:
    """Each field of message type ``t``: the python types a map field of it takes, and
    whether it is required (``v`` is the envelope's, drawn separately)."""
    out = {}
    for f in mi.type_info(_BY_TAG[t]).fields:
        kind = f.type
        if isinstance(kind, mi.UnionType):  # an optional record
            kind = next(k for k in kind.types if not isinstance(k, mi.NoneType))
        if f.name != "v":
            out[f.name] = (_TYPES.get(type(kind), (object,)), f.required)
    return out


def near_value(types: tuple) -> st.SearchStrategy:
    """The right type, with values that get past the first checks and probe the next ones."""
    if types == (int,):
        return st.sampled_from([0, 0, 1, 2, -1, 2**40])
    if types == (str,):
        return st.sampled_from(["$C", "$C", "$W", "w-x", "tcp://127.0.0.1:1"])
    if types == (list,):
        return st.lists(st.lists(st.sampled_from([0, 1, 2, -1, 10**9]), max_size=3), max_size=4)
    if types == (dict,):
        return st.just({})
    return values


def hostile_value(types: tuple) -> st.SearchStrategy:
    if types == (int,):
        return st.one_of(ints, values)
    if types == (str,):
        return st.one_of(texts, values)
    return values


@st.composite
def master_messages(draw) -> tuple:
    t = draw(st.sampled_from(sorted(wire.MASTER_REQUESTS)))
    value = near_value if draw(st.booleans()) else hostile_value
    fields = {name: draw(value(types)) for name, (types, required) in schema(t).items()
              if required or draw(st.booleans())}
    if draw(st.integers(0, 9)) == 0:
        fields[draw(texts)] = draw(values)  # an unknown field
    v = wire.PROTOCOL_VERSION
    header = {"v": draw(st.sampled_from([v] * 8 + [v - 1, str(v)])), "t": t, **fields}
    cut = draw(st.one_of(st.none(), st.floats(0, 1))) if draw(st.integers(0, 9)) == 0 else None  # truncation
    frames = [b"x" * draw(st.integers(0, 64)) for _ in range(draw(st.integers(0, 2)))]
    return header, cut, frames


def packed(message: tuple, worker_id: str, session: str = "") -> list:
    header, cut, frames = message
    real = {"$W": worker_id, "$C": session}
    header = {k: real.get(v, v) if isinstance(v, str) else v for k, v in header.items()}
    raw = msgpack.packb(header, use_bin_type=True)
    return [raw if cut is None else raw[: int(cut * len(raw))], *frames]


@pytest.fixture(scope="module")
def spec(tables) -> DatasetSpec:
    return DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=256, shuffle=True))


def serve(service: MasterService, parts: list) -> None:
    """What MasterServer does with one message, minus the socket: decode, handle, encode."""
    try:
        header, _ = wire.decode(parts)
    except wire.ProtocolError:
        return
    reply = service.handle(header)  # must not raise: handlers refuse with an error reply
    wire.decode(wire.encode(reply))  # and the reply must itself follow the protocol


# A split's rows and piece count, by its record minus the fields that only route it (session,
# seq): every example's master plans the same splits of the same table, so each is read and
# transformed once per test run rather than once per example (most of an example's time).
_PRODUCED: dict[bytes, tuple[list[int], int]] = {}


def produce(processor_of, record: dict) -> tuple[list[int], int]:
    """The rows of the split ``record`` and its piece count, through the real processor."""
    key = msgspec.msgpack.encode({k: v for k, v in record.items() if k not in ("session", "seq")}, order="sorted")
    if key not in _PRODUCED:
        task = SplitTask.from_wire(msgspec.convert(record, M.SplitTaskRecord))
        pieces = list(processor_of().pieces(task))
        _PRODUCED[key] = ([int(r) for p in pieces for r in p.arrays["pt.row_id"]], len(pieces))
    return _PRODUCED[key]


def full_epoch(service: MasterService, spec: DatasetSpec, epoch: int) -> list[int]:
    """A worker and a client, in process: every row of the epoch, through the real processor
    (each distinct split processed once, see ``produce``)."""
    w = ask(service, {"t": "register", "addr": "tcp://127.0.0.1:9", "pid": 1,
                      "fingerprint": spec.fingerprint()})[1]["worker_id"]
    t, reply = ask(service, {"t": "hello", "rank": 0, "world_size": 1, "spec": spec.to_dict(),
                               "fingerprint": spec.fingerprint()})
    assert t == "welcome", reply
    session = reply["session"]
    t, reply = ask(service, {"t": "start_epoch", "session": session, "epoch": epoch})
    assert t == "epoch"
    seq = reply["seq"]
    processor: list[SplitProcessor] = []
    rows: list[int] = []

    def processor_of() -> SplitProcessor:
        if not processor:
            processor.append(SplitProcessor(service.bound))
        return processor[0]

    token = service.keys.worker_token(w)
    while (reply := ask(service, {"t": "get_split", "worker_id": w, "token": token}))[0] == "split":
        task = SplitTask.from_wire(msgspec.convert(reply[1]["split"], M.SplitTaskRecord))
        if task.epoch != epoch:  # the worker reads ahead into the next epoch: this one is all out
            break
        split_rows, pieces = produce(processor_of, reply[1]["split"])
        rows += split_rows
        ask(service, {"t": "split_produced", "worker_id": w, "token": token, "epoch": epoch,
                        "split_id": task.split_id})
        ask(service, {"t": "client_heartbeat", "session": session, "seq": seq,
                        "acks": [[task.split_id, pieces]]})
    return rows


@pytest.mark.slow  # 300 examples, each a journaled master, its replay and a whole epoch: seconds
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.lists(master_messages(), min_size=1, max_size=12))
def test_generated_messages_neither_crash_nor_poison_the_master(spec, tmp_path_factory, messages):
    directory = tmp_path_factory.mktemp("journal")
    service = MasterService(MasterConfig(allowed_tables=(str(spec.table.path),)), Journal(directory))
    service.submit(spec)
    worker_id = ask(service, {"t": "register", "addr": "tcp://127.0.0.1:8", "pid": 2,
                              "fingerprint": spec.fingerprint()})[1]["worker_id"]
    session = ask(service, {"t": "hello", "rank": 0, "world_size": 1, "spec": spec.to_dict(),
                            "fingerprint": spec.fingerprint()})[1]["session"]
    ask(service, {"t": "start_epoch", "session": session, "epoch": 0})
    for message in messages:
        serve(service, packed(message, worker_id, session))
        service.tick()
    service.journal.close()
    # Whatever was journaled replays, and the master still serves an exact epoch.
    restarted = MasterService(MasterConfig(), Journal(directory))
    assert not (directory / "journal.quarantine").exists()
    rows = full_epoch(restarted, spec, epoch=0)
    assert sorted(rows) == list(range(ROWS))


def test_random_bytes_are_refused(spec):
    rng = np.random.default_rng(0)
    service = MasterService(MasterConfig())
    service.submit(spec)
    for _ in range(2000):
        n = int(rng.integers(0, 200))
        serve(service, [rng.integers(0, 256, n, dtype=np.uint8).tobytes()])
    assert sorted(full_epoch(service, spec, epoch=3)) == list(range(ROWS))


@st.composite
def worker_messages(draw, session: str) -> list:
    """What a hostile peer sends a worker's data socket: requests of every type (mostly
    credit, with hostile values), truncated msgpack, random bytes, wrong frame counts,
    frames past the worker's 64 KiB message limit. It knows the real client's ``session``
    ("$C": status lists sessions), not the token the master signed it with."""
    kind = draw(st.sampled_from(["credit"] * 4 + ["other", "bytes", "frames", "oversize"]))
    if kind == "bytes":
        return [draw(st.binary(max_size=200))]
    if kind == "oversize":
        return [msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "credit", "session": "s-0", "seq": 0, "pieces": 1,
                               "bytes": 1}), b"x" * (70 << 10)]
    t = "credit" if kind in ("credit", "frames") else draw(st.sampled_from(sorted(_BY_TAG)))
    fields = {name: draw(hostile_value(types)) for name, (types, required) in schema(t).items()
              if required or draw(st.booleans())}
    message = packed(({"v": wire.PROTOCOL_VERSION, "t": t, **fields},
                      draw(st.one_of(st.none(), st.floats(0, 1))) if draw(st.integers(0, 5)) == 0 else None, []), "",
                     session)
    if kind == "frames":
        message += [b"y"] * draw(st.integers(1, 70))
    return message


def test_generated_messages_neither_crash_nor_starve_a_worker(tables, cluster):
    master = cluster.master(workers=1)
    spec = spec_dict(tables["orc"], batch_size=256)
    ctx = zmq.Context.instance()
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        assert sorted(r for b in loader for r in b.passthrough["row_id"].tolist()) == list(range(ROWS))
        status = master_status(master.addr)
        (worker,), (client,) = status["workers"], status["clients"]

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(worker_messages(client["id"]), min_size=1, max_size=50))
        def attack(messages):
            hostile = ctx.socket(zmq.DEALER)
            hostile.setsockopt(zmq.LINGER, 0)
            hostile.connect(worker["addr"])
            for message in messages:
                hostile.send_multipart(message)
            served = hostile.poll(50)
            hostile.close()
            assert not served, "a peer without the session's token was sent something"

        attack()
        # Same worker process, still heartbeating, and the next epoch is exact.
        assert master.worker_pids() == [worker["pid"]]
        assert sorted(r for b in loader for r in b.passthrough["row_id"].tolist()) == list(range(ROWS))
