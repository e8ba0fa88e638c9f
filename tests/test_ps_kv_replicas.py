"""Replicated key ranges of the key-value API (KVStore(..., replicas=R), rdmaflow/ps/kv_replica.py),
in real jobs whose shard processes the test SIGKILLs while the workers push.

Each job is 2-3 workers x 3 shards (shard process c holds key range c and backs up the R-1 ranges
before it); the c10d store is served by this process (as the launcher's agent does), so that no
process the test kills serves it. Every worker pushes integers (exact in float64) to keys of
every range, one push per range in flight, and counts what it saw acknowledged (wait returned);
after the failures, a barrier, and every worker's pull of every key must equal the sum of what
all workers counted: every acknowledged push applied exactly once. A private key per worker
checks read-your-writes across the failover (a pull right after an unacknowledged push).
"""
from __future__ import annotations

import json
import random
import time

import pytest
import torch
from test_ps_kv import COMMON, Job

from rdmaflow.ps import kv_snapshot
from rdmaflow.ps.kv_layout import declaration

JOB_DEADLINE = 150.0  # seconds from the start of the jobs until every process must have exited

PUSHER = COMMON + """
ctx = ps.init()
w, nw = ctx.role.index, ctx.role.num_workers
R = @REPLICAS@
KEYS = list(range(12)) + [100 + v for v in range(nw)]   # 4 shared keys per range; a private one each
kv = ps.KVStore(KEYS, [(3,)] * len(KEYS), torch.float64, replicas=R)
expected = {k: 0.0 for k in KEYS}   # what this worker saw acknowledged, per key
mine, own, ryw_bad = 100 + w, 0.0, []

def body():
    global own
    ready()
    t0, i, prev, barriers = time.monotonic(), 0, None, 0
    while time.monotonic() - t0 < @SECONDS@:
        i += 1
        keys = sorted({(i * 5 + w) % 12, (i * 7 + 3) % 12, (i + 2 * w) % 12})
        v = float(i % 7 + 1)
        h = kv.push(keys, [torch.full((3,), v, dtype=torch.float64)] * len(keys))
        if prev is not None:
            kv.wait(prev[0])
            for k in prev[1]:
                expected[k] += prev[2]
        prev = (h, keys, v)
        if i % 5 == 0:  # read-your-writes: the pull follows a push not acknowledged yet
            kv.push(mine, torch.full((3,), 1.0, dtype=torch.float64))
            own += 1.0
            got = kv.wait(kv.pull(mine))
            if got.tolist() != [own] * 3:
                ryw_bad.append([own, got.tolist()])
        # Barriers all along (range 0's primary relays them, and it may be the one killed): the
        # same number on every worker, at times, since the workers' loops run at their own pace.
        if barriers < 3 and time.monotonic() - t0 > (barriers + 1) * @SECONDS@ / 4:
            kv.barrier()
            barriers += 1
        time.sleep(0.003)
    kv.wait(prev[0])
    for k in prev[1]:
        expected[k] += prev[2]
    expected[mine] = own
    for _ in range(barriers, 3):
        kv.barrier()
    kv.barrier()
    kv.save(pathlib.Path(__file__).with_suffix(".snapshot"))  # written by worker 0 once all are in
    final = kv.wait(kv.pull(torch.tensor(KEYS)))
    report(error=None, expected=expected, final=final.view(-1, 3).tolist(), ryw_bad=ryw_bad, pushes=i,
           failovers=kv.stats.get("failovers", 0))
    kv.close()

try:
    body()
except _core.RdmaflowError as e:
    report(error=f"{type(e).__name__}: {e}")
    sys.exit(3)
"""

# name: (workers, shards, transport, replicas, seconds the workers push, the kills: (shard, delay))
JOBS = {
    "primary_dies": (3, 3, "tcp", 2, 4.0, [(1, None)]),
    "two_in_a_row": (2, 3, "sm", 3, 4.5, [(0, None), (1, 1.0)]),
    "every_copy_dies": (2, 3, "sm", 2, 30.0, [(1, 0.5), (2, 0.0)]),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvrep")
    started = {}
    try:
        for name, (workers, shards, transport, replicas, seconds, _) in JOBS.items():
            script = PUSHER.replace("@REPLICAS@", str(replicas)).replace("@SECONDS@", str(seconds))
            started[name] = Job(name, script, workers, shards, transport, tmp)
        yield started, time.monotonic() + JOB_DEADLINE
    finally:
        for job in started.values():
            job.kill()


def run_with_kills(job: Job, kills, deadline: float) -> float:
    """Lets the workers go; once all said READY, SIGKILLs each shard of ``kills`` after its delay
    (None: a random one within the pushing); waits for the job. Returns when the last kill was."""
    job.go()
    for rank in range(job.shards, len(job.procs)):
        while "READY" not in job.logs[rank].read_text():
            assert job.procs[rank].poll() is None, job.output()
            assert time.monotonic() < deadline, f"rank {rank} never got ready:\n{job.output()}"
            time.sleep(0.05)
    killed = time.monotonic()
    for shard, delay in kills:
        time.sleep(random.uniform(0.2, 2.0) if delay is None else delay)
        job.kill([shard])
        killed = time.monotonic()
    job.wait(deadline)
    return killed


def stats(job: Job, shard: int) -> dict:
    return json.loads(job.store.get(f"rdmaflow/ps/stats/shard/{shard}"))


def check_exact(job: Job, killed: list[int]) -> list[dict]:
    bad = [r for r, p in enumerate(job.procs) if r not in killed and p.returncode != 0]
    assert not bad, f"ranks {bad} of job {job.name} failed:\n{job.output()}"
    res = job.results()
    total: dict[str, float] = {}
    for r in res:
        assert r["error"] is None and not r["ryw_bad"], r
        for k, v in r["expected"].items():
            total[k] = total.get(k, 0.0) + v
    keys = list(res[0]["expected"])
    for r in res:  # every worker pulls every key after the barrier: the sum of all acknowledged pushes
        got = {k: row for k, row in zip(keys, r["final"])}
        wrong = {k: (got[k][0], total[k]) for k in keys if got[k] != [total[k]] * 3}
        assert not wrong, f"{job.name}: (pulled, acknowledged) per key differ: {wrong}\n{job.output()}"
    assert all(r["failovers"] >= 1 for r in res), res  # every worker met the dead primary
    return res


def test_a_killed_primary_loses_no_acknowledged_push_over_tcp(jobs):
    started, deadline = jobs
    job = started["primary_dies"]
    killed = run_with_kills(job, JOBS["primary_dies"][5], deadline)
    res = check_exact(job, [1])
    # shard 2 serves range 1 now, within 5 s of the kill; shard 0 lost range 0's backup (shard 1)
    # and went on without it
    assert stats(job, 2).get("takeovers") == 1, stats(job, 2)
    print(f"shard 2 took over range 1 {stats(job, 2)['took_over_at'] - killed:.2f} s after the kill")
    assert stats(job, 2)["took_over_at"] - killed < 5.0, stats(job, 2)["took_over_at"] - killed
    assert stats(job, 0).get("backups_dropped") == 1, stats(job, 0)
    assert stats(job, 0)["replicated"] > 0
    # save() after the failover: the file holds the same sums
    keys = [int(k) for k in res[0]["expected"]]
    decl = declaration(keys, [(3,)] * len(keys), torch.float64)
    saved = kv_snapshot.load(str(job.path.with_suffix(".snapshot")), decl)
    assert [t.tolist() for t in saved] == res[0]["final"]


def test_two_primaries_killed_in_a_row_with_three_copies_over_sm_barriers_go_on(jobs):
    started, deadline = jobs
    job = started["two_in_a_row"]
    run_with_kills(job, JOBS["two_in_a_row"][5], deadline)
    check_exact(job, [0, 1])
    # shard 2 serves all: range 1 (after shard 1), range 0 (after shard 0, directly or after shard 1)
    assert stats(job, 2).get("takeovers") == 2, stats(job, 2)


def test_every_copy_of_a_range_dead_is_a_clear_error_on_every_worker(jobs):
    started, deadline = jobs
    job = started["every_copy_dies"]
    killed = run_with_kills(job, JOBS["every_copy_dies"][5], deadline)
    assert job.ended - killed < 30, f"the job ended {job.ended - killed:.0f} s after the last kill"
    for r in job.results():
        assert r["error"] and "key range 1 (the keys k with k % 3 == 1) is lost" in r["error"], (r, job.output())
    assert all(job.procs[r].returncode == 3 for r in range(3, 5)), job.output()
    assert job.procs[0].returncode == 1, "shard 0 should have stopped with the job"


def test_the_replica_count_is_checked_and_the_argument_wins_over_the_environment(monkeypatch):
    from rdmaflow import InvalidArgumentError
    from rdmaflow.ps.context import REPLICAS_ENV, replica_count

    monkeypatch.delenv(REPLICAS_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the store outlives the shards
    assert replica_count(None, 3) == 1
    monkeypatch.setenv(REPLICAS_ENV, "2")
    assert replica_count(None, 3) == 2
    assert replica_count(3, 3) == 3  # the argument wins
    for bad, name in ((4, "replicas=4"), (0, "replicas=0"), (1.5, "replicas must"), (True, "replicas must")):
        with pytest.raises(InvalidArgumentError, match=name):
            replica_count(bad, 3)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # rank 0, a shard, would serve the store
    with pytest.raises(InvalidArgumentError, match="serves the job's store"):
        replica_count(2, 3)
    assert replica_count(1, 3) == 1
    monkeypatch.setenv(REPLICAS_ENV, "two")
    with pytest.raises(InvalidArgumentError, match=r"\$RDMAFLOW_SHARD_REPLICAS must be a whole number"):
        replica_count(None, 3)


def test_a_successor_redoes_the_last_whole_record_and_never_a_torn_one():
    """kv_replica.redo on a real layout: the record the commit word names (round, slot) is
    applied again when its in-place WRITEs may not have landed (commit's round > mround); a
    record being written into the other slot meanwhile is never read."""
    from types import SimpleNamespace

    from rdmaflow.ps.kv_layout import KVLayout, words
    from rdmaflow.ps.kv_replica import redo
    from rdmaflow.ps.kv_server import KVRange

    decl = declaration([0, 2, 4, 6], [(2,)] * 4, torch.float32)
    spec = KVLayout(decl, num_shards=2, num_workers=2, replicas=2)
    L = spec.shards[0]
    raw = torch.zeros(L.total, dtype=torch.uint8)
    rng = SimpleNamespace(layout=L, raw=raw, nw=2, spec=spec, stats={}, offsets=L.offsets.tolist(),
                          numels=L.numels.tolist(), stored=raw[: L.elements * 4].view(torch.float32))
    rng._where = KVRange._where.__get__(rng)
    rng._count = KVRange._count
    rng.stored[:] = 1.0
    words(raw, L.mapplied, 2)[:] = torch.tensor([3, 4])
    # round 7, in slot 1: keys 1 and 3 (local rows) set to 5.0, applied numbers 4 and 6
    head = words(raw, L.rec(1), 2 + 2 + 2)
    head[:] = torch.tensor([7, 2, 4, 6, 1, 3])
    raw[L.rec_values(1) : L.rec_values(1) + 16].view(torch.float32)[:] = 5.0
    words(raw, L.rec(0), 2)[:] = torch.tensor([8, 4])  # round 8 half written into slot 0: not committed
    words(raw, L.commit, 1)[0] = 7 << 1 | 1
    words(raw, L.mround, 1)[0] = 6
    assert redo(rng).tolist() == [4, 6]
    assert rng.stored.tolist() == [1, 1, 5, 5, 1, 1, 5, 5]
    rng.stored[:] = 2.0  # the in-place WRITEs had landed: mround == the commit's round, nothing redone
    words(raw, L.mround, 1)[0] = 7
    assert redo(rng).tolist() == [4, 6] and rng.stored.tolist() == [2.0] * 8


def test_a_distributed_optimizer_asked_for_replicas_where_they_are_not_built_refuses_and_aborts_the_job(monkeypatch):
    """The dense protocol replicates mode="sync" on CPU shards only: asked for copies elsewhere, it
    says so instead of running unreplicated."""
    from types import SimpleNamespace

    from rdmaflow import InvalidArgumentError, ps

    monkeypatch.delenv("RDMAFLOW_SHARD_REPLICAS", raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the store outlives the shards
    aborted = []
    ctx = SimpleNamespace(is_worker=True, kv_state=None, optimizer_state=None, shard_replicas=2,
                          role=SimpleNamespace(num_shards=2, index=0), store=SimpleNamespace(abort=aborted.append))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(InvalidArgumentError, match="mode='async' is not supported yet"):
        ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="async", ctx=ctx)
    assert aborted and "worker 0: replicated shards" in aborted[0]
