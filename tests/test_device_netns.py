"""Two processes on two "hosts": network namespaces joined by a veth pair, over UCX tcp."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HERE, PeerProcess

from rdmaflow.bench.perftest import ucx_env
from rdmaflow.testing.netns import TwoHosts, netns_unavailable_reason

REASON = netns_unavailable_reason()


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
def test_transfer_between_two_hosts(job_secret):
    half = 32 << 20
    with TwoHosts() as (a, b):
        env_a = ucx_env("tcp", net_device=a.ifname)
        env_a.update(RDMAFLOW_JOB_SECRET=job_secret, RDMAFLOW_TEST_HOST=a.addr)
        peer = PeerProcess(env_a, argv_prefix=a.argv([]))
        try:
            assert peer.endpoint.startswith(a.addr + ":")
            peer.call("alloc", name="buf", nbytes=2 * half)
            peer.call("fill", name="buf", seed=5, timeout=60)
            env_b = ucx_env("tcp", net_device=b.ifname)
            env_b["RDMAFLOW_JOB_SECRET"] = job_secret
            out = subprocess.run(
                b.argv([sys.executable, os.path.join(HERE, "netns_client.py"), peer.endpoint, b.addr]),
                env=env_b, capture_output=True, text=True, timeout=120, check=False,
            )
            assert out.returncode == 0, out.stderr[-3000:]
            res = json.loads(out.stdout.strip().splitlines()[-1])
            assert res["read_ok"], "READ across hosts returned wrong bytes"
            got = peer.call("digest", name="buf", offset=0, nbytes=half, timeout=60)["digest"]
            assert got == res["write_digest"], "WRITE across hosts delivered wrong bytes"
        finally:
            peer.close()
