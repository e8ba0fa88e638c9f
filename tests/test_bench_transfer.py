"""``rdmaflow bench transfer``: a short real run over tcp, the report with a failing system,
and clean-up on Ctrl-C. No timing assertions (this machine is shared and noisy)."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import processes_with_env as _processes_with_env

from rdmaflow.bench import transfer
from rdmaflow.bench.harness import write_csv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("system", "transport", "size_bytes", "gb_per_s", "p50_us", "gb_per_s_min",
            "gb_per_s_max", "gb_per_s_iqr", "repeats", "status")


def _stopped(marker: str) -> int:
    n = 0
    for pid in _processes_with_env(marker):
        try:
            with open(f"/proc/{pid}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "T"
        except OSError:
            pass
    return n


def _env(marker: str) -> dict[str, str]:
    env = dict(os.environ)
    env["RDMAFLOW_TEST_MARK"] = marker
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.timeout(120)
def test_quick_tcp_run_writes_csv_and_plot(tmp_path):
    marker = os.urandom(8).hex()
    systems = "rdmaflow-zerocopy,rdmaflow-copy,rdmaflow-dynamic,gloo,ucx-perftest-put,memcpy"
    p = subprocess.run(
        [sys.executable, "-m", "rdmaflow.bench.transfer", "--quick", "--transport", "tcp",
         "--systems", systems, "--sizes", "64K,16M", "--out", str(tmp_path)],
        cwd=ROOT, env=_env(marker), capture_output=True, text=True, timeout=110, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert _processes_with_env(marker) == [], "the benchmark left processes behind"
    assert "transport tcp" in p.stdout
    assert "rdmaflow-zerocopy / rdmaflow-copy" in p.stdout  # an acceptance ratio line (16M)
    with open(tmp_path / "transfer.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for col in REQUIRED:
        assert col in rows[0], col
    assert {(r["system"], int(r["size_bytes"])) for r in rows} == {
        (s, n) for s in systems.split(",") for n in (64 << 10, 16 << 20)}
    for r in rows:
        assert r["transport"] == "tcp"
        assert r["status"] == "ok", r
        assert int(r["repeats"]) == transfer.QUICK_REPEATS
        assert 0 < float(r["gb_per_s_min"]) <= float(r["gb_per_s"]) <= float(r["gb_per_s_max"])
        if r["system"] != "ucx-perftest-put":  # perftest reports bandwidth only
            assert float(r["p50_us"]) > 0
    png = tmp_path / "transfer.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_grpc_and_tensorpipe_smoke(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "rdmaflow.bench.transfer", "--quick", "--transport", "tcp",
         "--systems", "grpc-protobuf,tensorpipe", "--sizes", "64K", "--repeats", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, env=_env(os.urandom(8).hex()), capture_output=True, text=True, timeout=55, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "transfer.csv", newline="") as f:
        rows = {r["system"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"grpc-protobuf", "tensorpipe"}
    assert all(float(r["gb_per_s"]) > 0 and float(r["p50_us"]) > 0 for r in rows.values())


class _Fake(transfer.System):
    def __init__(self, name, transport, gbps):
        super().__init__(name, transport)
        self.gbps = gbps
        self.closed = 0

    def measure(self, size, count, warmup, window, timeout, tag):
        if self.gbps is None:
            raise transfer.BenchError("boom: receiver exited")
        return {"gb_per_s": self.gbps, "p50_us": size / self.gbps / 1e3}

    def close(self):
        self.closed += 1


def test_failed_system_is_reported_and_the_run_goes_on(monkeypatch, tmp_path):
    speeds = {"rdmaflow-zerocopy": 4.0, "rdmaflow-copy": 2.0, "gloo": None, "tensorpipe": 1.0}
    made = {}

    def fake(name, transport, **kw):
        made[name] = _Fake(name, transport, speeds[name])
        return made[name]

    monkeypatch.setattr(transfer, "make_system", fake)
    results = {}
    sizes = [16 << 20, 64 << 20]
    transfer.bench_transport("tcp", list(speeds), sizes, repeats=3, target_bytes=1 << 20,
                             min_iters=1, max_iters=4, window=2, max_inflight=1 << 30,
                             busy_poll=False, timeout=5, torch_threads=1, results=results,
                             log=lambda s: None)
    assert all(m.closed >= 1 for m in made.values())  # everything closed at the end
    assert results[("gloo", "tcp", 16 << 20)]["gb_per_s"] == []
    assert "boom" in results[("gloo", "tcp", 16 << 20)]["errors"][0]
    assert len(results[("rdmaflow-zerocopy", "tcp", 64 << 20)]["gb_per_s"]) == 3
    table = transfer.format_tables(results, "tcp", list(speeds), sizes, 3)
    assert "failed" in table and "boom" in table
    rows = {(r["den"], r["size"]): r for r in transfer.acceptance(results, ["tcp"])}
    assert rows[("tensorpipe", 16 << 20)]["verdict"] == "PASS"   # 4.0 / 1.0 >= 1.5
    assert rows[("rdmaflow-copy", 16 << 20)]["verdict"] == "PASS"  # 4.0 / 2.0 >= 1.2
    assert rows[("gloo", 16 << 20)]["verdict"] == "n/a"
    path = tmp_path / "t.csv"
    write_csv(str(path), transfer.CSV_COLUMNS, transfer.csv_rows(results))
    with open(path, newline="") as f:
        status = {(r["system"], int(r["size_bytes"])): r["status"] for r in csv.DictReader(f)}
    assert status[("gloo", 16 << 20)].startswith("failed: boom")
    assert status[("tensorpipe", 64 << 20)] == "ok"
    transfer.plot(str(tmp_path / "t.png"), results, ["tcp"], list(speeds), sizes)
    assert (tmp_path / "t.png").stat().st_size > 0


def test_parameters():
    assert transfer.iterations(1 << 10, 256 << 20, 2, 1000) == 1000
    assert transfer.iterations(16 << 20, 256 << 20, 2, 1000) == 16
    assert transfer.iterations(1 << 30, 256 << 20, 1, 1000) == 1
    assert transfer.warmup_of(1000) == 100 and transfer.warmup_of(2) == 1
    assert transfer.window_of(1 << 30, 2, 1 << 30) == 1
    assert transfer.window_of(256 << 20, 2, 1 << 30) == 2
    sizes = [1 << 20, 1 << 30]
    # Static receivers hold `window` slots; the copy sender `window` staging buffers.
    assert transfer.arena_bytes("rdmaflow-zerocopy", "receiver", sizes, 2, 1 << 30) >= 1 << 30
    assert transfer.arena_bytes("rdmaflow-copy", "sender", [256 << 20], 2, 1 << 30) >= 512 << 20
    assert transfer.arena_bytes("rdmaflow-zerocopy", "sender", [256 << 20], 2, 1 << 30) < 512 << 20
    # One pair per size for the whole run: the sizes add up.
    assert transfer.arena_bytes("rdmaflow-zerocopy", "sender", [1 << 20, 4 << 20], 2, 1 << 30) >= 5 << 20
    assert transfer.arena_bytes("rdmaflow-dynamic", "receiver", sizes, 2, 1 << 30) < (1 << 30) + (64 << 20)


def test_rejects_bad_arguments():
    assert transfer.main(["--sizes", "0"]) == 2
    assert transfer.main(["--sizes", "6"]) == 2
    assert transfer.main(["--systems", "nope"]) == 2
    assert transfer.main(["--transport", "ib"]) == 2


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_process(tmp_path):
    marker = os.urandom(8).hex()
    p = subprocess.Popen(
        [sys.executable, "-m", "rdmaflow.bench.transfer", "--transport", "tcp",
         "--systems", "rdmaflow-zerocopy,gloo,grpc-protobuf", "--sizes", "1K,64M",
         "--repeats", "50", "--out", str(tmp_path)],
        cwd=ROOT, env=_env(marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_processes_with_env(marker)) < 7 and time.monotonic() < deadline:
            time.sleep(0.2)  # driver + 3 pairs
        assert len(_processes_with_env(marker)) >= 7, "the worker processes did not start"
        time.sleep(2.0)  # well inside the measurements
        # Systems not being measured are stopped (SIGSTOP), so that they cannot steal the CPU.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _stopped(marker) < 2:
            time.sleep(0.1)
        assert _stopped(marker) >= 2, "idle systems were not paused"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, out[-2000:] + err[-2000:]
    assert "interrupted" in err
    deadline = time.monotonic() + 10
    while _processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with_env(marker) == [], "processes left behind after Ctrl-C"


def test_cli_help():
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "transfer", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert "usage: rdmaflow bench transfer" in p.stdout and "--systems" in p.stdout


def test_cell_budget_stops_slow_cells_at_three_repeats(monkeypatch):
    class Slow(_Fake):
        def measure(self, size, count, warmup, window, timeout, tag):
            time.sleep(0.02 if self.name == "grpc-protobuf" else 0)
            return super().measure(size, count, warmup, window, timeout, tag)

    monkeypatch.setattr(transfer, "make_system", lambda name, transport, **kw: Slow(name, transport, 1.0))
    results = {}
    transfer.bench_transport("sm", ["rdmaflow-zerocopy", "grpc-protobuf"], [1 << 20], repeats=5,
                             target_bytes=1 << 20, min_iters=1, max_iters=4, window=2,
                             max_inflight=1 << 30, busy_poll=False, timeout=5, torch_threads=1,
                             results=results, log=lambda s: None, cell_budget=0.01)
    assert len(results[("grpc-protobuf", "sm", 1 << 20)]["gb_per_s"]) == transfer.MIN_REPEATS
    assert len(results[("rdmaflow-zerocopy", "sm", 1 << 20)]["gb_per_s"]) == 5
    assert "^ fewer repeats" in transfer.format_tables(results, "sm", ["rdmaflow-zerocopy", "grpc-protobuf"],
                                                       [1 << 20], 5)


@pytest.mark.timeout(150)
@pytest.mark.skipif(not transfer.default_systems().count("nixl"), reason="NIXL is not installed (scripts/setup.sh)")
def test_nixl_peer(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "rdmaflow.bench.transfer", "--quick", "--transport", "tcp,sm", "--systems", "nixl",
         "--sizes", "4K,1M", "--out", str(tmp_path)],
        check=False, cwd=ROOT, env=_env(os.urandom(8).hex()), capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "transfer.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["transport"], int(r["size_bytes"])) for r in rows} == {
        (t, n) for t in ("tcp", "sm") for n in (4 << 10, 1 << 20)}
    for r in rows:  # every received tensor had the right max, or the status would say so
        assert r["system"] == "nixl" and r["status"] == "ok" and float(r["gb_per_s"]) > 0, r
