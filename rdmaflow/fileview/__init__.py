"""The parameter server's model as files (iRDMA §IV-D): ``rdmaflow mount`` serves a job's model
through FUSE, so that any language reads weights and writes gradients with plain POSIX I/O.

It sits above ``rdmaflow.ps``: a mount is an ordinary ``DistributedOptimizer`` worker whose
training loop is whatever writes its files. See docs/file-view.md."""
from __future__ import annotations

import os

from rdmaflow.fileview.fuse import fuse_problem, is_mounted, unmount
from rdmaflow.fileview.model import Declaration, load_declaration, parse_declaration

# The file every process of a file-view job runs, for launchers that take a script path
# (torchrun); `rdmaflow launch -m rdmaflow.fileview` runs the same module.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")

__all__ = ["SCRIPT", "Declaration", "fuse_problem", "is_mounted", "load_declaration", "parse_declaration", "unmount"]
