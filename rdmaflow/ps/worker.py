"""The worker side: parameters and gradients in registered memory, push and pull per step.

With ``overlap`` (the default) communication runs under computation (Xue et al. §5.2, iRDMA
§IV-B):

- a gradient unit is WRITten to its shard the moment backward has accumulated every gradient
  in it (a post-accumulate-grad hook), so pushes run in reverse layer order during backward;
- synchronous mode: ``step()`` writes the push flags and returns once the push has left the
  gradient buffers (``p.grad`` may then be zeroed in place); the shards deliver the new
  weights chunk by chunk in forward order, and a forward pre-hook on each layer waits for
  just the chunks holding that layer's weights;
- asynchronous modes: two parameter buffers (buffer switching). A step computes on one while
  the shards write the next weights into the other; the request for them is timed from moving
  averages of compute and pull time so that they land as the computation ends (adaptive
  pulling, the "bubble");
- two gradient buffers, switched by ``zero_grad()``, so zeroing never waits for a push.

A model on a CUDA device (its parameters decide) keeps its gradient buffers, and with zero copy
its parameters, in the device's GPU arena: backward accumulates straight into the send buffer,
which is WRITten from GPU memory to the shards once the producing stream is done; the flag
words stay in host memory. The shards write weights into the host parameter buffers as for any
worker, and each landed chunk is copied from there into the GPU parameters before the layer
that needs it runs (iRDMA's weights from a host copy).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

import torch
from tqdm import tqdm

from rdmaflow import WRITE, Arena, InvalidArgumentError, PeerError, RdmaflowError, RemoteRegion, TimeoutError
from rdmaflow._args import integer
from rdmaflow.deadline import Deadline
from rdmaflow.job import env_int
from rdmaflow.ps.adaptive_pull import AdaptivePull
from rdmaflow.ps.context import profile_stream
from rdmaflow.ps.layout import (
    BATCH_BYTES,
    MIN_CHUNK_BYTES,
    describe_difference,
    make_plan,
    runs_of,
    spec_entries,
    spec_of,
    units_holding,
)
from rdmaflow.ps.optim import describe_optimizer, hyper_fields
from rdmaflow.ps.protocol import (
    ABORT,
    DONE,
    FLAG,
    ShardLayout,
    WorkerLayout,
    progress,
    record_bytes,
    write_runs_then_flag,
)
from rdmaflow.ps.services import declare as declare_service
from rdmaflow.ps.shared_wait import SharedWait
from rdmaflow.ps.step_gradients import StepGradients
from rdmaflow.ps.step_record import StepRecord
from rdmaflow.transfer import FLOAT_DTYPES, Word, pack_header, unpack_header, wait_flag
from rdmaflow.transfer.common import stream_done

POLL = 0.05
MODES = ("sync", "async", "bounded")
SHARD_DEVICES = ("cpu", "cuda")


def checked_staleness(mode: str, staleness) -> int:
    """The bound of mode "bounded" (steps ahead of the slowest worker): an integer, >= 0 there.
    Other modes take no bound: a staleness given with them would be ignored, so it is refused."""
    staleness = integer(staleness, "staleness")
    if mode == "bounded" and staleness < 0:
        raise InvalidArgumentError(f"staleness must be >= 0, got {staleness}")
    if mode != "bounded" and staleness != 0:
        raise InvalidArgumentError(f"staleness {staleness} applies to mode 'bounded' only; mode {mode!r} takes none")
    return staleness


class WorkerFailure(RdmaflowError):
    pass


def model_device(named) -> torch.device | None:
    """The CUDA device every parameter is on, or None when they are all in host memory."""
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise InvalidArgumentError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
                                   "a parameter-server worker needs them on one")
    d = next(iter(devices), torch.device("cpu"))
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise InvalidArgumentError(f"parameters on {d} are not supported (host or CUDA memory only)")
    return d


def trained_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """The (name, parameter) pairs the job trains: the model's parameters that require a gradient
    and that the optimizer holds. Those it does not hold stay as they are, as torch leaves them."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = list(model.named_parameters())
    foreign = held - {id(p) for _, p in named}
    if foreign:
        raise InvalidArgumentError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the "
                                   "model: give DistributedOptimizer the model whose parameters it trains")
    return [(n, p) for n, p in named if p.requires_grad and id(p) in held]


def log_line(rec: dict) -> str:
    """A ``log_every`` record as one line for people (``RDMAFLOW_PS_LOG=json`` prints the record)."""
    loss = "" if rec["loss"] is None else f"loss {rec['loss']:.4g} | "
    return (f"rdmaflow ps: worker {rec['worker']} step {rec['step']}: {loss}{rec['steps_per_s']:.1f} steps/s, "
            f"{rec['bytes_per_s'] / 1e6:.1f} MB/s | per step: compute {rec['compute_ms']:.2f} ms, "
            f"push {rec['push_ms']:.2f} ms, pull {rec['pull_ms']:.2f} ms")


class Worker:
    """Wraps a model and its torch optimizer: ``step()`` pushes gradients and pulls weights."""

    def __init__(self, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, mode: str = "sync",
                 staleness: int = 0, policy: str = "block", block_bytes: int = 1 << 20,
                 overlap: bool = True, zero_copy: bool = True, min_workers: int | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 log_every: int = 0, progress: bool | None = None, shard_device: str | None = None,
                 replicas: int = 1):
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        staleness, block_bytes = checked_staleness(mode, staleness), integer(block_bytes, "block_bytes")
        checkpoint_every, log_every = integer(checkpoint_every, "checkpoint_every"), integer(log_every, "log_every")
        nw = ctx.role.num_workers
        source = "min_workers"
        if min_workers is None and os.environ.get("RDMAFLOW_MIN_WORKERS"):
            # rdmaflow launch --min-workers
            min_workers, source = env_int("RDMAFLOW_MIN_WORKERS"), "$RDMAFLOW_MIN_WORKERS"
        if min_workers is not None and not 1 <= integer(min_workers, "min_workers") <= nw:
            raise InvalidArgumentError(f"{source} must be between 1 and the {nw} workers, got {min_workers}")
        if checkpoint_every < 0:
            raise InvalidArgumentError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if checkpoint_every and not checkpoint_dir:
            raise InvalidArgumentError("checkpoint_every needs a checkpoint_dir")
        shard_device = shard_device or os.environ.get("RDMAFLOW_PS_SHARD_DEVICE") or "cpu"
        if shard_device not in SHARD_DEVICES:
            raise InvalidArgumentError(f"shard_device must be one of {SHARD_DEVICES}, got {shard_device!r}")
        self._named = trained_parameters(model, optimizer)
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.model = model
        self.optimizer = optimizer
        self.mode = mode
        self.overlap = bool(overlap)
        self.zero_copy = bool(zero_copy)
        self.log_every = log_every
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.step_count = 0
        self._last_step_end = None
        self._closed = False
        self._lock = threading.Lock()
        # Where a step's time goes (seconds, summed); RDMAFLOW_PS_PROFILE=1 prints it at close.
        # push_out: of step_wait, the wait for the push to leave the gradient buffers (overlap).
        self.profile = {"compute": 0.0, "forward_wait": 0.0, "zero_grad": 0.0, "step_push": 0.0, "step_wait": 0.0,
                        "push_out": 0.0}
        self._logged = dict(self.profile)  # the profile at the last log line (log_every)
        self._losses: list[torch.Tensor] = []  # the losses step() got since the last log line
        cfg = {"mode": mode, "staleness": staleness, "policy": policy, "block_bytes": block_bytes,
               "overlap": self.overlap, "min_workers": nw if min_workers is None else int(min_workers),
               "checkpoint_dir": os.path.abspath(checkpoint_dir) if checkpoint_dir else None,
               "checkpoint_every": int(checkpoint_every), "optim": describe_optimizer(optimizer),
               "shard_device": shard_device, "replicas": int(replicas),
               # Tuning: the smallest chunk of pipelined weight delivery (tests use tiny ones).
               "chunk_bytes": int(os.environ.get("RDMAFLOW_PS_CHUNK_BYTES", MIN_CHUNK_BYTES))}
        try:
            self._setup(cfg)
        except Exception as e:
            self.store.abort(f"worker {self.id}: {e}")
            raise

    # -- setup --------------------------------------------------------------------------------
    def _setup(self, mine: dict) -> None:
        store = self.store
        named = self._named
        self.cuda = model_device(named)  # None: a host model
        spec = spec_of(named)
        declare_service(self.ctx, "optimizer")  # the job's shards serve a DistributedOptimizer (services.py)
        store.set(f"ep/worker/{self.id}", self.dev.endpoint)
        if self.id == 0:
            store.set("config", json.dumps(mine))
            store.set("spec", json.dumps(spec))
        cfg = json.loads(store.get("config"))
        job_spec = json.loads(store.get("spec"))
        if spec != job_spec:
            raise WorkerFailure(f"worker {self.id}'s model differs from the job's: "
                                f"{describe_difference(spec_entries(spec), spec_entries(job_spec))}")
        for k in ("mode", "policy", "overlap", "shard_device"):
            if cfg[k] != mine[k]:
                raise WorkerFailure(f"worker {self.id} asks for {k}={mine[k]}; the job runs {k}={cfg[k]}")
        if mine["optim"]["name"] != cfg["optim"]["name"]:  # the hyperparameters then differ in kind
            raise WorkerFailure(f"worker {self.id}'s optimizer is {mine['optim']['name']}; the job runs worker 0's "
                                f"{cfg['optim']['name']}")
        self.cfg = cfg
        self.plan = plan = make_plan(spec, self.role.num_shards, cfg["policy"], int(cfg["block_bytes"]))
        self.dtype = FLOAT_DTYPES[plan.dtype]
        isz = self.itemsize = plan.itemsize
        # Asynchronous overlap computes on one parameter buffer while the other fills.
        self.switching = self.overlap and self.mode != "sync"
        # The hyperparameters that may change (an LR scheduler's lr) go in the step record.
        L = self.layout = WorkerLayout(plan.total, isz, self.role.num_shards, 2 if self.switching else 1,
                                       0 if self.cuda else 2, len(hyper_fields(cfg["optim"])), len(plan.params))
        # A region of this service's own, not the device's one arena: a job's other services
        # (services.py) and a KVStore's arena tensors size theirs independently.
        arena = self.arena = Arena(self.dev.alloc_region(L.total + (1 << 20)))
        self.block = arena.allocate(L.total)
        self.base = self.block.offset
        self.region = arena.region
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[L.reply :].zero_()
        nbytes = plan.total * isz
        self.flat_params = [raw[L.params_at(b) : L.params_at(b) + nbytes].view(self.dtype)
                            for b in range(L.param_buffers)]
        self.dev_params: torch.Tensor | None = None  # a CUDA model's flat parameters (zero copy)
        if self.cuda is None:
            # The region and offset of gradient buffer 0; buffer 1 follows at L.stride.
            self.grad_region, self._grads_base = self.region, self.base + L.grads
            self.flat_grads = [raw[L.grads_at(b) : L.grads_at(b) + nbytes].view(self.dtype) for b in range(2)]
        else:
            self._setup_gpu(nbytes)
        for g in self.flat_grads:
            g.zero_()
        self.pbuf = 0  # the parameter buffer in use
        self.gbuf = 0  # the gradient buffer backward writes into
        # The allocation-site decision of Xue et al. §3.4, in PyTorch: parameters and gradients
        # live in registered memory, so backward writes straight into the send buffers and
        # new weights land straight in the parameters. Without zero_copy they live in ordinary
        # memory and every push and pull copies (the baseline of Xue et al. Figure 12). A CUDA
        # model's parameters are in its GPU arena: new weights land in the host parameter
        # buffers and each version is copied in before it is used, as without zero_copy.
        self._copy_in = not self.zero_copy or self.cuda is not None
        self._params = []
        with torch.no_grad():
            for (name, p), info in zip(named, plan.params):
                for fp in self.flat_params:
                    fp[info.offset : info.offset + info.numel].copy_(p.data.reshape(-1))
                if self.zero_copy:
                    if self.dev_params is not None:
                        view = self._dview(info)
                        view.copy_(p.data)
                        p.data = view
                    else:
                        p.data = self._pview(0, info)
                    p.grad = self._gview(0, info)
                self._params.append((p, info))
        self._loaded = [0] * len(self._params)  # the weight version each parameter's own copy holds
        self.reply = [Word.at(raw, L.reply + FLAG * s) for s in range(self.role.num_shards)]
        self._reply_waits = [SharedWait(f"shard {s}", self.reply[s].get,
                                        lambda target, what, seconds, s=s: self._wait_word(s, target, what, seconds))
                             for s in range(self.role.num_shards)]
        self.push_src = [raw[L.push_src + FLAG * s : L.push_src + FLAG * s + 8].view(torch.int64)
                         for s in range(self.role.num_shards)]
        self.pull_src = [raw[L.pull_src + FLAG * s : L.pull_src + FLAG * s + 8].view(torch.int64)
                         for s in range(self.role.num_shards)]
        n = record_bytes(L.hyper_count, L.param_count)
        self._record = StepRecord(cfg["optim"], mine["optim"], len(plan.params), 2 if self.switching else 1,
                                  [raw[L.record_src + i * L.record_stride : L.record_src + i * L.record_stride + n]
                                   for i in range(2)])
        # The parameters whose gradient exists, as torch would have it: backward reached them
        # since the last zero_grad(set_to_none=True) (a zero_copy grad is never None).
        self._seen: set[int] = set()
        self._index_units()
        self.dev.publish("ps/worker", pack_header({"layout": L.to_dict(), "base": self.base},
                                                  arena.region.descriptor()))
        store.set(f"ready/worker/{self.id}", "1")
        self.shards = []
        for s in range(self.role.num_shards):
            ep = store.get(f"ep/shard/{s}")
            store.wait([f"ready/shard/{s}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/shard"), "ps/shard")
            sh = {"ep": ep, "remote": RemoteRegion.from_descriptor(desc), "base": int(meta["base"]),
                  "layout": ShardLayout.from_dict(meta["layout"]), "channel": self.dev.channel(ep)}
            # Where gradients go: the shard's host block, or on a GPU shard the same offsets in
            # its GPU block; the push flags are in the host block either way.
            data = meta.get("data")
            sh["data_remote"] = RemoteRegion.from_descriptor(bytes.fromhex(data["descriptor"])) if data else sh["remote"]
            sh["data_base"] = int(data["base"]) if data else sh["base"]
            sh["flags_remote"] = sh["remote"] if data else None
            self.shards.append(sh)
        # A resumed job continues counting from its checkpoint's step; flags and versions count
        # absolute steps, so the initial weights are version start_step + 1.
        S = self.step_count = self.start_step = int(store.get("start_step"))
        self.bytes_per_step = 2 * plan.total * isz
        self._version = S + 1      # the weight version the parameters will hold
        self._ready = False        # whether all of it has landed
        self._step = StepGradients(self.units_of_param, len(self.units), self.zero_copy)
        self._push_futs: list[list] = [[], []]  # of finished steps, per gradient buffer
        self._cur_futs: list = []                # of this step's units
        # Per shard, the small units waiting for one WRITE per run (docs/parameter-server.md).
        self._batch: list[set[int]] = [set() for _ in range(self.role.num_shards)]
        self._batch_bytes = [0] * self.role.num_shards
        self.push_writes = 0                     # gradient WRITEs posted, flags not counted
        self._hooks = []
        self._pull = AdaptivePull(self._send_pull_request, self._pull_landed, last=S)
        self._await_all(S + 1, "the initial weights")
        self._ready = True
        self.pbuf = S % L.param_buffers
        if self._copy_in:
            self._load(range(len(self._params)), S + 1)
        else:
            for p, info in self._params:
                p.data = self._pview(self.pbuf, info)
        if self.switching:
            self._pull.request(S + 1, 0.0)
        self._install_hooks()
        # Off unless stderr is a terminal (progress=None), so that logs stay free of bars.
        self._bar = tqdm(desc=f"rdmaflow ps worker {self.id}", unit="step", initial=S, file=sys.stderr,
                         disable=not self.progress, dynamic_ncols=True)
        self._t0 = time.monotonic()
        self._compute_start = self._t0

    def _setup_gpu(self, nbytes: int) -> None:
        """A CUDA model: its two gradient buffers, and with zero copy its parameters, in this
        device's GPU arena (registered GPU memory of the model's CUDA device)."""
        stride = self.layout.stride
        bufs = 3 if self.zero_copy else 2
        gpu = self.dev.create_arena(bufs * stride + (1 << 20), device=str(self.cuda))
        self.gpu_block = gpu.allocate(bufs * stride)
        graw = torch.as_tensor(self.gpu_block, device=gpu.cuda_device)
        self.grad_region, self._grads_base = gpu.region, self.gpu_block.offset
        self.flat_grads = [graw[b * stride : b * stride + nbytes].view(self.dtype) for b in range(2)]
        if self.zero_copy:
            self.dev_params = graw[2 * stride : 2 * stride + nbytes].view(self.dtype)

    def _grads_at(self, buf: int) -> int:
        """Where gradient buffer ``buf`` starts in ``grad_region``."""
        return self._grads_base + (buf % 2) * self.layout.stride

    def _load(self, indices, version: int | None) -> None:
        """Copies the weights of parameters ``indices`` from the host parameter buffer in use into
        the parameters' own memory (no zero copy, or a CUDA model's GPU parameters), unless they
        hold ``version`` already (None: always). Synchronous: the shards may overwrite the host
        buffer once the next push is out."""
        with torch.no_grad():
            for i in indices:
                if version is None or self._loaded[i] != version:
                    p, info = self._params[i]
                    p.data.copy_(self._pview(self.pbuf, info))
                    self._loaded[i] = version or 0

    def _dview(self, info) -> torch.Tensor:
        return self.dev_params[info.offset : info.offset + info.numel].view(info.shape)

    def _pview(self, buf: int, info) -> torch.Tensor:
        return self.flat_params[buf][info.offset : info.offset + info.numel].view(info.shape)

    def _gview(self, buf: int, info) -> torch.Tensor:
        return self.flat_grads[buf][info.offset : info.offset + info.numel].view(info.shape)

    def _index_units(self) -> None:
        """Which units each parameter touches, and per shard which chunk holds each unit."""
        plan = self.plan
        self.units = sorted(plan.units, key=lambda u: u.offset)
        starts = self._unit_starts = [u.offset for u in self.units]
        uidx = {u.key: i for i, u in enumerate(self.units)}
        self.chunk_of = [0] * len(self.units)
        self.nchunks = []
        for s in range(self.role.num_shards):
            chunks = plan.chunks_of(s, int(self.cfg.get("chunk_bytes") or MIN_CHUNK_BYTES))
            self.nchunks.append(len(chunks))
            for k, chunk in enumerate(chunks, 1):
                for u in chunk:
                    self.chunk_of[uidx[u.key]] = k
        self.units_of_param: list[list[int]] = []
        for _, info in self._params:
            self.units_of_param.append([i for i in units_holding(starts, info.offset, info.offset + info.numel)
                                        if self.units[i].offset + self.units[i].numel > info.offset])

    def _install_hooks(self) -> None:
        index = {id(p): i for i, (p, _) in enumerate(self._params)}
        for i, (p, _) in enumerate(self._params):
            # Without overlap a hook only notes that backward reached the parameter (_has_grad).
            hook = (lambda p, i=i: self._grad_ready(i)) if self.overlap else (lambda p, i=i: self._seen.add(i))
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        # model.state_dict() (a checkpoint saved right after step()) waits for weights still on
        # the wire: each module holding trained parameters, as state_dict() recurses into it.
        for module in self.model.modules():
            if any(id(p) in index for p in module.parameters(recurse=False)):
                self._hooks.append(module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self.wait_weights()))
        if not self.overlap or self.mode != "sync":
            return
        # Each module that owns parameters waits, before it runs, for the chunks holding them.
        for module in self.model.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            need: dict[int, int] = {}
            for i in own:
                for u in self.units_of_param[i]:
                    s = self.units[u].shard
                    need[s] = max(need.get(s, 0), self.chunk_of[u])
            waits = sorted(need.items())
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, args, need=waits, own=own: self._before_forward(need, own)))

    # -- waiting ------------------------------------------------------------------------------
    def _wait_word(self, s: int, target: int, what: str, timeout: float | None = None) -> None:
        timeout = self.ctx.step_timeout if timeout is None else timeout
        word = self.reply[s]
        sh = self.shards[s]

        def shard_gone() -> bool:
            if sh["channel"].failed:
                self._shard_died(s, f"shard {s} at {sh['ep']} died while worker {self.id} waited for {what}")
            return False

        def too_late():
            raise TimeoutError(f"shard {s} did not deliver {what} within {timeout:g} s")

        wait_flag(word, target, Deadline(timeout), what, give_up=shard_gone,
                  abort_reason=self.store.abort_reason, aborted=WorkerFailure, on_timeout=too_late, poll=POLL)
        self._check_reply(word)

    def _shard_died(self, s: int, msg: str) -> None:
        """Raises for shard ``s`` found gone: PeerError ``msg``, unless the job was aborted
        already (the shard may have stopped for that reason, and is then not the cause: the
        reason on record is said instead)."""
        if int(getattr(self, "cfg", {}).get("replicas") or 1) > 1:
            msg += ("; its units have a backup, but failover of a DistributedOptimizer's shards is not built yet: "
                    "the job stops (resume it from a checkpoint)")
        reason = self.store.fail_with(msg, ("shard", s))
        if reason:
            raise WorkerFailure(f"the job was aborted: {reason}") from None
        raise PeerError(msg) from None

    def _check_reply(self, word: Word) -> None:
        """A shard that gave up writes ABORT into the reply flags: it is above every target."""
        if word.get() >= ABORT:
            raise WorkerFailure(f"the job was aborted: {self.store.aborted() or 'by a shard'}")

    def _await_all(self, version: int, what: str) -> None:
        for s in range(self.role.num_shards):
            self._wait_word(s, progress(version, self.nchunks[s]), what)

    def _before_forward(self, need, own) -> None:
        if self._ready:
            return
        v = self._version
        t0 = time.monotonic()
        for s, k in need:
            self._wait_word(s, progress(v, k), f"the weights of version {v}")
        self.profile["forward_wait"] += time.monotonic() - t0
        if self._copy_in:
            self._load(own, v)

    def wait_weights(self) -> None:
        """Blocks until the parameters hold the newest weights (``step()`` may return before
        they land; the next forward waits by itself, anything else that reads them calls this)."""
        if self._ready:
            return
        self._await_all(self._version, f"the weights of version {self._version}")
        if self._copy_in:
            self._load(range(len(self._params)), self._version)
        self._ready = True

    def _element_range(self, lo, hi, op: str) -> tuple[int, int]:
        """[lo, hi) checked: whole numbers with 0 <= lo <= hi <= the model's flat elements."""
        lo, hi = integer(lo, f"{op}'s start"), integer(hi, f"{op}'s stop")
        if not 0 <= lo <= hi <= self.plan.total:
            raise InvalidArgumentError(f"{op}: [{lo}, {hi}) is not a range of the model's {self.plan.total} "
                                       "flat elements")
        return lo, hi

    def _units_in(self, lo: int, hi: int) -> range:
        """Indices into ``self.units`` (sorted by offset) of the units holding elements [lo, hi)."""
        return units_holding(self._unit_starts, lo, hi)

    def wait_range(self, lo: int, hi: int, timeout: float | None = None, give_up=None) -> None:
        """Blocks until the chunks of the newest weights that hold flat elements [lo, hi) have
        landed (within ``timeout`` seconds, default the step timeout). Then those weights can be
        read whole, and the shards have read every gradient element of the last step there, so
        the next step's gradient may be written and pushed into them. ``give_up()``, looked at
        every few milliseconds while it waits, ends the wait with InterruptedError once true (a
        file-view client's interrupted request). Thread-safe."""
        self._check_open("wait_range")
        lo, hi = self._element_range(lo, hi, "wait_range")
        deadline = Deadline(self.ctx.step_timeout if timeout is None else timeout)
        if self._ready:
            return
        v = self._version
        need: dict[int, int] = {}
        for i in self._units_in(lo, hi):
            s = self.units[i].shard
            need[s] = max(need.get(s, 0), self.chunk_of[i])
        for s, k in sorted(need.items()):
            self._wait_reply(s, progress(v, k), f"the weights of version {v}", deadline, give_up)

    def _wait_reply(self, s: int, target: int, what: str, deadline: Deadline, give_up=None) -> None:
        """Waits until shard s's reply word reaches ``target``: of the threads waiting on one
        shard, one polls the word and the others sleep (shared_wait.py)."""
        self._reply_waits[s].wait(target, what, deadline, give_up)
        self._check_reply(self.reply[s])

    # -- pushing ------------------------------------------------------------------------------
    def push_range(self, lo: int, hi: int) -> list:
        """WRITEs flat elements [lo, hi) of this step's gradient buffer into their shards' slots
        now, one WRITE per run, and returns the futures; does not block. For a caller that fills
        the gradient buffer itself (the file view) and wants it on the wire before ``step()``:
        ``step()`` then sends again only the units that these ranges did not cover exactly once.
        Without overlap only, after ``wait_range(lo, hi)``. Thread-safe."""
        self._check_open("push_range")
        lo, hi = self._element_range(lo, hi, "push_range")
        if self.overlap:
            raise InvalidArgumentError("push_range needs overlap=False (overlap pushes units from backward)")
        t, isz = self.step_count + 1, self.itemsize
        src = self._grads_at(self.gbuf)
        runs: list[list[int]] = []  # [shard, local byte, remote byte, bytes]
        for i in self._units_in(lo, hi):
            u = self.units[i]
            a, b = max(lo, u.offset), min(hi, u.offset + u.numel)
            if a >= b:
                continue
            sh = self.shards[u.shard]
            local = src + a * isz
            remote = sh["data_base"] + sh["layout"].gslot(self.id, t) + (u.shard_offset + a - u.offset) * isz
            last = runs[-1] if runs else None
            if last and last[0] == u.shard and last[1] + last[3] == local and last[2] + last[3] == remote:
                last[3] += (b - a) * isz
            else:
                runs.append([u.shard, local, remote, (b - a) * isz])
        if self.cuda is not None:
            stream_done(self.flat_grads[self.gbuf])
        futs = [self.shards[s]["channel"].memcpy(self.grad_region, lo_b, self.shards[s]["data_remote"], ro, n, WRITE)
                for s, lo_b, ro, n in runs]
        with self._lock:
            self._step.ranges.append((lo, hi))
            self._cur_futs.extend(futs)
            self.push_writes += len(futs)
        return futs

    def mark_gradients(self) -> None:
        """Every trained parameter has a gradient in this step's push, as if backward had
        reached each: for a caller that fills the gradient buffer itself. Thread-safe."""
        with self._lock:
            self._seen = set(range(len(self._params)))

    def _stage_grad(self, i: int) -> None:
        """Puts parameter i's gradient into the registered buffer of this step."""
        p, info = self._params[i]
        view = self._gview(self.gbuf, info)
        g = p.grad
        if g is not None and g.data_ptr() == view.data_ptr():
            return  # backward accumulated straight into the send buffer
        self._wait_pushes(self.gbuf)  # an earlier step's push may still read this buffer
        with torch.no_grad():
            if g is None:
                view.zero_()
            else:
                view.copy_(g)  # the sender-side copy (no zero_copy, or a gradient made anew)
        if self.zero_copy:
            p.grad = view

    def _grad_ready(self, i: int) -> None:
        self._stage_grad(i)
        with self._lock:
            self._seen.add(i)
            # The send buffer's version counter now: after this accumulation, the latest.
            for u in self._step.hook(i, self._params[i][0].grad, self.flat_grads[self.gbuf]._version):
                self._push_unit(u, self.step_count + 1)

    def _push_unit(self, u: int, t: int) -> None:
        """Queues unit u's gradient for step t in its shard's batch; the batch is written once
        it holds BATCH_BYTES (a large unit goes at once), or by push(). Caller holds the lock."""
        unit = self.units[u]
        s = unit.shard
        if u not in self._batch[s]:
            self._batch[s].add(u)
            self._batch_bytes[s] += unit.numel * self.itemsize
        self._step.written.add(u)
        if self._batch_bytes[s] >= BATCH_BYTES:
            self._write_batch(s, t)

    def _batch_runs(self, s: int, t: int) -> list[tuple[int, int, int]]:
        """Shard s's batch as runs of adjacent units (local offset, remote offset, bytes) into its
        slot for step t; the batch is emptied."""
        if not self._batch[s]:
            return []
        sh, isz = self.shards[s], self.itemsize
        src = self._grads_at(self.gbuf)
        dst = sh["data_base"] + sh["layout"].gslot(self.id, t)
        runs = runs_of([self.units[u] for u in self._batch[s]])
        self.push_writes += len(runs)
        self._batch[s].clear()
        self._batch_bytes[s] = 0
        return [(src + r.offset * isz, dst + r.shard_offset * isz, r.numel * isz) for r in runs]

    def _write_batch(self, s: int, t: int) -> None:
        """One WRITE per run of adjacent units in shard s's batch, into its slot for step t."""
        sh = self.shards[s]
        runs = self._batch_runs(s, t)
        if runs and self.cuda is not None:
            # Backward's kernels are queued, maybe not done: UCX reads on streams of its own.
            stream_done(self.flat_grads[self.gbuf])
        for lo, ro, n in runs:
            self._cur_futs.append(sh["channel"].memcpy(self.grad_region, lo, sh["data_remote"], ro, n, WRITE))

    def _wait_pushes(self, buf: int) -> None:
        for f in self._push_futs[buf]:
            f.result(self.ctx.timeout)
        self._push_futs[buf] = []

    @contextlib.contextmanager
    def _naming_dead_shards(self, t: int):
        """A channel's failure while pushing step t (posting, or waiting for the WRITEs to
        leave) names the shard, like a wait for its flags would."""
        try:
            yield
        except PeerError:
            for s, sh in enumerate(self.shards):
                if sh["channel"].failed:
                    self._shard_died(s, f"shard {s} at {sh['ep']} died while worker {self.id} pushed step {t}")
            raise

    def push(self, t: int) -> list:
        """Pushes what backward has not pushed yet, then each shard's push flag behind a fence."""
        with self._naming_dead_shards(t):
            return self._push(t)

    def _push(self, t: int) -> list:
        with self._lock:
            step = self._step
            if self.overlap:
                # A gradient changed after backward pushed it is staged and written again.
                for i in step.changed([p.grad for p, _ in self._params], self.flat_grads[self.gbuf]._version):
                    self._stage_grad(i)
                    step.rewrite(i)
            # Before staging turns None into zeros. Hyperparameters go only once they differ
            # from the job's (a shard without them keeps its own: the job's, or a checkpoint's).
            record = self._record.of(self.optimizer, self._has_grad())
            if not self.overlap:
                for i in range(len(self._params)):
                    self._stage_grad(i)
            else:
                for i in range(len(self._params)):
                    if i not in step.fired:
                        self._stage_grad(i)  # no gradient this step (unused), or set by hand
            step.apply_ranges(self.units)
            for s in sorted({self.units[u].shard for u in step.dirty}):
                self.shards[s]["channel"].fence()  # a unit written again lands after its earlier WRITE
            for u in step.to_write():
                self._push_unit(u, t)
            if self.cuda is not None:
                stream_done(self.flat_grads[self.gbuf])  # staged and accumulated on the GPU
            self._send_record(t, record)
            flags_local = self.region if self.cuda is not None else None  # the flags stay in host memory
            futs = []
            for s, sh in enumerate(self.shards):
                # What is left of the batch, then the push flag; its last run travels with the flag.
                written = write_runs_then_flag(sh["channel"], self.grad_region, sh["data_remote"],
                                               self._batch_runs(s, t), self.base + self.layout.push_src + FLAG * s,
                                               t, sh["base"] + sh["layout"].push + FLAG * self.id, flags_local,
                                               sh["flags_remote"])
                self._cur_futs.extend(written[:-1])
                futs.append(written[-1])
            self._push_futs[self.gbuf].extend(self._cur_futs + futs)
            self._cur_futs = []
            step.reset()
        return futs

    def _has_grad(self) -> list[bool]:
        """Which parameters have a gradient in this push: those torch's optimizer would not skip.
        One has none if its grad is None, or if its grad is the send buffer (never None) and
        backward has not reached it since a zero_grad(set_to_none=True), unless it was written
        by hand (nonzero). A step whose gradient push_range wrote has them all."""
        if self._step.ranges:
            return self._record.every_grad
        grads = [p.grad for p, _ in self._params]
        if len(self._seen) == len(self._params) and all(g is not None for g in grads):
            # (None: the model's zero_grad() dropped it after backward had reached it.)
            return self._record.every_grad
        has = []
        for i, (g, (_, info)) in enumerate(zip(grads, self._params)):
            if g is None:
                has.append(False)
            elif i in self._seen or g.data_ptr() != self._gview(self.gbuf, info).data_ptr():
                has.append(True)
            else:
                has.append(bool(g.any()))
        return has

    def _send_record(self, t: int, record: tuple) -> None:
        """WRITEs push t's step record into each shard's record slot, when it differs from what
        that slot last got (step_record.py); the push flag follows on the same channel."""
        i = self._record.encode(t, record, self.ctx.timeout)
        if i is None:
            return
        L = self.layout
        n, off = record_bytes(L.hyper_count, L.param_count), self.base + L.record_src + i * L.record_stride
        self._record.sent(i, [sh["channel"].memcpy(self.region, off, sh["remote"],
                                                   sh["base"] + sh["layout"].record_at(self.id, t), n, WRITE)
                              for sh in self.shards])

    # -- pulling (asynchronous overlap; when: adaptive_pull.py) --------------------------------
    def _send_pull_request(self, r: int) -> None:
        """Asks every shard for its current weights into buffer r % 2 (pull r)."""
        for s, sh in enumerate(self.shards):
            if sh["channel"].failed:
                continue
            try:
                sh["channel"].fence()  # after this worker's latest push flag
                self.pull_src[s].fill_(r)
                sh["channel"].memcpy(self.region, self.base + self.layout.pull_src + FLAG * s, sh["remote"],
                                     sh["base"] + sh["layout"].pull + FLAG * self.id, 8, WRITE)
            except RdmaflowError:
                pass  # the wait for the weights reports the shard

    def _pull_landed(self, r: int) -> bool:
        """Waits until pull r's weights are in, on the pull's own thread, so that its latency is
        measured; False if it gave up (closed, or a step's time passed: the step that waits for
        these weights reports the shard)."""
        deadline = Deadline(self.ctx.step_timeout)
        return all(wait_flag(self.reply[s], progress(r + 1, n), deadline, f"pull {r} from shard {s}",
                             give_up=lambda: self._closed, on_timeout=lambda: None, poll=POLL)
                   for s, n in enumerate(self.nchunks))

    @property
    def bubbles(self) -> list[float]:
        """The delay chosen before each pull request (asynchronous overlap), in seconds."""
        return self._pull.bubbles

    def _switch(self, t: int) -> None:
        """Buffer switching at the end of step t: computation t + 1 runs on pull t's weights."""
        self._await_all(t + 1, f"the weights of pull {t}")
        self._pull.join(self.ctx.timeout)
        self.pbuf = t % 2
        if self._copy_in:
            self._load(range(len(self._params)), None)
        else:
            for p, info in self._params:
                p.data = self._pview(self.pbuf, info)
        # The next pull is timed to land as the next computation ends.
        self._pull.request(t + 1, self._pull.next_delay())

    # -- the step -----------------------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{op}: this parameter-server worker is closed")

    def step(self, wait: bool = True, loss=None) -> None:
        """Pushes this step's gradients to the shards. Without overlap it waits for the new
        weights, or with ``wait=False`` only until the push has landed (``wait_weights`` and
        ``wait_range`` wait for the weights); with overlap until the push has left the gradient
        buffers, and the next forward (sync) or the buffer switch (async) waits for the weights.
        ``loss`` (a number or tensor) goes into the ``log_every`` lines, as their interval's mean."""
        self._check_open("step")
        if loss is not None and self.log_every:
            self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss)))
        t0 = time.monotonic()
        compute = t0 - self._compute_start
        self._pull.computed(compute)
        if not self.switching:
            self.wait_weights()  # the weights this step computed on (a step without a forward)
        t = self.step_count + 1
        flags = self.push(t)
        t1 = time.monotonic()
        if self.switching:
            self._switch(t)
        else:
            self._version = t + 1
            self._ready = False
            if not self.overlap and wait:
                self.wait_weights()
                self._wait_pushes(self.gbuf)
            elif not self.overlap:
                for f in flags:
                    f.result(self.ctx.timeout)
        if self.overlap:
            # The gradient has left its buffer, which is p.grad: the caller may zero it in place
            # now (model.zero_grad(set_to_none=False)). In sync mode the weights come later anyway.
            t_out = time.monotonic()
            with self._naming_dead_shards(t):
                self._wait_pushes(self.gbuf)
            self.profile["push_out"] += time.monotonic() - t_out
        t2 = time.monotonic()
        self.profile["step_push"] += t1 - t0
        self.profile["step_wait"] += t2 - t1
        self.profile["compute"] += compute
        self.step_count = t
        self._last_step_end = t2
        self._compute_start = t2
        self._report(t)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Switches to the other gradient buffer and zeroes it: the gradient buffers are the send
        buffers, so they are zeroed in place, never dropped; the one just pushed is left alone."""
        self._check_open("zero_grad")
        if set_to_none:
            self._seen = set()
        t0 = time.monotonic()
        with self._lock:
            # A backward since the last step() is thrown away: what its hooks already pushed into
            # this step's slots must be written again from the zeroed buffer (behind a fence),
            # and every unit waits for its parameters' gradients anew.
            self._step.discard()
            self._push_futs[self.gbuf].extend(self._cur_futs)  # they read the buffer left behind
            self._cur_futs = []
        self.gbuf ^= 1
        self._wait_pushes(self.gbuf)  # pushed two steps ago: long done
        self.flat_grads[self.gbuf].zero_()
        self.profile["zero_grad"] += time.monotonic() - t0
        with torch.no_grad():
            for p, info in self._params:
                if self.zero_copy:
                    p.grad = self._gview(self.gbuf, info)
                elif set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def _report(self, t: int) -> None:
        done = t - self.start_step
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        self._bar.update(1)
        if self.progress and t % 10 == 0:
            self._bar.set_postfix_str(f"{done / elapsed * self.bytes_per_step / 1e9:.2f} GB/s", refresh=False)
        if self.log_every and t % self.log_every == 0:
            n, last = self.log_every, self._logged
            ms = {k: 1e3 * (self.profile[k] - last[k]) / n for k in ("step_push", "step_wait", "compute")}
            loss = None
            if self._losses:  # one host sync per line, not per step (a CUDA loss)
                loss = torch.stack([v.to("cpu", torch.float64).reshape(()) for v in self._losses]).mean().item()
            self._losses = []
            rec = {"event": "ps_step", "worker": self.id, "step": t, "loss": loss,
                   "push_ms": ms["step_push"], "pull_ms": ms["step_wait"], "compute_ms": ms["compute"],
                   "steps_per_s": done / elapsed, "bytes_per_s": done * self.bytes_per_step / elapsed}
            # One write per line, so that lines of several workers sharing a pipe never interleave.
            sys.stdout.write((json.dumps(rec) if os.environ.get("RDMAFLOW_PS_LOG") == "json" else log_line(rec)) + "\n")
            sys.stdout.flush()
            self._logged = dict(self.profile)

    def close(self) -> None:
        """Waits for the last weights, then tells the shards this worker is done (DONE)."""
        if self._closed:
            return
        self._closed = True
        if os.environ.get("RDMAFLOW_PS_PROFILE"):
            print(json.dumps({"event": "ps_profile", "worker": self.id, "steps": self.step_count - self.start_step,
                              **{k: round(v, 4) for k, v in self.profile.items()}}), file=profile_stream(), flush=True)
        for h in self._hooks:
            h.remove()
        self._pull.join(self.ctx.timeout)  # its wait gives up now (_closed); its delay is under a step's compute
        self._bar.close()
        try:
            if self.switching:
                # The pull asked for last must land before DONE: nothing writes here after it.
                self._await_all(self._pull.last + 1, f"the weights of pull {self._pull.last}")
            else:
                self.wait_weights()
        finally:
            futs = []
            for s, sh in enumerate(self.shards):
                if sh["channel"].failed:
                    continue
                self.push_src[s].fill_(DONE)
                sh["channel"].fence()
                futs.append(sh["channel"].memcpy(self.region, self.base + self.layout.push_src + FLAG * s, sh["remote"],
                                                 sh["base"] + sh["layout"].push + FLAG * self.id, 8, WRITE))
            for f in futs:
                f.wait(5.0)

