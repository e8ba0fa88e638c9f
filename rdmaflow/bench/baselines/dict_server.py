"""The dictionary-of-rows servers of ``rdmaflow bench kv --sparse``: an embedding table as a user
would serve it over RPC without a parameter server: a Python ``dict`` of row id -> tensor on
the server, a pull that looks every key up and returns the rows stacked, a push that adds each
pushed row to its stored row in order (a row seen for the first time starts at zeros, the
sparse table's initializer). Two RPC systems serve it:

* ``tensorpipe-dict``: ``torch.distributed.rpc`` (TensorPipe), ``rpc_sync(server, pull, (keys,))``;
  its transports per benchmark transport are :data:`~rdmaflow.bench.baselines.TENSORPIPE_OPTIONS`
  (tcp: libuv TCP; sm: its shared-memory ring and cma).
* ``grpc-dict``: gRPC (grpcio) unary calls, the keys' and rows' bytes in the protobuf message of
  ``bench train``'s gRPC parameter server (:func:`.grpc_ps.tensors_message`); over tcp a
  loopback TCP port, over sm a unix domain socket (gRPC has no shared-memory transport).

Each system has its own dictionary, so that their values can be compared after the same pushes.
TensorPipe pickles the functions it calls by reference: server and client both import this
module."""
from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from rdmaflow.bench.baselines import GRPC_OPTIONS, TENSORPIPE_OPTIONS

GRPC_SERVICE = "rdmaflow.bench.kv.Rows"


class RowDict:
    """The server's table: a dict of row id -> a tensor of ``dim`` floats, rows made on first push."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.rows: dict[int, torch.Tensor] = {}
        self.zero = torch.zeros(dim)
        self.lock = threading.Lock()  # gRPC serves on a thread pool

    def fill(self, n: int) -> int:
        """Rows 0..n-1 present (zeros), as pushes of every key would leave them; returns len."""
        with self.lock:
            for k in range(n):
                self.rows.setdefault(k, torch.zeros(self.dim))
            return len(self.rows)

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        get, zero = self.rows.get, self.zero
        with self.lock:
            return torch.stack([get(k, zero) for k in keys.tolist()])

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        with self.lock:
            for k, v in zip(keys.tolist(), values.unbind(0)):
                row = self.rows.get(k)
                if row is None:
                    self.rows[k] = v.clone()
                else:
                    row += v


# -- TensorPipe ----------------------------------------------------------------------------------
_TP_ROWS: RowDict | None = None


def _tp_fill(dim: int, n: int) -> int:
    global _TP_ROWS
    _TP_ROWS = RowDict(dim)
    return _TP_ROWS.fill(n)


def _tp_pull(keys: torch.Tensor) -> torch.Tensor:
    return _TP_ROWS.pull(keys)


def _tp_push(keys: torch.Tensor, values: torch.Tensor) -> bool:
    _TP_ROWS.push(keys, values)
    return True


def init_tensorpipe(role: str, transport: str, port: int, timeout: float) -> dict:
    """Joins the two-process RPC group (``role`` "server" or "client"); returns its transports."""
    from torch.distributed import rpc

    transports, channels = TENSORPIPE_OPTIONS[transport]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout,
                                           num_worker_threads=4, _transports=transports, _channels=channels)
    rpc.init_rpc(role, rank=0 if role == "server" else 1, world_size=2, rpc_backend_options=opts)
    return {"transports": transports, "channels": channels}


class TensorPipeDict:
    """The client's end of ``tensorpipe-dict``."""

    def __init__(self, dim: int, rows: int, timeout: float) -> None:
        from torch.distributed import rpc

        self.rpc, self.timeout = rpc, timeout
        rpc.rpc_sync("server", _tp_fill, args=(dim, rows), timeout=max(timeout, 60 + rows / 2e4))

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        return self.rpc.rpc_sync("server", _tp_pull, args=(keys,), timeout=self.timeout)

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.rpc.rpc_sync("server", _tp_push, args=(keys, values), timeout=self.timeout)

    def close(self) -> None:
        pass  # rpc.shutdown is the process's, after every system closed


# -- gRPC ----------------------------------------------------------------------------------------
def _as_tensor(b: bytes, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only bytes: only read from
        return torch.frombuffer(b, dtype=dtype) if b else torch.empty(0, dtype=dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class GrpcDictServer:
    """The server of ``grpc-dict`` at ``target`` (``host:port``, or ``unix:path`` over sm):
    Fill(step=rows, worker=dim), Pull(data=[keys]) -> data=[rows], Push(data=[keys, values])."""

    def __init__(self, target: str) -> None:
        import grpc

        from rdmaflow.bench.baselines.grpc_ps import tensors_message

        self.Tensors = Tensors = tensors_message()
        self.rows: RowDict | None = None
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            getattr(self, name), request_deserializer=Tensors.FromString,
            response_serializer=Tensors.SerializeToString) for name in ("Fill", "Pull", "Push")}
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
        if not self.server.add_insecure_port(target):
            raise RuntimeError(f"the gRPC server could not listen at {target}")
        self.server.start()

    def Fill(self, request, context):
        self.rows = RowDict(int(request.worker))
        return self.Tensors(step=self.rows.fill(int(request.step)))

    def Pull(self, request, context):
        rows = self.rows.pull(_as_tensor(request.data[0], torch.int64))
        return self.Tensors(data=[_bytes(rows)])

    def Push(self, request, context):
        keys = _as_tensor(request.data[0], torch.int64)
        self.rows.push(keys, _as_tensor(request.data[1], torch.float32).view(len(keys), self.rows.dim))
        return self.Tensors()

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(5.0)


class GrpcDict:
    """The client's end of ``grpc-dict``."""

    def __init__(self, target: str, dim: int, rows: int, timeout: float) -> None:
        import grpc

        from rdmaflow.bench.baselines.grpc_ps import tensors_message

        self.Tensors = Tensors = tensors_message()
        self.dim, self.timeout = dim, timeout
        self.channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"cannot connect to the gRPC dictionary server at {target} within {timeout:.0f} s") \
                from None
        self.call = {name: self.channel.unary_unary(f"/{GRPC_SERVICE}/{name}",
                                                    request_serializer=Tensors.SerializeToString,
                                                    response_deserializer=Tensors.FromString)
                     for name in ("Fill", "Pull", "Push")}
        self.call["Fill"](Tensors(step=rows, worker=dim), timeout=max(timeout, 60 + rows / 2e4))

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        rep = self.call["Pull"](self.Tensors(data=[_bytes(keys)]), timeout=self.timeout)
        return _as_tensor(rep.data[0], torch.float32).view(len(keys), self.dim)

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.call["Push"](self.Tensors(data=[_bytes(keys), _bytes(values)]), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()
