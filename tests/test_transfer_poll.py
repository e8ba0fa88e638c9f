"""Waiting without blocking: poll(), has_credit() and wait_any(). poll() says whether the next
transfer has landed, never blocks and consumes nothing; wait_any() returns a receiver whose next
transfer has landed, raises PeerError for a dead sender and TimeoutError when nothing comes, and
naps (a small share of a core) while it waits."""
from __future__ import annotations

import os
import random
import time

import pytest
import torch
from conftest import (
    TRANSFER_WAIT,
    local_device,
    raises_within,
)
from test_device_idle import cpu_seconds
from transfer_peer import (
    dynamic_tensor,
    mismatch,
    static_tensor,
)

import rdmaflow
from rdmaflow.transfer import DynamicReceiver, StaticReceiver, StaticSender, wait_any
from rdmaflow.transfer.bounded import BoundedReceiver

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = TRANSFER_WAIT  # bound on any single answer from a peer


def test_wait_any_and_wait_all_name_what_they_were_given():
    for bad in ([], None, ["x"], [1]):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="wait_any takes"):
            wait_any(bad, timeout=0.1)
    for bad in ([1], ["x"]):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="wait_all takes the futures"):
            rdmaflow.wait_all(bad, timeout=0.1)


POLL_SHAPE = (64, 3)


def _received_in_order(receivers, kinds, seed: int, total: int) -> list[int]:
    """Receives ``total`` transfers through wait_any, checking each against its receiver's
    sequence; returns how many each receiver got."""
    got = [0] * len(receivers)
    for _ in range(total):
        i = wait_any(receivers, timeout=WAIT)
        assert receivers[i].poll(), "wait_any returned a receiver with nothing to receive"
        t = receivers[i].recv(timeout=0.0 if kinds[i] == "static" else WAIT)
        want = (static_tensor(seed + i, got[i], POLL_SHAPE, torch.float32) if kinds[i] == "static"
                else dynamic_tensor(seed + i, got[i]))
        bad = mismatch(t, want)
        assert bad is None, f"receiver {i}, transfer {got[i]}: {bad}"
        got[i] += 1
    return got


def test_poll_does_not_block_or_consume(tpeer, dev):
    peer = tpeer()
    r = StaticReceiver(dev, "p", POLL_SHAPE, torch.float32, depth=2)
    assert not r.poll()  # no sender yet
    peer.call("static_sender", remote=dev.endpoint, name="p")
    assert not r.poll()  # a sender, nothing sent
    raises_within(rdmaflow.TimeoutError, 5, wait_any, [r], timeout=0.3)
    peer.call("send", name="p", n=2, seed=5, wait_consumed=False)
    for i in range(2):
        assert wait_any([r], timeout=WAIT) == 0  # the send's answer may come before its flag lands
        assert r.poll() and r.poll(), "poll() consumed the transfer"
        t = r.recv(timeout=0.0)  # it has landed: no wait
        assert mismatch(t, static_tensor(5, i, POLL_SHAPE, torch.float32)) is None
    assert not r.poll()  # both consumed
    with pytest.raises(rdmaflow.InvalidArgumentError):
        wait_any([])


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
def test_a_poll_applies_a_transfer_that_waits_in_the_socket(tpeer, dev):
    """Over tcp a transfer lands only when the receiving side's worker progresses. Right after a
    recv(), which drove the worker, its progress thread stays parked for a millisecond or more,
    so a transfer that arrives then waits in the socket until somebody drives the worker. A
    poll() that finds the flag unset drives it once and sees the transfer; before, poll() said
    False until the progress thread next woke. Each transfer has left the peer before the first
    poll(); nearly every one must be seen by that poll (one could arrive while the progress
    thread holds the worker, and that poll then finds it busy)."""
    peer = tpeer()
    r = StaticReceiver(dev, "ps", POLL_SHAPE, torch.float32, depth=2)
    peer.call("static_sender", remote=dev.endpoint, name="ps")
    n, first = 60, 0
    for i in range(n):
        peer.call("send", name="ps", n=1, start=i, seed=11, wait_consumed=False, wait_sent=True)
        first += r.poll()
        t = r.recv(timeout=WAIT)
        assert mismatch(t, static_tensor(11, i, POLL_SHAPE, torch.float32)) is None
    assert first >= 0.8 * n, f"the first poll() saw {first} of {n} transfers that had left the peer"


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
def test_a_senders_credit_check_applies_an_ack_that_waits_in_the_socket(tpeer, dev):
    """The sender's side of the test above: with depth 1 each send needs the ack of the last,
    which over tcp lands only when this side's worker progresses, and a send's post on this
    thread leaves the progress thread parked for a millisecond or more. has_credit() that finds
    none drives the worker once; before, the graph executor's credit check read the ack word
    only, and saw the ack when the progress thread next woke."""
    peer = tpeer()
    peer.call("static_receiver", name="cr", shape=list(POLL_SHAPE), dtype="float32", depth=1)
    s = StaticSender(dev, peer.endpoint, "cr", mode="zerocopy")
    assert s.has_credit()
    x = dev.empty(POLL_SHAPE, torch.float32)
    n, first = 60, 0
    for i in range(n):
        x.copy_(static_tensor(12, i, POLL_SHAPE, torch.float32))
        s.send(x, timeout=WAIT).result(WAIT)
        assert not s.has_credit(), "a credit before the receiver took the transfer"
        got = peer.call("recv", name="cr", n=1, seed=12, start=i, timeout=WAIT)  # takes it and acks it
        assert got["verified"] == 1, got
        first += s.has_credit()
        s.wait_consumed(timeout=WAIT)
    assert first >= 0.8 * n, f"the first has_credit() saw {first} of {n} acks that had left the peer"


def test_a_closed_receiver_or_one_whose_device_closed_is_not_waited_for(job_secret):
    """poll() of a closed receiver said False, so wait_any waited for it until its timeout (with
    None, for ever); a receiver whose device was closed was waited for until the timeout too."""
    with local_device() as d:
        r = StaticReceiver(d, "closed", 4, torch.float32)
        r.close()
        with pytest.raises(rdmaflow.InvalidArgumentError, match="poll: receiver 'closed' is closed"):
            r.poll()
        raises_within(rdmaflow.InvalidArgumentError, 5, wait_any, [r], timeout=30)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="rank is at most 64, got 65"):
            StaticReceiver(d, "rank", (1,) * 65, torch.float32)
        for shape in ((1 << 32, 1 << 32, 16), ((1 << 63) - 1,)):  # a raw pybind11 TypeError before
            for make in (StaticReceiver, BoundedReceiver):
                with pytest.raises(rdmaflow.ArenaFullError, match=r"bytes \(past 64 bits\)"):
                    make(d, "big", shape, torch.float32)
        orphan = StaticReceiver(d, "orphan", 4, torch.float32)
        dyn = DynamicReceiver(d, "orphan-dyn")
    for what in (lambda: orphan.recv(timeout=30), lambda: wait_any([orphan, dyn], timeout=30),
                 lambda: dyn.recv(timeout=30)):
        raises_within(rdmaflow.DeviceClosedError, 5, what)


def test_wait_any_receives_every_transfer_of_several_senders(tpeer, dev):
    """Two static and two dynamic receivers; the peer sends on them in a shuffled order, with
    pauses, so that wait_any sees them arrive one at a time and sometimes several at once."""
    peer = tpeer()
    kinds = ["static", "dynamic", "static", "dynamic"]
    seed = 40
    receivers = [StaticReceiver(dev, f"r{i}", POLL_SHAPE, torch.float32, depth=2) if k == "static"
                 else DynamicReceiver(dev, f"r{i}", depth=2) for i, k in enumerate(kinds)]
    for i, k in enumerate(kinds):
        peer.call(f"{k}_sender", remote=dev.endpoint, name=f"r{i}")
    per = 6
    order = [i for i in range(len(kinds)) for _ in range(per)]
    random.Random(seed).shuffle(order)
    sent = [0] * len(kinds)
    for n, i in enumerate(order):
        peer.post("send", name=f"r{i}", n=1, start=sent[i], seed=seed + i, wait_consumed=False,
                  sleep_before=0.02 if n % 3 == 0 else 0.0)
        sent[i] += 1
    got = _received_in_order(receivers, kinds, seed, len(order))
    for _ in order:
        peer.answer()
    assert got == [per] * len(kinds)
    assert not any(r.poll() for r in receivers)


def test_poll_and_wait_any_raise_when_the_sender_dies(tpeer, dev):
    peer = tpeer()
    rs = StaticReceiver(dev, "s", POLL_SHAPE, torch.float32)
    rd = DynamicReceiver(dev, "d")
    peer.call("static_sender", remote=dev.endpoint, name="s")
    peer.call("dynamic_sender", remote=dev.endpoint, name="d")
    peer.call("send", name="s", n=1, seed=7, wait_consumed=False)
    assert wait_any([rd, rs], timeout=WAIT) == 1
    assert mismatch(rs.recv(timeout=0.0), static_tensor(7, 0, POLL_SHAPE, torch.float32)) is None
    peer.crash()
    e = raises_within(rdmaflow.PeerError, 20, wait_any, [rs, rd], timeout=30)
    assert peer.endpoint in str(e), str(e)
    with pytest.raises(rdmaflow.PeerError):
        rd.poll()


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
def test_waiting_wait_any_sleeps(tpeer, dev):
    """Nothing arrives for the whole wait: wait_any naps instead of spinning a core."""
    peer = tpeer()
    receivers = [StaticReceiver(dev, f"w{i}", POLL_SHAPE, torch.float32) for i in range(3)]
    for i in range(3):
        peer.call("static_sender", remote=dev.endpoint, name=f"w{i}")
    peer.call("send", name="w0", n=1, seed=9, wait_consumed=False)
    assert wait_any(receivers, timeout=WAIT) == 0
    receivers[0].recv(timeout=0.0)
    window = 2.0
    before = cpu_seconds(os.getpid())
    t0 = time.monotonic()
    with pytest.raises(rdmaflow.TimeoutError):
        wait_any(receivers, timeout=window)
    took = time.monotonic() - t0
    used = cpu_seconds(os.getpid()) - before
    assert took >= window
    # A spinning wait would use about `took` CPU seconds; a napping one a few percent of it.
    assert used < 0.25 * took, f"wait_any used {used:.2f} CPU seconds in {took:.2f} s of waiting"
