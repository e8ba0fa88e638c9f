"""The tensor-transfer layer (rdmaflow.transfer) between two real processes, over tcp and sm.

This process runs one Device; tests/transfer_peer.py runs the other. No tensor data crosses
the command pipe: both sides regenerate "tensor i of sequence seed" (transfer_peer.py), and
whichever process receives checks every tensor it gets, element by element, dtype and shape.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import random
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import HERE, PeerProcess, local_device
from test_device_idle import cpu_seconds
from transfer_peer import (
    DTYPES,
    dynamic_spec,
    dynamic_tensor,
    mismatch,
    planned_tensor,
    static_tensor,
)

import rdmaflow
from rdmaflow.arena import ALIGNMENT
from rdmaflow.deadline import Deadline, time_left
from rdmaflow.transfer import Arena, DynamicReceiver, DynamicSender, StaticReceiver, StaticSender, wait_any
from rdmaflow.transfer.bounded import BoundedReceiver, BoundedSender
from rdmaflow.transfer.common import unpack_header

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = 60.0  # bound on any single answer from a peer


# -- the peer process ---------------------------------------------------------------------------
class TransferPeer(PeerProcess):
    """tests/transfer_peer.py in its own process.

    ``post`` sends a command without waiting, so that this process can send or receive while
    the peer does the other half; ``answer`` collects the reply.
    """

    def __init__(self, env: dict, timeout: float = WAIT):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "transfer_peer.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, start_new_session=True,
        )
        self.timeout = timeout
        self.endpoint = self._read(timeout)["endpoint"]

    def post(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def answer(self, wait: float = WAIT) -> dict:
        r = self._read(wait)
        if not r.get("ok"):
            raise AssertionError(f"peer failed: {r.get('error_type')}: {r.get('error')}\n{r.get('tb', '')}")
        return r

    def call(self, op: str, timeout: float | None = None, wait: float = WAIT, **kw) -> dict:
        # ``timeout`` keeps PeerProcess.close()'s meaning (how long to wait for the answer).
        self.post(op, **kw)
        if op == "crash":
            self.proc.wait(timeout or wait)
            return {}
        return self.answer(timeout or wait)

    def crash(self) -> None:
        self.post("crash")
        self.proc.wait(WAIT)


@pytest.fixture
def tpeer(transport, job_secret):
    """Starts transfer peers sharing this test's UCX transport and job secret; cleans them up."""
    peers: list[TransferPeer] = []

    def spawn(**env_extra) -> TransferPeer:
        env = dict(os.environ)
        env["RDMAFLOW_JOB_SECRET"] = job_secret
        env.update({k: str(v) for k, v in env_extra.items()})
        p = TransferPeer(env)
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.close()


@pytest.fixture
def dev(transport, job_secret):
    """This process's device (after ``transport`` restricted UCX), with a 64 MiB arena."""
    with local_device() as d:
        d.create_arena(64 * MiB)
        yield d


def assert_all_verified(r: dict, n: int, what: str = "") -> None:
    assert r["first_mismatch"] is None, f"{what}: tensor {r['first_mismatch']['i']} is wrong: {r['first_mismatch']['what']}"
    assert r["received"] == n and r["verified"] == n, f"{what}: {r}"


def random_shape(rng: random.Random, max_rank: int = 4, max_dim: int = 40) -> tuple[int, ...]:
    return tuple(rng.randint(1, max_dim) for _ in range(rng.randint(1, max_rank)))


def send_static(s: StaticSender, seed: int, n: int, start: int = 0, in_arena=False, dev=None) -> None:
    for i in range(start, start + n):
        x = static_tensor(seed, i, s.shape, s.dtype)
        if in_arena is True or (in_arena == "alternate" and i % 2 == 0):
            y = dev.empty(s.shape, s.dtype)
            y.copy_(x)
            x = y
        s.send(x, timeout=30)


def recv_check(r, n: int, expect, start: int = 0) -> None:
    """Receives n tensors in this process and checks each against ``expect(i)``; each one
    (unless empty) lives in the receiver's registered arena."""
    for i in range(start, start + n):
        got = r.recv(timeout=30)
        bad = mismatch(got, expect(i))
        assert bad is None, f"tensor {i} on '{r.name}': {bad}"
        assert got.numel() == 0 or r.arena.contains(got), f"tensor {i} on '{r.name}' is not in the arena"


def raises_within(exc, seconds: float, fn, *a, **kw):
    """Runs fn, expects ``exc``, and that it came within ``seconds`` (no hang)."""
    t0 = time.monotonic()
    with pytest.raises(exc) as ei:
        fn(*a, **kw)
    took = time.monotonic() - t0
    assert took < seconds, f"{exc.__name__} took {took:.1f} s"
    return ei.value


def test_time_left_takes_seconds_or_a_deadline():
    assert time_left(None) is None and time_left(2.5) == 2.5
    assert time_left(Deadline(None)) is None
    assert 9.0 < time_left(Deadline(10.0)) <= 10.0
    assert time_left(Deadline(-1.0)) == 0.0  # a deadline that passed leaves nothing, never less


# ==============================================================================================
# Arena: the allocator, device.empty
# ==============================================================================================
def test_arena_alignment_and_accounting(job_secret):
    with local_device() as d:
        a = Arena(d.alloc_region(4 * MiB))
        assert a.nbytes == 4 * MiB and a.used == 0 and a.largest_free == 4 * MiB
        assert a.num_allocations == 0 and a.num_free_blocks == 1
        blocks = [a.allocate(n) for n in (1, 255, 256, 257, 4095, 100_000, 0)]
        for b, n in zip(blocks, (1, 255, 256, 257, 4095, 100_000, 0)):
            assert b.offset % ALIGNMENT == 0 and b.address % ALIGNMENT == 0
            assert b.address == a.base + b.offset and b.nbytes == n
        # Every allocation takes a whole number of alignment units (a zero-byte one takes one).
        want = sum(max(1, -(-n // ALIGNMENT)) * ALIGNMENT for n in (1, 255, 256, 257, 4095, 100_000, 0))
        assert a.used == want and a.num_allocations == 7
        # Blocks never overlap.
        spans = sorted((b.offset, b.offset + max(b.nbytes, 1)) for b in blocks)
        assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
        del blocks, b
        gc.collect()
        assert a.used == 0 and a.num_allocations == 0 and a.num_free_blocks == 1 and a.largest_free == 4 * MiB
        with pytest.raises(rdmaflow.OutOfBoundsError):
            a.allocate(-1)
        with pytest.raises(rdmaflow.InvalidArgumentError):
            Arena(d.alloc_region(0))


def test_arena_is_thread_safe(job_secret):
    """Threads allocate, fill, check and free concurrently: no block is ever shared."""
    with local_device() as d:
        a = Arena(d.alloc_region(16 * MiB))
        errors: list[str] = []
        n_threads, rounds = 8, 1500

        def worker(tid: int) -> None:
            rng = random.Random(tid)
            live: list = []
            try:
                for r in range(rounds):
                    if live and (len(live) > 24 or rng.random() < 0.45):
                        b, tag = live.pop(rng.randrange(len(live)))
                        view = torch.frombuffer(b, dtype=torch.uint8, count=b.nbytes)
                        if not bool((view == tag).all()):
                            errors.append(f"thread {tid}: block at {b.offset} was overwritten")
                        del view, b
                    else:
                        b = a.allocate(rng.choice([1, 8, 100, 256, 1000, 4096, 10_000, 65_536]))
                        if b.offset % ALIGNMENT:
                            errors.append(f"unaligned offset {b.offset}")
                        tag = (tid * 31 + r) % 251 + 1
                        torch.frombuffer(b, dtype=torch.uint8, count=b.nbytes).fill_(tag)
                        live.append((b, tag))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {tid}: {type(e).__name__}: {e}")
            live.clear()

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "an allocating thread hung"
        assert not errors, errors[:5]
        gc.collect()
        assert a.used == 0 and a.num_allocations == 0
        assert a.num_free_blocks == 1 and a.largest_free == a.nbytes


def test_arena_training_pattern_does_not_fragment(job_secret):
    """Parameters live forever; each step allocates activations forward, frees them backward
    while gradients and temporaries come and go. Many steps must not fragment the arena."""
    with local_device() as d:
        cap = 32 * MiB
        a = Arena(d.alloc_region(cap))
        rng = random.Random(7)
        params = [a.allocate(rng.choice([4 * KiB, 64 * KiB, 300 * KiB, MiB + 17])) for _ in range(12)]
        p_used = a.used
        layers = [rng.choice([16 * KiB, 200 * KiB, 512 * KiB + 3, MiB]) for _ in range(10)]
        free_after_params = a.largest_free
        for step in range(300):
            batch = rng.choice([1, 2, 3])  # the activation sizes change with the batch
            acts, temps = [], []
            for size in layers:
                acts.append(a.allocate(size * batch))
                temps.append(a.allocate(rng.randint(1, 64 * KiB)))
                if rng.random() < 0.5:
                    temps.pop(rng.randrange(len(temps)))
            grads = []
            while acts:  # backward: a gradient appears, the activation goes
                grads.append(a.allocate(rng.randint(1, 512 * KiB)))
                acts.pop()
                if temps and rng.random() < 0.7:
                    temps.pop(rng.randrange(len(temps)))
            rng.shuffle(grads)  # the optimizer frees gradients in any order
            grads.clear()
            temps.clear()
            assert a.used == p_used, f"step {step}: {a.used - p_used} bytes leaked"
            assert a.largest_free == free_after_params, f"step {step}: fragmented: {a.num_free_blocks} free blocks"
        params.clear()
        assert a.used == 0 and a.num_allocations == 0
        assert a.num_free_blocks == 1 and a.largest_free == cap


def test_full_arena_error_names_the_sizes(job_secret):
    with local_device() as d:
        a = Arena(d.alloc_region(MiB))
        b = a.allocate(600 * KiB)
        e = raises_within(ArenaFullError, 5, a.allocate, 600 * KiB)
        msg = str(e)
        assert str(600 * KiB) in msg, msg                 # requested
        assert str(MiB - 600 * KiB) in msg, msg           # free, which is also the largest block
        assert str(MiB) in msg, msg                       # the arena's size
        assert isinstance(e, rdmaflow.RdmaflowError) and isinstance(e, MemoryError)
        del b
        # Fragmented: enough bytes free in total, but no block large enough.
        blocks = [a.allocate(256 * KiB) for _ in range(4)]
        del blocks[2], blocks[0]
        msg = str(raises_within(ArenaFullError, 5, a.allocate, 300 * KiB))
        assert str(300 * KiB) in msg and str(512 * KiB) in msg and str(256 * KiB) in msg, msg
        # The arena is intact after the failures.
        blocks.append(a.allocate(256 * KiB))
        assert a.used == 3 * 256 * KiB
        # device.empty reports the same error.
        d.create_arena(MiB)
        keep = d.empty((600 * KiB,), torch.uint8)
        msg = str(raises_within(ArenaFullError, 5, d.empty, (200 * KiB,), torch.float32))
        assert str(800 * KiB) in msg and str(MiB - 600 * KiB) in msg, msg
        del keep


def test_arena_full_error_is_exported():
    from rdmaflow import _core

    assert rdmaflow.ArenaFullError is _core.ArenaFullError


def test_device_empty_lives_in_the_arena_and_returns_its_memory(job_secret, monkeypatch):
    monkeypatch.setenv("RDMAFLOW_ARENA_BYTES", "8M")
    with local_device() as d:
        t = d.empty((3, 5), torch.float16)  # the first use creates the arena, sized by the env
        arena = d.arena
        assert arena.nbytes == 8 * MiB
        assert t.shape == (3, 5) and t.dtype == torch.float16 and t.is_contiguous()
        assert arena.contains(t) and t.data_ptr() % ALIGNMENT == 0
        assert arena.used == ALIGNMENT and arena.num_allocations == 1
        v = t[1:]  # a view keeps the memory alive
        del t
        gc.collect()
        assert arena.used == ALIGNMENT
        del v
        gc.collect()
        assert arena.used == 0 and arena.num_free_blocks == 1
        for dtype in DTYPES.values():
            x = d.empty(7, dtype)
            assert x.shape == (7,) and x.dtype == dtype and arena.contains(x)
        del x
        # Memory comes back as tensors die: 1000 x 1 MiB through an 8 MiB arena.
        for i in range(1000):
            y = d.empty((MiB // 4,), torch.float32)
            y.fill_(i)
        del y
        gc.collect()
        assert arena.used == 0 and arena.largest_free == arena.nbytes
        # Empty tensors take no arena memory.
        z = d.empty((3, 0, 2), torch.bool)
        assert z.shape == (3, 0, 2) and arena.used == 0
        with pytest.raises(rdmaflow.InvalidArgumentError, match="negative"):
            d.empty((2, -1))
        with pytest.raises(rdmaflow.InvalidArgumentError, match="dtype"):
            d.empty((2,), "float32")
        # One arena per device.
        assert d.create_arena(8 * MiB) is arena
        with pytest.raises(rdmaflow.InvalidArgumentError, match="one arena per device"):
            d.create_arena(16 * MiB)


def test_the_device_holds_what_the_layers_keep_per_device(job_secret):
    """A device's arena, its published receivers and the memory it keeps for peers are its own
    declared fields, reached through its accessors; nothing else is hung on it."""
    with local_device() as d:
        before = set(vars(d))
        assert d.ensure_arena(2 * MiB) is d.arena and d.arena.nbytes == 2 * MiB  # made once ...
        assert d.ensure_arena(4 * MiB) is d.arena  # ... and kept, whatever size is asked for later
        r = StaticReceiver(d, "held", (4,), torch.float32, depth=2)
        assert d.receivers["held"][0]() is r
        r.close()
        assert "held" not in d.receivers
        n = d.arena.num_allocations
        d.keep_until_closed(block := d.arena.allocate(64))
        del block
        gc.collect()
        assert d.arena.num_allocations == n + 1  # the device still holds the block
        assert set(vars(d)) == before, "something hung state of its own on the device"


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


# ==============================================================================================
# Static and dynamic transfer, checked tensor by tensor
# ==============================================================================================
def test_static_random_shapes_every_dtype_both_directions(tpeer, dev):
    peer = tpeer()
    rng = random.Random(2024)
    shapes = {name: random_shape(rng) for name in DTYPES}
    n = 12
    # This process sends, the peer receives and checks.
    for k, (name, shape) in enumerate(shapes.items()):
        peer.call("static_receiver", name=f"to_{name}", shape=shape, dtype=name, depth=2)
        s = StaticSender(dev, peer.endpoint, f"to_{name}", shape=shape, dtype=DTYPES[name])
        peer.post("recv", name=f"to_{name}", n=n, seed=k)
        send_static(s, k, n, in_arena="alternate", dev=dev)
        assert_all_verified(peer.answer(), n, f"{name}{list(shape)}")
        s.wait_consumed(timeout=30)
        assert s.consumed() == n
    # The peer sends, this process receives and checks.
    for k, (name, shape) in enumerate(shapes.items()):
        r = StaticReceiver(dev, f"from_{name}", shape, DTYPES[name], depth=2)
        peer.post("static_sender", remote=dev.endpoint, name=f"from_{name}")
        peer.answer()
        peer.post("send", name=f"from_{name}", n=n, seed=100 + k)
        recv_check(r, n, lambda i, k=k, shape=shape, name=name: static_tensor(100 + k, i, shape, DTYPES[name]))
        r.release()
        assert peer.answer()["sent"] == n


def test_empty_tensors_static_and_dynamic(tpeer, dev):
    peer = tpeer()
    for shape, dtype in [((0,), "float32"), ((3, 0, 2), "bool"), ((3, 0, 2), "bfloat16")]:
        name = f"e_{dtype}_{len(shape)}"
        peer.call("static_receiver", name=name, shape=shape, dtype=dtype, depth=2)
        s = StaticSender(dev, peer.endpoint, name)
        assert s.shape == shape and s.nbytes == 0
        peer.post("recv", name=name, n=5, seed=1)
        for mode_tensor in [torch.empty(shape, dtype=DTYPES[dtype]), dev.empty(shape, DTYPES[dtype])] * 2 + [
                torch.zeros(shape, dtype=DTYPES[dtype])]:
            s.send(mode_tensor, timeout=30)
        assert_all_verified(peer.answer(), 5, name)
    # Dynamic: empty shapes among ordinary ones, both directions.
    plan = [[[0], "float32"], [[3, 0, 2], "int64"], [[], "float16"], [[5], "bool"], [[0, 0], "bfloat16"],
            [[1, 0, 1, 0, 1, 0, 1, 0], "bool"], [[3, 0, 2], "float32"], [[2, 3], "bfloat16"]]
    peer.call("dynamic_receiver", name="ed", depth=2)
    s = DynamicSender(dev, peer.endpoint, "ed")
    peer.post("recv", name="ed", n=2 * len(plan), seed=9, plan=plan)
    for i in range(2 * len(plan)):
        s.send(planned_tensor(9, i, plan), timeout=30)
    assert_all_verified(peer.answer(), 2 * len(plan), "dynamic empties")
    r = DynamicReceiver(dev, "ed_back", depth=2)
    peer.call("dynamic_sender", remote=dev.endpoint, name="ed_back")
    peer.post("send", name="ed_back", n=len(plan), seed=10, plan=plan, in_arena=True)
    recv_check(r, len(plan), lambda i: planned_tensor(10, i, plan))
    peer.answer()


BOUNDED_PLAN = [[[6, 40], "float32"], [[1, 3], "float32"], [[6, 0], "float32"], [[2, 17], "float32"],
                [[5, 40], "float32"]]


def test_bounded_shapes_within_the_maxima_both_directions(tpeer, dev):
    """Each transfer has its own shape, at most [6, 40], in a slot at the maxima with its size
    record; the receiver gets a view of the slot of exactly that shape; beyond the maxima is refused."""
    peer = tpeer()
    n = 3 * len(BOUNDED_PLAN)
    peer.call("bounded_receiver", name="bd", max_shape=[6, 40], dtype="float32", depth=2)
    s = BoundedSender(dev, peer.endpoint, "bd", [6, 40], torch.float32)
    peer.post("recv", name="bd", n=n, seed=4, plan=BOUNDED_PLAN)
    for i in range(n):
        x = planned_tensor(4, i, BOUNDED_PLAN)
        if i % 2:  # zero-copy from the arena, else staged at the maxima
            y = dev.empty(tuple(x.shape), x.dtype)
            y.copy_(x)
            x = y
        s.send(x, timeout=30)
    assert_all_verified(peer.answer(), n, "bounded")
    for bad in [torch.zeros(7, 40), torch.zeros(6, 41), torch.zeros(6, 40, 1), torch.zeros(6, 40, dtype=torch.float64)]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=r"exceeds the bound of receiver 'bd'"):
            s.send(bad, timeout=30)
    r = BoundedReceiver(dev, "bd_back", [6, 40], torch.float32, depth=2)
    peer.call("bounded_sender", remote=dev.endpoint, name="bd_back", max_shape=[6, 40], dtype="float32")
    peer.post("send", name="bd_back", n=n, seed=5, plan=BOUNDED_PLAN)
    recv_check(r, n, lambda i: planned_tensor(5, i, BOUNDED_PLAN))
    r.release()
    assert peer.answer()["sent"] == n


def test_thousands_back_to_back(tpeer, dev):
    """2000 static 4 KiB tensors and 1000 dynamic ones of random shapes and dtypes, each
    checked by the process that receives it; then a shorter run the other way round."""
    peer = tpeer()
    peer.call("static_receiver", name="bb", shape=[1024], dtype="float32", depth=3)
    s = StaticSender(dev, peer.endpoint, "bb", mode="auto")
    peer.post("recv", name="bb", n=2000, seed=5)
    send_static(s, 5, 2000, in_arena="alternate", dev=dev)
    assert_all_verified(peer.answer(), 2000, "static 4 KiB")
    # 1 MiB tensors into a single slot: if a flag ever landed before its data, the receiver
    # would see (part of) the previous tensor.
    peer.call("static_receiver", name="bbig", shape=[512, 512], dtype="float32", depth=1)
    sb = StaticSender(dev, peer.endpoint, "bbig")
    peer.post("recv", name="bbig", n=60, seed=15)
    send_static(sb, 15, 60, in_arena="alternate", dev=dev)
    assert_all_verified(peer.answer(), 60, "static 1 MiB")

    # The dynamic sequence covers every dtype, rank 0 to 8 and empty tensors.
    specs = [dynamic_spec(6, i) for i in range(1000)]
    assert {d for _, d in specs} == set(DTYPES.values())
    assert {len(sh) for sh, _ in specs} == set(range(9))
    assert any(0 in sh for sh, _ in specs)

    r = DynamicReceiver(dev, "bbd", depth=3)
    gc.collect()
    before = dev.arena.used
    peer.call("dynamic_sender", remote=dev.endpoint, name="bbd")
    peer.post("send", name="bbd", n=1000, seed=6, in_arena=True)
    recv_check(r, 1000, lambda i: dynamic_tensor(6, i))
    assert peer.answer()["sent"] == 1000
    gc.collect()
    assert dev.arena.used == before, "received dynamic tensors did not return their memory"

    # This process sends with copies: each copy is released once the receiver has READ it,
    # so at most depth + 1 of them are held at any time.
    peer.call("dynamic_receiver", name="bbd2", depth=2)
    gc.collect()
    base = dev.arena.used
    s2 = DynamicSender(dev, peer.endpoint, "bbd2", mode="copy")
    own = dev.arena.used - base
    peer.post("recv", name="bbd2", n=300, seed=7)
    sizes = []
    for i in range(300):
        x = dynamic_tensor(7, i)
        sizes.append(-(-x.numel() * x.element_size() // ALIGNMENT) * ALIGNMENT)
        s2.send(x, timeout=30)
        held = dev.arena.used - base - own
        assert held <= sum(sizes[-3:]), f"transfer {i}: {held} bytes of copies held, more than depth + 1 transfers"
    assert_all_verified(peer.answer(), 300, "dynamic, this process sending")
    s2.wait_consumed(timeout=30)
    s2.close()
    gc.collect()
    assert dev.arena.used == base + own, "the sender still holds copies after close()"

    r2 = StaticReceiver(dev, "bb2", (16, 16), torch.int64, depth=1)
    peer.call("static_sender", remote=dev.endpoint, name="bb2")
    peer.post("send", name="bb2", n=300, seed=8, in_arena=True)
    recv_check(r2, 300, lambda i: static_tensor(8, i, (16, 16), torch.int64))
    r2.release()
    peer.answer()


@pytest.mark.parametrize("depth", [1, 3])
def test_sender_runs_ahead_of_a_slow_receiver(tpeer, dev, depth):
    """The sender sends as fast as it can; the receiver is slow. No tensor is overwritten
    before it is consumed (static), and no source buffer is released before it is read
    (dynamic), so every tensor still holds its own iteration's values when checked."""
    peer = tpeer()
    n = 40
    peer.call("static_receiver", name="ra", shape=[32, 32], dtype="float32", depth=depth)
    s = StaticSender(dev, peer.endpoint, "ra", mode="copy")
    # Static: the receiver holds each tensor 10 ms before checking it.
    peer.post("recv", name="ra", n=n, seed=3, sleep=0.01)
    buf = torch.empty(32, 32)
    lead = 0
    for i in range(n):
        buf.copy_(static_tensor(3, i, (32, 32), torch.float32))
        s.send(buf, timeout=30)  # copy mode: buf may be refilled as soon as send() returns
        ahead = s.seq - s.consumed()
        assert ahead <= depth, f"sender is {ahead} transfers ahead with depth {depth}"
        lead = max(lead, ahead)
    assert lead == depth, f"the sender never ran ahead (at most {lead} of {depth})"
    assert_all_verified(peer.answer(), n, f"static, depth {depth}")
    s.wait_consumed(timeout=30)

    # Dynamic: the receiver READs each tensor 10 ms late. The sender sends zero-copy from
    # arena tensors it drops at once and then scribbles over fresh allocations of the same
    # size: if a buffer were released before the READ, the scribble would land in it.
    peer.call("dynamic_receiver", name="rad", depth=depth)
    ds = DynamicSender(dev, peer.endpoint, "rad", mode="zerocopy")
    peer.post("recv", name="rad", n=n, seed=4, sleep_before=0.01)
    scribbles: list = []
    for i in range(n):
        x = dynamic_tensor(4, i)
        y = dev.empty(tuple(x.shape), x.dtype)
        y.copy_(x)
        if y.numel():
            ds.send(y, timeout=30)
        else:
            ds.send(x, timeout=30)
        del x, y
        junk = dev.empty((4096,), torch.uint8).fill_(0xA5)
        scribbles = (scribbles + [junk])[-4:]
        assert ds.seq - ds.consumed() <= depth
    assert_all_verified(peer.answer(), n, f"dynamic, depth {depth}")
    ds.wait_consumed(timeout=30)


def test_zero_copy_and_copy_modes_agree(tpeer, dev):
    peer = tpeer()
    shape, n = (64, 33), 20
    used = {}
    for mode in ("zerocopy", "copy", "auto"):
        peer.call("static_receiver", name=f"m_{mode}", shape=list(shape), dtype="bfloat16", depth=2)
        s = StaticSender(dev, peer.endpoint, f"m_{mode}", mode=mode)
        srcs = []
        for i in range(n):
            x = static_tensor(11, i, shape, torch.bfloat16)
            if mode == "zerocopy" or (mode == "auto" and i % 2):
                y = dev.empty(shape, torch.bfloat16)
                y.copy_(x)
                x = y
            srcs.append(x)
        if mode == "zerocopy":
            # A tensor outside the arena cannot be sent without a copy: refused, nothing sent.
            with pytest.raises(rdmaflow.InvalidArgumentError, match="zero-copy"):
                s.send(torch.zeros(shape, dtype=torch.bfloat16))
            assert s.seq == 0
        before = dev.arena.used
        peer.post("recv", name=f"m_{mode}", n=n, seed=11)
        for x in srcs:
            s.send(x, timeout=30)
        assert_all_verified(peer.answer(), n, f"static {mode}")
        used[mode] = dev.arena.used - before
    # Zero copy sends every tensor from its own memory: no staging buffer was allocated.
    assert used["zerocopy"] == 0
    assert used["copy"] > 0

    for mode in ("zerocopy", "copy", "auto"):
        peer.call("dynamic_receiver", name=f"md_{mode}", depth=2)
        s = DynamicSender(dev, peer.endpoint, f"md_{mode}", mode=mode)
        if mode == "zerocopy":
            with pytest.raises(rdmaflow.InvalidArgumentError, match="zero-copy"):
                s.send(torch.ones(3, 4))
        peer.post("recv", name=f"md_{mode}", n=n, seed=12)
        for i in range(n):
            x = dynamic_tensor(12, i)
            if x.numel() and (mode == "zerocopy" or (mode == "auto" and i % 2)):
                y = dev.empty(tuple(x.shape), x.dtype)
                y.copy_(x)
                x = y
            s.send(x, timeout=30)
        assert_all_verified(peer.answer(), n, f"dynamic {mode}")
    for cls in (StaticSender, DynamicSender):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="mode"):
            cls(dev, peer.endpoint, "m_copy", mode="fast")


# ==============================================================================================
# Bad input: a clear exception, never a hang, a crash or a wrong tensor
# ==============================================================================================
def test_mismatched_and_bad_tensors_are_refused(tpeer, dev):
    peer = tpeer()
    peer.call("static_receiver", name="m", shape=[4, 5], dtype="float32", depth=2)
    peer.call("dynamic_receiver", name="md", depth=2)
    ep = peer.endpoint
    # Declared shape / dtype that do not match the receiver: refused at construction.
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"float32\[4, 5\].*float32\[5, 4\]"):
        StaticSender(dev, ep, "m", shape=(5, 4))
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"float32\[4, 5\].*float16\[4, 5\]"):
        StaticSender(dev, ep, "m", dtype=torch.float16)
    with pytest.raises(rdmaflow.InvalidArgumentError, match="float32"):
        StaticSender(dev, ep, "m", shape=(20,), dtype=torch.float32)
    # Wrong kind, unknown name, a name that is not a receiver.
    with pytest.raises(rdmaflow.InvalidArgumentError, match="dynamic receiver, not a static"):
        StaticSender(dev, ep, "md")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="static receiver, not a dynamic"):
        DynamicSender(dev, ep, "m")
    for cls in (StaticSender, DynamicSender):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="published nothing named 'nope'"):
            cls(dev, ep, "nope")
    peer.call("publish_raw", name="raw", hex=b"hello, world".hex())
    peer.call("publish_raw", name="trunc", hex=(b"RFX1" + struct.pack("<I", 1000) + b"{}").hex())
    peer.call("publish_raw", name="json", hex=(b"RFX1" + struct.pack("<I", 5) + b"{nope").hex())
    with pytest.raises(rdmaflow.InvalidArgumentError, match="not an rdmaflow tensor receiver"):
        StaticSender(dev, ep, "raw")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="truncated"):
        DynamicSender(dev, ep, "trunc")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="malformed"):
        StaticSender(dev, ep, "json")

    # At send: wrong shape, wrong dtype, non-contiguous, not a tensor. Nothing is sent.
    s = StaticSender(dev, ep, "m", shape=(4, 5), dtype=torch.float32)
    for bad, what in [(torch.zeros(5, 4), "does not match"), (torch.zeros(4, 5, dtype=torch.float64), "does not match"),
                      (torch.zeros(20), "does not match"), (torch.zeros(5, 4).t(), "not contiguous"),
                      ([[0.0] * 5] * 4, "torch.Tensor")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=what):
            s.send(bad, timeout=5)
    assert s.seq == 0
    ds = DynamicSender(dev, ep, "md")
    for bad, what in [(torch.zeros(4, 6)[:, ::2], "not contiguous"), (torch.zeros([1] * 9), "rank 9 exceeds"),
                      (torch.zeros(3, dtype=torch.uint16), "cannot be transferred"), ("x", "torch.Tensor")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=what):
            ds.send(bad, timeout=5)
    assert ds.seq == 0
    # The refused calls left no trace: the next good tensors arrive as transfers 1, 2, 3.
    peer.post("recv", name="m", n=3, seed=21)
    send_static(s, 21, 3)
    assert_all_verified(peer.answer(), 3, "static after refusals")
    peer.post("recv", name="md", n=3, seed=22)
    for i in range(3):
        ds.send(dynamic_tensor(22, i), timeout=5)
    assert_all_verified(peer.answer(), 3, "dynamic after refusals")


_STATIC_META = {"kind": "static", "depth": 1, "base": 0, "ctl": 64, "data": 64 + 4096, "stride": 64,
                "shape": [4], "dtype": 1, "nbytes": 16}
_DYNAMIC_META = {"kind": "dynamic", "depth": 1, "base": 0, "ctl": 64, "data": 64 + 4096, "stride": 128,
                 "max_rank": 8, "record": 128}


@pytest.mark.parametrize("what, meta", [
    pytest.param("a valid static header", _STATIC_META, id="valid-static"),
    pytest.param("a valid dynamic header", _DYNAMIC_META, id="valid-dynamic"),
    pytest.param("missing fields", {"kind": "static"}, id="missing-fields"),
    pytest.param("unknown dtype code", dict(_STATIC_META, dtype=99), id="unknown-dtype"),
    pytest.param("non-integer depth", dict(_DYNAMIC_META, depth="x"), id="depth-not-int"),
    pytest.param("depth 0", dict(_DYNAMIC_META, depth=0), id="depth-0"),
    pytest.param("nbytes larger than the shape", dict(_STATIC_META, nbytes=4096, stride=4096), id="nbytes"),
])
def test_published_header_is_validated(job_secret, what, meta):
    """A header a receiver published (through the side RPC, so from a peer in the job) is
    checked by the sender: a bad one is an InvalidArgumentError at construction."""
    from rdmaflow.transfer.common import pack_header

    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        b.publish("h", pack_header(meta, b.arena.region.descriptor()))
        cls = DynamicSender if meta["kind"] == "dynamic" else StaticSender
        if what.startswith("a valid"):
            cls(a, b.endpoint, "h", timeout=5)  # the harness itself is sound
            return
        with pytest.raises(rdmaflow.InvalidArgumentError):
            cls(a, b.endpoint, "h", timeout=5)


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


MALFORMED = [
    # (what, fields to change in a valid record of a float32[3, 4] tensor, expected message)
    ("unknown dtype code", {"code": 99}, "unknown dtype code 99"),
    ("dtype code zero", {"code": 0}, "unknown dtype code 0"),
    ("rank above 8", {"rank": 9, "dims": [1] * 8}, "rank 9 exceeds the maximum of 8"),
    ("huge rank", {"rank": 2**32 - 1}, "exceeds the maximum of 8"),
    ("negative dimension", {"dims": [3, -4]}, "bad dimensions"),
    ("dimension past the rank", {"dims": [3, 4, 5]}, "bad dimensions"),
    ("nbytes too small", {"nbytes": 47}, "47 bytes do not match"),
    ("nbytes too large", {"nbytes": 96}, "96 bytes do not match"),
    ("nbytes of an empty shape", {"dims": [3, 0]}, "48 bytes do not match"),
    ("source past the arena", {"src_off": "past_end"}, "outside the sender's registered arena"),
    ("source straddles the arena's end", {"src_off": "straddle"}, "outside the sender's registered arena"),
    ("source offset wraps around", {"src_off": "wrap"}, "outside the sender's registered arena"),
    ("enormous consistent shape", {"dims": [2**40, 2**20], "nbytes": 2**62}, "outside the sender's registered arena"),
    ("another registered region", {"src_region": "other"}, "not the sender's registered arena"),
    ("unknown region id", {"src_region": 987654321}, "not the sender's registered arena"),
    ("wrong sequence number", {"seq": 1000}, "sequence number is 1000"),
]


def test_malformed_metadata_records(tpeer, dev):
    """A sender (the peer) writes a corrupt record + flag into this receiver's slot: recv()
    raises InvalidArgumentError naming the problem, returns no tensor and allocates nothing."""
    peer = tpeer()
    for k, (what, fields, msg) in enumerate(MALFORMED):
        r = DynamicReceiver(dev, f"bad{k}", depth=2)
        peer.post("forge", remote=dev.endpoint, name=f"bad{k}", set=fields)
        gc.collect()
        used = dev.arena.used
        got = []
        e = raises_within(rdmaflow.InvalidArgumentError, 20, lambda got=got, r=r: got.append(r.recv(timeout=15)))
        assert not got, f"{what}: a tensor was returned"
        assert "malformed metadata record" in str(e) and msg in str(e), f"{what}: {e}"
        assert dev.arena.used == used, f"{what}: the receiver allocated memory for a bad record"
        assert r.seq == 0
        # Asking again does not hang or crash either: the same record is refused again.
        with pytest.raises(rdmaflow.InvalidArgumentError, match="malformed"):
            r.recv(timeout=5)
        peer.answer()
        r.close()
    # A valid forged record goes through (the forging itself is sound).
    r = DynamicReceiver(dev, "good", depth=1)
    peer.call("forge", remote=dev.endpoint, name="good", set={})
    t = r.recv(timeout=15)
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).view(3, 4))


def test_receiver_arena_too_small_is_a_clear_error(tpeer, dev):
    """A valid record for a tensor that does not fit the receiver's arena: ArenaFullError
    naming the sizes, and the same transfer succeeds once memory is freed."""
    peer = tpeer(RDMAFLOW_TEST_ARENA=str(64 * MiB))
    r = DynamicReceiver(dev, "big", depth=1)
    hog = dev.empty((48 * MiB,), torch.uint8)
    plan = [[[8 * MiB], "float32"]]  # 32 MiB
    peer.call("dynamic_sender", remote=dev.endpoint, name="big")
    peer.post("send", name="big", n=1, seed=1, plan=plan, in_arena=True)
    e = raises_within(ArenaFullError, 20, r.recv, timeout=15)
    assert str(32 * MiB) in str(e), str(e)
    del hog
    gc.collect()
    recv_check(r, 1, lambda i: planned_tensor(1, i, plan))
    assert peer.answer()["sent"] == 1


# -- peers that die ---------------------------------------------------------------------------
def test_sender_dies_mid_transfer(tpeer, dev):
    """The sending process crashes while this process's receivers wait: each gets PeerError
    within a bounded time. A large tensor whose sender died while writing it is either
    complete and correct (its flag landed) or never returned."""
    peer = tpeer()
    big_shape = (8 * MiB // 4,)  # 8 MiB of float32
    rs = StaticReceiver(dev, "ds", (100,), torch.int64, depth=4)
    rd = DynamicReceiver(dev, "dd", depth=4)
    rb = StaticReceiver(dev, "db", big_shape, torch.float32, depth=1)
    for kind, name in [("static", "ds"), ("dynamic", "dd"), ("static", "db")]:
        peer.call(f"{kind}_sender", remote=dev.endpoint, name=name)
    peer.call("send", name="ds", n=3, seed=31, wait_consumed=False)
    peer.post("send", name="dd", n=3, seed=32)
    recv_check(rs, 3, lambda i: static_tensor(31, i, (100,), torch.int64))
    rs.release()
    recv_check(rd, 3, lambda i: dynamic_tensor(32, i))
    peer.answer()
    # Dies right after posting the big WRITE and its flag, without waiting for them.
    peer.post("send", name="db", n=1, seed=33, crash_after=1, crash_wait=False)
    peer.proc.wait(30)
    try:
        t = rb.recv(timeout=30)
    except rdmaflow.PeerError:
        pass
    else:
        assert mismatch(t, static_tensor(33, 0, big_shape, torch.float32)) is None, "a torn tensor was returned"
        del t
        raises_within(rdmaflow.PeerError, 20, rb.recv, timeout=30)
    # The others wait for their transfer 4 from a dead sender.
    e = raises_within(rdmaflow.PeerError, 20, rd.recv, timeout=30)
    assert peer.endpoint in str(e), str(e)
    raises_within(rdmaflow.PeerError, 20, rs.recv, timeout=30)


def test_receiver_dies_while_sender_waits_for_credit(tpeer, dev):
    """The receiving process crashes while senders are blocked (every slot unconsumed)."""
    peer = tpeer()
    peer.call("static_receiver", name="cs", shape=[256], dtype="float16", depth=2)
    peer.call("dynamic_receiver", name="cd", depth=2)
    s = StaticSender(dev, peer.endpoint, "cs")
    ds = DynamicSender(dev, peer.endpoint, "cd")
    send_static(s, 41, 2)
    for i in range(2):
        ds.send(dynamic_tensor(42, i), timeout=10)
    results: dict = {}

    def blocked(key, fn, x):
        t0 = time.monotonic()
        try:
            fn(x, timeout=60)
            results[key] = ("sent", None)
        except Exception as e:  # noqa: BLE001 - asserted below
            results[key] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=blocked, args=("static", s.send, static_tensor(41, 2, (256,), torch.float16))),
               threading.Thread(target=blocked, args=("dynamic", ds.send, dynamic_tensor(42, 2)))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert not results, f"a sender did not wait for credit: {results}"
    t_crash = time.monotonic()
    peer.crash()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a sender hung after its receiver died"
    for key in ("static", "dynamic"):
        e, _ = results[key]
        assert isinstance(e, rdmaflow.PeerError), f"{key}: {e!r}"
        assert "unreachable" in str(e), f"{key}: the error does not say why: {e}"  # the channel's reason
    assert time.monotonic() - t_crash < 30
    # Later calls fail at once.
    raises_within(rdmaflow.PeerError, 10, s.wait_consumed, timeout=30)


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


def test_receiver_names_depths_and_lazy_bits(job_secret):
    """A name holds one live receiver, and closing an old one does not unpublish its successor;
    depths a sender would refuse are refused here; a tensor whose conjugate or negative bit is
    set (its memory holds the values before that) is refused, not sent as its memory."""
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

        rc = StaticReceiver(b, "cplx", (2,), torch.complex64)
        sc = StaticSender(a, b.endpoint, "cplx")
        arena_c = a.empty((2,), torch.complex64)
        arena_c.copy_(torch.tensor([1 + 2j, 3 + 4j]))
        for t in (torch.tensor([1 + 2j, 3 + 4j]).conj(), arena_c.conj()):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="conjugate bit"):
                sc.send(t)
            with pytest.raises(rdmaflow.InvalidArgumentError, match="conjugate bit"):
                s.send(t)
        sc.send(arena_c.conj().resolve_conj(), timeout=5)
        assert rc.recv(timeout=5).tolist() == [1 - 2j, 3 - 4j]
        rn = StaticReceiver(b, "neg", (1,), torch.float32)
        sn = StaticSender(a, b.endpoint, "neg")
        t = torch.tensor([1 + 2j]).conj().imag  # one element: contiguous whatever its stride
        assert t.is_neg() and t.is_contiguous()
        with pytest.raises(rdmaflow.InvalidArgumentError, match="negative bit"):
            sn.send(t)
        sn.send(t.resolve_neg(), timeout=5)
        assert rn.recv(timeout=5).tolist() == [-2.0]



def test_lazy_negative_and_conjugate_views_are_never_sent_as_their_memory(tpeer, dev):
    """A tensor whose negative bit is set (torch._neg_view: any dtype, contiguous) or whose
    conjugate bit is set holds in memory the values before the negation: every sender refuses
    it (static from host memory and from the arena, bounded, dynamic; to a receiver on this
    host through its mapped slot over sm, over UCX on tcp) and sends nothing, where a static
    send on one host used to deliver +1 for -1. The resolved tensor then arrives as its values."""
    peer = tpeer()
    plan = [[[3, 5], "float32"]]
    peer.call("static_receiver", name="s", shape=[3, 5], dtype="float32", depth=2)
    peer.call("bounded_receiver", name="b", max_shape=[3, 5], dtype="float32", depth=2)
    peer.call("dynamic_receiver", name="d", depth=2)
    ep = peer.endpoint
    senders = {"s": StaticSender(dev, ep, "s"), "b": BoundedSender(dev, ep, "b", [3, 5], torch.float32),
               "d": DynamicSender(dev, ep, "d")}
    want = {"s": static_tensor(41, 0, (3, 5), torch.float32), "b": planned_tensor(42, 0, plan),
            "d": planned_tensor(43, 0, plan)}
    for name, s in senders.items():
        x = want[name]
        in_arena = dev.empty(x.shape, x.dtype)
        in_arena.copy_(-x)
        for bad in (torch._neg_view(-x), torch._neg_view(in_arena)):
            assert bad.is_neg() and bad.is_contiguous() and torch.equal(bad, x)  # its values are x
            with pytest.raises(rdmaflow.InvalidArgumentError, match="negative bit"):
                s.send(bad, timeout=5)
        if name != "s":  # the static receiver holds float32: a complex tensor fails its dtype first
            z = torch.complex(x, x).conj().resolve_conj()
            with pytest.raises(rdmaflow.InvalidArgumentError, match="conjugate bit"):
                s.send(z.conj(), timeout=5)
        assert s.seq == 0
        peer.post("recv", name=name, n=1, seed={"s": 41, "b": 42, "d": 43}[name],
                  **({} if name == "s" else {"plan": plan}))
        s.send(torch._neg_view(in_arena).resolve_neg(), timeout=5)
        assert_all_verified(peer.answer(), 1, f"{name} after refused lazy views")


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors).*:UserWarning")
def test_sparse_and_nested_tensors_are_refused(job_secret):
    """A sparse or nested tensor's memory is not its values in order: every sender (and
    register()) refuses it by name, where it used to raise PyTorch's internal errors."""
    with local_device() as a, local_device() as b:
        for d in (a, b):
            d.create_arena(MiB)
        rs = StaticReceiver(b, "dense", (3, 3), torch.float32)
        rd = DynamicReceiver(b, "dense_any")
        senders = (StaticSender(a, b.endpoint, "dense"), DynamicSender(a, b.endpoint, "dense_any"))
        eye = torch.eye(3)
        cases = [(eye.to_sparse(), "sparse_coo tensor"), (eye.to_sparse_csr(), "sparse_csr tensor"),
                 (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor")]
        for t, what in cases:
            for s in senders:
                with pytest.raises(rdmaflow.InvalidArgumentError, match=what):
                    s.send(t, timeout=5)
            with pytest.raises(rdmaflow.InvalidArgumentError, match=what):
                a.register(t)
        for s in senders:  # each still sends its dense form
            s.send(eye, timeout=5)
        assert torch.equal(rs.recv(timeout=5), eye) and torch.equal(rd.recv(timeout=5), eye)

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


def test_closed_receiver_stops_its_sender(job_secret):
    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        r = StaticReceiver(b, "c", (4,), torch.float32)
        s = StaticSender(a, b.endpoint, "c")
        s.send(torch.ones(4), timeout=5)
        r.recv(timeout=5)
        r.close()
        with pytest.raises(rdmaflow.PeerError, match="closed"):
            s.send(torch.ones(4), timeout=5)
            s.send(torch.ones(4), timeout=5)
        # The receiver's slots stay allocated (a late write lands in memory nobody reuses).
        assert b.arena.used > 0


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


def _pair_of_kind(kind: str, a, b, name: str, depth: int = 2):
    """A receiver on ``b`` and its sender on ``a``, of ``kind``, for 4 float32 values."""
    return _receiver_of_kind(kind, b, name, depth), _sender_of_kind(kind, a, b, name)


@pytest.mark.parametrize("kind", ["static", "bounded", "dynamic"])
@pytest.mark.parametrize("transport", ["tcp", "sm"], indirect=True)
def test_closed_sender_ends_its_receivers_waits(transport, kind, job_secret):
    """A sender's close() leaves the number it sent in the receiver's control block: what it
    sent is still received, every byte, and a wait for more ends in PeerError well before its
    timeout (it would be TimeoutError otherwise), in recv(), poll() and wait_any(); also for a
    receiver whose sender closed before sending anything."""
    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        r, s = _pair_of_kind(kind, a, b, "cs")
        sent = [a.arena.empty((4,), torch.float32).copy_(torch.arange(4.0) + 10 * i) for i in (1, 2)]
        for t in sent:
            s.send(t, timeout=5)
        s.close()
        for t in sent:  # the first recv() latches the sender: the closing word already waits
            assert torch.equal(r.recv(timeout=5).cpu(), t)
        with pytest.raises(rdmaflow.PeerError, match="closed after sending 2 transfers: transfer 3"):
            r.poll()
        with pytest.raises(rdmaflow.PeerError, match="closed after sending 2"):
            wait_any([r], timeout=30)
        with pytest.raises(rdmaflow.PeerError, match="closed after sending 2"):
            r.recv(timeout=30)

        r0, s0 = _pair_of_kind(kind, a, b, "cs0")
        assert not r0.poll()
        s0.close()
        with pytest.raises(rdmaflow.PeerError, match="closed after sending 0 transfers: transfer 1"):
            r0.recv(timeout=30)


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


@pytest.mark.parametrize("kind", ["static", "bounded", "dynamic"])
@pytest.mark.parametrize("transport", ["tcp", "sm"], indirect=True)
def test_a_closed_receiver_consumes_no_more(transport, kind, job_secret):
    """A receiver that closes after receiving one of three transfers leaves that count: the
    sender's consumed() says 1, wait_consumed(1) returns, and a wait for transfer 2 or 3 (or
    for all) ends in PeerError well before its timeout; it does not report them consumed. The
    closing word reaches the sender some time after the receiver's close() returns (over tcp it
    lands once the sender's worker is next driven, by its progress thread or a waiter), and
    wait_consumed(1) may return on the earlier ack: receiver_closed is asserted only once a
    wait for transfer 2 has seen the word."""
    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        r, s = _pair_of_kind(kind, a, b, "cc", depth=3)
        for i in range(3):
            s.send(torch.full((4,), float(i)), timeout=5)
        assert torch.equal(r.recv(timeout=5).cpu(), torch.zeros(4))
        assert not s.receiver_closed
        r.close()
        s.wait_consumed(1, timeout=30)
        assert s.consumed() == 1
        for k in (2, 3, None):
            e = raises_within(rdmaflow.PeerError, 20, s.wait_consumed, k, timeout=60)
            assert "closed after receiving 1 transfers" in str(e), str(e)
        assert s.receiver_closed and s.consumed() == 1
        with pytest.raises(rdmaflow.PeerError, match="was closed"):
            s.send(torch.ones(4), timeout=5)


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


def test_wait_any_and_wait_all_name_what_they_were_given():
    for bad in ([], None, ["x"], [1]):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="wait_any takes"):
            wait_any(bad, timeout=0.1)
    for bad in ([1], ["x"]):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="wait_all takes the futures"):
            rdmaflow.wait_all(bad, timeout=0.1)


# ==============================================================================================
# Non-blocking receive: poll() and wait_any(). poll() says whether the next transfer has landed,
# never blocks and consumes nothing; wait_any() returns a receiver whose next transfer has
# landed, raises PeerError for a dead sender and TimeoutError when nothing comes, and naps
# (a small share of a core) while it waits.
# ==============================================================================================
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


def test_release_takes_a_receiver_of_the_same_device(tpeer, dev, job_secret):
    peer = tpeer()
    peer.call("static_receiver", name="rel_in", shape=[4], dtype="int64")
    s = StaticSender(dev, peer.endpoint, "rel_in")
    with local_device() as other:
        other.create_arena(MiB)
        foreign = StaticReceiver(other, "foreign", (4,), torch.int64)
        for bad in (foreign, "r", 3):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="release= takes a receiver of this sender's device"):
                s.send(torch.zeros(4, dtype=torch.int64), release=bad)
    assert s.seq == 0  # refused before anything was sent


def test_a_rider_must_name_the_channels_peer(tpeer, dev, job_secret):
    """write_flagged's rider word goes to the same peer as the write: a region of another
    device is refused before anything is posted."""
    peer = tpeer()
    peer.call("static_receiver", name="rider_in", shape=[4], dtype="int64")
    s = StaticSender(dev, peer.endpoint, "rider_in")
    with local_device() as other:
        other.create_arena(MiB)
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
