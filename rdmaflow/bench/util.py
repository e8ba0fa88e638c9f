"""Small helpers shared by the benchmark tools (standard library only)."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable

__all__ = ["parse_size", "format_size", "summarize"]

# Binary multiples: "1M" means 1 MiB, the way sizes are quoted for RDMA buffers.
_SIZE_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse "123", "64K", "1M", "1G" (also "1MiB", "1mb") into bytes, powers of 1024."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: expected an integer with an optional "
                         "K/M/G/T suffix (powers of 1024), e.g. 64K, 1M, 123")
    return int(m.group(1)) << (10 * _SIZE_UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    """Inverse of parse_size for exact multiples (1048576 -> "1M"), else plain bytes."""
    for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _percentile(sorted_vals: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (same as numpy's default).
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Return {"median", "min", "max", "iqr"} of a non-empty sequence of numbers.

    iqr is Q3 - Q1 with linear interpolation; it is 0.0 for a single value.
    """
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("summarize() needs at least one value")
    return {
        "median": statistics.median(vals),
        "min": vals[0],
        "max": vals[-1],
        "iqr": _percentile(vals, 0.75) - _percentile(vals, 0.25),
    }
