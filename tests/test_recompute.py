"""recompute=True: only each micro-batch's input is kept and layer outputs are recomputed in
backward. The gradients are the same (the same GEMMs in the same order), the memory is less for
networks deeper than the widest layer pair, and the planner knows it."""
import gc

import numpy as np
import pytest

import cmlp

M = cmlp.memory


@pytest.mark.parametrize("sizes", [[784, 512, 256, 10], [5, 3], [20, 64, 32, 16, 8, 4], [30, 40, 40, 40, 40, 5]])
@pytest.mark.parametrize("data", ["float32", "uint8"])
def test_recompute_gives_the_same_training(sizes, data):
    rng = np.random.default_rng(len(sizes))
    x = rng.random((150, sizes[0]), dtype=np.float32)
    if data == "uint8":
        x = (x * 255).astype(np.uint8)
    y = rng.integers(0, sizes[-1], 150)
    out = []
    for recompute in (False, True):
        model = cmlp.MLP(sizes, seed=1)
        trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=32, accumulation_steps=2,
                               recompute=recompute, seed=4)
        trainer.fit(x, y, epochs=2, progress=False)
        out.append((model.state_dict(), model.grads()))
    for k in out[0][0]:
        np.testing.assert_array_equal(out[1][0][k], out[0][0][k], err_msg=k)
        np.testing.assert_array_equal(out[1][1][k], out[0][1][k], err_msg=k)


def _step_bytes(sizes, rows, recompute):
    x = np.zeros((rows, sizes[0]), np.float32)
    y = np.zeros(rows, np.int64)
    gc.collect()
    M.empty_cache("cpu")
    base = M.memory_allocated("cpu")
    M.reset_peak_memory_stats("cpu")
    model = cmlp.MLP(sizes, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01), batch_size=rows, recompute=recompute)
    trainer.step(x, y)
    measured = M.max_memory_allocated("cpu") - base
    planned = M.plan(sizes, rows, "sgd", recompute=recompute)
    return measured, planned.peak_bytes, planned


def test_recompute_uses_less_memory_and_the_planner_knows():
    sizes = [256, 1024, 1024, 1024, 1024, 10]
    stored, stored_plan, splan = _step_bytes(sizes, 2048, False)
    recomputed, recomputed_plan, plan = _step_bytes(sizes, 2048, True)
    assert recomputed < 0.75 * stored
    per_sample = lambda p: p.breakdown["activations"] + p.breakdown["workspace"]  # noqa: E731
    assert per_sample(plan) < 0.55 * per_sample(splan)
    assert abs(stored - stored_plan) <= 0.02 * stored
    assert abs(recomputed - recomputed_plan) <= 0.02 * recomputed
    assert plan.recompute is True and "recompute" in str(plan)


def test_recompute_with_amp_is_refused_clearly():
    model = cmlp.MLP([4, 3], seed=0)
    with pytest.raises(ValueError, match="recompute"):
        cmlp.Trainer(model, cmlp.optim.SGD(model), amp="bf16", recompute=True)
    with pytest.raises(ValueError, match="recompute"):
        M.plan([4, 3], 8, amp="fp16", recompute=True)
