"""The README's code, run as written: the device snippet's receiver and sender as two processes
(the receiver learns from the flag word that the data arrived)."""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

from rdmaflow.bench.processes import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_blocks(lang: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(rf"```{lang}\n(.*?)```", f.read(), re.DOTALL)


def test_the_device_snippet_runs_as_two_processes(tmp_path):
    receiver, sender = [b for b in readme_blocks("python") if b.startswith(("# receiver.py", "# sender.py"))]
    here = f"127.0.0.1:{free_port()}"  # the README's hosts, on this one
    env = dict(os.environ, RDMAFLOW_JOB_SECRET=secrets.token_hex(16))
    env.pop("UCX_TLS", None)
    for name, code in (("receiver.py", receiver), ("sender.py", sender)):
        (tmp_path / name).write_text(code.replace("10.0.0.1:5000", here).replace("10.0.0.2", "127.0.0.1"))
    rx = subprocess.Popen([sys.executable, str(tmp_path / "receiver.py")], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert rx.stdout.readline() == "waiting for the data\n", rx.stderr.read() if rx.poll() is not None else ""
        tx = subprocess.run([sys.executable, str(tmp_path / "sender.py")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=90, check=False)
        assert tx.returncode == 0 and tx.stdout == "sent\n", tx.stdout + tx.stderr
        out, err = rx.communicate(timeout=60)
        assert rx.returncode == 0, err
        assert out == f"arrived: {4096.0 * 4096} flag 1\n", out + err
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(10)
