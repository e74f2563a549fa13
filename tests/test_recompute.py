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


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_recompute_under_amp_gives_the_same_training_and_less_memory(amp):
    sizes = [64, 128, 128, 128, 128, 10]
    rng = np.random.default_rng(7)
    x = rng.random((160, 64), dtype=np.float32)
    y = rng.integers(0, 10, 160)
    out = []
    for recompute in (False, True):
        model = cmlp.MLP(sizes, seed=2)
        cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=32, amp=amp, recompute=recompute,
                     shuffle=False).fit(x, y, epochs=1, progress=False)
        out.append(model.state_dict())
    for k in out[0]:
        np.testing.assert_array_equal(out[1][k], out[0][k], err_msg=k)
    stored = M.plan(sizes, 4096, amp=amp)
    recomputed = M.plan(sizes, 4096, amp=amp, recompute=True)
    assert recomputed.breakdown["activations"] < 0.5 * stored.breakdown["activations"]
    assert recomputed.peak_bytes < stored.peak_bytes
