"""Transfer conformance: every kind of pair, over every send path and transport, one contract.

Modelled on TensorPipe's channel tests (``test/channel/channel_test.h``): one fixture, ``cell``,
makes pairs of one kind (static, bounded, dynamic) that take one send path (the same-host direct
window, UCX's slot sender, UCX's general path, the GPU mapping) over one transport (tcp, sm), and
every contract test below runs in every cell. The fixture skips a cell that cannot exist and says
why; the GPU cells skip where no CUDA device is visible and run where one is.

Two real processes: this one and tests/transfer_peer.py. The peer and this process's device live
as long as the cells that share their UCX environment (a "link"), so a test pays for pairs, not
processes. Whichever process receives checks every byte of every tensor against the sequence both
regenerate (transfer_peer.planned_tensor); no tensor data crosses the command pipe.

A new path joins by a row in ``layout`` (its link, where its slots and its tensors live), a line in
``Cell.check_path`` (how a sender shows that it took it) and, if some kind cannot take it, a reason
in ``why_not``.
"""
from __future__ import annotations

import gc
import itertools
import os
import secrets
import threading
import time

import pytest
import torch
from conftest import TRANSFER_WAIT as WAIT
from conftest import TransferPeer, assert_all_verified, local_device, raises_within
from transfer_peer import ALL_DTYPES, DTYPES, dynamic_spec, dynamic_tensor, mismatch, planned_tensor

import rdmaflow
from rdmaflow._ucx import transport_vars
from rdmaflow.transfer import (
    BoundedReceiver,
    BoundedSender,
    DynamicReceiver,
    DynamicSender,
    StaticReceiver,
    StaticSender,
    wait_any,
)

KiB, MiB = 1 << 10, 1 << 20
KINDS = ("static", "bounded", "dynamic")
PATHS = ("direct", "ucx-slot", "ucx-general", "gpu-mapped")
TRANSPORTS = ("tcp", "sm")
ARENA = 128 * MiB  # each side's (a link's cells use up to ~64): a closed receiver's slots stay until its device closes
HAS_GPU = torch.cuda.is_available()

# The UCX environment of each link (rdmaflow._ucx.TRANSPORT_ENV): "sm" with rdmaflow's same-host
# mapping, "sm-cma" without it (UCX's shared memory moves the data), "cuda*" with UCX's CUDA
# transports, "cuda-ucx" with the same-host GPU mapping off.
LINKS = {
    "tcp": transport_vars("tcp"),
    "sm": transport_vars("sm"),
    "sm-cma": transport_vars("sm-cma"),
    "cuda": transport_vars("cuda"),
    "cuda-tcp": transport_vars("cuda-tcp"),
    "cuda-ucx": {**transport_vars("cuda"), "RDMAFLOW_GPU_IPC": "0"},
}

# Where the paths change how bytes move: posts made on the caller's thread up to 64 KiB
# (csrc/channel.cpp, kInlineMaxBytes), one active message over tcp up to flagged_message_bytes,
# striped over two workers over tcp from striped_write_bytes, non-temporal copies on one host
# from half the last-level cache (csrc/same_host.cpp).
INLINE_BYTES = 64 * KiB
MESSAGE_BYTES = rdmaflow.Channel.flagged_message_bytes
STRIPE_BYTES = rdmaflow.Channel.striped_write_bytes


def non_temporal_bytes() -> int:
    """Where the same-host copy switches to non-temporal stores: half the last-level cache, at
    least 4 MiB (csrc/same_host.cpp reads the same sysfs file)."""
    llc = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        value = int(text.rstrip("KMG") or 0) * {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
        llc = max(llc, value)
    return max(llc // 2, 4 * MiB)


def why_not(kind: str, path: str, transport: str) -> str | None:
    """Why a cell cannot exist, or None where it can."""
    if path == "direct" and transport == "tcp":
        return ("the direct window maps the receiver's arena, shared memory that UCX_TLS=tcp rules out: "
                "a peer on this host is then reached over UCX, as one on another host")
    if path == "ucx-slot" and kind == "bounded":
        return ("a bounded send writes its size record only once its credit is there, in a few calls: "
                "the UCX general path, never the slot sender's one call")
    if path == "ucx-slot" and kind == "dynamic":
        return "a dynamic send writes a metadata record that its receiver READs the data from: it has no slot sender"
    if path == "gpu-mapped" and kind == "bounded":
        return "a bounded receiver keeps its size records in its slots: host memory only, no GPU slots"
    return None


def layout(kind: str, path: str, transport: str) -> tuple[str, str | None, str]:
    """(link, where a static receiver's slots are: "cuda" or None for host memory, where the
    sent tensors live: "cuda" or "cpu") of a cell that can exist."""
    ucx = "tcp" if transport == "tcp" else "sm-cma"
    if path == "direct":
        return "sm", None, "cpu"
    if path == "ucx-slot" or (path == "ucx-general" and kind != "static"):
        return ucx, None, "cpu"
    if path == "ucx-general":
        # A static pair of host tensors over UCX always takes the slot sender; its general path
        # is what CUDA data takes: over tcp CUDA tensors into host slots (staged by cuda_copy),
        # over sm GPU slots that UCX's cuda_ipc writes (the same-host GPU mapping off).
        return ("cuda-tcp", None, "cuda") if transport == "tcp" else ("cuda-ucx", "cuda", "cuda")
    return ("cuda-tcp" if transport == "tcp" else "cuda"), ("cuda" if kind == "static" else None), "cuda"


class Link:
    """This process's device and one peer process, in one UCX environment."""

    def __init__(self, name: str):
        self.name = name
        self.mp = pytest.MonkeyPatch()
        self.mp.delenv("RDMAFLOW_GPU_IPC", raising=False)
        for k, v in {"RDMAFLOW_SAME_HOST": "auto", "RDMAFLOW_JOB_SECRET": secrets.token_hex(16), **LINKS[name]}.items():
            self.mp.setenv(k, v)
        self.dev = self.peer = None
        try:
            self.dev = rdmaflow.Device("127.0.0.1:0")
            self.dev.create_arena(ARENA)
            if name.startswith("cuda"):
                self.dev.create_arena(ARENA, device="cuda")
            self.peer = self.spawn()
        except BaseException:
            self.close()
            raise

    def spawn(self) -> TransferPeer:
        return TransferPeer(dict(os.environ, RDMAFLOW_TEST_ARENA=str(ARENA)))

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
        if self.dev is not None:
            self.dev.close()
        self.mp.undo()


class Links:
    """The link open now: cells of one link run one after another (module-scoped parameters),
    and a cell of another link closes it first."""

    def __init__(self):
        self.open: Link | None = None

    def get(self, name: str) -> Link:
        if self.open is not None and self.open.name != name:
            self.close()
        if self.open is None:
            self.open = Link(name)
        return self.open

    def close(self) -> None:
        if self.open is not None:
            link, self.open = self.open, None
            link.close()


_names = itertools.count()


class Cell:
    """Makes pairs of one kind that take one path over one transport, this process at one end and
    the peer at the other."""

    def __init__(self, kind: str, path: str, transport: str, link: Link, slots: str | None, on: str):
        self.kind, self.path, self.transport = kind, path, transport
        self.link, self.dev, self.peer = link, link.dev, link.peer
        self.slots, self.on = slots, on
        # Where a received tensor lives: a static receiver's slots; a dynamic one's arena of the
        # sent tensor's kind of memory.
        self.received_on = on if kind == "dynamic" else ("cuda" if slots else "cpu")

    def __repr__(self) -> str:
        return f"{self.kind}-{self.path}-{self.transport}"

    def name(self) -> str:
        return f"{self.kind}{next(_names)}"

    # -- the peer receives -------------------------------------------------------------------
    def receiver_there(self, shape, dtype: str, depth: int = 2, peer: TransferPeer | None = None) -> str:
        """A receiver of this kind on the peer (``shape``: a static one's shape, a bounded one's
        maxima; a dynamic one takes any); its name."""
        peer, name = peer or self.peer, self.name()
        if self.kind == "static":
            peer.call("static_receiver", name=name, shape=list(shape), dtype=dtype, depth=depth, cuda=self.slots)
        elif self.kind == "bounded":
            peer.call("bounded_receiver", name=name, max_shape=list(shape), dtype=dtype, depth=depth)
        else:
            peer.call("dynamic_receiver", name=name, depth=depth)
        return name

    def sender(self, name: str, shape=None, dtype: str | None = None, mode: str = "auto",
               peer: TransferPeer | None = None):
        """This kind's sender on this process's device to the peer's receiver ``name``."""
        dt, at = None if dtype is None else ALL_DTYPES[dtype], (peer or self.peer).endpoint
        if self.kind == "static":
            return StaticSender(self.dev, at, name, shape=shape, dtype=dt, mode=mode, timeout=WAIT)
        if self.kind == "bounded":
            return BoundedSender(self.dev, at, name, shape, dt, mode=mode, timeout=WAIT)
        return DynamicSender(self.dev, at, name, mode=mode, timeout=WAIT)

    def pair_out(self, shape, dtype: str, depth: int = 2, mode: str = "auto", peer: TransferPeer | None = None):
        """(name, sender): this process sends, the peer receives and checks."""
        name = self.receiver_there(shape, dtype, depth, peer)
        s = self.sender(name, shape, dtype, mode, peer)
        self.check_path(s)
        return name, s

    def check_path(self, s) -> None:
        """The sender took this cell's path."""
        direct = s._direct is not None
        if self.path != "gpu-mapped":  # (a dynamic one's records take the direct window there over sm)
            assert direct == (self.path == "direct"), f"{self}: the direct window is {'' if direct else 'not '}in use"
        if self.path == "ucx-slot":
            assert s._one_call, f"{self}: not the slot sender"
        if self.path == "ucx-general" and self.kind != "dynamic":
            assert s._gpu_map is None and (not s._one_call or self.on == "cuda"), f"{self}: not the general path"
        if self.path == "gpu-mapped" and self.kind == "static":
            assert s._gpu_map is not None, f"{self}: the receiver's GPU slots are not mapped"

    # -- this process receives ---------------------------------------------------------------
    def pair_in(self, shape, dtype: str, depth: int = 2, peer: TransferPeer | None = None):
        """(name, receiver): the peer sends, this process receives (a dynamic pair takes any
        ``shape`` and ``dtype``)."""
        peer, name, dt = peer or self.peer, self.name(), ALL_DTYPES[dtype]
        if self.kind == "static":
            r = StaticReceiver(self.dev, name, tuple(shape), dt, depth=depth, timeout=WAIT, cuda=self.slots)
            peer.call("static_sender", remote=self.dev.endpoint, name=name)
        elif self.kind == "bounded":
            r = BoundedReceiver(self.dev, name, tuple(shape), dt, depth=depth, timeout=WAIT)
            peer.call("bounded_sender", remote=self.dev.endpoint, name=name, max_shape=list(shape), dtype=dtype)
        else:
            r = DynamicReceiver(self.dev, name, depth=depth, timeout=WAIT)
            peer.call("dynamic_sender", remote=self.dev.endpoint, name=name)
        return name, r

    # -- tensors -----------------------------------------------------------------------------
    def data_arena(self):
        """The arena that this cell's sent tensors are born in."""
        return self.dev.gpu_arena() if self.on == "cuda" else self.dev.arena

    def tensor(self, values: torch.Tensor, in_arena: bool) -> torch.Tensor:
        """``values`` where this cell's sent tensors live: born in the arena (zero copy) or not."""
        if in_arena:
            y = self.dev.empty(tuple(values.shape), values.dtype, device=None if self.on == "cpu" else self.on)
            return y.copy_(values)
        return values.to(self.on)

    def plan(self, shape, dtype: str) -> list:
        """A plan (transfer_peer.planned_tensor) of tensors this kind's receiver of ``shape``
        takes: that shape; for a bounded one also smaller ones, an empty one among them."""
        plan = [[list(shape), dtype]]
        if self.kind == "bounded" and shape:
            plan += [[[(d + 1) // 2 for d in shape], dtype], [[0] + list(shape[1:]), dtype]]
        return plan


@pytest.fixture(scope="module")
def links():
    held = Links()
    yield held
    held.close()


# Ordered by link: module-scoped parameters run in this order, each link's cells one after another.
CELLS = [pytest.param(c, id="-".join(c)) for c in sorted(
    itertools.product(KINDS, PATHS, TRANSPORTS),
    key=lambda c: (why_not(*c) is not None, layout(*c)[0] if why_not(*c) is None else "", c))]


@pytest.fixture(scope="module", params=CELLS)
def cell(request, links) -> Cell:
    """One kind x path x transport: skipped, saying why, where it cannot exist, and where it
    needs a GPU that this host lacks."""
    kind, path, transport = request.param
    why = why_not(kind, path, transport)
    if why is not None:
        pytest.skip(f"cannot apply: {why}")
    link, slots, on = layout(kind, path, transport)
    if on == "cuda" and not HAS_GPU:
        pytest.skip("no CUDA device is visible to this process: the GPU cells run on a host with an NVIDIA GPU "
                    "(README, 'GPU machines')")
    return Cell(kind, path, transport, links.get(link), slots, on)


def send_plan(cell: Cell, s, plan, seed: int, n: int, start: int = 0, in_arena="alternate") -> None:
    """Sends tensors ``start`` .. ``start + n`` of ``plan`` (every other one born in the arena)."""
    for i in range(start, start + n):
        x = planned_tensor(seed, i, plan)
        s.send(cell.tensor(x, in_arena is True or (in_arena == "alternate" and i % 2 == 0)), timeout=WAIT)


def recv_plan(cell: Cell, r, plan, seed: int, n: int, start: int = 0) -> list:
    """Receives n tensors here and checks each to the byte, and where it lives; returns them."""
    got = []
    for i in range(start, start + n):
        t = r.recv(timeout=WAIT)
        bad = mismatch(t.cpu(), planned_tensor(seed, i, plan))
        assert bad is None, f"{cell}: tensor {i} on '{r.name}': {bad}"
        assert t.device.type == cell.received_on, f"{cell}: tensor {i} arrived on {t.device}"
        where = cell.dev.gpu_arena() if t.is_cuda else cell.dev.arena
        assert t.numel() == 0 or where.contains(t), f"{cell}: tensor {i} is not in the arena"
        got.append(t)
    return got


def release(r) -> None:
    """Hands the last received tensor back (a dynamic receiver did when it READ it)."""
    r.release()


# ==============================================================================================
# The contract
# ==============================================================================================
def test_every_size_arrives_to_the_byte(cell):
    """From nothing and one byte to one byte past each size where a path changes how it moves
    data (inline posts, one message over tcp, stripes over tcp, non-temporal copies on one host),
    both ways; the sender's consumed() counts them all."""
    sizes = [0, 1, 4095, INLINE_BYTES, INLINE_BYTES + 1, MESSAGE_BYTES, MESSAGE_BYTES + 1, MiB + 1, STRIPE_BYTES + 1]
    out = sizes + ([non_temporal_bytes() + 1] if cell.path == "direct" else [])
    for nbytes in out:
        small = nbytes <= MiB + 1
        depth, n = (2, 3) if small else (1, 2)
        plan = cell.plan([nbytes], "uint8")
        name, s = cell.pair_out([nbytes], "uint8", depth)
        assert cell.kind != "static" or (s.shape, s.nbytes) == ((nbytes,), nbytes)
        cell.peer.post("recv", name=name, n=n, seed=nbytes, plan=plan)
        send_plan(cell, s, plan, nbytes, n)
        got = cell.peer.answer()
        assert_all_verified(got, n, f"{cell}, {nbytes} bytes")
        if cell.kind == "dynamic" and nbytes:  # its receiver reads a CUDA tensor through the mapping, or not
            assert got["gpu_mapped"] == (cell.path == "gpu-mapped"), f"{cell}: {got}"
        s.wait_consumed(timeout=WAIT)
        assert s.consumed() == n and s.has_credit()
    for nbytes in sizes:
        plan = cell.plan([nbytes], "uint8")
        n = 2 if nbytes <= MiB + 1 else 1
        name, r = cell.pair_in([nbytes], "uint8", n)
        cell.peer.post("send", name=name, n=n, seed=nbytes + 1, plan=plan, on=cell.on, in_arena=bool(nbytes % 2))
        recv_plan(cell, r, plan, nbytes + 1, n)
        if cell.kind == "dynamic" and nbytes:
            assert (r._sender_gpu_map is not None) == (cell.path == "gpu-mapped"), f"{cell}"
        release(r)
        assert cell.peer.answer()["sent"] == n


def test_every_dtype_and_shape_arrives_to_the_byte(cell):
    """Every dtype a transfer carries, and the shapes the receiver takes: rank 0, rank 8, empty
    ones (a dynamic pair: a random mix of all of them on one pair), both ways."""
    peer = cell.peer
    for k, dtype in enumerate(ALL_DTYPES):
        plan = cell.plan([3, 5], dtype)
        name, s = cell.pair_out([3, 5], dtype)
        peer.post("recv", name=name, n=4, seed=k, plan=plan)
        send_plan(cell, s, plan, k, 4)
        assert_all_verified(peer.answer(), 4, f"{cell}, {dtype}")
    shapes = [((), "float64"), ((0,), "bool"), ((3, 0, 2), "bfloat16"), ((1, 2, 1, 2, 1, 2, 1, 2), "int16"),
              ((7,), "complex128")]
    if cell.kind == "dynamic":  # one pair: any shape, any dtype, each transfer its own
        plan = [[list(shape), dtype] for shape, dtype in shapes]
        shapes = [((), plan)]
    for k, (shape, dtype) in enumerate(shapes):
        plan = dtype if isinstance(dtype, list) else cell.plan(shape, dtype)
        name, s = cell.pair_out(shape, plan[0][1])
        peer.post("recv", name=name, n=2 * len(plan), seed=100 + k, plan=plan)
        send_plan(cell, s, plan, 100 + k, 2 * len(plan))
        assert_all_verified(peer.answer(), 2 * len(plan), f"{cell}, {plan}")
        name, r = cell.pair_in(shape, plan[0][1])
        peer.post("send", name=name, n=2 * len(plan), seed=200 + k, plan=plan, on=cell.on, in_arena=k % 2 == 0)
        recv_plan(cell, r, plan, 200 + k, 2 * len(plan))
        release(r)
        peer.answer()
    if cell.kind == "dynamic":  # random shapes of rank 0 to 8 and dtypes, this process receiving
        specs = [dynamic_spec(300, i) for i in range(60)]
        assert {d for _, d in specs} == set(DTYPES.values()) and {len(sh) for sh, _ in specs} == set(range(9))
        assert any(0 in sh for sh, _ in specs)
        name, r = cell.pair_in((), "float32")
        peer.post("send", name=name, n=60, seed=300, on=cell.on, in_arena=True)
        for i in range(60):
            t = r.recv(timeout=WAIT)
            bad = mismatch(t.cpu(), dynamic_tensor(300, i))
            assert bad is None, f"{cell}: tensor {i}: {bad}"
        peer.answer()


def test_offset_views_in_every_mode_and_strided_views_refused(cell):
    """Contiguous views that start inside a larger tensor, in the arena or not, in each mode:
    the bytes of the view, no more, no fewer. Zero copy allocates nothing and refuses a tensor
    outside the arena; copy stages (a dynamic sender holds at most depth + 1 copies, none once
    the receiver has them and the sender closed). A strided view is refused, nothing sent."""
    shape, dtype, depth, n = [33, 17], "float32", 2, 6
    plan = [[shape, dtype]]
    numel = 33 * 17
    arena = cell.data_arena()
    for mode in ("auto", "zerocopy", "copy"):
        name, s = cell.pair_out(shape, dtype, depth, mode=mode)
        if mode == "zerocopy":
            with pytest.raises(rdmaflow.InvalidArgumentError, match="zero-copy"):
                s.send(cell.tensor(planned_tensor(1, 0, plan), in_arena=False), timeout=5)
        wide = cell.tensor(torch.zeros(34, 34), in_arena=True)
        for bad in (wide[:33, :17], wide[::2, :17], wide[:17, :33].t()):
            assert not bad.is_contiguous()
            with pytest.raises(rdmaflow.InvalidArgumentError, match="not contiguous"):
                s.send(bad, timeout=5)
        assert s.seq == 0
        views = []
        for i in range(n):
            off = 1 + i % 5  # elements: the view starts off the arena's alignment
            big = cell.tensor(torch.full((numel + off + 3,), -7.0), in_arena=mode == "zerocopy" or i % 2 == 1)
            view = big[off : off + numel].view(shape).copy_(planned_tensor(7, i, plan))
            assert view.is_contiguous() and view.storage_offset() == off
            views.append(view)
        gc.collect()
        used, held = arena.used, []
        cell.peer.post("recv", name=name, n=n, seed=7, plan=plan, sleep=0.002)
        for v in views:
            s.send(v, timeout=WAIT)
            held.append(arena.used - used)
        del v, views, big  # the next mode's accounting starts without them
        assert_all_verified(cell.peer.answer(), n, f"{cell}, {mode}")
        if mode == "zerocopy":
            assert held == [0] * n, f"{cell}: zero copy allocated {held}"
        elif mode == "copy":
            assert held[-1] > 0, f"{cell}: copy mode staged nothing"
            if cell.kind == "dynamic":
                each = -(-numel * 4 // 256) * 256
                assert max(held) <= (depth + 1) * each, f"{cell}: copies held {held}, more than depth + 1"
                s.wait_consumed(timeout=WAIT)
                s.close()
                gc.collect()
                assert arena.used <= used, f"{cell}: the sender holds copies after close()"
    with pytest.raises(rdmaflow.InvalidArgumentError, match="mode"):
        cell.sender(cell.receiver_there(shape, dtype), shape, dtype, mode="fast")


def send_scribbled(cell: Cell, s, plan, seed: int, i: int, scribbles: list) -> None:
    """Sends tensor ``i`` from an arena tensor dropped at once, then takes fresh arena memory
    of its size and fills it with -1: where the source was let go too early, the scribble lands
    in what the receiver reads."""
    s.send(cell.tensor(planned_tensor(seed, i, plan), in_arena=True), timeout=WAIT)
    junk = cell.tensor(torch.full((32 * 32,), -1.0), in_arena=True)
    scribbles[:] = (scribbles + [junk])[-4:]


def test_in_flight_up_to_the_depth_and_past_it(cell):
    """A sender runs ``depth`` transfers ahead of its receiver, never more: with nobody
    receiving, the transfer past the depth times out naming why, and has_credit() says so; against
    a slow receiver it keeps exactly ``depth`` in flight. Each source is dropped right after its
    send and its memory scribbled over: a slot or buffer let go before the receiver had it would
    show the scribble."""
    shape, dtype, n = [32, 32], "float32", 16
    plan = cell.plan(shape, dtype)
    for depth in (1, 3):
        name, s = cell.pair_out(shape, dtype, depth, mode="zerocopy")
        assert s.has_credit()
        scribbles: list = []
        for i in range(depth):
            send_scribbled(cell, s, plan, depth, i, scribbles)
        assert not s.has_credit() and s.consumed() == 0
        nxt = cell.tensor(planned_tensor(depth, depth, plan), in_arena=True)
        e = raises_within(rdmaflow.TimeoutError, 10, s.send, nxt, timeout=0.3)
        assert "never overwrites" in str(e), str(e)
        assert s.seq == depth
        slow = {"sleep_before": 0.01} if cell.kind == "dynamic" else {"sleep": 0.01}  # a late READ, a slow consumer
        cell.peer.post("recv", name=name, n=n, seed=depth, plan=plan, **slow)
        lead = 0
        for i in range(depth, n):
            send_scribbled(cell, s, plan, depth, i, scribbles)
            ahead = s.seq - s.consumed()
            assert ahead <= depth, f"{cell}: {ahead} transfers in flight with depth {depth}"
            lead = max(lead, ahead)
        assert lead == depth, f"{cell}: the sender never ran {depth} ahead (at most {lead})"
        assert_all_verified(cell.peer.answer(), n, f"{cell}, depth {depth}")
        s.wait_consumed(timeout=WAIT)
        assert s.consumed() == n and s.has_credit()


def test_received_tensors_are_intact_until_handed_back_and_then_the_callers(cell):
    """A received tensor holds its transfer while the caller holds it, with the sender pressing
    (depth 1: it must wait for this very slot); the caller may then write into it, and the next
    transfer is whole again. A dynamic receiver's tensors are each the caller's own memory: kept,
    written or dropped, they never alias each other, and dropped they return to the arena."""
    shape, dtype, n = [64, 9], "int32", 12
    plan = cell.plan(shape, dtype)
    arena = cell.dev.gpu_arena() if cell.received_on == "cuda" else cell.dev.arena
    name, r = cell.pair_in(shape, dtype, depth=1)
    gc.collect()
    before = arena.used
    cell.peer.post("send", name=name, n=n, seed=5, plan=plan, on=cell.on)
    kept = []
    for i in range(n):
        t = recv_plan(cell, r, plan, 5, 1, start=i)[0]
        if i % 4 == 0:
            time.sleep(0.05)  # the sender presses for this slot meanwhile
            assert mismatch(t.cpu(), planned_tensor(5, i, plan)) is None, f"{cell}: tensor {i} changed while held"
        if i % 2:
            t.fill_(-(i + 1))  # the caller's to use: a static slot, rewritten whole by the next transfer
        if cell.kind == "dynamic":
            kept.append((i, t))
        del t
    release(r)
    assert cell.peer.answer()["sent"] == n
    for i, t in kept:
        want = planned_tensor(5, i, plan) if i % 2 == 0 else torch.full(t.shape, -(i + 1), dtype=t.dtype)
        assert mismatch(t.cpu(), want) is None, f"{cell}: kept tensor {i} changed"
    if cell.kind == "dynamic":
        assert arena.used > before
        del t
        kept.clear()
        gc.collect()
        assert arena.used == before, f"{cell}: {arena.used - before} bytes still held after the tensors were dropped"


def test_thousands_in_order_on_two_pairs_sharing_a_channel(cell):
    """Two pairs to one peer, sends interleaved on the channel they share: each receiver gets its
    own transfers, in order, every byte (a tensor of the other pair, or an older one, fails);
    then a long stream the other way."""
    shape, dtype, n = [256], "int32", 200
    plan = cell.plan(shape, dtype)
    a, sa = cell.pair_out(shape, dtype, depth=3)
    b, sb = cell.pair_out(shape, dtype, depth=3)
    cell.peer.post("recv", names=[a, b], n=n, seed=11, plan=plan)
    for i in range(n):
        send_plan(cell, sa, plan, 11, 1, start=2 * i, in_arena=i % 3 == 0)
        send_plan(cell, sb, plan, 11, 1, start=2 * i + 1, in_arena=i % 3 == 1)
    assert_all_verified(cell.peer.answer(), 2 * n, f"{cell}, two pairs")
    name, r = cell.pair_in(shape, dtype, depth=3)
    cell.peer.post("send", name=name, n=2 * n, seed=12, plan=plan, on=cell.on, in_arena=True)
    recv_plan(cell, r, plan, 12, 2 * n)
    release(r)
    assert cell.peer.answer()["sent"] == 2 * n


def test_a_sender_closed_mid_stream(cell):
    """A sender that closes with transfers in flight: its receiver gets every one of them, every
    byte, and then PeerError saying how many were sent, well before its timeout, in recv(),
    poll() and wait_any(); also when the sender closed before sending anything. Both ways."""
    shape, dtype = [40, 3], "float64"
    plan = cell.plan(shape, dtype)
    peer = cell.peer
    name, s = cell.pair_out(shape, dtype, depth=4)
    send_plan(cell, s, plan, 21, 3)
    s.close()
    with pytest.raises(rdmaflow.InvalidArgumentError, match="closed"):
        s.send(cell.tensor(planned_tensor(21, 3, plan), in_arena=False))
    peer.post("recv", name=name, n=4, seed=21, plan=plan, timeout=30)
    f = peer.failure()
    assert f["error_type"] == "PeerError" and "closed after sending 3 transfers: transfer 4" in f["error"], f
    assert f["received"] == f["verified"] == 3 and f["first_mismatch"] is None, f
    assert f["wait_s"] < 20, f
    name, s = cell.pair_out(shape, dtype)
    s.close()
    peer.post("recv", name=name, n=1, seed=22, plan=plan, timeout=30)
    f = peer.failure()
    assert f["error_type"] == "PeerError" and "closed after sending 0 transfers: transfer 1" in f["error"], f

    name, r = cell.pair_in(shape, dtype, depth=4)
    peer.call("send", name=name, n=2, seed=23, plan=plan, on=cell.on, wait_consumed=False)
    peer.call("close", name=name)
    recv_plan(cell, r, plan, 23, 2)
    raises_within(rdmaflow.PeerError, 20, wait_any, [r], timeout=30)
    with pytest.raises(rdmaflow.PeerError, match="closed after sending 2 transfers: transfer 3"):
        r.poll()
    raises_within(rdmaflow.PeerError, 20, r.recv, timeout=30)
    name, r0 = cell.pair_in(shape, dtype)
    peer.call("close", name=name)
    e = raises_within(rdmaflow.PeerError, 20, r0.recv, timeout=30)
    assert "closed after sending 0 transfers: transfer 1" in str(e), str(e)


def test_a_receiver_closed_mid_stream(cell):
    """A receiver that closes after taking one of three transfers: its sender's consumed() says
    1, wait_consumed(1) returns and a wait for transfer 2 or 3 (or all) ends in PeerError well
    before its timeout, never reporting them consumed; the next send is refused. The receiver's
    slots stay allocated (a late write lands in memory nobody reuses). Both ways."""
    shape, dtype = [17], "int64"
    plan = cell.plan(shape, dtype)
    peer = cell.peer
    name, s = cell.pair_out(shape, dtype, depth=3)
    send_plan(cell, s, plan, 31, 3)
    assert_all_verified(peer.call("recv", name=name, n=1, seed=31, plan=plan), 1, f"{cell}")
    peer.call("close", name=name)
    s.wait_consumed(1, timeout=30)
    assert s.consumed() == 1
    for k in (2, 3, None):
        e = raises_within(rdmaflow.PeerError, 20, s.wait_consumed, k, timeout=60)
        assert "closed after receiving 1 transfers" in str(e), str(e)
    assert s.receiver_closed and s.consumed() == 1
    with pytest.raises(rdmaflow.PeerError, match="was closed"):
        s.send(cell.tensor(planned_tensor(31, 3, plan), in_arena=False), timeout=5)

    name, r = cell.pair_in(shape, dtype, depth=3)
    peer.call("send", name=name, n=3, seed=32, plan=plan, on=cell.on, wait_consumed=False)
    held = recv_plan(cell, r, plan, 32, 1)
    gc.collect()
    used = cell.dev.arena.used
    r.close()
    gc.collect()
    assert cell.dev.arena.used == used, f"{cell}: a closed receiver's slots went back to the arena"
    del held
    peer.post("wait_consumed", name=name, k=2, timeout=30)
    f = peer.failure()
    assert f["error_type"] == "PeerError" and "closed after receiving 1 transfers" in f["error"], f
    assert f["consumed"] == 1 and f["receiver_closed"], f
    peer.post("send", name=name, n=1, start=3, seed=32, plan=plan, on=cell.on, timeout=5)
    f = peer.failure()
    assert f["error_type"] == "PeerError" and "was closed" in f["error"], f


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors).*:UserWarning")
def test_what_it_cannot_carry_is_refused_and_nothing_is_sent(cell):
    """A clear InvalidArgumentError naming the problem, at construction (a declaration the
    receiver does not match, another kind's sender, a mode that does not exist) or at send (a
    shape or dtype the receiver does not take, a strided, sparse or nested tensor, one whose
    negative or conjugate bit is set: its memory holds the values before that, not a tensor, a
    release= that is no receiver of this device), before anything is written: the good tensors
    then arrive as transfers 1, 2, 3, every byte."""
    shape, dtype = [3, 5], "float32"
    plan = [[shape, dtype]]
    name = cell.receiver_there(shape, dtype)
    if cell.kind != "dynamic":  # a declaration the receiver does not match, refused before it claims
        for d_shape, d_dtype in (([5, 3], dtype), ([15], dtype), (shape, "float16")):
            with pytest.raises(rdmaflow.InvalidArgumentError, match=r"holds float32\[3, 5\]; this sender declared"):
                cell.sender(name, d_shape, d_dtype)
    other = {"static": DynamicSender, "bounded": StaticSender, "dynamic": StaticSender}[cell.kind]
    with pytest.raises(rdmaflow.InvalidArgumentError, match="receiver, not a"):
        other(cell.dev, cell.peer.endpoint, name)
    s = cell.sender(name, shape, dtype)
    good = planned_tensor(41, 0, plan)
    in_arena = cell.dev.empty(shape, torch.float32).copy_(-good)
    bad = [
        (torch.zeros(6, 10)[::2, ::2], "not contiguous"),
        (torch._neg_view(-good), "negative bit"),
        (torch._neg_view(in_arena), "negative bit"),
        (torch.tensor([1 + 2j]).conj().imag, "negative bit"),  # one element: contiguous, its bit set
        (torch.zeros(3, 5).to_sparse(), "sparse_coo tensor"),
        (torch.zeros(3, 5).to_sparse_csr(), "sparse_csr tensor"),
        (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
        ([[0.0] * 5] * 3, "torch.Tensor"),
        ("x", "torch.Tensor"),
    ]
    if cell.kind == "static":
        bad += [(torch.zeros(5, 3), "does not match"), (torch.zeros(15), "does not match"),
                (torch.zeros(3, 5, dtype=torch.float64), "does not match")]
    elif cell.kind == "bounded":
        bad += [(torch.zeros(4, 5), "exceeds the bound"), (torch.zeros(3, 6), "exceeds the bound"),
                (torch.zeros(3, 5, 1), "exceeds the bound"), (torch.zeros(3, 5, dtype=torch.float64), "exceeds the bound")]
    else:
        bad += [(torch.zeros([1] * 9), "rank 9 exceeds"), (torch.zeros(3, dtype=torch.uint16), "cannot be transferred")]
    for t, what in bad:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=what):
            s.send(t, timeout=5)
    if cell.kind != "dynamic":  # release= names a receiver of this device whose slot the send hands back
        with local_device() as elsewhere:
            elsewhere.create_arena(MiB)
            foreign = StaticReceiver(elsewhere, "foreign", (4,), torch.int64)
            for r in (foreign, "r", 3):
                with pytest.raises(rdmaflow.InvalidArgumentError, match="release= takes a receiver of this sender's"):
                    s.send(cell.tensor(good, in_arena=False), release=r)
    assert s.seq == 0
    cell.peer.post("recv", name=name, n=3, seed=41, plan=plan)
    send_plan(cell, s, plan, 41, 3)
    assert_all_verified(cell.peer.answer(), 3, f"{cell}, after refusals")
    cplan = [[shape, "complex64"]]  # the conjugate bit: a pair of a complex dtype
    name, sc = cell.pair_out(shape, "complex64")
    conj = planned_tensor(42, 0, cplan).conj().resolve_conj()
    for lazy in (conj.conj(), cell.tensor(conj, in_arena=True).conj()):  # the values wanted, not the memory
        with pytest.raises(rdmaflow.InvalidArgumentError, match="conjugate bit"):
            sc.send(lazy, timeout=5)
    assert sc.seq == 0
    cell.peer.post("recv", name=name, n=1, seed=42, plan=cplan)
    sc.send(cell.tensor(conj, in_arena=True).conj().resolve_conj(), timeout=WAIT)
    assert_all_verified(cell.peer.answer(), 1, f"{cell}, resolved")


def cells_of_link(link: str) -> list[tuple[str, str, str]]:
    """The cells (kind, path, transport) that run over ``link``."""
    return [(k, p, t) for k in KINDS for p in PATHS for t in TRANSPORTS
            if why_not(k, p, t) is None and layout(k, p, t)[0] == link]


@pytest.mark.parametrize("link", sorted({layout(*c)[0] for c in itertools.product(KINDS, PATHS, TRANSPORTS)
                                         if why_not(*c) is None}))
def test_a_peer_that_dies_mid_stream_ends_every_wait(link):
    """The peer process dies while, in every cell of a link, this process's sender waits for a
    credit (every slot unconsumed) and its receiver waits for a transfer, with a large transfer
    of the peer's on the way: every wait ends in PeerError naming why, well before its timeout;
    the large tensor is either whole (its flag landed) or never returned. One peer per link (a
    process is what costs): it holds the pairs of all that link's cells."""
    if link.startswith("cuda") and not HAS_GPU:
        pytest.skip("no CUDA device is visible to this process: the GPU cells run on a host with an NVIDIA GPU")
    held = Link(link)  # a link of its own: its peer dies
    try:
        _die_mid_stream([Cell(k, p, t, held, *layout(k, p, t)[1:]) for k, p, t in cells_of_link(link)], held.peer)
    finally:
        held.close()


def _die_mid_stream(cells: list[Cell], peer: TransferPeer) -> None:
    shape, dtype = [64, 33], "float16"
    big = [[[2 * MiB], "float32"]]
    ends = []
    for cell in cells:
        plan = cell.plan(shape, dtype)
        _, s = cell.pair_out(shape, dtype, depth=2, peer=peer)
        _, r = cell.pair_in(shape, dtype, depth=4, peer=peer)
        big_name, rb = cell.pair_in([2 * MiB], "float32", depth=1, peer=peer)
        send_plan(cell, s, plan, 51, 2)
        peer.call("send", name=r.name, n=2, seed=52, plan=plan, on=cell.on, wait_consumed=False)
        recv_plan(cell, r, plan, 52, 2)
        ends.append((cell, plan, s, r, big_name, rb))
    results: dict = {}

    def blocked(cell: Cell, s, x) -> None:
        t0 = time.monotonic()
        try:
            s.send(x, timeout=60)
            results[repr(cell)] = (None, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - asserted below
            results[repr(cell)] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=blocked, args=(cell, s, cell.tensor(planned_tensor(51, 2, plan), False)))
               for cell, plan, s, *_ in ends]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not results, f"a send past the depth did not wait: {results}"
    for i, (cell, *_, big_name, _) in enumerate(ends):  # the last one dies right after posting its big one
        peer.post("send", name=big_name, n=1, seed=53, plan=big, on=cell.on, wait_consumed=False,
                  **({"crash_after": 1, "crash_wait": False} if i == len(ends) - 1 else {}))
    peer.proc.wait(WAIT)
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a sender hung after its receiver died"
    for cell, plan, s, r, _, rb in ends:
        e, took = results[repr(cell)]
        assert isinstance(e, rdmaflow.PeerError), f"{cell}: {e!r}"
        assert "unreachable" in str(e), f"{cell}: the error does not say why: {e}"
        assert took < 40, f"{cell}: {took:.1f} s"
        try:
            whole = rb.recv(timeout=30)
        except rdmaflow.PeerError:
            pass
        else:
            assert mismatch(whole.cpu(), planned_tensor(53, 0, big)) is None, f"{cell}: a torn tensor was returned"
            del whole
        e = raises_within(rdmaflow.PeerError, 20, r.recv, timeout=30)
        assert peer.endpoint in str(e), f"{cell}: {e}"
        raises_within(rdmaflow.PeerError, 10, s.wait_consumed, timeout=30)
