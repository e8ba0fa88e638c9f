"""The ``rdmaflow`` command: ``info`` and ``bench device``, run as real subprocesses."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import processes_with_env as _processes_with_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 60.0, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RDMAFLOW_JOB_SECRET", None)  # info must work without a secret
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "rdmaflow", *args], cwd=ROOT, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                       start_new_session=True, check=False)
    assert p.returncode == 0, f"rdmaflow {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def test_info_text():
    import rdmaflow

    out = run_cli("info", timeout=30).stdout
    assert f"UCX {rdmaflow.ucx_version()}" in out
    assert re.search(r"^RDMA verbs: (yes \(.+\)|no — .+)$", out, re.MULTILINE), out
    assert re.search(r"^CUDA: (yes \(.+\)|no — .+)$", out, re.MULTILINE), out
    assert "Transports and devices UCX found" in out
    # Every build this project supports has tcp; it is listed as a found transport.
    assert re.search(r"^\s+tcp\s+\S", out, re.MULTILINE), out
    assert "A temporary rdmaflow Device (" in out


def test_info_json_and_masked_secret():
    import rdmaflow

    secret = "s3cr3t-value-that-must-not-show"
    p = run_cli("info", "--json", timeout=30,
                env_extra={"RDMAFLOW_JOB_SECRET": secret, "UCX_TLS": "tcp,self"})
    assert secret not in p.stdout
    info = json.loads(p.stdout)
    assert info["ucx_version"] == rdmaflow.ucx_version()
    assert isinstance(info["rdma_verbs"]["present"], bool)
    assert isinstance(info["cuda"]["present"], bool)
    assert info["rdma_verbs"]["present"] == bool(info["rdma_verbs"]["transports"])
    names = {t["transport"] for t in info["transports"]}
    assert "tcp" in names
    assert info["settings"]["UCX_TLS"] == "tcp,self"
    assert "RDMAFLOW_JOB_SECRET" in info["settings"]
    assert info["device"]["ok"], info["device"]
    # The temporary device honours UCX_TLS.
    assert {t["transport"] for t in info["device"]["transports"]} <= {"tcp", "self"}
    assert info["libucp_path"] and "libucp" in info["libucp_path"]


def test_with_tcp_helper():
    from rdmaflow.bench.device import with_tcp

    assert with_tcp({"UCX_TLS": "cma,posix,self"})["UCX_TLS"] == "cma,posix,self,tcp"
    assert with_tcp({"UCX_TLS": "tcp"})["UCX_TLS"] == "tcp"
    assert with_tcp({"UCX_TLS": "all"})["UCX_TLS"] == "all"
    assert with_tcp({"UCX_TLS": "^tcp,sysv"})["UCX_TLS"] == "^sysv"
    assert "UCX_TLS" not in with_tcp({})


def test_bench_device_quick_tcp_csv(tmp_path):
    path = tmp_path / "device.csv"
    marker = os.urandom(8).hex()
    p = run_cli("bench", "device", "--quick", "--transport", "tcp", "--csv", str(path),
                timeout=90, env_extra={"RDMAFLOW_TEST_MARK": marker})
    assert _processes_with_env(marker) == [], "the benchmark left processes behind"
    assert "WRITE/put" in p.stdout
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for col in ("system", "transport", "op", "size_bytes", "gb_per_s_median", "gb_per_s_min",
                "gb_per_s_max", "repeats", "ratio_vs_perftest"):
        assert col in rows[0], col
    seen = {(r["system"], r["op"], int(r["size_bytes"])) for r in rows}
    expected = {(s, o, n) for s, o in (("rdmaflow", "write"), ("rdmaflow", "read"),
                                       ("ucx_perftest", "put"), ("ucx_perftest", "get"))
                for n in (1 << 20, 16 << 20)}
    assert seen == expected
    for r in rows:
        assert r["transport"] == "tcp"
        assert int(r["repeats"]) == 3
        assert 0 < float(r["gb_per_s_min"]) <= float(r["gb_per_s_median"]) <= float(r["gb_per_s_max"])
        if r["system"] == "rdmaflow":
            assert float(r["ratio_vs_perftest"]) > 0


def test_bench_device_rejects_bad_sizes():
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "device", "--sizes", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2 and "positive" in p.stderr


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "device", "--help"]])
def test_help(argv):
    out = run_cli(*argv, timeout=30).stdout
    assert "usage: rdmaflow" in out
