"""rdmaflow.job: the launcher's environment, the job secret and the job's c10d store that the
parameter server and the pipeline share. Real TCPStores on loopback, several per test process
(one serving, the others its clients), as a job's processes hold them."""
from __future__ import annotations

import gc
import time

import pytest

import rdmaflow
from rdmaflow import job
from rdmaflow.bench.processes import free_port
from rdmaflow.job import JobStore, env_int, job_secret

NS = "rdmaflow/test/"


@pytest.fixture
def store_env(monkeypatch):
    """MASTER_ADDR/PORT of a fresh store, served by rank 0 of this test process."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def stores(world: int, ns: str = NS) -> list[JobStore]:
    """The stores of ranks 0..world-1; rank 0's serves."""
    return [JobStore(r, world, 5.0, ns) for r in range(world)]


def test_the_serving_process_counts_the_left_and_the_declared_dead_as_gone(store_env):
    """A process declared dead never leaves and counts as gone instead: once, however many
    processes name it. A process counts itself out once, however often it says so."""
    host, a, b = stores(3)
    assert host.serving and not a.serving and not b.serving
    assert host._gone() == 0
    a.declare_dead("shard", 1)
    b.declare_dead("shard", 1)  # the same process, found dead by another
    assert host._gone() == 1
    host.declare_dead("worker", 1)
    assert host._gone() == 2
    a.count_out()
    a.count_out()
    assert host._gone() == 3
    assert a.check("dead/shard/1") and not a.check("dead/shard/0")


def test_the_serving_process_waits_at_exit_only_for_processes_still_there(store_env, monkeypatch):
    """leave() on the serving process returns as soon as every process left or was declared
    dead; with one unaccounted for it waits out its bound, and no longer."""
    monkeypatch.setattr(job, "LINGER", 60.0)
    host, worker, _dead0, _dead1 = stores(4)
    worker.count_out()
    worker.declare_dead("shard", 2)
    host.declare_dead("shard", 3)
    t0 = time.monotonic()
    host.leave()
    assert time.monotonic() - t0 < 30.0, "the serving process waited for processes that left or died"

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(job, "LINGER", 1.0)
    host, worker, _alive = stores(3)
    worker.leave()  # a client does not wait
    t0 = time.monotonic()
    host.leave()
    waited = time.monotonic() - t0
    assert 0.9 <= waited < 30.0, f"with rank 2 still there the serving process waited {waited:.2f} s, not its 1 s bound"


def test_a_wait_raises_the_jobs_abort_reason_and_names_missing_keys(store_env):
    host, other = stores(2)
    other.set("a", "1")
    assert host.get("a") == "1"
    with pytest.raises(rdmaflow.TimeoutError, match=r"waiting for \['b'\]"):
        host.wait(["a", "b"], timeout=0.3)
    other.abort("rank 1: first")
    host.abort("rank 0: second")  # the first reason wins
    assert host.abort_reason() == other.aborted() == "rank 1: first"
    with pytest.raises(rdmaflow.PeerError, match="the job was aborted: rank 1: first"):
        host.wait(["b"], timeout=5.0)
    assert host.fail_with("rank 0: later", ("worker", 1)) == "rank 1: first"
    assert not host.check("dead/worker/1"), "a failure after the abort is its consequence: nothing is recorded"


def test_fail_with_records_the_first_failure_and_the_dead_process(store_env):
    host, other = stores(2)
    assert other.fail_with("shard 1 died", ("shard", 1)) is None
    assert host.abort_reason() == "shard 1 died"
    assert host.check("dead/shard/1") and host._gone() == 1


def test_a_value_larger_than_a_store_message_goes_in_parts(store_env):
    """A key-value declaration of a million keys is about 15 MB of JSON: torch's TCPStore drops
    a message over 8 MiB, and the connection with it (every process then waited out its setup
    timeout)."""
    host, other = stores(2)
    value = "".join(chr(ord("a") + i % 26) for i in range(20 << 20))
    other.set_large("spec", value)
    assert host.get_large("spec") == value
    other.set_large("empty", "")
    assert host.get_large("empty") == ""


def test_namespaces_keep_the_layers_keys_apart(store_env):
    """The parameter server and the pipeline share the job's store, each under its own keys,
    also in one process of the serving rank."""
    ps, graph, other = JobStore(0, 2, 5.0, "rdmaflow/ps/"), JobStore(0, 2, 5.0, "rdmaflow/graph/"), stores(2)[1]
    ps.abort("a shard failed")
    ps.set("k", "ps")
    assert graph.aborted() is None and not graph.check("k")
    assert ps.tcp.check(["rdmaflow/ps/k"]) and other.tcp.check(["rdmaflow/ps/k"])


def test_a_process_holding_several_stores_counts_out_once(store_env):
    """The serving rank builds a second pipeline while the first is alive: both stores work (one
    server), and the process leaves once."""
    first, second = JobStore(0, 2, 5.0, NS), JobStore(0, 2, 5.0, NS)
    second.set("k", "v")
    assert first.get("k") == "v"
    first.count_out()
    second.count_out()
    assert first._gone() == 1


def test_a_gone_store_raises_library_errors(store_env):
    """The process serving the store has exited: every call raises the library's PeerError."""
    host, client = stores(2)
    client.set("k", "v")
    job._SERVING.remove(host)  # held until exit, where it would wait for the client
    del host
    gc.collect()
    with pytest.raises(rdmaflow.PeerError):
        client.get("k", 2.0)
    for call in (lambda: client.set("x", "1"), lambda: client.check("k")):
        with pytest.raises(rdmaflow.PeerError):
            call()
    assert client.aborted() == "the job's c10d store is unreachable"
    assert client.abort_reason() is None


def test_the_launchers_environment_is_checked(monkeypatch):
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$RANK='two' is not an integer"):
        env_int("RANK", 0)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$MASTER_PORT is not set"):
        env_int("MASTER_PORT")
    assert env_int("MASTER_PORT", 29500) == 29500
    monkeypatch.setenv("MASTER_PORT", "99999")  # torch's TCPStore refused it with its signature dump
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$MASTER_PORT=99999 is not a port in \[1, 65535\]"):
        JobStore(1, 2, 5.0, "rdmaflow/test/")


def test_a_job_of_several_processes_needs_its_secret(monkeypatch):
    monkeypatch.setenv("RDMAFLOW_JOB_SECRET", "")  # records the session's value, restored after
    monkeypatch.delenv("RDMAFLOW_JOB_SECRET")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="RDMAFLOW_JOB_SECRET is not set"):
        job_secret(2)
    one = job_secret(1)  # a single process makes one up, and keeps it
    assert len(one) == 32 and job_secret(2) == one
    monkeypatch.setenv("RDMAFLOW_JOB_SECRET", "s3cret-of-the-test-job")
    assert job_secret(4) == "s3cret-of-the-test-job"
