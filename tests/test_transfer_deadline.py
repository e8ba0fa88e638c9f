"""Timeouts of the transfer layer: deadlines, a send or receive that times out and can be retried,
a negative timeout that looks without waiting, and timeouts that are not numbers."""
from __future__ import annotations

import pytest
import torch
from conftest import (
    TRANSFER_WAIT,
    assert_all_verified,
    raises_within,
    recv_check,
    send_static,
)
from transfer_peer import (
    dynamic_tensor,
    static_tensor,
)

import rdmaflow
from rdmaflow.deadline import Deadline, time_left
from rdmaflow.transfer import DynamicReceiver, DynamicSender, StaticReceiver, StaticSender

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = TRANSFER_WAIT  # bound on any single answer from a peer


def test_time_left_takes_seconds_or_a_deadline():
    assert time_left(None) is None and time_left(2.5) == 2.5
    assert time_left(Deadline(None)) is None
    assert 9.0 < time_left(Deadline(10.0)) <= 10.0
    assert time_left(Deadline(-1.0)) == 0.0  # a deadline that passed leaves nothing, never less


# -- timeouts ---------------------------------------------------------------------------------
def test_send_and_recv_timeouts(tpeer, dev):
    peer = tpeer()
    # No sender at all.
    rs = StaticReceiver(dev, "t_s", (8,), torch.float32, depth=1)
    rd = DynamicReceiver(dev, "t_d", depth=1, timeout=0.3)
    raises_within(rdmaflow.TimeoutError, 10, rs.recv, timeout=0.3)
    raises_within(rdmaflow.TimeoutError, 10, rd.recv)  # the receiver's own default timeout
    # A connected sender that sends nothing more.
    peer.call("static_sender", remote=dev.endpoint, name="t_s")
    peer.call("send", name="t_s", n=1, seed=51, wait_consumed=False)
    recv_check(rs, 1, lambda i: static_tensor(51, i, (8,), torch.float32))
    e = raises_within(rdmaflow.TimeoutError, 10, rs.recv, timeout=0.3)
    assert isinstance(e, TimeoutError)  # also the builtin
    # A receiver that does not consume: the sender's next send times out, and can be retried.
    peer.call("static_receiver", name="t_r", shape=[8], dtype="float32", depth=1)
    peer.call("dynamic_receiver", name="t_rd", depth=1)
    s = StaticSender(dev, peer.endpoint, "t_r")
    ds = DynamicSender(dev, peer.endpoint, "t_rd", timeout=0.3)
    send_static(s, 52, 1)
    ds.send(dynamic_tensor(53, 0))
    x1 = static_tensor(52, 1, (8,), torch.float32)
    e = raises_within(rdmaflow.TimeoutError, 10, s.send, x1, timeout=0.3)
    assert "never overwrites" in str(e), str(e)
    raises_within(rdmaflow.TimeoutError, 10, ds.send, dynamic_tensor(53, 1))
    raises_within(rdmaflow.TimeoutError, 10, s.wait_consumed, timeout=0.3)
    # A negative timeout is a look that does not wait (to the core, a negative wait had no end),
    # -1 too (it once stood for the endpoint's own timeout, 60 s for rs and s); NaN or a word is
    # refused; a transfer not sent cannot be waited for.
    for look in (-5, -1, -1.0):
        raises_within(rdmaflow.TimeoutError, 10, s.send, x1, timeout=look)
        raises_within(rdmaflow.TimeoutError, 10, ds.send, dynamic_tensor(53, 1), timeout=look)
        raises_within(rdmaflow.TimeoutError, 10, rs.recv, timeout=look)
        raises_within(rdmaflow.TimeoutError, 10, rd.recv, timeout=look)
        raises_within(rdmaflow.TimeoutError, 10, s.wait_consumed, timeout=look)
    for bad in (float("nan"), "1"):
        for call, args in ((s.send, (x1,)), (ds.send, (dynamic_tensor(53, 1),)), (rs.recv, ()), (rd.recv, ()),
                           (s.wait_consumed, ())):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="timeout must be a number of seconds"):
                call(*args, timeout=bad)
    for k in (2, -1, "1"):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="was not sent"):
            s.wait_consumed(k, timeout=0.3)
    assert s.seq == 1 and ds.seq == 1
    peer.post("recv", name="t_r", n=2, seed=52)
    s.send(x1, timeout=30)
    assert_all_verified(peer.answer(), 2, "static after a send timeout")
    peer.post("recv", name="t_rd", n=2, seed=53)
    ds.send(dynamic_tensor(53, 1), timeout=30)
    assert_all_verified(peer.answer(), 2, "dynamic after a send timeout")
