"""Every thread's native stack of a live process, for a test whose job process missed its
deadline: whether it hangs in the core, in UCX or in Python's exit says where to look.

Best effort: it needs ``gdb`` (absent: an empty string) and may take a few seconds. The
extension is built stripped, so its own frames show as addresses; UCX's, libc's and Python's
have names."""
from __future__ import annotations

import shutil
import subprocess


def native_stacks(pid: int, timeout: float = 60.0) -> str:
    """The frames of every thread of ``pid`` (``gdb -batch``, ``thread apply all bt``)."""
    if not shutil.which("gdb"):
        return ""
    try:
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
                           check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no stacks: {e})"
    return "\n".join(line for line in r.stdout.splitlines() if line.startswith(("#", "Thread ")))


def stacks_of(named: list[tuple[str, int]]) -> str:
    """``native_stacks`` of each (name, pid), each under a ``--- name: stacks`` line."""
    return "".join(f"\n--- {name}: stacks\n{native_stacks(pid)}" for name, pid in named)
