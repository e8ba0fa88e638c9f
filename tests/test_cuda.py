"""GPU tensors: GPU memory as regions, and transfers of CUDA tensors.

Two real processes, as in the conformance suite: this one and tests/peer.py or
tests/transfer_peer.py, over UCX's CUDA transports ("cuda": cuda_ipc and cuda_copy beside shared
memory; "cuda-tcp": sockets, GPU memory staged by cuda_copy). Every byte that crosses is checked.
The tests that need a GPU skip, with their reason, where none is visible; the refusals that need
none run everywhere.
"""
from __future__ import annotations

import hashlib
import random

import pytest
import torch
from conftest import TransferPeer, assert_all_verified, local_device
from transfer_peer import dynamic_tensor, static_tensor

import rdmaflow
from rdmaflow._ucx import transport_vars
from rdmaflow.transfer import DynamicReceiver, DynamicSender, StaticReceiver, StaticSender

MiB = 1 << 20
NO_GPU = not torch.cuda.is_available()
gpu = pytest.mark.skipif(NO_GPU, reason="no CUDA device is visible to this process: the GPU tests run on a "
                                        "host with an NVIDIA GPU (README, 'GPU machines')")
REGION = 64 * MiB + 8192
SIZES = [1, 7, 4096, 65537, MiB + 3, 16 * MiB + 5, 64 * MiB]


@pytest.fixture(params=["cuda", "cuda-tcp"])
def transport(request, monkeypatch):
    """This module's transports: UCX with its CUDA transports (replaces conftest's)."""
    for k, v in {"RDMAFLOW_SAME_HOST": "auto", **transport_vars(request.param)}.items():
        monkeypatch.setenv(k, v)
    return request.param


@pytest.fixture(params=["mapped", "ucx"])
def gpu_path(request, transport, monkeypatch):
    """How GPU memory of a peer on this host is reached: mapped through CUDA IPC and copied by a
    kernel (the default), or through UCX alone (RDMAFLOW_GPU_IPC=0; over "cuda" only)."""
    if request.param == "ucx":
        if transport != "cuda":
            pytest.skip("the UCX path is checked over the cuda transport")
        monkeypatch.setenv("RDMAFLOW_GPU_IPC", "0")
    return request.param


@pytest.fixture
def tpeer(transport, job_secret):
    peers: list[TransferPeer] = []

    def spawn() -> TransferPeer:
        import os

        p = TransferPeer(dict(os.environ, RDMAFLOW_JOB_SECRET=job_secret))
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.close()


def host_bytes(region, offset: int, nbytes: int) -> bytes:
    t = region.tensor(torch.uint8, region.nbytes)[offset : offset + nbytes]
    return t.cpu().numpy().tobytes()


def digest(region, offset: int, nbytes: int) -> str:
    return hashlib.blake2b(host_bytes(region, offset, nbytes), digest_size=32).hexdigest()


def seeded_bytes(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# -- refusals that need no GPU ------------------------------------------------------------------
@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a host without a GPU")
def test_gpu_memory_without_a_gpu_is_refused_naming_why(job_secret):
    with local_device() as d:
        for make in (lambda: d.create_arena(MiB, device="cuda"), lambda: d.empty(4, device="cuda"),
                     lambda: d.alloc_region(4096, "cuda")):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="no CUDA device is visible"):
                make()


def test_a_gpu_arena_needs_a_cuda_device(job_secret):
    with local_device() as d:
        with pytest.raises(rdmaflow.InvalidArgumentError, match="expected a CUDA device"):
            d.create_arena(MiB, device="cpu")
        with pytest.raises(rdmaflow.InvalidArgumentError, match="not a device"):
            d.alloc_region(4096, "gpu0")
        # Host memory as before, and a host region says so.
        assert d.alloc_region(4096).cuda_device == -1


# -- regions of GPU memory ----------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("local_kind, remote_kind", [("gpu", "gpu"), ("gpu", "host"), ("host", "gpu")])
def test_write_then_read_between_host_and_gpu_memory_every_byte(spawn_peer, transport, local_kind, remote_kind):
    peer = spawn_peer()
    peer.call("alloc", name="buf", nbytes=REGION, cuda=remote_kind == "gpu", timeout=60)
    rng = random.Random(1234)
    with local_device() as dev:
        local = dev.alloc_region(REGION, "cuda" if local_kind == "gpu" else None)
        assert (local.cuda_device >= 0) == (local_kind == "gpu")
        view = local.tensor(torch.uint8, REGION)
        view.copy_(seeded_bytes(7, REGION))
        remote = dev.lookup_region(peer.endpoint, "buf")
        assert (remote.cuda_device >= 0) == (remote_kind == "gpu")
        ch = dev.channel(peer.endpoint)
        for size in SIZES:
            lo, ro = rng.randrange(0, REGION - size + 1), rng.randrange(0, REGION - size + 1)
            ch.memcpy(local, lo, remote, ro, size, rdmaflow.WRITE).result(60)
            got = peer.call("digest", name="buf", offset=ro, nbytes=size, timeout=60)["digest"]
            assert got == digest(local, lo, size), f"WRITE of {size} B from {lo} to {ro} differs"
        peer.call("fill", name="buf", seed=99, timeout=60)
        expect = seeded_bytes(99, REGION)
        for size in SIZES:
            lo, ro = rng.randrange(0, REGION - size + 1), rng.randrange(0, REGION - size + 1)
            view.zero_()
            ch.memcpy(local, lo, remote, ro, size, rdmaflow.READ).result(60)
            got = view.cpu()
            assert torch.equal(got[lo : lo + size], expect[ro : ro + size]), f"READ of {size} B differs"
            assert int(got[:lo].count_nonzero()) == 0 and int(got[lo + size :].count_nonzero()) == 0


@gpu
def test_a_registered_cuda_tensor_is_viewed_with_no_copy(job_secret, transport):
    with local_device() as dev:
        t = torch.arange(1024, dtype=torch.float32, device="cuda")
        r = dev.register(t)
        assert r.cuda_device == t.device.index and r.nbytes == 4096 and r.address == t.data_ptr()
        v = r.tensor(torch.float32, (32, 32))
        assert v.is_cuda and v.data_ptr() == t.data_ptr()
        v[0, 0] = -1.0
        assert float(t[0]) == -1.0
        with pytest.raises(BufferError) as e:  # Python's buffer protocol reports it so
            memoryview(r)
        assert isinstance(e.value.__cause__, rdmaflow.InvalidArgumentError) and "GPU memory" in str(e.value.__cause__)
        # The device's GPU arena: CUDA tensors in one registered region, returned when they die.
        arena = dev.create_arena(8 * MiB, device="cuda")
        x = dev.empty((16, 16), torch.float16, device="cuda")
        assert x.is_cuda and arena.contains(x) and arena.region.cuda_device == x.device.index
        used = arena.used
        del x
        assert arena.used < used


@gpu
def test_gpu_region_errors(spawn_peer, transport):
    peer = spawn_peer()
    peer.call("alloc", name="g", nbytes=MiB, cuda=True)
    with local_device() as dev:
        local = dev.alloc_region(MiB, "cuda")
        host = dev.alloc_region(MiB)
        remote = dev.lookup_region(peer.endpoint, "g")
        ch = dev.channel(peer.endpoint)
        ch.memcpy(local, 0, remote, 0, 4096, rdmaflow.WRITE).result(30)
        # Out of bounds, either side.
        with pytest.raises(rdmaflow.OutOfBoundsError):
            ch.memcpy(local, MiB - 8, remote, 0, 16, rdmaflow.WRITE)
        with pytest.raises(rdmaflow.OutOfBoundsError):
            ch.memcpy(local, 0, remote, MiB - 8, 16, rdmaflow.READ)
        # A flag lives in host memory: a word in GPU memory, either side, is refused.
        with pytest.raises(rdmaflow.InvalidArgumentError, match="GPU memory"):
            ch.write_flagged(local, 0, remote, 0, 64, 0, 1, 64)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="GPU memory"):
            ch.write_flagged(host, 0, remote, 0, 64, 64, 1, 64, None, None, 0, 0, 0, host, remote)
        # A freed GPU region, remote and local.
        peer.call("free", name="g")
        with pytest.raises(rdmaflow.RegionError, match="freed"):
            ch.memcpy(local, 0, remote, 0, 4096, rdmaflow.WRITE)
        mine = dev.alloc_region(MiB, "cuda")
        mine.free()
        with pytest.raises(rdmaflow.RegionError, match="freed"):
            mine.descriptor()


# -- transfer pairs with CUDA tensors -----------------------------------------------------------
def _send_static(s, seed: int, n: int, on: str, dev=None, in_arena: bool = False) -> None:
    for i in range(n):
        x = static_tensor(seed, i, s.shape, s.dtype)
        if in_arena:
            y = dev.empty(s.shape, s.dtype, device=on)
            y.copy_(x)
            x = y
        else:
            x = x.to(on)
        s.send(x, timeout=30)


@gpu
@pytest.mark.parametrize("slots, source, mode", [
    ("cuda", "cuda", "zerocopy"),   # GPU to GPU, straight from the GPU arena
    ("cuda", "cuda", "copy"),       # staged in GPU memory first
    ("cuda", "cpu", "auto"),        # host tensors into GPU slots
    (None, "cuda", "auto"),         # CUDA tensors into host slots
])
def test_static_pairs_carry_cuda_tensors(tpeer, transport, job_secret, gpu_path, slots, source, mode):
    peer = tpeer()
    shape, n = (256, 1025), 24
    with local_device() as dev:
        dev.create_arena(64 * MiB)
        dev.create_arena(64 * MiB, device="cuda")
        peer.call("static_receiver", name="s", shape=list(shape), dtype="float32", depth=2, cuda=slots)
        s = StaticSender(dev, peer.endpoint, "s", mode=mode)
        assert (s._gpu_map is not None) == (slots is not None and gpu_path == "mapped")
        peer.post("recv", name="s", n=n, seed=5)
        _send_static(s, 5, n, source, dev, in_arena=mode == "zerocopy")
        r = peer.answer()
        assert_all_verified(r, n, f"slots {slots}, source {source}, {mode}")
        assert r["devices"] == ["cuda" if slots else "cpu"]
        s.wait_consumed(timeout=30)


@gpu
def test_a_receiver_with_gpu_slots_gets_cuda_tensors_in_its_arena(tpeer, transport, job_secret):
    peer = tpeer()
    shape, n = (3, 4097), 16
    with local_device() as dev:
        dev.create_arena(16 * MiB)
        gpu_arena = dev.create_arena(16 * MiB, device="cuda")
        r = StaticReceiver(dev, "from_peer", shape, torch.float32, depth=2, cuda="cuda")
        peer.call("static_sender", remote=dev.endpoint, name="from_peer")
        peer.post("send", name="from_peer", n=n, seed=8, on="cuda", in_arena=True)
        for i in range(n):
            t = r.recv(timeout=30)
            assert t.is_cuda and gpu_arena.contains(t)
            assert torch.equal(t.cpu(), static_tensor(8, i, shape, torch.float32)), f"tensor {i} differs"
        r.release()
        assert peer.answer()["sent"] == n


@gpu
@pytest.mark.parametrize("in_arena", [True, False])
def test_dynamic_pairs_carry_cuda_tensors_both_ways(tpeer, transport, job_secret, gpu_path, in_arena):
    peer = tpeer()
    n = 30
    with local_device() as dev:
        dev.create_arena(64 * MiB)
        dev.create_arena(64 * MiB, device="cuda")
        peer.call("dynamic_receiver", name="d", depth=2)
        s = DynamicSender(dev, peer.endpoint, "d")
        peer.post("recv", name="d", n=n, seed=3)
        for i in range(n):
            x = dynamic_tensor(3, i)
            if in_arena:
                y = dev.empty(tuple(x.shape), x.dtype, device="cuda")
                y.copy_(x)
                x = y
            s.send(x.cuda() if not in_arena else x, timeout=30)
        r = peer.answer()
        assert_all_verified(r, n, "dynamic, CUDA tensors")
        assert r["devices"] == ["cuda"]
        s.wait_consumed(timeout=30)
        # The other way: the peer sends CUDA tensors, this process receives them on its GPU.
        recv = DynamicReceiver(dev, "back", depth=2)
        peer.call("dynamic_sender", remote=dev.endpoint, name="back")
        peer.post("send", name="back", n=n, seed=4, on="cuda", in_arena=in_arena)
        for i in range(n):
            t = recv.recv(timeout=30)
            want = dynamic_tensor(4, i)
            assert t.is_cuda and t.dtype == want.dtype and t.shape == want.shape
            assert torch.equal(t.cpu(), want), f"tensor {i} differs"
        assert peer.answer()["sent"] == n
        assert (recv._sender_gpu_map is not None) == (gpu_path == "mapped")


@gpu
def test_a_send_waits_for_the_stream_that_produced_the_tensor(tpeer, transport, job_secret, gpu_path):
    """The producer's kernels are still queued when send() is called (a long sleep kernel ahead of
    the fill): the receiver must see the filled values, never the old ones."""
    peer = tpeer()
    shape, n = (1 << 20,), 6
    with local_device() as dev:
        dev.create_arena(16 * MiB)
        dev.create_arena(64 * MiB, device="cuda")
        peer.call("static_receiver", name="w", shape=list(shape), dtype="float32", depth=2, cuda="cuda")
        s = StaticSender(dev, peer.endpoint, "w", mode="zerocopy")
        bufs = [dev.empty(shape, torch.float32, device="cuda") for _ in range(2)]
        peer.post("recv", name="w", n=n, seed=11)
        for i in range(n):
            b, src = bufs[i % 2], static_tensor(11, i, shape, torch.float32).cuda()
            b.zero_()
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time, queued before the copy
            b.copy_(src)  # device to device: queued behind the sleep, send() is called at once
            s.send(b, timeout=30).result(30)
        assert_all_verified(peer.answer(), n, "sent right behind queued kernels")
