"""``rdmaflow bench converge``: a short real run of both systems (a parameter-server job of two
workers and one shard, and DDP over gloo with two processes) on scikit-learn's digits.

- the run writes curves.csv, summary.csv and the plot;
- both systems learn: the test accuracy after 3 epochs is >= 0.90 (a correct run gets
  0.956-0.964 over seeds 0-5; a job whose weights never change, or never come back to the
  workers, stays near chance, 0.08-0.16) and the losses fall;
- both are the same synchronous data-parallel SGD: their per-step losses agree, and equal
  single-process SGD on the concatenated batches computed here from the module's own data, model,
  batches and optimizer. This is the check that catches a wrong aggregation: using one worker's
  gradient or the sum instead of the mean still reaches the accuracy bound (0.95-0.97), but not
  this curve;
- bad arguments are refused before any process starts; a job that outlives --timeout is
  reported and every one of its processes is gone afterwards.

The run is one subprocess (``python -m rdmaflow.bench.converge``, bounded) shared by the tests.
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("sklearn")
torch = pytest.importorskip("torch")

from rdmaflow.bench import converge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = {"workers": 2, "shards": 1, "epochs": 3, "batch": 64, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0,
       "hidden": 128, "seed": 3, "log_every": 1}
RUN_TIMEOUT = 150.0   # both jobs, start-up included (about 35 s on an idle 2-core machine)
MIN_ACC = 0.90
RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order, 66 steps


def _argv(out: str, **over) -> list[str]:
    c = dict(CFG, **over)
    return ["--systems", "rdmaflow", "ddp", "--workers", str(c["workers"]), "--shards", str(c["shards"]),
            "--epochs", str(c["epochs"]), "--batch", str(c["batch"]), "--lr", str(c["lr"]),
            "--momentum", str(c["momentum"]), "--weight-decay", str(c["weight_decay"]), "--hidden", str(c["hidden"]),
            "--seed", str(c["seed"]), "--out", out]


def _run_bounded(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.Popen([sys.executable, "-m", "rdmaflow.bench.converge", *argv], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the driver's children die with it (PR_SET_PDEATHSIG)
        out, _ = p.communicate()
        pytest.fail(f"the benchmark did not finish within {timeout:.0f} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def _read(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _num(v: str) -> float | None:
    return None if v == "" else float(v)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("converge")
    r = _run_bounded(_argv(str(out)) + ["--timeout", "120"], RUN_TIMEOUT)
    assert r.returncode == 0, r.stdout[-6000:]
    curves: dict[str, list[dict]] = {}
    for row in _read(out / "curves.csv"):
        curves.setdefault(row["system"], []).append(row)
    summary = {row["system"]: row for row in _read(out / "summary.csv")}
    return {"out": out, "stdout": r.stdout, "curves": curves, "summary": summary}


def test_writes_curves_summary_and_plot(result):
    out = result["out"]
    with open(out / "curves.csv") as f:
        assert f.readline().strip() == ",".join(converge.CURVE_FIELDS)
    assert set(result["curves"]) == {"rdmaflow", "ddp"}
    assert set(result["summary"]) == {"rdmaflow", "ddp"}
    spe = converge.steps_per_epoch(1437, CFG["workers"], CFG["batch"])
    for system, rows in result["curves"].items():
        steps = [int(r["step"]) for r in rows]
        assert steps == list(range(CFG["epochs"] * spe + 1)), system  # step 0 (untrained) and every step
        secs = [float(r["seconds"]) for r in rows]
        assert secs == sorted(secs) and secs[0] == 0.0 and secs[-1] > 0
        evals = [r for r in rows if r["test_acc"] != ""]
        assert [int(r["epoch"]) for r in evals] == list(range(CFG["epochs"] + 1))
        s = result["summary"][system]
        assert int(s["steps"]) == CFG["epochs"] * spe
        assert float(s["train_seconds"]) == pytest.approx(secs[-1], rel=0.5)
    png = out / "converge.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and "no plot" in result["stdout"]
        return
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "test acc" in result["stdout"] and "rdmaflow" in result["stdout"]


def test_both_systems_learn(result):
    for system, rows in result["curves"].items():
        evals = [r for r in rows if r["test_acc"] != ""]
        acc = [float(r["test_acc"]) for r in evals]
        test_loss = [float(r["test_loss"]) for r in evals]
        assert acc[0] < 0.3, f"{system}: the untrained model is already at {acc[0]}"
        assert acc[-1] >= MIN_ACC, f"{system}: test accuracy {acc} after {CFG['epochs']} epochs"
        assert test_loss[-1] < 0.3 * test_loss[0], f"{system}: test loss {test_loss}"
        train = [float(r["train_loss"]) for r in rows if r["train_loss"] != ""]
        spe = len(train) // CFG["epochs"]
        first, last = sum(train[:spe]) / spe, sum(train[-spe:]) / spe
        assert last < 0.3 * first, f"{system}: mean training loss of the first epoch {first}, of the last {last}"
        assert float(result["summary"][system]["final_test_acc"]) == pytest.approx(acc[-1])


def reference_curve(cfg: dict) -> tuple[list[float], list[tuple[float, float]]]:
    """Single-process SGD on every step's concatenated batches: worker 0's batch loss per step and
    the test loss and accuracy after every epoch."""
    torch.set_num_threads(1)
    d = converge.load_data()
    model = converge.make_model(cfg["seed"], cfg["hidden"])
    opt = converge.make_optimizer(model.parameters(), cfg)
    W, n, local = cfg["workers"], len(d["x_train"]), cfg["batch"] // cfg["workers"]
    losses, evals = [], []
    for epoch in range(1, cfg["epochs"] + 1):
        per_worker = [converge.worker_batches(cfg["seed"], epoch, n, W, cfg["batch"], w) for w in range(W)]
        for i in range(len(per_worker[0])):
            idx = torch.cat([per_worker[w][i] for w in range(W)])
            opt.zero_grad()
            out = model(d["x_train"][idx])
            loss = torch.nn.functional.cross_entropy(out, d["y_train"][idx])  # mean over the global batch
            loss.backward()
            opt.step()
            with torch.no_grad():
                losses.append(torch.nn.functional.cross_entropy(out[:local], d["y_train"][idx[:local]]).item())
        with torch.no_grad():
            o = model(d["x_test"])
            evals.append((torch.nn.functional.cross_entropy(o, d["y_test"]).item(),
                          (o.argmax(1) == d["y_test"]).float().mean().item()))
    return losses, evals


def test_same_curve_as_each_other_and_single_process_sgd(result):
    ref_losses, ref_evals = reference_curve(CFG)
    curves = {}
    for system, rows in result["curves"].items():
        curves[system] = [float(r["train_loss"]) for r in rows if r["train_loss"] != ""]
        evals = [(float(r["test_loss"]), float(r["test_acc"])) for r in rows if r["test_acc"] != ""][1:]
        assert len(curves[system]) == len(ref_losses)
        for t, (got, want) in enumerate(zip(curves[system], ref_losses), start=1):
            assert got == pytest.approx(want, rel=RTOL, abs=ATOL), (
                f"{system}: step {t} loss {got}, single-process SGD on the same batches {want}")
        for e, ((gl, ga), (wl, wa)) in enumerate(zip(evals, ref_evals), start=1):
            assert gl == pytest.approx(wl, rel=RTOL, abs=ATOL) and ga == pytest.approx(wa, abs=1.5 / 360), (
                f"{system}: epoch {e} test loss/acc {gl}/{ga}, single-process {wl}/{wa}")
    for a, b in zip(curves["rdmaflow"], curves["ddp"]):
        assert a == pytest.approx(b, rel=RTOL, abs=ATOL)


def _args(**over) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    converge.add_arguments(ap)
    return ap.parse_args([a for k, v in over.items() for a in (f"--{k.replace('_', '-')}", str(v))])


@pytest.mark.parametrize("over", [{"batch": 63}, {"systems": "ddp,gloo"}, {"workers": 0}, {"epochs": 0}])
def test_bad_arguments_are_refused(tmp_path, over, capsys):
    args = _args(out=str(tmp_path / "out"), **over)
    assert converge.run(args) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "out" / "logs").exists()  # nothing was started


def _our_processes(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_timeout_is_reported_and_every_process_killed(tmp_path):
    out = tmp_path / "slow"
    t0 = time.monotonic()
    r = _run_bounded(["--systems", "ddp", "--epochs", "200", "--timeout", "2", "--out", str(out)], 60)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "still running after 2 s" in r.stdout, r.stdout[-3000:]
    assert time.monotonic() - t0 < 45
    assert _our_processes(str(out / "data.pt")) == []
