"""`rdmaflow bench pipeline`: its models and runs. No timing is asserted.

- Padding the variable-length model to its bound and masking the loss gives the gradients of
  the unpadded batch (what makes the padded baseline train the same model).
- A smoke run measures every system on a cell, prints the targets, writes the CSV, JSON and plot;
  across two network-namespace hosts too.
- Bad arguments exit 2 naming the problem; a job that outlives its timeout is reported and
  killed, never a hang.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import QUIET_PLACEMENT_COSTS

from rdmaflow.bench.pipeline_models import SEQ_MAX, Workload, masked_mse
from rdmaflow.graph.placement import COSTS_ENV
from rdmaflow.testing.netns import netns_unavailable_reason


def _bench(tmp_path, *args, timeout=400):
    """Placement weighs this machine's quiet figures, so that what it decides is the same every run."""
    out = tmp_path / "out"
    env = {**os.environ, COSTS_ENV: QUIET_PLACEMENT_COSTS}
    r = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "pipeline", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=timeout, check=False, env=env)
    return r, out


def _grads(model, x, y, length):
    model.zero_grad()
    masked_mse([length])(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("length", [16, 37, 200])
def test_padded_varlen_training_has_the_unpadded_gradients(length):
    work = Workload("varlen", 2, seed=3)
    model = work.model()
    x, y = work.batch(1, length)
    xp, yp = work.batch(1, length, pad_to=SEQ_MAX)
    assert xp.shape[1] == SEQ_MAX and torch.equal(xp[:, :length], x) and not xp[:, length:].any()
    plain, padded = _grads(model, x, y, length), _grads(model, xp, yp, length)
    for name, g in plain.items():
        torch.testing.assert_close(padded[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in plain.values())


def test_models_split_into_the_stages_asked():
    for name in ("comm", "compute", "varlen"):
        for stages in (2, 4):
            w = Workload(name, stages)
            names = w.split_names()
            assert len(names) == stages - 1
            mods = dict(w.model().named_modules())
            assert all(n in mods for n in names), (name, stages, names)
    lengths = Workload("varlen", 2).lengths(50)
    assert min(lengths) >= 16 and max(lengths) <= SEQ_MAX and len(set(lengths)) > 10
    assert Workload("varlen", 2).lengths(5) == Workload("varlen", 4).lengths(5)  # one seed, every split


def test_smoke_run_measures_every_system_and_writes_its_outputs(tmp_path):
    r, out = _bench(tmp_path, "--quick", "--models", "varlen", "--stages", "2", "--transport", "tcp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"varlen 2 stages tcp: rdmaflow/pipelining-gloo [\d.]+x  target: >= 1.2x  (met|missed)",
                     r.stdout), r.stdout
    # each rdmaflow job says what placement did on stage 0: this transformer's phases are declined
    assert re.search(r"varlen 2 stages tcp rdmaflow: .*; stage 0: 0/\d+ sends zero-copy \(placement declined: "
                     r"its forward runs \d+ ops", r.stdout), r.stdout
    assert re.search(r"varlen 2 stages tcp rdmaflow-copy: .*; stage 0: 0/\d+ sends zero-copy \(.*copy mode",
                     r.stdout), r.stdout
    with open(out / "pipeline.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(x["system"], x["model"], x["stages"], x["transport"]) for x in rows} == {
        (s, "varlen", "2", "tcp") for s in ("rdmaflow", "rdmaflow-copy", "pipelining-gloo")}
    assert all(float(x["median"]) > 0 for x in rows)
    doc = json.loads((out / "pipeline.json").read_text())
    assert doc["failures"] == [] and doc["bars"] and "bench pipeline" in doc["command"]
    assert (out / "pipeline.png").stat().st_size > 0


NETNS = netns_unavailable_reason()


@pytest.mark.skipif(NETNS is not None, reason=f"network namespaces unavailable: {NETNS}")
def test_two_stages_across_network_namespace_hosts(tmp_path):
    r, out = _bench(tmp_path, "--quick", "--models", "varlen", "--stages", "2", "--transport", "tcp",
                    "--hosts", "netns", "--systems", "rdmaflow,pipelining-gloo")
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "pipeline.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(x["system"], x["hosts"]) for x in rows} == {("rdmaflow", "netns"), ("pipelining-gloo", "netns")}


@pytest.mark.parametrize("args, message", [
    (["--models", "bert"], "--models: invalid choice 'bert' (choose from comm, compute, varlen)"),
    (["--stages", "1"], "--stages must be between 2 and 8"),
    (["--systems", "rdmaflow,nccl"], "--systems: invalid choice 'nccl'"),
    (["--hosts", "netns", "--transport", "sm"], "--hosts netns runs rdmaflow over tcp"),
])
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, args, message):
    r, _ = _bench(tmp_path, *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr


def test_a_job_past_its_timeout_is_reported_and_killed(tmp_path):
    r, out = _bench(tmp_path, "--quick", "--models", "compute", "--stages", "2", "--transport", "tcp",
                    "--systems", "rdmaflow", "--timeout", "3", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "compute 2 stages tcp rdmaflow: failed: timed out after 3 s; still running: rdmaflow stage 0" in r.stdout
    doc = json.loads((out / "pipeline.json").read_text())
    assert doc["failures"][0]["system"] == "rdmaflow" and doc["rows"] == []
    r2 = subprocess.run(["pgrep", "-f", "rdmaflow.bench._pipeline_worker"], capture_output=True, text=True,
                        check=False)
    assert r2.stdout.strip() == "", "a stage outlived the benchmark"
