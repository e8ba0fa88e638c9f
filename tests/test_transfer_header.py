"""What a sender reads before it writes: the header a receiver publishes, and a dynamic receiver's
metadata records. A bad one is a clear InvalidArgumentError, never a hang, a crash or a tensor."""
from __future__ import annotations

import gc
import struct

import pytest
import torch
from conftest import (
    TRANSFER_WAIT,
    local_device,
    raises_within,
)

import rdmaflow
from rdmaflow.transfer import DynamicReceiver, DynamicSender, StaticSender

KiB, MiB = 1 << 10, 1 << 20
ArenaFullError = rdmaflow.ArenaFullError
WAIT = TRANSFER_WAIT  # bound on any single answer from a peer


def test_a_name_that_holds_no_receiver_is_refused(job_secret):
    """An unknown name, and bytes published under a name that are no receiver's header (not one,
    truncated, malformed JSON): InvalidArgumentError at the sender's construction."""
    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        for cls in (StaticSender, DynamicSender):
            with pytest.raises(rdmaflow.InvalidArgumentError, match="published nothing named 'nope'"):
                cls(a, b.endpoint, "nope", timeout=5)
        b.publish("raw", b"hello, world")
        b.publish("trunc", b"RFX1" + struct.pack("<I", 1000) + b"{}")
        b.publish("json", b"RFX1" + struct.pack("<I", 5) + b"{nope")
        with pytest.raises(rdmaflow.InvalidArgumentError, match="not an rdmaflow tensor receiver"):
            StaticSender(a, b.endpoint, "raw", timeout=5)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="truncated"):
            DynamicSender(a, b.endpoint, "trunc", timeout=5)
        with pytest.raises(rdmaflow.InvalidArgumentError, match="malformed"):
            StaticSender(a, b.endpoint, "json", timeout=5)


_STATIC_META = {"kind": "static", "depth": 1, "base": 0, "ctl": 64, "data": 64 + 4096, "stride": 64,
                "shape": [4], "dtype": 1, "nbytes": 16}


_DYNAMIC_META = {"kind": "dynamic", "depth": 1, "base": 0, "ctl": 64, "data": 64 + 4096, "stride": 128,
                 "max_rank": 8, "record": 128}


@pytest.mark.parametrize("what, meta", [
    pytest.param("a valid static header", _STATIC_META, id="valid-static"),
    pytest.param("a valid dynamic header", _DYNAMIC_META, id="valid-dynamic"),
    pytest.param("missing fields", {"kind": "static"}, id="missing-fields"),
    pytest.param("unknown dtype code", dict(_STATIC_META, dtype=99), id="unknown-dtype"),
    pytest.param("non-integer depth", dict(_DYNAMIC_META, depth="x"), id="depth-not-int"),
    pytest.param("depth 0", dict(_DYNAMIC_META, depth=0), id="depth-0"),
    pytest.param("nbytes larger than the shape", dict(_STATIC_META, nbytes=4096, stride=4096), id="nbytes"),
])
def test_published_header_is_validated(job_secret, what, meta):
    """A header a receiver published (through the side RPC, so from a peer in the job) is
    checked by the sender: a bad one is an InvalidArgumentError at construction."""
    from rdmaflow.transfer.common import pack_header

    with local_device() as a, local_device() as b:
        a.create_arena(MiB)
        b.create_arena(MiB)
        b.publish("h", pack_header(meta, b.arena.region.descriptor()))
        cls = DynamicSender if meta["kind"] == "dynamic" else StaticSender
        if what.startswith("a valid"):
            cls(a, b.endpoint, "h", timeout=5)  # the harness itself is sound
            return
        with pytest.raises(rdmaflow.InvalidArgumentError):
            cls(a, b.endpoint, "h", timeout=5)


MALFORMED = [
    # (what, fields to change in a valid record of a float32[3, 4] tensor, expected message)
    ("unknown dtype code", {"code": 99}, "unknown dtype code 99"),
    ("dtype code zero", {"code": 0}, "unknown dtype code 0"),
    ("rank above 8", {"rank": 9, "dims": [1] * 8}, "rank 9 exceeds the maximum of 8"),
    ("huge rank", {"rank": 2**32 - 1}, "exceeds the maximum of 8"),
    ("negative dimension", {"dims": [3, -4]}, "bad dimensions"),
    ("dimension past the rank", {"dims": [3, 4, 5]}, "bad dimensions"),
    ("nbytes too small", {"nbytes": 47}, "47 bytes do not match"),
    ("nbytes too large", {"nbytes": 96}, "96 bytes do not match"),
    ("nbytes of an empty shape", {"dims": [3, 0]}, "48 bytes do not match"),
    ("source past the arena", {"src_off": "past_end"}, "outside the sender's registered arena"),
    ("source straddles the arena's end", {"src_off": "straddle"}, "outside the sender's registered arena"),
    ("source offset wraps around", {"src_off": "wrap"}, "outside the sender's registered arena"),
    ("enormous consistent shape", {"dims": [2**40, 2**20], "nbytes": 2**62}, "outside the sender's registered arena"),
    ("another registered region", {"src_region": "other"}, "not the sender's registered arena"),
    ("unknown region id", {"src_region": 987654321}, "not the sender's registered arena"),
    ("wrong sequence number", {"seq": 1000}, "sequence number is 1000"),
]


def test_malformed_metadata_records(tpeer, dev):
    """A sender (the peer) writes a corrupt record + flag into this receiver's slot: recv()
    raises InvalidArgumentError naming the problem, returns no tensor and allocates nothing."""
    peer = tpeer()
    for k, (what, fields, msg) in enumerate(MALFORMED):
        r = DynamicReceiver(dev, f"bad{k}", depth=2)
        peer.post("forge", remote=dev.endpoint, name=f"bad{k}", set=fields)
        gc.collect()
        used = dev.arena.used
        got = []
        e = raises_within(rdmaflow.InvalidArgumentError, 20, lambda got=got, r=r: got.append(r.recv(timeout=15)))
        assert not got, f"{what}: a tensor was returned"
        assert "malformed metadata record" in str(e) and msg in str(e), f"{what}: {e}"
        assert dev.arena.used == used, f"{what}: the receiver allocated memory for a bad record"
        assert r.seq == 0
        # Asking again does not hang or crash either: the same record is refused again.
        with pytest.raises(rdmaflow.InvalidArgumentError, match="malformed"):
            r.recv(timeout=5)
        peer.answer()
        r.close()
    # A valid forged record goes through (the forging itself is sound).
    r = DynamicReceiver(dev, "good", depth=1)
    peer.call("forge", remote=dev.endpoint, name="good", set={})
    t = r.recv(timeout=15)
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).view(3, 4))
