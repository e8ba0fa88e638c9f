"""A pair's life outside its transfers: construction and its refusals, one receiver per name, one
sender per receiver for its life, and endpoints dropped or closed that leave no write in memory
given to others. Closing mid-stream: tests/test_transfer_conformance.py."""
from __future__ import annotations

import gc

import pytest
import torch
from conftest import (
    TRANSFER_WAIT,
    local_device,
)

import rdmaflow
from rdmaflow.transfer import DynamicReceiver, DynamicSender, StaticReceiver, StaticSender
from rdmaflow.transfer.bounded import BoundedReceiver, BoundedSender
from rdmaflow.transfer.common import unpack_header

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = TRANSFER_WAIT  # bound on any single answer from a peer


def test_receiver_construction_errors(job_secret):
    with local_device() as d:
        d.create_arena(4 * MiB)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="depth"):
            StaticReceiver(d, "a", (4,), torch.float32, depth=0)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="depth"):
            DynamicReceiver(d, "b", depth=0)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="negative"):
            StaticReceiver(d, "c", (4, -2), torch.float32)
        for shape in ("ab", None, 2.7, (2.7,), ("3",), True, (True,), (2, False), b"\x04",  # True is no size
                      torch.tensor(True), (torch.tensor(True), 2), torch.tensor([True, True])):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="a shape is an integer or a sequence of integers"):
                StaticReceiver(d, "d", shape, torch.float32)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="past 64 bits"):
            StaticReceiver(d, "d", (2**64, 1), torch.float32)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="cannot be transferred"):
            StaticReceiver(d, "e", (4,), torch.uint16)
        with pytest.raises(ArenaFullError):
            StaticReceiver(d, "f", (MiB,), torch.float64)  # 8 MiB of slots in a 4 MiB arena
        assert d.arena.used == 0, "a failed constructor leaked arena memory"
        assert StaticReceiver(d, "d", torch.Size([2, 3]), torch.float32).shape == (2, 3)
        assert StaticReceiver(d, "d2", 5, torch.float32).shape == (5,)


def test_rejected_sender_does_not_hijack_the_receiver(job_secret):
    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        r = StaticReceiver(b, "s", (4,), torch.float32, depth=1)
        good = StaticSender(a, b.endpoint, "s")
        with pytest.raises(rdmaflow.InvalidArgumentError, match="declared"):
            StaticSender(a, b.endpoint, "s", shape=(5,))
        gc.collect()
        victim = a.empty(8192, torch.uint8).zero_()  # takes the rejected sender's freed block
        for i in range(3):
            good.send(torch.full((4,), float(i)), timeout=3)
            assert torch.equal(r.recv(timeout=3), torch.full((4,), float(i)))
            r.release()  # consumed: the sender may write the slot again
        good.wait_consumed(timeout=3)
        assert int(victim.count_nonzero()) == 0, "the receiver wrote into the sending process's memory"


def test_endpoints_dropped_or_closed_leave_no_write_in_memory_given_to_others(job_secret):
    """A receiver dropped without close() is unpublished, and its slots stay its own (its sender
    may still write them); a dropped sender's ack word stays its own (its receiver still acks);
    a dynamic sender closed before its receiver READ a buffer keeps that buffer."""
    with local_device() as a, local_device() as b:
        for d in (a, b):
            d.create_arena(MiB)
        r = StaticReceiver(b, "dropped", (1024,), torch.float32)
        s = StaticSender(a, b.endpoint, "dropped")
        del r
        gc.collect()
        others = [b.empty((1024,), torch.float32).zero_() for _ in range(8)]
        s.send(torch.full((1024,), 5.0), timeout=5).result(5)
        assert all(int(t.count_nonzero()) == 0 for t in others), "a send landed in another tensor"
        with pytest.raises(rdmaflow.InvalidArgumentError, match="published nothing named 'dropped'"):
            StaticSender(a, b.endpoint, "dropped")

        r2 = StaticReceiver(b, "acked", (4,), torch.float32)
        s2 = StaticSender(a, b.endpoint, "acked")
        s2.send(torch.ones(4), timeout=5).result(5)
        del s2
        gc.collect()
        mine = [a.empty((8192,), torch.uint8).zero_() for _ in range(8)]
        assert r2.recv(timeout=5).tolist() == [1.0] * 4
        r2.close()  # acks the transfer, then CLOSED, and waits for both
        assert all(int(t.count_nonzero()) == 0 for t in mine), "an ack landed in another tensor"

        rd = DynamicReceiver(b, "unread", depth=2)
        sd = DynamicSender(a, b.endpoint, "unread")
        sd.send(torch.full((1 << 14,), 1.0), timeout=5).result(5)
        sd.close()
        gc.collect()
        junk = [a.empty((1 << 14,), torch.float32).fill_(-9.0) for _ in range(4)]
        assert rd.recv(timeout=5).unique().tolist() == [1.0]
        assert all(t.unique().tolist() == [-9.0] for t in junk)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="closed"):
            sd.send(torch.ones(2))
        rd.close()
        with pytest.raises(rdmaflow.InvalidArgumentError, match="closed"):
            rd.recv(timeout=1)


def test_a_name_holds_one_live_receiver_and_depths_are_checked(job_secret):
    """A name holds one live receiver, and closing an old one does not unpublish its successor;
    depths and queue-pair indices a sender would refuse are refused here. (Tensors whose
    conjugate or negative bit is set: tests/test_transfer_conformance.py.)"""
    with local_device() as a, local_device() as b:
        for d in (a, b):
            d.create_arena(MiB)
        r = StaticReceiver(b, "dup", (4,), torch.float32)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="a receiver named 'dup' already lives"):
            DynamicReceiver(b, "dup")
        r.close()
        r2 = DynamicReceiver(b, "dup")
        r.close()
        s = DynamicSender(a, b.endpoint, "dup")  # finds the live one
        s.send(torch.arange(3.0), timeout=5)
        assert r2.recv(timeout=5).tolist() == [0.0, 1.0, 2.0]
        for qp_idx in (2**40, -1, 1, 1.0, "0"):  # 2**40 used to meet pybind11's TypeError
            with pytest.raises(rdmaflow.InvalidArgumentError, match="qp_idx must be an integer in .0, 1."):
                StaticSender(a, b.endpoint, "dup", qp_idx=qp_idx)
        for depth in (0, 70000, True, None, "2", 1.5):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="depth must be an integer"):
                StaticReceiver(b, "deep", (4,), torch.float32, depth=depth)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="depth must be an integer"):
            DynamicReceiver(b, "deep", depth=70000)


def test_a_ready_word_rewritten_behind_the_claim_is_detected(job_secret):
    """The claim keeps a second sender out; a peer that writes the receiver's ready word
    anyway (one that bypasses the library) is still caught by the generation check at the
    receiver's next wait, not taken as its sender."""
    with local_device() as a, local_device() as b, local_device() as c:
        for d in (a, b, c):
            d.create_arena(MiB)
        r = StaticReceiver(b, "one", (4,), torch.float32)
        first = StaticSender(a, b.endpoint, "one")
        first.send(torch.ones(4), timeout=5)
        assert torch.equal(r.recv(timeout=5), torch.ones(4))
        meta, desc = unpack_header(c.lookup(b.endpoint, "one", 5.0), "one")
        word = c.empty(1, torch.int64).fill_(12345)
        c.channel(b.endpoint).memcpy(c.arena.region, c.arena.offset_of(word), rdmaflow.RemoteRegion.from_descriptor(desc),
                                     meta["base"] + meta["ctl"], 8, rdmaflow.WRITE).result(5)
        with pytest.raises(rdmaflow.RdmaflowError, match="second sender"):
            r.recv(timeout=5)


def _receiver_of_kind(kind: str, b, name: str, depth: int = 2):
    """A receiver of ``kind`` on ``b`` for 4 float32 values."""
    if kind == "static":
        return StaticReceiver(b, name, (4,), torch.float32, depth=depth)
    if kind == "bounded":
        return BoundedReceiver(b, name, [4], torch.float32, depth=depth)
    return DynamicReceiver(b, name, depth=depth)


def _sender_of_kind(kind: str, a, b, name: str):
    """The sender of ``kind`` on ``a`` to ``b``'s receiver ``name``."""
    if kind == "static":
        return StaticSender(a, b.endpoint, name)
    if kind == "bounded":
        return BoundedSender(a, b.endpoint, name, [4], torch.float32)
    return DynamicSender(a, b.endpoint, name)


@pytest.mark.parametrize("kind", ["static", "bounded", "dynamic"])
@pytest.mark.parametrize("transport", ["tcp", "sm"], indirect=True)
def test_a_receiver_pairs_with_one_sender_for_its_life(transport, kind, job_secret):
    """The receiver's device hands its name to the first sender that claims it: every later
    one, from any device, before or after the first receive, while a received tensor is held,
    after the first sender closed, is refused at construction, before it writes a byte; what the
    first one sends arrives intact. A sender refused for its declaration claims nothing. A
    receiver published anew under the name pairs with a new sender."""
    with local_device() as a, local_device() as b, local_device() as c:
        for d in (a, b, c):
            d.create_arena(MiB)
        r = _receiver_of_kind(kind, b, "one", depth=1)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="receiver, not a"):
            (DynamicSender if kind == "static" else StaticSender)(a, b.endpoint, "one")
        first = _sender_of_kind(kind, a, b, "one")
        for d in (c, a):  # before the first receive: it would have latched the second one
            with pytest.raises(rdmaflow.InvalidArgumentError, match="already claimed by " + a.endpoint):
                _sender_of_kind(kind, d, b, "one")
        first.send(torch.full((4,), 1.0), timeout=5)
        held = r.recv(timeout=5)  # depth 1, not released: a second sender would write this slot
        used = c.arena.used
        with pytest.raises(rdmaflow.InvalidArgumentError, match="pairs with one sender"):
            _sender_of_kind(kind, c, b, "one")
        gc.collect()
        assert c.arena.used == used, "a refused sender kept its arena memory"
        assert torch.equal(held.cpu(), torch.full((4,), 1.0))
        r.release()
        first.send(torch.full((4,), 2.0), timeout=5)
        assert torch.equal(r.recv(timeout=5).cpu(), torch.full((4,), 2.0))
        first.close()
        with pytest.raises(rdmaflow.InvalidArgumentError, match="already claimed"):
            _sender_of_kind(kind, c, b, "one")
        with pytest.raises(rdmaflow.PeerError, match="closed after sending 2"):
            r.recv(timeout=30)
        r.close()
        r2 = _receiver_of_kind(kind, b, "one", depth=1)
        second = _sender_of_kind(kind, c, b, "one")
        second.send(torch.full((4,), 3.0), timeout=5)
        assert torch.equal(r2.recv(timeout=5).cpu(), torch.full((4,), 3.0))
