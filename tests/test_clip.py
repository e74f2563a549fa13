"""Gradient clipping: cmlp.nn.utils.clip_grad_norm_ / clip_grad_value_ against a float64 norm of
the model's own gradients and against torch.nn.utils, Trainer(max_grad_norm=...) against the
same steps written by hand (bit for bit on the CPU), and model.parameters() where torch code
passes it.
"""

import gc
import os
import sys

import numpy as np
import pytest

import cmlp
from cmlp.nn.utils import clip_grad_norm_, clip_grad_value_

sys.path.insert(0, os.path.dirname(__file__))
from checks import fill_cache_but, room_for  # noqa: E402

F, C = 20, 4
SIZES = [F, 32, 16, C]


def batch(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, F)).astype(np.float32), rng.integers(0, C, size=n)


def flat_grads(model):
    return model._c.get_grads()


def by_name(model):
    """The gradients in state_dict order (fc1.weight, fc1.bias, ...), flattened."""
    return np.concatenate([g.ravel() for g in model.grads().values()])


def with_grads(seed=0, sizes=SIZES, device="cpu"):
    model = cmlp.MLP(sizes, seed=seed, device=device)
    x, y = batch(seed=seed)
    model.forward_backward(x, y)
    return model


def reference_norm(g, p):
    g = np.abs(g.astype(np.float64))
    if p == np.inf:
        return g.max()
    return (g ** p).sum() ** (1.0 / p)


def coefficient(max_norm, norm):
    """torch's clip coefficient in float32: max_norm / (norm + 1e-6), which torch evaluates as
    a reciprocal times max_norm, at most 1."""
    c = np.float32(1) / (np.float32(norm) + np.float32(1e-6)) * np.float32(max_norm)
    return min(c, np.float32(1.0))


@pytest.mark.parametrize("p", [2.0, 1.0, np.inf, "inf", 3.5, 0.5])
def test_the_norm_is_the_float64_norm_and_the_gradients_are_scaled_by_torchs_coefficient(p):
    model = with_grads()
    g = flat_grads(model)
    want = reference_norm(g, float(p))
    max_norm = want / 3
    total = clip_grad_norm_(model.parameters(), max_norm, norm_type=p)
    assert isinstance(total, float) and total.item() == float(total)  # a float, with torch's .item()
    assert abs(total - want) <= 2e-7 * want  # the float64 norm, rounded once to float32 (pow: 1e-7 more)
    c = coefficient(max_norm, total)
    assert c < 1
    np.testing.assert_array_equal(flat_grads(model), g * c)
    # the new norm: the old one times the coefficient (about max_norm), up to float rounding
    assert abs(reference_norm(flat_grads(model), float(p)) - c * want) <= 1e-6 * c * want


def test_a_norm_under_max_norm_changes_nothing():
    model = with_grads()
    g = flat_grads(model)
    total = clip_grad_norm_(model, 1e9)
    np.testing.assert_array_equal(flat_grads(model), g)
    assert total == pytest.approx(np.linalg.norm(g.astype(np.float64)), rel=2e-7)
    assert clip_grad_norm_(model, float("inf")) == total  # max_norm inf: the norm alone


def test_clip_grad_value_clamps_and_keeps_nan():
    model = with_grads()
    g = flat_grads(model)
    v = float(np.quantile(np.abs(g), 0.5))
    clip_grad_value_(model.parameters(), v)
    np.testing.assert_array_equal(flat_grads(model), np.clip(g, -np.float32(v), np.float32(v)))
    clip_grad_value_(model, 0)
    assert not flat_grads(model).any()
    clip_grad_value_(model, float("inf"))  # a no-op, as in torch
    assert not flat_grads(model).any()


def nan_grads():
    model = cmlp.MLP(SIZES, seed=0)
    x, y = batch()
    model.forward_backward(x, y, loss_scale=1e9, amp="fp16")  # overflows in half precision
    assert not np.isfinite(flat_grads(model)).all()
    return model


def test_a_non_finite_norm_raises_only_when_asked_and_then_changes_nothing():
    model = nan_grads()
    g = flat_grads(model)
    with pytest.raises(RuntimeError, match=r"of order 2 of the gradients is non-finite \(nan\), so it cannot be "
                                           r"clipped; set error_if_nonfinite=False"):  # (torch's words in it)
        clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(flat_grads(model), g)
    total = clip_grad_norm_(model, 1.0)  # torch scales by the non-finite norm: all NaN or zero
    assert not np.isfinite(total)
    assert not np.isfinite(flat_grads(model)).all()


def test_bad_arguments_raise_and_change_nothing():
    model = with_grads()
    g = flat_grads(model)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(model, -1.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(model, float("nan"))
    for p in (float("nan"), "nan", "two"):
        with pytest.raises(ValueError, match="norm_type"):
            clip_grad_norm_(model, 1.0, norm_type=p)
    with pytest.raises(TypeError, match="max_norm"):
        clip_grad_norm_(model, "1.0")
    with pytest.raises(TypeError, match="norm_type"):
        clip_grad_norm_(model, 1.0, norm_type=None)
    with pytest.raises(ValueError, match="clip_value"):
        clip_grad_value_(model, -0.5)
    with pytest.raises(ValueError, match="2 of the model's 6 parameters"):
        clip_grad_norm_(list(model.parameters())[:2], 1.0)
    with pytest.raises(TypeError, match="parameters"):
        clip_grad_norm_([np.ones((8, 16), np.float32)], 1.0)
    with pytest.raises(TypeError, match="parameters"):
        clip_grad_value_(None, 1.0)
    np.testing.assert_array_equal(flat_grads(model), g)


def test_torchs_iterables_of_parameters_clip_the_whole_model():
    """As torch's clip functions take any iterable of parameters: a list, a generator, one array
    or named_parameters() of all of the model's (the gradients are one buffer, clipped whole:
    a part of them is refused); none at all is a norm of 0 and changes nothing."""
    from cmlp.nn.utils import clip_grads_with_norm_

    for make in (lambda m: list(m.parameters()), lambda m: (p for p in m.parameters()), lambda m: m.named_parameters(),
                 lambda m: tuple(m.parameters())[::-1]):
        runs = []
        for arg in (lambda m: m, make):
            model = cmlp.MLP([16, 8, 4], seed=3)
            set_flat_grads(model, random_grads(model, 5))
            norm = clip_grad_norm_(arg(model), 0.5)
            clip_grad_value_(arg(model), 1e-3)
            clip_grads_with_norm_(arg(model), 0.5, 10.0)
            runs.append((norm, flat_grads(model)))
        assert runs[0][0] == runs[1][0]
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
    model = cmlp.MLP([16, 8, 4], seed=3)
    set_flat_grads(model, random_grads(model, 5))
    g = flat_grads(model)
    assert clip_grad_norm_([], 0.5) == 0.0
    clip_grad_value_(iter(()), 0.5)
    np.testing.assert_array_equal(flat_grads(model), g)
    other = cmlp.MLP([16, 8, 4], seed=4)
    with pytest.raises(ValueError, match="more than one model"):
        clip_grad_norm_(list(model.parameters())[:3] + list(other.parameters())[3:], 0.5)


def set_flat_grads(model, g):
    model._c.set_grads(np.ascontiguousarray(g, dtype=np.float32))


def random_grads(model, seed):
    """Gradients without zeros (a ReLU network's have them), so that min |g| and the negative
    p-norms are not 0."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(model.num_parameters()).astype(np.float32)
    g[np.abs(g) < 1e-3] = 0.5
    set_flat_grads(model, g)
    return g


@pytest.mark.parametrize("p", [-np.inf, "-inf", -1.0, -2.5])
def test_negative_norm_types_are_torchs_vector_norm(p):
    model = cmlp.MLP(SIZES, seed=0)
    g = random_grads(model, 1)
    a = np.abs(g.astype(np.float64))
    want = a.min() if float(p) == -np.inf else (a ** float(p)).sum() ** (1.0 / float(p))
    max_norm = want / 2
    total = clip_grad_norm_(model, max_norm, norm_type=p)
    assert abs(total - want) <= 2e-7 * want
    np.testing.assert_array_equal(flat_grads(model), g * coefficient(max_norm, total))
    # one zero gradient makes them 0 (|0|^p is inf), and nothing is scaled
    g[7] = 0.0
    set_flat_grads(model, g)
    assert clip_grad_norm_(model, 1e-3, norm_type=p) == 0.0
    np.testing.assert_array_equal(flat_grads(model), g)


def test_norm_type_0_counts_the_tensors_with_a_gradient_as_torch_does():
    """torch's clip_grad_norm_ takes each tensor's 0-norm (its nonzero count) and then the 0-norm
    of those: the number of weight and bias tensors whose gradient is not all zeros."""
    model = cmlp.MLP(SIZES, seed=0)
    random_grads(model, 2)
    grads = model.grads()
    assert clip_grad_norm_(model, 100.0, norm_type=0) == 6.0
    grads["fc2.bias"][:] = 0.0
    grads["fc1.weight"][:] = 0.0
    grads["fc1.weight"][3, 4] = np.nan  # a NaN is not zero
    grads["fc3.weight"][:] = 0.0
    flat = np.concatenate([grads[k].ravel() for k in ("fc1.weight", "fc2.weight", "fc3.weight",
                                                      "fc1.bias", "fc2.bias", "fc3.bias")])
    set_flat_grads(model, flat)
    assert clip_grad_norm_(model, 100.0, norm_type=0.0) == 4.0  # 4 < 100: nothing scaled
    np.testing.assert_array_equal(by_name(model), np.concatenate([v.ravel() for v in grads.values()]))
    total = clip_grad_norm_(model, 2.0, norm_type=0)
    assert total == 4.0
    np.testing.assert_array_equal(flat_grads(model), flat * coefficient(2.0, 4.0))
    set_flat_grads(model, np.zeros(model.num_parameters(), np.float32))
    assert clip_grad_norm_(model, 1.0, norm_type=0) == 0.0


def test_torch_gives_the_same_norm_for_every_norm_type():
    torch = pytest.importorskip("torch")
    mine = cmlp.MLP(SIZES, seed=0)
    g = random_grads(mine, 3)
    for case in ("no zeros", "zeros"):
        if case == "zeros":  # the negative norms are 0; the 0-norm counts 4 tensors
            g[11] = 0.0
            g[-1] = 0.0
            set_flat_grads(mine, g)
        grads = mine.grads()
        if case == "zeros":
            for k in ("fc2.bias", "fc3.weight"):
                grads[k][:] = 0.0
        check_against_torch(torch, mine, grads)


def check_against_torch(torch, mine, grads):
    flat = np.concatenate([grads[k].ravel() for k in ("fc1.weight", "fc2.weight", "fc3.weight",
                                                      "fc1.bias", "fc2.bias", "fc3.bias")])
    for p in (0, 0.0, -np.inf, -1.0, -2.5, 0.5, 3.0, np.inf):
        set_flat_grads(mine, flat)
        params = [torch.zeros(v.shape, dtype=torch.float32, requires_grad=True) for v in grads.values()]
        for t, value in zip(params, grads.values()):
            t.grad = torch.from_numpy(value.copy())
        total = float(torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=p))
        got = clip_grad_norm_(mine, 0.5, norm_type=p)
        assert got == pytest.approx(total, rel=1e-6), p
        np.testing.assert_allclose(by_name(mine), np.concatenate([t.grad.numpy().ravel() for t in params]),
                                   rtol=2e-6, atol=1e-12, err_msg=str(p))


def test_torch_gives_the_same_norm_and_gradients():
    torch = pytest.importorskip("torch")
    model = with_grads(seed=3)
    grads = model.grads()
    params = [torch.zeros(value.shape, dtype=torch.float32, requires_grad=True) for value in grads.values()]
    for p in (2.0, 1.0, float("inf")):
        want = reference_norm(flat_grads(model), p)
        mine = with_grads(seed=3)
        for t, value in zip(params, grads.values()):
            t.grad = torch.from_numpy(value.copy())
        total = torch.nn.utils.clip_grad_norm_(params, want / 4, norm_type=p)
        got = clip_grad_norm_(mine.parameters(), want / 4, norm_type=p)
        assert got == pytest.approx(float(total), rel=1e-6)
        clipped = np.concatenate([t.grad.numpy().ravel() for t in params])
        np.testing.assert_allclose(by_name(mine), clipped, rtol=2e-6, atol=1e-12)
    torch.nn.utils.clip_grad_value_(params, 1e-3)
    clip_grad_value_(mine, 1e-3)
    np.testing.assert_allclose(by_name(mine), np.concatenate([t.grad.numpy().ravel() for t in params]),
                               rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("max_norm", [1.0, 1e3])
def test_a_norm_above_2_to_the_126_scales_as_torchs_subnormal_coefficient(max_norm):
    """1 / (norm + 1e-6) is subnormal in float32 when the norm passes 2^126 (about 8.5e37); torch
    keeps subnormals, and so does the coefficient here (the core flushes them elsewhere): the
    gradients are torch's, but for products that are themselves subnormal, which are 0."""
    model = with_grads(seed=5)
    g = flat_grads(model)
    factor = 2e38 / reference_norm(g, 2.0)
    for f in (1e19, factor / 1e19):  # g *= f in float32, twice (the factor itself is no float32)
        model._c.unscale_grads(float(np.float32(f)))
    g = flat_grads(model)
    total = clip_grad_norm_(model, max_norm)
    assert total == pytest.approx(2e38, rel=1e-5)
    with np.errstate(under="ignore"):
        c = coefficient(max_norm, total)
        want = g * c
    assert 0 < np.float32(1) / np.float32(total) < np.finfo(np.float32).tiny and c > 0
    want[np.abs(want) < np.finfo(np.float32).tiny] *= 0  # flushed, with its sign
    got = flat_grads(model)
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(got) > got.size // 2
    torch = pytest.importorskip("torch")
    grad = torch.from_numpy(g.copy())
    param = torch.zeros(g.shape, dtype=torch.float32, requires_grad=True)
    param.grad = grad
    torch.nn.utils.clip_grad_norm_([param], max_norm)
    theirs = param.grad.numpy()
    normal = np.abs(theirs) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got[normal], theirs[normal])


def test_parameters_stand_for_the_model_where_torch_code_passes_them():
    model = cmlp.MLP(SIZES, seed=0)
    ps = model.parameters()
    assert len(ps) == 6 and [a.shape for a in ps] == [a.shape for a in model.state_dict().values()]
    assert sum(a.size for a in model.parameters()) == model.num_parameters()
    assert [n for n, _ in model.named_parameters()] == list(model.state_dict())
    a = cmlp.MLP(SIZES, seed=0)
    b = cmlp.MLP(SIZES, seed=0)
    oa, ob = cmlp.optim.Adam(a.parameters(), lr=1e-2), cmlp.optim.Adam(b, lr=1e-2)
    assert oa.model is a
    x, y = batch()
    for m, o in ((a, oa), (b, ob)):
        o.zero_grad()
        m.forward_backward(x, y)
        o.step()
    np.testing.assert_array_equal(a._c.get_params(), b._c.get_params())
    with pytest.raises(TypeError, match="cmlp.MLP"):
        cmlp.optim.SGD([np.zeros(3)], lr=0.1)


# ---- the trainer ----

def hand_step(model, opt, x, y, max_norm, accum=1, scaler=None):
    """One step as a torch user writes it: accumulate, unscale, clip, step."""
    opt.zero_grad()
    k = len(x) // accum
    for i in range(accum):
        scale = scaler.get_scale() if scaler else 1.0
        model.forward_backward(x[i * k:(i + 1) * k], y[i * k:(i + 1) * k], loss_scale=scale / accum,
                               amp="fp16" if scaler else None)
    if scaler:
        scaler.unscale_(opt)
    norm = clip_grad_norm_(model.parameters(), max_norm)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return norm


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_trainer_step_clips_as_the_hand_written_loop_does(accum, opt):
    def make():
        m = cmlp.MLP(SIZES, seed=1)
        o = cmlp.optim.Adam(m, lr=1e-2) if opt == "adam" else cmlp.optim.SGD(m, lr=0.1, momentum=0.9)
        return m, o

    a, oa = make()
    b, ob = make()
    trainer = cmlp.Trainer(a, oa, batch_size=24 // accum, accumulation_steps=accum, max_grad_norm=0.05)
    assert trainer.last_grad_norm is None
    for step in range(4):
        x, y = batch(seed=step)
        trainer.step(x, y)
        norm = hand_step(b, ob, x, y, 0.05, accum)
        assert trainer.last_grad_norm == norm and norm > 0.05  # clipped every time
        np.testing.assert_array_equal(a._c.get_params(), b._c.get_params())


def test_trainer_step_under_fp16_unscales_before_clipping():
    a, b = cmlp.MLP(SIZES, seed=2), cmlp.MLP(SIZES, seed=2)
    oa, ob = cmlp.optim.Adam(a, lr=1e-2), cmlp.optim.Adam(b, lr=1e-2)
    trainer = cmlp.Trainer(a, oa, batch_size=24, amp="fp16", scaler=cmlp.amp.GradScaler(init_scale=2.0**28),
                           max_grad_norm=0.05)
    scaler = cmlp.amp.GradScaler(init_scale=2.0**28)
    for step in range(16):  # the first steps overflow and are skipped, then the scale fits
        x, y = batch(seed=step)
        trainer.step(x, y)
        hand_step(b, ob, x, y, 0.05, scaler=scaler)
        np.testing.assert_allclose(a._c.get_params(), b._c.get_params(), rtol=0, atol=1e-6)
    assert trainer.scaler.get_scale() == scaler.get_scale() < 2.0**28
    assert trainer._c.skipped_steps() > 0
    assert 0 < trainer.last_grad_norm < 100  # the unscaled norm


def fit(max_grad_norm, amp=None, **kw):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((300, F)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((F, C)), axis=1)
    model = cmlp.MLP(SIZES, seed=4)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-2), batch_size=32, amp=amp,
                           max_grad_norm=max_grad_norm, **kw)
    history = trainer.fit(x, y, epochs=2, progress=False)
    return model, trainer, history


def test_fit_reports_the_mean_norm_and_a_loose_bound_changes_nothing():
    plain, _, h0 = fit(None)
    assert all(h["grad_norm"] is None for h in h0)
    loose, t1, h1 = fit(1e30)
    np.testing.assert_array_equal(plain._c.get_params(), loose._c.get_params())
    assert all(h["grad_norm"] > 0 for h in h1) and t1.last_grad_norm > 0
    tight, _, h2 = fit(0.05)
    assert not np.array_equal(plain._c.get_params(), tight._c.get_params())
    assert h2[0]["grad_norm"] > 0.05


def test_fit_with_clipping_equals_the_same_steps_by_hand():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((96, F)).astype(np.float32)
    y = rng.integers(0, C, size=96)
    a, b = cmlp.MLP(SIZES, seed=4), cmlp.MLP(SIZES, seed=4)
    oa, ob = cmlp.optim.Adam(a, lr=1e-2), cmlp.optim.Adam(b, lr=1e-2)
    history = cmlp.Trainer(a, oa, batch_size=32, shuffle=False, max_grad_norm=0.1).fit(x, y, epochs=1,
                                                                                       progress=False)
    norms = [hand_step(b, ob, x[i:i + 32], y[i:i + 32], 0.1) for i in range(0, 96, 32)]
    np.testing.assert_array_equal(a._c.get_params(), b._c.get_params())
    assert history[0]["grad_norm"] == pytest.approx(np.mean(norms), rel=1e-12)


def test_micro_batches_under_a_memory_limit_clip_the_whole_steps_gradients():
    plain, _, h0 = fit(0.05, shuffle=False)
    del _
    gc.collect()  # what earlier tests left in cycles is freed now, not inside the run under the limit
    cmlp.memory.empty_cache("cpu")
    # the cache keeps room for a run in micro-batches of 4 and no new segment may be made
    filler = fill_cache_but("cpu", room_for(cmlp.memory.plan(SIZES, 4, "adam", accumulation_steps=8)))
    try:
        cmlp.memory.set_memory_limit(cmlp.memory.memory_allocated("cpu"), "cpu")
        with pytest.warns(cmlp.MemoryWarning, match="micro-batches of 4, not 32"):
            split, t, h1 = fit(0.05, shuffle=False)
    finally:
        cmlp.memory.set_memory_limit(None, "cpu")
        for ptr in filler:
            cmlp.memory.caching_allocator_delete(ptr)
    assert h1[-1]["microbatch_size"] < 32
    np.testing.assert_allclose(split._c.get_params(), plain._c.get_params(), rtol=0, atol=1e-5)
    assert h1[0]["grad_norm"] == pytest.approx(h0[0]["grad_norm"], rel=1e-5)


def test_max_grad_norm_is_checked():
    model = cmlp.MLP(SIZES)
    opt = cmlp.optim.Adam(model)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_grad_norm"):
            cmlp.Trainer(model, opt, max_grad_norm=bad)
    with pytest.raises(TypeError, match="max_grad_norm"):
        cmlp.Trainer(model, opt, max_grad_norm="1")


def test_get_total_norm_and_clip_grads_with_norm_are_clip_grad_norm_in_two_steps():
    """torch 2.6's split of clip_grad_norm_: get_total_norm (nothing changes) and
    clip_grads_with_norm_ give what clip_grad_norm_ gives, for every norm type."""
    for p in (2.0, 1.0, np.inf, -np.inf, 0, -1.5, 3.0):
        one, two = with_grads(seed=5), with_grads(seed=5)
        g = flat_grads(two)
        total = cmlp.nn.utils.get_total_norm(two.parameters(), p)
        np.testing.assert_array_equal(flat_grads(two), g)
        want = clip_grad_norm_(one, 0.01, norm_type=p)
        assert total == want or (np.isnan(total) and np.isnan(want))
        cmlp.nn.utils.clip_grads_with_norm_(two, 0.01, total)
        np.testing.assert_array_equal(flat_grads(two), flat_grads(one))
    # arrays: the norm of the arrays' float64 norms, as torch's
    grads = list(with_grads(seed=5).grads().values())
    for p in (2.0, np.inf, 0):
        norms = [reference_norm(a.ravel(), p) if p else np.count_nonzero(a) for a in grads]
        want = reference_norm(np.asarray(norms), p) if p else np.count_nonzero(norms)
        assert cmlp.nn.utils.get_total_norm(grads, p) == pytest.approx(want, rel=1e-12)
    with pytest.raises(RuntimeError, match=r"is non-finite \(nan\), so it cannot be clipped; set error_if_nonfinite=False"):
        cmlp.nn.utils.get_total_norm([np.array([1.0, np.nan])], error_if_nonfinite=True)
    model = nan_grads()
    g = flat_grads(model)
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        cmlp.nn.utils.get_total_norm(model, error_if_nonfinite=True)
    np.testing.assert_array_equal(flat_grads(model), g)
    with pytest.raises(ValueError, match="max_norm"):
        cmlp.nn.utils.clip_grads_with_norm_(model, -1.0, 2.0)
    with pytest.raises(TypeError, match="total_norm"):
        cmlp.nn.utils.clip_grads_with_norm_(model, 1.0, "2")
    with pytest.raises(ValueError, match=r"total_norm must be >= 0"):
        cmlp.nn.utils.clip_grads_with_norm_(model, 1.0, -1.0)
    np.testing.assert_array_equal(flat_grads(model), g)
    with pytest.warns(FutureWarning, match="clip_grad_norm_"):
        assert np.isnan(cmlp.nn.utils.clip_grad_norm(model, 1.0))


def test_torchs_split_clipping_gives_the_same_gradients():
    torch = pytest.importorskip("torch")
    model = with_grads(seed=6)
    grads = model.grads()
    params = [torch.zeros(v.shape, dtype=torch.float32, requires_grad=True) for v in grads.values()]
    for t, v in zip(params, grads.values()):
        t.grad = torch.from_numpy(v.copy())
    total = torch.nn.utils.get_total_norm([t.grad for t in params], 2.0)
    assert cmlp.nn.utils.get_total_norm(model) == pytest.approx(float(total), rel=1e-6)
    assert cmlp.nn.utils.get_total_norm(list(grads.values())) == pytest.approx(float(total), rel=1e-6)
    torch.nn.utils.clip_grads_with_norm_(params, 0.05, total)
    cmlp.nn.utils.clip_grads_with_norm_(model, 0.05, float(total))
    np.testing.assert_allclose(by_name(model), np.concatenate([t.grad.numpy().ravel() for t in params]),
                               rtol=2e-6, atol=1e-12)
