"""Checks the float64 NumPy oracle itself (needs only NumPy): finite differences against its
analytic gradients, and Adam/SGD steps against values computed by hand."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from reference import (RefAdam, RefMLP, RefSGD, draw_batch, finite_difference,  # noqa: E402
                       layer_names, numerical_grads, rel_err)


def tiny_net(sizes, seed):
    rng = np.random.default_rng(seed)
    ref = RefMLP.random(sizes, rng)
    x, y = draw_batch(ref, rng, 5, margin=1e-2)
    return ref, x, y


# ---- forward and loss ----------------------------------------------------------------------

def test_forward_by_hand():
    # 2 -> 2 -> 2: h = relu(W1 x + b1), logits = W2 h + b2
    params = {"fc1.weight": [[1.0, -2.0], [0.5, 0.25]], "fc1.bias": [0.5, -1.0],
              "fc2.weight": [[2.0, 1.0], [-1.0, 3.0]], "fc2.bias": [0.1, -0.2]}
    ref = RefMLP([2, 2, 2], params)
    x = np.array([[1.0, 2.0], [2.0, 0.0]])
    # sample 0: z1 = [1-4+0.5, 0.5+0.5-1] = [-2.5, 0] -> h = [0, 0] -> logits = b2
    # sample 1: z1 = [2+0.5, 1-1] = [2.5, 0] -> h = [2.5, 0] -> [5.1, -2.7]
    np.testing.assert_allclose(ref.forward(x), [[0.1, -0.2], [5.1, -2.7]], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(ref.relu_margin(x), [0.0, 0.0])


def test_no_relu_after_last_layer():
    ref = RefMLP([1, 1], {"fc1.weight": [[2.0]], "fc1.bias": [-1.0]})
    np.testing.assert_array_equal(ref.forward(np.array([[-3.0], [4.0]])), [[-7.0], [7.0]])
    assert ref.relu_margin(np.zeros((2, 1))).tolist() == [np.inf, np.inf]


def test_constructor_checks_names_and_shapes():
    good = {"fc1.weight": np.zeros((3, 2)), "fc1.bias": np.zeros(3)}
    RefMLP([2, 3], good)
    with pytest.raises(ValueError):
        RefMLP([2, 3], {"fc1.weight": np.zeros((2, 3)), "fc1.bias": np.zeros(3)})
    with pytest.raises(ValueError):
        RefMLP([2, 3], {"fc1.weight": np.zeros((3, 2))})
    assert layer_names(2) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_parameters_are_copied_to_float64():
    w = np.ones((3, 2), dtype=np.float32)
    ref = RefMLP([2, 3], {"fc1.weight": w, "fc1.bias": np.zeros(3, dtype=np.float32)})
    assert ref.params["fc1.weight"].dtype == np.float64
    w[0, 0] = 7.0
    assert ref.params["fc1.weight"][0, 0] == 1.0


def test_loss_by_hand():
    ref = RefMLP([2, 3], {"fc1.weight": np.zeros((3, 2)), "fc1.bias": [0.0, 1.0, 2.0]})
    x = np.zeros((2, 2))
    logz = math.log(1 + math.e + math.e ** 2)
    # per-sample loss = log(sum exp) - logit[y]
    assert ref.loss(x, [2, 0]) == pytest.approx(((logz - 2) + (logz - 0)) / 2, rel=1e-14)
    # label smoothing e: loss = (1 - e) nll + e * mean_c(-log p_c)
    e = 0.2
    mean_nll = np.mean([logz - c for c in (0.0, 1.0, 2.0)])
    expected = (1 - e) * ((logz - 2) + logz) / 2 + e * mean_nll
    assert ref.loss(x, [2, 0], label_smoothing=e) == pytest.approx(expected, rel=1e-14)


def test_log_softmax_is_stable():
    ref = RefMLP([1, 2], {"fc1.weight": [[0.0], [0.0]], "fc1.bias": [1000.0, 0.0]})
    x = np.zeros((2, 1))
    loss, grads = ref.loss_and_grads(x, [1, 0])
    assert loss == pytest.approx(500.0, rel=1e-12)  # (1000 + ~0) / 2
    assert all(np.isfinite(g).all() for g in grads.values())
    # d loss / d logits = (softmax - onehot) / N: sample 0 -> (1, -1)/2, sample 1 -> (0, 0)
    np.testing.assert_allclose(grads["fc1.bias"], [0.5, -0.5], atol=1e-15)


def test_evaluate():
    ref = RefMLP([2, 3], {"fc1.weight": [[1.0, 0], [0, 1.0], [0, 0]], "fc1.bias": [0, 0, 0.5]})
    x = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 0.0]])
    y = np.array([0, 0, 2, 1])
    out = ref.evaluate(x, y)
    assert out["accuracy"] == 0.5
    assert out["loss"] == pytest.approx(ref.loss(x, y), rel=1e-15)


# ---- gradients -----------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[3, 2], [3, 4, 2], [4, 5, 3, 3]])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_gradients_match_finite_differences(sizes, label_smoothing):
    ref, x, y = tiny_net(sizes, seed=len(sizes))
    assert ref.relu_margin(x).min() > 1e-3  # steps of 1e-6 cannot cross a ReLU kink

    def fun(p):
        return RefMLP(sizes, p).loss(x, y, label_smoothing)

    loss, grads = ref.loss_and_grads(x, y, label_smoothing=label_smoothing)
    assert loss == pytest.approx(fun(ref.params), rel=1e-15)
    numeric = numerical_grads(fun, ref.params, h=1e-6)
    for name in ref.names:
        assert rel_err(grads[name], numeric[name]) < 1e-7, name
        assert np.linalg.norm(grads[name]) > 0, name


def test_loss_scale_and_sum_reduction():
    ref, x, y = tiny_net([4, 5, 3], seed=1)
    loss, grads = ref.loss_and_grads(x, y)
    loss_s, grads_s = ref.loss_and_grads(x, y, loss_scale=8.0)
    loss_sum, grads_sum = ref.per_sample_grad_sum(x, y)
    assert loss_s == loss  # the returned loss is unscaled
    assert loss_sum == pytest.approx(len(y) * loss, rel=1e-14)
    for name in ref.names:
        np.testing.assert_allclose(grads_s[name], 8.0 * grads[name], rtol=1e-14, atol=0)
        np.testing.assert_allclose(grads_sum[name], len(y) * grads[name], rtol=1e-13, atol=1e-16)


def test_accumulation_identity():
    """sum_k (sum of micro-batch k's per-sample gradients) / N == mean gradient of the batch,
    for uneven micro-batches; weighting each micro-batch by 1/K instead is wrong."""
    rng = np.random.default_rng(2)
    ref = RefMLP.random([6, 8, 4], rng)
    x, y = draw_batch(ref, rng, 10, margin=1e-3)
    _, whole = ref.loss_and_grads(x, y)
    parts = [slice(0, 4), slice(4, 8), slice(8, 10)]
    acc = {k: 0.0 for k in ref.names}
    by_k = {k: 0.0 for k in ref.names}
    for s in parts:
        _, g_sum = ref.per_sample_grad_sum(x[s], y[s])
        _, g_mean = ref.loss_and_grads(x[s], y[s])
        for k in ref.names:
            acc[k] = acc[k] + g_sum[k] / len(y)
            by_k[k] = by_k[k] + g_mean[k] / len(parts)
    for k in ref.names:
        assert rel_err(acc[k], whole[k]) < 1e-14
    assert max(rel_err(by_k[k], whole[k]) for k in ref.names) > 1e-3


def test_finite_difference_helper():
    params = {"a": np.array([1.0, -2.0, 3.0])}

    def fun(p):
        return float((p["a"] ** 3).sum())

    assert finite_difference(fun, params, "a", (1,), 1e-4) == pytest.approx(12.0, rel=1e-8)
    np.testing.assert_allclose(numerical_grads(fun, params, h=1e-5)["a"], [3.0, 12.0, 27.0],
                               rtol=1e-9)
    np.testing.assert_array_equal(params["a"], [1.0, -2.0, 3.0])  # left unchanged


def test_draw_batch_keeps_relu_margin():
    rng = np.random.default_rng(3)
    ref = RefMLP.random([10, 64, 64, 3], rng)
    x, y = draw_batch(ref, rng, 50, margin=1e-2)
    assert x.dtype == np.float32 and x.shape == (50, 10)
    assert y.dtype == np.int64 and y.min() >= 0 and y.max() < 3
    assert ref.relu_margin(x).min() >= 1e-2


# ---- optimizers ----------------------------------------------------------------------------

def test_adam_first_steps_by_hand():
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    p = {"w": np.array([1.0, -1.0])}
    opt = RefAdam(lr=lr)
    opt.step(p, {"w": np.array([0.5, -2.0])})
    # t = 1: m_hat = g, sqrt(v_hat) = |g|, so theta -= lr * g / (|g| + eps)
    expected = [1.0 - lr * 0.5 / (0.5 + eps), -1.0 + lr * 2.0 / (2.0 + eps)]
    np.testing.assert_allclose(p["w"], expected, rtol=1e-15)
    w1 = p["w"].copy()
    opt.step(p, {"w": np.array([-0.25, 1.0])})
    g1, g2 = np.array([0.5, -2.0]), np.array([-0.25, 1.0])
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v = b2 * (1 - b2) * g1 ** 2 + (1 - b2) * g2 ** 2
    expected = w1 - lr / (1 - b1 ** 2) * m / (np.sqrt(v) / math.sqrt(1 - b2 ** 2) + eps)
    np.testing.assert_allclose(p["w"], expected, rtol=1e-15)
    assert opt.t == 2


def test_adam_eps_outside_sqrt_and_l2_weight_decay():
    # eps large enough for its placement to matter: theta -= lr * g' / (|g'| + eps) at t = 1,
    # with g' = g + wd * theta (L2 added to the gradient, not AdamW's decoupled decay)
    lr, eps, wd = 0.01, 0.5, 0.1
    p = {"w": np.array([2.0])}
    opt = RefAdam(lr=lr, betas=(0.8, 0.99), eps=eps, weight_decay=wd)
    opt.step(p, {"w": np.array([0.3])})
    g = 0.3 + wd * 2.0
    assert p["w"][0] == pytest.approx(2.0 - lr * g / (g + eps), rel=1e-15)


def test_adam_state_starts_at_first_step_and_lr_is_used_live():
    opt = RefAdam(lr=1.0)
    assert opt.exp_avg is None and opt.t == 0
    p = {"w": np.array([0.0])}
    opt.lr = 0.0
    opt.step(p, {"w": np.array([1.0])})
    assert p["w"][0] == 0.0 and opt.t == 1


def test_sgd_plain_and_weight_decay():
    p = {"w": np.array([1.0, 2.0])}
    RefSGD(lr=0.5).step(p, {"w": np.array([0.2, -0.4])})
    np.testing.assert_allclose(p["w"], [0.9, 2.2], rtol=1e-15)
    p = {"w": np.array([1.0])}
    RefSGD(lr=0.5, weight_decay=0.1).step(p, {"w": np.array([0.2])})
    assert p["w"][0] == pytest.approx(1.0 - 0.5 * (0.2 + 0.1), rel=1e-15)


def test_sgd_momentum_dampening_by_hand():
    lr, mu, d = 0.1, 0.9, 0.25
    p = {"w": np.array([1.0])}
    opt = RefSGD(lr=lr, momentum=mu, dampening=d)
    opt.step(p, {"w": np.array([2.0])})
    # first step: buffer = g (no dampening)
    assert p["w"][0] == pytest.approx(1.0 - lr * 2.0, rel=1e-15)
    opt.step(p, {"w": np.array([-1.0])})
    buf = mu * 2.0 + (1 - d) * -1.0
    assert p["w"][0] == pytest.approx(1.0 - lr * 2.0 - lr * buf, rel=1e-15)


def test_sgd_nesterov_by_hand():
    lr, mu = 0.1, 0.9
    p = {"w": np.array([1.0])}
    opt = RefSGD(lr=lr, momentum=mu, nesterov=True)
    opt.step(p, {"w": np.array([2.0])})
    # buffer = g; update g + mu * buffer
    assert p["w"][0] == pytest.approx(1.0 - lr * (2.0 + mu * 2.0), rel=1e-15)
    opt.step(p, {"w": np.array([1.0])})
    buf = mu * 2.0 + 1.0
    assert p["w"][0] == pytest.approx(1.0 - lr * 3.8 - lr * (1.0 + mu * buf), rel=1e-15)


def test_optimizer_validation():
    for kwargs in [dict(lr=-1e-3), dict(eps=-1.0), dict(betas=(1.0, 0.999)),
                   dict(betas=(0.9, -0.1)), dict(weight_decay=-0.1)]:
        with pytest.raises(ValueError):
            RefAdam(**kwargs)
    for kwargs in [dict(lr=-0.1), dict(nesterov=True), dict(nesterov=True, momentum=0.9,
                                                               dampening=0.1),
                   dict(momentum=-0.5), dict(weight_decay=-1.0)]:
        with pytest.raises(ValueError):
            RefSGD(**kwargs)
    RefAdam(lr=0.0, betas=(0.0, 0.0), eps=0.0)
    RefSGD(lr=0.0, momentum=0.9, nesterov=True)
