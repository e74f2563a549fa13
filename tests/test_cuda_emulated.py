"""tests/test_cuda.py against the real CUDA backend (csrc/backend_cuda*.c and the kernels), built over
an emulated CUDA runtime and cuBLASLt that run on the CPU (tests/emu/cuda_runtime_emu.cpp, built
by `make emu-cuda` into build/emu/_cmlp_cuda_emu.so and loaded through CMLP_CUDA_LIBRARY).

Where there is no GPU, this is how the backend's host code runs on every change: its streams,
copies and waits (work runs only when the host waits for it, so a missing wait reads stale
results), graph capture and replay (kernels keep the arguments of their capture), the allocator
on cudaMalloc and on expandable segments (unmapped pages fault), device out-of-memory, cuBLASLt
layouts, epilogues and alignments, and every kernel launch (a host pointer as a kernel argument
fails), on poisoned memory (new device memory reads as NaN until written) with the blocks of a
kernel, and a block's threads between barriers, run last first. The emulator computes GEMMs in float64 and rounds once, so GPU-vs-CPU
comparisons are made at a real distance, not bit for bit. Skipped only where the CUDA toolkit's
headers are missing."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import cmlp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import assert_exits_with_daemon_threads  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBRARY = os.path.join(ROOT, "build", "emu", "_cmlp_cuda_emu.so")


def _cuda_include():
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return os.path.join(home, "include", "cuda_runtime.h")


needs_emulator = [
    pytest.mark.skipif(not os.path.exists(_cuda_include()), reason="the CUDA toolkit's headers are not installed"),
    pytest.mark.skipif(cmlp.cuda.is_available(), reason="a GPU is here: the real backend runs instead"),
]


def _emulated_env():
    build = subprocess.run(["make", "-s", "emu-cuda", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # blocks (and threads) run last first (test_kernels runs both orders): a race gives other bits
    # the emulated runtime is NVML too (the GPUs it counts without starting CUDA)
    env = dict(os.environ, CMLP_CUDA_LIBRARY=LIBRARY, CMLP_NVML_LIBRARY=LIBRARY, OPENBLAS_NUM_THREADS="1",
               CMLP_EMU_BLOCK_ORDER="reverse")
    env.pop("CMLP_TEST_CUDA_DEVICE", None)
    return env


@needs_emulator[0]
@needs_emulator[1]
@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_gpu_tests_pass_on_the_emulated_cuda_backend(alloc_conf):
    """Once with the allocator's defaults, once with every segment expandable (the driver's
    virtual memory API behind every allocation)."""
    env = _emulated_env()
    env.pop("CMLP_ALLOC_CONF", None)
    env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(HERE, "test_cuda.py")], env=env, capture_output=True, text=True, timeout=1800)
    tail = r.stdout[-4000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " failed" not in summary and " error" not in summary, tail
    # the backend really ran: every test but the one about having no GPU
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 165, tail


@needs_emulator[0]
@needs_emulator[1]
def test_daemon_threads_using_a_gpu_when_the_interpreter_exits_let_it_exit(tmp_path):
    """The CUDA runtime is loaded at the first use of a GPU, after cmlp's C exit handler was
    registered, so its teardown (the emulator's, here) ran first, under the daemon threads'
    copies, kernels and frees: half the exits crashed. The package's Python exit hook now waits
    for every call made without the GIL, before any C exit handler."""
    assert_exits_with_daemon_threads(tmp_path, _emulated_env(), "cuda", 64, 4000, 0.3, runs=8)


@needs_emulator[0]
@needs_emulator[1]
@pytest.mark.parametrize("knob", ["CMLP_EMU_LT_NO_EPILOGUE", "CMLP_EMU_LT_NO_ALGO"])
def test_gemms_without_a_cublaslt_algorithm_give_the_same_results(knob):
    """Where cuBLASLt has no algorithm for a fused bias (and ReLU) epilogue, which it may answer
    for some mixes of types, layouts and alignments, the backend does without it, and where it
    has none for a GEMM at all, cuBLAS's cublasGemmEx runs it: the forward and backward tests
    (every sweep shape, fp32, fp16, bf16) and graph replay against eager execution pass with the
    emulated cuBLASLt offering no such algorithm (CMLP_EMU_LT_NO_EPILOGUE=1) or none at all
    (CMLP_EMU_LT_NO_ALGO=1)."""
    env = dict(_emulated_env(), **{knob: "1"})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                        "forward and not graph or graph_replay_equals",
                        os.path.join(HERE, "test_cuda.py")], env=env, capture_output=True, text=True, timeout=900)
    tail = r.stdout[-4000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " failed" not in summary and int(summary.split(" passed")[0].split()[-1]) >= 90, tail


_CUBLAS_FIT = r"""
import sys
import numpy as np
import cmlp
rng = np.random.default_rng(0)
x = rng.random((64, 13), dtype=np.float32)
y = rng.integers(0, 7, 64)
out = []
for amp in (None, "fp16", "bf16"):
    m = cmlp.MLP([13, 9, 7], seed=1).to("cuda")
    t = cmlp.Trainer(m, cmlp.optim.Adam(m.parameters(), lr=1e-2), amp=amp, batch_size=16)
    t.fit(x, y, epochs=2, progress=False)
    out.append(np.concatenate([v.ravel() for v in m.state_dict().values()]))
np.save(sys.argv[1], np.concatenate(out))
"""


@needs_emulator[0]
@needs_emulator[1]
def test_a_fit_with_every_gemm_in_cublas_equals_one_in_cublaslt(tmp_path):
    """With no cuBLASLt algorithm for any GEMM, the layers' GEMMs run in cuBLAS, the bias and
    ReLU by the kernels (fp32) or the bias rows and ReLU around the GEMM (half precision): the
    emulated libraries round as the fused epilogue does, so a fit's parameters come out the same
    bits in fp32, fp16 and bf16, eager and replayed."""
    env = _emulated_env()
    runs = []
    for knob in ("0", "1"):
        path = tmp_path / f"params{knob}.npy"
        r = subprocess.run([sys.executable, "-c", _CUBLAS_FIT, str(path)], env=dict(env, CMLP_EMU_LT_NO_ALGO=knob),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs.append(np.load(path))
    assert runs[0].shape == (3 * (13 * 9 + 9 + 9 * 7 + 7),)
    np.testing.assert_array_equal(runs[0], runs[1])


# the scripts' start: a device whose every free byte cmlp holds (fill_the_device)
_FULL_DEVICE = r"""
import numpy as np
import cmlp
M = cmlp.memory


def fill_the_device(keep=0):
    # every byte the device has left taken by cmlp's allocator: given back to its cache (the
    # cache holds it, CUDA sees none free), or with keep, all in use but the last keep blocks
    # of 512 bytes (room for a small step's buffers in the last small segment, which the rest
    # of its blocks keep in use)
    blocks = {}
    for size in (16 << 20, 1 << 20, 512):
        blocks[size] = []
        try:
            while True:
                blocks[size].append(M.caching_allocator_alloc(size, "cuda"))
        except cmlp.OutOfMemoryError:
            pass
    free = [b for size in blocks for b in blocks[size]] if not keep else blocks[512][-keep:]
    for b in free:
        M.caching_allocator_delete(b)
    return [b for size in blocks for b in blocks[size] if b not in free]


def give_back(blocks):
    for b in blocks:
        M.caching_allocator_delete(b)


def steps(trainer):
    return sorted(int(s.get("step", 0)) for s in trainer.optimizer.state_dict()["state"].values())


def step_on_a_full_device(trainer, x, y):
    # a step with every byte of the device in use but a small step's buffers: what it raised,
    # and whether the model, the micro-batch and the optimizer's steps are as they were
    before = trainer.model.state_dict()
    held = fill_the_device(keep=2000)
    try:
        trainer.step(x, y)
        print("no error")
    except cmlp.OutOfMemoryError as e:
        print("raised:", " ".join(str(e).split()))
    print("unchanged:", all(np.array_equal(v, before[k]) for k, v in trainer.model.state_dict().items()),
          trainer._c.oom_retries(), trainer.microbatch_size, steps(trainer))
    give_back(held)
"""

_LAZY_LOADING = _FULL_DEVICE + r"""
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 20)).astype(np.float32)
y = rng.integers(0, 5, 256)
cpu = cmlp.MLP([20, 64, 5], seed=0)
gpu = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
held = fill_the_device(keep=2000)
try:
    gpu.forward_backward(x, y)  # its kernels' first launches, with no memory to load them
    print("no error")
except cmlp.OutOfMemoryError as e:
    print("raised:", " ".join(str(e).split()))
give_back(held)  # to the cache: the launch gives it back to CUDA and goes on
reserved = M.memory_reserved("cuda")
gpu.zero_grad()
loss, want = gpu.forward_backward(x, y), cpu.forward_backward(x, y)
print("cached:", abs(loss - want) <= 1e-5 * want, M.memory_reserved("cuda") < reserved)

# a trainer's first steps on a device whose cache holds every byte: the same, no micro-batching
model = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, shuffle=False)
fill_the_device()
history = trainer.fit(x, y, epochs=2, progress=False)
print("fit:", trainer._c.oom_retries(), trainer.microbatch_size, history[-1]["microbatch_size"],
      np.isfinite(history[-1]["loss"]))
"""


@needs_emulator[0]
@needs_emulator[1]
def test_a_launch_that_cannot_load_its_kernel_gives_the_cache_back_or_raises_out_of_memory():
    """CUDA loads a kernel's code on its first launch, into device memory outside cmlp's
    allocator (the emulated runtime loads kernels so: CMLP_EMU_MODULE_BYTES). Where cmlp's cache
    holds that memory, the launch gives the cache back to the device and is made again: the
    call, and a fit, go on as if nothing happened (no micro-batching). Where memory in use
    leaves none, it is cmlp.OutOfMemoryError, which says so (not a device error)."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(256 << 20), CMLP_EMU_MODULE_BYTES=str(4 << 20))
    r = subprocess.run([sys.executable, "-c", _LAZY_LOADING], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("raised: CUDA out of memory at a launch: CUDA loads a kernel's code"), r.stdout
    # a kernel of cmlp's, or cuBLASLt's first run of a GEMM plan (its kernels load then too)
    assert "cmlp.cuda.empty_cache()" in lines[0], r.stdout
    assert "cudaErrorMemoryAllocation" in lines[0] or "cublasLtMatmul" in lines[0], r.stdout
    assert lines[1] == "cached: True True", r.stdout
    assert lines[2] == "fit: 0 64 64 True", r.stdout


_BIAS_GRAD_LOAD = _FULL_DEVICE + r"""
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 20)).astype(np.float32)
y = rng.integers(0, 5, 256)
warm = cmlp.MLP([20, 64, 5], device="cuda", seed=1)
warm.evaluate(x, y)  # the forward pass's and the loss's kernels, not the bias gradients'
cpu = cmlp.MLP([20, 64, 5], seed=0)
gpu = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
fill_the_device()
ooms = M.memory_stats("cuda")["num_ooms"]
loss, want = gpu.forward_backward(x, y), cpu.forward_backward(x, y)
grads = all(np.allclose(g, cpu.grads()[k], rtol=1e-4, atol=1e-6) for k, g in gpu.grads().items())
print("backward:", abs(loss - want) <= 1e-5 * want, grads, M.memory_stats("cuda")["num_ooms"] - ooms)
"""


@needs_emulator[0]
@needs_emulator[1]
def test_bias_gradients_whose_kernels_cannot_load_give_the_cache_back():
    """The bias gradients are launched under the backend's lock, where a launch out of memory
    cannot have the cache given back: their kernels are loaded before it is taken. A backward
    pass whose first new kernels are theirs, on a device whose cache holds every byte, goes on
    as if nothing happened (before, it raised an out-of-memory that told the user to empty the
    cache)."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(256 << 20), CMLP_EMU_MODULE_BYTES=str(4 << 20))
    r = subprocess.run([sys.executable, "-c", _BIAS_GRAD_LOAD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.splitlines() == ["backward: True True 0"], r.stdout


_GEMM_LOAD = _FULL_DEVICE + r"""
rng = np.random.default_rng(0)


def data(n, k, c):
    return rng.standard_normal((n, k)).astype(np.float32), rng.integers(0, c, n)


x, y = data(64, 20, 5)
warm = cmlp.MLP([20, 64, 5], device="cuda", seed=1)
warm.forward_backward(x, y, amp="fp16")  # cmlp's kernels loaded, and the small GEMMs' plans
x, y = data(1500, 300, 7)
cpu = cmlp.MLP([300, 128, 7], seed=0)
gpu = cmlp.MLP([300, 128, 7], device="cuda", seed=0)
want = cpu.forward_backward(x, y)
fill_the_device()
reserved = M.memory_reserved("cuda")
try:
    print("ran:", abs(gpu.forward_backward(x, y, amp="fp16") - want) < 1e-2 * want)
except cmlp.OutOfMemoryError as e:
    print("raised:", " ".join(str(e).split()))
print("given back:", M.memory_reserved("cuda") < reserved)
gpu.zero_grad()
print("then:", abs(gpu.forward_backward(x, y, amp="fp16") - want) < 1e-2 * want)
"""


@needs_emulator[0]
@needs_emulator[1]
@pytest.mark.parametrize("gemms", ["cuBLASLt", "cuBLASLt, split-K in place", "cuBLAS"])
def test_a_gemm_whose_kernels_cannot_load_gives_the_cache_back(gemms):
    """cuBLASLt (and cuBLAS) load a GEMM plan's kernels at its first run, into device memory the
    cache may hold (the emulated runtime does so per epilogue, types and size class). The first
    run that fails so has the cache given back and is made again, as a kernel's launch is. Here
    the forward GEMMs add to C (beta 1: a half-precision bias set first, the fused epilogue
    unused): where a part of the GEMM may have run (cuBLAS's, whose algorithm is not known), it
    is not made again: an out-of-memory, the cache given back, and the call, made again, runs.
    Before, each was a device error. A split-K algorithm that would reduce in C itself
    (CMLP_EMU_LT_INPLACE=1) is not taken for a half-precision C, whose partial sums would then be
    added in half precision: the GEMM splits in fp32, and is made again."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(256 << 20), CMLP_EMU_MODULE_BYTES=str(4 << 20),
               CMLP_EMU_LT_NO_EPILOGUE="1", CMLP_EMU_LT_INPLACE="1" if "in place" in gemms else "0",
               CMLP_EMU_LT_NO_ALGO="1" if gemms == "cuBLAS" else "0")
    r = subprocess.run([sys.executable, "-c", _GEMM_LOAD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    if gemms != "cuBLAS":
        assert lines == ["ran: True", "given back: True", "then: True"], r.stdout
    else:
        call = "cublasGemmEx (for a GEMM cuBLASLt has no algorithm for)"
        assert lines[0].startswith("raised: CUDA out of memory at a launch: CUDA loads a kernel's code"), r.stdout
        assert f"{call} (1500 x 128 x 300), which failed to execute with little" in lines[0], r.stdout
        assert lines[1:] == ["given back: True", "then: True"], r.stdout


_PARTS_HELD = r"""
import numpy as np
import cmlp
M = cmlp.memory
model = cmlp.MLP([512, 512, 512], device="cuda", seed=0)
groups = [{"params": ["fc1.weight"], "lr": 2e-3}, {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}]
opt = cmlp.optim.SGD(model, lr=0.01, momentum=0.9, param_groups=groups)
opt._sync_parts(opt._rates()[1])  # the groups' settings on the device, as fit puts them before planning
free = [b["size"] for s in M.memory_snapshot("cuda") if s["segment_type"] == "small" for b in s["blocks"]
        if b["state"] == "inactive"]
kept = [M.caching_allocator_alloc(1 << 20, "cuda"), M.caching_allocator_alloc(free[0] - (1 << 20), "cuda")]
M.set_memory_limit(M.memory_reserved("cuda") + (1 << 20), "cuda")  # no room for another small segment
rng = np.random.default_rng(0)
x, y = rng.standard_normal((1000, 512)).astype(np.float32), rng.integers(0, 512, 1000)
history = cmlp.Trainer(model, opt, batch_size=1000).fit(x, y, epochs=1, progress=False)
print(history[0]["microbatch_size"], M.memory_stats("cuda")["num_ooms"])
"""


@needs_emulator[0]
@needs_emulator[1]
def test_the_planned_start_counts_the_param_groups_settings_it_holds():
    """The optimizer's param groups' settings are put on the device as they are given (before a
    fit plans its start): the planned start counts them as held, not as a request still to come.
    Before, with the small pool full, each size failed on that request alone and the fit ran out
    of memory, where the whole batch trains."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(1 << 30))
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARTS_HELD], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.split() == ["1000", "0"], r.stdout


_DATA_LEAVES_NO_ROOM = r"""
import numpy as np
import cmlp
M = cmlp.memory
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (8192, 784), dtype=np.uint8), rng.integers(0, 10, 8192)
model = cmlp.MLP([784, 1024, 1024, 10], seed=0, device="cuda")
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=4096)
history = trainer.fit(x, y, epochs=1, progress=False)
print(history[0]["microbatch_size"], trainer._c.data_resident(), np.isfinite(history[0]["loss"]))
"""


@needs_emulator[0]
@needs_emulator[1]
def test_a_data_set_that_leaves_no_room_on_a_full_gpu_goes_back_to_the_host():
    """No memory limit, an 80 MiB GPU: the data set's copy fits, and then not even one sample's
    step does beside it. The copy goes and the batches are staged from host memory, as they would
    be under a limit (before, the fit ran out of memory where trainer.step trains)."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(80 << 20))
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _DATA_LEAVES_NO_ROOM], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    micro, resident, finite = r.stdout.split()
    assert 1 < int(micro) < 4096 and resident == "False" and finite == "True", r.stdout
    # the copy goes first, before any micro-batch shrinks: here the step then fits whole (one
    # out-of-memory, no split and no warning of one; before, it halved down to 1 sample first)
    env["CMLP_EMU_MEMORY"] = str(68 << 20)  # 34 MiB of it the GEMM workspace
    r = subprocess.run([sys.executable, "-W", "error::cmlp.MemoryWarning", "-c", _DATA_GOES_FIRST], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.split() == ["2048", "False", "1", "0", "0"], r.stdout


_DATA_GOES_FIRST = r"""
import numpy as np
import cmlp
M = cmlp.memory
rng = np.random.default_rng(0)
x, y = rng.standard_normal((4096, 784), dtype=np.float32), rng.integers(0, 10, 4096)
model = cmlp.MLP([784, 1000, 10], seed=0, device="cuda")
trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01, momentum=0.9), batch_size=2048, amp="bf16")
history = trainer.fit(x, y, epochs=1, progress=False)
ooms = M.memory_stats("cuda")["num_ooms"]
trainer.fit(x, y, epochs=1, progress=False)
print(history[0]["microbatch_size"], trainer._c.data_resident(), ooms, trainer._c.oom_retries(),
      M.memory_stats("cuda")["num_ooms"] - ooms)
"""


_GEMM_FAULT = r"""
import numpy as np
import cmlp
rng = np.random.default_rng(0)
x, y = rng.standard_normal((256, 20)).astype(np.float32), rng.integers(0, 5, 256)
model = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.1), batch_size=256)
try:
    trainer.step(x, y)
    print("no error")
except RuntimeError as e:
    print(type(e).__name__ + ":", " ".join(str(e).split())[:200])
print("retries:", trainer._c.oom_retries(), cmlp.memory.memory_stats("cuda")["num_ooms"])
"""


@needs_emulator[0]
@needs_emulator[1]
def test_a_gemm_that_fails_with_memory_free_is_a_device_error():
    """A GEMM that fails to execute with most of the device's memory free (CMLP_EMU_LT_FAIL=1)
    did not fail for want of room to load its kernels: it is the device error it says, not an
    out-of-memory that a training step would retry in ever smaller micro-batches."""
    env = dict(_emulated_env(), CMLP_EMU_LT_FAIL="1")
    r = subprocess.run([sys.executable, "-c", _GEMM_FAULT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("RuntimeError: cublasLtMatmul (256 x 64 x 20) failed: the GPU program failed"), r.stdout
    assert lines[1] == "retries: 0 0", r.stdout


_NO_KERNEL_IMAGE = r"""
import numpy as np
import cmlp
print("available:", cmlp.cuda.is_available())
try:
    cmlp.MLP([4, 3, 2], device="cuda")
    print("opened")
except RuntimeError as e:
    print("raised:", e)
cpu = cmlp.MLP([4, 3, 2], seed=0)
print("cpu:", np.isfinite(cpu.forward_backward(np.ones((2, 4), np.float32), [0, 1])))
"""


@needs_emulator[0]
@needs_emulator[1]
@pytest.mark.parametrize("image, why", [
    ("none", "cannot run cmlp's kernels: this build has code for other architectures only (CMLP_CUDA_ARCH). "
             "Reinstall cmlp with CMLP_CUDA_ARCH=90 set (cudaErrorNoKernelImageForDevice)"),
    ("ptx_too_new", "cannot run cmlp's kernels: this build has no machine code for its compute capability 9.0, and "
                    "its PTX is from a CUDA toolkit"),
])
def test_a_gpu_the_build_has_no_code_for_is_refused_when_it_opens(image, why):
    """A build whose kernels have no code the GPU runs (made for other architectures, or PTX of a
    toolkit newer than the driver) is refused as the device opens, with what to do, not at the
    first launch of a step; the CPU goes on working."""
    env = dict(_emulated_env(), CMLP_EMU_KERNEL_IMAGE=image)
    r = subprocess.run([sys.executable, "-c", _NO_KERNEL_IMAGE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "available: True" and lines[2] == "cpu: True", r.stdout
    assert lines[1].startswith("raised: cuda:0 (cmlp emulated GPU 0") and why in lines[1], r.stdout


# the update scripts' start: a batch, two param groups, the CPU's first Adam step to compare with
_UPDATE_START = _FULL_DEVICE + r"""
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 20)).astype(np.float32)
y = rng.integers(0, 5, 64)
GROUPS = [{"params": ["fc1.weight", "fc1.bias"]}, {"params": ["fc2.weight", "fc2.bias"], "lr": 3e-3}]


def cpu_step(**kw):
    cpu = cmlp.MLP([20, 64, 5], seed=0)
    cmlp.Trainer(cpu, cmlp.optim.Adam(cpu, lr=1e-2, **kw), batch_size=64).step(x, y)
    return cpu.state_dict()


def close(model, want):
    # Adam's first step moves each parameter by about lr (1e-2), g / (|g| + eps) of it: where a
    # gradient is near eps, the last bits of the GPU's GEMMs (float64, rounded once) and the
    # CPU's sgemm move it by 1e-5; a step counted twice or state left over moves it by far more
    return max(float(np.abs(model.state_dict()[k] - v).max()) for k, v in want.items()) < 1e-4
"""

_UPDATE_OOM = _UPDATE_START + r"""
# a step of SGD with param groups loads the forward and backward passes' kernels and the
# update's bookkeeping (a launch before the update's own)
warm = cmlp.MLP([20, 64, 5], device="cuda", seed=1)
cmlp.Trainer(warm, cmlp.optim.SGD(warm, lr=0.1, momentum=0.9, param_groups=GROUPS), batch_size=64).step(x, y)

# Adam's update (its kernels not loaded yet) where memory in use leaves none: raised
plain = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
plain_trainer = cmlp.Trainer(plain, cmlp.optim.Adam(plain, lr=1e-2), batch_size=64)
step_on_a_full_device(plain_trainer, x, y)

# Adam's update with param groups: its kernels, loaded before the step, cannot load until the
# cache is given back
model = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-2, param_groups=GROUPS), batch_size=64)
fill_the_device()
trainer.step(x, y)
print("groups:", close(model, cpu_step(param_groups=GROUPS)), trainer._c.oom_retries(), steps(trainer))

# the memory free: the step that raised gives the CPU's update
plain_trainer.step(x, y)
print("then:", close(plain, cpu_step()), steps(plain_trainer))
"""


@needs_emulator[0]
@needs_emulator[1]
def test_an_update_whose_kernel_cannot_load_is_made_once():
    """Out of memory loading the optimizer update's kernels (loaded before the step, CUDA loading
    a kernel at its first launch): where memory in use leaves none, the step is not retried with
    smaller micro-batches (no micro-batch's size is the cause): it raises cmlp.OutOfMemoryError
    with the model and optimizer as they were, and once memory is free the same step gives the
    CPU's update. Where the cache can give memory back, the load is made again and the step
    completes, its bookkeeping (step count, loss scale, data position) moved once."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(256 << 20), CMLP_EMU_MODULE_BYTES=str(4 << 20))
    r = subprocess.run([sys.executable, "-c", _UPDATE_OOM], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("raised: CUDA out of memory at a launch"), r.stdout
    assert lines[1] == "unchanged: True 0 64 []", r.stdout
    assert lines[2] == "groups: True 0 [1, 1, 1, 1]", r.stdout
    assert lines[3] == "then: True [1, 1, 1, 1]", r.stdout


_UPDATE_LOAD = _UPDATE_START + r"""
# a step of SGD loads the forward and backward passes' kernels and the bookkeeping's (the launch
# before the update's own with param groups), not Adam's update
warm = cmlp.MLP([20, 64, 5], device="cuda", seed=1)
cmlp.Trainer(warm, cmlp.optim.SGD(warm, lr=0.1), batch_size=64).step(x, y)
model = cmlp.MLP([20, 64, 5], device="cuda", seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-2, param_groups=GROUPS), batch_size=64)
step_on_a_full_device(trainer, x, y)
trainer.step(x, y)
print("then:", close(model, cpu_step(param_groups=GROUPS)), steps(trainer))
"""


@needs_emulator[0]
@needs_emulator[1]
def test_an_update_whose_kernel_cannot_load_moves_no_bookkeeping():
    """With param groups (and for SGD) an update is two launches: the bookkeeping (step count,
    loss scale, data position), then the update's own kernel. That kernel is loaded before the
    first: where memory in use leaves it no room, the step raises with the optimizer's steps
    where they were (not one step on, with the parameters not updated), and the same step,
    once memory is free, gives the CPU's first step."""
    env = dict(_emulated_env(), CMLP_EMU_MEMORY=str(256 << 20), CMLP_EMU_MODULE_BYTES=str(4 << 20))
    r = subprocess.run([sys.executable, "-c", _UPDATE_LOAD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("raised: CUDA out of memory at a launch"), r.stdout
    assert lines[1] == "unchanged: True 0 64 []", r.stdout
    assert lines[2] == "then: True [1, 1, 1, 1]", r.stdout


def _sanitizer_runtime(name):
    r = subprocess.run([os.environ.get("CC", "cc"), f"-print-file-name={name}"], capture_output=True, text=True)
    path = r.stdout.strip()
    return path if r.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _sanitized_env():
    """The environment of a Python whose cmlp (the extension, the CUDA backend and the emulator) is
    built with -fsanitize=address,undefined (`make asan-emu`), the sanitizers' runtimes preloaded."""
    runtimes = [_sanitizer_runtime("libasan.so"), _sanitizer_runtime("libubsan.so")]
    assert all(runtimes), f"the compiler's sanitizer runtimes are missing: {runtimes}"
    build = subprocess.run(["make", "-s", "asan-emu", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    env = _emulated_env()
    asan_library = os.path.join(ROOT, "build", "asan", "_cmlp_cuda_emu.so")
    env.update(CMLP_CUDA_LIBRARY=asan_library, CMLP_NVML_LIBRARY=asan_library,
               PYTHONPATH=os.path.join(ROOT, "build", "asan", "lib"), LD_PRELOAD=" ".join(runtimes),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
               CMLP_EMU_BLOCK_ORDER="forward")
    probe = subprocess.run([sys.executable, "-c", "import cmlp; print(cmlp.__file__, cmlp.cuda.is_available(), "
                            "'libasan' in open('/proc/self/maps').read())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and "build/asan/lib" in probe.stdout and "True True" in probe.stdout, probe
    return env


def _sanitized_pytest(env, *args):
    """tests/test_cuda.py (args: pytest's selection) in that Python: no sanitizer report, no failure."""
    # --capture=sys: a sanitizer's report (written to file descriptor 2 as the process ends)
    # reaches stderr here instead of pytest's capture
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", *args,
                        os.path.join(HERE, "test_cuda.py")], env=env, capture_output=True, text=True, timeout=2400)
    found = [line for line in r.stderr.splitlines() if "runtime error" in line or "ERROR: AddressSanitizer" in line]
    tail = "\n".join(found[:10]) + "\n" + r.stdout[-4000:] + "\n" + r.stderr[-4000:]
    assert r.returncode == 0 and not found, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " failed" not in summary and " error" not in summary, tail
    return int(summary.split(" passed")[0].split()[-1]), tail


@needs_emulator[0]
@needs_emulator[1]
def test_the_gpu_tests_pass_under_address_and_undefined_behaviour_sanitizers():
    """The same tests with cmlp's extension (the core: model, trainer, allocator, planner), the
    CUDA backend and the emulator built with -fsanitize=address,undefined (`make asan-emu`), the
    sanitizers' runtimes preloaded into Python: an access outside a buffer or undefined behaviour
    on the GPU paths of the core or in backend_cuda*.c ends the run with a report. On the CPU the
    allocator poisons the bytes no caller holds (past each request, and free blocks), so the CPU
    side is checked to each buffer's own end."""
    passed, tail = _sanitized_pytest(_sanitized_env())
    assert passed >= 165, tail


# what runs on the GPU with every kind of kernel and copy, from the sweeps of shapes
_KERNEL_TESTS = ("forward_matches_the_cpu or uint8_inputs or forward_backward_matches or optimizer_steps_match or "
                 "amp_forward_backward or trainer_steps_leave or clip_grad_norm_on_the_gpu or second_stream or "
                 "recompute_on_the_gpu or move_that_runs_out")


@needs_emulator[0]
@needs_emulator[1]
def test_with_caching_off_every_gpu_buffer_is_checked_to_its_own_end():
    """With CMLP_NO_MEMORY_CACHING=1 each GPU buffer is a cudaMalloc of exactly its bytes, whose
    pages past them the sanitized emulator poisons: a kernel or copy that reads or writes past a
    buffer's end is reported, as compute-sanitizer's memcheck reports it on a GPU, rather than
    landing in a neighbouring block of a cached segment. First a write one byte past a buffer,
    which must be reported (on the GPU with caching off; on the CPU with it on), then the tests
    that run every kind of kernel over the sweeps of odd shapes."""
    env = _sanitized_env()
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:exitcode=23"
    for device, caching_off in (("cuda", "1"), ("cpu", "0")):
        code = ("import ctypes, cmlp\n"
                f"p = cmlp.memory.caching_allocator_alloc(1000, {device!r})\n"
                "ctypes.memset(p, 7, 1000)\nprint('inside', flush=True)\nctypes.memset(p + 1000, 7, 1)\n")
        r = subprocess.run([sys.executable, "-c", code], env=dict(env, CMLP_NO_MEMORY_CACHING=caching_off),
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == "inside" and r.returncode == 23, (device, r.stdout, r.stderr[-2000:])
        assert "ERROR: AddressSanitizer: use-after-poison" in r.stderr, (device, r.stderr[-2000:])
    passed, tail = _sanitized_pytest(dict(env, CMLP_NO_MEMORY_CACHING="1"), "-k", _KERNEL_TESTS)
    assert passed >= 150, tail


@needs_emulator[0]
@needs_emulator[1]
def test_the_gpu_benchmark_runs_on_the_emulated_cuda_backend():
    """bench/bench_gpu.py --smoke: small batches, every cmlp path of the benchmark on "cuda" (the
    PyTorch columns stay empty: torch sees no GPU)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_gpu.py"), "--smoke"], env=_emulated_env(),
                       capture_output=True, text=True, timeout=900)
    tail = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    assert "device: cuda" in r.stdout and "| 1024 | fp16 |" in r.stdout, tail
    assert "| with OneCycleLR per step |" in r.stdout, tail  # the per-step schedule's row
    assert "FAILED" not in r.stdout + r.stderr, tail


@needs_emulator[0]
@needs_emulator[1]
def test_the_device_check_script_runs_on_the_emulated_cuda_backend():
    """scripts/device_check.sh end to end, with one GPU test and the benchmark's smoke test:
    every phase passes and the summary holds the test count, the benchmark's table and the
    profile's verdict (torch sees no GPU here, so nothing is profiled)."""
    env = dict(_emulated_env(), BENCH_FLAGS="--smoke", PYTEST_FLAGS="-q -k planned_peak_is", SMOKE_LIMIT="600",
               TEST_LIMIT="900", BENCH_LIMIT="600", DEADLINE="3000", PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_check.sh")], env=env, capture_output=True,
                       text=True, timeout=1800)
    tail = r.stdout[-5000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    summary = r.stdout.split("device check summary", 1)[1]
    for phase in ("wheels", "build", "probe", "smoke", "tests", "bench", "sanitize", "profile"):
        assert f"| {phase} | ok" in summary, tail
    assert "| tests | ok: 1 passed" in summary and "| 32 | fp16 |" in summary, tail
    assert "profile_gpu: nothing profiled" in summary, tail
    assert "fused ReLU keeps a NaN: False" in summary, tail  # the emulated cuBLASLt's max(x, 0)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the profile is PyTorch's profiler")
def test_the_kernel_profile_script_runs_on_the_cpu():
    """bench/profile_gpu.py --device cpu: PyTorch's operators on the CPU, the script's own code."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_gpu.py"), "--device", "cpu", "--steps",
                        "5"], env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    tail = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    for amp in ("fp32", "fp16"):
        assert f"### PyTorch, {amp}" in r.stdout and f"PyTorch, {amp}: " in r.stdout, tail
    assert "aten::addmm" in r.stdout and "per step; wall" in r.stdout, tail


def test_the_gpu_benchmark_runs_on_the_cpu():
    """bench/bench_gpu.py --device cpu: the same script with both sides on the CPU."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_gpu.py"), "--device", "cpu"], env=env,
                       capture_output=True, text=True, timeout=900)
    tail = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    assert "device: cpu" in r.stdout and "| 1024 | fp16 |" in r.stdout and "FAILED" not in r.stdout, tail
    assert "targets not checked: a smoke test's numbers mean nothing" in r.stdout and "(met)" not in r.stdout, tail
    assert "| with OneCycleLR per step |" in r.stdout, tail


_SCHEDULE_SCRIPT = r"""
import sys
import numpy as np
import cmlp
from cmlp.optim import lr_scheduler as S
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (64 * 6, 784), dtype=np.uint8)
y = rng.integers(0, 10, 64 * 6)
for name, interval in (("steplr", "epoch"), ("warmup", "step"), ("one-cycle", "step"), ("sgd-one-cycle", "step")):
    model = cmlp.MLP([784, 64, 10], device="cuda", seed=0)
    opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9) if name.startswith("sgd") else cmlp.optim.AdamW(model, lr=1e-2)
    sched = (S.StepLR(opt, step_size=1, gamma=0.5) if name == "steplr" else
             S.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10)) if name == "warmup" else
             S.OneCycleLR(opt, max_lr=0.05, total_steps=18, base_momentum=0.0))  # 6 steps an epoch
    h = cmlp.Trainer(model, opt, batch_size=64).fit(x, y, epochs=3, progress=False, scheduler=sched,
                                                    scheduler_interval=interval)
    assert len({e["lr"] for e in h}) == 3, h
    print(f"fit done: {name}", file=sys.stderr, flush=True)
"""


@needs_emulator[0]
@needs_emulator[1]
def test_a_schedule_changes_the_rate_without_capturing_the_step_again():
    """The rate and momentum are read on the device: a fit of three epochs whose rate changes
    every epoch, or at every step, and OneCycleLR's momentum with it (through 0 for SGD, whose
    buffer stays), captures its step once and replays it at each rate."""
    env = dict(_emulated_env(), CMLP_EMU_TRACE_GRAPHS="1")
    r = subprocess.run([sys.executable, "-c", _SCHEDULE_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    counts, n = {}, 0
    for line in r.stderr.splitlines():
        if line.startswith("cuda_emu: graph of "):
            n += 1
        elif line.startswith("fit done: "):
            counts[line.split(": ")[1]] = n
            n = 0
    assert counts == {"steplr": 1, "warmup": 1, "one-cycle": 1, "sgd-one-cycle": 1}, r.stderr[-3000:]


_TRACE_SCRIPT = r"""
import sys
import numpy as np
import cmlp
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (64 * 3, 784), dtype=np.uint8)
y = rng.integers(0, 10, 64 * 3)
for amp in (None, "fp16", "bf16"):
    model = cmlp.MLP([784, 512, 256, 10], device="cuda", seed=0)
    cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp).fit(x, y, epochs=2, progress=False)
    print(f"fit done: {amp}", file=sys.stderr, flush=True)
"""


@needs_emulator[0]
@needs_emulator[1]
def test_a_captured_training_step_launches_what_bench_readme_lists():
    """The launch count of the reference model's step, as fit captures it once and replays it
    (bench/README.md lists the launches): fp32 14, fp16 17, bf16 16 (no loss scaler), with no
    copy or memset inside a step; on the second stream 3 in fp32 (the weight gradients of layers 2
    and 3 and the top bias gradient) and 5 under amp (and the step's half weights and the logits'
    bias through half precision, beside the batch's gather)."""
    env = dict(_emulated_env(), CMLP_EMU_TRACE_GRAPHS="1")
    r = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    graphs, per_fit = {}, []
    for line in r.stderr.splitlines():
        if line.startswith("cuda_emu: graph of "):
            head, names = line.split(": ", 2)[1:]
            per_fit.append((head, names.split()))
        elif line.startswith("fit done: "):
            graphs[line.split(": ")[1]] = per_fit
            per_fit = []
    assert set(graphs) == {"None", "fp16", "bf16"}, r.stderr[-3000:]
    for amp, expected, side in (("None", 14, 3), ("fp16", 17, 5), ("bf16", 16, 5)):
        assert len(graphs[amp]) == 1, f"{amp}: {len(graphs[amp])} graphs captured in one fit of two epochs"
        head, names = graphs[amp][0]
        assert head.endswith(f"({side} on other streams)"), (amp, head)
        assert len(names) == expected, f"{amp}: {len(names)} launches: {names}"
        assert names.count("cublasLtMatmul") == 8, names
        assert not [n for n in names if n.startswith("memcpy") or n == "memset"], names
