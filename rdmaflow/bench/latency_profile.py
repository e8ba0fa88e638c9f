"""``rdmaflow bench latency --profile``: where the one-way time of an rdmaflow static transfer
goes, seen from Python, without touching the C++ core.

The same ping-pong as ``bench latency`` (two processes, a ``StaticSender``/``StaticReceiver``
pair each way, zero copy, depth 1, each send handing back the slot of the transfer it answers
with ``release=``), with every step of a transfer timestamped on
CLOCK_MONOTONIC, which both processes share:

* sender: ``send()`` called; the credit granted (``_wait_credit`` returned); the post of
  payload, fence and flag begins and ends (``_post``: one command; on one host
  ``_send_direct``: credit, copy and flag store in one call into the core; over UCX into host
  slots ``_send_slot``: credit and post in one call into the core, so the credit is not
  stamped and that phase reads "not measured"); ``send()`` returned. The transfer's Python
  methods are wrapped on the instances; a step whose method no longer exists is reported as
  not measured.
* receiver: ``recv()`` called; its ack of the previous transfer (``_ack``, over UCX, where
  the send's ``release=`` did not carry it already and ``recv()`` did not post it in its wait's
  call); its wait for the flag begins and ends (``_await``, which on one host also stores the ack);
  ``recv()`` returned. In ``spin`` mode the receiver
  first spins on ``poll()`` (yielding the core between looks, for at most ``SPIN_S``), so a
  flag that lands meanwhile is seen at once, with no sleep and no wake-up.

Each process also samples, per thread, ``/proc/self/task/*/schedstat`` (CPU time, time
waiting for a core, time slices) and the context switches in ``status`` around the timed
round trips: the main (Python) thread against the progress thread and the other C++ threads.

Phases of one transfer (both directions pooled; ``flag seen`` minus ``send() returned`` is a
difference between the two processes' clocks, the same CLOCK_MONOTONIC):

  send: to credit        send() called -> credit granted (argument checks, ack word read)
  send: payload posted   credit -> _post called (the previous future of the slot)
  send: fence + flag     _post (payload, fence, flag: one command) or _send_direct (one host)
  send: return           the post returned -> send() returned
  in flight              send() returned -> the receiver's wait saw the flag: the progress
                         thread picks the posts up, UCX moves them, the peer's progress (tcp)
                         applies them, the receiver's thread wakes up
  recv: return           flag seen -> recv() returned
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rdmaflow.bench._latency_worker import RdmaflowWorker, clock, other, round_trips, wrong
from rdmaflow.bench.harness import format_size, percentile, text_table, write_json
from rdmaflow.bench.processes import BackgroundMeter, BenchError, format_background, new_secret

MODES = ("wait", "spin")
DEFAULT_SIZE = 1 << 10
SPIN_S = 200e-6  # spin mode: how long the receiver spins on poll() before it waits in recv()
JSON_NAME = "latency_profile.json"

#: (phase, (process of the start stamp, its name), (process of the end stamp, its name));
#: "tx" is the sending process of a transfer, "rx" the receiving one.
PHASES = (
    ("send: to credit", ("tx", "send_call"), ("tx", "credit")),
    ("send: payload posted", ("tx", "credit"), ("tx", "flag_post_start")),
    ("send: fence + flag posted", ("tx", "flag_post_start"), ("tx", "flag_post_end")),
    ("send: return", ("tx", "flag_post_end"), ("tx", "send_return")),
    ("in flight (progress, wire, wake-up)", ("tx", "send_return"), ("rx", "flag_seen")),
    ("recv: return", ("rx", "flag_seen"), ("rx", "recv_return")),
    ("one way: send() called -> recv() returned", ("tx", "send_call"), ("rx", "recv_return")),
)


# ------------------------------------------------------------------------------------------
# In the worker processes


class Stamps:
    """Named lists of CLOCK_MONOTONIC instants; ``wrap`` times a method of an object."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = defaultdict(list)

    def wrap(self, obj: Any, method: str, before: str | None, after: str | None) -> None:
        f = getattr(obj, method, None)
        if f is None:
            return  # the method is gone (the fast path): this step is reported as not measured
        t = self.t

        def timed(*args, **kwargs):
            if before:
                t[before].append(clock())
            try:
                return f(*args, **kwargs)
            finally:
                if after:
                    t[after].append(clock())

        setattr(obj, method, timed)

    def clear(self) -> None:
        self.t.clear()


#: syscall a sleeping thread is blocked in -> what it is: the device's progress thread sleeps in
#: poll() on UCX's wakeup fd, its copy helpers on a condition variable (futex), UCX's async
#: thread in epoll_wait.
BLOCKED_IN = {"7": "progress thread? (in poll)", "202": "helper (in futex)", "232": "UCX async (in epoll)",
              "281": "UCX async (in epoll)"}


def _native_name(tid: str, comm: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            nr = f.read().split()[0]
    except (OSError, IndexError):
        nr = ""
    return f"{comm}: " + BLOCKED_IN.get(nr, "native, running" if nr == "running" else f"native (syscall {nr})")


def thread_counters() -> dict[int, dict[str, Any]]:
    """Per thread of this process: CPU ns, ns waiting for a core, time slices, voluntary and
    involuntary context switches, and its name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, slices = (int(x) for x in f.read().split()[:3])
            with open(f"/proc/self/task/{tid}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        i = int(tid)
        name = names.get(i) or _native_name(tid, st.get("Name", "?").strip())
        out[i] = {"name": name, "cpu_ns": run, "wait_ns": wait, "slices": slices,
                  "voluntary": int(st["voluntary_ctxt_switches"]), "involuntary": int(st["nonvoluntary_ctxt_switches"])}
    return out


def counter_deltas(before: dict, after: dict, n: int) -> list[dict[str, Any]]:
    """Each thread's counters over the timed part, per round trip, busiest first."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid, {k: 0 for k in a})
        # A native thread's name says where it was blocked: whichever look caught it blocked.
        name = a["name"] if "running" in b.get("name", "running") else b["name"]
        rows.append({"tid": tid, "name": name, **{k: (a[k] - b[k]) / max(1, n) for k in a if k != "name"}})
    return sorted(rows, key=lambda r: -r["cpu_ns"])


class ProfileWorker(RdmaflowWorker):
    """:class:`RdmaflowWorker` with its pairs' steps timestamped."""

    def __init__(self, role: str, arena_bytes: int, busy_poll: bool) -> None:
        super().__init__(role, arena_bytes, busy_poll)
        self.stamps = Stamps()
        self.wrapped: set[int] = set()

    def _pair(self, cmd: dict):
        s, r, src = super()._pair(cmd)
        if cmd["size"] not in self.wrapped:
            self.wrapped.add(cmd["size"])
            w = self.stamps.wrap
            w(s, "send", "send_call", "send_return")
            w(s, "_wait_credit", None, "credit")
            w(s, "_post", "flag_post_start", "flag_post_end")  # over UCX: payload, fence, flag: one command
            w(s, "_send_direct", "flag_post_start", "flag_post_end")  # same host: credit, copy, flag: one call
            w(s, "_send_slot", "flag_post_start", "flag_post_end")  # UCX, host slots: credit and post: one call
            w(r, "recv", "recv_call", "recv_return")
            w(r, "_ack", "ack_start", "ack_end")
            w(r, "_wait_flag", "wait_start", "flag_seen")  # the first transfer: its sender introduces itself
            w(r, "_await", "wait_start", "flag_seen")  # every later one, with its ack on the same-host path
        return s, r, src

    def _receive(self, r, spin: bool):
        if spin:
            # Bounded, yielding the core between looks: on 2 cores the progress threads that
            # move the data need it.
            end = clock() + SPIN_S
            while not r.poll():
                if clock() > end:
                    self.stamps.t["landed"].append(math.nan)  # not seen while spinning
                    return r.recv()
                os.sched_yield()
            self.stamps.t["landed"].append(clock())
        return r.recv()

    def _profiled(self, cmd: dict, loop) -> dict:
        self.stamps.clear()
        before = thread_counters()
        out = loop()
        threads = counter_deltas(before, thread_counters(), cmd["count"])
        return {**out, "stamps": {k: list(v) for k, v in self.stamps.t.items()}, "threads": threads}

    def pong(self, cmd: dict, ready) -> dict:
        self._receiver(cmd)
        ready()
        s, r, src = self._pair(cmd)
        spin = cmd.get("mode") == "spin"
        bad = []

        def loop() -> dict:
            count = cmd["count"]
            for i in range(count):
                t = self._receive(r, spin)
                if i == count - 1:  # checked before the pong hands its slot back
                    bad.append(wrong(t, cmd["tag"], other(self.role)))
                s.send(src, release=r)  # as bench latency: the ping's slot goes back with the pong
            return {}

        out = self._profiled(cmd, loop)
        return {**out, "bad": bad[0] if bad else 0}

    def ping(self, cmd: dict) -> dict:
        s, r, src = self._pair(cmd)
        spin = cmd.get("mode") == "spin"
        last = []

        def one() -> None:
            s.send(src, release=r)  # the previous pong's slot goes back with this ping
            last[:] = [self._receive(r, spin)]

        out = self._profiled(cmd, lambda: {"one_way_us": round_trips(cmd["count"], one)})
        bad = wrong(last[0], cmd["tag"], other(self.role)) if last else 0
        r.release()
        return {**out, "bad": bad}


# ------------------------------------------------------------------------------------------
# In the driver


def phase_samples(ping: dict, pong: dict, warmup: int) -> dict[str, list[float]]:
    """Each phase's durations (us) over the timed transfers of both directions."""
    out: dict[str, list[float]] = {}
    directions = ((ping["stamps"], pong["stamps"]), (pong["stamps"], ping["stamps"]))
    for name, (p0, k0), (p1, k1) in PHASES:
        vals: list[float] = []
        for tx, rx in directions:
            a, b = (tx if p0 == "tx" else rx).get(k0), (tx if p1 == "tx" else rx).get(k1)
            if a and b:
                vals += [(y - x) * 1e6 for x, y in zip(a[warmup:], b[warmup:])]
        out[name] = vals
    for name, (start, end) in (("off the path: ack of the previous transfer (in recv())", ("ack_start", "ack_end")),
                               ("spin mode: flag landed -> spin saw it, recv() returned", ("landed", "recv_return"))):
        vals = []
        for st in (ping["stamps"], pong["stamps"]):
            a, b = st.get(start), st.get(end)
            if a and b:
                vals += [(y - x) * 1e6 for x, y in zip(a[-len(b):][warmup:], b[warmup:]) if not math.isnan(x)]
        out[name] = vals
    return out


def _dist(vals: Sequence[float]) -> list[str]:
    if not vals:
        return ["not measured", "", ""]
    v = sorted(vals)
    return [f"{statistics.median(v):.1f}", f"{percentile(v, 0.1):.1f}", f"{percentile(v, 0.9):.1f}"]


OVERLAP_NOTE = ("(phases overlap where a step ran before the previous one finished, e.g. the progress thread "
                "delivered the flag before send() returned: then 'in flight' is negative)")


def format_profile(transport: str, size: int, mode: str, ping: dict, pong: dict, warmup: int) -> str:
    samples = phase_samples(ping, pong, warmup)
    rt = ping["one_way_us"][warmup:]
    rows = [[name, *_dist(vals)] for name, vals in samples.items()]
    rows.append(["ping-pong: round trip / 2 (uninstrumented steps included)", *_dist(rt)])
    waits = "spins on poll()" if mode == "spin" else "waits in recv()"
    title = (f"## {transport}, {format_size(size)}, receiver {waits}: one transfer's phases, us (median, p10, p90 "
             f"over {len(rt)} round trips, both directions)")
    lines = [title, *text_table(["phase", "median", "p10", "p90"], rows)]
    landed = [x for reply in (ping, pong) for x in reply["stamps"].get("landed", [])[warmup:]]
    if landed:
        seen = sum(not math.isnan(x) for x in landed)
        lines.append(f"spin mode: {seen} of {len(landed)} transfers landed while their receiver spun "
                     f"({SPIN_S * 1e6:.0f} us at most, yielding between looks)")
    lines += [OVERLAP_NOTE, "",
             "threads, per round trip (us of CPU, us waiting for a core, context switches voluntary/involuntary):"]
    for who, reply in (("sender", ping), ("receiver", pong)):
        for t in reply["threads"][:4]:
            lines.append(f"  {who:>8} {t['name'][:36]:<36} cpu {t['cpu_ns'] / 1e3:7.1f}  waiting {t['wait_ns'] / 1e3:7.1f}"
                         f"  switches {t['voluntary']:5.2f}/{t['involuntary']:5.2f}")
    return "\n".join(lines)


def run(args, transports: Sequence[str], sizes: Sequence[int]) -> int:
    from rdmaflow.bench.latency import DEFAULT_SIZES, make_system

    sizes = [DEFAULT_SIZE] if args.sizes == DEFAULT_SIZES else list(sizes)
    iters, warmup = args.iters, max(10, args.iters // 10)
    print(f"rdmaflow bench latency --profile: {', '.join(format_size(s) for s in sizes)}, {iters} round trips "
          f"after {warmup} warm-up ones; timestamps from Python (each adds well under a microsecond)", flush=True)
    doc: dict[str, Any] = {}
    status = 0
    for t in transports:
        meter = BackgroundMeter()
        pair = make_system("rdmaflow-profile", t, secret=new_secret(), sizes=sizes, busy_poll=args.busy_poll,
                           timeout=args.timeout)
        try:
            for size in sizes:
                for tag, mode in enumerate(MODES, 1):
                    try:
                        ping, pong = pair.exchange(size, warmup + iters, tag, args.timeout, mode=mode)
                    except (BenchError, OSError, RuntimeError) as e:
                        print(f"{t} {format_size(size)} {mode}: failed: {e}", flush=True)
                        status = 1
                        pair.close()
                        continue
                    print()
                    print(format_profile(t, size, mode, ping, pong, warmup), flush=True)
                    doc[f"{t}/{size}/{mode}"] = {"ping": ping, "pong": pong, "warmup": warmup}
        finally:
            pair.close()
        print(format_background(meter.report()), flush=True)
    path = os.path.join(args.out, JSON_NAME)
    write_json(path, doc)
    print(f"\nraw timestamps and thread counters: {path}")
    return status


if __name__ == "__main__":  # pragma: no cover - for reading a saved profile again
    with open(sys.argv[1]) as f:
        saved = json.load(f)
    for key, v in saved.items():
        t, size, mode = key.split("/")
        print(format_profile(t, int(size), mode, v["ping"], v["pong"], v["warmup"]))
