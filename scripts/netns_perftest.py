"""Self-check of rdmaflow.testing.netns: a ucx_perftest server in host a, its client in host b,
over the veth between them (needs root). ``python scripts/netns_perftest.py [--size 16M]``."""
from __future__ import annotations

import argparse
import sys

from rdmaflow.bench.harness import parse_size
from rdmaflow.bench.perftest import run_perftest
from rdmaflow.testing.netns import TwoHosts, list_netns, netns_unavailable_reason


def main() -> int:
    ap = argparse.ArgumentParser(description="TwoHosts self-check with ucx_perftest over tcp")
    ap.add_argument("--size", default="16M")
    ap.add_argument("--op", default="put", choices=["put", "get"])
    ap.add_argument("--rate", default=None, help="tc rate, e.g. 10gbit")
    ap.add_argument("--mtu", type=int, default=None)
    args = ap.parse_args()
    reason = netns_unavailable_reason()
    if reason:
        print(f"netns unavailable: {reason}")
        return 1
    with TwoHosts(rate=args.rate, mtu=args.mtu) as th:
        a, b = th.a, th.b
        print(f"a={a} b={b}")
        # Each side names its own veth: the server binds on a's, the client on b's.
        bw = run_perftest("tcp", args.op, parse_size(args.size), timeout=30, server_addr=a.addr,
                          server_env={"UCX_NET_DEVICES": a.ifname},
                          client_env={"UCX_NET_DEVICES": b.ifname},
                          server_popen=a.popen, client_popen=b.popen)
        print(f"tcp {args.op} {args.size} over veth: {bw / 1e9:.3f} GB/s")
        names = th.namespaces
    left = [n for n in list_netns() if n in names]
    print("namespaces left:", left or "none")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
