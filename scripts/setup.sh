#!/usr/bin/env bash
# Sets up rdmaflow for development in ./.venv: PyTorch, UCX (the libucx wheel), the C++
# extension and the test and benchmark tools.
#
#   TORCH_SPEC   the PyTorch requirement to install when .venv has none
#                (default torch==2.13.0; e.g. "torch --index-url .../cu124" for a GPU build)
#   RDMAFLOW_UCX_ROOT   build against a system UCX (e.g. the cluster's UCX with verbs)
#                       instead of the libucx wheel
#   PYTHON       the interpreter that creates the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

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
$PY -m rdmaflow info
