#!/usr/bin/env bash
# Prepares a fresh Debian machine for cmlp and installs it from this checkout:
#   - Debian packages: a C compiler, make, pkg-config, Python headers/venv when the system
#     Python is used, Open MPI (libopenmpi-dev, openmpi-bin: data parallelism and its tests;
#     CMLP_MPI=0 leaves it out) and Fashion-MNIST (dataset-fashion-mnist);
#   - a virtual environment in .venv with NumPy, the OpenBLAS build (scipy-openblas32),
#     pytest, tqdm and mypy;
#   - cmlp itself, built from source into that environment, with the CUDA backend when the CUDA
#     toolkit is found (nvcc on PATH, CUDA_HOME, or /usr/local/cuda); CMLP_CUDA=0 skips it and
#     CMLP_CUDA=1 makes a missing toolkit an error.
# Safe to run again: it skips what is already there. Needs root or sudo for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PY=${PYTHON:-python3}
pkgs="build-essential pkg-config dataset-fashion-mnist"
if [ "${CMLP_MPI:-}" != "0" ]; then
    pkgs="$pkgs libopenmpi-dev openmpi-bin"
fi
if ! command -v "$PY" >/dev/null 2>&1 || [ "$(command -v "$PY")" = "/usr/bin/python3" ]; then
    pkgs="$pkgs python3 python3-dev python3-venv"
fi
missing=""
for p in $pkgs; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "setup: installing Debian packages:$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
$VPY -m pip install -q --upgrade pip
$VPY -m pip install -q "numpy>=2.0" "scipy-openblas32>=0.3.27" "setuptools>=64" wheel pytest tqdm "mypy==2.4.1"
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
fi
echo "setup: building cmlp"
$VPY -m pip install -q --no-build-isolation --force-reinstall --no-deps .
$VPY -c "import cmlp; i = cmlp.build_info(); print('setup: cmlp', cmlp.__version__, 'with', i['blas'] + ',',
         'CUDA ' + i['cuda'] if i['cuda'] else 'no CUDA backend', 'and',
         'the MPI module' if cmlp.distributed.is_available() else 'no MPI module')"
