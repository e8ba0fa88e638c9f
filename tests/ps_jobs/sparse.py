# A sparse-table job (rdmaflow.ps.SparseTable) that checks many things in one run; the test
# (tests/test_ps_sparse.py) prepends MODE, READ_PATH and OUT and reads each worker's RESULT line.
# MODE "main": several workers push and pull concurrently (exact sums against a dict of the same
# pushes), a pull races pushes of one key, rows are read while the table grows, initializers,
# a full table, bad input, the shard's request counter, SparseAdagrad, then save() to OUT.
# MODE "resume": a job of another shard count starts from OUT's snapshot and checks every row.
import json
import sys

import torch

from rdmaflow import InvalidArgumentError, ps


def report(**res):
    print("RESULT " + json.dumps(res), flush=True)


def pushes_of(worker: int, rounds: int, n: int):
    """Worker's pushes: keys of any int64 (negative, large, repeated), integer-valued rows, so
    that sums are exact in float32 whatever the order."""
    g = torch.Generator().manual_seed(100 + worker)
    out = []
    for _ in range(rounds):
        keys = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)
        keys[: n // 4] = torch.randint(0, 50, (n // 4,), generator=g)   # shared, and repeated
        vals = torch.randint(-8, 9, (n, 8), generator=g).to(torch.float32)
        out.append((keys, vals))
    return out


ctx = ps.init(sparse_handlers={"scale_set": lambda keys, rows, pushed: pushed * 2})
w, nw = ctx.role.index, ctx.role.num_workers
res = {}

if MODE == "resume":  # noqa: F821 - prepended by the test
    table = ps.SparseTable("emb", dim=8, init=OUT, initial_rows=64, read_path=READ_PATH)  # noqa: F821
    expected = torch.load(OUT + ".expected.pt")  # noqa: F821
    got = table.wait(table.pull(expected["keys"]))
    res["resumed_equal"] = bool(torch.equal(got, expected["rows"]))
    res["resumed_rows"] = len(expected["keys"])
    table.close()
    report(**res)
    sys.exit(0)

emb = ps.SparseTable("emb", dim=8, initial_rows=64, read_path=READ_PATH)  # noqa: F821 - grows several times
race = ps.SparseTable("race", dim=16, read_path=READ_PATH)  # noqa: F821
inits = ps.SparseTable("inits", dim=5, dtype=torch.bfloat16, initializer=ps.Normal(0.5, 2.0), seed=3,
                       read_path=READ_PATH)  # noqa: F821
small = ps.SparseTable("small", dim=4, max_rows_per_shard=10, read_path=READ_PATH)  # noqa: F821
ada = ps.SparseTable("ada", dim=3, handler=ps.SparseAdagrad(lr=0.5, eps=1e-6, initial_accumulator_value=0.1),
                     initializer=ps.Constant(1.0), read_path=READ_PATH)  # noqa: F821
user = ps.SparseTable("user", dim=2, dtype=torch.float16, handler="scale_set", read_path=READ_PATH)  # noqa: F821
# requests of at most 48 rows: a pull's READs land for a whole batch (every bucket choice of 48 keys)
batched = ps.SparseTable("batched", dim=8, batch_rows=48, read_path=READ_PATH)  # noqa: F821

# -- bad input, before anything moves ------------------------------------------------------------------
bad = {
    "float_keys": lambda: emb.push(torch.zeros(2), torch.zeros(2, 8)),
    "int32_keys": lambda: emb.pull(torch.zeros(2, dtype=torch.int32)),
    "list_keys": lambda: emb.pull([1, 2]),
    "2d_keys": lambda: emb.pull(torch.zeros(2, 2, dtype=torch.int64)),
    "wrong_row_shape": lambda: emb.push(torch.tensor([1, 2]), torch.zeros(2, 7)),
    "wrong_row_count": lambda: emb.push(torch.tensor([1, 2]), torch.zeros(3, 8)),
    "wrong_dtype": lambda: emb.push(torch.tensor([1, 2]), torch.zeros(2, 8, dtype=torch.float64)),
    "bad_handle": lambda: emb.wait("nope"),
    "unknown_handler": lambda: ps.SparseTable("x", dim=2, handler="nope"),
    "bad_read_path": lambda: ps.SparseTable("x", dim=2, read_path="fast"),
    "bad_dtype": lambda: ps.SparseTable("x", dim=2, dtype=torch.int64),
}
errors = {}
for name, fn in bad.items():
    try:
        fn()
        errors[name] = "no error"
    except InvalidArgumentError as e:
        errors[name] = str(e)
res["errors"] = errors

# -- every pushed row reads back exactly, with concurrent pushes and pulls of several workers ---------
mine = pushes_of(w, rounds=6, n=300)
handles = []
for i, (k, v) in enumerate(mine):
    handles.append(emb.push(k, v))
    if i % 2:  # pulls meanwhile: read-your-writes of this worker's pushes
        got = emb.wait(emb.pull(k))
        assert bool((got == got.round()).all()), "a pulled row is not a sum of integer rows"
for h in handles:
    emb.wait(h)
emb.barrier()
expected = {}
for v_ in range(nw):
    for k, v in pushes_of(v_, rounds=6, n=300):
        for key, row in zip(k.tolist(), v):
            expected[key] = expected.get(key, torch.zeros(8)) + row
keys = torch.tensor(sorted(expected), dtype=torch.int64)
want = torch.stack([expected[k] for k in keys.tolist()])
got = emb.wait(emb.pull(keys))
res["exact"] = bool(torch.equal(got, want))
res["rows"] = len(keys)
emb.barrier()
if w == 0:
    batched.wait(batched.push(keys, want))
batched.barrier()
res["batched_exact"] = bool(torch.equal(batched.wait(batched.pull(keys)), want))

# -- a pull of present keys on the one-sided path sends no request (between barriers: no one else) ---
before = emb.stats()
for _ in range(3):
    emb.wait(emb.pull(keys))
after = emb.stats()
res["requests_before_after"] = [before["requests"], after["requests"]]
res["one_sided_rows"] = after["one_sided_rows"] - before["one_sided_rows"]
res["epochs"] = [s["epoch"] for s in after["shards"]]
emb.barrier()

# -- rows read while the table grows: worker 0 inserts many keys, the others read fixed ones ------------
fixed = keys[:64]
fixed_want = want[:64]
if w == 0:
    g = torch.Generator().manual_seed(7)
    for _ in range(30):
        emb.wait(emb.push(torch.randint(1 << 40, 1 << 50, (200,), generator=g), torch.ones(200, 8)))
    ctx.store.set("sparse-test/grown", "1")
else:
    wrong, reads = 0, 0
    while not ctx.store.check("sparse-test/grown") or reads < 5:
        got = emb.wait(emb.pull(fixed))
        wrong += int((got != fixed_want).any(1).sum())
        reads += 1
    res["grow_reads"], res["grow_wrong"] = reads, wrong
emb.barrier()
st = emb.stats()
res["epochs_after_growth"] = [s["epoch"] for s in st["shards"]]
res["stale"] = st["stale"]

# -- a pull racing pushes of the same key: wholly old or wholly new, never a mix ----------------------
K = torch.tensor([12345], dtype=torch.int64)
ITER = 2000
if w == 0:
    hs = []
    for i in range(ITER):
        hs.append(race.push(K, torch.ones(1, 16)))   # row i: all elements equal i
        if len(hs) > 8:
            race.wait(hs.pop(0))
    for h in hs:
        race.wait(h)
    ctx.store.set("sparse-test/raced", "1")
else:
    mixed, last, seen, pulls = 0, -1.0, set(), 0
    while not ctx.store.check("sparse-test/raced") or pulls < ITER:
        row = race.wait(race.pull(K))[0]
        pulls += 1
        if not bool((row == row[0]).all()):
            mixed += 1
        v = float(row[0])
        if v < last:
            mixed += 1   # a row older than one read before
        last = v
        seen.add(v)
    res["race_pulls"], res["race_mixed"], res["race_values"] = pulls, mixed, len(seen)
race.barrier()
res["race_final"] = float(race.wait(race.pull(K))[0, 0])
res["race_torn_retried"] = race.stats()["torn"]

# -- initializers: the same whichever worker reads first --------------------------------------------
A = torch.tensor([5, -7, 1 << 60, 99], dtype=torch.int64)
B = torch.tensor([6, -8, 1 << 61, 98], dtype=torch.int64)
first = A if w == 0 else B
r1 = inits.wait(inits.pull(first))
inits.barrier()
r2 = inits.wait(inits.pull(B if w == 0 else A))
res["init_rows"] = {"A": (r1 if w == 0 else r2).float().tolist(), "B": (r2 if w == 0 else r1).float().tolist()}
inits.barrier()
if w == 0:
    inits.wait(inits.push(A[:1], torch.ones(1, 5, dtype=torch.bfloat16)))
inits.barrier()
res["init_plus_push"] = inits.wait(inits.pull(A[:1])).float().tolist()

# -- a full table ------------------------------------------------------------------------------------
if w == 0:
    small.wait(small.push(torch.arange(3), torch.ones(3, 4)))
    try:
        small.wait(small.push(torch.arange(100, 200), torch.ones(100, 4)))
        res["full"] = "no error"
    except ps.TableFullError as e:
        res["full"] = f"{type(e).__name__} memory={isinstance(e, MemoryError)}: {e}"
    res["after_full"] = small.wait(small.pull(torch.arange(3))).tolist()
small.barrier()

# -- SparseAdagrad and a user's handler ---------------------------------------------------------------
if w == 0:
    for gval in (1.0, -2.0):
        ada.wait(ada.push(torch.tensor([42, 42]), torch.full((2, 3), gval / 2)))   # duplicates: summed
    user.wait(user.push(torch.tensor([1, 1, 2]), torch.tensor([[1.0, 2.0], [1.0, 0.0], [3.0, 3.0]]).half()))
ada.barrier()
res["adagrad"] = ada.wait(ada.pull(torch.tensor([42])))[0].tolist()
res["user"] = user.wait(user.pull(torch.tensor([1, 2]))).float().tolist()

# -- a snapshot of "emb", for a job of another shard count --------------------------------------------
emb.save(OUT)  # noqa: F821
if w == 0:
    snap_keys = torch.cat([keys, torch.tensor([123456789], dtype=torch.int64)])
    torch.save({"keys": snap_keys, "rows": emb.wait(emb.pull(snap_keys))}, OUT + ".expected.pt")  # noqa: F821
for t in (emb, race, inits, small, ada, user, batched):
    t.barrier()
    t.close()
report(**res)
