"""cmlp.optim.lr_scheduler: the rates torch's schedules give, to the bit (same formulas in double),
their state_dict, resuming, and Trainer.fit(scheduler=...) stepping one per epoch.
"""
import math

import numpy as np
import pytest

import cmlp
from cmlp.optim import lr_scheduler as S

SIZES = [12, 16, 3]

CASES = [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[2, 5, 5, 9], gamma=0.3)),
    ("ExponentialLR", dict(gamma=0.9)),
    ("CosineAnnealingLR", dict(T_max=7, eta_min=1e-4)),
    ("CosineAnnealingLR", dict(T_max=3)),
    ("LinearLR", dict()),
    ("LinearLR", dict(start_factor=0.1, end_factor=0.5, total_iters=4)),
    ("LambdaLR", dict(lr_lambda=lambda e: 1.0 / (1 + e) ** 0.5)),
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
    ts = getattr(torch.optim.lr_scheduler, name)(topt, **kw)
    theirs = [ts.get_last_lr()[0]]
    for _ in range(25):
        topt.step()
        ts.step()
        theirs.append(ts.get_last_lr()[0])
    assert mine == theirs


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


def test_resuming_needs_the_initial_rate_and_arguments_are_checked():
    model = cmlp.MLP(SIZES)
    opt = cmlp.optim.SGD(model, lr=0.1)
    with pytest.raises(KeyError, match="initial_lr"):
        S.StepLR(opt, step_size=2, last_epoch=3)
    S.StepLR(opt, step_size=2)
    assert S.StepLR(opt, step_size=2, last_epoch=3).base_lrs == [0.1]
    for bad in (0, -1, 2.5, True):
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


def test_a_refused_rate_leaves_the_schedule_where_it_was():
    opt, sched = make("LambdaLR", dict(lr_lambda=lambda e: 1.0 if e < 2 else -1.0))
    sched.step()
    with pytest.raises(ValueError, match="learning rate"):
        sched.step()
    assert (sched.last_epoch, sched._step_count, sched.get_last_lr(), opt.lr) == (1, 2, [0.1], 0.1)


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
