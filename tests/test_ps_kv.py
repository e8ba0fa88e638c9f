"""The parameter server's key-value API (rdmaflow.ps.KVStore), in real jobs.

Each job is a set of processes started here with the variables a launcher sets (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RDMAFLOW_JOB_SECRET,
RDMAFLOW_SHARDS_PER_NODE); ranks below the shard count are shards. The c10d store is served by
this process (as torchrun's agent does under ``rdmaflow launch``), except in one job where rank 0
serves it. All jobs of this file start together (they spend most of their time importing torch)
and every test waits for its own.
Workers print one ``RESULT {json}`` line; every wait is bounded and every process group is
killed at the end.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import stop_process

from rdmaflow.bench.perftest import ucx_env
from rdmaflow.bench.processes import free_port
from rdmaflow.testing.stacks import stacks_of

JOB_DEADLINE = 150.0  # seconds from the start of the jobs until every process must have exited

COMMON = """
import json, os, pathlib, sys, time, torch
import rdmaflow.ps as ps
from rdmaflow import _core

def ready():  # says READY once the test said go (Job.go): a job's window after it is the test's
    go, t0 = pathlib.Path(__file__).with_suffix(".go"), time.monotonic()
    while not go.exists():
        assert time.monotonic() - t0 < 150, "the test never said go"
        time.sleep(0.02)
    print("READY", flush=True)

def report(**res):
    print("RESULT " + json.dumps(res), flush=True)

def report_error(body):  # runs body(); reports error=None, or the library error it raised (exit 3)
    try:
        body()
        report(error=None)
    except _core.RdmaflowError as e:
        report(error=f"{type(e).__name__}: {e}")
        sys.exit(3)
"""

# 3 workers x 2 shards: overlapping pushes, read-your-writes, bad input, zero copy, init values.
SUMS = COMMON + """
ctx = ps.init()
w, nw = ctx.role.index, ctx.role.num_workers
KEYS = [0, 1, 2, 3, 5, 8, 13, 21]                  # shared by every worker, on both shards
SHAPES = [(4,), (2, 3), (), (7,), (1,), (3, 3), (16,), (1000,)]
PRIVATE = [100 + v for v in range(nw)]             # key 100 + v: pushed by worker v only
keys, shapes = KEYS + PRIVATE, SHAPES + [(5,)] * nw
init = [torch.full(s, float(k)) for k, s in zip(keys, shapes)]   # stored values start at the key
# The declaration's order does not matter; only worker 0's init is used.
kv = ps.KVStore(keys[::-1], shapes[::-1], torch.float32, init=init[::-1] if w == 0 else None)

bad = {
    "unknown_key": lambda: kv.push([999], [torch.zeros(4)]),
    "wrong_shape": lambda: kv.push([0], [torch.zeros(5)]),
    "wrong_dtype": lambda: kv.push([0], [torch.zeros(4, dtype=torch.float64)]),
    "pull_unknown_key": lambda: kv.pull([999]),
    "pull_wrong_out": lambda: kv.pull([1], [torch.zeros(3, 2)]),
    "pull_wrong_out_dtype": lambda: kv.pull([1], [torch.zeros(2, 3, dtype=torch.int32)]),
    "count_mismatch": lambda: kv.push([0, 1], [torch.zeros(4)]),
    "duplicate_key": lambda: kv.push([0, 0], [torch.zeros(4), torch.zeros(4)]),
    "not_a_tensor": lambda: kv.push([0], [[1.0, 2.0, 3.0, 4.0]]),
    "key_not_int": lambda: kv.pull(["a"]),
    "negative_key": lambda: kv.pull([-1]),
    "bad_handle": lambda: kv.wait("nope"),
    "push_without_values": lambda: kv.push([0, 1], None),
    "batched_push_without_values": lambda: kv.push(torch.tensor([0]), None),
    "push_a_number": lambda: kv.push([0, 1], 5),
    "nan_timeout": lambda: kv.barrier(timeout=float("nan")),
    "string_timeout": lambda: kv.barrier(timeout="3"),
}
errors = {}
for name, fn in bad.items():
    try:
        fn()
        errors[name] = "no error"
    except _core.InvalidArgumentError:
        errors[name] = "ok"
    except Exception as e:  # noqa: BLE001
        errors[name] = f"{type(e).__name__}: {e}"

# Requests of no keys, cut over both shards: nothing to move.
empty = [kv.wait(kv.push([], [])), kv.wait(kv.pull([])), kv.wait(kv.pull(torch.tensor([], dtype=torch.int64))).tolist()]

# Read-your-writes: a pull right after a push (no wait in between) sees it. Every third push is
# of a tensor that requires grad, and pulls go into such tensors too (a model's parameters).
mine, acc, ryw = 100 + w, float(100 + w), []
for i in range(15):
    kv.push(mine, torch.full((5,), float(i + 1), requires_grad=i % 3 == 0))
    acc += i + 1
    if i % 3 == 1:
        got = kv.wait(kv.pull(mine, torch.zeros(5, requires_grad=True)))
    elif i % 3 == 2:
        got = kv.wait(kv.pull(torch.tensor([mine]), torch.zeros(5, requires_grad=True)))
    else:
        got = kv.wait(kv.pull(mine))
    ryw.append([acc, got.tolist()])

# Concurrent pushes to overlapping keys; meanwhile pulls must never see a half-applied value.
R = 40
handles, torn, last = [], [], {}
for it in range(R):
    v = float((w + 1) * (it % 4 + 1))
    if it % 2:   # tensors born in the arena go without a copy
        vals = [ctx.device.empty(s, torch.float32).fill_(v) for s in SHAPES]
    else:
        vals = [torch.full(s, v) for s in SHAPES]
    handles.append(kv.push(KEYS, vals))
    if it % 5 == 4:
        for k, t in zip(KEYS, kv.wait(kv.pull(KEYS))):
            flat = t.flatten()
            if not bool((flat == flat[0]).all()) or flat[0].item() < last.get(k, 0.0):
                torn.append([k, flat.tolist()[:8]])
            last[k] = flat[0].item()
for h in handles:
    kv.wait(h)
kv.barrier()
outs = [torch.empty(s) for s in SHAPES]
got = kv.wait(kv.pull(KEYS, outs))
same = all(g is o for g, o in zip(got, outs))
per_worker = sum(it % 4 + 1 for it in range(R))
expect = {k: k + per_worker * sum(v + 1 for v in range(nw)) for k in KEYS}
sums = {k: sorted(set(t.flatten().tolist())) for k, t in zip(KEYS, got)}
private = {k: sorted(set(kv.wait(kv.pull(k)).tolist())) for k in PRIVATE}
kv.barrier()
kv.close()
try:
    ps.KVStore(keys, shapes, torch.float32)
    errors["kvstore_after_close"] = "no error"
except _core.InvalidArgumentError:
    errors["kvstore_after_close"] = "ok"
report(worker=w, errors=errors, ryw=ryw, torn=torn, sums=sums, expect=expect, private=private,
       outs_returned=same, zero_copy=kv.stats["zero_copy"], empty=empty)
"""

# 2 workers x 1 shard with a user-defined handler.
HANDLER = COMMON + """
def handler(key, stored, pushed):
    if key == 0:
        torch.maximum(stored, pushed, out=stored)
    elif key == 1:
        stored.mul_(0.5).add_(pushed)
    elif key == 2:
        return stored + 2 * pushed          # returning the new value works too
    else:
        stored.add_(pushed)

ctx = ps.init(kv_handler=handler)
w = ctx.role.index
kv = ps.KVStore([0, 1, 2], [(3,), (3,), (2, 2)], torch.float32)
for it in range(10):
    a = [float(it), 100.0 - it, 5.0] if w == 0 else [50.0 - it, 2.0 * it, 7.0]
    kv.push(0, torch.tensor(a))
    kv.push(2, torch.ones(2, 2))
    if w == 0 and it < 5:
        kv.push(1, torch.full((3,), 8.0))   # one pusher: 8, 12, 14, 15, 15.5
kv.barrier()
k0, k1, k2 = kv.wait(kv.pull([0, 1, 2]))
kv.close()
report(worker=w, k0=k0.tolist(), k1=k1.tolist(), k2=k2.flatten().tolist())
"""

# 1 worker x 1 shard whose handler raises: the worker gets an error naming it.
FAILING = COMMON + """
def handler(key, stored, pushed):
    if key == 7:
        raise ValueError("seven is not welcome")
    stored.add_(pushed)

ctx = ps.init(kv_handler=handler)
kv = ps.KVStore([6, 7], [(2,), (2,)])
kv.wait(kv.push(6, torch.ones(2)))
t0 = time.monotonic()
try:
    kv.push(7, torch.ones(2))
    kv.wait(kv.pull(7))
    report(error=None)
except _core.RdmaflowError as e:
    report(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    sys.exit(3)
"""

# 2 workers x 1 shard; worker 1 declares key 1 with another shape.
MISMATCH = COMMON + """
ctx = ps.init()
w = ctx.role.index
shape = (3,) if w == 0 else (4,)
try:
    kv = ps.KVStore([0, 1], [(2,), shape], torch.float32)
    kv.close()
    report(error=None)
except _core.RdmaflowError as e:
    report(error=f"{type(e).__name__}: {e}", at=time.time())
    sys.exit(3)
"""

# 1 worker x 2 shards; the test kills shard 1 while the worker pushes and pulls its key.
SHARD_DIES = COMMON + """
ctx = ps.init()
kv = ps.KVStore([0, 1], [(2,), (2,)])
kv.wait(kv.push([0, 1], [torch.ones(2), torch.ones(2)]))
ready()

def body():
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        kv.push(1, torch.ones(2))
        kv.wait(kv.pull(1))
        time.sleep(0.005)

report_error(body)
"""

# 3 workers x 2 shards, batched requests at scale, every value checked: whole requests (the keys
# of one shard all move together), concurrent sums, read-your-writes, sums after a barrier.
BATCHED = COMMON + """
import random
ctx = ps.init()
w, nw = ctx.role.index, ctx.role.num_workers
GROUP = list(range(200))                       # scalars: every request adds 1 to each of them
VEC = [1000 + i for i in range(10)]            # (5,) vectors, pushed per key (list form)
MIXED = [2000 + i for i in range(100)]         # random subsets, random values
MINE = 5000 + w                                # pushed by this worker only
ALL = GROUP + VEC + MIXED + [5000 + v for v in range(nw)]
kv = ps.KVStore(ALL, [()] * 200 + [(5,)] * 10 + [()] * 100 + [()] * nw, torch.float32)
rng = random.Random(w)
R = 300
group = torch.tensor(GROUP)
contrib = {k: 0.0 for k in MIXED}
mine, torn, ryw_bad, requests, checked, last = 0.0, [], [], 0, 0, None
for it in range(R):
    sub = sorted(rng.sample(MIXED, rng.randint(1, 40)))
    vals = [float(rng.randint(1, 9)) for _ in sub]
    for k, v in zip(sub, vals):
        contrib[k] += v
    mine += it + 1
    keys = torch.tensor(GROUP + sub + [MINE])
    flat = torch.cat([torch.ones(len(GROUP)), torch.tensor(vals), torch.tensor([float(it + 1)])])
    kv.push(keys, flat)                       # one request per shard
    kv.push(VEC, [torch.ones(5)] * len(VEC))  # the list form
    requests += 2 * ctx.role.num_shards
    got = kv.wait(kv.pull(torch.tensor([MINE])))
    checked += 1
    if got.tolist() != [mine]:
        ryw_bad.append([it, got.tolist(), mine])
    if it % 3 == 0:
        snap = kv.wait(kv.pull(group))
        checked += len(GROUP)
        for s in range(ctx.role.num_shards):   # a request is applied whole on each shard
            part = snap[s::ctx.role.num_shards]
            if not bool((part == part[0]).all()):
                torn.append([it, s, sorted(set(part.tolist()))[:6]])
        if last is not None and bool((snap < last).any()):
            torn.append([it, "went back"])
        last = snap
kv.barrier()
final_group = kv.wait(kv.pull(group)).tolist()
final_vec = [t.tolist() for t in kv.wait(kv.pull(VEC))]
final_mixed = kv.wait(kv.pull(torch.tensor(MIXED))).tolist()
final_mine = kv.wait(kv.pull([5000 + v for v in range(nw)]))
kv.barrier()
kv.close()
report(worker=w, torn=torn, ryw_bad=ryw_bad, group=final_group, vec=final_vec, mixed=final_mixed,
       contrib=[contrib[k] for k in MIXED], mine=[t.item() for t in final_mine], requests=requests,
       checked=checked, R=R)
"""

# 2 workers x 2 shards with a batch handler that is not commutative (stored = 3 stored + pushed
# mod P): each worker's private keys end at its local replay only if its pushes apply in order.
ORDERED = COMMON + """
P = 1000003
def batch(keys, stored, pushed):
    stored.mul_(3).add_(pushed).remainder_(P)

ctx = ps.init(kv_batch_handler=batch)
w, nw = ctx.role.index, ctx.role.num_workers
KEYS = [100 * v + i for v in range(nw) for i in range(64)]
kv = ps.KVStore(KEYS, [()] * len(KEYS), torch.int64)
mine = torch.tensor([100 * w + i for i in range(64)])
expect = torch.zeros(64, dtype=torch.int64)
bad, checked = [], 0
for it in range(1000):
    n = 1 + it % 64
    v = torch.arange(n, dtype=torch.int64) * 7 + it
    kv.push(mine[:n], v)                       # no wait: requests queue behind each other
    expect[:n] = (expect[:n] * 3 + v) % P
    if it % 50 == 49:
        got = kv.wait(kv.pull(mine))
        checked += 64
        if not torch.equal(got, expect):
            bad.append([it, int((got != expect).sum())])
kv.barrier()
got = kv.wait(kv.pull(mine))
kv.close()
report(worker=w, bad=bad, final_equal=torch.equal(got, expect), checked=checked + 64)
"""

# 2 workers x 2 shards; the test kills shard 1: both workers must report it.
SHARD_DIES_ALL = COMMON + """
ctx = ps.init()
kv = ps.KVStore(torch.arange(64).tolist(), [()] * 64)
keys = torch.arange(64)
kv.wait(kv.push(keys, torch.ones(64)))
ready()
t0 = time.monotonic()
try:
    while time.monotonic() - t0 < 60:
        kv.push(keys, torch.ones(64))
        kv.wait(kv.pull(keys))
        time.sleep(0.005)
    report(error=None)
except _core.RdmaflowError as e:
    report(error=f"{type(e).__name__}: {e}", at=time.monotonic())
    sys.exit(3)
"""

# 2 workers x 2 shards (key 0 on shard 0, key 1 on shard 1), every wait bounded at 1 s. Shard 1
# takes 3 s over worker 0's first push: its next push times out waiting for shard 1's ack, and
# must have sent shard 0 nothing (it had: a retry added key 0's part twice). Then worker 0's
# barriers time out while worker 1 sleeps: each retry must wait for the same barrier (it entered
# a new one, and was ahead of worker 1 from then on), and say that worker 1 had not entered it.
# Last, shard 0 takes 5 s over a push: the barrier behind it times out saying that shard 0 has
# not released it.
TIMEOUTS = COMMON + """
def handler(key, stored, pushed):
    if key == 1 and float(pushed[0]) == 7.0:
        time.sleep(3)
    if key == 0 and float(pushed[0]) == 50.0:
        time.sleep(5)
    stored.add_(pushed)

ctx = ps.init(kv_handler=handler)
w = ctx.role.index
kv = ps.KVStore([0, 1], [(2,), (2,)], timeout=1.0)
res = {"worker": w}
if w == 0:
    kv.push([0, 1], [torch.full((2,), 7.0), torch.full((2,), 7.0)])
    try:
        kv.push([0, 1], [torch.ones(2), torch.ones(2)])
        res["push_timed_out"] = False
    except _core.TimeoutError:
        res["push_timed_out"] = True
    time.sleep(3)
    kv.wait(kv.push([0, 1], [torch.ones(2), torch.ones(2)]), timeout=30)  # the retry
    res["barrier_timeouts"] = 0
    while True:
        try:
            kv.barrier(timeout=1.0)
            break
        except _core.TimeoutError as e:
            res["barrier_timeouts"] += 1
            # The first: worker 1 still sleeps. In the last, it may have entered during the
            # wait, and the message then says that shard 0 has not released it (a CI failure).
            res.setdefault("barrier_error", str(e))
    kv.wait(kv.push(0, torch.full((2,), 100.0)), timeout=30)  # between the barriers
    kv.barrier(timeout=30)
else:
    time.sleep(9)
    kv.barrier(timeout=30)
    kv.barrier(timeout=30)
res["values"] = [t.tolist() for t in kv.wait(kv.pull([0, 1]), timeout=30)]
kv.barrier(timeout=30)
if w == 0:  # shard 0 takes 5 s over this push: the barriers behind it time out with both workers in
    kv.push(0, torch.full((2,), 50.0))
    while True:
        try:
            kv.barrier(timeout=1.0)
            break
        except _core.TimeoutError as e:
            res["late_release"] = str(e)
else:
    kv.barrier(timeout=30)
kv.close()
report(**res)
"""

# 2 workers x 2 shards; the test kills shard 1 while worker 0 waits in a barrier (shard 0 relays
# it) and worker 1 pulls from shard 0 only.
SHARD_DIES_IN_BARRIER = COMMON + """
ctx = ps.init()
w = ctx.role.index
kv = ps.KVStore([0, 1], [(2,), (2,)])
ready()

def body():
    if w == 0:
        kv.barrier()
    else:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            kv.wait(kv.pull(0))
            time.sleep(0.01)

report_error(body)
"""

# 2 workers x 1 shard: worker 0 makes a KVStore, worker 1 a DistributedOptimizer.
MIXED_API = COMMON + """
ctx = ps.init()
w = ctx.role.index

def body():
    if w == 0:
        ps.KVStore([0], [(2,)]).close()
    else:
        model = torch.nn.Linear(2, 1)
        ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))

report_error(body)
"""

# 2 workers x 1 shard; the test kills worker 1 once both are ready.
WORKER_DIES = COMMON + """
ctx = ps.init()
w = ctx.role.index
kv = ps.KVStore([0], [(2,)])
ready()

def body():
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        kv.wait(kv.pull(0))
        time.sleep(0.01)

report_error(body)
"""

# 1 worker x 2 shards: one KVStore used from four threads at once (pushes, pulls, waits).
THREADS = COMMON + """
import threading

def handler(key, stored, pushed):
    if key == 3 or (key == 2 and pushed[0] < 0):
        time.sleep(2)  # shard 1 (key % 2) takes 2 s over key 3's push, shard 0 over key 2's below 0
    stored.add_(pushed)

ctx = ps.init(kv_handler=handler)
kv = ps.KVStore([0, 1, 2, 3], [(3,), (), (50,), (1,)])
N, T = 200, 4
errors = []

def run(t):
    try:
        for i in range(N):
            h = kv.push([0, 1, 2], [torch.ones(3), torch.tensor(1.0), torch.full((50,), float(t))])
            if i % 10 == 9:
                kv.wait(h)
                kv.wait(kv.pull([0, 1]))
    except Exception as e:
        errors.append(f"thread {t}: {type(e).__name__}: {e}")

threads = [threading.Thread(target=run, args=(t,)) for t in range(T)]
for th in threads:
    th.start()
for th in threads:
    th.join(60)
kv.barrier()
got = kv.wait(kv.pull([0, 1, 2]))
# A wait does not hold the store: a thread waits for a pull that shard 1 answers only once it has
# applied key 3's push (2 s), while this thread pushes and pulls key 0 on shard 0.
kv.push(3, torch.full((1,), 9.0))
slow = kv.pull(3)
order = []
waiter = threading.Thread(target=lambda: order.append(("slow", kv.wait(slow).tolist())))
waiter.start()
time.sleep(0.2)  # the waiter is in its wait
kv.wait(kv.push(0, torch.ones(3)))
order.append(("other", kv.wait(kv.pull(0)).tolist()))
waiter.join(30)
# Nor does a push's wait for a shard's acknowledgement of the last push: a thread pushes key 3
# again while shard 1 is still applying the last push of it, and this thread meanwhile pushes
# and pulls key 0.
kv.push(3, torch.full((1,), 9.0))
pushing = []
pusher = threading.Thread(target=lambda: (kv.push(3, torch.ones(1)), pushing.append("second push of key 3")))
pusher.start()
time.sleep(0.2)  # the pusher waits for shard 1's acknowledgement
kv.wait(kv.push(0, torch.ones(3)))
pushing.append(("other", kv.wait(kv.pull(0)).tolist()))
pusher.join(30)
key3 = kv.wait(kv.pull(3)).tolist()
# Nor does a barrier's wait for shard 0: a thread enters one while shard 0 takes 2 s over a push
# of key 2 (it relays the barrier after that), and this thread meanwhile pushes and pulls key 1
# on shard 1.
kv.push(2, torch.full((50,), -1.0))
barrier = []
barrierer = threading.Thread(target=lambda: (kv.barrier(), barrier.append("barrier")))
barrierer.start()
time.sleep(0.2)  # the barrierer waits for shard 0
kv.wait(kv.push(1, torch.tensor(1.0)))
barrier.append(("other", kv.wait(kv.pull(1)).tolist()))
kv.barrier()  # shard 0 still sleeps: this thread takes part in the barrier under way
barrier.append("joined")
barrierer.join(30)
res = dict(errors=errors, alive=[th.is_alive() for th in threads] + [waiter.is_alive(), pusher.is_alive(),
                                                                   barrierer.is_alive()],
       sums=[g.tolist() for g in got], expect=[[N * T] * 3, N * T, [N * sum(range(T))] * 50], order=order,
       pushing=pushing, key3=key3, barrier=barrier, push_pull=[t.tolist() for t in kv.push_pull([3, 0], [torch.ones(1), torch.ones(3)])])
res["stats"] = dict(kv.stats)
# A barrier that waits while another thread closes the store ends at once: a closed worker
# takes no part in barriers, so shard 0 would never release it for this one. So does a push
# that waits for shard 1's acknowledgement of the last push of key 3 (2 s in its handler).
kv.push(2, torch.full((50,), -1.0))
kv.push(3, torch.ones(1))
closed, push_closed = [], []
def ends(call, into):
    try:
        call()
        into.append("returned")
    except Exception as e:
        into.append(f"{type(e).__name__}: {e}")
closing = threading.Thread(target=ends, args=(kv.barrier, closed))
pushing_when_closed = threading.Thread(target=ends, args=(lambda: kv.push(3, torch.ones(1)), push_closed))
closing.start()
pushing_when_closed.start()
time.sleep(0.2)  # the barrier waits for shard 0, the push for shard 1
t0 = time.monotonic()
kv.close()
closing.join(30)
pushing_when_closed.join(30)
report(**res, closed=closed, closed_after=time.monotonic() - t0, push_closed=push_closed,
       alive_after_close=closing.is_alive() or pushing_when_closed.is_alive())
"""

# 1 worker x 2 shards over tcp, no same-host mapping: an arena tensor pushed to shard 0 while
# the test has that shard stopped (its WRITE cannot complete) and a small one to shard 1. The
# worker drops both and the handle, pushes again, and asks the arena for as many bytes.
HELD = COMMON + """
import gc, pathlib
os.environ["RDMAFLOW_SAME_HOST"] = "0"   # every WRITE through UCX tcp, completed by the peer's reads
here = pathlib.Path(__file__).parent
ctx = ps.init()
ctx.device.create_arena(192 << 20)
N = 8 << 20                              # 32 MiB: more than loopback's socket buffers hold
kv = ps.KVStore([0, 1], [(N,), (4,)])

def wait_for(name):
    t0 = time.monotonic()
    while not (here / name).exists():
        assert time.monotonic() - t0 < 60, name
        time.sleep(0.05)

big = ctx.device.empty(N)
big.zero_()
kv.push([0, 1], [big, torch.zeros(4)])   # the regions are known to both shards now,
kv.wait(kv.pull([0, 1]))                 # and the push applied:
while int(kv.ack[0]) < kv.push_seq[0]:   # its acknowledgement is in (the next push waits for it)
    time.sleep(0.01)
big.fill_(1.0)
print("READY", flush=True)
wait_for("held.stopped")
h = kv.push([0, 1], [big, torch.ones(4)])
off = kv.arena.offset_of(big)
del h, big
time.sleep(0.5)                          # shard 1's WRITEs complete; shard 0's cannot
kv.push([1], [torch.ones(4)])
gc.collect()
again = ctx.device.empty(N)
reused = kv.arena.offset_of(again) == off
again.fill_(7.0)                         # what a WRITE still reading that memory would send
print("CHECKED", flush=True)
wait_for("held.continued")
kv.barrier()
got = kv.wait(kv.pull(0))
report(reused=reused, values=sorted(set(got.unique().tolist())))
kv.close()
"""

# 1 worker x 1 shard, started as `rdmaflow launch --resume` starts a job.
RESUME = COMMON + """
os.environ["RDMAFLOW_RESUME"] = "1"
ctx = ps.init()
report_error(lambda: ps.KVStore([0], [(2,)]))
"""

# 2 workers x 2 shards over tcp: pushes, then save() (collective), then pushes that must not be
# in the file; a file worker 0 cannot write fails save() on both workers.
SNAPSHOT = COMMON + """
import rdmaflow
import rdmaflow.ps.kv_snapshot
here = pathlib.Path(__file__).parent
ctx = ps.init()
w = ctx.role.index
KEYS, SHAPES = [0, 1, 2, 5], [(3,), (2, 2), (), (1000,)]
kv = ps.KVStore(KEYS, SHAPES, torch.float64)
for i in range(5):   # not waited for: the save's barrier must take them in
    kv.push(KEYS, [torch.full(s, float(w + 1), dtype=torch.float64) for s in SHAPES])
kv.save(str(here / "kv.snapshot.tmp"))  # worker 1's path is not used
if w == 0:
    os.rename(here / "kv.snapshot.tmp", here / "kv.snapshot")  # the restoring job starts on it
kv.wait(kv.push(KEYS, [torch.full(s, 100.0, dtype=torch.float64) for s in SHAPES]))
bad = {}
for name, path in [("under_a_file", here / "snapshot.py" / "kv.snapshot"), ("not_a_path", 3.5)]:
    try:
        kv.save(path)
        bad[name] = "no error"
    except _core.InvalidArgumentError as e:
        bad[name] = str(e)
# A save that times out on worker 1 while worker 0 writes the file (a slow disk: 2 s) is the one
# its next call waits for; the save after that is a new one on both workers.
late = None
if w == 0:
    write = rdmaflow.ps.kv_snapshot.save
    def slow_write(*args):
        time.sleep(2.0)
        write(*args)
    rdmaflow.ps.kv_snapshot.save = slow_write
    kv.save(str(here / "kv.late"))
    rdmaflow.ps.kv_snapshot.save = write
else:
    try:
        kv.save(str(here / "kv.late"), timeout=1.0)
        late = "no error"
    except rdmaflow.TimeoutError as e:
        late = f"timeout: {e}"
    kv.save(str(here / "kv.late"))
kv.save(str(here / "kv.again"))
again = [sorted(set(t.flatten().tolist())) for t in ps.kv_snapshot.load(str(here / "kv.again"), kv.spec.decl)]
kv.barrier()
final = [sorted(set(t.flatten().tolist())) for t in kv.wait(kv.pull(KEYS))]
kv.close()
report(worker=w, bad=bad, final=final, late=late, again=again, saves=kv.save_seq)
"""

# 1 worker x 1 shard (another shard and worker count than the job that saved), started as
# `rdmaflow launch --resume` starts a job: init= the snapshot SNAPSHOT saved.
RESTORE = COMMON + """
here = pathlib.Path(__file__).parent
t0 = time.monotonic()
while not (here / "kv.snapshot").exists():   # every rank, before the job's setup starts its clocks
    assert time.monotonic() - t0 < 140, "the snapshot job never saved"
    time.sleep(0.05)
os.environ["RDMAFLOW_RESUME"] = "1"
ctx = ps.init()
kv = ps.KVStore([5, 2, 1, 0], [(1000,), (), (2, 2), (3,)], torch.float64, init=here / "kv.snapshot")
got = kv.wait(kv.pull([0, 1, 2, 5]))
report(values=[sorted(set(t.flatten().tolist())) for t in got], shapes=[list(t.shape) for t in got])
kv.close()
"""

JOBS = {
    # name: (script, workers, shards, UCX transport: tcp puts are applied by the target's
    # progress thread, sm ones by the sender's kernel call; whether rank 0 serves the store)
    "sums": (SUMS, 3, 2, "tcp", False),
    "handler": (HANDLER, 2, 1, "sm", False),
    "failing": (FAILING, 1, 1, "tcp", False),
    "mismatch": (MISMATCH, 2, 1, "sm", True),
    "shard_dies": (SHARD_DIES, 1, 2, "tcp", False),
    "batched": (BATCHED, 3, 2, "sm", False),
    "ordered": (ORDERED, 2, 2, "tcp", False),
    "shard_dies_all": (SHARD_DIES_ALL, 2, 2, "sm", False),
    "timeouts": (TIMEOUTS, 2, 2, "tcp", False),
    "shard_dies_in_barrier": (SHARD_DIES_IN_BARRIER, 2, 2, "sm", False),
    "mixed_api": (MIXED_API, 2, 1, "tcp", False),
    "worker_dies": (WORKER_DIES, 2, 1, "tcp", False),
    "threads": (THREADS, 1, 2, "tcp", False),
    "held": (HELD, 1, 2, "tcp", False),
    "resume": (RESUME, 1, 1, "sm", False),
    "snapshot": (SNAPSHOT, 2, 2, "tcp", False),
    "restore": (RESTORE, 1, 1, "sm", False),
}


class Job:
    """The processes of one job. ``own_store``: rank 0 serves the job's c10d store (as without
    torchrun); otherwise this process serves it, as torchrun's agent does under rdmaflow launch."""

    def __init__(self, name: str, script: str, workers: int, shards: int, transport: str, tmp,
                 own_store: bool = False):
        self.name, self.workers, self.shards, self.transport = name, workers, shards, transport
        self.tmp, self.own_store = tmp, own_store
        self.path = tmp / f"{name}.py"
        self.path.write_text(textwrap.dedent(script))
        self.attempt = 0
        self.store = None
        self.procs, self.logs = [], []
        self.ended: float | None = None
        self._start()

    def _start(self) -> None:
        n = self.workers + self.shards
        self.attempt += 1
        if self.own_store:
            port = free_port()
        else:
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, n, True, wait_for_workers=False)
            port = self.store.port
        secret = secrets.token_hex(8)
        self.procs, self.logs = [], []
        self.started = time.monotonic()
        for rank in range(n):
            env = {k: v for k, v in ucx_env(self.transport).items()
                   if not k.startswith(("RDMAFLOW_", "TORCHELASTIC_", "GROUP_RANK", "ROLE_"))}
            env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                       GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RDMAFLOW_JOB_SECRET=secret, RDMAFLOW_SHARDS_PER_NODE=str(self.shards),
                       RDMAFLOW_PS_TIMEOUT="60", RDMAFLOW_PS_STEP_TIMEOUT="45", OMP_NUM_THREADS="1")
            if not self.own_store:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            log = self.tmp / f"{self.name}.{self.attempt}.{rank}.log"
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen([sys.executable, str(self.path)], stdout=f,
                                                   stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def go(self) -> None:
        """Lets the job's workers say READY (COMMON's ready()): the jobs all start with the module,
        but a window of 60 s after READY must start when the test that ends it runs."""
        (self.tmp / f"{self.name}.go").touch()

    def wait(self, deadline: float) -> None:
        while any(p.poll() is None for p in self.procs):
            if self.own_store and self.attempt < 3 and "EADDRINUSE" in self.logs[0].read_text():
                self.kill()  # another process took the port first: start again on another one
                self._start()
                continue
            if time.monotonic() > deadline:
                stacks = stacks_of([(f"rank {r}", p.pid) for r, p in enumerate(self.procs) if p.poll() is None])
                self.kill()
                pytest.fail(f"job {self.name} did not finish in time:\n{self.output()}{stacks}")
            time.sleep(0.1)
        self.ended = self.ended or time.monotonic()

    def kill(self, ranks=None) -> None:
        procs = self.procs if ranks is None else [self.procs[r] for r in ranks]
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if ranks is None:
            self.store = None  # the store this process served for the job

    def output(self, rank: int | None = None) -> str:
        ranks = range(len(self.procs)) if rank is None else [rank]
        return "\n".join(f"--- {self.name} rank {r} (exit {self.procs[r].returncode}):\n"
                         + self.logs[r].read_text()[-3000:] for r in ranks)

    def results(self) -> list[dict]:
        """The RESULT of every worker, by worker index."""
        out = []
        for r in range(self.shards, len(self.procs)):
            lines = [ln for ln in self.logs[r].read_text().splitlines() if ln.startswith("RESULT ")]
            assert lines, f"worker {r - self.shards} reported nothing:\n{self.output()}"
            out.append(json.loads(lines[-1][len("RESULT "):]))
        return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv")
    started = {}
    try:
        for name, (script, workers, shards, transport, own_store) in JOBS.items():
            started[name] = Job(name, script, workers, shards, transport, tmp, own_store)
        deadline = time.monotonic() + JOB_DEADLINE

        def get(name: str, wait: bool = True) -> Job:
            job = started[name]
            if wait:
                job.wait(deadline)
            return job

        get.deadline = deadline

        yield get
    finally:
        for job in started.values():
            job.kill()


def finished_ok(job: Job) -> list[dict]:
    bad = [r for r, p in enumerate(job.procs) if p.returncode != 0]
    assert not bad, f"ranks {bad} of job {job.name} failed:\n{job.output()}"
    return job.results()


def test_concurrent_pushes_sum_exactly_and_pulls_see_them(jobs):
    res = finished_ok(jobs("sums"))
    assert len(res) == 3
    for r in res:
        for k, values in r["sums"].items():
            assert values == [r["expect"][k]], f"worker {r['worker']} key {k}: {values} != {r['expect'][k]}"
        assert r["outs_returned"], "wait() must return the tensors given to pull()"
        assert r["zero_copy"] > 0, "arena tensors should be pushed without a copy"


def test_one_kvstore_used_from_several_threads(jobs):
    res = finished_ok(jobs("threads"))[0]
    assert res["errors"] == [] and not any(res["alive"]), res
    assert res["sums"] == res["expect"], "every thread's pushes are applied exactly once"
    # One thread's wait for a slow shard held back another thread's push to the other shard:
    # its wait for a pull's reply, and then its push's wait for the last push's acknowledgement.
    assert res["order"] == [["other", [200.0 * 4 + 1] * 3], ["slow", [9.0]]], res["order"]
    assert res["pushing"] == [["other", [200.0 * 4 + 2] * 3], "second push of key 3"], res["pushing"]
    assert res["key3"] == [19.0], res
    # Nor did its wait in a barrier that shard 0 relayed late, which another thread then joined
    # (so the job made two barriers: one before it, this one).
    assert res["barrier"][0] == ["other", 200.0 * 4 + 1], res["barrier"]
    assert sorted(res["barrier"][1:]) == ["barrier", "joined"], res["barrier"]
    assert res["stats"]["barriers"] == 2, res["stats"]
    # A barrier another thread's close() cut short (within its 2 s in shard 0, not the timeout).
    assert not res["alive_after_close"] and len(res["closed"]) == 1, res
    assert res["closed"][0].startswith("InvalidArgumentError: barrier: this KVStore was closed while it waited"), res
    # So was a push waiting for a shard's acknowledgement (it raised only once the ack came).
    push_closed = "InvalidArgumentError: push: this KVStore was closed while it waited for shard 1's acknowledgement"
    assert res["push_closed"] == [push_closed + " of the last push"], res
    assert res["closed_after"] < 10, res
    assert res["push_pull"] == [[20.0], [200.0 * 4 + 3] * 3], res


def test_an_arena_tensor_stays_held_until_each_of_its_writes_completed(jobs):
    """Its memory is not handed out again while the WRITE to a slower shard still reads it."""
    job = jobs("held", wait=False)
    log = job.logs[2]  # the worker (ranks 0 and 1 are the shards)

    def wait_for(text):
        while text not in log.read_text():
            assert all(p.poll() is None for p in job.procs), job.output()
            assert time.monotonic() < jobs.deadline, job.output()
            time.sleep(0.05)

    wait_for("READY")
    stop_process(job.procs[0].pid)  # shard 0, which holds key 0
    try:
        (job.tmp / "held.stopped").touch()
        wait_for("CHECKED")
    finally:
        os.kill(job.procs[0].pid, signal.SIGCONT)
    (job.tmp / "held.continued").touch()
    res = finished_ok(jobs("held"))[0]
    assert not res["reused"], "the arena handed out memory a pending WRITE was reading"
    assert res["values"] == [1.0], res


def test_resume_without_a_snapshot_is_refused_for_a_kv_job(jobs):
    """--resume without init=<snapshot> restarted a KVStore job's values from zero, unsaid."""
    job = jobs("resume")
    (res,) = job.results()
    assert res["error"].startswith("InvalidArgumentError: rdmaflow launch --resume"), res
    assert "give KVStore init= the path its save() wrote" in res["error"], res
    assert job.procs[0].returncode != 0 and "the job was aborted" in job.output(0), job.output()


def test_a_snapshot_holds_the_pushes_before_save_and_restarts_a_job_of_another_size(jobs):
    res = finished_ok(jobs("snapshot"))
    for r in res:
        # 5 pushes of w + 1 from workers 0 and 1, then 100 from each after the save.
        assert r["final"] == [[15.0 + 200.0]] * 4, r
        assert "snapshot.py/kv.snapshot: FileExistsError" in r["bad"]["under_a_file"], r
        assert "path must be a file name, got float" in r["bad"]["not_a_path"], r
    assert "could not write" in res[1]["bad"]["under_a_file"], "worker 1 hears worker 0's failure"
    assert res[1]["late"].startswith("timeout") and "kv/save/3" in res[1]["late"], res[1]
    assert [r["saves"] for r in res] == [4, 4], "the timed-out save and its retry are one save"
    for r in res:
        assert r["again"] == [[215.0]] * 4, r
    (got,) = finished_ok(jobs("restore"))
    assert got["values"] == [[15.0]] * 4, "the file holds the values as of the save, none pushed after"
    assert got["shapes"] == [[3], [2, 2], [], [1000]], got


def test_a_snapshot_of_another_declaration_or_none_is_refused(tmp_path):
    import torch

    import rdmaflow
    from rdmaflow.ps import kv, kv_snapshot

    decl = kv.declaration([1, 4], [(2,), ()], torch.float32)
    path = str(tmp_path / "s.pt")
    kv_snapshot.save(path, decl, torch.arange(3, dtype=torch.float32))
    a, b = kv_snapshot.load(path, decl)
    assert a.tolist() == [0.0, 1.0] and b.shape == () and b.item() == 2.0
    cases = [
        (kv.declaration([1, 4], [(2,), ()], torch.float64), "dtype float64 here, float32 in the snapshot"),
        (kv.declaration([1, 5], [(2,), ()], torch.float32), "keys [5] are declared here only"),
        (kv.declaration([1, 4], [(2,), (1,)], torch.float32), "key 4 has shape [1] here, [] in the snapshot"),
    ]
    for other, why in cases:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=r"another declaration: " + re.escape(why)):
            kv_snapshot.load(path, other)
    with pytest.raises(rdmaflow.InvalidArgumentError, match="is missing"):
        kv_snapshot.load(str(tmp_path / "none.pt"), decl)
    (tmp_path / "junk.pt").write_bytes(b"not a snapshot")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="is unreadable"):
        kv_snapshot.load(str(tmp_path / "junk.pt"), decl)
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="not a key-value snapshot"):
        kv_snapshot.load(str(tmp_path / "other.pt"), decl)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="holds a list"):
        kv_snapshot.load(str(tmp_path / "list.pt"), decl)
    state = torch.load(path, weights_only=True)
    for damage in ({"values": torch.zeros(2)}, {"values": "x"}, {"keys": None}, {"keys": [[1]]}):
        torch.save(dict(state, **damage), tmp_path / "bad.pt")
        with pytest.raises(rdmaflow.InvalidArgumentError, match="damaged|another declaration"):
            kv_snapshot.load(str(tmp_path / "bad.pt"), decl)


def test_pulls_never_see_half_applied_values(jobs):
    for r in finished_ok(jobs("sums")):
        assert r["torn"] == [], f"worker {r['worker']} saw inconsistent values: {r['torn']}"


def test_read_your_writes(jobs):
    res = finished_ok(jobs("sums"))
    for r in res:
        for expected, got in r["ryw"]:
            assert got == [expected] * 5, f"worker {r['worker']}: pulled {got} right after pushing, want {expected}"
    # After a barrier, every worker sees every other worker's private key.
    total = sum(range(1, 16))
    for r in res:
        assert r["private"] == {str(100 + v): [100 + v + total] for v in range(3)}


def test_bad_input_raises_at_the_call(jobs):
    for r in finished_ok(jobs("sums")):
        assert r["errors"] == {k: "ok" for k in r["errors"]}, r["errors"]
        assert "kvstore_after_close" in r["errors"] and "nan_timeout" in r["errors"]
        assert r["empty"] == [None, [], []], "requests of no keys move nothing and return nothing"


def test_a_handlers_value_of_another_shape_is_refused():
    """copy_ would broadcast a smaller tensor over a key's values: the shard refuses it instead."""
    import torch

    from rdmaflow.ps.kv_server import KVShard
    from rdmaflow.ps.shard import ShardFailure

    stored = torch.zeros(3)
    with pytest.raises(ShardFailure, match=r"shape \[\] for key 0, whose values are of shape \[3\]"):
        KVShard._store_returned(torch.tensor(6.0), stored, "key 0")
    KVShard._store_returned(torch.full((3,), 2.0), stored, "key 0")
    assert stored.tolist() == [2.0, 2.0, 2.0]


def test_custom_handler(jobs):
    res = finished_ok(jobs("handler"))
    k0 = [max(max(float(i) for i in range(10)), max(50.0 - i for i in range(10))),
          max(max(100.0 - i for i in range(10)), max(2.0 * i for i in range(10))), 7.0]
    for r in res:
        assert r["k0"] == k0
        assert r["k1"] == [15.5] * 3
        assert r["k2"] == [2.0 * 20] * 4


def test_failing_handler_reaches_the_worker(jobs):
    job = jobs("failing")
    shard_out, worker_out = job.output(0), job.output(1)
    assert job.procs[0].returncode == 1, shard_out
    assert "seven is not welcome" in shard_out
    assert job.procs[1].returncode == 3, worker_out
    (r,) = job.results()
    assert "kv handler raised on key 7" in r["error"] and "seven is not welcome" in r["error"], r
    assert r["seconds"] < 10


def test_mismatched_declaration_fails_everywhere(jobs):
    job = jobs("mismatch")
    w0, w1 = job.results()
    # Every process has its error (its last output) within seconds of the mismatch's detection.
    last_output = max(log.stat().st_mtime for log in job.logs)
    assert last_output - w1["at"] < 15, f"the job took {last_output - w1['at']:.0f} s to stop"
    for rank, p in enumerate(job.procs):
        out = job.output(rank)
        assert p.returncode != 0, out
        assert "key declaration differs from worker 0's: key 1 has shape [4] here, [3] on worker 0" in out, out
    assert w1["error"].startswith("InvalidArgumentError"), w1
    assert "aborted" in w0["error"], w0


def kill_shard_1_when_ready(jobs, job: Job, worker_ranks) -> None:
    """Once every worker of ``job`` printed READY, kills shard 1 and waits for the job: every
    process must have ended within 20 s."""
    job.go()
    for rank in worker_ranks:
        while "READY" not in job.logs[rank].read_text():
            assert job.procs[rank].poll() is None, job.output()
            assert time.monotonic() < jobs.deadline, f"worker {rank} never got ready:\n{job.output()}"
            time.sleep(0.1)
    killed = time.monotonic()
    job.kill([1])
    job.wait(jobs.deadline)
    assert job.ended - killed < 20, f"the workers noticed the dead shard only after {job.ended - killed:.0f} s"


def test_dead_shard_fails_the_worker_wait(jobs):
    job = jobs("shard_dies", wait=False)
    kill_shard_1_when_ready(jobs, job, [2])
    (r,) = job.results()
    assert r["error"].startswith("PeerError: shard 1 at "), r
    assert job.procs[2].returncode == 3
    assert job.procs[0].returncode == 1, "shard 0 should have been told the job failed"
    assert "the job was aborted: shard 1 at" in job.output(0)


def test_a_push_that_times_out_sends_nothing_and_a_barrier_that_times_out_is_waited_again(jobs):
    w0, w1 = sorted(finished_ok(jobs("timeouts")), key=lambda r: r["worker"])
    assert w0["push_timed_out"], w0
    assert w0["barrier_timeouts"] >= 1, w0
    assert w0["barrier_error"] == "worker 0 waited 1 s for barrier 1 (shard 0) in vain: worker 1 had not entered it", w0
    assert w0["late_release"] == ("worker 0 waited 1 s for barrier 4 (shard 0) in vain: every live worker entered "
                                  "it, shard 0 has not released it yet"), w0
    # key 0: 7, the retried push once, then 100 (seen by worker 1 after the second barrier); key 1: 7 + 1
    for r in (w0, w1):
        assert r["values"] == [[108.0, 108.0], [8.0, 8.0]], r


def test_a_shard_that_dies_during_a_barrier_is_named(jobs):
    """Shard 0 relays the barrier; shard 1's death is seen by the worker waiting in it (it waited
    out its step timeout, and said only that), and the job is aborted for the other worker."""
    job = jobs("shard_dies_in_barrier", wait=False)
    kill_shard_1_when_ready(jobs, job, [2, 3])
    w0, w1 = job.results()
    assert w0["error"].startswith("PeerError: shard 1 at ") and "barrier" in w0["error"], w0
    assert "shard 1" in w1["error"], w1


def test_workers_of_one_job_must_use_one_api(jobs):
    job = jobs("mixed_api")
    (_, w1) = [r["error"] for r in job.results()]
    assert w1 == ("InvalidArgumentError: worker 1 uses DistributedOptimizer, but worker 0 declared KVStore: every "
                  "worker of a job must declare the same services (ps.init(services=...))"), job.output()


def test_a_shard_declares_a_worker_it_finds_dead(jobs):
    """So that the process serving the store does not wait at exit (15 s) for the dead one."""
    job = jobs("worker_dies", wait=False)
    job.go()
    while "READY" not in job.logs[1].read_text() or "READY" not in job.logs[2].read_text():
        assert all(p.poll() is None for p in job.procs), job.output()
        assert time.monotonic() < jobs.deadline, job.output()
        time.sleep(0.1)
    job.kill([2])
    job.wait(jobs.deadline)
    assert "worker 1 at" in job.output(0) and "died" in job.output(0), job.output()
    # A crash and a process that ended without close() look alike to a shard: it names both.
    assert "if its process ended normally, it did not call close()" in job.output(0), job.output()
    assert job.store.check(["rdmaflow/ps/dead/worker/1"]), job.output()


# -- in this process: the declaration -------------------------------------------------------------
def test_declaration_is_canonical_and_checked():
    import torch

    import rdmaflow
    from rdmaflow.ps import kv

    d = kv.declaration([3, 1, 2], [(2,), 4, ()], torch.float32)
    assert d == {"dtype": "float32", "keys": [[1, [4]], [2, []], [3, [2]]]}, "keys ascending, shapes as lists"
    assert kv.declaration([1, 3, 2], [4, (2,), ()], "float32") == d
    for keys, shapes, dtype in [([1, 1], [(2,), (2,)], torch.float32),   # a key twice
                                ([1], [(0,)], torch.float32),             # no elements
                                ([1], [(2,)], torch.bool),                # no such dtype
                                ([-1], [(2,)], torch.float32),            # negative key
                                ([True], [(2,)], torch.float32),          # not an integer
                                ([1], [(True, 2)], torch.float32),        # True is no dimension
                                ([torch.tensor(True)], [(2,)], torch.float32),      # nor a bool tensor
                                ([1], [(torch.tensor(True), 2)], torch.float32),    # a key or a dimension
                                ([1], [b"\x02"], torch.float32),          # nor are bytes a shape
                                ([], [], torch.float32),                  # nothing
                                ([1, 2], [(2,)], torch.float32)]:         # counts differ
        with pytest.raises(rdmaflow.InvalidArgumentError):
            kv.declaration(keys, shapes, dtype)
    other = kv.declaration([1, 2, 4], [4, (), (2,)], torch.float32)
    assert kv.describe_difference(other, d) == "keys [4] are declared here only; keys [3] are declared on worker 0 only"
    assert kv.describe_difference(kv.declaration([1, 2, 3], [4, (), (3,)], torch.float32), d) == \
        "key 3 has shape [3] here, [2] on worker 0"
    assert kv.describe_difference(kv.declaration([1, 2, 3], [4, (), (2,)], torch.float64), d) == \
        "dtype float64 here, float32 on worker 0"
    with pytest.raises(rdmaflow.InvalidArgumentError, match="init"):
        rdmaflow.ps.KVStore([1], [(2,)])


# -- batched requests at scale ---------------------------------------------------------------------
def test_batched_requests_apply_whole_sum_exactly_and_read_your_writes(jobs):
    res = finished_ok(jobs("batched"))
    assert len(res) == 3
    total_requests = sum(r["requests"] for r in res)
    assert total_requests >= 3000, total_requests
    assert sum(r["checked"] for r in res) >= 10000
    nw, R = len(res), res[0]["R"]
    contrib = [sum(r["contrib"][i] for r in res) for i in range(100)]
    for r in res:
        assert r["torn"] == [], f"worker {r['worker']} saw part of a request applied: {r['torn'][:5]}"
        assert r["ryw_bad"] == [], f"worker {r['worker']} pulled a stale value of its own key: {r['ryw_bad'][:5]}"
        assert r["group"] == [float(nw * R)] * 200, f"worker {r['worker']}: {sorted(set(r['group']))}"
        assert r["vec"] == [[float(nw * R)] * 5] * 10
        for i, (got, want) in enumerate(zip(r["mixed"], contrib)):
            assert got == want, f"worker {r['worker']} key {2000 + i}: {got} != {want}"
        assert r["mine"] == [float(R * (R + 1) // 2)] * nw


def test_a_workers_pushes_apply_in_order_with_a_batch_handler(jobs):
    res = finished_ok(jobs("ordered"))
    for r in res:
        assert r["bad"] == [], f"worker {r['worker']}: pulls differ from the in-order replay at {r['bad'][:5]}"
        assert r["final_equal"], f"worker {r['worker']}: the final values differ from the in-order replay"
        assert r["checked"] >= 1000


def test_dead_shard_is_reported_on_every_worker(jobs):
    job = jobs("shard_dies_all", wait=False)
    kill_shard_1_when_ready(jobs, job, [2, 3])
    for r in job.results():
        assert r["error"] is not None and ("shard 1" in r["error"] or "aborted" in r["error"]), r
    assert [job.procs[rank].returncode for rank in (2, 3)] == [3, 3], job.output()


def test_batched_request_is_checked_and_cut_by_shard():
    import torch

    import rdmaflow
    from rdmaflow.ps.kv_layout import KVLayout, declaration
    from rdmaflow.ps.kv_request import Request

    keys = [0, 1, 2, 3, 10, 11]
    spec = KVLayout(declaration(keys, [(), (), (2,), (), (3,), ()], torch.float32), 2, 3)
    req = Request(spec, torch.tensor([11, 2, 1]), torch.arange(4.0), "push")
    assert req.batched and req.elements == 4
    parts = {s: (None if p is None else p.tolist()) for s, p in req.by_shard()}
    assert parts == {1: [0, 2], 0: [1]}, "keys 11 and 1 on shard 1, key 2 on shard 0"
    assert req.element_positions(torch.tensor([1])).tolist() == [1, 2], "key 2's two elements"
    assert req.element_positions(torch.tensor([0, 2])).tolist() == [0, 3]
    # Keys in any collection, as the declaration takes them (a range was read as one key)
    import numpy as np
    for coll in (range(2), np.array([0, 1]), (k for k in [0, 1])):
        listed = Request(spec, coll, [torch.ones(()), torch.ones(())], "push")
        assert not listed.single and listed.keys.tolist() == [0, 1]
    assert Request(spec, np.int64(3), torch.ones(()), "push").single
    single = Request(spec, torch.tensor([10]), torch.ones(3), "push")
    assert [(s, p) for s, p in single.by_shard()] == [(0, None)], "one shard: the whole request"
    # Stored values are packed per shard in key order: shard 0 holds 0, 2, 10 (1 + 2 + 3 elements).
    assert spec.shards[0].offsets.tolist() == [0, 1, 3] and spec.shards[0].elements == 6
    for bad_keys, values, match in [
        (torch.tensor([11, 5]), torch.ones(2), "key 5 was not declared"),
        (torch.tensor([1, 3, 1]), torch.ones(3), "key 1 appears twice"),
        (torch.tensor([1, 3]), torch.ones(3), r"float32\[2\] tensor, got float32\[3\]"),
        (torch.tensor([1, 3]), torch.ones(2, dtype=torch.float64), "float64"),
        (torch.tensor([1.0, 3.0]), torch.ones(2), "keys must be integers"),
        (torch.tensor([-1, 3]), torch.ones(2), "key must be in"),
        (torch.tensor(True), torch.ones(()), "key must be an integer"),  # 0-d: one key, not key 1
        (torch.tensor([1 << 40]), torch.ones(1), "not declared"),
    ]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=match):
            Request(spec, bad_keys, values, "push")
    # Sparse keys take the binary search instead of the table; the same answers.
    sparse = KVLayout(declaration([5, 1 << 40], [(), ()], torch.float32), 1, 1)
    assert sparse.key_table is None
    assert Request(sparse, torch.tensor([1 << 40, 5]), None, "pull", values_optional=True).j.tolist() == [1, 0]
    with pytest.raises(rdmaflow.InvalidArgumentError, match="key 6 was not declared"):
        Request(sparse, torch.tensor([6]), None, "pull", values_optional=True)


def test_bench_kv_runs_and_writes_its_outputs(tmp_path):
    """A smoke run of `rdmaflow bench kv` (no timing is asserted): every cell of both systems and
    both operations is measured, the issue's bar lines are printed, the CSV and plot written."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "kv", "--quick", "--transport", "sm",
                        "--keys", "1,100", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sm keys push / sm tensor push at N=100" in r.stdout, r.stdout
    rows = (out / "kv.csv").read_text().splitlines()
    cells = {tuple(line.split(",")[1:3]) for line in rows[1:]}
    assert cells == {(what, n) for what in ("keys push", "keys pull", "tensor push", "tensor pull")
                     for n in ("1", "100")}, rows
    assert (out / "kv.png").stat().st_size > 0
