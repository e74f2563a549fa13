"""Gradient accumulation and micro-batching: one optimizer step over an effective batch must
equal one step on the whole batch, however it is split (each micro-batch
contributes the sum of its per-sample gradients / N).

Parameters after the step are compared with norm-wise relative tolerance 1e-6 against the
unsplit cmlp step and against the float64 reference. The common "accumulation" recipe (one
micro-batch run K times) must be detected as different.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from reference import RefAdam, RefMLP, RefSGD, draw_batch, rel_err  # noqa: E402

import cmlp  # noqa: E402

DEVICE = os.environ.get("CMLP_TEST_DEVICE", "cpu")
SIZES = [20, 32, 16, 5]
SEED = 3
TOL = 1e-6
MARGIN = 1e-4

# SGD without momentum sees the gradient's scale and direction; Adam's first step is nearly
# scale-free, so it checks the direction. eps=1e-6 keeps Adam's g / (|g| + eps) from turning
# float32 rounding of near-zero gradient entries into O(lr) differences.
OPTIMIZERS = {
    "sgd": (lambda m: cmlp.optim.SGD(m, lr=0.1), lambda: RefSGD(lr=0.1)),
    "adam": (lambda m: cmlp.optim.Adam(m, lr=1e-3, eps=1e-6), lambda: RefAdam(lr=1e-3, eps=1e-6)),
}


def fresh(kind):
    model = cmlp.MLP(SIZES, device=DEVICE, seed=SEED)
    return model, OPTIMIZERS[kind][0](model)


def start_params():
    return {k: v.astype(np.float64) for k, v in cmlp.MLP(SIZES, device=DEVICE, seed=SEED)
            .state_dict().items()}


def batch(n, seed=0):
    ref = RefMLP(SIZES, start_params())
    return draw_batch(ref, np.random.default_rng(seed), n, MARGIN)


def reference_step(kind, x, y):
    """Parameters after one float64 optimizer step on the whole batch, and the batch's loss."""
    ref = RefMLP(SIZES, start_params())
    loss, grads = ref.loss_and_grads(x, y)
    OPTIMIZERS[kind][1]().step(ref.params, grads)
    return ref.params, loss


def trainer_step(kind, x, y, **trainer_kwargs):
    model, opt = fresh(kind)
    trainer = cmlp.Trainer(model, opt, shuffle=False, **trainer_kwargs)
    loss = trainer.step(x, y)
    return model.state_dict(), loss, trainer


def manual_step(kind, x, y, parts, scales):
    """zero_grad, forward_backward on each part with its loss_scale, one opt.step()."""
    model, opt = fresh(kind)
    model.zero_grad()
    for part, scale in zip(parts, scales):
        model.forward_backward(x[part], y[part], loss_scale=scale)
    opt.step()
    return model.state_dict()


def max_rel_err(a, b):
    return max(rel_err(a[k], b[k]) for k in b)


def assert_same_step(got, expected, what):
    err = max_rel_err(got, expected)
    assert err < TOL, "%s: max relative error %.3g" % (what, err)


def assert_step_is_visible(expected):
    """The step must move the parameters far beyond TOL, or equality proves nothing."""
    assert max_rel_err(expected, start_params()) > 100 * TOL


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_accumulation_equals_one_big_batch(kind):
    x, y = batch(64)
    expected, ref_loss = reference_step(kind, x, y)
    assert_step_is_visible(expected)

    acc, loss, trainer = trainer_step(kind, x, y, batch_size=16, accumulation_steps=4)
    assert isinstance(loss, float)
    assert loss == pytest.approx(ref_loss, rel=1e-5)  # mean loss of the effective batch
    assert_same_step(acc, expected, "Trainer(batch_size=16, accumulation_steps=4) vs reference")

    big, loss_big, _ = trainer_step(kind, x, y, batch_size=64, accumulation_steps=1)
    assert loss_big == pytest.approx(ref_loss, rel=1e-5)
    assert_same_step(big, expected, "Trainer(batch_size=64) vs reference")
    assert_same_step(acc, big, "accumulated vs unsplit Trainer")

    parts = [slice(16 * k, 16 * (k + 1)) for k in range(4)]
    manual = manual_step(kind, x, y, parts, [16 / 64] * 4)
    assert_same_step(manual, big, "manual accumulation (loss_scale = n_k / N) vs unsplit")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("n, micro, sizes", [(64, 24, [24, 24, 16]), (50, 16, [16, 16, 16, 2])])
def test_uneven_microbatches_equal_unsplit_step(kind, n, micro, sizes):
    x, y = batch(n, seed=1)
    expected, ref_loss = reference_step(kind, x, y)

    split, loss, trainer = trainer_step(kind, x, y, batch_size=n, microbatch_size=micro)
    assert trainer.microbatch_size == micro
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    unsplit, _, _ = trainer_step(kind, x, y, batch_size=n)
    assert_same_step(split, unsplit, "micro-batches %s vs unsplit" % sizes)
    assert_same_step(split, expected, "micro-batches %s vs reference" % sizes)

    bounds = np.cumsum([0] + sizes)
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    manual = manual_step(kind, x, y, parts, [s / n for s in sizes])
    assert_same_step(manual, unsplit, "manual %s with loss_scale n_k / N" % sizes)


def test_dividing_by_k_is_wrong_for_uneven_splits():
    """With 24+24+16, weighting each micro-batch by 1/K instead of n_k/N changes the step;
    this is what the exact comparisons above would catch."""
    x, y = batch(64, seed=1)
    parts = [slice(0, 24), slice(24, 48), slice(48, 64)]
    exact = manual_step("sgd", x, y, parts, [24 / 64, 24 / 64, 16 / 64])
    by_k = manual_step("sgd", x, y, parts, [1 / 3] * 3)
    assert max_rel_err(by_k, exact) > 100 * TOL


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_rerunning_one_microbatch_is_not_accumulation(kind):
    """The common recipe: K backward passes over the SAME micro-batch, loss / K."""
    x, y = batch(64)
    big, _, _ = trainer_step(kind, x, y, batch_size=64)
    same = manual_step(kind, x, y, [slice(0, 16)] * 4, [1 / 4] * 4)
    assert max_rel_err(same, big) > 100 * TOL


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_consecutive_accumulated_steps(kind):
    """Two Trainer steps in a row: the second must start from zeroed gradients."""
    model, opt = fresh(kind)
    trainer = cmlp.Trainer(model, opt, batch_size=16, accumulation_steps=4, shuffle=False)
    ref = RefMLP(SIZES, start_params())
    ref_opt = OPTIMIZERS[kind][1]()
    for step in range(2):
        x, y = draw_batch(ref, np.random.default_rng(10 + step), 64, MARGIN)
        ref_loss, grads = ref.loss_and_grads(x, y)
        ref_opt.step(ref.params, grads)
        assert trainer.step(x, y) == pytest.approx(ref_loss, rel=1e-5)
    assert_same_step(model.state_dict(), ref.params, "two accumulated steps vs reference")
