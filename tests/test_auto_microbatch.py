"""Automatic micro-batching (Trainer(auto_microbatch=True)): an out-of-memory inside a step is
rolled back and the step retried with half the micro-batch, giving the update of the unsplit
step; without it the OOM reaches the caller and nothing changed. Driven on the CPU by a memory
limit and by the allocator's fault hook, from a clean allocator state so that every step
really asks the device for memory.
"""
import gc
import os
import sys
import warnings

import numpy as np
import pytest

import cmlp

sys.path.insert(0, os.path.dirname(__file__))
from checks import fill_cache_but, room_for, same, unplanned  # noqa: E402

M = cmlp.memory
DEV = "cpu"
MIB = 1 << 20
TOL = 1e-5  # norm-wise relative error per tensor

# A model whose step needs fresh device memory: its workspace and Adam state do not fit in the
# segment that holds the parameters and gradients. At this batch a whole step keeps part of its
# buffers in the first layer's weight gradient, and what it keeps outside (the input and the
# hidden layer's output) still takes a segment of its own; a micro-batch of a split step keeps
# them all outside.
WIDE = [784, 2048, 10]
WIDE_BATCH = 704


@pytest.fixture(autouse=True)
def clean_allocator():
    M.set_memory_limit(None, DEV)
    M._fail_raw_alloc(0, DEV)
    yield
    M.set_memory_limit(None, DEV)
    M._fail_raw_alloc(0, DEV)
    gc.collect()
    M._validate(DEV)


def data(layers, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, layers[0]), dtype=np.float32), rng.integers(0, layers[-1], n)


def rel_err(got, want):
    assert got.keys() == want.keys()
    return max(float(np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])) for k in want)


def state(trainer):
    """Copies of everything a failed step must leave alone."""
    scaler = trainer.scaler.state_dict() if trainer.scaler is not None else None
    return trainer.model.state_dict(), trainer.optimizer.state_dict(), scaler


def fresh(layers, batch, amp=None, **kw):
    """A new model, Adam and trainer on an allocator with nothing cached: the caller must have
    dropped its previous run, or its memory would be reused instead of allocated."""
    gc.collect()
    M.empty_cache(DEV)
    model = cmlp.MLP(layers, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, amp=amp, shuffle=False, **kw)
    gc.collect()
    M.empty_cache(DEV)
    return trainer


def raw_calls():
    return M.memory_stats(DEV)["num_raw_alloc_calls"]


# ---- a limit of half the planned peak ----

HALF_LAYERS, HALF_BATCH = [784, 512, 256, 10], 8192


def _half_run(limit=None, auto_microbatch=True, microbatch_size=None, second="step"):
    """Two steps from a clean allocator: fit on the first batch (so the weights after it can be
    seen), then trainer.step (or another fit) on the second; limit="half": the reserved
    baseline plus half the planned peak."""
    x, y = data(HALF_LAYERS, 2 * HALF_BATCH)
    gc.collect()
    M.empty_cache(DEV)
    M.reset_peak_memory_stats(DEV)  # fit leaves the statistics' peaks to the caller, as torch
    base = M.memory_reserved(DEV)
    model = cmlp.MLP(HALF_LAYERS, seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    plan = M.plan(HALF_LAYERS, HALF_BATCH, opt)
    trainer = cmlp.Trainer(model, opt, batch_size=HALF_BATCH, shuffle=False, auto_microbatch=auto_microbatch,
                           microbatch_size=microbatch_size)
    limit = base + plan.peak_bytes // 2 if limit == "half" else None
    if limit is not None:
        M.set_memory_limit(limit, DEV)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = trainer.fit(x[:HALF_BATCH], y[:HALF_BATCH], epochs=1, progress=False)
            first = model.state_dict()
            if second == "fit":
                history += trainer.fit(x[HALF_BATCH:], y[HALF_BATCH:], epochs=1, progress=False)
            else:
                trainer.step(x[HALF_BATCH:], y[HALF_BATCH:])
                history.append({"microbatch_size": trainer.microbatch_size, "peak_memory_bytes":
                                M.max_memory_allocated(DEV)})
        max_reserved = M.max_memory_reserved(DEV)
    finally:
        M.set_memory_limit(None, DEV)
    memory_warnings = [w for w in caught if issubclass(w.category, cmlp.MemoryWarning)]
    return {"first": first, "weights": model.state_dict(), "history": history, "warnings": memory_warnings,
            "limit": limit, "plan": plan, "max_reserved": max_reserved, "microbatch_size": trainer.microbatch_size}


@pytest.fixture(scope="module")
def half_limit():
    unlimited = _half_run()
    limited = _half_run("half")
    split = _half_run(microbatch_size=limited["history"][0]["microbatch_size"])
    return unlimited, limited, split


def test_half_the_planned_peak_gives_the_same_weights(half_limit):
    unlimited, limited, split = half_limit
    assert [h["microbatch_size"] for h in unlimited["history"]] == [HALF_BATCH] * 2
    assert unlimited["max_reserved"] > limited["limit"]  # the limit binds
    assert unlimited["warnings"] == []
    micro = limited["history"][0]["microbatch_size"]
    assert micro < HALF_BATCH and limited["history"][1]["microbatch_size"] == micro == limited["microbatch_size"]
    assert all(h["peak_memory_bytes"] <= limited["limit"] for h in limited["history"])
    assert limited["max_reserved"] <= limited["limit"]
    assert len(limited["warnings"]) == 1, [str(w.message) for w in limited["warnings"]]
    # the automatic run is exactly the micro-batched computation, which is the unsplit step
    # (test_accumulation checks that against a float64 reference) ...
    assert same(limited["first"], split["first"]) and same(limited["weights"], split["weights"])
    # ... up to summation order: the loss agrees. The weights are not compared with the unsplit
    # run's: with 8192 x 768 ReLU pre-activations a step can have one within rounding of zero
    # that changes side between the two orders (the GEMM kernels OpenBLAS picks for the CPU
    # decide which), changing one sample's gradient; Adam's first step turns that into
    # updates of up to 2 lr (measured: 6.6e-4 norm-wise on one machine, 0 on another).
    assert limited["history"][0]["loss"] == pytest.approx(unlimited["history"][0]["loss"], rel=1e-5)


def test_start_under_limit_warning_names_the_batch_it_replaced(half_limit):
    # the warning names the micro-batch it replaced, not the one it chose twice
    _, limited, _ = half_limit
    assert limited["warnings"], "no MemoryWarning"
    msg = str(limited["warnings"][0].message)
    micro = limited["history"][0]["microbatch_size"]
    assert f"micro-batches of {micro}" in msg, msg
    assert f"not {HALF_BATCH}" in msg, msg


def test_a_second_fit_under_the_same_limit_keeps_the_microbatch(half_limit):
    # the planned start must not count the workspace the model kept from the first fit twice
    # (`python -m cmlp train` calls fit(epochs=1) once per epoch)
    _, limited, _ = half_limit
    again = _half_run("half", second="fit")
    assert again["history"][0]["microbatch_size"] == limited["history"][0]["microbatch_size"]
    assert again["history"][1]["microbatch_size"] == again["history"][0]["microbatch_size"], again["history"]


def test_without_auto_microbatch_the_same_limit_raises():
    with pytest.raises(cmlp.OutOfMemoryError, match="out of memory"):
        _half_run("half", auto_microbatch=False)


# ---- the fault hook: one failed device allocation at every point of a step ----


@pytest.mark.parametrize("amp", [None, "fp16"])
def test_one_failed_device_allocation_is_absorbed_at_every_point(amp):
    """_fail_raw_alloc(k) fails the k-th device allocation once. The allocator's retry ladder
    (release the cache, ask again, as PyTorch's does) absorbs it, so the step completes with
    the unfailed result with or without auto_microbatch, and no OOM is counted."""
    x, y = data(WIDE, WIDE_BATCH)
    trainer = fresh(WIDE, WIDE_BATCH, amp)
    before = raw_calls()
    trainer.step(x, y)
    count = raw_calls() - before
    assert count >= 2  # the workspace and the optimizer state at least: the fresh state worked
    want = trainer.model.state_dict()
    for auto in (True, False):
        for k in range(1, count + 1):
            trainer = None
            trainer = fresh(WIDE, WIDE_BATCH, amp, auto_microbatch=auto)
            s0 = M.memory_stats(DEV)
            M._fail_raw_alloc(k, DEV)
            try:
                trainer.step(x, y)
            finally:
                M._fail_raw_alloc(0, DEV)
            s1 = M.memory_stats(DEV)
            where = f"auto_microbatch={auto}, k={k} of {count}"
            assert s1["num_raw_alloc_calls"] - s0["num_raw_alloc_calls"] == count + 1, where
            assert s1["num_alloc_retries"] - s0["num_alloc_retries"] == 1, where
            assert s1["num_ooms"] == s0["num_ooms"], where
            assert trainer.microbatch_size == WIDE_BATCH, where
            assert rel_err(trainer.model.state_dict(), want) <= TOL, where
            M._validate(DEV)


# ---- an OOM at every device allocation of a step, made by a memory limit ----


def _model_buffers(amp, nparams):
    """Bytes (as requested) a model keeps after a failed step besides its workspace: with amp,
    the half-precision weight copy, made on first use and kept for the next step. Requested,
    not allocated bytes: a cached block too big to split is handed out whole, so the allocated
    bytes of the same buffer depend on the cache."""
    if amp is None:
        return {0}
    return {0, 2 * nparams}


@pytest.mark.parametrize("amp", [None, "fp16"])
def test_an_oom_at_every_device_allocation_rolls_back_or_retries(amp):
    """The k-th device allocation of the step is refused (for every k) by a memory limit that
    lets the first k-1 through: the hook alone cannot do it (the retry ladder absorbs a single
    failure). Without auto_microbatch the step raises and nothing changed; with it the step
    either completes with the unsplit result or raises the one-sample OOM, nothing changed."""
    x, y = data(WIDE, WIDE_BATCH)
    trainer = fresh(WIDE, WIDE_BATCH, amp)
    r0, before = M.memory_reserved(DEV), raw_calls()
    want_loss = trainer.step(x, y)
    count, growth = raw_calls() - before, M.memory_reserved(DEV) - r0
    assert count >= 2 and growth % (2 * MIB) == 0
    nparams = trainer.model.num_parameters()

    def attempt(extra, auto):
        nonlocal trainer
        trainer = None
        trainer = fresh(WIDE, WIDE_BATCH, amp, auto_microbatch=auto)
        model = trainer.model
        model._c.release_workspace()
        s0, saved = M.memory_stats(DEV), state(trainer)
        M.set_memory_limit(s0["reserved_bytes.all.current"] + extra, DEV)
        loss = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", cmlp.MemoryWarning)
                loss = trainer.step(x, y)
            error = None
        except cmlp.OutOfMemoryError as e:
            error = str(e)
        finally:
            M.set_memory_limit(None, DEV)
        M._validate(DEV)
        position = M.memory_stats(DEV)["num_raw_alloc_calls"] - s0["num_raw_alloc_calls"] + 1
        model._c.release_workspace()
        s1 = M.memory_stats(DEV)
        kept = s1["requested_bytes.all.current"] - s0["requested_bytes.all.current"]
        if kept == 0:  # back at the baseline, to the byte
            assert s1["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
        return error, position, saved, kept, loss

    # without auto_microbatch: every limit below what the step needs
    positions = {}
    for extra in range(0, growth, 2 * MIB):
        error, position, saved, kept, _ = attempt(extra, False)
        where = f"limit +{extra >> 20} MiB, device allocation {position}"
        assert error is not None and "out of memory" in error, where
        assert same(state(trainer), saved), where
        assert kept in _model_buffers(amp, nparams), (where, kept)
        positions.setdefault(position, []).append(extra)
    assert sorted(positions) == list(range(1, count + 1)), positions

    # the same failure points with auto_microbatch: the least and the most room for each
    outcomes = []
    for extras in positions.values():
        for extra in sorted({extras[0], extras[-1]}):
            error, position, saved, kept, loss = attempt(extra, True)
            where = f"limit +{extra >> 20} MiB"
            if error is None:
                micro = trainer.microbatch_size
                assert micro < WIDE_BATCH, where
                # the step of the micro-batches it ended with, bit for bit (which is the unsplit
                # step up to summation order: test_accumulation), and the loss of the unsplit
                # step: a failed attempt's loss is taken back
                got, trainer = trainer.model.state_dict(), None
                assert same(got, _replay(WIDE, WIDE_BATCH, [(x, y)], [micro], amp=amp)), where
                assert loss == pytest.approx(want_loss, rel=1e-5), where
            else:
                assert "1 sample" in error, (where, error)
                assert same(state(trainer), saved), where
                assert kept in _model_buffers(amp, nparams), (where, kept)
            outcomes.append(error is None)
    assert any(outcomes), "no limit let the split step through"


def test_a_failed_step_holds_nothing_once_the_model_is_gone():
    x, y = data(WIDE, WIDE_BATCH)
    gc.collect()
    M.empty_cache(DEV)
    start = M.memory_allocated(DEV)
    trainer = fresh(WIDE, WIDE_BATCH, "fp16", auto_microbatch=False)
    taken = fill_cache_but(DEV, 0)
    M.set_memory_limit(M.memory_reserved(DEV), DEV)
    try:
        with pytest.raises(cmlp.OutOfMemoryError):
            trainer.step(x, y)
    finally:
        M.set_memory_limit(None, DEV)
        for ptr in taken:
            M.caching_allocator_delete(ptr)
    trainer = None
    gc.collect()
    assert M.memory_allocated(DEV) == start


# ---- even one sample does not fit ----


@pytest.mark.parametrize("how", ["step", "fit"])
def test_when_one_sample_does_not_fit_the_oom_says_so(how):
    x, y = data(WIDE, 64)
    trainer = fresh(WIDE, 64)
    saved = state(trainer)
    taken = fill_cache_but(DEV, 0)  # other tests' free blocks would hold the optimizer state
    M.set_memory_limit(M.memory_reserved(DEV) + 4096, DEV)  # the optimizer state cannot be made
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cmlp.MemoryWarning)
            with pytest.raises(cmlp.OutOfMemoryError) as info:
                if how == "step":
                    trainer.step(x, y)
                else:
                    trainer.fit(x, y, epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, DEV)
        for ptr in taken:
            M.caching_allocator_delete(ptr)
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    for needle in ("out of memory", "1 sample", "parameters", "gradients", "optimizer state", "activations",
                   "workspace"):
        assert needle in msg, (needle, msg)
    one = M.plan(WIDE, 1, trainer.optimizer)
    assert f"parameters {M._fmt(one.breakdown['parameters'])}" in msg, msg
    assert f"optimizer state {M._fmt(one.breakdown['optimizer_state'])}" in msg, msg
    assert same(state(trainer), saved)
    # nothing was taken: no epoch begun, and the micro-batch the trainer tried is not kept
    assert trainer.epochs == 0 and trainer.microbatch_size == 64


def test_a_fit_whose_first_step_runs_out_begins_no_epoch():
    # with nothing taken the state is as before the call: the epoch's order is drawn again, and
    # the retried fit equals a fit that never failed (shuffled, so a wrong epoch count shows)
    x, y = data([64, 1024, 1024, 3], 256)

    def build():
        model = cmlp.MLP([64, 1024, 1024, 3], seed=1)
        return model, cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.05), batch_size=64, auto_microbatch=False)

    model, trainer = build()
    trainer.fit(x, y, epochs=1, progress=False)
    want = model.state_dict()
    model = trainer = None
    model, trainer = build()
    gc.collect()
    M.empty_cache(DEV)
    M.set_memory_limit(M.memory_allocated(DEV) + 4096, DEV)
    try:
        with pytest.raises(cmlp.OutOfMemoryError):
            trainer.fit(x, y, epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, DEV)
    assert trainer.epochs == 0 and trainer.state_dict()["epochs"] == 0
    trainer.fit(x, y, epochs=1, progress=False)
    assert same(model.state_dict(), want)


# ---- the micro-batch grows back ----


def _replay(layers, batch, batches, used, **kw):
    """The same steps with the micro-batch of each set by hand and no limit: what the automatic
    run must equal bitwise (kw: the trainer's other arguments)."""
    trainer = fresh(layers, batch, microbatch_size=used[0], **kw)
    for (xb, yb), micro in zip(batches, used):
        trainer.microbatch_size = micro
        trainer.step(xb, yb)
    return trainer.model.state_dict()


def _short_of_a_step(xb, yb, **kw):
    """A new trainer (kw: its arguments) under a limit 2 MiB short of what a whole step of
    (xb, yb) reserves, its start not planned: its step runs out of memory inside. The caller
    lifts the limit."""
    trainer = fresh(WIDE, WIDE_BATCH)
    r0 = M.memory_reserved(DEV)
    trainer.step(xb, yb)
    growth = M.memory_reserved(DEV) - r0
    trainer = None
    trainer = fresh(WIDE, WIDE_BATCH, **kw)
    M.set_memory_limit(M.memory_reserved(DEV) + growth - 2 * MIB, DEV)
    unplanned(trainer, WIDE_BATCH)
    return trainer


def test_the_microbatch_grows_back_after_a_real_oom():
    x, y = data(WIDE, 6 * WIDE_BATCH)
    batches = [(x[i:i + WIDE_BATCH], y[i:i + WIDE_BATCH]) for i in range(0, len(x), WIDE_BATCH)]
    trainer = _short_of_a_step(*batches[0], grow_interval=2)
    try:
        with pytest.warns(cmlp.MemoryWarning, match="out of memory inside a training step"):
            trainer.step(*batches[0])  # a real OOM, then halving
    finally:
        M.set_memory_limit(None, DEV)
    used = [trainer.microbatch_size]
    assert used[0] < WIDE_BATCH
    with warnings.catch_warnings():
        warnings.simplefilter("error", cmlp.MemoryWarning)  # said once per trainer
        for xb, yb in batches[1:]:
            used.append(trainer.microbatch_size)
            trainer.step(xb, yb)
    assert used == sorted(used) and trainer.microbatch_size == WIDE_BATCH, used
    got = trainer.model.state_dict()
    trainer = None
    assert same(got, _replay(WIDE, WIDE_BATCH, batches, used))


def test_the_split_warning_names_the_size_that_ran_not_the_growth_to_try():
    """With grow_interval=1 the step that halved also reaches its wait: microbatch_size is the
    growth the next step tries, the warning (as the history) says the size the step ran at."""
    x, y = data(WIDE, WIDE_BATCH)
    trainer = _short_of_a_step(x, y, grow_interval=1)
    try:
        with pytest.warns(cmlp.MemoryWarning, match="out of memory inside a training step") as caught:
            trainer.step(x, y)
    finally:
        M.set_memory_limit(None, DEV)
    ran = trainer._c.last_microbatch()
    assert ran < WIDE_BATCH == trainer.microbatch_size, (ran, trainer.microbatch_size)
    assert f"micro-batches of {ran} " in str(caught[0].message), str(caught[0].message)


def test_the_planned_start_counts_the_segments_of_other_allocations():
    """Under a limit, a segment of the user's (or another model's) lies beside the run's: the
    step's new segments come on top of it. The planner's micro-batch trains without an
    out-of-memory, and its one warning names the size that ran (before, the plan took 2048
    rows where its segments did not fit, the step ran out of memory, fell to 1024, and the
    warning named 2048)."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (8192, 784)).astype(np.uint8), rng.integers(0, 10, 8192)
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=4096, shuffle=False)
    block = None
    try:
        M.set_memory_limit(100 << 20, DEV)
        trainer.fit(x[:4096], y[:4096], epochs=1, progress=False)
        M.empty_cache(DEV)
        block = M.caching_allocator_alloc(64 << 20, DEV)  # a segment of its own, most of the limit
        ooms = M.memory_stats(DEV)["num_ooms"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = trainer.fit(x[4096:], y[4096:], epochs=1, progress=False)
    finally:
        if block is not None:
            M.caching_allocator_delete(block)
        M.set_memory_limit(None, DEV)
    said = [str(w.message) for w in caught if issubclass(w.category, cmlp.MemoryWarning)]
    micro = history[0]["microbatch_size"]
    assert M.memory_stats(DEV)["num_ooms"] == ooms and micro < 4096, (micro, said)
    assert len(said) == 1 and f"fits micro-batches of {micro}, not 4096" in said[0], said


_BESIDE = r"""
import json, sys, warnings
import numpy as np
import cmlp
M = cmlp.memory
case, micro = sys.argv[1], int(sys.argv[2])  # micro 0: the planner's
rng = np.random.default_rng(0)
kept = []
if case == "another model":  # its parameters and gradients in segments of their own, its cache emptied
    other = cmlp.MLP([2000, 2000, 10], seed=1)
    cmlp.Trainer(other, cmlp.optim.SGD(other, lr=1e-2), batch_size=256).fit(
        rng.standard_normal((256, 2000)).astype(np.float32), rng.integers(0, 10, 256), epochs=1, progress=False)
    M.empty_cache("cpu")
    kept.append(other)
    layers, batch, optim, room = [100, 64, 64, 10], 8192, "adam", 4 << 20
elif case == "a step of 1-10 MiB takes a 20 MiB segment":  # what fits is not monotonic in the size
    layers, batch, optim, room = [256, 1024, 1024, 10], 4096, "sgd", 12 << 20
elif case == "the small pool full":  # 1.5 MiB free in a large segment, no room for a new small one
    kept += [M.caching_allocator_alloc(1 << 20, "cpu") for _ in range(2)]
    layers, batch, optim, room = [512, 512, 512], 1000, "sgd", 1 << 20
else:  # a user's 5 MiB block first: the model's parameters and gradients share its segment
    if case == "a user's block, expandable segments":
        M.configure("expandable_segments:True")
    kept.append(M.caching_allocator_alloc(5 << 20, "cpu"))
    layers, batch, optim, room = {"a user's block, Adam": ([784, 1024, 10], 1024, "adam", 2 << 20),
                                  "a user's block, SGD": ([200, 512, 10], 2048, "sgd", 1 << 20),
                                  "a user's block, expandable segments": ([784, 1024, 10], 4096, "adam", 10 << 20)}[case]
model = cmlp.MLP(layers, seed=0)
opt = cmlp.optim.Adam(model) if optim == "adam" else cmlp.optim.SGD(model, lr=1e-2, momentum=0.9)
if case == "the small pool full":  # room in the model's segment for the momentum and 1.5 MiB more
    free = max(b["size"] for s in M.memory_snapshot("cpu") for b in s["blocks"] if b["state"] == "inactive")
    kept.append(M.caching_allocator_alloc(free - 4 * model.num_parameters() - (3 << 19), "cpu"))
x, y = rng.standard_normal((batch, layers[0])).astype(np.float32), rng.integers(0, layers[-1], batch)
M.set_memory_limit(M.memory_reserved("cpu") + room, "cpu")
# a micro-batch of its own: steps of that many micro-batches, as the trainer would accumulate them
trainer = (cmlp.Trainer(model, opt, batch_size=micro, accumulation_steps=-(-batch // micro), auto_microbatch=False)
           if micro else cmlp.Trainer(model, opt, batch_size=batch))
out = {"batch": batch}
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["micro"] = trainer.fit(x, y, epochs=1, progress=False)[0]["microbatch_size"]
    out["said"] = [str(w.message) for w in caught]
except cmlp.OutOfMemoryError:
    out["micro"] = None
out["ooms"] = M.memory_stats("cpu")["num_ooms"]
print(json.dumps(out))
"""


def _beside(case, micro):
    import json
    import subprocess
    r = subprocess.run([sys.executable, "-c", _BESIDE, case, str(micro)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="", CMLP_ALLOC_CONF=""))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", ["another model", "a user's block, Adam", "a user's block, SGD",
                                  "a user's block, expandable segments", "a step of 1-10 MiB takes a 20 MiB segment",
                                  "the small pool full"])
def test_the_planned_start_is_the_largest_micro_batch_that_fits_beside_other_allocations(case):
    """Under a limit, beside another model's segments or a user's block (which may share a
    segment with the model): the planner's micro-batch trains without an out-of-memory, and every
    larger one it could have taken (fewer equal micro-batches of the step) runs out of memory.
    The planner tries the run's requests on a copy of the allocator. Before, it told the run's
    segments from others by what their blocks held and counted its own from an empty cache:
    beside another model it planned 4096, ran out of memory three times and ended at 512 (now
    820); beside a user's block with Adam, 342, one out-of-memory, 171 (now 205); with SGD, 158
    where 2048 trains. Whether a size fits is not monotonic in it (a step's buffers of 1 to 10
    MiB take a 20 MiB segment where 11 MiB take 12; those of at most 1 MiB a new small segment
    where a larger one fits a cached block): every size is tried from the largest down. Before,
    the search halved and stopped: 373 where 820 trains, and "fits no micro-batch" where 167
    trains. Each case in a process of its own: the cache as it starts."""
    run = _beside(case, 0)
    micro, batch = run["micro"], run["batch"]
    assert run["ooms"] == 0 and micro, run
    if case == "a user's block, SGD":
        assert micro == batch and not run["said"], run  # it fits whole
        return
    assert micro < batch and len(run["said"]) == 1 and f"micro-batches of {micro}," in run["said"][0], run
    for k in range(1, -(-batch // micro)):  # each larger one, of fewer micro-batches: an out-of-memory
        larger = -(-batch // k)
        assert _beside(case, larger)["micro"] is None, (micro, larger)


_WIDE_STEP = r"""
import numpy as np
import cmlp
M = cmlp.memory
rng = np.random.default_rng(0)
x, y = rng.standard_normal((4096, 256)).astype(np.float32), rng.integers(0, 10, 4096)
model = cmlp.MLP([256, 1024, 1024, 10], seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01, momentum=0.9), batch_size=4096)
"""

_SECOND_FIT = _WIDE_STEP + r"""M.set_memory_limit(M.memory_reserved("cpu") + (12 << 20), "cpu")
first = trainer.fit(x, y, epochs=1, progress=False)[0]["microbatch_size"]
M.set_memory_limit(M.memory_reserved("cpu") + (1 << 30), "cpu")
ooms = M.memory_stats("cpu")["num_ooms"]
second = trainer.fit(x, y, epochs=1, progress=False)[0]["microbatch_size"]
print(first, second, trainer.microbatch_size, M.memory_stats("cpu")["num_ooms"] - ooms)
"""


def test_a_later_fit_with_more_room_starts_from_the_micro_batch_asked_for():
    """The planned start tries from the micro-batch asked for, not the one an earlier fit under a
    tighter limit ended with: after the limit rises, the next fit trains whole (before, it kept
    the smaller micro-batch). In a process of its own: the cache as it starts."""
    import subprocess
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _SECOND_FIT], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="", CMLP_ALLOC_CONF=""))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    first, second, now, ooms = map(int, r.stdout.split())
    assert first < 4096 and (second, now, ooms) == (4096, 4096, 0), r.stdout


_LIMIT_REMOVED = _WIDE_STEP + r"""out = []
for call in ("fit", "step"):
    M.empty_cache("cpu")
    M.set_memory_limit(M.memory_reserved("cpu") + (12 << 20), "cpu")
    run = (lambda: trainer.fit(x, y, epochs=1, progress=False)) if call == "fit" else (lambda: trainer.step(x, y))
    run()
    cut = trainer.microbatch_size
    M.set_memory_limit(None, "cpu")
    ooms = M.memory_stats("cpu")["num_ooms"]
    run()
    out += [cut, trainer._c.last_microbatch(), M.memory_stats("cpu")["num_ooms"] - ooms]
print(*out)
"""


def test_a_fit_or_step_after_the_limit_is_removed_computes_the_micro_batch_asked_for():
    """A micro-batch the planner cut for a limit is the one asked for again once the limit is gone
    (before, it waited grow_interval good steps to grow back, one halving at a time)."""
    import subprocess
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _LIMIT_REMOVED], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="", CMLP_ALLOC_CONF=""))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    fit_cut, fit_ran, fit_ooms, step_cut, step_ran, step_ooms = map(int, r.stdout.split())
    assert fit_cut < 4096 and step_cut < 4096, r.stdout
    assert (fit_ran, fit_ooms, step_ran, step_ooms) == (4096, 0, 4096, 0), r.stdout


_BELOW_RESERVED = r"""
import warnings
import numpy as np
import cmlp
M = cmlp.memory
rng = np.random.default_rng(0)
x, y = rng.standard_normal((2048, 200)).astype(np.float32), rng.integers(0, 10, 2048)
model = cmlp.MLP([200, 512, 10], seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=1e-2, momentum=0.9), batch_size=2048)
M.configure("max_split_size_mb:20")
trainer.fit(x, y, epochs=1, progress=False)  # the cache keeps the step's 20 MiB segment
M.set_memory_limit(M.memory_allocated("cpu") + (1 << 20), "cpu")
print("below:", M.memory_reserved("cpu") > M.get_memory_limit("cpu"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = trainer.fit(x, y, epochs=1, progress=False)
print("ooms:", M.memory_stats("cpu")["num_ooms"], history[0]["microbatch_size"] < 2048)
print("said:", [str(w.message) for w in caught])
"""


def test_a_limit_below_what_is_reserved_plans_with_the_blocks_the_cache_holds():
    """A limit under what the cache reserves: no new segment can be made, and a free segment of
    the other pool (here an oversize one, with max_split_size_mb) serves none of the step's
    requests. The planner's micro-batch fits what is there, and trains without an out-of-memory
    (before, it was compared with the reserved bytes: 205 rows, then an OOM and 103). In a
    process of its own: the cache as it starts."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _BELOW_RESERVED], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="", CMLP_ALLOC_CONF=""))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "below: True" and lines[1] == "ooms: 0 True", r.stdout
    assert "the planner fits micro-batches of" in lines[2], r.stdout


def test_a_smaller_micro_batch_than_the_one_announced_is_announced_again():
    """One MemoryWarning for each size the steps fall to: where a step runs out of memory at
    the micro-batch the planner's warning named, the split warning names the smaller one."""
    x, y = data(WIDE, WIDE_BATCH)
    trainer = _short_of_a_step(x, y)
    trainer._warned = WIDE_BATCH  # as if the planner had named the whole batch
    try:
        with pytest.warns(cmlp.MemoryWarning, match="out of memory inside a training step") as caught:
            trainer.step(x, y)
        ran = trainer._c.last_microbatch()
        with warnings.catch_warnings():
            warnings.simplefilter("error", cmlp.MemoryWarning)  # the same size: said already
            trainer.step(x, y)
    finally:
        M.set_memory_limit(None, DEV)
    assert f"micro-batches of {ran} " in str(caught[0].message) and trainer._warned == ran


@pytest.mark.filterwarnings("error::cmlp.MemoryWarning")
def test_the_batch_max_batch_size_gives_starts_whole_under_that_budget():
    """The planned start counts what is allocated now as the allocator holds it (its blocks
    rounded, the device scalars after the gradients): the batch max_batch_size finds for a budget
    starts whole under that limit, as it does with auto_microbatch=False (counted twice, the
    rounding made it start at half)."""
    layers = [1479, 749, 1215, 835]
    budget = M.plan(layers, 4096, "sgd").reserved_bytes
    n = M.max_batch_size(layers, budget, "sgd")
    x, y = np.zeros((n, layers[0]), np.float32), np.zeros(n, np.int64)
    gc.collect()
    M.empty_cache(DEV)
    ooms = M.memory_stats(DEV)["num_ooms"]
    M.set_memory_limit(budget, DEV)
    try:
        model = cmlp.MLP(layers, seed=0)
        trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01), batch_size=n)
        history = trainer.fit(x, y, epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, DEV)
    assert history[0]["microbatch_size"] == n and M.memory_stats(DEV)["num_ooms"] == ooms


def test_the_microbatch_a_planned_start_cut_is_whole_again_once_the_limit_goes():
    layers, batch = [784, 512, 256, 10], 2048
    x, y = data(layers, 9 * batch)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    trainer = fresh(layers, batch, grow_interval=2)
    plan = M.plan(layers, batch // 8, trainer.optimizer, accumulation_steps=8)
    # the model's segment has room past it, which serves larger micro-batches under a limit below
    # it: all but what micro-batches of batch // 8 ask is taken, so that the start is theirs
    filler = fill_cache_but(DEV, room_for(plan, ("optimizer_state", "step")))
    held = plan.breakdown["parameters"] + plan.breakdown["gradients"]
    # room for micro-batches of batch // 8 next to the model, as the planner counts it
    M.set_memory_limit(M.memory_allocated(DEV) + plan.peak_bytes - held, DEV)
    try:
        with pytest.warns(cmlp.MemoryWarning, match="the planner fits"):
            first = trainer.fit(*batches[0], epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, DEV)
        for ptr in filler:
            M.caching_allocator_delete(ptr)
    assert first[0]["microbatch_size"] == batch // 8
    used = [batch // 8]
    for xb, yb in batches[1:]:
        trainer.step(xb, yb)
        used.append(trainer._c.last_microbatch())  # the size the step ran with
    # the limit gone, the micro-batch it cut is the one asked for again (growth is for an
    # out-of-memory's: test_the_microbatch_grows_back_after_a_real_oom)
    assert used == [256] + [2048] * 8, used
    assert trainer.microbatch_size == batch
    rest = trainer.fit(x[:batch], y[:batch], epochs=1, progress=False)
    assert rest[0]["microbatch_size"] == batch
    got = trainer.model.state_dict()
    trainer = None
    want = _replay(layers, batch, batches + [batches[0]], used + [batch])
    assert same(got, want)


def test_a_growth_that_runs_out_of_memory_goes_back_to_the_size_that_worked():
    """Under a limit that fits a step of 8000 in 3 micro-batches of 2667 and not in 2 of 4000: the
    planned start is 2667 (the fewest equal micro-batches, not halving's 2000); after
    grow_interval good steps the trainer tries half as many (2 of 4000, not 5334 + 2666), runs
    out of memory and goes back to 2667, which worked (not 4000 / 2), and tries again after
    twice as many good steps (each failed try is an out-of-memory, a rollback and the cache
    emptied); a growth that works makes the next wait grow_interval again. The updates are
    those of the micro-batches set by hand."""
    layers, batch = [784, 512, 256, 10], 8000
    x, y = data(layers, 4 * batch)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    steps = [batches[i % 4] for i in range(8)]
    trainer = fresh(layers, batch, grow_interval=2)
    # reserved memory decides here (42 MiB from an empty cache for 3 of 2667, 52 for 2 of 4000)
    fits = M.plan(layers, 2667, trainer.optimizer, accumulation_steps=3).reserved_bytes
    more = M.plan(layers, 4000, trainer.optimizer, accumulation_steps=2).reserved_bytes
    assert fits < more and M.memory_reserved(DEV) < fits
    M.set_memory_limit((fits + more) // 2, DEV)
    used, waits = [], []
    try:
        with pytest.warns(cmlp.MemoryWarning, match="fits micro-batches of 2667, not 8000"):
            first = trainer.fit(*steps[0], epochs=1, progress=False)
        assert first[0]["microbatch_size"] == 2667
        retries = trainer._c.oom_retries()
        for xb, yb in steps[1:6]:
            used.append(trainer.microbatch_size)  # the size the step starts with
            trainer.step(xb, yb)
            waits.append(trainer.state_dict()["microbatch_grow_wait"])
        # steps 2 to 6: 2667 (the second good step: grows), 4000 (out of memory: 2667 again, and
        # the next growth waits 4 good steps), 2667, 2667, 2667 (the fourth: grows)
        assert used == [2667, 4000, 2667, 2667, 2667] and trainer._c.oom_retries() == retries + 1, used
        assert waits == [2, 4, 4, 4, 4], waits
        assert trainer.microbatch_size == 4000
    finally:
        M.set_memory_limit(None, DEV)
    got = trainer.model.state_dict()
    checkpoint = (got, trainer.optimizer.state_dict(), trainer.state_dict())
    assert checkpoint[2]["microbatch_grown_from"] == 2667 and checkpoint[2]["microbatch_good_steps"] == 0
    trainer = None
    assert same(got, _replay(layers, batch, steps[:6], [2667] * 6))

    # a run resumed from the checkpoint goes back to 2667 too when 4000 runs out (not 4000 / 2),
    # and waits twice as long again
    trainer = fresh(layers, batch, grow_interval=2)
    trainer.model.load_state_dict(checkpoint[0])
    trainer.optimizer.load_state_dict(checkpoint[1])
    trainer.load_state_dict(checkpoint[2])
    M.set_memory_limit((fits + more) // 2, DEV)
    unplanned(trainer, batch)
    try:
        with pytest.warns(cmlp.MemoryWarning, match="micro-batches of 2667"):
            trainer.step(*steps[6])
        assert trainer.microbatch_size == 2667 and trainer._c.oom_retries() == 1
        assert trainer.state_dict()["microbatch_grow_wait"] == 8
        trainer.step(*steps[7])  # a good step: 2 of the 8 the next growth waits for
        assert trainer.state_dict()["microbatch_good_steps"] == 2
        # a size that had worked runs out of memory (its workspace given back, as a fit's
        # evaluation does, under a lower limit): twice as many micro-batches, and the next
        # growth waits grow_interval good steps again
        fewer = M.plan(layers, 1334, trainer.optimizer, accumulation_steps=6).reserved_bytes
        assert fewer < fits
        trainer.model._c.release_workspace()
        M.empty_cache(DEV)
        M.set_memory_limit((fewer + fits) // 2, DEV)
        unplanned(trainer, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cmlp.MemoryWarning)
            trainer.step(*steps[0])
        assert trainer.microbatch_size == 1334 and trainer._c.oom_retries() == 2
        assert trainer.state_dict()["microbatch_grow_wait"] == 2
    finally:
        M.set_memory_limit(None, DEV)
    got = trainer.model.state_dict()
    trainer = None
    assert same(got, _replay(layers, batch, steps + steps[:1], [2667] * 8 + [1334]))

    # from the same checkpoint with no limit: the micro-batch the limit's plan cut to, which the
    # checkpoint carries, gives way to the one asked for, as the uninterrupted trainer's would;
    # without it (an earlier cmlp's checkpoint) the growth works, and the next waits grow_interval
    assert checkpoint[2]["microbatch_limit_cut"] == 2667
    for state in (checkpoint[2], {k: v for k, v in checkpoint[2].items() if k != "microbatch_limit_cut"}):
        trainer = fresh(layers, batch, grow_interval=2)
        trainer.model.load_state_dict(checkpoint[0])
        trainer.optimizer.load_state_dict(checkpoint[1])
        trainer.load_state_dict(state)
        trainer.step(*steps[6])
        after = trainer.state_dict()
        assert trainer._c.oom_retries() == 0
        if "microbatch_limit_cut" in state:
            assert after["microbatch_size"] == after["microbatch_target"] == batch, after
        else:
            assert after["microbatch_size"] == 4000, after
            assert after["microbatch_good_steps"] == 1 and after["microbatch_grow_wait"] == 2


def test_a_step_under_a_limit_starts_from_the_planners_micro_batch_as_fit_does():
    """Trainer.step under a memory limit ran out of memory first and halved (4 of 2000 for a step
    of 8000), where fit starts from the planner's 3 of 2667; it now starts there too, once for
    each limit and batch size (later steps grow back from there), and says so where it is
    called. A fit whose last step made the micro-batch grow reports the size its steps ran
    with, not the one the next step will try."""
    layers, batch = [784, 512, 256, 10], 8000
    x, y = data(layers, 2 * batch + 123)  # a short last step runs one micro-batch of its 123 rows
    trainer = fresh(layers, batch, grow_interval=2)
    fits = M.plan(layers, 2667, trainer.optimizer, accumulation_steps=3).reserved_bytes
    more = M.plan(layers, 4000, trainer.optimizer, accumulation_steps=2).reserved_bytes
    M.set_memory_limit((fits + more) // 2, DEV)
    ooms = M.memory_stats(DEV)["num_ooms"]
    try:
        with pytest.warns(cmlp.MemoryWarning, match="the planner fits micro-batches of 2667, not 8000") as said:
            trainer.step(x[:batch], y[:batch])
        assert [w.filename for w in said] == [__file__]
        assert trainer.microbatch_size == 2667 and trainer._c.oom_retries() == 0
        assert M.memory_stats(DEV)["num_ooms"] == ooms
        got = trainer.model.state_dict()
        trainer = None
        assert same(got, _replay(layers, batch, [(x[:batch], y[:batch])], [2667]))

        trainer = fresh(layers, batch, grow_interval=2)
        with pytest.warns(cmlp.MemoryWarning, match="fits micro-batches of 2667"):
            history = trainer.fit(x, y, epochs=1, progress=False)
        # the second good step made it grow: the next step tries 4000, the epoch's ran at 2667
        assert history[0]["microbatch_size"] == 2667 and trainer.microbatch_size == 4000
        assert M.memory_stats(DEV)["num_ooms"] == ooms
    finally:
        M.set_memory_limit(None, DEV)


def test_an_oom_makes_twice_as_many_equal_micro_batches():
    """Out of memory in micro-batches of 2667 (3 of a step of 8000): the retry runs 6 of 1334,
    not 7 of 1333 (the last of 2 rows), and the update is that of the micro-batches set by
    hand."""
    layers, batch = [784, 512, 256, 10], 8000
    x, y = data(layers, batch)
    trainer = fresh(layers, batch)
    trainer._c.start_microbatch(2667)
    fits = M.plan(layers, 1334, trainer.optimizer, accumulation_steps=6).reserved_bytes  # 20 MiB
    more = M.plan(layers, 2667, trainer.optimizer, accumulation_steps=3).reserved_bytes  # 42 MiB
    assert fits < more  # from an empty cache, the model's segment among them
    M.set_memory_limit((fits + more) // 2, DEV)
    unplanned(trainer, batch)
    try:
        with pytest.warns(cmlp.MemoryWarning, match="micro-batches of 1334"):
            trainer.step(x, y)
    finally:
        M.set_memory_limit(None, DEV)
    assert trainer.microbatch_size == 1334 and trainer._c.oom_retries() == 1
    got = trainer.model.state_dict()
    trainer = None
    assert same(got, _replay(layers, batch, [(x, y)], [1334]))


def test_growth_on_a_short_last_step_is_sized_for_a_whole_step():
    """The good steps that make the micro-batch grow can end on an epoch's short last step: the
    growth is still sized for a whole step (8000 in 4 of 2000 grow to 2 of 4000), not for the
    short step's 2500 rows (which would give 2500, still 4 micro-batches of a whole step)."""
    for rows in (8000 + 2500, 2 * 8000):  # the second good step is the short one, or a whole one
        x, y = data([784, 16, 10], rows)
        model = cmlp.MLP([784, 16, 10], seed=0)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=8000, grow_interval=2, shuffle=False)
        trainer._c.start_microbatch(2000)
        trainer.fit(x, y, epochs=1, progress=False)
        assert trainer.microbatch_size == 4000, rows


# ---- recompute ----


def test_recompute_with_auto_microbatch():
    # recomputation composes with automatic micro-batching
    x, y = data(WIDE, WIDE_BATCH)
    trainer = fresh(WIDE, WIDE_BATCH, recompute=True)
    r0 = M.memory_reserved(DEV)
    trainer.step(x, y)
    growth = M.memory_reserved(DEV) - r0
    trainer = None
    trainer = fresh(WIDE, WIDE_BATCH, recompute=True)
    M.set_memory_limit(M.memory_reserved(DEV) + growth - 2 * MIB, DEV)
    try:
        with pytest.warns(cmlp.MemoryWarning):
            trainer.step(x, y)
    finally:
        M.set_memory_limit(None, DEV)
    micro = trainer.microbatch_size
    assert micro < WIDE_BATCH
    got, trainer = trainer.model.state_dict(), None
    assert same(got, _replay(WIDE, WIDE_BATCH, [(x, y)], [micro], recompute=True))


def _limit_run(epochs, validation):
    gc.collect()
    M.empty_cache("cpu")  # what other tests left cached counts under the limit too
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1100, 200)).astype(np.float32)
    y = rng.integers(0, 10, 1100)
    model = cmlp.MLP([200, 1024, 1024, 10], seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=300, accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hist = trainer.fit(x, y, epochs=epochs, progress=False, validation_data=(x[:500], y[:500]) if validation else None)
    return model, trainer, hist, (x[:500], y[:500])


def test_validation_survives_the_limit_that_training_survives():
    # 1000-row evaluation buffers do not fit under a limit that micro-batching trains under: the
    # validation halves its chunk and starts again, and gives what an evaluation without a limit does
    M.set_memory_limit(34 * 2**20, "cpu")
    try:
        model, trainer, hist, (vx, vy) = _limit_run(2, True)
    finally:
        M.set_memory_limit(None, "cpu")
    assert len(hist) == 2 and trainer.microbatch_size < 300
    assert trainer._eval_rows < 1000
    assert all(h["peak_memory_bytes"] <= 34 * 2**20 for h in hist)
    free = model.evaluate(vx, vy)
    assert hist[-1]["val_loss"] == pytest.approx(free["loss"], rel=1e-6)
    assert hist[-1]["val_accuracy"] == free["accuracy"]


def test_a_small_validation_set_fits_where_no_small_segment_can_be_made():
    """Under the README's 20 MB limit, batch 1500 trains in one micro-batch; a validation set of 100
    or 7 rows has buffers under 1 MiB, whose pool has no segment and may make none under the limit,
    and fewer rows would not help: they take a piece of the free block in the large pool that the
    step's buffers went back to (each epoch's history kept, no out-of-memory error). The planner
    says so too (it said 0: the small pool's new segment, 22 MiB reserved)."""
    rng = np.random.default_rng(0)
    xu, y = rng.integers(0, 256, (3000, 784), dtype=np.uint8), rng.integers(0, 10, 3000)
    gc.collect()
    M.empty_cache(DEV)
    for rows in (0, 100, 7):
        assert M.max_batch_size([784, 512, 256, 10], "20MB", validation_rows=rows) == 1500, rows
    assert M.plan([784, 512, 256, 10], 1500, validation_rows=100).reserved_bytes == 22 * 2**20  # without a limit
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=1500)
    M.set_memory_limit(20 * 2**20, DEV)
    try:
        ooms = M.memory_stats(DEV)["num_ooms"]
        for rows in (100, 7):
            hist = trainer.fit(xu, y, epochs=1, validation_data=(xu[:rows], y[:rows]), progress=False)
            assert hist[0]["val_accuracy"] is not None
        got = model.evaluate(xu[:50], y[:50])
        assert M.memory_stats(DEV)["num_ooms"] == ooms and M.memory_reserved(DEV) <= 20 * 2**20
    finally:
        M.set_memory_limit(None, DEV)
    assert got == model.evaluate(xu[:50], y[:50])  # as without a limit


def test_a_validation_chunk_that_runs_out_of_memory_halves():
    """A chunk too big for the limit halves and the evaluation starts again; the smaller chunk is
    kept for the next epochs."""
    x, y = data([200, 256, 10], 2000)
    model = cmlp.MLP([200, 256, 10], seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64)
    trainer.fit(x[:64], y[:64], epochs=1, progress=False)
    want = model.evaluate(x, y, batch_size=7)
    gc.collect()
    M.empty_cache("cpu")
    M.set_memory_limit(M.memory_reserved("cpu") + 2 * 2**20, "cpu")  # a small segment, not their 3 MB
    try:
        loss_sum, correct = trainer._evaluate_rows(*trainer._data(x, y, "validation"))
    finally:
        M.set_memory_limit(None, "cpu")
    assert trainer._eval_rows < 1000
    assert loss_sum / 2000 == pytest.approx(want["loss"], rel=1e-6) and correct / 2000 == want["accuracy"]


def test_forward_and_evaluate_halve_their_chunk_under_a_limit_as_validation_does():
    """model(x), predict and evaluate run out of memory under a limit at their first chunk (1024
    rows; evaluate's batch_size), then halve it and start again: the same logits and the same loss
    and accuracy, and the buffers go back to the cache."""
    x, y = data([200, 256, 10], 2000)
    model = cmlp.MLP([200, 8192, 10], seed=0)  # 7 MB of parameters in a 20 MB segment
    want_logits, want = model(x), model.evaluate(x, y)
    gc.collect()
    M.empty_cache("cpu")
    held = M.memory_allocated("cpu")
    M.set_memory_limit(M.memory_reserved("cpu"), "cpu")  # 13 MB free: 1000 rows' hidden units are 32 MB
    try:
        with pytest.raises(cmlp.OutOfMemoryError):
            model._c.forward(x, *model.normalize, 1024)
        model._c.release_workspace()
        logits = model(x)  # the BLAS may sum in another order for fewer rows: float32's rounding apart
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
        assert np.array_equal(model.predict(x), logits.argmax(1))
        got = model.evaluate(x, y)
        assert M.memory_allocated("cpu") == held
    finally:
        M.set_memory_limit(None, "cpu")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["accuracy"] == want["accuracy"]


def test_the_one_sample_plan_counts_the_momentum_buffer_to_come():
    sizes = [200, 1024, 1024, 10]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((512, 200)).astype(np.float32), rng.integers(0, 10, 512)
    gc.collect()
    M.empty_cache("cpu")  # from an empty cache, as the plan is made: segments cached earlier could fit
    model = cmlp.MLP(sizes, seed=0)
    opt = cmlp.optim.SGD(model, lr=0.05, momentum=0.9)
    M.set_memory_limit(36 * 2**20, "cpu")
    try:
        with pytest.raises(cmlp.OutOfMemoryError, match="micro-batch of 1 sample") as e, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the planner's MemoryWarning: micro-batches of 1
            cmlp.Trainer(model, opt, batch_size=256, amp="bf16").fit(x, y, epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, "cpu")
    p = M.plan(sizes, 1, opt, "bf16")
    assert "optimizer state 4.83 MiB" in str(e.value) and p.breakdown["optimizer_state"] == 4 * model.num_parameters()
    assert f"{p.reserved_bytes / 2**20:.2f} MiB reserved" in str(e.value)


def test_a_limit_the_bytes_fit_under_but_not_the_segments_says_so():
    """8.3 MiB allocated at batch 32, but a 20 MiB segment for the requests from 1 to 10 MiB and a
    2 MiB one for those up to 1 MiB: 22 MiB reserved, which a micro-batch of 1 needs too. The
    warning says so, at the caller's line, and names expandable segments, under which it fits."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (64, 784), dtype=np.uint8), rng.integers(0, 10, 64)
    gc.collect()
    M.empty_cache("cpu")
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    M.set_memory_limit(20 * 2**20, "cpu")
    try:
        with pytest.warns(M.MemoryWarning, match=r"would take 4.10 MiB of the 15.91 MiB left, but memory is reserved "
                                                 r"in whole segments.*expandable_segments:True.*reserve 22.00 MiB") as w, \
                pytest.raises(cmlp.OutOfMemoryError, match="even with a micro-batch of 1") as e:
            cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=32).fit(x, y, epochs=1, progress=False)
        assert w[0].filename == __file__
        message = str(e.value)
        del e  # (its traceback holds the trainer's frames, and so its memory)
        # the last failure as a user reads it: no source file and line of the C core's
        assert "The last failure: cpu out of memory" in message and ".c:" not in message, message
        model = None
        M.configure("expandable_segments:True")
        gc.collect()
        M.empty_cache("cpu")
        model = cmlp.MLP([784, 512, 256, 10], seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", M.MemoryWarning)
            history = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=32).fit(x, y, epochs=1, progress=False)
        assert history[0]["microbatch_size"] == 32 and M.memory_reserved("cpu") <= 20 * 2**20
        # under expandable segments, one that the pages do not fit under says pages, and offers nothing on
        model = history = None
        gc.collect()
        M.empty_cache("cpu")
        M.set_memory_limit(M.memory_reserved("cpu") + 13 * 2**20, "cpu")
        model = cmlp.MLP([784, 1000, 7, 10], seed=0)
        with pytest.warns(M.MemoryWarning, match=r"memory is reserved in pages of 2 MiB: the run would reserve") as w, \
                pytest.raises(cmlp.OutOfMemoryError, match=r"reserved \(in whole segments, or pages where"):
            cmlp.Trainer(model, cmlp.optim.AdamW(model), batch_size=32).fit(x, y, epochs=1, progress=False)
        assert "configure(" not in str(w[0].message)
    finally:
        M.set_memory_limit(None, "cpu")
        M.configure("")
        gc.collect()
        M.empty_cache("cpu")


def test_a_limit_below_the_models_own_state_is_said_plainly():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((256, 784)).astype(np.float32), rng.integers(0, 10, 256)
    gc.collect()
    M.empty_cache("cpu")
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    M.set_memory_limit(6 * 2**20, "cpu")  # parameters, gradients and Adam's state take 8.2 MiB
    try:
        with pytest.warns(M.MemoryWarning, match="fits no micro-batch, not even of 1 sample"), \
                pytest.raises(cmlp.OutOfMemoryError, match="optimizer state alone take 8.1") as e:
            cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=128).fit(x, y, epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, "cpu")
    assert "Try micro-batches" not in str(e.value)  # tried already


def test_what_stays_allocated_after_training_or_inference_is_the_models_state():
    # as in torch, where a step's activations and an inference's tensors are freed: parameters,
    # gradients (with the step's device scalars) and optimizer state; fp32 steps after fp16 ones
    # drop the half-precision weights, which they would refresh at every step for nothing
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((512, 784)).astype(np.float32), rng.integers(0, 10, 512)
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    opt = cmlp.optim.Adam(model)
    gc.collect()

    def held():
        return {k for k, v in M.memory_breakdown("cpu").items() if v}

    cmlp.Trainer(model, opt, batch_size=256, amp="fp16").fit(x, y, epochs=1, progress=False)
    assert held() == {"parameters", "gradients", "optimizer state", "half-precision weights"}
    trainer = cmlp.Trainer(model, opt, batch_size=256)
    trainer.fit(x, y, epochs=1, progress=False)
    state = M.memory_allocated("cpu")
    assert held() == {"parameters", "gradients", "optimizer state"}
    model.evaluate(x, y, batch_size=4096)
    model.predict(x)
    assert M.memory_allocated("cpu") == state and held() == {"parameters", "gradients", "optimizer state"}
    del trainer


@pytest.mark.filterwarnings("error::cmlp.MemoryWarning")
def test_a_data_set_smaller_than_the_batch_is_planned_as_the_step_it_makes():
    """Fewer samples than the batch make every step one micro-batch of them all: the planned start
    plans that step (a batch of 4096 planned as such would not fit the limit, and would start at
    micro-batches of 1024 for a data set of 100)."""
    layers, rows = [784, 512, 10], 100
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (rows, 784), dtype=np.uint8), rng.integers(0, 10, rows)
    gc.collect()
    M.empty_cache(DEV)
    model = cmlp.MLP(layers, seed=0)
    opt = cmlp.optim.Adam(model)
    whole = M.plan(layers, 4096, opt, data_rows=rows)
    assert whole.batch_size == rows and whole.reserved_bytes < M.plan(layers, 4096, opt).reserved_bytes
    M.set_memory_limit(M.memory_reserved(DEV) + whole.reserved_bytes, DEV)
    ooms = M.memory_stats(DEV)["num_ooms"]
    history = cmlp.Trainer(model, opt, batch_size=4096).fit(x, y, epochs=2, progress=False)
    assert [h["microbatch_size"] for h in history] == [4096, 4096]
    assert M.memory_stats(DEV)["num_ooms"] == ooms


@pytest.mark.filterwarnings("error::cmlp.MemoryWarning")
@pytest.mark.parametrize("batch", [512, 4096])
def test_a_limit_below_what_the_cache_holds_lets_its_free_blocks_serve_the_step(batch):
    """A limit set after a run, below what the cache reserved for it (here at what is allocated,
    so no new segment may be made): the planned start asks the cache whether its free blocks
    serve the step's requests as they are (tried on a copy: nothing changes), and trains whole, as
    auto_microbatch=False does, where the plan from an empty cache would have halved it."""
    layers = [784, 512, 256, 10]
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (2 * batch, 784), dtype=np.uint8), rng.integers(0, 10, 2 * batch)
    gc.collect()
    M.empty_cache(DEV)
    model = cmlp.MLP(layers, seed=0)
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=batch)
    trainer.fit(x, y, epochs=1, progress=False)
    M.set_memory_limit(M.memory_allocated(DEV), DEV)
    assert M.memory_reserved(DEV) > M.memory_allocated(DEV)
    plan = M.plan(layers, batch, opt)
    assert plan.peak_bytes - plan._allocated["model"] - plan._allocated["optimizer_state"] > 0  # no room by bytes
    step = [n for what, n in plan._requests if what == "step"]
    stats, snapshot = M.memory_stats(DEV), M.memory_snapshot(DEV)
    assert cmlp._cmlp.try_requests(DEV, step)
    assert not cmlp._cmlp.try_requests(DEV, step + [M.memory_reserved(DEV)])  # more than the cache holds
    assert M.memory_stats(DEV) == stats and M.memory_snapshot(DEV) == snapshot  # a dry run
    M._validate(DEV)
    ooms = M.memory_stats(DEV)["num_ooms"]
    history = trainer.fit(x, y, epochs=2, progress=False)
    assert [h["microbatch_size"] for h in history] == [batch, batch]
    assert M.memory_stats(DEV)["num_ooms"] == ooms and M.memory_stats(DEV)["num_device_alloc"] == stats[
        "num_device_alloc"]


@pytest.fixture
def caching_off():
    """Caching off (caching_allocator_enable): every request its own exact segment, so that a
    limit can sit a few bytes above a plan."""
    was = M.get_config()["memory_caching"]
    M.caching_allocator_enable(False)
    gc.collect()
    M.empty_cache(DEV)  # (what was cached before stays reserved until given back)
    yield
    M.caching_allocator_enable(was)


def test_a_short_step_keeps_the_micro_batch_the_limit_planned(caching_off):
    """trainer.step under a limit: a short batch that fits whole leaves the micro-batch the full
    batches were planned at, so that the next full batch runs as planned, without running out of
    memory (it used to start again from the batch asked for, run out twice and halve below the
    plan)."""
    layers, batch = [20, 512, 5], 2048
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((batch, 20), dtype=np.float32), rng.integers(0, 5, batch)
    model = cmlp.MLP(layers, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, shuffle=False)
    p = M.plan(layers, 512, trainer.optimizer, accumulation_steps=4)
    M.set_memory_limit(M.memory_reserved(DEV) + p.peak_bytes, DEV)
    ooms = M.memory_stats(DEV)["num_ooms"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sizes = []
        for rows in (batch, batch, 30, batch, batch):
            trainer.step(x[:rows], y[:rows])
            sizes.append(trainer.microbatch_size)
    assert sizes == [512] * 5 and M.memory_stats(DEV)["num_ooms"] == ooms
    assert len([w for w in seen if issubclass(w.category, cmlp.MemoryWarning)]) == 1


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_a_step_after_a_smaller_one_peaks_as_planned(amp):
    """A step of more rows than the last gives the smaller buffers back before it takes its own:
    its peak is the plan's (it used to hold both, 68% above the plan, and run out of memory under
    a limit that the same step had fit)."""
    layers = [20, 384, 96, 5]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((255, 20), dtype=np.float32), rng.integers(0, 5, 255)
    gc.collect()
    base = M.memory_allocated(DEV)
    model = cmlp.MLP(layers, seed=0)
    opt = cmlp.optim.SGD(model, lr=0.01)
    trainer = cmlp.Trainer(model, opt, batch_size=255, shuffle=False, amp=amp)
    for rows in (243, 255):
        M.reset_peak_memory_stats(DEV)
        trainer.step(x[:rows], y[:rows])
        assert M.max_memory_allocated(DEV) - base == M.plan(layers, rows, opt, amp=amp).peak_bytes, rows


def test_a_fit_after_skipped_steps_plans_the_optimizer_state_it_holds(caching_off):
    """fp16 steps all skipped (inf gradients at a high scale) have made Adam's state before any
    step counts: the next fit under the same limit plans it as held, not a second time, and keeps
    its micro-batch (it used to cut it to 43 of 64, and warn again)."""
    layers, batch = [20, 96, 48, 24, 5], 128
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((batch, 20), dtype=np.float32), rng.integers(0, 5, batch)
    gc.collect()  # (the models of tests before: their memory goes back, with caching off to the device)
    model = cmlp.MLP(layers, seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=batch, amp="fp16", scaler=cmlp.amp.GradScaler(init_scale=2.0**40),
                           shuffle=False)
    full = M.plan(layers, batch, opt, amp="fp16").peak_bytes
    one = M.plan(layers, 1, opt, amp="fp16", accumulation_steps=batch).peak_bytes
    M.set_memory_limit(M.memory_reserved(DEV) + (full + one) // 2, DEV)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runs = [trainer.fit(x, y, epochs=1, progress=False)[0] for _ in range(3)]
    assert [h["skipped_steps"] for h in runs] == [1, 1, 1]
    assert runs[0]["microbatch_size"] < batch and len({h["microbatch_size"] for h in runs}) == 1
    assert len([w for w in seen if issubclass(w.category, cmlp.MemoryWarning)]) == 1


def test_a_step_larger_than_the_batch_keeps_the_micro_batch_where_it_fits():
    """A Trainer.step of more rows than batch_size computes them in micro-batches of batch_size
    and the rest (339 as 220 and 119): where that fits the limit, the planned start keeps 220 (it
    used to try 2 of 170 first, warn that 220 does not fit, and keep 170 for later steps)."""
    layers, batch = [49, 147, 288, 6], 220
    plan = lambda rows, steps=1: M.plan(layers, rows, "adam", device=DEV, accumulation_steps=steps)  # noqa: E731
    gc.collect()
    M.empty_cache(DEV)
    M.set_memory_limit(M.memory_reserved(DEV) + max(plan(220).reserved_bytes, plan(220, 2).reserved_bytes), DEV)
    rng = np.random.default_rng(0)
    model = cmlp.MLP(layers, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=batch)
    ooms = M.memory_stats(DEV)["num_ooms"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", cmlp.MemoryWarning)
        for rows in (220, 339, 220):
            trainer.step(rng.standard_normal((rows, 49)).astype(np.float32), rng.integers(0, 6, rows))
            assert trainer.microbatch_size == batch, rows
    assert M.memory_stats(DEV)["num_ooms"] == ooms
