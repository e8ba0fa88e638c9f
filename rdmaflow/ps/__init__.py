"""Parameter server for PyTorch training over one-sided transfers (Xue et al.; iRDMA; Li et al.: docs/references.md).

A few lines turn a single-process training loop into a parameter-server job::

    import rdmaflow.ps as ps

    ctx = ps.init()                       # shards serve here and exit when the job ends
    model = Net()
    opt = ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                        # push gradients, shards run SGD, weights come back
    torch.save(model.state_dict(), "model.pt")  # waits for the last step's weights (opt.synchronize() too)
    opt.close()

A ``torch.optim.lr_scheduler`` takes ``opt`` itself (``StepLR(opt, 30)``): its ``lr`` reaches the
shards with the next push.

Start it with ``rdmaflow launch --nproc-per-node 1 train.py`` (one worker and one shard per
host), or any launcher that sets torchrun's variables. A model on a CUDA device trains the same
way (``model.cuda()`` before wrapping it); ``shard_device="cuda"`` puts the shards on GPUs too.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from rdmaflow import Device, InvalidArgumentError, RdmaflowError
from rdmaflow.deadline import seconds_setting
from rdmaflow.job import job_secret, route_address
from rdmaflow.ps.context import Role, Store, replica_count, resolve_role, shard_incarnation
from rdmaflow.ps.kv import KVHandle, KVStore
from rdmaflow.ps.kv_server import check_handlers
from rdmaflow.ps.layout import DEFAULT_BLOCK_BYTES, POLICIES
from rdmaflow.ps.services import announce as announce_services
from rdmaflow.ps.services import checked as checked_services
from rdmaflow.ps.sparse import (
    Constant,
    Normal,
    SparseAdagrad,
    SparseHandle,
    SparseTable,
    TableFullError,
    Uniform,
    check_user_handlers,
)
from rdmaflow.ps.worker import MODES, Worker

__all__ = ["MODES", "POLICIES", "Constant", "DistributedOptimizer", "KVHandle", "KVStore", "Normal", "PSContext",
           "SparseAdagrad", "SparseHandle", "SparseTable", "TableFullError", "Uniform", "init"]


@dataclass
class PSContext:
    role: Role
    store: Store
    device: Device
    timeout: float
    step_timeout: float
    kv_state: str | None = None  # this job's KVStore: None (none made yet), "open" or "closed"
    shard_replicas: int | None = None  # init's shard_replicas: a KVStore's replicas unless it names its own
    optimizer_state: str | None = None  # this job's DistributedOptimizer, the same way
    services: tuple[str, ...] | None = None  # what this worker declared (services.py); None: its first service
    services_agreed: bool = False  # whether they were checked against worker 0's (or written, on worker 0)
    # How long a shard's service waits for its workers to make it (None: ``timeout``; longer in a job of
    # several services, whose workers make one after another's setup: services.py)
    declare_timeout: float | None = None
    stop_reason: str | None = None  # on a shard: why one of its services failed (the others stop on it)
    sparse_handlers: dict = field(default_factory=dict)  # init's sparse_handlers, by name
    sparse_names: list = field(default_factory=list)     # the SparseTables this worker made, in order

    @property
    def is_shard(self) -> bool:
        return self.role.kind == "shard"

    @property
    def is_worker(self) -> bool:
        return self.role.kind == "worker"

    def close(self) -> None:
        self.device.close()


_CTX: PSContext | None = None


def init(*, timeout: float | None = None, step_timeout: float | None = None, exit_shards: bool = True,
         kv_handler=None, kv_batch_handler=None, sparse_handlers: dict | None = None,
         services=None, shard_replicas: int | None = None) -> PSContext:
    """Joins the job. On a shard this serves until every worker is done, then exits the process
    (``exit_shards=False`` returns the shard's statistics instead); on a worker it returns the
    context that ``DistributedOptimizer`` or ``KVStore`` uses. ``kv_handler(key, stored, pushed)``
    is what the shards of a ``KVStore`` job apply to each key of a push (default: ``stored +=
    pushed``, over a whole request at once); ``kv_batch_handler(keys, stored, pushed)`` instead
    gets a whole request: its keys and their stored and pushed values as tensors (see kv_server.py).
    ``sparse_handlers``: ``{name: fn(keys, rows, pushed)}``, handlers a ``SparseTable`` names
    (``handler="name"``): ``fn`` returns the new rows or updates ``rows`` in place (sparse.py).

    ``services``: what the job's workers use, when it is more than one service, e.g.
    ``("optimizer", "sparse")`` for a ``DistributedOptimizer`` beside ``SparseTable``s; every
    worker gives the same (shards ignore it: they serve what worker 0 declared). Without it a job
    runs the one service each worker makes first (services.py).

    ``shard_replicas``: how many shard processes hold a copy of each key range of a ``KVStore``
    job (kv_replica.py; ``KVStore(replicas=)`` wins over it, it over ``$RDMAFLOW_SHARD_REPLICAS``;
    worker 0's decides), or of each unit of a ``DistributedOptimizer`` in mode="sync" on CPU
    shards (dense_replica.py: replication without failover so far; other modes refuse R > 1)."""
    global _CTX
    check_handlers(kv_handler, kv_batch_handler)
    sparse_handlers = check_user_handlers(sparse_handlers)
    services = checked_services(services)
    timeout = seconds_setting(timeout, "timeout", "RDMAFLOW_PS_TIMEOUT", 60.0)
    step_timeout = seconds_setting(step_timeout, "step_timeout", "RDMAFLOW_PS_STEP_TIMEOUT", 300.0)
    role = resolve_role()
    if shard_replicas is not None:
        replica_count(shard_replicas, role.num_shards)  # checked here, used by the KVStore
    if role.kind == "shard" and shard_incarnation() > 0:
        # Rejoin (copying its ranges from a live copy) is not built: a restarted shard that set up
        # afresh would publish an empty copy under its old name. It leaves before touching the job.
        print(f"rdmaflow ps: shard {role.index} (restart {shard_incarnation()}) does not rejoin a running job "
              "yet; it exits and the job goes on with one copy fewer of its ranges", file=sys.stderr, flush=True)
        if exit_shards:
            sys.exit(0)
        return {"kind": "restarted", "rejoined": False}
    secret = job_secret()
    store = Store(role, timeout)
    host = route_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    device = Device(f"{host}:0", secret=secret, connect_timeout=min(timeout, 30.0), rpc_timeout=timeout)
    ctx = PSContext(role, store, device, timeout, step_timeout, sparse_handlers=sparse_handlers,
                    services=services, shard_replicas=shard_replicas)
    if role.kind == "shard":
        from rdmaflow.ps.kv import KVShard
        from rdmaflow.ps.services import serve
        from rdmaflow.ps.shard import Shard
        from rdmaflow.ps.sparse import SparseShard

        makers = {"optimizer": lambda: Shard(ctx), "kv": lambda: KVShard(ctx, kv_handler, kv_batch_handler),
                  "sparse": lambda: SparseShard(ctx, sparse_handlers)}
        try:
            stats = serve(ctx, makers)  # every service worker 0 declared, each in its own thread
        except (RdmaflowError, KeyboardInterrupt) as e:  # Ctrl-C: rdmaflow launch passes it to every process
            stopped = isinstance(e, KeyboardInterrupt)
            why = "interrupted; the job is aborted" if stopped else f"failed: {e}"
            if not (stopped and os.environ.get("RDMAFLOW_LAUNCHED")):  # rdmaflow launch says it once
                print(f"rdmaflow ps: shard {role.index} {why}", file=sys.stderr, flush=True)
            device.close()
            # Now, while this frame holds the store: serving it, this process stays (bounded)
            # until the others have read why (rdmaflow.job); at exit the store may be gone.
            store.leave()
            if exit_shards:
                sys.exit(130 if stopped else 1)  # 130: as a shell reports a process SIGINT ended
            raise
        if exit_shards:
            device.close()
            store.leave()
            sys.exit(0)
        stats["ctx"] = ctx
        return stats
    announce_services(ctx)
    _CTX = ctx
    return ctx


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a model and its optimizer, in the style of DistributedDataParallel.

    It is a ``torch.optim.Optimizer`` to the code around it: ``param_groups`` are the wrapped
    optimizer's own, so a ``torch.optim.lr_scheduler`` takes either object (``StepLR(opt, ...)``)
    and the ``lr`` it sets goes to the shards with the next push. The optimizer's state
    (momentum, Adam's moments) lives on the shards: ``checkpoint_dir`` saves it, and
    ``state_dict()`` of this object raises instead of returning an empty state.

    Weights a user reads after ``step()`` are the step's: ``model.state_dict()`` (so
    ``torch.save(model.state_dict(), ...)``) waits for weights still on the wire (a state-dict
    pre-hook on each module this optimizer trains), and ``synchronize()`` does it for code that
    reads the parameters directly.

    ``mode``: ``"sync"`` (every step aggregates all workers' gradients), ``"async"`` (a shard
    applies each gradient on arrival), ``"bounded"`` (async, but no worker runs more than
    ``staleness`` steps ahead of the slowest). ``policy``: ``"block"`` (blocks of
    ``block_bytes`` spread over the shards, iRDMA) or ``"variable"`` (whole variables
    in contiguous runs balanced by bytes, Xue et al.; a shard's many small tensors move in
    one WRITE). The optimizer's algorithm and hyperparameters run on the shards.

    ``overlap`` (default on) pushes each gradient block as backward produces it and lets the
    next forward start on the layers whose weights have arrived (sync), or computes on one
    parameter buffer while the next weights fill the other (async: one step staler, never
    waiting). ``zero_copy=False`` keeps parameters and gradients in ordinary memory and copies
    them on every push and pull (to measure what zero copy saves, Xue et al. Figure 12).

    A model whose parameters are on a CUDA device keeps its parameters and gradients in
    registered GPU memory (the device's GPU arena): backward accumulates straight into the send
    buffer, and each new weight chunk is copied in from the host copy the shards write, before
    the layer that needs it runs. ``shard_device`` (default ``"cpu"``, or
    ``$RDMAFLOW_PS_SHARD_DEVICE``): ``"cuda"`` runs the shards' aggregation and optimizer on
    their GPUs, with weights and gradient slots in GPU memory. CPU and CUDA workers may mix.

    ``min_workers``: the job goes on without dead workers while at least this many remain
    (default: all, so any worker failure ends the job). ``checkpoint_dir`` and
    ``checkpoint_every``: shards save weights and optimizer state every N steps (and at the
    end); ``rdmaflow launch --resume`` restarts from the latest one, and ``step_count`` then
    starts at its step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, mode: str = "sync",
                 staleness: int = 0, policy: str = "block", block_bytes: int = DEFAULT_BLOCK_BYTES,
                 overlap: bool = True, zero_copy: bool = True, min_workers: int | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 log_every: int = 0, progress: bool | None = None, shard_device: str | None = None,
                 ctx: PSContext | None = None):
        ctx = ctx or _CTX
        if ctx is None:
            raise InvalidArgumentError("call rdmaflow.ps.init() first")
        if not ctx.is_worker:
            raise InvalidArgumentError("DistributedOptimizer runs on workers; this process is a shard")
        if ctx.optimizer_state == "open":
            raise InvalidArgumentError("this job already has a DistributedOptimizer: a job trains one model")
        if ctx.optimizer_state == "closed":
            raise InvalidArgumentError("this job's DistributedOptimizer was closed, and its shards finished with it: "
                                       "a job has one DistributedOptimizer")
        replicas = replica_count(ctx.shard_replicas, ctx.role.num_shards)
        if replicas > 1:  # never a silent single copy: what is not built says so
            where = shard_device or os.environ.get("RDMAFLOW_PS_SHARD_DEVICE") or "cpu"
            missing = (f"mode={mode!r}" if mode != "sync" else
                       f"shard_device={where!r}" if where != "cpu" else None)
            if missing:
                reason = (f"replicated shards (R={replicas}: ps.init(shard_replicas=), $RDMAFLOW_SHARD_REPLICAS, "
                          "rdmaflow launch --shard-replicas) of a DistributedOptimizer are built for mode='sync' "
                          f"on CPU shards only; {missing} is not supported yet: start this job with one copy")
                ctx.store.abort(f"worker {ctx.role.index}: {reason}")
                raise InvalidArgumentError(reason)
            if ctx.role.index == 0:  # the copies are real, the failover is not: say so once, at the start
                print(f"rdmaflow ps: DistributedOptimizer units replicated on {replicas} shards; failover of a "
                      "dense shard is not built yet, so a shard's death still ends the job "
                      "(docs/parameter-server.md, 'The dense protocol')", file=sys.stderr, flush=True)
        if checkpoint_dir is None:
            checkpoint_dir = os.environ.get("RDMAFLOW_CHECKPOINT_DIR") or None
        self.worker = Worker(ctx, model, optimizer, mode=mode, staleness=staleness, policy=policy,
                             block_bytes=block_bytes, overlap=overlap, zero_copy=zero_copy,
                             min_workers=min_workers, checkpoint_dir=checkpoint_dir,
                             checkpoint_every=checkpoint_every, log_every=log_every, progress=progress,
                             shard_device=shard_device, replicas=replicas)
        ctx.optimizer_state = "open"
        self.ctx = ctx
        self.optimizer = optimizer
        self.model = model

    # torch.optim.Optimizer's attributes, for LR schedulers and other code that reads them: the
    # wrapped optimizer's. Optimizer.__init__ is not run: this object holds no parameters itself.
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        raise InvalidArgumentError(
            "a DistributedOptimizer's optimizer state (momentum, Adam's moments) lives on the shards, not here: "
            "DistributedOptimizer(checkpoint_dir=D, checkpoint_every=N) saves it with the weights, and "
            "`rdmaflow launch --resume` restores both; model.state_dict() holds the weights")

    def load_state_dict(self, state_dict) -> None:
        raise InvalidArgumentError(
            "a DistributedOptimizer's optimizer state lives on the shards: resume it from a checkpoint "
            "(checkpoint_dir=D, then `rdmaflow launch --resume`), not with load_state_dict()")

    def add_param_group(self, param_group: dict) -> None:
        raise InvalidArgumentError("the parameter server supports optimizers with one parameter group")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def step(self, closure=None, *, wait: bool = True, loss=None):
        """Pushes this step's gradients (``closure``, as torch's optimizers take one: called
        first, with gradients enabled; its loss is returned). Without overlap it blocks until
        the new weights are in the parameters, or with ``wait=False`` only until the push has
        landed on the shards (``synchronize``/``wait_range`` then wait for the weights). With
        overlap it blocks until the push has left the gradient buffers (``p.grad``, which may
        then be zeroed in place); the next forward, ``model.state_dict()`` and ``synchronize()``
        wait for the weights. Gradients changed after backward (clipping) are what it sends.
        ``loss`` (the step's loss, or the closure's) is what the
        ``log_every`` lines report. Not thread-safe against ``push_range``/``wait_range`` of the
        same step."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.worker.step(wait, loss)
        return loss

    def push_range(self, start: int, stop: int) -> list:
        """Writes flat gradient elements [start, stop) (the parameters' gradients concatenated
        in registration order) to their shards now and returns the futures (``f.result(timeout)``
        blocks until the bytes are in the shard's memory). Does not block. ``step()`` then resends
        only what such ranges did not cover exactly once. For callers that fill the gradient
        buffer themselves (the file view); needs ``overlap=False``. Thread-safe."""
        return self.worker.push_range(start, stop)

    def mark_gradients(self) -> None:
        """Every parameter has a gradient in this step's push (its buffer's values, zeros where
        nothing was written), as if backward had reached each; until ``zero_grad(set_to_none=True)``.
        For callers that fill the gradient buffer themselves. Does not block. Thread-safe."""
        self.worker.mark_gradients()

    def wait_range(self, start: int, stop: int, timeout: float | None = None, *, give_up=None) -> None:
        """Blocks until the newest weights of flat elements [start, stop) have landed: they can
        be read, and the next step's gradient of those elements can be written and pushed.
        Bounded by ``timeout`` (default the step timeout): ``rdmaflow.TimeoutError``. ``give_up``,
        a callable looked at every few milliseconds, ends the wait with ``InterruptedError``
        once it returns true (the file view: a client's request interrupted). Thread-safe."""
        self.worker.wait_range(start, stop, timeout, give_up)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradient buffers in place (they are the send buffers). ``set_to_none``
        keeps torch's meaning: a parameter that backward does not reach before the next
        ``step()`` has no gradient then, and the shards skip it as torch's optimizer would."""
        self.worker.zero_grad(set_to_none)

    @property
    def step_count(self) -> int:
        """Steps taken by the job so far (a resumed job starts at its checkpoint's step)."""
        return self.worker.step_count

    def synchronize(self) -> None:
        """Blocks until the parameters hold the weights of the last ``step()``. With overlap
        (or ``step(wait=False)``) ``step()`` returns before they land; the next forward and
        ``model.state_dict()`` wait by themselves, but code that reads the parameters another
        way (``p.data``, ``model.parameters()``, pickling the whole model) calls this first."""
        self.worker.wait_weights()

    def wait_weights(self) -> None:
        """The same as ``synchronize()``."""
        self.worker.wait_weights()

    def close(self) -> None:
        """Waits for the last weights and tells the shards this worker is done; idempotent."""
        self.ctx.optimizer_state = "closed"
        self.worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
