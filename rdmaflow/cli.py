"""The ``rdmaflow`` command (also ``python -m rdmaflow``).

    rdmaflow info [--json]            what rdmaflow and UCX can do on this machine
    rdmaflow bench device [...]       Channel.memcpy bandwidth next to ucx_perftest
    rdmaflow bench transfer [...]     one-way tensor transfer next to gRPC, gloo, TensorPipe
    rdmaflow bench kv [...]           key-value requests of N keys next to one tensor
    rdmaflow bench latency [...]      one-way latency of small transfers next to UCX, NIXL, gloo
    rdmaflow launch [...] script.py   start a job's workers and shards (or a pipeline's stages) with torchrun
    rdmaflow mount MOUNTPOINT [...]   a worker serving the job's model as files (FUSE)

To add a subcommand (``bench train``, ...), write a module with ``add_arguments(parser)`` (or
``build_parser(parser)``) and ``run(args) -> int`` (the exit status) and list it in
:data:`COMMANDS` or :data:`BENCHMARKS`. Modules keep heavy work inside ``run``. A module that
fails to import only disables its own subcommand.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Each module has add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("rdmaflow.info", "show versions, UCX transports/devices (verbs? CUDA?) and settings"),
    "launch": ("rdmaflow.launch", "start a job: workers and parameter-server shards, or a pipeline's stages"),
    "mount": ("rdmaflow.fileview.mount", "serve a parameter-server job's model as files (FUSE), as a worker"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "device": ("rdmaflow.bench.device",
               "WRITE/READ bandwidth of Channel.memcpy next to ucx_perftest put/get"),
    "transfer": ("rdmaflow.bench.transfer",
                 "one-way tensor transfer, rdmaflow next to gRPC, TensorPipe, gloo, perftest"),
    "latency": ("rdmaflow.bench.latency",
                "one-way latency of small transfers (ping-pong), rdmaflow next to ucx_perftest, NIXL, gloo"),
    "train": ("rdmaflow.bench.train",
              "training throughput (batches/s), rdmaflow PS next to TensorPipe, gRPC, DDP, local"),
    "file": ("rdmaflow.bench.file",
             "a training step through the file view (rdmaflow mount), sync and async I/O, next to the Python API"),
    "pipeline": ("rdmaflow.bench.pipeline",
                 "pipeline-parallel training steps/s, rdmaflow.graph next to torch.distributed.pipelining"),
    "converge": ("rdmaflow.bench.converge",
                 "loss against wall-clock time on a real data set, rdmaflow next to DDP-gloo"),
    "kv": ("rdmaflow.bench.kv",
           ("key-value push/pull of N scalar keys in one request next to one tensor of the same bytes; "
            "--sparse: Zipf ids from an embedding table, SparseTable next to KVStore and RPC dictionary servers")),
    "c10d": ("rdmaflow.bench.c10d",
             "torch.distributed over the rdmaflow backend next to gloo: P2P latency, stream, all_reduce"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    try:
        mod = importlib.import_module(module)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        else:
            mod.build_parser(p)
    except Exception as e:  # noqa: BLE001 - reported when this subcommand is used
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(_module=None, _broken=f"{module}: {type(e).__name__}: {e}")
        return
    p.set_defaults(_module=module)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rdmaflow",
                                 description="One-sided RDMA tensor transfer over UCX.")
    ap.add_argument("--version", action="store_true", help="print the rdmaflow version and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks (rdmaflow bench --help lists them)",
                           description="rdmaflow benchmarks",
                           epilog="Every benchmark takes the same flags for the same things: --transport "
                                  "(one or several of tcp, sm), --systems, --models, --sizes, --repeats, "
                                  "--out DIR, --seed, --threads, --hosts, --quick, -v (docs/benchmarks.md).")
    bsub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bsub, name, module, help_text)
    bench.set_defaults(_parser=bench)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(None if argv is None else list(argv))
    if args.version:
        import rdmaflow

        print(f"rdmaflow {rdmaflow.__version__}")
        return 0
    broken = getattr(args, "_broken", None)
    if broken:
        print(f"rdmaflow: this subcommand is unavailable: {broken}", file=sys.stderr)
        return 1
    module = getattr(args, "_module", None)
    if module is None:
        getattr(args, "_parser", ap).print_help()
        return 2
    try:
        return int(importlib.import_module(module).run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: the subcommands' finally blocks have stopped their processes
        print("rdmaflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`rdmaflow info --json | head -1`): as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
