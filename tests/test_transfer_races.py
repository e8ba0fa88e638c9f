"""Both directions at once, as fast as the credits allow: the flag is never seen before its data, on
every flagged path (one message, the flag in the stream, the flag after the data's flush, stripes),
with acks riding replies, on one core, and against a receiver that only polls; every element of
every tensor checked. Also a send that waits for its credit lets other Python threads run."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest
import torch
from conftest import (
    TRANSFER_WAIT,
    local_device,
)
from transfer_peer import (
    static_tensor,
)

import rdmaflow
from rdmaflow.transfer import StaticReceiver, StaticSender

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = TRANSFER_WAIT  # bound on any single answer from a peer


@pytest.mark.parametrize("nbytes,n", [(8, 3000), (64 * 1024, 3000), (256 * 1024, 1000), (512 * 1024, 500),
                                     (MiB, 300), (8 * MiB, 60)])
def test_racing_sender_and_receiver_never_see_a_flag_before_its_data(tpeer, dev, transport, nbytes, n):
    """Both directions at once, each sender as fast as its credits allow (depth 2, so a slot is
    rewritten as soon as it is handed back): every tensor a receiver gets holds its own
    transfer number in every element, i.e. the flag of transfer k was never seen before k's
    data, on the same-host direct path (sm: copy + release store; 8 MiB is copied with
    non-temporal stores) and over UCX: tcp up to 512 KiB as one active message, the flag stored
    by its handler once the data is in place (the default there); tcp at 1 MiB (posted on
    the sending thread, the rest carried by the progress thread) as WRITE and the flag's WRITE
    right behind it on the endpoint's one tcp connection (UCX_NET_DEVICES=lo: one lane); tcp at
    8 MiB striped, its halves WRITEs on two workers' connections, the flag's WRITE once both
    flushes have completed; sm-cma as WRITE, then the flag's WRITE once the data's flush has
    completed."""
    direct = transport == "sm"  # sm-cma turns rdmaflow's same-host path off: UCX's own sm moves the data
    before = dev.transfer_counts()["striped"]
    theirs = race(tpeer(), dev, nbytes, n, direct)
    striped = transport == "tcp" and nbytes >= rdmaflow.Channel.striped_write_bytes
    if not direct:
        by_message = transport == "tcp" and nbytes <= rdmaflow.Channel.flagged_message_bytes
        words = None if by_message else ("stream" if transport == "tcp" and not striped else "flush")
        for counts in (dev.transfer_counts(), theirs["counts"]):
            assert_flagged_path(counts, n, by_message=by_message, words=words)
    assert dev.transfer_counts()["striped"] - before == (n if striped else 0)
    assert theirs["counts"]["striped"] == (n if striped else 0)


@pytest.mark.parametrize("nbytes,n", [(8, 2000), (64 * 1024, 1000)])
def test_racing_sender_and_receiver_sharing_one_core(tpeer, dev, transport, nbytes, n):
    """The race above with every thread of both processes pinned to one core, as where processes
    outnumber the cores: the waits, the progress threads and the peer's answers all take turns
    on that core. Every element of every tensor is checked, both ways, and every wait is the
    race's bounded one."""
    peer = tpeer()
    with sharing_one_core(os.getpid(), peer.proc.pid):
        race(peer, dev, nbytes, n, direct=transport == "sm")


def received_by_polling(r: StaticReceiver, timeout: float) -> torch.Tensor:
    """``r``'s next transfer, found by poll() in a loop with no sleep and no wait, then taken by
    a recv() that may not wait."""
    deadline = time.monotonic() + timeout
    while not r.poll():
        assert time.monotonic() < deadline, f"no transfer landed on '{r.name}' within {timeout} s of polling"
    return r.recv(timeout=0.0)


@pytest.mark.parametrize("nbytes,n", [(8, 3000), (64 * 1024, 1000), (MiB, 200)])
def test_racing_against_a_receiver_that_only_polls(tpeer, dev, transport, nbytes, n):
    """The race above with this side's receives made by poll() in a loop, as the graph
    executor's are: over UCX a poll that finds nothing drives the worker once, so over tcp this
    thread applies most writes itself (a message's handler, or at 1 MiB the WRITE and the
    flag's WRITE behind it), with the progress thread beside it. The flag is never seen
    before its data: every element of every tensor checked, both ways."""
    race(tpeer(), dev, nbytes, n, transport == "sm", poll_only=True)


@contextlib.contextmanager
def sharing_one_core(*pids: int):
    """Pins every thread of each process in ``pids`` to this process's first allowed core, and
    gives each thread its former cores back afterwards (a thread started meanwhile, its
    process's main thread's)."""
    def threads(pid: int) -> list[int]:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]

    def cores_of(tid: int) -> set[int] | None:
        try:
            return os.sched_getaffinity(tid)
        except ProcessLookupError:  # a thread that ended since the listing
            return None

    core = min(os.sched_getaffinity(0))
    before = {tid: cores for pid in pids for tid in threads(pid) if (cores := cores_of(tid)) is not None}
    try:
        for tid in before:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, {core})
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(FileNotFoundError):
                for tid in threads(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.sched_setaffinity(tid, before.get(tid, before[pid]))


def test_a_flush_right_after_a_striped_send_covers_both_halves_and_the_flag(tpeer, dev, transport):
    """Over tcp a static send of 8 MiB is striped: its halves travel on two workers' connections,
    which no fence of one worker orders. A flush of the sender's channel right after send()
    waits until both halves and then the flag have landed: the send's future is done when the
    flush's is, and the receiver finds each tensor without waiting (``timeout=0``), every element
    checked."""
    if transport != "tcp":
        pytest.skip("only tcp stripes")
    numel = 8 * MiB // 8
    peer = tpeer()
    peer.call("static_receiver", name="fl", shape=[numel], dtype="int64")
    s = StaticSender(dev, peer.endpoint, "fl", mode="zerocopy")
    before = dev.transfer_counts()["striped"]
    x = dev.empty((numel,), torch.int64)
    for i in range(4):
        x.copy_(static_tensor(7, i, s.shape, s.dtype))
        f = s.send(x, timeout=30)
        s.channel.flush().result(30)
        assert f.done()
        got = peer.call("recv", name="fl", n=1, seed=7, start=i, timeout=0.0)
        assert got["verified"] == 1, got
    assert dev.transfer_counts()["striped"] - before == 4


@pytest.mark.parametrize("transport,flagged,busy", [("tcp", "put", False), ("sm-cma", "message", False),
                                                   ("tcp", "message", True)], indirect=["transport"])
@pytest.mark.parametrize("nbytes,n", [(8, 3000), (64 * 1024, 3000), (256 * 1024, 1000)])
def test_racing_on_each_flagged_path(tpeer, job_secret, transport, flagged, busy, nbytes, n):
    """The race above with write_flagged's path forced: WRITE, then the flag's WRITE once the
    data's flush has completed, over tcp; messages asked for over UCX's shared memory, which
    takes the put path there instead (a flush there does not say a message was applied, so
    nothing could order a later write behind one); and the messages over tcp with busy-polling
    progress threads, which then apply most messages while the receiving thread polls the flag
    (a receiver that drives the worker itself applies them before it looks)."""
    env = {"RDMAFLOW_FLAGGED_WRITES": flagged, "RDMAFLOW_TEST_BUSY_POLL": "1" if busy else "0"}
    with local_device(flagged_writes=flagged, busy_poll=busy) as d:
        d.create_arena(64 * MiB)
        theirs = race(tpeer(**env), d, nbytes, n, direct=False)
        by_message = flagged == "message" and transport == "tcp"
        for counts in (d.transfer_counts(), theirs["counts"]):
            assert_flagged_path(counts, n, by_message=by_message, words=None if by_message else "flush")


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("nbytes,n", [(8, 2000), (64 * 1024, 1000), (8 * MiB, 20)])
def test_racing_with_each_send_handing_the_last_receive_back(tpeer, dev, transport, depth, nbytes, n):
    """The race above, both sides sending with ``release=`` their receiver: each side's credit
    then comes back with the other side's next transfer where it can (over tcp in the same
    message, up to 512 KiB; at 8 MiB as a word-only write behind the put), and on its own where
    the sender would wait for a credit first (depth 1: both sides send at once, and neither may
    hold its ack back until it has a credit). No deadlock, and every element checked."""
    theirs = race(tpeer(), dev, nbytes, n, transport == "sm", depth=depth, release=True)
    for counts in (dev.transfer_counts(), theirs["counts"]):
        assert counts["dropped"] == 0, counts


@pytest.mark.parametrize("nbytes,n", [(8, 1500), (64 * 1024, 1000), (512 * 1024, 200), (1 * MiB, 100)])
def test_a_reply_carries_the_ack_of_the_request_it_answers(tpeer, dev, transport, nbytes, n):
    """Ping-pong with ``send(reply, release=receiver)`` on both sides (depth 1): every element
    of every ping and pong checked. Over tcp up to 512 KiB the ack rides the reply's message:
    each side sends one message per transfer, not two (transfer_counts), and none is dropped."""
    numel = nbytes // 8
    r = StaticReceiver(dev, "pong_in", (numel,), torch.int64)
    peer = tpeer()
    peer.call("static_receiver", name="ping_in", shape=[numel], dtype="int64")
    peer.call("static_sender", remote=dev.endpoint, name="pong_in")
    s = StaticSender(dev, peer.endpoint, "ping_in", mode="zerocopy")
    before = dev.transfer_counts()["message"]
    peer.post("pong", out="pong_in", **{"in": "ping_in"}, n=n)
    buf = dev.empty((numel,), torch.int64)
    bad = None
    for i in range(n):
        buf.fill_(i + 1)
        s.send(buf, timeout=60, release=r).result(60)
        t = r.recv(timeout=60)
        lo, hi = int(t.min()), int(t.max())
        if bad is None and not lo == hi == -(i + 1):
            bad = {"i": i, "min": lo, "max": hi}
    r.release()
    theirs = peer.answer(120)
    assert bad is None, f"pong {bad['i']} holds {bad['min']}..{bad['max']}"
    assert theirs["rounds"] == n and theirs["first_mismatch"] is None, theirs
    mine = dev.transfer_counts()
    for counts in (mine, theirs["counts"]):
        assert counts["dropped"] == 0, counts
    if transport == "tcp" and nbytes <= rdmaflow.Channel.flagged_message_bytes:
        assert mine["message"] - before <= n + 2, mine
        assert theirs["counts"]["message"] <= n + 2, theirs["counts"]


def test_a_rider_must_name_the_channels_peer(job_secret):
    """write_flagged's rider word goes to the same peer as the write: a region of another
    device is refused before anything is posted (a check of the arguments, on any transport)."""
    with local_device() as a, local_device() as b, local_device() as other:
        for d in (a, b, other):
            d.create_arena(MiB)
        r = StaticReceiver(b, "rider_in", (4,), torch.int64)  # held: a dropped receiver is unpublished
        s = StaticSender(a, b.endpoint, r.name)
        elsewhere = rdmaflow.RemoteRegion.from_descriptor(other.arena.region.descriptor())
        with pytest.raises(rdmaflow.InvalidArgumentError, match="owned by the device at"):
            s.channel.write_flagged(s.arena.region, 0, s.remote, s.r_base + s.r_data, 8, 64, 1, s.r_base,
                                    rider_remote_region=elsewhere, rider_offset=72, rider_value=1,
                                    rider_remote_offset=0)


def assert_flagged_path(counts: dict, n: int, by_message: bool, words: str | None = None) -> None:
    """A device's transfer_counts() after sending n transfers: each went as one message, or as
    two puts (data, flag), the flag's put right behind the data's (``words="stream"``) or once
    the data's flush completed (``"flush"``); none arriving was dropped."""
    if by_message:
        assert counts["message"] >= n and counts["ucx"] < n, counts
    else:
        assert counts["ucx"] >= 2 * n, counts
    if words is not None:
        assert counts["word_in_stream" if words == "stream" else "word_after_flush"] >= n, counts
    assert counts["dropped"] == 0, counts


def race(peer, dev, nbytes: int, n: int, direct: bool, depth: int = 2, release: bool = False,
         poll_only: bool = False) -> dict:
    """Runs n rounds of send-one, receive-one against ``peer`` doing the same (int64 tensors of
    nbytes filled with the round's number; with ``release`` each send hands the tensor received
    last back; with ``poll_only`` this side receives by polling, then ``recv(timeout=0)``);
    asserts every element of every tensor either side received, and returns the peer's answer."""
    numel = nbytes // 8
    r = StaticReceiver(dev, f"race_in_{nbytes}", (numel,), torch.int64, depth=depth)
    peer.call("static_receiver", name=f"race_out_{nbytes}", shape=[numel], dtype="int64", depth=depth)
    peer.call("static_sender", remote=dev.endpoint, name=f"race_in_{nbytes}")
    s = StaticSender(dev, peer.endpoint, f"race_out_{nbytes}", mode="zerocopy")
    assert (s._direct is not None) == direct
    peer.post("race", out=f"race_in_{nbytes}", **{"in": f"race_out_{nbytes}"}, n=n, release=release)
    bufs = [dev.empty((numel,), torch.int64) for _ in range(2)]
    futs: list = [None, None]
    bad = None
    for i in range(n):  # as the peer does: send one, receive one
        j = i % 2
        if futs[j] is not None:
            futs[j].result(60)
        bufs[j].fill_(i + 1)
        futs[j] = s.send(bufs[j], timeout=60, release=r if release else None)
        t = received_by_polling(r, 60) if poll_only else r.recv(timeout=60)
        lo, hi = int(t.min()), int(t.max())
        if bad is None and not lo == hi == i + 1:
            bad = {"i": i, "min": lo, "max": hi}
    r.release()
    s.wait_consumed(timeout=60)
    theirs = peer.answer(120)
    assert bad is None, f"received tensor {bad['i']} holds {bad['min']}..{bad['max']}, not {bad['i'] + 1}"
    assert theirs["rounds"] == n and theirs["first_mismatch"] is None, theirs
    assert theirs["direct"] == direct
    return theirs


@pytest.mark.parametrize("transport", ["tcp", "sm"], indirect=True)
def test_a_send_waiting_for_its_credit_over_ucx_lets_other_python_threads_run(transport, job_secret):
    """Over UCX a static send (credit wait and post) is one call into the core with the GIL
    released, and so is a receive that owes an ack (its post, then the wait). Here the send of transfer 2
    waits for the credit that only another Python thread's recv() gives back, and that thread
    starts receiving only once the send is waiting. The interpreter would hand the GIL over only
    after a switch interval, set to 60 s here: a send that held it through its calls into the
    core would time out."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        _send_waits_for_a_python_thread()
    finally:
        sys.setswitchinterval(interval)


def _send_waits_for_a_python_thread() -> None:
    with local_device(same_host=False) as a, local_device(same_host=False) as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        r = StaticReceiver(b, "gil", (256,), torch.float32, depth=1)
        s = StaticSender(a, b.endpoint, "gil")
        assert s._direct is None and s._one_call  # the path under test
        got, errors = [], []

        def consume():
            time.sleep(0.3)  # the main thread is in send 2's wait by now
            try:
                for _ in range(3):
                    got.append(r.recv(timeout=10).clone())
            except rdmaflow.RdmaflowError as e:  # reported below
                errors.append(e)

        t = threading.Thread(target=consume)
        s.send(torch.full((256,), 1.0), timeout=5)
        t.start()
        for i in (2, 3):
            s.send(torch.full((256,), float(i)), timeout=5)
        t.join(15)
        assert not t.is_alive() and not errors, errors
        assert [int(x[0]) for x in got] == [1, 2, 3] and all(bool((x == x[0]).all()) for x in got)
        assert r.acked == 2  # recv 2 and 3 each acked the one before in their call
