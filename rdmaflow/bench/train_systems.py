"""The five systems of ``rdmaflow bench train`` (seed 000 §5.2, Figures 9, 11, 12).

One process of one benchmark cell runs :func:`run` (through ``python -m
rdmaflow.bench._train_proc``, see there for the contract with the harness). Every system
trains the same model with the same data and the same optimizer; only how gradients and
weights move differs:

* ``local``: single-process training (``torch.optim.SGD`` in the process).
* ``ddp``: ``DistributedDataParallel`` over gloo (allreduce of the gradients, SGD on every
  worker).
* ``tensorpipe``: a synchronous parameter server over ``torch.distributed.rpc`` (TensorPipe),
  the pattern of PyTorch's batch-updating parameter server tutorial: variables round-robin
  over the shards; each step a worker sends each shard the gradients of its variables
  (``rpc_async`` of an ``@rpc.functions.async_execution`` function); once every worker's
  gradients of the step are there the shard averages them, runs SGD (momentum 0.9) and
  answers every worker with its new weights, which the workers copy into their model.
* ``grpc``: the same parameter server over gRPC (grpcio): one unary call per shard per step
  whose request (a protobuf message: step, worker, ``repeated bytes`` with one tensor's bytes
  each) carries that shard's gradients and whose response carries its new weights; tensor
  bytes go through protobuf serialization, as on TensorFlow's gRPC path.
* ``rdmaflow``: :class:`rdmaflow.ps.DistributedOptimizer` (one-sided WRITEs over UCX).

Ranks of the parameter-server systems: 0..shards-1 are shards, shards..shards+workers-1 are
workers. Rank 0 serves the job's c10d TCPStore at ``MASTER_ADDR:MASTER_PORT`` (for tensorpipe
the store of ``rpc.init_rpc``); servers bind and advertise the address of this host on the
route to the master (:func:`rdmaflow.ps.context.local_address`), and gloo and TensorPipe are
pointed at that address's interface (``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``, unless
already set), so processes in different network namespaces ("hosts") reach each other.

Every wait is bounded by the configuration's ``timeout``; a watchdog thread ends a process
that made no progress for longer than that (plus a margin), so no process ever hangs.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import importlib
import inspect
import json
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed.rpc as rpc

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
TENSORPIPE_TRANSPORTS = {"tcp": (["uv"], ["basic"]), "sm": (["shm", "uv"], ["cma", "basic"])}

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
    if cfg.get("transport") is not None and cfg["transport"] not in TENSORPIPE_TRANSPORTS:
        raise ConfigError(f"transport must be one of {sorted(TENSORPIPE_TRANSPORTS)}, got {cfg['transport']!r}")
    if cfg.get("dump") is not None and not isinstance(cfg["dump"], str):
        raise ConfigError(f"dump must be a path, got {cfg['dump']!r}")
    return cfg


def check_model(cfg: dict) -> None:
    m = _models()
    names = list(getattr(m, "MODELS", ())) + list(getattr(m, "TEST_MODELS", ()))
    if cfg["model"] not in names:
        raise ConfigError(f"unknown model {cfg['model']!r}; the models are {', '.join(map(str, names))}")


@dataclass
class Proc:
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


def resolve_proc(cfg: dict) -> Proc:
    system, workers, shards = cfg["system"], cfg["workers"], cfg["shards"]
    if system == "local":
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        if rank != 0 or world != 1:
            raise ConfigError(f"system 'local' is one process (RANK 0, WORLD_SIZE 1), got RANK {rank}, WORLD_SIZE {world}")
        return Proc(system, "worker", 0, 0, 1, os.environ.get("MASTER_ADDR", "127.0.0.1"), 0)
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
        return Proc(system, "worker", rank, rank, world, addr, port)
    if rank < shards:
        return Proc(system, "shard", rank, rank, world, addr, port)
    return Proc(system, "worker", rank - shards, rank, world, addr, port)


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
                print(f"[{time.time():.3f} cpu {time.process_time():.2f}] {self.who}: {what}", file=sys.stderr, flush=True)

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
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        pass
    os._exit(code)


def host_address(master_addr: str) -> str:
    from rdmaflow.ps.context import local_address

    return local_address(master_addr)


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
    name = interface_of(host_address(master_addr))
    if name:
        os.environ[var] = name


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def make_store(proc: Proc, timeout: float):
    import torch.distributed as dist

    try:
        return dist.TCPStore(proc.master_addr, proc.master_port, proc.world_size, proc.rank == 0,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        raise RuntimeError(f"cannot reach the job's c10d store at {hostport(proc.master_addr, proc.master_port)} "
                           f"within {timeout:.0f} s: {e}") from None


def leave_store(store, proc: Proc, timeout: float) -> None:
    """Every process counts itself out; rank 0, which serves the store, leaves last (bounded)."""
    store.add("rdmaflow/train/left", 1)
    if proc.rank == 0:
        deadline = now() + timeout
        while store.add("rdmaflow/train/left", 0) < proc.world_size:
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


# ------------------------------------------------------------------------------------------
# local


def run_local(cfg: dict, proc: Proc, wd: Watchdog) -> dict:
    model = build_model(cfg)
    opt = make_sgd(model.parameters(), cfg)
    times, losses = train_loop(cfg, 0, model, opt.zero_grad, opt.step, lambda: None, wd)
    dump_state(cfg, 0, model)
    return result(cfg, 0, times, losses)


# ------------------------------------------------------------------------------------------
# ddp


def run_ddp(cfg: dict, proc: Proc, wd: Watchdog) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    timeout = cfg["timeout"]
    point_at_interface(proc.master_addr, "GLOO_SOCKET_IFNAME")
    store = make_store(proc, timeout)
    dist.init_process_group("gloo", store=store, rank=proc.rank, world_size=proc.world_size,
                            timeout=timedelta(seconds=timeout))
    wd.kick("DistributedDataParallel setup")
    model = build_model(cfg)
    ddp = DistributedDataParallel(model)
    opt = make_sgd(ddp.parameters(), cfg)
    wd.kick("training")
    times, losses = train_loop(cfg, proc.index, ddp, opt.zero_grad, opt.step, lambda: None, wd)
    dump_state(cfg, proc.index, model)
    # Rank 0 serves the store: it leaves last, once every rank is past its last collective.
    dist.destroy_process_group()
    leave_store(store, proc, timeout)
    return result(cfg, proc.index, times, losses)


# ------------------------------------------------------------------------------------------
# the synchronous shard shared by tensorpipe and grpc


def variables_of(params: list, shard: int, shards: int) -> list[int]:
    """Indices of the variables shard ``shard`` holds: round-robin over the model's parameters."""
    return [i for i in range(len(params)) if i % shards == shard]


class SyncShard:
    """A shard's variables and its SGD; applies a step once every worker's gradients for it
    arrived (their mean), then delivers the new weights to every worker of the step."""

    def __init__(self, cfg: dict, shard: int, on_progress=None):
        model = build_model(cfg)
        params = list(model.parameters())
        self.index = shard
        self.workers = cfg["workers"]
        self.vars = [torch.nn.Parameter(params[i].detach().clone()) for i in variables_of(params, shard, cfg["shards"])]
        del model, params
        self.acc = [torch.zeros_like(p) for p in self.vars]
        self.opt = make_sgd(self.vars, cfg) if self.vars else None
        self.lock = threading.Lock()
        self.step = 0
        self.arrived: set[int] = set()
        self.waiters: list = []
        self.done: set[int] = set()
        self.all_done = threading.Event()
        self.failed: str | None = None
        self.on_progress = on_progress or (lambda what: None)

    def weights(self) -> list:
        return [p.detach() for p in self.vars]

    def push(self, step: int, worker: int, grads: list, deliver) -> None:
        """``deliver(weights, None)`` once step ``step`` is applied, or ``deliver(None, exc)``."""
        with self.lock:
            err = self.failed
            if err is None and (step != self.step + 1 or worker in self.arrived):
                err = f"shard {self.index}: worker {worker} pushed step {step}, the shard is at step {self.step + 1}"
            if err is None and (not 0 <= worker < self.workers or len(grads) != len(self.vars)):
                err = f"shard {self.index}: bad push from worker {worker} ({len(grads)} gradients, {len(self.vars)} variables)"
            if err is not None:
                self.failed = self.failed or err
                waiters, self.waiters = self.waiters, []
            else:
                first = not self.arrived
                with torch.no_grad():
                    for a, g in zip(self.acc, grads):
                        g = g.reshape(a.shape)
                        if first:
                            a.copy_(g)
                        else:
                            a.add_(g)
                self.arrived.add(worker)
                self.waiters.append(deliver)
                if len(self.arrived) < self.workers:
                    return
                for p, a in zip(self.vars, self.acc):
                    p.grad = a.div_(self.workers)
                if self.opt is not None:
                    self.opt.step()
                self.step += 1
                self.arrived = set()
                waiters, self.waiters = self.waiters, []
        if err is not None:
            exc = RuntimeError(err)
            for d in waiters + [deliver]:
                d(None, exc)
            return
        self.on_progress(f"step {self.step}")
        w = self.weights()
        for d in waiters:
            d(w, None)

    def finish(self, worker: int) -> None:
        with self.lock:
            self.done.add(worker)
            if len(self.done) >= self.workers:
                self.all_done.set()
        self.on_progress(f"worker {worker} done")

    def wait_done(self) -> None:
        # Bounded by the watchdog: every step or finished worker is progress.
        while not self.all_done.wait(0.2):
            pass


def ps_setup(cfg: dict, model) -> tuple[list, list[list[int]]]:
    params = list(model.parameters())
    return params, [variables_of(params, s, cfg["shards"]) for s in range(cfg["shards"])]


def grads_of(params: list, idx: list[int]) -> list:
    out = []
    for i in idx:
        g = params[i].grad
        out.append(torch.zeros_like(params[i]) if g is None else g.detach())
    return out


def copy_weights(params: list, idx: list[int], weights: list) -> None:
    if len(weights) != len(idx):
        raise RuntimeError(f"a shard answered {len(weights)} tensors for {len(idx)} variables")
    with torch.no_grad():
        for i, w in zip(idx, weights):
            params[i].copy_(w.reshape(params[i].shape))


# ------------------------------------------------------------------------------------------
# tensorpipe: torch.distributed.rpc


_TP_SHARD: SyncShard | None = None


def _tp_push_impl(step: int, worker: int, grads: list):
    fut = torch.futures.Future()

    def deliver(weights, exc):
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(weights)

    if _TP_SHARD is None:
        fut.set_exception(RuntimeError("this process is no tensorpipe shard"))
    else:
        _TP_SHARD.push(step, worker, grads, deliver)
    return fut


def _tp_pull(worker: int) -> list:
    return _TP_SHARD.weights()


def _tp_done(worker: int) -> bool:
    _TP_SHARD.finish(worker)
    return True


@rpc.functions.async_execution
def _tp_push(step: int, worker: int, grads: list):
    """Runs on a shard, called by each worker every step: answers (a future) the shard's new
    weights once every worker's gradients of the step are in and applied."""
    return _tp_push_impl(step, worker, grads)


_RPC_SCHEME = "rdmaflowtrain"
_RPC_STORE = None


def _rpc_rendezvous(url: str, **kwargs):
    """torch.distributed rendezvous handler that hands rpc this process's own store, so that
    rank 0 can keep serving it until every process is through rpc.shutdown (whose join still
    uses the store)."""
    from urllib.parse import parse_qsl, urlparse

    q = dict(parse_qsl(urlparse(url).query))
    yield (_RPC_STORE, int(q["rank"]), int(q["world_size"]))


def _tp_init(cfg: dict, proc: Proc, store) -> None:
    global _RPC_STORE
    import torch.distributed as dist

    _RPC_STORE = store
    try:
        dist.register_rendezvous_handler(_RPC_SCHEME, _rpc_rendezvous)
    except RuntimeError:
        pass  # registered already
    point_at_interface(proc.master_addr, "TP_SOCKET_IFNAME")
    point_at_interface(proc.master_addr, "GLOO_SOCKET_IFNAME")  # rpc's own gloo group
    kw = {}
    if cfg.get("transport"):
        transports, channels = TENSORPIPE_TRANSPORTS[cfg["transport"]]
        kw = {"_transports": transports, "_channels": channels}
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"{_RPC_SCHEME}://", rpc_timeout=cfg["timeout"],
        num_worker_threads=max(16, 2 * cfg["workers"] + 4), **kw)
    with warnings.catch_warnings():
        # rpc's own use of a gloo group as a ProcessGroup (a deprecation warning of torch's)
        warnings.filterwarnings("ignore", message="You are using a Backend")
        rpc.init_rpc(proc.name, rank=proc.rank, world_size=proc.world_size, rpc_backend_options=opts)


def run_tensorpipe(cfg: dict, proc: Proc, wd: Watchdog) -> dict | None:
    global _TP_SHARD
    timeout = cfg["timeout"]
    store = make_store(proc, timeout)
    if proc.role == "shard":
        _TP_SHARD = SyncShard(cfg, proc.index, wd.kick)
        wd.kick("rpc setup")
        _tp_init(cfg, proc, store)
        wd.kick("serving")
        _TP_SHARD.wait_done()
        wd.kick("rpc shutdown")
        rpc.shutdown(graceful=True, timeout=timeout)
        leave_store(store, proc, timeout)
        return None

    model = build_model(cfg)
    params, placement = ps_setup(cfg, model)
    _tp_init(cfg, proc, store)
    wd.kick("initial weights")
    shards = [(f"shard{s}", idx) for s, idx in enumerate(placement) if idx]
    for name, idx in shards:
        copy_weights(params, idx, rpc.rpc_sync(name, _tp_pull, args=(proc.index,), timeout=timeout))
    state = {"t": 0}

    def step():
        state["t"] += 1
        futs = [(rpc.rpc_async(name, _tp_push, args=(state["t"], proc.index, grads_of(params, idx)), timeout=timeout), idx)
                for name, idx in shards]
        for fut, idx in futs:
            copy_weights(params, idx, fut.wait())

    wd.kick("training")
    times, losses = train_loop(cfg, proc.index, model, model.zero_grad, step, lambda: None, wd)
    dump_state(cfg, proc.index, model)
    for s in range(cfg["shards"]):
        rpc.rpc_sync(f"shard{s}", _tp_done, args=(proc.index,), timeout=timeout)
    wd.kick("rpc shutdown")
    rpc.shutdown(graceful=True, timeout=timeout)
    leave_store(store, proc, timeout)
    return result(cfg, proc.index, times, losses)


# ------------------------------------------------------------------------------------------
# grpc: grpcio, protobuf messages with the tensors' bytes


GRPC_SERVICE = "rdmaflow.bench.train.ParameterServer"
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_TENSORS_CLS = None


def tensors_message():
    """The protobuf message class ``rdmaflow.bench.train.Tensors``:
    ``int64 step = 1; int32 worker = 2; repeated bytes data = 3;`` (one tensor's bytes each)."""
    global _TENSORS_CLS
    if _TENSORS_CLS is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        F = descriptor_pb2.FieldDescriptorProto
        fdp = descriptor_pb2.FileDescriptorProto(name="rdmaflow_bench_train.proto", package="rdmaflow.bench.train",
                                                 syntax="proto3")
        m = fdp.message_type.add(name="Tensors")
        m.field.add(name="step", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
        m.field.add(name="worker", number=2, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
        m.field.add(name="data", number=3, type=F.TYPE_BYTES, label=F.LABEL_REPEATED)
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        _TENSORS_CLS = message_factory.GetMessageClass(pool.FindMessageTypeByName("rdmaflow.bench.train.Tensors"))
    return _TENSORS_CLS


def tensor_bytes(t) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bytes_tensor(b: bytes, like):
    if like.numel() == 0:
        return torch.empty_like(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only bytes: only read from
        return torch.frombuffer(b, dtype=like.dtype, count=like.numel()).view(like.shape)


class GrpcShardService:
    def __init__(self, shard: SyncShard, timeout: float):
        self.shard = shard
        self.timeout = timeout
        self.Tensors = tensors_message()
        self.cache: tuple[int, object] | None = None  # (step, response message): built once per step
        self.cache_lock = threading.Lock()

    def _reply(self, step: int, weights: list):
        with self.cache_lock:
            if self.cache is None or self.cache[0] != step:
                self.cache = (step, self.Tensors(step=step, data=[tensor_bytes(w) for w in weights]))
            return self.cache[1]

    def Pull(self, request, context):
        return self._reply(self.shard.step, self.shard.weights())

    def Push(self, request, context):
        import grpc

        sh = self.shard
        if len(request.data) != len(sh.vars):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(request.data)} gradients for the {len(sh.vars)} variables of shard {sh.index}")
        grads = [bytes_tensor(b, p) for b, p in zip(request.data, sh.vars)]
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def deliver(weights, exc):
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(weights)

        sh.push(int(request.step), int(request.worker), grads, deliver)
        try:
            weights = fut.result(self.timeout)
        except concurrent.futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"shard {sh.index}: not every worker pushed step {request.step} within {self.timeout:.0f} s")
        except Exception as e:  # noqa: BLE001
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return self._reply(int(request.step), weights)

    def Done(self, request, context):
        self.shard.finish(int(request.worker))
        return self.Tensors()


def run_grpc(cfg: dict, proc: Proc, wd: Watchdog) -> dict | None:
    import grpc

    timeout = cfg["timeout"]
    Tensors = tensors_message()
    store = make_store(proc, timeout)
    wd.kick("store")
    if proc.role == "shard":
        shard = SyncShard(cfg, proc.index, wd.kick)
        svc = GrpcShardService(shard, timeout)
        handlers = {m: grpc.unary_unary_rpc_method_handler(
            getattr(svc, m), request_deserializer=Tensors.FromString, response_serializer=Tensors.SerializeToString)
            for m in ("Pull", "Push", "Done")}
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2 * cfg["workers"] + 4),
                             options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
        host = host_address(proc.master_addr)
        port = server.add_insecure_port(hostport(host, 0))
        if not port:
            raise RuntimeError(f"the gRPC server could not bind a port on {host}")
        server.start()
        store.set(f"rdmaflow/train/grpc/{proc.index}", hostport(host, port))
        wd.kick("serving")
        shard.wait_done()
        server.stop(grace=2.0).wait(5.0)
        leave_store(store, proc, timeout)
        return None

    model = build_model(cfg)
    params, placement = ps_setup(cfg, model)
    stubs = []
    keys = [f"rdmaflow/train/grpc/{s}" for s in range(cfg["shards"])]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001
        raise TimeoutError(f"the gRPC shards did not publish their addresses within {timeout:.0f} s: {e}") from None
    channels = []
    for s, idx in enumerate(placement):
        target = store.get(keys[s]).decode()
        ch = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        channels.append(ch)
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"cannot connect to gRPC shard {s} at {target} within {timeout:.0f} s") from None
        m = {name: ch.unary_unary(f"/{GRPC_SERVICE}/{name}", request_serializer=Tensors.SerializeToString,
                                  response_deserializer=Tensors.FromString) for name in ("Pull", "Push", "Done")}
        stubs.append((m, idx))
    wd.kick("initial weights")
    for m, idx in stubs:
        if idx:
            rep = m["Pull"](Tensors(worker=proc.index), timeout=timeout)
            copy_weights(params, idx, [bytes_tensor(b, params[i]) for b, i in zip(rep.data, idx)])
    state = {"t": 0}

    def step():
        state["t"] += 1
        futs = []
        for m, idx in stubs:
            if idx:
                # TensorFlow's gRPC path: each tensor's bytes into a protobuf message.
                msg = Tensors(step=state["t"], worker=proc.index, data=[tensor_bytes(g) for g in grads_of(params, idx)])
                futs.append((m["Push"].future(msg, timeout=timeout), idx))
                del msg
        for fut, idx in futs:
            rep = fut.result()
            copy_weights(params, idx, [bytes_tensor(b, params[i]) for b, i in zip(rep.data, idx)])

    wd.kick("training")
    times, losses = train_loop(cfg, proc.index, model, model.zero_grad, step, lambda: None, wd)
    dump_state(cfg, proc.index, model)
    for m, _ in stubs:
        m["Done"](Tensors(worker=proc.index), timeout=timeout)
    for ch in channels:
        ch.close()
    leave_store(store, proc, timeout)
    return result(cfg, proc.index, times, losses)


# ------------------------------------------------------------------------------------------
# rdmaflow


PENDING_METHODS = ("wait_weights", "synchronize")  # the first that DistributedOptimizer has


def run_rdmaflow(cfg: dict, proc: Proc, wd: Watchdog) -> dict | None:
    os.environ.update(RDMAFLOW_ROLE=proc.role, RDMAFLOW_ROLE_INDEX=str(proc.index),
                      RDMAFLOW_NUM_SHARDS=str(cfg["shards"]), RDMAFLOW_NUM_WORKERS=str(cfg["workers"]))
    import rdmaflow.ps as ps

    timeout = cfg["timeout"]
    if proc.role == "shard":
        # A shard serves inside init(); its waits are the library's own, bounded by the timeouts.
        wd.limit = float("inf")
        stats = ps.init(timeout=timeout, step_timeout=timeout, exit_shards=False)
        stats["ctx"].close()
        return None
    ctx = ps.init(timeout=timeout, step_timeout=timeout)
    model = build_model(cfg)
    wd.kick("DistributedOptimizer setup")
    accepted = inspect.signature(ps.DistributedOptimizer.__init__).parameters
    kw = {"mode": cfg["mode"], "progress": False}
    if cfg.get("policy"):
        kw["policy"] = cfg["policy"]
    if cfg.get("staleness") is not None:
        kw["staleness"] = cfg["staleness"]
    for k in ("overlap", "zero_copy"):
        if k in accepted:
            kw[k] = cfg[k]
    opt = ps.DistributedOptimizer(model, make_sgd(model.parameters(), cfg), **kw)
    state = {"closed": False}

    def finish():
        # The last iteration ends when its communication is complete.
        for name in PENDING_METHODS:
            fn = getattr(opt, name, None)
            if callable(fn):
                fn()
                return
        if cfg["overlap"] and "overlap" in accepted:
            opt.close()  # no explicit wait: close() completes what is pending
            state["closed"] = True

    wd.kick("training")
    times, losses = train_loop(cfg, proc.index, model, opt.zero_grad, opt.step, finish, wd)
    if not state["closed"]:
        opt.close()
    dump_state(cfg, proc.index, model)
    ctx.close()
    return result(cfg, proc.index, times, losses)


RUNNERS = {"local": run_local, "ddp": run_ddp, "tensorpipe": run_tensorpipe, "grpc": run_grpc,
           "rdmaflow": run_rdmaflow}


def run(cfg: dict, proc: Proc, wd: Watchdog) -> dict | None:
    """Runs this process's part of the cell: a worker's result dict, or None for a shard."""

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    return RUNNERS[cfg["system"]](cfg, proc, wd)


def describe_error(proc: Proc | None, e: BaseException) -> str:
    who = f"{proc.system} {proc.name} (rank {proc.rank})" if proc else "setup"
    return f"rdmaflow bench train: {who} failed: {type(e).__name__}: {e}"


def format_tb() -> str:
    return traceback.format_exc()
