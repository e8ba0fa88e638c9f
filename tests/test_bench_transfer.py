"""``rdmaflow bench transfer``: a short real run over tcp, the report with a failing system,
and clean-up on Ctrl-C. No timing assertions (this machine is shared and noisy)."""
from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import processes_with_env as _processes_with_env

from rdmaflow.bench import processes, transfer
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
    assert rows[("tensorpipe", 16 << 20)]["verdict"] == "met"   # 4.0 / 1.0 >= 1.5
    assert rows[("rdmaflow-copy", 16 << 20)]["verdict"] == "met"  # 4.0 / 2.0 >= 1.2
    assert rows[("gloo", 16 << 20)]["verdict"] == "n/a"
    path = tmp_path / "t.csv"
    write_csv(str(path), transfer.CSV_COLUMNS, transfer.csv_rows(results))
    with open(path, newline="") as f:
        status = {(r["system"], int(r["size_bytes"])): r["status"] for r in csv.DictReader(f)}
    assert status[("gloo", 16 << 20)].startswith("failed: boom")
    assert status[("tensorpipe", 64 << 20)] == "ok"
    transfer.plot(str(tmp_path / "t.png"), results, ["tcp"], list(speeds), sizes)
    assert (tmp_path / "t.png").stat().st_size > 0


def test_a_cell_measured_while_the_host_handed_lines_slowly_is_marked(monkeypatch, tmp_path):
    """Each measurement records the slower of the handoff probes around it; a cell with a repeat
    at twice the run's fastest handoff or more is marked, and the CSV keeps every repeat's."""
    monkeypatch.setattr(transfer, "make_system", lambda name, transport, **kw: _Fake(name, transport, 2.0))
    probes = iter([30.0, 31.0, 165.0, 29.0] + [30.0] * 100)  # before/after: gloo's first repeat is slow
    monkeypatch.setattr(processes, "handoff_ns", lambda: next(probes))
    results = {}
    sizes = [1 << 20]
    transfer.bench_transport("tcp", ["rdmaflow-zerocopy", "gloo"], sizes, repeats=2, target_bytes=1 << 20,
                             min_iters=1, max_iters=4, window=2, max_inflight=1 << 30, busy_poll=False,
                             timeout=5, torch_threads=1, results=results, log=lambda s: None)
    slow = results[("gloo", "tcp", 1 << 20)]
    assert slow["handoff_ns"][0] == 165.0 and results[("rdmaflow-zerocopy", "tcp", 1 << 20)]["handoff_ns"] == [31.0, 30.0]
    table = transfer.format_tables(results, "tcp", ["rdmaflow-zerocopy", "gloo"], sizes, 2)
    row = next(line for line in table.splitlines() if line.strip().startswith("1M"))
    assert row.count("~") == 1 and row.rstrip().endswith("~")  # gloo's cell, the last column
    assert "slow phase of the host" in table and "(30 ns)" in table
    rows = {r["system"]: r for r in transfer.csv_rows(results)}
    assert rows["gloo"]["values_handoff_ns"] == "165 30"


def test_a_measurement_waits_bounded_for_the_host_to_leave_a_slow_phase(monkeypatch):
    """--settle: before a measurement the probe repeats (idle in between) until the handoff is
    within 2x of the fastest seen, or the time is up; either way the measurement runs."""
    monkeypatch.setattr(transfer, "make_system", lambda name, transport, **kw: _Fake(name, transport, 2.0))
    monkeypatch.setattr(processes, "SETTLE_STEP", 0.0)
    probes = iter([30.0, 30.0, 170.0, 165.0, 31.0, 32.0])
    calls = []
    monkeypatch.setattr(processes, "handoff_ns", lambda: calls.append(1) or next(probes, 170.0))
    results = {}
    kw = {"target_bytes": 1 << 20, "min_iters": 1, "max_iters": 4, "window": 2, "max_inflight": 1 << 30,
          "busy_poll": False, "timeout": 5, "torch_threads": 1, "results": results, "log": lambda s: None}
    transfer.bench_transport("tcp", ["gloo"], [1 << 20], repeats=2, settle=30, **kw)
    assert results[("gloo", "tcp", 1 << 20)]["handoff_ns"] == [30.0, 32.0]  # waited out 170 and 165
    assert len(calls) == 6
    probes = iter([30.0, 30.0])  # then slow for good: the second measurement waits `settle`, then runs
    t0 = time.monotonic()
    transfer.bench_transport("sm", ["gloo"], [1 << 20], repeats=2, settle=0.3, **kw)
    assert results[("gloo", "sm", 1 << 20)]["handoff_ns"] == [30.0, 170.0]
    assert 0.3 <= time.monotonic() - t0 < 30
    ap = argparse.ArgumentParser()
    transfer.add_arguments(ap)
    assert transfer.settings(ap.parse_args([]))["settle"] == transfer.DEFAULT_SETTLE
    assert transfer.settings(ap.parse_args(["--quick"]))["settle"] == 0
    with pytest.raises(ValueError, match="--settle"):
        transfer.settings(ap.parse_args(["--settle", "-1"]))
    # A value given is the value checked: `or DEFAULT` used to run the default benchmark for 0.
    for argv, said in [(["--repeats", "0"], "--repeats"), (["--min-iters", "0"], "--min-iters"),
                       (["--timeout", "-1"], "--timeout"), (["--target-bytes", "0"], "--target-bytes"),
                       (["--sizes", ""], "--sizes")]:
        with pytest.raises(ValueError, match=said):
            transfer.settings(ap.parse_args(argv))


def test_the_cache_line_probe_measures_and_refuses_bad_cpus():
    from rdmaflow import InvalidArgumentError
    from rdmaflow.bench.processes import handoff_ns
    from rdmaflow.device import cache_line_handoff_ns

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        assert 0 < handoff_ns(0.01) < 1e6
    with pytest.raises(InvalidArgumentError, match="must differ"):
        cache_line_handoff_ns(cpus[0], cpus[0], 0.01)
    with pytest.raises(InvalidArgumentError, match="may run on"):
        cache_line_handoff_ns(cpus[0], max(cpus) + 1, 0.01)
    with pytest.raises(InvalidArgumentError, match="seconds"):
        cache_line_handoff_ns(cpus[0], cpus[-1] if len(cpus) > 1 else cpus[0] + 1, 0)


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


# ------------------------------------------------------------------------------------------
# --device cuda: what runs without a GPU. The measurement itself runs on a GPU host.


def _cuda_args(*argv):
    import argparse

    ap = argparse.ArgumentParser()
    transfer.add_arguments(ap)
    return ap.parse_args(["--device", "cuda", *argv])


def test_cuda_settings_and_their_errors():
    cfg = transfer.settings(_cuda_args())
    assert cfg["transports"] == ["cuda"]
    assert cfg["systems"] == list(transfer.CUDA_SYSTEMS)
    assert cfg["sizes"] == [1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    assert (cfg["repeats"], cfg["consume"], cfg["window"]) == (3, "sync", 2)
    assert (cfg["target_bytes"], cfg["min_iters"], cfg["timeout"]) == (2 << 30, 2, 30.0)
    # At 1 GiB: 2 timed transfers and 1 warm-up, the window shrinks to 1 (1 GiB in flight at most).
    assert transfer.iterations(1 << 30, cfg["target_bytes"], cfg["min_iters"], cfg["max_iters"]) == 2
    assert transfer.window_of(1 << 30, 2, cfg["max_inflight"]) == 1
    assert transfer.iterations(256 << 20, cfg["target_bytes"], cfg["min_iters"], cfg["max_iters"]) == 8
    assert transfer.settings(_cuda_args("--consume", "max"))["consume"] == "max"
    assert transfer.settings(_cuda_args("--transport", "cuda", "--systems", "rdmaflow-zerocopy,d2d-copy"))[
        "systems"] == ["rdmaflow-zerocopy", "d2d-copy"]
    for bad in (["--transport", "tcp"], ["--systems", "memcpy"], ["--systems", "grpc-protobuf"],
                ["--no-reduce", "--consume", "max"]):
        with pytest.raises(ValueError):
            transfer.settings(_cuda_args(*bad))
    host = transfer.settings(_cuda_args("--device", "cpu"))  # the last --device wins: the host defaults
    assert host["transports"] == ["tcp", "sm"] and host["consume"] == "max" and host["repeats"] == 5
    assert "d2d-copy" not in host["systems"]
    assert transfer.main(["--consume", "sync"]) == 2      # a CUDA stream needs --device cuda
    assert transfer.main(["--systems", "d2d-copy"]) == 2  # a CUDA system on the host


def test_cuda_without_a_gpu_is_one_line(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transfer.main(["--device", "cuda", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device cuda" in err and "no CUDA device is visible" in err
    monkeypatch.setattr(torch.version, "cuda", None)
    assert transfer.main(["--device", "cuda", "--out", str(tmp_path)]) == 1
    assert "built without CUDA" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing was started or written


@pytest.mark.timeout(60)
def test_cuda_command_without_a_gpu_exits_at_once(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the command would run the benchmark")
    marker = os.urandom(8).hex()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "transfer", "--device", "cuda",
                        "--out", str(tmp_path)], cwd=ROOT, env=_env(marker), capture_output=True,
                       text=True, timeout=55, check=False)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: "), p.stderr
    assert time.monotonic() - t0 < 30
    assert _processes_with_env(marker) == []


def test_cuda_run_reports_bars_ratios_and_json(monkeypatch, tmp_path, capsys):
    """The whole driver of a CUDA run with fake systems: bars at 256M and 1G, the ratio table,
    a failing system reported while the run goes on, and the JSON file."""
    import json

    speeds = {"rdmaflow-zerocopy": 100.0, "rdmaflow-zerocopy-ucx": 60.0, "rdmaflow-dynamic": 50.0,
              "rdmaflow-staging": None,
              "tensorpipe": 120.0, "gloo": 10.0, "d2d-copy": 125.0}
    seen = {}

    def fake(name, transport, **kw):
        seen[name] = (transport, kw["device"], kw["consume"])
        return _Fake(name, transport, speeds[name])

    monkeypatch.setattr(transfer, "make_system", fake)
    monkeypatch.setattr(transfer, "cuda_device_info", lambda: {
        "gpu": "Fake H100", "gpu_memory_gib": 79.6, "gpus": 1, "torch": "2.11.0+cu130", "cuda": "13.0"})
    out = tmp_path / "out"
    rc = transfer.main(["--device", "cuda", "--sizes", "1M,256M,1G", "--out", str(out),
                        "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert rc == 1  # rdmaflow-staging failed everywhere
    assert set(seen.values()) == {("cuda", "cuda", "sync")}
    assert "Fake H100" in text and "consume: sync" in text and "after a CUDA stream synchronize" in text
    assert "rdmaflow-zerocopy over each" in text and "/d2d-copy" in text
    assert "cuda 256M  rdmaflow-zerocopy / d2d-copy" in text
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["device"] == "cuda" and doc["machine"]["gpu"] == "Fake H100" and doc["transports"] == ["cuda"]
    assert doc["consume"] == "sync" and doc["repeats"] == 3 and not doc["interrupted"]
    assert "cuda_ipc" in doc["ucx_tls"]["cuda"]
    bars = {(r["den"], r["size"]): r for r in doc["acceptance"]}
    assert set(bars) == {(d, s) for d in ("d2d-copy", "gloo", "tensorpipe") for s in ("256M", "1G")}
    assert bars[("d2d-copy", "1G")]["ratio"] == pytest.approx(0.8) and bars[("d2d-copy", "1G")]["verdict"] == "met"
    assert bars[("gloo", "256M")]["ratio"] == pytest.approx(10.0) and bars[("gloo", "256M")]["verdict"] == "met"
    assert bars[("tensorpipe", "1G")]["verdict"] == "missed"  # 100 / 120 < 1.0
    assert doc["ratios"]["cuda"]["1M"]["gloo"] == pytest.approx(10.0)
    assert doc["ratios"]["cuda"]["1M"]["rdmaflow-staging"] is None
    rows = {(r["system"], r["size"]): r for r in doc["rows"]}
    assert rows[("rdmaflow-staging", "1G")]["status"].startswith("failed: boom")
    assert rows[("d2d-copy", "256M")]["status"] == "ok" and rows[("d2d-copy", "256M")]["repeats"] == 3
    assert (out / "transfer-cuda.csv").exists() and (out / "transfer-cuda.png").exists()


def test_cuda_systems_processes_and_arenas():
    sizes, gib = [1 << 20, 256 << 20, 1 << 30], 1 << 30
    plan = (sizes, 2, gib)
    # Zero copy and dynamic keep their data in the CUDA arena, control in the host arena.
    assert transfer.cuda_arena_bytes("rdmaflow-zerocopy", "receiver", *plan) >= 2 * (1 << 20) + (512 << 20) + gib
    assert transfer.cuda_arena_bytes("rdmaflow-zerocopy", "sender", *plan) >= (1 << 20) + (256 << 20) + gib
    assert transfer.cuda_arena_bytes("rdmaflow-dynamic", "receiver", *plan) >= gib  # window tensors in flight
    for system in ("rdmaflow-zerocopy", "rdmaflow-dynamic"):
        assert transfer.arena_bytes(system, "receiver", *plan, device="cuda") < 64 << 20
    # Staging: the data in host memory (window staging tensors at the sender), no CUDA arena.
    assert transfer.cuda_arena_bytes("rdmaflow-staging", "sender", *plan) == 0
    assert transfer.arena_bytes("rdmaflow-staging", "sender", *plan, device="cuda") >= 512 << 20
    assert transfer.arena_bytes("rdmaflow-staging", "receiver", *plan, device="cuda") >= gib + (512 << 20)
    # On the host nothing changes: no CUDA arena.
    assert transfer.cuda_arena_bytes("rdmaflow-zerocopy", "receiver", *plan, device="cpu") == 0

    kw = {"secret": "a-bench-test-secret-0123", "sizes": sizes, "window": 2, "max_inflight": gib, "busy_poll": False,
          "sock_dir": "/tmp", "timeout": 30.0, "torch_threads": 1, "consume": "sync", "device": "cuda"}
    zc = transfer.make_system("rdmaflow-zerocopy", "cuda", **kw)
    argv = zc._argv("receiver", 1234)
    assert argv[argv.index("--device") + 1] == "cuda"
    assert int(argv[argv.index("--cuda-arena-bytes") + 1]) == transfer.cuda_arena_bytes(
        "rdmaflow-zerocopy", "receiver", *plan)
    assert "cuda_ipc" in zc.env["UCX_TLS"] and zc.env["RDMAFLOW_JOB_SECRET"] == "a-bench-test-secret-0123"
    assert "--cuda-arena-bytes" not in transfer.make_system("rdmaflow-staging", "cuda", **kw)._argv("sender", 1)
    gloo = transfer.make_system("gloo", "cuda", **kw)
    assert "RDMAFLOW_JOB_SECRET" not in gloo.env and "--cuda-arena-bytes" not in gloo._argv("sender", 1)
    d2d = transfer.make_system("d2d-copy", "cuda", **kw)
    assert d2d.name == "d2d-copy" and d2d.device == "cuda"


def test_consume_steps():
    import torch

    from rdmaflow.bench import _transfer_worker as w

    t = w.fill(torch.empty(16), 3)
    _, ok, m = w.consume(t, "max", w.marker(3), last=False)
    assert ok and float(m) == w.marker(3)
    assert not w.consume(t, "max", w.marker(4), last=True)[1]
    assert w.consume(t, "none", w.marker(4), last=True)[1:] == (True, None)  # nothing checked
    assert w.consume_mode({"consume": "sync"}) == "sync"
    assert w.consume_mode({"reduce": False}) == "none" and w.consume_mode({}) == "max"
    with pytest.raises(ValueError):
        w.consume_mode({"consume": "nope"})
