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
$PY -m pip install -q -e ".[test,bench]"
if [ -n "$NIXL_SPEC" ] && ! $PY -c "import nixl._api" 2>/dev/null; then
  # A benchmark peer only: without it `bench latency` reports NIXL as not measured.
  # shellcheck disable=SC2086 # NIXL_SPEC is a list of requirements
  $PY -m pip install -q --no-deps $NIXL_SPEC || echo "warning: could not install NIXL ($NIXL_SPEC)" >&2
fi
$PY -m rdmaflow info
