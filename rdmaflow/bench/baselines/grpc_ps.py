"""``grpc`` of ``rdmaflow bench train``: the synchronous parameter server of
:mod:`.sync_shard` over gRPC (grpcio). One unary call per shard per step: its request (a
protobuf message: step, worker, ``repeated bytes`` with one tensor's bytes each) carries that
shard's gradients, its response the shard's new weights; tensor bytes go through protobuf
serialization, as on TensorFlow's gRPC path."""
from __future__ import annotations

import concurrent.futures
import threading
import warnings
from datetime import timedelta

import torch

from rdmaflow.bench.baselines import GRPC_OPTIONS
from rdmaflow.bench.baselines.sync_shard import SyncShard, copy_weights, grads_of, ps_setup
from rdmaflow.bench.train_job import (
    ProcessRole,
    Watchdog,
    build_model,
    dump_state,
    hostport,
    leave_store,
    make_store,
    result,
    train_loop,
)
from rdmaflow.job import route_address

GRPC_SERVICE = "rdmaflow.bench.train.ParameterServer"
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


def run(cfg: dict, me: ProcessRole, wd: Watchdog) -> dict | None:
    import grpc

    timeout = cfg["timeout"]
    Tensors = tensors_message()
    store = make_store(me, timeout)
    wd.kick("store")
    if me.role == "shard":
        shard = SyncShard(cfg, me.index, wd.kick)
        svc = GrpcShardService(shard, timeout)
        handlers = {m: grpc.unary_unary_rpc_method_handler(
            getattr(svc, m), request_deserializer=Tensors.FromString, response_serializer=Tensors.SerializeToString)
            for m in ("Pull", "Push", "Done")}
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2 * cfg["workers"] + 4),
                             options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
        host = route_address(me.master_addr)
        port = server.add_insecure_port(hostport(host, 0))
        if not port:
            raise RuntimeError(f"the gRPC server could not bind a port on {host}")
        server.start()
        store.set(f"rdmaflow/train/grpc/{me.index}", hostport(host, port))
        wd.kick("serving")
        shard.wait_done()
        server.stop(grace=2.0).wait(5.0)
        leave_store(store, me, timeout)
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
            rep = m["Pull"](Tensors(worker=me.index), timeout=timeout)
            copy_weights(params, idx, [bytes_tensor(b, params[i]) for b, i in zip(rep.data, idx)])
    state = {"t": 0}

    def step():
        state["t"] += 1
        futs = []
        for m, idx in stubs:
            if idx:
                # TensorFlow's gRPC path: each tensor's bytes into a protobuf message.
                msg = Tensors(step=state["t"], worker=me.index, data=[tensor_bytes(g) for g in grads_of(params, idx)])
                futs.append((m["Push"].future(msg, timeout=timeout), idx))
                del msg
        for fut, idx in futs:
            rep = fut.result()
            copy_weights(params, idx, [bytes_tensor(b, params[i]) for b, i in zip(rep.data, idx)])

    wd.kick("training")
    times, losses = train_loop(cfg, me.index, model, model.zero_grad, step, lambda: None, wd)
    dump_state(cfg, me.index, model)
    for m, _ in stubs:
        m["Done"](Tensors(worker=me.index), timeout=timeout)
    for ch in channels:
        ch.close()
    leave_store(store, me, timeout)
    return result(cfg, me.index, times, losses)
