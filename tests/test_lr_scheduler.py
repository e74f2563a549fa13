"""cmlp.optim.lr_scheduler: the rates torch's schedules give, to the bit (same formulas in double),
their state_dict, resuming, and Trainer.fit(scheduler=...) stepping one per epoch or, with
scheduler_interval="step", one per optimizer step.
"""
import gc
import math
import os
import re
import sys
import warnings

import numpy as np
import pytest

import cmlp
from cmlp.optim import lr_scheduler as S

sys.path.insert(0, os.path.dirname(__file__))
from checks import CountedCalls  # noqa: E402

SIZES = [12, 16, 3]

# most tests step schedules alone, which torch's first step() warns about (tested below)
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")

CASES = [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[2, 5, 5, 9], gamma=0.3)),
    ("ExponentialLR", dict(gamma=0.9)),
    ("CosineAnnealingLR", dict(T_max=7, eta_min=1e-4)),
    ("CosineAnnealingLR", dict(T_max=3)),
    ("LinearLR", dict()),
    ("LinearLR", dict(start_factor=0.1, end_factor=0.5, total_iters=4)),
    ("LambdaLR", dict(lr_lambda=lambda e: 1.0 / (1 + e) ** 0.5)),
    ("MultiplicativeLR", dict(lr_lambda=lambda e: 0.95 if e % 2 else 0.99)),
    ("ConstantLR", dict()),
    ("ConstantLR", dict(factor=0.5, total_iters=3)),
    ("PolynomialLR", dict()),
    ("PolynomialLR", dict(total_iters=7, power=2.5)),
    ("CosineAnnealingWarmRestarts", dict(T_0=4)),
    ("CosineAnnealingWarmRestarts", dict(T_0=3, T_mult=2, eta_min=1e-3)),
    # lengths given as floats, which torch takes too (T_max=total_steps / 2)
    ("StepLR", dict(step_size=2.5)),
    ("CosineAnnealingLR", dict(T_max=7.5, eta_min=1e-4)),
    ("CosineAnnealingLR", dict(T_max=6.0)),
    ("LinearLR", dict(total_iters=4.5)),
    ("ConstantLR", dict(total_iters=3.0)),
    ("PolynomialLR", dict(total_iters=5.5, power=2.0)),
    # no steps to go: torch's forms stay at the start factor, and at the rate
    ("LinearLR", dict(start_factor=0.5, total_iters=0)),
    ("PolynomialLR", dict(total_iters=0, power=2.0)),
]


def case_id(case):
    name, kw = case
    return name + "".join(f"-{k}{v}" for k, v in kw.items() if k != "lr_lambda")


def rates(sched, steps=25):
    out = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def torch_rates(topt, ts, steps=25):
    """torch's rates over `steps` steps of its loop (optimizer.step(), then scheduler.step())."""
    out = [ts.get_last_lr()[0]]
    for _ in range(steps):
        topt.step()
        ts.step()
        out.append(ts.get_last_lr()[0])
    return out


def make(name, kw, lr=0.1, kind="adam"):
    model = cmlp.MLP(SIZES)
    opt = cmlp.optim.Adam(model, lr=lr) if kind == "adam" else cmlp.optim.SGD(model, lr=lr, momentum=0.9)
    return opt, getattr(S, name)(opt, **kw)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rates_are_torchs_to_the_bit(case):
    torch = pytest.importorskip("torch")
    name, kw = case
    opt, sched = make(name, kw)
    mine = rates(sched)
    assert opt.lr == mine[-1]
    topt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert mine == torch_rates(topt, getattr(torch.optim.lr_scheduler, name)(topt, **kw))


def composites(S, opt):
    """SequentialLR and ChainedScheduler cases, made with the module S (cmlp's or torch's)."""
    return {
        "warmup-cosine": lambda: S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=4),
                                                      S.CosineAnnealingLR(opt, T_max=10)], milestones=[4]),
        "three-parts": lambda: S.SequentialLR(opt, [S.LambdaLR(opt, lambda e: (e + 1) / 3),
                                                    S.StepLR(opt, step_size=2, gamma=0.5),
                                                    S.ExponentialLR(opt, gamma=0.9)], milestones=[3, 8]),
        "restart-polynomial": lambda: S.SequentialLR(opt, [S.ConstantLR(opt, factor=0.2, total_iters=2),
                                                           S.PolynomialLR(opt, total_iters=6, power=2.0),
                                                           S.MultiStepLR(opt, [2, 4], gamma=0.3)],
                                                     milestones=[5, 12]),
        "chained": lambda: S.ChainedScheduler([S.ConstantLR(opt, factor=0.1, total_iters=2),
                                               S.ExponentialLR(opt, gamma=0.9)]),
    }


@pytest.mark.parametrize("name", ["warmup-cosine", "three-parts", "restart-polynomial", "chained"])
def test_composite_schedules_are_torchs_to_the_bit(name):
    torch = pytest.importorskip("torch")
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    mine = rates(composites(S, opt)[name](), 25)
    assert opt.lr == mine[-1]
    topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert mine == torch_rates(topt, composites(torch.optim.lr_scheduler, topt)[name]())


def optimizer_pair(kind, lr, momentum):
    """torch, and the same optimizer in cmlp and torch (Adam with betas (0.9, 0.99), or SGD)."""
    torch = pytest.importorskip("torch")
    model, param = cmlp.MLP(SIZES), [torch.nn.Parameter(torch.zeros(1))]
    if kind == "adam":
        betas = (0.9, 0.99)
        return torch, cmlp.optim.Adam(model, lr=lr, betas=betas), torch.optim.Adam(param, lr=lr, betas=betas)
    return torch, cmlp.optim.SGD(model, lr=lr, momentum=momentum), torch.optim.SGD(param, lr=lr, momentum=momentum)


ONE_CYCLE = [("adam", dict(max_lr=0.5, total_steps=25)),
             ("sgd", dict(max_lr=[0.3], epochs=5, steps_per_epoch=5, anneal_strategy="linear")),
             ("adam", dict(max_lr=1.0, total_steps=25, three_phase=True, pct_start=0.25, div_factor=10.0)),
             ("sgd", dict(max_lr=0.2, total_steps=25, cycle_momentum=False, final_div_factor=100.0))]


@pytest.mark.parametrize("kind,kw", ONE_CYCLE, ids=["adam-cos", "sgd-linear", "adam-three-phase", "sgd-no-momentum"])
def test_one_cycle_rates_and_momenta_are_torchs_to_the_bit(kind, kw):
    torch, opt, topt = optimizer_pair(kind, lr=0.1, momentum=0.9)
    sched = S.OneCycleLR(opt, **kw)
    ts = torch.optim.lr_scheduler.OneCycleLR(topt, **kw)
    for _ in range(25):
        group = topt.param_groups[0]
        assert opt.lr == max(group["lr"], 0.0)  # torch's linear strategy goes below 0 after its last step
        assert opt._momentum() == (group["betas"][0] if kind == "adam" else group["momentum"])
        if kind == "adam":
            assert opt.betas[1] == 0.99
        topt.step()
        ts.step()
        sched.step()
    group = topt.param_groups[0]
    assert opt.lr == max(group["lr"], 0.0) and (kind == "sgd" and "linear" in kw.values()) == (group["lr"] < 0)
    with pytest.raises(ValueError, match="Tried to step 26 times"):
        sched.step()
    assert opt.state_dict()["param_groups"][0]["initial_lr"] == topt.param_groups[0]["initial_lr"]


def test_one_cycle_through_zero_momentum_keeps_sgds_buffer_as_torch_does():
    """base_momentum=0: the momentum reaches 0 at the peak and comes back; torch keeps the
    momentum buffer meanwhile (and Nesterov takes plain steps at 0), and so does SGD here, in a
    hand loop and in fit."""
    torch = pytest.importorskip("torch")
    x, y = data(160)
    kw = dict(max_lr=0.2, total_steps=20, pct_start=0.25, base_momentum=0.0)
    for nesterov in (False, True):
        runs = []
        for by_fit in (True, False):
            model = cmlp.MLP(SIZES, seed=6)
            opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9, nesterov=nesterov)
            sched = S.OneCycleLR(opt, **kw)
            trainer = cmlp.Trainer(model, opt, batch_size=16, shuffle=False)
            if by_fit:
                trainer.fit(x, y, epochs=2, progress=False, scheduler=sched, scheduler_interval="step")
            else:
                hand_loop(trainer, sched, x, y, 2, 16)
            runs.append(model._c.get_params())
        np.testing.assert_array_equal(runs[0], runs[1])
        torch.manual_seed(0)
        ref = cmlp.MLP(SIZES, seed=6)
        params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in ref.state_dict().values()]
        topt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=nesterov)
        ts = torch.optim.lr_scheduler.OneCycleLR(topt, **kw)
        names = list(ref.state_dict())
        for i in range(0, 320, 16):  # cmlp's gradients at torch's parameters, then torch's step
            ref.load_state_dict({k: p.detach().numpy() for k, p in zip(names, params)})
            ref.zero_grad()
            ref.forward_backward(x[i % 160:i % 160 + 16], y[i % 160:i % 160 + 16])
            for p, g in zip(params, ref.grads().values()):
                p.grad = torch.from_numpy(g)
            topt.step()
            ts.step()
        theirs = np.concatenate([p.detach().numpy().ravel() for p in params])
        mine = np.concatenate([v.ravel() for v in model.state_dict().values()])
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)


def test_a_one_cycle_schedule_the_optimizer_refuses_changes_nothing():
    opt = cmlp.optim.Adam(cmlp.MLP(SIZES), lr=0.01, betas=(0.8, 0.99))
    with pytest.raises(ValueError, match="beta"):
        S.OneCycleLR(opt, max_lr=0.1, total_steps=10, max_momentum=1.5)
    assert (opt._initial_lr, opt.lr, opt.betas) == (None, 0.01, (0.8, 0.99))


def test_a_call_that_fails_leaves_the_schedule_as_after_the_steps_it_took():
    """Out of memory at the first step (no automatic micro-batching): nothing was taken, and the
    schedule and the rate are as before the call."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((96, 784)).astype(np.float32), rng.integers(0, 10, 96)
    model = cmlp.MLP([784, 512, 10])  # Adam's state (3.3 MB) needs memory beyond what is reserved
    opt = cmlp.optim.Adam(model, lr=0.1)
    sched = warmup(opt)
    trainer = cmlp.Trainer(model, opt, batch_size=16, auto_microbatch=False)
    gc.collect()
    cmlp.memory.empty_cache("cpu")  # no cached block that Adam's state could take
    cmlp.memory.set_memory_limit(cmlp.memory.memory_reserved("cpu"), "cpu")
    try:
        with pytest.raises(cmlp.OutOfMemoryError):
            trainer.fit(x, y, epochs=1, progress=False, scheduler=sched, scheduler_interval="step")
    finally:
        cmlp.memory.set_memory_limit(None, "cpu")
    assert (sched.last_epoch, opt.lr, trainer._c.run_steps()) == (0, 0.1 * (1 / 5), 0)


def test_fit_with_one_cycle_equals_the_hand_loop():
    """OneCycleLR cycles Adam's beta1 with the rate: fit ends each call into C where the momentum
    changes, and trains as the hand loop does."""
    x, y = data(160)
    runs = []
    for by_fit in (True, False):
        model = cmlp.MLP(SIZES, seed=6)
        opt = cmlp.optim.Adam(model, lr=0.01)
        sched = S.OneCycleLR(opt, max_lr=0.05, epochs=2, steps_per_epoch=10)
        trainer = cmlp.Trainer(model, opt, batch_size=16, shuffle=False)
        if by_fit:
            trainer.fit(x, y, epochs=2, progress=False, scheduler=sched, scheduler_interval="step")
        else:
            hand_loop(trainer, sched, x, y, 2, 16)
        runs.append((model._c.get_params(), opt.lr, opt.betas, sched.last_epoch))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:] and runs[0][3] == 20


class Halving:
    """A scale_fn with state of its own (torch keeps such an object's attributes in state_dict)."""

    def __init__(self):
        self.base = 2.0

    def __call__(self, x):
        return 1 / (self.base ** (x - 1))


CYCLIC = [("adam", dict(base_lr=0.01, max_lr=0.1, step_size_up=4)),
          ("sgd", dict(base_lr=[0.001], max_lr=0.05, step_size_up=3, step_size_down=5, mode="triangular2")),
          ("adam", dict(base_lr=0.02, max_lr=0.2, step_size_up=2, mode="exp_range", gamma=0.9,
                        base_momentum=0.85, max_momentum=0.95)),
          ("sgd", dict(base_lr=0.01, max_lr=0.1, step_size_up=5, scale_fn=lambda x: 0.5 ** x,
                       scale_mode="iterations")),
          ("sgd", dict(base_lr=0.01, max_lr=0.1, step_size_up=3, cycle_momentum=False))]


@pytest.mark.parametrize("kind,kw", CYCLIC, ids=["adam-triangular", "sgd-triangular2", "adam-exp-range",
                                                 "sgd-scale-fn", "sgd-no-momentum"])
def test_cyclic_rates_and_momenta_are_torchs_to_the_bit(kind, kw):
    torch, opt, topt = optimizer_pair(kind, lr=0.3, momentum=0.5)
    sched = S.CyclicLR(opt, **kw)
    ts = torch.optim.lr_scheduler.CyclicLR(topt, **kw)
    for _ in range(30):
        group = topt.param_groups[0]
        assert opt.lr == group["lr"]
        assert opt._momentum() == (group["betas"][0] if kind == "adam" else group["momentum"])
        topt.step()
        ts.step()
        sched.step()
    assert opt.state_dict()["param_groups"][0]["initial_lr"] == topt.param_groups[0]["initial_lr"]
    keys = ("initial_lr", "max_momentum", "base_momentum")  # the bounds kept in the groups too, as torch's
    assert [{k: g[k] for k in keys if k in g} for g in opt.state_dict()["param_groups"]] == \
           [{k: g[k] for k in keys if k in g} for g in topt.state_dict()["param_groups"]]


def test_cyclic_state_dict_resumes_and_bad_arguments_change_nothing():
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.3, momentum=0.5)
    fn = Halving()
    sched = S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3, scale_fn=fn)
    for _ in range(4):
        sched.step()
    state = sched.state_dict()
    assert state["_scale_fn_custom"] == {"base": 2.0} and "optimizer" not in state
    ahead = rates(sched, 6)
    fn2 = Halving()
    fn2.base = 7.0
    again = S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3, scale_fn=fn2, last_epoch=0)
    again.load_state_dict(state)
    assert fn2.base == 2.0 and again.last_epoch == 4
    opt.lr = ahead[0]
    assert rates(again, 6)[1:] == ahead[1:]
    plain = S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, scale_fn=lambda x: 1.0, last_epoch=0)
    assert plain.state_dict()["_scale_fn_custom"] is None
    opt = cmlp.optim.Adam(cmlp.MLP(SIZES), lr=0.01, betas=(0.8, 0.99))
    for kw, error in [(dict(mode="sawtooth"), ValueError), (dict(max_momentum=1.5), ValueError),
                      (dict(base_lr=[0.1, 0.2]), ValueError), (dict(step_size_up=0), ValueError),
                      (dict(scale_fn=3), TypeError)]:
        with pytest.raises(error):
            S.CyclicLR(opt, **{"base_lr": 0.001, "max_lr": 0.1, **kw})
        assert (opt._initial_lr, opt.lr, opt.betas) == (None, 0.01, (0.8, 0.99)), kw


def test_fit_with_cyclic_equals_the_hand_loop():
    """CyclicLR moves SGD's momentum with the rate at every step, in fit as in the hand loop."""
    x, y = data(160)
    runs = []
    for by_fit in (True, False):
        model = cmlp.MLP(SIZES, seed=6)
        opt = cmlp.optim.SGD(model, lr=0.01, momentum=0.9, nesterov=True)
        sched = S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3, mode="triangular2")
        trainer = cmlp.Trainer(model, opt, batch_size=16, shuffle=False)
        if by_fit:
            trainer.fit(x, y, epochs=2, progress=False, scheduler=sched, scheduler_interval="step")
        else:
            hand_loop(trainer, sched, x, y, 2, 16)
        runs.append((model._c.get_params(), opt.lr, opt.momentum, sched.last_epoch))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:] and runs[0][3] == 20


def test_composites_resume_from_a_state_dict_and_check_their_parts():
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    sched = composites(S, opt)["three-parts"]()
    for _ in range(5):
        sched.step()
    saved, lr = sched.state_dict(), opt.lr
    rest = rates(sched, 9)
    opt2 = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    again = composites(S, opt2)["three-parts"]()
    opt2.lr = lr
    again.load_state_dict(saved)
    assert rates(again, 9) == rest
    other = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    with pytest.raises(ValueError, match="same optimizer"):
        S.SequentialLR(opt, [S.StepLR(opt, 2), S.StepLR(other, 2)], milestones=[3])
    with pytest.raises(ValueError, match="number of milestone"):
        S.SequentialLR(opt, [S.StepLR(opt, 2), S.StepLR(opt, 2)], milestones=[3, 4])
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        S.ChainedScheduler([S.ReduceLROnPlateau(opt)])
    with pytest.raises(ValueError, match="at least one"):
        S.SequentialLR(opt, [], milestones=[])
    with pytest.raises(ValueError, match="T_0"):
        S.CosineAnnealingWarmRestarts(opt, T_0=0)
    with pytest.raises(ValueError, match="Constant multiplicative factor"):
        S.ConstantLR(opt, factor=1.5)


def test_a_lambdas_own_state_travels_in_the_state_dict_as_in_torch():
    """A callable object that keeps state (not a plain function): its attributes are saved and
    restored, so the resumed schedule continues its rates."""

    class Decay:
        def __init__(self):
            self.calls = 0

        def __call__(self, epoch):
            self.calls += 1
            return 0.9 ** self.calls

    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    sched = S.LambdaLR(opt, Decay())
    rates(sched, 3)
    saved = sched.state_dict()
    assert saved["lr_lambdas"] == [{"calls": 4}]
    rest = rates(sched, 3)
    opt2 = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    again = S.LambdaLR(opt2, Decay())
    again.load_state_dict(saved)
    opt2.lr = rest[0]
    assert rates(again, 3) == rest
    assert S.MultiplicativeLR(opt, lambda e: 0.5).state_dict()["lr_lambdas"] == [None]


def test_closed_forms_without_torch():
    _, step = make("StepLR", dict(step_size=2, gamma=0.1))
    np.testing.assert_allclose(rates(step, 6), [0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 1e-4], rtol=1e-12)
    _, cos = make("CosineAnnealingLR", dict(T_max=10, eta_min=0.01))
    r = rates(cos, 10)
    want = [0.01 + 0.09 * (1 + math.cos(math.pi * t / 10)) / 2 for t in range(11)]
    np.testing.assert_allclose(r, want, rtol=1e-12)
    _, warm = make("LinearLR", dict(start_factor=0.25, total_iters=3))
    np.testing.assert_allclose(rates(warm, 5), [0.025, 0.05, 0.075, 0.1, 0.1, 0.1], rtol=1e-12)
    _, lam = make("LambdaLR", dict(lr_lambda=lambda e: 0.5 ** e))
    np.testing.assert_allclose(rates(lam, 3), [0.1, 0.05, 0.025, 0.0125], rtol=1e-15)
    _, poly = make("PolynomialLR", dict(total_iters=4, power=2.0))
    np.testing.assert_allclose(rates(poly, 5), [0.1 * (1 - min(t, 4) / 4) ** 2 for t in range(6)], atol=1e-15)
    for name, kw, want in (("LinearLR", dict(start_factor=0.5, total_iters=0), 0.05),
                           ("PolynomialLR", dict(total_iters=0), 0.1)):  # (torch's closed forms divide by 0)
        opt, sched = make(name, kw)
        assert rates(sched, 3) == [want] * 4
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the epoch argument is deprecated)
            sched.step(2)
        assert sched.get_last_lr() == [want]
    _, sgdr = make("CosineAnnealingWarmRestarts", dict(T_0=2, T_mult=2))
    cycle = [(0, 2), (1, 2), (0, 4), (1, 4), (2, 4), (3, 4), (0, 8)]
    np.testing.assert_allclose(rates(sgdr, 6), [0.05 * (1 + math.cos(math.pi * c / T)) for c, T in cycle],
                               rtol=1e-12)


@pytest.mark.parametrize("case", CASES[:5], ids=case_id)
def test_a_state_dict_resumes_the_schedule(case):
    name, kw = case
    opt, sched = make(name, kw)
    for _ in range(4):
        sched.step()
    saved, lr = sched.state_dict(), opt.lr
    rest = rates(sched, 8)
    opt2, sched2 = make(name, kw, lr=0.7)  # another rate: the state and the optimizer's rate carry it
    opt2.lr = lr
    sched2.load_state_dict(saved)
    assert rates(sched2, 8) == rest


def test_multistep_milestones_are_a_counter_that_torch_can_resume():
    """MultiStepLR.milestones is a collections.Counter, as torch's: torch's scheduler, given
    cmlp's state_dict, takes .elements() of it; a state_dict with a plain dict loads as a Counter."""
    from collections import Counter

    opt, sched = make("MultiStepLR", dict(milestones=[5, 2, 5], gamma=0.5), lr=1.0)
    assert type(sched.milestones) is Counter and sched.milestones == Counter({2: 1, 5: 2})
    saved = sched.state_dict()
    saved["milestones"] = dict(saved["milestones"])
    sched.load_state_dict(saved)
    assert type(sched.milestones) is Counter
    with pytest.warns(UserWarning, match="deprecated"):
        sched.step(7)  # the closed form
    assert opt.lr == 0.125
    torch = pytest.importorskip("torch")
    topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ts = torch.optim.lr_scheduler.MultiStepLR(topt, milestones=[1])
    ts.load_state_dict(sched.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's step(epoch) is deprecated
        ts.step(7)
    assert topt.param_groups[0]["lr"] == 0.125


def test_resuming_needs_the_initial_rate_and_arguments_are_checked():
    model = cmlp.MLP(SIZES)
    opt = cmlp.optim.SGD(model, lr=0.1)
    with pytest.raises(KeyError, match="initial_lr"):
        S.StepLR(opt, step_size=2, last_epoch=3)
    S.StepLR(opt, step_size=2)
    assert S.StepLR(opt, step_size=2, last_epoch=3).base_lrs == [0.1]
    for bad in (0, -1, 0.5, True, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="step_size"):
            S.StepLR(opt, step_size=bad)
    with pytest.raises(ValueError, match="T_max"):
        S.CosineAnnealingLR(opt, T_max=0)
    with pytest.raises(ValueError, match="Starting multiplicative factor"):
        S.LinearLR(opt, start_factor=0)
    with pytest.raises(TypeError, match="not a cmlp optimizer"):
        S.ExponentialLR(object(), gamma=0.5)
    with pytest.raises(TypeError, match="callable"):
        S.LambdaLR(opt, lr_lambda=3)
    with pytest.raises(ValueError, match="learning rate"):  # the rate is the optimizer's to check
        S.LambdaLR(opt, lr_lambda=lambda e: -1.0)


def data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, np.argmax(x @ rng.standard_normal((SIZES[0], SIZES[-1])), axis=1)


def test_fit_steps_the_schedule_once_an_epoch_as_a_loop_of_one_epoch_fits_does():
    x, y = data()
    a, b = cmlp.MLP(SIZES, seed=1), cmlp.MLP(SIZES, seed=1)
    oa, ob = cmlp.optim.SGD(a, lr=0.2, momentum=0.9), cmlp.optim.SGD(b, lr=0.2, momentum=0.9)
    sa, sb = S.CosineAnnealingLR(oa, T_max=4), S.CosineAnnealingLR(ob, T_max=4)
    history = cmlp.Trainer(a, oa, batch_size=16).fit(x, y, epochs=4, progress=False, scheduler=sa)
    tb = cmlp.Trainer(b, ob, batch_size=16)
    lrs = []
    for _ in range(4):
        lrs.append(ob.lr)
        tb.fit(x, y, epochs=1, progress=False)
        sb.step()
    assert [h["lr"] for h in history] == lrs and lrs[0] == 0.2 and lrs[2] == pytest.approx(0.1)
    np.testing.assert_array_equal(a._c.get_params(), b._c.get_params())
    assert oa.lr == ob.lr == pytest.approx(0.0, abs=1e-15)


def test_fit_refuses_a_schedule_of_another_optimizer():
    x, y = data()
    model = cmlp.MLP(SIZES)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=16)
    other = cmlp.optim.Adam(cmlp.MLP(SIZES))
    with pytest.raises(ValueError, match="another optimizer"):
        trainer.fit(x, y, epochs=1, progress=False, scheduler=S.StepLR(other, 1))
    with pytest.raises(TypeError, match="scheduler"):
        trainer.fit(x, y, epochs=1, progress=False, scheduler="cosine")
    assert trainer.fit(x, y, epochs=1, progress=False)[0]["lr"] == 1e-3


def warmup(opt, steps=5):
    """Linear warm-up, then a decay every third step: a rate that changes at every step."""
    return S.LambdaLR(opt, lambda k: min(1.0, (k + 1) / steps) * 0.8 ** (k // 3))


def hand_loop(trainer, sched, x, y, epochs, batch):
    """torch's per-step loop: a step, then scheduler.step(). Returns each epoch's first rate."""
    firsts = []
    for _ in range(epochs):
        firsts.append(trainer.optimizer.lr)
        for i in range(0, len(x), batch):
            trainer.step(x[i:i + batch], y[i:i + batch])
            sched.step()
    return firsts


STEP_CASES = [("adam", None, 1), ("adamw", None, 2), ("sgd", None, 1), ("adam", "fp16", 2), ("sgd", "bf16", 1),
              ("sgd-sequential", None, 1)]


@pytest.mark.parametrize("kind,amp,accumulation", STEP_CASES, ids=["-".join(map(str, c)) for c in STEP_CASES])
def test_fit_steps_a_schedule_per_step_as_torchs_loop_does(kind, amp, accumulation):
    """scheduler_interval="step": each optimizer step trains at the rate the schedule gave it, and
    the schedule is stepped after it; the same bits as Trainer.step and scheduler.step() by hand
    (with accumulation over distinct micro-batches, and under amp)."""
    x, y = data(200)
    runs = []
    for by_fit in (True, False):
        model = cmlp.MLP(SIZES, seed=2)
        opt = {"adam": lambda: cmlp.optim.Adam(model, lr=0.05),
               "adamw": lambda: cmlp.optim.AdamW(model, lr=0.05, weight_decay=0.1),
               "sgd": lambda: cmlp.optim.SGD(model, lr=0.2, momentum=0.9, nesterov=True),
               "sgd-sequential": lambda: cmlp.optim.SGD(model, lr=0.2)}[kind]()
        sched = warmup(opt) if kind != "sgd-sequential" else composites(S, opt)["warmup-cosine"]()
        trainer = cmlp.Trainer(model, opt, batch_size=8, accumulation_steps=accumulation, amp=amp, shuffle=False)
        if by_fit:
            history = trainer.fit(x, y, epochs=2, progress=False, scheduler=sched, scheduler_interval="step")
            firsts = [h["lr"] for h in history]
        else:
            firsts = hand_loop(trainer, sched, x, y, 2, 8 * accumulation)
        runs.append((model._c.get_params(), firsts, opt.lr, sched.last_epoch,
                     trainer.scaler and trainer.scaler.get_scale()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:]
    assert runs[0][3] == 2 * -(-200 // (8 * accumulation))  # stepped once per step


def test_a_schedule_per_step_fills_calls_of_at_most_max_rates_steps():
    """An epoch of more than 200 * MAX_RATES steps: fit's calls into C take MAX_RATES rates at a
    time (the rest at the end of the epoch), and the run is still the hand loop's."""
    x, y = data(17 * 200 + 5)
    params = []
    for by_fit in (True, False):
        model = cmlp.MLP(SIZES, seed=4)
        opt = cmlp.optim.Adam(model, lr=1e-2)
        sched = S.CosineAnnealingLR(opt, T_max=700)
        trainer = cmlp.Trainer(model, opt, batch_size=1, shuffle=False)
        if by_fit:
            trainer.fit(x, y, epochs=1, progress=False, scheduler=sched, scheduler_interval="step")
        else:
            hand_loop(trainer, sched, x, y, 1, 1)
        params.append((model._c.get_params(), opt.lr, sched.last_epoch))
    np.testing.assert_array_equal(params[0][0], params[1][0])
    assert params[0][1:] == params[1][1:] and params[0][2] == 17 * 200 + 5


def test_a_schedule_per_step_grows_its_calls_up_to_max_rates_steps():
    """600 steps: the calls start at 600 // 200 = 3 steps, double while quick (3, 6, 12, 16 unless
    the machine is very busy) and stop at MAX_RATES (the rates a call takes); the run is the hand
    loop's."""
    x, y = data(600)
    params = []
    for by_fit in (True, False):
        model = cmlp.MLP(SIZES, seed=4)
        opt = cmlp.optim.SGD(model, lr=1e-2, momentum=0.9)
        sched = S.OneCycleLR(opt, max_lr=0.05, total_steps=600)
        trainer = cmlp.Trainer(model, opt, batch_size=1, shuffle=False)
        if by_fit:
            trainer._c = CountedCalls(trainer._c)
            trainer.fit(x, y, epochs=1, progress=False, scheduler=sched, scheduler_interval="step")
            asked = trainer._c.asked
        else:
            hand_loop(trainer, sched, x, y, 1, 1)
        params.append((model._c.get_params(), opt.lr, opt.param_groups[0]["momentum"], sched.last_epoch))
    assert asked[0] == 3 and max(asked) == cmlp._cmlp.MAX_RATES and sum(asked[:-1]) < 600 <= sum(asked), asked
    np.testing.assert_array_equal(params[0][0], params[1][0])
    assert params[0][1:] == params[1][1:] and params[0][3] == 600


def test_fit_per_step_refusals_and_a_failed_call_leave_the_schedule_alone():
    x, y = data()
    model = cmlp.MLP(SIZES)
    opt = cmlp.optim.SGD(model, lr=0.1)
    trainer = cmlp.Trainer(model, opt, batch_size=16, shuffle=False)
    with pytest.raises(ValueError, match="scheduler_interval"):
        trainer.fit(x, y, epochs=1, progress=False, scheduler=warmup(opt), scheduler_interval="batch")
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        trainer.fit(x, y, epochs=1, progress=False, scheduler=S.ReduceLROnPlateau(opt), scheduler_interval="step")
    # a schedule whose third rate the optimizer refuses: as in torch's loop, the second step is
    # taken, then scheduler.step() raises (and leaves the schedule where it was)
    sched = S.LambdaLR(opt, lambda k: 1.0 if k < 2 else -1.0)
    by_hand = cmlp.MLP(SIZES)
    hand = cmlp.Trainer(by_hand, cmlp.optim.SGD(by_hand, lr=0.1), batch_size=16, shuffle=False)
    hand.step(x[:16], y[:16])
    hand.step(x[16:32], y[16:32])
    with pytest.raises(ValueError, match="learning rate"):
        trainer.fit(x, y, epochs=1, progress=False, scheduler=sched, scheduler_interval="step")
    assert (sched.last_epoch, opt.lr) == (1, 0.1)
    np.testing.assert_array_equal(model._c.get_params(), by_hand._c.get_params())


def test_a_second_schedule_starts_from_the_first_rate_as_in_torch():
    opt, warm = make("LinearLR", dict(start_factor=0.1, total_iters=2), lr=1.0)
    cos = S.CosineAnnealingLR(opt, T_max=10)
    assert warm.base_lrs == cos.base_lrs == [1.0]
    torch = pytest.importorskip("torch")
    topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    torch.optim.lr_scheduler.LinearLR(topt, start_factor=0.1, total_iters=2)
    assert torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=10).base_lrs == cos.base_lrs


def test_a_schedule_resumes_on_an_optimizer_loaded_from_a_checkpoint():
    opt, sched = make("StepLR", dict(step_size=2, gamma=0.5), lr=0.8)
    for _ in range(3):
        sched.step()
    ckpt, want = opt.state_dict(), rates(sched, 6)
    assert ckpt["param_groups"][0]["initial_lr"] == 0.8
    fresh = cmlp.optim.Adam(cmlp.MLP(SIZES), lr=0.1)
    with pytest.raises(KeyError, match="initial_lr"):
        S.StepLR(fresh, step_size=2, last_epoch=3)
    fresh.load_state_dict(ckpt)  # torch's resume recipe: the optimizer, then the schedule at its epoch
    resumed = S.StepLR(fresh, step_size=2, gamma=0.5, last_epoch=3)  # as in torch, made at epoch 3 it sets epoch 4
    assert resumed.base_lrs == [0.8]
    assert rates(resumed, 5) == want[1:]
    bad = fresh.state_dict()
    bad["param_groups"][0]["initial_lr"] = "x"
    with pytest.raises(TypeError, match="initial_lr"):
        fresh.load_state_dict(bad)


@pytest.mark.parametrize("kw,match", [(dict(factor=-0.5), r"factor must be in \[0, 1\)"),
                                      (dict(eps=math.nan), "eps must be a finite number >= 0"),
                                      (dict(threshold=math.nan), "threshold must be a finite number"),
                                      (dict(threshold=math.inf), "threshold must be a finite number")])
def test_plateau_settings_that_would_make_no_rate_or_no_change_are_refused(kw, match):
    """torch takes them: with threshold NaN every epoch is bad (the rate falls however the
    metric improves), with eps NaN the rate never falls, a negative factor sets min_lr at once."""
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    with pytest.raises(ValueError, match=match):
        S.ReduceLROnPlateau(opt, **kw)


@pytest.mark.parametrize("bad", [None, [1, 2], {"last_epoch": "3"}, {"base_lrs": 0.1}, {"base_lrs": ["x"]},
                                 {"_is_initial": 1}, {"_schedulers": [{"last_epoch": "3"}, {}]}, {"_schedulers": [{}]}],
                         ids=["none", "list", "text-epoch", "number-for-list", "text-rate", "int-for-bool",
                              "a-part's", "too-few-parts"])
def test_a_state_dict_of_the_wrong_kind_is_refused_and_loads_nothing(bad):
    def made():
        opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
        warmup = S.LinearLR(opt, start_factor=0.1, total_iters=4)
        sched = S.SequentialLR(opt, [warmup, S.StepLR(opt, step_size=2, gamma=0.5)], milestones=[4]) \
            if "_schedulers" in (bad or ()) else warmup
        sched.step()
        return sched

    sched, twin = made(), made()
    with pytest.raises((TypeError, ValueError), match="state_dict|schedules"):
        sched.load_state_dict(bad)
    assert rates(sched, 6) == rates(twin, 6)  # from where it was


@pytest.mark.parametrize("name,kw,key,value,match", [
    ("OneCycleLR", dict(max_lr=0.1, total_steps=10), "_schedule_phases", [], "empty"),
    ("OneCycleLR", dict(max_lr=0.1, total_steps=10), "_schedule_phases", [{}], "[0] has no 'end_step'"),
    ("OneCycleLR", dict(max_lr=0.1, total_steps=10), "_groups", [{}],
     "names 'initial_lr', which the schedule's group 0 does not hold"),
    ("OneCycleLR", dict(max_lr=0.1, total_steps=10), "total_steps", 0, ">= 1"),
    ("CosineAnnealingWarmRestarts", dict(T_0=3), "T_i", 0, ">= 1"),
    ("CosineAnnealingWarmRestarts", dict(T_0=3), "T_mult", 0, ">= 1"),
    ("CosineAnnealingWarmRestarts", dict(T_0=3), "T_i", 2**1100, "beyond every float"),
    ("CosineAnnealingWarmRestarts", dict(T_0=3), "last_epoch", math.inf, "not a finite number"),
    ("CosineAnnealingWarmRestarts", dict(T_0=3), "eta_min", math.nan, "not a finite number"),
    ("ReduceLROnPlateau", dict(), "best", 2**1100, "beyond every float"),
    ("ReduceLROnPlateau", dict(), "patience", -1, ">= 0"),
    ("StepLR", dict(step_size=2), "gamma", None, "None"),
    ("StepLR", dict(step_size=2), "last_epoch", None, "None"),
    ("StepLR", dict(step_size=2), "step_size", 0, ">= 1"),
    ("CosineAnnealingLR", dict(T_max=5), "T_max", 0, ">= 1"),
    ("LinearLR", dict(), "start_factor", 0, "> 0"),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1), "total_size", 0, "> 0"),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1), "max_lrs", None, "None"),
    # the bounds of the constructor's factors: a rate of 0 at once (eta_min), a step that fails (gamma)
    ("CosineAnnealingLR", dict(T_max=5), "eta_min", -5.0, ">= 0"),
    ("CosineAnnealingWarmRestarts", dict(T_0=3), "eta_min", -1.0, ">= 0"),
    ("StepLR", dict(step_size=2), "gamma", -5.0, ">= 0"),
    ("MultiStepLR", dict(milestones=[2]), "gamma", -5.0, ">= 0"),
    ("ExponentialLR", dict(gamma=0.9), "gamma", -0.5, ">= 0"),
    ("PolynomialLR", dict(), "power", -1.0, ">= 0"),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1), "step_ratio", -5.0, "> 0"),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, mode="exp_range"), "gamma", -1.0, ">= 0"),
    ("ReduceLROnPlateau", dict(), "factor", 1.5, "< 1"),
    ("ReduceLROnPlateau", dict(), "factor", -1.0, ">= 0"),
    ("ReduceLROnPlateau", dict(), "eps", -1.0, ">= 0"),
    ("ReduceLROnPlateau", dict(), "threshold", math.nan, "not a finite number"),
])
def test_a_state_dict_whose_values_would_fail_the_next_step_is_refused_and_loads_nothing(name, kw, key, value, match):
    """A state_dict of the right kinds of values that no step can use (an empty list of phases, a
    dict without its keys, a period of 0, a number beyond every float, None for a number) was
    taken, and the next step failed (ZeroDivisionError, UnboundLocalError, KeyError,
    OverflowError); it is refused by name, as the constructor refuses such arguments, and the
    schedule goes on as it was."""
    def made():
        opt, sched = make(name, kw, kind="sgd")
        sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
        return sched

    sched, twin = made(), made()
    bad = {**sched.state_dict(), key: value}
    with pytest.raises(ValueError, match=r"state_dict\[.*" + re.escape(match)):
        sched.load_state_dict(bad)
    if name == "ReduceLROnPlateau":
        sched.step(1.0), twin.step(1.0)
        assert sched.state_dict() == twin.state_dict()
    else:
        assert rates(sched, 6) == rates(twin, 6)  # from where it was


def test_loaded_values_a_schedule_may_hold_are_taken():
    """What a real schedule's state holds stays loadable: a finished OneCycleLR (its next step
    raises, as torch's), three phases into a schedule of two, ReduceLROnPlateau's infinite best
    and None for one min_lr per group, a LambdaLR's None for its function."""
    opt, done = make("OneCycleLR", dict(max_lr=0.1, total_steps=4), kind="sgd")
    for _ in range(3):
        done.step()
    opt, sched = make("OneCycleLR", dict(max_lr=0.1, total_steps=4), kind="sgd")
    sched.load_state_dict(done.state_dict())
    assert sched.last_epoch == 3
    three = make("OneCycleLR", dict(max_lr=0.1, total_steps=10, three_phase=True), kind="sgd")[1]
    opt, sched = make("OneCycleLR", dict(max_lr=0.1, total_steps=10), kind="sgd")
    sched.load_state_dict(three.state_dict())
    assert len(sched._schedule_phases) == 3 and rates(sched, 9) == rates(three, 9)
    opt, plateau = make("ReduceLROnPlateau", dict(min_lr=[0.0]), kind="sgd")
    opt, sched = make("ReduceLROnPlateau", dict(), kind="sgd")
    sched.load_state_dict(plateau.state_dict())
    assert sched.best == math.inf and sched.default_min_lr is None
    opt, sched = make("LambdaLR", dict(lr_lambda=lambda e: 0.5 ** e), kind="sgd")
    sched.load_state_dict(sched.state_dict())
    # a OneCycleLR that does not cycle momentum keeps no momenta in its groups: its state loads
    # into one that does, and steps as it
    flat = make("OneCycleLR", dict(max_lr=0.5, total_steps=20, cycle_momentum=False), kind="sgd")[1]
    flat.step()
    opt, sched = make("OneCycleLR", dict(max_lr=0.5, total_steps=20), kind="sgd")
    sched.load_state_dict(flat.state_dict())
    assert rates(sched, 5) == rates(flat, 5)


class _Hold(S.LRScheduler):
    """A schedule of the caller's that holds None until its first step, a rate after."""

    def __init__(self, optimizer):
        self.peak = None
        super().__init__(optimizer)

    def get_lr(self):
        if self.last_epoch >= 1:
            self.peak = 0.1
        return [0.1 for _ in self.optimizer.param_groups]


def test_a_schedule_of_the_callers_is_held_to_the_kinds_of_its_values_only():
    """A schedule defined elsewhere may hold None (or an infinity) at one step and a number at
    another: its own earlier state loads, and a ChainedScheduler whose other part refuses a rate
    puts it back where it was (the refusal of its own state hid the rate's error)."""
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    hold = _Hold(opt)
    early = hold.state_dict()
    hold.step()
    hold.load_state_dict(early)
    assert hold.peak is None and hold.last_epoch == 0
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    hold = _Hold(opt)
    chain = S.ChainedScheduler([hold, S.LambdaLR(opt, lambda e: -1.0 if e == 2 else 1.0)])
    chain.step()
    with pytest.raises(ValueError, match="learning rate"):
        chain.step()
    assert (hold.last_epoch, hold.peak) == (1, 0.1)


def test_a_refused_rate_leaves_the_schedule_where_it_was():
    opt, sched = make("LambdaLR", dict(lr_lambda=lambda e: 1.0 if e < 2 else -1.0))
    sched.step()
    with pytest.raises(ValueError, match="learning rate"):
        sched.step()
    assert (sched.last_epoch, sched._step_count, sched.get_last_lr(), opt.lr) == (1, 2, [0.1], 0.1)


@pytest.mark.parametrize("name,kw", [
    ("StepLR", dict(step_size=2, gamma=-1.0)), ("StepLR", dict(step_size=2, gamma=math.nan)),
    ("MultiStepLR", dict(milestones=[2], gamma=math.inf)), ("ExponentialLR", dict(gamma=-0.5)),
    ("CosineAnnealingLR", dict(T_max=5, eta_min=-1e-3)), ("CosineAnnealingLR", dict(T_max=5, eta_min=math.nan)),
    ("CosineAnnealingWarmRestarts", dict(T_0=5, eta_min=-1.0)), ("PolynomialLR", dict(power=-1.0)),
    ("CyclicLR", dict(base_lr=0.01, max_lr=math.inf)), ("CyclicLR", dict(base_lr=0.01, max_lr=[-0.1])),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, mode="exp_range", gamma=-0.9))])
def test_an_argument_that_makes_rates_the_optimizer_refuses_is_refused_by_name_at_once(name, kw):
    """Rates made of a negative or non-finite gamma, eta_min, power or max_lr are refused by the
    optimizer at some step well into a run (Trainer.fit would train epochs first): the schedule
    refuses the argument itself, naming it, and the optimizer is as it was."""
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1, momentum=0.9)
    before = [dict(g) for g in opt.param_groups]
    arg = next(k for k in ("gamma", "eta_min", "power", "max_lr") if k in kw)
    with pytest.raises(ValueError, match=rf"{arg} must be a finite number >= 0"):
        getattr(S, name)(opt, **kw)
    assert [dict(g) for g in opt.param_groups] == before


def test_a_sequence_refuses_a_composite_it_would_start_at_a_milestone_when_it_is_made():
    """torch's SequentialLR fails at the milestone, epochs into a run; the part is refused at once."""
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    chain = S.ChainedScheduler([S.StepLR(opt, 2), S.ExponentialLR(opt, 0.9)])
    with pytest.raises(TypeError, match=r"schedulers\[1\] .* a ChainedScheduler cannot be placed at an epoch"):
        S.SequentialLR(opt, [S.ConstantLR(opt, 0.5), chain], milestones=[3])
    first = S.SequentialLR(opt, [chain, S.ConstantLR(opt, 0.5)], milestones=[3])  # first, it only steps
    assert len(rates(first, 5)) == 6


def test_a_schedule_refused_at_its_first_rate_leaves_the_optimizer_without_initial_lr():
    """The constructor's own step is refused (a NaN rate): torch would have set every group's
    'initial_lr' already; here the optimizer is as before, so a later schedule starts afresh."""
    model = cmlp.MLP([4, 8, 3], seed=0)
    opt = cmlp.optim.SGD(model, lr=0.1)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="learning rate"):
        S.LambdaLR(opt, lambda e: float("nan"))
    assert [dict(g) for g in opt.param_groups] == before and "initial_lr" not in opt.param_groups[0]
    opt.lr = 0.2
    assert S.StepLR(opt, step_size=1).base_lrs == [0.2]


def test_a_refused_rate_leaves_a_chain_and_every_schedule_in_it_where_they_were():
    model = cmlp.MLP([2, 2])
    opt = cmlp.optim.SGD(model, lr=0.1)
    a, b = S.ExponentialLR(opt, 0.9), S.LambdaLR(opt, lambda e: -1.0 if e == 3 else 1.0)
    chain = S.ChainedScheduler([a, b])
    chain.step()
    chain.step()
    before = (opt.lr, a.last_epoch, b.last_epoch, a.get_last_lr(), chain.get_last_lr())
    with pytest.raises(ValueError, match="learning rate"):
        chain.step()
    assert (opt.lr, a.last_epoch, b.last_epoch, a.get_last_lr(), chain.get_last_lr()) == before


def test_numpy_integers_are_taken_where_torch_takes_them():
    # the same schedule from NumPy integers as from Python ints, and param indices as an array
    cases = [("StepLR", dict(step_size=3)), ("MultiStepLR", dict(milestones=[2, 4])),
             ("CosineAnnealingLR", dict(T_max=5)), ("LinearLR", dict(total_iters=3)),
             ("ConstantLR", dict(total_iters=2)), ("PolynomialLR", dict(total_iters=4)),
             ("CosineAnnealingWarmRestarts", dict(T_0=2, T_mult=2)), ("OneCycleLR", dict(max_lr=0.5, total_steps=9))]
    for name, kw in cases:
        rates = []
        for convert in (lambda v: v, lambda v: np.array(v) if isinstance(v, list) else np.int64(v)):
            opt, sched = make(name, {k: convert(v) if k != "max_lr" else v for k, v in kw.items()})
            rates.append([opt.lr] + [sched.step() or opt.lr for _ in range(8)])
        assert rates[0] == rates[1], name
    opt, _ = make("StepLR", dict(step_size=1))
    plateau = S.ReduceLROnPlateau(opt, patience=np.int32(0), cooldown=np.int64(1))
    assert (plateau.patience, plateau.cooldown) == (0, 1)
    state = opt.state_dict()
    state["param_groups"][0]["params"] = np.arange(len(state["param_groups"][0]["params"]))
    opt.load_state_dict(state)


def test_a_linear_decay_to_0_ends_at_0_where_torchs_rounds_below():
    """LinearLR's factor from start_factor to end_factor=0: torch's recursive form rounds to about
    -4e-20 at the end (which the optimizer here refuses); here it is 0, and every other rate is
    torch's to the bit."""
    torch = pytest.importorskip("torch")
    for lr, start, total in ((0.01, 0.1, 5), (1e-3, 1.0 / 3, 7), (0.1, 0.5, 1000)):
        kw = dict(start_factor=start, end_factor=0.0, total_iters=total)
        opt, sched = make("LinearLR", kw, lr=lr)
        mine = rates(sched, steps=total + 3)
        topt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        theirs = torch_rates(topt, torch.optim.lr_scheduler.LinearLR(topt, **kw), steps=total + 3)
        assert mine[total:] == [0.0] * 4 and all(abs(v) < 1e-18 for v in theirs[total:])
        assert mine[:total] == theirs[:total]
        with pytest.warns(UserWarning, match="epoch"):  # the deprecated form: its closed form, at 0 too
            sched.step(total + 1)
        assert opt.lr == 0.0


def test_arguments_that_are_not_numbers_are_type_errors():
    opt, _ = make("StepLR", dict(step_size=1))
    for name, kw in (("StepLR", dict(step_size=2, gamma="a")), ("ExponentialLR", dict(gamma=None)),
                     ("CosineAnnealingLR", dict(T_max=3, eta_min="0")), ("PolynomialLR", dict(power=[2])),
                     ("ReduceLROnPlateau", dict(min_lr="a")), ("ReduceLROnPlateau", dict(threshold="x")),
                     ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, mode="exp_range", gamma="g"))):
        before = (opt.lr, opt.betas)
        with pytest.raises(TypeError, match="must be a number"):
            getattr(S, name)(opt, **kw)
        assert (opt.lr, opt.betas) == before


def test_reduce_on_plateau_refuses_a_nan_factor_and_a_negative_floor():
    opt, _ = make("StepLR", dict(step_size=1))
    for kw in (dict(factor=float("nan")), dict(factor=1.0), dict(min_lr=-1.0), dict(min_lr=[float("inf")])):
        with pytest.raises(ValueError):
            S.ReduceLROnPlateau(opt, **kw)


PLATEAU = [dict(), dict(mode="max", factor=0.5, patience=1, threshold=0.05, threshold_mode="abs", cooldown=2),
           dict(factor=0.3, patience=0, cooldown=1, min_lr=0.004)]


@pytest.mark.parametrize("kw", PLATEAU, ids=["defaults", "max-abs-cooldown", "min_lr"])
def test_reduce_on_plateau_follows_torch(kw):
    torch = pytest.importorskip("torch")
    metrics = [1.0, 0.9, 0.95, 0.95, 0.9, 0.89999, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.5,
               0.6, 0.6, 0.6, 0.6, 0.6]
    opt, _ = make("StepLR", dict(step_size=1000), lr=0.1)
    mine = S.ReduceLROnPlateau(opt, **kw)
    topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kw)
    got, want = [], []
    for i, m in enumerate(metrics):
        mine.step(m)
        theirs.step(m)
        got.append(opt.lr)
        want.append(topt.param_groups[0]["lr"])
        if i == 9:  # a state_dict taken midway resumes the same
            saved = mine.state_dict()
            assert sorted(saved) == sorted(theirs.state_dict())
            assert saved["default_min_lr"] == theirs.state_dict()["default_min_lr"]
            mine = S.ReduceLROnPlateau(opt)
            mine.load_state_dict(saved)
    assert got == want and len(set(got)) > 1


def test_fit_steps_reduce_on_plateau_with_the_validation_loss():
    x, y = data()
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.SGD(model, lr=0.5)
    # nothing but the first epoch's loss counts as an improvement: from the second on, each reduces
    sched = S.ReduceLROnPlateau(opt, patience=0, threshold=1e9, threshold_mode="abs")
    history = cmlp.Trainer(model, opt, batch_size=16).fit(x, y, epochs=4, progress=False, scheduler=sched,
                                                          validation_data=data(40, seed=1))
    assert [h["lr"] for h in history] == pytest.approx([0.5, 0.5, 0.05, 0.005])
    assert sched.best == history[0]["val_loss"]
    with pytest.raises(ValueError, match="Factor"):
        S.ReduceLROnPlateau(opt, factor=1.0)
    with pytest.raises(ValueError, match="mode"):
        S.ReduceLROnPlateau(opt, mode="lowest")


def test_a_refused_step_leaves_the_momentum_too_and_arithmetic_failures_are_value_errors():
    """get_lr moves the momentum before the optimizer sees the rate: a rate it refuses puts the
    momentum back; a formula that cannot be computed (torch's ZeroDivisionError) is a ValueError."""
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.01, momentum=0.9)
    sched = S.CyclicLR(opt, 0.001, 0.1, step_size_up=2, scale_fn=lambda c: -5.0)
    before = (opt.lr, opt._momentum(), sched.last_epoch)
    with pytest.raises(ValueError, match="learning rate"):
        sched.step()
    assert (opt.lr, opt._momentum(), sched.last_epoch) == before
    for kw in (dict(step_size_up=0, step_size_down=5), dict(step_size_up=math.inf), dict(step_size_up=10**400),
               dict(step_size_up=-1), dict(step_size_down=float("nan"))):
        with pytest.raises(ValueError, match="step_size"):
            S.CyclicLR(opt, 0.001, 0.1, **kw)
    with pytest.raises(TypeError, match="step_size_up"):
        S.CyclicLR(opt, 0.001, 0.1, step_size_up="2")
    assert S.CyclicLR(opt, 0.001, 0.1, step_size_up=np.int64(3)).total_size == 6.0  # NumPy's ints, as torch
    for kw in (dict(div_factor=0), dict(final_div_factor=0.0), dict(div_factor=-1)):
        with pytest.raises(ValueError, match="div_factor"):
            S.OneCycleLR(opt, max_lr=0.1, total_steps=10, **kw)
    opt = cmlp.optim.Adam(cmlp.MLP(SIZES), lr=0.1)
    sched = S.ConstantLR(opt, factor=0.0, total_iters=2)
    assert rates(sched, 3) == [0.0, 0.0, 0.1, 0.1]  # torch divides by the factor at total_iters
    opt = cmlp.optim.Adam(cmlp.MLP(SIZES), lr=0.1)
    sched = S.OneCycleLR(opt, max_lr=0.1, total_steps=4, pct_start=1.0)
    with pytest.raises(ValueError, match="cannot compute the rate of epoch 4"):
        for _ in range(4):
            sched.step()


@pytest.mark.filterwarnings("ignore:To get the last learning rate")  # get_lr() outside step(), on purpose
@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("kind", ["onecycle", "cyclic"])
def test_get_lr_outside_step_moves_the_momentum_at_once_as_torchs(kind):
    """A cyclic schedule's step sets its momenta with its rates, as one; its get_lr() called alone
    sets them at once, as torch's sets them in the groups (the rate stays), and leaves nothing for
    the next step to set: the steps after it are torch's, and the state_dict holds torch's keys."""
    torch = pytest.importorskip("torch")

    def make(lib, opt):
        if kind == "onecycle":
            return lib.OneCycleLR(opt, max_lr=0.1, total_steps=20)
        return lib.CyclicLR(opt, 0.001, 0.1, step_size_up=3)

    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.01, momentum=0.9)
    tnet = torch.nn.Linear(2, 2)
    topt = torch.optim.SGD(tnet.parameters(), lr=0.01, momentum=0.9)
    sched, tsched = make(S, opt), make(torch.optim.lr_scheduler, topt)
    for i in range(6):
        sched.step()
        tsched.step()
        if i in (1, 4):
            opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.5  # (get_lr sets it back)
            lrs, tlrs = sched.get_lr(), tsched.get_lr()
            assert opt._momenta() != [0.5]
            assert lrs == tlrs
            assert opt._momenta() == [g["momentum"] for g in topt.param_groups]
            assert opt.lr == topt.param_groups[0]["lr"]  # (the rate is the last step's)
        assert [opt.lr] == sched.get_last_lr() == tsched.get_last_lr()
        assert opt._momenta() == [g["momentum"] for g in topt.param_groups]
        assert "_momenta_due" not in sched.state_dict()
    # (OneCycleLR keeps its groups' values in "_groups" too, for a load without the optimizer's state)
    assert set(sched.state_dict()) - {"_groups"} == set(tsched.state_dict())


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("kind", ["onecycle", "cyclic"])
def test_subclasses_that_read_or_set_the_momentum_get_lr_set_see_it_as_torchs_do(kind):
    """A cyclic schedule's own step sets its momenta with its rates; a subclass whose get_lr reads
    or changes the momentum super().get_lr() just set, or whose own step() calls get_lr as torch's
    does, sees it set at once, as in torch, and nothing is left behind."""
    torch = pytest.importorskip("torch")

    def capped(base):
        class Capped(base):
            def get_lr(self):
                lrs = super().get_lr()
                group = self.optimizer.param_groups[0]
                self.seen = group["momentum"]  # (the value just computed)
                group["momentum"] = min(self.seen, 0.88)
                return lrs
        return Capped

    def own_step(base):
        class OwnStep(base):
            def step(self, epoch=None):  # torch's pattern: the flag around get_lr, then the rates set
                self._get_lr_called_within_step = True
                try:
                    self.last_epoch += 1
                    lrs = self.get_lr()
                finally:
                    self._get_lr_called_within_step = False
                for group, lr in zip(self.optimizer.param_groups, lrs):
                    group["lr"] = lr
                self._last_lr = lrs
        return OwnStep

    def make(lib, opt, wrap):
        if kind == "onecycle":
            return wrap(lib.OneCycleLR)(opt, max_lr=1.0, total_steps=10)
        return wrap(lib.CyclicLR)(opt, 0.01, 0.1, step_size_up=4)

    for wrap in (capped, own_step):
        opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1, momentum=0.9)
        topt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
        sched, tsched = make(S, opt, wrap), make(torch.optim.lr_scheduler, topt, wrap)
        for _ in range(5):
            sched.step()
            tsched.step()
            assert getattr(sched, "seen", None) == getattr(tsched, "seen", None)
            assert opt._momenta() == [topt.param_groups[0]["momentum"]]
            assert opt.lr == topt.param_groups[0]["lr"]
            assert "_momenta_due" not in vars(sched)


@pytest.mark.filterwarnings("ignore:Detected call of")  # torch's: no optimizer step here
# (torch's closed forms of no steps to go divide by 0: test_closed_forms_without_torch has cmlp's)
@pytest.mark.parametrize("case", [c for c in CASES if c[1].get("total_iters") != 0], ids=case_id)
def test_the_deprecated_step_with_an_epoch_gives_torchs_rates(case):
    # step(epoch) jumps to that epoch (the closed form where the schedule has one), with a warning;
    # a float epoch is last_epoch from there on, as torch keeps it
    torch = pytest.importorskip("torch")
    name, kw = case
    opt, sched = make(name, kw)
    topt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ts = getattr(torch.optim.lr_scheduler, name)(topt, **kw)
    for epoch in (None, 5, None, None, 2, 9, None, 2.5, None, 6.0, 0.25, None, 3.5, 4, 0, None):
        if epoch is None:
            sched.step()
            ts.step()
        elif name == "CosineAnnealingWarmRestarts":  # its own form, not deprecated (no warning)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                sched.step(epoch)
            ts.step(epoch)
        else:
            with pytest.warns(UserWarning, match="deprecated"):
                sched.step(epoch)
            with pytest.warns(UserWarning):
                ts.step(epoch)
        assert sched.get_last_lr() == ts.get_last_lr() and sched.last_epoch == ts.last_epoch, epoch
        assert type(sched.last_epoch) is type(ts.last_epoch), epoch
    for bad in (-1, -0.5, float("nan"), float("inf"), True, "3"):
        with pytest.raises(ValueError, match="epoch"):
            sched.step(bad)
    assert sched.get_last_lr() == ts.get_last_lr() and sched.last_epoch == ts.last_epoch
    # a schedule made again from a float last_epoch goes on from it, as torch's
    if name == "CosineAnnealingWarmRestarts":
        sched.step(2.5)
        ts.step(2.5)
    else:
        with pytest.warns(UserWarning):
            sched.step(2.5)
        with pytest.warns(UserWarning):
            ts.step(2.5)
    again = getattr(S, name)(opt, **kw, last_epoch=sched.last_epoch)
    tagain = getattr(torch.optim.lr_scheduler, name)(topt, **kw, last_epoch=ts.last_epoch)
    for _ in range(4):
        assert again.get_last_lr() == tagain.get_last_lr() and again.last_epoch == tagain.last_epoch
        again.step()
        tagain.step()


def test_the_deprecated_epoch_of_reduce_on_plateau_is_torchs():
    torch = pytest.importorskip("torch")
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    sched = S.ReduceLROnPlateau(opt, patience=0)
    topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ts = torch.optim.lr_scheduler.ReduceLROnPlateau(topt, patience=0)
    for metric, epoch in ((1.0, None), (2.0, 7), (3.0, None)):
        if epoch is None:
            sched.step(metric)
            ts.step(metric)
        else:
            with pytest.warns(UserWarning):
                sched.step(metric, epoch)
            with pytest.warns(UserWarning):
                ts.step(metric, epoch)
        assert sched.get_last_lr() == ts.get_last_lr() and sched.last_epoch == ts.last_epoch


def test_torchs_warnings_a_step_before_the_optimizers_and_get_lr_outside_step():

    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    sched = S.StepLR(opt, step_size=2)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()  # only the first step checks, as torch's
        assert sched.get_last_lr() == [opt.lr]
    with pytest.warns(UserWarning, match="get_last_lr"):
        sched.get_lr()
    assert not sched._get_lr_called_within_step and "_get_lr_called_within_step" in sched.state_dict()
    # in torch's order, and in a trainer's fit: no warning
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model)
    x = np.random.default_rng(0).standard_normal((40, SIZES[0])).astype(np.float32)
    y = np.arange(40) % SIZES[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = S.CosineAnnealingWarmRestarts(opt, T_0=3)
        warm = S.SequentialLR(opt, [S.LinearLR(opt, 0.1, total_iters=2), S.ExponentialLR(opt, 0.9)], milestones=[2])
        model.forward_backward(x, y)
        opt.step()
        warm.step()
        sched.step()
        model2 = cmlp.MLP(SIZES, seed=1)
        opt2 = cmlp.optim.SGD(model2, lr=0.1)
        cmlp.Trainer(model2, opt2, batch_size=8).fit(x, y, epochs=2, progress=False, scheduler=S.StepLR(opt2, 1),
                                                     scheduler_interval="step")
        model3 = cmlp.MLP(SIZES, seed=1)
        opt3 = cmlp.optim.SGD(model3, lr=0.1)
        cmlp.Trainer(model3, opt3, batch_size=8).step(x[:8], y[:8])
        S.StepLR(opt3, 1).step()
        unstepped = S.StepLR(cmlp.optim.SGD(cmlp.MLP(SIZES)), 1)
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        unstepped.step()


def test_the_old_base_class_name_is_exported():
    assert S._LRScheduler is S.LRScheduler


def test_one_cycle_linear_one_step_past_its_end_keeps_adams_beta1_below_1():
    """torch's linear strategy extrapolates the momentum past max_momentum at the step after the
    last (beta1 >= 1 here, which Adam refuses): it stays at the phase's end value, as the rate
    stays at 0, and a fit whose schedule takes that step ends as it should."""
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model, lr=0.01)
    sched = S.OneCycleLR(opt, max_lr=0.1, epochs=20, steps_per_epoch=1, anneal_strategy="linear", max_momentum=0.99)
    for _ in range(20):
        sched.step()
    assert opt.betas[0] == 0.99 and opt.lr == 0.0
    x, y = data(40)
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model, lr=0.01)
    sched = S.OneCycleLR(opt, max_lr=0.1, epochs=4, steps_per_epoch=1, anneal_strategy="linear", max_momentum=0.99)
    history = cmlp.Trainer(model, opt, batch_size=40).fit(x, y, epochs=4, progress=False, scheduler=sched)
    assert len(history) == 4 and opt.betas[0] == 0.99



def test_an_error_of_the_callers_function_is_raised_as_it_is_and_the_schedule_stays():
    # torch raises a LambdaLR function's own error; the rate and the count stay where they were
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)

    def rate(epoch):
        if epoch == 2:
            raise ZeroDivisionError("the caller's")
        return 0.5 ** epoch

    sched = S.LambdaLR(opt, rate)
    opt.step()
    sched.step()
    with pytest.raises(ZeroDivisionError, match="the caller's"):
        sched.step()
    assert sched.last_epoch == 1 and opt.lr == pytest.approx(0.05)
    big = S.LambdaLR(opt, lambda e: 10 ** 400 if e else 1.0)
    opt.step()
    with pytest.raises(ValueError, match="LambdaLR cannot compute the rate of epoch 1"):  # its own product
        big.step()


def test_rates_given_as_any_real_number_are_taken():
    from fractions import Fraction

    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1)
    S.CyclicLR(opt, Fraction(1, 100), 0.1)  # torch takes any real number
    assert opt.lr == pytest.approx(0.01)
    with pytest.raises(ValueError, match="max_lr must be finite"):
        S.OneCycleLR(opt, max_lr=10 ** 400, total_steps=10)
