"""``rdmaflow launch`` as a user meets it: what it says it starts, its --help, a wrong master
port, one line per failed job, Ctrl-C, and errors that name the cause and the fix. Real
launcher processes, torchrun and ranks; the scripts are small files written here."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rdmaflow import launch
from rdmaflow.bench.processes import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_launch(*args: str, timeout: float = 120, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RDMAFLOW_JOB_SECRET", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "rdmaflow", "launch", "--master-port", str(free_port()), *args],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True, check=False)


def last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def test_help_documents_every_flag_with_its_default_and_what_it_starts():
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "launch", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=True)
    text = " ".join(p.stdout.replace("`", "").split())
    assert "workers plus --shards-per-node parameter-server shards" in text, text
    assert "--shards-per-node 0 --nproc-per-node STAGES" in text, text
    ap = launch.build_parser()
    for action in ap._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and "(default" in action.help, f"{action.option_strings} has no default in its help"
        assert action.option_strings[0] in text
    for flag, default in [("--node-rank", "(default 0)"), ("--master-addr", "(default 127.0.0.1)"),
                          ("--master-port", "(default 29500)"), ("--join-timeout", "(default 60)")]:
        assert default in text[text.index(flag + " "):], flag


def test_what_it_starts_in_one_line():
    ns = lambda *a: launch.build_parser().parse_args([*a, "x.py"])
    assert launch.summary(ns()) == ("rdmaflow launch: starting 1 worker + 1 shard per node: ranks 0-1; "
                                    "job store at 127.0.0.1:29500")
    assert launch.summary(ns("--nproc-per-node", "2", "--shards-per-node", "0")) == (
        "rdmaflow launch: starting 2 processes and no shard (a pipeline: one stage per process, 2 stages in all): "
        "ranks 0-1; job store at 127.0.0.1:29500")
    two = ns("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "10.0.0.1")
    assert launch.summary(two) == ("rdmaflow launch: starting 2 workers + 1 shard per node (4 workers + 2 shards "
                                   "in all): ranks 3-5; node 1 of 2, job store at 10.0.0.1:29500")
    assert [launch.role(two, r) for r in range(6)] == ["shard 0", "worker 0", "worker 1",
                                                       "shard 1", "worker 2", "worker 3"]
    assert launch.role(ns("--shards-per-node", "0", "--nproc-per-node", "3"), 2) == "stage 2"


def test_a_pipeline_job_starts_exactly_its_stages_and_no_shard(tmp_path):
    script = tmp_path / "env.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], "
                      "'shards', os.environ['RDMAFLOW_SHARDS_PER_NODE'])\n")
    p = run_launch("--shards-per-node", "0", "--nproc-per-node", "2", str(script))
    assert p.returncode == 0, p.stderr
    assert sorted(x for x in p.stdout.splitlines() if x.startswith("rank")) == [
        "rank 0 of 2 shards 0", "rank 1 of 2 shards 0"], p.stdout
    assert "starting 2 processes and no shard (a pipeline: one stage per process, 2 stages in all)" in p.stderr
    with pytest.raises(SystemExit, match="needs --shards-per-node >= 1"):
        launch.command(launch.build_parser().parse_args(["--shards-per-node", "0", "--min-workers", "1",
                                                         str(script)]))


def test_a_wrong_master_port_ends_naming_the_address_it_waited_for(tmp_path):
    """Node 1 of a job whose node 0 is not there (a wrong port): torchrun's agent waited without
    a word for more than 400 s. Now it waits --join-timeout (default 60) seconds, saying so."""
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    p = run_launch("--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--join-timeout", "4",
                   str(script), env_extra={"RDMAFLOW_JOB_SECRET": "a-secret-of-32-characters-000000"}, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode != 0 and "ran" not in p.stdout, p.stdout + p.stderr
    assert took < 30, took
    assert f"waiting up to 4 s for node 0's store at 127.0.0.1:{port}" in p.stderr, p.stderr
    assert last_line(p.stderr) == (
        f"rdmaflow launch: node 0's store at 127.0.0.1:{port} did not answer within 4 s (Connection refused): "
        "start node 0 with the same --master-addr and --master-port, and open that port in its firewall"), p.stderr


def test_node_0_alone_ends_naming_the_nodes_it_waited_for(tmp_path):
    """Node 0 of two whose node 1 never comes: torchrun waited 600 s (its static rendezvous's
    default), silent; now --join-timeout seconds, then one line."""
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    t0 = time.monotonic()
    p = run_launch("--nnodes", "2", "--join-timeout", "3", str(script),
                   env_extra={"RDMAFLOW_JOB_SECRET": "a-secret-of-32-characters-000000"}, timeout=60)
    assert p.returncode != 0 and "ran" not in p.stdout, p.stdout + p.stderr
    assert time.monotonic() - t0 < 40
    line = last_line(p.stderr)
    assert line.startswith("rdmaflow launch: the job's nodes did not all join at 127.0.0.1:") and (
        "within 3 s (this is node 0; waited for node 1): start the same command on every host") in line, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


FAILS = """import os, sys, time
if os.environ['RANK'] == '2':
    time.sleep(0.5)
    raise ValueError('rank two gave up: bad batch 7')
time.sleep(60)
"""


def test_a_failed_job_ends_with_one_line_naming_rank_role_and_cause(tmp_path):
    """torchrun ended a failure with 80-90 lines of ChildFailedError whose "Root Cause" was the
    first rank (a shard stopped because a worker failed), not the culprit; the launcher's last
    line now names the culprit, its role and its exception."""
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    p = run_launch("--nproc-per-node", "2", str(script), timeout=90)
    assert p.returncode != 0
    line = last_line(p.stderr)
    assert line.startswith("rdmaflow launch: the job failed: rank 2 (worker 1): "
                           "ValueError: rank two gave up: bad batch 7"), p.stderr
    assert "ChildFailedError" not in p.stderr and "Root Cause" not in p.stderr, p.stderr
    assert p.stderr.count("Traceback") == 1, p.stderr  # the culprit's own


def test_a_dead_shard_under_min_workers_stops_the_job_without_the_others_go_on(tmp_path):
    script = tmp_path / "shard_dies.py"
    script.write_text("import os, time\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    time.sleep(0.5)\n"
                      "    os.kill(os.getpid(), 9)\n"
                      "time.sleep(60)\n")
    p = run_launch("--nproc-per-node", "2", "--min-workers", "1", str(script), timeout=90)
    assert p.returncode != 0
    assert "shard 0 (rank 0) exited with -9; stopping the job" in p.stderr, p.stderr
    assert "the others go on" not in p.stderr, p.stderr
    assert last_line(p.stderr) == "rdmaflow launch: the job failed: rank 0 (shard 0): killed by SIGKILL", p.stderr


PS_JOB = """import os, pathlib, time, torch
from rdmaflow import ps
ctx = ps.init()
model = torch.nn.Linear(8, 1)
opt = ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05))
for step in range(100000):
    opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step(); time.sleep(0.01)
    if step == 3:
        pathlib.Path(UP, 'up' + os.environ['RANK']).write_text('')
"""


@pytest.mark.parametrize("extra, job", [([], "sleep"), (["--min-workers", "1"], "sleep"), ([], "ps")])
def test_ctrl_c_ends_the_job_with_one_line_and_status_130(tmp_path, extra, job):
    """Ctrl-C reaches the launcher (the job's processes run in sessions of their own): it printed
    84 lines and three KeyboardInterrupt tracebacks; now one line, and 130 as a shell reports.
    In a parameter-server job too (its shard said it was interrupted as well)."""
    script = tmp_path / "wait.py"
    if job == "ps":  # the worker says it is up; the shard serves inside ps.init()
        script.write_text(f"UP = {str(tmp_path)!r}\n" + PS_JOB)
        (tmp_path / "up0").write_text("")
    else:
        script.write_text("import os, pathlib, time\n"
                          f"pathlib.Path({str(tmp_path)!r}, 'up' + os.environ['RANK']).write_text('')\n"
                          "time.sleep(120)\n")
    env = dict(os.environ)
    env.pop("RDMAFLOW_JOB_SECRET", None)
    launcher = subprocess.Popen([sys.executable, "-m", "rdmaflow", "launch", "--nproc-per-node", "1",
                                 "--master-port", str(free_port()), *extra, str(script)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("up*"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        time.sleep(0.5)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    assert launcher.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[0].startswith("rdmaflow launch: starting 1 worker + 1 shard per node"), err
    assert lines[1:] == ["rdmaflow launch: interrupted; stopped the job's processes on this node"
                         if not extra else
                         "rdmaflow launch: interrupted; stopped the job's 2 processes on this node"], err


DEVICE = """import os, rdmaflow
dev = rdmaflow.Device("127.0.0.1:0", connect_timeout=5.0)
if os.environ.get("CONNECT"):
    other = rdmaflow.Device("127.0.0.1:0", connect_timeout=5.0)
    dev.channel(other.endpoint, qp_idx=0).flush().result(timeout=10)
"""


@pytest.mark.parametrize("tls, connect, said", [
    ("rc", "", "UCX_TLS=rc names no transport UCX can use on this host: unset it"),
    ("sm,self", "1", "UCX_TLS=sm,self has no tcp: rdmaflow devices connect through UCX's sockaddr"),
])
def test_an_impossible_ucx_tls_in_a_job_names_the_cause_and_the_fix(tmp_path, tls, connect, said):
    script = tmp_path / "device.py"
    script.write_text(DEVICE)
    p = run_launch("--shards-per-node", "0", str(script), env_extra={"UCX_TLS": tls, "CONNECT": connect},
                   timeout=90)
    assert p.returncode != 0
    line = last_line(p.stderr)
    assert line.startswith("rdmaflow launch: the job failed: rank 0 (stage 0): ") and said in line, p.stderr


def test_explain_device_error_knows_the_ucx_settings():
    from rdmaflow.info import explain_device_error

    assert "UCX_TLS=rc names no transport" in explain_device_error("ucp_init failed: No such device", {"UCX_TLS": "rc"})
    assert "UCX_NET_DEVICES=nope names no device" in explain_device_error(
        "ucp_init failed: No such device", {"UCX_NET_DEVICES": "nope"})
    unreachable = "Destination is unreachable (is an rdmaflow device listening there?)"
    assert "has no tcp" in explain_device_error(unreachable, {"UCX_TLS": "sm,self"})
    for tls in ("sm,self,tcp", "^rc", "all", ""):  # these connect: the peer is the problem
        assert explain_device_error(unreachable, {"UCX_TLS": tls}) is None, tls
    assert "has no tcp" in explain_device_error(unreachable, {"UCX_TLS": "^tcp,rdmacm"})


def test_a_parameter_server_script_run_without_the_launcher_says_how_to_start_it():
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RDMAFLOW_SHARDS_PER_NODE"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "examples/ps_mlp.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode != 0
    line = last_line(p.stderr)
    assert "no launcher started it: run it with `rdmaflow launch --nproc-per-node 1 SCRIPT" in line, p.stderr
    assert "RDMAFLOW_SHARDS_PER_NODE" not in p.stderr, p.stderr


def test_a_pipeline_started_with_a_shard_says_which_flags_start_one_process_per_stage():
    """`--nproc-per-node 2` adds a shard: 3 processes for 2 stages. The error said only "start one
    process per stage"; it now gives the flags, and the launcher's last line carries it."""
    p = run_launch("--nproc-per-node", "2", "examples/graph_mlp.py", timeout=150)
    assert p.returncode != 0
    line = last_line(p.stderr)
    assert "split the model into 2 stages but the job has WORLD_SIZE=3 processes" in line, p.stderr
    assert "`rdmaflow launch --shards-per-node 0 --nproc-per-node 2 SCRIPT`" in line, p.stderr


def test_the_culprit_is_the_cause_not_its_consequences():
    ns = launch.build_parser().parse_args(["--nproc-per-node", "2", "x.py"])
    aborted = "WorkerFailure: the job was aborted: worker 1: worker 1's model differs from the job's"
    mismatch = [{"rank": 0, "exitcode": 1, "message": "PeerError: the job was aborted: worker 1: ...", "timestamp": 5},
                {"rank": 1, "exitcode": 1, "message": aborted.replace("worker 1: worker", "worker 1: x"), "timestamp": 5},
                {"rank": 2, "exitcode": 1, "message": aborted, "timestamp": 6}]
    assert launch.culprit(ns, mismatch)["rank"] == 2  # its own abort, though not the first
    killed = [{"rank": 0, "exitcode": -9, "message": None, "timestamp": 9},
              {"rank": 1, "exitcode": 1, "message": "PeerError: shard 0 at h:1 died while worker 0 waited",
               "timestamp": 8},
              {"rank": 2, "exitcode": -15, "message": None, "timestamp": 8}]
    assert launch.failure_line(ns, killed, {}) == (
        "rdmaflow launch: the job failed: rank 0 (shard 0): killed by SIGKILL; 2 other processes failed after it")
