"""cmlp.optim.Adam and SGD against the float64 reference optimizers (tests/reference.py).

20-step trajectories from identical parameters, a different batch each step: every parameter
tensor must end within 1e-5 norm-wise relative error of the reference, and its displacement
from the start (the sum of the updates, which is what a wrong update rule changes most)
within 1e-4 of the reference displacement's norm plus 1e-6 of the parameter's norm (float32
storage rounding).
"""

import copy
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from checks import fill_cache_but  # noqa: E402
from reference import RefAdam, RefMLP, RefSGD, draw_batch, rel_err  # noqa: E402

import cmlp  # noqa: E402

DEVICE = os.environ.get("CMLP_TEST_DEVICE", "cpu")
SIZES = [20, 32, 16, 5]
BATCH = 16
STEPS = 20
MARGIN = 1e-4

ADAM_CASES = [
    {},
    {"weight_decay": 0.01},
    {"betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01},
    {"amsgrad": True},
    {"lr": 3e-3, "weight_decay": 0.01, "amsgrad": True, "maximize": True},
    {"maximize": True},
]
SGD_CASES = [
    {},
    {"lr": 0.05},
    {"lr": 0.02, "momentum": 0.9},
    {"lr": 0.02, "momentum": 0.9, "dampening": 0.1},
    {"lr": 0.02, "momentum": 0.9, "nesterov": True},
    {"lr": 0.05, "weight_decay": 1e-3},
    {"lr": 0.02, "momentum": 0.9, "weight_decay": 1e-3},
    {"lr": 0.05, "maximize": True},
    {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3, "maximize": True},
]


def case_id(kwargs):
    return ",".join("%s=%s" % kv for kv in sorted(kwargs.items())) or "defaults"


def has_tiny_entries(grads, params, weight_decay):
    """True if some effective gradient entry is nonzero but below 1e-7: there Adam's update
    g / (|g| + eps) turns float32 rounding into an O(lr) difference (exact zeros, from ReLUs
    dead for the whole batch, are zero in float32 too)."""
    for k, g in grads.items():
        g = g + weight_decay * params[k]
        if ((g != 0) & (np.abs(g) < 1e-7)).any():
            return True
    return False


def reference_trajectory(params, ref_opt, steps, seed, guard_tiny=False):
    """Runs the float64 reference; returns the batches it used and its final parameters.

    Each batch keeps every ReLU pre-activation at least MARGIN from zero under the reference's
    parameters at that step, so float32 and float64 runs take the same ReLU branches."""
    ref = RefMLP(SIZES, params)
    rng = np.random.default_rng(seed)
    wd = getattr(ref_opt, "weight_decay", 0.0)
    batches = []
    for _ in range(steps):
        for _ in range(100):
            x, y = draw_batch(ref, rng, BATCH, MARGIN)
            _, grads = ref.loss_and_grads(x, y)
            if not (guard_tiny and has_tiny_entries(grads, ref.params, wd)):
                break
        else:
            raise RuntimeError("no well-conditioned batch found")
        batches.append((x, y))
        ref_opt.step(ref.params, grads)
    return batches, ref.params


def cmlp_step(model, opt, x, y):
    opt.zero_grad()
    model.forward_backward(x, y)
    opt.step()


def assert_params_close(model, expected, start, tol=1e-5, disp_tol=1e-4):
    final = model.state_dict()
    for name, p in final.items():
        assert p.dtype == np.float32, name
        err = rel_err(p, expected[name])
        assert err < tol, "%s: relative error %.3g" % (name, err)
        # float32 storage rounds the parameters at every step (~1e-7 relative over 20 steps),
        # which the displacement's error budget allows for in its second term
        moved = expected[name] - start[name]
        budget = disp_tol * np.linalg.norm(moved) + 1e-6 * np.linalg.norm(expected[name])
        diff = np.linalg.norm(p.astype(np.float64) - start[name] - moved)
        assert diff <= budget, "%s: displacement off by %.3g, allowed %.3g" % (name, diff, budget)


def run_against_reference(make_opt, ref_opt, seed, guard_tiny):
    model = cmlp.MLP(SIZES, device=DEVICE, seed=seed)
    start = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    batches, expected = reference_trajectory(start, ref_opt, STEPS, seed + 1000, guard_tiny)
    opt = make_opt(model)
    for x, y in batches:
        cmlp_step(model, opt, x, y)
    # The run must move the parameters well beyond the tolerances, or it proves nothing.
    for name in start:
        assert rel_err(expected[name], start[name]) > 1e-3, name
    assert_params_close(model, expected, start)


# ---- trajectories --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=case_id)
def test_adam_trajectory(kwargs):
    run_against_reference(lambda m: cmlp.optim.Adam(m, **kwargs), RefAdam(**kwargs),
                          seed=1, guard_tiny=True)


ADAMW_CASES = [{}, {"lr": 3e-3, "weight_decay": 0.1}, {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.5},
               {"lr": 3e-3, "weight_decay": 0.1, "amsgrad": True, "maximize": True}]


@pytest.mark.parametrize("kwargs", ADAMW_CASES, ids=case_id)
def test_adamw_trajectory(kwargs):
    ref = RefAdam(**dict({"weight_decay": 1e-2}, **kwargs), decoupled_weight_decay=True)
    run_against_reference(lambda m: cmlp.optim.AdamW(m, **kwargs), ref, seed=4, guard_tiny=True)


def test_adamw_is_adam_with_decoupled_weight_decay_and_not_l2():
    rng = np.random.default_rng(9)
    batches = [(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], BATCH))
               for _ in range(5)]
    models = [cmlp.MLP(SIZES, device=DEVICE, seed=1) for _ in range(3)]
    opts = [cmlp.optim.AdamW(models[0], lr=1e-2, weight_decay=0.3),
            cmlp.optim.Adam(models[1], lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True),
            cmlp.optim.Adam(models[2], lr=1e-2, weight_decay=0.3)]
    for x, y in batches:
        for m, o in zip(models, opts):
            cmlp_step(m, o, x, y)
    p = [m._c.get_params() for m in models]
    np.testing.assert_array_equal(p[0], p[1])
    assert rel_err(p[2], p[0]) > 1e-3  # L2 decay moves the parameters elsewhere
    group = opts[0].state_dict()["param_groups"][0]
    assert group["decoupled_weight_decay"] is True and group["weight_decay"] == 0.3
    assert opts[2].state_dict()["param_groups"][0]["decoupled_weight_decay"] is False
    with pytest.raises(TypeError, match="decoupled_weight_decay"):
        cmlp.optim.Adam(models[2], decoupled_weight_decay="yes")


def test_adamw_follows_torch():
    torch = pytest.importorskip("torch")
    model = cmlp.MLP(SIZES, seed=2)
    layers = [torch.nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])]
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.weight.copy_(torch.from_numpy(model.state_dict()[f"fc{i + 1}.weight"]))
            layer.bias.copy_(torch.from_numpy(model.state_dict()[f"fc{i + 1}.bias"]))
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    theirs = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.2)
    mine = cmlp.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.2)
    rng = np.random.default_rng(3)
    for _ in range(10):
        x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], BATCH)
        h = torch.from_numpy(x)
        for i, layer in enumerate(layers):
            h = layer(h) if i == len(layers) - 1 else torch.relu(layer(h))
        theirs.zero_grad()
        torch.nn.functional.cross_entropy(h, torch.from_numpy(y)).backward()
        theirs.step()
        cmlp_step(model, mine, x, y)
    got = model.state_dict()
    for i, layer in enumerate(layers):
        assert rel_err(got[f"fc{i + 1}.weight"], layer.weight.detach().numpy()) < 1e-5
        assert rel_err(got[f"fc{i + 1}.bias"], layer.bias.detach().numpy()) < 1e-5
    # torch's AdamW state_dict loads into cmlp's AdamW, and into Adam as AdamW
    sd = theirs.state_dict()
    sd = {"state": {k: {n: (v.numpy() if hasattr(v, "numpy") else v) for n, v in e.items()}
                    for k, e in sd["state"].items()}, "param_groups": sd["param_groups"]}
    adam = cmlp.optim.Adam(cmlp.MLP(SIZES, seed=2))
    adam.load_state_dict(sd)
    assert adam.decoupled_weight_decay and adam.weight_decay == 0.2


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=case_id)
def test_sgd_trajectory(kwargs):
    run_against_reference(lambda m: cmlp.optim.SGD(m, **kwargs), RefSGD(**kwargs),
                          seed=2, guard_tiny=False)


# ---- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"lr": -1e-3}, {"eps": -1e-8}, {"betas": (1.0, 0.999)}, {"betas": (-0.1, 0.999)},
    {"betas": (0.9, 1.0)}, {"betas": (0.9, 1.5)}, {"weight_decay": -0.01},
], ids=case_id)
def test_adam_rejects_invalid_hyperparameters(kwargs):
    model = cmlp.MLP(SIZES, device=DEVICE, seed=0)
    with pytest.raises(ValueError):
        cmlp.optim.Adam(model, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"lr": -0.1}, {"nesterov": True}, {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
    {"momentum": -0.5}, {"weight_decay": -1e-3},
], ids=case_id)
def test_sgd_rejects_invalid_hyperparameters(kwargs):
    model = cmlp.MLP(SIZES, device=DEVICE, seed=0)
    with pytest.raises(ValueError):
        cmlp.optim.SGD(model, **kwargs)


def test_boundary_hyperparameters_are_accepted():
    model = cmlp.MLP(SIZES, device=DEVICE, seed=0)
    cmlp.optim.Adam(model, lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    cmlp.optim.SGD(model, lr=0.0, momentum=0.9, nesterov=True)


# ---- learning rate -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_lr_is_readable_and_writable(kind):
    if kind == "adam":
        lr0, lr1 = 1e-3, 5e-3
        make_opt, ref_opt = (lambda m: cmlp.optim.Adam(m, lr=lr0)), RefAdam(lr=lr0)
    else:
        lr0, lr1 = 0.02, 0.1
        make_opt = lambda m: cmlp.optim.SGD(m, lr=lr0, momentum=0.9)  # noqa: E731
        ref_opt = RefSGD(lr=lr0, momentum=0.9)
    model = cmlp.MLP(SIZES, device=DEVICE, seed=3)
    start = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    opt = make_opt(model)
    assert opt.lr == pytest.approx(lr0, rel=1e-12)

    ref = RefMLP(SIZES, start)
    rng = np.random.default_rng(4)
    for step in range(6):
        if step == 3:
            opt.lr = lr1
            ref_opt.lr = lr1
            assert opt.lr == pytest.approx(lr1, rel=1e-12)
        x, y = draw_batch(ref, rng, BATCH, MARGIN)
        _, grads = ref.loss_and_grads(x, y)
        ref_opt.step(ref.params, grads)
        cmlp_step(model, opt, x, y)
    assert_params_close(model, ref.params, start)


# ---- optimizer state round trip ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_state_dict_round_trip_continues_bitwise(kind):
    if kind == "adam":
        def make_opt(m):
            return cmlp.optim.Adam(m, lr=2e-3, betas=(0.8, 0.99), weight_decay=0.01)
    else:
        def make_opt(m):
            return cmlp.optim.SGD(m, lr=0.02, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
                rng.integers(0, SIZES[-1], BATCH).astype(np.int64)) for _ in range(10)]

    a = cmlp.MLP(SIZES, device=DEVICE, seed=6)
    opt_a = make_opt(a)
    for x, y in batches[:5]:
        cmlp_step(a, opt_a, x, y)

    b = cmlp.MLP(SIZES, device=DEVICE, seed=7)
    b.load_state_dict(a.state_dict())
    opt_b = make_opt(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    # same weights, fresh optimizer state: shows that the state matters
    c = cmlp.MLP(SIZES, device=DEVICE, seed=7)
    c.load_state_dict(a.state_dict())
    opt_c = make_opt(c)

    for x, y in batches[5:]:
        for model, opt in ((a, opt_a), (b, opt_b), (c, opt_c)):
            cmlp_step(model, opt, x, y)
    pa, pb, pc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in pa:
        np.testing.assert_array_equal(pb[name], pa[name], err_msg=name)
    assert any(rel_err(pc[name], pa[name]) > 1e-5 for name in pa)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_loads_a_state_dict_laid_out_as_torch_optim_saves_it(kind):
    """torch.optim's state_dict as it comes (param-group keys cmlp has no use for, such as
    foreach, capturable, fused, differentiable; Adam's step as a 0-d tensor): taken over, and the
    next update uses it."""
    model = cmlp.MLP(SIZES, device=DEVICE, seed=3)
    shapes = [v.shape for v in model.state_dict().values()]
    rng = np.random.default_rng(8)
    n = len(shapes)
    if kind == "adam":
        group = {"lr": 0.003, "betas": (0.8, 0.99), "eps": 1e-07, "weight_decay": 0, "amsgrad": False,
                 "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": False, "params": list(range(n))}
        state = {i: {"step": np.array(4.0, dtype=np.float32), "exp_avg": rng.standard_normal(s).astype(np.float32),
                     "exp_avg_sq": rng.random(s).astype(np.float32)} for i, s in enumerate(shapes)}
        opt = cmlp.optim.Adam(model)
    else:
        group = {"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 0, "nesterov": False,
                 "maximize": False, "foreach": None, "differentiable": False, "fused": None,
                 "params": list(range(n))}
        state = {i: {"momentum_buffer": rng.standard_normal(s).astype(np.float32)} for i, s in enumerate(shapes)}
        opt = cmlp.optim.SGD(model, momentum=0.5)
    group["lr"] = np.array(group["lr"])  # torch may keep lr as a 0-d tensor
    opt.load_state_dict({"state": state, "param_groups": [group]})
    got = opt.state_dict()
    assert got["param_groups"][0]["lr"] == float(group["lr"])
    for i in range(n):
        for key, value in state[i].items():
            np.testing.assert_array_equal(np.asarray(got["state"][i][key], dtype=np.float64),
                                          np.asarray(value, dtype=np.float64), err_msg=f"{i}.{key}")
    if kind == "adam":
        assert got["param_groups"][0]["betas"] == (0.8, 0.99) and got["param_groups"][0]["eps"] == 1e-07
    else:
        assert got["param_groups"][0]["momentum"] == 0.9


def test_sgd_state_whose_momentum_buffers_are_none_means_no_buffers_yet():
    model = cmlp.MLP(SIZES, device=DEVICE, seed=3)
    opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
    n = len(model.state_dict())
    opt.load_state_dict({"state": {i: {"momentum_buffer": None} for i in range(n)},
                         "param_groups": [{"lr": 0.2, "momentum": 0.9, "dampening": 0, "weight_decay": 0,
                                           "nesterov": False, "maximize": False, "params": list(range(n))}]})
    assert opt.lr == 0.2 and opt.state_dict()["state"] == {}
    with pytest.raises(TypeError, match=r"lr must be a number"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": np.array(True), "params": list(range(n))}]})


def test_a_momentum_buffer_that_holds_nan_keeps_it_as_torchs():
    """A buffer that has started and holds NaN (a run that diverged) stays NaN, as torch's: its
    state_dict and a copy keep it, and finite weights loaded back step to NaN there, where a
    buffer that starts afresh would hide the divergence. Only a buffer that has not started (a
    group without momentum so far) starts from the gradient."""
    model = cmlp.MLP([4, 3], device=DEVICE, seed=0)
    opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
    good = model.state_dict()
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    model.load_state_dict({k: np.full_like(v, 3e38) for k, v in good.items()})  # logits overflow
    opt.zero_grad()
    model.forward_backward(x, y)
    opt.step()
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1] and np.isnan(state[0]["momentum_buffer"]).any()
    twin = copy.deepcopy(opt)
    for o in (opt, twin):
        o.model.load_state_dict(good)  # finite weights back, the optimizer's state as it is
        o.zero_grad()
        o.model.forward_backward(x, y)
        o.step()
        w = o.model.state_dict()["fc1.weight"]
        assert np.isnan(w).any(), w
        assert np.array_equal(np.isnan(w), np.isnan(state[0]["momentum_buffer"]))


def test_a_state_dict_taken_while_another_thread_trains_is_of_one_step():
    # lr 0 and one full batch: every step's state is fixed by its number, so each snapshot taken
    # during fit must be the state of the step it reports, every buffer from that same step
    import threading

    rng = np.random.default_rng(0)
    x, y = rng.random((64, 16), dtype=np.float32), rng.integers(0, 4, 64)

    def build():
        model = cmlp.MLP([16, 32, 4], seed=1)
        opt = cmlp.optim.Adam(model, lr=0.0)
        return opt, cmlp.Trainer(model, opt, batch_size=64, shuffle=False)

    opt, trainer = build()
    want = {}
    for step in range(1, 1001):  # a run long enough for the main thread to look in often
        trainer.step(x, y)
        state = opt.state_dict()["state"][0]
        want[step] = (state["exp_avg"], state["exp_avg_sq"])
    opt, trainer = build()
    worker = threading.Thread(target=lambda: trainer.fit(x, y, epochs=1000, progress=False))
    worker.start()
    seen = 0
    while worker.is_alive():
        state = opt.state_dict()["state"]
        if state:
            step = int(state[0]["step"])
            assert np.array_equal(state[0]["exp_avg"], want[step][0]), step
            assert np.array_equal(state[0]["exp_avg_sq"], want[step][1]), step
            seen += 1
    worker.join()
    assert seen > 10, seen


@pytest.mark.filterwarnings("ignore:Detected call of")  # (the schedule's first step may come before fit's)
def test_a_schedule_stepped_while_another_thread_trains_sets_its_rates_and_momenta():
    """The rate and momentum setters take a free model lock without letting the GIL go, and wait
    for a busy one as every call does (here the training thread's, in its C loop): each step of the
    schedule lands in the C optimizer, and neither thread waits for the other's end."""
    import threading

    from cmlp.optim import lr_scheduler

    rng = np.random.default_rng(0)
    x, y = rng.random((2048, 64), dtype=np.float32), rng.integers(0, 4, 2048)
    model = cmlp.MLP([64, 128, 4], seed=1)
    opt = cmlp.optim.SGD(model, lr=0.01, momentum=0.9)
    trainer = cmlp.Trainer(model, opt, batch_size=8)
    sched = lr_scheduler.CyclicLR(opt, 0.001, 0.1, step_size_up=5)
    worker = threading.Thread(target=lambda: trainer.fit(x, y, epochs=20, progress=False))
    worker.start()
    steps = 0
    while worker.is_alive() and steps < 5000:
        sched.step()
        steps += 1
        assert opt._c.lr == opt.lr == sched.get_last_lr()[0]
        assert opt._c.momentum == opt.param_groups[0]["momentum"]
    worker.join(timeout=300)
    assert not worker.is_alive() and steps > 100, steps


@pytest.mark.parametrize("make", [lambda m: cmlp.optim.AdamW(m, weight_decay=0.5),
                                  lambda m: cmlp.optim.SGD(m, lr=0.1, momentum=0.9, weight_decay=0.5)],
                         ids=["adamw", "sgd"])
def test_a_step_without_gradients_changes_nothing_as_in_torch(make):
    # torch's .grad is None on a new model and after zero_grad() (set_to_none=True, the default):
    # step() skips such parameters, making no state and counting no step
    model = cmlp.MLP([8, 5, 3], seed=0)
    opt = make(model)
    x, y = np.ones((4, 8), np.float32), np.arange(4) % 3
    start = model._c.get_params()
    opt.step()
    assert np.array_equal(model._c.get_params(), start) and opt.state_dict()["state"] == {}
    model.forward_backward(x, y)
    opt.step()
    after_one = model._c.get_params()
    assert not np.array_equal(after_one, start)
    opt.zero_grad()
    opt.step()
    assert np.array_equal(model._c.get_params(), after_one)
    assert opt._c.get_state()[0] == 1
    opt.zero_grad(set_to_none=False)  # a None .grad stays None
    model.zero_grad(set_to_none=False)
    opt.step()
    assert np.array_equal(model._c.get_params(), after_one) and opt._c.get_state()[0] == 1
    model.forward_backward(x, y)
    opt.zero_grad(set_to_none=False)  # zero gradients that exist: weight decay still applies
    opt.step()
    assert not np.array_equal(model._c.get_params(), after_one) and opt._c.get_state()[0] == 2
    with pytest.raises(TypeError):
        opt.zero_grad(set_to_none="yes")


def test_a_state_whose_step_or_buffers_are_not_real_numbers_is_refused_and_changes_nothing():
    model = cmlp.MLP([4, 3], seed=0)
    opt = cmlp.optim.Adam(model)
    model.forward_backward(np.ones((2, 4), np.float32), np.array([0, 1]))
    opt.step()
    good = opt.state_dict()
    for key, bad in (("step", True), ("step", "3"), ("step", 1 + 2j), ("step", [1.0, 2.0]),
                     ("exp_avg", lambda a: a.astype(bool)), ("exp_avg_sq", lambda a: a.astype(np.complex64))):
        state = {k: dict(v) for k, v in good["state"].items()}
        for entry in state.values():
            entry[key] = bad(entry[key]) if callable(bad) else bad
        with pytest.raises(ValueError, match="real numbers|must be a number"):
            opt.load_state_dict({"state": state, "param_groups": good["param_groups"]})
        now = opt.state_dict()
        assert all(np.array_equal(now["state"][i][k], good["state"][i][k]) for i in good["state"]
                   for k in good["state"][i])


def test_the_gradients_of_a_fit_that_failed_after_steps_count_as_gradients():
    # a schedule refuses its rate after the first epoch: fit raises, with its steps taken and
    # their gradients in the buffer, which a step() then uses (as torch's .grad would be set)
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 8), dtype=np.float32), rng.integers(0, 3, 32)
    model = cmlp.MLP([8, 5, 3], seed=0)
    opt = cmlp.optim.SGD(model, lr=0.1)
    sched = cmlp.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 if e < 1 else -1.0)
    with pytest.raises(ValueError):
        cmlp.Trainer(model, opt, batch_size=8).fit(x, y, epochs=2, progress=False, scheduler=sched)
    taken, before = opt._c.get_state()[0], model._c.get_params()
    assert taken == 4
    opt.step()
    assert opt._c.get_state()[0] == taken + 1 and not np.array_equal(model._c.get_params(), before)


@pytest.mark.parametrize("kind,betas", [("adam", (0.9, 0.999)), ("adam", (0.9, 0.99999)), ("adam", (0.99999, 0.999)),
                                        ("adam", (0.5, 0.75)), ("sgd", 0.999)])
def test_one_minus_beta_and_dampening_are_formed_in_double_as_torch_forms_them(kind, betas):
    """torch forms 1 - beta1, 1 - beta2 (and SGD's 1 - dampening) in double and rounds them once;
    1.0f - (float)beta is off by 1.3e-5 relative for beta 0.999 and by 1e-3 near 0.99999. Adam's
    moments after one step are (1 - beta1) g and (1 - beta2) g^2; SGD's buffer after two steps on
    the same gradients is (momentum + 1 - dampening) g: each within float rounding."""
    model = cmlp.MLP([6, 5, 3], seed=0, device=DEVICE)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
    model.forward_backward(x, y)
    g = [v.astype(np.float64) for v in model.grads().values()]
    if kind == "adam":
        opt = cmlp.optim.Adam(model, betas=betas)
        opt.step()
        want = {"exp_avg": [(1 - betas[0]) * t for t in g], "exp_avg_sq": [(1 - betas[1]) * t * t for t in g]}
    else:
        opt = cmlp.optim.SGD(model, momentum=1e-3, dampening=betas)
        opt.step()
        opt.step()
        want = {"momentum_buffer": [(1e-3 + (1 - betas)) * t for t in g]}
    state = opt.state_dict()["state"]
    for key, tensors in want.items():
        for i, w in enumerate(tensors):
            got = np.asarray(state[i][key], np.float64)
            big = np.abs(w) > 1e-3 * np.abs(w).max()
            assert np.max(np.abs(got[big] - w[big]) / np.abs(w[big])) < 5e-7, (key, i)


def _torch_twin(model):
    torch = pytest.importorskip("torch")
    sd = model.state_dict()
    layers = [torch.nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])]
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.weight.copy_(torch.from_numpy(sd[f"fc{i + 1}.weight"]))
            layer.bias.copy_(torch.from_numpy(sd[f"fc{i + 1}.bias"]))
    return torch, layers


def _torch_backward(torch, layers, x, y):
    h = torch.from_numpy(x)
    for i, layer in enumerate(layers):
        h = layer(h) if i == len(layers) - 1 else torch.relu(layer(h))
    torch.nn.functional.cross_entropy(h, torch.from_numpy(y)).backward()


EDITS = {"adam": [("weight_decay", 0.3), ("betas", (0.5, 0.9)), ("eps", 1e-3), ("lr", 3e-2),
                  ("decoupled_weight_decay", True)],
         "sgd": [("momentum", 0.0), ("weight_decay", 0.2), ("momentum", 0.5), ("dampening", 0.25), ("lr", 0.3),
                 ("dampening", 0.0), ("nesterov", True)]}


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("how", ["attribute", "param_groups"])
def test_hyperparameters_changed_between_steps_apply_from_the_next_step_as_in_torch(kind, how):
    """torch reads its param groups at every step: a setting changed in between (here as
    param_groups[0][key] = value, or in cmlp as an attribute too) is what the next step uses."""
    model = cmlp.MLP(SIZES, seed=5)
    torch, layers = _torch_twin(model)
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    if kind == "adam":
        mine, theirs = cmlp.optim.Adam(model, lr=1e-2), torch.optim.Adam(params, lr=1e-2)
    else:
        mine, theirs = cmlp.optim.SGD(model, lr=0.1, momentum=0.9), torch.optim.SGD(params, lr=0.1, momentum=0.9)
    rng = np.random.default_rng(6)
    for key, value in [(None, None)] + EDITS[kind]:
        if key is not None:
            if how == "attribute":
                setattr(mine, key, value)
            else:
                mine.param_groups[0][key] = value
            theirs.param_groups[0][key] = value
            assert mine.param_groups[0][key] == value and mine.state_dict()["param_groups"][0][key] == value
        x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], BATCH)
        theirs.zero_grad()
        _torch_backward(torch, layers, x, y)
        theirs.step()
        cmlp_step(model, mine, x, y)
        got = model.state_dict()
        for i, layer in enumerate(layers):
            assert rel_err(got[f"fc{i + 1}.weight"], layer.weight.detach().numpy()) < 1e-5, key
            assert rel_err(got[f"fc{i + 1}.bias"], layer.bias.detach().numpy()) < 1e-5, key


def test_a_setting_changed_as_an_attribute_steps_as_one_loaded_with_a_state_dict():
    runs = []
    for how in ("attribute", "load"):
        model = cmlp.MLP(SIZES, seed=5)
        opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
        rng = np.random.default_rng(6)
        for step in range(3):
            if step == 1:
                if how == "attribute":
                    opt.weight_decay, opt.momentum = 0.5, 0.25
                else:
                    sd = opt.state_dict()
                    sd["param_groups"][0].update(weight_decay=0.5, momentum=0.25)
                    opt.load_state_dict(sd)
            cmlp_step(model, opt, rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
                      rng.integers(0, SIZES[-1], BATCH))
        runs.append(model._c.get_params())
    assert np.array_equal(runs[0], runs[1])
    start = cmlp.MLP(SIZES, seed=5)._c.get_params()
    assert not np.array_equal(runs[0], start)


def test_a_refused_setting_changes_nothing():
    model = cmlp.MLP(SIZES, seed=0)
    adam, sgd = cmlp.optim.Adam(model), cmlp.optim.SGD(cmlp.MLP(SIZES, seed=0), momentum=0.9)
    before = (adam.state_dict()["param_groups"], sgd.state_dict()["param_groups"])
    for opt, key, value, error in [(adam, "betas", (1.0, 0.9), ValueError), (adam, "eps", -1.0, ValueError),
                                   (adam, "weight_decay", "x", TypeError), (adam, "betas", 0.9, TypeError),
                                   (sgd, "momentum", -0.1, ValueError), (sgd, "nesterov", 1.5, TypeError),
                                   (sgd, "dampening", float("nan"), ValueError)]:
        for how in ("attribute", "param_groups"):
            with pytest.raises(error):
                if how == "attribute":
                    setattr(opt, key, value)
                else:
                    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match="'params' cannot change"):
        sgd.param_groups[0]["params"] = [0]
    with pytest.raises(ValueError, match="no 'betas'"):
        sgd.param_groups[0]["betas"] = (0.9, 0.99)
    with pytest.raises(TypeError, match="amsgrad must be a bool"):
        adam.param_groups[0]["amsgrad"] = "yes"
    with pytest.raises(TypeError, match="maximize must be a bool"):
        sgd.maximize = 2
    assert (adam.state_dict()["param_groups"], sgd.state_dict()["param_groups"]) == before


def test_param_groups_is_torchs_one_group():
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model, lr=2e-3)
    (group,) = opt.param_groups
    assert dict(group) == opt.state_dict()["param_groups"][0]
    assert group["params"] == list(range(len(model.state_dict())))
    for g in opt.param_groups:  # torch's idiom for a manual schedule
        g["lr"] = g["lr"] * 0.5
    assert opt.lr == 1e-3
    group["my_note"] = "kept"  # torch keeps any key
    assert group["my_note"] == "kept" and "my_note" in group
    del group["my_note"]
    with pytest.raises(KeyError):
        del group["lr"]
    group["initial_lr"] = 5e-3
    assert opt.state_dict()["param_groups"][0]["initial_lr"] == 5e-3


def test_torchs_implementation_flags_are_taken_and_unsupported_ones_refused():
    model = cmlp.MLP(SIZES, seed=0)
    for make in (lambda **k: cmlp.optim.Adam(model, **k), lambda **k: cmlp.optim.AdamW(model, **k),
                 lambda **k: cmlp.optim.SGD(model, **k)):
        opt = make(foreach=True, fused=None, differentiable=False, maximize=False)
        group = opt.state_dict()["param_groups"][0]
        assert group["foreach"] is True and group["fused"] is None and group["differentiable"] is False
        assert group["maximize"] is False
        opt.param_groups[0]["fused"] = True
        assert opt.param_groups[0]["fused"] is True
        with pytest.raises(ValueError, match="differentiable=True is not supported"):
            make(differentiable=True)
        with pytest.raises(ValueError, match="differentiable=True is not supported"):
            opt.param_groups[0]["differentiable"] = True
        with pytest.raises(TypeError):
            make(foreach="yes")
        with pytest.raises(TypeError):
            make(maximize="yes")
        climbing = make(maximize=True)
        assert climbing.param_groups[0]["maximize"] is True and climbing.maximize is True
    opt = cmlp.optim.Adam(model, 1e-3, (0.9, 0.999), 1e-8, 0.0, True, capturable=True)  # torch's positions
    assert opt.amsgrad is True and opt.param_groups[0]["amsgrad"] is True
    sgd = cmlp.optim.SGD(model)
    with pytest.raises(ValueError, match="SGD has no 'amsgrad' setting"):
        sgd.param_groups[0]["amsgrad"] = True


def test_param_groups_update_is_all_or_nothing_and_initial_lr_is_a_rate():
    opt = cmlp.optim.Adam(cmlp.MLP(SIZES, seed=0), lr=1e-3)
    before = opt.state_dict()["param_groups"]
    with pytest.raises(ValueError):
        opt.param_groups[0].update({"lr": 0.5, "fused": True, "betas": (2.0, 0.9)})
    assert opt.state_dict()["param_groups"] == before and opt.lr == 1e-3
    opt.param_groups[0].update(lr=0.5, betas=(0.8, 0.9))
    assert opt.lr == 0.5 and opt.betas == (0.8, 0.9)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="initial_lr"):
            opt.param_groups[0]["initial_lr"] = bad
        sd = opt.state_dict()
        sd["param_groups"][0]["initial_lr"] = bad
        with pytest.raises(ValueError, match="initial_lr"):
            opt.load_state_dict(sd)
    assert "initial_lr" not in opt.state_dict()["param_groups"][0]


def test_group_keys_round_trip_and_copies_survive_any_reachable_setting():
    import copy

    model = cmlp.MLP(SIZES, seed=0)
    sgd = cmlp.optim.SGD(model, lr=0.1, momentum=0.9, nesterov=True, fused=True)
    sgd.param_groups[0]["capturable"] = True  # not SGD's: kept as any key, as torch keeps it
    sgd.param_groups[0]["note"] = "mine"
    sgd.momentum = 0.0  # torch checks Nesterov's needs when the optimizer is made only
    twin = copy.deepcopy(sgd)
    assert twin.nesterov and twin.momentum == 0.0 and twin.param_groups[0]["capturable"] is True
    sd = sgd.state_dict()
    assert sd["param_groups"][0]["note"] == "mine" and sd["param_groups"][0]["fused"] is True
    other = cmlp.optim.SGD(cmlp.MLP(SIZES, seed=0), lr=0.1, momentum=0.9)
    other.load_state_dict(sd)
    assert other.param_groups[0]["note"] == "mine" and other.param_groups[0]["fused"] is True
    assert other.state_dict()["param_groups"] == sd["param_groups"]
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        cmlp.optim.Adam(model, foreach=True, fused=True)
    model.opt = opt = cmlp.optim.Adam(model)  # a model that refers to its optimizer: one copy of each
    o2 = copy.deepcopy(opt)
    assert o2.model.opt is o2 and o2.model is not model


def test_adamw_stays_decoupled_when_it_loads_an_adam_state_dict_as_torchs():
    """torch's AdamW forces decoupled_weight_decay=True whenever it loads (and in a deepcopy), so
    an Adam checkpoint does not turn it into Adam with L2 decay; a live edit still applies."""
    model = cmlp.MLP(SIZES, seed=0)
    adam = cmlp.optim.Adam(model, weight_decay=0.1)
    cmlp_step(model, adam, *batch_of(1))
    adamw = cmlp.optim.AdamW(cmlp.MLP(SIZES, seed=0))
    adamw.load_state_dict(adam.state_dict())
    assert adamw.decoupled_weight_decay is True and adamw.weight_decay == 0.1
    assert adamw.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True
    adamw.param_groups[0]["decoupled_weight_decay"] = False  # as torch, until the next load
    assert adamw.decoupled_weight_decay is False
    assert copy.deepcopy(adamw).decoupled_weight_decay is True
    plain = cmlp.optim.Adam(cmlp.MLP(SIZES, seed=0))
    plain.load_state_dict(adam.state_dict())
    assert plain.decoupled_weight_decay is False


def batch_of(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], BATCH)


def test_sgd_takes_nesterov_and_weight_decay_by_name_only():
    """torch's fifth positional argument is weight_decay, nesterov the sixth: a positional call
    written either way would silently mean the other, so both are refused."""
    model = cmlp.MLP(SIZES, seed=0)
    for args in ((0.1, 0.9, 0.0, 1e-4), (0.1, 0.9, 0.0, True), (0.1, 0.9, 0.0, 1e-4, True)):
        with pytest.raises(TypeError, match="by name"):
            cmlp.optim.SGD(model, *args)
    opt = cmlp.optim.SGD(model, 0.1, 0.9, 0.0, weight_decay=1e-4, nesterov=True)
    assert (opt.lr, opt.momentum, opt.dampening, opt.weight_decay, opt.nesterov) == (0.1, 0.9, 0.0, 1e-4, True)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_step_closure_state_and_defaults_as_torchs(kind):
    torch = pytest.importorskip("torch")
    model = cmlp.MLP(SIZES, seed=0)
    make = {"adam": lambda m, **kw: cmlp.optim.Adam(m, lr=2e-3, **kw),
            "sgd": lambda m, **kw: cmlp.optim.SGD(m, lr=0.05, momentum=0.9, **kw)}[kind]
    opt = make(model)
    tmake = {"adam": lambda p: torch.optim.Adam(p, lr=2e-3), "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}
    theirs = tmake[kind]([torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults == {k: v for k, v in theirs.defaults.items()}
    assert opt.state == {}
    x, y = batch_of(2)
    twin = cmlp.MLP(SIZES, seed=0)
    topt = make(twin)

    def closure():
        opt.zero_grad()
        return model.forward_backward(x, y)

    loss = opt.step(closure)
    topt.zero_grad()
    assert loss == twin.forward_backward(x, y)
    assert topt.step() is None
    assert same_arrays(model.state_dict(), twin.state_dict())
    state = opt.state
    assert sorted(state) == opt.param_groups[0]["params"] == list(range(6))
    for p in opt.param_groups[0]["params"]:  # torch's idiom
        assert set(state[p]) == set(theirs_state_keys(kind))
    opt.lr = 1.0
    assert opt.defaults["lr"] == (2e-3 if kind == "adam" else 0.05)  # as constructed
    with pytest.raises(TypeError, match="closure"):
        opt.step(3)


def theirs_state_keys(kind):
    return ("step", "exp_avg", "exp_avg_sq") if kind == "adam" else ("momentum_buffer",)


def same_arrays(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def torch_twin(torch, model):
    """torch Linear layers holding the model's parameters, and a function of their logits."""
    layers = [torch.nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])]
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.weight.copy_(torch.from_numpy(model.state_dict()[f"fc{i + 1}.weight"]))
            layer.bias.copy_(torch.from_numpy(model.state_dict()[f"fc{i + 1}.bias"]))

    def logits(x):
        h = torch.from_numpy(x)
        for i, layer in enumerate(layers):
            h = layer(h) if i == len(layers) - 1 else torch.relu(layer(h))
        return h

    return layers, logits


def as_numpy_state(sd):
    return {"state": {k: {n: (v.numpy() if hasattr(v, "numpy") else v) for n, v in e.items()}
                      for k, e in sd["state"].items()}, "param_groups": sd["param_groups"]}


@pytest.mark.parametrize("kind,kwargs", [("Adam", {"amsgrad": True}), ("Adam", {"maximize": True, "weight_decay": 0.1}),
                                         ("AdamW", {"amsgrad": True, "maximize": True}),
                                         ("SGD", {"lr": 0.05, "momentum": 0.9, "maximize": True})],
                         ids=lambda v: v if isinstance(v, str) else case_id(v))
def test_amsgrad_and_maximize_follow_torch_and_their_state_dicts_load_both_ways(kind, kwargs):
    torch = pytest.importorskip("torch")
    model = cmlp.MLP(SIZES, seed=2)
    layers, logits = torch_twin(torch, model)
    theirs = getattr(torch.optim, kind)([p for layer in layers for p in layer.parameters()], **kwargs)
    mine = getattr(cmlp.optim, kind)(model, **kwargs)
    rng = np.random.default_rng(3)
    for step in range(12):
        x, y = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], BATCH)
        theirs.zero_grad()
        torch.nn.functional.cross_entropy(logits(x), torch.from_numpy(y)).backward()
        theirs.step()
        cmlp_step(model, mine, x, y)
        if step == 5:  # each takes the other's state and goes on from it
            ours, torchs = mine.state_dict(), as_numpy_state(theirs.state_dict())
            assert [sorted(e) for e in ours["state"].values()] == [sorted(e) for e in torchs["state"].values()]
            assert ours["param_groups"][0].keys() >= {k for k in torchs["param_groups"][0] if k != "fused"}
            for key in ("amsgrad", "maximize"):
                if key in torchs["param_groups"][0]:
                    assert ours["param_groups"][0][key] == torchs["param_groups"][0][key]
            mine.load_state_dict(torchs)
            theirs.load_state_dict({"state": {k: {n: torch.tensor(v) for n, v in e.items()}
                                              for k, e in ours["state"].items()},
                                    "param_groups": theirs.state_dict()["param_groups"]})
    got = model.state_dict()
    for i, layer in enumerate(layers):
        assert rel_err(got[f"fc{i + 1}.weight"], layer.weight.detach().numpy()) < 1e-5
        assert rel_err(got[f"fc{i + 1}.bias"], layer.bias.detach().numpy()) < 1e-5


def test_amsgrad_turned_on_after_steps_starts_its_maximum_there_and_off_keeps_it():
    model = cmlp.MLP(SIZES, seed=4)
    start = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    ref = RefAdam(lr=3e-3)
    ref_model = RefMLP(SIZES, {k: v.copy() for k, v in start.items()})
    opt = cmlp.optim.Adam(model, lr=3e-3)
    rng = np.random.default_rng(8)
    for step in range(10):
        x, y = draw_batch(ref_model, rng, BATCH, MARGIN)
        if step == 4:  # on: the reference makes its maximum at the next step, from zeros, as cmlp
            opt.amsgrad = ref.amsgrad = True
        if step == 8:
            opt.param_groups[0]["amsgrad"] = ref.amsgrad = False
        _, grads = ref_model.loss_and_grads(x, y)
        ref.step(ref_model.params, grads)
        cmlp_step(model, opt, x, y)
        names = sorted(opt.state[0])
        assert names == (["exp_avg", "exp_avg_sq", "step"] if step < 4 else
                         ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]), (step, names)
    got = model.state_dict()
    kept = opt.state_dict()["state"]
    for i, name in enumerate(got):
        assert rel_err(got[name], ref_model.params[name]) < 1e-5, name
        assert rel_err(kept[i]["max_exp_avg_sq"], ref.max_exp_avg_sq[name]) < 1e-5, name
    # the kept maximum stays as it was once AMSGrad is off, and a state_dict with it loads anywhere
    twin = cmlp.optim.Adam(cmlp.MLP(SIZES, seed=4))
    twin.load_state_dict(opt.state_dict())
    assert twin.amsgrad is False and sorted(twin.state[0]) == sorted(opt.state[0])
    bad = opt.state_dict()
    del bad["state"][0]["exp_avg"]
    for e in bad["state"].values():
        e.pop("exp_avg", None)
    with pytest.raises(ValueError, match="without exp_avg and exp_avg_sq"):
        twin.load_state_dict(bad)
    neg = opt.state_dict()
    neg["state"][1]["max_exp_avg_sq"][0] = -1.0
    with pytest.raises(ValueError, match="max_exp_avg_sq must be >= 0"):
        twin.load_state_dict(neg)


def test_a_loaded_group_without_torchs_flags_takes_their_defaults_as_torch_does():
    """torch's load_state_dict sets a flag a loaded group lacks to False (amsgrad, maximize,
    nesterov); a missing rate or weight decay keeps the group's own."""
    model = cmlp.MLP(SIZES, seed=0)
    adam = cmlp.optim.Adam(model, lr=2e-3, amsgrad=True, maximize=True)
    sd = adam.state_dict()
    for key in ("amsgrad", "maximize", "lr"):
        del sd["param_groups"][0][key]
    adam.load_state_dict(sd)
    assert (adam.amsgrad, adam.maximize, adam.lr) == (False, False, 2e-3)
    sgd = cmlp.optim.SGD(model, lr=0.1, momentum=0.9, nesterov=True, maximize=True)
    sd = sgd.state_dict()
    del sd["param_groups"][0]["nesterov"], sd["param_groups"][0]["maximize"]
    sgd.load_state_dict(sd)
    assert (sgd.nesterov, sgd.maximize, sgd.momentum) == (False, False, 0.9)


@pytest.mark.filterwarnings("ignore::cmlp.MemoryWarning")
def test_a_step_that_runs_out_of_memory_after_amsgrad_is_turned_on_leaves_no_maximum_behind():
    """The maximum made for that step goes with it: memory and state as before, and the next
    step, with room, makes it again (training as if nothing had failed)."""
    M = cmlp.memory
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 256)).astype(np.float32), rng.integers(0, 10, 64)
    runs = []
    for fail in (True, False):
        model = cmlp.MLP([256, 1024, 256, 10], seed=0)
        opt = cmlp.optim.Adam(model)
        trainer = cmlp.Trainer(model, opt, batch_size=64, shuffle=False)
        trainer.step(x, y)
        opt.amsgrad = True
        if fail:  # no room: the cache's free blocks (other tests' too) taken, and no new segment
            model._c.release_workspace()
            M.empty_cache("cpu")
            taken = fill_cache_but("cpu", 0)
            before, keys = M.memory_allocated("cpu"), sorted(opt.state[0])
            M.set_memory_limit(M.memory_reserved("cpu"), "cpu")
            try:
                with pytest.raises(cmlp.OutOfMemoryError):
                    trainer.step(x, y)
                assert M.memory_allocated("cpu") == before and sorted(opt.state[0]) == keys
            finally:
                M.set_memory_limit(None, "cpu")
                for ptr in taken:
                    M.caching_allocator_delete(ptr)
        trainer.step(x, y)
        runs.append(model._c.get_params())
        assert "max_exp_avg_sq" in opt.state[0]
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("kind,kwargs", [("Adam", {"weight_decay": 0.0}), ("AdamW", {"amsgrad": True}),
                                         ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0})])
def test_repr_lists_each_groups_settings_as_torchs(kind, kwargs):
    model = cmlp.MLP(SIZES, seed=0)
    mine = repr(getattr(cmlp.optim, kind)(model, **kwargs))
    assert mine.startswith(f"{kind} (\nParameter Group 0\n") and mine.endswith("\n)") and "params" not in mine
    torch = pytest.importorskip("torch")
    layers, _ = torch_twin(torch, model)
    # (the settings given as floats: torch keeps its defaults' int zeros, cmlp floats)
    assert mine == repr(getattr(torch.optim, kind)([p for layer in layers for p in layer.parameters()], **kwargs))


def test_repr_of_groups_apart():
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.SGD(model, lr=0.1, param_groups=[{"params": ["fc1.weight", "fc1.bias"], "lr": 0.5},
                                                      {"params": ["fc2.weight", "fc2.bias", "fc3.weight",
                                                                  "fc3.bias"]}])
    lines = repr(opt).splitlines()
    assert lines[0] == "SGD (" and lines[-1] == ")"
    assert lines.index("Parameter Group 1") > lines.index("Parameter Group 0") == 1
    assert "    lr: 0.5" in lines and "    lr: 0.1" in lines
