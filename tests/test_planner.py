"""cmlp.memory.plan against the allocator: the predicted peak must equal what a training run
measures (within 2%), over a grid of layer sizes, batch sizes, optimizers and precisions, on the
CPU. The grid runs in one fresh interpreter (a clean allocator, default settings); the reserved
peak is checked in a fresh interpreter per configuration. Also: the breakdown's categories and
values, argument validation, max_batch_size, and `python -m cmlp plan`.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import cmlp

M = cmlp.memory
DEV = "cpu"
MIB = 1 << 20

# where this process imported cmlp from (an in-place build or site-packages): subprocesses use the same
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))

LAYERS = ([784, 512, 256, 10], [100, 300, 10], [784, 1024, 1024, 1024, 10])
BATCHES = (1, 32, 500, 2048)
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")
AMPS = (None, "fp16", "bf16")
GRID = [(layers, b, o, a, False) for layers in LAYERS for b in BATCHES for o in OPTIMIZERS for a in AMPS]
# recompute=True keeps each micro-batch's input and recomputes layer outputs
GRID += [(layers, b, o, a, True) for layers in LAYERS for b in BATCHES for o in OPTIMIZERS for a in AMPS]
# two micro-batches per optimizer step: the step's buffers cannot share the gradients
GRID += [(layers, b, "adam", a, False, 2) for layers in LAYERS for b in (1, 32) for a in AMPS]
# AMSGrad's third state buffer
GRID += [(layers, b, "adam_amsgrad", a, False) for layers in LAYERS[:2] for b in (1, 500) for a in (None, "fp16")]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CMLP_ALLOC_CONF", None)  # the allocator's defaults, the same for the run and its plan
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


def _python(code, args=(), timeout=300):
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(),
                       timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _status(layers, batch, budget, optimizer="adam", amp=None, recompute=False, accumulation_steps=1, **kw):
    """plan --budget's exit status: 0 where the run as planned fits the budget (one epoch's
    reserved memory, a limit's view), 1 where it does not."""
    return int(M.plan(layers, batch, optimizer, amp, recompute, accumulation_steps=accumulation_steps, epochs=1,
                      **kw).reserved_bytes > budget)


def _cli(args, cwd, timeout=60):
    return subprocess.run([sys.executable, "-m", "cmlp", "plan", *args], capture_output=True, text=True, cwd=cwd,
                          env=_env(), timeout=timeout)


# One training run per configuration: fit one epoch of two batches (no validation data:
# evaluation has buffers of its own), measured from a clean allocator state.
_RUN = r'''
import gc, json, sys
import numpy as np
import cmlp
M = cmlp.memory

def make_optimizer(model, name):
    if name.startswith("adam"):
        return cmlp.optim.Adam(model, lr=1e-3, amsgrad=name == "adam_amsgrad")
    return cmlp.optim.SGD(model, lr=0.01, momentum=0.9 if name == "sgd_momentum" else 0.0)

def run(layers, batch, opt_name, amp, recompute=False, accumulation=1):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((2 * batch * accumulation, layers[0]), dtype=np.float32)
    y = rng.integers(0, layers[-1], 2 * batch * accumulation)
    gc.collect()
    M.empty_cache("cpu")
    base = M.memory_stats("cpu")
    held_before = M.memory_breakdown("cpu")
    M.reset_peak_memory_stats("cpu")
    model = cmlp.MLP(layers, seed=0)
    opt = make_optimizer(model, opt_name)
    trainer = cmlp.Trainer(model, opt, batch_size=batch, accumulation_steps=accumulation, amp=amp,
                           recompute=recompute, shuffle=False)
    trainer.fit(x, y, epochs=1, progress=False)
    s = M.memory_stats("cpu")
    # fit hands its step's buffers back at its end; a step keeps them, to be seen
    trainer.step(x[:batch * accumulation], y[:batch * accumulation])
    held = {k: v - held_before.get(k, 0) for k, v in M.memory_breakdown("cpu").items()}
    del trainer
    p = M.plan(layers, batch, opt, amp, recompute, accumulation_steps=accumulation)
    out = {"layers": layers, "batch": batch, "optimizer": opt_name, "amp": amp, "recompute": recompute,
           "accumulation": accumulation, "planned": p.peak_bytes, "in_gradients": p.in_gradients,
           "measured": s["allocated_bytes.all.peak"] - base["allocated_bytes.all.current"],
           "planned_reserved": p.reserved_bytes, "reserved_before": base["reserved_bytes.all.current"],
           "max_reserved": s["reserved_bytes.all.peak"],
           "requested": s["requested_bytes.all.peak"] - base["requested_bytes.all.current"],
           "breakdown": p.breakdown, "plan_optimizer": p.optimizer, "num_parameters": model.num_parameters(),
           "held": {k: v for k, v in held.items() if v}}
    del model, opt
    return out

for cfg in json.loads(sys.argv[1]):
    print(json.dumps(run(*cfg)), flush=True)
'''


def _key(layers, batch, opt, amp, recompute, accumulation=1):
    return (tuple(layers), batch, opt, amp, recompute, accumulation)


@pytest.fixture(scope="module")
def grid_runs():
    out = _python(_RUN, [json.dumps(GRID)])
    runs = [json.loads(line) for line in out.splitlines()]
    assert len(runs) == len(GRID)
    return {_key(r["layers"], r["batch"], r["optimizer"], r["amp"], r["recompute"], r["accumulation"]): r
            for r in runs}


def _id(cfg):
    layers, b, o, a, rc, acc = (*cfg, 1)[:6]
    return (f"{'-'.join(map(str, layers))}-b{b}-{o}-{a or 'fp32'}{'-recompute' if rc else ''}"
            f"{f'-accumulate{acc}' if acc > 1 else ''}")


@pytest.mark.parametrize("cfg", GRID, ids=[_id(c) for c in GRID])
def test_planned_peak_matches_the_measured_peak(grid_runs, cfg):
    r = grid_runs[_key(*cfg)]
    assert abs(r["measured"] - r["planned"]) <= 0.02 * r["measured"], r
    # the categories are the bytes the run requests: at the peak every buffer is held
    assert r["requested"] == sum(r["breakdown"].values()), r


@pytest.mark.parametrize("cfg", GRID, ids=[_id(c) for c in GRID])
def test_breakdown_categories_and_values(grid_runs, cfg):
    layers, b, opt, amp, recompute, accumulation = (*cfg, 1)[:6]
    r = grid_runs[_key(*cfg)]
    d, n = r["breakdown"], r["num_parameters"]
    assert list(d) == ["parameters", "gradients", "optimizer_state", "half_weights", "activations", "workspace",
                       "data", "evaluation"]
    assert d["evaluation"] == 0  # no validation planned
    assert n == sum(i * o + o for i, o in zip(layers, layers[1:]))
    assert r["plan_optimizer"] == ("adam" if opt.startswith("adam") else "sgd")
    assert d["parameters"] == 4 * n
    assert d["gradients"] == 4 * n
    assert d["optimizer_state"] == {"adam": 8, "adam_amsgrad": 12, "sgd": 0, "sgd_momentum": 4}[opt] * n
    assert d["half_weights"] == (2 * n if amp else 0)
    assert d["data"] == 0  # float32 C-contiguous input is read in place on the CPU

    def a64(v):
        return (v + 63) // 64 * 64

    widest = max(layers[1:])
    # the gradient flows back through two buffers in turn: the logits' and every second layer's
    # input gradient below it in one, the others in the other
    # (down to layer 2's input: layer 1's input gradient is written over the outputs of layers
    # 2 and up and the buffer after them, which is made wide enough)
    top = len(layers) - 1
    low = 2 if top > 1 else 1
    grads = [max([layers[i] for i in range(top, low - 1, -1) if (top - i) % 2 == j], default=1) for j in (0, 1)]
    if top > 1:
        grads[(top - 1) % 2] = max(grads[(top - 1) % 2], layers[1] - sum(layers[2:]))
    scalars = -(4 * n) % 64 + 640  # the device scalars after the gradients, which are padded to 64 bytes
    if recompute and amp:  # only the half-precision input is kept, and the float32 logits
        assert d["activations"] == a64(b * layers[0] * 2) + a64(b * layers[-1] * 4)
        assert d["workspace"] > 0
    elif recompute:  # checked against the measured run above; less than storing every layer's output
        stored = sum(a64(b * s * 4) for s in layers) + 2 * a64(b * widest * 4) + a64(b * 4) + scalars
        assert 0 < d["activations"] + d["workspace"] <= stored
    elif amp is None:  # every layer's output (the input included) for backward; two gradient buffers; labels
        # With one micro-batch per step, all but the input and layer 1's input (which the input
        # gradient of layer 1 replaces) lie in the first layer's weight gradient when they fit:
        # the step writes that gradient last. The CPU's amp keeps them apart (its GEMMs read fp32
        # copies of the half weights).
        inside = sum(a64(b * s * 4) for s in layers[2:]) + sum(a64(b * g * 4) for g in grads)
        if accumulation == 1 and len(layers) > 2 and inside <= 4 * layers[0] * layers[1]:
            assert r["in_gradients"] == inside
            assert d["activations"] == a64(b * layers[0] * 4) + a64(b * layers[1] * 4)
            assert d["workspace"] == a64(b * 4) + scalars
        else:
            assert r["in_gradients"] == 0
            assert d["activations"] == sum(a64(b * s * 4) for s in layers)
            assert d["workspace"] == sum(a64(b * g * 4) for g in grads) + a64(b * 4) + scalars
    else:  # layer inputs in half precision, logits in float32
        assert d["activations"] == sum(a64(b * s * 2) for s in layers[:-1]) + a64(b * layers[-1] * 4)
        assert d["workspace"] > 0
    assert all(v >= 0 for v in d.values())


@pytest.mark.parametrize("cfg", GRID, ids=[_id(c) for c in GRID])
def test_what_the_run_holds_is_the_plans_breakdown(grid_runs, cfg):
    """memory_breakdown() after the run, by what each block holds, against the plan: the same
    parameters, optimizer state and half-precision weights, and the rest (gradients with the
    device scalars, the activations' block) adding up to the plan's gradients, activations and
    workspace."""
    r = grid_runs[_key(*cfg)]
    d, held = r["breakdown"], dict(r["held"])
    assert held.pop("parameters") == d["parameters"]
    assert held.pop("optimizer state", 0) == d["optimizer_state"]
    assert held.pop("half-precision weights", 0) == d["half_weights"]
    assert held.pop("gradients") >= d["gradients"]
    assert held and all(k.startswith("activations") for k in held), held  # nothing else, nothing unnamed
    assert r["requested"] == sum(r["held"].values()), "everything the run requested is still held, and named"


# fresh interpreters: every layer set, batch size, optimizer and precision at least once
RESERVED = [([784, 512, 256, 10], 32, "adam", None, False), ([784, 512, 256, 10], 2048, "sgd", "fp16", False),
            ([784, 512, 256, 10], 1, "sgd_momentum", "bf16", False),
            ([100, 300, 10], 500, "sgd_momentum", None, False),
            ([100, 300, 10], 2048, "adam", "bf16", False), ([100, 300, 10], 1, "sgd", "fp16", False),
            ([784, 1024, 1024, 1024, 10], 2048, "sgd_momentum", None, False),
            ([784, 1024, 1024, 1024, 10], 500, "adam", "fp16", False),
            ([784, 1024, 1024, 1024, 10], 32, "sgd", "bf16", False),
            ([784, 1024, 1024, 1024, 10], 2048, "adam", None, True)]


def test_planned_reserved_matches_a_fresh_process():
    procs = [subprocess.Popen([sys.executable, "-c", _RUN, json.dumps([cfg])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for cfg in RESERVED]
    for cfg, p in zip(RESERVED, procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        r = json.loads(out)
        assert r["reserved_before"] == 0, r  # nothing is reserved before the model
        assert abs(r["max_reserved"] - r["planned_reserved"]) <= 0.02 * r["max_reserved"], (cfg, r)
        assert abs(r["measured"] - r["planned"]) <= 0.02 * r["measured"], (cfg, r)


def test_plan_accepts_optimizer_objects_and_names():
    model = cmlp.MLP([20, 30, 5], seed=0)
    for opt, name in ((cmlp.optim.Adam(model), "adam"), (cmlp.optim.SGD(model, lr=0.1), "sgd"),
                      (cmlp.optim.SGD(model, lr=0.1, momentum=0.9), "sgd_momentum"),
                      (cmlp.optim.Adam(model, amsgrad=True), "adam_amsgrad"),
                      (cmlp.optim.AdamW(model, amsgrad=True), "adamw_amsgrad")):
        by_object, by_name = M.plan([20, 30, 5], 16, opt), M.plan([20, 30, 5], 16, name)
        assert by_object.breakdown == by_name.breakdown
        assert by_object.peak_bytes == by_name.peak_bytes and by_object.reserved_bytes == by_name.reserved_bytes
    p = M.plan((20, 30, 5), 16)
    assert p.layer_sizes == [20, 30, 5] and p.batch_size == 16 and p.optimizer == "adam" and p.amp is None
    assert p.device == "cpu" and p.peak_bytes <= p.reserved_bytes
    assert p.peak_bytes >= sum(p.breakdown.values())  # allocator rounding only adds
    text = str(p)
    for name in ("parameters", "gradients", "optimizer state", "activations", "workspace", "peak allocated",
                 "peak reserved", "20-30-5", "batch 16"):
        assert name in text, text


def test_the_scaler_lives_in_the_device_scalars_a_model_always_keeps():
    with_scaler = M.plan([784, 512, 256, 10], 64, "adam", "fp16")
    without = M.plan([784, 512, 256, 10], 64, "adam", "fp16", scaler=False)
    assert with_scaler.breakdown["workspace"] == without.breakdown["workspace"]
    assert M.plan([784, 512, 256, 10], 64, "adam", "bf16").breakdown["workspace"] == without.breakdown["workspace"]


@pytest.mark.parametrize("layers", [[784], [], [784, 0, 10], [-1, 10], [784, 10, -5]])
def test_plan_rejects_bad_layer_sizes(layers):
    with pytest.raises(ValueError, match="layer"):
        M.plan(layers, 32)


@pytest.mark.parametrize("layers", ["784,10", 784, [784.0, 10], [784, None]])
def test_plan_rejects_layer_sizes_of_the_wrong_type(layers):
    with pytest.raises((TypeError, ValueError), match="layer"):
        M.plan(layers, 32)


@pytest.mark.parametrize("batch", [0, -1, 1.5, "32", None, True])
def test_plan_rejects_bad_batch_sizes(batch):
    with pytest.raises(ValueError, match="batch_size"):
        M.plan([784, 10], batch)


@pytest.mark.parametrize("opt", ["rmsprop", "Adam", "", None, 2])
def test_plan_rejects_bad_optimizers(opt):
    with pytest.raises(ValueError, match="optimizer"):
        M.plan([784, 10], 32, optimizer=opt)


@pytest.mark.parametrize("amp", ["fp8", "FP16", "float16", "", True])
def test_plan_rejects_bad_amp(amp):
    with pytest.raises(ValueError, match="amp"):
        M.plan([784, 10], 32, amp=amp)


def test_plan_rejects_unknown_devices():
    with pytest.raises(ValueError, match="device"):
        M.plan([784, 10], 32, device="tpu")


def test_plan_of_a_layer_too_wide_is_refused_or_exact():
    # a size the model cannot have is refused, never planned as some other size
    wide = 2 ** 31
    try:
        p = M.plan([wide, 10], 1, "sgd")
    except ValueError:
        return
    assert p.breakdown["parameters"] == 4 * (wide * 10 + 10), p.breakdown


BUDGETS = [0, 1, MIB, 2 * MIB, 3 * MIB, 22 * MIB, 23 * MIB, 40 * MIB, 64 * MIB, 100 * MIB, 256 * MIB, 1 << 30]


@pytest.mark.parametrize("layers, opt, amp", [([784, 512, 256, 10], "adam", None), ([100, 300, 10], "sgd", "bf16"),
                                              ([784, 1024, 1024, 1024, 10], "sgd_momentum", "fp16")])
def test_max_batch_size_is_monotonic_and_consistent(layers, opt, amp):
    sizes = [M.max_batch_size(layers, b, opt, amp) for b in BUDGETS]
    assert sizes == sorted(sizes), list(zip(BUDGETS, sizes))
    for budget, n in zip(BUDGETS, sizes):
        if n == 0:
            assert M.plan(layers, 1, opt, amp).reserved_bytes > budget
            continue
        assert M.plan(layers, n, opt, amp).reserved_bytes <= budget < M.plan(layers, n + 1, opt, amp).reserved_bytes


@pytest.mark.parametrize("layers, budget", [([784, 2048, 2048, 10], 110 * MIB), ([784, 2048, 2048, 10], 96 * MIB),
                                            ([64, 4096, 10], 40 * MIB), ([100, 300, 10], 21 * MIB)])
def test_max_batch_size_is_the_largest_even_where_reserved_memory_dips(layers, budget):
    """Reserved memory can fall as the batch grows (a request that reaches 10 MiB gets a segment of
    its own size instead of a 20 MiB one): the answer is still the largest batch that fits, checked
    against every batch up to where the allocated peak alone exceeds the budget."""
    n = M.max_batch_size(layers, budget)
    top = 1
    while M.plan(layers, top + 1).peak_bytes <= budget:
        top += 1
    fitting = [b for b in range(1, top + 1) if M.plan(layers, b).reserved_bytes <= budget]
    assert n == (fitting[-1] if fitting else 0)


def test_max_batch_size_is_zero_when_nothing_fits():
    one = M.plan([784, 512, 256, 10], 1).reserved_bytes
    assert M.max_batch_size([784, 512, 256, 10], 0) == 0
    assert M.max_batch_size([784, 512, 256, 10], M.plan([784, 512, 256, 10], 1).peak_bytes - 1) == 0
    assert M.max_batch_size([784, 512, 256, 10], one) >= 1


def test_max_batch_size_reads_sizes_and_rejects_bad_budgets():
    assert M.max_batch_size([784, 512, 256, 10], "2GB") == M.max_batch_size([784, 512, 256, 10], 2 << 30)
    assert M.max_batch_size([784, 512, 256, 10], "64 MiB", "sgd") == M.max_batch_size([784, 512, 256, 10],
                                                                                        64 * MIB, "sgd")
    for bad in (-1, "lots", "2XB", "-5MB"):
        with pytest.raises(ValueError):
            M.max_batch_size([784, 512, 256, 10], bad)
    with pytest.raises(ValueError, match="optimizer"):
        M.max_batch_size([784, 512, 256, 10], MIB, optimizer="rmsprop")


# ---- python -m cmlp plan ----


def test_cli_plan_prints_the_breakdown(tmp_path):
    r = _cli(["--layers", "784,512,256,10", "--batch-size", "4096"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(M.plan([784, 512, 256, 10], 4096)).strip()
    assert "largest batch" not in r.stdout
    r = _cli(["--batch-size", "32", "--validation-rows", "10000", "--budget", "20MB"], tmp_path)
    assert r.returncode == 1, r.stderr  # batch 32 itself reserves more (see below)
    assert r.stdout.splitlines()[-1] == "the run as planned (batch 32) does not fit in 20.00 MiB: it reserves " + \
        M._fmt(M.plan([784, 512, 256, 10], 32, validation_rows=10000, epochs=1).reserved_bytes)
    whole = M.plan([784, 512, 256, 10], 32, validation_rows=10000)
    assert r.stdout.startswith(str(whole)) and whole.breakdown["evaluation"] > 0
    fits = M.max_batch_size([784, 512, 256, 10], 20 << 20, validation_rows=10000)
    assert f"largest batch that fits in 20.00 MiB: {fits}" in r.stdout and fits > 0
    assert M.plan([784, 512, 256, 10], fits, validation_rows=10000).reserved_bytes <= 20 << 20


def test_cli_plan_with_a_budget_prints_the_largest_batch(tmp_path):
    r = _cli(["--layers", "784,512,256,10", "--batch-size", "4096", "--budget", "2GB"], tmp_path)
    assert r.returncode == 0, r.stderr
    n = M.max_batch_size([784, 512, 256, 10], 2 << 30)
    assert n > 4096
    assert f"largest batch that fits in 2.00 GiB: {n}" in r.stdout.splitlines()
    assert str(M.plan([784, 512, 256, 10], 4096)) in r.stdout


def test_cli_plan_with_a_budget_plans_a_small_validation_under_it(tmp_path):
    """Under the budget the validation's few rows take a piece of the block the step's buffers
    went back to, as fit's do: the plan printed is the run under the budget, which fits."""
    args = ["--batch-size", "1500", "--validation-rows", "100", "--epochs", "1"]
    r = _cli(args + ["--budget", "20MB"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "peak reserved       20.00 MiB" in r.stdout and "largest batch that fits in 20.00 MiB: 1500" in r.stdout
    r = _cli(args, tmp_path)  # without one, the small pool makes its segment
    assert r.returncode == 0 and "peak reserved       22.00 MiB" in r.stdout, r.stdout + r.stderr


def test_cli_plan_says_when_the_largest_batch_is_the_searchs_end(tmp_path):
    r = _cli(["--layers", "784,10", "--budget", "10TB"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "largest batch that fits in 10.00 TiB: 16777216 (or more: the search stops at 2**24)" in r.stdout


def test_cli_plan_with_a_budget_lists_the_ways_to_fit_a_step(tmp_path):
    """Each precision, with and without recomputation: the fewest micro-batches k a step of
    --batch-size takes within the budget and their size, the plan of k of them (a step of several
    needs more than one alone) fitting, and k - 1 not enough."""
    for layers, batch, budget in (([784, 512, 256, 10], 65536, 256 << 20), ([784, 4096, 4096, 10], 4096, 160 << 20)):
        r = _cli(["--layers", ",".join(map(str, layers)), "--batch-size", str(batch), "--budget", str(budget),
                  "--optimizer", "sgd"], tmp_path)
        assert r.returncode == _status(layers, batch, budget, "sgd") == 1, r.stderr
        rows = {}
        for line in r.stdout.splitlines():
            m = re.match(r"  (fp32|fp16|bf16)\s+(no|yes)\s+(\d+|none fits)\s+(\d+|-)", line)
            if m:
                rows[m.group(1), m.group(2)] = (0, 0) if m.group(4) == "-" else (int(m.group(3)), int(m.group(4)))
                assert line.endswith("<- as planned above") == (m.group(1, 2) == ("fp32", "no"))
        assert len(rows) == 6 and any(k for _, k in rows.values())
        for (prec, rc), (micro, k) in rows.items():  # the CLI's fresh process holds nothing on the CPU
            amp, recompute = None if prec == "fp32" else prec, rc == "yes"
            def reserved(j):
                return M.plan(layers, -(-batch // j), "sgd", amp, recompute, accumulation_steps=j,
                              epochs=1).reserved_bytes

            if k == 0:
                assert all(reserved(j) > budget for j in range(1, 65)), (prec, rc)
                continue
            assert micro == -(-batch // k)
            assert reserved(k) <= budget, (prec, rc, micro, k)
            if k > 1:
                fewer = M.max_batch_size(layers, budget, "sgd", amp, recompute, accumulation_steps=k - 1)
                assert (k - 1) * fewer < batch or reserved(k - 1) > budget, (prec, rc, k)
    r = _cli(["--batch-size", "64", "--budget", "1MB"], tmp_path)
    assert r.returncode == 1 and "ways to train" not in r.stdout, "nothing fits: no table"


def test_cli_plan_says_a_batch_below_the_largest_may_not_fit(tmp_path):
    """Reserved memory is in whole segments: at 20 MB, batch 1500 fits (its requests share 20 MiB
    segments) where batch 32 does not (its small requests take a 2 MiB segment more), nor any
    micro-batch of it in fp32; the table says so, planning each answer itself, and names the
    setting that maps pages instead."""
    layers, budget = [784, 512, 256, 10], 20 << 20
    r = _cli(["--batch-size", "32", "--budget", "20MB"], tmp_path)
    assert r.returncode == 1, r.stderr
    n = M.max_batch_size(layers, budget)
    assert M.plan(layers, 32, epochs=1).reserved_bytes > budget and n > 32
    assert f"largest batch that fits in 20.00 MiB: {n} (not every smaller one: batch 32 reserves 22.00 MiB" in r.stdout
    rows = dict(re.findall(r"  (fp32|fp16|bf16)\s+no\s+(\d+|none fits)", r.stdout))
    assert rows["fp32"] == "none fits" and rows["fp16"] == "32", r.stdout
    assert M.plan(layers, 32, amp="fp16", epochs=1).reserved_bytes <= budget
    assert all(M.plan(layers, -(-32 // k), accumulation_steps=k, epochs=1).reserved_bytes > budget
               for k in range(2, 33))
    assert "expandable_segments:True" in r.stdout


def test_cli_plan_of_accumulated_and_recomputed_steps(tmp_path):
    """--accumulation-steps and --recompute plan what train runs with them: the micro-batch's
    plan with k to a step, the largest micro-batch for steps of k, and ways for steps of
    batch x k samples, the row of recomputation in fp32 marked as the one planned."""
    layers, batch, k, budget = [784, 512, 256, 10], 2000, 4, 46 << 20
    r = _cli(["--batch-size", str(batch), "--accumulation-steps", str(k), "--recompute", "--budget", "46MB"], tmp_path)
    assert r.returncode == _status(layers, batch, budget, recompute=True, accumulation_steps=k), r.stderr
    want = M.plan(layers, batch, recompute=True, accumulation_steps=k)
    assert r.stdout.startswith(str(want).replace(f"batch {batch},", f"batch {batch} x {k},")), r.stdout
    n = M.max_batch_size(layers, budget, recompute=True, accumulation_steps=k)
    assert f"largest batch that fits in 46.00 MiB: {n} (as a micro-batch, 4 to a step)" in r.stdout, r.stdout
    assert f"ways to train steps of {batch * k} samples" in r.stdout
    marked = [ln for ln in r.stdout.splitlines() if ln.endswith("<- as planned above")]
    assert len(marked) == 1 and re.match(r"  fp32\s+yes\s", marked[0]), marked
    assert M.plan(layers, batch, recompute=True).breakdown != M.plan(layers, batch).breakdown


_UNDER_LIMIT = r'''
import json, sys, warnings
import numpy as np
import cmlp
layers, batch, acc, limit, amp, recompute = json.loads(sys.argv[1])
cmlp.memory.set_memory_limit(limit, "cpu")
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (batch * acc, layers[0]), dtype=np.uint8)
y = rng.integers(0, layers[-1], batch * acc)
model = cmlp.MLP(layers, seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=batch, accumulation_steps=acc, amp=amp,
                       recompute=recompute)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    h = trainer.fit(x, y, epochs=1, progress=False)
print(json.dumps([h[0]["microbatch_size"], cmlp.memory.memory_stats("cpu")["num_ooms"],
                  [str(w.message) for w in said]]))
'''


@pytest.mark.parametrize("batch, acc, budget", [(8000, 1, 40), (8000, 1, 46), (2000, 4, 24), (2000, 4, 32)])
def test_the_trainer_under_a_limit_runs_the_micro_batches_plan_offers(tmp_path, batch, acc, budget):
    """What `plan --budget` offers a step is what the trainer starts from under that limit: the
    fewest equal micro-batches of at most --batch-size (8000 in 3 of 2667, not 4 of 2000 as
    halving would give; 4 x 2000 in 6 of 1334 or 5 of 1600), for every precision, with and
    without recomputation, and no step runs out of memory."""
    layers = [784, 512, 256, 10]
    r = _cli(["--batch-size", str(batch), "--accumulation-steps", str(acc), "--budget", f"{budget}MB"], tmp_path)
    assert r.returncode == _status(layers, batch, budget << 20, accumulation_steps=acc) == 1, r.stderr
    rows = re.findall(r"  (fp32|fp16|bf16)\s+(no|yes)\s+(\d+)\s+(\d+)", r.stdout)
    assert len(rows) == 6, r.stdout
    assert any(int(k) in (3, 5, 6) for *_, k in rows), "a case halving would not find"
    for prec, rc, micro, k in rows:
        args = json.dumps([layers, batch, acc, budget << 20, None if prec == "fp32" else prec, rc == "yes"])
        run = subprocess.run([sys.executable, "-c", _UNDER_LIMIT, args], capture_output=True, text=True,
                             env=_env(), timeout=120)
        assert run.returncode == 0, run.stderr
        used, ooms, said = json.loads(run.stdout)
        assert (used, ooms) == (int(micro), 0), (prec, rc, micro, k, said)
        assert int(micro) <= batch and int(k) == -(-batch * acc // int(micro))
        if int(micro) < batch:
            assert any(f"fits micro-batches of {micro}, not {batch}" in w for w in said), said


def test_cli_plan_ways_to_fit_a_step_count_the_validation(tmp_path):
    """The table of ways counts --validation-rows, as the largest batch above it does: where the
    evaluation's buffers leave no room for any micro-batch, no way is offered."""
    layers, budget, rows = [784, 64, 10], 8 << 20, 10000
    args = ["--layers", "784,64,10", "--batch-size", "1024", "--budget", str(budget), "--optimizer", "sgd"]
    r = _cli(args, tmp_path)
    assert r.returncode == 1, r.stderr
    alone = M.max_batch_size(layers, budget, "sgd")
    assert 0 < alone < 1024 and f"largest batch that fits in 8.00 MiB: {alone}" in r.stdout
    assert "ways to train steps of 1024" in r.stdout
    assert M.max_batch_size(layers, budget, "sgd", validation_rows=rows) == 0
    r = _cli([*args, "--validation-rows", str(rows)], tmp_path)
    assert r.returncode == 1, r.stderr
    assert "largest batch that fits in 8.00 MiB: 0" in r.stdout and "ways to train" not in r.stdout
    for amp in (None, "fp16", "bf16"):
        for recompute in (False, True):
            assert M.max_batch_size(layers, budget, "sgd", amp, recompute, accumulation_steps=2,
                                    validation_rows=rows) == 0


@pytest.mark.parametrize("args, layers, batch, opt, amp", [
    (["--amp", "fp16", "--optimizer", "sgd"], [784, 512, 256, 10], 32, "sgd", "fp16"),
    (["--amp", "bf16", "--optimizer", "sgd", "--momentum", "0.9", "--batch-size", "100"], [784, 512, 256, 10], 100,
     "sgd_momentum", "bf16"),
    (["--layers", "100,300,10", "--batch-size", "7", "--device", "cpu"], [100, 300, 10], 7, "adam", None),
    (["--amsgrad", "--optimizer", "adamw", "--batch-size", "64"], [784, 512, 256, 10], 64, "adamw_amsgrad", None),
])
def test_cli_plan_options(tmp_path, args, layers, batch, opt, amp):
    r = _cli([*args, "--budget", "64MB"], tmp_path)
    assert r.returncode == _status(layers, batch, 64 * MIB, opt, amp), r.stderr
    assert str(M.plan(layers, batch, opt, amp)) in r.stdout
    n = M.max_batch_size(layers, 64 * MIB, opt, amp)
    assert f"largest batch that fits in 64.00 MiB: {n}" in r.stdout


def test_cli_plan_when_nothing_fits(tmp_path):
    """The exit status says whether the run as planned fits: 1 where not (a script tests it
    before training), 0 where it does."""
    r = _cli(["--budget", "1MB"], tmp_path)
    assert r.returncode == 1, r.stderr
    assert "largest batch that fits in 1.00 MiB: 0" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("the run as planned (batch 32) does not fit in 1.00 MiB: it reserves ")
    r = _cli(["--budget", "64MB"], tmp_path)
    assert r.returncode == 0 and "does not fit" not in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("args, needle", [
    (["--layers", "784,abc,10"], "--layers"),
    (["--layers", "784,0,10"], "--layers: expected sizes in [1, 2**24]"),
    (["--layers", "784"], "--layers: expected an input and an output size"),
    (["--batch-size", "0"], "--batch-size"),
    (["--momentum", "-1"], "--momentum"),
    (["--batch-size", "many"], "--batch-size"),
    (["--budget", "2XB"], "2XB"),
    (["--budget", "-1GB"], "size"),
    (["--amp", "fp8"], "--amp"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--device", "tpu"], "tpu"),
    (["--optimizer", "sgd", "--amsgrad"], "--amsgrad is Adam's"),
])
def test_cli_plan_errors_exit_2_with_a_message(tmp_path, args, needle):
    r = _cli(args, tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


def test_adamw_keeps_what_adam_keeps():
    a = cmlp.memory.plan([784, 512, 256, 10], batch_size=32, optimizer="adamw")
    b = cmlp.memory.plan([784, 512, 256, 10], batch_size=32, optimizer="adam")
    assert a.peak_bytes == b.peak_bytes and a.breakdown == b.breakdown
    model = cmlp.MLP([784, 512, 256, 10])
    assert cmlp.memory.plan([784, 512, 256, 10], 32, cmlp.optim.AdamW(model)).peak_bytes == b.peak_bytes
    with pytest.raises(ValueError, match="adamw"):
        cmlp.memory.plan([784, 512, 256, 10], 32, "lamb")


def test_amsgrad_plans_the_buffers_its_optimizer_holds_at_its_next_step():
    """A third buffer with AMSGrad (in any param group); turned on after steps, the next step makes
    it (planned), and turned off it stays (still planned, as it is still held)."""
    sizes = [20, 30, 5]
    two, three = (cmlp.memory.plan(sizes, 8, name).breakdown["optimizer_state"] for name in ("adam", "adam_amsgrad"))
    model = cmlp.MLP(sizes, seed=0)
    assert three == 3 * 4 * model.num_parameters() and two * 3 == three * 2
    opt = cmlp.optim.Adam(model)
    x, y = np.ones((8, 20), np.float32), np.zeros(8, np.int64)
    model.forward_backward(x, y)
    opt.step()
    assert cmlp.memory.plan(sizes, 8, opt).breakdown["optimizer_state"] == two
    opt.amsgrad = True
    assert cmlp.memory.plan(sizes, 8, opt).breakdown["optimizer_state"] == three
    opt.step()
    opt.amsgrad = False
    assert cmlp.memory.plan(sizes, 8, opt).breakdown["optimizer_state"] == three
    assert len(opt.state[0]) == 4  # step, exp_avg, exp_avg_sq, max_exp_avg_sq
    # one param group's amsgrad: the maximum spans every group's parameters (not started in the others')
    grouped = cmlp.optim.Adam(model, param_groups=[{"params": ["fc1.weight"], "amsgrad": True},
                                                   {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}])
    assert cmlp.memory.plan(sizes, 8, grouped).breakdown["optimizer_state"] == three


def test_a_sharded_optimizer_state_is_planned_for_the_first_rank():
    # ZeroRedundancyOptimizer: rank 0 keeps the state of n / ranks parameters, rounded up to 64
    n = 535_818
    whole = cmlp.memory.plan([784, 512, 256, 10], 32)
    for ranks in (1, 2, 3, 8):
        p = cmlp.memory.plan([784, 512, 256, 10], 32, optimizer_shards=ranks)
        part = min(n, -(-(-(-n // ranks)) // 64) * 64)
        assert p.breakdown["optimizer_state"] == 2 * part * 4
        assert p.peak_bytes <= whole.peak_bytes and (ranks == 1) == (p.peak_bytes == whole.peak_bytes)
        if ranks > 1:
            assert f"sharded over {ranks} ranks" in str(p)
    tiny = cmlp.memory.plan([4, 3, 2], 8, "sgd_momentum", optimizer_shards=3)
    assert tiny.breakdown["optimizer_state"] == 23 * 4  # the first part holds them all
    budget = whole.reserved_bytes
    assert cmlp.memory.max_batch_size([784, 512, 256, 10], budget, optimizer_shards=4) >= \
        cmlp.memory.max_batch_size([784, 512, 256, 10], budget)
    for bad in (0, -1, True, 2.0, 2**21):
        with pytest.raises(ValueError, match="optimizer_shards"):
            cmlp.memory.plan([784, 512, 256, 10], 32, optimizer_shards=bad)


_VALIDATION_RUN = r'''
import gc, json
import numpy as np
import cmlp
M = cmlp.memory
out = []
for layers, batch, amp, vrows, vdtype in (([784, 512, 256, 10], 32, None, 2500, "uint8"),
                                         ([784, 512, 256, 10], 300, "fp16", 2500, "uint8"),
                                         ([64, 32, 4], 8, None, 2500, "uint8"),
                                         ([784, 512, 256, 10], 32, None, 600, "float32"),
                                         ([784, 512, 256, 10], 4096, None, 2500, "uint8")):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (3 * batch, layers[0]), dtype=np.uint8)
    y = rng.integers(0, layers[-1], 3 * batch)
    vx = rng.integers(0, 256, (vrows, layers[0])).astype(vdtype)
    vy = rng.integers(0, layers[-1], vrows)
    gc.collect()
    M.empty_cache("cpu")
    base = M.memory_allocated("cpu")
    M.reset_peak_memory_stats("cpu")
    model = cmlp.MLP(layers, seed=0)
    opt = cmlp.optim.Adam(model)
    history = cmlp.Trainer(model, opt, batch_size=batch, amp=amp).fit(x, y, epochs=2, validation_data=(vx, vy),
                                                                       progress=False)
    measured = M.max_memory_allocated("cpu") - base
    plan = M.plan(layers, batch, opt, amp)
    whole = M.plan(layers, batch, opt, amp, validation_rows=vrows, validation_dtype=vdtype)
    ref = model.evaluate(vx, vy)
    out.append({"plan": plan.peak_bytes, "whole": whole.peak_bytes, "evaluation": whole.breakdown["evaluation"],
                "history": [h["peak_memory_bytes"] - base for h in history],
                "measured": measured, "val_loss": history[-1]["val_loss"],
                "ref_loss": ref["loss"], "val_accuracy": history[-1]["val_accuracy"], "ref_accuracy": ref["accuracy"]})
    del model, opt
print(json.dumps(out))
'''


def test_an_epochs_recorded_peak_is_its_training_peak_and_the_callers_statistics_are_kept():
    """Each epoch's peak_memory_bytes is its training's peak, the plan's, also when validation
    follows (its chunks of up to 1000 rows, after the step's buffers went back, may take more: the
    caller's max_memory_allocated, which fit does not reset, shows it); the validation loss is
    model.evaluate's."""
    for r in json.loads(_python(_VALIDATION_RUN).strip().splitlines()[-1]):
        assert r["history"] == [r["plan"]] * 2 and r["measured"] >= r["plan"], r
        # the plan of the whole run, validation included, is its measured peak
        assert r["measured"] == r["whole"] and r["evaluation"] > 0, r
        assert r["val_loss"] == pytest.approx(r["ref_loss"], rel=1e-6) and r["val_accuracy"] == r["ref_accuracy"]


def test_a_data_set_is_planned_off_the_host_only_and_its_arguments_are_checked():
    p = M.plan([784, 512, 256, 10], 32, data_rows=60000)
    assert p.breakdown["data"] == 0 and p.peak_bytes == M.plan([784, 512, 256, 10], 32).peak_bytes
    assert p.standing_reserved_bytes == 0  # the CPU holds nothing from its start
    assert M.max_batch_size([784, 512, 256, 10], 64 * MIB, data_rows=60000, data_dtype="float32", shuffle=False) \
        == M.max_batch_size([784, 512, 256, 10], 64 * MIB)
    for kw, match in (({"data_rows": -1}, "data_rows"), ({"data_rows": 1.5}, "data_rows"),
                      ({"data_rows": 10, "data_dtype": None}, "data_dtype"),
                      ({"validation_rows": 10, "validation_dtype": None}, "validation_dtype"),
                      ({"data_rows": 10, "data_dtype": "int8"}, "data_dtype"),
                      ({"data_rows": 10, "data_dtype": "bogus"}, "data_dtype")):
        with pytest.raises(ValueError, match=match):
            M.plan([784, 10], 32, **kw)
    with pytest.raises(TypeError, match="shuffle"):
        M.plan([784, 10], 32, data_rows=10, shuffle="yes")
    with pytest.raises(TypeError, match="scaler"):
        M.plan([784, 10], 32, scaler="yes")


@pytest.mark.parametrize("layers, batch, opt, amp", [([784, 512, 256, 10], 32, "adam", None),
                                                     ([56, 363, 3, 44], 51, "sgd", None),
                                                     ([784, 512, 256, 10], 500, "sgd_momentum", "bf16")])
def test_a_loop_of_ones_own_is_planned_as_one_that_accumulates(layers, batch, opt, amp):
    """forward_backward adds to the gradients, so a loop of it and opt.step() holds what a run of
    accumulation_steps=2 holds (the README says so)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, layers[0])).astype(np.float32)
    y = rng.integers(0, layers[-1], batch)
    M.empty_cache(DEV)
    base = M.memory_allocated(DEV)
    M.reset_peak_memory_stats(DEV)
    model = cmlp.MLP(layers, seed=0)
    optimizer = cmlp.optim.Adam(model) if opt == "adam" else cmlp.optim.SGD(model, lr=0.1,
                                                                           momentum=0.9 if opt != "sgd" else 0.0)
    for _ in range(2):
        optimizer.zero_grad()
        model.forward_backward(x, y, amp=amp)
        optimizer.step()
    assert M.max_memory_allocated(DEV) - base == M.plan(layers, batch, opt, amp, accumulation_steps=2).peak_bytes


def test_amsgrad_turned_on_between_fits_adds_its_buffer_and_nothing_more():
    """The maximum is a buffer of its own, made beside the state as it is: the fit's peak is the
    plan of an optimizer with AMSGrad, with no copy of the state in between."""
    sizes = [300, 400, 200, 10]
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((32, 300)).astype(np.float32), rng.integers(0, 10, 32)
    M.empty_cache(DEV)
    base = M.memory_allocated(DEV)
    model = cmlp.MLP(sizes, seed=0)
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=8, shuffle=False)
    trainer.fit(x, y, epochs=1, progress=False)
    opt.amsgrad = True
    plan = M.plan(sizes, 8, opt)
    M.reset_peak_memory_stats(DEV)
    trainer.fit(x, y, epochs=1, progress=False)
    assert M.max_memory_allocated(DEV) - base == plan.peak_bytes
    assert plan.breakdown["optimizer_state"] == 3 * 4 * model.num_parameters()


_EPOCHS_RUN = r'''
import json, sys
import numpy as np
import cmlp
M = cmlp.memory
conf, layers, batch, vrows, epochs = json.loads(sys.argv[1])
M.configure(conf)
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (3 * batch, layers[0]), dtype=np.uint8)
y = rng.integers(0, layers[-1], 3 * batch)
vx = rng.integers(0, 256, (vrows, layers[0]), dtype=np.uint8)
vy = rng.integers(0, layers[-1], vrows)
model = cmlp.MLP(layers, seed=0)
opt = cmlp.optim.SGD(model, lr=0.01)
plan = M.plan(layers, batch, opt, validation_rows=vrows, epochs=epochs)
once = M.plan(layers, batch, opt, validation_rows=vrows, epochs=1)
cmlp.Trainer(model, opt, batch_size=batch).fit(x, y, epochs=epochs, validation_data=(vx, vy), progress=False)
print(json.dumps({"plan": [plan.peak_bytes, plan.reserved_bytes], "once": once.reserved_bytes,
                  "measured": [M.max_memory_allocated(), M.max_memory_reserved()]}))
'''


@pytest.mark.parametrize("conf, layers, batch, vrows, epochs, grows", [
    # each epoch's step and validation buffers take new 20 MiB segments, which, freed, are at
    # max_split_size: no smaller request may take them again
    ("max_split_size_mb:20", [804, 17], 586, 1656, 2, True),
    ("max_split_size_mb:20", [804, 17], 586, 1656, 5, True),
    ("max_split_size_mb:20", [804, 17], 586, 1656, 90, True),  # the later epochs counted, not replayed
    # the validation chunk's 29.6 MB comes in a 30 MiB segment, at max_split_size_mb:30
    ("max_split_size_mb:30", [7400, 17], 64, 1000, 4, True),
    # a segment under max_split_size is taken again: the epochs reserve nothing more
    ("max_split_size_mb:21", [804, 17], 586, 1656, 4, False),
    ("expandable_segments:True", [804, 300, 17], 586, 1656, 3, False),
])
def test_a_fits_epochs_are_planned_where_each_reserves_new_segments(conf, layers, batch, vrows, epochs, grows):
    r = json.loads(_python(_EPOCHS_RUN, [json.dumps([conf, layers, batch, vrows, epochs])]).strip().splitlines()[-1])
    assert r["plan"] == r["measured"], r
    assert (r["plan"][1] > r["once"]) == grows, r


def test_the_epochs_a_plan_counts_are_checked_and_bounded_by_the_device():
    for bad in (0, -1, 1.5, True, 2**31, "5"):
        with pytest.raises(ValueError, match="epochs"):
            M.plan([784, 10], 32, validation_rows=100, epochs=bad)
    assert M.plan([784, 10], 32, validation_rows=100, epochs=np.int64(3)).reserved_bytes > 0
    code = r'''
import sys
import cmlp
M = cmlp.memory
M.configure("max_split_size_mb:20")
p = M.plan([804, 17], 586, "sgd", validation_rows=1656, epochs=2**31 - 1)
free, total = M.mem_get_info("cpu")
print(p.reserved_bytes, total, M.plan([804, 17], 586, "sgd", validation_rows=1656, epochs=100).reserved_bytes,
      M.plan([804, 17], 586, "sgd", validation_rows=1656, epochs=99).reserved_bytes)
'''
    reserved, total, hundred, ninety_nine = map(int, _python(code).split())
    assert reserved <= total and hundred - ninety_nine == 40 * MIB  # the step's and the validation's 20 MiB
    # epochs that would add more than 2**63 bytes: the device's memory all the same
    code = r'''
import cmlp
M = cmlp.memory
M.configure("max_split_size_mb:4098")
print(M.plan([1074116, 10], 1, "sgd", validation_rows=1000, epochs=2**31 - 1).reserved_bytes,
      M.mem_get_info("cpu")[1])
'''
    reserved, total = map(int, _python(code).split())
    assert reserved == total


def test_cli_plan_takes_the_epochs(tmp_path):
    args = ["--layers", "804,17", "--batch-size", "586", "--optimizer", "sgd", "--validation-rows", "1656"]
    env_conf = {"CMLP_ALLOC_CONF": "max_split_size_mb:20"}
    outs = []
    for extra in ([], ["--epochs", "1"], ["--epochs", "5"]):
        r = subprocess.run([sys.executable, "-m", "cmlp", "plan", *args, *extra], capture_output=True, text=True,
                           cwd=tmp_path, env={**_env(), **env_conf}, timeout=60)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[2] != outs[1]
    r = _cli(args + ["--epochs", "0"], tmp_path)
    assert r.returncode == 2 and "--epochs" in r.stderr, r.stderr
    # under a budget, the segments later epochs would add stop at it (the allocator gives cached
    # ones back there): 90 epochs plan 3.52 GiB without one, and fit in 150 MiB
    for budget, reserved in ((None, "3.52 GiB"), ("150MB", "150.00 MiB")):
        r = subprocess.run([sys.executable, "-m", "cmlp", "plan", *args, "--epochs", "90"] +
                           (["--budget", budget] if budget else []), capture_output=True, text=True, cwd=tmp_path,
                           env={**_env(), **env_conf}, timeout=60)
        assert r.returncode == 0 and re.search(rf"peak reserved +{reserved}\n", r.stdout), r.stdout + r.stderr


_SHORT_DATA_RUN = r'''
import json, sys
import numpy as np
import cmlp
M = cmlp.memory
layers, batch, accumulation, rows, conf, vrows, epochs, recompute = json.loads(sys.argv[1])
if conf:
    M.configure(conf)
rng = np.random.default_rng(0)
x = rng.standard_normal((rows, layers[0]), dtype=np.float32)
y = rng.integers(0, layers[-1], rows)
validation = None
if vrows:
    validation = (rng.integers(0, 256, (vrows, layers[0]), dtype=np.uint8), rng.integers(0, layers[-1], vrows))
model = cmlp.MLP(layers, seed=0)
opt = cmlp.optim.SGD(model, lr=0.01)
plan = M.plan(layers, batch, opt, recompute=recompute, accumulation_steps=accumulation, validation_rows=vrows,
              epochs=epochs, data_rows=rows, data_dtype="float32")
cmlp.Trainer(model, opt, batch_size=batch, accumulation_steps=accumulation, recompute=recompute).fit(
    x, y, epochs=epochs, validation_data=validation, progress=False)
print(json.dumps({"plan": [plan.peak_bytes, plan.reserved_bytes], "batch": plan.batch_size,
                  "measured": [M.max_memory_allocated(), M.max_memory_reserved()]}))
'''


@pytest.mark.parametrize("case", [
    # fewer samples than a micro-batch: each step is one micro-batch of them all, whose buffers
    # stay in the gradients (as a step of one micro-batch's do) and which can reserve more than
    # the batch asked for would
    [[1008, 2214, 16], 756, 4, 317, "", 0, 1, False],
    [[784, 10], 64, 1, 10, "", 0, 1, False],
    [[3139, 943, 16], 682, 1, 218, "max_split_size_mb:20", 2000, 12, True],
    # as many as a micro-batch, of a step that would accumulate: one micro-batch all the same
    [[2919, 1497, 1374, 18], 306, 2, 306, "roundup_power2_divisions:4", 0, 1, False],
    # more: the batch as asked
    [[784, 100, 10], 64, 3, 100, "", 0, 1, False],
    [[784, 100, 10], 64, 1, 64, "", 0, 2, False],
])
def test_a_data_set_smaller_than_the_batch_is_planned_as_the_step_it_makes(case):
    r = json.loads(_python(_SHORT_DATA_RUN, [json.dumps(case)]).strip().splitlines()[-1])
    assert r["plan"] == r["measured"], r
    assert r["batch"] == min(case[1], case[3]), r


def test_max_batch_size_is_at_most_the_data_set():
    assert M.max_batch_size([784, 512, 256, 10], "1GB", data_rows=300) == 300
    assert M.max_batch_size([784, 512, 256, 10], "1GB", data_rows=300, limit=200) == 200
    small = M.max_batch_size([784, 512, 256, 10], 20 * MIB)
    assert 0 < small < 3000 and M.max_batch_size([784, 512, 256, 10], 20 * MIB, data_rows=3000) == small


_BUDGET_EPOCHS_RUN = r'''
import json
import numpy as np
import cmlp
M = cmlp.memory
M.configure("max_split_size_mb:20")
layers, vrows, budget = [804, 17], 1656, 64 << 20
b = M.max_batch_size(layers, budget, "sgd", validation_rows=vrows)
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (3 * b, 804), dtype=np.uint8), rng.integers(0, 17, 3 * b)
vx, vy = rng.integers(0, 256, (vrows, 804), dtype=np.uint8), rng.integers(0, 17, vrows)
model = cmlp.MLP(layers, seed=0)
opt = cmlp.optim.SGD(model, lr=0.01)
M.set_memory_limit(budget)
cmlp.Trainer(model, opt, batch_size=b, auto_microbatch=False).fit(x, y, epochs=8, validation_data=(vx, vy),
                                                                  progress=False)
print(json.dumps([b, M.plan(layers, b, opt, validation_rows=vrows, epochs=8).reserved_bytes, M.max_memory_reserved(),
                  M.memory_stats()["num_ooms"]]))
'''


def test_the_batch_max_batch_size_gives_trains_every_epoch_under_that_limit():
    """Where each epoch reserves new segments (max_split_size_mb:20), a memory limit has the
    allocator give the cached ones back: the batch planned for one epoch trains eight under it,
    whose plan without a limit reserves far more."""
    b, unlimited, reserved, ooms = json.loads(_python(_BUDGET_EPOCHS_RUN).strip().splitlines()[-1])
    assert b > 0 and reserved <= 64 * MIB < unlimited and ooms == 0


_DESCRIBED_GPU = r'''
import json
import cmlp
M = cmlp.memory
sizes = [784, 512, 256, 10]
out = {}
for major in (8, 9, 12, 13):
    p = M.plan(sizes, 32, device="cuda", device_properties={"major": major, "total_memory": "80GB"})
    out[major] = [p.standing_reserved_bytes, p.peak_bytes, p.reserved_bytes, p.device]
print(json.dumps(out))
'''


@pytest.mark.parametrize("kib", [None, "1024", "0"])
def test_a_gpu_that_is_not_here_is_planned_from_its_compute_capability(kib):
    """device_properties describe the GPU a plan is for where there is none (or another): its
    compute capability sizes the GEMM workspace the device holds once open (10 MiB, 34 MiB on 9.x
    to 12.x; with CUBLASLT_WORKSPACE_SIZE, that many KiB and the kernels' slots, 288.25 KiB, on
    top of the second stream's 2 MiB), which the run's blocks land beside (standing_reserved_bytes:
    its segment)."""
    env = dict(_env())
    env.pop("CUBLASLT_WORKSPACE_SIZE", None)
    if kib is not None:
        env["CUBLASLT_WORKSPACE_SIZE"] = kib
    r = subprocess.run([sys.executable, "-c", _DESCRIBED_GPU], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    slots = (256 << 10) + 33024
    for major, (standing, peak, _, device) in out.items():
        block = (int(kib) << 10) + slots if kib is not None else (32 if 9 <= major <= 12 else 8) * MIB
        block += 2 * MIB
        # its segment: of its own size (in 2 MiB) from 10 MiB on, a 20 MiB one below
        assert standing == (-(-block // (2 * MIB)) * 2 * MIB if block >= 10 * MIB else 20 * MIB), (major, standing)
        assert device == "cuda:0" and peak == M.plan([784, 512, 256, 10], 32).peak_bytes


def test_a_gpu_described_plans_its_data_set_and_half_precision_as_a_gpu_does():
    """A GPU described plans as one opened: the data set a fit copies to it (the samples, their
    labels and their order), the param groups' settings kept there, amp's half operands multiplied
    directly; max_batch_size and plan --budget take it too."""
    gpu = {"major": 9, "total_memory": 80 << 30}
    p = M.plan([784, 64, 10], 32, device="cuda", data_rows=640, device_properties=gpu)
    assert p.breakdown["data"] == 640 * (784 + 4 + 8)
    assert M.plan([784, 64, 10], 32, data_rows=640).breakdown["data"] == 0  # (the CPU reads it in place)
    assert M.plan([784, 64, 10], 32, device="cuda:1", device_properties=gpu).device == "cuda:1"
    model = cmlp.MLP([784, 64, 10], seed=0)
    opt = cmlp.optim.Adam(model, param_groups=[{"params": ["fc1.weight"], "lr": 1e-4},
                                               {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}])
    on_gpu = M.plan([784, 64, 10], 32, opt, device="cuda", device_properties=gpu)
    assert on_gpu.breakdown["optimizer_state"] > M.plan([784, 64, 10], 32, opt).breakdown["optimizer_state"]
    # torch's properties object (the fields read), cmlp.cuda's NamedTuple alike
    props = type("Props", (), {"major": 9, "minor": 0, "total_memory": 80 << 30})()
    assert vars(M.plan([784, 64, 10], 4096, "sgd", "fp16", device="cuda", device_properties=props)) == \
        vars(M.plan([784, 64, 10], 4096, "sgd", "fp16", device="cuda", device_properties=gpu))
    n = M.max_batch_size([784, 512, 256, 10], "64MB", device="cuda", device_properties=gpu)
    assert M.plan([784, 512, 256, 10], n, device="cuda", device_properties=gpu, epochs=1).reserved_bytes <= 64 * MIB
    assert M.plan([784, 512, 256, 10], n + 1, device="cuda", device_properties=gpu, epochs=1).peak_bytes > 64 * MIB \
        or M.plan([784, 512, 256, 10], n + 1, device="cuda", device_properties=gpu, epochs=1).reserved_bytes > 64 * MIB
    for bad, match in (({"major": 0}, "major"), ({}, "major"), ({"major": 9.0}, "major"), ({"major": True}, "major"),
                       ({"major": 9, "total_memory": -1}, "total_memory"), ({"major": 9, "total_memory": "x"}, "total"),
                       ({"major": 9, "total_memory": 2.5}, "total_memory")):
        with pytest.raises(ValueError, match=match):
            M.plan([4, 2], device="cuda", device_properties=bad)
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cuda:N'"):
        M.plan([4, 2], device="cpu", device_properties=gpu)
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cuda:N'"):
        M.max_batch_size([4, 2], "1MB", device="cpu", device_properties=gpu)
    if not cmlp.cuda.is_available():  # the GPU named and not described: said where it is missing
        with pytest.raises(RuntimeError, match="device_properties"):
            M.plan([4, 2], device="cuda")
