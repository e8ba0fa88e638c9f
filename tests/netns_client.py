"""Runs inside a network namespace: transfers to and from a peer device on another "host"."""
from __future__ import annotations

import hashlib
import json
import sys

import torch

import rdmaflow

MiB = 1 << 20


def main() -> None:
    endpoint, host = sys.argv[1], sys.argv[2]
    half = 32 * MiB
    with rdmaflow.Device(f"{host}:0") as dev:
        local = dev.alloc_region(2 * half)
        view = local.tensor(torch.uint8, 2 * half)
        g = torch.Generator().manual_seed(9)
        view[:half].copy_(torch.randint(0, 256, (half,), dtype=torch.uint8, generator=g))
        remote = dev.lookup_region(endpoint, "buf")
        ch = dev.channel(endpoint)
        ch.memcpy(local, half, remote, half, half, rdmaflow.READ).result(60)
        g = torch.Generator().manual_seed(5)
        expect = torch.randint(0, 256, (2 * half,), dtype=torch.uint8, generator=g)
        read_ok = bool(torch.equal(view[half:], expect[half:]))
        ch.memcpy(local, 0, remote, 0, half, rdmaflow.WRITE).result(60)
        digest = hashlib.blake2b(memoryview(local)[:half], digest_size=32).hexdigest()
    print(json.dumps({"read_ok": read_ok, "write_digest": digest}), flush=True)


if __name__ == "__main__":
    main()
