"""Bad input raises the documented exception (ValueError or TypeError, with a message that
names the argument or the problem), loses nothing (parameters, gradients and optimizer state
are unchanged and the model keeps working), and never crashes the interpreter. The positive
side: every array layout and dtype the API allows is accepted, gives the same result as the
C-contiguous float32 equivalent, and is never modified.
"""

import gc
import itertools
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import cmlp

F, H, C = 20, 16, 5
SIZES = [F, H, C]
N = 24
# where this process imported cmlp from (an in-place build or site-packages): subprocesses use the same
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))


def data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, F)).astype(np.float32)
    y = (np.arange(n) % C).astype(np.int64)
    return x, y


class Ctx:
    """A model that has done one optimizer step (so Adam has state) and holds a gradient."""

    def __init__(self):
        self.model = cmlp.MLP(SIZES, seed=1)
        self.opt = cmlp.optim.Adam(self.model, lr=1e-2)
        self.trainer = cmlp.Trainer(self.model, self.opt, batch_size=8, shuffle=True, seed=0)
        self.x, self.y = data()
        self.trainer.step(self.x, self.y)
        self.model.forward_backward(self.x, self.y)


@pytest.fixture
def ctx():
    return Ctx()


def snapshot(c):
    opt = c.opt.state_dict()["state"]
    return (c.model.state_dict(), c.model.grads(),
            {i: {k: np.array(v, copy=True) for k, v in e.items()} for i, e in opt.items()})


def assert_same_state(before, after):
    params0, grads0, opt0 = before
    params1, grads1, opt1 = after
    for k in params0:
        np.testing.assert_array_equal(params1[k], params0[k], err_msg=f"parameter {k} changed")
        np.testing.assert_array_equal(grads1[k], grads0[k], err_msg=f"gradient {k} changed")
    assert opt1.keys() == opt0.keys()
    for i in opt0:
        for k in opt0[i]:
            np.testing.assert_array_equal(opt1[i][k], opt0[i][k], err_msg=f"optimizer state {i}.{k} changed")


def assert_still_works(c):
    logits = c.model(c.x)
    assert logits.shape == (N, C) and np.isfinite(logits).all()
    assert np.isfinite(c.model.forward_backward(c.x, c.y))
    before = c.model.state_dict()
    assert np.isfinite(c.trainer.step(c.x, c.y))
    assert any(not np.array_equal(v, before[k]) for k, v in c.model.state_dict().items())


def X(shape, dtype=np.float32, fill=0.25):
    return np.full(shape, fill, dtype=dtype)


def with_value(value, dtype=np.float32, row=N - 1, col=F - 1):
    x, _ = data()
    x = x.astype(dtype)
    x[row, col] = value
    return x


def fit(c, x, y, **kw):
    return c.trainer.fit(x, y, epochs=1, progress=False, **kw)


Y = (np.arange(N) % C).astype(np.int64)
# every entry point that takes x (and y): (name, call(ctx, x, y))
ENTRY_X = [
    ("forward", lambda c, x, y: c.model(x)),
    ("predict", lambda c, x, y: c.model.predict(x)),
    ("forward_backward", lambda c, x, y: c.model.forward_backward(x, y)),
    ("evaluate", lambda c, x, y: c.model.evaluate(x, y)),
    ("trainer.step", lambda c, x, y: c.trainer.step(x, y)),
    ("trainer.fit", lambda c, x, y: fit(c, x, y)),
]
ENTRY_XY = [e for e in ENTRY_X if e[0] not in ("forward", "predict")]


def _cases():
    cases = []
    add = lambda name, call, exc, match: cases.append(pytest.param(call, exc, match, id=name))  # noqa: E731

    for ep, call in ENTRY_X:
        add(f"{ep}-features+1", lambda c, f=call: f(c, X((N, F + 1)), Y), ValueError, r"x has 21 features.*expects 20")
        add(f"{ep}-features-1", lambda c, f=call: f(c, X((N, F - 1)), Y), ValueError, r"x has 19 features.*expects 20")
        add(f"{ep}-1d", lambda c, f=call: f(c, X((F,)), Y[:1]), ValueError, r"x must be 2-D")
        add(f"{ep}-3d", lambda c, f=call: f(c, X((N, F, 2)), Y), ValueError, r"x must be 2-D")
        add(f"{ep}-0d", lambda c, f=call: f(c, np.float32(1.0), Y[:1]), ValueError, r"x must be 2-D")
        add(f"{ep}-empty", lambda c, f=call: f(c, X((0, F)), Y[:0]), ValueError, r"x is empty")
        add(f"{ep}-nan", lambda c, f=call: f(c, with_value(np.nan), Y), ValueError, r"NaN or inf")
        add(f"{ep}-inf", lambda c, f=call: f(c, with_value(np.inf), Y), ValueError, r"NaN or inf")
        add(f"{ep}-neginf", lambda c, f=call: f(c, with_value(-np.inf, row=0, col=0), Y), ValueError, r"NaN or inf")
        add(f"{ep}-nan-float64", lambda c, f=call: f(c, with_value(np.nan, np.float64), Y), ValueError, r"NaN or inf")
        add(f"{ep}-inf-float16", lambda c, f=call: f(c, with_value(np.inf, np.float16), Y), ValueError, r"NaN or inf")
        for dt in (bool, object, complex, np.int32, np.int8, np.uint16):
            add(f"{ep}-dtype-{np.dtype(dt).name}", lambda c, f=call, dt=dt: f(c, X((N, F), dt, 0), Y), TypeError,
                r"x must be a floating-point array or uint8.*dtype")
        add(f"{ep}-dtype-str", lambda c, f=call: f(c, np.full((N, F), "a"), Y), TypeError, r"x must be .*dtype")

    x0 = data()[0]
    for ep, call in ENTRY_XY:
        bad_neg, bad_c = Y.copy(), Y.copy()
        bad_neg[5], bad_c[7] = -1, C
        add(f"{ep}-label-negative", lambda c, f=call, y=bad_neg: f(c, x0, y), ValueError,
            r"y holds label -1, outside \[0, 5\)")
        add(f"{ep}-label-eq-classes", lambda c, f=call, y=bad_c: f(c, x0, y), ValueError,
            r"y holds label 5, outside \[0, 5\)")
        add(f"{ep}-label-float", lambda c, f=call: f(c, x0, Y.astype(np.float32)), TypeError, r"y must hold integer")
        add(f"{ep}-label-bool", lambda c, f=call: f(c, x0, Y > 2), TypeError, r"y must hold integer")
        add(f"{ep}-label-count", lambda c, f=call: f(c, x0, Y[:-1]), ValueError, r"y has 23 labels for 24 samples")
        add(f"{ep}-label-2d", lambda c, f=call: f(c, x0, Y[:, None]), ValueError, r"y must be 1-D")

    for dev in ("gpu", "cuda:x", "cpu:1", "", "CPU", "cuda:-1"):
        add(f"device-{dev!r}", lambda c, d=dev: cmlp.MLP(SIZES, device=d), ValueError, r"unknown device")
        add(f"to-{dev!r}", lambda c, d=dev: c.model.to(d), ValueError, r"unknown device")
        add(f"memory-{dev!r}", lambda c, d=dev: cmlp.memory.memory_allocated(d), ValueError, r"unknown device")
    add("device-int", lambda c: cmlp.MLP(SIZES, device=3.5), TypeError, r"device must be a str")
    add("to-int", lambda c: c.model.to(3.5), TypeError, r"device must be a str|unknown device")
    add("memory-device-float", lambda c: cmlp.memory.memory_allocated(3.0), TypeError, r"device must be a str")
    add("memory-device-negative", lambda c: cmlp.memory.memory_allocated(-1), ValueError, r"Invalid device argument -1")
    add("cuda-memory-device-negative", lambda c: cmlp.cuda.memory_stats(-1), ValueError, r"Invalid device argument -1")
    add("memory-snapshot-pool", lambda c: cmlp.memory.memory_snapshot("cpu", mempool_id=(1, 2)), ValueError,
        r"mempool_id must be None or \(0, 0\)")

    for name, sizes, exc in [("empty", [], ValueError), ("one", [784], ValueError), ("zero", [784, 0, 10], ValueError),
                             ("negative", [784, -1, 10], ValueError), ("float", [784, 2.5, 10], TypeError),
                             ("bool", [784, True, 10], TypeError), ("str", "784", TypeError),
                             ("none", None, TypeError), ("int", 784, TypeError)]:
        add(f"layer_sizes-{name}", lambda c, s=sizes: cmlp.MLP(s), exc, r"layer")
    add("seed-negative", lambda c: cmlp.MLP(SIZES, seed=-1), ValueError, r"seed")
    for name, seed in [("none", None), ("float", 1.5), ("str", "0"), ("bool", True)]:
        add(f"seed-{name}", lambda c, s=seed: cmlp.MLP(SIZES, seed=s), TypeError, r"seed must be an int")

    Adam, SGD = cmlp.optim.Adam, cmlp.optim.SGD
    for name, make, exc, match in [
        ("adam-lr-negative", lambda m: Adam(m, lr=-1e-3), ValueError, r"learning rate"),
        # any negative or NaN learning rate, however far from the default
        ("adam-lr-nan", lambda m: Adam(m, lr=float("nan")), ValueError, r"learning rate"),
        ("adam-lr-minus-one", lambda m: Adam(m, lr=-1.0), ValueError, r"learning rate"),
        ("adam-lr-minus-inf", lambda m: Adam(m, lr=float("-inf")), ValueError, r"learning rate"),
        ("sgd-lr-nan", lambda m: SGD(m, lr=float("nan")), ValueError, r"learning rate"),
        ("sgd-lr-minus-one", lambda m: SGD(m, lr=-1.0), ValueError, r"learning rate"),
        ("adam-lr-inf", lambda m: Adam(m, lr=float("inf")), ValueError, r"learning rate"),
        ("adam-lr-str", lambda m: Adam(m, lr="0.1"), TypeError, r"lr must be a number"),
        ("adam-eps-negative", lambda m: Adam(m, eps=-1e-8), ValueError, r"epsilon"),
        ("adam-beta1-one", lambda m: Adam(m, betas=(1.0, 0.999)), ValueError, r"beta parameter at index 0"),
        ("adam-beta1-negative", lambda m: Adam(m, betas=(-0.1, 0.999)), ValueError, r"beta parameter at index 0"),
        ("adam-beta2-one", lambda m: Adam(m, betas=(0.9, 1.0)), ValueError, r"beta parameter at index 1"),
        ("adam-betas-scalar", lambda m: Adam(m, betas=0.9), TypeError, r"betas"),
        ("adam-betas-triple", lambda m: Adam(m, betas=(0.9, 0.99, 0.999)), TypeError, r"betas"),
        ("adam-betas-set", lambda m: Adam(m, betas={0.9, 0.99}), TypeError, r"betas"),  # no order
        ("adam-betas-iterator", lambda m: Adam(m, betas=iter((0.9, 0.99))), TypeError, r"betas"),
        ("adam-betas-dict", lambda m: Adam(m, betas={0: 0.9, 1: 0.99}), TypeError, r"betas"),
        ("adam-weight_decay-negative", lambda m: Adam(m, weight_decay=-0.1), ValueError, r"weight_decay"),
        ("adam-not-a-model", lambda m: Adam(object()), TypeError, r"cmlp.MLP"),
        ("sgd-lr-negative", lambda m: SGD(m, lr=-0.1), ValueError, r"learning rate"),
        ("sgd-momentum-negative", lambda m: SGD(m, momentum=-0.9), ValueError, r"momentum"),
        ("sgd-weight_decay-negative", lambda m: SGD(m, weight_decay=-1.0), ValueError, r"weight_decay"),
        ("sgd-nesterov-no-momentum", lambda m: SGD(m, nesterov=True), ValueError, r"Nesterov"),
        ("sgd-nesterov-dampening", lambda m: SGD(m, momentum=0.9, dampening=0.1, nesterov=True), ValueError,
         r"Nesterov"),
        ("sgd-dampening-nan", lambda m: SGD(m, dampening=float("nan")), ValueError, r"dampening"),
    ]:
        add(name, lambda c, mk=make: mk(c.model), exc, match)

    def set_lr(c, v):
        c.opt.lr = v
    add("opt-lr-set-negative", lambda c: set_lr(c, -1.0), ValueError, r"learning rate")
    add("opt-lr-set-str", lambda c: set_lr(c, "1e-3"), TypeError, r"lr must be a number")

    T = cmlp.Trainer
    for name, make, exc, match in [
        ("trainer-batch_size-0", lambda c: T(c.model, c.opt, batch_size=0), ValueError, r"batch_size"),
        ("trainer-batch_size-negative", lambda c: T(c.model, c.opt, batch_size=-4), ValueError, r"batch_size"),
        ("trainer-accumulation_steps-0", lambda c: T(c.model, c.opt, accumulation_steps=0), ValueError,
         r"accumulation_steps"),
        ("trainer-other-model", lambda c: T(cmlp.MLP(SIZES), c.opt), ValueError, r"another model"),
        ("trainer-not-optimizer", lambda c: T(c.model, object()), TypeError, r"optimizer"),
        ("trainer-not-model", lambda c: T(object(), c.opt), TypeError, r"model"),
        ("trainer-seed-negative", lambda c: T(c.model, c.opt, seed=-1), ValueError, r"seed"),
        ("trainer-seed-none", lambda c: T(c.model, c.opt, seed=None), TypeError, r"seed must be an int"),
        ("trainer-normalize-std-0", lambda c: T(c.model, c.opt, normalize=(0.5, 0.0)), ValueError, r"normalize"),
        ("trainer-normalize-scalar", lambda c: T(c.model, c.opt, normalize=0.5), TypeError, r"normalize"),
        ("trainer-normalize-text", lambda c: T(c.model, c.opt, normalize="12"), TypeError, r"normalize"),
        ("mlp-normalize-bytes", lambda c: cmlp.MLP(SIZES, normalize=b"\x01\x02"), TypeError, r"normalize"),
        ("mlp-normalize-bool", lambda c: cmlp.MLP(SIZES, normalize=(True, 2)), TypeError, r"normalize"),
        ("mlp-normalize-three", lambda c: cmlp.MLP(SIZES, normalize=(0.5, 0.5, 0.5)), TypeError, r"normalize"),
        ("mlp-normalize-overflow", lambda c: cmlp.MLP(SIZES, normalize=(10**400, 1.0)), ValueError, r"normalize"),
        ("mlp-normalize-no-repr", lambda c: cmlp.MLP(SIZES, normalize=(10**5000, 1.0)), ValueError,
         r"normalize must be finite in float32, got an int of 16610 bits"),
        ("mlp-normalize-endless", lambda c: cmlp.MLP(SIZES, normalize=itertools.count()), TypeError, r"normalize"),
        # endless iterators where a list is read: refused once they run past what could be valid
        ("mlp-sizes-endless", lambda c: cmlp.MLP(itertools.count(1)), ValueError, r"at most 65 layer sizes"),
        ("mlp-sizes-66", lambda c: cmlp.MLP([4] * 66), ValueError, r"at most 65 layer sizes are supported, got 66"),
        ("configure-divisions-endless",
         lambda c: cmlp.memory.configure({"roundup_power2_divisions": itertools.repeat(4)}), ValueError,
         r"roundup_power2_divisions must be an int or 16 ints"),
        ("history-skip-endless",
         lambda c: cmlp.memory._record_memory_history("all", skip_actions=itertools.repeat("alloc")), TypeError,
         r"skip_actions must be a list"),
        # set on the model: checked as the constructor's (a bad pair made every forward and load fail)
        ("mlp-normalize-set-three", lambda c: setattr(c.model, "normalize", (0.5, 0.5, 0.5)), TypeError,
         r"normalize must be a pair"),
        ("mlp-normalize-set-none", lambda c: setattr(c.model, "normalize", None), TypeError, r"normalize"),
        ("mlp-normalize-set-std-0", lambda c: setattr(c.model, "normalize", (0.5, 0)), ValueError, r"normalize"),
        ("fit-epochs-0", lambda c: c.trainer.fit(c.x, c.y, epochs=0, progress=False), ValueError, r"epochs"),
        ("fit-validation-not-pair", lambda c: c.trainer.fit(c.x, c.y, validation_data=c.x[:3], progress=False),
         TypeError, r"validation_data"),
        ("fit-validation-features",
         lambda c: c.trainer.fit(c.x, c.y, validation_data=(X((4, F + 2)), Y[:4]), progress=False),
         ValueError, r"validation x has 22 features"),
        ("fit-validation-labels", lambda c: c.trainer.fit(c.x, c.y, validation_data=(c.x, Y + C), progress=False),
         ValueError, r"validation y holds label"),
        ("evaluate-batch_size-0", lambda c: c.model.evaluate(c.x, c.y, batch_size=0), ValueError, r"batch_size"),
        ("forward_backward-loss_scale-nan", lambda c: c.model.forward_backward(c.x, c.y, loss_scale=float("nan")),
         ValueError, r"loss_scale"),
        ("forward_backward-amp-unknown", lambda c: c.model.forward_backward(c.x, c.y, amp="fp8"), ValueError, r"amp"),
        ("load_state_dict-not-mapping", lambda c: c.model.load_state_dict([1, 2]), TypeError, r"state_dict"),
        # sizes beyond int64 arithmetic: refused, not wrapped into a small or negative step
        ("trainer-effective-batch-overflows", lambda c: T(c.model, c.opt, batch_size=2**32, accumulation_steps=2**32),
         ValueError, r"batch_size \* accumulation_steps must be at most 2\*\*62"),
        ("trainer-effective-batch-2**63", lambda c: T(c.model, c.opt, batch_size=2**62, accumulation_steps=2),
         ValueError, r"at most 2\*\*62"),
        ("trainer-batch-2**64", lambda c: T(c.model, c.opt, batch_size=2**64), ValueError, r"batch_size must be"),
        ("trainer-microbatch-2**63", lambda c: setattr(c.trainer, "microbatch_size", 2**63), ValueError,
         r"microbatch_size must be"),
        ("trainer-seed-2**64", lambda c: T(c.model, c.opt, seed=2**64), ValueError, r"seed must be an int in"),
        ("mlp-seed-2**64", lambda c: cmlp.MLP(SIZES, seed=2**64), ValueError, r"seed must be an int in"),
        ("mlp-size-2**31", lambda c: cmlp.MLP([2**31, 10]), ValueError, r"layer_sizes\[0\] = 2147483648"),
        ("mlp-size-2**70", lambda c: cmlp.MLP([20, 2**70]), ValueError, r"layer_sizes\[1\] = 1180591620717411303424"),
        ("plan-batch-overflows", lambda c: cmlp.memory.plan([784, 512, 10], 2**62), ValueError,
         r"batch_size 4611686018427387904 is too large to plan"),
        ("plan-batch-2**63", lambda c: cmlp.memory.plan([784, 10], 2**63), ValueError, r"batch_size must be"),
        ("evaluate-batch-2**63", lambda c: c.model.evaluate(c.x, c.y, batch_size=2**63), ValueError,
         r"batch_size must be"),
        # text after a NUL would be dropped by C
        ("mlp-device-nul", lambda c: cmlp.MLP(SIZES, device="cpu\x00junk"), ValueError, r"NUL"),
        ("to-device-nul", lambda c: c.model.to("cpu\x00"), ValueError, r"NUL"),
        # uint8 pixels must map to finite float32 values
        ("mlp-normalize-tiny-std", lambda c: cmlp.MLP(SIZES, normalize=(0.5, 1e-40)), ValueError,
         r"outside float32's range"),
        ("trainer-normalize-tiny-std", lambda c: T(c.model, c.opt, normalize=(0.5, 1e-39)), ValueError,
         r"outside float32's range"),
        ("mlp-normalize-huge-mean", lambda c: cmlp.MLP(SIZES, normalize=(1e39, 1.0)), ValueError, r"float32"),
        # the loss scaler's counters are int32, as in PyTorch
        ("scaler-growth_interval-2**31", lambda c: cmlp.amp.GradScaler(growth_interval=2**31), ValueError,
         r"growth_interval must be in \[1, 2\*\*31 - 1\]"),
        # optimizer settings the float32 update cannot use
        ("adam-lr-beyond-float32", lambda c: cmlp.optim.Adam(c.model, lr=1e39), ValueError,
         r"finite in float32"),
        ("adam-lr-huge-int", lambda c: cmlp.optim.Adam(c.model, lr=10**400), ValueError, r"lr must be finite"),
        ("adam-weight_decay-inf", lambda c: cmlp.optim.Adam(c.model, weight_decay=float("inf")), ValueError,
         r"weight_decay"),
        ("adam-eps-inf", lambda c: cmlp.optim.Adam(c.model, eps=float("inf")), ValueError, r"epsilon"),
        ("sgd-momentum-inf", lambda c: cmlp.optim.SGD(c.model, momentum=float("inf")), ValueError, r"momentum"),
        ("sgd-dampening-beyond-float32", lambda c: cmlp.optim.SGD(c.model, momentum=0.9, dampening=-1e39),
         ValueError, r"dampening"),
        ("adam-set-lr-inf", lambda c: setattr(c.opt, "lr", float("inf")), ValueError, r"learning rate"),
        # switches take a bool (or 0 / 1), not whatever is truthy
        ("trainer-recompute-str", lambda c: T(c.model, c.opt, recompute="no"), TypeError, r"recompute must be a bool"),
        ("trainer-auto_microbatch-nan", lambda c: T(c.model, c.opt, auto_microbatch=float("nan")), TypeError,
         r"auto_microbatch must be a bool"),
        ("trainer-shuffle-none", lambda c: T(c.model, c.opt, shuffle=None), TypeError, r"shuffle must be a bool"),
        ("trainer-shuffle-2", lambda c: T(c.model, c.opt, shuffle=2), TypeError, r"shuffle must be a bool"),
        ("sgd-nesterov-str", lambda c: cmlp.optim.SGD(c.model, momentum=0.9, nesterov="no"), TypeError,
         r"nesterov must be a bool"),
        ("adam-decoupled-list", lambda c: cmlp.optim.Adam(c.model, decoupled_weight_decay=[1]), TypeError,
         r"decoupled_weight_decay must be a bool"),
        ("plan-recompute-str", lambda c: cmlp.memory.plan(SIZES, 4, recompute="no"), TypeError,
         r"recompute must be a bool"),
        ("scaler-enabled-str", lambda c: cmlp.amp.GradScaler(enabled="false"), TypeError, r"enabled must be a bool"),
        ("onecycle-cycle_momentum-none",
         lambda c: cmlp.optim.lr_scheduler.OneCycleLR(c.opt, 0.1, total_steps=10, cycle_momentum=None), TypeError,
         r"cycle_momentum must be a bool"),
    ]:
        add(name, make, exc, match)
    return cases


@pytest.mark.parametrize("call,exc,match", _cases())
def test_bad_input_raises_and_loses_nothing(ctx, call, exc, match):
    before = snapshot(ctx)
    with pytest.raises(exc, match=match):
        call(ctx)
    assert_same_state(before, snapshot(ctx))
    assert_still_works(ctx)



def _adam_state(c):
    return c.opt.state_dict()


def _sgd_dict(c):
    other = cmlp.optim.SGD(cmlp.MLP(SIZES, seed=3), lr=0.5, momentum=0.9)
    other.model.forward_backward(c.x, c.y)
    other.step()
    return other.state_dict()


def _with_state(c, change):
    sd = _adam_state(c)
    change(sd)
    return sd


@pytest.mark.parametrize("make,match", [
    pytest.param(_sgd_dict, r"not from Adam: its param group has \['dampening', 'momentum', 'nesterov'\]", id="sgd-into-adam"),
    pytest.param(lambda c: {"state": {}, "param_groups": 5}, r"param_groups must be a list of dicts",
                 id="groups-int"),
    pytest.param(lambda c: {"state": {}, "param_groups": [[1, 2]]}, r"param_groups must be a list of dicts",
                 id="group-list"),
    pytest.param(lambda c: {"state": [], "param_groups": _adam_state(c)["param_groups"]}, r"'state' must be a dict",
                 id="state-list"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"].update({"0": sd["state"].pop(0)})),
                 r"does not cover every parameter", id="state-keys-mixed"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"].update({1: 7})), r"must be a dict, got int",
                 id="state-entry-int"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][2].update({"momentum_buffer": 0})),
                 r"not from Adam: parameter 2 has state \['momentum_buffer'\]", id="state-foreign-buffer"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][0]["exp_avg_sq"].__setitem__((0, 0), -1.0)),
                 r"exp_avg_sq must be >= 0", id="exp_avg_sq-negative"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][0]["exp_avg_sq"].__setitem__((0, 0), np.nan)),
                 r"exp_avg_sq holds inf or NaN", id="exp_avg_sq-nan"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][3]["exp_avg"].__setitem__(0, np.inf)),
                 r"exp_avg holds inf or NaN", id="exp_avg-inf"),
    pytest.param(lambda c: _with_state(c, lambda sd: [e.update({"step": np.inf}) for e in sd["state"].values()]),
                 r"step must be a whole number >= 0, got inf", id="step-inf"),
    pytest.param(lambda c: _with_state(c, lambda sd: [e.update({"step": 2.5}) for e in sd["state"].values()]),
                 r"step must be a whole number >= 0, got 2.5", id="step-fraction"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][1].pop("exp_avg")),
                 r"exp_avg is given for some parameters only", id="buffer-missing-once"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][1].update({"step": -1.0})),
                 r"step must be a whole number >= 0", id="step-negative"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["state"][1].update({"step": "x"})),
                 r"step must be a number", id="step-str"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["param_groups"][0].update({"lr": float("inf")})),
                 r"learning rate", id="lr-inf"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["param_groups"][0].update({"lr": 0.5, "eps": -1.0})),
                 r"epsilon", id="eps-negative-after-a-good-lr"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["param_groups"][0].update({"decoupled_weight_decay": "yes"})),
                 (TypeError, r"decoupled_weight_decay must be a bool"), id="adamw-flag-not-bool"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["param_groups"][0].update({"amsgrad": "yes"})),
                 (TypeError, r"amsgrad must be a bool"), id="amsgrad-not-bool"),
    pytest.param(lambda c: _with_state(c, lambda sd: sd["param_groups"][0].update({"differentiable": True})),
                 r"differentiable=True is not supported", id="differentiable"),
])
def test_optimizer_load_state_dict_checks_everything_before_it_changes_anything(ctx, make, match):
    bad = make(ctx)
    error, match = match if isinstance(match, tuple) else (ValueError, match)  # a value of the wrong type: TypeError
    before, lr, betas, eps = snapshot(ctx), ctx.opt.lr, ctx.opt.betas, ctx.opt.eps
    with pytest.raises(error, match=match):
        ctx.opt.load_state_dict(bad)
    assert (ctx.opt.lr, ctx.opt.betas, ctx.opt.eps) == (lr, betas, eps)
    assert_same_state(before, snapshot(ctx))
    assert_still_works(ctx)


def test_sgd_load_that_fails_keeps_its_momentum_buffer(ctx):
    sgd = cmlp.optim.SGD(ctx.model, lr=0.1, momentum=0.9)
    ctx.model.forward_backward(ctx.x, ctx.y)
    sgd.step()
    sd = sgd.state_dict()
    before = sgd.state_dict()
    # momentum 0 with a buffer (as torch's state is after OneCycleLR took the momentum to 0): taken
    off = {"state": sd["state"], "param_groups": [{**sd["param_groups"][0], "momentum": 0.0}]}
    sgd.load_state_dict(off)
    assert sgd.momentum == 0.0 and len(sgd.state_dict()["state"][0]) == 1
    sgd.load_state_dict(sd)
    spoiled = {"state": {i: {"momentum_buffer": np.full_like(e["momentum_buffer"], np.nan)}
                         for i, e in sd["state"].items()}, "param_groups": sd["param_groups"]}
    with pytest.raises(ValueError, match=r"momentum_buffer holds inf or NaN"):
        sgd.load_state_dict(spoiled)
    after = sgd.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, e in before["state"].items():
        np.testing.assert_array_equal(after["state"][i]["momentum_buffer"], e["momentum_buffer"])


def test_sgd_refuses_an_adam_state_dict(ctx):
    sgd = cmlp.optim.SGD(ctx.model, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"not from SGD: its param group has \['amsgrad', 'betas', 'eps'\]"):
        sgd.load_state_dict(ctx.opt.state_dict())
    assert sgd.lr == 0.1 and sgd.momentum == 0.9


def test_sgd_state_dict_whose_nesterov_is_not_a_bool_is_refused(ctx):
    opt = cmlp.optim.SGD(ctx.model, momentum=0.9)
    sd = opt.state_dict()
    sd["param_groups"][0]["nesterov"] = "no"  # truthy: it would have turned Nesterov on
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        opt.load_state_dict(sd)
    assert opt.nesterov is False and opt.state_dict() == cmlp.optim.SGD(ctx.model, momentum=0.9).state_dict()


def test_scaler_counters_beyond_int32_are_refused():
    s = cmlp.amp.GradScaler()
    good = s.state_dict()
    for key in ("_growth_tracker", "growth_interval"):
        with pytest.raises(ValueError, match=r"in \[\d, 2\*\*31 - 1\]"):
            s.load_state_dict({**good, key: 2**32 + 1})
    assert s.state_dict() == good


def test_allocator_settings_out_of_range_or_with_nul_are_refused():
    before = cmlp.memory.get_config()
    for text in ("roundup_power2_divisions:2147483648", "roundup_power2_divisions:[256:1099511627776,>:1]",
                 "max_split_size_mb:300\x00garbage"):
        with pytest.raises(ValueError, match=r"roundup_power2_divisions|NUL"):
            cmlp.memory.configure(text)
        assert cmlp.memory.get_config() == before
    cmlp.memory.configure("roundup_power2_divisions:1073741824")  # 2**30: the largest
    try:
        assert cmlp.memory.get_config()["roundup_power2_divisions"] == [2**30] * 16
    finally:
        cmlp.memory.configure(before)


def test_sizes_in_text_and_limits_beyond_int64():
    from cmlp.memory import parse_size

    assert parse_size("1KiB") == 1024 and parse_size("2 gb") == 2 * 1024**3 and parse_size("7B") == 7
    # exactly, not through a float
    assert parse_size("9007199254740993") == 2**53 + 1 and parse_size("18446744073709551615") == 2**64 - 1
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("0.3KB") == 307  # a fraction of a unit rounds down
    with pytest.raises(ValueError, match=r"a number of bytes is a whole number"):
        parse_size("0.5B")
    for text in ("1iB", "1 iB", "1KB B", "MB"):
        with pytest.raises(ValueError, match=r"cannot read .* as a size"):
            parse_size(text)
    cmlp.memory.set_memory_limit(2**70)  # more than anything: accepted, no cap in effect
    try:
        assert cmlp.memory.get_memory_limit() == 2**63 - 1
    finally:
        cmlp.memory.set_memory_limit(None)


def test_raw_blocks_take_ints_only():
    for bad in (None, 1.0, "x"):
        with pytest.raises(TypeError, match=r"ptr must be an int"):
            cmlp.memory.caching_allocator_delete(bad)
    with pytest.raises(ValueError, match=r"nbytes must be in \[0, 2\*\*63\)"):
        cmlp.memory.caching_allocator_alloc(2**63)
    ptr = cmlp.memory.caching_allocator_alloc(512, "cpu")
    cmlp.memory.caching_allocator_delete(mem_ptr=ptr)  # torch's keyword
    with pytest.raises(ValueError, match="already deleted"):
        cmlp.cuda.caching_allocator_delete(mem_ptr=ptr)


def test_save_errors_name_the_callers_path(ctx, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cannot save to '.*nowhere/m.npz'.*directory"):
        ctx.model.save(tmp_path / "nowhere" / "m.npz")
    with pytest.raises(IsADirectoryError, match=r"it is a directory"):
        ctx.model.save(tmp_path)
    assert os.listdir(tmp_path) == []


def test_unaligned_arrays_are_accepted(ctx):
    x, y = data()
    raw = np.zeros(x.nbytes + 1, np.uint8)
    ux = np.frombuffer(raw.data, dtype=np.float32, count=x.size, offset=1).reshape(x.shape)
    raw[1:] = x.view(np.uint8).ravel()
    assert not ux.flags.aligned
    yraw = np.zeros(y.size * 4 + 1, np.uint8)
    yraw[1:] = y.astype(np.int32).view(np.uint8)
    uy = np.frombuffer(yraw.data, dtype=np.int32, offset=1)
    assert not uy.flags.aligned
    np.testing.assert_array_equal(ctx.model(ux), ctx.model(x))
    assert ctx.model.evaluate(ux, uy) == ctx.model.evaluate(x, y)


def test_save_and_load_take_bytes_paths(ctx, tmp_path):
    path = os.fsencode(tmp_path / "m.npz")
    ctx.model.save(path)
    loaded = cmlp.MLP.load(path)
    for k, v in ctx.model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v)


def test_one_trainer_runs_one_call_at_a_time():
    import threading

    m = cmlp.MLP(SIZES, seed=0)
    t = cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=1)
    x, y = data(4000)
    errors = []
    runner = threading.Thread(target=lambda: t.fit(x, y, epochs=3, progress=False))
    runner.start()
    try:
        while t._owner() is None and runner.is_alive():
            pass
        for call in (lambda: t.step(x[:8], y[:8]), lambda: t.fit(x, y, epochs=1, progress=False),
                     lambda: setattr(t, "microbatch_size", 1), t.state_dict):  # (half an epoch's state)
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))
    finally:
        runner.join()
    assert len(errors) == 4 and all("already running fit or step in another thread" in e for e in errors), errors
    assert t.microbatch_size == 1
    assert np.isfinite(t.step(x[:8], y[:8]))  # free again


def test_a_refused_call_names_the_thread_that_had_the_trainer_when_it_was_refused():
    """The owner may give the trainer back between the refusal and its message, leaving the
    refused call's claim first: the message is still of the owner seen (another thread's call),
    not of a call from inside the caller's own fit."""
    import threading

    m = cmlp.MLP(SIZES, seed=0)
    t = cmlp.Trainer(m, cmlp.optim.SGD(m, lr=0.1), batch_size=8)
    other = object()
    t._claims[other] = threading.get_ident() + 1  # another thread's fit has the trainer
    t._owner = lambda: threading.get_ident()  # what a second look would see once it gave it back
    with pytest.raises(RuntimeError, match="already running fit or step in another thread"):
        t.microbatch_size = 4
    del t._owner
    t._claims.pop(other)
    assert t.microbatch_size == 8 and t.state_dict()["microbatch_size"] == 8


def test_a_call_from_inside_fit_says_so():
    m = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(m)
    t = cmlp.Trainer(m, opt, batch_size=8)
    x, y = data(64)
    seen = []

    def rate(epoch):
        if epoch == 1:
            try:
                t.step(x[:8], y[:8])
            except RuntimeError as e:
                seen.append(str(e))
        return 1.0

    t.fit(x, y, epochs=2, progress=False, scheduler=cmlp.optim.lr_scheduler.LambdaLR(opt, rate))
    assert len(seen) == 1 and "called from inside it" in seen[0], seen
    assert np.isfinite(t.step(x[:8], y[:8]))


LABELS_CHANGED_DURING_FIT = textwrap.dedent(r"""
    import threading, time
    import numpy as np
    import cmlp

    rng = np.random.default_rng(0)
    x = rng.standard_normal((20000, 50)).astype(np.float32)
    y = rng.integers(0, 10, 20000).astype(np.int32)
    spoiled = []
    def spoil(labels):
        time.sleep(0.01)
        labels[:] = -5 * 10**8
        spoiled.append(time.perf_counter())
    def run(labels, spoiler):
        m = cmlp.MLP([50, 256, 10], seed=0)
        t = cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=8, seed=1)
        if spoiler:
            spoiler = threading.Thread(target=spoil, args=(labels,))
            spoiler.start()
        h = t.fit(x, labels, epochs=3, progress=False)
        end = time.perf_counter()
        if spoiler:
            spoiler.join()
            assert spoiled[0] < end, "fit ended before the labels were changed"
        return m.state_dict(), h[-1]["loss"]
    ref, loss = run(y.copy(), False)
    got, loss2 = run(y, True)
    assert loss == loss2 and all(np.array_equal(ref[k], got[k]) for k in ref), "training saw the changed labels"
    print("unchanged", loss)
""")


def test_labels_changed_by_another_thread_during_fit_are_not_seen(tmp_path):
    """fit reads the labels with the GIL released: it works on its own checked copy, so a caller
    that changes its array meanwhile changes nothing (before, an out-of-range label read outside
    the logits and crashed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", LABELS_CHANGED_DURING_FIT], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "unchanged" in r.stdout

def test_cpu_0_names_the_cpu_as_in_torch(ctx, tmp_path):
    # torch.device("cpu:0") is the CPU; any other index of it is refused (above)
    m = cmlp.MLP(SIZES, device="cpu:0")
    assert m.device == "cpu"
    assert ctx.model.to("cpu:0").device == "cpu"
    assert cmlp.memory.memory_allocated("cpu:0") == cmlp.memory.memory_allocated("cpu")
    assert cmlp.amp.GradScaler("cpu:0").get_scale() == 65536.0
    path = tmp_path / "m.npz"
    m.save(path)
    assert cmlp.MLP.load(path, device="cpu:0").device == "cpu"
    with pytest.raises(ValueError, match=r"unknown device \"cpu:1\": the CPU's device index is 0"):
        cmlp.MLP(SIZES, device="cpu:1")
    assert_still_works(ctx)


def test_messages_from_the_core_say_what_happened_without_where(ctx):
    """As torch's: the text starts with what happened, not with the C file and line that found it
    (which only a bug's RuntimeError keeps)."""
    with pytest.raises(ValueError) as e:
        cmlp.optim.Adam(ctx.model.parameters(), lr=-1)
    assert str(e.value).startswith("Invalid learning rate: -1")
    with pytest.raises(ValueError) as e:
        cmlp.nn.utils.clip_grad_norm_(ctx.model.parameters(), -1.0)
    assert str(e.value).startswith("max_norm must be a number >= 0, got -1"), str(e.value)
    gc.collect()
    cmlp.memory.empty_cache()
    cmlp.memory.set_memory_limit(cmlp.memory.memory_reserved() + 2**20)
    try:
        with pytest.raises(cmlp.OutOfMemoryError) as e:
            cmlp.MLP([16384, 4096, 10])  # 256 MiB of parameters: more than any block the cache holds
    finally:
        cmlp.memory.set_memory_limit(None)
    assert str(e.value).startswith("cpu out of memory. Tried to allocate "), str(e.value)[:80]
    if not cmlp.cuda.is_available():
        with pytest.raises(RuntimeError) as e:
            cmlp.MLP(SIZES, device="cuda")
        assert str(e.value).startswith("CUDA is not available: "), str(e.value)
    assert_still_works(ctx)


def test_the_extension_checks_again_what_the_python_layer_checks():
    """cmlp._cmlp, under the Python layer, refuses what that layer refuses, so that no call of it
    loses memory or state: a model's block freed as a raw one, arrays in the other byte order,
    seeds and counts past their range, a negative mean of squares."""
    from cmlp import _cmlp

    m = cmlp.MLP([4, 8, 3], seed=0)
    opt = cmlp.optim.Adam(m, lr=0.01)
    before = m._c.get_params().copy()
    params = [b for s in cmlp.memory.memory_snapshot("cpu") for b in s["blocks"]
              if b["state"] == "active_allocated" and b["frames"] and b["frames"][0]["name"] == "parameters"]
    allocated = cmlp.memory.memory_allocated("cpu")
    with pytest.raises(ValueError, match="not a block from caching_allocator_alloc: it stays allocated"):
        _cmlp.free("cpu", params[0]["address"])
    assert cmlp.memory.memory_allocated("cpu") == allocated
    with pytest.raises(TypeError, match="byte order"):
        m._c.forward(np.zeros((2, 4), ">f4"), 0.5, 0.5, 16)
    with pytest.raises(TypeError, match="byte order"):
        m._c.set_params(before.astype(">f4"))
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
            _cmlp.Model((4, 8, 3), "cpu", seed)
    trainer = cmlp.Trainer(m, opt, batch_size=4)
    with pytest.raises(ValueError, match=r"epochs must be in \[0, 2\*\*62\]"):
        trainer._c.epochs = 2**63 - 1
    n = m.num_parameters()
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt._c.set_state(1, [np.zeros(n, np.float32), np.full(n, -1.0, np.float32)])
    for backend in (2**32, -1, 2):
        with pytest.raises((ValueError, OverflowError)):
            _cmlp.dist_init(backend)
    assert not cmlp.distributed.is_initialized()
    assert np.array_equal(m._c.get_params(), before) and opt.state_dict()["state"] == {}
    _cmlp.validate("cpu")


def test_small_arguments_torch_would_refuse_are_refused():
    model = cmlp.MLP([4, 8, 3], seed=0)
    with pytest.raises(TypeError, match="tensors must be"):
        cmlp.nn.utils.get_total_norm(b"x")
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool"):
        cmlp.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite="x")
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool"):
        cmlp.nn.utils.get_total_norm(model, error_if_nonfinite="yes")
    for reader in (cmlp.cuda.memory_allocated, cmlp.cuda.memory_reserved, cmlp.cuda.memory_stats):
        with pytest.raises(ValueError, match="Invalid device index"):
            reader(2**63)


@pytest.mark.skipif(cmlp.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("dev", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_gpu_is_runtime_error_saying_why(ctx, dev):
    with pytest.raises(RuntimeError, match=r"CUDA.*(build|GPU|driver)"):
        cmlp.MLP(SIZES, device=dev)
    before = snapshot(ctx)
    with pytest.raises(RuntimeError, match=r"CUDA"):
        ctx.model.to(dev)
    assert ctx.model.device == "cpu"
    assert_same_state(before, snapshot(ctx))
    assert_still_works(ctx)


def test_nan_in_validation_data_is_rejected_before_training(ctx):
    # checked before the epoch trains, so nothing is applied and lost
    vx = with_value(np.nan, row=3, col=3)
    before = snapshot(ctx)
    with pytest.raises(ValueError, match=r"validation x contains NaN or inf \(first at sample 3, feature 3\)"):
        fit(ctx, ctx.x, ctx.y, validation_data=(vx, ctx.y))
    assert_same_state(before, snapshot(ctx))
    assert_still_works(ctx)


def test_nan_in_a_trainers_x_names_the_argument_and_where(ctx):
    # as every other check of the trainer's arguments names them ("training x", "batch x")
    x = with_value(np.inf, row=2, col=5)
    before = snapshot(ctx)
    for call, what in ((lambda: fit(ctx, x, ctx.y[:len(x)]), "training"), (lambda: ctx.trainer.step(x, Y), "batch")):
        with pytest.raises(ValueError, match=rf"^{what} x contains NaN or inf \(first at sample 2, feature 5\)$"):
            call()
        assert_same_state(before, snapshot(ctx))


def test_float64_that_overflows_float32_is_rejected(ctx):
    """A finite value past float32's range is named as such (it is no NaN or inf of the caller's),
    with the argument; a state_dict's too, by its tensor."""
    x = data()[0].astype(np.float64)
    x[2, 2] = 1e300
    before = snapshot(ctx)
    with pytest.raises(ValueError, match=r"^x holds values outside float32's range.*1e\+300"):
        ctx.model(x)
    with pytest.raises(ValueError, match=r"^training x holds values outside float32's range"):
        fit(ctx, x, ctx.y)
    x[2, 2] = np.inf
    with pytest.raises(ValueError, match=r"NaN or inf"):
        ctx.model(x)
    state = ctx.model.state_dict()
    for value, what in ((1e300, "values outside float32's range"), (np.nan, "NaN or inf")):
        bad = {k: v.astype(np.float64) for k, v in state.items()}
        bad["fc2.bias"][1] = value
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warning from the cast either
            with pytest.raises(ValueError, match=rf"^state_dict\['fc2.bias'\] holds {what}"):
                ctx.model.load_state_dict(bad)
    assert_same_state(before, snapshot(ctx))


def test_ragged_list_is_value_error_naming_the_argument(ctx):
    before = snapshot(ctx)
    with pytest.raises(ValueError, match=r"^x must be a rectangular array"):
        ctx.model([[0.0] * F, [0.0] * (F - 1)])
    with pytest.raises(ValueError, match=r"^y must be a rectangular array, \[N\]"):
        ctx.model.evaluate(data()[0][:2], [[1], [2, 3]])
    bad = dict(ctx.model.state_dict(), **{"fc1.bias": [[0.0], [0.0, 1.0]]})
    with pytest.raises(ValueError, match=r"^state_dict\['fc1.bias'\] must be a rectangular array"):
        ctx.model.load_state_dict(bad)
    assert_same_state(before, snapshot(ctx))
    assert_still_works(ctx)


# ---- model files ----

@pytest.fixture
def saved(tmp_path):
    model = cmlp.MLP(SIZES, seed=5)
    path = tmp_path / "model.npz"
    model.save(path)
    return path, model


def _arrays(model, **change):
    arrays = dict(model.state_dict())
    arrays["__layer_sizes__"] = np.asarray(SIZES, dtype=np.int64)
    arrays.update(change)
    return {k: v for k, v in arrays.items() if v is not None}


@pytest.mark.parametrize("content,match", [
    pytest.param(b"", r"not a readable cmlp model file", id="empty-file"),
    pytest.param(os.urandom(4096), r"not a readable cmlp model file", id="garbage"),
    pytest.param(b"PK\x03\x04" + os.urandom(4096), r"not a readable cmlp model file", id="garbage-zip-magic"),
    pytest.param(b"\x93NUMPY" + os.urandom(200), r"model file", id="garbage-npy-magic"),
])
def test_load_garbage_is_value_error(tmp_path, content, match):
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        cmlp.MLP.load(path)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
def test_load_truncated_is_value_error(saved, fraction):
    path, _ = saved
    raw = path.read_bytes()
    path.write_bytes(raw[:int(len(raw) * fraction)])
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match=r"model\.npz") as refused:
        cmlp.MLP.load(path)
    # the file is closed at once, not when the error (and the traceback it keeps) goes
    assert len(os.listdir("/proc/self/fd")) == fds and refused.value is not None


@pytest.mark.parametrize("change,match", [
    pytest.param({"fc2.bias": None}, r"missing keys \['fc2.bias'\]", id="missing-bias"),
    pytest.param({"fc1.weight": None}, r"missing keys \['fc1.weight'\]", id="missing-weight"),
    pytest.param({"__layer_sizes__": None}, r"__layer_sizes__", id="missing-sizes"),
    pytest.param({"fc3.weight": np.zeros((3, 3), np.float32)}, r"unexpected keys \['fc3.weight'\]", id="extra-key"),
    pytest.param({"fc2.bias": np.zeros(C + 1, np.float32)}, r"fc2.bias.*shape", id="bias-shape"),
    pytest.param({"fc1.weight": np.zeros((F, H), np.float32)}, r"fc1.weight.*shape", id="weight-transposed"),
    pytest.param({"__layer_sizes__": np.asarray([F, H + 1, C])}, r"shape", id="sizes-disagree"),
    pytest.param({"__layer_sizes__": np.asarray([F, -H, C])}, r"layer size", id="sizes-negative"),
    # refused before a model of 2**24 x 2**24 floats is made (a 64 TiB claim in a file of kilobytes)
    pytest.param({"__layer_sizes__": np.asarray([2**24, 2**24])}, r"unexpected keys \['fc2.weight', 'fc2.bias'\]", id="sizes-huge"),
    pytest.param({"__layer_sizes__": np.asarray([2**22, 64, C])}, r"fc1.weight.*shape", id="sizes-large"),
    pytest.param({"__layer_sizes__": np.asarray([[F, H, C]])}, r"1-D integer", id="sizes-2d"),
    pytest.param({"__layer_sizes__": np.asarray([F, H, C], dtype=np.float64)}, r"1-D integer", id="sizes-float"),
    # (NaN and inf load as saved: a model that diverged comes back as it was, test_model_io)
    pytest.param({"fc1.bias": np.full(H, 1e300)}, r"values outside float32's range", id="beyond-float32"),
    pytest.param({"fc1.bias": np.array([None] * H, dtype=object)}, r"model file", id="object-array"),
])
def test_load_bad_contents_is_value_error(tmp_path, change, match):
    model = cmlp.MLP(SIZES, seed=5)
    path = tmp_path / "bad.npz"
    np.savez(path, **_arrays(model, **change))
    with pytest.raises(ValueError, match=match):
        cmlp.MLP.load(path)


def test_load_plain_npy_is_value_error(tmp_path):
    # a valid .npy (one array, not an archive) is a ValueError naming the file
    path = tmp_path / "weights.npy"
    np.save(path, np.zeros(10, np.float32))
    with pytest.raises(ValueError, match=r"weights\.npy"):
        cmlp.MLP.load(path)


def test_load_of_a_fifo_is_value_error_without_waiting_for_a_writer(tmp_path):
    path = tmp_path / "m.npz"
    os.mkfifo(path)
    with pytest.raises(ValueError, match=r"not a regular file"):
        cmlp.MLP.load(path)


def test_load_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.npz"):
        cmlp.MLP.load(tmp_path / "nope.npz")


def test_load_bad_device_is_value_error(saved):
    path, _ = saved
    with pytest.raises(ValueError, match=r"unknown device"):
        cmlp.MLP.load(path, device="gpu")


# ---- accepted layouts and dtypes: same results as C-contiguous float32, inputs untouched ----

def run_everything(x, y):
    """Logits, predictions, evaluate, forward_backward (loss, grads), one trainer step and one
    shuffled epoch (parameters after each), all from the same fresh model."""
    out = {}
    model = cmlp.MLP(SIZES, seed=2)
    out["logits"] = model(x)
    out["predict"] = model.predict(x)
    ev = model.evaluate(x, y, batch_size=7)
    out["eval_loss"], out["eval_acc"] = np.float64(ev["loss"]), np.float64(ev["accuracy"])
    out["fb_loss"] = np.float64(model.forward_backward(x, y))
    for k, v in model.grads().items():
        out[f"grad.{k}"] = v
    opt = cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
    trainer = cmlp.Trainer(model, opt, batch_size=N, shuffle=False)
    out["step_loss"] = np.float64(trainer.step(x, y))
    for k, v in model.state_dict().items():
        out[f"step.{k}"] = v
    trainer2 = cmlp.Trainer(model, opt, batch_size=5, shuffle=True, seed=3)
    out["fit_loss"] = np.float64(trainer2.fit(x, y, epochs=1, progress=False)[0]["loss"])
    for k, v in model.state_dict().items():
        out[f"fit.{k}"] = v
    return out


def assert_results(got, want, exact=True):
    assert got.keys() == want.keys()
    for k in want:
        if exact or k == "predict":
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


def _float_variants():
    x, _ = data()
    wide = np.zeros((2 * N, 3 * F), np.float32)
    wide[::2, ::3] = x
    ro = x.copy()
    ro.flags.writeable = False
    ro64 = x.astype(np.float64)
    ro64.flags.writeable = False
    return {
        "fortran": np.asfortranarray(x),
        "strided": wide[::2, ::3],
        "transposed-view": np.ascontiguousarray(x.T).T,
        "negative-stride": x[::-1].copy()[::-1],
        "float64": x.astype(np.float64),
        "float64-fortran": np.asfortranarray(x.astype(np.float64)),
        "big-endian": x.astype(">f4"),
        "read-only": ro,
        "read-only-float64": ro64,
        "list": x.tolist(),
    }


@pytest.fixture(scope="module")
def reference_results():
    x, y = data()
    return run_everything(x, y)


@pytest.mark.parametrize("name", list(_float_variants()))
def test_float_layouts_match_c_contiguous_float32(name, reference_results):
    x = _float_variants()[name]
    y = data()[1]
    keep = np.array(x, copy=True)
    got = run_everything(x, y)
    assert_results(got, reference_results)
    np.testing.assert_array_equal(np.asarray(x), keep, err_msg="the input was modified")
    if isinstance(x, np.ndarray):
        assert x.dtype == keep.dtype


def test_float16_matches_its_float32_values():
    x16 = data()[0].astype(np.float16)
    y = data()[1]
    keep = x16.copy()
    want = run_everything(x16.astype(np.float32), y)
    assert_results(run_everything(x16, y), want)
    assert_results(run_everything(np.asfortranarray(x16), y), want)
    np.testing.assert_array_equal(x16, keep)


def _uint8():
    return np.random.default_rng(4).integers(0, 256, size=(N, F), dtype=np.uint8)


@pytest.mark.parametrize("layout", ["c", "fortran", "strided", "read-only"])
def test_uint8_matches_normalised_float32(layout):
    u = _uint8()
    y = data()[1]
    manual = ((u.astype(np.float32) / 255.0 - 0.5) / 0.5).astype(np.float32)
    if layout == "fortran":
        u = np.asfortranarray(u)
    elif layout == "strided":
        wide = np.zeros((N, 2 * F), np.uint8)
        wide[:, 1::2] = u
        u = wide[:, 1::2]
    elif layout == "read-only":
        u.flags.writeable = False
    keep = u.copy()
    assert_results(run_everything(u, y), run_everything(manual, y), exact=False)
    np.testing.assert_array_equal(u, keep)


INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_labels_of_every_integer_dtype(dtype, reference_results):
    x, y = data()
    yd = y.astype(dtype)
    keep = yd.copy()
    assert_results(run_everything(x, yd), reference_results)
    np.testing.assert_array_equal(yd, keep)
    assert yd.dtype == dtype


@pytest.mark.parametrize("kind", ["strided", "read-only", "list", "big-endian"])
def test_labels_layouts(kind, reference_results):
    x, y = data()
    if kind == "strided":
        wide = np.zeros(2 * N, np.int64)
        wide[::2] = y
        yv = wide[::2]
    elif kind == "read-only":
        yv = y.copy()
        yv.flags.writeable = False
    elif kind == "list":
        yv = y.tolist()
    else:
        yv = y.astype(">i4")
    keep = np.array(yv, copy=True)
    assert_results(run_everything(x, yv), reference_results)
    np.testing.assert_array_equal(np.asarray(yv), keep)


def test_outputs_are_new_arrays_owned_by_the_caller():
    x, y = data()
    model = cmlp.MLP(SIZES, seed=2)
    a, b = model(x), model(x)
    assert a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
    assert not np.shares_memory(a, b) and not np.shares_memory(a, x)
    a[...] = 123.0
    np.testing.assert_array_equal(model(x), b)
    p = model.predict(x)
    assert p.dtype == np.int64 and p.shape == (N,)
    sd = model.state_dict()
    sd["fc1.weight"][...] = 7.0
    assert not np.any(model.state_dict()["fc1.weight"] == 7.0)


# ---- the interpreter survives a barrage of bad input ----

SURVIVOR = textwrap.dedent(r"""
    import gc, os, sys
    import numpy as np
    import cmlp

    m = cmlp.MLP([20, 16, 5], seed=0)
    opt = cmlp.optim.Adam(m)
    t = cmlp.Trainer(m, opt, batch_size=4)
    x = np.random.default_rng(0).standard_normal((8, 20)).astype(np.float32)
    y = np.arange(8) % 5
    p0 = m.state_dict()
    nan = x.copy(); nan[4, 4] = np.nan
    bad = [
        lambda: m(None), lambda: m(object()), lambda: m("x"), lambda: m(3.0), lambda: m([]),
        lambda: m(np.zeros((8, 21), np.float32)), lambda: m(np.zeros((0, 20), np.float32)),
        lambda: m(np.zeros((8, 20, 2), np.float32)), lambda: m(np.zeros((8, 20), complex)),
        lambda: m(np.zeros((8, 20), object)), lambda: m(nan), lambda: m([[0.0] * 20, [0.0] * 3]),
        lambda: m.forward_backward(x, None), lambda: m.forward_backward(x, y[:3]),
        lambda: m.forward_backward(x, y + 100), lambda: m.forward_backward(x, -y - 1),
        lambda: m.forward_backward(x, np.full(8, 2**63 - 1, np.int64)),
        lambda: m.forward_backward(x, np.full(8, 2**64 - 1, np.uint64)),
        lambda: m.forward_backward(x, y.astype(float)), lambda: m.forward_backward(nan, y),
        lambda: m.evaluate(x, y, batch_size=0), lambda: m.evaluate(x, y, batch_size=-5),
        lambda: t.step(nan, y), lambda: t.step(x, y[:2]), lambda: t.fit(nan, y, progress=False),
        lambda: t.fit(x, y, epochs=0, progress=False), lambda: t.fit(x, y, epochs=-1, progress=False),
        lambda: m.load_state_dict({}), lambda: m.load_state_dict({"fc1.weight": np.zeros(3)}),
        lambda: m.load_state_dict(None), lambda: m.to("gpu"), lambda: m.to(3.5),  # (to(None): torch's no-op)
        lambda: cmlp.MLP([]), lambda: cmlp.MLP([20, 0, 5]), lambda: cmlp.MLP([20, 2**40, 5]),
        lambda: cmlp.MLP([20, -3]), lambda: cmlp.MLP([20, 2.5, 5]), lambda: cmlp.MLP("20,5"),
        lambda: cmlp.MLP([20, 5], device=""), lambda: cmlp.MLP([20, 5], device=b"cpu"),
        lambda: cmlp.optim.Adam(m, lr=-0.01), lambda: cmlp.optim.Adam(m, betas=(2, 2)),
        lambda: cmlp.optim.SGD(m, nesterov=True), lambda: cmlp.Trainer(m, opt, batch_size=0),
        lambda: cmlp.Trainer(cmlp.MLP([20, 5]), opt),
        lambda: cmlp.memory.caching_allocator_delete(12345), lambda: cmlp.memory.caching_allocator_alloc(-5),
        lambda: cmlp.memory.caching_allocator_alloc("8"), lambda: cmlp.memory.set_memory_limit(-1),
        lambda: cmlp.memory.set_memory_limit("1GB"), lambda: cmlp.memory.set_per_process_memory_fraction(2.0),
        lambda: cmlp.memory.set_per_process_memory_fraction(1), lambda: cmlp.memory.memory_stats("tpu"),
        lambda: cmlp.MLP.load(os.devnull), lambda: opt.load_state_dict({}), lambda: opt.load_state_dict(None),
    ]
    unexpected = []
    for i, call in enumerate(bad):
        try:
            call()
        except (ValueError, TypeError):
            pass
        except BaseException as e:  # noqa: BLE001
            unexpected.append(f"case {i}: {type(e).__name__}: {e}")
        else:
            unexpected.append(f"case {i}: no exception")
        gc.collect()
    for k, v in m.state_dict().items():
        if not np.array_equal(v, p0[k]):
            unexpected.append(f"parameter {k} changed")
    assert np.isfinite(t.step(x, y)) and np.isfinite(m(x)).all()
    if unexpected:
        print("\n".join(unexpected))
        sys.exit(1)
    print("survived", len(bad))
""")


def test_interpreter_survives_bad_inputs(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SURVIVOR], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "survived" in r.stdout


def test_numbers_and_flags_given_as_text_are_refused():
    model = cmlp.MLP([4, 3], seed=0)
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    for kw in ({"loss_scale": "2"}, {"loss_scale": True}, {"label_smoothing": "0.1"}):
        with pytest.raises(TypeError):
            model.forward_backward(x, y, **kw)
    assert model._grads_none  # nothing was added
    with pytest.raises(TypeError):
        cmlp.Trainer(model, cmlp.optim.SGD(model), batch_size=2, label_smoothing="0.1")
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model), batch_size=2)
    before = model._c.get_params()
    with pytest.raises(TypeError, match="progress"):
        trainer.fit(x, y, epochs=1, progress="no")
    assert np.array_equal(model._c.get_params(), before) and trainer.state_dict()["epochs"] == 0


def test_allocator_settings_given_as_a_dict_name_the_key_they_refuse():
    before = cmlp.memory.get_config()
    for config, key in [({"roundup_power2_divisions": True}, "roundup_power2_divisions"),
                        ({"roundup_power2_divisions": "4"}, "roundup_power2_divisions"),
                        ({"roundup_power2_divisions": [1.5] * 4}, "roundup_power2_divisions"),
                        ({"max_split_size_mb": float("inf")}, "max_split_size_mb"),
                        ({"max_split_size_mb": "abc"}, "max_split_size_mb"),
                        ({"max_split_size_mb": 128.9}, "max_split_size_mb")]:
        with pytest.raises(ValueError, match=key):
            cmlp.memory.configure(config)
    assert cmlp.memory.get_config() == before
    cmlp.memory.configure({"max_split_size_mb": np.int64(128)})
    assert cmlp.memory.get_config()["max_split_size_mb"] == 128
    cmlp.memory.configure(before)
    assert cmlp.memory.get_config() == before


def test_a_model_file_whose_array_claims_more_than_memory_is_refused(tmp_path):
    import zipfile
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,), }"
    header += b" " * (64 - (10 + len(header) + 1) % 64) + b"\n"
    path = tmp_path / "claims.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fc1.weight.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 16)
    with pytest.raises(ValueError, match="not a readable cmlp model file"):
        cmlp.MLP.load(path)


def test_private_calls_hold_their_list_items_while_they_run():
    """An item's __index__ that empties the list of requests, and the buffers of set_state, are
    read from a copy of the list the call holds (a borrowed item was read after it was freed)."""
    requests = []

    class Emptying:
        def __index__(self):
            requests.clear()
            return 8

    requests.extend([Emptying()] + [1] * 15)
    assert cmlp._cmlp.try_requests("cpu", requests) in (True, False)
    model = cmlp.MLP(SIZES)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    n = model._c.get_params().size
    with pytest.raises(ValueError, match=r"2\*\*53"):  # a count that the steps could overflow
        opt._c.set_state(2**63 - 1, [np.zeros(n, np.float32)] * 2)
    opt._c.set_state(2**53 - 1, [np.zeros(n, np.float32), np.ones(n, np.float32)])


@pytest.mark.parametrize("call", [
    lambda: cmlp.memory.memory_stats("€" * 30),  # quoted back cut to 64 bytes: inside a character
    lambda: cmlp.MLP(SIZES, device="€" * 30),
    lambda: cmlp.memory.configure("é" * 1500),  # a message cut to its buffer's size
], ids=["device", "model-device", "configure"])
def test_a_message_cut_inside_a_character_is_still_the_value_error(call):
    before = cmlp.memory.get_config()
    with pytest.raises(ValueError) as e:
        call()
    assert not isinstance(e.value, UnicodeError) and ("unknown device" in str(e.value) or
                                                      "Unrecognized CachingAllocator option" in str(e.value))
    assert cmlp.memory.get_config() == before


@pytest.mark.parametrize("call,what", [
    (lambda: cmlp.memory.memory_stats("\ud800"), "device"),
    (lambda: cmlp.memory.configure("expandable_segments:\ud800"), "the allocator configuration"),
])
def test_text_without_a_utf8_form_is_a_value_error_naming_it(call, what):
    with pytest.raises(ValueError, match=f"{what} must be text that UTF-8 can encode"):
        call()


def test_ints_beyond_every_float_are_value_errors_naming_the_argument(ctx):
    S, big = cmlp.optim.lr_scheduler, 10 ** 400
    for call, match in [
        (lambda: cmlp.memory.configure({"garbage_collection_threshold": big}), "garbage_collection_threshold"),
        (lambda: cmlp.amp.GradScaler(init_scale=big), "init_scale must be finite"),
        (lambda: cmlp.amp.GradScaler(growth_factor=big), "growth_factor must be finite"),
        (lambda: cmlp.amp.GradScaler(backoff_factor=-big), "backoff_factor must be finite"),
        (lambda: S.OneCycleLR(ctx.opt, max_lr=big, total_steps=10), "max_lr must be finite"),
        (lambda: S.OneCycleLR(ctx.opt, max_lr=0.1, total_steps=big), "total_steps must be below 2\\*\\*63"),
        (lambda: S.OneCycleLR(ctx.opt, max_lr=0.1, epochs=big, steps_per_epoch=2), "total_steps must be below"),
        (lambda: S.CyclicLR(ctx.opt, 0.01, big), "max_lr must be finite"),
        (lambda: S.CyclicLR(ctx.opt, big, 0.1), "base_lr must be finite"),
        (lambda: S.CosineAnnealingWarmRestarts(ctx.opt, big), "T_0 and T_mult must be below 2\\*\\*63"),
        (lambda: S.CosineAnnealingWarmRestarts(ctx.opt, 10, T_mult=big), "T_0 and T_mult must be below"),
    ]:
        lr = ctx.opt.lr
        with pytest.raises(ValueError, match=match):
            call()
        assert ctx.opt.lr == lr


def test_a_plateau_metric_beyond_every_float_compares_as_an_infinity(ctx):
    s = cmlp.optim.lr_scheduler.ReduceLROnPlateau(ctx.opt, patience=0)
    s.step(10 ** 400)  # worse than anything: the rate is cut at once
    assert s.best == float("inf") and ctx.opt.lr == pytest.approx(1e-3)
    s.step(-10 ** 400)  # better than anything
    assert s.best == -float("inf") and ctx.opt.lr == pytest.approx(1e-3)


def test_an_array_fit_reads_cannot_be_resized_under_it():
    """fit reads a float32 x in place across calls, between which Python runs (a schedule): NumPy
    refuses to resize it (or the array it views) meanwhile, refcheck=False too, which would free
    the memory the steps read. The refusal raises from the schedule; the trainer trains on."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2 * 4096, F)).astype(np.float32)
    y = np.arange(4096) % C
    for owner in ("x", "base"):
        x = base[:4096] if owner == "base" else base[:4096].copy()
        model = cmlp.MLP(SIZES, seed=0)
        opt = cmlp.optim.SGD(model, lr=0.01)
        trainer = cmlp.Trainer(model, opt, batch_size=8)
        target = base if owner == "base" else x

        def rate(step, target=target):
            if step == 3:
                target.resize((10, F), refcheck=False)
            return 1.0

        sched = cmlp.optim.lr_scheduler.LambdaLR(opt, rate)
        with pytest.raises(ValueError, match="cannot resize"):
            trainer.fit(x, y, epochs=1, progress=False, scheduler=sched, scheduler_interval="step")
        assert target.shape[0] >= 4096
        trainer.fit(x, y, epochs=1, progress=False)
        target.resize((10, F), refcheck=False)  # once fit returned, the array is the caller's again


def test_a_chained_schedule_of_nothing_or_not_schedules_says_so():
    with pytest.raises(ValueError, match="ChainedScheduler expects at least one scheduler"):
        cmlp.optim.lr_scheduler.ChainedScheduler([])
    for item in (5, "StepLR", None):
        with pytest.raises(TypeError, match="ChainedScheduler at index 0 should be a cmlp.optim.lr_scheduler"):
            cmlp.optim.lr_scheduler.ChainedScheduler([item])


def test_module_names_with_numbers_of_any_length_load_in_their_natural_order():
    """Keys named as another model's (layerN.weight, ...) load in the numbers' order, however many
    digits they have (Python's int() refuses more than 4300)."""
    model = cmlp.MLP(SIZES, seed=0)
    sd = cmlp.MLP(SIZES, seed=1).state_dict()
    big = "9" * 5000
    given = {f"layer{big}.weight": sd["fc2.weight"], f"layer{big}.bias": sd["fc2.bias"],
             "layer007.weight": sd["fc1.weight"], "layer007.bias": sd["fc1.bias"]}
    model.load_state_dict(given)
    assert all(np.array_equal(model.state_dict()[k], v) for k, v in sd.items())
