"""Non-blocking receive: ``receiver.poll()`` and ``rdmaflow.transfer.wait_any``, between real
processes (tests/transfer_peer.py sends), over tcp and sm.

- poll() says whether the next transfer has landed, never blocks and consumes nothing;
- wait_any() returns a receiver whose next transfer has landed; with transfers spread over
  static and dynamic receivers in an order only the sender knows, every tensor is received
  once, in its receiver's order, and checked element by element;
- a sender that dies: poll() and wait_any() raise PeerError; nothing arriving: TimeoutError;
- a wait_any() with nothing arriving sleeps: it uses a small share of a core.
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

import rdmaflow
from rdmaflow.transfer import DynamicReceiver, StaticReceiver, wait_any

from test_device_idle import cpu_seconds
from test_transfer import WAIT, dev, raises_within, tpeer  # noqa: F401 - fixtures
from transfer_peer import dynamic_tensor, mismatch, static_tensor

SHAPE = (64, 3)


def _received_in_order(receivers, kinds, seed: int, total: int) -> list[int]:
    """Receives ``total`` transfers through wait_any, checking each against its receiver's
    sequence; returns how many each receiver got."""
    got = [0] * len(receivers)
    for _ in range(total):
        i = wait_any(receivers, timeout=WAIT)
        assert receivers[i].poll(), "wait_any returned a receiver with nothing to receive"
        t = receivers[i].recv(timeout=0.0 if kinds[i] == "static" else WAIT)
        want = (static_tensor(seed + i, got[i], SHAPE, torch.float32) if kinds[i] == "static"
                else dynamic_tensor(seed + i, got[i]))
        bad = mismatch(t, want)
        assert bad is None, f"receiver {i}, transfer {got[i]}: {bad}"
        got[i] += 1
    return got


def test_poll_does_not_block_or_consume(tpeer, dev):
    peer = tpeer()
    r = StaticReceiver(dev, "p", SHAPE, torch.float32, depth=2)
    assert not r.poll()  # no sender yet
    peer.call("static_sender", remote=dev.endpoint, name="p")
    assert not r.poll()  # a sender, nothing sent
    raises_within(rdmaflow.TimeoutError, 5, wait_any, [r], timeout=0.3)
    peer.call("send", name="p", n=2, seed=5, wait_consumed=False)
    for i in range(2):
        assert wait_any([r], timeout=WAIT) == 0  # the send's answer may come before its flag lands
        assert r.poll() and r.poll(), "poll() consumed the transfer"
        t = r.recv(timeout=0.0)  # it has landed: no wait
        assert mismatch(t, static_tensor(5, i, SHAPE, torch.float32)) is None
    assert not r.poll()  # both consumed
    with pytest.raises(rdmaflow.InvalidArgumentError):
        wait_any([])


def test_wait_any_receives_every_transfer_of_several_senders(tpeer, dev):
    """Two static and two dynamic receivers; the peer sends on them in a shuffled order, with
    pauses, so that wait_any sees them arrive one at a time and sometimes several at once."""
    peer = tpeer()
    kinds = ["static", "dynamic", "static", "dynamic"]
    seed = 40
    receivers = [StaticReceiver(dev, f"r{i}", SHAPE, torch.float32, depth=2) if k == "static"
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
    rs = StaticReceiver(dev, "s", SHAPE, torch.float32)
    rd = DynamicReceiver(dev, "d")
    peer.call("static_sender", remote=dev.endpoint, name="s")
    peer.call("dynamic_sender", remote=dev.endpoint, name="d")
    peer.call("send", name="s", n=1, seed=7, wait_consumed=False)
    assert wait_any([rd, rs], timeout=WAIT) == 1
    assert mismatch(rs.recv(timeout=0.0), static_tensor(7, 0, SHAPE, torch.float32)) is None
    peer.crash()
    e = raises_within(rdmaflow.PeerError, 20, wait_any, [rs, rd], timeout=30)
    assert peer.endpoint in str(e), str(e)
    with pytest.raises(rdmaflow.PeerError):
        rd.poll()


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
def test_waiting_wait_any_sleeps(tpeer, dev):
    """Nothing arrives for the whole wait: wait_any naps instead of spinning a core."""
    peer = tpeer()
    receivers = [StaticReceiver(dev, f"w{i}", SHAPE, torch.float32) for i in range(3)]
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
