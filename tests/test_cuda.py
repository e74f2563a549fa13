"""The CUDA backend against the CPU backend, which is the reference (skipped without a GPU).

Every backend operation is reached from Python through a model-level comparison on both
devices, from the same parameters and inputs, over a sweep of layer sizes (tiny, odd, a hidden
layer of width 1, the reference model) and batch sizes (1, 2, 31, 257, 1024):
  - forward (logits, predict, evaluate; float32 and uint8 inputs): GEMM, bias + ReLU,
    normalisation of uint8 rows, softmax cross-entropy and argmax;
  - forward_backward (loss and every gradient, with label smoothing, loss scaling and
    accumulation): ReLU backward, bias gradients, GEMMs with every transpose;
  - optimizer steps (Adam; SGD with momentum, dampening, nesterov, weight decay; lr changes);
  - mixed precision (fp16, bf16): half casts, unscale and the inf/NaN check, GradScaler skips.
Then whole runs: a training run follows the CPU run's loss curve; the trainer's C loop (where a
backend may capture a step once and replay it as a CUDA graph) equals the Python-driven eager
loop bitwise, and so does a run with graphs switched off (CMLP_CUDA_GRAPHS=0); two seeded runs
are bitwise identical. Memory: under a limit, and for a request larger than the device, the
GPU raises cmlp.OutOfMemoryError and keeps working; statistics equal the snapshot; automatic
micro-batching, expandable segments, steady-state steps that allocate nothing, and the
planner's peak against the measured one, on the GPU. Runs with CMLP_ALLOW_TF32 removed from the
environment.

Tolerances (norm-wise relative error per tensor, tests/reference.py's rel_err; and every element
within 10x that fraction of the tensor's largest magnitude, which catches a wrong tail element
in odd sizes that a norm would average away):
  - fp32, GPU vs CPU and GPU vs the float64 reference: 1e-5 and 2e-5. The GPU must not use
    TF32 for fp32 GEMMs (TF32 gives errors near 1e-3). Inputs are drawn with no ReLU
    pre-activation within 1e-4 of zero, so rounding cannot flip a ReLU.
  - amp, GPU amp vs CPU amp: 5e-3 (fp16), 1e-2 (bf16). Both devices round to half precision at
    the same points (tests/test_amp.py holds the CPU within 2e-3 of a float64 emulation of that
    rounding), so they differ by fp32 summation order and the rare half-precision value that
    lands on the other side of a rounding boundary: a few ulps of fp16 (9.8e-4) or bf16 (3.9e-3).
  - amp vs the fp32 float64 reference (reference model only): test_amp's 0.05 (fp16), 0.2 (bf16).
  - whole training runs: per-step losses within 1e-3 (fp32) and 1e-2 (amp), per-epoch losses
    within 1e-3 and 3e-2; trajectories part in the last bits after the first step (ReLU flips,
    Adam's division by |g|), so weights are not compared there. After optimizer steps tensors
    are compared norm-wise only (see assert_close).

Run on a GPU machine after `CMLP_CUDA=1 python3 setup.py build_ext --inplace`:
    PYTHONPATH=python python3 -m pytest -q tests/test_cuda.py
With CMLP_TEST_CUDA_DEVICE=cpu the tests run with the CPU standing in for the GPU: a dry run of
the tests' own code on a machine without one (tests/test_cuda_dry_run.py), whose comparisons
hold trivially; tests about CUDA itself are skipped there.
"""
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from checks import (FORKED, assert_history_explains, assert_non_finite_values_as_torch,  # noqa: E402
                    assert_stats_match_snapshot, same)
from reference import RefMLP, draw_batch, rel_err  # noqa: E402

import cmlp  # noqa: E402

# fp32 on the GPU must be fp32: CMLP_ALLOW_TF32 (read when a device is opened, which no test has
# done yet at import) would make the fp32 comparisons fail by design.
os.environ.pop("CMLP_ALLOW_TF32", None)

M = cmlp.memory
MIB = 1 << 20
CUDA = os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda")  # "cpu": a dry run without a GPU
DRY_RUN = CUDA == "cpu"
GPU = DRY_RUN or cmlp.cuda.is_available()
_WHY = ("this build of cmlp has no CUDA backend (build with CMLP_CUDA=1)"
        if not cmlp.build_info().get("cuda_compiled") else "cmlp finds no usable GPU on this machine")
needs_gpu = pytest.mark.skipif(not GPU, reason=f"needs a GPU; cmlp.cuda.is_available() is False: {_WHY}")
needs_cuda = pytest.mark.skipif(DRY_RUN or not GPU, reason="about CUDA itself: needs a GPU, not a stand-in")
DEVICE_NAME = "cpu" if DRY_RUN else "cuda:0"  # what a model on CUDA reports
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))

TOL = 1e-5  # fp32, GPU vs CPU
TOL_REF = 2e-5  # fp32, either device vs the float64 reference
AMP_TOL = {"fp16": 5e-3, "bf16": 1e-2}  # GPU amp vs CPU amp
AMP_REF_TOL = {"fp16": 0.05, "bf16": 0.2}  # amp vs the fp32 float64 reference
MARGIN = 1e-4  # no ReLU pre-activation this close to zero in drawn inputs

SIZES = [[1, 1], [3, 5, 2], [7, 33, 1, 4], [784, 512, 256, 10]]
BATCHES = [1, 2, 31, 257, 1024]
SWEEP = [(s, n) for s in SIZES for n in BATCHES]
REF_SIZES = [784, 512, 256, 10]


def _id(value):
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return "-".join(map(str, value))
    return None


def sweep_id(case):
    sizes, n = case
    return f"{_id(sizes)}-b{n}"


@pytest.fixture(autouse=True)
def clean_cuda_allocator():
    """No memory limit or armed fault hook on the GPU before and after each test; the
    allocator's invariants hold afterwards."""
    if GPU:
        M.configure("")
        M.set_memory_limit(None, CUDA)
        M._fail_raw_alloc(0, CUDA)
    yield
    if GPU:
        M.configure("")
        M.set_memory_limit(None, CUDA)
        M._fail_raw_alloc(0, CUDA)
        gc.collect()
        M._validate(CUDA)


# ---------------------------------------------------------------- helpers

def assert_close(got, want, tol, what, elementwise=True):
    """Norm-wise relative error <= tol and (elementwise) every element within 10 * tol of want's
    largest magnitude, exact zeros staying zeros up to 1e-12. Not elementwise after optimizer
    steps: Adam divides by |g|, so an element whose gradient is near zero (its relative
    rounding large) may move by a sizeable fraction of lr on one device and not the other."""
    got = np.asarray(got)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all() or not np.isfinite(want).all(), f"{what}: non-finite values"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: norm-wise relative error {err:.3g} > {tol:g}"
    if not elementwise:
        return
    scale = float(np.abs(want).max(initial=0.0))
    worst = float(np.abs(got.astype(np.float64) - want).max(initial=0.0))
    assert worst <= 10 * tol * scale + 1e-12, f"{what}: worst element off by {worst:.3g} (largest |value| {scale:.3g})"


def assert_dicts_close(got, want, tol, what, elementwise=True):
    assert list(got) == list(want), what
    for k in want:
        assert_close(got[k], want[k], tol, f"{what} {k}", elementwise)


def assert_loss_close(got, want, tol, what="loss"):
    assert isinstance(got, float), what
    assert abs(got - want) <= tol * abs(want) + 1e-7, f"{what}: {got!r} vs {want!r}"


def pair(sizes, seed=0):
    """A CPU model and a GPU model holding the same parameters."""
    cpu = cmlp.MLP(sizes, seed=seed)
    gpu = cmlp.MLP(sizes, device=CUDA, seed=seed)
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


_BATCHES = {}


def margin_batch(sizes, n, seed=0):
    """(ref, x, y): the float64 reference of seed-0 parameters and a batch with no ReLU
    pre-activation within MARGIN of zero under it. Cached: the draw is float64 work."""
    key = (tuple(sizes), n, seed)
    if key not in _BATCHES:
        ref = RefMLP(sizes, cmlp.MLP(sizes, seed=0).state_dict())
        x, y = draw_batch(ref, np.random.default_rng(1000 * n + seed), n, MARGIN)
        _BATCHES[key] = (ref, x, y)
    return _BATCHES[key]


def teacher_data(n, seed=0, classes=10):
    """uint8 images [n, 784] labelled by a random linear teacher: learnable, so loss falls."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 784), dtype=np.uint8)
    w = rng.standard_normal((784, classes))
    y = ((x / 127.5 - 1.0) @ w).argmax(axis=1).astype(np.int64)
    return x, y


def make_optimizer(model, kind, config):
    return {"adam": cmlp.optim.Adam, "adamw": cmlp.optim.AdamW, "sgd": cmlp.optim.SGD}[kind](model, **config)


# ---------------------------------------------------------------- no GPU: a clear refusal (runs without one)

@pytest.mark.skipif(GPU, reason="a GPU is available here: the refusal without one cannot be observed")
def test_asking_for_cuda_without_a_gpu_raises_and_says_why():
    compiled = bool(cmlp.build_info().get("cuda_compiled"))
    assert cmlp.cuda.device_count() == 0
    if not compiled:
        assert cmlp.build_info()["cuda"] is None
    for device in ("cuda", "cuda:0"):
        with pytest.raises(RuntimeError) as info:
            cmlp.MLP([2, 2], device=device)
        msg = str(info.value)
        assert "CUDA" in msg, msg
        # it says whether the build lacks CUDA or the machine lacks a GPU
        assert ("build" in msg) if not compiled else ("GPU" in msg), msg
    model = cmlp.MLP([2, 2])
    with pytest.raises(RuntimeError, match="CUDA"):
        model.to("cuda")
    assert model.device == "cpu"
    model(np.zeros((1, 2), np.float32))  # still usable
    with pytest.raises(RuntimeError, match="CUDA"):
        cmlp.cuda.synchronize()
    with pytest.raises(RuntimeError, match="CUDA"):
        M.memory_stats("cuda")
    assert M.memory_allocated() == M.memory_allocated("cpu")  # the default device is the CPU


def test_unknown_device_strings_are_value_errors():
    for device in ("gpu", "cuda:x", "cuda:-1", "CUDA"):
        with pytest.raises(ValueError, match="device"):
            cmlp.MLP([2, 2], device=device)
    # a GPU that is not there is torch's RuntimeError (an invalid ordinal), however large its index
    for device in ("cuda:16", "cuda:99", "cuda:" + "9" * 30):
        with pytest.raises(RuntimeError, match="does not exist: .* CUDA device" if cmlp.cuda.is_available()
                           else "CUDA is not available"):
            cmlp.MLP([2, 2], device=device)


# ---------------------------------------------------------------- devices

@needs_cuda
def test_device_queries_and_names():
    count = cmlp.cuda.device_count()
    assert count >= 1
    version = cmlp.build_info()["cuda"]
    assert isinstance(version, str) and version, cmlp.build_info()
    cmlp.cuda.synchronize()
    cmlp.cuda.synchronize("cuda")
    cmlp.cuda.synchronize("cuda:0")
    assert cmlp.MLP([2, 2], device="cuda").device == "cuda:0"
    assert cmlp.MLP([2, 2], device="cuda:0").device == "cuda:0"
    if count < 16:
        with pytest.raises(RuntimeError, match=f"cuda:{count}"):
            cmlp.MLP([2, 2], device=f"cuda:{count}")
    # the default memory device is the GPU
    assert M.memory_allocated() == M.memory_allocated("cuda:0")


@needs_gpu
@pytest.mark.parametrize("sizes", SIZES, ids=_id)
def test_initialisation_is_the_same_on_both_devices(sizes):
    cpu = cmlp.MLP(sizes, seed=7)
    gpu = cmlp.MLP(sizes, device=CUDA, seed=7)
    assert gpu.layer_sizes == cpu.layer_sizes and gpu.num_parameters() == cpu.num_parameters()
    assert same(gpu.state_dict(), cpu.state_dict())
    assert all(not g.any() for g in gpu.grads().values())


@needs_gpu
def test_to_moves_parameters_and_optimizer_state_exactly():
    sizes = [7, 33, 1, 4]
    gc.collect()
    base = M.memory_allocated(CUDA)
    x, y = margin_batch(sizes, 31)[1:]
    moved = cmlp.MLP(sizes, seed=0)
    stay = cmlp.MLP(sizes, seed=0)
    opts = [cmlp.optim.Adam(m, lr=1e-2) for m in (moved, stay)]
    for device in ("cpu", "cpu", CUDA, CUDA, "cpu"):
        if moved.device.split(":")[0] != device:
            before = moved.state_dict(), opts[0].state_dict()
            assert moved.to(device) is moved
            assert moved.device.startswith(device)
            assert same(moved.state_dict(), before[0]) and same(opts[0].state_dict(), before[1])
        for i, model in enumerate((moved, stay)):
            opts[i].zero_grad()
            model.forward_backward(x, y)
            opts[i].step()
    assert_dicts_close(moved.state_dict(), stay.state_dict(), TOL, "parameters", elementwise=False)
    got, want = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for i in want:
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(got[i][name], want[i][name], 1e-4, f"state {i} {name}", elementwise=False)
    del moved, stay, opts, model
    gc.collect()
    assert M.memory_allocated(CUDA) == base, "moving back to the CPU must free the GPU copies"


@needs_gpu
def test_a_pickled_model_and_optimizer_come_back_on_the_device_and_train_on_alike():
    """pickle (torch.save of whole objects): a model on the device comes back there, with its
    optimizer bound to it and their state, and both train on bit for bit as the originals."""
    import pickle

    sizes = [9, 17, 4]
    x, y = margin_batch(sizes, 64)[1:]
    model = cmlp.MLP(sizes, seed=0, device=CUDA)
    opt = cmlp.optim.Adam(model, lr=1e-2, param_groups=[{"params": ["fc1.weight"], "amsgrad": True},
                                                        {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}])
    cmlp.Trainer(model, opt, batch_size=8, shuffle=False).fit(x, y, epochs=1, progress=False)
    m2, o2 = pickle.loads(pickle.dumps([model, opt]))
    assert m2.device == model.device and o2.model is m2
    assert same(o2.state_dict()["state"], opt.state_dict()["state"])
    for m, o in ((model, opt), (m2, o2)):
        cmlp.Trainer(m, o, batch_size=8, shuffle=False).fit(x, y, epochs=1, progress=False)
    assert same(m2.state_dict(), model.state_dict())


@needs_gpu
@pytest.mark.skipif(CUDA == "cpu", reason="moves between two devices")
@pytest.mark.parametrize("short_of", ["gradients", "optimizer state"])
def test_a_move_that_runs_out_of_memory_leaves_everything_where_it_was(short_of):
    """model.to under a limit with room for the parameters but not the gradients (or for the
    model but not Adam's state): OutOfMemoryError, and the model, its optimizer and the GPU's
    memory are as before, and the CPU's once a step has made the model's workspace again (a move
    gives it up); the model trains on, and owns its memory (a block handed out next is not its
    parameters). The layer is wide enough that its buffers (12.4 MiB) take segments of about
    their own size, so that the limit falls where it is meant to with caching on or off."""
    sizes = [784, 4096, 10]
    model = cmlp.MLP(sizes, seed=0)
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=16)
    x, y = margin_batch(sizes, 16)[1:]
    trainer.step(x, y)
    nbytes = model.num_parameters() * 4
    gc.collect()
    M.empty_cache(CUDA)
    before = (model.state_dict(), opt.state_dict(), M.memory_allocated("cpu"), M.memory_allocated(CUDA),
              M.memory_reserved(CUDA))
    room = nbytes + (nbytes // 2 if short_of == "gradients" else nbytes + (4 << 20))
    M.set_memory_limit(M.memory_reserved(CUDA) + room, CUDA)
    try:
        with pytest.raises(cmlp.OutOfMemoryError):
            model.to(CUDA)
    finally:
        M.set_memory_limit(None, CUDA)
    assert model.device == "cpu" and opt.state_dict()["state"]
    assert same(model.state_dict(), before[0]) and same(opt.state_dict(), before[1])
    assert M.memory_allocated(CUDA) == before[3] and M.memory_allocated("cpu") <= before[2]
    block = M.caching_allocator_alloc(nbytes, "cpu")  # the parameters' old block, were it free
    ctypes.memset(block, 0, nbytes)
    M.caching_allocator_delete(block)
    assert same(model.state_dict(), before[0])
    trainer.step(x, y)
    assert M.memory_allocated("cpu") == before[2]
    assert model.to(CUDA) is model and model.device == DEVICE_NAME
    trainer.step(x, y)


@needs_gpu
@pytest.mark.skipif(CUDA == "cpu", reason="moves between two devices")
def test_steps_in_another_thread_never_find_the_model_moved_without_its_optimizer():
    """model.to moved the model, then (in another call, the lock let go between) each of its
    optimizers: a step in another thread got in between all but every time and failed with
    "moved to another device without its optimizer", blaming a move made as the API says. The
    model and its optimizers now move in one call under the model's lock."""
    sizes = [16, 32, 4]
    model = cmlp.MLP(sizes, seed=0, device=CUDA)
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=32)
    x, y = margin_batch(sizes, 32)[1:]
    stop = threading.Event()
    moves = []

    def mover():
        while not stop.is_set():
            model.to("cpu")
            model.to(CUDA)
            moves.append(1)

    thread = threading.Thread(target=mover)
    thread.start()
    try:
        losses = [trainer.step(x, y) for _ in range(60)]
    finally:
        stop.set()
        thread.join()
    assert moves and all(np.isfinite(losses))
    assert opt.state_dict()["state"][0]["step"] == 60 and model.device == DEVICE_NAME


@needs_gpu
def test_an_optimizer_made_during_a_move_follows_the_model_at_its_first_step():
    """An optimizer made in one thread while another moved the model was made on the device the
    model left and registered after the move had taken its optimizers: its first step failed
    with "moved to another device without its optimizer". With no state yet, it now follows the
    model (its groups' settings with it) and steps as one made after the move; one that holds
    state and was left behind still says so."""
    sizes = [16, 32, 4]
    x, y = margin_batch(sizes, 32)[1:]
    groups = [{"params": ["fc1.weight", "fc1.bias"], "lr": 1e-2}, {"params": ["fc2.weight", "fc2.bias"]}]
    results = []
    for late in (True, False):
        model = cmlp.MLP(sizes, seed=0)
        opt = cmlp.optim.Adam(model, lr=1e-3, param_groups=groups)
        if late:  # made before the move and registered after it, as in the race
            model._optimizers.discard(opt)
        model.to(CUDA)
        model._optimizers.add(opt)
        trainer = cmlp.Trainer(model, opt, batch_size=32)
        results.append(([trainer.step(x, y) for _ in range(3)], model.state_dict()))
    assert results[0][0] == results[1][0] and same(results[0][1], results[1][1])
    if DRY_RUN:  # no move between two devices
        return
    model = cmlp.MLP(sizes, seed=0)
    opt = cmlp.optim.Adam(model)
    cmlp.Trainer(model, opt, batch_size=32).step(x, y)
    model._optimizers.discard(opt)
    model.to(CUDA)
    with pytest.raises(RuntimeError, match="without its optimizer"):
        opt.step()


@needs_gpu
@pytest.mark.skipif(CUDA == "cpu", reason="moves between two devices")
def test_optimizers_made_and_stepped_while_another_thread_moves_the_model_move_with_it():
    """model.to took the optimizers it moves from the model's set while another thread made one:
    the set changed size during the iteration (the move raised), or an optimizer made and stepped
    between the set's reading and the move stayed behind with its state, and failed at every
    step after. Making an optimizer and moving the model now take turns."""
    sizes = [8, 6, 3]
    x, y = margin_batch(sizes, 16)[1:]
    model = cmlp.MLP(sizes, seed=1)
    stop, made, errors = threading.Event(), [], []
    switch = sys.getswitchinterval()

    def mover():
        while not stop.is_set():
            try:
                model.to(CUDA if model.device == "cpu" else "cpu")
            except RuntimeError as e:  # pragma: no cover - the failure this test is for
                errors.append(str(e))

    def maker():
        while not stop.is_set():
            opt = cmlp.optim.Adam(model, lr=1e-3)
            model.forward_backward(x, y)
            opt.step()
            made.append(opt)

    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=mover), threading.Thread(target=maker)]
    try:
        for t in threads:
            t.start()
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(switch)
    assert made and not errors
    for opt in made:  # each is where the model is
        model.forward_backward(x, y)
        opt.step()


@needs_gpu
def test_save_and_load_onto_the_gpu(tmp_path):
    cpu = cmlp.MLP([3, 5, 2], seed=4)
    path = tmp_path / "m.npz"
    cpu.save(path)
    gpu = cmlp.MLP.load(path, device=CUDA)
    assert gpu.device == DEVICE_NAME and same(gpu.state_dict(), cpu.state_dict())
    gpu.save(tmp_path / "g.npz")
    assert same(cmlp.MLP.load(tmp_path / "g.npz").state_dict(), cpu.state_dict())


# ---------------------------------------------------------------- every op, GPU vs CPU, fp32

@needs_gpu
@pytest.mark.parametrize("case", SWEEP, ids=sweep_id)
def test_forward_matches_the_cpu(case):
    sizes, n = case
    ref, x, y = margin_batch(sizes, n)
    cpu, gpu = pair(sizes)
    x_before = x.copy()
    logits = gpu(x)
    assert logits.dtype == np.float32 and logits.shape == (n, sizes[-1])
    assert np.array_equal(x, x_before), "the input was modified"
    want = cpu(x)
    assert_close(logits, want, TOL, "logits vs cpu")
    assert_close(logits, ref.forward(x), TOL_REF, "logits vs reference")
    assert np.array_equal(gpu.forward(x), logits), "forward is deterministic"
    # predict: argmax (first maximum) of the GPU's own logits; the CPU agrees away from ties
    pred = gpu.predict(x)
    assert pred.dtype == np.int64 and np.array_equal(pred, np.argmax(logits, axis=1))
    clear = np.ones(n, bool)  # rows whose top two logits are not within rounding of each other
    if sizes[-1] > 1:
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3 * np.abs(want).max()
    assert np.array_equal(pred[clear], cpu.predict(x)[clear])
    # evaluate in odd chunks
    ev, ev_cpu = gpu.evaluate(x, y, batch_size=7), cpu.evaluate(x, y, batch_size=7)
    assert_loss_close(ev["loss"], ev_cpu["loss"], TOL, "evaluate loss")
    assert ev["accuracy"] == pytest.approx(float(np.mean(pred == y)), abs=1e-12)
    assert abs(ev["accuracy"] - ev_cpu["accuracy"]) <= np.sum(~clear) / n + 1e-12


@needs_gpu
@pytest.mark.parametrize("n", [1, 31, 1024])
def test_uint8_inputs_are_normalised_alike(n):
    sizes = [784, 512, 256, 10]
    rng = np.random.default_rng(n)
    xu = rng.integers(0, 256, (n, 784), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    cpu, gpu = pair(sizes)
    for m in (cpu, gpu):
        m.normalize = (0.1307, 0.3081)
    assert_close(gpu(xu), cpu(xu), TOL, "logits of uint8 images")
    loss_gpu, loss_cpu = gpu.forward_backward(xu, y), cpu.forward_backward(xu, y)
    assert_loss_close(loss_gpu, loss_cpu, TOL)
    assert_dicts_close(gpu.grads(), cpu.grads(), TOL, "grads from uint8 images")


@needs_gpu
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("case", SWEEP, ids=sweep_id)
def test_forward_backward_matches_the_cpu(case, label_smoothing):
    sizes, n = case
    ref, x, y = margin_batch(sizes, n)
    cpu, gpu = pair(sizes)
    x_before, y_before = x.copy(), y.copy()
    loss = gpu.forward_backward(x, y, label_smoothing=label_smoothing)
    assert np.array_equal(x, x_before) and np.array_equal(y, y_before), "inputs were modified"
    loss_cpu = cpu.forward_backward(x, y, label_smoothing=label_smoothing)
    ref_loss, ref_grads = ref.loss_and_grads(x, y, label_smoothing=label_smoothing)
    assert_loss_close(loss, loss_cpu, TOL, "loss vs cpu")
    assert_loss_close(loss, ref_loss, TOL_REF, "loss vs reference")
    grads = gpu.grads()
    assert all(g.dtype == np.float32 for g in grads.values())
    assert_dicts_close(grads, cpu.grads(), TOL, "grads vs cpu")
    assert_dicts_close(grads, ref_grads, TOL_REF, "grads vs reference")


@needs_gpu
@pytest.mark.parametrize("sizes", SIZES, ids=_id)
def test_loss_scale_accumulation_and_zero_grad(sizes):
    ref, x, y = margin_batch(sizes, 31)
    _, x2, y2 = margin_batch(sizes, 31, seed=1)
    cpu, gpu = pair(sizes)
    for m in (cpu, gpu):
        m.forward_backward(x, y, loss_scale=8.0)
        m.forward_backward(x2, y2, loss_scale=0.5)  # adds to the first
    assert_dicts_close(gpu.grads(), cpu.grads(), TOL, "accumulated scaled grads")
    _, g1 = ref.loss_and_grads(x, y, loss_scale=8.0)
    _, g2 = ref.loss_and_grads(x2, y2, loss_scale=0.5)
    assert_dicts_close(gpu.grads(), {k: g1[k] + g2[k] for k in g1}, TOL_REF, "accumulated vs reference")
    gpu.zero_grad()
    assert all(not g.any() for g in gpu.grads().values())
    gpu.forward_backward(x, y)
    assert_dicts_close(gpu.grads(), ref.loss_and_grads(x, y)[1], TOL_REF, "after zero_grad")


OPTIMIZERS = [
    ("adam", {}),
    ("adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2)),
    ("adamw", dict(lr=3e-3, weight_decay=0.1)),
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    ("adam", dict(lr=1e-3, weight_decay=1e-2, amsgrad=True, maximize=True)),
    ("adamw", dict(lr=3e-3, weight_decay=0.1, amsgrad=True)),
    ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=1e-3, maximize=True)),
]


def _opt_id(opt):
    kind, config = opt
    return kind + "".join(f"-{k}{v}" for k, v in config.items()).replace(" ", "")


@needs_gpu
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=_opt_id)
@pytest.mark.parametrize("sizes", SIZES, ids=_id)
def test_optimizer_steps_match_the_cpu(sizes, opt):
    kind, config = opt
    batches = [margin_batch(sizes, 31, seed=s)[1:] for s in range(4)]
    cpu, gpu = pair(sizes)
    opts = [make_optimizer(m, kind, config) for m in (cpu, gpu)]
    for i, (x, y) in enumerate(batches):
        if i == 2:
            for o in opts:
                o.lr = o.lr * 0.5
        for m, o in zip((cpu, gpu), opts):
            o.zero_grad()
            m.forward_backward(x, y)
            o.step()
    assert_dicts_close(gpu.state_dict(), cpu.state_dict(), TOL, "parameters", elementwise=False)
    got, want = opts[1].state_dict(), opts[0].state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert got["state"][i].keys() == entry.keys()
        for name, value in entry.items():
            if name == "step":
                assert got["state"][i][name] == value
            else:
                assert_close(got["state"][i][name], value, 1e-4, f"optimizer state {i} {name}", elementwise=False)


@needs_gpu
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_a_gemm_with_a_side_of_65535_x_32_or_more_runs_without_the_fused_bias(amp):
    """cuBLASLt's bias epilogue has failed to run on GEMMs with a side of 65535 x 32 or more
    (torch's addmm does without it there; the emulated cuBLASLt fails so): a forward and backward
    pass through a first layer of 2**21 inputs, whose GEMM sums that many products before its
    bias and ReLU, gives the CPU's loss and gradients."""
    sizes, n = [2**21, 3, 2], 4
    rng = np.random.default_rng(21)
    x = rng.standard_normal((n, sizes[0])).astype(np.float32)
    y = rng.integers(0, 2, n)
    cpu, gpu = pair(sizes)
    scale = 1024.0 if amp else 1.0
    loss = gpu.forward_backward(x, y, amp=amp, loss_scale=scale)
    loss_cpu = cpu.forward_backward(x, y, amp=amp, loss_scale=scale)
    tol = AMP_TOL[amp] if amp else 1e-5
    assert_loss_close(loss, loss_cpu, tol, "loss vs cpu")
    assert_dicts_close(gpu.grads(), cpu.grads(), tol, "grads vs cpu", elementwise=False)
    assert_close(gpu(x), cpu(x), tol, "logits vs cpu")


# ---------------------------------------------------------------- mixed precision

@needs_gpu
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
@pytest.mark.parametrize("case", SWEEP, ids=sweep_id)
def test_amp_forward_backward_matches_cpu_amp(case, amp):
    sizes, n = case
    ref, x, y = margin_batch(sizes, n)
    cpu, gpu = pair(sizes)
    scale = 1024.0 if amp == "fp16" else 1.0
    loss = gpu.forward_backward(x, y, amp=amp, loss_scale=scale)
    loss_cpu = cpu.forward_backward(x, y, amp=amp, loss_scale=scale)
    assert_loss_close(loss, loss_cpu, AMP_TOL[amp], f"{amp} loss vs cpu")
    grads = gpu.grads()
    assert_dicts_close(grads, cpu.grads(), AMP_TOL[amp], f"{amp} grads vs cpu")
    if sizes == REF_SIZES:
        ref_loss, ref_grads = ref.loss_and_grads(x, y, loss_scale=scale)
        assert abs(loss - ref_loss) < 1e-2 * ref_loss
        for k in ref_grads:
            assert rel_err(grads[k], ref_grads[k]) < AMP_REF_TOL[amp], k
        # and it really is half precision on the GPU: not the fp32 result
        fp32 = cmlp.MLP(sizes, device=CUDA, seed=0)
        fp32.forward_backward(x, y, loss_scale=scale)
        assert rel_err(grads["fc1.weight"], fp32.grads()["fc1.weight"]) > 1e-4


@needs_gpu
@pytest.mark.parametrize("amp", [None, "fp16", "bf16"])
@pytest.mark.parametrize("case", [(s, n) for s in SIZES for n in (1, 31, 257)], ids=sweep_id)
def test_trainer_steps_leave_their_gradients_and_match_the_cpu(case, amp):
    """A step alone in its optimizer step keeps its buffers in the first layer's weight gradient
    where they fit (under amp on the GPU its half weights too: the reference model up to about a
    hundred rows, in fp32 a few hundred; the small models at a row or two) and writes that
    gradient last: model.grads() after Trainer.step holds the step's gradients on both devices,
    and the next steps, whose half weights are made again from the updated weights, follow the
    CPU's losses."""
    sizes, n = case
    ref, x, y = margin_batch(sizes, n)
    runs = {}
    for name, model in zip(("cpu", "gpu"), pair(sizes)):
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=n, amp=amp, shuffle=False)
        losses = [trainer.step(x, y)]
        grads = model.grads()
        losses += [trainer.step(x, y) for _ in range(2)]
        runs[name] = losses, grads
    (cpu_losses, cpu_grads), (losses, grads) = runs["cpu"], runs["gpu"]
    tol = AMP_TOL[amp] if amp else TOL
    assert_loss_close(losses[0], cpu_losses[0], tol, "first step's loss vs cpu")
    assert_dicts_close(grads, cpu_grads, tol, f"{amp or 'fp32'} grads after a step vs cpu")
    if amp is None:
        ref_loss, ref_grads = ref.loss_and_grads(x, y)
        assert_loss_close(losses[0], ref_loss, TOL_REF, "first step's loss vs the reference")
        assert_dicts_close(grads, ref_grads, TOL_REF, "grads after a step vs the reference")
    for i in (1, 2):
        assert_loss_close(losses[i], cpu_losses[i], 1e-2 if amp else 1e-3, f"loss of step {i + 1} vs cpu")


@needs_gpu
def test_fp16_overflow_gives_inf_and_the_scaler_skips_the_step():
    cpu, gpu = pair([4, 3, 2])
    sd = cpu.state_dict()
    sd["fc1.weight"][...] = 1.0
    x = np.full((2, 4), 30000.0, np.float32)  # hidden activations of 120000 exceed fp16's 65504
    y = np.array([0, 1])
    for m in (cpu, gpu):
        m.load_state_dict(sd)
        opt = cmlp.optim.Adam(m)
        scaler = cmlp.amp.GradScaler(init_scale=1024.0)
        m.forward_backward(x, y, amp="fp16", loss_scale=scaler.get_scale())
        assert not np.isfinite(m.grads()["fc1.weight"]).all(), m.device
        assert scaler.step(opt) is False
        scaler.update()
        assert scaler.get_scale() == 512.0
        assert same(m.state_dict(), sd), f"{m.device}: a skipped step changed the parameters"
        m.zero_grad()
        m.forward_backward(x, y, amp="bf16")
        assert all(np.isfinite(g).all() for g in m.grads().values()), m.device


@needs_gpu
def test_grad_scaler_loop_matches_the_cpu():
    sizes = [784, 512, 256, 10]
    cpu, gpu = pair(sizes)
    runs = []
    for m in (cpu, gpu):
        opt = cmlp.optim.Adam(m, lr=1e-3)
        # far from fp16's overflow (the overflow test covers skipping), growing every 2 steps
        scaler = cmlp.amp.GradScaler(init_scale=2.0**13, growth_interval=2)
        stepped, scales = [], []
        for i in range(6):
            x = np.random.default_rng(i).standard_normal((64, 784)).astype(np.float32)
            y = np.random.default_rng(100 + i).integers(0, 10, 64)
            opt.zero_grad()
            m.forward_backward(x, y, amp="fp16", loss_scale=scaler.get_scale())
            scaler.unscale_(opt)
            stepped.append(scaler.step(opt))
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((stepped, scales, m.state_dict()))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1], (runs[0][:2], runs[1][:2])
    assert_dicts_close(runs[1][2], runs[0][2], AMP_TOL["fp16"], "parameters after the scaled loop", elementwise=False)


# ---------------------------------------------------------------- whole runs

def _train(device, amp, x, y, xv, yv, steps=30, epochs=2, batch=64):
    """`steps` Trainer.step calls on fixed batches (early training: losses of order 1), then
    Trainer.fit (the C epoch loop, shuffled) for `epochs`. Returns (per-step losses, history,
    model)."""
    model = cmlp.MLP([784, 512, 256, 10], device=device, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, amp=amp, seed=3)
    losses = [trainer.step(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]
    history = trainer.fit(x, y, epochs=epochs, validation_data=(xv, yv), progress=False)
    return losses, history, model


@needs_gpu
@pytest.mark.parametrize("amp", [None, "fp16", "bf16"])
def test_training_follows_the_cpu_loss_curve(amp):
    # Tolerances measured on the CPU against the same run computed in micro-batches of 16 (a
    # different summation order): fp32 parts by 3e-8, amp by up to 5e-4 per step and 2e-3 per
    # epoch, and the runs part further as training goes on.
    x, y = teacher_data(4096 + 1024, seed=1)
    x, y, xv, yv = x[:4096], y[:4096], x[4096:], y[4096:]
    step_tol, epoch_tol = (1e-3, 1e-3) if amp is None else (1e-2, 3e-2)
    s_gpu, h_gpu, gpu = _train(CUDA, amp, x, y, xv, yv)
    s_cpu, h_cpu, _ = _train("cpu", amp, x, y, xv, yv)
    assert h_gpu[-1]["loss"] < 0.5 * s_gpu[0], "the GPU run did not learn"
    np.testing.assert_allclose(s_gpu, s_cpu, rtol=step_tol)
    for e, (g, c) in enumerate(zip(h_gpu, h_cpu)):
        for key in ("loss", "val_loss"):
            assert g[key] == pytest.approx(c[key], rel=epoch_tol), (e, key, g[key], c[key])
        assert abs(g["val_accuracy"] - c["val_accuracy"]) <= 0.02, (e, g["val_accuracy"], c["val_accuracy"])
        assert g["microbatch_size"] == c["microbatch_size"] == 64
        assert g["skipped_steps"] == c["skipped_steps"]
        assert g["peak_memory_bytes"] > 0
    assert all(np.isfinite(v).all() for v in gpu.state_dict().values())


DEVICES = ["cpu", pytest.param(CUDA, marks=needs_gpu)]


@pytest.mark.parametrize("amp", [None, "fp16", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_graph_replay_equals_eager_execution(device, amp):
    """Trainer.fit runs its steps in the C loop, where a CUDA backend may capture a step once and
    replay it as a graph; a Python loop of forward_backward / GradScaler / optimizer calls runs every
    operation eagerly, one call at a time; Trainer.step is in between. All three must give the
    same bits (float32 inputs: no normalisation that two paths could round differently)."""
    sizes, batch, steps, epochs = [784, 512, 256, 10], 64, 6, 2
    rng = np.random.default_rng(11)
    x = rng.standard_normal((batch * steps, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    graph = cmlp.MLP(sizes, device=device, seed=0)
    t_graph = cmlp.Trainer(graph, cmlp.optim.Adam(graph), batch_size=batch, amp=amp, shuffle=False)
    history = t_graph.fit(x, y, epochs=epochs, progress=False)

    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt = cmlp.optim.Adam(eager)
    scaler = cmlp.amp.GradScaler() if amp == "fp16" else None
    eager_losses = []
    for _ in range(epochs):
        total = 0.0
        for i in range(steps):
            xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
            opt.zero_grad()
            total += batch * eager.forward_backward(xb, yb, amp=amp, loss_scale=scaler.get_scale() if scaler else 1.0)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        eager_losses.append(total / (batch * steps))

    stepped = cmlp.MLP(sizes, device=device, seed=0)
    t_step = cmlp.Trainer(stepped, cmlp.optim.Adam(stepped), batch_size=batch, amp=amp, shuffle=False)
    for _ in range(epochs):
        for i in range(steps):
            t_step.step(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])

    assert same(graph.state_dict(), eager.state_dict()), "fit (replayed) and the eager loop differ"
    assert same(t_graph.optimizer.state_dict(), opt.state_dict())
    assert same(stepped.state_dict(), eager.state_dict()), "Trainer.step and the eager loop differ"
    if scaler is not None:
        assert t_graph.scaler.state_dict() == scaler.state_dict() == t_step.scaler.state_dict()
    np.testing.assert_allclose([h["loss"] for h in history], eager_losses, rtol=1e-9)


@pytest.mark.parametrize("amp", [None, "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_clipping_inside_a_replayed_step_equals_the_eager_loop(device, amp):
    """Trainer(max_grad_norm=...) clips on the device inside the captured step (the norm and the
    scaling read from device memory), and AdamW decays the weights there; the same steps written
    with clip_grad_norm_ and AdamW.step give the same bits, and fit reports the norms the loop saw."""
    sizes, batch, steps, epochs, max_norm = [784, 64, 10], 32, 5, 2, 0.05
    rng = np.random.default_rng(12)
    x = rng.standard_normal((batch * steps, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    graph = cmlp.MLP(sizes, device=device, seed=0)
    t_graph = cmlp.Trainer(graph, cmlp.optim.AdamW(graph, weight_decay=0.1), batch_size=batch, amp=amp,
                           shuffle=False, max_grad_norm=max_norm)
    history = t_graph.fit(x, y, epochs=epochs, progress=False)

    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt = cmlp.optim.AdamW(eager, weight_decay=0.1)
    scaler = cmlp.amp.GradScaler() if amp == "fp16" else None
    norms = []
    for _ in range(epochs):
        norms.append([])
        for i in range(steps):
            xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
            opt.zero_grad()
            eager.forward_backward(xb, yb, amp=amp, loss_scale=scaler.get_scale() if scaler else 1.0)
            if scaler:
                scaler.unscale_(opt)
            norms[-1].append(cmlp.nn.utils.clip_grad_norm_(eager.parameters(), max_norm))
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()

    assert min(min(n) for n in norms) > max_norm  # every step was clipped
    assert same(graph.state_dict(), eager.state_dict()), "fit (replayed) and the eager loop differ"
    assert same(t_graph.optimizer.state_dict(), opt.state_dict())
    for h, n in zip(history, norms):
        assert h["grad_norm"] == pytest.approx(np.mean(n), rel=1e-12)
    assert t_graph.last_grad_norm == norms[-1][-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interval", ["epoch", "step", "one-cycle", "cyclic"])
@pytest.mark.parametrize("kind", ["sgd", "adamw", "sgd-from-0"])
def test_a_learning_rate_schedule_replays_the_captured_step_and_equals_the_eager_loop(device, interval, kind):
    """A captured step reads its rate on the device: a schedule stepped each epoch, or each step
    (warm-up), changes the rate of the replays, and the run equals the eager loop with the same
    rates (opt.step() and scheduler.step() from Python), bit for bit; OneCycleLR, which moves the
    momentum too, and CyclicLR, as well (read on the device like the rate; from SGD's momentum 0,
    its buffer is made by an eager step once the momentum is no longer 0)."""
    sizes, batch, steps, epochs = [784, 64, 10], 32, 4, 3
    rng = np.random.default_rng(13)
    x = rng.standard_normal((batch * steps, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    def optimizer(model):
        if kind.startswith("sgd"):
            return cmlp.optim.SGD(model, lr=0.1, momentum=0.0 if kind == "sgd-from-0" else 0.9)
        return cmlp.optim.AdamW(model, lr=1e-2, weight_decay=0.5)

    def schedule(opt):
        if interval == "epoch":
            return cmlp.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if interval == "one-cycle":  # sgd-from-0: the momentum rises from 0 to 0.9, then falls back
            ends = dict(max_momentum=0.0, base_momentum=0.9) if kind == "sgd-from-0" else {}
            return cmlp.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps * epochs, **ends)
        if interval == "cyclic":  # the momentum against the rate, every step
            ends = dict(max_momentum=0.0, base_momentum=0.9) if kind == "sgd-from-0" else {}
            return cmlp.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3,
                                                    mode="triangular2", **ends)
        return cmlp.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 6) * 0.9 ** k)

    graph = cmlp.MLP(sizes, device=device, seed=0)
    opt_g = optimizer(graph)
    t_graph = cmlp.Trainer(graph, opt_g, batch_size=batch, shuffle=False)
    history = t_graph.fit(x, y, epochs=epochs, progress=False, scheduler=schedule(opt_g),
                          scheduler_interval="epoch" if interval == "epoch" else "step")
    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt = optimizer(eager)
    sched = schedule(opt)
    firsts = []
    for _ in range(epochs):
        firsts.append(opt.lr)
        for i in range(steps):
            opt.zero_grad()
            eager.forward_backward(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
            opt.step()
            if interval != "epoch":
                sched.step()
        if interval == "epoch":
            sched.step()
    assert [h["lr"] for h in history] == firsts and len(set(firsts)) == epochs
    assert opt_g.lr == opt.lr
    assert same(graph.state_dict(), eager.state_dict())


PARAM_GROUPS = [{"params": ["fc1.weight", "fc2.weight"], "lr": 3e-3},
                {"params": ["fc1.bias", "fc2.bias"], "weight_decay": 0.0, "lr": 5e-3}]
# the same groups with hyperparameters of their own (torch's per-group betas, eps, amsgrad, momentum, ...)
OWN_GROUPS = {"adam": [{**PARAM_GROUPS[0], "betas": (0.8, 0.99), "eps": 1e-6},
                       {**PARAM_GROUPS[1], "maximize": True, "betas": (0.9, 0.9), "amsgrad": True}],
              "sgd": [{**PARAM_GROUPS[0], "momentum": 0.5, "dampening": 0.2},
                      {**PARAM_GROUPS[1], "nesterov": True, "maximize": True}]}


@needs_gpu
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd", "adam-amsgrad", "adam-own", "sgd-own"])
def test_param_groups_step_like_the_cpu(kind):
    """Each group's part of the parameters at its own rate, weight decay and hyperparameters, on
    the device as on the CPU; a group's rate and betas or momentum changed between steps too."""
    sizes = [37, 19, 5]
    batches = [margin_batch(sizes, 31, seed=s)[1:] for s in range(4)]
    cpu, gpu = pair(sizes)
    kind, own = kind.replace("-own", ""), kind.endswith("-own")
    groups = OWN_GROUPS[kind] if own else PARAM_GROUPS
    config = dict(lr=0.05, momentum=0.9, weight_decay=1e-2) if kind == "sgd" else dict(lr=1e-3, weight_decay=0.1)
    if kind == "adam-amsgrad":
        kind, config = "adam", dict(config, amsgrad=True, maximize=True)
    opts = [make_optimizer(m, kind, dict(config, param_groups=groups)) for m in (cpu, gpu)]
    for i, (x, y) in enumerate(batches):
        if i == 2:
            for o in opts:
                o.param_groups[1]["lr"] = 1e-2
                if own:
                    # (the first group's AMSGrad maximum starts here, beside the second's)
                    o.param_groups[0].update({"betas": (0.7, 0.95), "amsgrad": True} if kind == "adam"
                                             else {"momentum": 0.3})
        if i == 1:  # the groups' settings move with the optimizer: a copy of the CPU's, moved over
            moved = cmlp.MLP(sizes, seed=0)
            moved.load_state_dict(cpu.state_dict())
            opts.append(make_optimizer(moved, kind, dict(config, param_groups=groups)))
            opts[-1].load_state_dict(opts[0].state_dict())
            moved.to(CUDA)
        for m, o in zip((cpu, gpu, moved) if i >= 1 else (cpu, gpu), opts):
            o.zero_grad()
            m.forward_backward(x, y)
            o.step()
    assert_dicts_close(gpu.state_dict(), cpu.state_dict(), TOL, "parameters", elementwise=False)
    assert_dicts_close(moved.state_dict(), cpu.state_dict(), TOL, "parameters (moved)", elementwise=False)
    got, want = opts[1].state_dict(), opts[0].state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, entry in want["state"].items():
        for name, value in entry.items():
            if name != "step":
                assert_close(got["state"][i][name], value, 1e-4, f"optimizer state {i} {name}", elementwise=False)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # a skipped first step, as torch warns
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule", ["lambda", "cosine", "epoch", "cosine-fp16"])
def test_param_groups_in_a_replayed_step_equal_the_eager_loop(device, schedule):
    """A captured step reads the base rate and each group's multiple of it on the device: a schedule
    that keeps the groups in proportion (LambdaLR) replays one capture, one that does not
    (CosineAnnealingLR with eta_min) gives each step its own multiples; both equal the eager loop
    bit for bit, and so does a schedule stepped each epoch."""
    sizes, batch, steps, epochs = [784, 64, 10], 32, 4, 3
    rng = np.random.default_rng(17)
    x = rng.standard_normal((batch * steps, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    def optimizer(model):
        return cmlp.optim.AdamW(model, lr=1e-2, weight_decay=0.5, param_groups=PARAM_GROUPS)

    def schedule_of(opt):
        if schedule == "lambda":
            return cmlp.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 6) * 0.9 ** k)
        if schedule.startswith("cosine"):
            return cmlp.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-3)
        return cmlp.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    amp = "fp16" if schedule.endswith("fp16") else None  # the steps a scale overflows are skipped on the device

    def scaler():
        return cmlp.amp.GradScaler(init_scale=2.0**30) if amp else None

    graph = cmlp.MLP(sizes, device=device, seed=0)
    opt_g = optimizer(graph)
    t_graph = cmlp.Trainer(graph, opt_g, batch_size=batch, shuffle=False, amp=amp, scaler=scaler())
    history = t_graph.fit(x, y, epochs=epochs, progress=False, scheduler=schedule_of(opt_g),
                          scheduler_interval="epoch" if schedule == "epoch" else "step")
    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt = optimizer(eager)
    sched = schedule_of(opt)
    gs = scaler()
    skipped = 0
    for _ in range(epochs):
        for i in range(steps):
            opt.zero_grad()
            eager.forward_backward(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch], amp=amp,
                                   loss_scale=gs.get_scale() if gs else 1.0)
            if gs:
                skipped += not gs.step(opt)
                gs.update()
            else:
                opt.step()
            if schedule != "epoch":
                sched.step()
        if schedule == "epoch":
            sched.step()
    assert [g["lr"] for g in opt_g.param_groups] == [g["lr"] for g in opt.param_groups]
    assert same(graph.state_dict(), eager.state_dict())
    assert sum(h["skipped_steps"] for h in history) == skipped and (skipped > 0) == (amp is not None)


def eager_steps(model, opt, sched, scaler, x, y, batch, steps, amp):
    """The hand loop of `steps` steps of `batch` rows: forward_backward, the optimizer's step
    (through the scaler when there is one), then the schedule's step (when there is one)."""
    for i in range(steps):
        opt.zero_grad()
        model.forward_backward(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch], amp=amp,
                               loss_scale=scaler.get_scale() if scaler else 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # a skipped first step, as torch warns
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,amp", [("adam", None), ("adam", "fp16"), ("sgd", None)])
@pytest.mark.parametrize("schedule", ["cosine", "onecycle", "cyclic"])
def test_groups_own_settings_replay_as_the_eager_loop_steps(device, kind, amp, schedule):
    """Groups with hyperparameters of their own, in fits with a per-step schedule (each step its
    own multiples; with OneCycleLR each group's own momenta too; with CyclicLR the first group's
    momentum starts within a call, its buffer from the gradient, and the second's never does)
    and with a group's betas (momentum) and eps (dampening) changed between fits (a new capture):
    every step, replayed or skipped on the device, equals the eager loop bit for bit."""
    sizes, batch, steps = [784, 64, 10], 32, 4
    rng = np.random.default_rng(29)
    x = rng.standard_normal((batch * steps, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    def make(model):
        if kind == "sgd":
            opt = cmlp.optim.SGD(model, lr=0.05, momentum=0.9, param_groups=OWN_GROUPS["sgd"])
        else:
            opt = cmlp.optim.Adam(model, lr=1e-2, param_groups=OWN_GROUPS["adam"])
        if schedule == "onecycle":
            return opt, cmlp.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 3e-2], total_steps=3 * steps,
                                                           base_momentum=[0.8, 0.6], max_momentum=[0.9, 0.95])
        if schedule == "cyclic":
            return opt, cmlp.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=3,
                                                         base_momentum=[0.9, 0.0], max_momentum=[0.0, 0.0])
        return opt, cmlp.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-3)

    def scaler():
        return cmlp.amp.GradScaler(init_scale=2.0**30) if amp else None

    graph = cmlp.MLP(sizes, device=device, seed=0)
    opt_g, sched_g = make(graph)
    t_graph = cmlp.Trainer(graph, opt_g, batch_size=batch, shuffle=False, amp=amp, scaler=scaler())
    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt, sched = make(eager)
    gs = scaler()
    for epoch in range(3):
        if epoch == 1:
            for o in (opt_g, opt):
                o.param_groups[1].update({"betas": (0.5, 0.99), "eps": 1e-4} if kind == "adam"
                                         else {"momentum": 0.7, "dampening": 0.1, "nesterov": False})
        if epoch == 2:
            for o in (opt_g, opt):
                o.param_groups[0]["maximize"] = True
        t_graph.fit(x, y, epochs=1, progress=False, scheduler=sched_g, scheduler_interval="step")
        eager_steps(eager, opt, sched, gs, x, y, batch, steps, amp)
        assert same(graph.state_dict(), eager.state_dict()), epoch
    assert opt_g.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    mine, theirs = opt_g.state_dict()["state"], opt.state_dict()["state"]
    assert sorted(mine) == sorted(theirs)
    for i in mine:
        assert same({k: v for k, v in mine[i].items() if k != "step"},
                    {k: v for k, v in theirs[i].items() if k != "step"})


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # a skipped first step, as torch warns
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [None, "fp16"])
@pytest.mark.parametrize("bounds", [([0.0, 0.0], [0.0, 0.9]), ([0.0, 0.9], [0.0, 0.0])])
def test_sgd_momentum_that_starts_within_a_call_replays_as_the_eager_loop_steps(device, amp, bounds):
    """SGD groups whose momenta a per-step CyclicLR moves within calls of several steps (the
    first call's groups hold none after it, its steps some; or one group's starts within it):
    the buffer is made for the call, each group's starts from the gradient at its first step with
    momentum, and the captured, replayed steps equal the eager loop bit for bit."""
    sizes, batch, steps = [20, 16, 5], 2, 480
    rng = np.random.default_rng(31)
    x = rng.standard_normal((batch * steps, 20)).astype(np.float32)
    y = rng.integers(0, 5, batch * steps)
    groups = [{"params": ["fc1.weight", "fc2.weight"]}, {"params": ["fc1.bias", "fc2.bias"], "dampening": 0.3}]

    def make(model):
        opt = cmlp.optim.SGD(model, lr=0.01, param_groups=[dict(g) for g in groups])
        return opt, cmlp.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2,
                                                     base_momentum=bounds[0], max_momentum=bounds[1])

    def scaler():
        return cmlp.amp.GradScaler(init_scale=2.0**30) if amp else None

    graph = cmlp.MLP(sizes, device=device, seed=0)
    opt_g, sched_g = make(graph)
    cmlp.Trainer(graph, opt_g, batch_size=batch, shuffle=False, amp=amp, scaler=scaler()).fit(
        x, y, epochs=1, progress=False, scheduler=sched_g, scheduler_interval="step")
    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt, sched = make(eager)
    eager_steps(eager, opt, sched, scaler(), x, y, batch, steps, amp)
    assert same(graph.state_dict(), eager.state_dict())
    mine, theirs = opt_g.state_dict()["state"], opt.state_dict()["state"]
    assert sorted(mine) == sorted(theirs) and mine
    assert all(same(mine[i], theirs[i]) for i in mine)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # a skipped first step, as torch warns
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_amsgrad_turned_on_between_fits_replays_as_the_eager_loop_steps(device, amp):
    """AMSGrad turned on after a fit: the next fit's first step adds its maximum to the state
    (outside any capture) and the steps captured after it read it; maximize turned on then too.
    Every step, replayed or skipped on the device, equals the eager loop bit for bit."""
    sizes, batch, steps = [784, 64, 10], 32, 4
    rng = np.random.default_rng(23)
    x = rng.standard_normal((batch * steps, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch * steps)

    def scaler():
        return cmlp.amp.GradScaler(init_scale=2.0**30) if amp else None

    graph = cmlp.MLP(sizes, device=device, seed=0)
    opt_g = cmlp.optim.Adam(graph, lr=1e-2)
    t_graph = cmlp.Trainer(graph, opt_g, batch_size=batch, shuffle=False, amp=amp, scaler=scaler())
    eager = cmlp.MLP(sizes, device=device, seed=0)
    opt = cmlp.optim.Adam(eager, lr=1e-2)
    gs = scaler()
    for epoch in range(3):
        if epoch == 1:
            opt_g.amsgrad = opt.amsgrad = True
        if epoch == 2:
            opt_g.param_groups[0]["maximize"] = opt.param_groups[0]["maximize"] = True
        t_graph.fit(x, y, epochs=1, progress=False)
        eager_steps(eager, opt, None, gs, x, y, batch, steps, amp)
        assert same(graph.state_dict(), eager.state_dict()), epoch
    mine, theirs = opt_g.state_dict()["state"], opt.state_dict()["state"]
    assert sorted(mine[0]) == sorted(theirs[0]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    for i in mine:
        assert same({k: v for k, v in mine[i].items() if k != "step"},
                    {k: v for k, v in theirs[i].items() if k != "step"})


@pytest.mark.parametrize("device", DEVICES)
def test_a_skipped_step_that_made_sgds_buffer_leaves_it_unused(device):
    """The momentum goes from 0 to 0.9 (as a schedule may set it) and the step that makes SGD's
    buffer overflows under loss scaling: the device skips it, as torch's scaler skips
    optimizer.step(), so the next step starts the buffer from the gradient (dampening shows the
    difference), and no buffer is reported meanwhile."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)

    def run(skip):
        model = cmlp.MLP([6, 8, 3], seed=0, device=device)
        opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.0, dampening=0.5)
        scaler = cmlp.amp.GradScaler(init_scale=2.0**100)
        trainer = cmlp.Trainer(model, opt, batch_size=8, scaler=scaler, shuffle=False)
        trainer.step(x, y)
        opt._set_momentum(0.9)
        if skip:
            before = model._c.get_params()
            trainer.step(x * np.float32(1e20), y)
            np.testing.assert_array_equal(model._c.get_params(), before)
            state = opt.state_dict()["state"]
            assert all("momentum_buffer" not in e for e in state.values()) and scaler.get_scale() == 2.0**99
        else:
            scaler.update(2.0**99)
        trainer.step(x, y)
        trainer.step(x, y)
        return model._c.get_params(), opt.state_dict()["state"][0]["momentum_buffer"]

    (p0, b0), (p1, b1) = run(False), run(True)
    np.testing.assert_array_equal(p1, p0)
    np.testing.assert_array_equal(b1, b0)


@needs_gpu
@pytest.mark.parametrize("sizes", [[784, 512, 256, 10], [5, 3, 2]], ids=_id)
def test_clip_grad_norm_on_the_gpu_is_the_float64_norm(sizes):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((33, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], 33)
    for p in (2.0, 1.0, float("inf"), 3.5):
        model = cmlp.MLP(sizes, device=CUDA, seed=0)
        model.forward_backward(x, y)
        g = model._c.get_grads()
        a = np.abs(g.astype(np.float64))
        want = a.max() if p == float("inf") else (a ** p).sum() ** (1 / p)
        total = cmlp.nn.utils.clip_grad_norm_(model, want / 2, norm_type=p)
        assert abs(total - want) <= 2e-7 * want, (p, total, want)
        c = min(np.float32(1) / (np.float32(total) + np.float32(1e-6)) * np.float32(want / 2), np.float32(1))
        np.testing.assert_array_equal(model._c.get_grads(), g * c)
    cmlp.nn.utils.clip_grad_value_(model, 1e-3)
    np.testing.assert_array_equal(model._c.get_grads(), np.clip(g * c, np.float32(-1e-3), np.float32(1e-3)))



@needs_gpu
def test_clip_grad_norm_of_order_0_and_negative_on_the_gpu_is_the_cpus():
    """torch's norm types 0 (the tensors with a gradient), -inf (min |g|) and negative p: the
    GPU's norm and scaled gradients are the CPU's (bit for bit for 0 and -inf)."""
    sizes = [784, 512, 256, 10]
    rng = np.random.default_rng(4)
    g = rng.standard_normal(cmlp.MLP(sizes).num_parameters()).astype(np.float32)
    g[np.abs(g) < 1e-3] = 0.5
    g[784 * 512: 784 * 512 + 512 * 256] = 0.0  # fc2.weight: no gradient
    for p in (0.0, float("-inf"), -1.5):
        out = {}
        for device in ("cpu", CUDA):
            model = cmlp.MLP(sizes, device=device, seed=0)
            model._c.set_grads(g)
            total = cmlp.nn.utils.clip_grad_norm_(model, 0.5, norm_type=p)
            out[device] = total, model._c.get_grads()
        assert out["cpu"][0] == (5.0 if p == 0 else 0.0), p  # fc2.weight's zeros: the negative norms are 0
        assert out[CUDA][0] == out["cpu"][0], p
        np.testing.assert_array_equal(out[CUDA][1], out["cpu"][1])
    g[784 * 512: 784 * 512 + 512 * 256] = 0.25
    for p in (float("-inf"), -1.5):
        totals = []
        for device in ("cpu", CUDA):
            model = cmlp.MLP(sizes, device=device, seed=0)
            model._c.set_grads(g)
            totals.append(cmlp.nn.utils.clip_grad_norm_(model, 1e-4, norm_type=p))
        a = np.abs(g.astype(np.float64))
        want = a.min() if p == float("-inf") else (a ** p).sum() ** (1 / p)
        assert abs(totals[0] - want) <= 2e-7 * want and abs(totals[1] - totals[0]) <= 1e-6 * want, (p, totals)


@needs_gpu
def test_infinite_and_nan_values_load_and_train_as_in_torch():
    """The loss kernel's -inf logit and NaN argmax, and the optimizer kernels' weight decay of 0,
    as the CPU's (tests/test_numerics.py) and torch's."""
    pytest.importorskip("torch")
    assert_non_finite_values_as_torch(CUDA)


_GRAPHS_SCRIPT = r"""
import hashlib, json, os, sys
import numpy as np
import cmlp
rng = np.random.default_rng(2)
x = rng.integers(0, 256, (64 * 8 + 5, 784), dtype=np.uint8)
y = rng.integers(0, 10, 64 * 8 + 5)
model = cmlp.MLP([784, 512, 256, 10], device=os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda"), seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=sys.argv[1] or None, seed=1)
h, counts = [], []
fits = int(sys.argv[2]) if len(sys.argv) > 2 else 1
micros = [int(v) for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64] * fits  # each fit's micro-batch
for micro in micros[:fits]:  # fit calls
    trainer.microbatch_size = micro
    h += trainer.fit(x, y, epochs=3, progress=False)
    counts.append(trainer._c.graph_counts())
w = b"".join(v.tobytes() for v in model.state_dict().values())
print(json.dumps({"w": hashlib.sha1(w).hexdigest(), "loss": [e["loss"] for e in h],
                  "graphs": counts[-1], "graphs_per_fit": counts}))
"""


@needs_gpu
@pytest.mark.parametrize("amp", ["", "fp16"])
def test_graph_replay_and_eager_steps_train_identically(amp):
    """fit captures a full step as a CUDA graph and replays it; CMLP_CUDA_GRAPHS=0 runs every step
    eagerly. Same bits either way."""
    import json
    import os
    import subprocess
    import sys

    runs = []
    for graphs in ("1", "0"):
        env = dict(os.environ, CMLP_CUDA_GRAPHS=graphs)
        r = subprocess.run([sys.executable, "-c", _GRAPHS_SCRIPT, amp], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout))
    assert runs[0]["w"] == runs[1]["w"]
    np.testing.assert_allclose(runs[0]["loss"], runs[1]["loss"], rtol=1e-12)
    # 3 epochs of 8 whole steps and a short last one: the first whole step eager, the second
    # captured, the other 6 replayed, each epoch (a new epoch's order, the same buffers)
    if not DRY_RUN:
        assert runs[0]["graphs"] == [1, 22, 0], runs[0]["graphs"]
    assert runs[1]["graphs"] == [0, 0, 0]


@needs_cuda
def test_a_graph_that_cannot_go_onto_the_gpu_for_lack_of_memory_leaves_the_steps_eager():
    """A captured step's graph is uploaded as it is made (cudaGraphUpload), not at its first
    launch: that takes device memory outside the caching allocator. Out of it, the cache goes
    back and the upload is tried once more; out of it again, the graph is dropped and the rest of
    the fit runs eagerly; the next fit captures its steps again. Either way two fits train as the
    eager loop. (CMLP_EMU_GRAPH_UPLOAD_OOM=n: the emulated GPU's next n uploads run out of
    memory.)"""
    runs = {}
    for graphs, ooms in (("0", "0"), ("1", "1"), ("1", "2")):
        env = dict(os.environ, CMLP_CUDA_GRAPHS=graphs, CMLP_EMU_GRAPH_UPLOAD_OOM=ooms, CMLP_EMU_TRACE_GRAPHS="1")
        r = subprocess.run([sys.executable, "-c", _GRAPHS_SCRIPT, "", "2"], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[graphs, ooms] = json.loads(r.stdout.strip().splitlines()[-1]), r.stderr
    eager = runs["0", "0"][0]
    for key, (out, err) in runs.items():
        assert out["w"] == eager["w"], key
    if "cuda_emu:" not in runs["1", "1"][1]:
        pytest.skip("the emulated GPU's switch (a real GPU had the memory)")
    once, twice = runs["1", "1"][1], runs["1", "2"][1]
    assert once.count("upload ran out of memory") == 1 and once.count("a graph uploaded") == 1, once[-2000:]
    assert twice.count("upload ran out of memory") == 2 and twice.count("a graph uploaded") == 1, twice[-2000:]
    assert twice.rindex("upload ran out of memory") < twice.index("a graph uploaded")
    # the graph made in the first fit serves the second (after one eager step); one dropped in the
    # first fit leaves its steps eager, and the second fit captures a step again and replays it
    assert runs["1", "1"][0]["graphs_per_fit"] == [[1, 22, 0], [1, 45, 0]], runs
    assert runs["1", "2"][0]["graphs_per_fit"] == [[0, 0, 1], [1, 22, 1]], runs


@needs_cuda
def test_a_capture_that_cannot_go_onto_the_gpu_after_a_graph_was_kept_leaves_its_fit_eager():
    """A trainer keeps one graph. A fit at another micro-batch drops it and captures its own step;
    that graph's upload out of memory twice (the try and the retry after the cache went back)
    leaves the rest of that fit eager, and the next fit captures again and replays. The three
    fits train bit for bit as the eager loop. (CMLP_EMU_GRAPH_UPLOAD_OOM_AT=2,3: the emulated
    GPU's second and third uploads run out of memory.)"""
    runs = {}
    for graphs in ("0", "1"):
        env = dict(os.environ, CMLP_CUDA_GRAPHS=graphs, CMLP_EMU_GRAPH_UPLOAD_OOM_AT="2,3", CMLP_EMU_TRACE_GRAPHS="1")
        r = subprocess.run([sys.executable, "-c", _GRAPHS_SCRIPT, "", "3", "64,32,32"], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[graphs] = json.loads(r.stdout.strip().splitlines()[-1]), r.stderr
    (eager, _), (on, err) = runs["0"], runs["1"]
    assert on["w"] == eager["w"] and on["loss"] == eager["loss"], runs
    assert eager["graphs"] == [0, 0, 0]
    if "cuda_emu:" not in err:
        pytest.skip("the emulated GPU's switch (a real GPU had the memory)")
    assert err.count("upload ran out of memory") == 2 and err.count("a graph uploaded") == 2, err[-2000:]
    # fit 1 captures at 64 and replays; fit 2's capture at 32 is dropped, its steps eager; fit 3
    # captures at 32 again and replays (each fit: one eager step first, then a capture)
    assert on["graphs_per_fit"] == [[1, 22, 0], [1, 22, 1], [2, 44, 1]], on


_CUT_GRAPHS_SCRIPT = r"""
import hashlib, json, os, sys, warnings
import numpy as np
import cmlp
M = cmlp.memory
dev = os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda")
batch = 4096
rng = np.random.default_rng(3)
x = rng.integers(0, 256, (2 * batch + 37, 784), dtype=np.uint8)
y = rng.integers(0, 10, len(x))
model = cmlp.MLP([784, 512, 256, 10], device=dev, seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=batch, seed=1, grow_interval=2)
M.set_memory_limit(M.memory_reserved(dev) + 20 * 2**20, dev)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    h = trainer.fit(x, y, epochs=8, progress=False)
w = b"".join(v.tobytes() for v in model.state_dict().values())
print(json.dumps({"w": hashlib.sha1(w).hexdigest(), "loss": [e["loss"] for e in h],
                  "micro": [e["microbatch_size"] for e in h], "warned": len(caught),
                  "retries": trainer._c.oom_retries(), "graphs": trainer._c.graph_counts()}))
"""


@needs_cuda
def test_steps_at_a_micro_batch_a_limit_cut_replay_graphs_as_the_eager_loop():
    """Under a memory limit whose plan starts the micro-batch below the one asked for, and whose
    growth trials back to it run out of memory, the steps between the trials are still captured
    and replayed (a trial changes the step, so it runs eagerly, with its retry), and the fit
    trains bit for bit as the eager loop."""
    runs = {}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "CMLP_ALLOC_CONF")}
    for graphs in ("1", "0"):  # (with the allocator's defaults: expandable segments keep the data set on the host here)
        r = subprocess.run([sys.executable, "-c", _CUT_GRAPHS_SCRIPT], env=dict(env, CMLP_CUDA_GRAPHS=graphs),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[graphs] = json.loads(r.stdout.strip().splitlines()[-1])
    on, off = runs["1"], runs["0"]
    assert on["w"] == off["w"] and on["loss"] == off["loss"], runs
    assert on["micro"] == off["micro"] and on["retries"] == off["retries"] and on["warned"] == off["warned"] == 1
    assert max(on["micro"]) < 4096 and on["retries"] >= 1, on  # cut by the plan, and the trials failed
    assert off["graphs"] == [0, 0, 0]
    # 16 whole steps: a capture after a failed trial where it left a new workspace, the rest replays
    assert on["graphs"][0] >= 1 and on["graphs"][1] >= 6 and on["graphs"][2] == 0, on


@needs_cuda
@pytest.mark.parametrize("batch,rows,room,recompute", [(512, 3000, 0, False), (128, 851, MIB, True)])
def test_a_growth_trial_due_after_an_eager_step_runs_eagerly_not_in_a_capture(batch, rows, room, recompute):
    """With growth trials due every good step, the eager step that makes a step's key warm is also
    the one after which a trial is due: the trial, at a larger micro-batch on the smaller
    workspace, runs eagerly (captured, it would ask for the larger workspace, and the failed
    capture would turn graphs off for the trainer), and the steps at the size that holds replay."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((rows, 64)).astype(np.float32), rng.integers(0, 10, rows)
    model = cmlp.MLP([64, 768, 10], device=CUDA, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.05), batch_size=batch, grow_interval=1,
                           recompute=recompute)
    gc.collect()
    M.empty_cache(CUDA)
    M.set_memory_limit(M.memory_reserved(CUDA) + room, CUDA)  # the plan starts smaller; growth trials run out
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cmlp.MemoryWarning)
            h = trainer.fit(x, y, epochs=2, progress=False)
    finally:
        M.set_memory_limit(None, CUDA)
    captures, replays, failed = trainer._c.graph_counts()
    assert max(e["microbatch_size"] for e in h) < batch and trainer._c.oom_retries() >= 2, h
    assert failed == 0 and captures >= 1 and replays >= 1, trainer._c.graph_counts()
    h = trainer.fit(x, y, epochs=1, progress=False)  # no limit: the micro-batch asked for, captured
    assert h[0]["microbatch_size"] == batch and trainer._c.graph_counts()[1] > replays


_STREAMS_SCRIPT = r"""
import os, sys
import numpy as np
import cmlp
out, dev = {}, os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda")
for sizes in ([784, 512, 256, 10], [7, 33, 1, 4], [3, 5, 2], [20, 9, 8, 7, 6, 5]):
    for n in (31, 1024) if sizes[0] == 784 else (31, 1024, 1025):
        for amp in (None, "fp16", "bf16"):
            model = cmlp.MLP(sizes, device=dev, seed=1)
            rng = np.random.default_rng(n)
            x = rng.standard_normal((n, sizes[0])).astype(np.float32)
            y = rng.integers(0, sizes[-1], n)
            loss = model.forward_backward(x, y, amp=amp)
            key = f"{sizes}-{n}-{amp}"
            out[key + "-loss"] = np.array([loss])
            for k, v in model.grads().items():
                out[f"{key}-{k}"] = v
rng = np.random.default_rng(2)
x = rng.integers(0, 256, (64 * 4 + 5, 784), dtype=np.uint8)
y = rng.integers(0, 10, 64 * 4 + 5)
for amp in (None, "fp16"):
    for accumulate in (1, 2):
        model = cmlp.MLP([784, 512, 256, 10], device=dev, seed=0)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp, seed=1,
                               accumulation_steps=accumulate)
        h = trainer.fit(x, y, epochs=3, progress=False)
        out[f"fit-{amp}-{accumulate}"] = np.array([e["loss"] for e in h])
np.savez(sys.argv[1], **out)
"""


@needs_gpu
def test_a_second_stream_computes_what_one_stream_does(tmp_path):
    """A backward pass of up to 1024 rows makes its weight gradients on a second stream beside the
    input-gradient chain (CMLP_CUDA_STREAMS=1 keeps everything on one). A missing join there is a
    race: gradients read before they are written, or buffers overwritten while a GEMM reads them.
    Gradients of forward_backward (several depths, amp, rows up to 1024 and past it) and fit's
    per-epoch losses (graphs, accumulation) agree within this file's tolerances: the two streams'
    GEMMs may use different algorithms (their workspaces differ), a race gives garbage. On the
    emulated backend they agree bit for bit (tests/test_cuda_emulated.py)."""
    runs = {}
    for streams in ("1", "2"):
        env = dict(os.environ, CMLP_CUDA_STREAMS=streams, PYTHONPATH=REPO_PYTHON)
        path = str(tmp_path / f"streams{streams}.npz")
        r = subprocess.run([sys.executable, "-c", _STREAMS_SCRIPT, path], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[streams] = dict(np.load(path))
    one, two = runs["1"], runs["2"]
    assert one.keys() == two.keys()
    if os.path.basename(os.environ.get("CMLP_CUDA_LIBRARY", "")).startswith("_cmlp_cuda_emu"):
        # the emulator multiplies the same way whatever the algorithm, and runs a second stream's
        # work as late as its joins allow: a missing join changes the bits
        for key in one:
            assert np.array_equal(two[key], one[key]), key
    for key in one:
        amp = "fp16" if "fp16" in key else "bf16" if "bf16" in key else None
        if key.startswith("fit-"):
            np.testing.assert_allclose(two[key], one[key], rtol=1e-3 if amp is None else 3e-2, err_msg=key)
        elif key.endswith("-loss"):
            np.testing.assert_allclose(two[key], one[key], rtol=TOL if amp is None else AMP_TOL[amp], err_msg=key)
        else:
            assert_close(two[key], one[key], TOL if amp is None else AMP_TOL[amp], key)


@needs_gpu
@pytest.mark.parametrize("amp", [None, "fp16", "bf16"])
def test_recompute_on_the_gpu_trains_as_without_it_and_as_the_cpu(amp):
    """recompute=True keeps only the input and recomputes each layer's input in backward (under
    amp through the gradient buffers, the first of which the loss kernel then overwrites with the
    logits' gradient in half precision). Per-epoch losses within the whole-run tolerances of this
    file against the same run without recompute and against the CPU's run with it."""
    x, y = teacher_data(64 * 8, seed=13)
    losses = {}
    for device, recompute in ((CUDA, True), (CUDA, False), ("cpu", True)):
        model = cmlp.MLP([784, 512, 256, 10], device=device, seed=3)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp, seed=3, recompute=recompute)
        losses[device, recompute] = [h["loss"] for h in trainer.fit(x, y, epochs=3, progress=False)]
    tol = 1e-3 if amp is None else 3e-2
    for other in ((CUDA, False), ("cpu", True)):
        np.testing.assert_allclose(losses[CUDA, True], losses[other], rtol=tol, err_msg=f"against {other}")


@needs_gpu
@pytest.mark.parametrize("batch", [2048, 512])
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_two_threads_training_on_one_gpu_match_runs_one_after_the_other(amp, batch):
    """Two models on the same GPU, trained from two threads at once, share the device's stream,
    GEMM workspace (where tall bias gradients keep partial sums: batch 2048 splits them) and
    allocator, and a graph captured by one thread must not record the other's work: each ends
    bit for bit where it ends trained alone. At batch 512 the weight gradients are made on the
    second stream, which the threads share too (one thread's eager steps beside the other's
    graphs, whose second branch has its own workspace)."""
    import threading

    x, y = teacher_data(batch * 3, seed=12)

    def run(seed, out):
        model = cmlp.MLP([784, 512, 256, 10], device=CUDA, seed=seed)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=batch, amp=amp, seed=seed)
        trainer.fit(x, y, epochs=3, progress=False)
        out[seed] = model.state_dict()  # (reading the parameters waits for the device)

    alone, together = {}, {}
    for seed in (1, 2):
        run(seed, alone)
    threads = [threading.Thread(target=run, args=(seed, together)) for seed in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert set(together) == {1, 2}
    for seed in (1, 2):
        assert same(together[seed], alone[seed]), f"model {seed} trained differently beside another thread"


@pytest.mark.parametrize("amp", [None, "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_identical_seeded_runs_are_bitwise_identical(device, amp):
    x, y = teacher_data(64 * 10 + 17, seed=3)  # a short last batch too
    runs = []
    for _ in range(2):
        model = cmlp.MLP([784, 512, 256, 10], device=device, seed=5)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp, shuffle=True, seed=9)
        history = trainer.fit(x, y, epochs=2, progress=False)
        runs.append((model.state_dict(), trainer.optimizer.state_dict(), [h["loss"] for h in history]))
        del model, trainer
    assert same(runs[0][0], runs[1][0]), "parameters differ between identical runs"
    assert same(runs[0][1], runs[1][1]), "optimizer state differs between identical runs"
    np.testing.assert_allclose(runs[0][2], runs[1][2], rtol=1e-9)  # loss sums may use atomics


@needs_gpu
def test_accumulation_equals_one_big_batch_on_the_gpu():
    x, y = teacher_data(256, seed=4)
    weights = []
    for batch, acc in ((64, 1), (16, 4)):
        model = cmlp.MLP([784, 512, 256, 10], device=CUDA, seed=0)
        cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=batch, accumulation_steps=acc,
                     shuffle=False).fit(x, y, epochs=1, progress=False)
        weights.append(model.state_dict())
    assert_dicts_close(weights[1], weights[0], 1e-3, "accumulated vs big batch", elementwise=False)


# ---------------------------------------------------------------- memory on the GPU

@needs_gpu
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_statistics_equal_the_snapshot_through_a_model_lifetime(amp):
    gc.collect()
    base = M.memory_allocated(CUDA)
    assert_stats_match_snapshot(CUDA)
    model = cmlp.MLP([784, 512, 256, 10], device=CUDA, seed=0)
    opt = cmlp.optim.Adam(model)
    assert M.memory_allocated(CUDA) >= base + 2 * 4 * model.num_parameters(), "parameters and gradients"
    assert_stats_match_snapshot(CUDA)
    x, y = teacher_data(300, seed=5)
    trainer = cmlp.Trainer(model, opt, batch_size=64, amp=amp)
    trainer.fit(x, y, epochs=1, progress=False)
    assert_stats_match_snapshot(CUDA)
    del trainer, opt, model
    gc.collect()
    assert M.memory_allocated(CUDA) == base
    assert_stats_match_snapshot(CUDA)


@needs_gpu
@pytest.mark.parametrize("amp,conf", [(None, ""), ("fp16", "expandable_segments:True")])
def test_the_memory_history_explains_a_captured_training_run(amp, conf):
    """The history of a fit on the GPU (its step captured once and replayed) replays to the
    memory the allocator holds; every allocation says what it holds, the device copy of the data
    set included; the snapshot names the device by its index, as PyTorch's viewer needs."""
    M.configure(conf)
    gc.collect()
    M.empty_cache(CUDA)
    M._record_memory_history(device=CUDA)
    try:
        start = M._snapshot(CUDA)
        model = cmlp.MLP([784, 512, 256, 10], device=CUDA, seed=0)
        x, y = teacher_data(600, seed=3)
        cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp).fit(x, y, epochs=2, progress=False)
        end = M._snapshot(CUDA)
        entries = assert_history_explains(start, end)
    finally:
        M._record_memory_history(None, device=CUDA)
    held = {e["frames"][0]["name"] for e in entries if e["action"] == "alloc"}
    assert {"parameters", "gradients", "optimizer state"} <= held
    if not DRY_RUN:
        assert {"data set", "data set labels", "data set order"} <= held
        index = int(DEVICE_NAME.partition(":")[2])
        assert len(end["device_traces"]) == index + 1 and all(s["device"] == index for s in end["segments"])
    del model
    gc.collect()
    assert_stats_match_snapshot(CUDA)


@needs_cuda
def test_mem_get_info_counts_what_the_allocator_reserves():
    """The driver's free memory falls by what the allocator reserves and rises by what
    empty_cache returns (torch.cuda.mem_get_info's meaning: cached memory is not free)."""
    gc.collect()
    M.empty_cache(CUDA)
    free0, total = cmlp.cuda.mem_get_info()
    assert (free0, total) == M.mem_get_info(CUDA) and total == M.memory_stats(CUDA)["total_memory"]
    assert cmlp.cuda.mem_get_info(0)[1] == total  # an index, as torch.cuda takes it
    r0 = M.memory_reserved(CUDA)
    p = M.caching_allocator_alloc(64 * MIB, CUDA)
    grown = M.memory_reserved(CUDA) - r0
    free1, _ = M.mem_get_info(CUDA)
    assert grown >= 64 * MIB and free0 - free1 >= grown
    M.caching_allocator_delete(p)
    assert M.mem_get_info(CUDA)[0] == free1, "a cached block is not free to the driver"
    M.empty_cache(CUDA)
    assert M.mem_get_info(CUDA)[0] >= free1 + grown - 2 * MIB


@needs_gpu
def test_caching_allocator_on_the_gpu_reuses_blocks_without_a_device_call():
    p = M.caching_allocator_alloc(3 * MIB, CUDA)
    M.caching_allocator_delete(p)
    before = M.memory_stats(CUDA)
    q = M.caching_allocator_alloc(3 * MIB, CUDA)
    after = M.memory_stats(CUDA)
    assert q == p
    assert after["num_device_alloc"] == before["num_device_alloc"]
    M.caching_allocator_delete(q)
    assert_stats_match_snapshot(CUDA)


@pytest.mark.skipif(DRY_RUN or not GPU, reason=f"needs a GPU; cmlp.cuda.is_available() is False: {_WHY}")
def test_torch_cuda_memory_names_serve_the_current_gpu():
    """torch.cuda.caching_allocator_alloc/delete and torch.cuda.memory (where torch keeps
    _record_memory_history and _snapshot) port: on the current GPU by default."""
    c = cmlp.cuda
    assert c.memory is M and c.get_allocator_backend() == "native"
    before = M.memory_allocated("cuda:0")
    p = c.caching_allocator_alloc(3 * MIB)
    assert M.memory_allocated("cuda:0") == before + 3 * MIB == c.memory.memory_allocated()
    c.memory._record_memory_history(max_entries=100)
    try:
        c.caching_allocator_delete(p)
        trace = c.memory._snapshot()["device_traces"][0]
        frees = [e for e in trace if e["action"].startswith("free")]
        assert [e["action"] for e in frees] == ["free_requested", "free_completed"] and frees[0]["addr"] == p
    finally:
        c.memory._record_memory_history(None)
    assert M.memory_allocated("cuda:0") == before


def test_torch_cuda_names_a_port_meets():
    assert cmlp.cuda.OutOfMemoryError is cmlp.OutOfMemoryError  # `except torch.cuda.OutOfMemoryError` ports
    # every GPU cmlp's kernels run on (sm_80 and later) computes in bfloat16
    assert cmlp.cuda.is_bf16_supported() is cmlp.cuda.is_available()
    assert cmlp.cuda.is_bf16_supported(including_emulation=False) is cmlp.cuda.is_available()
    with pytest.raises(TypeError, match="including_emulation"):
        cmlp.cuda.is_bf16_supported("yes")


def test_torch_cuda_memory_functions_port_to_cmlp_cuda():
    if not cmlp.cuda.is_available():  # as torch's before CUDA starts: nothing to read, nothing cached
        cmlp.cuda.empty_cache()
        assert [cmlp.cuda.memory_allocated(), cmlp.cuda.max_memory_reserved(1), cmlp.cuda.memory_stats("cuda:3"),
                cmlp.cuda.memory_stats_as_nested_dict(), cmlp.cuda.memory_snapshot()] == [0, 0, {}, {}, []]
        for call in (cmlp.cuda.reset_peak_memory_stats, cmlp.cuda.memory_summary, cmlp.cuda.mem_get_info,
                     cmlp.cuda.get_per_process_memory_fraction):  # these say why
            with pytest.raises(RuntimeError, match="CUDA is not available"):
                call()
        for call in (cmlp.cuda.memory_allocated, cmlp.cuda.memory_summary, cmlp.cuda.mem_get_info,
                     cmlp.cuda.synchronize):  # the CPU is no GPU: torch.cuda's words
            with pytest.raises(ValueError, match="Expected a cuda device"):
                call("cpu")
        with pytest.raises(ValueError, match="Expected a cuda device"):  # not the CPU's limit, silently
            cmlp.cuda.set_per_process_memory_fraction(0.0, "cpu")
        assert M.get_memory_limit("cpu") is None
        return
    model = cmlp.MLP([784, 64, 10], device="cuda", seed=0)
    assert cmlp.cuda.memory_allocated() == M.memory_allocated("cuda") >= 4 * model.num_parameters()
    assert cmlp.cuda.memory_stats(0) == M.memory_stats("cuda:0")
    assert cmlp.cuda.max_memory_reserved() == M.max_memory_reserved("cuda")
    summary = cmlp.cuda.memory_summary()
    assert "CUDA memory summary, device ID 0" in summary and "GPU reserved memory" in summary
    assert re.search(r"CUDA OOMs: \d+ .*\| +cudaMalloc retries: \d+ ", summary), "torch's words: scripts read them"
    stats = cmlp.cuda.memory_stats()
    counts = "  {_:9} CUDA OOMs: {num_ooms:<12d} | {_:6} cudaMalloc retries: {num_alloc_retries:<8d}  ".format(
        _="", **stats)  # torch's line, at its columns
    assert f"|{counts}|" in summary.splitlines(), summary
    del model
    cmlp.cuda.empty_cache()
    assert M.memory_reserved("cuda") == M.memory_stats("cuda")["reserved_bytes.all.current"]


@needs_cuda
def test_allocator_settings_set_after_import_apply_when_the_first_gpu_opens():
    """The seed article's os.environ['PYTORCH_CUDA_ALLOC_CONF'] = ... after the import, as PyTorch
    reads it when CUDA starts: applied as the first GPU opens, unless configure() came first; a
    bad one fails that opening (and the next, until it is fixed)."""
    code = """if True:
        import json, os, cmlp
        out = {{}}
        os.environ[{var!r}] = "max_split_size_mb:256,expandable_segments:True"
        {before}
        out["cpu_first"] = cmlp.memory.get_config()["expandable_segments"]  # the CPU opens no GPU
        cmlp.memory.memory_allocated("cpu")
        out["cpu_after"] = cmlp.memory.get_config()["expandable_segments"]
        try:
            cmlp.MLP([4, 3], device="cuda")
        except ValueError as e:
            out["error"] = str(e)
            os.environ[{var!r}] = "max_split_size_mb:256,expandable_segments:True"
            cmlp.MLP([4, 3], device="cuda")
        out["config"] = cmlp.memory.get_config()
        os.environ[{var!r}] = "max_split_size_mb:512"  # read once, as PyTorch: no longer
        cmlp.memory.memory_allocated("cuda:0")
        out["later"] = cmlp.memory.get_config()["max_split_size_mb"]
        print(json.dumps(out))
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("CMLP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    def run(var="PYTORCH_CUDA_ALLOC_CONF", before="", extra=None):
        r = subprocess.run([sys.executable, "-c", code.format(var=var, before=before)], env={**env, **(extra or {})},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    out = run()
    assert not out["cpu_first"] and not out["cpu_after"] and "error" not in out
    assert out["config"]["expandable_segments"] and out["config"]["max_split_size_mb"] == 256
    assert out["later"] == 256
    out = run(var="PYTORCH_ALLOC_CONF")
    assert out["config"]["max_split_size_mb"] == 256
    # configure() after the import is the user's word: the variable set after it is not read
    out = run(before='cmlp.memory.configure("garbage_collection_threshold:0.5")')
    assert out["config"]["max_split_size_mb"] is None and out["config"]["garbage_collection_threshold"] == 0.5
    # CMLP_ALLOC_CONF given at the start takes precedence, as at import
    out = run(extra={"CMLP_ALLOC_CONF": "max_split_size_mb:64"})
    assert out["config"]["max_split_size_mb"] == 64 and not out["config"]["expandable_segments"]
    # a bad one: the first GPU does not open, and opens once it is fixed
    out = run(before='os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:banana"')
    assert "PYTORCH_CUDA_ALLOC_CONF" in out["error"] and "max_split_size_mb" in out["error"]
    assert "first GPU" in out["error"] and out["config"]["max_split_size_mb"] == 256


@needs_cuda
def test_per_process_memory_fraction_in_the_settings_limits_each_gpu():
    total = M.memory_stats(CUDA)["total_memory"]
    M.configure("per_process_memory_fraction:0.5")  # a GPU in use takes it at once
    try:
        assert M.get_memory_limit(CUDA) == int(0.5 * total)
        assert M.get_config()["per_process_memory_fraction"] == 0.5
        assert M.get_memory_limit("cpu") is None  # as torch's: GPUs only
    finally:
        M.configure("")
        M.set_memory_limit(None, CUDA)
    # a GPU opened after the settings were read (at import) takes it when it opens
    code = ("import cmlp; m = cmlp.memory; t = m.memory_stats('cuda')['total_memory']; "
            "print(m.get_memory_limit('cuda') == int(0.25 * t), m.get_per_process_memory_fraction('cuda'))")
    env = {k: v for k, v in os.environ.items() if k != "CMLP_ALLOC_CONF"}
    env["PYTORCH_CUDA_ALLOC_CONF"] = "per_process_memory_fraction:0.25"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "0.25"], r.stdout
    # a fraction below the GEMM workspace the GPU opens with (0, as torch takes) leaves it open:
    # its statistics are read, its requests refused, and a larger fraction set afterwards serves
    code = ("import cmlp; m = cmlp.memory\n"
            "free, total = cmlp.cuda.mem_get_info()\n"
            "s = m.memory_stats('cuda'); ws = s['reserved_bytes.all.current']\n"
            "try:\n    m.caching_allocator_alloc(1 << 20, 'cuda'); print('served')\n"
            "except cmlp.OutOfMemoryError as e:\n"
            "    print('refused', str(e).startswith('CUDA out of memory. Tried to allocate'))\n"
            "m.set_per_process_memory_fraction(0.5, 'cuda')\n"
            "m.caching_allocator_delete(m.caching_allocator_alloc(1 << 20, 'cuda'))\n"
            "print(ws > 0, m.get_memory_limit('cuda') == int(0.5 * total))")
    env["PYTORCH_CUDA_ALLOC_CONF"] = "per_process_memory_fraction:0.0"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["refused", "True", "True", "True"], r.stdout


@needs_cuda
def test_torch_cuda_readers_open_no_gpu():
    """As torch's before CUDA starts, cmlp.cuda's statistics of a GPU not opened are 0, {} and []
    (opening it would reserve its GEMM workspace); once it is open they are cmlp.memory's."""
    code = ("import json, warnings, cmlp; c = cmlp.cuda; m = cmlp.memory\n"
            "before = [c.memory_reserved(), c.max_memory_allocated(0), c.memory_stats(), c.memory_snapshot(),"
            " cmlp._cmlp.cuda_device_opened(0)]\n"
            "c.empty_cache()\n"
            "before.append(cmlp._cmlp.cuda_device_opened(0))\n"
            "before.append(c.memory_allocated(c.device_count()))\n"  # as torch's: no index checked before CUDA starts
            "c.is_available()\n"  # (which starts it)
            "try:\n    c.memory_allocated(c.device_count())\nexcept RuntimeError as e:\n    before.append(str(e))\n"
            "model = cmlp.MLP([8, 4], device='cuda')\n"
            "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
            "    cached = c.memory_cached()\n"
            "after = [c.memory_reserved() == m.memory_reserved('cuda') > 0, c.memory_stats() == m.memory_stats('cuda'),"
            " len(c.memory_snapshot()) > 0, cached == m.memory_reserved('cuda'), w[0].category.__name__]\n"
            "print(json.dumps([before, after]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    before, after = json.loads(r.stdout.strip().splitlines()[-1])
    assert before[:7] == [0, 0, {}, [], False, False, 0] and "does not exist" in before[7], before
    assert after == [True, True, True, True, "FutureWarning"], after


def _on_two_gpus(code):
    """What `code`, run in a new process with two GPUs (the emulated backend makes two), printed
    last as JSON; skips where there are fewer (the code prints null then)."""
    env = dict(os.environ, CMLP_EMU_DEVICES="2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout.strip().splitlines()[-1])
    if said is None:
        pytest.skip("needs two GPUs")
    return said


@needs_cuda
def test_set_device_makes_cuda_name_that_gpu_in_this_thread():
    """As torch.cuda.set_device: "cuda", device None and model.cuda() name the current GPU; a
    `device` block puts the one before back; another thread starts at GPU 0; empty_cache returns
    every GPU's cache (what stays reserved is in use: the GEMM workspace). (Two GPUs; the emulated
    backend makes two.)"""
    code = ("import json, threading, cmlp; c = cmlp.cuda; m = cmlp.memory\n"
            "if c.device_count() < 2:\n    print(json.dumps(None)); raise SystemExit\n"
            "c.init()\n"
            "said = [c.current_device()]\n"
            "c.set_device(1)\n"
            "model = cmlp.MLP([8, 4], device='cuda')\n"
            "said += [c.current_device(), model.device, cmlp.MLP([8, 4]).cuda().device,\n"
            "         m.memory_allocated() == m.memory_allocated('cuda:1') > 0, c.memory_allocated(0)]\n"
            "with c.device(0):\n"
            "    said += [c.current_device(), cmlp.MLP([8, 4], device='cuda').device]\n"
            "    with c.device_of(model):\n"
            "        said.append(c.current_device())\n"
            "    said.append(c.current_device())\n"
            "said.append(c.current_device())\n"
            "other = []\n"
            "t = threading.Thread(target=lambda: other.append(c.current_device())); t.start(); t.join()\n"
            "del model\n"
            "c.empty_cache()\n"
            "said += [other] + [m.memory_reserved(d) - m.memory_allocated(d) for d in ('cuda:0', 'cuda:1')]\n"
            "try:\n    c.set_device(2)\nexcept RuntimeError as e:\n    said.append(str(e))\n"
            "said += [c.current_device(), c.is_initialized()]\n"
            "print(json.dumps(said))")
    said = _on_two_gpus(code)
    assert said[:6] == [0, 1, "cuda:1", "cuda:1", True, 0], said
    assert said[6:11] == [0, "cuda:0", 1, 0, 1], said
    assert said[11] == [0] and said[12:14] == [0, 0], said
    assert "cuda:2 does not exist" in said[14] and said[15] == 1, said
    assert said[16] is True, said  # is_initialized


@needs_cuda
def test_a_model_trains_on_its_gpu_whichever_is_current():
    """A model on cuda:1 trains, evaluates and moves with GPU 0 current in the thread (and one on
    cuda:0 with GPU 1 current): every kernel, GEMM and copy runs on the model's GPU with its
    memory (the emulated GPU refuses a kernel another GPU's memory is handed to), and the
    weights are those of the same run on GPU 0 alone."""
    code = ("import hashlib, json, numpy as np, cmlp; c = cmlp.cuda\n"
            "if c.device_count() < 2:\n    print(json.dumps(None)); raise SystemExit\n"
            "x = np.random.default_rng(0).integers(0, 256, (300, 64), dtype=np.uint8); y = np.arange(300) % 5\n"
            "def run(dev, current):\n"
            "    c.set_device(current)\n"
            "    m = cmlp.MLP([64, 32, 5], device=dev, seed=0)\n"
            "    t = cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=32, amp='fp16')\n"
            "    t.fit(x, y, epochs=2, progress=False)\n"
            "    acc = m.evaluate(x, y)['accuracy']\n"
            "    m.to('cuda:0' if dev == 'cuda:1' else 'cuda:1')\n"
            "    t.fit(x, y, epochs=1, progress=False)\n"
            "    w = b''.join(v.tobytes() for v in m.state_dict().values())\n"
            "    return [hashlib.sha1(w).hexdigest(), acc, m.device, c.current_device()]\n"
            "print(json.dumps([run('cuda:1', 0), run('cuda:0', 1)]))")
    one, zero = _on_two_gpus(code)
    assert one[0] == zero[0] and one[1] == zero[1], (one, zero)
    assert one[2:] == ["cuda:0", 0] and zero[2:] == ["cuda:1", 1], (one, zero)


@needs_cuda
def test_torch_cuda_memory_stats_of_a_gpu_not_used_once_another_is_open():
    """As torch's once CUDA has started, memory_stats of a GPU not used yet has every key, all 0,
    with the settings it will open with; reading it opens nothing. (Two GPUs; the emulated
    backend makes two.)"""
    code = ("import json, cmlp; c = cmlp.cuda; m = cmlp.memory\n"
            "m.configure('max_split_size_mb:20,per_process_memory_fraction:0.5')\n"
            "if c.device_count() < 2:\n    print(json.dumps(None)); raise SystemExit\n"
            "model = cmlp.MLP([8, 4], device='cuda:0')\n"
            "unused, nested = c.memory_stats(1), c.memory_stats_as_nested_dict('cuda:1')\n"
            "opened = cmlp._cmlp.cuda_device_opened(1)\n"
            "now = m.memory_stats('cuda:1')\n"
            "print(json.dumps([unused, nested, opened, now]))")
    said = _on_two_gpus(code)
    unused, nested, opened, now = said
    settings = ("max_split_size", "limit", "total_memory")
    assert not opened and set(unused) == set(now) and len(unused) > 100
    assert {k: v for k, v in unused.items() if v} == {k: now[k] for k in settings}
    assert unused["max_split_size"] == 20 << 20 and unused["limit"] == now["total_memory"] // 2
    assert nested["allocated_bytes"]["all"] == {"allocated": 0, "current": 0, "freed": 0, "peak": 0}
    assert nested["limit"] == unused["limit"] and nested["reserved_bytes_by_private_pools"] == {}


@needs_cuda
def test_torch_cuda_memory_snapshot_gives_every_open_gpus_segments():
    """torch.cuda.memory_snapshot(mempool_id=None, include_traces=True) covers every device:
    cmlp.cuda's gives the segments of each GPU opened here, device 0's first; cmlp.memory's
    gives one device's. A pool id other than (0, 0) (the only pool) gives none. (Two GPUs; the
    emulated backend makes two.)"""
    code = ("import json, cmlp; c = cmlp.cuda; m = cmlp.memory\n"
            "if c.device_count() < 2:\n    print(json.dumps(None)); raise SystemExit\n"
            "a = cmlp.MLP([8, 4], device='cuda:1'); b = cmlp.MLP([300, 4], device='cuda:0')\n"
            "every = c.memory_snapshot()\n"
            "ones = m.memory_snapshot('cuda:0') + m.memory_snapshot('cuda:1')\n"
            "said = [[s['device'] for s in every], every == ones, c.memory_snapshot((0, 0), False) == every,\n"
            "        c.memory_snapshot(mempool_id=(1, 2)), sum(s['allocated_size'] for s in every),\n"
            "        m.memory_allocated('cuda:0') + m.memory_allocated('cuda:1')]\n"
            "for bad in ('cuda:1', 0, (0,), (0.0, 0)):\n"
            "    try:\n        c.memory_snapshot(bad)\n    except TypeError as e:\n        said.append(str(e)[:10])\n"
            "print(json.dumps(said))")
    said = _on_two_gpus(code)
    devices = said[0]
    assert devices == sorted(devices) and set(devices) == {0, 1}, said
    assert said[1:4] == [True, True, []] and said[4] == said[5] > 0, said
    assert said[6:] == ["mempool_id"] * 4, said


_WORKSPACE_SCRIPT = """
import gc, json, os, sys, numpy as np, cmlp
final, bad = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"errors": []}
for value in bad:  # each fails the device's opening, and changes nothing
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = value
    try:
        cmlp.MLP([8, 4], device="cuda")
    except ValueError as e:
        out["errors"].append(str(e))
    out["opened"] = cmlp._cmlp.cuda_device_opened(0)
if final is None:
    os.environ.pop("CUBLASLT_WORKSPACE_SIZE", None)
else:
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = final
del_me = cmlp.MLP([8, 4], device="cuda")
del del_me
gc.collect()
out["workspace"] = cmlp.memory.memory_allocated("cuda")  # what the device holds once open
model = cmlp.MLP([784, 512, 256, 10], device="cuda")
out["capability"] = cmlp.cuda.get_device_capability()
rng = np.random.default_rng(0)
x = rng.standard_normal((257, 784)).astype(np.float32)
y = rng.integers(0, 10, 257)
t = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=257)
out["losses"] = [t.step(x, y) for _ in range(3)]
print(json.dumps(out))
"""

_BAD_WORKSPACE_SIZES = ["abc", "-8", "99999999999", "1e4", "4194305"]
_KERNEL_SLOTS = (256 << 10) + 33024  # the bias slot, and the loss kernel's parts (4096 doubles and a counter)


@needs_cuda
@pytest.mark.parametrize("value", [None, "0", "1500 ", "65536"])
def test_cublaslt_workspace_size_sets_the_first_streams_workspace(value):
    """The first stream's GEMM workspace is 8 MiB, 32 MiB on compute capability 9.x to 12.x
    (torch's cuBLAS sizes), the kernels' slots inside it; CUBLASLT_WORKSPACE_SIZE (KiB, 0 to
    4194304) gives cuBLASLt that much there instead, the slots on top; the second stream's 2 MiB
    come on top of either. A bad value fails the device's opening with a ValueError naming it,
    and the device opens once it is good; every size trains alike (with 0, cuBLASLt chooses
    algorithms that need no workspace and bias gradients are not split)."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLASLT_WORKSPACE_SIZE"}
    bad = _BAD_WORKSPACE_SIZES if value is None else []
    r = subprocess.run([sys.executable, "-c", _WORKSPACE_SCRIPT, json.dumps(value), json.dumps(bad)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["errors"]) == len(bad) and out.get("opened", False) is False, out
    for v, error in zip(bad, out["errors"]):
        assert "CUBLASLT_WORKSPACE_SIZE=" + v in error and "0 to 4194304" in error, (v, error)
    if value is None:
        first = (32 if 9 <= out["capability"][0] <= 12 else 8) * MIB
    else:
        first = (int(value) << 10) + _KERNEL_SLOTS
    assert out["workspace"] == -(-(first + 2 * MIB) // 512) * 512, out  # as the allocator rounds it
    assert np.isfinite(out["losses"]).all() and out["losses"][2] < out["losses"][0], out


_CONTEXT_SCRIPT = """
import ctypes, gc, json, os, sys, numpy as np, cmlp
emu = os.environ.get("CMLP_CUDA_LIBRARY", "")
if emu:  # the emulated driver's contexts
    lib = ctypes.CDLL(emu)
    lib.cmlp_emu_ctx_create.restype = lib.cmlp_emu_ctx_current.restype = ctypes.c_void_p
    lib.cmlp_emu_ctx_destroy.argtypes = [ctypes.c_void_p]
    create, current, destroy = lib.cmlp_emu_ctx_create, lib.cmlp_emu_ctx_current, lib.cmlp_emu_ctx_destroy
else:
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0

    def create(index):
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        assert cu.cuDeviceGet(ctypes.byref(dev), index) == 0
        assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
        return ctx.value

    def current():
        ctx = ctypes.c_void_p()
        assert cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value

    def destroy(ctx):
        assert cu.cuCtxDestroy_v2(ctypes.c_void_p(ctx)) == 0
assert cmlp.cuda.is_available()
last = "cuda:%d" % (cmlp.cuda.device_count() - 1)
mine = create(0)  # the caller's own context, current on this thread
kept = []
def check(what):
    kept.append([what, current() == mine])
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 20)).astype(np.float32)
y = rng.integers(0, 3, 64)
devices = list(dict.fromkeys(["cuda:0", last]))  # cuda:0 opened while the caller's context is current
for device in devices:
    model = cmlp.MLP([20, 16, 3], device=device, seed=0); check("MLP on " + device)
    t = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=8, shuffle=False)
    loss = t.step(x[:8], y[:8]); check("step")
    h = t.fit(x, y, epochs=3, progress=False); check("fit")
    p = model.predict(x); check("predict")
    cmlp.memory.memory_stats(device); check("memory_stats")
    cmlp.memory.empty_cache(device); check("empty_cache")
    cmlp.cuda.synchronize(device); check("synchronize")
    model.to("cpu"); check("to cpu")
    model.to(device); check("to " + device)
    del t, model
    gc.collect(); check("freed")
destroy(mine)  # the devices' streams and memory were never the caller's
for device in devices:
    model = cmlp.MLP([20, 16, 3], device=device, seed=1)
    t = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=8, shuffle=False)
    t.fit(x, y, epochs=2, progress=False)
    loss = t.step(x[:8], y[:8])
print(json.dumps([kept, bool(np.isfinite(loss)), bool((p == p).all())]))
"""


@needs_cuda
@pytest.mark.parametrize("keeps", ["0", "1"])
def test_a_call_puts_back_the_callers_cuda_context(keeps):
    """The thread's current CUDA context is what it was before each call (another library's
    context, on the same device as the model or another: torch's device guards put the current
    device back), and the model, whose work runs in its device's primary context, trains in
    between; once the caller destroys its context, the model still trains. The emulated backend
    makes two GPUs and refuses work queued from another context or a destroyed one; keeps="1"
    makes its cudaSetDevice leave another context of the same device current, so the backend
    makes the primary context current itself, also when it first opens the device."""
    env = dict(os.environ, CMLP_EMU_DEVICES="2", CMLP_EMU_SET_DEVICE_KEEPS_CONTEXT=keeps)
    r = subprocess.run([sys.executable, "-c", _CONTEXT_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    kept, finite, predicted = json.loads(r.stdout.strip().splitlines()[-1])
    assert [what for what, same_ctx in kept if not same_ctx] == [], kept
    assert finite and predicted


@needs_gpu
def test_out_of_memory_under_a_limit_is_detailed_and_the_gpu_keeps_working():
    M.empty_cache(CUDA)
    gc.collect()
    base = M.memory_allocated(CUDA)
    ooms = M.memory_stats(CUDA)["num_ooms"]
    limit = M.memory_reserved(CUDA) + 8 * MIB
    M.set_memory_limit(limit, CUDA)
    assert M.get_memory_limit(CUDA) == limit
    try:
        with pytest.raises(cmlp.OutOfMemoryError) as info:
            cmlp.MLP([4096, 1024, 10], device=CUDA)  # 16 MiB of parameters
        msg = str(info.value)
        assert isinstance(info.value, RuntimeError)
        # PyTorch's words first: code and people search for them
        head = ("cpu out of memory. Tried to allocate 18.00 MiB. The cpu" if CUDA == "cpu" else
                f"CUDA out of memory. Tried to allocate 18.00 MiB. GPU {cmlp.cuda._device_index(CUDA)}")
        assert msg.startswith(head + " has a total capacity of "), msg
        for needle in ("bytes requested", "allowed (the memory limit", "Of the allocated memory", "is allocated by cmlp",
                       "is reserved by cmlp but unallocated"):
            assert needle in msg, (needle, msg)
        s = M.memory_stats(CUDA)
        assert s["num_ooms"] == ooms + 1
        assert M.memory_allocated(CUDA) == base, "a failed model creation must free what it took"
        assert M.memory_reserved(CUDA) <= limit
        assert_stats_match_snapshot(CUDA)
    finally:
        M.set_memory_limit(None, CUDA)
    # the device keeps working: the same model now fits, and a small one trains like the CPU's
    big = cmlp.MLP([4096, 1024, 10], device=CUDA)
    del big
    sizes = [3, 5, 2]
    cpu, gpu = pair(sizes)
    _, x, y = margin_batch(sizes, 31)
    for m in (cpu, gpu):
        opt = cmlp.optim.Adam(m)
        for _ in range(3):
            opt.zero_grad()
            m.forward_backward(x, y)
            opt.step()
    assert_dicts_close(gpu.state_dict(), cpu.state_dict(), TOL, "after the OOM", elementwise=False)
    assert_stats_match_snapshot(CUDA)


@needs_gpu
def test_a_request_larger_than_the_device_is_out_of_memory_and_harmless():
    """A real device failure (no limit set): the driver's error must be cleared, not left to
    surface at the next kernel launch."""
    total = M.memory_stats(CUDA)["total_memory"]
    assert total > 0
    with pytest.raises(cmlp.OutOfMemoryError, match="out of memory"):
        M.caching_allocator_alloc(2 * total, CUDA)
    cpu, gpu = pair([7, 33, 1, 4])
    _, x, y = margin_batch([7, 33, 1, 4], 257)
    assert_loss_close(gpu.forward_backward(x, y), cpu.forward_backward(x, y), TOL)
    assert_dicts_close(gpu.grads(), cpu.grads(), TOL, "after a failed device allocation")
    assert_stats_match_snapshot(CUDA)


@needs_gpu
def test_auto_microbatch_under_a_limit_on_the_gpu():
    sizes, batch = [784, 512, 256, 10], 8192
    rng = np.random.default_rng(6)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    runs = {}
    for limited in (False, True):
        gc.collect()
        M.empty_cache(CUDA)
        base = M.memory_reserved(CUDA)
        model = cmlp.MLP(sizes, device=CUDA, seed=0)
        opt = cmlp.optim.Adam(model)
        plan = M.plan(sizes, batch, opt, device=CUDA)
        trainer = cmlp.Trainer(model, opt, batch_size=batch, shuffle=False)
        limit = base + plan.peak_bytes // 2
        if limited:
            M.set_memory_limit(limit, CUDA)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                history = trainer.fit(x, y, epochs=1, progress=False)
        finally:
            M.set_memory_limit(None, CUDA)
        runs[limited] = (model.state_dict(), history[0], [w for w in caught if w.category is cmlp.MemoryWarning],
                         limit)
        del model, opt, trainer
    weights, h, caught, limit = runs[True]
    assert h["microbatch_size"] < batch and len(caught) == 1, (h, [str(w.message) for w in caught])
    assert h["peak_memory_bytes"] <= limit
    assert runs[False][1]["microbatch_size"] == batch and runs[False][2] == []
    assert_dicts_close(weights, runs[False][0], TOL, "micro-batched vs whole batch", elementwise=False)
    assert h["loss"] == pytest.approx(runs[False][1]["loss"], rel=1e-5)
    assert_stats_match_snapshot(CUDA)


@needs_gpu
def test_expandable_segments_on_the_gpu_train_identically_and_give_pages_back():
    x, y = teacher_data(512, seed=8)

    def run():
        model = cmlp.MLP([784, 512, 256, 10], device=CUDA, seed=0)
        cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=128, shuffle=False).fit(x, y, epochs=1,
                                                                                       progress=False)
        assert_stats_match_snapshot(CUDA)
        return model.state_dict(), any(seg["is_expandable"] for seg in M.memory_snapshot(CUDA))

    plain, _ = run()
    gc.collect()
    M.configure("expandable_segments:True")
    M.empty_cache(CUDA)
    before = M.memory_reserved(CUDA)
    M.caching_allocator_delete(M.caching_allocator_alloc(3 * MIB, CUDA))
    if not any(seg["is_expandable"] for seg in M.memory_snapshot(CUDA)):
        pytest.skip("this GPU has no virtual memory API: expandable_segments is taken as off (its own test)")
    weights, expandable = run()
    assert expandable, "no expandable segment in the snapshot"
    assert same(weights, plain), "placement in memory changed the numbers"
    gc.collect()
    M.empty_cache(CUDA)
    assert M.memory_reserved(CUDA) <= before
    assert_stats_match_snapshot(CUDA)


_NO_VMM_SCRIPT = r"""
import gc, json, numpy as np, cmlp
M = cmlp.memory
M.configure("expandable_segments:True")
rng = np.random.default_rng(0)
x, y = rng.standard_normal((512, 784), dtype=np.float32), rng.integers(0, 10, 512)
layers = [784, 512, 256, 10]
M.caching_allocator_delete(M.caching_allocator_alloc(1 << 20, "cuda"))  # the device opens
gc.collect()
M.empty_cache("cuda")
base = M.memory_stats("cuda")
M.reset_peak_memory_stats("cuda")
model = cmlp.MLP(layers, device="cuda", seed=0)
opt = cmlp.optim.Adam(model)
cmlp.Trainer(model, opt, batch_size=100, shuffle=False).fit(x, y, epochs=1, progress=False)
s = M.memory_stats("cuda")
snap = M.memory_snapshot("cuda")
p = M.plan(layers, 100, opt, device="cuda", data_rows=len(x), data_dtype=x.dtype, shuffle=False)
out = {"expandable": any(seg["is_expandable"] for seg in snap), "config": M.get_config()["expandable_segments"],
       "reserved": s["reserved_bytes.all.peak"] - base["reserved_bytes.all.current"], "planned": p.reserved_bytes,
       "segments": s["segment.all.current"], "params": model.to("cpu")._c.get_params()[:4096].tolist()}
try:
    M.caching_allocator_alloc(1 << 45, "cuda")
except cmlp.OutOfMemoryError as e:
    out["oom"] = str(e)
print(json.dumps(out))
"""


@needs_cuda
def test_a_gpu_without_virtual_memory_takes_expandable_segments_as_off():
    """Where the device has no virtual memory API (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_
    SUPPORTED is 0: some vGPUs), expandable_segments:True is ignored, as PyTorch ignores it where
    it is unsupported: ordinary segments, the same numbers, a plan of those segments, and no advice
    to turn it on. (CMLP_EMU_NO_VMM=1 makes the emulated GPU such a device; a real one ignores it.)"""
    outs = {}
    for no_vmm in ("0", "1"):
        env = dict(os.environ, CMLP_EMU_NO_VMM=no_vmm)
        env.pop("CMLP_ALLOC_CONF", None)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        r = subprocess.run([sys.executable, "-c", _NO_VMM_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[no_vmm] = json.loads(r.stdout.strip().splitlines()[-1])
    has, lacks = outs["0"], outs["1"]
    assert has["config"] and lacks["config"]  # the setting stays as set
    if lacks["expandable"]:
        pytest.skip("this GPU has the virtual memory API (CMLP_EMU_NO_VMM is the emulated GPU's)")
    if not has["expandable"]:
        pytest.skip("this GPU has no virtual memory API")
    assert lacks["segments"] > 1 and has["segments"] <= 2, outs  # (expandable: one range per pool)
    assert lacks["params"] == has["params"]
    for out in outs.values():
        assert out["planned"] == out["reserved"], out
    assert "expandable_segments:True" not in lacks["oom"] and "out of memory" in lacks["oom"], lacks["oom"]


@needs_gpu
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_steady_state_steps_allocate_nothing(amp):
    model = cmlp.MLP([784, 512, 256, 10], device=CUDA, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=128, amp=amp)
    x, y = teacher_data(128, seed=7)
    xf = np.random.default_rng(7).standard_normal((128, 784)).astype(np.float32)

    def calls():
        trainer.step(x, y)
        model(xf)
        model.evaluate(x, y, batch_size=128)
        model.forward_backward(xf, y, amp=amp)
        model.zero_grad()

    calls()
    calls()
    gc.collect()
    first = M.memory_stats(CUDA)
    for i in range(20):
        calls()
        now = M.memory_stats(CUDA)
        for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "allocation.all.current",
                    "num_device_alloc"):
            assert now[key] == first[key], f"{key} changed at call {i}: {now[key]} != {first[key]}"


# One planned configuration per line, run in a fresh interpreter (a clean GPU allocator), as
# tests/test_planner.py does on the CPU.
_PLAN_RUN = r'''
import gc, json, os, sys
import numpy as np
import cmlp
M = cmlp.memory
DEV = os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda")
for layers, batch, amp, *val in json.loads(sys.argv[1]):
    vrows = val[0] if val else 0
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((2 * batch, layers[0]), dtype=np.float32)
    y = rng.integers(0, layers[-1], 2 * batch)
    vdata = (rng.integers(0, 256, (vrows, layers[0]), dtype=np.uint8), rng.integers(0, layers[-1], vrows)) \
        if vrows else None
    gc.collect()
    M.empty_cache(DEV)
    base = M.memory_stats(DEV)
    M.reset_peak_memory_stats(DEV)
    model = cmlp.MLP(layers, device=DEV, seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    cmlp.Trainer(model, opt, batch_size=batch, amp=amp, shuffle=False).fit(x, y, epochs=1, validation_data=vdata,
                                                                            progress=False)
    s = M.memory_stats(DEV)
    # fit keeps the epoch's data set on the GPU (x as given, y as int32; no order without shuffling):
    # the plan of a fit of len(x) samples counts it (the CPU reads it in place)
    p = M.plan(layers, batch, opt, amp, device=DEV, validation_rows=vrows, data_rows=len(x), data_dtype=x.dtype,
               shuffle=False)
    data = sum((n + 511) // 512 * 512 for n in (x.nbytes, 4 * len(y))) if DEV != "cpu" else 0
    assert p.breakdown["data"] == x.nbytes + 4 * len(y) if DEV != "cpu" else p.breakdown["data"] == 0
    print(json.dumps({"cfg": [layers, batch, amp], "planned": p.peak_bytes,
                      "measured": s["allocated_bytes.all.peak"] - base["allocated_bytes.all.current"],
                      "without_data": M.plan(layers, batch, opt, amp, device=DEV, validation_rows=vrows).peak_bytes,
                      "data": data, "breakdown": p.breakdown}), flush=True)
    del model, opt
'''
PLAN_GRID = [([784, 512, 256, 10], b, a) for b in (1, 32, 4096) for a in (None, "fp16", "bf16")]


def _plan_runs(script, grid):
    """Runs a planned-peak script over grid in a fresh interpreter (the allocator's defaults)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CMLP_ALLOC_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    r = subprocess.run([sys.executable, "-c", script, json.dumps(grid)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    runs = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(runs) == len(grid)
    return runs


@needs_gpu
def test_planned_peak_matches_the_measured_peak_on_the_gpu():
    runs = _plan_runs(_PLAN_RUN, PLAN_GRID)
    bad = [run for run in runs if abs(run["measured"] - run["planned"]) > 0.02 * run["measured"]]
    assert not bad, bad
    assert all(run["planned"] > run["without_data"] for run in runs if run["data"]), runs


@needs_gpu
def test_planned_peak_of_a_fit_with_validation_on_the_gpu():
    runs = _plan_runs(_PLAN_RUN, [([784, 512, 256, 10], b, a, 2500) for b in (32, 4096) for a in (None, "fp16")])
    bad = [run for run in runs if abs(run["measured"] - run["planned"]) > 0.02 * run["measured"]]
    assert not bad, bad
    assert all(run["breakdown"]["evaluation"] > 0 for run in runs)


# Trainer.step on a host batch: nothing but the model's own requests, so the plan is exact.
_STEP_PLAN_RUN = r'''
import gc, json, os, sys
import numpy as np
import cmlp
M = cmlp.memory
DEV = os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda")
for layers, batch, amp in json.loads(sys.argv[1]):
    rng = np.random.default_rng(batch)
    x = rng.integers(0, 256, (batch, layers[0]), dtype=np.uint8)
    y = rng.integers(0, layers[-1], batch)
    gc.collect()
    M.empty_cache(DEV)
    base = M.memory_allocated(DEV)
    M.reset_peak_memory_stats(DEV)
    model = cmlp.MLP(layers, device=DEV, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=batch, amp=amp)
    for _ in range(3):
        trainer.step(x, y)
    print(json.dumps({"cfg": [layers, batch, amp], "measured": M.max_memory_allocated(DEV) - base,
                      "planned": M.plan(layers, batch, "adam", amp, device=DEV).peak_bytes}), flush=True)
    del model, trainer
'''


@needs_gpu
def test_planned_peak_is_the_peak_of_training_steps_to_the_byte_on_the_gpu():
    grid = [([784, 512, 256, 10], b, a) for b in (1, 32, 1024) for a in (None, "fp16", "bf16")]
    grid.append(([7, 33, 1, 4], 31, "fp16"))
    runs = _plan_runs(_STEP_PLAN_RUN, grid)
    assert all(run["measured"] == run["planned"] for run in runs), runs


@needs_gpu
def test_a_plan_for_the_gpu_described_equals_the_plan_on_it():
    """plan's device_properties describe a GPU that need not be here: given this GPU's
    (cmlp.cuda.get_device_properties, or its major and total_memory as a dict), every plan and
    max_batch_size's answers are those made on it, opened."""
    if CUDA == "cpu":
        pytest.skip("the CPU standing in is no GPU to describe")
    props = cmlp.cuda.get_device_properties(CUDA)
    short = {"major": props.major, "total_memory": props.total_memory}
    model = cmlp.MLP([20, 33, 7], device=CUDA, seed=0)
    groups = cmlp.optim.Adam(model, param_groups=[{"params": ["fc1.weight"], "lr": 1e-4},
                                                  {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}])
    cases = [([784, 512, 256, 10], 32, dict()), ([784, 512, 256, 10], 4096, dict(amp="fp16")),
             ([784, 512, 256, 10], 1500, dict(amp="bf16", recompute=True, validation_rows=100, epochs=3)),
             ([784, 512, 256, 10], 8192, dict(accumulation_steps=3, data_rows=20000)),
             ([20, 33, 7], 77, dict(optimizer=groups, data_rows=500, data_dtype="float32")),
             ([784, 100, 10], 1, dict(optimizer="sgd", _budget=20 << 20, validation_rows=1000))]
    def fields(p):  # (but the GPU described, which the plan prints)
        return {k: v for k, v in vars(p).items() if k != "_described"}

    for sizes, batch, kw in cases:
        here = fields(M.plan(sizes, batch, device=CUDA, **kw))
        for described in (props, short):
            assert fields(M.plan(sizes, batch, device=CUDA, device_properties=described, **kw)) == here, (sizes, kw)
    for budget, kw in (("20MB", dict()), ("64MB", dict(amp="fp16", data_rows=5000)), ("1GB", dict(data_rows=9000))):
        assert M.max_batch_size([784, 512, 256, 10], budget, device=CUDA, device_properties=props, **kw) == \
            M.max_batch_size([784, 512, 256, 10], budget, device=CUDA, **kw), (budget, kw)


@needs_gpu
def test_plans_of_param_groups_a_resident_data_set_and_a_limit_hold_on_the_gpu():
    """On a GPU the plan counts the param groups' settings (in the device's memory) and the data
    set a fit copies there; a fit's history peak is that plan on top of what the device holds
    once open. Under a limit, a fit at max_batch_size's answer trains without running out of
    memory: the data set goes back to host memory when the step needs its room, and the first
    micro-batch leaves room for what the device holds (the limit counts it)."""
    sizes, rows = [784, 64, 10], 640
    rng = np.random.default_rng(12)
    x, y = rng.integers(0, 256, (rows, 784), dtype=np.uint8), rng.integers(0, 10, rows)
    gc.collect()
    M.empty_cache(CUDA)
    M.reset_peak_memory_stats(CUDA)
    base = M.memory_allocated(CUDA)
    model = cmlp.MLP(sizes, device=CUDA, seed=0)
    opt = cmlp.optim.Adam(model, param_groups=[{"params": ["fc1.weight"], "lr": 1e-4},
                                               {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}])
    history = cmlp.Trainer(model, opt, batch_size=32).fit(x, y, epochs=1, progress=False)
    p = M.plan(sizes, 32, opt, device=CUDA, data_rows=rows)
    assert M.max_memory_allocated(CUDA) - base == p.peak_bytes
    assert history[0]["peak_memory_bytes"] == p.peak_bytes + base
    off_host = CUDA != "cpu"  # (the CPU standing in keeps both in host memory)
    assert p.breakdown["data"] == off_host * rows * (784 + 4 + 8)  # the samples, their labels and their order
    # each part's scale, decay, momentum and beta2, a scale and a momentum for each step of a call (16), and
    # its coefficients
    each = (4 + 2 * cmlp._cmlp.MAX_RATES) * 8 + 5 * 4
    assert p.breakdown["optimizer_state"] == 2 * 4 * model.num_parameters() + off_host * len(opt._c_parts) * each
    del model, opt, history
    # under a limit of the plan's budget, with the data set too large to stay beside the step
    layers, acc = [3, 6, 2, 15], 4
    budget = 2232161  # where the data set fitted and then left the step no room
    n = M.max_batch_size(layers, budget, "sgd", device=CUDA, accumulation_steps=acc)
    x = rng.standard_normal((2 * n * acc, 3)).astype(np.float32)
    y = rng.integers(0, 15, len(x))
    # beside the data set that micro-batch does not fit: planned with it, max_batch_size answers it
    # staged from host memory, as the fits below run
    if off_host:
        assert M.plan(layers, n, "sgd", device=CUDA, accumulation_steps=acc, data_rows=len(x),
                      data_dtype=x.dtype).reserved_bytes > budget
    assert M.max_batch_size(layers, budget, "sgd", device=CUDA, accumulation_steps=acc, data_rows=len(x),
                            data_dtype=x.dtype) == n
    gc.collect()
    M.empty_cache(CUDA)
    held = M.memory_reserved(CUDA)
    ooms = M.memory_stats(CUDA)["num_ooms"]
    M.set_memory_limit(held + budget, CUDA)
    try:
        for auto in (False, True):
            model = cmlp.MLP(layers, device=CUDA, seed=0)
            trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01), batch_size=n, accumulation_steps=acc,
                                   auto_microbatch=auto)
            h = trainer.fit(x, y, epochs=1, progress=False)
            assert h[0]["microbatch_size"] == n and not trainer._c.data_resident()
            del model, trainer
        # a data set the limit cannot take is not copied (no out-of-memory at each epoch)
        big = rng.integers(0, 256, (4000, 784), dtype=np.uint8)
        M.set_memory_limit(held + 3 * 2**20, CUDA)
        staged = M.max_batch_size([784, 50], 3 * 2**20, device=CUDA)  # (the data set alone is 3 MiB)
        assert staged >= 64 and M.max_batch_size([784, 50], 3 * 2**20, device=CUDA, data_rows=len(big)) == staged
        model = cmlp.MLP([784, 50], device=CUDA, seed=0)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64)
        trainer.fit(big, rng.integers(0, 50, 4000), epochs=2, progress=False)
        assert not trainer._c.data_resident() and M.memory_stats(CUDA)["num_ooms"] == ooms
        del model, trainer
        # nor one whose allocated bytes fit but whose new segment does not: tried, no out-of-memory
        gc.collect()
        M.empty_cache(CUDA)
        mid = rng.standard_normal((16384, 100)).astype(np.float32)  # 6.25 MiB: a new 20 MiB segment
        model = cmlp.MLP([100, 300, 10], device=CUDA, seed=0)
        M.set_memory_limit(M.memory_reserved(CUDA) + 18 * 2**20, CUDA)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=8192)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cmlp.MemoryWarning)
            h = trainer.fit(mid, rng.integers(0, 10, len(mid)), epochs=1, progress=False)
        assert not trainer._c.data_resident() and trainer._c.oom_retries() == 0 and np.isfinite(h[0]["loss"])
        assert M.memory_stats(CUDA)["num_ooms"] == ooms
        del model, trainer
        # a first micro-batch whose reserved memory fits beside the device's own, not beside nothing
        # (the cache emptied: a free segment left by the cases above would serve the step whole)
        gc.collect()
        M.empty_cache(CUDA)
        layers, batch, acc = [8, 264], 1845, 4
        x = rng.integers(0, 256, (batch * acc, 8), dtype=np.uint8)
        y = rng.integers(0, 264, len(x))
        M.set_memory_limit(held + 16 * 2**20, CUDA)
        model = cmlp.MLP(layers, device=CUDA, seed=0)
        trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01, momentum=0.9), batch_size=batch,
                               accumulation_steps=acc)
        # halving from 1845 fits 461 (17 micro-batches of the 7380 a step has); 16 of 462 fit too
        with pytest.warns(cmlp.MemoryWarning, match="fits micro-batches of 462, not 1845"):
            trainer.fit(x, y, epochs=1, progress=False)
    finally:
        M.set_memory_limit(None, CUDA)
    assert M.memory_stats(CUDA)["num_ooms"] == ooms


@needs_cuda
def test_cli_budget_counts_what_the_device_holds_once_open(capsys):
    """`plan --budget` answers as a --memory-limit would: the device's standing workspace is part
    of the budget, and the batch it names trains under that limit."""
    from cmlp.__main__ import main

    layers, budget = [784, 16, 10], 12 * 2**20
    status = main(["plan", "--device", "cuda", "--layers", ",".join(map(str, layers)), "--budget", "12MB"])
    out = capsys.readouterr().out
    held = cmlp.memory.memory_reserved("cuda")
    n = cmlp.memory.max_batch_size(layers, budget - held, device="cuda") if budget > held else 0
    assert f"largest batch that fits in 12.00 MiB: {n}" in out
    run = cmlp.memory.plan(layers, 32, device="cuda", epochs=1).reserved_bytes  # --batch-size's default
    assert status == (0 if held + run <= budget else 1) and ("does not fit" in out) == bool(status)
    if held:
        assert f"cuda:0 holds {cmlp.memory._fmt(held)} of it once open" in out


_DATA_PARALLEL_SCRIPT = r"""
import json, os, sys
import numpy as np
import cmlp
dev = os.environ.get("CMLP_TEST_CUDA_DEVICE", "cuda")
cmlp.distributed.init_process_group("mpi" if dev == "cpu" else "nccl")
rng = np.random.default_rng(3)
x = rng.integers(0, 256, (64 * 5 + 7, 784), dtype=np.uint8)
y = rng.integers(0, 10, len(x))
out = {"world": cmlp.distributed.get_world_size(), "backend": cmlp.distributed.get_backend()}
for amp in ("", "fp16"):
    runs = []
    for distributed, zero in ((True, False), (False, False), (True, True)):
        model = cmlp.MLP([784, 512, 256, 10], device=dev, seed=0)
        opt = (cmlp.distributed.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam) if zero
               else cmlp.optim.Adam(model))
        trainer = cmlp.Trainer(model, opt, batch_size=64, amp=amp or None, seed=1, distributed=distributed)
        h = trainer.fit(x, y, epochs=3, progress=False)
        runs.append(([e["loss"] for e in h], model._c.get_params()))
    out[amp or "fp32"] = {"losses": [r[0] for r in runs],
                          "same_params": all(np.array_equal(runs[0][1], r[1]) for r in runs[1:])}
print(json.dumps(out))
"""


def _nccl_for_the_test():
    """The NCCL a subprocess loads: the emulated backend's own (it is NCCL too, over MPI, where it
    was built with MPI), else whichever cmlp.distributed finds; None where there is none."""
    import ctypes

    emulated = os.environ.get("CMLP_CUDA_LIBRARY")
    if emulated:
        return emulated if hasattr(ctypes.CDLL(emulated), "ncclAllReduce") else None
    return cmlp.distributed._nccl_library() if cmlp.distributed.is_nccl_available() else None


@needs_gpu
def test_data_parallel_training_in_a_group_of_one_equals_training_alone():
    """The data-parallel step on the GPU: NCCL's all-reduce of the gradients on the stream, inside
    the step fit captures and replays, here in a group of one rank (no MPI launcher): the sum of one
    is the gradients themselves, so the run equals the run without a group bit for bit, in fp32
    and fp16; so does a run whose optimizer state is sharded (its one part gathered by an NCCL
    broadcast in the captured step). tests/test_distributed.py runs groups of 2 and 3 on the
    emulated backend."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not DRY_RUN:
        nccl = _nccl_for_the_test()
        if nccl is None:
            pytest.skip("no NCCL to load (set CMLP_NCCL_LIBRARY, or install the nvidia-nccl wheel)")
        env["CMLP_NCCL_LIBRARY"] = nccl
    r = subprocess.run([sys.executable, "-c", _DATA_PARALLEL_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["world"] == 1 and out["backend"] == ("mpi" if DRY_RUN else "nccl")
    for amp in ("fp32", "fp16"):
        assert out[amp]["same_params"], out
        assert out[amp]["losses"][0] == out[amp]["losses"][1] == out[amp]["losses"][2]


_FORK_SCRIPT = FORKED + r"""
import json, os, sys
import numpy as np
import cmlp
x = np.random.default_rng(0).random((5, 8), dtype=np.float32)
y = np.arange(5, dtype=np.int64) % 4
model = cmlp.MLP([8, 16, 4], device="cuda", seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=5)
trainer.fit(x, y, epochs=2, progress=False)  # a captured step too
before = model.forward(x)
def in_child():
    global trainer, model
    said = {}
    for name, call in (("forward", lambda: model.forward(x)), ("fit", lambda: trainer.fit(x, y, progress=False)),
                       ("new", lambda: cmlp.MLP([8, 4], device="cuda")),
                       ("stats", lambda: cmlp.memory.memory_allocated("cuda")),
                       ("empty_cache", lambda: cmlp.memory.empty_cache("cuda"))):
        try:
            call()
            said[name] = "ran"
        except RuntimeError as e:
            said[name] = str(e)
    cmlp.empty_cache()  # the default device of a child that cannot use CUDA is the CPU
    said["default_device"] = cmlp.memory.memory_stats()["allocated_bytes.all.current"] >= 0
    said["available"] = cmlp.cuda.is_available()
    said["cpu"] = float(cmlp.MLP([8, 4], seed=0).forward(x).sum())
    del trainer, model  # what the parent's memory and graphs hold is left alone
    return said
child, code = forked(in_child)
after = model.forward(x)
trainer.fit(x, y, epochs=1, progress=False)
print(json.dumps({"child": child, "exit": code, "same": bool(np.array_equal(before, after))}))
"""


@needs_cuda
def test_a_child_forked_after_cuda_started_is_refused_cuda_and_the_parent_works_on():
    """The CUDA driver does not survive fork(): in the child every use of CUDA (a model already on
    the GPU, a new one, the allocator's statistics) is a RuntimeError that says to use 'spawn',
    nothing waits or crashes, the parent's objects go away without touching the device, and the
    CPU works. The parent goes on training on the GPU."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exit"] == 0 and out["same"], out
    child = out["child"]
    for name in ("forward", "fit", "new", "stats", "empty_cache"):
        assert "forked" in child[name] and "'spawn'" in child[name], (name, child[name])
    assert child["available"] is True  # as torch: the devices are there, this process cannot use them
    assert child["default_device"]
    assert np.isfinite(child["cpu"])


@needs_cuda
def test_device_properties_are_the_gpus_as_torch_reads_them():
    p = cmlp.cuda.get_device_properties()
    assert isinstance(p.name, str) and p.name and p.major >= 7 and p.multi_processor_count > 0
    assert p.warp_size == 32 and p.max_threads_per_multi_processor > 0 and p.L2_cache_size > 0
    assert p.total_memory == M.mem_get_info("cuda:0")[1]
    assert cmlp.cuda.get_device_name("cuda:0") == cmlp.cuda.get_device_name(0) == p.name
    assert cmlp.cuda.get_device_capability() == (p.major, p.minor)
    assert f"total_memory={p.total_memory // 2**20}MB" in repr(p)
    with pytest.raises(AssertionError, match="Invalid device id"):
        cmlp.cuda.get_device_properties(cmlp.cuda.device_count())
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        t = torch.cuda.get_device_properties(0)
        assert (p.name, p.major, p.minor, p.total_memory, p.multi_processor_count) == \
            (t.name, t.major, t.minor, t.total_memory, t.multi_processor_count)


_PROCESSES_SCRIPT = r"""
import json, os
import cmlp
listing = cmlp.cuda.list_gpu_processes()
cmlp.memory.set_memory_limit(64 << 20, "cuda")
try:
    cmlp.MLP([4096, 8192, 10], device="cuda")
    message = ""
except cmlp.OutOfMemoryError as e:
    message = str(e)
print(json.dumps({"listing": listing, "oom": message, "pid": os.getpid(), "name": cmlp.cuda.get_device_name()}))
"""


@needs_cuda
@pytest.mark.parametrize("mig", ["", "1"])
def test_out_of_memory_names_the_processes_that_hold_the_gpu_as_torch(mig):
    """As torch's out-of-memory message: the other processes on the GPU and this process's whole
    use, from NVML; and torch.cuda.list_gpu_processes. The emulated NVML adds a process holding
    1 GiB (CMLP_EMU_NVML_PROCESSES); on a GPU, NVML reports what runs there. On a MIG instance
    (CMLP_EMU_MIG=1) NVML knows the device by its "MIG-" UUID."""
    env = dict(os.environ, CMLP_EMU_NVML_PROCESSES="4242:1073741824", CMLP_EMU_MIG=mig)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _PROCESSES_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "out of memory" in out["oom"], out
    if out["listing"].startswith("NVML"):
        pytest.skip("NVML (libnvidia-ml.so.1) is not on this machine")
    lines = out["listing"].splitlines()
    # the advice (for parameters: what the batch does not change) is whole
    assert out["oom"].count("ZeroRedundancyOptimizer shards it) make them fit.") == 1, out["oom"]
    assert lines[0].startswith("GPU:")
    if lines[1:] == ["no processes are running"]:  # NVML may show a container no process at all
        return
    assert all(line.startswith("process ") and line.endswith(" MB GPU memory") for line in lines[1:]), lines
    assert "memory in use." in out["oom"] or "this process has" in out["oom"], out["oom"]
    if out["name"].startswith("cmlp emulated GPU"):
        assert f"process {4242:>10d} uses     1024.000 MB GPU memory" in lines
        assert any(line.startswith(f"process {out['pid']:>10d} uses") for line in lines)
        # where PyTorch's message has them: after the device's free memory
        assert " is free. Process 4242 has 1024.00 MiB memory in use. Including memory outside " \
               "cmlp's allocator, this process has" in out["oom"], out["oom"]


_COUNT_THEN_FORK_SCRIPT = FORKED + r"""
import json, os, sys
import numpy as np
import cmlp
from cmlp import _cmlp
said = {"count": cmlp.cuda.device_count(), "nvml": _cmlp.nvml_devices()}
os.environ["CMLP_NVML_BASED_CUDA_CHECK"] = "1"
said["available"] = cmlp.cuda.is_available()
said["started"] = _cmlp.cuda_started()
x = np.random.default_rng(0).random((6, 8), dtype=np.float32)
y = np.arange(6, dtype=np.int64) % 4
def train():
    model = cmlp.MLP([8, 16, 4], device="cuda", seed=0)
    cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=3).fit(x, y, epochs=2, progress=False)
    return model.to("cpu")._c.get_params()
params, said["child_exit"] = forked(lambda: train().tolist())
said["same"] = params is not None and params == train().tolist()
said["cuda_count"] = _cmlp.cuda_device_count()
said["count_after"] = cmlp.cuda.device_count()
del os.environ["CMLP_NVML_BASED_CUDA_CHECK"]
print(json.dumps(said))
"""


@needs_cuda
def test_counting_the_gpus_leaves_cuda_to_children_forked_afterwards():
    """As torch.cuda's: device_count() asks NVML, which starts nothing, and so does is_available()
    with CMLP_NVML_BASED_CUDA_CHECK=1; a child forked afterwards trains on the GPU as the parent
    does. Once CUDA is started, its own count answers, and NVML's agreed with it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", _COUNT_THEN_FORK_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    said = json.loads(r.stdout.strip().splitlines()[-1])
    if said["nvml"] is None:
        pytest.skip("NVML (libnvidia-ml.so.1) is not on this machine: CUDA counts, and starts")
    assert said["available"] and not said["started"], said
    assert said["child_exit"] == 0 and said["same"], said
    assert said["count"] == said["cuda_count"] == said["count_after"] == len(said["nvml"]) >= 1, said


@needs_cuda
def test_cuda_visible_devices_selects_what_nvml_counts():
    code = ("import json, cmlp\nfrom cmlp import _cmlp\n"
            "print(json.dumps([cmlp.cuda.device_count(), _cmlp.cuda_started(), _cmlp.nvml_devices()]))")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    def count(visible):
        r = subprocess.run([sys.executable, "-c", code], env=dict(env, CUDA_VISIBLE_DEVICES=visible),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        n, started, uuids = json.loads(r.stdout.strip().splitlines()[-1])
        if uuids is None:
            pytest.skip("NVML (libnvidia-ml.so.1) is not on this machine: CUDA counts, and starts")
        assert not started
        return n, uuids

    n, uuids = count("0")
    assert n == 1 and uuids
    assert count(f"0,{len(uuids)}")[0] == 1  # past the last GPU: the list ends
    assert count(str(len(uuids)))[0] == 0
    assert count(uuids[-1])[0] == 1
    assert count(uuids[0][:-4] + "," + uuids[0])[0] == 0  # the same GPU twice


@needs_gpu
def test_a_loss_scale_whose_reciprocal_is_subnormal_trains_as_on_the_cpu():
    # past 2**126, 1/scale is a subnormal float: the GPU keeps it, the CPU (which flushes
    # subnormals) takes it as a normal float times 2**-64; both must unscale to the gradients
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 12), dtype=np.float32), rng.integers(0, 4, 64)
    params = {}
    for dev in ("cpu", CUDA):
        model = cmlp.MLP([12, 9, 4], seed=0, device=dev)
        scaler = cmlp.amp.GradScaler(init_scale=2.0**127, growth_interval=1)
        cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.1), batch_size=8, scaler=scaler).fit(x, y, epochs=1,
                                                                                           progress=False)
        assert scaler.get_scale() == 2.0**127  # growth to 2**128 is inf: refused, no step skipped
        params[dev] = model.to("cpu")._c.get_params()
    start = cmlp.MLP([12, 9, 4], seed=0)._c.get_params()
    assert not np.array_equal(params["cpu"], start)
    assert rel_err(params[CUDA], params["cpu"]) <= TOL
