"""A parameter-server job of real processes, started as a launcher starts them (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RDMAFLOW_JOB_SECRET,
RDMAFLOW_SHARDS_PER_NODE) with the job's c10d store served by the test process, as torchrun's
agent serves it: no launcher or torchrun processes of its own (each would import torch too)."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from rdmaflow._ucx import ucx_env


class PSJob:
    def __init__(self, name: str, argv: list[str], workers: int, shards: int, transport: str, tmp, cwd=None,
                 **env_extra: str):
        n = workers + shards
        self.name, self.shards = name, shards
        self.store = dist.TCPStore("127.0.0.1", 0, n, True, wait_for_workers=False)
        secret = secrets.token_hex(16)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("RDMAFLOW_", "TORCHELASTIC_"))}
        self.procs, self.logs = [], []
        for rank in range(n):
            env = ucx_env(transport, base)
            env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                       GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                       RDMAFLOW_JOB_SECRET=secret, RDMAFLOW_SHARDS_PER_NODE=str(shards),
                       TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
                       RDMAFLOW_PS_TIMEOUT="90", RDMAFLOW_PS_STEP_TIMEOUT="90", **env_extra)
            log = tmp / f"{name}.{rank}.log"
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                                                   env=env, cwd=cwd, start_new_session=True))

    def wait(self, timeout: float = 150) -> list[int]:
        """Every rank's exit status; AssertionError with the output after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"job {self.name} did not finish in {timeout} s:\n{self.output()}")
            time.sleep(0.1)
        return [p.returncode for p in self.procs]

    def worker_output(self, w: int) -> str:
        return self.logs[self.shards + w].read_text()

    def output(self) -> str:
        return "\n".join(f"--- {self.name} rank {r} (exit {p.returncode}):\n{log.read_text()[-3000:]}"
                         for r, (p, log) in enumerate(zip(self.procs, self.logs)))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
