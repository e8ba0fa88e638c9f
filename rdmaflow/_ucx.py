"""Loads the UCX shared libraries before the extension is imported.

With the libucx wheel (the default), its libraries are preloaded so that the extension's
``libucp.so.0`` dependency resolves. A build against a system UCX finds it through its rpath,
and ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=1`` makes the wheel prefer a system copy.
"""
from __future__ import annotations

import os


def wheel_dir() -> str | None:
    try:
        import libucx
    except ImportError:
        return None
    return os.path.dirname(libucx.__file__)


def load() -> None:
    try:
        import libucx
    except ImportError:
        return
    libucx.load_library()


def bin_path(name: str) -> str | None:
    """Path of a UCX tool (ucx_info, ucx_perftest): the wheel's, $UCX_HOME's, or PATH's."""
    import shutil

    for root in (wheel_dir(), os.environ.get("UCX_HOME")):
        if root:
            p = os.path.join(root, "bin", name)
            if os.access(p, os.X_OK):
                return p
    return shutil.which(name)


def tool_env(base: dict | None = None) -> dict:
    """Environment in which the wheel's UCX binaries find their libraries."""
    env = dict(os.environ if base is None else base)
    d = wheel_dir()
    if d:
        lib = os.path.join(d, "lib")
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env
