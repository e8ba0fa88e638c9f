"""``rdmaflow bench train``: the driver (cells, process contract, metrics, CSV/JSON, tables,
ratios, plots, failures, Ctrl-C, netns hosts).

Two kinds of runs, both real processes:

* a stand-in training process (``FAKE_PROC`` below, written to a temporary directory and
  chosen with the hidden ``--proc-module``): no torch, instant, and it records the environment
  each process got, so that the process contract itself is checked, and it fails or hangs on
  demand;
* the real ``rdmaflow.bench._train_proc`` with the test model ``mlp-tiny`` (skipped while
  that module is absent).

No timing assertions: this machine is shared and noisy.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import processes_with_env as _processes_with_env

from rdmaflow.bench import train, train_cells, train_plots
from rdmaflow.testing.netns import list_netns, netns_unavailable_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("system", "model", "batch", "workers", "shards", "batches_per_s",
            "batches_per_s_p25", "batches_per_s_p75", "batches_per_s_min", "batches_per_s_max",
            "samples_per_s", "median_iter_s", "iters", "hosts", "zero_copy", "error", "status")
PNG = b"\x89PNG\r\n\x1a\n"
HAVE_PROC = importlib.util.find_spec("rdmaflow.bench._train_proc") is not None
NETNS = netns_unavailable_reason()
needs_proc = pytest.mark.skipif(not HAVE_PROC, reason="rdmaflow.bench._train_proc is not there yet")

FAKE_PROC = r'''
"""Stand-in for rdmaflow.bench._train_proc: follows the contract without training."""
import json, os, sys, time

cfg = json.loads(os.environ["RDMAFLOW_TRAIN_CFG"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
system, S, W = cfg["system"], cfg["shards"], cfg["workers"]
log = os.environ.get("FAKE_LOG_DIR")
if log:
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "RDMAFLOW_JOB_SECRET",
            "RDMAFLOW_ROLE", "RDMAFLOW_ROLE_INDEX", "UCX_TLS", "UCX_NET_DEVICES", "GLOO_SOCKET_IFNAME")
    rec = {"cfg": cfg, "env": {k: os.environ.get(k) for k in keys},
           "netns": os.readlink("/proc/self/ns/net"), "pgid": os.getpgid(0), "pid": os.getpid()}
    name = f"{system}-{int(cfg['zero_copy'])}-{cfg['model']}-{cfg['batch']}-{W}-{S}-{rank}.json"
    with open(os.path.join(log, name), "w") as f:
        json.dump(rec, f)
if cfg["model"] not in ("m1", "m2"):
    print(f"KeyError: unknown model {cfg['model']!r}", file=sys.stderr)
    sys.exit(2)
if system in os.environ.get("FAKE_FAIL", "").split(","):
    print(f"Traceback (most recent call last):\nRuntimeError: boom in {system} rank {rank}", file=sys.stderr)
    sys.exit(3)
if system in os.environ.get("FAKE_HANG", "").split(","):
    time.sleep(3600)
ps = system in ("rdmaflow", "tensorpipe", "grpc")
if ps and rank < S:
    sys.exit(0)  # a shard
worker = rank - S if ps else rank
speed = {"rdmaflow": 100.0, "tensorpipe": 70.0, "grpc": 40.0, "ddp": 90.0, "local": 120.0}[system]
if not cfg["zero_copy"]:
    speed *= 0.8
speed *= 8.0 / cfg["batch"]
t = (1.0 + 0.1 * worker) / speed
n = cfg["iters"]
print(f"worker {worker} done")
print("RDMAFLOW_TRAIN_RESULT " + json.dumps({
    "system": system, "model": cfg["model"], "worker": worker, "batch": cfg["batch"],
    "times": [t * (1 + 0.01 * i) for i in range(n)], "losses": [1.0 / (i + 1) for i in range(n)]}))
'''


def _env(marker: str, fake_dir=None, **extra) -> dict[str, str]:
    env = dict(os.environ)
    env["RDMAFLOW_TEST_MARK"] = marker
    paths = [ROOT] + ([str(fake_dir)] if fake_dir else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def fake(tmp_path):
    d = tmp_path / "fakemod"
    d.mkdir()
    (d / "fake_train_proc.py").write_text(FAKE_PROC)
    (tmp_path / "log").mkdir()
    return d


def _bench(args, *, env, timeout, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "train", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------------
# Pure functions


def _res(w, t, n=5):
    return {"system": "x", "model": "m", "worker": w, "batch": 8, "times": [t] * n,
            "losses": [2.0, 1.0]}


def test_metrics():
    res = [{**_res(0, 0.1), "times": [0.1, 0.1, 0.2, 0.1]}, _res(1, 0.25, 4)]
    m = train.cell_metrics(res, 8)
    assert m["worker_batches_per_s"] == pytest.approx([10.0, 4.0])
    assert m["batches_per_s"] == pytest.approx(7.0)  # median over the two workers
    assert m["samples_per_s"] == pytest.approx(7.0 * 8 * 2)
    assert m["batches_per_s_min"] == pytest.approx(4.0) and m["batches_per_s_max"] == pytest.approx(10.0)
    assert m["batches_per_s_min"] <= m["batches_per_s_p25"] <= m["batches_per_s_p75"] <= m["batches_per_s_max"]
    assert m["median_iter_s"] == pytest.approx(0.225)  # of all 8 iteration times
    assert m["iters"] == 4 and m["loss_first"] == 2.0 and m["loss_last"] == 1.0


def test_layout_plan_schedule():
    ps = train_cells.layout(("rdmaflow", "m", 8, 2, 3), netns=False)
    assert [(m.rank, m.role, m.index) for m in ps] == [
        (0, "shard", 0), (1, "shard", 1), (2, "shard", 2), (3, "worker", 0), (4, "worker", 1)]
    nn = train_cells.layout(("grpc", "m", 8, 3, 3), netns=True)
    assert {(m.role, m.index): m.host for m in nn} == {(r, i): i for r in ("shard", "worker") for i in range(3)}
    assert [m.rank for m in train_cells.layout(("ddp", "m", 8, 3, 0), netns=False)] == [0, 1, 2]
    assert len(train_cells.layout(train.cell_key("local", "m", 8, 4, 2), netns=False)) == 1
    assert train.cell_key("ddp", "m", 8, 4, 2) == ("ddp", "m", 8, 4, 0)
    assert train.cell_key("local", "m", 8, 4, 2) == ("local", "m", 8, 1, 0)
    cfg = train.train_cfg(("rdmaflow-copy", "m", 8, 2, 1), warmup=1, iters=3, lr=0.1, seed=4,
                          timeout=9, threads=None)
    assert cfg["system"] == "rdmaflow" and cfg["zero_copy"] is False and "threads" not in cfg
    assert set(cfg) == {"system", "model", "batch", "workers", "shards", "warmup", "iters",
                        "zero_copy", "overlap", "mode", "lr", "seed", "timeout"}
    configs = train.plan(["a"], [4, 8], [1, 2], [1, 2], netns=False)
    assert len(configs) == 8
    assert train.plan(["a"], [8], [1, 3], [5], netns=True) == [("a", 8, 1, 1), ("a", 8, 3, 3)]
    order = train.schedule(configs, ["rdmaflow", "ddp", "local"])
    assert len(order) == len(set(order))
    assert sum(k[0] == "local" for k in order) == 2      # once per (model, batch)
    assert sum(k[0] == "ddp" for k in order) == 4        # once per (model, batch, workers)
    assert sum(k[0] == "rdmaflow" for k in order) == 8
    # the systems of one configuration run back to back, the first system rotating
    assert [k[0] for k in order[:3]] == ["rdmaflow", "ddp", "local"]
    assert order[3][0] == "ddp"


def _synthetic(systems, configs, speed, fail=()):
    cells = {}
    for cfg in configs:
        for s in systems:
            key = train.cell_key(s, *cfg)
            if key in cells:
                continue
            c = train.new_cell(key, hosts="local", warmup=1, iters=5)
            if s in fail:
                c.update(status="failed", error="boom: worker 0 exited with code 3")
            else:
                t = 1.0 / (speed[s] * (1 + 0.2 * cfg[2]) / cfg[1])
                res = [_res(w, t * (1 + 0.05 * w)) for w in range(key[3])]
                c.update(status="ok", metrics=train.cell_metrics(res, cfg[1]), workers_results=res)
            cells[key] = c
    return cells


def test_report_csv_json_and_plots_on_synthetic_results(tmp_path):
    systems = ["rdmaflow", "rdmaflow-copy", "tensorpipe", "grpc", "ddp", "local"]
    configs = train.plan(["fcn5", "alexnet"], [4, 8], [1, 2], [2], netns=False)
    speed = {"rdmaflow": 10.0, "rdmaflow-copy": 8.0, "tensorpipe": 9.0, "grpc": 4.0, "ddp": 9.5,
             "local": 12.0}
    cells = _synthetic(systems, configs, speed, fail=("tensorpipe",))
    table = train.format_tables(cells, configs, systems)
    assert "failed" in table and "boom" in table
    rows = train.ratio_rows(cells, configs, systems)
    assert len(rows) == len(configs)
    assert rows[0]["grpc"] == pytest.approx(2.5) and rows[0]["tensorpipe"] is None
    acc = {(r["model"], r["den"]): r for r in train.acceptance(cells, configs)}
    assert acc[("fcn5", "grpc")]["verdict"] == "met"          # 10 / 4 >= 2
    assert acc[("fcn5", "ddp")]["verdict"] == "met"           # 10 / 9.5 >= 1.0
    assert acc[("alexnet", "tensorpipe")]["verdict"] == "n/a"  # failed
    text = train.format_acceptance(list(acc.values()))
    assert "rdmaflow / grpc" in text and "target: >= 2x  met" in text
    assert "/grpc" in train.format_ratios(rows, systems)
    ordered = train.ordered_cells(cells, configs, systems)
    train.save_csv(str(tmp_path / "r.csv"), ordered)
    got = _rows(tmp_path / "r.csv")
    assert len(got) == len(cells) and all(c in got[0] for c in REQUIRED)
    st = {(r["system"], r["model"], r["batch"], r["workers"], r["shards"]): r for r in got}
    assert st[("tensorpipe", "fcn5", "4", "1", "2")]["status"] == "failed"
    assert "boom" in st[("tensorpipe", "fcn5", "4", "1", "2")]["error"]
    assert st[("local", "fcn5", "4", "1", "0")]["status"] == "ok"
    assert st[("rdmaflow-copy", "fcn5", "4", "1", "2")]["zero_copy"] == "0"
    assert st[("grpc", "fcn5", "4", "1", "2")]["zero_copy"] == ""
    train.save_json(str(tmp_path / "r.json"), {"x": 1}, ordered, rows, list(acc.values()))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["cells"]) == len(cells) and doc["acceptance"]
    made = train.make_plots(str(tmp_path), cells, configs, systems, False, "synthetic")
    assert {os.path.basename(p) for p in made} == {
        train_plots.PNG_BARS, train_plots.PNG_FIG9, train_plots.PNG_FIG11, train_plots.PNG_FIG12}
    for p in made:
        with open(p, "rb") as f:
            assert f.read(8) == PNG


def test_rejects_bad_arguments(tmp_path):
    out = str(tmp_path / "o")
    assert train.main(["--systems", "nope", "--out", out]) == 2
    assert train.main(["--batch", "0", "--out", out]) == 2
    assert train.main(["--iters", "0", "--out", out]) == 2
    assert train.main(["--hosts", "netns", "--workers", "2", "--shards", "1", "--out", out]) == 2
    assert not os.path.exists(out)


def test_cli_help():
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "train", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert "usage: rdmaflow bench train" in p.stdout and "--no-zero-copy" in p.stdout


# ------------------------------------------------------------------------------------------
# The driver with the stand-in process


@pytest.mark.timeout(60)
def test_fake_run_contract_csv_table_plots(tmp_path, fake):
    marker = os.urandom(8).hex()
    log = tmp_path / "log"
    out = tmp_path / "out"
    p = _bench(["--models", "m1", "--batch", "4", "8", "--workers", "2", "--shards", "1",
                "--warmup", "1", "--iters", "3", "--no-zero-copy", "--timeout", "30",
                "--out", str(out), "--proc-module", "fake_train_proc"],
               env=_env(marker, fake, FAKE_LOG_DIR=log), timeout=55)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert _processes_with_env(marker) == []
    rows = _rows(out / "results.csv")
    assert all(c in rows[0] for c in REQUIRED)
    keys = {(r["system"], r["batch"], r["workers"], r["shards"]) for r in rows}
    assert keys == {(s, b, "2", "1") for s in ("rdmaflow", "rdmaflow-copy", "tensorpipe", "grpc")
                    for b in ("4", "8")} | {("ddp", b, "2", "0") for b in ("4", "8")} | {
                    ("local", b, "1", "0") for b in ("4", "8")}
    for r in rows:
        assert r["status"] == "ok" and r["error"] == "" and r["hosts"] == "local", r
        assert r["iters"] == "3"
        bps = float(r["batches_per_s"])
        assert float(r["batches_per_s_min"]) <= bps <= float(r["batches_per_s_max"])
        n = 1 if r["system"] == "local" else 2
        assert float(r["samples_per_s"]) == pytest.approx(bps * int(r["batch"]) * n, rel=1e-4)
    assert "mini-batches/s per worker" in p.stdout and "rdmaflow over each system" in p.stdout
    for name in ("throughput.png", "fig9_batch.png", "fig12_zero_copy.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert not (out / "fig11_workers.png").exists()  # one worker count
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["cells"]) == len(rows) and doc["cells"][0]["workers_results"]

    # What every process got: the contract the training process is written against.
    recs = [json.loads(f.read_text()) for f in log.iterdir()]
    by_cell: dict = {}
    for r in recs:
        c = r["cfg"]
        by_cell.setdefault((c["system"], c["zero_copy"], c["batch"]), []).append(r)
    assert len(by_cell) == len(rows)
    for (system, zc, batch), procs in by_cell.items():
        env0 = procs[0]["env"]
        ranks = sorted(int(r["env"]["RANK"]) for r in procs)
        world = {"ddp": 2, "local": 1}.get(system, 3)
        assert ranks == list(range(world)), (system, ranks)
        assert {r["env"]["WORLD_SIZE"] for r in procs} == {str(world)}
        assert len({(r["env"]["MASTER_PORT"], r["env"]["RDMAFLOW_JOB_SECRET"]) for r in procs}) == 1
        assert env0["MASTER_ADDR"] == "127.0.0.1"
        assert len({r["pgid"] for r in procs}) == len(procs)  # each in its own process group
        assert all(r["pgid"] == r["pid"] for r in procs)
        cfg = procs[0]["cfg"]
        assert cfg["mode"] == "sync" and cfg["overlap"] is True and cfg["warmup"] == 1 and cfg["iters"] == 3
        if system == "rdmaflow":
            roles = {int(r["env"]["RANK"]): (r["env"]["RDMAFLOW_ROLE"], r["env"]["RDMAFLOW_ROLE_INDEX"])
                     for r in procs}
            assert roles == {0: ("shard", "0"), 1: ("worker", "0"), 2: ("worker", "1")}
            assert env0["UCX_TLS"] and env0["UCX_NET_DEVICES"] == "lo"
        if system == "local":
            assert (cfg["workers"], cfg["shards"]) == (1, 0)
    assert {zc for (s, zc, _) in by_cell if s == "rdmaflow"} == {True, False}
    # Fresh secret and port per cell.
    assert len({p[0]["env"]["RDMAFLOW_JOB_SECRET"] for p in by_cell.values()}) == len(by_cell)


@pytest.mark.timeout(60)
def test_fake_failing_cells_are_reported_and_the_run_goes_on(tmp_path, fake):
    marker = os.urandom(8).hex()
    out = tmp_path / "out"
    t0 = time.monotonic()
    p = _bench(["--models", "m1", "nosuchmodel", "--workers", "2", "--shards", "1", "--warmup",
                "1", "--iters", "3", "--systems", "rdmaflow", "grpc", "tensorpipe", "ddp",
                "--timeout", "4", "--out", str(out), "--proc-module", "fake_train_proc", "--no-plot"],
               env=_env(marker, fake, FAKE_FAIL="grpc", FAKE_HANG="tensorpipe"), timeout=55)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert time.monotonic() - t0 < 45
    assert _processes_with_env(marker) == []
    rows = {(r["system"], r["model"]): r for r in _rows(out / "results.csv")}
    assert len(rows) == 8
    assert rows[("rdmaflow", "m1")]["status"] == "ok"
    assert rows[("ddp", "m1")]["status"] == "ok"
    grpc = rows[("grpc", "m1")]
    assert grpc["status"] == "failed" and "exited with code 3" in grpc["error"]
    assert "boom in grpc" in grpc["error"] and grpc["batches_per_s"] == ""
    assert "timed out after 4 s" in rows[("tensorpipe", "m1")]["error"]
    for s in ("rdmaflow", "ddp"):
        assert "unknown model" in rows[(s, "nosuchmodel")]["error"]
    assert "failed: " in p.stdout and "boom in grpc" in p.stdout
    assert not list(out.glob("*.png"))


def _wait_for(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def _ctrl_c(tmp_path, args, env, marker, ready, settle):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "rdmaflow", "bench", "train", *args, "--out", str(out)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: ready(out), 60), "the training processes did not start"
        time.sleep(settle)
        p.send_signal(signal.SIGINT)
        so, se = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, so[-2000:] + se[-2000:]
    assert "interrupted" in se
    assert _wait_for(lambda: not _processes_with_env(marker), 10), "processes left behind after Ctrl-C"
    return out, so


@pytest.mark.timeout(90)
def test_fake_ctrl_c_stops_every_process_and_keeps_what_was_measured(tmp_path, fake):
    marker = os.urandom(8).hex()

    def ready(out):  # rdmaflow measured, then the (hanging) local cell running
        return (out / "results.csv").exists() and len(_processes_with_env(marker)) >= 2

    out, _ = _ctrl_c(tmp_path, ["--models", "m1", "--workers", "2", "--shards", "2", "--systems",
                                "rdmaflow", "local", "--proc-module", "fake_train_proc"],
                     _env(marker, fake, FAKE_HANG="local"), marker, ready, 0.5)
    rows = _rows(out / "results.csv")
    assert [(r["system"], r["status"]) for r in rows] == [("rdmaflow", "ok")]


@pytest.mark.skipif(NETNS is not None, reason=f"network namespaces unavailable: {NETNS}")
@pytest.mark.timeout(60)
def test_fake_netns_hosts(tmp_path, fake):
    marker = os.urandom(8).hex()
    log = tmp_path / "log"
    before = set(list_netns())
    p = _bench(["--hosts", "netns", "--models", "m1", "--workers", "2", "--systems", "rdmaflow", "ddp",
                "--warmup", "1", "--iters", "2", "--timeout", "30", "--out", str(tmp_path / "out"),
                "--proc-module", "fake_train_proc", "--no-plot"],
               env=_env(marker, fake, FAKE_LOG_DIR=log), timeout=55)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(tmp_path / "out" / "results.csv")
    assert {(r["system"], r["workers"], r["shards"], r["hosts"]) for r in rows} == {
        ("rdmaflow", "2", "2", "netns"), ("ddp", "2", "0", "netns")}
    recs = [json.loads(f.read_text()) for f in log.iterdir()]
    mine = os.readlink("/proc/self/ns/net")
    ps = {int(r["env"]["RANK"]): r for r in recs if r["cfg"]["system"] == "rdmaflow"}
    # shard i and worker i (rank 2 + i) share host i; the hosts differ; none is this namespace
    assert ps[0]["netns"] == ps[2]["netns"] and ps[1]["netns"] == ps[3]["netns"]
    assert ps[0]["netns"] != ps[1]["netns"] and mine not in {r["netns"] for r in recs}
    assert {r["env"]["MASTER_ADDR"] for r in recs} == {"10.252.0.1"}
    assert {r["env"]["UCX_NET_DEVICES"] for r in ps.values()} == {"eth0"}
    assert {r["env"]["GLOO_SOCKET_IFNAME"] for r in recs} == {"eth0"}
    assert set(list_netns()) <= before, "namespaces left behind"
    assert _processes_with_env(marker) == []


# ------------------------------------------------------------------------------------------
# The real training process


@needs_proc
@pytest.mark.timeout(120)
def test_real_run_all_systems(tmp_path):
    # One configuration (5 cells): the batch sweep and its plots are covered with the stand-in
    # above, which is instant; a real cell costs 5-20 s of start-up on this 2-core machine.
    marker = os.urandom(8).hex()
    out = tmp_path / "out"
    p = _bench(["--models", "mlp-tiny", "--batch", "8", "--workers", "2", "--shards", "1",
                "--warmup", "1", "--iters", "3", "--timeout", "60", "--threads", "1",
                "--out", str(out)], env=_env(marker), timeout=110)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert _processes_with_env(marker) == []
    rows = _rows(out / "results.csv")
    assert all(c in rows[0] for c in REQUIRED)
    assert {(r["system"], r["batch"], r["workers"], r["shards"]) for r in rows} == {
        ("rdmaflow", "8", "2", "1"), ("tensorpipe", "8", "2", "1"), ("grpc", "8", "2", "1"),
        ("ddp", "8", "2", "0"), ("local", "8", "1", "0")}
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["batches_per_s"]) > 0 and int(r["iters"]) == 3
    assert "mini-batches/s per worker" in p.stdout and "rdmaflow over each system" in p.stdout
    assert (out / "throughput.png").read_bytes()[:8] == PNG
    doc = json.loads((out / "results.json").read_text())
    assert all(len(c["workers_results"]) == (1 if c["system"] == "local" else 2) for c in doc["cells"])


@needs_proc
@pytest.mark.timeout(60)
def test_real_unknown_model_fails_its_cell_only(tmp_path):
    marker = os.urandom(8).hex()
    out = tmp_path / "out"
    p = _bench(["--models", "no-such-model", "mlp-tiny", "--systems", "local", "--warmup", "1",
                "--iters", "2", "--timeout", "40", "--no-plot", "--out", str(out)],
               env=_env(marker), timeout=55)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["model"]: r for r in _rows(out / "results.csv")}
    assert rows["no-such-model"]["status"] == "failed"
    assert "no-such-model" in rows["no-such-model"]["error"]
    assert rows["mlp-tiny"]["status"] == "ok"
    assert _processes_with_env(marker) == []


@needs_proc
@pytest.mark.skipif(NETNS is not None, reason=f"network namespaces unavailable: {NETNS}")
@pytest.mark.timeout(90)
def test_real_netns_two_hosts(tmp_path):
    marker = os.urandom(8).hex()
    out = tmp_path / "out"
    before = set(list_netns())
    p = _bench(["--hosts", "netns", "--models", "mlp-tiny", "--workers", "2", "--systems", "rdmaflow",
                "--warmup", "1", "--iters", "3", "--timeout", "60", "--threads", "1",
                "--no-plot", "--out", str(out)], env=_env(marker), timeout=85)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    (row,) = _rows(out / "results.csv")
    assert (row["system"], row["hosts"], row["workers"], row["shards"], row["status"]) == (
        "rdmaflow", "netns", "2", "2", "ok"), row
    assert set(list_netns()) <= before
    assert _processes_with_env(marker) == []


@needs_proc
@pytest.mark.timeout(90)
def test_real_ctrl_c_leaves_no_processes(tmp_path):
    marker = os.urandom(8).hex()
    _ctrl_c(tmp_path, ["--models", "mlp-tiny", "--workers", "2", "--shards", "1", "--systems",
                       "rdmaflow", "--warmup", "1", "--iters", "100000", "--timeout", "120"],
            _env(marker), marker, lambda out: len(_processes_with_env(marker)) >= 1 + 3, 3.0)


@pytest.mark.skipif(NETNS is not None, reason=f"network namespaces unavailable: {NETNS}")
@pytest.mark.timeout(60)
def test_hosts_reach_each_other_and_are_removed():
    from rdmaflow.testing.netns import Hosts

    server = ("import socket, sys\n"
              "s = socket.socket(); s.bind(('0.0.0.0', 5555)); s.listen(8); print('up', flush=True)\n"
              "for _ in range(2):\n"
              "    c, _ = s.accept(); c.sendall(b'hello'); c.close()\n")
    client = "import socket, sys; print(socket.create_connection((sys.argv[1], 5555), timeout=10).recv(5).decode())"
    with Hosts(3) as hosts:
        names = hosts.namespaces
        assert len(set(names)) == 4 and all(n in list_netns() for n in names)
        assert hosts.addrs == ["10.252.0.1", "10.252.0.2", "10.252.0.3"]
        srv = hosts.popen(2, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "up"
        for i in (0, 1):
            cp = hosts.run(i, [sys.executable, "-c", client, hosts[2].addr], capture_output=True,
                           text=True, timeout=30)
            assert cp.returncode == 0 and cp.stdout.strip() == "hello", cp.stderr
        # The hosts' addresses are not reachable from here (they live in the namespaces only).
        assert hosts[2].addr not in subprocess.run(["ip", "-o", "addr"], capture_output=True,
                                                   text=True, check=False).stdout
        srv.wait(10)
    assert not set(names) & set(list_netns())
