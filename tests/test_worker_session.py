"""The worker's session with its master, in process against a scripted fake master:
re-registration windows (issue 22 defects 4 and 5), the job fingerprint (defect 6), and
threads that fail."""
from __future__ import annotations

from remoteloader.worker.lifecycle import TableRefused, WorkerFailed

from .test_worker_fakes import Client, FakeMaster, Job, RunningWorker, job, master  # noqa: F401 (fixtures)


def registered(master: FakeMaster) -> None:
    master.wait_for(lambda m: m["t"] == "register" and not master.hold_register.is_set())


def asks_register_every(worker: RunningWorker, seconds: float) -> RunningWorker:
    """A register left unanswered is asked again after ``seconds`` (by default the worker's
    RPC timeout): the window a test of a master that does not answer register waits through."""
    worker.worker.control.registrar.register_timeout_s = seconds
    return worker


def test_a_get_split_the_old_master_never_answered_is_given_up_when_the_worker_registers_again(master, job):
    """A get_split sent just before the master died gets no answer. Once the worker learns
    its session ended (the restarted master does not know it) and registers again, the
    producer gives that request up and asks the new master, instead of waiting out its
    whole RPC timeout (an hour here, so only giving up lets the split below be produced)."""
    worker = RunningWorker(master.addr, rpc_timeout_s=3600.0)
    try:
        first = master.wait_for(lambda m: m["t"] == "get_split")["worker_id"]
        master.hold_get_split.set()
        master.held.get(timeout=60)  # a get_split is now in flight, never to be answered
        master.heartbeat_state = "unknown"  # the master restarted without a journal
        master.wait_for(lambda m: m["t"] == "register")
        master.heartbeat_state = "run"
        master.hold_get_split.clear()
        master.splits.put(job.task(0, session="s-a"))
        produced = master.wait_for(lambda m: m["t"] == "split_produced")
        assert produced["worker_id"] != first and produced["split_id"] == 0
    finally:
        worker.stop()


def test_a_get_split_the_old_master_never_answered_is_given_up_after_a_restart_on_its_journal(master, job):
    """The same after a restart on the journal: the new master process knows the worker, so
    its session goes on, but heartbeats name another process; the request the old process
    never answered is given up and asked again under the same worker id."""
    worker = RunningWorker(master.addr, rpc_timeout_s=3600.0)
    try:
        first = master.wait_for(lambda m: m["t"] == "get_split")["worker_id"]
        master.hold_get_split.set()
        master.held.get(timeout=60)
        master.hold_get_split.clear()
        master.splits.put(job.task(0, session="s-a"))
        master.incarnation = "m-restarted"
        produced = master.wait_for(lambda m: m["t"] == "split_produced")
        assert produced["worker_id"] == first and produced["split_id"] == 0
        assert sum(m["t"] == "register" for m in master.seen) == 1  # the session went on
    finally:
        worker.stop()


def test_no_split_is_asked_for_while_the_worker_registers_again_and_it_produces_after(master, job):
    """Defect 4: a get_split between 'unknown' and the new registration had no worker id;
    the producer died on it and the worker heartbeated on without ever taking a split."""
    worker = asks_register_every(RunningWorker(master.addr), 0.1)
    try:
        first = master.wait_for(lambda m: m["t"] == "get_split")["worker_id"]
        master.hold_register.set()  # the master restarted without a journal and answers register slowly
        master.heartbeat_state = "unknown"
        master.wait_for(lambda m: m["t"] == "register")
        master.heartbeat_state = "run"
        # Several no_split retry periods (20 ms) pass while register hangs; the producer must wait, not die.
        for _ in range(3):
            master.wait_for(lambda m: m["t"] == "register")  # register retries (every 0.1 s)
        master.hold_register.clear()
        master.splits.put(job.task(0, session="s-a"))
        produced = master.wait_for(lambda m: m["t"] == "split_produced")
        assert produced["worker_id"] != first and produced["split_id"] == 0
        assert all(isinstance(m["worker_id"], str) for m in master.seen if "worker_id" in m)
    finally:
        worker.stop()
    assert worker.error is None


def test_a_worker_asked_to_drain_while_it_registers_again_exits(master):
    """Defect 5: SIGTERM during re-registration left a worker that never exited."""
    worker = RunningWorker(master.addr)
    master.wait_for(lambda m: m["t"] == "heartbeat")
    master.hold_register.set()  # the master will never answer register
    master.heartbeat_state = "unknown"
    master.wait_for(lambda m: m["t"] == "register")
    worker.worker.request("drain")  # what the SIGTERM handler does
    assert worker.join(), "the worker did not exit"
    assert worker.error is None  # the master does not count on it: nothing to drain, a clean exit


def test_a_worker_of_a_master_restarted_for_another_job_rebuilds_its_pipeline(tables, master, job):
    """Defect 6: after a restart for another spec, the worker kept the old pipeline."""
    worker = RunningWorker(master.addr)
    client = Client(worker.worker.addr)
    try:
        register = master.wait_for(lambda m: m["t"] == "register")
        assert register["fingerprint"] == job.fingerprint
        other = Job(tables["orc"], batch_size=100)  # same table and shapes, another spec
        master.job = other  # the master restarted (same address) for job B
        master.heartbeat_state = "unknown"
        register = master.wait_for(lambda m: m["t"] == "register" and m["fingerprint"] == other.fingerprint)
        master.heartbeat_state = "run"
        master.splits.put(other.task(0, session="s-b"))
        client.credit("s-b", 0)
        header, arrays = client.batch()
        assert header["session"] == "s-b" and header["seq"] == 0
        assert header["rows"][0] == 100  # job B's batch size: its pipeline, not job A's
    finally:
        client.close()
        worker.stop()
    assert worker.error is None


def test_a_split_of_another_job_is_handed_back_and_the_worker_registers_for_that_job(tables, master, job):
    """A standing master that moved to another job: its split names that job's fingerprint."""
    worker = RunningWorker(master.addr)
    client = Client(worker.worker.addr)
    try:
        first = master.wait_for(lambda m: m["t"] == "register")
        other = Job(tables["orc"], batch_size=100)
        master.job = other
        master.splits.put(other.task(3, session="s-b"))
        released = master.wait_for(lambda m: m["t"] == "splits_released")
        assert released["splits"] == [[0, 3]] and released["reason"] == "wrong_job"
        master.wait_for(lambda m: m["t"] == "register" and m["fingerprint"] == other.fingerprint)
        master.splits.put(other.task(3, session="s-b"))
        client.credit("s-b", 0)
        header, _ = client.batch()
        assert header["split_id"] == 3 and header["rows"][0] == 100
        assert first["fingerprint"] == job.fingerprint
        assert not [m for m in master.seen if m["t"] == "split_produced" and m["worker_id"] == "w-0"]
    finally:
        client.close()
        worker.stop()


def test_a_new_job_outside_allow_table_stops_the_worker(tables, master):
    worker = RunningWorker(master.addr, allowed_tables=(str(tables["orc"]),))
    master.wait_for(lambda m: m["t"] == "heartbeat")
    master.job = Job(tables["parquet"])  # a table this worker may not read
    master.heartbeat_state = "unknown"
    assert worker.join(), "the worker did not exit"
    assert isinstance(worker.error, TableRefused)


def test_a_thread_that_fails_stops_the_whole_worker(master):
    worker = RunningWorker(master.addr)
    master.wait_for(lambda m: m["t"] == "get_split")

    def broken(*_):
        raise RuntimeError("injected")

    worker.worker.buffer.keep_sessions = broken  # the control thread's next heartbeat reply raises
    master.sessions = []
    assert worker.join(), "the worker did not exit"
    assert isinstance(worker.error, WorkerFailed) and "injected" in str(worker.error.__cause__)
    assert master.wait_for(lambda m: m["t"] == "bye")  # it leaves the master at once, not by timeout
