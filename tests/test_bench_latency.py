"""``rdmaflow bench latency``: a short real run over tcp with every system, and the pieces of
its method. No timing assertions (this machine is shared and noisy)."""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import processes_with_env
from test_bench_transfer import ROOT, _env

from rdmaflow.bench import latency, latency_profile, perftest

SIZES = (8, 1 << 10)


@pytest.mark.timeout(240)
def test_tcp_run_end_to_end_writes_csv_and_plot(tmp_path):
    marker = os.urandom(8).hex()
    p = subprocess.run(
        [sys.executable, "-m", "rdmaflow", "bench", "latency", "--transport", "tcp", "--sizes", "8,1K",
         "--repeats", "2", "--iters", "20", "--settle", "0", "--out", str(tmp_path)],
        cwd=ROOT, env=_env(marker), capture_output=True, text=True, timeout=230, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert processes_with_env(marker) == [], "the benchmark left processes behind"
    assert "transport tcp" in p.stdout and "rdmaflow/ucx_perftest" in p.stdout and "rdmaflow/gloo" in p.stdout
    with open(tmp_path / "latency.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == latency.CSV_COLUMNS
    measured = {r["system"] for r in rows}
    expected = set(latency.SYSTEMS) - ({"nixl"} if latency.nixl_missing() else set())
    assert measured == expected, p.stdout
    if latency.nixl_missing():
        assert "nixl: not measured" in p.stdout  # said so, and no row
    assert {(r["system"], int(r["size_bytes"])) for r in rows} == {(s, n) for s in expected for n in SIZES}
    for r in rows:
        assert r["transport"] == "tcp" and r["status"] == "ok", r
        assert int(r["repeats"]) == 2 and int(r["iters"]) == 20, r
        assert len(r["values_handoff_ns"].split()) == 2, r  # the host probed around each repeat
        values = [float(r[c]) for c in ("one_way_us", "min_us", "max_us", "p10_us", "p90_us") if r[c] != ""]
        assert values and all(math.isfinite(v) and v > 0 for v in values), r
        assert float(r["min_us"]) <= float(r["one_way_us"]) <= float(r["max_us"])
        if r["p10_us"]:  # ucx_perftest reports no percentiles
            assert float(r["p10_us"]) <= float(r["p90_us"])
        assert r["system"] == "ucx_perftest" or r["p10_us"], r
        ratio = float(r["ratio_to_ucx_perftest"])
        assert math.isfinite(ratio) and ratio > 0
    png = tmp_path / "latency.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_iterations_and_summary():
    assert latency.iterations(8, 1000, 64 << 20) == (1000, 100)
    assert latency.iterations(1 << 20, 1000, 64 << 20) == (64, 10)  # capped by --max-bytes
    assert latency.iterations(1 << 30, 1000, 64 << 20) == (latency.MIN_ITERS, latency.MIN_ITERS)
    s = latency.one_way_summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median_us"] == 3.0 and s["p10_us"] == pytest.approx(1.4) and s["p90_us"] == pytest.approx(4.6)
    with pytest.raises(latency.BenchError):
        latency.one_way_summary([])


def test_ratios_and_bars():
    cell = latency.new_cell(10, 10)
    results = {("rdmaflow", "tcp", 1024): dict(cell, median_us=[30.0, 50.0]),
               ("gloo", "tcp", 1024): dict(cell, median_us=[100.0]),
               ("ucx_perftest", "tcp", 1024): dict(cell, median_us=[5.0])}
    assert latency.ratio(results, "tcp", 1024, "rdmaflow", "gloo") == pytest.approx(0.4)
    bars = {(b["peer"], b["verdict"]) for b in latency.check_bars(results, ["tcp"])}
    assert bars == {("gloo", "missed"), ("ucx_perftest", "missed")}  # 0.4 > 0.25; 8 > 4
    text = latency.format_bars(latency.check_bars(results, ["tcp"]))  # in the user's terms
    assert "target" in text and "<= 0.25x" in text and "missed" in text and "issue" not in text
    assert latency.check_bars(results, ["sm"]) == []


def test_parse_perftest_latency():
    out = ("+----+\niterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n"
           "1000,12.909,14.061,14.061,69.45,69.45,71119,71119\n")
    r = perftest._parse_latency(out)
    assert r["median_s"] == pytest.approx(12.909e-6) and r["avg_s"] == pytest.approx(14.061e-6)
    with pytest.raises(RuntimeError):
        perftest._parse_latency("garbage\n")


def test_a_cell_with_a_repeat_in_a_slow_phase_is_marked():
    results = {}
    for system, handoffs in (("rdmaflow", [30.0, 170.0]), ("gloo", [31.0, 30.0])):
        cell = results[(system, "tcp", 8)] = latency.new_cell(10, 1)
        cell["median_us"], cell["handoff_ns"] = [10.0, 11.0], handoffs
    table = latency.format_table(results, "tcp", ["rdmaflow", "gloo"], [8], 2, {})
    row = next(line for line in table.splitlines() if line.strip().startswith("8 "))
    assert row.count("~") == 1 and "slow phase of the host" in table and "(30 ns)" in table
    assert {r["system"]: r["values_handoff_ns"] for r in latency.csv_rows(results)}["rdmaflow"] == "30 170"


def test_rejects_bad_arguments(capsys):
    ap = argparse.ArgumentParser()
    latency.add_arguments(ap)
    for argv in (["--transport", "ib"], ["--systems", "mpi"], ["--sizes", "0"], ["--repeats", "0"], ["--settle", "-1"]):
        assert latency.run(ap.parse_args(argv)) == 2, argv
        assert "error:" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_profile_times_every_phase_of_both_directions(tmp_path):
    marker = os.urandom(8).hex()
    p = subprocess.run(
        [sys.executable, "-m", "rdmaflow", "bench", "latency", "--profile", "--transport", "sm", "--iters", "30",
         "--out", str(tmp_path)],
        cwd=ROOT, env=_env(marker), capture_output=True, text=True, timeout=170, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert processes_with_env(marker) == []
    with open(tmp_path / "latency_profile.json") as f:
        doc = json.load(f)
    assert set(doc) == {"sm/1024/wait", "sm/1024/spin"}
    for run in doc.values():
        n = 30 + run["warmup"]
        for side in ("ping", "pong"):
            stamps = run[side]["stamps"]
            # sm takes the same-host direct path: credit, copy and flag are one call (the
            # flag_post stamps), so there is no separate credit step to time.
            for name in ("send_call", "flag_post_start", "flag_post_end", "send_return", "recv_call",
                         "wait_start", "flag_seen", "recv_return"):
                assert len(stamps[name]) == n, (side, name)
            assert not stamps.get("credit"), side
            assert any(t["name"] == "MainThread" and t["cpu_ns"] > 0 for t in run[side]["threads"])
        samples = latency_profile.phase_samples(run["ping"], run["pong"], run["warmup"])
        one_way = samples["one way: send() called -> recv() returned"]
        assert len(one_way) == 2 * 30 and all(math.isfinite(v) and v > 0 for v in one_way)
    for phase, _, _ in latency_profile.PHASES:
        assert phase in p.stdout
