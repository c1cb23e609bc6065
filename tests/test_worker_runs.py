"""Runs through a whole worker, in process against a scripted fake master: pieces go to
the run they were produced for, and pieces discarded for any reason are handed back and
counted, never reported stored. Plus the credit book on its own."""
from __future__ import annotations

from remoteloader.worker.credit import CreditBook

from .test_worker_fakes import Client, FakeMaster, RunningWorker, job, master  # noqa: F401 (fixtures)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def discarded(master: FakeMaster, reason: str) -> int:
    beat = master.wait_for(lambda m: m["t"] == "heartbeat" and reason in m["stats"].get("discarded", {}))
    return beat["stats"]["discarded"][reason]


def test_pieces_go_to_their_run_and_a_newer_run_of_the_session_hands_the_older_back(master, job):
    worker = RunningWorker(master.addr)
    client = Client(worker.worker.addr)
    try:
        master.splits.put(job.task(0, session="s-1", seq=0, epoch=0))
        master.wait_for(lambda m: m["t"] == "split_produced" and m["split_id"] == 0)
        master.splits.put(job.task(1, session="s-1", seq=1, epoch=1))  # read ahead: the next run
        master.wait_for(lambda m: m["t"] == "split_produced" and m["split_id"] == 1)
        client.credit("s-1", 1, batches=1)  # the client skipped run 0 (e.g. set_epoch 0, 1)
        header, _ = client.batch()
        assert (header["session"], header["seq"], header["split_id"], header["piece"]) == ("s-1", 1, 1, 0)
        released = master.wait_for(lambda m: m["t"] == "splits_released")
        assert released["splits"] == [[0, 0]] and released["reason"] == "stale_run"
        assert discarded(master, "stale_run") == -(-job.splits[0].rows // job.batch_size)
    finally:
        client.close()
        worker.stop()


def test_a_session_the_master_no_longer_lists_loses_its_pieces_and_its_splits_go_back(master, job):
    master.sessions = ["s-1"]
    worker = RunningWorker(master.addr)
    try:
        master.splits.put(job.task(2, session="s-1", epoch=4))
        master.wait_for(lambda m: m["t"] == "split_produced")
        master.sessions = []  # the client said goodbye (or timed out) on the master
        released = master.wait_for(lambda m: m["t"] == "splits_released")
        assert released["splits"] == [[4, 2]] and released["reason"] == "session_gone"
        assert discarded(master, "session_gone") > 0
        assert worker.worker.buffer.held(("s-1", 0)) == 0
    finally:
        worker.stop()


def test_a_task_of_a_new_session_of_a_rank_hands_back_the_old_sessions_splits(master, job):
    worker = RunningWorker(master.addr)
    client = Client(worker.worker.addr)
    try:
        master.splits.put(job.task(0, session="job-a", epoch=1))
        master.wait_for(lambda m: m["t"] == "split_produced")
        master.splits.put(job.task(0, session="job-b", epoch=0))  # job B's rank 0, epoch 0 after epoch 1
        # Job A's splits go back when job B's task is admitted, before or after B's split is
        # produced (the control thread reports releases on its own beat).
        produced = released = None
        while produced is None or released is None:
            m = master.wait_for(lambda m: m["t"] in ("split_produced", "splits_released"))
            if m["t"] == "split_produced":
                produced = m
            else:
                released = m
        assert released["splits"] == [[1, 0]] and released["reason"] == "session_gone"
        client.credit("job-b", 0, batches=1)
        header, _ = client.batch()
        assert (header["session"], header["split_id"], header["piece"]) == ("job-b", 0, 0)
    finally:
        client.close()
        worker.stop()


def test_credit_for_a_run_with_no_task_yet_waits_for_it():
    book = CreditBook(expire_after_s=30, clock=FakeClock())
    book.grant(("s", 0), b"c", 4, 1 << 20)
    book.grant(("s", 0), b"c", 2, 1 << 10)  # totals: a late, smaller grant changes nothing
    [(run, creditors)] = book.runs()
    assert run == ("s", 0) and (creditors[b"c"].pieces, creditors[b"c"].bytes) == (4, 1 << 20)


def test_credit_of_an_older_run_goes_when_the_session_credits_a_newer_one_and_silent_credit_expires():
    clock = FakeClock()
    book = CreditBook(expire_after_s=30, clock=clock)
    book.grant(("s", 0), b"c", 4, 100)
    book.grant(("t", 0), b"d", 4, 100)
    book.grant(("s", 2), b"c", 1, 100)
    assert sorted(run for run, _ in book.runs()) == [("s", 2), ("t", 0)]
    clock.now = 20
    book.grant(("t", 0), b"d", 5, 100)
    clock.now = 31
    book.expire()  # the client of session s said nothing for 30 s
    assert [run for run, _ in book.runs()] == [("t", 0)]


def _messages(master: FakeMaster, job, session: str, **worker_kwargs) -> list[tuple[list[int], int]]:
    """Split 0 pushed whole to one client by a worker made with ``worker_kwargs``, credited only
    once every piece is buffered (so what goes together is the pusher's choice alone): each
    message's piece rows and data bytes."""
    worker = RunningWorker(master.addr, **worker_kwargs)
    client = Client(worker.worker.addr)
    try:
        master.splits.put(job.task(0, session=session))
        master.wait_for(lambda m: m["t"] == "split_produced" and m["split_id"] == 0)
        client.credit(session, 0)
        got, rows = [], 0
        while rows < job.splits[0].rows:
            header, arrays = client.batch()
            got.append((header["rows"], sum(a.nbytes for a in arrays.values())))
            rows += sum(header["rows"])
        return got
    finally:
        client.close()
        worker.stop()


def test_a_run_of_pieces_goes_in_messages_of_at_most_max_message_bytes(master, job):
    # One byte: every piece is larger, so each goes alone (none is held back or dropped).
    alone = _messages(master, job, "s-1", max_message_bytes=1)
    assert len(alone) >= 3 and all(len(rows) == 1 for rows, _ in alone)
    sizes = [nbytes for _, nbytes in alone]
    # Room for exactly the first two pieces: runs are cut greedily, each within the cap.
    cap = sizes[0] + sizes[1]
    expected, run, total = [], [], 0
    for rows, nbytes in alone:
        if run and total + nbytes > cap:
            expected.append(run)
            run, total = [], 0
        run.append(rows[0])
        total += nbytes
    expected.append(run)
    got = _messages(master, job, "s-2", max_message_bytes=cap)
    assert [rows for rows, _ in got] == expected and len(got) > 1
    assert all(nbytes <= cap or len(rows) == 1 for rows, nbytes in got)
    assert sum(nbytes for _, nbytes in got) == sum(sizes)
    # The default (16 MiB) takes this whole small split as one message, as before.
    assert [rows for rows, _ in _messages(master, job, "s-3")] == [[r for rows, _ in alone for r in rows]]
