"""cmlp's forward, loss and gradients against the float64 NumPy reference (tests/reference.py).

Tolerances: logits, loss and every gradient tensor within 1e-5 norm-wise relative error of the
reference. Inputs are drawn so that no ReLU pre-activation lies within 1e-4 of zero, so float32
rounding cannot flip a ReLU and the comparison measures rounding only.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from reference import RefMLP, draw_batch, layer_names, rel_err  # noqa: E402

import cmlp  # noqa: E402

DEVICE = os.environ.get("CMLP_TEST_DEVICE", "cpu")
TOL = 1e-5
MARGIN = 1e-4
CONFIGS = [[784, 512, 256, 10], [5, 3], [7, 16, 16, 16, 4], [1, 1]]
BATCHES = [1, 3, 32]


def sizes_id(sizes):
    return "-".join(map(str, sizes))


def make_case(sizes, n, seed=0):
    """A cmlp model, the reference holding the same parameters, and a batch (x, y)."""
    model = cmlp.MLP(sizes, device=DEVICE, seed=seed)
    ref = RefMLP(sizes, model.state_dict())
    x, y = draw_batch(ref, np.random.default_rng(100 + seed), n, MARGIN)
    return model, ref, x, y


def assert_loss_close(loss, expected):
    assert isinstance(loss, float)
    assert abs(loss - expected) <= TOL * abs(expected) + 1e-7, (loss, expected)


def assert_grads_close(grads, expected, tol=TOL):
    assert sorted(grads) == sorted(expected)
    for name, g in grads.items():
        assert g.dtype == np.float32, name
        assert g.shape == expected[name].shape, name
        err = rel_err(g, expected[name])
        assert err < tol, "%s: relative error %.3g" % (name, err)


@pytest.mark.parametrize("sizes", CONFIGS, ids=sizes_id)
def test_state_dict_layout(sizes):
    model = cmlp.MLP(sizes, device=DEVICE, seed=0)
    sd = model.state_dict()
    assert list(sd) == layer_names(len(sizes) - 1)
    for i in range(len(sizes) - 1):
        w, b = sd["fc%d.weight" % (i + 1)], sd["fc%d.bias" % (i + 1)]
        assert w.shape == (sizes[i + 1], sizes[i]) and b.shape == (sizes[i + 1],)
        assert w.dtype == np.float32 and b.dtype == np.float32
    assert tuple(model.layer_sizes) == tuple(sizes)
    assert model.num_parameters() == sum(v.size for v in sd.values())


@pytest.mark.parametrize("n", BATCHES)
@pytest.mark.parametrize("sizes", CONFIGS, ids=sizes_id)
def test_forward(sizes, n):
    model, ref, x, _ = make_case(sizes, n)
    logits = model(x)
    assert isinstance(logits, np.ndarray)
    assert logits.dtype == np.float32 and logits.shape == (n, sizes[-1])
    err = rel_err(logits, ref.forward(x))
    assert err < TOL, err
    np.testing.assert_array_equal(model.forward(x), logits)


@pytest.mark.parametrize("n", BATCHES)
@pytest.mark.parametrize("sizes", CONFIGS, ids=sizes_id)
def test_forward_backward(sizes, n):
    model, ref, x, y = make_case(sizes, n)
    model.zero_grad()
    loss = model.forward_backward(x, y)
    ref_loss, ref_grads = ref.loss_and_grads(x, y)
    assert_loss_close(loss, ref_loss)
    assert_grads_close(model.grads(), ref_grads)
    assert list(model.grads()) == list(model.state_dict())


@pytest.mark.parametrize("n", [1, 32, 500])
@pytest.mark.parametrize("sizes", CONFIGS, ids=sizes_id)
def test_a_trainer_step_leaves_the_gradients_of_its_batch(sizes, n):
    """A step alone in its optimizer step may keep its layer outputs and the gradients between
    layers in the first layer's weight gradient, which it writes last (the reference model at 1
    and 32 rows, not at 500): afterwards model.grads() holds the batch's gradients all the same,
    and the step before it left nothing behind that changes them."""
    model, ref, x, y = make_case(sizes, n)
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.0), batch_size=n, shuffle=False)
    for _ in range(2):
        loss = trainer.step(x, y)
        ref_loss, ref_grads = ref.loss_and_grads(x, y)
        assert_loss_close(loss, ref_loss)
        assert_grads_close(model.grads(), ref_grads)


@pytest.mark.parametrize("depth", [57, 61])
def test_a_deep_model_steps_alike_whether_or_not_its_buffers_share_the_gradients(depth):
    """A step's buffers go into the first layer's weight gradient only while a mask of 64 pieces
    can list them: 57 hidden layers of 4 after one of 64 (63 pieces) do, 61 (67 pieces) do not.
    Either way the step leaves the batch's gradients."""
    sizes = [64, 64] + [4] * depth + [3]
    assert (cmlp.memory.plan(sizes, 2).in_gradients > 0) == (depth == 57)
    model, ref, x, y = make_case(sizes, 2)
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.0), batch_size=2, shuffle=False)
    loss = trainer.step(x, y)
    ref_loss, ref_grads = ref.loss_and_grads(x, y)
    assert_loss_close(loss, ref_loss)
    assert_grads_close(model.grads(), ref_grads)


@pytest.mark.parametrize("scale", [8.0, 0.1, 1024.0])
def test_loss_scale_multiplies_gradients(scale):
    model, ref, x, y = make_case([7, 16, 16, 16, 4], 32, seed=1)
    model.zero_grad()
    loss = model.forward_backward(x, y, loss_scale=scale)
    ref_loss, ref_grads = ref.loss_and_grads(x, y, loss_scale=scale)
    assert_loss_close(loss, ref_loss)  # the returned loss is unscaled
    assert_grads_close(model.grads(), ref_grads)


def test_gradients_add_across_calls_and_zero_grad_clears():
    sizes = [7, 16, 16, 16, 4]
    model, ref, x1, y1 = make_case(sizes, 32, seed=2)
    x2, y2 = draw_batch(ref, np.random.default_rng(7), 5, MARGIN)
    _, g1 = ref.loss_and_grads(x1, y1)
    _, g2 = ref.loss_and_grads(x2, y2, loss_scale=0.5)

    model.zero_grad()
    model.forward_backward(x1, y1)
    model.forward_backward(x2, y2, loss_scale=0.5)
    assert_grads_close(model.grads(), {k: g1[k] + g2[k] for k in g1})

    model.zero_grad()
    for name, g in model.grads().items():
        assert not g.any(), name
    model.forward_backward(x2, y2, loss_scale=0.5)
    assert_grads_close(model.grads(), g2)


def test_grads_returns_copies():
    model, _, x, y = make_case([5, 3], 4)
    model.zero_grad()
    model.forward_backward(x, y)
    before = model.grads()
    mutated = model.grads()
    for g in mutated.values():
        g[...] = 123.0
    for name, g in model.grads().items():
        np.testing.assert_array_equal(g, before[name])


@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
@pytest.mark.parametrize("sizes", [[784, 512, 256, 10], [7, 16, 16, 16, 4]], ids=sizes_id)
def test_label_smoothing(sizes, label_smoothing):
    model, ref, x, y = make_case(sizes, 32, seed=3)
    model.zero_grad()
    loss = model.forward_backward(x, y, label_smoothing=label_smoothing)
    ref_loss, ref_grads = ref.loss_and_grads(x, y, label_smoothing=label_smoothing)
    assert_loss_close(loss, ref_loss)
    assert_grads_close(model.grads(), ref_grads)


def test_finite_differences_of_cmlp_itself():
    """cmlp's analytic gradient against central differences of cmlp's own float32 loss.

    h = 1e-2 keeps float32 rounding of the loss (~1e-7) small against 2h; inputs keep every
    ReLU at least 0.2 from its kink, and coordinates whose +-h step would still change a ReLU
    (checked with the reference) are skipped. Coordinates are chosen among the larger gradient
    entries so that the difference quotient is not dominated by rounding.
    """
    sizes, h = [4, 6, 5, 3], 1e-2
    model = cmlp.MLP(sizes, device=DEVICE, seed=4)
    ref = RefMLP(sizes, model.state_dict())
    x, y = draw_batch(ref, np.random.default_rng(5), 8, margin=0.2)
    base = model.state_dict()
    model.zero_grad()
    model.forward_backward(x, y)
    grads = model.grads()

    def cmlp_loss(params):
        model.load_state_dict(params)
        model.zero_grad()
        return model.forward_backward(x, y)

    def relu_pattern(params):
        return [z > 0 for z in RefMLP(sizes, params).preactivations(x)]

    rng = np.random.default_rng(6)
    pattern = relu_pattern(base)
    checked = 0
    for name in ref.names:
        g = grads[name]
        candidates = np.argwhere(np.abs(g) >= 0.1 * np.abs(g).max())
        for idx in candidates[rng.permutation(len(candidates))[:3]]:
            idx = tuple(idx)
            plus = {k: v.copy() for k, v in base.items()}
            minus = {k: v.copy() for k, v in base.items()}
            plus[name][idx] += np.float32(h)
            minus[name][idx] -= np.float32(h)
            if any((a != b).any() for p in (plus, minus)
                   for a, b in zip(relu_pattern(p), pattern)):
                continue
            step = float(plus[name][idx]) - float(minus[name][idx])
            fd = (cmlp_loss(plus) - cmlp_loss(minus)) / step
            assert abs(fd - g[idx]) <= 2e-2 * abs(g[idx]), (name, idx, fd, g[idx])
            checked += 1
    model.load_state_dict(base)
    assert checked >= 2 * len(ref.names)


@pytest.mark.parametrize("sizes", [[784, 512, 256, 10], [7, 16, 16, 16, 4]], ids=sizes_id)
def test_predict_is_int64_argmax(sizes):
    model, _, x, _ = make_case(sizes, 50, seed=5)
    labels = model.predict(x)
    assert isinstance(labels, np.ndarray)
    assert labels.dtype == np.int64 and labels.shape == (50,)
    np.testing.assert_array_equal(labels, np.argmax(model(x), axis=1))


@pytest.mark.parametrize("sizes", [[784, 512, 256, 10], [7, 16, 16, 16, 4]], ids=sizes_id)
def test_evaluate(sizes):
    """Loss is the mean over all samples (not a mean of per-chunk means); accuracy a fraction."""
    model, ref, x, y = make_case(sizes, 100, seed=6)
    # labels the model gets right now and then, so accuracy is not trivially 0
    y[::3] = np.argmax(ref.forward(x[::3]), axis=1)
    expected = ref.evaluate(x, y)
    top2 = np.sort(ref.forward(x), axis=1)[:, -2:]
    ambiguous = int(np.sum(top2[:, 1] - top2[:, 0] < 1e-4))
    for batch_size in (32, 1000):
        out = model.evaluate(x, y, batch_size=batch_size)
        assert out["loss"] == pytest.approx(expected["loss"], rel=TOL)
        assert abs(out["accuracy"] - expected["accuracy"]) <= ambiguous / len(y)
        assert out["accuracy"] == pytest.approx(np.mean(model.predict(x) == y), abs=1e-12)
    assert 0.3 < expected["accuracy"] < 1.0


def test_a_nan_inside_the_network_reaches_the_loss_as_in_torch():
    """torch's ReLU keeps a NaN (relu(nan) is nan), so a network that overflows inside (inf - inf
    in a later layer) gives NaN logits and a NaN loss, not a healthy-looking number; its backward
    passes the gradient at a NaN, as torch's threshold_backward (a NaN is not <= 0)."""
    model = cmlp.MLP([2, 2, 2, 2], seed=0, normalize=(0.0, 1.0))
    model.load_state_dict({
        "fc1.weight": np.array([[1e30, 0], [1e30, 0]], np.float32), "fc1.bias": np.zeros(2, np.float32),
        "fc2.weight": np.array([[1, -1], [0, 0]], np.float32), "fc2.bias": np.zeros(2, np.float32),
        "fc3.weight": np.eye(2, dtype=np.float32), "fc3.bias": np.zeros(2, np.float32)})
    x, y = np.array([[1e10, 0.0]], np.float32), np.array([1])
    logits = model.forward(x)
    assert np.isnan(logits[0, 0])
    assert np.isnan(model.evaluate(x, y)["loss"]) and np.isnan(model.forward_backward(x, y))
    assert np.isnan(model.grads()["fc3.weight"][:, 0]).all()
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2), torch.nn.ReLU(),
                              torch.nn.Linear(2, 2))
    with torch.no_grad():
        for i, layer in zip((1, 2, 3), (net[0], net[2], net[4])):
            layer.weight.copy_(torch.from_numpy(model.state_dict()[f"fc{i}.weight"]))
            layer.bias.copy_(torch.from_numpy(model.state_dict()[f"fc{i}.bias"]))
        theirs = net(torch.from_numpy(x)).numpy()
    assert np.array_equal(np.isnan(theirs), np.isnan(logits))


def test_infinite_and_nan_values_load_and_train_as_in_torch():
    pytest.importorskip("torch")
    from checks import assert_non_finite_values_as_torch
    assert_non_finite_values_as_torch("cpu")


def test_bias_gradients_of_many_rows_keep_their_precision():
    """A bias gradient sums its column over every row of the step: a running float sum over 2**21
    rows of mixed signs was off by 7.5e-4 of the total (fc1.bias here), where torch's cascade
    stays near 1e-6. The columns are summed in double precision and rounded once."""
    sizes, n = [2, 3, 2], 2**21
    rng = np.random.default_rng(21)
    x = rng.standard_normal((n, 2)).astype(np.float32)
    y = rng.integers(0, 2, n)
    model = cmlp.MLP(sizes, device=DEVICE, seed=0)
    ref = RefMLP(sizes, model.state_dict())
    loss = model.forward_backward(x, y)
    ref_loss, ref_grads = ref.loss_and_grads(x, y)
    assert_loss_close(loss, ref_loss)
    grads = model.grads()
    for k in ref_grads:
        assert rel_err(grads[k], ref_grads[k]) <= TOL, k
    # two halves, each adding its sum to the gradient the other left (as accumulation does)
    model.zero_grad()
    for part in (slice(0, n // 2), slice(n // 2, n)):
        model.forward_backward(x[part], y[part], loss_scale=0.5)
    grads = model.grads()
    for k in ref_grads:
        assert rel_err(grads[k], ref_grads[k]) <= TOL, k
