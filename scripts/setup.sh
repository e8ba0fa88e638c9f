#!/usr/bin/env bash
# Sets up rdmaflow for development in ./.venv: PyTorch, UCX (the libucx wheel), the C++
# extension and the test and benchmark tools.
#
#   TORCH_SPEC   the PyTorch requirement to install when .venv has none
#                (default torch==2.13.0; e.g. "torch --index-url .../cu124" for a GPU build)
#   RDMAFLOW_UCX_ROOT   build against a system UCX (e.g. the cluster's UCX with verbs)
#                       instead of the libucx wheel
#   PYTHON       the interpreter that creates the venv (default python3)
#   NIXL_SPEC    the NIXL packages for `rdmaflow bench latency` (default nixl==1.5.1
#                nixl-cu12==1.5.1; empty: skip). Installed without dependencies: their
#                metadata asks for the CUDA build of PyTorch, which would replace the one here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
NIXL_SPEC=${NIXL_SPEC-nixl==1.5.1 nixl-cu12==1.5.1}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip
if ! $PY -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086 # TORCH_SPEC may carry pip options
  $PY -m pip install -q $TORCH_SPEC
fi
# The file view (rdmaflow mount) needs libfuse and fusermount3 from the system.
if ! command -v fusermount3 >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep libfuse3.so.3 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing fuse3 (libfuse3 and fusermount3) for rdmaflow mount"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null; }; then
      echo "setup: WARNING: apt-get could not install fuse3 (no network?): rdmaflow mount and its tests need it" >&2
    fi
  else
    echo "setup: WARNING: fuse3 is missing and cannot be installed here (not root, or no apt-get):" >&2
    echo "setup:   rdmaflow mount and its tests need it: run 'sudo apt-get install fuse3' (Debian/Ubuntu)," >&2
    echo "setup:   'sudo dnf install fuse3' (Fedora/RHEL) or your system's equivalent." >&2
  fi
fi
$PY -m pip install -q -e ".[test,bench,fileview]"
if [ -n "$NIXL_SPEC" ] && ! $PY -c "import nixl._api" 2>/dev/null; then
  # A benchmark peer only: without it `bench latency` reports NIXL as not measured.
  # shellcheck disable=SC2086 # NIXL_SPEC is a list of requirements
  $PY -m pip install -q --no-deps $NIXL_SPEC || echo "warning: could not install NIXL ($NIXL_SPEC)" >&2
fi
$PY -m rdmaflow info
