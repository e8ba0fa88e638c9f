"""``rdmaflow bench c10d`` runs end to end: one small cell over tcp, both systems, a CSV row per
repeat (the figures themselves are for docs/benchmarks.md, not for a test)."""
from __future__ import annotations

import csv

from rdmaflow.bench import c10d


def test_bench_c10d_writes_every_cell(tmp_path, capsys):
    rc = c10d.main(["--transport", "tcp", "--sizes", "1K", "--ranks", "2", "--repeats", "2",
                    "--ops", "pingpong,all_reduce", "--iterations", "20", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "c10d.csv") as f:
        rows = list(csv.DictReader(f))
    cells = {(r["op"], r["system"]) for r in rows}
    assert cells == {(op, s) for op in ("pingpong", "all_reduce") for s in ("rdmaflow", "gloo")}
    assert len(rows) == 8 and all(float(r["seconds"]) > 0 for r in rows)
    assert "gloo/rdmaflow" in capsys.readouterr().out
