"""``rdmaflow bench kv --sparse`` at a tiny size over tcp: every system measured in one run, every
cell in the CSV, and after the same pushes every system pulls the same rows (no timing is
asserted: a smoke run)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

from rdmaflow.bench.kv_sparse import SYSTEMS


def test_bench_kv_sparse_runs_every_system_and_their_rows_agree(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "kv", "--sparse", "--quick", "--transport", "tcp",
                        "--rows", "3000", "--dims", "8", "--keys", "256", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "kv-sparse.csv") as f:
        rows = list(csv.DictReader(f))
    cells = {(row["system"], row["op"]): row for row in rows}
    for system in SYSTEMS:
        for op in ("pull", "push"):
            row = cells[(system, op)]
            assert row["status"] == "ok" and float(row["median_ms"]) > 0, row
            assert (row["transport"], row["rows"], row["dim"], row["keys"]) == ("tcp", "3000", "8", "256"), row
            assert row["values"] == "agree", row
    assert float(cells[("declared", "pull")]["vs_declared"]) == 1.0
    perf = cells[("ucx_perftest ucp_get", "get")]
    assert perf["status"] == "ok" and "gets/s of 32 B" in perf["note"], perf
    doc = json.loads((out / "kv-sparse.json").read_text())
    checks = {c["system"]: c["check"] for c in doc["cells"]}
    assert set(checks) == set(SYSTEMS)
    assert len({c["sha256"] for c in checks.values()}) == 1, checks
    assert all(c["shape"] == [256 + 256, 8] and c["sum"] > 0 for c in checks.values()), checks
    read = next(c for c in doc["cells"] if c["system"] == "sparse-read")
    assert read["stats"].get("requests", 0) == 0, read  # present keys: the READ path asked the shard nothing
