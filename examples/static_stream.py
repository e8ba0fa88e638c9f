"""Two processes stream a static tensor one way through the public API; the receiver prints the
distribution of the time between arrivals, and how much of the run went to stalls, then where
each side's time went: the receiver's wait in `recv()` and its reduce, the sender's `send()`
(p10, p50, p90 in us, the first tenth of the transfers left out).

    python examples/static_stream.py [SIZE_BYTES] [TRANSFERS] [DEPTH]
    UCX_TLS=tcp UCX_NET_DEVICES=lo python examples/static_stream.py 1048576 2000 2

The sender sends as fast as its credits allow (the receiver's DEPTH slots); the receiver reduces
each tensor (max) as `rdmaflow bench transfer` does, then takes the next. The first process
starts the second; they find each other through a temporary directory.
"""
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import rdmaflow
from rdmaflow.transfer import StaticReceiver, StaticSender

STALL_S = 2e-3  # an arrival gap this long is a stall: several times a transfer's time here


def percentiles(name: str, seconds: list[float]) -> str:
    """p10, p50 and p90 of ``seconds`` in us, the first tenth (the start) left out."""
    v = sorted(seconds[len(seconds) // 10:])
    return f"{name} " + ", ".join(f"p{int(100 * q)} {1e6 * v[int(q * (len(v) - 1))]:.1f}" for q in (0.1, 0.5, 0.9))


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    role = sys.argv[4] if len(sys.argv) > 4 else "send"
    torch.set_num_threads(1)
    os.environ.setdefault("RDMAFLOW_JOB_SECRET", os.urandom(16).hex())
    if role == "send":
        rendezvous = tempfile.mkdtemp(prefix="rdmaflow-stream-")
        child = subprocess.Popen([sys.executable, __file__, str(size), str(count), str(depth), "recv", rendezvous])
    else:
        rendezvous = sys.argv[5]
    where = os.path.join(rendezvous, "receiver")
    dev = rdmaflow.Device("127.0.0.1:0")
    dev.create_arena(max(64 << 20, 4 * depth * size))
    numel = size // 4
    if role == "recv":
        receiver = StaticReceiver(dev, "stream", (numel,), torch.float32, depth=depth)
        with open(where + ".tmp", "w") as f:
            f.write(dev.endpoint)
        os.rename(where + ".tmp", where)
        arrivals, waits, reduces = [], [], []
        for _ in range(count):
            t0 = time.perf_counter()
            t = receiver.recv()
            t1 = time.perf_counter()
            float(t.max())
            arrivals.append(time.perf_counter())
            waits.append(t1 - t0)
            reduces.append(arrivals[-1] - t1)
        receiver.release()
        gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
        n, span = len(gaps), arrivals[-1] - arrivals[0]
        stalls = [g for g in gaps if g > STALL_S]
        us = [1e6 * gaps[int(q * (n - 1))] for q in (0.5, 0.9, 0.99, 1.0)]
        slow = [g for g in gaps if g > 4 * gaps[n // 2]]  # the tail that separates mean from median
        print(f"{size} B, depth {depth}: {size * n / span / 1e9:.4g} GB/s; between arrivals mean "
              f"{1e6 * span / n:.1f} us, median {us[0]:.1f}, p90 {us[1]:.0f}, p99 {us[2]:.0f}, max {us[3]:.0f}; "
              f"{len(slow)} over 4x the median ({sum(slow) / span:.0%} of the run); {len(stalls)} over "
              f"{STALL_S * 1e3:.0f} ms ({sum(stalls) / span:.0%})")
        print(f"receiver: {percentiles('in recv()', waits)}; {percentiles('reduce', reduces)} us")
        time.sleep(0.3)  # the sender's last wait for credits ends before this process goes
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(where):
            if time.monotonic() > deadline:
                raise SystemExit("the receiver did not start within 60 s")
            time.sleep(0.01)
        with open(where) as f:
            sender = StaticSender(dev, f.read(), "stream", mode="zerocopy")
        x = dev.empty((numel,), torch.float32)
        x.fill_(1)
        sends = []
        for _ in range(count):
            t0 = time.perf_counter()
            sender.send(x)
            sends.append(time.perf_counter() - t0)
        sender.wait_consumed(timeout=60)
        print(f"sender: {percentiles('in send()', sends)} us")
        child.wait(60)
        shutil.rmtree(rendezvous, ignore_errors=True)  # the receiver's endpoint file
    dev.close()


if __name__ == "__main__":
    main()
