"""The package's annotations (it ships py.typed) hold: mypy finds no error in python/cmlp,
the C extension read from its stub, _cmlp.pyi. Skipped where mypy is not installed."""
import os
import subprocess
import sys

import pytest

PACKAGE_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")


def test_the_package_type_checks_with_mypy(tmp_path):
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "cmlp"], cwd=PACKAGE_ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Success" in r.stdout, r.stdout[-5000:] + r.stderr[-2000:]
