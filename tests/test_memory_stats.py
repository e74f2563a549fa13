"""cmlp.memory on "cpu": every byte of a model, its gradients and its optimizer state shows in
PyTorch-named statistics and is given back; raw blocks round to 512 bytes; a memory limit turns
an allocation into cmlp.OutOfMemoryError without leaking; memory stays flat over many calls.
Every test restores the memory limit, so other tests are unaffected.
"""

import collections
import gc
import json
import subprocess
import sys

import numpy as np
import pytest

import cmlp

M = cmlp.memory
DEV = "cpu"
SIZES = [784, 512, 256, 10]
NPARAMS = 535818
ROUND = 512
STATS = ["allocation", "allocated_bytes", "requested_bytes", "active", "active_bytes", "segment", "reserved_bytes",
         "inactive_split", "inactive_split_bytes"]
POOLS = ["all", "large_pool", "small_pool"]
METRICS = ["current", "peak", "allocated", "freed"]
SCALARS = ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
           "max_split_size"]


def in_a_process_of_its_own(code):
    """The standard output of Python running code in a new process (whose cache starts empty)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def rounded(n):
    return max(ROUND, -(-n // ROUND) * ROUND)


def segment(n):
    """The segment the caching allocator reserves for a request of n bytes (PyTorch's rule)."""
    r = rounded(n)
    if r <= 1 << 20:
        return 2 << 20
    if r < 10 << 20:
        return 20 << 20
    return -(-r // (2 << 20)) * (2 << 20)


def fmt(n):
    """Two decimals in the largest unit (the messages' other way of writing a size)."""
    v, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB"]
    u = 0
    while u < 4 and v >= 1024.0:
        v, u = v / 1024.0, u + 1
    return f"{v:.2f} {units[u]}"


@pytest.fixture(autouse=True)
def no_limit_afterwards():
    gc.collect()
    M.set_memory_limit(None, DEV)
    try:
        yield
    finally:
        M.set_memory_limit(None, DEV)


def allocated():
    gc.collect()
    return M.memory_allocated(DEV)


def batch(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 784)).astype(np.float32), rng.integers(0, 10, n)


def test_default_device_is_cpu_here():
    if cmlp.cuda.is_available():
        pytest.skip("a GPU is the default device here")
    assert M.memory_allocated() == M.memory_allocated(DEV)
    assert M.memory_stats() == M.memory_stats(DEV)


def test_model_memory_appears_and_is_given_back():
    base = allocated()
    model = cmlp.MLP(SIZES, seed=0)
    grown = allocated() - base
    assert grown >= rounded(2 * NPARAMS * 4), "parameters and gradients must come from the allocator"
    assert grown < 2 * rounded(NPARAMS * 4) + 64 * 1024
    opt = cmlp.optim.Adam(model)
    assert allocated() - base == grown, "Adam's state must not exist before the first step"
    trainer = cmlp.Trainer(model, opt, batch_size=32)
    x, y = batch()
    trainer.step(x, y)
    assert allocated() - base >= grown + 2 * NPARAMS * 4
    del model, opt, trainer
    assert allocated() == base
    assert M.memory_reserved(DEV) >= M.memory_allocated(DEV)


def test_adam_state_appears_at_the_first_step():
    base = allocated()
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model)
    x, y = batch()
    model.forward_backward(x, y)  # the activation workspace exists from here on
    before_step = allocated()
    assert opt.state_dict()["state"] == {}
    opt.step()
    state = allocated() - before_step
    assert 2 * NPARAMS * 4 <= state <= 2 * rounded(NPARAMS * 4)
    opt.step()
    model.forward_backward(x, y)
    opt.step()
    assert allocated() - before_step == state, "later steps must not allocate"
    sgd_model = cmlp.MLP(SIZES, seed=0)
    sgd = cmlp.optim.SGD(sgd_model, lr=0.1, momentum=0.9)
    sgd_model.forward_backward(x, y)
    mid = allocated()
    sgd.step()
    assert NPARAMS * 4 <= allocated() - mid <= rounded(NPARAMS * 4), "SGD momentum buffer: one copy of the parameters"
    del model, opt, sgd_model, sgd
    assert allocated() == base


def _align(n, to):
    return (n + to - 1) // to * to


@pytest.mark.parametrize("images", ["float32", "uint8"])
def test_a_forward_pass_holds_no_gradient_buffers(images):
    # forward-only buffers: the input when it is copied (uint8 is normalised into it; float32
    # on the CPU is read in place), then two that odd and even layers' outputs take in turn
    sizes, rows = [784, 512, 256, 10], 1000
    model = cmlp.MLP(sizes, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (rows, 784)).astype(images)
    y = rng.integers(0, 10, rows)
    want = (_align(rows * 784 * 4, 64) if images == "uint8" else 0) + _align(rows * 512 * 4, 64) \
        + _align(rows * 256 * 4, 64) + _align(rows * 4, 64)
    for run in (lambda: model.evaluate(x, y, batch_size=rows), lambda: model(x)):
        M.empty_cache(DEV)
        base = M.memory_allocated(DEV)
        M.reset_peak_memory_stats(DEV)
        run()
        assert M.max_memory_allocated(DEV) - base == _align(want, 512)
        assert M.memory_allocated(DEV) == base
    # a training step's own buffers (all its own: two micro-batches a step) serve a later
    # forward pass when they are large enough
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01), batch_size=rows, accumulation_steps=2,
                           shuffle=False)
    trainer.step(np.concatenate([x, x]).astype(np.float32) / 255, np.concatenate([y, y]))
    held = M.memory_allocated(DEV)
    M.reset_peak_memory_stats(DEV)
    model._c.evaluate(x, y.astype(np.int32), 0.5, 0.5, rows)  # without the release that evaluate() makes
    assert M.max_memory_allocated(DEV) == held


def test_a_model_that_does_not_fit_fails_before_drawing_its_parameters():
    # 1 GiB of parameters under a 64 MiB limit: refused at once, without a host copy of them
    code = ("import resource, cmlp\n"
            "cmlp.memory.set_memory_limit(64 << 20, 'cpu')\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "try:\n"
            "    cmlp.MLP([16384, 16384])\n"
            "except cmlp.OutOfMemoryError:\n"
            "    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024,"
            " cmlp.memory.memory_allocated('cpu'))\n")
    grown_mib, allocated = map(int, in_a_process_of_its_own(code).split())
    assert grown_mib < 64 and allocated == 0


def test_peaks_and_reset():
    base = allocated()
    ptr = M.caching_allocator_alloc(8 << 20, DEV)
    M.caching_allocator_delete(ptr)
    assert M.max_memory_allocated(DEV) >= base + (8 << 20)
    assert M.max_memory_allocated(DEV) >= M.memory_allocated(DEV)
    assert M.max_memory_reserved(DEV) >= M.memory_reserved(DEV)
    M.reset_peak_memory_stats(DEV)
    assert M.max_memory_allocated(DEV) == M.memory_allocated(DEV) == base
    assert M.max_memory_reserved(DEV) == M.memory_reserved(DEV)
    stats = M.memory_stats(DEV)
    for key, value in stats.items():
        if key.endswith(".peak"):
            assert value == stats[key[:-len("peak")] + "current"], key
    model = cmlp.MLP([100, 10])
    assert M.max_memory_allocated(DEV) == M.memory_allocated(DEV) > base
    del model
    assert M.max_memory_allocated(DEV) > M.memory_allocated(DEV) == base


def test_memory_stats_keys_and_consistency():
    model = cmlp.MLP(SIZES, seed=0)  # something in both pools
    ptr = M.caching_allocator_alloc(1000, DEV)
    try:
        stats = M.memory_stats(DEV)
        expected = [f"{s}.{p}.{m}" for s in STATS for p in POOLS for m in METRICS]
        expected += [f"oversize_{k}.{m}" for k in ("allocations", "segments") for m in METRICS]
        expected += SCALARS
        missing = [k for k in expected if k not in stats]
        assert not missing, f"memory_stats lacks {missing}"
        assert all(isinstance(v, int) for v in stats.values())
        assert isinstance(stats, collections.OrderedDict) and list(stats) == sorted(stats)  # as torch's
        for s in STATS:
            for m in ("current", "allocated", "freed"):
                assert stats[f"{s}.all.{m}"] == stats[f"{s}.large_pool.{m}"] + stats[f"{s}.small_pool.{m}"], (s, m)
            assert stats[f"{s}.all.current"] == stats[f"{s}.all.allocated"] - stats[f"{s}.all.freed"], s
        assert stats["allocated_bytes.large_pool.current"] > 0 and stats["allocated_bytes.small_pool.current"] > 0
        assert stats["max_split_size"] == -1
        assert M.memory_allocated(DEV) == stats["allocated_bytes.all.current"]
        assert M.memory_reserved(DEV) == stats["reserved_bytes.all.current"]
        assert M.max_memory_allocated(DEV) == stats["allocated_bytes.all.peak"]
        assert M.max_memory_reserved(DEV) == stats["reserved_bytes.all.peak"]
        assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
        assert stats["allocated_bytes.all.current"] >= stats["requested_bytes.all.current"]
    finally:
        M.caching_allocator_delete(ptr)
        del model


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 1000, 4096 + 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 7])
def test_caching_allocator_alloc_rounds_to_512(nbytes):
    before = M.memory_stats(DEV)
    ptr = M.caching_allocator_alloc(nbytes, DEV)
    assert isinstance(ptr, int) and ptr != 0
    mid = M.memory_stats(DEV)
    size = rounded(nbytes)
    pool = "small_pool" if nbytes <= (1 << 20) else "large_pool"
    assert mid["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] == size
    assert mid[f"allocated_bytes.{pool}.current"] - before[f"allocated_bytes.{pool}.current"] == size
    assert mid["requested_bytes.all.current"] - before["requested_bytes.all.current"] == nbytes
    assert mid["allocation.all.current"] - before["allocation.all.current"] == 1
    M.caching_allocator_delete(ptr)
    after = M.memory_stats(DEV)
    for key in ("allocated_bytes.all.current", "requested_bytes.all.current", "allocation.all.current",
                f"allocated_bytes.{pool}.current"):
        assert after[key] == before[key], key
    assert after["allocated_bytes.all.freed"] - before["allocated_bytes.all.freed"] == size


def test_caching_allocator_block_is_usable_and_distinct():
    import ctypes
    a = M.caching_allocator_alloc(4096, DEV)
    b = M.caching_allocator_alloc(4096, DEV)
    try:
        assert a != b and abs(a - b) >= 4096
        ctypes.memset(a, 0xAB, 4096)
        ctypes.memset(b, 0x00, 4096)
        assert ctypes.string_at(a, 4096) == b"\xab" * 4096
    finally:
        M.caching_allocator_delete(a)
        M.caching_allocator_delete(b)


def test_caching_allocator_delete_unknown_pointer():
    base = allocated()
    with pytest.raises(ValueError, match=r"caching_allocator_alloc"):
        M.caching_allocator_delete(0xDEADBEEF)
    ptr = M.caching_allocator_alloc(100, DEV)
    M.caching_allocator_delete(ptr)
    with pytest.raises(ValueError, match=r"already"):
        M.caching_allocator_delete(ptr)
    with pytest.raises(ValueError, match=r"nbytes"):
        M.caching_allocator_alloc(-1, DEV)
    with pytest.raises(TypeError, match=r"nbytes"):
        M.caching_allocator_alloc(1.5, DEV)
    assert allocated() == base


def test_memory_limit_oom_is_clean_and_recoverable():
    big = [4096, 4096, 10]
    big_params = 4096 * 4096 + 4096 + 4096 * 10 + 10
    base = allocated()
    ooms = M.memory_stats(DEV)["num_ooms"]
    limit = M.memory_reserved(DEV) + (4 << 20) + 12345  # room for a new 2 MiB segment, run alone too
    M.set_memory_limit(limit, DEV)
    assert M.get_memory_limit(DEV) == limit == M.memory_stats(DEV)["limit"]  # (read without the statistics)
    with pytest.raises(cmlp.OutOfMemoryError) as info:
        cmlp.MLP(big, seed=0)
    err = info.value
    assert isinstance(err, RuntimeError)
    msg = str(err)
    assert "out of memory" in msg
    assert str(big_params * 4) in msg or fmt(big_params * 4) in msg, msg
    assert str(limit) in msg or fmt(limit) in msg, msg
    del info, err
    assert M.memory_stats(DEV)["num_ooms"] == ooms + 1
    assert allocated() == base
    small = cmlp.MLP([10, 4])  # still fits under the limit
    del small
    M.set_memory_limit(None, DEV)
    assert M.get_memory_limit(DEV) is None
    model = cmlp.MLP(big, seed=0)
    assert model.num_parameters() == big_params
    del model
    assert allocated() == base


def test_oom_on_the_gradient_buffer_frees_the_parameters():
    big = [2048, 2048, 10]
    nbytes = (2048 * 2048 + 2048 + 2048 * 10 + 10) * 4
    base = allocated()
    M.empty_cache(DEV)
    # room for the parameters' segment, not for the gradients'
    M.set_memory_limit(M.memory_reserved(DEV) + segment(nbytes) + (1 << 20), DEV)
    with pytest.raises(cmlp.OutOfMemoryError, match="out of memory"):
        cmlp.MLP(big)
    assert allocated() == base


def test_oom_at_the_first_optimizer_step_changes_nothing():
    # big enough that Adam's state cannot come from what the cache holds
    model = cmlp.MLP([784, 4096, 10], seed=0)
    nparams = model.num_parameters()
    opt = cmlp.optim.Adam(model)
    x, y = batch()
    model.forward_backward(x, y)
    params = model.state_dict()
    base = allocated()
    M.empty_cache(DEV)
    M.set_memory_limit(M.memory_reserved(DEV) + nparams * 4, DEV)
    with pytest.raises(cmlp.OutOfMemoryError, match="out of memory"):
        opt.step()
    assert allocated() == base
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, params[k], err_msg=k)
    assert opt.state_dict()["state"] == {}
    M.set_memory_limit(None, DEV)
    opt.step()
    assert opt.state_dict()["state"][0]["step"] == 1.0


def test_set_per_process_memory_fraction_validation():
    with pytest.raises(TypeError, match=r"fraction"):
        M.set_per_process_memory_fraction(1, DEV)
    with pytest.raises(TypeError, match=r"fraction"):
        M.set_per_process_memory_fraction("0.5", DEV)
    with pytest.raises(ValueError, match=r"fraction"):
        M.set_per_process_memory_fraction(1.5, DEV)
    with pytest.raises(ValueError, match=r"fraction"):
        M.set_per_process_memory_fraction(-0.1, DEV)
    assert M.get_memory_limit(DEV) is None
    M.set_per_process_memory_fraction(0.5, DEV)
    total = M.memory_stats(DEV)["total_memory"]
    assert total > 0
    assert M.get_memory_limit(DEV) == int(0.5 * total)
    M.set_per_process_memory_fraction(np.float64(0.25), DEV)  # a NumPy float is a float
    assert type(M.get_per_process_memory_fraction(DEV)) is float and M.get_per_process_memory_fraction(DEV) == 0.25
    M.set_per_process_memory_fraction(0.0, DEV)
    with pytest.raises(cmlp.OutOfMemoryError):
        cmlp.MLP([4096, 4096, 10])  # larger than anything the cache can hold


def test_a_request_beyond_any_device_is_refused_in_torchs_words_and_counted():
    before = M.memory_stats(DEV)["num_ooms"]
    said = r"out of memory\. Tried to allocate 67108864\.00 GiB\. .* request was 67108864\.00 GiB \(72057594037927937"
    with pytest.raises(cmlp.OutOfMemoryError, match=said):
        M.caching_allocator_alloc(2**56 + 1, DEV)
    assert M.memory_stats(DEV)["num_ooms"] == before + 1


def test_set_memory_limit_validation():
    with pytest.raises(ValueError, match=r"nbytes"):
        M.set_memory_limit(-1, DEV)
    with pytest.raises(TypeError, match=r"nbytes"):
        M.set_memory_limit("1GB", DEV)
    with pytest.raises(TypeError, match=r"nbytes"):
        M.set_memory_limit(1.5e9, DEV)
    assert M.get_memory_limit(DEV) is None


def test_memory_summary():
    s = M.memory_summary(DEV)
    assert isinstance(s, str)
    for title in ("Allocated memory", "Active memory", "Reserved memory", "Non-releasable memory", "Allocations"):
        assert title in s, title
    model = cmlp.MLP(SIZES)
    text = M.memory_summary(DEV)
    # PyTorch's layout: 75 columns between the bars; a byte count as an int in the unit that its
    # row's first value calls for (KiB from 768 KiB, MiB from 768 MiB)
    assert {len(line) for line in text.splitlines()} == {77}, text
    for name in ("Oversize allocations", "Non-releasable allocs", "Active allocs"):
        assert f"| {name:<21} |" in text
    n = M.memory_allocated(DEV)
    row = next(line for line in text.splitlines() if line.startswith("| Allocated memory"))
    shown = f"{n // 1024**2:6d} MiB" if n >= 768 * 1024**2 else f"{n // 1024:6d} KiB" if n >= 768 * 1024 else f"{n:6d} B  "
    assert row.split("|")[2] == f" {shown} ", row
    # the count rows, Oversize ones too, as torch's _format_count: 7 digits, a unit, a space
    oversize = next(line for line in text.splitlines() if line.startswith("| Oversize allocations"))
    allocs = next(line for line in text.splitlines() if line.startswith("| Allocations"))
    assert [len(c) for c in oversize.split("|")[2:6]] == [len(c) for c in allocs.split("|")[2:6]] == [12] * 4
    assert oversize.split("|")[2] == f" {M.memory_stats(DEV)['oversize_allocations.current']:7d}    "
    # the counts at torch's columns, whatever their width (on the CPU without "CUDA", "cudaMalloc")
    stats = M.memory_stats(DEV)
    counts = text.splitlines()[3]
    ooms, retries = stats["num_ooms"], stats["num_alloc_retries"]
    assert counts == f"|{'OOMs: ':>23}{ooms:<12d} | {'alloc retries: ':>27}{retries:<8d}  |"
    assert counts.index("|", 1) == 37, counts
    short = M.memory_summary(DEV, abbreviated=True)  # torch's: without the pool rows
    assert "from large pool" in text and "from small pool" in text
    assert short.splitlines() == [line for line in text.splitlines() if "      from " not in line]
    with pytest.raises(TypeError):
        M.memory_summary(DEV, abbreviated="yes")
    del model


def test_empty_cache_is_safe():
    base = allocated()
    M.empty_cache(DEV)
    cmlp.empty_cache()
    assert allocated() == base
    assert M.memory_reserved(DEV) >= M.memory_allocated(DEV)


def test_memory_stays_flat_over_many_calls():
    model = cmlp.MLP([784, 128, 64, 10], seed=0)  # small, so 200 rounds stay fast
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=64)
    x, y = batch(64)
    xu = np.random.default_rng(1).integers(0, 256, (64, 784), dtype=np.uint8)

    def calls():
        model(x)
        model.forward_backward(x, y)
        model.forward_backward(xu, y)
        model.predict(xu)
        model.evaluate(x, y, batch_size=64)
        model.grads()
        model.state_dict()
        opt.zero_grad()
        trainer.step(x, y)

    # two rounds reach the steady state: inference hands its buffers back to the cache, and the
    # second round's training finds the cache holding what the first left there
    calls()
    calls()
    gc.collect()
    first = (M.memory_allocated(DEV), M.memory_reserved(DEV), M.memory_stats(DEV)["allocation.all.current"])
    for i in range(200):
        calls()
        now = (M.memory_allocated(DEV), M.memory_reserved(DEV), M.memory_stats(DEV)["allocation.all.current"])
        assert now == first, f"memory changed at call {i}: {now} != {first}"


def test_mem_get_info_reports_the_machine():
    free, total = M.mem_get_info(DEV)
    assert total == M.memory_stats(DEV)["total_memory"] > 0
    assert 0 < free <= total
    assert M.mem_get_info() == pytest.approx((free, total), rel=0.5)  # the default device is the CPU here
    with pytest.raises(ValueError, match="unknown device"):
        M.mem_get_info("gpu")
    if not cmlp.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            cmlp.cuda.mem_get_info()


def test_oom_error_is_exported():
    assert issubclass(cmlp.OutOfMemoryError, RuntimeError)
    assert cmlp.OutOfMemoryError is cmlp._cmlp.OutOfMemoryError


def test_torchs_other_memory_functions():
    """memory_stats_as_nested_dict, reset_accumulated_memory_stats, get_per_process_memory_fraction,
    get_allocator_backend and the deprecated *_cached / reset_max_* aliases, with torch's meanings."""
    p = M.caching_allocator_alloc(3 << 20, DEV)
    M.caching_allocator_delete(p)
    flat, nested = M.memory_stats(DEV), M.memory_stats_as_nested_dict(DEV)
    assert nested["allocated_bytes"]["all"]["peak"] == flat["allocated_bytes.all.peak"]
    assert nested["num_ooms"] == flat["num_ooms"] and nested["oversize_allocations"]["current"] == 0

    def flatten(d, prefix=""):
        for k, v in d.items():
            yield from flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    assert dict(flatten(nested)) == flat
    M.reset_accumulated_memory_stats(DEV)
    s = M.memory_stats(DEV)
    for key in STATS:
        for pool in POOLS:
            assert s[f"{key}.{pool}.allocated"] == 0 and s[f"{key}.{pool}.freed"] == 0, (key, pool)
            assert s[f"{key}.{pool}.current"] == flat[f"{key}.{pool}.current"], "currents stay"
    assert s["num_ooms"] == s["num_alloc_retries"] == s["num_device_alloc"] == s["num_device_free"] == 0
    assert M.get_per_process_memory_fraction(DEV) == 1.0
    M.set_per_process_memory_fraction(0.3, DEV)
    assert M.get_per_process_memory_fraction(DEV) == 0.3
    M.set_memory_limit(s["total_memory"] // 4, DEV)
    assert M.get_per_process_memory_fraction(DEV) == (s["total_memory"] // 4) / s["total_memory"]
    assert M.get_allocator_backend() == "native"
    with pytest.warns(FutureWarning, match="memory_reserved"):
        assert M.memory_cached(DEV) == M.memory_reserved(DEV)
    with pytest.warns(FutureWarning):
        assert M.max_memory_cached(DEV) == M.max_memory_reserved(DEV)
    with pytest.warns(FutureWarning, match="reset_peak_memory_stats"):
        M.reset_max_memory_allocated(DEV)
    assert M.max_memory_allocated(DEV) == M.memory_allocated(DEV)


def test_a_child_forked_while_threads_allocate_can_allocate():
    """fork() while other threads are inside the allocator: the child starts with every allocator
    lock free (they are taken around fork), so its first call returns."""
    import os
    import signal
    import threading

    stop = threading.Event()

    def churn():
        while not stop.is_set():
            M.caching_allocator_delete(M.caching_allocator_alloc(3000, DEV))

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    codes = []
    try:
        for _ in range(200):
            pid = os.fork()
            if pid == 0:  # the child: dies by the alarm if a lock is never given back
                signal.alarm(20)
                M.caching_allocator_delete(M.caching_allocator_alloc(5000, DEV))
                os._exit(0 if M.memory_allocated(DEV) >= 0 else 1)
            codes.append(os.waitpid(pid, 0)[1])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert codes == [0] * 200


def test_torchs_other_device_forms_and_caching_allocator_alloc_keywords():
    """An int N means "cuda:N" (as torch.cuda's functions), a torch.device its own name;
    caching_allocator_alloc takes torch's size= and stream=None."""
    base = M.memory_allocated("cpu")
    ptr = M.caching_allocator_alloc(size=3000, device="cpu", stream=None)
    assert M.memory_allocated("cpu") == base + 3072
    M.caching_allocator_delete(ptr)
    with pytest.raises(TypeError, match="both"):
        M.caching_allocator_alloc(10, size=10)
    with pytest.raises(ValueError, match="stream"):
        M.caching_allocator_alloc(10, "cpu", stream=7)
    if not cmlp.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            M.memory_allocated(0)
    torch = pytest.importorskip("torch")
    assert M.memory_stats(torch.device("cpu")) == M.memory_stats("cpu")
    if cmlp.cuda.is_available():
        assert M.memory_reserved(torch.device("cuda", 0)) == M.memory_reserved(0) == M.memory_reserved("cuda:0")


def test_deleting_a_model_its_optimizer_trainer_and_schedule_frees_their_memory_at_once():
    """No reference cycle among them: `del` frees the memory without waiting for the cyclic
    garbage collector (a loop of trials under a limit would otherwise run out), as torch's."""
    import gc

    x, y = batch(64)
    gc.collect()
    base = M.memory_allocated(DEV)
    gc.disable()
    try:
        for kind in ("adam", "sgd"):
            model = cmlp.MLP(SIZES, seed=0)
            opt = cmlp.optim.Adam(model) if kind == "adam" else cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
            sched = cmlp.optim.lr_scheduler.StepLR(opt, 1)
            trainer = cmlp.Trainer(model, opt, batch_size=16, amp="fp16")
            trainer.fit(x, y, epochs=1, progress=False, scheduler=sched)
            opt.param_groups[0]["lr"] = 1e-4
            assert M.memory_allocated(DEV) > base
            del model, opt, sched, trainer
            assert M.memory_allocated(DEV) == base, kind
    finally:
        gc.enable()


def test_inactive_split_totals_take_each_operation_s_net_change_and_releases_count_syncs():
    """PyTorch's totals of inactive_split: a block split off a split block, or freed back into its
    free neighbour, changes the bytes by its own size, not by a free and an allocation of the whole
    remainder. 1000 bytes from a new 2 MiB small segment leave a split remainder (1 block,
    2 MiB - 1024 bytes); 5000 bytes from it shrink it by 5120; freeing them grows it back. Each
    release of the cache counts in num_sync_all_streams, as torch's does. (A process of its own:
    the cache starts empty.)"""
    code = ("import json, cmlp\n"
            "M = cmlp.memory\n"
            "a = M.caching_allocator_alloc(1000, 'cpu')\n"
            "c = M.caching_allocator_alloc(5000, 'cpu')\n"
            "M.caching_allocator_delete(c)\n"
            "s = M.memory_stats('cpu')\n"
            "M.caching_allocator_delete(a)\n"
            "M.empty_cache('cpu')\n"
            "M.empty_cache('cpu')\n"
            "print(json.dumps([s, M.memory_stats('cpu')['num_sync_all_streams']]))\n")
    s, syncs = json.loads(in_a_process_of_its_own(code))
    remainder = (2 << 20) - 1024
    split = {m: s[f"inactive_split_bytes.small_pool.{m}"] for m in METRICS}
    assert split == {"current": remainder, "peak": remainder, "allocated": remainder + 5120, "freed": 5120}
    count = {m: s[f"inactive_split.small_pool.{m}"] for m in METRICS}
    assert count == {"current": 1, "peak": 1, "allocated": 1, "freed": 0}
    assert s["num_sync_all_streams"] == 0 and syncs == 2


def test_python_out_of_memory_in_a_call_raises_and_loses_no_block():
    """Python's own allocations failing inside a call (one at a time, each in turn): a
    MemoryError, never a result with an error set behind it (SystemError), and no block of the
    allocator left that nothing could give back."""
    testcapi = pytest.importorskip("_testcapi")
    model = cmlp.MLP([8, 300, 4], seed=0)
    c = cmlp._cmlp
    calls = {"sizes": model._c.sizes, "snapshot": lambda: c.snapshot("cpu"),
             "snapshot_history": lambda: c.snapshot_history("cpu"), "get_settings": c.get_settings,
             "alloc": lambda: c.free("cpu", c.alloc("cpu", 100))}
    base = cmlp.memory.memory_allocated("cpu")
    for name, call in calls.items():
        for k in range(1, 25):
            gc.collect()
            testcapi.set_nomemory(k, k + 1)
            try:
                call()
            except MemoryError:
                pass
            except SystemError as e:
                pytest.fail(f"{name}, Python's allocation {k} failing: {e}")
            finally:
                testcapi.remove_mem_hooks()
        assert cmlp.memory.memory_allocated("cpu") == base, name
