"""cmlp.amp.GradScaler against PyTorch's rules, on a
real cmlp model and optimizer: growth after exactly growth_interval finite steps, backoff on
inf or NaN with no lower bound, no growth to inf, update(new_scale), the misuse errors and
their messages, state_dict, the disabled scaler, exact unscaling, skipped steps that leave the
parameters and the optimizer state bitwise unchanged, and a scaled training loop that equals
the unscaled one.
"""

import os
import pickle

import numpy as np
import pytest

import cmlp
import cmlp.amp  # noqa: F401  (a submodule file; __init__ may not import it yet)
from cmlp import amp

# several tests here scale gradients by hand, or not at all, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:the gradients were made without loss_scale")

DEVICE = os.environ.get("CMLP_TEST_DEVICE", "cpu")
SIZES = [6, 8, 3]
FLT_MAX = float(np.finfo(np.float32).max)
KEYS = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]


def batch(seed=0, n=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, rng.integers(0, SIZES[-1], n)


def make(opt="adam", seed=0):
    model = cmlp.MLP(SIZES, seed=seed, device=DEVICE)
    if opt == "adam":
        return model, cmlp.optim.Adam(model, lr=1e-2)
    return model, cmlp.optim.SGD(model, lr=0.1, momentum=0.9)


def flat(d):
    return np.concatenate([v.ravel() for v in d.values()])


def finite_grads(model, scale, seed=0):
    model.zero_grad()
    model.forward_backward(*batch(seed), loss_scale=scale)
    g = flat(model.grads())
    assert np.isfinite(g).all()
    return g


def bad_grads(model, kind):
    """Gradients with +-inf ("inf") or NaN ("nan") entries: large inputs times a loss scale
    near float32's max overflow; adding the same with the opposite sign turns inf into NaN."""
    x, y = batch(1)
    model.zero_grad()
    model.forward_backward(x * 1e6, y, loss_scale=3e38)
    if kind == "nan":
        model.forward_backward(x * 1e6, y, loss_scale=-3e38)
    g = flat(model.grads())
    if kind == "inf":
        assert np.isinf(g).any() and not np.isnan(g).any()
    else:
        assert np.isnan(g).any()


def iteration(scaler, model, opt, kind="finite"):
    """One iteration; returns what step() returned."""
    if kind == "finite":
        finite_grads(model, scaler.get_scale())
    else:
        bad_grads(model, kind)
    stepped = scaler.step(opt)
    scaler.update()
    return stepped


def adam_state(opt):
    sd = opt.state_dict()["state"]
    return {(i, k): np.array(v) for i, e in sd.items() for k, v in e.items()}


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ---- construction ----

def test_defaults():
    s = amp.GradScaler()
    assert s.is_enabled()
    assert s.get_scale() == 65536.0
    assert s.state_dict() == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                              "growth_interval": 2000, "_growth_tracker": 0}
    assert list(s.state_dict()) == KEYS
    assert s.scale(1.5) == 1.5 * 65536.0
    assert s._get_state() == (65536.0, 0)


def test_init_scale_reads_as_given_until_the_scale_is_first_used():
    # torch keeps init_scale (or a loaded scale) as given until its scale tensor is made
    f32 = float(np.float32(0.1))
    s = amp.GradScaler(init_scale=0.1)
    assert s.get_scale() == s.state_dict()["scale"] == 0.1 != f32
    s.load_state_dict({**s.state_dict(), "scale": 0.3})
    assert s.get_scale() == 0.3
    s.load_state_dict({**s.state_dict(), "scale": 0.1})
    assert s.scale(1.0) == f32                                 # the first use: float32 from now on
    assert s.get_scale() == s.state_dict()["scale"] == f32
    s.load_state_dict({**s.state_dict(), "scale": 0.3})
    assert s.get_scale() == float(np.float32(0.3))
    assert pickle.loads(pickle.dumps(amp.GradScaler(init_scale=0.1))).get_scale() == 0.1
    for use in (lambda t: t.update(new_scale=0.1), lambda t: t._get_state()):
        t = amp.GradScaler(init_scale=0.1)
        use(t)
        assert t.get_scale() == f32
    t = amp.GradScaler(init_scale=0.1)
    with pytest.raises(TypeError):
        t.update(new_scale="x")
    assert t.get_scale() == 0.1                                # a refused call leaves it unused


def test_loss_scale_is_used_in_float32_as_torchs():
    """torch multiplies the loss by the scale in float32: 0.1 scales as float32's 0.1 does, and a
    scale beyond float32 is refused (an inf there) with the model left as it was."""
    model, _ = make()
    x, y = batch(n=5)  # (0.3 / 5 and float32(0.3) / 5 round to different float32 values)
    grads = []
    for scale in (0.3, float(np.float32(0.3))):
        model.zero_grad()
        model.forward_backward(x, y, loss_scale=scale)
        grads.append(flat(model.grads()))
    assert np.array_equal(*grads)
    before = flat(model.grads())
    with pytest.raises(ValueError, match="loss_scale must be finite in float32"):
        model.forward_backward(*batch(), loss_scale=1e39)
    assert np.array_equal(flat(model.grads()), before)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"growth_factor": 1.0}, ValueError, "growth_factor"),
    ({"growth_factor": 0.5}, ValueError, "growth_factor"),
    ({"growth_factor": float("nan")}, ValueError, "growth_factor"),
    ({"growth_factor": "2"}, TypeError, "growth_factor"),
    ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
    ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
    ({"backoff_factor": -0.5}, ValueError, "backoff_factor"),
    ({"backoff_factor": None}, TypeError, "backoff_factor"),
    ({"growth_interval": 0}, ValueError, "growth_interval"),
    ({"growth_interval": -3}, ValueError, "growth_interval"),
    ({"growth_interval": 2.0}, TypeError, "growth_interval"),
    ({"growth_interval": True}, TypeError, "growth_interval"),
    ({"init_scale": 0.0}, ValueError, "init_scale"),
    ({"init_scale": -1.0}, ValueError, "init_scale"),
    ({"init_scale": float("inf")}, ValueError, "init_scale"),
    ({"init_scale": float("nan")}, ValueError, "init_scale"),
    ({"init_scale": "1"}, TypeError, "init_scale"),
    ({"init_scale": 1e39}, ValueError, "init_scale"),      # inf in float32
    ({"init_scale": 1e-50}, ValueError, "init_scale"),     # zero in float32
    ({"init_scale": 1e-39}, ValueError, "smallest normal"),  # subnormal: flushed to 0 in compute
])
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        amp.GradScaler(**kwargs)


# ---- the growth / backoff rule ----

def test_growth_after_exactly_growth_interval():
    model, opt = make()
    s = amp.GradScaler(init_scale=4.0, growth_interval=3)
    seen = []
    for _ in range(7):
        assert iteration(s, model, opt) is True
        seen.append(s._get_state())
    assert seen == [(4.0, 1), (4.0, 2), (8.0, 0), (8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1)]


@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_backoff_resets_tracker(kind):
    model, opt = make()
    s = amp.GradScaler(init_scale=64.0, growth_interval=3)
    iteration(s, model, opt)
    iteration(s, model, opt)
    assert s._get_state() == (64.0, 2)
    assert iteration(s, model, opt, kind) is False
    assert s._get_state() == (32.0, 0)
    # growth needs growth_interval finite steps counted from the backoff
    iteration(s, model, opt)
    iteration(s, model, opt)
    assert s._get_state() == (32.0, 2)
    iteration(s, model, opt)
    assert s._get_state() == (64.0, 0)


def test_no_lower_bound():
    model, opt = make()
    s = amp.GradScaler(init_scale=4.0)
    for k in range(1, 31):
        iteration(s, model, opt, "inf")
        assert s._get_state() == (4.0 * 0.5**k, 0)
    assert s.get_scale() == 2.0**-28


def test_backoff_underflows_to_zero():
    """No lower bound: halving from 1.0 passes the float32 subnormals (2**-149 is the last) and
    reaches 0.0; then unscaling multiplies by inf, every step is skipped, and the state still
    round-trips (as a trainer does with it)."""
    model, opt = make()
    s = amp.GradScaler(init_scale=1.0, growth_interval=1)
    with pytest.warns(RuntimeWarning, match="smallest normal number"):  # once, at 2**-127
        for _ in range(149):
            iteration(s, model, opt, "inf")
    assert s.get_scale() == 2.0**-149
    iteration(s, model, opt, "inf")                 # 2**-150 is a tie: to even, zero
    assert s._get_state() == (0.0, 0)
    p = flat(model.state_dict())
    assert iteration(s, model, opt) is False
    assert same_bits(flat(model.state_dict()), p)
    assert s._get_state() == (0.0, 0)
    t = amp.GradScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    t._set_state(0.0, 0)


def test_a_scale_backed_off_below_the_smallest_normal_float_warns_and_a_trainer_refuses_it():
    """Backoff has no lower bound (torch's): a scale that falls below 2**-126 warns once (every step
    from then on finds inf); a state holding one (or 0) loads, as torch's, but a Trainer refuses to
    run with it, saying why and changing nothing; given a new scale, it trains."""
    model, opt = make()
    s = amp.GradScaler(init_scale=2.0**-124)
    with pytest.warns(RuntimeWarning, match="smallest normal number") as seen:
        for _ in range(4):
            iteration(s, model, opt, "inf")
    assert len(seen) == 1 and s.get_scale() == 2.0**-128
    with pytest.raises(ValueError, match="smallest normal"):
        s.update(new_scale=1e-39)
    t = amp.GradScaler()
    t.load_state_dict({**t.state_dict(), "scale": 0.0})
    assert t.get_scale() == 0.0
    x, y = batch(n=16)
    trainer = cmlp.Trainer(model, opt, batch_size=8, amp="fp16", scaler=t)
    before = model.state_dict()
    with pytest.raises(ValueError, match="scale is 0, below float32's smallest normal number"):
        trainer.fit(x, y, epochs=1, progress=False)
    assert flat(model.state_dict()).tolist() == flat(before).tolist() and t.get_scale() == 0.0
    t.update(new_scale=1024.0)
    history = trainer.fit(x, y, epochs=1, progress=False)
    assert np.isfinite(history[0]["loss"]) and history[0]["skipped_steps"] == 0
    # the trainer's own loop backs off too: it warns as update() does, once
    model._c.set_params(np.full(model.num_parameters(), np.nan, np.float32), False)
    t.update(new_scale=2.0**-120)
    with pytest.warns(RuntimeWarning, match="smallest normal number") as seen:
        history = trainer.fit(np.tile(x, (4, 1)), np.tile(y, 4), epochs=1, progress=False)
    assert len(seen) == 1 and history[0]["skipped_steps"] == 8 and t.get_scale() < 2.0**-126


def test_pickled_and_copied_only_between_iterations_as_torchs():
    """What unscale_ and step recorded belongs to this process's optimizers: torch refuses to
    pickle it, and so does this scaler; between iterations its copy scales as it does."""
    import copy

    model, opt = make("sgd")
    s = amp.GradScaler(init_scale=1024.0, growth_interval=3)
    iteration(s, model, opt)
    finite_grads(model, s.get_scale())
    s.unscale_(opt)
    for copier in (pickle.dumps, copy.deepcopy):
        with pytest.raises(AssertionError, match="only be pickled at the beginning of an iteration"):
            copier(s)
    s.step(opt)
    s.update()
    twin = pickle.loads(pickle.dumps(s))
    assert twin.state_dict() == s.state_dict() and copy.deepcopy(s).state_dict() == s.state_dict()


def test_backoff_rounds_to_float32_each_time():
    model, opt = make()
    s = amp.GradScaler(init_scale=1000.0, backoff_factor=0.1)
    expect = np.float32(1000.0)
    for _ in range(12):
        iteration(s, model, opt, "inf")
        expect = np.float32(np.float64(expect) * 0.1)
        assert s.get_scale() == float(expect)
    assert s.get_scale() < 1e-8


@pytest.mark.parametrize("init_scale, growth, expect", [
    (2.0**127, 2.0, 2.0**127),            # 2**128 is inf in float32: no growth
    (FLT_MAX, 2.0, FLT_MAX),
    (2.0**126, 2.0, 2.0**127),            # the largest power of two is reachable
    (2.0**127, 1.5, 1.5 * 2.0**127),      # finite: grows
    (2.0**127, 2 - 3 * 2.0**-25, FLT_MAX),  # above FLT_MAX in float64, rounds to it in float32: grows
    (2.0**127, 2 - 2.0**-25, 2.0**127),     # above FLT_MAX, rounds to inf in float32: no growth
])
def test_growth_stops_below_inf(init_scale, growth, expect):
    model, opt = make()
    s = amp.GradScaler(init_scale=init_scale, growth_factor=growth, growth_interval=2)
    for _ in range(2):
        model.zero_grad()
        model.forward_backward(*batch(), loss_scale=1.0)   # tiny but finite after unscaling
        assert s.step(opt) is True
        s.update()
    assert s._get_state() == (expect, 0)


def test_update_new_scale_keeps_tracker():
    model, opt = make()
    s = amp.GradScaler(init_scale=8.0, growth_interval=3)
    iteration(s, model, opt)
    iteration(s, model, opt)
    finite_grads(model, s.get_scale())
    s.step(opt)
    s.update(100.0)
    assert s._get_state() == (100.0, 2)
    iteration(s, model, opt)
    assert s._get_state() == (200.0, 0)
    # a 1-element array, rounded to float32; no step needed before update(new_scale)
    s.update(np.array([0.1]))
    assert s._get_state() == (float(np.float32(0.1)), 0)
    s.update(7)
    assert s.get_scale() == 7.0


@pytest.mark.parametrize("value, exc", [(0.0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), (np.ones(2), TypeError),
                                        ("2", TypeError), (True, TypeError)])
def test_update_bad_new_scale(value, exc):
    s = amp.GradScaler(init_scale=8.0)
    with pytest.raises(exc, match="new_scale"):
        s.update(value)
    assert s._get_state() == (8.0, 0)


def test_update_after_unscale_only_counts():
    """PyTorch's update() uses every inf check recorded, also from unscale_ without step."""
    model, opt = make()
    s = amp.GradScaler(init_scale=8.0, growth_interval=5)
    finite_grads(model, 8.0)
    s.unscale_(opt)
    s.update()
    assert s._get_state() == (8.0, 1)
    bad_grads(model, "inf")
    s.unscale_(opt)
    s.update()
    assert s._get_state() == (4.0, 0)


def test_two_optimizers_one_inf():
    """The optimizer whose gradients overflowed skips its step; the other steps; update backs off."""
    m1, o1 = make(seed=1)
    m2, o2 = make(seed=2)
    s = amp.GradScaler(init_scale=16.0)
    finite_grads(m1, 16.0)
    bad_grads(m2, "inf")
    p1, p2 = flat(m1.state_dict()), flat(m2.state_dict())
    assert s.step(o1) is True
    assert s.step(o2) is False
    assert not np.array_equal(flat(m1.state_dict()), p1)
    assert same_bits(flat(m2.state_dict()), p2)
    s.update()
    assert s._get_state() == (8.0, 0)


# ---- misuse ----

def test_unscale_twice():
    model, opt = make()
    s = amp.GradScaler()
    finite_grads(model, s.get_scale())
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the "
                                           r"last update\(\)\."):
        s.unscale_(opt)


def test_unscale_after_step():
    model, opt = make()
    s = amp.GradScaler()
    finite_grads(model, s.get_scale())
    s.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)\."):
        s.unscale_(opt)


def test_step_twice():
    model, opt = make()
    s = amp.GradScaler()
    finite_grads(model, s.get_scale())
    s.step(opt)
    p = flat(model.state_dict())
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)\."):
        s.step(opt)
    assert same_bits(flat(model.state_dict()), p)


def test_update_without_step():
    s = amp.GradScaler()
    with pytest.raises(AssertionError, match=r"No inf checks were recorded prior to update\."):
        s.update()
    model, opt = make()
    iteration(s, model, opt)
    with pytest.raises(AssertionError, match="No inf checks"):
        s.update()          # update() ended the iteration: nothing recorded since
    assert s._get_state() == (65536.0, 1)


def test_an_iteration_without_gradients_checks_nothing_as_in_torch():
    # torch's unscale_ checks the parameters that have a .grad: with none, nothing is recorded,
    # so step() and update() assert, and the scale does not grow
    s = amp.GradScaler(init_scale=4.0, growth_interval=1)
    model, opt = make()
    start = flat(model.state_dict())
    opt.zero_grad()
    s.unscale_(opt)
    with pytest.raises(AssertionError, match=r"No inf checks were recorded prior to update\."):
        s.update()
    model.forward_backward(*batch(0), loss_scale=s.get_scale())  # gradients after unscale_: never checked
    with pytest.raises(AssertionError, match=r"No inf checks were recorded for this optimizer\."):
        s.step(opt)
    assert same_bits(flat(model.state_dict()), start) and s._get_state() == (4.0, 0)
    s2 = amp.GradScaler(init_scale=4.0, growth_interval=1)
    opt.zero_grad()
    with pytest.raises(AssertionError, match="for this optimizer"):
        s2.step(opt)
    with pytest.raises(AssertionError, match="prior to update"):  # the refused step recorded nothing
        s2.update()
    assert s2._get_state() == (4.0, 0)


def test_update_resets_the_iteration():
    model, opt = make()
    s = amp.GradScaler()
    for _ in range(3):
        finite_grads(model, s.get_scale())
        s.unscale_(opt)
        assert s.step(opt) is True
        s.update()


def test_step_needs_a_cmlp_optimizer():
    s = amp.GradScaler()
    with pytest.raises(TypeError, match="optimizer"):
        s.step(object())
    with pytest.raises(TypeError, match="optimizer"):
        s.unscale_("adam")


# ---- state_dict ----

def test_state_dict_round_trip():
    model, opt = make()
    s = amp.GradScaler(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=4)
    for kind in ["finite", "finite", "inf", "finite", "finite"]:
        iteration(s, model, opt, kind)
    sd = s.state_dict()
    assert list(sd) == KEYS
    assert sd == {"scale": 256.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 4,
                  "_growth_tracker": 2}
    t = amp.GradScaler()
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    for kind in ["finite", "finite", "inf", "finite"]:
        iteration(s, model, opt, kind)
        iteration(t, model, opt, kind)
        assert t.state_dict() == s.state_dict()
    sd["scale"] = 5.0     # the scaler holds no reference to a returned dict
    assert s.get_scale() != 5.0


def test_load_empty_state_dict():
    s = amp.GradScaler()
    with pytest.raises(RuntimeError, match="The source state dict is empty, possibly because it was saved from "
                                           "a disabled instance of GradScaler."):
        s.load_state_dict({})
    assert s._get_state() == (65536.0, 0)


def test_a_factor_out_of_range_is_a_value_error_and_torchs_assertion_error():
    for kw in (dict(growth_factor=0.5), dict(growth_factor=float("inf")), dict(backoff_factor=2.0),
               dict(backoff_factor=0.0)):
        with pytest.raises(ValueError, match=r"The (growth|backoff) factor must be") as info:
            amp.GradScaler(**kw)
        assert isinstance(info.value, AssertionError)  # what torch's raises: code written for it catches this
    s = amp.GradScaler()
    with pytest.raises(AssertionError, match="growth_factor=1.0"):
        s.set_growth_factor(1.0)
    assert s.get_growth_factor() == 2.0


def test_load_bad_state_dict():
    s = amp.GradScaler()
    good = amp.GradScaler(init_scale=2.0).state_dict()
    with pytest.raises(KeyError, match="_growth_tracker"):
        s.load_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="growth_factor"):
        s.load_state_dict({**good, "growth_factor": 0.5})
    with pytest.raises(ValueError, match="scale"):
        s.load_state_dict({**good, "scale": -1.0})
    with pytest.raises(ValueError, match="_growth_tracker"):
        s.load_state_dict({**good, "_growth_tracker": -1})
    assert s.state_dict() == amp.GradScaler().state_dict()   # nothing half-loaded


def test_a_tracker_at_or_past_the_interval_loads_as_set_growth_interval_leaves_it():
    """torch's set_growth_interval leaves the tracker at or past a lower interval (its scale then
    never grows again) and saves it so; such a state loads here, and the scale grows at the next
    successful step, as after this library's set_growth_interval (which would otherwise count
    on to the int32's end and fail in the middle of a fit)."""
    s = amp.GradScaler(init_scale=8.0)
    s.load_state_dict({**s.state_dict(), "growth_interval": 3, "_growth_tracker": 12})
    assert s.state_dict()["_growth_tracker"] == 2
    model, opt = make()
    finite_grads(model, 1.0)
    s.step(opt)
    s.update()
    assert s.get_scale() == 16.0 and s._get_growth_tracker() == 0
    t = amp.GradScaler(init_scale=8.0, growth_interval=10)
    t._set_state(8.0, 5)
    t.set_growth_interval(3)
    assert t.state_dict() == s.state_dict() | {"scale": 8.0, "_growth_tracker": 2}


def test_torchs_device_first_form():
    """torch.amp.GradScaler("cuda", init_scale=...): the device first, or device=; the scale
    stays a host number and the scaler stays enabled without a GPU."""
    for args, kwargs in ((("cuda",), {"init_scale": 1024.0}), (("cpu", 1024.0), {}), ((1024.0,), {"device": "cuda:1"}),
                         ((), {"device": "cuda", "init_scale": 1024.0, "growth_interval": 7})):
        s = amp.GradScaler(*args, **kwargs)
        assert s.is_enabled() and s.get_scale() == 1024.0
        assert s.device == (args[0] if args and isinstance(args[0], str) else kwargs["device"])
    assert amp.GradScaler().device == "cuda"
    assert amp.GradScaler("cuda", 2.0, 3.0, 0.25, 5, False).state_dict() == {}
    assert amp.GradScaler("cpu", 2.0, 3.0, 0.25, 5).state_dict() == {
        "scale": 2.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 5, "_growth_tracker": 0}
    with pytest.raises(ValueError, match="device"):
        amp.GradScaler("tpu")
    with pytest.raises(ValueError, match="device"):
        amp.GradScaler(device="cuda:x")
    with pytest.raises(TypeError, match="device"):
        amp.GradScaler("cuda", device="cpu")
    with pytest.raises(TypeError):
        amp.GradScaler("cuda", init_scale=2.0, bogus=1)


# ---- disabled ----

def test_disabled():
    model, opt = make()
    s = amp.GradScaler(init_scale=1024.0, enabled=False)
    assert not s.is_enabled()
    assert s.get_scale() == 1.0
    assert s.state_dict() == {}
    assert s.scale(2.5) == 2.5
    g = finite_grads(model, 1.0)
    s.unscale_(opt)
    s.unscale_(opt)                                  # no-op, no error
    assert same_bits(flat(model.grads()), g)
    p = flat(model.state_dict())
    assert s.step(opt) is True
    assert not np.array_equal(flat(model.state_dict()), p)
    assert s.step(opt) is True                       # no bookkeeping when disabled
    s.update()
    s.update()
    s.load_state_dict({})                            # a no-op, as in PyTorch
    assert s.get_scale() == 1.0 and s.state_dict() == {}


def test_disabled_does_not_skip_nonfinite_steps():
    model, opt = make()
    s = amp.GradScaler(enabled=False)
    bad_grads(model, "inf")
    assert s.step(opt) is True
    assert not np.isfinite(flat(model.state_dict())).all()


# ---- unscaling and skipping ----

@pytest.mark.parametrize("scale", [65536.0, 3.0, 1000.0, 0.1, 2.0**-20, 12345.678])
def test_unscale_is_exact(scale):
    """Every gradient is multiplied by float32(1 / float64(scale)), once."""
    model, opt = make()
    s = amp.GradScaler(init_scale=scale)
    g = finite_grads(model, s.get_scale())
    inv = np.float32(1.0 / np.float64(np.float32(scale)))
    s.unscale_(opt)
    assert same_bits(flat(model.grads()), g * inv)
    s.step(opt)                                      # step does not unscale again
    assert same_bits(flat(model.grads()), g * inv)


@pytest.mark.parametrize("opt_kind", ["adam", "sgd"])
@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_skipped_step_changes_nothing(opt_kind, kind, explicit_unscale):
    model, opt = make(opt_kind)
    s = amp.GradScaler(init_scale=256.0)
    for _ in range(3):
        assert iteration(s, model, opt) is True
    p = flat(model.state_dict())
    state = adam_state(opt)
    if opt_kind == "adam":
        assert state[(0, "step")] == 3.0
    assert state and all(np.any(v != 0) for v in state.values())
    bad_grads(model, kind)
    if explicit_unscale:
        s.unscale_(opt)
    assert s.step(opt) is False
    s.update()
    assert same_bits(flat(model.state_dict()), p)
    after = adam_state(opt)
    assert after.keys() == state.keys()
    assert all(same_bits(after[k], state[k]) for k in state)
    assert s._get_state() == (128.0, 0)
    assert iteration(s, model, opt) is True           # and training goes on
    assert np.isfinite(flat(model.state_dict())).all()


# ---- a training loop ----

@pytest.mark.parametrize("opt_kind", ["adam", "sgd"])
def test_scaled_loop_equals_unscaled(opt_kind):
    """Powers-of-two scales make scale-then-unscale exact, so the scaled loop (with one
    overflowing step skipped) follows the plain fp32 loop that skips the same step."""
    steps, overflow_at = 12, 5
    ma, oa = make(opt_kind)
    mb, ob = make(opt_kind)
    s = amp.GradScaler(init_scale=2.0**10, growth_interval=3)
    scales = []
    for i in range(steps):
        x, y = batch(seed=100 + i, n=8)
        ma.zero_grad()
        mb.zero_grad()
        if i == overflow_at:
            ma.forward_backward(x * 1e6, y, loss_scale=3e38)
            assert s.step(oa) is False
        else:
            la = ma.forward_backward(x, y, loss_scale=s.get_scale())
            lb = mb.forward_backward(x, y)
            assert la == lb                              # the returned loss is unscaled
            assert s.step(oa) is True
            ob.step()
        s.update()
        scales.append(s.get_scale())
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**10, 2.0**11,
                      2.0**11, 2.0**11, 2.0**12]
    pa, pb = flat(ma.state_dict()), flat(mb.state_dict())
    np.testing.assert_allclose(pa, pb, rtol=1e-6, atol=1e-7)
    sa, sb = adam_state(oa), adam_state(ob)
    for k in sb:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-6, atol=1e-9)


# ---- trainer hooks ----

def test_private_state_hooks():
    s = amp.GradScaler()
    s._set_state(0.1, 7)
    assert s._get_state() == (float(np.float32(0.1)), 7)
    assert s.state_dict()["_growth_tracker"] == 7
    with pytest.raises(ValueError):
        s._set_state(-1.0, 0)
    with pytest.raises(ValueError):
        s._set_state(float("inf"), 0)
    with pytest.raises(ValueError):
        s._set_state(1.0, -1)


def test_step_without_gradients_is_torchs_assertion_and_changes_nothing():
    model, opt = make()
    s = amp.GradScaler(init_scale=8.0)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        s.step(opt)
    assert s.state_dict()["scale"] == 8.0 and opt._c.get_state()[0] == 0



@pytest.mark.parametrize("scale", [2.0**127, 1.5 * 2.0**127, 2.0**126])
def test_a_scale_whose_reciprocal_is_subnormal_unscales_as_torch(scale):
    # past 2**126, 1/scale is a subnormal float32; this CPU computes with subnormals flushed
    # (for speed), which would read it as 0 and unscale every gradient to 0 unseen. The product
    # must be torch's (g * the subnormal, rounded once); only a subnormal result is flushed.
    rng = np.random.default_rng(0)
    x, y = rng.random((64, SIZES[0]), dtype=np.float32), rng.integers(0, SIZES[-1], 64)
    model, opt = make("sgd")
    model.forward_backward(x, y, loss_scale=scale)
    scaled = model._c.get_grads()
    inv = np.float32(1.0 / np.float64(scale))
    with np.errstate(under="ignore"):
        want = scaled * inv  # NumPy keeps subnormals
    want[np.abs(want) < np.finfo(np.float32).tiny] = 0.0
    assert not model._c.unscale_grads(float(inv))
    got = model._c.get_grads()
    assert np.array_equal(got, want) and np.abs(got).max() > 0
    # the trainer's loop (the scale read on the device side) steps with these gradients too
    model, opt = make("sgd")
    s = amp.GradScaler(init_scale=scale, growth_interval=1)
    start = model._c.get_params()
    cmlp.Trainer(model, opt, batch_size=8, scaler=s).fit(x, y, epochs=1, progress=False)
    ref, ref_opt = make("sgd")
    cmlp.Trainer(ref, ref_opt, batch_size=8).fit(x, y, epochs=1, progress=False)
    assert not np.array_equal(model._c.get_params(), start)
    assert np.allclose(model._c.get_params(), ref._c.get_params(), rtol=1e-5, atol=1e-6)


def test_the_factors_and_interval_are_read_and_set_as_in_torch():
    s = amp.GradScaler(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 3)
    model, opt = make()
    iteration(s, model, opt)
    iteration(s, model, opt)
    assert s._get_growth_tracker() == 2
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.5)
    s.set_growth_interval(2)  # two good steps in a row already: the next one grows
    assert s.state_dict() == {"scale": 4.0, "growth_factor": 4.0, "backoff_factor": 0.5, "growth_interval": 2,
                              "_growth_tracker": 1}
    iteration(s, model, opt)
    assert s._get_state() == (16.0, 0)
    iteration(s, model, opt, "inf")
    assert s._get_state() == (8.0, 0)
    for bad in (lambda: s.set_growth_factor(1.0), lambda: s.set_backoff_factor(1.5),
                lambda: s.set_growth_interval(0)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        s.set_growth_interval(2.0)
    assert s.state_dict()["growth_factor"] == 4.0 and s.get_growth_interval() == 2
    assert amp.GradScaler(enabled=False)._get_growth_tracker() == 0


def test_gradients_made_without_the_scale_are_warned_about_once():
    model, opt = make("sgd")
    s = amp.GradScaler(init_scale=1024.0)
    for i in range(2):
        model.zero_grad()
        model.forward_backward(*batch(i))  # loss_scale forgotten: these would be divided by 1024
        if i == 0:
            with pytest.warns(UserWarning, match=r"without loss_scale .* 1024: pass loss_scale=scaler.get_scale\(\)") \
                    as record:
                s.step(opt)
            assert record[0].filename == __file__  # the caller's line
        else:
            s.step(opt)  # once per scaler
        s.update()
    model.zero_grad()
    model.forward_backward(*batch(3), loss_scale=s.get_scale())  # as it should be: no warning
    s2 = amp.GradScaler(init_scale=1024.0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s2.step(opt)
        s2.update()
        # torch's scaler.scale(loss / steps) with a scale that has come down to the step count
        s3 = amp.GradScaler(init_scale=4.0)
        model.zero_grad()
        for k in range(4):
            model.forward_backward(*batch(k), loss_scale=s3.get_scale() / 4)
        s3.unscale_(opt)
        s3.step(opt)


def test_step_passes_arguments_on_and_an_enabled_scaler_refuses_a_closure():
    """As torch's: scaler.step(opt, *args, **kwargs) calls opt.step(*args, **kwargs), so that a
    loop written with GradScaler(enabled=use_amp) and a closure runs with amp off; an enabled
    scaler refuses a closure given by keyword, before anything changes."""
    x, y = batch()
    calls = []

    def closure():
        calls.append(1)
        model.zero_grad()
        return model.forward_backward(x, y)

    model, opt = make("sgd")
    ref_model, ref_opt = make("sgd")
    off = amp.GradScaler(enabled=False)
    assert off.step(opt, closure=closure) is True and calls == [1]
    ref_model.forward_backward(x, y)
    ref_opt.step()
    assert same_bits(flat(model.state_dict()), flat(ref_model.state_dict()))
    assert off.step(opt, closure) is True and calls == [1, 1]  # positionally too
    on = amp.GradScaler()
    model.zero_grad()
    model.forward_backward(x, y, loss_scale=on.get_scale())
    before = flat(model.state_dict())
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        on.step(opt, closure=closure)
    assert calls == [1, 1] and same_bits(flat(model.state_dict()), before)
    assert on.step(opt) is True  # the iteration goes on
    on.update()


def test_scale_takes_a_list_or_tuple_of_outputs():
    s = amp.GradScaler(init_scale=4.0)
    assert s.scale(1.5) == 6.0
    assert s.scale([1.0, (2.0, 3.0)]) == [4.0, (8.0, 12.0)]
    out = s.scale((np.float32(1.0), np.ones(2, np.float32)))
    assert isinstance(out, tuple) and out[0] == 4.0 and (out[1] == 4.0).all()
    off = amp.GradScaler(enabled=False)
    values = [1.0, 2.0]
    assert off.scale(values) is values
