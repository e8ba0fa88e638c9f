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

from rdmaflow.ps.sparse_table import Normal, TableFormat, TableView, entry_check, mix, place

JOB = pathlib.Path(__file__).parent / "ps_jobs" / "sparse.py"
DEADLINE = 240.0


def script(mode: str, read_path: str, out: pathlib.Path) -> str:
    return f"MODE, READ_PATH, OUT = {mode!r}, {read_path!r}, {str(out)!r}\n" + JOB.read_text()


# name: (mode, workers, shards, transport, read path)
MAIN = {"sm": ("main", 2, 2, "sm", "auto"), "tcp": ("main", 2, 2, "tcp", "read")}
# resuming each main job's snapshot: another shard count, and over tcp the request path
RESUME = {"sm": ("resume", 1, 1, "sm", "auto"), "tcp": ("resume", 1, 3, "tcp", "request")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sparse")
    started = {name: Job(f"sparse-{name}", script(mode, rp, tmp / f"{name}.snapshot"), nw, ns, tr, tmp)
               for name, (mode, nw, ns, tr, rp) in MAIN.items()}
    deadline = time.monotonic() + DEADLINE

    def get(name: str) -> Job:
        started[name].wait(deadline)
        return started[name]

    def resumed(name: str) -> Job:
        """The job resuming from ``name``'s snapshot; both start together once both main jobs ended."""
        if "resume-sm" not in started:
            for main, (mode, nw, ns, tr, rp) in RESUME.items():
                finished_ok(get(main))
                started[f"resume-{main}"] = Job(f"sparse-resume-{main}", script(mode, rp, tmp / f"{main}.snapshot"),
                                                nw, ns, tr, tmp)
        started[f"resume-{name}"].wait(deadline)
        return started[f"resume-{name}"]

    get.resumed = resumed
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
        assert r["batched_exact"], "a pull of many requests of batch_rows keys each reads back exactly"
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
        assert r["race_final"] == 2000.0
        # initializers: identical whichever worker read first, and as computed here
        assert r["init_rows"] == results[0]["init_rows"]
        # SparseAdagrad: acc = 0.1 + 1 + 4, row = 1 - 0.5*1/(sqrt(1.1)+eps) + 0.5*2/(sqrt(5.1)+eps)
        acc1, acc2 = 0.1 + 1.0, 0.1 + 1.0 + 4.0
        row = 1.0 - 0.5 * 1.0 / (acc1 ** 0.5 + 1e-6) + 0.5 * 2.0 / (acc2 ** 0.5 + 1e-6)
        assert r["adagrad"] == pytest.approx([row] * 3, rel=1e-5)
        assert r["user"] == [[4.0, 4.0], [6.0, 6.0]]   # duplicates summed, then the handler: 2 * pushed
        if w != 0:
            assert r["grow_wrong"] == 0 and r["grow_reads"] >= 5, r
            assert r["race_mixed"] == 0 and r["race_pulls"] >= 2000 and r["race_values"] > 2, r
    r0 = results[0]
    init = Normal(0.5, 2.0)
    for name, keys in (("A", [5, -7, 1 << 60, 99]), ("B", [6, -8, 1 << 61, 98])):
        want = init.values(torch.tensor(keys), 5, 3).to(torch.bfloat16).float()
        assert torch.equal(torch.tensor(r0["init_rows"][name]), want), name
    assert r0["init_plus_push"] == [(init.values(torch.tensor([5]), 5, 3).to(torch.bfloat16).float()
                                     + 1).to(torch.bfloat16).float().tolist()[0]]
    assert r0["full"].startswith("TableFullError memory=True") and "max_rows_per_shard=10" in r0["full"], r0
    assert r0["after_full"] == [[1.0] * 4] * 3   # the refused push applied nothing


@pytest.mark.parametrize("transport", ["sm", "tcp"])
def test_snapshot_resumes_with_another_shard_count(jobs, transport):
    (r,) = finished_ok(jobs.resumed(transport))
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


def test_placed_keys_are_found_and_a_mixed_copy_of_an_entry_fails_its_check():
    """No I/O: every placed key is found in its slot and absent ones are not; an entry copied
    partly before and partly after a write (any subset of its words) never matches its check."""
    fmt = TableFormat(16, torch.float32, 0)
    nb = 256
    view = TableView(torch.zeros(fmt.region_bytes(nb), dtype=torch.uint8), fmt, nb)
    fill = torch.zeros(nb, dtype=torch.int64)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (1500,), generator=torch.Generator().manual_seed(1))
    slots = place(fill, keys, nb)
    assert slots is not None and len(set(slots.tolist())) == len(keys)
    view.keys.view(-1, 2)[slots] = torch.stack([keys, torch.ones_like(keys)], 1)
    found, at = view.find(keys)
    assert bool(found.all()) and torch.equal(at, slots)
    assert not bool(view.find(keys + 1)[0].any())
    assert place(fill, torch.arange(10**4), nb) is None   # more than the slots: the table must grow
    old = torch.zeros(1, fmt.words, dtype=torch.int64)
    old[0, 1] = 77
    old[0, 0] = 2
    fmt.rows_of(old)[:] = 3.0
    old[0, 2] = entry_check(old, fmt.row_words)[0]
    new = old.clone()
    new[0, 0] = 4
    fmt.rows_of(new)[:] = 4.0
    new[0, 2] = entry_check(new, fmt.row_words)[0]
    g = torch.Generator().manual_seed(2)
    for _ in range(2000):
        take = torch.rand(fmt.words, generator=g) < 0.5
        mixed = torch.where(take, new, old)
        if torch.equal(mixed, old) or torch.equal(mixed, new):
            continue
        assert int(mixed[0, 2]) != int(entry_check(mixed, fmt.row_words)[0]), take
