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
        return ("/dev/fuse does not exist: this kernel (or container) has no FUSE; "
                "load the fuse module (modprobe fuse) or give the container --device /dev/fuse")
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return f"fusermount3 is not installed: {INSTALL_HINT}"
    try:
        import mfusepy  # noqa: F401 - loads libfuse
    except ImportError:
        return f"the mfusepy binding is not installed: {INSTALL_HINT}"
    except OSError as e:
        return f"libfuse cannot be loaded ({e}): {INSTALL_HINT}"
    return None


def is_mounted(path: str) -> bool:
    """Whether ``path`` is a mount point, also when its FUSE daemon is gone (a stale mount, on
    which os.path.ismount fails: stat answers ENOTCONN)."""
    path = os.path.abspath(path)
    try:
        with open("/proc/self/mounts") as f:
            targets = [line.split()[1] for line in f if len(line.split()) > 1]
    except OSError:
        return os.path.ismount(path)
    # /proc/mounts escapes spaces, tabs, newlines and backslashes in octal.
    return any(t.encode().decode("unicode_escape") == path for t in targets)


def unmount(mountpoint: str, timeout: float = 10.0) -> bool:
    """Detaches ``mountpoint`` at once, even with files open (lazy): no stale mount is left.
    Returns whether it is no longer a mount point."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    cmds = ([[tool, "-u", "-z", mountpoint]] if tool else []) + [["umount", "-l", mountpoint]]
    for cmd in cmds:
        if not is_mounted(mountpoint):
            break
        try:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
    return not is_mounted(mountpoint)


CONNECTIONS = "/sys/fs/fuse/connections"


def connection_of(mountpoint: str) -> int | None:
    """The FUSE connection number of a mounted file view (its device's minor number)."""
    try:
        st = os.stat(mountpoint)
    except OSError:
        return None
    return os.minor(st.st_dev) if os.major(st.st_dev) == 0 else None


def abort_connection(conn: int | None) -> bool:
    """Aborts a FUSE connection (fusectl): every request still pending fails with ENOTCONN and
    libfuse's loop ends, even while clients hold files open. Mounts fusectl if it is not (root)."""
    if conn is None:
        return False
    if not os.path.exists(os.path.join(CONNECTIONS, str(conn))):
        try:
            subprocess.run(["mount", "-t", "fusectl", "fusectl", CONNECTIONS], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
    try:
        with open(os.path.join(CONNECTIONS, str(conn), "abort"), "w") as f:
            f.write("1")
        return True
    except OSError:
        return False
