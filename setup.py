"""Builds cmlp's one extension module from csrc/ (the C core) and python/cmlp/_cmlp.c.

Environment:
  CMLP_PORTABLE=1   no -march=native (a wheel to run on other CPUs)
  CMLP_DEBUG=1      -O0 -g
  CMLP_BLAS=scipy|openblas   pick the BLAS (default: scipy-openblas32 when importable)
  CMLP_CUDA=0|1     0 forces a CPU-only build; 1 makes a missing CUDA toolkit an error. Unset:
                    the CUDA backend is built when the toolkit is found (CUDA_HOME, else nvcc
                    on PATH).
  CMLP_CUDA_ARCH    compute capabilities, e.g. "90" or "80;90" (default): machine code for
                    each, plus PTX of the highest for later GPUs.
  CMLP_MPI=0|1      0 builds no MPI module; 1 makes a missing MPI an error. Unset: built when
                    an MPI compiler wrapper is found (MPICC, else mpicc on PATH).

The CUDA backend is its own shared library, cmlp/_cmlp_cuda.so (kernels/*.cu and
csrc/backend_cuda.c, with the CUDA runtime linked statically and cuBLASLt), which the extension
loads on first use: a CUDA build imports and runs on machines without a GPU or driver.
Data parallelism's MPI side is another, cmlp/_cmlp_mpi.so (csrc/comm_mpi.c, built with mpicc),
loaded when a process group is made: cmlp imports and runs where there is no MPI.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


def cuda_config():
    want = os.environ.get("CMLP_CUDA", "")
    if want not in ("", "0", "1"):
        sys.exit(f"CMLP_CUDA={want!r}: use 0 (CPU only) or 1 (CUDA required)")
    if want == "0":
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        if want == "1":
            sys.exit("CMLP_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME or put nvcc on PATH")
        return None
    home = home or os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        sys.exit(f"cannot read the CUDA version from {nvcc} --version")
    libdir, cublaslt = cuda_library(home, "cublasLt")
    blasdir, cublas = cuda_library(home, "cublas")
    archs = [a.strip() for a in re.split(r"[;, ]+", os.environ.get("CMLP_CUDA_ARCH", "80;90")) if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        sys.exit(f"CMLP_CUDA_ARCH={os.environ.get('CMLP_CUDA_ARCH')!r}: expected numbers such as 80;90")
    return dict(nvcc=nvcc, home=home, version=m.group(1), libdirs=sorted({libdir, blasdir}), cublaslt=cublaslt,
                cublas=cublas, archs=sorted(set(archs), key=int))


def cuda_library(home, name):
    """(folder, -l argument) of the toolkit's library lib<name>.so (cublasLt, cublas): lib<name>.so
    in a toolkit's lib64 (or its targets' lib), else a versioned lib<name>.so.N alone, as in a
    toolkit of pip's wheels (nvidia/cuNN, whose lib holds no development link)."""
    folders = [os.path.join(home, "lib64"), os.path.join(home, "targets", "x86_64-linux", "lib"),
               os.path.join(home, "lib")]
    for d in folders:
        if os.path.exists(os.path.join(d, f"lib{name}.so")):
            return d, f"-l{name}"
    for d in folders:
        versioned = [os.path.basename(f) for f in glob.glob(os.path.join(d, f"lib{name}.so.*"))
                     if re.fullmatch(rf"lib{re.escape(name)}\.so\.\d+", os.path.basename(f))]
        if versioned:  # the newest by number (13 after 9)
            return d, "-l:" + max(versioned, key=lambda lib: int(lib.rsplit(".", 1)[1]))
    sys.exit(f"the CUDA toolkit at {home} has no lib{name}.so (looked in {', '.join(folders)})")


def mpi_config():
    want = os.environ.get("CMLP_MPI", "")
    if want not in ("", "0", "1"):
        sys.exit(f"CMLP_MPI={want!r}: use 0 (no MPI module) or 1 (MPI required)")
    if want == "0":
        return None
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc or not os.path.exists(mpicc):
        if want == "1":
            sys.exit("CMLP_MPI=1 but no MPI compiler wrapper was found: apt-get install libopenmpi-dev, or set MPICC")
        return None
    return dict(mpicc=mpicc)


def run(cmd):
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)


class BuildExt(build_ext):
    """Builds the extension, then (with CUDA) the backend library beside it."""

    def run(self):
        super().run()
        if cuda:
            self.build_cuda_library()
        if mpi:
            self.build_mpi_library()

    def build_mpi_library(self):
        out = os.path.join(os.path.dirname(self.get_ext_fullpath("cmlp._cmlp")), "_cmlp_mpi.so")
        deps = ["csrc/comm_mpi.c", "csrc/comm.h", "csrc/backend.h", "csrc/cmlp.h", "setup.py"]
        if not self.force and os.path.exists(out) and all(os.path.getmtime(d) <= os.path.getmtime(out) for d in deps):
            return
        os.makedirs(os.path.dirname(out), exist_ok=True)
        run([mpi["mpicc"], "-std=c11", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wundef",
             "-Wno-missing-field-initializers", "-Icsrc", "csrc/comm_mpi.c", "-o", out])

    def build_cuda_library(self):
        out = os.path.join(os.path.dirname(self.get_ext_fullpath("cmlp._cmlp")), "_cmlp_cuda.so")
        cu = sorted(glob.glob("kernels/*.cu"))
        backend = sorted(glob.glob("csrc/backend_cuda*.c"))
        deps = cu + backend + glob.glob("kernels/*.h") + glob.glob("kernels/*.cuh") + \
            ["csrc/backend_cuda.h", "csrc/cuda_workspace.h", "csrc/backend.h", "csrc/cmlp.h", "setup.py"]
        if not self.force and os.path.exists(out) and all(os.path.getmtime(d) <= os.path.getmtime(out) for d in deps):
            return
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cuda["archs"]]
        top = cuda["archs"][-1]
        gencode.append(f"-gencode=arch=compute_{top},code=compute_{top}")
        cc = os.environ.get("CC", "cc")
        jobs = []  # (command, object), compiled on every core
        for src in cu:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            # -lineinfo: compute-sanitizer's reports name source lines (the code is the same)
            jobs.append(([cuda["nvcc"], "-std=c++17", "-O3", "-lineinfo", "-Xcompiler",
                          "-fPIC,-Wall,-Wextra,-fvisibility=hidden", "-Ikernels", *gencode, "-c", src, "-o", obj], obj))
        for src in backend:
            obj = os.path.join(tmp, os.path.basename(src)[:-2] + ".o")
            jobs.append(([cc, "-std=c11", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wundef",
                          "-Wno-missing-field-initializers", "-D_GNU_SOURCE=1",
                          "-DCMLP_CUDA_ARCHS=\"%s\"" % ", ".join("sm_" + a for a in cuda["archs"]),
                          "-Icsrc", "-Ikernels", "-isystem",
                          os.path.join(cuda["home"], "include"), "-c", src, "-o", obj], obj))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(run, [cmd for cmd, _ in jobs]))  # the first failure raises here
        objs = [obj for _, obj in jobs]
        os.makedirs(os.path.dirname(out), exist_ok=True)
        libdirs = [arg for d in cuda["libdirs"] for arg in ("-L" + d, "-Xlinker", "-rpath=" + d)]
        run([cuda["nvcc"], "-shared", "-cudart", "static", *gencode, "-o", out, *objs, *libdirs, cuda["cublaslt"],
             cuda["cublas"], "-lpthread", "-ldl", "-lrt"])

    def get_outputs(self):
        outs = super().get_outputs()
        here = os.path.dirname(self.get_ext_fullpath("cmlp._cmlp"))
        if cuda:
            outs.append(os.path.join(here, "_cmlp_cuda.so"))
        if mpi:
            outs.append(os.path.join(here, "_cmlp_mpi.so"))
        return outs


blas = blas_config()
cuda = cuda_config()
mpi = mpi_config()
debug = os.environ.get("CMLP_DEBUG") == "1"
# -ffp-contract=off: every product rounded once, as the CUDA kernels and torch round them (GCC
# contracts nothing in ISO C mode anyway; clang would fuse multiply-adds by default)
cflags = ["-std=c11", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off", "-Wall", "-Wextra", "-Wundef",
          "-Wno-missing-field-initializers"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
if os.environ.get("CMLP_PORTABLE") != "1":
    cflags.append("-march=native")

# the CUDA backend and the MPI module are libraries of their own (above)
sources = sorted(f for f in glob.glob("csrc/*.c")
                 if not os.path.basename(f).startswith("backend_cuda") and not f.endswith("comm_mpi.c")) + \
    sorted(glob.glob("python/cmlp/_cmlp*.c"))
cuda_macros = [("CMLP_WITH_CUDA", "1"), ("CMLP_CUDA_VERSION", f'"{cuda["version"]}"')] if cuda else \
    [("CMLP_WITH_CUDA", "0")]
ext = Extension(
    "cmlp._cmlp",
    sources=sources,
    include_dirs=["csrc", numpy.get_include()] + blas["include_dirs"],
    library_dirs=blas["library_dirs"],
    libraries=blas["libraries"] + ["m", "pthread", "dl"],
    runtime_library_dirs=blas["runtime_library_dirs"],
    define_macros=blas["define_macros"] + cuda_macros + [("CMLP_VERSION", f'"{VERSION}"'), ("_GNU_SOURCE", "1")],
    extra_compile_args=cflags,
    depends=sorted(glob.glob("csrc/*.h")) + ["python/cmlp/_cmlp.h"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt}, package_dir={"": "python"}, packages=["cmlp", "cmlp.distributed", "cmlp.nn", "cmlp.optim", "cmlp.optim.lr_scheduler"],
      package_data={"cmlp": ["py.typed", "*.pyi"]})
