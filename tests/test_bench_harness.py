"""The benchmark harness (rdmaflow.bench.harness, .processes, .plots): child processes for real, output files,
ratio tables and plots on known numbers."""
from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import pid_alive

from rdmaflow.bench import harness as h
from rdmaflow.bench import plots, processes
from rdmaflow.device import tcp_congestion_of

ECHO = textwrap.dedent("""
    import json, sys
    print(json.dumps({"ok": True, "hello": 1}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "fail":
            print(json.dumps({"ok": False, "error": "asked to fail"}), flush=True)
        elif cmd["cmd"] == "die":
            sys.exit(7)
        else:
            print(json.dumps({"ok": True, "echo": cmd["x"]}), flush=True)
""")


def test_child_process_json_lines():
    p = processes.ChildProcess([sys.executable, "-c", ECHO], os.environ, "echo")
    try:
        assert p.read(30)["hello"] == 1
        p.send({"cmd": "echo", "x": [1, 2]})
        assert p.read(30)["echo"] == [1, 2]
        p.send({"cmd": "fail"})
        with pytest.raises(processes.BenchError, match="echo: asked to fail"):
            p.read(30)
        t0 = time.monotonic()
        with pytest.raises(processes.BenchError, match="did not answer within"):
            p.read(0.3)  # nothing comes: bounded
        assert time.monotonic() - t0 < 5
        assert "to stderr" in p.stderr_tail()
        p.send({"cmd": "die"})
        with pytest.raises(processes.BenchError, match=r"exited \(code 7\)"):
            p.read(30)
    finally:
        p.close()
    assert p.poll() == 7


def test_child_process_close_and_log(tmp_path):
    p = processes.ChildProcess([sys.executable, "-c", ECHO], os.environ, "echo")
    p.read(30)
    p.close(grace=10)
    assert p.poll() == 0  # it left on {"cmd": "exit"}, not by the kill
    log = str(tmp_path / "out.log")
    q = processes.ChildProcess([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                       os.environ, "logged", stdin=False, log=log)
    assert q.wait(30) == 0
    assert "out" in q.output() and "err" in q.stderr_tail()
    assert q.drain(1.0) == []
    q.kill()


def test_child_process_dies_with_its_parent():
    # A parent that starts a ChildProcess (its own session: a kill of the parent's group does
    # not reach it) and is then SIGKILLed: the kernel must kill the child too.
    parent = textwrap.dedent("""
        import sys, time
        from rdmaflow.bench.processes import ChildProcess
        c = ChildProcess([sys.executable, "-c", "import time; time.sleep(120)"], {}, "sleeper", stdin=False)
        print(c.pid, flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        child = int(p.stdout.readline())
        assert pid_alive(child)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the child outlived its parent"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        if "child" in locals() and pid_alive(child):
            os.kill(child, signal.SIGKILL)  # only when the test failed


def test_free_port_and_process_env():
    port = processes.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_lo = int(f.read().split()[0])
    if ephemeral_lo > 11000:  # outside the range outgoing connections take their ports from
        assert all(10000 <= processes.free_port() < ephemeral_lo for _ in range(20))
    env = processes.process_env("tcp", base={"PATH": "/bin"}, secret="s3-a-long-test-secret", threads=2)
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "lo"
    assert env["RDMAFLOW_JOB_SECRET"] == "s3-a-long-test-secret" and env["OMP_NUM_THREADS"] == "2" and env["PATH"] == "/bin"
    plain = processes.process_env(base={"PATH": "/bin"})
    assert "UCX_TLS" not in plain and plain["PYTHONUNBUFFERED"] == "1"
    assert len({processes.new_secret() for _ in range(4)}) == 4


def test_parse_sizes_and_ratios():
    assert h.parse_sizes("64K, 1M,,") == [64 << 10, 1 << 20]
    assert h.median_ratio([4, 6, 5], [2, 3, 1]) == 2.5
    assert h.median_ratio([], [1]) is None and h.median_ratio([1], [0]) is None
    assert h.paired_ratio([4, 9, 6], [2, 3, 1]) == 3.0  # per-repeat 2, 3, 6
    assert h.spread([3.0, 1.0, 2.0]) == "2 [1-3]"
    assert [h.verdict(x, 1.5) for x in (1.5, 1.49, None)] == ["PASS", "MISS", "n/a"]


def test_cell_recorders_append_to_the_transports_cells():
    results = {(n, t, 1024): {"errors": [], "handoff_ns": []} for n in ("a", "b") for t in ("tcp", "sm")}
    fail, record_phase = h.cell_recorders(results, "sm")
    fail("a", 1024, "boom")
    record_phase("b", 1024, 31.0)
    record_phase("b", 1024, None)
    assert results[("a", "sm", 1024)] == {"errors": ["boom"], "handoff_ns": []}
    assert results[("b", "sm", 1024)] == {"errors": [], "handoff_ns": [31.0, None]}
    assert all(c == {"errors": [], "handoff_ns": []} for (n, t, _), c in results.items() if t == "tcp")
    with pytest.raises(KeyError):
        fail("c", 1024, "no such cell")


def test_measurements_table_csv_and_plot(tmp_path):
    m = h.Measurements("GB/s")
    for rdma, grpc in ((4.0, 1.0), (6.0, 2.0), (5.0, 1.5)):
        m.add("rdmaflow", 1 << 20, rdma)
        m.add("grpc", 1 << 20, grpc)
    m.add("rdmaflow", 16 << 20, 8.0)
    assert m.systems == ["rdmaflow", "grpc"] and m.points == [1 << 20, 16 << 20]
    assert m.ratio("rdmaflow", "grpc", 1 << 20) == pytest.approx(5.0 / 1.5)
    assert m.ratio("rdmaflow", "grpc", 16 << 20) is None
    table = h.ratio_table(m, "rdmaflow", point_label=h.format_size)
    lines = table.splitlines()
    assert lines[1].split() == ["point", "rdmaflow", "grpc", "rdmaflow/grpc"]
    assert lines[3].split() == ["1M", "5", "[4-6]", "1.5", "[1-2]", "3.33"]
    assert lines[4].split() == ["16M", "8", "[8-8]", "-", "-"]
    bars = h.check_bars(m, [("rdmaflow", "grpc", 3.0), ("rdmaflow", "grpc", 4.0)], m.points)
    assert [(b["point"], b["verdict"]) for b in bars] == [(1 << 20, "PASS"), (16 << 20, "n/a"),
                                                          (1 << 20, "MISS"), (16 << 20, "n/a")]
    path = str(tmp_path / "sub" / "m.csv")
    h.write_csv(path, h.MEASUREMENT_COLUMNS, m.rows())
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["system"] for r in rows] == ["rdmaflow", "grpc", "rdmaflow"]
    assert rows[0]["median"] == "5.0" and rows[0]["repeats"] == "3" and rows[0]["values"] == "4 6 5"
    assert not os.path.exists(path + ".tmp")
    h.write_csv(path, ("a", "b"), [{"a": None, "b": 0.1, "c": "ignored"}])
    with open(path) as f:
        assert f.read().splitlines() == ["a,b", ",0.1"]
    h.write_json(str(tmp_path / "d.json"), {"x": 3, "path": tmp_path})  # not JSON: written as str
    with open(tmp_path / "d.json") as f:
        assert json.load(f) == {"x": 3, "path": str(tmp_path)}
    png = str(tmp_path / "m.png")
    plots.line_plot(png, m, xlabel="size", ylabel="GB/s", sizes=True, logy=True, title="a title")
    assert os.path.getsize(png) > 0


def test_styles_and_background_meter():
    assert plots.style("rdmaflow") == plots.style("rdmaflow-zerocopy")
    assert plots.style("no-such-system")[0] is None
    meter = processes.BackgroundMeter()
    sum(range(10 ** 5))
    bg = meter.report()
    assert bg["wall_s"] > 0 and bg["other_cpus"] >= 0 and bg["cpus"] >= 1
    assert "background:" in processes.format_background(bg)


def test_background_meter_counts_tcp_segments_and_names_the_congestion_control():
    """The meter's TCP line: what the kernel's counters moved by while the run sent over TCP,
    and the congestion control every socket got."""
    meter = processes.BackgroundMeter()
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write its own segment, even under load
    conn, _ = srv.accept()
    got = []
    reader = threading.Thread(target=lambda: got.append(sum(len(b) for b in iter(lambda: conn.recv(1 << 16), b""))))
    reader.start()
    for _ in range(64):
        cli.sendall(b"x" * 1024)
        time.sleep(0.001)
    cli.close()
    reader.join(10)
    conn.close()
    srv.close()
    assert got == [64 * 1024]
    bg = meter.report()
    assert bg["tcp_out_segs"] >= 64 and bg["tcp_retrans_segs"] >= 0 and bg["tcp_reorder"] >= 0
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        assert bg["tcp_cc"] == f.read().strip() != ""
    quiet = dict(bg, tcp_out_segs=999)
    assert "tcp, machine-wide" not in processes.format_background(quiet)
    assert bg["rdmaflow_tcp_cc"] == tcp_congestion_of()
    busy = dict(bg, tcp_out_segs=2000, tcp_retrans_segs=30, tcp_reorder=7, tcp_cc="bbr", rdmaflow_tcp_cc="bbr")
    assert processes.format_background(busy).splitlines()[1] == (
        "tcp, machine-wide: congestion control bbr; 30 of 2000 segments retransmitted (1.50%), 7 reorderings seen")
    busy["rdmaflow_tcp_cc"] = "cubic"
    assert processes.format_background(busy).splitlines()[1].startswith(
        "tcp, machine-wide: congestion control bbr (rdmaflow's data sockets: cubic); 30 of 2000")


def test_host_phases_wait_bounded_and_once_per_slow_phase():
    """HostPhases.before() waits (probing) while the handoff is 2x the fastest seen or more, for
    at most `settle` seconds; a wait that ran out is not repeated until the host is fast again."""
    from rdmaflow.bench.processes import HostPhases

    figures = iter([30.0, 170.0, 168.0, 31.0])
    calls = []

    def probe():
        calls.append(1)
        return next(figures, 170.0)

    phases = HostPhases(settle=0.3, probe=probe, step=0.05)
    assert phases.before() == 30.0 and len(calls) == 1
    assert phases.before() == 31.0 and len(calls) == 4  # waited out 170 and 168
    assert phases.after(31.0) == 170.0  # the slower of before and after
    n = len(calls)
    assert phases.before() == 170.0 and len(calls) > n + 1  # slow for good: waits, then gives up
    n = len(calls)
    assert phases.before() == 170.0 and len(calls) == n + 1  # no second wait in the same phase
    figures = iter([32.0, 175.0])
    assert phases.before() == 32.0  # fast again ...
    n = len(calls)
    assert phases.before() == 170.0 and len(calls) > n + 1  # ... so the next slow phase is waited for
    assert HostPhases(settle=5, probe=lambda: None).before() is None  # no probe here: no wait
