"""``rdmaflow launch --shard-replicas``: the launcher supervises the job's processes, restarts a
dead shard with its rank and the next incarnation, and serves the job's store itself so that it
outlives every shard. Real launcher processes and ranks; the job programs use the job's store
only (the replication protocol is the parameter server's, tested there)."""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

import pytest

from rdmaflow import launch
from rdmaflow.bench.processes import free_port
from rdmaflow.testing.netns import TwoHosts, netns_unavailable_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ranks: shards 0 and 1, worker 2 (--shards-per-node 2 --nproc-per-node 1). Shard 1 is done at
# once (exit 0: not restarted). The worker SIGKILLs shard 0 twice: incarnation 0 after it wrote
# a key, incarnation 1 after it read that key through the store the launcher kept up.
KILLED = """import os, signal, sys, time
from rdmaflow.job import JobStore
from rdmaflow.ps import context

role = context.resolve_role()
me = f"{role.kind} {role.index} incarnation {context.shard_incarnation()}"
print(f"{me}: replicas {context.shard_replicas(role)}, restarts {context.max_shard_restarts()}, "
      f"store outlives shards {context.store_outlives_shards()}", flush=True)
store = JobStore(role.rank, role.world_size, 60.0, "test/replicas/")
if role.rank == 1:
    sys.exit(0)
if role.rank == 0:
    inc = context.shard_incarnation()
    if inc == 0:
        store.set("before", "written by incarnation 0")
    else:
        print(f"{me} read {store.get('before')!r}", flush=True)
    store.set(f"pid/{inc}", str(os.getpid()))
    time.sleep(120)
ps_store = JobStore(role.rank, role.world_size, 60.0, context.PREFIX)

def stopped(signum, frame):
    print(f"worker stopped; the job's abort reason: {ps_store.abort_reason()}", flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, stopped)
for inc in (0, 1):
    os.kill(int(store.get(f"pid/{inc}")), signal.SIGKILL)
    store.set(f"after/{inc}", "ok")
    print(f"worker: the store answers after killing incarnation {inc}: {store.get(f'after/{inc}')}", flush=True)
time.sleep(120)
"""


def last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def parse(*args: str):
    return launch.build_parser().parse_args([*args, os.path.join(ROOT, "examples", "ps_mlp.py")])


def test_bad_values_are_refused_before_anything_starts(tmp_path):
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    for args, said in [(["--shard-replicas", "0"], "--shard-replicas 0 must be >= 1"),
                       (["--shard-replicas", "3", "--nnodes", "2"],
                        ("--shard-replicas 3 needs at least 3 shard processes, one per replica; the job has 2 "
                        "(--nnodes 2 x --shards-per-node 1)")),
                       (["--shard-replicas", "2", "--shards-per-node", "0"], "the job has 0"),
                       (["--shard-replicas", "2", "--shards-per-node", "2", "--max-shard-restarts", "-1"],
                        "--max-shard-restarts -1 must be >= 0"),
                       (["--max-shard-restarts", "2"], "it needs --shard-replicas 2 or more")]:
        with pytest.raises(SystemExit, match=re.escape(said)):
            launch.command(launch.build_parser().parse_args([*args, str(script)]))
    env = {k: v for k, v in os.environ.items() if k != "RDMAFLOW_JOB_SECRET"}
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "launch", "--shard-replicas", "2", "--master-port",
                        str(free_port()), str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode != 0 and last_line(p.stderr) == (
        "rdmaflow launch: --shard-replicas 2 needs at least 2 shard processes, one per replica; the job has 1 "
        "(--nnodes 1 x --shards-per-node 1)"), p.stderr
    assert not (tmp_path / "ran").exists()


def test_one_replica_is_todays_job_on_torchrun_and_more_are_supervised(monkeypatch):
    """R=1 (the default) runs torchrun as before (tests/test_launch.py runs such jobs); R > 1
    supervises the processes and tells them that the launcher serves the store."""
    argv, env = launch.command(parse())
    assert argv[1:3] == ["-m", "rdmaflow._agent"]
    assert env["RDMAFLOW_SHARD_REPLICAS"] == "1" and "RDMAFLOW_MAX_SHARD_RESTARTS" not in env
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert launch.summary(parse()) == ("rdmaflow launch: starting 1 worker + 1 shard per node: ranks 0-1; "
                                       "job store at 127.0.0.1:29500")
    ns = parse("--shard-replicas", "2", "--shards-per-node", "2")
    _, env = launch.command(ns)
    assert env["RDMAFLOW_SHARD_REPLICAS"] == "2" and env["RDMAFLOW_MAX_SHARD_RESTARTS"] == "3"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert launch.summary(ns).endswith("job store at 127.0.0.1:29500 (served by node 0's rdmaflow launch); "
                                       "2 replicas of each unit, a dead shard restarted up to 3 times")
    assert "share this one host" in launch.shared_hosts(ns)
    two = parse("--shard-replicas", "2", "--nnodes", "2", "--node-rank", "1", "--max-shard-restarts", "0")
    monkeypatch.setenv("RDMAFLOW_JOB_SECRET", secrets.token_hex(16))
    _, env = launch.command(two)
    assert launch.shared_hosts(two) is None and env["RDMAFLOW_MAX_SHARD_RESTARTS"] == "0"
    printed = launch.dry_run(two, *launch.command(two))
    assert "TORCHELASTIC_USE_AGENT_STORE=True" in printed and "RDMAFLOW_SHARD_REPLICAS=2" in printed
    assert "RANK=2 LOCAL_RANK=0" in printed and "RDMAFLOW_SHARD_INCARNATION=1, 2" in printed, printed


def test_a_killed_shard_is_restarted_with_its_incarnation_until_the_limit(tmp_path):
    """SIGKILL of rank 0 (shard 0) under --shard-replicas 2: the store, served by the launcher,
    still answers the worker; incarnation 1 reads the key incarnation 0 wrote; a second SIGKILL
    is past --max-shard-restarts 1: one line, the job stopped, a non-zero exit."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {k: v for k, v in os.environ.items() if k != "RDMAFLOW_JOB_SECRET"}
    p = subprocess.run([sys.executable, "-m", "rdmaflow", "launch", "--shards-per-node", "2", "--shard-replicas", "2",
                        "--max-shard-restarts", "1", "--master-port", str(free_port()), str(script)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
                       stdin=subprocess.DEVNULL, start_new_session=True)
    out, err = p.stdout, p.stderr
    assert p.returncode == 1, out + err
    assert "shard 0 incarnation 0: replicas 2, restarts 1, store outlives shards True" in out, out + err
    assert "shard 0 incarnation 1 read 'written by incarnation 0'" in out, out + err
    for inc in (0, 1):
        assert f"worker: the store answers after killing incarnation {inc}: ok" in out, out + err
    assert ("worker stopped; the job's abort reason: shard 0: died (killed by SIGKILL) 2 times, past "
            "--max-shard-restarts 1") in out, out + err
    lines = [x for x in err.splitlines() if x.startswith("rdmaflow launch:")]
    assert "share this one host" in lines[1], err
    assert re.fullmatch(r"rdmaflow launch: shard 0 \(rank 0\) died \(killed by SIGKILL\); restarted it as "
                        r"incarnation 1 \(restart 1 of at most 1\), pid \d+", lines[2]), err
    assert lines[3:] == [
        ("rdmaflow launch: shard 0 (rank 0) died (killed by SIGKILL) with no restart left (--max-shard-restarts 1); "
        "stopping the job"),
        ("rdmaflow launch: the job failed: rank 0 (shard 0): killed by SIGKILL, after 1 restart: past "
        "--max-shard-restarts 1")], err
    assert "shard 1" not in err  # it exited 0: done, not restarted


# Two hosts, a shard and a worker each; node 1's worker (rank 3) SIGKILLs node 1's shard (rank 2)
# once; its launcher restarts it, and incarnation 1 reads what incarnation 0 wrote into the store
# node 0's launcher serves. Then every process ends normally.
TWO_HOSTS = """import os, signal, time
from rdmaflow.job import JobStore
from rdmaflow.ps import context

role = context.resolve_role()
inc = context.shard_incarnation()
store = JobStore(role.rank, role.world_size, 60.0, "test/replicas/")
if role.rank == 2:
    if inc == 0:
        store.set("before", "written on node 1")
        store.set("pid", str(os.getpid()))
        time.sleep(120)
    print(f"shard 1 incarnation {inc} read {store.get('before')!r}", flush=True)
    store.set("reborn", str(inc))
elif role.rank == 3:
    os.kill(int(store.get("pid")), signal.SIGKILL)
store.get("reborn")
print(f"{role.kind} {role.index}: done", flush=True)
"""


@pytest.mark.skipif(netns_unavailable_reason() is not None, reason=f"no network namespaces: {netns_unavailable_reason()}")
def test_a_shard_on_node_1_is_restarted_while_node_0_serves_the_store(tmp_path):
    script = tmp_path / "two_hosts.py"
    script.write_text(TWO_HOSTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "RDMAFLOW_"))}
    env["RDMAFLOW_JOB_SECRET"] = secrets.token_hex(16)
    with TwoHosts() as (a, b):
        procs = [host.popen([sys.executable, "-m", "rdmaflow", "launch", "--nnodes", "2", "--node-rank", str(i),
                             "--master-addr", a.addr, "--master-port", "29500", "--shard-replicas", "2",
                             "--join-timeout", "180", str(script)], env=dict(env, RDMAFLOW_HOST=host.addr), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, host in enumerate((a, b))]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=240))
            finally:
                if p.poll() is None:
                    p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    (out0, err0), (out1, err1) = outs
    assert "shard 1 incarnation 1 read 'written on node 1'" in out1, out1 + err1
    assert re.search(r"^rdmaflow launch: shard 1 \(rank 2\) died \(killed by SIGKILL\); restarted it as incarnation 1 "
                     r"\(restart 1 of at most 3\)", err1, re.MULTILINE), err1
    assert sorted(x for x in (out0 + out1).splitlines() if x.endswith(": done")) == [
        "shard 0: done", "shard 1: done", "worker 0: done", "worker 1: done"], out0 + out1
    assert "share" not in err0 + err1 and "died" not in err0, err0
