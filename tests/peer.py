"""A peer process for the tests: one rdmaflow Device driven by JSON lines on stdin.

Each command is answered by one JSON line on stdout. The test process runs the other Device
itself, so every transfer crosses a real process boundary.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import traceback


def host_bytes(r, offset: int, nbytes: int):
    """Bytes [offset, offset + nbytes) of region r, copied to the host when it is GPU memory."""
    if r.cuda_device >= 0:
        import torch

        return r.tensor(torch.uint8, r.nbytes)[offset : offset + nbytes].cpu().numpy().tobytes()
    return memoryview(r)[offset : offset + nbytes]


def main() -> None:
    import torch

    import rdmaflow

    host = os.environ.get("RDMAFLOW_TEST_HOST", "127.0.0.1")
    dev = rdmaflow.Device(
        f"{host}:0",
        num_cqs=int(os.environ.get("RDMAFLOW_TEST_CQS", "1")),
        qps_per_peer=int(os.environ.get("RDMAFLOW_TEST_QPS", "1")),
        busy_poll=os.environ.get("RDMAFLOW_TEST_BUSY_POLL") == "1",
    )
    regions: dict[str, rdmaflow.MemRegion] = {}
    out = sys.stdout

    def reply(**kw) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    reply(endpoint=dev.endpoint)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "alloc":
                # registered=True: memory a tensor owns, registered in place (never shared).
                # cuda=True: GPU memory (registered from a CUDA tensor, or from alloc_region's).
                if cmd.get("registered"):
                    r = dev.register(torch.zeros(cmd["nbytes"], dtype=torch.uint8,
                                                 device="cuda" if cmd.get("cuda") else "cpu"))
                else:
                    r = dev.alloc_region(cmd["nbytes"], "cuda" if cmd.get("cuda") else None)
                regions[cmd["name"]] = r
                dev.publish_region(cmd["name"], r)
                reply(ok=True, descriptor=r.descriptor().hex())
            elif op == "fill":
                # Deterministic pseudo-random bytes the test process can regenerate.
                r = regions[cmd["name"]]
                g = torch.Generator().manual_seed(cmd["seed"])
                t = r.tensor(torch.uint8, r.nbytes)
                t.copy_(torch.randint(0, 256, (r.nbytes,), dtype=torch.uint8, generator=g))
                reply(ok=True)
            elif op == "digest":
                mv = host_bytes(regions[cmd["name"]], cmd["offset"], cmd["nbytes"])
                reply(ok=True, digest=hashlib.blake2b(mv, digest_size=32).hexdigest())
            elif op == "read":
                reply(ok=True, data=bytes(host_bytes(regions[cmd["name"]], cmd["offset"], cmd["nbytes"])).hex())
            elif op == "watch":
                # Polls an 8-byte marker until it reaches `until`: each time it has moved, the
                # 8-byte flag must be at least as far (a WRITE posted after a fence lands after
                # everything before the fence). Answers how often it was not, and how many
                # marker values were seen. flag_name: the flag is in that region instead;
                # flag_at: the flag's byte offset there (default 0).
                words = regions[cmd["name"]].tensor(torch.int64, 2)
                flag_region = regions[cmd.get("flag_name", cmd["name"])]
                flags = flag_region.tensor(torch.int64, flag_region.nbytes // 8)[cmd.get("flag_at", 0) // 8:]
                marker, seen, behind = 0, 0, 0
                end = time.monotonic() + cmd["seconds"]
                while marker < cmd["until"] and time.monotonic() < end:
                    m = int(words[1])
                    if m != marker:
                        marker, seen = m, seen + 1
                        behind += int(flags[0]) < m
                    else:
                        time.sleep(0)
                reply(ok=True, behind=behind, seen=seen, marker=marker)
            elif op == "write_to":
                # WRITEs `nbytes` of byte `value` into region `name` published by the device at
                # `endpoint` (this device's first channel to it, when it has none yet).
                r = regions.get("_src")
                if r is None or r.nbytes < cmd["nbytes"]:
                    r = regions["_src"] = dev.alloc_region(cmd["nbytes"])
                r.tensor(torch.uint8, cmd["nbytes"]).fill_(cmd["value"])
                remote = dev.lookup_region(cmd["endpoint"], cmd["name"])
                dev.channel(cmd["endpoint"]).memcpy(r, 0, remote, 0, cmd["nbytes"], rdmaflow.WRITE).result(60)
                reply(ok=True)
            elif op == "free":
                regions.pop(cmd["name"]).free()
                reply(ok=True)
            elif op == "close":
                dev.close()
                reply(ok=True)
            elif op == "exit":
                reply(ok=True)
                break
            elif op == "crash":
                os._exit(17)
            else:
                reply(ok=False, error=f"unknown op {op}")
        except Exception as e:  # noqa: BLE001 - reported to the test
            reply(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    dev.close()


if __name__ == "__main__":
    # Die with the test process: a broken pipe on stdin ends the loop.
    threading.excepthook = lambda args: os._exit(3)
    main()
