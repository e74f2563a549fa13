"""The CPU's thread pool, which OpenBLAS shares: two Python threads can train at once and get the
bits each gets alone, and a forked child keeps working. (OpenBLAS itself may pick other kernels
for another number of threads, so runs are compared at the same number.)"""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import hashlib, json, os, sys, threading
import numpy as np
import cmlp

def train(seed, amp=None):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (3000, 784), dtype=np.uint8)
    y = rng.integers(0, 10, 3000)
    m = cmlp.MLP([784, 256, 10], seed=seed)
    t = cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=500, amp=amp, seed=seed)
    t.fit(x, y, epochs=2, progress=False)
    return hashlib.sha1(b"".join(v.tobytes() for v in m.state_dict().values())).hexdigest()

mode = sys.argv[1]
if mode == "plain":
    print(json.dumps([train(1), train(2, "bf16")]))
elif mode == "threads":
    out = {}
    th = [threading.Thread(target=lambda s=s: out.__setitem__(s, train(s, "bf16" if s == 2 else None))) for s in (1, 2)]
    for t in th: t.start()
    for t in th: t.join()
    print(json.dumps([out[1], out[2]]))
elif mode.startswith("blas="):  # OpenBLAS's count set at run time: above the pool's, or 1 (threadpoolctl's limit)
    import ctypes, glob
    import scipy_openblas32
    train(1)
    lib = ctypes.CDLL(glob.glob(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas*.so"))[0])
    lib.scipy_openblas_set_num_threads(int(mode[5:]))
    print(json.dumps([train(1), train(2, "bf16"), lib.scipy_openblas_get_num_threads()]))
elif mode == "fork":
    first = train(1)
    pid = os.fork()
    if pid == 0:  # one thread left: OpenBLAS runs single-threaded there, so other bits may come
        train(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps([first, os.WEXITSTATUS(status)]))
'''


def run(mode, threads=None):
    env = dict(os.environ)
    env.pop("CMLP_NUM_THREADS", None)
    if threads:
        env["CMLP_NUM_THREADS"] = str(threads)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def reference():
    return run("plain", threads=2)


def test_runs_are_reproducible_on_the_pool(reference):
    assert run("plain", threads=2) == reference


def test_two_python_threads_train_at_once(reference):
    assert run("threads", threads=2) == reference


def test_a_forked_child_trains_and_the_parent_goes_on(reference):
    first, child_status = run("fork", threads=2)
    assert first == reference[0] and child_status == 0


def test_more_blas_threads_than_the_pool_still_trains():
    """(and the count stays as it was set: cmlp never changes OpenBLAS's process-wide thread count
    while it trains, which another thread's limit, threadpoolctl's, could read and restore)"""
    *out, blas_threads = run("blas=4", threads=2)
    assert len(out) == 2 and all(len(h) == 40 for h in out) and blas_threads == 4


def test_openblas_held_to_one_thread_at_run_time_trains_as_on_one_thread():
    """threadpoolctl's limit: every GEMM runs one-threaded, so the bits are those of a one-thread
    run (the pool's own loops give the same bits on any number of threads)."""
    *out, blas_threads = run("blas=1", threads=2)
    assert out == run("plain", threads=1) and blas_threads == 1


@pytest.mark.parametrize("value", ["abc", "0", "-2", "4x", "1.5", "²"])
def test_a_thread_count_that_is_not_one_is_refused_at_import(value):
    """The run's bits depend on the count: a bad one is not quietly every CPU."""
    env = dict(os.environ, CMLP_NUM_THREADS=value)
    r = subprocess.run([sys.executable, "-c", "import cmlp"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"ValueError: CMLP_NUM_THREADS={value!r}: expected a count of CPU threads" in r.stderr


def test_a_thread_count_with_spaces_or_empty_is_read():
    code = "import cmlp, numpy as np; m = cmlp.MLP([3, 2]); print(m.predict(np.ones((4, 3), np.float32)).shape)"
    for value in (" 2 ", ""):
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CMLP_NUM_THREADS=value),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "(4,)\n", r.stderr
