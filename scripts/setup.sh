#!/usr/bin/env bash
# Sets up rdmaflow for development in ./.venv: PyTorch, UCX (the libucx wheel), the C++
# extension and the test and benchmark tools.
#
#   TORCH_SPEC   the PyTorch requirement to install when .venv has none
#                (default torch==2.13.0; e.g. "torch --index-url .../cu130" for a GPU build)
#   RDMAFLOW_UCX_WHEEL  the libucx wheel: libucx-cu12 or libucx-cu13 (or cu12, cu13). Default:
#                       the one for the venv's PyTorch's CUDA major version (torch.version.cuda;
#                       libucx-cu12 for a CPU-only PyTorch). Any other libucx wheel is removed:
#                       both install the package libucx and must never both be installed.
#   RDMAFLOW_UCX_ROOT   build against a system UCX (e.g. the cluster's UCX with verbs)
#                       instead of a libucx wheel (then none is installed)
#   PYTHON       the interpreter that creates the venv (default python3)
#   VENV_ARGS    options of `python -m venv` (e.g. --system-site-packages: use the PyTorch that
#                the host's Python already has; see README, "GPU machines")
#   NIXL_SPEC    the NIXL packages for `rdmaflow bench latency` (default nixl==1.5.1
#                nixl-cu12==1.5.1, nixl-cu13 with libucx-cu13; empty: skip). Installed without
#                dependencies: their metadata asks for the CUDA build of PyTorch, which would
#                replace the one here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  # shellcheck disable=SC2086 # VENV_ARGS is a list of options
  "$PYTHON" -m venv ${VENV_ARGS:-} .venv
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
# UCX: a system UCX, or the libucx wheel for this PyTorch (scripts/requirements.py). It is
# installed before the extension is built, and the build (without isolation) uses it, so the
# extension is built against the very UCX it loads.
libucx_installed() {
  $PY -m pip list --format=freeze 2>/dev/null | sed -n 's/^\(libucx[-_]cu[0-9]*\)==.*/\1/p' | tr _ -
}
if [ -n "${RDMAFLOW_UCX_ROOT:-}" ]; then
  UCX_WHEEL=""
  UCX_EXTRA=""
  echo "setup: UCX: the system UCX in $RDMAFLOW_UCX_ROOT (no libucx wheel)"
else
  UCX_WHEEL=$($PY -W ignore scripts/requirements.py ucx-wheel "${RDMAFLOW_UCX_WHEEL:-}")
  UCX_EXTRA=",$($PY scripts/requirements.py extra "$UCX_WHEEL")"
  echo "setup: UCX: $UCX_WHEEL (PyTorch $($PY -W ignore -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'))"
fi
INSTALLED=$(libucx_installed)
if [ -n "$(echo "$INSTALLED" | grep -vx "$UCX_WHEEL" || true)" ]; then
  # All of them, the chosen one too: their files overlap, so removing one breaks the other.
  echo "setup: removing the libucx wheels installed ($(echo $INSTALLED)): one is not ${UCX_WHEEL:-wanted}"
  # shellcheck disable=SC2086 # one name a line
  $PY -m pip uninstall -q -y $INSTALLED
fi
# The build requirements: pyproject.toml's, then what scikit-build-core asks for (the libucx
# wheel; cmake and ninja where the system has none).
# shellcheck disable=SC2046 # one requirement a line
$PY -m pip install -q $($PY scripts/requirements.py build-system)
BUILD_REQS=$(RDMAFLOW_UCX_WHEEL=$UCX_WHEEL $PY -c 'from scikit_build_core.build import get_requires_for_build_editable as r; print(" ".join(r()))')
if [ -n "$BUILD_REQS" ]; then
  # shellcheck disable=SC2086 # a list of requirements
  $PY -m pip install -q $BUILD_REQS
fi
$PY -m pip install -q --no-build-isolation -e ".[test,bench,fileview$UCX_EXTRA]"
CU=${UCX_EXTRA#,}
NIXL_SPEC=${NIXL_SPEC-nixl==1.5.1 nixl-${CU:-cu12}==1.5.1}
if [ -n "$NIXL_SPEC" ] && ! $PY -c "import nixl._api" 2>/dev/null; then
  # A benchmark peer only: without it `bench latency` reports NIXL as not measured.
  # shellcheck disable=SC2086 # NIXL_SPEC is a list of requirements
  $PY -m pip install -q --no-deps $NIXL_SPEC || echo "warning: could not install NIXL ($NIXL_SPEC)" >&2
fi
$PY -m rdmaflow info
