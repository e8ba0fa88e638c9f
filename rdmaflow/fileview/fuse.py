"""What the file view needs from the system: /dev/fuse, libfuse (2 or 3) and its mount helper,
and the mfusepy binding. ``scripts/setup.sh`` installs them (Debian: fuse3, as root)."""
from __future__ import annotations

import os
import shutil
import subprocess

INSTALL_HINT = ("install FUSE: `apt-get install fuse3` (Debian/Ubuntu, as root; scripts/setup.sh does it) "
                "and the binding: `pip install -e '.[fileview]'`")


def fuse_problem() -> str | None:
    """Why this machine cannot mount a file view, or None if it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist: this kernel (or container) has no FUSE; load the fuse module or run with --device /dev/fuse"
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return f"fusermount3 is not installed: {INSTALL_HINT}"
    try:
        import mfusepy  # noqa: F401 - loads libfuse
    except ImportError:
        return f"the mfusepy binding is not installed: {INSTALL_HINT}"
    except (OSError, EnvironmentError) as e:
        return f"libfuse cannot be loaded ({e}): {INSTALL_HINT}"
    return None


def unmount(mountpoint: str, timeout: float = 10.0) -> bool:
    """Detaches ``mountpoint`` at once, even with files open (lazy): no stale mount is left.
    Returns whether it is no longer a mount point."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    cmds = ([[tool, "-u", "-z", mountpoint]] if tool else []) + [["umount", "-l", mountpoint]]
    for cmd in cmds:
        if not os.path.ismount(mountpoint):
            break
        try:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
    return not os.path.ismount(mountpoint)
