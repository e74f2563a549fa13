"""The CUDA backend is a library of its own, loaded on first use: a CUDA build imports and runs
everything on the CPU where there is no GPU or driver, and says why CUDA is unavailable."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cmlp

INFO = cmlp.build_info()
compiled = pytest.mark.skipif(not INFO["cuda_compiled"], reason="this build has no CUDA backend")


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=120)


def test_build_info_names_the_cuda_version_of_a_cuda_build():
    if INFO["cuda_compiled"]:
        assert re.fullmatch(r"\d+\.\d+", INFO["cuda"])
        assert (Path(cmlp.__file__).parent / "_cmlp_cuda.so").is_file()
    else:
        assert INFO["cuda"] is None


def test_device_count_agrees_with_is_available():
    assert (cmlp.cuda.device_count() > 0) == cmlp.cuda.is_available()


@compiled
def test_a_missing_backend_library_is_explained_and_the_cpu_still_works():
    code = ("import cmlp, numpy as np\n"
            "assert not cmlp.cuda.is_available()\n"
            "try:\n    cmlp.MLP([2, 2], device='cuda')\n"
            "except RuntimeError as e:\n    print('error:', e)\n"
            "m = cmlp.MLP([2, 2])\n"
            "print('cpu:', m(np.ones((1, 2), np.float32)).shape)\n")
    r = run_python(code, CMLP_CUDA_LIBRARY="/nonexistent/_cmlp_cuda.so")
    assert r.returncode == 0, r.stderr
    assert "cannot load the CUDA backend" in r.stdout and "/nonexistent/_cmlp_cuda.so" in r.stdout
    assert "cpu: (1, 2)" in r.stdout


@compiled
@pytest.mark.skipif(cmlp.cuda.is_available(), reason="a GPU is available here")
def test_without_a_gpu_the_error_gives_cudas_reason():
    with pytest.raises(RuntimeError, match=r"no usable GPU or CUDA driver was found on this machine \(.+\)") as e:
        cmlp.MLP([2, 2], device="cuda")
    assert "cannot load" not in str(e.value)  # the library loaded; CUDA itself said no
    with pytest.raises(RuntimeError, match="CUDA"):
        cmlp.cuda.synchronize()
