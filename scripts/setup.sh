#!/usr/bin/env bash
# Prepares a fresh Debian machine for cmlp and installs it from this checkout:
#   - Debian packages: a C compiler, make, pkg-config, Python headers/venv when the system
#     Python is used, and Fashion-MNIST (dataset-fashion-mnist);
#   - a virtual environment in .venv with NumPy, the OpenBLAS build (scipy-openblas32),
#     pytest and tqdm;
#   - cmlp itself, built from source into that environment.
# Safe to run again: it skips what is already there. Needs root or sudo for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PY=${PYTHON:-python3}
pkgs="build-essential pkg-config dataset-fashion-mnist"
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
$VPY -m pip install -q "numpy>=2.0" "scipy-openblas32>=0.3.27" "setuptools>=64" wheel pytest tqdm
echo "setup: building cmlp"
$VPY -m pip install -q --no-build-isolation --force-reinstall --no-deps .
$VPY -c "import cmlp; print('setup: cmlp', cmlp.__version__, 'with', cmlp.build_info()['blas'])"
