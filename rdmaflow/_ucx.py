"""Loads the UCX shared libraries before the extension is imported.

With the libucx wheel (the default), its libraries are preloaded so that the extension's
``libucp.so.0`` dependency resolves. A build against a system UCX (``RDMAFLOW_UCX_ROOT``)
finds it through its rpath and loads nothing from the wheel.
"""
from __future__ import annotations

import os


def wheel_dir() -> str | None:
    try:
        import libucx
    except ImportError:
        return None
    return os.path.dirname(libucx.__file__)


def build_source() -> str:
    """'wheel' or 'system': which UCX the extension was built against."""
    try:
        from rdmaflow._build_info import UCX_SOURCE
    except ImportError:
        return "wheel"
    return UCX_SOURCE


def load() -> None:
    # A build against a system UCX finds it through its rpath; preloading the wheel's copy
    # would put two UCX builds in one process.
    if build_source() == "system":
        return
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
