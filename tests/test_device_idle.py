"""Idle devices sleep on UCX's wakeup fd: four of them on a 2-core machine burn almost no CPU."""
from __future__ import annotations

import os
import time

from conftest import local_device

import rdmaflow

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime, all threads


def test_four_idle_devices_do_not_burn_cpu(spawn_peer):
    peers = [spawn_peer(RDMAFLOW_TEST_CQS=2) for _ in range(4)]
    for p in peers:
        p.call("alloc", name="r", nbytes=1 << 20)
    with local_device(num_cqs=2) as dev:
        local = dev.alloc_region(1 << 20)
        # Connected and used once, so that every progress thread has endpoints to watch.
        for p in peers:
            ch = dev.channel(p.endpoint)
            ch.memcpy(local, 0, dev.lookup_region(p.endpoint, "r"), 0, 1 << 20, rdmaflow.WRITE).result(30)
        time.sleep(0.5)
        before = [cpu_seconds(p.proc.pid) for p in peers] + [cpu_seconds(os.getpid())]
        window = 3.0
        time.sleep(window)
        after = [cpu_seconds(p.proc.pid) for p in peers] + [cpu_seconds(os.getpid())]
    used = [a - b for a, b in zip(after, before)]
    # A busy-polling process would use ~window seconds per progress thread.
    assert all(u < 0.1 * window for u in used), f"CPU seconds used while idle: {used}"


def test_busy_poll_is_opt_in(spawn_peer):
    quiet = spawn_peer()
    busy = spawn_peer(RDMAFLOW_TEST_BUSY_POLL=1)
    time.sleep(0.5)
    b0, q0 = cpu_seconds(busy.proc.pid), cpu_seconds(quiet.proc.pid)
    time.sleep(2.0)
    b1, q1 = cpu_seconds(busy.proc.pid), cpu_seconds(quiet.proc.pid)
    assert b1 - b0 > 0.5, "busy_poll=True did not poll"
    assert q1 - q0 < 0.2
