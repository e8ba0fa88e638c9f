"""A peer process for the tensor-transfer tests: one rdmaflow Device driven by JSON lines.

The first line it writes is ``{"endpoint": ...}``; then every command read on stdin is
answered by one JSON line on stdout: ``{"ok": true, ...}``, or ``{"ok": false, "error_type":
..., "error": ..., ...}`` when the command raised (the test asserts on the error type).

It can be a receiver (static or dynamic) that checks every tensor it gets, a sender, a forger
of malformed metadata records, or a process that dies mid-stream. No tensor data crosses the
command pipe: both processes regenerate "tensor i of sequence seed" with the functions below.
Every wait is bounded by a timeout carried in the command (default ``DEFAULT_TIMEOUT``).

Commands (``op``):
  static_receiver  name, shape, dtype, depth, [cuda]  a StaticReceiver published as ``name``
                                                    (cuda: its slots in the GPU arena)
  dynamic_receiver name, depth                      a DynamicReceiver
  static_sender    remote, name, [shape, dtype, mode]   a StaticSender to ``remote``'s ``name``
  dynamic_sender   remote, name, [mode]
  bounded_receiver name, max_shape, dtype, depth    a BoundedReceiver (recv/send with a ``plan``)
  bounded_sender   remote, name, max_shape, dtype, [mode]   a BoundedSender
  recv    name, n, seed, [start, sleep, sleep_before, plan, crash_after, names]
          receives n transfers and checks each against tensor i of the sequence (every byte);
          answers received / verified / first_mismatch (also in an error answer: how many came
          first); with ``names``, n rounds of one transfer from each of those receivers in turn
  send    name, n, seed, [start, in_arena, on, plan, crash_after, crash_wait, wait_consumed, sleep_before]
          (on "cuda": CUDA tensors, in the GPU arena with in_arena); recv answers the devices
          the tensors arrived on
  forge   remote, name, set     writes a metadata record of a float32[3, 4] tensor, with the
          fields in ``set`` replaced, and its flag, into a DynamicReceiver's next slot
  close   name                  closes that sender or receiver (mid-stream, as a test asks)
  wait_consumed name, [k]       a sender's wait_consumed(k); answers consumed, receiver_closed
  publish_raw name, hex         publishes arbitrary bytes under ``name``
  arena                         the arena's counters
  crash                         os._exit(17) at once;  exit: closes everything and ends
"""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback

import torch

DEFAULT_TIMEOUT = 30.0

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}
# Every dtype a transfer carries (rdmaflow.transfer.dtypes.WIRE_DTYPES), by name: what plans may
# name. DTYPES above is the mix that random dynamic sequences draw from.
ALL_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}


# -- the deterministic tensor sequences both processes regenerate -----------------------------
def make_values(seed: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Pseudo-random values of ``dtype`` and ``shape``, a function of ``seed`` only."""
    g = torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    shape = tuple(int(s) for s in shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return (torch.randn(shape, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
                * 100).to(dtype)
    if dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=dtype)
    if dtype.is_complex:
        real = torch.float64 if dtype == torch.complex128 else torch.float32
        return torch.complex(torch.randn(shape, generator=g, dtype=real), torch.randn(shape, generator=g, dtype=real))
    raise ValueError(f"no generator for {dtype}")


def static_tensor(seed: int, i: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``i`` of the static sequence ``seed`` (fixed shape and dtype)."""
    return make_values(seed * 1_000_003 + i, shape, dtype)


def dynamic_spec(seed: int, i: int, dtypes=None) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape (rank 0..8, sometimes with a zero dimension) and dtype of dynamic tensor ``i``."""
    rng = random.Random(seed * 1_000_003 + i)
    names = list(dtypes or DTYPES)
    dtype = DTYPES[rng.choice(names)]
    rank = rng.randint(0, 8)
    if rank == 0:
        return (), dtype
    maxdim = max(2, round(4096 ** (1.0 / rank)) + 1)  # at most a few thousand elements
    shape = [rng.randint(1, maxdim) for _ in range(rank)]
    if rng.random() < 0.08:
        shape[rng.randrange(rank)] = 0  # an empty tensor now and then
    return tuple(shape), dtype


def dynamic_tensor(seed: int, i: int, dtypes=None) -> torch.Tensor:
    shape, dtype = dynamic_spec(seed, i, dtypes)
    return make_values(seed * 1_000_003 + i, shape, dtype)


def planned_tensor(seed: int, i: int, plan) -> torch.Tensor:
    """Tensor ``i`` of an explicit plan: a list of (shape, dtype name), used cyclically."""
    shape, name = plan[i % len(plan)]
    return make_values(seed * 1_000_003 + i, tuple(shape), ALL_DTYPES[name])


def expected(kind: str, seed: int, i: int, shape=None, dtype=None, dtypes=None, plan=None) -> torch.Tensor:
    if kind == "static":
        return static_tensor(seed, i, shape, dtype)
    if plan:
        return planned_tensor(seed, i, plan)
    return dynamic_tensor(seed, i, dtypes)


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if ``got`` is ``want`` exactly (dtype, shape, every byte); else what differs."""
    if not isinstance(got, torch.Tensor):
        return f"got a {type(got).__name__}, not a tensor"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.equal(got, want):
        bad = (got != want).reshape(-1).nonzero()
        j = int(bad[0]) if len(bad) else -1
        return (f"{len(bad)} of {want.numel()} elements differ, first at flat index {j}: "
                f"{got.reshape(-1)[j].item()} != {want.reshape(-1)[j].item()}")
    if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
        return "equal values, other bytes (a zero's sign)"
    return None


def parse_dtype(name):
    return None if name is None else ALL_DTYPES[name]


# -- the process ------------------------------------------------------------------------------
def main() -> None:
    import struct

    import rdmaflow
    from rdmaflow.transfer import DynamicReceiver, DynamicSender, StaticReceiver, StaticSender
    from rdmaflow.transfer import dynamic as dyn
    from rdmaflow.transfer.bounded import BoundedReceiver, BoundedSender

    dev = rdmaflow.Device(f"{os.environ.get('RDMAFLOW_TEST_HOST', '127.0.0.1')}:0",
                          busy_poll=os.environ.get("RDMAFLOW_TEST_BUSY_POLL") == "1")
    arena = dev.create_arena(int(os.environ.get("RDMAFLOW_TEST_ARENA", str(64 << 20))))
    receivers: dict = {}
    senders: dict = {}
    keep: list = []  # regions that must stay registered
    out = sys.stdout

    def reply(**kw) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def receive(cmd) -> dict:
        """Receives n transfers and checks each; the answer carries how many matched. With
        ``names`` (several receivers) it takes one transfer from each of them in turn, n rounds:
        round i's transfer from the j-th is tensor i * len(names) + j of the sequence."""
        rs = [receivers[x] for x in cmd.get("names", [cmd.get("name")])]
        n, seed, start = cmd["n"], cmd.get("seed", 0), cmd.get("start", 0)
        timeout = cmd.get("timeout", DEFAULT_TIMEOUT)
        sleep = cmd.get("sleep", 0.0)
        crash_after = cmd.get("crash_after")
        dtypes = cmd.get("dtypes")
        state = {"received": 0, "verified": 0, "first_mismatch": None, "wait_s": None}
        for round_ in range(start, start + n):
            for j, r in enumerate(rs):
                i = round_ * len(rs) + j
                static = isinstance(r, StaticReceiver)
                if crash_after is not None and state["received"] == crash_after:
                    os._exit(17)
                if cmd.get("sleep_before"):
                    time.sleep(cmd["sleep_before"])  # a late READ: the sender must still hold the data
                t0 = time.monotonic()
                try:
                    t = r.recv(timeout=timeout)
                except Exception as e:
                    state["wait_s"] = time.monotonic() - t0
                    state["devices"] = sorted(state.get("devices", ()))
                    e.state = state  # the answer says how many arrived before the error
                    raise
                state["received"] += 1
                state.setdefault("devices", set()).add(t.device.type)
                if sleep:
                    time.sleep(sleep)  # a slow consumer: the sender must not overwrite t meanwhile
                want = expected("static" if static and not cmd.get("plan") else "dynamic", seed, i,
                                getattr(r, "shape", None), getattr(r, "dtype", None), dtypes, cmd.get("plan"))
                bad = mismatch(t.cpu(), want)
                if bad is None and static and cmd.get("check_slot", True):
                    where = dev.gpu_arena() if t.is_cuda else arena
                    bad = None if t.numel() == 0 or where.contains(t) else "the tensor is not in the arena"
                if bad is None:
                    state["verified"] += 1
                elif state["first_mismatch"] is None:
                    state["first_mismatch"] = {"i": i, "what": bad}
                del t
        for r in rs:
            if isinstance(r, StaticReceiver) and cmd.get("release", True):
                r.release()
        state["devices"] = sorted(state.get("devices", ()))
        # A dynamic receiver that took CUDA tensors from a sender on this host mapped its GPU arena.
        state["gpu_mapped"] = any(getattr(r, "_sender_gpu_map", None) is not None for r in rs)
        return state

    def send(cmd) -> dict:
        s = senders[cmd["name"]]
        n, seed, start = cmd["n"], cmd.get("seed", 0), cmd.get("start", 0)
        timeout = cmd.get("timeout", DEFAULT_TIMEOUT)
        in_arena = cmd.get("in_arena", False)
        crash_after = cmd.get("crash_after")
        dtypes = cmd.get("dtypes")
        static = isinstance(s, StaticSender)
        sent = 0
        for i in range(start, start + n):
            if cmd.get("sleep_before"):
                time.sleep(cmd["sleep_before"])  # the receiver waits with nothing to receive meanwhile
            x = expected("static" if static and not cmd.get("plan") else "dynamic", seed, i, getattr(s, "shape", None),
                         getattr(s, "dtype", None), dtypes, cmd.get("plan"))
            on = cmd.get("on", "cpu")
            if in_arena:
                y = dev.empty(tuple(x.shape), x.dtype, device=on)
                y.copy_(x)
                x = y
            elif on != "cpu":
                x = x.to(on)
            try:
                f = s.send(x, timeout=timeout)
            except Exception as e:
                e.state = {"sent": sent}
                raise
            sent += 1
            if cmd.get("wait_sent"):
                f.result(timeout)  # it has left this process (over tcp: it is in the receiver's socket)
            if crash_after is not None and sent == crash_after:
                if cmd.get("crash_wait", True):
                    f.result(timeout)  # the record / tensor and its flag have landed
                    if not static:
                        s.wait_consumed(timeout=timeout)  # the receiver READ the data
                os._exit(17)  # with crash_wait False: while the transfer may still be on its way
            del x
        if cmd.get("wait_consumed", True):
            s.wait_consumed(timeout=timeout)
        return {"sent": sent, "seq": s.seq}

    def race(cmd) -> dict:
        """n rounds of: send tensor i (int64, filled with i + 1) on sender ``out``, then receive
        on receiver ``in`` and check that it holds i + 1 in every element. Buffers are arena
        tensors refilled as soon as their previous send completed, so each side runs as fast
        as its credits allow."""
        s, r = senders[cmd["out"]], receivers[cmd["in"]]
        timeout = cmd.get("timeout", DEFAULT_TIMEOUT)
        release = r if cmd.get("release") else None  # each send hands the last tensor received back
        bufs = [dev.empty(s.shape, torch.int64) for _ in range(2)]
        futs: list = [None] * 2
        bad = None
        for i in range(cmd["n"]):
            j = i % 2
            if futs[j] is not None:
                futs[j].result(timeout)
            bufs[j].fill_(i + 1)
            futs[j] = s.send(bufs[j], timeout=timeout, release=release)
            t = r.recv(timeout=timeout)
            lo, hi = int(t.min()), int(t.max())
            if bad is None and not lo == hi == i + 1:
                bad = {"i": i, "min": lo, "max": hi}
        r.release()
        s.wait_consumed(timeout=timeout)
        return {"rounds": cmd["n"], "direct": s._direct is not None, "first_mismatch": bad,
                "counts": dev.transfer_counts()}

    def pong(cmd) -> dict:
        """n rounds of: receive on ``in`` (int64, i + 1 in every element, checked), then answer
        on ``out`` with a tensor of -(i + 1) whose send hands the received slot back."""
        s, r = senders[cmd["out"]], receivers[cmd["in"]]
        timeout = cmd.get("timeout", DEFAULT_TIMEOUT)
        buf = dev.empty(s.shape, torch.int64)
        bad = None
        for i in range(cmd["n"]):
            t = r.recv(timeout=timeout)
            lo, hi = int(t.min()), int(t.max())
            if bad is None and not lo == hi == i + 1:
                bad = {"i": i, "min": lo, "max": hi}
            buf.fill_(-(i + 1))
            s.send(buf, timeout=timeout, release=r).result(timeout)
        return {"rounds": cmd["n"], "first_mismatch": bad, "counts": dev.transfer_counts()}

    def forge(cmd) -> dict:
        """Writes a metadata record (valid, then altered by ``set``) + its flag, as a sender would."""
        s = senders.get(cmd["name"])
        if s is None:
            s = DynamicSender(dev, cmd["remote"], cmd["name"], timeout=cmd.get("timeout", DEFAULT_TIMEOUT))
            senders[cmd["name"]] = s
        src = dev.empty((3, 4), torch.float32)
        src.copy_(torch.arange(12, dtype=torch.float32).view(3, 4))
        keep.append(src)
        off = arena.offset_of(src)
        k = s.seq + 1
        slot = (k - 1) % s.depth
        f = {"seq": k, "code": dyn.dtype_code(torch.float32), "rank": 2, "dims": [3, 4], "nbytes": 48,
             "src_off": off, "src_region": arena.region.id}
        for key, v in cmd.get("set", {}).items():
            if key == "src_off" and v == "past_end":
                v = arena.nbytes + 256
            elif key == "src_off" and v == "straddle":
                v = arena.nbytes - 24  # starts inside, ends 24 bytes past the end
            elif key == "src_off" and v == "wrap":
                v = 2**64 - 16  # offset + nbytes wraps around 2**64
            elif key == "src_region" and v == "other":
                other = dev.alloc_region(4096)  # registered, published, but not the arena
                keep.append(other)
                v = other.id
            f[key] = v
        dims = list(f["dims"]) + [0] * (8 - len(f["dims"]))
        rec = struct.pack("<QII8qQQQ", f["seq"], f["code"], f["rank"], *dims[:8], f["nbytes"],
                          f["src_off"], f["src_region"])
        cell = torch.frombuffer(s._records, dtype=torch.uint8, count=len(rec), offset=slot * dyn.RECORD_BYTES)
        cell.copy_(torch.frombuffer(bytearray(rec), dtype=torch.uint8))
        s._post(k, slot, s._records.offset + slot * dyn.RECORD_BYTES, s.r_base + s.r_data + slot * s.r_stride,
                len(rec)).result(cmd.get("timeout", DEFAULT_TIMEOUT))
        s.seq = k
        return {"seq": k, "record": {k2: v for k2, v in f.items()}}

    reply(endpoint=dev.endpoint)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            timeout = cmd.get("timeout", DEFAULT_TIMEOUT)
            if op == "static_receiver":
                receivers[cmd["name"]] = StaticReceiver(
                    dev, cmd["name"], tuple(cmd["shape"]), ALL_DTYPES[cmd["dtype"]],
                    depth=cmd.get("depth", 1), timeout=timeout, cuda=cmd.get("cuda"))
                reply(ok=True)
            elif op == "dynamic_receiver":
                receivers[cmd["name"]] = DynamicReceiver(dev, cmd["name"], depth=cmd.get("depth", 1), timeout=timeout)
                reply(ok=True)
            elif op == "static_sender":
                shape = None if cmd.get("shape") is None else tuple(cmd["shape"])
                senders[cmd["name"]] = StaticSender(
                    dev, cmd["remote"], cmd["name"], shape=shape, dtype=parse_dtype(cmd.get("dtype")),
                    mode=cmd.get("mode", "auto"), timeout=timeout)
                reply(ok=True)
            elif op == "dynamic_sender":
                senders[cmd["name"]] = DynamicSender(dev, cmd["remote"], cmd["name"],
                                                     mode=cmd.get("mode", "auto"), timeout=timeout)
                reply(ok=True)
            elif op == "bounded_receiver":
                receivers[cmd["name"]] = BoundedReceiver(dev, cmd["name"], tuple(cmd["max_shape"]),
                                                         ALL_DTYPES[cmd["dtype"]], depth=cmd.get("depth", 1),
                                                         timeout=timeout)
                reply(ok=True)
            elif op == "bounded_sender":
                senders[cmd["name"]] = BoundedSender(dev, cmd["remote"], cmd["name"], tuple(cmd["max_shape"]),
                                                     ALL_DTYPES[cmd["dtype"]], mode=cmd.get("mode", "auto"),
                                                     timeout=timeout)
                reply(ok=True)
            elif op == "recv":
                reply(ok=True, **receive(cmd))
            elif op == "send":
                reply(ok=True, **send(cmd))
            elif op == "race":
                reply(ok=True, **race(cmd))
            elif op == "pong":
                reply(ok=True, **pong(cmd))
            elif op == "forge":
                reply(ok=True, **forge(cmd))
            elif op == "close":  # a sender or receiver, mid-stream
                (senders.get(cmd["name"]) or receivers[cmd["name"]]).close()
                reply(ok=True)
            elif op == "wait_consumed":
                s = senders[cmd["name"]]
                try:
                    s.wait_consumed(cmd.get("k"), timeout=timeout)
                except Exception as e:
                    e.state = {"consumed": s.consumed(), "receiver_closed": s.receiver_closed}
                    raise
                reply(ok=True, consumed=s.consumed(), receiver_closed=s.receiver_closed)
            elif op == "publish_raw":
                dev.publish(cmd["name"], bytes.fromhex(cmd["hex"]))
                reply(ok=True)
            elif op == "arena":
                reply(ok=True, used=arena.used, largest_free=arena.largest_free, nbytes=arena.nbytes,
                      num_allocations=arena.num_allocations, num_free_blocks=arena.num_free_blocks)
            elif op == "exit":
                reply(ok=True)
                break
            elif op == "crash":
                os._exit(17)
            else:
                reply(ok=False, error_type="KeyError", error=f"unknown op {op}")
        except Exception as e:  # noqa: BLE001 - reported to the test
            extra = {}
            if isinstance(getattr(e, "state", None), dict):
                extra = e.state
            reply(ok=False, error_type=type(e).__name__, error=str(e), tb=traceback.format_exc(), **extra)
    for x in list(senders.values()) + list(receivers.values()):
        x.close()
    dev.close()


if __name__ == "__main__":
    # Die with the test process: a broken pipe on stdin ends the loop.
    threading.excepthook = lambda args: os._exit(3)
    main()
