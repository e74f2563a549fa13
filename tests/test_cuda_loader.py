"""The CUDA backend is a library of its own, loaded on first use: a CUDA build imports and runs
everything on the CPU where there is no GPU or driver, and says why CUDA is unavailable."""
import ctypes
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
    assert "cannot load the CUDA backend" not in str(e.value)  # the library loaded; CUDA itself said no
    try:  # no driver's library at all: said so, not CUDA's "driver version is insufficient" alone
        ctypes.CDLL("libcuda.so.1")
        assert "no NVIDIA driver" not in str(e.value)
    except OSError:
        assert "(no NVIDIA driver: libcuda.so.1 cannot be loaded; CUDA says " in str(e.value)
    with pytest.raises(RuntimeError, match="CUDA"):
        cmlp.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"cmlp was built with CUDA but no usable GPU"):  # the same words
        cmlp.cuda.get_device_properties()


# ---- counting the GPUs without starting CUDA (NVML), as torch.cuda.device_count() ----

VISIBLE = [  # CUDA_VISIBLE_DEVICES -> the devices it selects, as the CUDA runtime reads it
    (None, list(range(64))),
    ("", []),
    ("0", [0]),
    ("1,0", [1, 0]),
    (" 2 , 0 ", [2, 0]),
    ("1gpu2,2ampere", [1, 2]),  # each entry read as strtoul reads it
    ("+3,1", [3, 1]),
    ("0,-1,2", [0]),  # a negative entry ends the list
    ("0,x,2", [0]),  # so does one that is not a number
    ("-", []),
    ("+", []),
    ("0,1,0", []),  # a repeated device hides every device
    ("GPU-ab,GPU-cd", ["GPU-ab", "GPU-cd"]),
    ("GPU-ab,1,GPU-cd", ["GPU-ab"]),
    ("GPU-ab,GPU-ab", []),
    ("MIG-1,MIG-2", ["MIG-1", "MIG-2"]),
    ("MIG-1,GPU-2", ["MIG-1"]),
]


@pytest.mark.parametrize("var,devices", VISIBLE)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(var, devices):
    assert cmlp.cuda._visible_devices(var) == devices


UUIDS = ["GPU-7e570000-aa", "GPU-7e570001-bb", "GPU-9f000002-cc"]


@pytest.mark.parametrize("var,count", [
    (None, 3), ("0,1,2", 3), ("2", 1), ("0,3,1", 1), ("3", 0), ("", 0), ("1,1", 0),
    ("GPU-9f", 1),  # a unique prefix names a GPU
    ("GPU-7e570001-bb,GPU-9", 2),
    ("GPU-7e57", 0),  # an ambiguous prefix names none, and ends the list
    ("GPU-9,GPU-7e57,GPU-7e570000", 1),
    ("GPU-9,GPU-9f00", 0),  # the same GPU twice
    ("GPU-0", 0),
])
def test_nvml_count_applies_cuda_visible_devices(monkeypatch, var, count):
    monkeypatch.setattr(cmlp._cmlp, "nvml_devices", lambda: list(UUIDS))
    assert cmlp.cuda._nvml_count(var) == count


def test_without_nvml_or_with_mig_instances_nvml_cannot_tell(monkeypatch):
    monkeypatch.setattr(cmlp._cmlp, "nvml_devices", lambda: None)
    assert cmlp.cuda._nvml_count(None) == -1
    assert cmlp.cuda._nvml_count("") == 0  # nothing is visible: NVML is not asked
    monkeypatch.setattr(cmlp._cmlp, "nvml_devices", lambda: list(UUIDS))
    assert cmlp.cuda._nvml_count("MIG-7e57") == -1


def test_the_visible_devices_match_torchs_reading():
    """torch.cuda reads CUDA_VISIBLE_DEVICES and UUID prefixes in Python: the same strings give
    the same devices (strings it cannot read, e.g. a bare sign, are left out)."""
    tc = pytest.importorskip("torch.cuda")
    rng = __import__("random").Random(0)
    atoms = ["0", "1", "2", "7", "12", "-1", "+1", "x", "1x", " 3", "GPU-7e57", "GPU-7e570001", "GPU-9", "MIG-1", ""]
    cases = [",".join(rng.choice(atoms) for _ in range(rng.randint(1, 4))) for _ in range(400)] + [None]
    compared = 0
    for var in cases:
        old = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        try:
            if var is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = var
            try:
                theirs = tc._parse_visible_devices()
            except ValueError:
                continue
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            if old is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = old
        ours = cmlp.cuda._visible_devices(var)
        assert ours == theirs, var
        if ours and isinstance(ours[0], str) and not ours[0].startswith("MIG-"):
            assert cmlp.cuda._uuid_ordinals(ours, UUIDS) == tc._transform_uuid_to_ordinals(ours, UUIDS), var
        compared += 1
    assert compared > 300


@compiled
def test_without_nvml_the_count_is_cudas():
    # a library without NVML's functions, then none at all: CUDA's count (0 here, or the GPUs)
    code = ("import cmlp\nfrom cmlp import _cmlp\n"
            "print(_cmlp.nvml_devices(), cmlp.cuda.device_count() == _cmlp.cuda_device_count(), _cmlp.cuda_started())")
    for lib in ("libc.so.6", "/nonexistent/libnvidia-ml.so.1"):
        r = run_python(code, CMLP_NVML_LIBRARY=lib)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["None", "True", "True"], (lib, r.stdout)


def test_loading_cuda_starts_nothing():
    code = ("import cmlp\nfrom cmlp import _cmlp\n"
            "loadable = _cmlp.cuda_loadable()\n"
            "print(loadable, _cmlp.cuda_started(), _cmlp.cuda_forked())\n")
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(INFO["cuda_compiled"]), "False", "False"]


def test_device_properties_need_a_gpu_and_a_cuda_device():
    if not cmlp.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            cmlp.cuda.get_device_properties()
        with pytest.raises(RuntimeError, match="CUDA"):
            cmlp.cuda.get_device_name(0)
        said = cmlp.cuda.list_gpu_processes()  # as torch's: a line saying why
        assert said.startswith("cannot list the processes on the GPU: ") and "CUDA" in said, said
    for bad, error in (("cpu", ValueError), ("cuda:x", ValueError), ("cuda:-1", ValueError), (1.0, TypeError),
                       (True, TypeError)):
        with pytest.raises(error):
            cmlp.cuda.get_device_capability(bad)


def test_the_current_device_needs_a_gpu_and_its_arguments_are_torchs():
    """current_device, set_device and the device blocks, where there is no GPU: RuntimeError
    saying why, as asking for "cuda" does; what torch does nothing with does nothing here too."""
    c = cmlp.cuda
    if not c.is_available():
        assert not c.is_initialized()
        for call in (c.init, c.current_device, lambda: c.set_device(0), lambda: c.device(0).__enter__()):
            with pytest.raises(RuntimeError, match="CUDA is not available"):
                call()
        assert cmlp.memory.memory_allocated() == cmlp.memory.memory_allocated("cpu")  # device None: the CPU
        c.empty_cache()  # nothing opened: a no-op
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            c.caching_allocator_alloc(512)
    assert c.memory is cmlp.memory and c.get_allocator_backend() == "native"  # torch.cuda.memory's place
    with pytest.raises(AttributeError, match="has no attribute 'Stream'"):
        c.Stream
    c.set_device(-1)  # a negative index: nothing, as in torch
    with c.device(None), c.device(-1), c.device_of(cmlp.MLP([2, 2])):
        pass
    for bad, error in (("cuda", ValueError), (None, ValueError), ("cpu", ValueError), ("cuda:x", ValueError),
                       (1.5, TypeError), (2**40, ValueError)):
        with pytest.raises(error):
            c.set_device(bad)


def _setup_function(name):
    """A function of setup.py, alone (importing setup.py would run the build)."""
    import ast
    import glob as glob_module
    source = (Path(__file__).parent.parent / "setup.py").read_text()
    tree = ast.parse(source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    scope = {"os": os, "re": re, "sys": sys, "glob": glob_module}
    exec(compile(ast.Module(body=found, type_ignores=[]), "setup.py", "exec"), scope)
    return scope[name]


def test_the_build_finds_cublaslt_and_cublas_in_a_toolkit_and_in_a_toolkit_of_wheels(tmp_path):
    find = _setup_function("cuda_library")
    with pytest.raises(SystemExit, match="has no libcublasLt.so"):
        find(str(tmp_path), "cublasLt")
    wheels = tmp_path / "lib"  # pip's nvidia/cu13: versioned names only
    wheels.mkdir()
    for name in ("libcublasLt.so.13.0.2.14", "libcublasLt.so.13", "libcublasLt.so.9"):
        (wheels / name).write_bytes(b"")
    assert find(str(tmp_path), "cublasLt") == (str(wheels), "-l:libcublasLt.so.13")
    with pytest.raises(SystemExit, match="has no libcublas.so"):  # cuBLASLt's files are not cuBLAS's
        find(str(tmp_path), "cublas")
    for name in ("libcublas.so.12", "libcublas.so.13"):
        (wheels / name).write_bytes(b"")
    assert find(str(tmp_path), "cublas") == (str(wheels), "-l:libcublas.so.13")
    toolkit = tmp_path / "lib64"  # /usr/local/cuda: the development link, found first
    toolkit.mkdir()
    (toolkit / "libcublasLt.so").write_bytes(b"")
    assert find(str(tmp_path), "cublasLt") == (str(toolkit), "-lcublasLt")
    assert find(str(tmp_path), "cublas") == (str(wheels), "-l:libcublas.so.13")
