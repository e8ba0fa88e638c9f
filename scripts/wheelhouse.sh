#!/usr/bin/env bash
# Fills a folder with the wheels that a host without a package registry (a GPU machine that has
# Python and its CUDA PyTorch) needs for rdmaflow, on a machine with one:
#
#   PYTHON=python3.12 bash scripts/wheelhouse.sh cu13 [DIR]      # DIR: default ./wheelhouse
#
#   - rdmaflow's wheel, built here with $PYTHON against the chosen libucx wheel;
#   - that libucx wheel (cu12 or cu13: the host's PyTorch's CUDA major version);
#   - what building rdmaflow from its source there takes (scikit-build-core, pybind11, cmake,
#     ninja), so that scripts/setup.sh works there too;
#   - rdmaflow's other dependencies and those of EXTRAS, with theirs. Not PyTorch (nor what it
#     depends on): the host has its own build of it, and pip leaves it alone.
#
# Every wheel is for $PYTHON's version on this machine's platform (e.g. CPython 3.12,
# linux x86_64): the host must have the same. On the host, either
#   pip install --no-index --find-links DIR rdmaflow libucx-cu13
# or, in a checkout of the same sources, with DIR's wheels in reach of pip:
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/wheelhouse PYTHON=python3.12 \
#     VENV_ARGS=--system-site-packages NIXL_SPEC= bash scripts/setup.sh
# (README.md, "GPU machines").
#
#   first argument or RDMAFLOW_UCX_WHEEL   cu12, cu13, libucx-cu12 or libucx-cu13 (default cu12)
#   PYTHON   the interpreter of the host's Python version (default python3)
#   EXTRAS   rdmaflow's extras whose packages come along (default test,bench,fileview: all that
#            scripts/setup.sh installs; empty: the runtime dependencies only)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CHOICE=${1:-${RDMAFLOW_UCX_WHEEL:-cu12}}
OUT=${2:-$ROOT/wheelhouse}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS-test,bench,fileview}
REQS="$ROOT/scripts/requirements.py"

UCX_WHEEL=$("$PYTHON" "$REQS" ucx-wheel "$CHOICE")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "wheelhouse: $($PYTHON -c 'import sys, sysconfig; print(sys.implementation.name, sys.version.split()[0], sysconfig.get_platform())'), $UCX_WHEEL -> $OUT"
"$PYTHON" -m venv "$TMP/venv"
PY=$TMP/venv/bin/python
$PY -m pip install -q --upgrade pip

# rdmaflow: its build requirements, then the libucx wheel as scikit-build-core asks for it
# (pyproject.toml's build.requires for RDMAFLOW_UCX_WHEEL), installed; then the build itself,
# without isolation, so that it is against that very wheel; in a build folder of its own.
export RDMAFLOW_UCX_WHEEL=$UCX_WHEEL
unset RDMAFLOW_UCX_ROOT UCX_HOME
mapfile -t BUILD_SYSTEM < <("$PY" "$REQS" build-system)
$PY -m pip install -q "${BUILD_SYSTEM[@]}"
mapfile -t BUILD_REQS < <(cd "$ROOT" && "$PY" -c \
  'from scikit_build_core.build import get_requires_for_build_wheel as r; print("\n".join(r()))')
$PY -m pip install -q "${BUILD_REQS[@]}"
$PY -m pip wheel -q --no-build-isolation --no-deps -C "build-dir=$TMP/build" -w "$OUT" "$ROOT"

# Everything else, as wheels for this Python (pip wheel: a package with no wheel is built into one).
mapfile -t RUNTIME < <("$PY" "$REQS" runtime "$EXTRAS")
$PY -m pip wheel -q -w "$OUT" "${BUILD_SYSTEM[@]}" "${BUILD_REQS[@]}" cmake ninja "${RUNTIME[@]}"

echo "wheelhouse: $(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
echo "wheelhouse: on the host: pip install --no-index --find-links $(basename "$OUT") rdmaflow $UCX_WHEEL"
