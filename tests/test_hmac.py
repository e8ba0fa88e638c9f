"""The core's hand-written HMAC-SHA256 (csrc/hmac_sha256.hpp), which authenticates the handshake
and region descriptors, against RFC 4231's test vectors and Python's hmac module."""
from __future__ import annotations

import hashlib
import hmac
import random

import pytest

from rdmaflow import _core

# RFC 4231 §4.2-4.8: (key, data, HMAC-SHA-256). Case 5's output is truncated to 128 bits there.
RFC4231 = [
    pytest.param(b"\x0b" * 20, b"Hi There",
                 "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", id="case1"),
    pytest.param(b"Jefe", b"what do ya want for nothing?",
                 "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", id="case2"),
    pytest.param(b"\xaa" * 20, b"\xdd" * 50,
                 "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe", id="case3"),
    pytest.param(bytes(range(1, 26)), b"\xcd" * 50,
                 "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b", id="case4"),
    pytest.param(b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b", id="case5"),
    pytest.param(b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
                 "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", id="case6"),
    pytest.param(b"\xaa" * 131,
                 b"This is a test using a larger than block-size key and a larger than block-size data. "
                 b"The key needs to be hashed before being used by the HMAC algorithm.",
                 "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", id="case7"),
]


@pytest.mark.parametrize("key, data, expected", RFC4231)
def test_rfc4231_vectors(key: bytes, data: bytes, expected: str):
    digest = _core._hmac_sha256(key, data)
    assert len(digest) == 32
    # Case 5 gives only the first 128 bits; the others the whole output.
    assert digest.hex()[: len(expected)] == expected


def test_matches_python_hmac_on_random_inputs():
    rng = random.Random(4231)
    # Lengths around SHA-256's 64-byte block and its 55/56-byte padding boundary, then random ones.
    edges = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129]
    cases = [(k, m) for k in (0, 1, 32, 63, 64, 65, 131) for m in edges]
    cases += [(rng.randrange(0, 300), rng.randrange(0, 5000)) for _ in range(200)]
    for key_len, msg_len in cases:
        key, msg = rng.randbytes(key_len), rng.randbytes(msg_len)
        want = hmac.new(key, msg, hashlib.sha256).digest()
        assert _core._hmac_sha256(key, msg) == want, f"key of {key_len} bytes, message of {msg_len} bytes"


def test_differs_when_key_or_message_changes():
    base = _core._hmac_sha256(b"secret", b"message")
    assert _core._hmac_sha256(b"secreT", b"message") != base
    assert _core._hmac_sha256(b"secret", b"messagf") != base
    # Bytes after a NUL count (keys and messages are bytes, not C strings).
    assert _core._hmac_sha256(b"sec\x00ret", b"message") != _core._hmac_sha256(b"sec", b"message")
    assert _core._hmac_sha256(b"secret", b"mes\x00sage") != _core._hmac_sha256(b"secret", b"mes")
