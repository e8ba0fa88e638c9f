"""The README's "Several hosts" section followed on two hosts: network namespaces joined by a
veth pair, each running its block of the README as written (only the addresses are the
namespaces' own)."""
from __future__ import annotations

import os
import re
import secrets
import subprocess

import pytest

from rdmaflow.testing.netns import TwoHosts, netns_unavailable_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = netns_unavailable_reason()


def host_blocks() -> tuple[str, str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Several hosts"):]
    blocks = [re.search(rf"On host {i} \(10\.0\.0\.{i + 1}\):\n\n```bash\n(.*?)```", section, re.DOTALL) for i in (0, 1)]
    assert all(blocks), "the README's two host blocks moved: update this test"
    return blocks[0].group(1), blocks[1].group(1)


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
def test_the_readme_multi_node_section_on_two_hosts():
    blocks = host_blocks()
    secret = secrets.token_hex(16)
    with TwoHosts() as (a, b):
        procs = []
        for host, block in zip((a, b), blocks):
            script = re.sub(r"RDMAFLOW_JOB_SECRET=\S+", f"RDMAFLOW_JOB_SECRET={secret}", block)
            script = script.replace("10.0.0.1", a.addr).replace("10.0.0.2", b.addr)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "RDMAFLOW_"))}
            procs.append(host.popen(["bash", "-ec", script], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=120))
            finally:
                if p.poll() is None:
                    p.kill()
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, out + err
        for i, (out, err) in enumerate(outs):
            assert re.search(rf"^worker {i}: loss \d", out, re.MULTILINE), out + err
            first = 2 * i
            assert (f"rdmaflow launch: starting 1 worker + 1 shard per node (2 workers + 2 shards in all): "
                    f"ranks {first}-{first + 1}; node {i} of 2, job store at {a.addr}:29500") in err, err
