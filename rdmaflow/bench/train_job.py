"""One process of one ``rdmaflow bench train`` cell: what every system's process shares.

The configuration (``RDMAFLOW_TRAIN_CFG``, :func:`parse_config`), who the process is in the
job (:class:`ProcessRole`, from torchrun's variables), a watchdog that ends a process that
made no progress, the job's c10d store, the network helpers that point gloo and TensorPipe at
the right interface, and the training loop every system runs (:func:`train_loop`: the same
model, data and optimizer everywhere; only how gradients and weights move differs, see
:mod:`rdmaflow.bench.train_systems`).

Ranks of the parameter-server systems: 0..shards-1 are shards, shards..shards+workers-1 are
workers. Rank 0 serves the job's c10d TCPStore at ``MASTER_ADDR:MASTER_PORT`` (for tensorpipe
the store of ``rpc.init_rpc``); servers bind and advertise the address of this host on the
route to the master (:func:`rdmaflow.job.route_address`), and gloo and TensorPipe are
pointed at that address's interface (``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``, unless
already set), so processes in different network namespaces ("hosts") reach each other.

Every wait is bounded by the configuration's ``timeout``; the :class:`Watchdog` ends a process
that made no progress for longer than that (plus a margin), so no process ever hangs.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from rdmaflow.bench.baselines import TENSORPIPE_OPTIONS
from rdmaflow.job import route_address

SYSTEMS = ("rdmaflow", "tensorpipe", "grpc", "ddp", "local")
PS_SYSTEMS = ("rdmaflow", "tensorpipe", "grpc")
RESULT_PREFIX = "RDMAFLOW_TRAIN_RESULT "
CFG_ENV = "RDMAFLOW_TRAIN_CFG"
MOMENTUM = 0.9

# Fields of RDMAFLOW_TRAIN_CFG. Required ones have no default.
REQUIRED = ("system", "model", "batch", "workers", "iters")
DEFAULTS = {"shards": 1, "warmup": 0, "zero_copy": True, "overlap": True, "mode": "sync", "lr": 0.01,
            "seed": 0, "timeout": 300.0}
# Optional fields: threads (torch.set_num_threads), dump (worker 0 saves its final state_dict
# there), policy and staleness (rdmaflow's placement and bounded-staleness bound), transport
# (tensorpipe: "tcp" or "sm").
OPTIONAL = ("threads", "dump", "policy", "staleness", "transport")

now = time.monotonic
TRACE = bool(os.environ.get("RDMAFLOW_TRAIN_TRACE"))  # progress lines with timestamps on stderr


class ConfigError(ValueError):
    """The configuration or the environment of the process is wrong (exit status 2)."""


# ------------------------------------------------------------------------------------------
# configuration and identity


def _models():
    return importlib.import_module("rdmaflow.bench.models")


def _int(cfg: dict, key: str, lo: int) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{key} must be an integer >= {lo}, got {v!r}")
    return v


def parse_config(text: str | None) -> dict:
    """Parses and checks ``RDMAFLOW_TRAIN_CFG``; fills the defaults. Raises ConfigError."""
    if not text:
        raise ConfigError(f"${CFG_ENV} is not set (a JSON object: {', '.join(REQUIRED + tuple(DEFAULTS))})")
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"${CFG_ENV} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"${CFG_ENV} must be a JSON object, got {type(cfg).__name__}")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"${CFG_ENV} lacks {missing}")
    cfg = {**DEFAULTS, **cfg}
    unknown = sorted(set(cfg) - set(REQUIRED) - set(DEFAULTS) - set(OPTIONAL))
    if unknown:
        print(f"rdmaflow bench train: ignoring unknown configuration fields {unknown}", file=sys.stderr)
    if cfg["system"] not in SYSTEMS:
        raise ConfigError(f"unknown system {cfg['system']!r}; the systems are {', '.join(SYSTEMS)}")
    for key, lo in (("batch", 1), ("workers", 1), ("warmup", 0), ("iters", 1), ("seed", 0)):
        _int(cfg, key, lo)
    # ddp and local have no shards (the harness records them with shards 0).
    _int(cfg, "shards", 1 if cfg["system"] in PS_SYSTEMS else 0)
    for key in ("zero_copy", "overlap"):
        if not isinstance(cfg[key], bool):
            raise ConfigError(f"{key} must be true or false, got {cfg[key]!r}")
    for key in ("lr", "timeout"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{key} must be a positive number, got {v!r}")
        cfg[key] = float(v)
    if cfg["mode"] not in ("sync", "async", "bounded"):
        raise ConfigError(f"mode must be 'sync', 'async' or 'bounded', got {cfg['mode']!r}")
    if cfg["system"] in ("tensorpipe", "grpc") and cfg["mode"] != "sync":
        raise ConfigError(f"the {cfg['system']} parameter server is synchronous: mode must be 'sync', "
                          f"got {cfg['mode']!r}")
    if cfg.get("threads") is not None:
        _int(cfg, "threads", 1)
    if cfg.get("staleness") is not None:
        _int(cfg, "staleness", 0)
    if cfg.get("transport") is not None and cfg["transport"] not in TENSORPIPE_OPTIONS:
        raise ConfigError(f"transport must be one of {sorted(TENSORPIPE_OPTIONS)}, got {cfg['transport']!r}")
    if cfg.get("dump") is not None and not isinstance(cfg["dump"], str):
        raise ConfigError(f"dump must be a path, got {cfg['dump']!r}")
    return cfg


def check_model(cfg: dict) -> None:
    m = _models()
    names = list(getattr(m, "MODELS", ())) + list(getattr(m, "TEST_MODELS", ()))
    if cfg["model"] not in names:
        raise ConfigError(f"unknown model {cfg['model']!r}; the models are {', '.join(map(str, names))}")


@dataclass
class ProcessRole:
    """Who this process is in the job."""

    system: str
    role: str           # "shard" or "worker"
    index: int          # shard or worker index
    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def _env_int(name: str, default: int | None = None) -> int:
    v = os.environ.get(name, "")
    if v == "":
        if default is None:
            raise ConfigError(f"${name} is not set")
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"${name}={v!r} is not an integer") from None


def resolve_role(cfg: dict) -> ProcessRole:
    system, workers, shards = cfg["system"], cfg["workers"], cfg["shards"]
    if system == "local":
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        if rank != 0 or world != 1:
            raise ConfigError(f"system 'local' is one process (RANK 0, WORLD_SIZE 1), "
                              f"got RANK {rank}, WORLD_SIZE {world}")
        return ProcessRole(system, "worker", 0, 0, 1, os.environ.get("MASTER_ADDR", "127.0.0.1"), 0)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    want = workers if system == "ddp" else workers + shards
    if world != want:
        what = "workers" if system == "ddp" else f"shards + workers = {shards} + {workers}"
        raise ConfigError(f"WORLD_SIZE is {world}, but system {system!r} needs {what} = {want} processes")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is outside 0..{world - 1}")
    addr = os.environ.get("MASTER_ADDR") or ""
    if not addr:
        raise ConfigError("$MASTER_ADDR is not set")
    port = _env_int("MASTER_PORT")
    if system == "ddp":
        return ProcessRole(system, "worker", rank, rank, world, addr, port)
    if rank < shards:
        return ProcessRole(system, "shard", rank, rank, world, addr, port)
    return ProcessRole(system, "worker", rank - shards, rank, world, addr, port)


# ------------------------------------------------------------------------------------------
# process helpers: watchdog, exit, network


class Watchdog:
    """Ends the process (exit status 3) when it made no progress for ``limit`` seconds."""

    def __init__(self, limit: float, who: str):
        self.limit = limit
        self.who = who
        self.what = "starting"
        self.last = now()
        self.deadline: float | None = None
        t = threading.Thread(target=self._run, name="rdmaflow-train-watchdog", daemon=True)
        t.start()

    def kick(self, what: str | None = None) -> None:
        self.last = now()
        if what is not None:
            self.what = what
            if TRACE:
                print(f"[{time.time():.3f} cpu {time.process_time():.2f}] {self.who}: {what}", file=sys.stderr,
                      flush=True)

    def final(self, seconds: float, what: str) -> None:
        """From now on the process must end within ``seconds`` whatever happens."""
        self.what = what
        self.deadline = now() + seconds

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            t = now()
            if self.deadline is not None and t > self.deadline:
                msg = f"did not finish {self.what} in time"
            elif self.deadline is None and t - self.last > self.limit:
                msg = f"no progress for {self.limit:.0f} s (last: {self.what})"
            else:
                continue
            try:
                sys.stderr.write(f"rdmaflow bench train: {self.who}: {msg}; giving up\n")
                sys.stderr.flush()
            finally:
                os._exit(3)


def watchdog_limit(timeout: float) -> float:
    # A margin over the timeout, so that the bounded waits report their own, clearer errors.
    return timeout + max(10.0, 0.25 * timeout)


def exit_process(code: int, watchdog: Watchdog | None = None) -> None:
    """Runs the atexit handlers (a store's host waits for its clients, bounded), then leaves
    without the interpreter's slow teardown of torch."""
    if watchdog is not None:
        watchdog.final(30.0, "exiting")
    with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing to flush to
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(Exception):  # the handlers are anyone's code; the process exits regardless
        atexit._run_exitfuncs()
    os._exit(code)


def interface_of(addr: str) -> str | None:
    """The name of the network interface holding IPv4 address ``addr`` (None if none)."""
    try:
        import fcntl
        import struct

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    r = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(r[20:24]) == addr:
                    return name
    except (OSError, ImportError):
        pass
    return None


def point_at_interface(master_addr: str, var: str) -> None:
    """Sets ``var`` (GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME) to the interface facing the master."""
    if os.environ.get(var):
        return
    name = interface_of(route_address(master_addr))
    if name:
        os.environ[var] = name


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def make_store(me: ProcessRole, timeout: float):
    import torch.distributed as dist

    try:
        return dist.TCPStore(me.master_addr, me.master_port, me.world_size, me.rank == 0,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        raise RuntimeError(f"cannot reach the job's c10d store at {hostport(me.master_addr, me.master_port)} "
                           f"within {timeout:.0f} s: {e}") from None


def leave_store(store, me: ProcessRole, timeout: float) -> None:
    """Every process counts itself out; rank 0, which serves the store, leaves last (bounded)."""
    store.add("rdmaflow/train/left", 1)
    if me.rank == 0:
        deadline = now() + timeout
        while store.add("rdmaflow/train/left", 0) < me.world_size:
            if now() > deadline:
                raise TimeoutError(f"not every process of the job finished within {timeout:.0f} s of rank 0")
            time.sleep(0.01)


# ------------------------------------------------------------------------------------------
# data, model, training loop


def batch_seed(seed: int, worker: int, t: int) -> int:
    """The generator seed of worker ``worker``'s batch of iteration ``t`` (0-based, warmup
    included): a stable hash of (seed, worker, t)."""
    h = hashlib.blake2b(f"rdmaflow-bench-train/{seed}/{worker}/{t}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def make_batch(model: str, batch: int, seed: int, worker: int, t: int):
    return _models().synthetic_batch(model, batch, torch.Generator().manual_seed(batch_seed(seed, worker, t)))


def build_model(cfg: dict):
    return _models().build(cfg["model"], seed=cfg["seed"])


def make_sgd(params, cfg: dict):
    return torch.optim.SGD(params, lr=cfg["lr"], momentum=MOMENTUM)


def train_loop(cfg: dict, worker: int, model, zero_grad, step, finish, watchdog: Watchdog) -> tuple[list, list]:
    """Runs warmup + iters iterations: zero_grad, forward, backward, ``step()``.

    Iteration t's time runs from its start to the start of iteration t+1; making the next
    batch is not counted (it happens between the two). The last iteration ends when
    ``finish()`` (pending communication) returns. Returns (times after warmup, every loss)."""
    loss_fn = _models().loss_fn(cfg["model"])
    torch.manual_seed(batch_seed(cfg["seed"], worker, -1))  # dropout etc.: reproducible per worker
    n = cfg["warmup"] + cfg["iters"]
    times: list[float] = []
    losses: list[float] = []
    start = None
    for t in range(n):
        d0 = now()
        x, y = make_batch(cfg["model"], cfg["batch"], cfg["seed"], worker, t)
        if start is not None:
            times.append(d0 - start)
        start = now()
        zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        step()
        losses.append(float(loss.detach()))
        watchdog.kick(f"iteration {t + 1} of {n}")
    finish()
    times.append(now() - start)
    return times[cfg["warmup"]:], losses


def dump_state(cfg: dict, worker: int, module) -> None:
    """Worker 0 saves its final ``state_dict`` (cloned tensors) to ``cfg["dump"]``."""
    if worker != 0 or not cfg.get("dump"):
        return
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save(state, cfg["dump"])


def result(cfg: dict, worker: int, times: list, losses: list) -> dict:
    return {"system": cfg["system"], "model": cfg["model"], "worker": worker, "times": times,
            "losses": losses, "batch": cfg["batch"]}


def describe_error(me: ProcessRole | None, e: BaseException) -> str:
    who = f"{me.system} {me.name} (rank {me.rank})" if me else "setup"
    return f"rdmaflow bench train: {who} failed: {type(e).__name__}: {e}"


def format_tb() -> str:
    return traceback.format_exc()
