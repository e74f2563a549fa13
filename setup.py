"""Builds cmlp's one extension module from csrc/ (the C core) and python/cmlp/_cmlp.c.

Environment:
  CMLP_PORTABLE=1   no -march=native (a wheel to run on other CPUs)
  CMLP_DEBUG=1      -O0 -g
  CMLP_BLAS=scipy|openblas   pick the BLAS (default: scipy-openblas32 when importable)
  CMLP_CUDA=0|1     0 forces a CPU-only build. The CUDA backend is not part of this version,
                    so 1 is refused with a clear error rather than silently ignored.
"""
import glob
import os
import subprocess
import sys

import numpy
from setuptools import Extension, setup

VERSION = "0.1.0"


def blas_config():
    choice = os.environ.get("CMLP_BLAS", "")
    if choice in ("", "scipy"):
        try:
            import scipy_openblas32 as sob
        except ImportError:
            if choice == "scipy":
                sys.exit("CMLP_BLAS=scipy but scipy-openblas32 is not installed (pip install scipy-openblas32)")
        else:
            libdir = sob.get_lib_dir()
            return dict(include_dirs=[sob.get_include_dir()], library_dirs=[libdir],
                        libraries=[sob.get_library()], runtime_library_dirs=[libdir],
                        define_macros=[("CMLP_BLAS_SCIPY", "1")])
    try:
        cflags = subprocess.check_output(["pkg-config", "--cflags", "openblas"], text=True).split()
        libs = subprocess.check_output(["pkg-config", "--libs", "openblas"], text=True).split()
    except (OSError, subprocess.CalledProcessError):
        sys.exit("no BLAS found: pip install scipy-openblas32, or apt-get install libopenblas-dev pkg-config")
    return dict(include_dirs=[f[2:] for f in cflags if f.startswith("-I")],
                library_dirs=[f[2:] for f in libs if f.startswith("-L")],
                libraries=[f[2:] for f in libs if f.startswith("-l")],
                runtime_library_dirs=[], define_macros=[("CMLP_BLAS_OPENBLAS", "1")])


def cuda_requested():
    want = os.environ.get("CMLP_CUDA", "")
    if want == "1":
        sys.exit("CMLP_CUDA=1: this version of cmlp has no CUDA backend yet; build without CMLP_CUDA=1")
    return False


blas = blas_config()
cuda_requested()
debug = os.environ.get("CMLP_DEBUG") == "1"
cflags = ["-std=c11", "-fvisibility=hidden", "-fno-math-errno", "-Wall", "-Wextra", "-Wundef",
          "-Wno-missing-field-initializers"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
if os.environ.get("CMLP_PORTABLE") != "1":
    cflags.append("-march=native")

sources = sorted(glob.glob("csrc/*.c")) + ["python/cmlp/_cmlp.c"]
ext = Extension(
    "cmlp._cmlp",
    sources=sources,
    include_dirs=["csrc", numpy.get_include()] + blas["include_dirs"],
    library_dirs=blas["library_dirs"],
    libraries=blas["libraries"] + ["m", "pthread"],
    runtime_library_dirs=blas["runtime_library_dirs"],
    define_macros=blas["define_macros"] + [("CMLP_WITH_CUDA", "0"), ("CMLP_VERSION", f'"{VERSION}"'),
                                           ("_GNU_SOURCE", "1")],
    extra_compile_args=cflags,
    depends=sorted(glob.glob("csrc/*.h")),
)

setup(ext_modules=[ext], package_dir={"": "python"}, packages=["cmlp"],
      package_data={"cmlp": ["py.typed", "*.pyi"]})
