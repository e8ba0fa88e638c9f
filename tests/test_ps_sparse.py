"""Sparse tables (rdmaflow.ps.SparseTable) in real jobs over UCX tcp and shared memory.

tests/ps_jobs/sparse.py checks many things in one job (exact sums against a dict of the same
pushes from several workers, a pull racing pushes of one key, reads while the table grows,
initializers, a full table, bad input, the shard's request counter, SparseAdagrad, a user's
handler, a snapshot); a second job of another shard count resumes from the snapshot. Both
main jobs start together with the module; each test waits for its own.
"""
from __future__ import annotations

import pathlib
import time

import pytest
import torch
from test_ps_kv import Job, finished_ok

from rdmaflow.ps.sparse_table import Normal, mix

JOB = pathlib.Path(__file__).parent / "ps_jobs" / "sparse.py"
DEADLINE = 240.0


def script(mode: str, read_path: str, out: pathlib.Path) -> str:
    return f"MODE, READ_PATH, OUT = {mode!r}, {read_path!r}, {str(out)!r}\n" + JOB.read_text()


# name: (mode, workers, shards, transport, read path)
MAIN = {"sm": ("main", 2, 2, "sm", "auto"), "tcp": ("main", 2, 2, "tcp", "read")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sparse")
    started = {name: Job(f"sparse-{name}", script(mode, rp, tmp / f"{name}.snapshot"), nw, ns, tr, tmp)
               for name, (mode, nw, ns, tr, rp) in MAIN.items()}
    deadline = time.monotonic() + DEADLINE

    def get(name: str) -> Job:
        started[name].wait(deadline)
        return started[name]

    get.tmp = tmp
    try:
        yield get
    finally:
        for job in started.values():
            job.kill()


@pytest.mark.parametrize("transport", ["sm", "tcp"])
def test_sparse_table_job(jobs, transport):
    results = finished_ok(jobs(transport))
    for w, r in enumerate(results):
        # every row pushed by both workers, read back exactly (every byte), on every worker
        assert r["exact"] and r["rows"] > 1000, r
        # bad input: InvalidArgumentError naming the problem, nothing sent
        e = r["errors"]
        assert all(v != "no error" for v in e.values()), e
        assert "int64" in e["float_keys"] and "keys" in e["int32_keys"] and "int32" in e["int32_keys"]
        assert "[2, 8]" in e["wrong_row_shape"] and "[2, 7]" in e["wrong_row_shape"]
        assert "float64" in e["wrong_dtype"] and "'nope'" in e["unknown_handler"] and "fast" in e["bad_read_path"]
        # present keys pulled one-sided: the shards served no request
        before, after = r["requests_before_after"]
        assert before == after and r["one_sided_rows"] >= 3 * r["rows"], r
        # the table grew (a new region, epoch > 1) while the other worker read: never a wrong row
        assert max(r["epochs_after_growth"]) > max(r["epochs"]) >= 1, r
        # races: every pulled row wholly old or wholly new, never older than one read before
        assert r["race_final"] == 1500.0
        # initializers: identical whichever worker read first, and as computed here
        assert r["init_rows"] == results[0]["init_rows"]
        # SparseAdagrad: acc = 0.1 + 1 + 4, row = 1 - 0.5*1/(sqrt(1.1)+eps) + 0.5*2/(sqrt(5.1)+eps)
        acc1, acc2 = 0.1 + 1.0, 0.1 + 1.0 + 4.0
        row = 1.0 - 0.5 * 1.0 / (acc1 ** 0.5 + 1e-6) + 0.5 * 2.0 / (acc2 ** 0.5 + 1e-6)
        assert r["adagrad"] == pytest.approx([row] * 3, rel=1e-5)
        assert r["user"] == [[4.0, 4.0], [6.0, 6.0]]   # duplicates summed, then the handler: 2 * pushed
        if w != 0:
            assert r["grow_wrong"] == 0 and r["grow_reads"] >= 5, r
            assert r["race_mixed"] == 0 and r["race_pulls"] >= 1500 and r["race_values"] > 2, r
    r0 = results[0]
    init = Normal(0.5, 2.0)
    for name, keys in (("A", [5, -7, 1 << 60, 99]), ("B", [6, -8, 1 << 61, 98])):
        want = init.values(torch.tensor(keys), 5, 3).to(torch.bfloat16).float()
        assert torch.equal(torch.tensor(r0["init_rows"][name]), want), name
    assert r0["init_plus_push"] == [(init.values(torch.tensor([5]), 5, 3).to(torch.bfloat16).float()
                                     + 1).to(torch.bfloat16).float().tolist()[0]]
    assert r0["full"].startswith("TableFullError memory=True") and "max_rows_per_shard=10" in r0["full"], r0
    assert r0["after_full"] == [[1.0] * 4] * 3   # the refused push applied nothing


@pytest.mark.parametrize("transport,shards,read_path", [("sm", 1, "auto"), ("tcp", 3, "request")])
def test_snapshot_resumes_with_another_shard_count(jobs, transport, shards, read_path):
    finished_ok(jobs(transport))
    out = jobs.tmp / f"{transport}.snapshot"
    job = Job(f"sparse-resume-{transport}", script("resume", read_path, out), 1, shards, transport, jobs.tmp)
    job.wait(time.monotonic() + 120)
    (r,) = finished_ok(job)
    assert r["resumed_equal"] and r["resumed_rows"] > 1000, r


def test_hash_words_wrap_as_unsigned_64_bit_arithmetic():
    """The hashes both sides compute with torch match splitmix64 modulo 2**64."""
    m = (1 << 64) - 1

    def ref(v):
        v &= m
        v ^= v >> 30
        v = (v * 0xBF58476D1CE4E5B9) & m
        v ^= v >> 27
        v = (v * 0x94D049BB133111EB) & m
        return v ^ (v >> 31)

    x = torch.tensor([0, 1, -5, (1 << 62) + 12345, -(1 << 63)], dtype=torch.int64)
    assert [int(t) & m for t in mix(x)] == [ref(int(t)) for t in x]
