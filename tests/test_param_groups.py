"""Param groups (torch's param_groups): each group of parameter tensors steps at its own learning
rate, weight decay and hyperparameters (Adam's betas, eps, amsgrad and maximize; SGD's momentum,
dampening, nesterov and maximize). Checked against a float64 reference and torch.optim, in the
hand loop and in Trainer.fit (to the bit), with state_dicts in torch's layout and bad groups
refused.
"""
import copy
import weakref

import numpy as np
import pytest

import cmlp
from cmlp.optim import lr_scheduler as S
from reference import RefAdam, RefSGD, rel_err

SIZES = [20, 16, 12, 5]
WEIGHTS = ["fc1.weight", "fc2.weight", "fc3.weight"]
BIASES = ["fc1.bias", "fc2.bias", "fc3.bias"]
# per-layer rates, and no weight decay on the biases
GROUPS = [{"params": ["fc1.weight", "fc2.weight"], "lr": 3e-3},
          {"params": ["fc3.weight"], "weight_decay": 0.3},
          {"params": BIASES, "weight_decay": 0.0, "lr": 5e-3}]
# the same groups, each with hyperparameters of its own too (the first group's are the C configuration's)
OWN = {"adam": [{**GROUPS[0], "betas": (0.8, 0.99), "eps": 1e-6}, {**GROUPS[1], "maximize": True, "amsgrad": True},
                {**GROUPS[2], "betas": (0.95, 0.9)}],
       "sgd": [{**GROUPS[0], "momentum": 0.5, "dampening": 0.2, "nesterov": False}, {**GROUPS[1], "maximize": True},
               {**GROUPS[2], "momentum": 0.0}]}
OWN["adamw"] = OWN["adam"]

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")


def make(kind, groups=GROUPS, seed=1, **kw):
    model = cmlp.MLP(SIZES, seed=seed)
    if kind == "adam":
        opt = cmlp.optim.Adam(model, lr=1e-3, weight_decay=0.1, param_groups=groups, **kw)
    elif kind == "adamw":
        opt = cmlp.optim.AdamW(model, lr=1e-3, weight_decay=0.1, param_groups=groups, **kw)
    else:
        opt = cmlp.optim.SGD(model, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, param_groups=groups,
                             **kw)
    return model, opt


def batches(n, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], n))
            for _ in range(steps)]


def reference_of(kind, g, defaults):
    """The float64 reference optimizer of group g."""
    d = {**defaults, **g}
    if kind == "sgd":
        # a group's nesterov without momentum does nothing in torch's step (its check is the constructor's)
        return RefSGD(d["lr"], momentum=d["momentum"], dampening=d["dampening"],
                      nesterov=d["nesterov"] and d["momentum"] > 0,
                      weight_decay=d["weight_decay"], maximize=d["maximize"])
    return RefAdam(d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                   decoupled_weight_decay=kind == "adamw", amsgrad=d["amsgrad"], maximize=d["maximize"])


def step_with_references(model, opt, refs, params, x, y):
    """One step of opt, and of each group's float64 reference (names, ref) on params with the same
    gradients (no feedback from rounding)."""
    opt.zero_grad()
    model.forward_backward(x, y)
    grads = model.grads()
    opt.step()
    for names, ref in refs:
        ref.step({k: params[k] for k in names}, {k: grads[k] for k in names})


def step_with_torch(tensors, m, o, t, x, y):
    """One step of the cmlp optimizer o on model m and of torch's t on tensors, from the same
    parameters (torch's, loaded into m) and gradients (m's, given to torch)."""
    import torch

    m.load_state_dict({k: v.detach().numpy() for k, v in tensors.items()})
    o.zero_grad()
    m.forward_backward(x, y)
    for k, g in m.grads().items():
        tensors[k].grad = torch.from_numpy(g.copy())
    o.step()
    t.step()


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_each_group_follows_the_float64_reference_at_its_own_settings(kind, own):
    groups = OWN[kind] if own else GROUPS
    model, opt = make(kind, groups=groups)
    params = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    refs = [(g["params"], reference_of(kind, g, opt.defaults)) for g in groups]
    for i, g in enumerate(groups):
        mine = opt.param_groups[i]
        assert {k: v for k, v in mine.items() if k in g} == {**g, "params": mine["params"]}
    for x, y in batches(8, 12):
        step_with_references(model, opt, refs, params, x, y)
        got = model.state_dict()
        for k in params:
            assert rel_err(got[k], params[k]) < 2e-6, k


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_groups_match_torch_with_settings_changed_between_steps(kind, own):
    torch = pytest.importorskip("torch")
    groups = OWN[kind] if own else GROUPS
    model, opt = make(kind, groups=groups)
    sd = model.state_dict()
    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in sd.items()}
    tgroups = [{**g, "params": [tensors[k] for k in g["params"]]} for g in groups]
    if kind == "sgd":
        topt = torch.optim.SGD(tgroups, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    else:
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        topt = cls(tgroups, lr=1e-3, weight_decay=0.1)
    for i, (x, y) in enumerate(batches(8, 20)):
        if i == 10:  # torch's way of changing a group's settings
            for groups in (opt.param_groups, topt.param_groups):
                groups[1]["lr"] = 2e-3
                groups[2]["weight_decay"] = 0.05
                groups[0]["lr"] = 0.0  # frozen from here on (Adam's moments still move, as torch's)
                if own and kind == "sgd":  # the biases' momentum starts (its buffer from the gradient)
                    groups[2].update({"momentum": 0.7, "dampening": 0.3})
                    groups[1]["dampening"] = 0.5
                elif own:
                    groups[1]["betas"] = (0.5, 0.9)
                    groups[2]["eps"] = 1e-3
                    groups[0]["maximize"] = True
        model.load_state_dict({k: t.detach().numpy() for k, t in tensors.items()})
        opt.zero_grad()
        model.forward_backward(x, y)
        for k, g in model.grads().items():
            tensors[k].grad = torch.from_numpy(g.copy())
        before = model.state_dict()
        opt.step()
        topt.step()
        got = model.state_dict()
        for k, t in tensors.items():
            assert rel_err(got[k], t.detach().numpy()) < 1e-6, (i, k)
        if i >= 10 and kind != "adamw":
            for k in ("fc1.weight", "fc2.weight"):
                np.testing.assert_array_equal(got[k], before[k])
    ours, theirs = opt.state_dict(), topt.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    for a, b in zip(ours["param_groups"], theirs["param_groups"]):
        assert {k: a[k] for k in b if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    for i, entry in theirs["state"].items():
        for name, value in entry.items():
            if name != "step":
                assert rel_err(ours["state"][i][name], value.numpy()) < 1e-5, (i, name)
    # torch's state_dict (groups and all) loads into a cmlp optimizer made with the same groups
    _, fresh = make(kind, seed=4)
    fresh.load_state_dict({"state": {i: {n: (v.numpy() if hasattr(v, "numpy") else v) for n, v in e.items()}
                                     for i, e in theirs["state"].items()},
                           "param_groups": theirs["param_groups"]})
    assert [{k: g[k] for k in t if k != "params"} for g, t in zip(fresh.param_groups, topt.param_groups)] == \
           [{k: v for k, v in t.items() if k != "params"} for t in topt.param_groups]


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_groups_with_one_setting_take_the_plain_step_to_the_bit(kind):
    """Groups that all have the optimizer's settings change nothing: the same bits as no groups."""
    runs = []
    for groups in (None, [{"params": WEIGHTS}, {"params": BIASES}], [{"params": [5, 4, 3, 2, 1, 0]}]):
        model, opt = make(kind, groups=groups)
        for x, y in batches(8, 5):
            opt.zero_grad()
            model.forward_backward(x, y)
            opt.step()
        runs.append(model._c.get_params())
    for run in runs[1:]:
        np.testing.assert_array_equal(run, runs[0])


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fit_with_groups_equals_the_hand_loop_to_the_bit(kind, own):
    x, y = batches(96, 1)[0]
    runs = []
    for by_fit in (True, False):
        model, opt = make(kind, groups=OWN[kind] if own else GROUPS)
        trainer = cmlp.Trainer(model, opt, batch_size=16, shuffle=False)
        if by_fit:
            trainer.fit(x, y, epochs=2, progress=False)
        else:
            for _ in range(2):
                for i in range(0, 96, 16):
                    trainer.step(x[i:i + 16], y[i:i + 16])
        runs.append(model._c.get_params())
    np.testing.assert_array_equal(runs[0], runs[1])


def test_frozen_group_keeps_its_parameters():
    """lr=0 freezes a group (torch's usual alternative to leaving it out): AdamW's decay too."""
    model, opt = make("adamw", groups=[{"params": ["fc1.weight", "fc1.bias"], "lr": 0.0},
                                       {"params": ["fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]}])
    before = model.state_dict()
    trainer = cmlp.Trainer(model, opt, batch_size=16)
    x, y = batches(64, 1)[0]
    trainer.fit(x, y, epochs=1, progress=False)
    after = model.state_dict()
    for k in ("fc1.weight", "fc1.bias"):
        np.testing.assert_array_equal(after[k], before[k])
    assert rel_err(after["fc2.weight"], before["fc2.weight"]) > 1e-4


class _Calls:
    """A trainer's C object, counting its epoch_run calls (and those with the parts' momenta) and
    the steps each asks for."""

    def __init__(self, c):
        self._inner, self.calls, self.with_momenta, self.asked = c, 0, 0, []

    def epoch_run(self, *args):
        self.calls += 1
        self.with_momenta += len(args) > 4 and args[4] is not None
        self.asked.append(args[0])
        return self._inner.epoch_run(*args)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def grew(self, total):
        """The calls of an epoch of `total` steps started at total // 200 (at least 1), grew (the
        steps of a small model are quick) and took at most MAX_RATES steps each."""
        first = max(1, total // 200)
        return (self.asked[0] == first and max(self.asked) == min(cmlp._cmlp.MAX_RATES, total)
                and self.calls < -(-total // first))


def schedule_of(sched, opt):
    if sched == "lambda":
        return S.LambdaLR(opt, lambda k: 0.9 ** k)
    if sched == "lambdas":  # the groups' own factors: their rates move apart at every step
        return S.LambdaLR(opt, [lambda k: 0.9 ** k, lambda k: 1.0 / (k + 1), lambda k: 1.0 + 0.1 * (k % 3)])
    if sched == "cyclic":
        return S.CyclicLR(opt, base_lr=[1e-4, 1e-3, 2e-3], max_lr=[1e-2, 2e-3, 5e-3], step_size_up=3,
                          cycle_momentum=False)
    if sched == "onecycle":  # each group's momentum moves too, between its own bounds
        return S.OneCycleLR(opt, max_lr=[1e-2, 2e-3, 5e-3], total_steps=500, base_momentum=[0.8, 0.7, 0.85],
                            max_momentum=[0.9, 0.95, 0.85])
    return S.CosineAnnealingLR(opt, T_max=7, eta_min=1e-4)


def fit_and_hand_loop(kind, sched, x, y, batch, epochs, amp=None, own=False):
    """The parameters and group rates after fit with a per-step schedule and after the hand loop
    (trainer.step, then the schedule's step), and fit's calls into the C loop (_Calls)."""
    runs, rates, calls = [], [], 0
    for by_fit in (True, False):
        model, opt = make(kind, groups=OWN[kind] if own else GROUPS)
        s = schedule_of(sched, opt)
        scaler = cmlp.amp.GradScaler(init_scale=2.0**12) if amp else None
        trainer = cmlp.Trainer(model, opt, batch_size=batch, shuffle=False, amp=amp, scaler=scaler)
        if by_fit:
            trainer._c = _Calls(trainer._c)
            trainer.fit(x, y, epochs=epochs, progress=False, scheduler=s, scheduler_interval="step")
            calls = trainer._c
        else:
            for _ in range(epochs):
                for i in range(0, len(x), batch):
                    trainer.step(x[i:i + batch], y[i:i + batch])
                    s.step()
        runs.append(model._c.get_params())
        rates.append([g["lr"] for g in opt.param_groups])
    np.testing.assert_array_equal(runs[0], runs[1])
    assert rates[0] == rates[1] and len(set(rates[0])) == 3
    return calls


@pytest.mark.parametrize("kind,amp", [("adam", None), ("sgd", None), ("adamw", "fp16")])
@pytest.mark.parametrize("sched", ["lambda", "cosine", "lambdas", "cyclic"])
def test_a_per_step_schedule_in_fit_equals_the_hand_loop(sched, kind, amp):
    """LambdaLR keeps the groups' rates in proportion; CosineAnnealingLR with eta_min, per-group
    lambdas and CyclicLR do not, and each step of a call then reads each group's multiple of its
    base rate from a row of its own (on the host, or on the device with the step's bookkeeping:
    fp16's scaler). Both equal the hand loop to the bit, and a call takes up to 16 steps either way."""
    x, y = batches(480, 1)[0]
    assert fit_and_hand_loop(kind, sched, x, y, batch=1, epochs=1, amp=amp).grew(480)


@pytest.mark.parametrize("kind,amp", [("adam", None), ("sgd", None), ("adamw", "fp16")])
@pytest.mark.parametrize("sched", ["lambda", "cosine", "onecycle"])
def test_groups_with_their_own_settings_in_fit_under_a_per_step_schedule_equal_the_hand_loop(sched, kind, amp):
    """Groups with betas, eps, momentum, ... of their own, under schedules that keep the groups'
    proportions (LambdaLR), move them apart (CosineAnnealingLR with eta_min) or move each group's
    momentum between bounds of its own (OneCycleLR): each step of a call reads its groups' rates
    and momenta (a table when they move apart), and fit equals the hand loop to the bit."""
    x, y = batches(480, 1)[0]
    calls = fit_and_hand_loop(kind, sched, x, y, batch=1, epochs=1, amp=amp, own=True)
    assert calls.grew(480) and (calls.with_momenta == calls.calls) == (sched == "onecycle")


@pytest.mark.parametrize("sched", ["lambda", "cosine"])
def test_a_per_step_schedule_in_fit_over_two_epochs_equals_the_hand_loop(sched):
    x, y = batches(80, 1)[0]
    asked = fit_and_hand_loop("adam", sched, x, y, batch=16, epochs=2).asked  # 5 steps an epoch: 1, 2, 2 each
    assert asked[0] == 1 and sum(asked) == 2 * 5 and max(asked) <= 4, asked


def test_state_dict_round_trip_deepcopy_and_a_different_grouping_refused():
    model, opt = make("adam")
    opt.param_groups[2]["note"] = "biases"  # torch keeps keys it does not know
    for x, y in batches(8, 3):
        opt.zero_grad()
        model.forward_backward(x, y)
        opt.step()
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2], [3, 4, 5]]
    assert sd["param_groups"][2]["note"] == "biases"
    assert sd["state"][3]["exp_avg"].shape == (16,)  # fc1.bias: numbered group after group, as torch
    twin = copy.deepcopy(opt)
    _, other = make("adam", seed=3)
    other.load_state_dict(sd)
    for o in (twin, other):
        assert o.state_dict()["param_groups"] == sd["param_groups"]
        for i in sd["state"]:
            for k in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(o.state_dict()["state"][i][k], sd["state"][i][k])
    twin.model.load_state_dict(model.state_dict())
    for m, o in ((model, opt), (twin.model, twin)):
        x, y = batches(8, 1, seed=5)[0]
        o.zero_grad()
        m.forward_backward(x, y)
        o.step()
    np.testing.assert_array_equal(model._c.get_params(), twin.model._c.get_params())
    _, single = make("adam", groups=None)
    before = single.state_dict()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        single.load_state_dict(sd)
    assert single.state_dict()["param_groups"] == before["param_groups"]
    _, regrouped = make("adam", groups=[{"params": WEIGHTS}, {"params": ["fc1.bias"]}, {"params": BIASES[1:]}])
    with pytest.raises(ValueError, match="doesn't match the size"):
        regrouped.load_state_dict(sd)
    bad = copy.deepcopy(sd)
    bad["param_groups"][1]["decoupled_weight_decay"] = True
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"other \['decoupled_weight_decay'\] than group 0: cmlp's param groups "
                                         "share decoupled_weight_decay"):
        other.load_state_dict(bad)
    assert other.state_dict()["param_groups"] == before["param_groups"]
    own = copy.deepcopy(sd)  # a group's own betas load, and the state_dict gives them back
    own["param_groups"][1]["betas"] = (0.8, 0.99)
    other.load_state_dict(own)
    assert other.state_dict()["param_groups"] == own["param_groups"]
    assert [g["betas"] for g in other.param_groups] == [(0.9, 0.999), (0.8, 0.99), (0.9, 0.999)]


def test_attributes_are_the_first_groups_and_shared_settings_are_everyones():
    model, opt = make("sgd")
    assert (opt.lr, opt.weight_decay) == (3e-3, 0.1)
    opt.lr = 1e-3  # the first group only, as torch's param_groups[0]["lr"]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2, 5e-3]
    opt.param_groups[2]["momentum"] = 0.5  # that group's own
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9, 0.5] and opt.momentum == 0.9
    opt.momentum = 0.8  # the attribute sets every group's
    assert [g["momentum"] for g in opt.param_groups] == [0.8] * 3
    with pytest.raises(ValueError, match="Invalid momentum value"):
        opt.param_groups[1]["momentum"] = -0.5
    with pytest.raises(TypeError, match="nesterov must be a bool"):  # as the constructor refuses it
        opt.param_groups[1]["nesterov"] = "yes"
    _, adam = make("adam")
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        adam.param_groups[2]["betas"] = (0.9, 1.0)
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        adam.param_groups[0].update({"lr": 0.5, "eps": -1.0})  # all or nothing
    with pytest.raises(TypeError, match="amsgrad must be a bool"):  # as Adam(amsgrad="yes")
        adam.param_groups[1]["amsgrad"] = "yes"
    adam.param_groups[1]["amsgrad"] = 1  # as Adam(amsgrad=1) takes it
    assert adam.param_groups[1]["amsgrad"] is True
    adam.param_groups[1]["amsgrad"] = True  # that group's own
    assert [(g["lr"], g["betas"], g["eps"], g["amsgrad"]) for g in adam.param_groups] == \
           [(3e-3, (0.9, 0.999), 1e-8, False), (1e-3, (0.9, 0.999), 1e-8, True), (5e-3, (0.9, 0.999), 1e-8, False)]
    adam.amsgrad = True  # the attribute sets every group's
    assert [g["amsgrad"] for g in adam.param_groups] == [True] * 3
    adam.param_groups[2]["decoupled_weight_decay"] = True  # shared: every group's
    assert [g["decoupled_weight_decay"] for g in adam.param_groups] == [True] * 3 and adam.decoupled_weight_decay
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.param_groups[1].update({"weight_decay": 0.2, "lr": -1.0})
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(1e-3, 0.1), (1e-2, 0.3), (5e-3, 0.0)]
    with pytest.raises(ValueError, match="cannot change"):
        opt.param_groups[0]["params"] = [0]
    with pytest.raises(ValueError, match="in a param group already"):
        opt.add_param_group({"params": ["fc1.weight"]})


@pytest.mark.parametrize("groups,error,match", [
    ([{"params": WEIGHTS}], ValueError, r"every parameter must be in a param group.*fc1\.bias"),
    ([{"params": WEIGHTS + BIASES}, {"params": ["fc1.bias"]}], ValueError, "more than one parameter group"),
    ([{"params": WEIGHTS + BIASES + ["fc4.weight"]}], ValueError, "not one of the model's parameters"),
    ([{"params": [0, 1, 2, 3, 4, 6]}], ValueError, "index 6"),
    ([{"params": set(WEIGHTS + BIASES)}], TypeError, "no order"),
    ([], ValueError, "empty parameter list"),
    ({"params": WEIGHTS + BIASES}, TypeError, "list of dicts"),
    ([{"lr": 0.1}], TypeError, "with 'params'"),
    ([{"params": WEIGHTS}, {"params": BIASES, "momentum": -0.5}], ValueError, "Invalid momentum value"),
    ([{"params": WEIGHTS}, {"params": BIASES, "nesterov": "yes"}], TypeError,
     r"param_groups\[1\]: nesterov must be a bool"),
    ([{"params": WEIGHTS}, {"params": BIASES, "lr": -0.1}], ValueError, "Invalid learning rate"),
    ([{"params": WEIGHTS}, {"params": BIASES, "betas": (0.9, 0.99)}], ValueError, "no 'betas' setting"),
])
def test_bad_groups_raise_clear_errors(groups, error, match):
    with pytest.raises(error, match=match):
        make("sgd", groups=groups)


NAN = float("nan")


@pytest.mark.parametrize("kind,key,value,match", [
    ("sgd", "momentum", NAN, r"param_groups\[1\]: Invalid momentum value: nan"),
    ("sgd", "dampening", NAN, r"param_groups\[1\]: Invalid dampening value: nan"),
    ("adam", "betas", (NAN, 0.999), r"param_groups\[1\]: Invalid beta parameter at index 0: nan"),
    ("adam", "betas", (0.9, NAN), r"param_groups\[1\]: Invalid beta parameter at index 1: nan"),
    ("adamw", "eps", NAN, r"param_groups\[1\]: Invalid epsilon value: nan"),
])
def test_a_nan_setting_in_a_later_group_is_refused_as_in_the_first(kind, key, value, match):
    """A NaN there is refused in every way it can come (made so, set, loaded), with nothing
    changed: it was taken for the first group's setting, which the steps then used."""
    with pytest.raises(ValueError, match=match):
        make(kind, groups=[{"params": WEIGHTS}, {"params": BIASES, key: value}])
    model, opt = make(kind, groups=[{"params": WEIGHTS}, {"params": BIASES}])
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.param_groups[1][key] = value
    bad = copy.deepcopy(before)
    bad["param_groups"][1][key] = value
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert repr(opt.state_dict()) == repr(before)


def test_a_schedule_that_keeps_the_groups_proportions_keeps_their_multiples():
    """A captured step replays while the groups' rates are the same multiples of the base rate:
    a schedule's rates (base * f(t) in each group) divide to multiples that differ in the last
    bits only, and the multiples are kept; a schedule that changes the proportions changes them."""
    _, opt = make("adam")
    sched = S.LambdaLR(opt, lambda k: 0.97 ** k / (1 + k) ** 0.5)
    first = opt._rates()[1]
    for _ in range(200):
        sched.step()
        base, scales = opt._rates()
        assert scales == first
        for lr, scale in zip([g["lr"] for g in opt.param_groups], scales):
            assert abs(base * scale - lr) <= 2e-12 * lr
    _, opt = make("adam")
    sched = S.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)
    seen = {opt._rates()[1]}
    for _ in range(5):
        sched.step()
        seen.add(opt._rates()[1])
    assert len(seen) == 6


def test_torchs_own_form_with_named_parameters_ports_as_it_is():
    """torch's idiom, param groups of the tensors named_parameters() gives, as the first argument:
    the copies cmlp gives out are known for what they are (while they live), so the same code
    makes the same groups; a list of them is one group."""
    model = cmlp.MLP(SIZES, seed=1)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = cmlp.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3,
                           weight_decay=0.05)
    assert opt.model is model
    assert [(g["params"], g["weight_decay"]) for g in opt.param_groups] == [([0, 1, 2], 0.05), ([3, 4, 5], 0.0)]
    named = cmlp.optim.AdamW(model, lr=1e-3, weight_decay=0.05,
                             param_groups=[{"params": WEIGHTS}, {"params": BIASES, "weight_decay": 0.0}])
    assert opt.state_dict()["param_groups"] == named.state_dict()["param_groups"]
    assert len(cmlp.optim.SGD(list(model.parameters()), lr=0.1).param_groups) == 1
    assert cmlp.optim.SGD([{"params": model.parameters(), "lr": 0.2}], lr=0.1).lr == 0.2
    other = cmlp.MLP(SIZES, seed=1)
    with pytest.raises(ValueError, match="more than one model"):
        cmlp.optim.SGD([{"params": decay}, {"params": list(other.parameters())}])
    with pytest.raises(TypeError, match="give the model too"):
        cmlp.optim.SGD([{"params": WEIGHTS + BIASES}])
    with pytest.raises(ValueError, match="not one of this model's parameters"):
        cmlp.optim.SGD(model, param_groups=[{"params": decay + [np.zeros(3)]}, {"params": BIASES}])
    with pytest.raises(ValueError, match="not one of this model's parameters"):
        cmlp.optim.SGD(other, param_groups=[{"params": decay + no_decay}])
    with pytest.raises(TypeError, match="given once"):
        cmlp.optim.SGD([{"params": decay + no_decay}], param_groups=[{"params": WEIGHTS + BIASES}])
    with pytest.raises(ValueError, match="every parameter must be in a param group"):
        cmlp.optim.SGD(decay)


def test_generators_in_torchs_form_and_copies_of_the_groups_are_plain():
    model = cmlp.MLP(SIZES, seed=1)
    opt = cmlp.optim.AdamW([
        {"params": (p for n, p in model.named_parameters() if n.endswith("weight"))},
        {"params": filter(lambda p: p.ndim == 1, model.parameters()), "weight_decay": 0.0}], lr=1e-3)
    assert [g["params"] for g in opt.param_groups] == [[0, 1, 2], [3, 4, 5]]
    saved = copy.deepcopy(opt.param_groups)
    saved[1]["lr"] = 0.5  # a copy is the settings, as torch's: the optimizer keeps its own
    assert opt.param_groups[1]["lr"] == 1e-3 and type(saved[1]) is dict
    assert type(copy.copy(opt.param_groups[0])) is dict
    import pickle
    assert pickle.loads(pickle.dumps(opt.param_groups)) == [dict(g) for g in opt.param_groups]


def test_the_list_of_groups_refuses_to_change_rather_than_lose_the_change():
    """torch lets code append or replace a group; here the groups are given when the optimizer is
    made, so such a change is refused with a TypeError saying so, and nothing changes."""
    model, opt = make("sgd", groups=[{"params": WEIGHTS}, {"params": BIASES, "lr": 0.5}])
    groups = opt.param_groups
    for change in (lambda: groups.append({"params": [0], "lr": 1.0}),
                   lambda: groups.__setitem__(0, {"params": WEIGHTS, "lr": 0.7}),
                   lambda: groups.__delitem__(1), lambda: groups.pop(), lambda: groups.extend([{}]),
                   lambda: groups.insert(0, {}), lambda: groups.clear(), lambda: groups.reverse()):
        with pytest.raises(TypeError, match=r"param_groups cannot be changed.*param_groups\[0\]\['lr'\]"):
            change()
    assert [g["lr"] for g in opt.param_groups] == [opt.lr, 0.5] and len(groups) == 2
    groups[1]["lr"] = 0.25  # a group's settings are set through it, as in torch
    assert opt.param_groups[1]["lr"] == 0.25
    assert type(copy.copy(groups)) is list and copy.copy(groups) == groups


def test_a_frozen_group_under_a_cosine_schedule_with_eta_min_stays_at_0_or_above():
    """torch's recursive form rounds the frozen group's rate to -6.5e-19 at some steps; the
    optimizer takes no negative rate, so the schedule gives 0 there."""
    model, opt = make("sgd", groups=[{"params": ["fc1.weight"], "lr": 0.0},
                                     {"params": [n for n in WEIGHTS + BIASES if n != "fc1.weight"]}])
    sched = S.CosineAnnealingLR(opt, T_max=20, eta_min=1e-4)
    for _ in range(60):
        opt.step()
        sched.step()
        assert all(g["lr"] >= 0.0 for g in opt.param_groups)


def test_a_group_falling_far_below_another_keeps_training_and_loads_back():
    """The base rate is the largest group rate: a group decayed to 1e-42 while another stays is a
    multiple of it far below 1 (as the first group's multiple it would overflow float32), and a
    state_dict of such rates loads."""
    model, opt = make("adam", groups=[{"params": WEIGHTS}, {"params": BIASES}])
    sched = S.LambdaLR(opt, [lambda e: 0.5 ** e, lambda e: 1.0])
    for x, y in batches(8, 200):
        opt.zero_grad()
        model.forward_backward(x, y)
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [1e-3 * 0.5 ** 200, 1e-3]
    _, other = make("adam", groups=[{"params": WEIGHTS}, {"params": BIASES}], seed=3)
    other.load_state_dict(opt.state_dict())
    assert [g["lr"] for g in other.param_groups] == [1e-3 * 0.5 ** 200, 1e-3]
    _, sgd = make("sgd", groups=[{"params": WEIGHTS}, {"params": BIASES}])
    sched = S.ExponentialLR(sgd, gamma=0.5)
    for _ in range(150):
        sched.step()
    _, fresh = make("sgd", groups=[{"params": WEIGHTS}, {"params": BIASES}], seed=2)
    fresh.load_state_dict(sgd.state_dict())
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in sgd.param_groups]


def test_named_parameters_pairs_are_taken_as_torch_takes_them():
    model = cmlp.MLP(SIZES, seed=1)
    opt = cmlp.optim.SGD(model.named_parameters(), lr=0.1)
    assert opt.model is model and len(opt.param_groups) == 1
    named = list(model.named_parameters())
    opt = cmlp.optim.AdamW([{"params": [p for p in named if p[0].endswith("weight")]},
                            {"params": [p for p in named if p[0].endswith("bias")], "weight_decay": 0.0}])
    assert [g["params"] for g in opt.param_groups] == [[0, 1, 2], [3, 4, 5]]
    opt = cmlp.optim.AdamW(model, param_groups=[{"params": named[:3]}, {"params": named[3:]}])
    assert [g["params"] for g in opt.param_groups] == [[0, 1, 2], [3, 4, 5]]
    # as torch's, each group records the names it was given, and the groups are all named or none
    assert [g["param_names"] for g in opt.state_dict()["param_groups"]] == [[n for n, _ in named[:3]],
                                                                           [n for n, _ in named[3:]]]
    unnamed = cmlp.optim.SGD(model.parameters())
    assert "param_names" not in unnamed.param_groups[0]
    with pytest.raises(ValueError, match="with/without names"):
        cmlp.optim.AdamW([{"params": named[:3]}, {"params": [p for _, p in named[3:]]}])
    with pytest.raises(ValueError, match="Some param names are missing"):
        cmlp.optim.AdamW([{"params": named[:3] + [p for _, p in named[3:]]}])
    torch = pytest.importorskip("torch")
    layers = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])])
    theirs = torch.optim.AdamW([{"params": list(layers.named_parameters())[:3]},
                                {"params": list(layers.named_parameters())[3:]}])
    assert [len(g["param_names"]) for g in theirs.param_groups] == [len(g["param_names"]) for g in opt.param_groups]



@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_loaded_group_without_a_rate_or_weight_decay_keeps_its_own(kind):
    """load_state_dict fills a key a loaded group lacks from that group's setting (never from the
    first group's); the list of groups refuses to change, and changes nothing."""
    _, opt = make(kind)
    before = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    saved = opt.state_dict()
    for group in saved["param_groups"][1:]:
        del group["lr"], group["weight_decay"]
    opt.load_state_dict(saved)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == before
    groups = opt.param_groups
    with pytest.raises(TypeError, match="param_groups cannot be changed"):
        groups.append({"params": [], "lr": 1.0})
    with pytest.raises(TypeError, match="param_groups cannot be changed"):
        groups.pop(0)
    assert len(opt.param_groups) == 3 and opt.param_groups[0]["params"] == [0, 1]
    copied = opt.param_groups[2].copy()
    assert type(copied) is dict and copied == dict(opt.param_groups[2])
    copied["lr"] = 1.0
    assert opt.param_groups[2]["lr"] == before[2][0]


def test_sgd_state_of_a_group_without_momentum_is_torchs_both_ways():
    """A group without momentum keeps no momentum buffer in torch's state_dict (no entry at all);
    the state_dict here leaves it out too, and a torch state_dict without it loads (its buffer
    then starts from zeros). With the state loaded each way, the next steps agree."""
    torch = pytest.importorskip("torch")
    groups = [{"params": WEIGHTS}, {"params": BIASES, "momentum": 0.0, "lr": 0.05}]
    model, opt = make("sgd", groups=groups)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in model.state_dict().items()}
    topt = torch.optim.SGD([{**g, "params": [tensors[k] for k in g["params"]]} for g in groups], lr=1e-2,
                           momentum=0.9, nesterov=True, weight_decay=0.1)

    def step(m, o, t, x, y):
        step_with_torch(tensors, m, o, t, x, y)

    for x, y in batches(8, 3):
        step(model, opt, topt, x, y)
    ours, theirs = opt.state_dict(), topt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"]) == [0, 1, 2]
    for i, entry in theirs["state"].items():
        assert rel_err(ours["state"][i]["momentum_buffer"], entry["momentum_buffer"].numpy()) < 1e-5
    _, fresh = make("sgd", groups=groups, seed=5)
    fresh.load_state_dict({"state": {i: {k: v.numpy() for k, v in e.items()} for i, e in theirs["state"].items()},
                           "param_groups": theirs["param_groups"]})
    assert sorted(fresh.state_dict()["state"]) == [0, 1, 2]
    topt.load_state_dict({"state": {i: {k: torch.from_numpy(v) for k, v in e.items()}
                                    for i, e in ours["state"].items()},
                          "param_groups": ours["param_groups"]})
    for x, y in batches(8, 2, seed=9):
        step(fresh.model, fresh, topt, x, y)
        got = fresh.model.state_dict()
        for k, t in tensors.items():
            assert rel_err(got[k], t.detach().numpy()) < 1e-6, k


def test_adam_state_of_a_group_without_amsgrad_is_torchs_both_ways():
    """torch keeps max_exp_avg_sq for the tensors of groups with amsgrad only: the state_dict here
    has it where torch's has it, a torch state_dict loads (the others' maximum not started), and
    with the state loaded each way the next steps agree; amsgrad turned off keeps the maximum in
    the state, as torch's. A maximum given negative is refused, and changes nothing."""
    torch = pytest.importorskip("torch")
    groups = [{"params": WEIGHTS, "amsgrad": True}, {"params": BIASES, "lr": 5e-3}]
    model, opt = make("adam", groups=groups)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in model.state_dict().items()}
    topt = torch.optim.Adam([{**g, "params": [tensors[k] for k in g["params"]]} for g in groups], lr=1e-3,
                            weight_decay=0.1)

    def step(m, o, t, x, y):
        step_with_torch(tensors, m, o, t, x, y)
        got = m.state_dict()
        for k, v in tensors.items():
            assert rel_err(got[k], v.detach().numpy()) < 1e-6, k

    def same_state(ours, theirs):
        assert {i: sorted(e) for i, e in ours["state"].items()} == {i: sorted(e) for i, e in theirs["state"].items()}
        for i, entry in theirs["state"].items():
            for name, value in entry.items():
                if name != "step":
                    assert rel_err(ours["state"][i][name], value.numpy()) < 1e-5, (i, name)

    for x, y in batches(8, 3):
        step(model, opt, topt, x, y)
    ours, theirs = opt.state_dict(), topt.state_dict()
    assert ["max_exp_avg_sq" in e for _, e in sorted(ours["state"].items())] == [True] * 3 + [False] * 3
    same_state(ours, theirs)
    _, fresh = make("adam", groups=[{"params": WEIGHTS}, {"params": BIASES}], seed=5)
    fresh.load_state_dict({"state": {i: {k: v.numpy() for k, v in e.items()} for i, e in theirs["state"].items()},
                           "param_groups": theirs["param_groups"]})
    assert [g["amsgrad"] for g in fresh.param_groups] == [True, False]
    same_state(fresh.state_dict(), theirs)
    bad = {"state": {i: dict(e) for i, e in ours["state"].items()}, "param_groups": ours["param_groups"]}
    bad["state"][1]["max_exp_avg_sq"] = -bad["state"][1]["max_exp_avg_sq"] - 1.0
    before = fresh.state_dict()
    with pytest.raises(ValueError, match="max_exp_avg_sq must be >= 0"):
        fresh.load_state_dict(bad)
    same_state(fresh.state_dict(), topt.state_dict())
    assert fresh.state_dict()["param_groups"] == before["param_groups"]
    topt.load_state_dict({"state": {i: {k: torch.from_numpy(np.asarray(v)) if k != "step" else torch.tensor(v)
                                        for k, v in e.items()} for i, e in ours["state"].items()},
                          "param_groups": ours["param_groups"]})
    for i, (x, y) in enumerate(batches(8, 4, seed=9)):
        if i == 2:  # turned off: the maximum stays in both states, and the steps go on without it
            fresh.param_groups[0]["amsgrad"] = topt.param_groups[0]["amsgrad"] = False
        step(fresh.model, fresh, topt, x, y)
    same_state(fresh.state_dict(), topt.state_dict())


def test_amsgrad_turned_on_for_a_group_later_starts_its_maximum_there():
    """torch has no maximum for a group that turns amsgrad on after its first step (its step then
    fails); here it starts at that step, from that step's exp_avg_sq as from zeros (the float64
    reference), while the other group's goes on from where it was, in the hand loop and in fit."""
    groups = [{"params": WEIGHTS, "amsgrad": True}, {"params": BIASES, "lr": 5e-3}]
    model, opt = make("adam", groups=groups)
    params = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    refs = [(g["params"], reference_of("adam", g, opt.defaults)) for g in groups]
    for i, (x, y) in enumerate(batches(8, 8)):
        if i == 4:
            opt.param_groups[1]["amsgrad"] = refs[1][1].amsgrad = True
            assert "max_exp_avg_sq" not in opt.state_dict()["state"][3]
        step_with_references(model, opt, refs, params, x, y)
    got = model.state_dict()
    for k in params:
        assert rel_err(got[k], params[k]) < 2e-6, k
    state = opt.state_dict()["state"]
    names = WEIGHTS + BIASES
    for i, name in enumerate(names):
        ref = refs[0][1] if name in WEIGHTS else refs[1][1]
        assert rel_err(state[i]["max_exp_avg_sq"], ref.max_exp_avg_sq[name]) < 1e-5, name
    x, y = batches(64, 1, seed=3)[0]
    runs = []
    for by_fit in (True, False):
        model, opt = make("adam", groups=[dict(g) for g in groups])
        trainer = cmlp.Trainer(model, opt, batch_size=8, shuffle=False)
        trainer.fit(x[:32], y[:32], epochs=1, progress=False) if by_fit else \
            [trainer.step(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
        opt.param_groups[1]["amsgrad"] = True
        trainer.fit(x[32:], y[32:], epochs=1, progress=False) if by_fit else \
            [trainer.step(x[i:i + 8], y[i:i + 8]) for i in range(32, 64, 8)]
        runs.append((model._c.get_params(), opt.state_dict()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for i, entry in runs[1][1]["state"].items():
        assert sorted(runs[0][1]["state"][i]) == sorted(entry)
        for name, value in entry.items():
            np.testing.assert_array_equal(runs[0][1]["state"][i][name], value)


@pytest.mark.parametrize("amp", [None, "fp16"])
@pytest.mark.parametrize("bounds", [([0.0, 0.0], [0.0, 0.9]), ([0.0, 0.9], [0.0, 0.0]), ([0.5, 0.0], [0.9, 0.8])])
def test_sgd_momentum_that_starts_within_a_call_starts_from_the_gradient(bounds, amp):
    """A group whose momentum a per-step schedule turns on within a call into the C loop (when no
    group has momentum as the call is made, or after another group's buffer has started): its
    buffer starts from the gradient at its first step with momentum (torch's rule, which the
    dampening would tell apart), fit equals the hand loop to the bit, and the hand loop follows the
    float64 reference. 480 steps of batch 1 make a first call of 2 steps: its groups hold no
    momentum after it (the schedule's third step), and its steps have some."""
    groups = [{"params": WEIGHTS}, {"params": BIASES, "dampening": 0.3}]
    x, y = batches(480, 1)[0]

    def made():
        model = cmlp.MLP(SIZES, seed=1)
        opt = cmlp.optim.SGD(model, lr=0.01, param_groups=[dict(g) for g in groups])
        s = S.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2, base_momentum=bounds[0],
                       max_momentum=bounds[1])
        return model, opt, s

    runs = []
    for by_fit in (True, False):
        model, opt, s = made()
        scaler = cmlp.amp.GradScaler(init_scale=2.0**12) if amp else None
        trainer = cmlp.Trainer(model, opt, batch_size=1, shuffle=False, amp=amp, scaler=scaler)
        if by_fit:
            trainer._c = _Calls(trainer._c)
            trainer.fit(x, y, epochs=1, progress=False, scheduler=s, scheduler_interval="step")
            assert trainer._c.asked[0] == 2 and trainer._c.with_momenta > 0
        else:
            for i in range(len(x)):
                trainer.step(x[i:i + 1], y[i:i + 1])
                s.step()
        runs.append(model._c.get_params())
    np.testing.assert_array_equal(runs[0], runs[1])
    if amp:
        return
    model, opt, s = made()
    params = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    refs = [(g["params"], RefSGD(0.0, dampening=g.get("dampening", 0.0))) for g in groups]
    for i in range(len(x)):
        for (names, ref), group in zip(refs, opt.param_groups):
            ref.lr, ref.momentum = group["lr"], group["momentum"]
        step_with_references(model, opt, refs, params, x[i:i + 1], y[i:i + 1])
        s.step()
    got = model.state_dict()
    for k in params:
        assert rel_err(got[k], params[k]) < 1e-5, k


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_settings_changed_between_a_schedules_steps_are_the_ones_the_next_step_takes(kind, grouped):
    """A schedule's step moves only the base rate while the groups' other settings stay as they
    were; set between its steps (weight decay, momentum, eps, one group's rate alone), they are the
    settings of the next optimizer step, as torch's."""
    torch = pytest.importorskip("torch")
    model, opt = make(kind, groups=GROUPS if grouped else None)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in model.state_dict().items()}
    tgroups = [{**g, "params": [tensors[k] for k in g["params"]]} for g in GROUPS] if grouped else \
        list(tensors.values())
    if kind == "sgd":
        topt = torch.optim.SGD(tgroups, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    else:
        topt = torch.optim.Adam(tgroups, lr=1e-3, weight_decay=0.1)
    sched = S.CosineAnnealingLR(opt, T_max=7, eta_min=1e-3)
    tsched = torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=7, eta_min=1e-3)
    last = len(topt.param_groups) - 1
    changes = {3: (last, "weight_decay", 0.02), 6: (0, "momentum", 0.5) if kind == "sgd" else (0, "betas", (0.7, 0.9)),
               9: (0, "lr", 2e-3), 12: (last, "weight_decay", 0.0) if kind == "sgd" else (last, "eps", 1e-4)}
    for i, (x, y) in enumerate(batches(8, 16)):
        if i in changes:
            g, key, value = changes[i]
            for groups in (opt.param_groups, topt.param_groups):
                groups[g][key] = value
        step_with_torch(tensors, model, opt, topt, x, y)
        sched.step()
        tsched.step()
        assert sched.get_last_lr() == tsched.get_last_lr() == [g["lr"] for g in opt.param_groups], i
        got = model.state_dict()
        for k, t in tensors.items():
            assert rel_err(got[k], t.detach().numpy()) < 1e-6, (i, k)


def test_a_group_refuses_clear_whole_and_a_state_dict_with_unhashable_ids_by_name():
    """clear() would empty a dict; a group keeps its params and settings, so it refuses at once
    (not after removing some keys). A loaded group's params are the ids of its parameters: a
    list there is refused as such, and nothing changes."""
    model = cmlp.MLP([4, 8, 3], seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    group = opt.param_groups[0]
    group["note"] = "mine"
    before = dict(group)
    with pytest.raises(KeyError, match="cannot be cleared"):
        group.clear()
    assert dict(group) == before
    model.forward_backward(np.ones((2, 4), np.float32), np.array([0, 1]))
    opt.step()
    sd = opt.state_dict()
    bad = {**sd, "param_groups": [{**sd["param_groups"][0], "params": [[0], [1], [2], [3]]}]}
    with pytest.raises(ValueError, match=r"param group 0 must list its parameters' ids.*got \[0\]"):
        opt.load_state_dict(bad)
    assert np.array_equal(opt.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])


def test_groups_outlive_their_optimizer_with_the_settings_it_ended_with():
    """A torch group is a dict that outlives its optimizer (a list of param_groups a logger
    kept); here it keeps the settings the optimizer ended with, to be read, and refuses a new
    one, which has no optimizer to apply to. The optimizer (and its state) is freed at once."""
    model = cmlp.MLP([4, 8, 3], seed=0)
    opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
    groups = opt.param_groups
    groups[0]["lr"] = 0.05
    groups[0]["note"] = "mine"
    expected = dict(groups[0])
    ref = weakref.ref(opt)
    del opt
    assert ref() is None
    assert dict(groups[0]) == expected and groups[0]["lr"] == 0.05 and repr(groups[0])
    with pytest.raises(ReferenceError, match="can be read, not changed"):
        groups[0]["lr"] = 0.2
    assert cmlp.optim.Adam(model, lr=1e-3).param_groups[0]["lr"] == 1e-3  # a temporary optimizer's too


def test_two_threads_setting_their_own_groups_both_take_and_the_steps_are_a_twins():
    # each group's value was set by rebuilding the list of every group's from the optimizer's and
    # pushing it, without a lock: a thread setting group 1 while another set group 0 lost its
    # writes, and the C configuration could keep settings the groups no longer held (a twin made
    # from the state_dict then stepped otherwise). Torch's groups are dicts of their own.
    import sys
    import threading
    model = cmlp.MLP([8, 6, 5, 3], seed=1)
    opt = cmlp.optim.Adam(model, lr=0.01, param_groups=[{"params": [0, 1]}, {"params": [2, 3]}, {"params": [4, 5]}])
    last = {}

    def setter(i):
        r = np.random.default_rng(i)
        for j in range(3000):
            lr, beta1, wd = float(r.uniform(1e-4, 1e-2)), float(r.uniform(0.0, 0.9)), float(r.uniform(0, 1e-2))
            group = opt.param_groups[i]
            group["lr"], group["betas"], group["weight_decay"] = lr, (beta1, 0.999), wd
            last[i] = (lr, (beta1, 0.999), wd)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=setter, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups] == [last[i] for i in range(3)]
    twin_model = copy.deepcopy(model)
    twin = cmlp.optim.Adam(twin_model, lr=0.01, param_groups=[{"params": [0, 1]}, {"params": [2, 3]},
                                                              {"params": [4, 5]}])
    twin.load_state_dict(opt.state_dict())
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    y = np.arange(16) % 3
    for m, o in ((model, opt), (twin_model, twin)):
        for _ in range(3):
            m.zero_grad()
            m.forward_backward(x, y)
            o.step()
    assert np.array_equal(model._c.get_params(), twin_model._c.get_params())
