"""The registered arena under the transfer layer: the allocator, device.empty, what a device keeps,
a full arena's error, and tensors register() cannot take. Local devices, and a peer where a
transfer fills the arena. The transfer contract itself: tests/test_transfer_conformance.py."""
from __future__ import annotations

import gc
import itertools
import random
import threading

import pytest
import torch
from conftest import (
    TRANSFER_WAIT,
    local_device,
    raises_within,
    recv_check,
)
from transfer_peer import (
    DTYPES,
    planned_tensor,
)

import rdmaflow
from rdmaflow.arena import ALIGNMENT
from rdmaflow.transfer import Arena, DynamicReceiver, StaticReceiver

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = TRANSFER_WAIT  # bound on any single answer from a peer


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


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors).*:UserWarning")
def test_register_refuses_sparse_and_nested_tensors(job_secret):
    """A sparse or nested tensor's memory is not its values in order: register() refuses it by
    name, where it used to raise PyTorch's internal errors (every sender refuses it too:
    tests/test_transfer_conformance.py)."""
    with local_device() as a:
        eye = torch.eye(3)
        for t, what in [(eye.to_sparse(), "sparse_coo tensor"), (eye.to_sparse_csr(), "sparse_csr tensor"),
                        (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor")]:
            with pytest.raises(rdmaflow.InvalidArgumentError, match=what):
                a.register(t)
