"""cmlp.Trainer: fit's history (keys, values, validation), the progress bar with and without
tqdm, the short last batch (its own step, normalised by its own size), accumulation equal to a
big batch, uint8 normalisation, and the micro-batch size it reports.
"""

import gc
import math
import os
import re
import sys
import warnings

import numpy as np
import pytest

import cmlp

sys.path.insert(0, os.path.dirname(__file__))
from checks import CountedCalls  # noqa: E402

KEYS = {"loss", "val_loss", "val_accuracy", "seconds", "samples_per_second", "peak_memory_bytes",
        "microbatch_size", "skipped_steps", "grad_norm", "lr"}
F, C = 20, 4
SIZES = [F, 32, C]


def teacher_data(n, seed=0):
    """A learnable problem: labels from a fixed random linear teacher."""
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(100).standard_normal((F, C))
    x = rng.standard_normal((n, F)).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int64)


def make(opt="sgd", seed=0, sizes=SIZES, **trainer_kw):
    model = cmlp.MLP(sizes, seed=seed)
    if opt == "sgd":
        optimizer = cmlp.optim.SGD(model, lr=0.1, momentum=0.9)
    else:
        optimizer = cmlp.optim.Adam(model, lr=1e-2)
    return model, optimizer, cmlp.Trainer(model, optimizer, **trainer_kw)


def params(model):
    return np.concatenate([v.ravel() for v in model.state_dict().values()]).astype(np.float64)


def rel_err(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def assert_params_equal(m1, m2):
    for (k, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=k)


# ---- history ----

def test_history_keys_values_and_learning():
    x, y = teacher_data(600)
    vx, vy = teacher_data(200, seed=1)
    model, opt, trainer = make("adam", batch_size=32)
    history = trainer.fit(x, y, epochs=3, validation_data=(vx, vy), progress=False)
    assert isinstance(history, list) and len(history) == 3
    for i, h in enumerate(history):
        assert isinstance(h, dict)
        assert set(h) - {"epoch"} == KEYS, sorted(h)
        if "epoch" in h:
            assert h["epoch"] == i + 1
        assert isinstance(h["loss"], float) and math.isfinite(h["loss"]) and h["loss"] > 0
        assert isinstance(h["val_loss"], float) and math.isfinite(h["val_loss"])
        assert 0.0 <= h["val_accuracy"] <= 1.0
        assert h["seconds"] > 0
        assert h["samples_per_second"] == pytest.approx(600 / h["seconds"], rel=0.01)
        assert isinstance(h["peak_memory_bytes"], int)
        assert h["peak_memory_bytes"] >= 2 * 4 * model.num_parameters()
        assert h["microbatch_size"] == 32
        assert h["skipped_steps"] == 0
    losses = [h["loss"] for h in history]
    assert losses[0] > losses[1] > losses[2], losses
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert history[-1]["val_accuracy"] > 0.7
    ev = model.evaluate(vx, vy)
    assert history[-1]["val_loss"] == pytest.approx(ev["loss"], rel=1e-9)
    assert history[-1]["val_accuracy"] == pytest.approx(ev["accuracy"], rel=1e-12)


def test_history_without_validation_has_none():
    x, y = teacher_data(100)
    _, _, trainer = make(batch_size=16)
    history = trainer.fit(x, y, epochs=2, progress=False)
    assert len(history) == 2
    for h in history:
        assert set(h) - {"epoch"} == KEYS
        assert h["val_loss"] is None and h["val_accuracy"] is None
        assert math.isfinite(h["loss"])


def test_fit_continues_from_where_it_was():
    x, y = teacher_data(200)
    m1, _, t1 = make("adam", batch_size=20)
    t1.fit(x, y, epochs=2, progress=False)
    m2, _, t2 = make("adam", batch_size=20)
    t2.fit(x, y, epochs=1, progress=False)
    t2.fit(x, y, epochs=1, progress=False)
    assert_params_equal(m1, m2)


CHECKPOINT_CASES = [dict(amp=None, sched="step"), dict(amp="fp16", sched="cosine-per-step"),
                    dict(amp="bf16", sched=None, micro=2)]


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=["fp32-steplr", "fp16-cosine-per-step", "bf16-microbatched"])
def test_a_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(case, tmp_path):
    """Three epochs in one go, against two, a checkpoint (the model's, optimizer's, schedule's
    and trainer's state_dicts through pickle, as torch.save would), new objects made from it,
    and a third: the same bits and the same third epoch (its shuffle order, loss scale,
    micro-batch and rates)."""
    import pickle

    x, y = teacher_data(300)
    S = cmlp.optim.lr_scheduler
    interval = "step" if case["sched"] == "cosine-per-step" else "epoch"

    def build():
        model = cmlp.MLP(SIZES, seed=3)
        opt = cmlp.optim.Adam(model, lr=1e-2)
        trainer = cmlp.Trainer(model, opt, batch_size=16, amp=case["amp"], seed=5, grow_interval=15)
        if "micro" in case:  # as automatic micro-batching leaves it after running out of memory: it
            trainer._c.start_microbatch(case["micro"])  # doubles after 15, 30, 45 steps (19 an epoch)
        sched = (S.StepLR(opt, step_size=1, gamma=0.7) if case["sched"] == "step" else
                 S.CosineAnnealingLR(opt, T_max=57) if case["sched"] else None)
        return model, opt, trainer, sched

    model, opt, trainer, sched = build()
    straight = trainer.fit(x, y, epochs=3, progress=False, scheduler=sched, scheduler_interval=interval)
    model2, opt2, trainer2, sched2 = build()
    trainer2.fit(x, y, epochs=2, progress=False, scheduler=sched2, scheduler_interval=interval)
    state = {"model": model2.state_dict(), "optimizer": opt2.state_dict(), "trainer": trainer2.state_dict(),
             "scheduler": sched2.state_dict() if sched2 is not None else None}
    (tmp_path / "ckpt.pkl").write_bytes(pickle.dumps(state))
    state = pickle.loads((tmp_path / "ckpt.pkl").read_bytes())
    model3 = cmlp.MLP(SIZES, seed=99)
    opt3 = cmlp.optim.Adam(model3, lr=1e-2)
    trainer3 = cmlp.Trainer(model3, opt3, batch_size=16, amp=case["amp"], seed=5, grow_interval=15)
    model3.load_state_dict(state["model"])
    opt3.load_state_dict(state["optimizer"])
    trainer3.load_state_dict(state["trainer"])
    sched3 = None
    if case["sched"] == "step":
        sched3 = S.StepLR(opt3, step_size=1, gamma=0.7)
    elif case["sched"]:
        sched3 = S.CosineAnnealingLR(opt3, T_max=57)
    if sched3 is not None:
        sched3.load_state_dict(state["scheduler"])
    # the checkpoint comes 38 steps in: the micro-batch is 8, with 8 good steps toward 16
    assert trainer3.epochs == 2 and trainer3.microbatch_size == (8 if "micro" in case else 16)
    # (at the target, where no growth is due, the count stops at 1)
    assert trainer3.state_dict()["microbatch_good_steps"] == (8 if "micro" in case else 1)
    third = trainer3.fit(x, y, epochs=1, progress=False, scheduler=sched3, scheduler_interval=interval)
    assert_params_equal(model, model3)
    assert third[0]["loss"] == straight[2]["loss"] and third[0]["lr"] == straight[2]["lr"]
    assert third[0]["epoch"] == straight[2]["epoch"] == 3  # the trainer's count, resumed
    assert trainer3.epochs == 3 and opt3.lr == opt.lr and trainer3.state_dict() == trainer.state_dict()
    if trainer.scaler is not None:
        assert trainer3.scaler.state_dict() == trainer.scaler.state_dict()
    # without the trainer's state the third epoch shuffles as the first did: other bits
    model4, opt4, trainer4, sched4 = build()
    model4.load_state_dict(state["model"])
    opt4.load_state_dict(state["optimizer"])
    trainer4.fit(x, y, epochs=1, progress=False)
    assert not np.array_equal(params(model4), params(model))


def test_a_bad_trainer_state_dict_raises_and_changes_nothing():
    x, y = teacher_data(64)
    _, _, trainer = make("adam", batch_size=16, amp="fp16")
    trainer.fit(x, y, epochs=1, progress=False)
    trainer._c.start_microbatch(8)
    good = trainer.state_dict()
    assert good == {"epochs": 1, "microbatch_size": 8, "microbatch_target": 16, "microbatch_good_steps": 0,
                    "microbatch_grown_from": 0, "microbatch_grow_wait": 100, "microbatch_planned": None,
                    "microbatch_limit_cut": None, "in_fit": False, "scaler": good["scaler"],
                    "batch_size": 16, "accumulation_steps": 1} and good["scaler"]["scale"] == 65536.0
    for bad, pattern in ((dict(good, epochs=-1), "epochs"), (dict(good, epochs=1.5), "epochs"),
                         (dict(good, epochs=2**70, microbatch_size=2), "epochs"),
                         (dict(good, microbatch_size=17), "at most batch_size"),
                         (dict(good, microbatch_size=12, microbatch_target=8), "larger than its target"),
                         (dict(good, microbatch_size=0), "microbatch_size"),
                         (dict(good, microbatch_target=2**63), "microbatch_target"),
                         (dict(good, microbatch_good_steps=-1), "good_steps"),
                         (dict(good, microbatch_grown_from=-1), "grown_from"),
                         (dict(good, microbatch_grown_from=8), "grown from"),
                         (dict(good, microbatch_grown_from=2.0), "grown_from"),
                         (dict(good, microbatch_grow_wait=-1), "grow_wait"),
                         (dict(good, microbatch_grow_wait=2**63), "grow_wait"),
                         (dict(good, microbatch_grow_wait=True), "grow_wait"),
                         (dict(good, microbatch_planned={"limit": 0, "batch_rows": [16]}), "limit"),
                         (dict(good, microbatch_planned={"limit": 1 << 20, "batch_rows": [0]}), "batch_rows"),
                         (dict(good, microbatch_planned={"limit": 1 << 20}), "microbatch_planned"),
                         (dict(good, microbatch_planned=[1 << 20, [16]]), "microbatch_planned"),
                         (dict(good, microbatch_limit_cut=17), "limit cut"),
                         (dict(good, microbatch_limit_cut=0), "limit_cut"),
                         (dict(good, in_fit="yes"), "in_fit"),
                         (dict(good, unknown=1), "keys"), (dict(good, batch_size=0), "batch_size"),
                         (dict(good, accumulation_steps=1.0), "accumulation_steps"),
                         (dict(good, batch_size=32, microbatch_size=0), "microbatch_size"),
                         (dict(good, scaler=None), "loss scaler"), ({"epochs": 1}, "keys"), ([], "keys"),
                         (dict(good, microbatch_size=2, scaler={"scale": -1.0}), "scale")):
        with pytest.raises((ValueError, TypeError, KeyError), match=pattern):
            trainer.load_state_dict(bad)
        assert trainer.state_dict() == good
    _, _, plain = make("adam", batch_size=16)
    with pytest.raises(ValueError, match="this trainer has none"):
        plain.load_state_dict(good)
    # a target other than the one the trainer was made with is taken over (set with microbatch_size)
    _, _, other = make("adam", batch_size=16, amp="fp16")
    other.load_state_dict(dict(good, microbatch_size=4, microbatch_target=12))
    assert other.microbatch_size == 4 and other.state_dict()["microbatch_target"] == 12
    # a state_dict of an earlier cmlp, without the micro-batch the last growth started from or the
    # good steps the next growth waits for, loads (the wait: grow_interval)
    other.load_state_dict(dict(good, microbatch_grown_from=4, microbatch_grow_wait=2**63 - 1))
    assert other.state_dict()["microbatch_grown_from"] == 4
    assert other.state_dict()["microbatch_grow_wait"] == 2**63 - 1
    defaults = {"microbatch_grown_from": 0, "microbatch_grow_wait": 100}
    full = dict(good, microbatch_grown_from=4, microbatch_grow_wait=800)
    for missing in (("microbatch_grown_from",), ("microbatch_grow_wait",), tuple(defaults)):
        other.load_state_dict({k: v for k, v in full.items() if k not in missing})
        assert other.state_dict() == dict(full, **{k: defaults[k] for k in missing})


def test_a_state_dict_of_another_batch_gives_its_epochs_and_scaler_and_micro_batching_starts_afresh():
    """A run resumed with another batch_size or accumulation_steps: the checkpoint's epochs and
    loss scaler are taken; its micro-batches were those of its own steps (here 2 of 16, and a
    target larger than the new step), and the new trainer's start as a new trainer's would."""
    x, y = teacher_data(64)
    _, _, trainer = make("adam", batch_size=32, amp="fp16")
    trainer.fit(x, y, epochs=1, progress=False)
    trainer._c.start_microbatch(16)
    state = trainer.state_dict()
    for kw in (dict(batch_size=16), dict(batch_size=64), dict(batch_size=32, accumulation_steps=2)):
        _, _, resumed = make("adam", amp="fp16", **kw)
        fresh = resumed.state_dict()
        resumed.load_state_dict(state)
        assert resumed.state_dict() == dict(fresh, epochs=1, scaler=state["scaler"]), kw
        assert resumed.microbatch_size == kw["batch_size"]
    # the same batch: its micro-batches too
    _, _, same = make("adam", batch_size=32, amp="fp16")
    same.load_state_dict(state)
    assert same.state_dict() == state and same.microbatch_size == 16
    # a state_dict of an earlier cmlp, without the batch, loads as of this trainer's batch
    same.load_state_dict({k: v for k, v in state.items() if k not in ("batch_size", "accumulation_steps")})
    assert same.state_dict() == state


def test_a_micro_batch_is_at_most_the_rows_of_a_step():
    """More rows at once than a step has would be reported but never run: refused."""
    model = cmlp.MLP([6, 5, 3], seed=0)
    opt = cmlp.optim.Adam(model)
    with pytest.raises(ValueError, match="at most batch_size"):
        cmlp.Trainer(model, opt, batch_size=8, microbatch_size=9)
    trainer = cmlp.Trainer(model, opt, batch_size=8, accumulation_steps=2, microbatch_size=16)
    assert trainer.microbatch_size == 16  # two micro-batches of the step at once
    with pytest.raises(ValueError, match="at most batch_size"):
        trainer.microbatch_size = 10**9
    assert trainer.microbatch_size == 16


# ---- progress ----

def test_progress_with_tqdm(capsys, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: tqdm draws there
    x, y = teacher_data(64)
    _, _, trainer = make(batch_size=16)
    trainer.fit(x, y, epochs=2, progress=True)
    err = capsys.readouterr().err
    assert "epoch 1/2" in err and "epoch 2/2" in err, err
    assert "4/4" in err, err
    assert "step" in err, "tqdm's unit is the optimizer step"


def test_progress_to_a_log_writes_whole_lines(capsys, monkeypatch):
    """stderr not a terminal (a file, a pipe): no carriage returns, one line when each epoch ends
    and one every LOG_INTERVAL seconds before (0 here: after each call but the last)."""
    from cmlp import _progress
    x, y = teacher_data(64)
    _, _, trainer = make(batch_size=16)
    trainer.fit(x, y, epochs=2, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [ln.split(" [")[0] for ln in lines] == ["epoch 1/2", "epoch 2/2"], err
    assert all(re.search(r"\] 4/4 steps [\d.]+s loss [\d.]+$", ln) for ln in lines), err
    monkeypatch.setattr(_progress, "LOG_INTERVAL", 0.0)
    trainer.fit(x, y, epochs=1, progress=True)
    err = capsys.readouterr().err
    # a line after each call into the C loop: 1 step, then 2 more where the first call was quick
    done = [int(re.search(r"\] (\d)/4 steps", ln).group(1)) for ln in err.splitlines()]
    assert done[0] == 1 and done[-1] == 4 and done == sorted(set(done)) and len(done) >= 3, err


def test_progress_in_a_notebook_redraws_its_line(capsys, monkeypatch):
    # a notebook's stderr is no terminal, yet it redraws (and tqdm.auto draws its widget there)
    import types
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    x, y = teacher_data(64)
    _, _, trainer = make(batch_size=16)
    trainer.fit(x, y, epochs=1, progress=True)
    assert "\r" in capsys.readouterr().err


def test_progress_without_tqdm(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError):
        import tqdm.auto  # noqa: F401
    x, y = teacher_data(64)
    _, _, trainer = make(batch_size=16)
    history = trainer.fit(x, y, epochs=2, progress=True)
    assert len(history) == 2
    err = capsys.readouterr().err
    assert "epoch 1/2" in err and "epoch 2/2" in err, err
    assert "4/4" in err and "#" * 30 in err, err
    assert "loss" in err


def test_a_tqdm_bar_shows_each_loss_with_the_step_count_it_belongs_to(monkeypatch):
    # the loss was set (which tqdm draws at once) before the count moved: each drawing showed a
    # chunk's loss beside the count before it
    tqdm_auto = pytest.importorskip("tqdm.auto")
    drawn = []

    class Recording(tqdm_auto.tqdm):
        def display(self, *args, **kwargs):
            drawn.append((self.n, self.postfix))
            return True

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(tqdm_auto, "tqdm", Recording)
    x, y = teacher_data(64)
    _, _, trainer = make(batch_size=16)
    trainer.fit(x, y, epochs=1, progress=True)
    assert drawn and all(n > 0 for n, post in drawn if post), drawn  # no loss beside the count 0


def test_no_progress_writes_nothing(capsys):
    x, y = teacher_data(64)
    _, _, trainer = make(batch_size=16)
    trainer.fit(x, y, epochs=1, progress=False)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


# ---- the short last batch ----

def test_short_last_batch_is_its_own_step_normalised_by_its_size():
    n, bs = 100, 32
    x, y = teacher_data(n)
    model, _, trainer = make(batch_size=bs, shuffle=False)
    history = trainer.fit(x, y, epochs=1, progress=False)

    manual, _, mt = make(batch_size=bs, shuffle=False)
    bounds = [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert len(bounds) == math.ceil(n / bs)
    losses = [mt.step(x[a:b], y[a:b]) for a, b in bounds]
    assert_params_equal(model, manual)
    assert history[0]["loss"] == pytest.approx(sum(l * (b - a) for l, (a, b) in zip(losses, bounds)) / n, rel=1e-6)

    dropped, _, dt = make(batch_size=bs, shuffle=False)
    for a, b in bounds[:3]:
        dt.step(x[a:b], y[a:b])
    assert rel_err(params(dropped), params(model)) > 1e-4, "the last 4 samples must get a step"

    # the same 4 samples normalised by 32 instead of 4 give another result
    wrong, wopt, wt = make(batch_size=bs, shuffle=False)
    for a, b in bounds[:3]:
        wt.step(x[a:b], y[a:b])
    wopt.zero_grad()
    wrong.forward_backward(x[96:], y[96:], loss_scale=4 / 32)
    wopt.step()
    assert rel_err(params(wrong), params(model)) > 1e-4


def test_fit_calls_the_epoch_loop_less_often_when_its_steps_are_short():
    """Each call into the C loop ends with a wait for the device: quick calls double their steps
    (2, 4, 8, ... for 480 steps of batch 1: 8 calls, not 480 // 2 = 240), slow ones halve, and
    the parameters are those of a step at a time."""
    x, y = teacher_data(480)
    model, _, trainer = make(batch_size=1, shuffle=False)
    trainer._c = CountedCalls(trainer._c)
    trainer.fit(x, y, epochs=1, progress=False)
    asked = trainer._c.asked
    assert asked[0] == 2 and len(asked) < 240
    assert all(b in (a // 2, a, 2 * a) for a, b in zip(asked, asked[1:]))
    manual, _, mt = make(batch_size=1, shuffle=False)
    for i in range(len(x)):
        mt.step(x[i:i + 1], y[i:i + 1])
    assert_params_equal(model, manual)
    # calls that take long halve the next one's steps, down to one
    from cmlp import _fit_loop
    assert _fit_loop._paced(8, 4.1 * _fit_loop.CALL_SECONDS) == 4
    assert _fit_loop._paced(1, 10.0) == 1
    assert _fit_loop._paced(8, _fit_loop.CALL_SECONDS) == 8


class _FixedCalls(CountedCalls):
    """Every epoch_run call asked for the same number of steps."""

    def __init__(self, c, steps):
        super().__init__(c)
        self.steps = steps

    def epoch_run(self, steps, *args):
        return super().epoch_run(self.steps, *args)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_an_epoch_s_loss_is_the_same_to_the_bit_whatever_the_calls_into_the_epoch_loop(max_grad_norm):
    """The epoch's loss (and clipping's mean norm) add up on the device in step order from one
    call to the next, so how fit splits an epoch into calls (it depends on their time) changes no
    bit of the history."""
    x, y = teacher_data(1000)
    histories = []
    for steps in (1, 3, 0):  # 0: the whole epoch in one call
        _, _, trainer = make("adam", batch_size=8, max_grad_norm=max_grad_norm)
        trainer._c = _FixedCalls(trainer._c, steps)
        histories.append([(h["loss"], h["grad_norm"]) for h in trainer.fit(x, y, epochs=2, progress=False)])
    assert histories[0] == histories[1] == histories[2]


def test_adam_counts_one_step_per_batch():
    x, y = teacher_data(100)
    _, opt, trainer = make("adam", batch_size=32)
    trainer.fit(x, y, epochs=1, progress=False)
    assert opt.state_dict()["state"][0]["step"] == 4.0
    trainer.fit(x, y, epochs=2, progress=False)
    assert opt.state_dict()["state"][0]["step"] == 12.0


# ---- accumulation ----

@pytest.mark.parametrize("n", [64, 70])
@pytest.mark.parametrize("shuffle", [False, True])
def test_accumulation_equals_big_batch(n, shuffle):
    x, y = teacher_data(n)
    big, _, tb = make(batch_size=32, shuffle=shuffle, seed=3)
    hb = tb.fit(x, y, epochs=2, progress=False)
    acc, _, ta = make(batch_size=16, accumulation_steps=2, shuffle=shuffle, seed=3)
    ha = ta.fit(x, y, epochs=2, progress=False)
    assert rel_err(params(acc), params(big)) < 1e-6
    assert ha[-1]["loss"] == pytest.approx(hb[-1]["loss"], rel=1e-6)
    assert ta.microbatch_size == 16
    # and it is not the same as plain batches of 16
    small, _, ts = make(batch_size=16, shuffle=shuffle, seed=3)
    ts.fit(x, y, epochs=2, progress=False)
    assert rel_err(params(small), params(big)) > 1e-3


def test_accumulation_counts_effective_batches():
    x, y = teacher_data(64)
    _, opt, trainer = make("adam", batch_size=16, accumulation_steps=2, shuffle=False)
    trainer.fit(x, y, epochs=1, progress=False)
    assert opt.state_dict()["state"][0]["step"] == 2.0


def test_step_equals_fit_on_one_batch():
    x, y = teacher_data(32)
    m1, _, t1 = make(batch_size=32, shuffle=False)
    t1.fit(x, y, epochs=1, progress=False)
    m2, _, t2 = make(batch_size=8, accumulation_steps=4, shuffle=False)
    loss = t2.step(x, y)
    assert rel_err(params(m2), params(m1)) < 1e-6
    assert loss == pytest.approx(cmlp.MLP(SIZES, seed=0).evaluate(x, y)["loss"], rel=1e-6)


# ---- uint8 ----

def test_the_trainers_normalisation_is_the_models_so_evaluate_sees_what_fit_saw(tmp_path):
    rng = np.random.default_rng(6)
    xu, y = rng.integers(0, 256, (96, 784), dtype=np.uint8), rng.integers(0, 10, 96)
    model, _, trainer = make(sizes=[784, 32, 10], batch_size=16, normalize=(0.2860, 0.3530))
    assert model.normalize == trainer.normalize == (0.2860, 0.3530)
    h = trainer.fit(xu, y, epochs=1, validation_data=(xu, y), progress=False)
    assert model.evaluate(xu, y)["loss"] == pytest.approx(h[0]["val_loss"], rel=1e-6)
    model.save(tmp_path / "m.npz")
    assert cmlp.MLP.load(tmp_path / "m.npz").normalize == (0.2860, 0.3530)
    trainer.normalize = (0.1307, 0.3081)  # one normalisation: setting either sets both
    assert model.normalize == (0.1307, 0.3081)
    model.normalize = (0.5, 0.5)
    assert trainer.normalize == (0.5, 0.5)
    kept, _, kept_trainer = make(sizes=[784, 32, 10])  # none given: the model's, as it was
    assert kept.normalize == kept_trainer.normalize == (0.5, 0.5)
    with pytest.raises(ValueError, match="accumulation_steps"):  # a refused trainer changes nothing
        cmlp.Trainer(kept, cmlp.optim.SGD(kept), accumulation_steps=0, normalize=(0.2, 0.3))
    assert kept.normalize == (0.5, 0.5)


@pytest.mark.parametrize("normalize", [(0.5, 0.5), (0.2860, 0.3530)])
def test_uint8_equals_float_normalised_by_hand(normalize):
    rng = np.random.default_rng(5)
    xu = rng.integers(0, 256, (96, 784), dtype=np.uint8)
    y = rng.integers(0, 10, 96)
    mean, std = normalize
    xf = ((xu.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
    sizes = [784, 32, 10]
    mu, _, tu = make(sizes=sizes, batch_size=16, normalize=normalize)
    hu = tu.fit(xu, y, epochs=1, progress=False)
    mf, _, tf = make(sizes=sizes, batch_size=16, normalize=normalize)
    hf = tf.fit(xf, y, epochs=1, progress=False)
    assert rel_err(params(mu), params(mf)) < 1e-5
    assert hu[0]["loss"] == pytest.approx(hf[0]["loss"], rel=1e-5)
    # and the normalisation matters: without it the result is far off
    mr, _, tr = make(sizes=sizes, batch_size=16, normalize=normalize)
    tr.fit(xu.astype(np.float32), y, epochs=1, progress=False)
    assert rel_err(params(mr), params(mf)) > 1e-2
    step_u = make(sizes=sizes, batch_size=16, normalize=normalize)
    step_f = make(sizes=sizes, batch_size=16, normalize=normalize)
    lu = step_u[2].step(xu[:16], y[:16])
    lf = step_f[2].step(xf[:16], y[:16])
    assert lu == pytest.approx(lf, rel=1e-5)


# ---- micro-batch size ----

@pytest.mark.parametrize("bs,acc", [(32, 1), (48, 1), (16, 3), (1, 1)])
def test_microbatch_size_defaults_to_batch_size(bs, acc):
    x, y = teacher_data(50)
    _, _, trainer = make(batch_size=bs, accumulation_steps=acc)
    assert trainer.microbatch_size == bs
    h = trainer.fit(x, y, epochs=1, progress=False)
    assert h[0]["microbatch_size"] == bs
    assert trainer.microbatch_size == bs


def _fill_cache():
    """Every cached free block that a request can use taken, so that new memory needs a new
    segment. A request over 1 MiB goes to the large pool: a small segment's free block is taken
    1 MiB at a time, and a large segment's block of 1 MiB or less serves no request."""
    M = cmlp.memory
    gc.collect()  # (memory that cycles of earlier tests' objects hold would come back into the cache later)
    M.empty_cache("cpu")
    blocks = []
    while True:
        usable = [b["size"] if s["segment_type"] == "large" else min(b["size"], 2**20)
                  for s in M.memory_snapshot("cpu") for b in s["blocks"]
                  if b["state"] == "inactive" and (s["segment_type"] == "small" or b["size"] > 2**20)]
        if not usable:
            return blocks
        before = M.memory_reserved("cpu")
        blocks.append(M.caching_allocator_alloc(max(usable), "cpu"))
        if M.memory_reserved("cpu") > before:  # (not expected: then give back what it reserved)
            M.caching_allocator_delete(blocks.pop())
            M.empty_cache("cpu")
            return blocks


@pytest.mark.parametrize("accumulated", [False, True])
def test_a_step_refused_for_the_optimizer_state_leaves_the_gradients_as_they_were(accumulated):
    """The state is made before the step's gradients: with room for the activations but not for
    Adam's state, the step is refused and the gradients (none, or the ones accumulated by hand)
    are as they were, so the next step is the one a run without the refusal takes."""
    M = cmlp.memory
    rng = np.random.default_rng(0)
    x = rng.random((256, 300), dtype=np.float32)
    y = rng.integers(0, 10, 256)

    def run(refuse):
        model = cmlp.MLP([300, 400, 200, 10], seed=1)
        opt = cmlp.optim.Adam(model)
        trainer = cmlp.Trainer(model, opt, batch_size=64, auto_microbatch=False)
        if accumulated:
            model.forward_backward(x[:16], y[:16])
        before = model.grads()
        if refuse:
            blocks = _fill_cache()
            M.set_memory_limit(M.memory_reserved("cpu") + 2 * 2**20, "cpu")
            try:
                with pytest.raises(cmlp.OutOfMemoryError):
                    trainer.step(x, y)
            finally:
                M.set_memory_limit(None, "cpu")
                for b in blocks:
                    M.caching_allocator_delete(b)
            assert all(np.array_equal(v, before[k]) for k, v in model.grads().items())
        if not accumulated:
            model.forward_backward(x[:32], y[:32])
        opt.step()
        return model.state_dict()

    want, got = run(False), run(True)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_progress_bar_that_cannot_draw_does_not_stop_training(monkeypatch):
    """stderr missing (pythonw, 2>&-), a pipe whose reader went away, or a binary stream: fit
    trains on."""
    import io
    import os

    rng = np.random.default_rng(0)
    x = rng.random((400, 16), dtype=np.float32)
    y = rng.integers(0, 4, 400)
    r, w = os.pipe()
    os.close(r)
    broken = os.fdopen(w, "w")
    try:
        for stream in (None, broken, io.BytesIO()):  # (a binary stream takes no text)
            model = cmlp.MLP([16, 8, 4], seed=0)
            trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=8)
            monkeypatch.setattr(sys, "stderr", stream)
            history = trainer.fit(x, y, epochs=2, progress=True)
            monkeypatch.undo()
            assert len(history) == 2 and trainer.epochs == 2
    finally:
        try:
            broken.close()
        except OSError:
            pass


@pytest.mark.parametrize("case", ["adam", "sgd", "accumulate", "groups-clip", "per-step", "short-last", "recompute",
                                  "amp"])
def test_a_call_of_many_steps_gives_the_bits_of_calls_of_one(case, monkeypatch):
    """Inside one call of the epoch loop each update zeroes the gradients as it reads them and the
    next step adds its first weight gradients to those zeros (with a step's buffers in the first
    layer's weight gradient, where a step is one micro-batch, zeroed before it is added to): the
    same bits as calls of one step each, whose steps write their gradients afresh; and the last
    step's gradients are left for Python."""
    from cmlp import _fit_loop
    sizes = [64, 128, 32, C]  # a step of 16 fits in the first weight gradient (compact)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((200 if case == "short-last" else 192, 64)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((64, C)), axis=1)
    groups = [{"params": ["fc1.weight", "fc2.weight"], "lr": 3e-3},
              {"params": ["fc3.weight", "fc1.bias", "fc2.bias", "fc3.bias"], "weight_decay": 0.0}]

    def run(chunk):
        monkeypatch.setattr(_fit_loop, "_paced", lambda c, seconds: chunk)
        model = cmlp.MLP(sizes, seed=4)
        if case in ("adam", "groups-clip", "per-step", "amp"):
            opt = cmlp.optim.Adam(model, lr=1e-2, weight_decay=0.01,
                                  param_groups=groups if case == "groups-clip" else None)
        else:
            opt = cmlp.optim.SGD(model, lr=0.05, momentum=0.9)
        kw = {"accumulation_steps": 3, "batch_size": 8} if case == "accumulate" else {"batch_size": 16}
        trainer = cmlp.Trainer(model, opt, shuffle=True, seed=5, amp="bf16" if case == "amp" else None,
                               recompute=case == "recompute",
                               max_grad_norm=0.5 if case == "groups-clip" else None, **kw)
        sched = cmlp.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=40) if case == "per-step" else None
        history = trainer.fit(x, y, epochs=3, progress=False, scheduler=sched,
                              scheduler_interval="step" if sched else "epoch")
        return model, history

    one, h1 = run(1)
    many, h2 = run(1000)  # after the first call of each epoch (one step), the rest in one
    assert_params_equal(many, one)
    for k, g in one.grads().items():
        np.testing.assert_array_equal(many.grads()[k], g, err_msg=k)
        assert np.abs(g).max() > 0, k
    assert [h["loss"] for h in h2] == [h["loss"] for h in h1]


@pytest.mark.parametrize("kind,kwargs,amp", [("Adam", {"amsgrad": True}, None),
                                             ("AdamW", {"amsgrad": True, "maximize": True}, None),
                                             ("Adam", {"amsgrad": True}, "fp16"),
                                             ("SGD", {"momentum": 0.9, "maximize": True}, None)])
def test_fit_steps_amsgrad_and_maximize_as_the_optimizer_steps_alone(kind, kwargs, amp):
    """The epoch loop's steps (bookkeeping on the device's side) and optimizer.step() give the
    same bits, AMSGrad's maximum included; maximize climbs the loss."""
    x, y = teacher_data(96)
    lr = 0.05 if kind == "SGD" else 1e-2
    model = cmlp.MLP(SIZES, seed=1)
    opt = getattr(cmlp.optim, kind)(model, lr=lr, **kwargs)
    trainer = cmlp.Trainer(model, opt, batch_size=32, shuffle=False, amp=amp,
                           scaler=cmlp.amp.GradScaler(init_scale=2.0**10) if amp else None)
    history = trainer.fit(x, y, epochs=2, progress=False)
    twin = cmlp.MLP(SIZES, seed=1)
    topt = getattr(cmlp.optim, kind)(twin, lr=lr, **kwargs)
    scaler = cmlp.amp.GradScaler(init_scale=2.0**10) if amp else None
    for _ in range(2):
        for a in range(0, 96, 32):
            topt.zero_grad()
            if amp:
                twin.forward_backward(x[a:a + 32], y[a:a + 32], amp=amp, loss_scale=scaler.get_scale())
                scaler.step(topt)
                scaler.update()
            else:
                twin.forward_backward(x[a:a + 32], y[a:a + 32])
                topt.step()
    assert_params_equal(model, twin)
    mine, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    assert sorted(mine[0]) == sorted(theirs[0])
    for i in mine:
        for key in mine[i]:
            np.testing.assert_array_equal(mine[i][key], theirs[i][key], err_msg=f"{i} {key}")
    if kwargs.get("maximize"):
        assert history[-1]["loss"] > history[0]["loss"]


SETTINGS = {"model": None, "optimizer": None, "batch_size": 64, "accumulation_steps": 2, "amp": "bf16",
            "scaler": None, "auto_microbatch": False, "recompute": True, "shuffle": False, "seed": 3,
            "label_smoothing": 0.1, "grow_interval": 5, "max_grad_norm": 1.0, "distributed": True}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_setting_reads_back_as_made_and_refuses_assignment(name):
    """What reads back is what trains: a setting the trainer is made with cannot be assigned
    (the C trainer follows the constructor's), and the refusal says how to get the new value."""
    model, opt, t = make(batch_size=8, shuffle=True, label_smoothing=0.05, grow_interval=7, max_grad_norm=2.0)
    made = {"model": model, "optimizer": opt, "batch_size": 8, "accumulation_steps": 1, "amp": None, "scaler": None,
            "auto_microbatch": True, "recompute": False, "shuffle": True, "seed": 0, "label_smoothing": 0.05,
            "grow_interval": 7, "max_grad_norm": 2.0, "distributed": False}
    assert getattr(t, name) is made[name] or getattr(t, name) == made[name]
    with pytest.raises(AttributeError, match=rf"Trainer\.{name} is fixed when the trainer is made.*cmlp\.Trainer"):
        setattr(t, name, SETTINGS[name])
    assert getattr(t, name) is made[name] or getattr(t, name) == made[name]
    x, y = teacher_data(64)
    assert math.isfinite(t.fit(x, y, epochs=1, progress=False)[0]["loss"])


def test_under_a_memory_limit_a_resumed_run_goes_on_as_the_uninterrupted_one():
    """Under a memory limit the planner cuts the step into micro-batches, and growth trials go
    back up. A checkpoint carries what they depend on: the steps of each batch size plan once
    (under that limit), so a run of steps resumed from one does not plan again; one taken inside
    a fit (here from a schedule's function, between epochs) resumes that fit where it was,
    whereas a new fit call plans afresh. Either way the rest of the run is the uninterrupted
    one's: losses, micro-batches, weights and the trainer's state. (Each run alone, under a
    limit of 2 MiB above what the process holds.)"""
    import pickle

    M = cmlp.memory
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1200, 32)).astype(np.float32)
    y = np.argmax(x @ np.random.default_rng(1).standard_normal((32, 10)), 1)
    S = cmlp.optim.lr_scheduler

    gc.collect()
    M.empty_cache("cpu")
    limit = M.memory_reserved("cpu") + (2 << 20)

    def build(seed=1, state=None):  # (the last run's objects gone: each starts from the same memory)
        gc.collect()
        M.empty_cache("cpu")
        M.set_memory_limit(limit, "cpu")
        model = cmlp.MLP([32, 256, 10], seed=seed)
        opt = cmlp.optim.Adam(model, lr=1e-3)
        trainer = cmlp.Trainer(model, opt, batch_size=512, grow_interval=2, seed=4, amp="fp16")
        if state is not None:
            state = pickle.loads(state)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            trainer.load_state_dict(state["trainer"])
        return model, opt, trainer

    def checkpoint(model, opt, trainer):
        return pickle.dumps({"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "trainer": trainer.state_dict()})

    def weights(model):
        return b"".join(v.tobytes() for v in model.state_dict().values())

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cmlp.MemoryWarning)
            # steps, every third batch 5 rows short (another batch size, planned once too)
            batches = [np.random.default_rng(i).permutation(1200)[:512 if i % 3 else 507] for i in range(9)]
            m, _, t = build()
            straight = [(t.step(x[b], y[b]), t.microbatch_size) for b in batches]
            want = weights(m), t.state_dict()
            del m, t
            m, o, t = build()
            for b in batches[:4]:
                t.step(x[b], y[b])
            assert t.state_dict()["microbatch_planned"]["batch_rows"] == [507, 512]
            blob = checkpoint(m, o, t)
            del m, o, t
            m, _, t = build(seed=99, state=blob)
            assert [(t.step(x[b], y[b]), t.microbatch_size) for b in batches[4:]] == straight[4:]
            assert (weights(m), t.state_dict()) == want and min(size for _, size in straight) < 512

            # a fit of 5 epochs, and a checkpoint taken inside one after its first (when a growth
            # trial has moved the micro-batch off the plan's start)
            del m, t
            m, _, t = build()
            whole = t.fit(x, y, epochs=5, progress=False)
            want = weights(m), t.state_dict()
            del m, t
            m, o, t = build()
            taken = []

            def rate(epoch, m=m, o=o, t=t):
                if epoch == 1:
                    taken.append(checkpoint(m, o, t))
                return 1.0

            t.fit(x, y, epochs=5, progress=False, scheduler=S.LambdaLR(o, rate))
            del m, o, t, rate
            m, _, t = build(seed=99, state=taken[0])
            assert t.epochs == 1 and t.microbatch_size != t.state_dict()["microbatch_limit_cut"]
            rest = t.fit(x, y, epochs=4, progress=False)
            assert [(h["loss"], h["microbatch_size"]) for h in rest] == \
                [(h["loss"], h["microbatch_size"]) for h in whole[1:]]
            assert (weights(m), t.state_dict()) == want
    finally:
        M.set_memory_limit(None, "cpu")
