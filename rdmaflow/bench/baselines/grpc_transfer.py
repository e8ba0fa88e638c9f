"""``grpc-protobuf`` of ``rdmaflow bench transfer``: gRPC (Python grpcio) unary calls carrying
a tensor's bytes in a protobuf ``BytesValue``, the way TensorFlow's gRPC transport moves
tensors. The receiver makes a tensor of the bytes (``torch.frombuffer``) and consumes it;
over ``sm`` the channel is a unix domain socket."""
from __future__ import annotations

import collections
import os
import warnings

from rdmaflow.bench._transfer_worker import CONSUMER, fill, now
from rdmaflow.bench.baselines import GRPC_OPTIONS

GRPC_METHOD = "/rdmaflow.bench.Transfer/Send"


class GrpcWorker:
    def __init__(self, system: str, role: str, transport: str, sock_dir: str) -> None:
        import grpc
        from google.protobuf.wrappers_pb2 import BytesValue

        self.grpc = grpc
        self.BytesValue = BytesValue
        self.transport = transport
        self.server = None
        self.channel = None
        self.stub = None
        self.info: dict = {}
        if role == "receiver":
            from concurrent.futures import ThreadPoolExecutor

            import torch

            empty = BytesValue()

            def handle(request, context):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the bytes are read-only; we only read
                    t = torch.frombuffer(request.value, dtype=torch.float32)
                CONSUMER.consume(t)
                return empty

            handler = grpc.method_handlers_generic_handler("rdmaflow.bench.Transfer", {
                "Send": grpc.unary_unary_rpc_method_handler(
                    handle, request_deserializer=BytesValue.FromString,
                    response_serializer=BytesValue.SerializeToString)})
            self.server = grpc.server(ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
            self.server.add_generic_rpc_handlers((handler,))
            if transport == "sm":
                target = f"unix:{os.path.join(sock_dir, f'grpc-{os.getpid()}.sock')}"
                self.server.add_insecure_port(target)
            else:
                port = self.server.add_insecure_port("127.0.0.1:0")
                if not port:
                    raise RuntimeError("gRPC server could not bind a port on 127.0.0.1")
                target = f"127.0.0.1:{port}"
            self.server.start()
            self.info = {"target": target}

    def recv(self, cmd: dict, ready) -> dict:
        return CONSUMER.receive(cmd, ready)

    def send(self, cmd: dict) -> dict:
        import torch

        grpc = self.grpc
        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        timeout = cmd["timeout"]
        if self.channel is None:
            self.channel = grpc.insecure_channel(cmd["peer"]["target"], options=GRPC_OPTIONS)
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
            self.stub = self.channel.unary_unary(
                GRPC_METHOD, request_serializer=self.BytesValue.SerializeToString,
                response_deserializer=self.BytesValue.FromString)
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
        pending: collections.deque = collections.deque()
        deadline = now() + timeout
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().result(timeout=max(0.001, deadline - now()))
            # What TensorFlow's gRPC path does per tensor: its bytes into a protobuf message.
            msg = self.BytesValue(value=src.numpy().tobytes())
            pending.append(self.stub.future(msg, timeout=max(0.001, deadline - now())))
            del msg
        while pending:
            pending.popleft().result(timeout=max(0.001, deadline - now()))
        return {}

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.server.stop(grace=1.0).wait(5.0)
