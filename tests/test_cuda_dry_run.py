"""Where there is no GPU, tests/test_cuda.py runs with the CPU standing in for it
(CMLP_TEST_CUDA_DEVICE=cpu): its comparisons then hold trivially, but every line of the tests'
own code runs, so that a mistake in them is found here and not on a GPU."""
import os
import subprocess
import sys

import pytest

import cmlp

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(cmlp.cuda.is_available(), reason="a GPU is here: tests/test_cuda.py runs for real")
def test_the_gpu_tests_run_with_the_cpu_standing_in():
    env = dict(os.environ, CMLP_TEST_CUDA_DEVICE="cpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "test_cuda.py")],
                       env=env, capture_output=True, text=True, timeout=1200)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
