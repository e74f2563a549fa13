#!/usr/bin/env bash
# Run on a machine with network access, before a check on an offline GPU machine: downloads into
# .whl/ the wheels that scripts/device_check.sh installs there (Python 3.12, x86-64):
# scipy-openblas32, the BLAS that cmlp's build links, and setuptools, installed only if missing.
# .whl/ is git-ignored through .git/info/exclude; copy it to the GPU machine with the checkout.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p .whl
rm -f .whl/*.whl # one version of each, which the offline install takes as a set

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl scipy-openblas32
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl setuptools
ls -l .whl
git check-ignore -q .whl/ || { echo "fetch_device_wheels: .whl/ is not ignored by git" >&2; exit 1; }
