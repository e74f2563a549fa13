"""cmlp.optim.lr_scheduler over optimizers with several param groups: every group's rate is
torch's to the bit (each group from its own initial_lr, per-group arguments as torch takes them),
and so is every group's momentum; argument checks, resuming and state_dict.
"""
import math

import numpy as np
import pytest

import cmlp
from cmlp.optim import lr_scheduler as S

SIZES = [12, 16, 8, 3]
STEPS = 30

# the schedules here are stepped alone, which torch's first step() warns about
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")

# the groups: (parameter names, rate; None for the optimizer's default, 0.1)
FC1, FC2, FC3 = (["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"], ["fc3.weight", "fc3.bias"])
GROUPS = {2: [(FC1, 0.5), (FC2 + FC3, None)],
          3: [(FC1, 0.5), (FC2, None), (FC3, 0.03)]}
LR = 0.1
RATES = {2: [0.5, 0.1], 3: [0.5, 0.1, 0.03]}  # each group's rate
PER_GROUP = ("lr_lambda", "max_lr", "base_lr", "min_lr", "base_momentum", "max_momentum")


def cmlp_optimizer(n, kind="sgd", momentum=0.9):
    groups = [{"params": names, **({} if lr is None else {"lr": lr})} for names, lr in GROUPS[n]]
    model = cmlp.MLP(SIZES, seed=0)
    if kind == "adam":
        return cmlp.optim.Adam(model, lr=LR, betas=(0.9, 0.99), param_groups=groups)
    return cmlp.optim.SGD(model, lr=LR, momentum=momentum, param_groups=groups)


def torch_optimizer(torch, n, kind="sgd", momentum=0.9):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], **({} if lr is None else {"lr": lr})}
              for _, lr in GROUPS[n]]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=LR, betas=(0.9, 0.99))
    return torch.optim.SGD(groups, lr=LR, momentum=momentum)


def pair(n, kind="sgd", momentum=0.9):
    torch = pytest.importorskip("torch")
    return torch, cmlp_optimizer(n, kind, momentum), torch_optimizer(torch, n, kind, momentum)


def for_groups(kw, n):
    """kw with its per-group lists cut to n entries."""
    return {k: v[:n] if k in PER_GROUP and isinstance(v, (list, tuple)) else v for k, v in kw.items()}


def group_lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def momenta(opt, kind):
    return [g["betas"][0] if kind == "adam" else g["momentum"] for g in opt.param_groups]


def lockstep(opt, sched, topt, ts, steps=STEPS, kind="sgd", momentum=False, clip=False):
    """Steps both as torch's loop does (optimizer.step(), then scheduler.step()) and compares
    get_last_lr() and every group's rate (and momentum) before the first step and after each."""
    for i in range(steps + 1):
        want = [max(lr, 0.0) for lr in ts.get_last_lr()] if clip else ts.get_last_lr()
        assert sched.get_last_lr() == want, i
        assert opt._group_lrs() == group_lrs(opt) == want, i
        assert want == ([max(lr, 0.0) for lr in group_lrs(topt)] if clip else group_lrs(topt)), i
        if momentum and clip and i == steps:  # past the end torch's linear momentum goes past its range too
            top = max(momenta(topt, kind)[0], 0.0)
            assert momenta(opt, kind)[0] <= top, i
        elif momentum:
            assert momenta(opt, kind) == momenta(topt, kind), i
        if i < steps:
            topt.step()
            ts.step()
            sched.step()
    assert opt.lr == sched.get_last_lr()[0]


CASES = [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[2, 5, 5, 9], gamma=0.3)),
    ("ExponentialLR", dict(gamma=0.9)),
    ("CosineAnnealingLR", dict(T_max=7, eta_min=1e-4)),
    ("CosineAnnealingLR", dict(T_max=3)),
    ("CosineAnnealingLR", dict(T_max=10, eta_min=0.02)),  # above the third group's rate
    ("LinearLR", dict()),
    ("LinearLR", dict(start_factor=0.1, end_factor=0.5, total_iters=4)),
    ("LambdaLR", dict(lr_lambda=lambda e: 1.0 / (1 + e) ** 0.5)),
    ("LambdaLR", dict(lr_lambda=[lambda e: 0.9 ** e, lambda e: 1.0 / (1 + e), lambda e: min(1.0, (e + 1) / 5)])),
    ("MultiplicativeLR", dict(lr_lambda=lambda e: 0.95 if e % 2 else 0.99)),
    ("MultiplicativeLR", dict(lr_lambda=(lambda e: 0.9, lambda e: 1.01 if e < 10 else 0.8, lambda e: 0.97))),
    ("ConstantLR", dict()),
    ("ConstantLR", dict(factor=0.5, total_iters=3)),
    ("PolynomialLR", dict()),
    ("PolynomialLR", dict(total_iters=7, power=2.5)),
    ("CosineAnnealingWarmRestarts", dict(T_0=4)),
    ("CosineAnnealingWarmRestarts", dict(T_0=3, T_mult=2, eta_min=1e-3)),
]
CLOSED_FORM = [c for c in CASES if c[0] not in ("LambdaLR", "MultiplicativeLR", "CosineAnnealingWarmRestarts")]


def case_id(case):
    name, kw = case
    return name + "".join(f"-{k}{v}" for k, v in kw.items() if k != "lr_lambda") + \
        ("-per-group" if isinstance(kw.get("lr_lambda"), (list, tuple)) else "")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_groups_rate_is_torchs_to_the_bit(case, n):
    name, kw = case
    torch, opt, topt = pair(n)
    kw = for_groups(kw, n)
    sched = getattr(S, name)(opt, **kw)
    ts = getattr(torch.optim.lr_scheduler, name)(topt, **kw)
    assert sched.base_lrs == ts.base_lrs == RATES[n]
    lockstep(opt, sched, topt, ts)
    assert [opt.state_dict()["param_groups"][i]["initial_lr"] for i in range(n)] == \
        [g["initial_lr"] for g in topt.param_groups]


@pytest.mark.filterwarnings("ignore::UserWarning")  # step(epoch)'s deprecation, in cmlp and torch
@pytest.mark.parametrize("case", CLOSED_FORM, ids=case_id)
def test_the_deprecated_step_with_an_epoch_gives_every_group_torchs_closed_form(case):
    name, kw = case
    torch, opt, topt = pair(3)
    sched = getattr(S, name)(opt, **kw)
    ts = getattr(torch.optim.lr_scheduler, name)(topt, **kw)
    for epoch in (None, 5, None, None, 2, 9, None, 20, None):
        sched.step(epoch)
        ts.step(epoch)
        assert sched.get_last_lr() == ts.get_last_lr() == group_lrs(opt) and sched.last_epoch == ts.last_epoch


def test_a_schedule_starts_each_group_from_its_own_initial_lr_as_torchs_setdefault():
    torch, opt, topt = pair(3)
    opt.param_groups[1]["initial_lr"] = 0.7  # a group that already has one keeps it
    topt.param_groups[1]["initial_lr"] = 0.7
    sched = S.CosineAnnealingLR(opt, T_max=6)
    ts = torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=6)
    assert sched.base_lrs == ts.base_lrs == [0.5, 0.7, 0.03]
    assert opt._initial_lrs == [g["initial_lr"] for g in topt.param_groups]
    lockstep(opt, sched, topt, ts, steps=12)
    # a second schedule starts from the first's initial rates, not from the rates it left
    second, tsecond = S.StepLR(opt, step_size=2), torch.optim.lr_scheduler.StepLR(topt, step_size=2)
    assert second.base_lrs == tsecond.base_lrs == [0.5, 0.7, 0.03]


def composites(S, opt, n):
    """SequentialLR and ChainedScheduler cases, made with the module S (cmlp's or torch's)."""
    lambdas = [lambda e: (e + 1) / 3, lambda e: 1.0, lambda e: 0.5 + e / 6][:n]
    return {
        "warmup-cosine": lambda: S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=4),
                                                      S.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)],
                                                milestones=[4]),
        "three-parts-per-group": lambda: S.SequentialLR(opt, [S.LambdaLR(opt, lambdas),
                                                              S.StepLR(opt, step_size=2, gamma=0.5),
                                                              S.ExponentialLR(opt, gamma=0.9)], milestones=[3, 8]),
        "restart-polynomial": lambda: S.SequentialLR(opt, [S.ConstantLR(opt, factor=0.2, total_iters=2),
                                                           S.PolynomialLR(opt, total_iters=6, power=2.0),
                                                           S.MultiStepLR(opt, [2, 4], gamma=0.3)],
                                                     milestones=[5, 12]),
        "chained": lambda: S.ChainedScheduler([S.ConstantLR(opt, factor=0.1, total_iters=2),
                                               S.ExponentialLR(opt, gamma=0.9)]),
        "chained-three": lambda: S.ChainedScheduler([S.LinearLR(opt, start_factor=0.2, total_iters=5),
                                                     S.MultiplicativeLR(opt, lambdas),
                                                     S.CosineAnnealingWarmRestarts(opt, T_0=4)]),
        "sequential-of-chained": lambda: S.SequentialLR(opt, [
            S.ChainedScheduler([S.ConstantLR(opt, factor=0.5, total_iters=3), S.ExponentialLR(opt, gamma=0.95)]),
            S.CosineAnnealingLR(opt, T_max=8)], milestones=[6]),
    }


COMPOSITES = ["warmup-cosine", "three-parts-per-group", "restart-polynomial", "chained", "chained-three",
              "sequential-of-chained"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", COMPOSITES)
def test_composite_schedules_are_torchs_to_the_bit_in_every_group(name, n):
    torch, opt, topt = pair(n)
    sched = composites(S, opt, n)[name]()
    ts = composites(torch.optim.lr_scheduler, topt, n)[name]()
    lockstep(opt, sched, topt, ts)


ONE_CYCLE = [
    ("adam", dict(max_lr=0.5, total_steps=STEPS)),
    ("sgd", dict(max_lr=[0.3, 0.2, 0.1], epochs=6, steps_per_epoch=5, anneal_strategy="linear")),
    ("adam", dict(max_lr=[1.0, 0.4, 0.05], total_steps=STEPS, three_phase=True, pct_start=0.25, div_factor=10.0)),
    ("sgd", dict(max_lr=(0.2, 0.6, 0.02), total_steps=STEPS, three_phase=True, anneal_strategy="linear")),
    ("sgd", dict(max_lr=0.2, total_steps=STEPS, cycle_momentum=False, final_div_factor=100.0)),
    ("adam", dict(max_lr=[0.1, 0.3, 0.2], total_steps=STEPS, base_momentum=[0.8] * 3, max_momentum=(0.93,) * 3)),
]
ONE_CYCLE_IDS = ["adam-cos", "sgd-linear", "adam-three-phase", "sgd-three-phase-linear", "sgd-no-momentum",
                 "adam-momentum-lists"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind,kw", ONE_CYCLE, ids=ONE_CYCLE_IDS)
def test_one_cycle_rates_and_momentum_are_torchs_in_every_group(kind, kw, n):
    torch, opt, topt = pair(n, kind)
    kw = for_groups(kw, n)
    sched = S.OneCycleLR(opt, **kw)
    ts = torch.optim.lr_scheduler.OneCycleLR(topt, **kw)
    # torch's linear strategy goes below 0 one step past the end, which cmlp's optimizer refuses: 0 there
    lockstep(opt, sched, topt, ts, kind=kind, momentum=True, clip=True)
    if kind == "adam":
        assert opt.betas[1] == 0.99
    assert [g["initial_lr"] for g in opt.state_dict()["param_groups"]] == [g["initial_lr"] for g in topt.param_groups]
    assert [g["max_lr"] for g in sched._groups] == [g["max_lr"] for g in topt.param_groups]
    assert [g["min_lr"] for g in sched._groups] == [g["min_lr"] for g in topt.param_groups]
    with pytest.raises(ValueError, match=f"Tried to step {STEPS + 1} times"):
        sched.step()


class Halving:
    """A scale_fn with state of its own."""

    def __init__(self):
        self.base = 2.0

    def __call__(self, x):
        return 1 / (self.base ** (x - 1))


CYCLIC = [
    ("adam", dict(base_lr=0.01, max_lr=0.1, step_size_up=4)),
    ("sgd", dict(base_lr=[0.001, 0.002, 0.003], max_lr=0.05, step_size_up=3, step_size_down=5, mode="triangular2")),
    ("adam", dict(base_lr=0.02, max_lr=[0.2, 0.3, 0.1], step_size_up=2, mode="exp_range", gamma=0.9,
                  base_momentum=[0.85] * 3, max_momentum=0.95)),
    ("sgd", dict(base_lr=[0.01, 0.05, 0.001], max_lr=[0.1, 0.2, 0.01], step_size_up=5, scale_fn=lambda x: 0.5 ** x,
                 scale_mode="iterations")),
    ("sgd", dict(base_lr=(0.01, 0.02, 0.03), max_lr=(0.1, 0.2, 0.3), step_size_up=3, cycle_momentum=False)),
    ("sgd", dict(base_lr=0.001, max_lr=[0.1, 0.01, 0.05], step_size_up=2.5, step_size_down=4, scale_fn=Halving())),
]
CYCLIC_IDS = ["adam-triangular", "sgd-triangular2", "adam-exp-range", "sgd-scale-fn-iterations", "sgd-no-momentum",
              "sgd-scale-object-fractional-steps"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind,kw", CYCLIC, ids=CYCLIC_IDS)
def test_cyclic_rates_and_momentum_are_torchs_in_every_group(kind, kw, n):
    torch, opt, topt = pair(n, kind, momentum=0.5)
    kw = for_groups(kw, n)
    sched = S.CyclicLR(opt, **kw)
    ts = torch.optim.lr_scheduler.CyclicLR(topt, **kw)
    lockstep(opt, sched, topt, ts, kind=kind, momentum=True)
    assert sched.base_lrs == ts.base_lrs and sched.max_lrs == ts.max_lrs
    assert [g["initial_lr"] for g in opt.state_dict()["param_groups"]] == [g["initial_lr"] for g in topt.param_groups]


METRICS = [1.0, 0.9, 0.95, 0.95, 0.9, 0.89999, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.5,
           0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.4, 0.6]
PLATEAU = [dict(),
           dict(mode="max", factor=0.5, patience=1, threshold=0.05, threshold_mode="abs", cooldown=2),
           dict(factor=0.3, patience=0, cooldown=1, min_lr=0.004),
           dict(factor=0.3, patience=0, min_lr=[0.004, 0.0, 0.02]),
           dict(factor=0.5, patience=1, min_lr=(0.1, 0.001, 0.0), eps=0.02)]  # small steps are skipped per group
PLATEAU_IDS = ["defaults", "max-abs-cooldown", "min_lr", "min_lr-per-group", "eps-per-group"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kw", PLATEAU, ids=PLATEAU_IDS)
def test_reduce_on_plateau_reduces_each_group_as_torch(kw, n):
    torch, opt, topt = pair(n)
    kw = for_groups(kw, n)
    mine = S.ReduceLROnPlateau(opt, **kw)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kw)
    assert mine.min_lrs == theirs.min_lrs and mine.get_last_lr() == theirs.get_last_lr()
    history = []
    for i, m in enumerate(METRICS):
        mine.step(m)
        theirs.step(m)
        assert mine.get_last_lr() == theirs.get_last_lr() == group_lrs(opt) == group_lrs(topt), i
        history.append(group_lrs(opt))
        if i == 9:  # a state_dict taken midway resumes the same
            saved = mine.state_dict()
            mine = S.ReduceLROnPlateau(opt)
            mine.load_state_dict(saved)
    assert len(set(map(tuple, history))) > 1
    if n == 3 and isinstance(kw.get("min_lr"), list):  # each group stops at its own floor, the third at once
        assert history[2] == [0.15, 0.03, 0.02] and history[-1][0] == 0.004 and history[-1][1] < 1e-7


def test_per_group_lambdas_give_each_group_its_own_factor_without_torch():
    opt = cmlp_optimizer(3)
    sched = S.LambdaLR(opt, [lambda e: 0.5 ** e, lambda e: 1.0, lambda e: e + 1.0])
    got = [sched.get_last_lr()]
    for _ in range(3):
        sched.step()
        got.append(sched.get_last_lr())
    assert got == [[0.5 * 0.5 ** e, 0.1, 0.03 * (e + 1.0)] for e in range(4)]
    opt = cmlp_optimizer(2)
    sched = S.MultiplicativeLR(opt, (lambda e: 0.5, lambda e: 2.0))
    sched.step()
    sched.step()
    assert opt._group_lrs() == [0.125, 0.4]
    one = S.LambdaLR(cmlp_optimizer(3), lambda e: 0.1)  # one function for every group
    assert one.get_last_lr() == [0.5 * 0.1, 0.1 * 0.1, 0.03 * 0.1] and len(one.lr_lambdas) == 3


def unchanged(opt):
    return list(opt._initial_lrs), opt._group_lrs(), opt._momenta()


def torch_message(build):
    """The message of torch's error for the same arguments."""
    with pytest.raises(ValueError) as e:
        build()
    return str(e.value)


def test_the_number_of_per_group_arguments_is_checked_as_in_torch():
    torch = pytest.importorskip("torch")
    TS = torch.optim.lr_scheduler
    opt, topt = cmlp_optimizer(3), torch_optimizer(torch, 3)
    before = unchanged(opt)
    fns = [lambda e: 1.0] * 2
    for name in ("LambdaLR", "MultiplicativeLR"):
        for lambdas in (fns, tuple(fns), fns[:1], fns * 2):
            with pytest.raises(ValueError, match=f"Expected 3 lr_lambdas, but got {len(lambdas)}") as e:
                getattr(S, name)(opt, lambdas)
            assert str(e.value) == torch_message(lambda: getattr(TS, name)(topt, lambdas))
        with pytest.raises(TypeError, match="callable"):
            getattr(S, name)(opt, [lambda e: 1.0, 2.0, lambda e: 1.0])
    for kw in (dict(max_lr=[0.1, 0.2]), dict(max_lr=(0.1,) * 4), dict(max_lr=[0.1])):
        with pytest.raises(ValueError, match="max_lr must have the same length as optimizer.param_groups") as e:
            S.OneCycleLR(opt, total_steps=10, **kw)
        assert str(e.value) == torch_message(lambda: TS.OneCycleLR(topt, total_steps=10, **kw))
    for kw in (dict(base_lr=[0.01, 0.02], max_lr=0.1), dict(base_lr=0.01, max_lr=[0.1] * 4)):
        with pytest.raises(ValueError, match="must have the same length as optimizer.param_groups") as e:
            S.CyclicLR(opt, **kw)
        assert str(e.value) == torch_message(lambda: TS.CyclicLR(topt, **kw))
    with pytest.raises(ValueError, match="base_momentum must have the same length"):
        S.CyclicLR(opt, 0.01, 0.1, base_momentum=[0.8, 0.8])
    with pytest.raises(TypeError, match="max_lr must be a number"):
        S.OneCycleLR(opt, max_lr=[0.1, "0.2", 0.3], total_steps=10)
    for min_lr in ([0.0, 0.0], (0.0,) * 4):
        with pytest.raises(ValueError, match=f"expected 3 min_lrs, got {len(min_lr)}") as e:
            S.ReduceLROnPlateau(opt, min_lr=min_lr)
        assert str(e.value) == torch_message(lambda: TS.ReduceLROnPlateau(topt, min_lr=min_lr))
    with pytest.raises(ValueError, match="min_lr"):
        S.ReduceLROnPlateau(opt, min_lr=[0.0, -1.0, 0.0])
    assert unchanged(opt) == before


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
def test_momentum_lists_give_each_group_its_own_as_torchs(kind, name):
    """Per-group momenta (a list each, as torch takes them): every group's momentum is torch's to
    the bit at every step; one the optimizer cannot take is refused and changes nothing."""
    torch, opt, topt = pair(3, kind)
    if name == "OneCycleLR":
        kw = dict(max_lr=[0.1, 0.2, 0.3], total_steps=STEPS, base_momentum=[0.85, 0.8, 0.7],
                  max_momentum=(0.95, 0.9, 0.99))
    else:
        kw = dict(base_lr=0.01, max_lr=[0.1, 0.2, 0.05], step_size_up=4, base_momentum=[0.85, 0.8, 0.7],
                  max_momentum=(0.95, 0.9, 0.99))
    sched = getattr(S, name)(opt, **kw)
    ts = getattr(torch.optim.lr_scheduler, name)(topt, **kw)
    assert len(set(momenta(opt, kind))) == 3
    lockstep(opt, sched, topt, ts, kind=kind, momentum=True)
    opt = cmlp_optimizer(3, kind)
    before = unchanged(opt)
    with pytest.raises(ValueError, match="beta parameter at index 0" if kind == "adam" else "momentum value"):
        getattr(S, name)(opt, **{**kw, "base_momentum": [0.8, -0.5, 0.8]})
    assert unchanged(opt) == before
    # without cycle_momentum the momenta are not used, as in torch
    S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, cycle_momentum=False, base_momentum=[0.1, 0.2, -0.3])
    assert unchanged(opt)[2] == before[2]


def test_resuming_needs_every_groups_initial_lr():
    opt = cmlp_optimizer(3)
    with pytest.raises(KeyError, match=r"param 'initial_lr' is not specified in param_groups\[0\]"):
        S.StepLR(opt, step_size=2, last_epoch=3)
    opt.param_groups[0]["initial_lr"] = 0.5
    opt.param_groups[2]["initial_lr"] = 0.03
    with pytest.raises(KeyError, match=r"param_groups\[1\] when resuming"):
        S.StepLR(opt, step_size=2, last_epoch=3)
    with pytest.raises(KeyError, match=r"param_groups\[1\]"):
        S.OneCycleLR(opt, max_lr=0.5, total_steps=10, last_epoch=3)
    assert opt._initial_lrs == [0.5, None, 0.03] and opt._group_lrs() == [0.5, 0.1, 0.03]
    opt.param_groups[1]["initial_lr"] = 0.2
    assert S.StepLR(opt, step_size=2, last_epoch=3).base_lrs == [0.5, 0.2, 0.03]


def test_a_schedule_resumes_on_an_optimizer_with_groups_loaded_from_a_checkpoint():
    opt = cmlp_optimizer(3)
    sched = S.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        sched.step()
    ckpt = opt.state_dict()
    want = []
    for _ in range(6):
        sched.step()
        want.append(sched.get_last_lr())
    assert [g["initial_lr"] for g in ckpt["param_groups"]] == [0.5, 0.1, 0.03]
    fresh = cmlp_optimizer(3)
    fresh._set_group_lrs([1.0, 2.0, 3.0])
    fresh.load_state_dict(ckpt)  # torch's resume recipe: the optimizer, then the schedule at its epoch
    resumed = S.StepLR(fresh, step_size=2, gamma=0.5, last_epoch=3)
    assert resumed.base_lrs == [0.5, 0.1, 0.03]
    got = [resumed.get_last_lr()]
    for _ in range(5):
        resumed.step()
        got.append(resumed.get_last_lr())
    assert got == want


def test_a_refused_rate_in_any_group_leaves_the_schedule_and_every_group_as_they_were():
    opt = cmlp_optimizer(3)
    sched = S.LambdaLR(opt, [lambda e: 1.0, lambda e: 1.0, lambda e: -1.0 if e == 2 else 1.0])
    sched.step()
    before = (sched.last_epoch, sched._step_count, sched.get_last_lr(), opt._group_lrs())
    with pytest.raises(ValueError, match="Invalid learning rate"):
        sched.step()
    assert (sched.last_epoch, sched._step_count, sched.get_last_lr(), opt._group_lrs()) == before
    opt = cmlp_optimizer(2)
    sched = S.MultiplicativeLR(opt, [lambda e: 1.0, lambda e: 1e40 if e == 2 else 1.0])  # past float32's range
    sched.step()
    before = (sched.last_epoch, sched.get_last_lr(), opt._group_lrs())
    with pytest.raises(ValueError, match="Invalid learning rate"):
        sched.step()
    assert (sched.last_epoch, sched.get_last_lr(), opt._group_lrs()) == before
    # CyclicLR moves the momentum before the rates are refused: it goes back too
    opt = cmlp_optimizer(3, momentum=0.5)
    sched = S.CyclicLR(opt, [0.01, 0.02, 0.03], 0.1, step_size_up=2, scale_fn=lambda x: -100.0)
    before = (sched.last_epoch, opt._group_lrs(), opt._momentum())
    with pytest.raises(ValueError, match="Invalid learning rate"):
        sched.step()
    assert (sched.last_epoch, opt._group_lrs(), opt._momentum()) == before
    # a chain: every part and every group as before
    opt = cmlp_optimizer(3)
    a, b = S.ExponentialLR(opt, 0.9), S.LambdaLR(opt, [lambda e: 1.0, lambda e: -1.0 if e == 3 else 1.0,
                                                       lambda e: 1.0])
    chain = S.ChainedScheduler([a, b])
    chain.step()
    chain.step()
    before = (opt._group_lrs(), a.last_epoch, b.last_epoch, a.get_last_lr(), chain.get_last_lr())
    with pytest.raises(ValueError, match="Invalid learning rate"):
        chain.step()
    assert (opt._group_lrs(), a.last_epoch, b.last_epoch, a.get_last_lr(), chain.get_last_lr()) == before


def test_a_one_cycle_or_cyclic_schedule_the_optimizer_refuses_changes_no_group():
    opt = cmlp_optimizer(3, "adam")
    before = unchanged(opt)
    with pytest.raises(ValueError, match="beta"):
        S.OneCycleLR(opt, max_lr=[0.1, 0.2, 0.3], total_steps=10, max_momentum=1.5)
    with pytest.raises(ValueError, match="beta"):
        S.CyclicLR(opt, base_lr=[0.01, 0.02, 0.03], max_lr=0.1, max_momentum=[1.5] * 3)
    with pytest.raises(ValueError, match="learning rate"):  # the first step's rate is refused
        S.CyclicLR(opt, base_lr=[0.01, -0.02, 0.03], max_lr=0.1)
    assert unchanged(opt) == before


def run(sched, steps):
    out = []
    for _ in range(steps):
        sched.step()
        out.append(sched.get_last_lr())
    return out


STATEFUL = {
    "StepLR": lambda opt: S.StepLR(opt, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda opt: S.CosineAnnealingLR(opt, T_max=6, eta_min=0.01),
    "LambdaLR-per-group": lambda opt: S.LambdaLR(opt, [lambda e: 0.9 ** e, lambda e: 1 / (e + 1), lambda e: 1.0]),
    "CosineAnnealingWarmRestarts": lambda opt: S.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2),
    "OneCycleLR": lambda opt: S.OneCycleLR(opt, max_lr=[0.5, 0.2, 0.1], total_steps=20, three_phase=True),
    "CyclicLR": lambda opt: S.CyclicLR(opt, base_lr=[0.01, 0.02, 0.03], max_lr=[0.1, 0.2, 0.3], step_size_up=3,
                                       mode="triangular2"),
    "SequentialLR": lambda opt: composites(S, opt, 3)["three-parts-per-group"](),
    "ChainedScheduler": lambda opt: composites(S, opt, 3)["chained-three"](),
}


@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_state_dict_with_groups_round_trips(name):
    opt = cmlp_optimizer(3)
    sched = STATEFUL[name](opt)
    for _ in range(5):
        sched.step()
    saved, lrs, momentum = sched.state_dict(), opt._group_lrs(), opt._momentum()
    assert "optimizer" not in saved
    rest = run(sched, 8)
    opt2 = cmlp_optimizer(3)
    again = STATEFUL[name](opt2)
    opt2._set_group_lrs(lrs)  # the optimizer's own state_dict carries these
    opt2._set_momentum(momentum)
    again.load_state_dict(saved)
    assert again.get_last_lr() == lrs
    if hasattr(sched, "base_lrs"):  # not a composite's
        assert again.base_lrs == sched.base_lrs
    assert run(again, 8) == rest


def test_a_one_group_one_cycle_state_dict_of_the_older_layout_still_loads():
    opt = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1, momentum=0.9)
    sched = S.OneCycleLR(opt, max_lr=0.4, total_steps=12)
    for _ in range(4):
        sched.step()
    saved = sched.state_dict()
    saved["_group"] = saved.pop("_groups")[0]
    lr, momentum = opt.lr, opt._momentum()
    rest = run(sched, 6)
    opt2 = cmlp.optim.SGD(cmlp.MLP(SIZES), lr=0.1, momentum=0.9)
    again = S.OneCycleLR(opt2, max_lr=1.0, total_steps=12)
    opt2.lr = lr
    opt2._set_momentum(momentum)
    again.load_state_dict(saved)
    assert run(again, 6) == rest and "_group" not in again.state_dict()


def test_a_trainer_steps_a_schedule_of_every_group():
    """fit(scheduler=...) with a multi-group optimizer: the schedule's rates reach each group."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], 64)
    opt = cmlp_optimizer(3)
    sched = S.ExponentialLR(opt, gamma=0.5)
    cmlp.Trainer(opt.model, opt, batch_size=16).fit(x, y, epochs=2, progress=False, scheduler=sched)
    assert opt._group_lrs() == sched.get_last_lr() == [0.5 * 0.25, 0.1 * 0.25, 0.03 * 0.25]
    assert all(math.isfinite(v) for v in opt.model._c.get_params())


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_cycle_keeps_its_settings_in_the_groups_and_torch_resumes_from_a_cmlp_checkpoint(kind):
    """As torch's, OneCycleLR writes max_lr, min_lr and the momenta into every param group, so that
    the optimizer's state_dict carries them: torch's OneCycleLR resumes from cmlp's checkpoint and
    steps on as cmlp's does, and a value set in a group is the one the next step takes."""
    torch, opt, topt = pair(3, kind)
    kw = dict(max_lr=[0.5, 0.2, 0.1], total_steps=STEPS)
    sched = S.OneCycleLR(opt, **kw)
    for _ in range(7):
        sched.step()
    ts = torch.optim.lr_scheduler.OneCycleLR(topt, **kw)
    for key in ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"):
        assert [g[key] for g in opt.param_groups] == [g[key] for g in topt.param_groups], key
    saved = opt.state_dict()
    topt.load_state_dict({"state": {}, "param_groups": [{**g, "params": t["params"]} for g, t in
                                                         zip(saved["param_groups"], topt.state_dict()["param_groups"])]})
    ts.load_state_dict(sched.state_dict())
    for _ in range(5):
        sched.step()
        ts.step()
        assert sched.get_last_lr() == ts.get_last_lr()
        assert momenta(opt, kind) == momenta(topt, kind)
    for o in (opt, topt):
        o.param_groups[1]["max_lr"] = 0.3
        o.param_groups[2]["min_lr"] = 1e-3
    sched.step()
    ts.step()
    assert sched.get_last_lr() == ts.get_last_lr()
    # a schedule's state loaded keeps the groups' own values (torch reads them from the groups)
    for o, sc in ((opt, sched), (topt, ts)):
        o.param_groups[0]["max_lr"] = 0.8
        sc.load_state_dict(sc.state_dict())
    assert opt.param_groups[0]["max_lr"] == topt.param_groups[0]["max_lr"] == 0.8
    sched.step()
    ts.step()
    assert sched.get_last_lr() == ts.get_last_lr()
    # a group's value that no rate can take is refused, and nothing moves
    before = (sched.last_epoch, group_lrs(opt))
    opt.param_groups[0]["max_lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['max_lr'\] must be a finite number >= 0"):
        sched.step()
    assert (sched.last_epoch, group_lrs(opt)) == before


def test_a_refused_step_puts_back_the_momenta_a_schedule_of_the_callers_moved():
    """A step whose rate the optimizer refuses leaves it as it was, the momenta too, where the
    schedule's own code moved them first: a subclass's get_lr, a LambdaLR's function."""

    class Warmup(S.LRScheduler):
        def get_lr(self):
            for g in self.optimizer.param_groups:
                g["betas"] = (0.5, g["betas"][1])
            return [-1.0] if self.last_epoch == 2 else [g["lr"] for g in self.optimizer.param_groups]

    adam = cmlp.optim.Adam(cmlp.MLP([4, 3, 2]), lr=0.1)
    sched = Warmup(adam)
    adam.param_groups[0]["betas"] = (0.9, 0.999)
    sched.step()
    adam.param_groups[0]["betas"] = (0.9, 0.999)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        sched.step()
    assert sched.last_epoch == 1 and adam.param_groups[0]["betas"] == (0.9, 0.999) and adam._c.momentum == 0.9
    sgd = cmlp_optimizer(3)

    def slower(epoch):
        sgd.param_groups[1]["momentum"] = 0.3
        return -1.0 if epoch == 1 else 1.0

    lam = S.LambdaLR(sgd, slower)
    sgd.param_groups[1]["momentum"] = 0.9
    with pytest.raises(ValueError, match="Invalid learning rate"):
        lam.step()
    assert lam.last_epoch == 0 and [g["momentum"] for g in sgd.param_groups] == [0.9] * 3


def test_one_cycle_takes_a_groups_value_that_equals_its_own_but_is_not_the_same_float():
    """OneCycleLR reads the groups' values at each step and keeps them as floats (float() of
    them, -0.0 apart from 0.0): a value set in a group, kept over a loaded state's equal one (an
    int, the other zero), is the one its state holds after the next step."""
    opt = cmlp_optimizer(2)
    sched = S.OneCycleLR(opt, max_lr=[0.5, 0.5], total_steps=STEPS)
    sched.step()
    saved = sched.state_dict()
    saved["_groups"][0]["min_lr"], saved["_groups"][1]["max_lr"] = 0.0, 1
    opt.param_groups[0]["min_lr"], opt.param_groups[1]["max_lr"] = -0.0, 1.0  # set since: kept (torch reads them)
    sched.load_state_dict(saved)
    sched.step()
    held = sched.state_dict()["_groups"]
    assert type(held[1]["max_lr"]) is float and held[1]["max_lr"] == 1.0, held
    assert math.copysign(1.0, held[0]["min_lr"]) == -1.0, held


def test_a_one_cycle_resumed_from_a_state_goes_on_apart_from_the_schedule_it_was_taken_from():
    """Two runs forked from one in-memory checkpoint: a value set in the first run's group moves
    the first schedule only, and the state taken before does not change with it."""
    def one_group():
        return cmlp.optim.SGD(cmlp.MLP(SIZES, seed=0), lr=LR, momentum=0.9)

    first = one_group()
    s1 = S.OneCycleLR(first, max_lr=0.5, total_steps=STEPS)
    s1.step()
    ckpt = {"opt": first.state_dict(), "sched": s1.state_dict()}
    second = one_group()
    s2 = S.OneCycleLR(second, max_lr=0.5, total_steps=STEPS)
    second.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["sched"])
    alone = one_group()  # the same resume, with no other run beside it
    s3 = S.OneCycleLR(alone, max_lr=0.5, total_steps=STEPS)
    alone.load_state_dict(ckpt["opt"])
    s3.load_state_dict(ckpt["sched"])
    first.param_groups[0]["max_lr"] = 2.0  # the first run only
    for _ in range(3):
        s1.step()
        s2.step()
        s3.step()
        assert s2.get_last_lr() == s3.get_last_lr() != s1.get_last_lr()
        assert momenta(second, "sgd") == momenta(alone, "sgd")
    assert second.param_groups[0]["max_lr"] == 0.5 and ckpt["sched"]["_groups"][0]["max_lr"] == 0.5


def test_a_one_cycle_takes_the_values_another_schedule_of_its_optimizer_writes_into_the_groups():
    """Two OneCycleLR schedules of one optimizer read the groups at each step, as torch's: a value
    one of them writes there (its constructor, its loaded state) is the one the other's next step
    takes."""
    opt = cmlp_optimizer(2)
    first = S.OneCycleLR(opt, max_lr=[0.5, 0.4], total_steps=STEPS)
    first.step()
    second = S.OneCycleLR(opt, max_lr=[0.3, 0.2], total_steps=STEPS)  # writes its values into the groups
    first.step()
    assert [g["max_lr"] for g in first.state_dict()["_groups"]] == [0.3, 0.2]
    state = second.state_dict()
    state["_groups"][0]["max_lr"] = 0.9
    second.load_state_dict(state)  # into the groups, where they hold what it wrote there
    assert opt.param_groups[0]["max_lr"] == 0.9
    first.step()
    assert [g["max_lr"] for g in first.state_dict()["_groups"]] == [0.9, 0.2]


def test_a_schedules_state_with_rates_as_0d_arrays_loads_as_torchs_with_tensor_rates():
    opt = cmlp_optimizer(2)
    sched = S.StepLR(opt, step_size=2, gamma=0.5)
    state = sched.state_dict()
    state["base_lrs"] = [np.array(v) for v in state["base_lrs"]]  # torch keeps a tensor lr's as tensors
    twin = S.StepLR(cmlp_optimizer(2), step_size=2, gamma=0.5)
    twin.load_state_dict(state)
    for _ in range(3):
        sched.step()
        twin.step()
    assert twin.get_last_lr() == sched.get_last_lr()


def test_one_cycle_refuses_a_negative_max_lr_in_any_group_and_changes_nothing():
    opt = cmlp_optimizer(3)
    before = unchanged(opt)
    for max_lr in (-0.1, [0.1, -0.1, 0.1], float("inf")):
        with pytest.raises(ValueError, match="max_lr must be a finite rate >= 0"):
            S.OneCycleLR(opt, max_lr=max_lr, total_steps=10)
        assert unchanged(opt) == before


# schedules whose steps read a list of one value per param group (torch's next step fails on a
# state saved with another number of groups, its lists cut short)
PER_GROUP_SCHEDULES = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9 ** e),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.5, total_steps=50),
    "CyclicLR": lambda o: S.CyclicLR(o, 0.01, 0.1), "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, 2),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, 5),
    "ReduceLROnPlateau(min_lr per group)": lambda o: S.ReduceLROnPlateau(o, min_lr=[0.0] * len(o.param_groups)),
    "SequentialLR": lambda o: S.SequentialLR(o, [S.ConstantLR(o), S.CosineAnnealingLR(o, 2)], [3]),
}
# schedules whose steps read each group's rate only: torch loads such a state and steps on
CHAINED_SCHEDULES = {
    "StepLR": lambda S, o: S.StepLR(o, step_size=2, gamma=0.5), "MultiStepLR": lambda S, o: S.MultiStepLR(o, [1, 3]),
    "ExponentialLR": lambda S, o: S.ExponentialLR(o, 0.9), "ConstantLR": lambda S, o: S.ConstantLR(o),
    "LinearLR": lambda S, o: S.LinearLR(o), "PolynomialLR": lambda S, o: S.PolynomialLR(o),
    "MultiplicativeLR": lambda S, o: S.MultiplicativeLR(o, lambda e: 0.95),
}


def stepped(sched):
    sched.optimizer.step()
    sched.step(*((1.0,) if isinstance(sched, S.ReduceLROnPlateau) else ()))


@pytest.mark.parametrize("name", PER_GROUP_SCHEDULES)
@pytest.mark.parametrize("saved, loaded", [(2, 3), (3, 2)])
def test_a_schedules_state_from_an_optimizer_with_other_param_groups_is_refused_and_loads_nothing(name, saved, loaded):
    source = PER_GROUP_SCHEDULES[name](cmlp_optimizer(saved))
    stepped(source)
    sched = PER_GROUP_SCHEDULES[name](cmlp_optimizer(loaded))
    before = sched.state_dict()
    with pytest.raises(ValueError, match=rf"has {saved} entries, one per param group of the optimizer it was saved "
                                         rf"with; this \w+'s optimizer has {loaded} param groups"):
        sched.load_state_dict(source.state_dict())
    assert sched.state_dict() == before
    stepped(sched)  # and it goes on


@pytest.mark.parametrize("name", CHAINED_SCHEDULES)
@pytest.mark.parametrize("saved, loaded", [(2, 3), (3, 2)])
def test_a_chained_schedules_state_from_other_param_groups_loads_and_steps_as_torchs(name, saved, loaded):
    # its last rates are this optimizer's own (torch's next step rewrites the saved ones)
    torch, opt, topt = pair(loaded)
    source, tsource = CHAINED_SCHEDULES[name](S, cmlp_optimizer(saved)), CHAINED_SCHEDULES[name](
        torch.optim.lr_scheduler, torch_optimizer(torch, saved))
    for _ in range(2):
        stepped(source)
        tsource.optimizer.step()
        tsource.step()
    sched, tsched = CHAINED_SCHEDULES[name](S, opt), CHAINED_SCHEDULES[name](torch.optim.lr_scheduler, topt)
    sched.load_state_dict(source.state_dict())
    tsched.load_state_dict(tsource.state_dict())
    assert sched.get_last_lr() == group_lrs(opt) and sched.last_epoch == tsched.last_epoch == 2
    for _ in range(4):
        stepped(sched)
        topt.step()
        tsched.step()
        assert group_lrs(opt) == pytest.approx(group_lrs(topt), rel=1e-12)


@pytest.mark.parametrize("saved, loaded", [(2, 3), (3, 2)])
def test_a_plateau_schedule_made_with_one_min_lr_takes_it_for_each_group_of_another_optimizer(saved, loaded):
    # torch's default_min_lr: the min_lr of each group when the groups changed
    source = S.ReduceLROnPlateau(cmlp_optimizer(saved), min_lr=1e-4, patience=0)
    stepped(source)
    opt = cmlp_optimizer(loaded)
    sched = S.ReduceLROnPlateau(opt, min_lr=0.0)
    sched.load_state_dict(source.state_dict())
    assert sched.min_lrs == [1e-4] * loaded and sched.get_last_lr() == group_lrs(opt)
    for _ in range(40):
        stepped(sched)
    assert group_lrs(opt) == pytest.approx([1e-4] * loaded)


def test_a_plateau_schedule_refuses_an_unknown_mode_before_taking_anything():
    sched = S.ReduceLROnPlateau(cmlp_optimizer(2), patience=1)
    before = sched.state_dict()
    cyclic = S.CyclicLR(cmlp_optimizer(2), 0.01, 0.1, step_size_up=3).state_dict()
    for state, why in ((cyclic, "mode triangular is unknown!"), (dict(before, threshold_mode="log"),
                                                                "threshold mode log is unknown!")):
        with pytest.raises(ValueError, match=why):
            sched.load_state_dict(state)
        assert sched.state_dict() == before
