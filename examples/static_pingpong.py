"""Two processes ping-pong a static tensor through the public API and print the one-way time.

    python examples/static_pingpong.py [SIZE_BYTES] [ROUND_TRIPS]
    UCX_TLS=tcp python examples/static_pingpong.py 1024 2000     # over UCX tcp (loopback)

    PINGPONG_RELEASE=1 UCX_TLS=tcp python examples/static_pingpong.py 1024 2000
                                        # each send hands the slot it answers back (release=)

The first process starts the second; they find each other through a temporary directory.
Uses only names every rdmaflow version since the first transfer layer has (Device,
StaticSender, StaticReceiver, Device.empty), so the same script times older checkouts too;
PINGPONG_RELEASE=1 needs ``send(..., release=)`` (2026-11-25).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import rdmaflow
from rdmaflow.transfer import StaticReceiver, StaticSender


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    role = sys.argv[3] if len(sys.argv) > 3 else "ping"
    os.environ.setdefault("RDMAFLOW_JOB_SECRET", os.urandom(16).hex())
    if role == "ping":
        rendezvous = tempfile.mkdtemp(prefix="rdmaflow-pingpong-")
        child = subprocess.Popen([sys.executable, __file__, str(size), str(iters), "pong", rendezvous])
    else:
        rendezvous = sys.argv[4]
    dev = rdmaflow.Device("127.0.0.1:0")
    me, other = role, ("pong" if role == "ping" else "ping")
    receiver = StaticReceiver(dev, "to_" + me, (size,), torch.uint8)
    with open(os.path.join(rendezvous, me + ".tmp"), "w") as f:
        f.write(dev.endpoint)
    os.rename(os.path.join(rendezvous, me + ".tmp"), os.path.join(rendezvous, me))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(rendezvous, other)):
        if time.monotonic() > deadline:
            raise SystemExit("the other process did not start within 60 s")
        time.sleep(0.01)
    with open(os.path.join(rendezvous, other)) as f:
        sender = StaticSender(dev, f.read(), "to_" + other, mode="zerocopy")
    x = dev.empty((size,), torch.uint8)
    x.fill_(1)
    kw = {"release": receiver} if os.environ.get("PINGPONG_RELEASE") == "1" else {}
    times = []
    for _ in range(iters + iters // 10):  # the first tenth warms up
        t0 = time.perf_counter()
        if role == "ping":
            sender.send(x, **kw)
            receiver.recv()
        else:
            receiver.recv()
            sender.send(x, **kw)
        times.append(time.perf_counter() - t0)
    if role == "ping":
        t = sorted(times[iters // 10:])
        half = [1e6 * v / 2 for v in (t[len(t) // 2], t[len(t) // 10], t[9 * len(t) // 10])]
        print(f"{size} B one way: median {half[0]:.1f} us (p10 {half[1]:.1f}, p90 {half[2]:.1f})")
        child.wait(60)
        shutil.rmtree(rendezvous, ignore_errors=True)  # the two endpoint files
    time.sleep(0.3)  # the peer's last recv() acks before this process goes
    dev.close()


if __name__ == "__main__":
    main()
