"""The ``rdmaflow`` command: ``info`` and ``bench device``, run as real subprocesses."""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import pid_alive
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
    assert re.search(r"^GPUDirect RDMA: (yes|no) — .+$", out, re.MULTILINE), out
    assert re.search(r"^  libucx wheel installed: .+$", out, re.MULTILINE), out
    assert re.search(r"^PyTorch \S+: .+$", out, re.MULTILINE), out
    assert "Transports and devices UCX found" in out
    # Every build this project supports has tcp; it is listed as a found transport.
    assert re.search(r"^\s+tcp\s+\S", out, re.MULTILINE), out
    assert "A temporary rdmaflow Device (" in out


def test_info_names_the_setting_that_leaves_no_way_to_connect():
    """UCX_NET_DEVICES naming no device: the remedy is that variable (it said to add tcp to
    UCX_TLS, which was unset). A UCX_TLS that leaves no device: exit status 1 (it was 0)."""
    out = run_cli("info", timeout=30, env_extra={"UCX_NET_DEVICES": "nosuchdev"}).stdout
    assert "UCX_NET_DEVICES=nosuchdev names no network device tcp can use" in out and "lo" in out, out
    env = dict(os.environ, UCX_TLS="bogus")
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "info"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=30, check=False)
    assert p.returncode == 1 and "could not be created" in p.stdout and "UCX_TLS=bogus names no transport" in p.stdout, \
        p.stdout + p.stderr
    # A bad rdmaflow setting names itself: no word about UCX's (they were blamed for it too).
    env = dict(os.environ, RDMAFLOW_SAME_HOST="maybe")
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "info"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=30, check=False)
    assert p.returncode == 1 and "RDMAFLOW_SAME_HOST must be 0, 1 or auto, got 'maybe'" in p.stdout, p.stdout + p.stderr
    assert "UCX_TLS and UCX_NET_DEVICES" not in p.stdout, p.stdout


def test_info_reports_a_weak_job_secret():
    """A short $RDMAFLOW_JOB_SECRET: one line saying so and how to make one, exit status 1, and
    the rest of the report still made (the temporary device takes a secret of its own)."""
    weak = "short-secret"
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "info"], cwd=ROOT, env=dict(os.environ, RDMAFLOW_JOB_SECRET=weak),
                       capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "warning: every device refuses $RDMAFLOW_JOB_SECRET: the job secret is too weak (12 bytes" in p.stdout, p.stdout
    assert "secrets.token_hex(16)" in p.stdout and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "A temporary rdmaflow Device (" in p.stdout and weak not in p.stdout, p.stdout


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
    g = info["gpudirect_rdma"]
    assert isinstance(g["possible"], bool) and g["possible"] == (not g["missing"]), g
    # Verbs are part of the decision: no verbs transport found, no GPUDirect RDMA.
    if not info["rdma_verbs"]["present"]:
        assert not g["possible"] and "verbs" in g["reason"], g
    import torch

    assert info["torch"]["version"] == torch.__version__
    assert info["torch"]["cuda"] == torch.version.cuda
    if info["ucx_built_against"] == "wheel":
        assert len(info["libucx_wheels"]) == 1, info["libucx_wheels"]
        if torch.version.cuda:  # scripts/setup.sh installs the wheel for PyTorch's CUDA
            assert info["libucx_wheels"][0]["name"] == info["libucx_wheel_expected"], info


def test_gpudirect_rdma_needs_verbs_cuda_and_peer_memory():
    from rdmaflow.info import gpudirect_rdma

    yes = gpudirect_rdma(["rc_mlx5", "ud_mlx5"], ["cuda_copy", "cuda_ipc"], ["nvidia_peermem"])
    assert yes["possible"] and yes["missing"] == [], yes
    assert "rc_mlx5" in yes["reason"] and "nvidia_peermem" in yes["reason"]
    assert gpudirect_rdma(["rc_verbs"], ["cuda_copy"], ["nv_peer_mem"])["possible"]
    # gdr_copy stands in for the kernel module.
    assert gpudirect_rdma(["rc_verbs"], ["cuda_copy", "gdr_copy"], [])["possible"]
    # Each one missing alone, and only that one reported.
    for args, word in (([[], ["cuda_copy"], ["nvidia_peermem"]], "verbs"),
                       ([["rc_mlx5"], [], ["nvidia_peermem"]], "CUDA transport"),
                       ([["rc_mlx5"], ["cuda_copy", "cuda_ipc"], []], "nvidia_peermem")):
        r = gpudirect_rdma(*args)
        assert not r["possible"] and len(r["missing"]) == 1 and word in r["missing"][0], (args, r)
        assert r["reason"].startswith("missing ") and word in r["reason"]
    none = gpudirect_rdma([], [], [])
    assert not none["possible"] and len(none["missing"]) == 3
    # What is not verbs, not CUDA, not a peer-memory module does not count as one.
    r = gpudirect_rdma(["tcp", "cma"], ["posix", "sysv"], ["nvidia", "nvidia_uvm", "ib_core"])
    assert not r["possible"] and len(r["missing"]) == 3, r
    # The libucx wheel's UCX has no verbs: never GPUDirect RDMA, whatever CUDA and the kernel have.
    assert not gpudirect_rdma(["tcp"], ["cuda_copy", "cuda_ipc", "gdr_copy"], ["nvidia_peermem"])["possible"]


def test_loaded_kernel_modules(tmp_path):
    from rdmaflow.info import PEER_MEMORY_MODULES, loaded_kernel_modules

    sys_module = tmp_path / "module"
    (sys_module / "nvidia").mkdir(parents=True)
    proc = tmp_path / "modules"
    proc.write_text("nvidia_uvm 1531904 0 - Live 0x0\nnvidia 54173696 1 nvidia_uvm, Live 0x0\n")
    assert loaded_kernel_modules(PEER_MEMORY_MODULES, str(sys_module), str(proc)) == []
    (sys_module / "nvidia_peermem").mkdir()
    assert loaded_kernel_modules(PEER_MEMORY_MODULES, str(sys_module), str(proc)) == ["nvidia_peermem"]
    proc.write_text(proc.read_text() + "nv_peer_mem 16384 0 - Live 0x0\n")
    assert loaded_kernel_modules(PEER_MEMORY_MODULES, str(sys_module), str(proc)) == list(PEER_MEMORY_MODULES)
    assert loaded_kernel_modules(PEER_MEMORY_MODULES, str(tmp_path / "none"), str(tmp_path / "none")) == []


def test_ucx_wheel_follows_torch_cuda_major():
    from rdmaflow import _ucx

    assert _ucx.wheel_for_cuda("13.0") == "libucx-cu13"
    assert _ucx.wheel_for_cuda("12.8") == "libucx-cu12"
    assert _ucx.wheel_for_cuda(None) == "libucx-cu12"  # CPU-only PyTorch
    assert _ucx.wheel_for_cuda("11.8") == "libucx-cu12"  # no wheel of its own: the default
    for choice in ("cu13", "13", "libucx-cu13", "libucx_cu13", "CU13"):
        assert _ucx.wheel_name(choice) == "libucx-cu13", choice
    with pytest.raises(ValueError, match="libucx-cu12"):
        _ucx.wheel_name("cu11")


def test_ucx_wheel_warning():
    from rdmaflow.info import ucx_wheel_warning

    assert ucx_wheel_warning(["libucx-cu13"], "13.0", "wheel") is None
    assert ucx_wheel_warning(["libucx-cu12"], None, "wheel") is None
    assert ucx_wheel_warning(["libucx-cu13"], None, "wheel") is None  # a CPU-only PyTorch: either
    assert ucx_wheel_warning(["libucx-cu12"], "12.8", "wheel") is None
    w = ucx_wheel_warning(["libucx-cu12"], "13.0", "wheel")
    assert w and "libucx-cu13" in w and "CUDA 13.0" in w
    w = ucx_wheel_warning(["libucx-cu12", "libucx-cu13"], "13.0", "system")
    assert w and "more than one" in w
    assert "none is installed" in ucx_wheel_warning([], "12.4", "wheel")
    assert ucx_wheel_warning([], "13.0", "system") is None  # a system UCX needs no wheel


def test_pyproject_names_one_libucx_wheel_per_extra_and_build(monkeypatch):
    """pyproject.toml agrees with rdmaflow._ucx.WHEELS: each wheel has its extra (for users) and
    is what an isolated build asks for under RDMAFLOW_UCX_WHEEL (the same requirement); no
    libucx wheel among the unconditional requirements; none for a system UCX."""
    from rdmaflow import _ucx

    spec = importlib.util.spec_from_file_location("_scripts_requirements",
                                                  os.path.join(ROOT, "scripts", "requirements.py"))
    requirements = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(requirements)
    project = requirements._pyproject()
    unconditional = project["project"]["dependencies"] + project["build-system"]["requires"]
    assert not [r for r in unconditional if r.startswith("libucx")], unconditional
    extras = project["project"]["optional-dependencies"]
    for wheel in _ucx.WHEELS.values():
        extra = requirements.extra(wheel)
        assert len(extras[extra]) == 1 and extras[extra][0].startswith(wheel), extras[extra]
    assert "torch" not in " ".join(requirements.runtime(list(extras)))
    build = pytest.importorskip("scikit_build_core.build")

    def build_requires(env: dict) -> list[str]:
        with monkeypatch.context() as m:
            for k in ("RDMAFLOW_UCX_WHEEL", "RDMAFLOW_UCX_ROOT", "UCX_HOME"):
                m.delenv(k, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            m.chdir(ROOT)
            return [r for r in build.get_requires_for_build_wheel() if r.startswith("libucx")]

    for wheel in _ucx.WHEELS.values():
        assert build_requires({"RDMAFLOW_UCX_WHEEL": wheel}) == extras[requirements.extra(wheel)]
    assert build_requires({}) == extras[requirements.extra(_ucx.DEFAULT_WHEEL)]
    assert build_requires({"RDMAFLOW_UCX_ROOT": "/opt/ucx", "RDMAFLOW_UCX_WHEEL": "cu13"}) == []


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
    p = run_cli("bench", "device", "--quick", "--transport", "tcp", "--out", str(tmp_path),
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


def test_bench_file_refuses_bad_arguments_before_a_job_starts():
    """They started the job and then failed as tracebacks (ValueError, ZeroDivisionError), or
    were taken (--depths 0)."""
    for args, said in ((["--sizes", "0"], "must be >= 1"), (["--steps", "0"], "must be >= 1"),
                       (["--depths", "0"], "must be >= 1"), (["--depths", "x"], "error: --sizes, --depths"),
                       (["--model-bytes", "2"], "--model-bytes >= 4"), (["--transport", "foo"], "invalid choice")):
        p = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "file", *args, "--out", "/nonexistent/x"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_bench_device_rejects_bad_sizes():
    for sizes, said in (("0", "positive"), ("abc", "error: --sizes: invalid size 'abc'")):
        p = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "device", "--sizes", sizes],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_launch_refuses_an_impossible_job_at_once(tmp_path):
    """Checked before torchrun starts: a node rank it would wait for without end, a port or an
    address it would fail on late, a missing script. End to end once (the command, then
    --dry-run), the rest through the same check in this process."""
    from rdmaflow import launch

    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    for args in (["--node-rank", "5", str(script)], ["--node-rank", "5", "--dry-run", str(script)]):
        p = subprocess.run([sys.executable, "-m", "rdmaflow", "launch", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=False)
        assert p.returncode != 0 and "--node-rank 5 is not in [0, --nnodes 1)" in p.stderr, p.stdout + p.stderr
        assert "ran" not in p.stdout
    for argv, said in [(["--min-workers", "1", "--node-rank", "-1", str(script)], "--node-rank -1 is not in"),
                       (["--master-port", "99999", str(script)], "a port in [1, 65535]"),
                       (["--master-addr", "", str(script)], "an address and a port"),
                       ([str(tmp_path / "missing.py")], "missing.py does not exist"),
                       ([str(tmp_path)], f"{tmp_path} is a directory, not a script"),
                       # argparse said "the following arguments are required: script, args".
                       (["--nproc-per-node", "2"], "no training script given: rdmaflow launch [options] train.py")]:
        with pytest.raises(SystemExit, match=re.escape(said)):
            launch.command(launch.build_parser().parse_args(argv))


def test_launch_runs_a_module_as_python_m_does(tmp_path, monkeypatch):
    """``-m MODULE``: each process runs rdmaflow._rank -m MODULE (as ``python -m`` does, under
    torchrun or --min-workers) with the rest of the line as the module's arguments (the file view needed the path of its __main__.py); a
    module that cannot be found is refused before anything starts."""
    from rdmaflow import launch

    line = ["-m", "rdmaflow.fileview", "/mnt/m-{worker}", "--model", "m.json"]
    ns = launch.build_parser().parse_args(["--nproc-per-node", "2", *line])
    argv, _ = launch.command(ns)
    rank = ["-m", "rdmaflow._rank", "-m", "rdmaflow.fileview", "/mnt/m-{worker}", "--model", "m.json"]
    assert argv[-7:] == rank, argv
    assert launch.supervised_argv(ns)[1:] == ["-u", *rank]
    argv, _ = launch.command(launch.build_parser().parse_args(["-m", "rdmaflow.fileview"]))
    assert argv[-4:] == ["-m", "rdmaflow._rank", "-m", "rdmaflow.fileview"]
    for name in ("rdmaflow.no_such_module", "no_such_package.sub"):
        with pytest.raises(SystemExit, match=re.escape(f"-m {name}")):
            launch.command(launch.build_parser().parse_args(["-m", name]))
    (tmp_path / "my_train_here.py").write_text("")  # python -m finds a module in the current directory
    monkeypatch.chdir(tmp_path)
    assert launch.command(launch.build_parser().parse_args(["-m", "my_train_here"]))[0][-1] == "my_train_here"


@pytest.mark.parametrize("extra", [[], ["--min-workers", "1"]])
def test_a_dry_run_prints_commands_that_run_the_same_job(tmp_path, extra):
    """What --dry-run prints, run by a shell, starts the processes the launcher starts, with the
    same job variables (it printed torchrun's line alone: no shards per node, no resume, no
    secret, and torchrun even where --min-workers does without it)."""
    from rdmaflow.bench.processes import free_port

    script = tmp_path / "env.py"
    script.write_text("import json, os, pathlib, sys\n"
                      "keep = {k: v for k, v in os.environ.items() if k.startswith('RDMAFLOW_') or k in "
                      "('RANK', 'WORLD_SIZE', 'LOCAL_RANK')}\n"
                      "pathlib.Path(sys.argv[1], os.environ['RANK'] + '.json').write_text(json.dumps(keep))\n")
    seen = {}
    for how in ("launcher", "dry-run"):
        out = tmp_path / how
        out.mkdir()
        args = [sys.executable, "-m", "rdmaflow", "launch", "--shards-per-node", "2", "--resume",
                "--master-port", str(free_port()), *extra, str(script), str(out)]
        if how == "dry-run":
            printed = subprocess.run([*args[:4], "--dry-run", *args[4:]], cwd=ROOT, capture_output=True, text=True,
                                     timeout=60, check=True).stdout
            args = ["bash", "-c", printed]
        subprocess.run(args, cwd=ROOT, capture_output=True, timeout=120, check=True)
        envs = [json.loads((out / f"{r}.json").read_text()) for r in range(3)]
        assert len({e.pop("RDMAFLOW_JOB_SECRET") for e in envs}) == 1, envs  # one secret, made per job
        seen[how] = envs
    assert seen["dry-run"] == seen["launcher"]
    assert seen["launcher"][0]["RDMAFLOW_SHARDS_PER_NODE"] == "2" and seen["launcher"][0]["RDMAFLOW_RESUME"] == "1"


@pytest.mark.parametrize("extra", [[], ["--min-workers", "1"]])
def test_launch_says_at_once_that_the_master_port_is_taken(tmp_path, extra):
    """Node 0 serves the job's store on --master-port (torchrun's agent, or rank 0 under
    --min-workers). A port another process listens on failed only inside torchrun, with c10d's
    traceback (DistNetworkError, EADDRINUSE); the launcher now says so before starting anything."""
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "rdmaflow", "launch", *extra, "--master-port", str(port), str(script)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode != 0 and "ran" not in p.stdout, p.stdout + p.stderr
    assert f"store on --master-port {port}, and this host cannot (Address already in use)" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("extra", [[], ["--min-workers", "1"]])
def test_launch_says_at_once_that_the_master_addr_does_not_resolve(tmp_path, extra):
    """Every rank reaches the job's store at --master-addr. A name that resolves to nothing
    (``.invalid`` never does) kept torchrun's ranks retrying, c10d warning every few seconds,
    for more than 90 s; the launcher now says so before starting anything."""
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "launch", *extra, "--master-addr", "no-such-host.invalid",
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode != 0 and "ran" not in p.stdout, p.stdout + p.stderr
    assert "--master-addr 'no-such-host.invalid' does not resolve on this host" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "c10d" not in p.stderr, p.stderr


@pytest.mark.parametrize("sig, extra", [(signal.SIGTERM, []), (signal.SIGINT, []),
                                        (signal.SIGTERM, ["--min-workers", "1"]),
                                        (signal.SIGHUP, ["--min-workers", "1"])])
def test_a_signal_to_the_launcher_stops_every_process_of_the_job(tmp_path, sig, extra):
    """A scheduler stops a job by signalling the launcher's pid, not its process group. The
    launcher passes the signal on (to torchrun, or to each process it supervises) and exits
    non-zero; no rank runs on (they did: the launcher died alone, torchrun and the ranks were
    orphaned)."""
    from rdmaflow.bench.processes import free_port

    script = tmp_path / "wait.py"
    script.write_text("import os, pathlib, sys, time\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "rdmaflow", "launch", "--nproc-per-node", "1",
                                 "--master-port", str(free_port()), *extra, str(script)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid*"))) < 2:  # a worker and a shard
            assert launcher.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # (each wrote its pid right before sleeping)
        pids += [int(p.read_text()) for p in tmp_path.glob("pid*")]
        launcher.send_signal(sig)  # this pid alone
        assert launcher.wait(90) != 0
        deadline = time.monotonic() + 30
        while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"ranks {alive} outlived the launcher"
    finally:  # whatever outlived it (torchrun ends once its ranks are gone)
        for pid in [launcher.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(10)


def test_a_reader_that_went_away_is_no_traceback():
    """`rdmaflow info --json | head -1`: the reader closed the pipe. The command ends as shell
    tools do (141, nothing on stderr), not with a BrokenPipeError traceback."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "rdmaflow", "info", "--json"], cwd=ROOT, stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(w)
    assert p.returncode == 141 and "Traceback" not in p.stderr, p.stderr
