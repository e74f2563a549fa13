"""One rank of a data-parallel scenario, started by tests/test_distributed.py under mpirun:
    mpirun -np W python tests/dist_worker.py SCENARIO
Every rank runs the scenario; rank 0 prints one JSON object (the facts the test checks) on the
last line of its output. Facts that hold on every rank are gathered with the collectives under
test, so a rank that disagrees shows up in rank 0's report."""
import ctypes
import datetime
import json
import os
import sys
import time
import warnings

import numpy as np

import cmlp
from cmlp.optim._groups import _not_started

D = cmlp.distributed
SIZES = [784, 48, 10]


def data(n, seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, sizes[0]), dtype=np.uint8), rng.integers(0, sizes[-1], size=n)


def optimizer(model, kind):
    if kind == "sgd":
        return cmlp.optim.SGD(model, lr=0.05, momentum=0.9, dampening=0.3)
    return cmlp.optim.Adam(model, lr=1e-3)


def params(model):
    return model._c.get_params()


def update_err(p, q, q0):
    """The norm-wise relative error of parameters p against q, both trained from q0: of the
    change, which is what training computes (see check_fit in test_distributed.py)."""
    return float(np.linalg.norm(p - q) / np.linalg.norm(q - q0))


def spread(a):
    """max over ranks minus min over ranks, elementwise max: 0 when every rank holds the same."""
    hi, lo = a.astype(np.float64), a.astype(np.float64)
    hi, lo = hi.copy(), lo.copy()
    D.all_reduce(hi, "max")
    D.all_reduce(lo, "min")
    return float(np.max(hi - lo)) if hi.size else 0.0


from checks import fill_cache_but, room_for  # noqa: E402 (this directory is the script's)


def leave_room(trainer, micro, device):
    """A limit at what is allocated, so that no new segment may be made, and the cache's free
    blocks taken but for room for what a step in micro-batches of `micro` asks (as the planner
    lists it): the rank cannot compute larger ones. The blocks taken are returned."""
    p = cmlp.memory.plan(list(trainer.model.layer_sizes), micro, trainer.optimizer, trainer.amp, device=device,
                         accumulation_steps=-(-trainer.batch_size // micro))
    taken = fill_cache_but(device, room_for(p, ("optimizer_state", "half_weights", "step")))  # (made by the first step)
    cmlp.memory.set_memory_limit(cmlp.memory.memory_allocated(device), device)
    return taken


def fit_case(opts):
    """Data-parallel fit against one process training batch_size * world on the same data."""
    w, r = D.get_world_size(), D.get_rank()
    n, batch, epochs = opts.get("n", 600), opts.get("batch", 16), opts.get("epochs", 2)
    kw = dict(accumulation_steps=opts.get("accum", 1), amp=opts.get("amp"), shuffle=opts.get("shuffle", True), seed=3,
              max_grad_norm=opts.get("clip"), grow_interval=opts.get("grow", 100))
    x, y = data(n)
    device = opts.get("device", "cpu")
    model = cmlp.MLP(SIZES, seed=10 + r, device=device)  # different on every rank: all start from rank 0's
    scaler = (lambda: cmlp.amp.GradScaler(init_scale=opts["init_scale"])) if "init_scale" in opts else (lambda: None)
    trainer = cmlp.Trainer(model, optimizer(model, opts.get("opt")), batch_size=batch, scaler=scaler(), **kw)
    filler = []
    if opts.get("limit_rank") == r:
        filler = leave_room(trainer, opts.get("room", batch // 2), device)
    if opts.get("start_micro_rank") == r:  # below the micro-batch asked for, as after an out-of-memory retry
        trainer._c.start_microbatch(opts["start_micro"])
    val = data(opts["val"], seed=7) if "val" in opts else None

    def schedule(opt):  # with "sched": OneCycleLR stepped with every optimizer step
        if not opts.get("sched"):
            return {}
        steps = epochs * -(-n // (batch * w * kw["accumulation_steps"]))
        return dict(scheduler=cmlp.optim.lr_scheduler.OneCycleLR(opt, max_lr=opts.get("max_lr", 1e-2), total_steps=steps),
                    scheduler_interval="step")

    hist = trainer.fit(x, y, epochs=epochs, progress=False, validation_data=val, **schedule(trainer.optimizer))
    time.sleep(opts.get("idle", 0))  # past the group's timeout: a collective still watched would end the job
    least = np.array([min(h["microbatch_size"] for h in hist)], dtype=np.float64)
    D.all_reduce(least, "min")
    cmlp.memory.set_memory_limit(None, device)
    for ptr in filler:
        cmlp.memory.caching_allocator_delete(ptr)
    ref_model = cmlp.MLP(SIZES, seed=10, device=device)
    ref = cmlp.Trainer(ref_model, optimizer(ref_model, opts.get("opt")), batch_size=batch * w, distributed=False,
                       scaler=scaler(), **kw)
    q0 = params(ref_model)
    ref_hist = ref.fit(x, y, epochs=epochs, progress=False, validation_data=val, **schedule(ref.optimizer))
    p, q = params(model), params(ref_model)
    return dict(world=w, distributed=trainer.distributed, max_diff=float(np.abs(p - q).max()),
                scale=float(np.abs(q).max()), rank_spread=spread(p),
                update_err=update_err(p, q, q0),
                loss=[h["loss"] for h in hist], ref_loss=[h["loss"] for h in ref_hist],
                skipped=[h["skipped_steps"] for h in hist], ref_skipped=[h["skipped_steps"] for h in ref_hist],
                micro=[h["microbatch_size"] for h in hist], micro_spread=spread(np.array([trainer.microbatch_size])),
                micro_least=float(least[0]), graphs=trainer._c.graph_counts(),
                graph_spread=spread(np.array(trainer._c.graph_counts())),
                grad_norm=[h["grad_norm"] for h in hist], ref_grad_norm=[h["grad_norm"] for h in ref_hist],
                val=[[h["val_loss"], h["val_accuracy"]] for h in hist],
                ref_val=[[h["val_loss"], h["val_accuracy"]] for h in ref_hist],
                nccl_graph_register=c_getenv("NCCL_GRAPH_REGISTER"))


def c_getenv(name):
    """The process environment as C sees it (os.environ is a copy taken at start)."""
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    v = getenv(name.encode())
    return v.decode() if v is not None else None


def small_data_case(opts):
    """A data set smaller than a step of the group: under a limit each rank plans its share of it,
    one micro-batch (not the batch asked for), and starts whole."""
    w = D.get_world_size()
    sizes, rows, batch = [784, 512, 10], opts["rows"], 4096
    x, y = data(rows)
    model = cmlp.MLP(sizes, seed=0)
    opt = optimizer(model, None)
    share = cmlp.memory.plan(sizes, batch, opt, data_rows=-(-rows // w))
    whole = cmlp.memory.plan(sizes, batch, opt)
    cmlp.memory.set_memory_limit(cmlp.memory.memory_reserved("cpu") + share.reserved_bytes, "cpu")
    ooms = cmlp.memory.memory_stats("cpu")["num_ooms"]
    hist = cmlp.Trainer(model, opt, batch_size=batch).fit(x, y, epochs=2, progress=False)
    cmlp.memory.set_memory_limit(None, "cpu")
    ooms = np.array([cmlp.memory.memory_stats("cpu")["num_ooms"] - ooms], dtype=np.float64)
    D.all_reduce(ooms, "max")
    micro = np.array([min(h["microbatch_size"] for h in hist)], dtype=np.float64)
    D.all_reduce(micro, "min")
    return dict(world=w, share_rows=share.batch_size, share_reserved=share.reserved_bytes,
                whole_reserved=whole.reserved_bytes, ooms=float(ooms[0]), micro=float(micro[0]))


class _PacedCalls:
    """A trainer's C object recording the steps each epoch_run call is asked for; on rank 1 the
    call numbered `slow_call` lasts `slow_seconds` longer after its steps (a rank held up where
    the others do not wait for it: they time their call without it)."""

    def __init__(self, c, slow_call, slow_seconds):
        self._inner, self.asked, self.slow = c, [], (slow_call, slow_seconds)

    def epoch_run(self, steps, *args):
        self.asked.append(steps)
        out = self._inner.epoch_run(steps, *args)
        if len(self.asked) == self.slow[0] and D.get_rank() == 1:
            time.sleep(self.slow[1])
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _SplitSteps:
    """A trainer's C object whose count of steps retried in micro-batches grows at each reading,
    and whose steps say they ran at half the micro-batch asked for, as after an out-of-memory
    inside each step (the steps themselves are as ever)."""

    def __init__(self, c):
        self._inner, self.extra = c, 0

    def oom_retries(self):
        self.extra += 1
        return self._inner.oom_retries() + self.extra

    def last_microbatch(self):
        return max(1, self._inner.microbatch_state()[1] // 2)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def calls_case(opts):
    """The ranks' calls into the epoch loop grow while they are quick and shrink after one that
    was slow on any rank: every rank asks for the same steps in every call."""
    w = D.get_world_size()
    x, y = data(opts.get("n", 4800))
    model = cmlp.MLP(SIZES, seed=1)
    trainer = cmlp.Trainer(model, optimizer(model, "adam"), batch_size=4)
    trainer._c = _PacedCalls(trainer._c, opts["slow_call"], opts["slow_seconds"])
    trainer.fit(x, y, epochs=1, progress=False)
    asked = np.array(trainer._c.asked, dtype=np.float64)
    count_spread = spread(np.array([len(asked)], dtype=np.float64))
    return dict(world=w, asked=asked.tolist(), count_spread=count_spread,
                asked_spread=spread(asked) if count_spread == 0 else None, rank_spread=spread(params(model)))


def step_case(opts):
    """Trainer.step with each rank's own batch (sizes differ) against one step on all of them."""
    w, r = D.get_world_size(), D.get_rank()
    x, y = data(60, seed=5)
    sizes = [5 + 3 * i for i in range(w)]
    lo = sum(sizes[:r])
    model = cmlp.MLP(SIZES, seed=1)
    trainer = cmlp.Trainer(model, optimizer(model, "adam"), batch_size=8)
    losses = [trainer.step(x[lo:lo + sizes[r]], y[lo:lo + sizes[r]]) for _ in range(3)]
    ref_model = cmlp.MLP(SIZES, seed=1)
    q0 = params(ref_model)
    ref = cmlp.Trainer(ref_model, optimizer(ref_model, "adam"), batch_size=8, distributed=False)
    ref_losses = [ref.step(x[:sum(sizes)], y[:sum(sizes)]) for _ in range(3)]
    return dict(losses=losses, ref_losses=ref_losses, update_err=update_err(params(model), params(ref_model), q0),
                rank_spread=spread(params(model)))


def failure_case(opts):
    """One rank cannot fit even one sample: every rank raises for that step, none hangs, and the
    group trains on afterwards."""
    r = D.get_rank()
    x, y = data(64)
    model = cmlp.MLP(SIZES, seed=0)
    trainer = cmlp.Trainer(model, optimizer(model, "adam"), batch_size=8)
    trainer.fit(x, y, epochs=1, progress=False)  # state and caches exist
    before = params(model)
    held = []
    if r == 1:  # the cache full to the limit: not even one sample's buffers fit
        model._c.release_workspace()
        cmlp.memory.empty_cache("cpu")
        cmlp.memory.set_memory_limit(cmlp.memory.memory_reserved("cpu"), "cpu")
        size = 1 << 20
        while size >= 512:
            try:
                held.append(cmlp.memory.caching_allocator_alloc(size, "cpu"))
            except cmlp.OutOfMemoryError:
                size //= 2
    error = None
    try:
        trainer.fit(x, y, epochs=1, progress=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    for ptr in held:
        cmlp.memory.caching_allocator_delete(ptr)
    cmlp.memory.set_memory_limit(None, "cpu")
    unchanged = bool(np.array_equal(before, params(model)))
    errors = D.get_world_size() * [None]
    flags = np.array([1 if error else 0], dtype=np.int64)
    D.all_reduce(flags, "sum")
    # the error of each rank, one at a time from its owner
    for k in range(D.get_world_size()):
        buf = np.zeros(2000, dtype=np.uint8)
        if k == r and error:
            raw = error.encode()[:2000]
            buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        D.broadcast(buf, k)
        errors[k] = bytes(buf).rstrip(b"\0").decode(errors="replace")
    hist = trainer.fit(x, y, epochs=1, progress=False)
    return dict(errors=errors, failed=int(flags[0]), unchanged=unchanged, after_loss=hist[0]["loss"],
                rank_spread=spread(params(model)))


def mismatch_case(opts):
    """Ranks with different settings or data sets raise ValueError, and none hangs."""
    r = D.get_rank()
    out = {}
    x, y = data(64)
    model = cmlp.MLP(SIZES, seed=0)
    try:  # found when the trainer is made
        cmlp.Trainer(model, optimizer(model, "adam"), batch_size=8 + (r == 1))
    except ValueError as e:
        out["batch"] = str(e)
    try:  # an argument refused on one rank
        cmlp.Trainer(model, optimizer(model, "adam"), batch_size=0 if r == 1 else 8)
    except (ValueError, RuntimeError) as e:
        out["argument"] = f"{type(e).__name__}: {e}"
    trainer = cmlp.Trainer(model, optimizer(model, "adam"), batch_size=8)
    try:
        trainer.step(x[:8], y[:8] if r == 0 else y[:7])
    except (ValueError, RuntimeError) as e:
        out["step"] = f"{type(e).__name__}: {e}"
    try:
        trainer.fit(x[:64 - r], y[:64 - r], epochs=1, progress=False)
    except ValueError as e:
        out["data"] = str(e)
    try:  # bad input on one rank only: every rank raises
        trainer.fit(x, np.where(np.arange(64) == 3, 10 if r == 1 else 0, y), epochs=1, progress=False)
    except ValueError as e:
        out["labels"] = f"ValueError: {e}"
    except RuntimeError as e:
        out["labels"] = f"RuntimeError: {e}"
    # settings that change the mathematics, one rank different
    for name, kw in (("smoothing", dict(label_smoothing=0.1 * r)), ("normalize", dict(normalize=(0.5, 0.5 + r))),
                     ("lr", dict(lr=1e-3 * (1 + r)))):
        m2 = cmlp.MLP(SIZES, seed=0)
        opt = cmlp.optim.Adam(m2, lr=kw.pop("lr", 1e-3))
        try:
            cmlp.Trainer(m2, opt, batch_size=8, **kw).fit(x, y, epochs=1, progress=False)
        except ValueError as e:
            out[name] = str(e)
    try:  # another model on one rank
        m3 = cmlp.MLP([SIZES[0], 16 + r, SIZES[-1]], seed=0)
        cmlp.Trainer(m3, cmlp.optim.Adam(m3), batch_size=8)
    except ValueError as e:
        out["layers"] = str(e)
    for name, kw in (("epochs", dict(epochs=1 + r)), ("validation", dict(validation_data=(x, y) if r else None))):
        try:  # fit's own arguments, one rank different
            trainer.fit(x, y, progress=False, **{"epochs": 1, **kw})
        except ValueError as e:
            out[name] = str(e)
    try:  # a step on one rank, an epoch on the other
        if r == 0:
            trainer.step(x[:8], y[:8])
        else:
            trainer.fit(x, y, epochs=1, progress=False)
    except ValueError as e:
        out["call"] = str(e)
    try:  # a step of 2**62 samples on each rank: the group's would not count
        cmlp.Trainer(model, optimizer(model, "adam"), batch_size=2**61, accumulation_steps=2)
    except ValueError as e:
        out["group_batch"] = str(e)
    # the same settings everywhere, -0.0 among them (its bits are the smallest int64)
    m2 = cmlp.MLP(SIZES, seed=0)
    cmlp.Trainer(m2, cmlp.optim.Adam(m2), batch_size=8, label_smoothing=-0.0, normalize=(-0.0, 0.5)).fit(
        (x > 0).astype(np.uint8), y, epochs=1, progress=False)
    out["negative_zero"] = "trained"
    try:  # another data set of the same size on one rank
        xr, yr = data(64, seed=r)
        trainer.fit(xr, yr, epochs=1, progress=False)
    except ValueError as e:
        out["contents"] = str(e)
    try:  # another validation set of the same size on one rank: each rank evaluates a share of one
        trainer.fit(x, y, epochs=1, progress=False, validation_data=data(16, seed=r))
    except ValueError as e:
        out["validation_contents"] = str(e)
    # per-step schedules: rates of one rank's own (in the middle of an epoch), and one that raises
    for name, rate in (("rates", lambda s: 10.0 if r == 1 and 3 <= s <= 5 else 1.0),
                       ("raised", lambda s: 1 / 0 if r == 1 and s == 5 else 1.0)):
        m2 = cmlp.MLP(SIZES, seed=0)
        opt = cmlp.optim.SGD(m2, lr=0.1)
        sched = cmlp.optim.lr_scheduler.LambdaLR(opt, rate)
        try:
            cmlp.Trainer(m2, opt, batch_size=2).fit(x, y, epochs=1, progress=False, scheduler=sched,
                                                    scheduler_interval="step")
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        # every rank where the others are: the steps taken, the schedule's count, the parameters
        state = np.concatenate([[opt._c.get_state()[0], sched.last_epoch], params(m2)])
        out[name + "_spread"] = float(spread(state))
        out[name + "_steps"] = int(state[0])
    # a per-epoch schedule that raises on one rank after the first epoch: every rank raises there
    m2 = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.SGD(m2, lr=0.1)
    sched = cmlp.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / 0 if r == 1 and e == 1 else 1.0)
    trainer2 = cmlp.Trainer(m2, opt, batch_size=8)
    try:
        trainer2.fit(x, y, epochs=3, progress=False, scheduler=sched)
    except (RuntimeError, ZeroDivisionError) as e:
        out["epoch_raised"] = f"{type(e).__name__}: {e}"
    out["epoch_raised_epochs"] = trainer2.epochs
    # rank 1 alone computes its steps in micro-batches (as if it ran out of memory), its warning
    # an error there: every rank raises after the first epoch, none waits for rank 1
    m3 = cmlp.MLP(SIZES, seed=0)
    trainer3 = cmlp.Trainer(m3, cmlp.optim.SGD(m3, lr=0.1), batch_size=8)
    if r == 1:
        trainer3._c = _SplitSteps(trainer3._c)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if r == 1 else "ignore", cmlp.memory.MemoryWarning)
        try:
            trainer3.fit(x, y, epochs=3, progress=False)
        except (RuntimeError, cmlp.memory.MemoryWarning) as e:
            out["split_warned"] = f"{type(e).__name__}: {e}"
    out["split_warned_epochs"] = trainer3.epochs
    # an interrupt in rank 1's schedule (per epoch, per step), caught there: every rank raises at
    # that point, and the group goes on in step (a barrier, then an epoch together)
    for interval, when in (("epoch", lambda e: e == 1), ("step", lambda s: s == 5)):
        m4 = cmlp.MLP(SIZES, seed=0)
        opt = cmlp.optim.SGD(m4, lr=0.1)

        def rate(i, when=when):
            if r == 1 and when(i):
                raise KeyboardInterrupt
            return 1.0

        sched = cmlp.optim.lr_scheduler.LambdaLR(opt, rate)
        trainer4 = cmlp.Trainer(m4, opt, batch_size=2)
        try:
            trainer4.fit(x, y, epochs=2, progress=False, scheduler=sched, scheduler_interval=interval)
        except (KeyboardInterrupt, RuntimeError) as e:
            out["interrupt_" + interval] = f"{type(e).__name__}: {e}"
        D.barrier()
        trainer4.fit(x, y, epochs=1, progress=False)
        state = np.concatenate([[opt._c.get_state()[0], sched.last_epoch, trainer4.epochs], params(m4)])
        out["interrupt_" + interval + "_spread"] = float(spread(state))
    flags = np.array([len(out)], dtype=np.int64)
    D.all_reduce(flags, "min")
    out["min_errors"] = int(flags[0])
    return out


def changed_case(opts):
    """Parameters or optimizer state changed from outside the trainer on some ranks only, or to
    different values on every rank: the trainer's next call raises on every rank, changes
    nothing, and raises again until every rank holds the same; a change made alike everywhere,
    or before the Trainer is made (rank 0's parameters go to every rank), trains on."""
    r = D.get_rank()
    device = opts.get("device", "cpu")
    x, y = data(64)
    out = {}

    def attempt(key, call):
        try:
            call()
            out[key] = "trained"
        except ValueError as e:
            out[key] = f"ValueError: {e}"

    def other(seed):
        return cmlp.MLP(SIZES, seed=seed).state_dict()

    model = cmlp.MLP(SIZES, seed=0, device=device)
    if r == 0:  # before the Trainer: as DistributedDataParallel, it starts every rank from rank 0's
        model.load_state_dict(other(7))
    opt = optimizer(model, "adam")
    trainer = cmlp.Trainer(model, opt, batch_size=8)
    attempt("before_trainer", lambda: trainer.fit(x, y, epochs=1, progress=False))
    out["before_trainer_spread"] = spread(params(model))
    out["from_rank_0"] = float(spread(np.array([params(model)[0]])))
    if r == 0:  # one rank loads a checkpoint
        model.load_state_dict(other(8))
    before = params(model)
    attempt("one_rank", lambda: trainer.fit(x, y, epochs=1, progress=False))
    attempt("one_rank_again", lambda: trainer.step(x[:8], y[:8]))  # (nothing was taken: it raises again)
    out["one_rank_unchanged"] = bool(np.array_equal(before, params(model))) and trainer.epochs == 1
    model.load_state_dict(other(8))  # now on every rank
    attempt("every_rank_same", lambda: trainer.step(x[:8], y[:8]))
    model.load_state_dict(other(20 + r))  # on every rank, each its own
    attempt("every_rank_own", lambda: trainer.step(x[:8], y[:8]))
    model.load_state_dict(other(8))
    attempt("fixed", lambda: trainer.step(x[:8], y[:8]))
    saved = opt.state_dict()
    model.zero_grad()  # a step of every rank's own, outside the trainer: each on its own gradients
    model.forward_backward(x[8 * r:8 * r + 8], y[8 * r:8 * r + 8])
    opt.step()
    attempt("own_step", lambda: trainer.step(x[:8], y[:8]))
    model.load_state_dict(other(8))
    opt.load_state_dict(saved)
    attempt("fixed_again", lambda: trainer.step(x[:8], y[:8]))
    state = opt.state_dict()  # the optimizer's state alone: the same step count, one moment of rank 1's nudged
    if r == 1:
        state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"] * 2.0
    opt.load_state_dict(state)
    attempt("state", lambda: trainer.step(x[:8], y[:8]))
    if r == 1:  # its parameters too
        model.load_state_dict(other(9))
    attempt("both", lambda: trainer.fit(x, y, epochs=1, progress=False))
    attempt("both_again", lambda: trainer.fit(x, y, epochs=1, progress=False))
    # rank 0's checkpoint (of the last state it trained from), read by every rank
    box = [dict(model=model.state_dict(), optimizer=opt.state_dict(), trainer=trainer.state_dict()) if r == 0 else None]
    D.broadcast_object_list(box)
    model.load_state_dict(box[0]["model"])
    opt.load_state_dict(box[0]["optimizer"])
    trainer.load_state_dict(box[0]["trainer"])
    attempt("checkpoint", lambda: trainer.fit(x, y, epochs=1, progress=False))
    out["checkpoint_spread"] = spread(np.concatenate([params(model)] + opt._c.get_state()[1]))
    out["epochs"], out["device"] = trainer.epochs, model.device
    # right after a Trainer is made (rank 0's parameters sent to every rank): one rank's change
    m2 = cmlp.MLP(SIZES, seed=0, device=device)
    o2 = optimizer(m2, "sgd")
    t2 = cmlp.Trainer(m2, o2, batch_size=8)
    if r == 1:
        m2.load_state_dict(other(9))
    attempt("after_trainer", lambda: t2.step(x[:8], y[:8]))
    m2.load_state_dict(other(9))
    attempt("sgd", lambda: t2.step(x[:8], y[:8]))
    # a trainer of each rank's own on the same model and optimizer, each on its own samples
    cmlp.Trainer(m2, o2, batch_size=8, distributed=False).step(x[8 * r:8 * r + 8], y[8 * r:8 * r + 8])
    attempt("local", lambda: t2.step(x[:8], y[:8]))
    # a second data-parallel trainer of the model, with an optimizer of its own: rank 1 changes
    # that optimizer's state alone, which the first trainer's calls do not compare
    m2.load_state_dict(other(9))
    o2.load_state_dict(dict(o2.state_dict(), state={}))
    o3 = optimizer(m2, "adam")
    t3 = cmlp.Trainer(m2, o3, batch_size=8)
    attempt("second", lambda: t3.step(x[:8], y[:8]))
    state = o3.state_dict()
    if r == 1:
        state["state"][1]["exp_avg_sq"] = state["state"][1]["exp_avg_sq"] * 2.0
    o3.load_state_dict(state)
    attempt("first_trainer", lambda: t2.step(x[:8], y[:8]))
    attempt("second_trainer", lambda: t3.step(x[:8], y[:8]))
    # AMSGrad in one param group: its maximum's "not started" mark, saved and loaded on rank 0
    m4 = cmlp.MLP(SIZES, seed=0, device=device)
    o4 = cmlp.optim.Adam(m4, param_groups=[{"params": ["fc1.weight", "fc1.bias"]},
                                           {"params": ["fc2.weight", "fc2.bias"], "amsgrad": True}])
    t4 = cmlp.Trainer(m4, o4, batch_size=8)
    t4.step(x[:8], y[:8])
    if r == 0:
        o4.load_state_dict(o4.state_dict())
    attempt("amsgrad_reloaded", lambda: t4.step(x[:8], y[:8]))
    # SGD's state_dict keeps no step count (as torch's): one loaded back on rank 0 alone, after
    # steps, trains on
    t2.step(x[:8], y[:8])
    if r == 0:
        o2.load_state_dict(o2.state_dict())
    attempt("sgd_reloaded", lambda: t2.step(x[:8], y[:8]))
    out["spread_at_end"] = spread(np.concatenate([params(m2), params(m4)]))
    return out


def evaluation_case(opts):
    """Validation that runs out of memory on one rank: that rank evaluates its share in smaller
    chunks, and every rank gets the group's result, the one without a limit."""
    r = D.get_rank()
    x, y = data(64)
    val = data(3000, seed=2)
    model = cmlp.MLP(SIZES, seed=0)
    trainer = cmlp.Trainer(model, optimizer(model, "adam"), batch_size=8)
    trainer.fit(x, y, epochs=1, progress=False)
    ref = cmlp.MLP(SIZES, seed=0)
    ref.load_state_dict(model.state_dict())
    if r == 1:  # room for training, not for 1000-row evaluation buffers
        cmlp.memory.set_memory_limit(cmlp.memory.memory_reserved("cpu"), "cpu")
    error = None
    try:
        hist = trainer.fit(x, y, epochs=1, validation_data=val, progress=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    cmlp.memory.set_memory_limit(None, "cpu")
    flags = np.array([error is not None], dtype=np.int64)
    D.all_reduce(flags)
    rows = np.array([trainer._eval_rows], dtype=np.int64)
    D.all_reduce(rows, "min")
    ref.load_state_dict(model.state_dict())  # the parameters the validation saw, on one process
    want = ref.evaluate(*val)
    return dict(error=error, raised=int(flags[0]), rows=int(rows[0]), rank_spread=spread(params(model)),
                val=None if error else [hist[0]["val_loss"], hist[0]["val_accuracy"]],
                want=[want["loss"], want["accuracy"]])


def uncaught_case(opts):
    """An exception nothing catches on rank 1: the job ends instead of waiting in rank 0's barrier."""
    if D.get_rank() == 1:
        raise KeyError("rank 1 fails alone")
    D.barrier()
    return {}


def exit_early_case(opts):
    """sys.exit on rank 1 while rank 0 waits for it in a barrier: rank 1 waits at its end for
    rank 0, which waits for rank 1; the group's timeout ends the job."""
    if D.get_rank() == 1:
        sys.exit(3)
    D.barrier()
    return {}


class _LoadsOnRank0Only:
    """An object that rank 1 cannot unpickle (as one whose module only some ranks have)."""

    def __init__(self):
        self.state = 1  # (an object without state is unpickled without __setstate__)

    def __setstate__(self, state):
        if D.get_rank() == 1:
            raise ImportError("not on this rank")
        self.__dict__.update(state)


def collectives_case(opts):
    w, r = D.get_world_size(), D.get_rank()
    out = {}
    for dt in (np.float32, np.float64, np.int64):
        a = np.arange(5, dtype=dt) + r
        D.all_reduce(a)
        b = np.arange(5, dtype=dt) * (r + 1)
        D.all_reduce(b, D.ReduceOp.MAX)
        c = np.arange(5, dtype=dt) - r
        D.all_reduce(c, "min")
        out[np.dtype(dt).name] = [a.tolist(), b.tolist(), c.tolist()]
    m = np.full((2, 3), float(r))
    D.broadcast(m, src=w - 1)
    out["broadcast"] = m.tolist()
    ll = np.arange(3, dtype=np.longlong)
    D.all_reduce(ll)
    out["longlong"] = ll.tolist()
    errors = []
    for call in (lambda: D.all_reduce(np.arange(6.0)[::2]), lambda: D.all_reduce(np.arange(3, dtype=np.int32)),
                 lambda: D.all_reduce(np.zeros(3), "prod"), lambda: D.broadcast(np.zeros(3), src=w),
                 lambda: D.all_reduce([1.0, 2.0]), lambda: D.init_process_group(),
                 lambda: D.all_reduce(np.arange(2, dtype=">f8")),
                 # objects: their bytes are pointers into the sender's process
                 lambda: D.broadcast(np.array([object()] * 4 if r == 0 else [None] * 4, dtype=object), src=0),
                 lambda: D.broadcast(np.zeros(2, dtype=[("a", "f8"), ("b", object)]), src=0)):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError, RuntimeError) as e:
            errors.append("/".join(k.__name__ for k in (TypeError, ValueError, RuntimeError) if isinstance(e, k)))
    out["errors"] = errors
    # torch's other reductions, its group and async_op arguments
    reduced = {}
    for op in ("avg", "product", "band", "bor", "bxor"):
        a = np.array([6, 5, 12], dtype=np.int64) + 3 * r if op != "avg" else np.array([1.0, 2.0]) * (r + 1)
        work = D.all_reduce(a, getattr(D.ReduceOp, op.upper()), group=D.group.WORLD, async_op=True)
        reduced[op] = [a.tolist(), work.wait(), work.is_completed()]
    out["reduced"] = reduced
    out["group_none"] = [D.get_rank(group=None), D.get_world_size(None), D.get_backend(None),
                         D.all_reduce(np.ones(2), group=None), D.barrier(group=None, device_ids=[0]),
                         D.broadcast(np.ones(2), 0, None, True).is_completed(),
                         D.all_gather([np.zeros(1) for _ in range(w)], np.ones(1), group=None, async_op=True).wait()]
    group_errors = []
    for call in (lambda: D.all_reduce(np.ones(2), group="other"), lambda: D.broadcast(np.ones(2), group=object()),
                 lambda: D.get_rank(group="g"), lambda: D.barrier(group=1),
                 lambda: D.all_reduce(np.ones(2), D.ReduceOp.BAND), lambda: D.all_reduce(np.ones(2, np.int64), "avg"),
                 lambda: D.all_reduce(np.ones(2), async_op=1), lambda: D.barrier(device_ids="0"),
                 lambda: D.all_gather_object([None] * w, 1, group="g")):
        try:
            call()
            group_errors.append(None)
        except (TypeError, ValueError) as e:
            group_errors.append(f"{type(e).__name__}: {e}")
    out["group_errors"] = group_errors
    # bad on one rank alone: every rank raises, none waits in the collective
    alone = []
    for call in (lambda: D.all_reduce(np.ones(2), async_op=1 if r == 0 else True),
                 lambda: D.barrier(device_ids="0" if r == 0 else [0]), lambda: D.barrier(group="x" if r else None),
                 lambda: D.all_gather([np.zeros(1) for _ in range(w)], np.ones(1), async_op=None if r else False),
                 lambda: D.broadcast(np.ones(2), async_op=0 if r else False)):
        try:
            call()
            alone.append(None)
        except (TypeError, ValueError) as e:
            alone.append(type(e).__name__)
    out["alone"] = alone
    big = np.full(3, 3e38, np.float32)  # avg scales each part first, as NCCL's: no overflow on the way
    D.all_reduce(big, D.ReduceOp.AVG)
    out["avg_big"] = big.tolist()
    # what else can differ between the ranks: the arrays' alignment, a structured dtype's fields,
    # an object list against none, the call itself
    unaligned = np.zeros(33, np.uint8)[1:].view(np.float64)
    structured = np.zeros(2, dtype=[("a", "<f8"), ("b", "<i8")] if r else [("x", "<i8"), ("y", "<f8")])
    differ2 = []
    for call in (lambda: D.all_reduce(unaligned if r else np.zeros(4)), lambda: D.broadcast(structured, src=0),
                 lambda: D.broadcast_object_list(None if r == 0 else [], src=0),
                 lambda: D.all_reduce(np.ones(2), "max") if r else D.broadcast(np.ones(2), src=1),
                 lambda: D.barrier() if r else D.all_reduce(np.ones(1))):
        try:
            call()
            differ2.append(None)
        except ValueError as e:
            differ2.append(str(e).split("differ in their ")[1].split(":")[0])
    out["differ2"] = differ2
    # an object rank 1 cannot unpickle: it raises, after every pickle was sent (none waits)
    objects = [None] * w
    try:
        D.all_gather_object(objects, _LoadsOnRank0Only())
        out["unpickle"] = "ran"
    except ImportError as e:
        out["unpickle"] = str(e)
    flags = np.array([out["unpickle"] == "ran"], dtype=np.int64)
    D.all_reduce(flags)  # and the group goes on
    out["unpickled_on"] = int(flags[0])
    # arguments that differ between the ranks: every rank raises, none waits or reads garbage
    out["differ"] = []
    for call in (lambda: D.all_reduce(np.ones(4 + r)), lambda: D.all_reduce(np.ones(4, np.float64 if r else np.float32)),
                 lambda: D.all_reduce(np.ones(4), "max" if r else "sum"), lambda: D.broadcast(np.ones((2, 2 + r))),
                 lambda: D.broadcast(np.ones(4), src=r), lambda: D.all_reduce(np.ones(8)[::1 + r])):
        try:
            call()
            out["differ"].append(None)
        except ValueError as e:
            out["differ"].append(str(e))
    agreed = np.ones(3)
    D.all_reduce(agreed)  # and the group goes on
    out["after_differ"] = agreed.tolist()
    # torch's gathering collectives: arrays, objects; and what one rank alone cannot do
    parts = [np.zeros((2, 2), np.float32) for _ in range(w)]
    D.all_gather(parts, np.full((2, 2), r + 0.5, np.float32))
    out["all_gather"] = [p[0, 0].item() for p in parts]
    objects = [None] * w
    D.all_gather_object(objects, {"rank": r, "name": f"r{r}"})
    out["all_gather_object"] = objects
    sent = [{"lr": 0.1}, "text", 3] if r == w - 1 else [None] * 3
    D.broadcast_object_list(sent, src=w - 1)
    out["broadcast_object_list"] = sent
    out["gather_errors"] = []
    for call in (lambda: D.all_gather_object([None] * (w + r), 1),
                 lambda: D.all_gather_object([None] * w, (lambda: 0) if r == 1 else 1),
                 lambda: D.broadcast_object_list([lambda: 0] if r == 0 else [None], src=0),
                 lambda: D.all_gather([np.zeros(2)] * w if r else [np.zeros(3)] * w, np.zeros(2))):
        try:
            call()
            out["gather_errors"].append(None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["gather_errors"].append(f"{type(e).__name__}: {e}"[:90])
    D.all_reduce(agreed)
    out["after_gather"] = agreed.tolist()
    D.barrier()
    out["rank"], out["world"] = r, w
    D.destroy_process_group()  # made again with torch's arguments: the launcher's ranks, or refused
    out["launcher"] = []
    for kw in (dict(world_size=w + 1), dict(rank=(r + 1) % w), dict(rank=0),
               dict(device_id="cpu" if r == 1 else r)):  # each rank's own GPU; a bad one on rank 1 alone
        try:
            D.init_process_group(**kw)
        except ValueError as e:
            out["launcher"].append(str(e))
    D.init_process_group("mpi", "env://", datetime.timedelta(minutes=30), world_size=w, rank=r, device_id=f"cuda:{r}")
    return out


def backend_case(opts):
    """A model on a CUDA device in a group made for the CPU (backend "mpi"): every rank raises."""
    model = cmlp.MLP(SIZES, seed=0, device=opts["device"])
    try:
        cmlp.Trainer(model, optimizer(model, "adam"), batch_size=8)
        return {"error": None}
    except RuntimeError as e:
        errors = np.array([1], dtype=np.int64)
        D.all_reduce(errors)
        return {"error": str(e), "ranks_raising": int(errors[0]), "backend": D.get_backend(),
                "local": [D.get_local_rank(), D.get_local_world_size()]}


def regroup_case(opts):
    """A trainer that outlives its process group: after destroy and init again it trains on with
    the new group's communicator (its captured step, made with the old one, is dropped)."""
    w = D.get_world_size()
    x, y = data(256)
    model = cmlp.MLP(SIZES, seed=4, device=opts["device"])
    trainer = cmlp.Trainer(model, optimizer(model, "adam"), batch_size=16)
    hist = trainer.fit(x, y, epochs=1, progress=False)
    D.destroy_process_group()
    D.init_process_group(opts.get("backend", "nccl"))
    hist += trainer.fit(x, y, epochs=1, progress=False)
    ref_model = cmlp.MLP(SIZES, seed=4, device=opts["device"])
    q0 = params(ref_model)
    cmlp.Trainer(ref_model, optimizer(ref_model, "adam"), batch_size=16 * w, distributed=False).fit(
        x, y, epochs=2, progress=False)
    p, q = params(model), params(ref_model)
    return dict(rank_spread=spread(p), epochs=len(hist), update_err=update_err(p, q, q0))


def state_bytes():
    return cmlp.memory.memory_breakdown(DEVICE[0]).get("optimizer state", 0)


DEVICE = ["cpu"]


def zero_case(opts):
    """ZeroRedundancyOptimizer against the same data-parallel run with the optimizer whole: the
    same parameters (bit for bit on 2 ranks), the state of 1/world of the parameters on each rank, the
    consolidated state equal to the whole optimizer's, and a state loaded back that trains on the
    same."""
    w, r = D.get_world_size(), D.get_rank()
    device = DEVICE[0] = opts.get("device", "cpu")
    Z = D.optim.ZeroRedundancyOptimizer
    sizes = opts.get("sizes", SIZES)
    x, y = data(opts.get("n", 400), sizes=sizes)
    kind = opts.get("opt", "adam")
    settings = {"adam": (cmlp.optim.Adam, dict(lr=1e-3)), "adamw": (cmlp.optim.AdamW, dict(lr=1e-3)),
                "adam-amsgrad": (cmlp.optim.Adam, dict(lr=1e-3, amsgrad=True)),
                "sgd": (cmlp.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
                # param groups whose parts the ranks' shards cut across
                "adamw-groups": (cmlp.optim.AdamW, dict(lr=1e-3, param_groups=[
                    {"params": ["fc1.weight"], "lr": 2e-3},
                    {"params": ["fc1.bias", "fc2.weight", "fc2.bias"], "weight_decay": 0.0}])),
                # state that one group keeps and the other does not (its entries left out, as torch's)
                "adam-amsgrad-groups": (cmlp.optim.Adam, dict(lr=1e-3, param_groups=[
                    {"params": ["fc1.weight"], "amsgrad": True}, {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}])),
                "sgd-groups": (cmlp.optim.SGD, dict(lr=0.05, momentum=0.9, param_groups=[
                    {"params": ["fc1.weight", "fc2.bias"], "momentum": 0.0},
                    {"params": ["fc1.bias", "fc2.weight"]}]))}[kind]
    kw = dict(batch_size=16, accumulation_steps=opts.get("accum", 1), amp=opts.get("amp"),
              max_grad_norm=opts.get("clip"), seed=2)

    def scaler():  # each run its own
        return cmlp.amp.GradScaler(init_scale=opts["init_scale"]) if "init_scale" in opts else None

    def run(sharded, epochs=2, state=None):
        model = cmlp.MLP(sizes, seed=10 + r, device=device)
        before = state_bytes()
        opt = Z(model, settings[0], **settings[1]) if sharded else settings[0](model, **settings[1])
        trainer = cmlp.Trainer(model, opt, scaler=scaler(), **kw)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        hist = trainer.fit(x, y, epochs=epochs, progress=False) if epochs else []
        held = state_bytes() - before
        return model, opt, hist, held

    m1, o1, h1, held1 = run(False)
    m2, o2, h2, held2 = run(True)
    o2.consolidate_state_dict(to=w - 1)
    whole = o1.state_dict()
    same_state, state_diff = np.zeros(1, dtype=np.int64), np.zeros(1)
    if r == w - 1:
        mine = o2.state_dict()
        same_state[0] = all(np.array_equal(mine["state"][i][k], whole["state"][i][k])
                            for i in whole["state"] for k in whole["state"][i])
        same_state[0] &= mine["param_groups"] == whole["param_groups"]
        state_diff[0] = max(float(np.max(np.abs(np.asarray(mine["state"][i][k], np.float64) - whole["state"][i][k])))
                            / max(float(np.max(np.abs(whole["state"][i][k]))), 1e-30)
                            for i in whole["state"] for k in whole["state"][i] if np.size(whole["state"][i][k]) > 1)
    D.all_reduce(same_state)  # rank w - 1's verdicts
    D.all_reduce(state_diff)
    refused = None
    if r != w - 1:
        try:
            o2.state_dict()
        except RuntimeError as e:
            refused = str(e)
    # a checkpoint of the first epoch, loaded into a sharded optimizer, continues as the whole one
    m3, o3, _, _ = run(False, epochs=1)
    m4, o4, _, _ = run(True, epochs=0, state=(m3.state_dict(), o3.state_dict()))
    cmlp.Trainer(m3, o3, scaler=scaler(), **kw).fit(x, y, epochs=1, progress=False)
    cmlp.Trainer(m4, o4, scaler=scaler(), **kw).fit(x, y, epochs=1, progress=False)
    lo, hi = o2.shard.start, o2.shard.stop
    local = o2.state  # this rank's state without a collective, the part in place and zeros elsewhere
    whole_keys = {i: set(e) for i, e in o1.state_dict()["state"].items()}
    local_ok = {i: set(e) for i, e in local.items()} == whole_keys
    # and its values are the rank's buffers (where a buffer has not started, zeros)
    _, raw = o2._c.get_state()
    views = [m2._split(b) for b in raw]
    names = [n for g in o2._param_groups for n in g._names]
    for i, entry in local.items():
        for bname, value in entry.items():
            if bname != "step":
                want = views[o2._buffers.index(bname)][names[i]].copy()
                if bname in ("momentum_buffer", "max_exp_avg_sq"):
                    want[_not_started(bname, want)] = 0.0
                local_ok &= np.array_equal(value, want)
    # the last step's gradients: this rank's part summed (by the reduce-scatter, without
    # clipping), the rest not; the emulated NCCL fills what a rank does not own with NaN
    g1, g2 = m1._c.get_grads().astype(np.float64), m2._c.get_grads()
    rest = np.concatenate([g2[:lo], g2[hi:]])
    p1 = params(m1).astype(np.float64)
    part_finite = np.isfinite(g1[lo:hi])  # a skipped last step leaves inf/NaN: compared as such
    return dict(grad_part_same=bool(np.array_equal(g1[lo:hi], g2[lo:hi], equal_nan=True)),
                grad_part_diff=float(np.max(np.abs(g1[lo:hi] - g2[lo:hi])[part_finite], initial=0.0)),
                grad_part_pattern=bool(np.array_equal(part_finite, np.isfinite(g2[lo:hi]))),
                grad_scale=float(np.max(np.abs(g1[np.isfinite(g1)]), initial=0.0)),
                rest_nan=bool(np.isnan(rest).all()) if rest.size else None,
                rest_same=bool(np.array_equal(g1[:lo], g2[:lo], equal_nan=True)
                               and np.array_equal(g1[hi:], g2[hi:], equal_nan=True)),
                world=w, same_params=bool(np.array_equal(params(m1), params(m2))), rank_spread=spread(params(m2)),
                param_diff=float(np.max(np.abs(p1 - params(m2)))), scale=float(np.max(np.abs(p1))),
                state_diff=float(state_diff[0]), resumed_diff=float(np.max(np.abs(params(m3) - params(m4).astype(
                    np.float64)))),
                loss=[h["loss"] for h in h2], ref_loss=[h["loss"] for h in h1], held=[held1, held2],
                shard=[lo, hi], n=m2.num_parameters(), same_state=bool(same_state[0]), refused=refused,
                resumed=bool(np.array_equal(params(m3), params(m4))),
                skipped=[h["skipped_steps"] for h in h2], ref_skipped=[h["skipped_steps"] for h in h1],
                local_state=bool(local_ok), norm_diff=max((abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                               for a, b in zip(h2, h1) if b.get("grad_norm")), default=0.0))


def zero_plan_case(opts):
    """The planner's peak for a data-parallel run with and without the optimizer's state sharded,
    against the peak the allocator measures on the rank that holds the most."""
    sizes = [784, 256, 128, 10]
    x, y = data(320)
    out = []
    for zero in (False, True):
        cmlp.memory.empty_cache("cpu")
        cmlp.memory.reset_peak_memory_stats("cpu")
        base = cmlp.memory.memory_allocated("cpu")
        model = cmlp.MLP(sizes, seed=0)
        opt = D.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam) if zero else cmlp.optim.Adam(model)
        cmlp.Trainer(model, opt, batch_size=32).fit(x, y, epochs=1, progress=False)
        peak = np.array([cmlp.memory.max_memory_allocated("cpu") - base], dtype=np.int64)
        D.all_reduce(peak, "max")
        out.append([int(peak[0]), cmlp.memory.plan(sizes, 32, opt).peak_bytes])
        del model, opt
    return {"peaks": out}


def zero_errors_case(opts):
    """What a ZeroRedundancyOptimizer refuses, and a step taken outside a trainer."""
    w, r = D.get_world_size(), D.get_rank()
    Z = D.optim.ZeroRedundancyOptimizer
    model = cmlp.MLP(SIZES, seed=r)
    out = {}
    for name, call in (("class", lambda: Z(model, "adam")), ("nested", lambda: Z(model, Z)),
                       ("group", lambda: Z(model, cmlp.optim.Adam, process_group=object())),
                       ("overlap", lambda: Z(model, cmlp.optim.Adam, overlap_with_ddp=True)),
                       ("bucket", lambda: Z(model, cmlp.optim.Adam, parameters_as_bucket_view="yes")),
                       ("setting", lambda: Z(model, cmlp.optim.Adam, lr=-1.0)),
                       ("alone", lambda: cmlp.Trainer(model, Z(model, cmlp.optim.SGD), distributed=False)),
                       ("to", lambda: Z(model, cmlp.optim.Adam).consolidate_state_dict(to=w)),
                       ("unconsolidated", lambda: Z(model, cmlp.optim.Adam).state_dict())):
        try:
            call()
            out[name] = None
        except (TypeError, ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    stepped = cmlp.optim.Adam(model)
    model.forward_backward(*data(8))
    stepped.step()
    try:
        stepped._c.shard(True)
        out["after_step"] = None
    except RuntimeError as e:
        out["after_step"] = str(e)
    # a step outside a data-parallel trainer (whose gradients no one summed over the ranks) is
    # refused before anything changes, by the optimizer and by a loss scaler alike
    opt = Z(model, cmlp.optim.SGD, lr=0.1, momentum=0.5)
    x, y = data(8, seed=r)
    model.zero_grad()
    model.forward_backward(x, y, loss_scale=1e38 if r == 1 else 1.0)  # inf on rank 1 only
    before, refused = params(model), []
    for call in (opt.step, lambda: cmlp.amp.GradScaler().step(opt), lambda: cmlp.amp.GradScaler().unscale_(opt),
                 opt._c.step):
        try:
            call()
        except RuntimeError as e:
            refused.append(str(e))
    out["standalone"] = refused
    out["unchanged"] = bool(np.array_equal(before, params(model))) and opt._c.get_state()[0] == 0
    # a group made again with the same ranks keeps the parts
    D.destroy_process_group()
    D.init_process_group(opts.get("backend", "mpi"))
    trainer = cmlp.Trainer(model, opt, batch_size=8)
    trainer.fit(*data(64), epochs=1, progress=False)
    out["regroup_spread"] = spread(params(model))
    # the consolidated state goes with the settings of the moment (as torch's), and a state
    # loaded afterwards makes it stale: state_dict() asks for a consolidation again
    opt.consolidate_state_dict(to=0)
    opt.lr = 0.025
    out["consolidated_lr"] = opt.state_dict()["param_groups"][0]["lr"] if r == 0 else None
    if r == 0:
        opt.load_state_dict(opt.state_dict())
        try:
            opt.state_dict()
        except RuntimeError as e:
            out["after_load"] = str(e)
    D.destroy_process_group()
    try:  # a trainer for a sharded optimizer whose group is gone
        cmlp.Trainer(model, opt, batch_size=8)
    except ValueError as e:
        out["no_group"] = str(e)
    D.init_process_group(opts.get("backend", "mpi"))
    # a state loaded on one rank only: consolidation refuses on every rank instead of waiting
    m2 = cmlp.MLP([8, 40, 3], seed=1)
    o2 = Z(m2, cmlp.optim.Adam)
    cmlp.Trainer(m2, o2, batch_size=8).fit(*data(64, sizes=[8, 40, 3]), epochs=1, progress=False)
    if r == 0:
        o2.load_state_dict({"state": {}, "param_groups": [dict(o2._group(), params=[0, 1, 2, 3])]})
    try:
        o2.consolidate_state_dict(0)
    except RuntimeError as e:
        out["mismatched"] = str(e)
    out["isinstance"] = [isinstance(opt, cmlp.optim.SGD), isinstance(opt, Z), type(opt).__name__]
    out["world_rank"] = [opt.world_size, opt.rank]
    return out


def zero_partial_inf_case(opts):
    """A sharded step with a loss scaler whose scale overflows the summed gradients of one rank's
    part only: each rank checks its own part, and every rank must skip the step all the same."""
    r = D.get_rank()
    device = opts.get("device", "cpu")
    rng = np.random.default_rng(0)
    sizes = [64, 64, 4]
    x = (rng.standard_normal((16, 64)) * 300).astype(np.float32)
    y = rng.integers(0, 4, 16)
    probe = cmlp.MLP(sizes, seed=1)
    probe.forward_backward(x, y)  # the step's gradient, all 16 samples
    g = np.abs(probe._c.get_grads().astype(np.float64))
    model = cmlp.MLP(sizes, seed=1, device=device)
    opt = D.optim.ZeroRedundancyOptimizer(model, cmlp.optim.SGD, lr=0.1)
    chunk = opt._c.shards()[3]
    parts = [float(g[i:i + chunk].max()) for i in range(0, g.size, chunk)]
    scale = 3.0e38 / min(parts)  # finite where |g| <= min(parts), inf in the part with a larger one
    scaler = cmlp.amp.GradScaler(init_scale=scale)
    before = params(model).copy()
    trainer = cmlp.Trainer(model, opt, batch_size=8, scaler=scaler, shuffle=False)
    trainer.step(x[8 * r:8 * r + 8], y[8 * r:8 * r + 8])
    after = np.array([scaler.get_scale()])
    return {"parts": parts, "scale": float(np.float32(scale)), "unchanged": bool(np.array_equal(before, params(model))),
            "scale_spread": spread(after), "scale_after": float(after[0]), "spread": spread(params(model))}


def fork_case(opts):
    """A rank forks: the child takes part in no collective and does not finalize MPI at exit (the
    group and MPI are the parent's); the parent's group works on."""
    import os

    model = cmlp.MLP(SIZES, seed=1)
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.1), batch_size=8)
    x, y = data(64)
    sys.stdout.flush()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        said = {"rank": D.get_rank(), "initialized": D.is_initialized()}
        for name, call in (("all_reduce", lambda: D.all_reduce(np.ones(3))), ("barrier", D.barrier),
                           ("broadcast", lambda: D.broadcast(np.ones(3), src=0)),
                           ("step", lambda: trainer.step(x[:8], y[:8])), ("destroy", D.destroy_process_group),
                           ("init", lambda: D.init_process_group("mpi"))):
            try:
                call()
                said[name] = "ran"
            except (RuntimeError, ValueError) as e:
                said[name] = str(e)
        said["cpu"] = float(cmlp.MLP(SIZES, seed=1).forward(x[:2].astype(np.float32)).sum())
        os.write(wfd, json.dumps(said).encode())
        os.close(wfd)
        sys.exit(0)  # a normal exit: the atexit handlers run in the child
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:  # to the child's end
        said = f.read()
    _, status = os.waitpid(pid, 0)
    out = {"child": json.loads(said.decode()), "child_exit": os.waitstatus_to_exitcode(status)}
    # a child that ends on an exception nothing caught ends alone: the job is its parent's
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        os.dup2(wfd, 2)
        raise ValueError("uncaught in the child")
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    out["uncaught"] = [os.waitstatus_to_exitcode(status), "uncaught in the child" in err.decode(),
                       "ends the job" in err.decode()]
    trainer.fit(x, y, epochs=1, progress=False)  # the parent's group is untouched
    out["spread"] = spread(params(model))
    exits = np.array([out["child_exit"]], dtype=np.float64)
    D.all_reduce(exits, "max")
    out["max_child_exit"] = float(exits[0])
    return out


def late_launch_case(opts):
    """On the emulated GPU: rank 1's device memory in use (all but holes in live small-pool
    segments) when its first data-parallel Adam step (with clipping) needs the update's kernels,
    which CUDA loads at their first launch (the emulator so, with CMLP_EMU_MODULE_BYTES: read at
    its first launch, here). Every rank must raise before any takes the step, and once the memory
    is back every rank takes the next one alike."""
    w, r = D.get_world_size(), D.get_rank()
    if r == 1:
        os.environ.update(CMLP_EMU_MODULE_BYTES=str(8 << 20), CMLP_EMU_MEMORY=str(1 << 30))
    sizes, b = [20, 48, 5], 16
    x, y = data(b * w, sizes=sizes)
    model = cmlp.MLP(sizes, seed=1, device="cuda")
    warm = cmlp.MLP(sizes, seed=2, device="cuda")  # the forward's and backward's kernels, this rank alone
    cmlp.Trainer(warm, cmlp.optim.SGD(warm, lr=0.01), batch_size=b, distributed=False).step(x[:b], y[:b])
    opt = D.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam, lr=1e-3) if opts.get("zero") else \
        cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=b, max_grad_norm=opts.get("clip"))
    held = []
    if r == 1:
        size = 256 << 20
        while size >= 512:
            try:
                held.append((size, cmlp.memory.caching_allocator_alloc(size, "cuda")))
            except cmlp.OutOfMemoryError:
                size //= 2
        for s, p in [h for h in held if 4096 <= h[0] <= (64 << 10)]:
            cmlp.memory.caching_allocator_delete(p)
            held.remove((s, p))
    before = params(model)
    error = None
    try:
        trainer.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])
    except (cmlp.OutOfMemoryError, RuntimeError) as e:
        error = type(e).__name__ + ": " + str(e)
    errors = [None] * w
    D.all_gather_object(errors, error)
    unchanged = np.array_equal(before, params(model))
    for _, p in held:
        cmlp.memory.caching_allocator_delete(p)
    trainer.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])
    after = params(model)
    everywhere = np.array([int(unchanged)], np.int64)
    D.all_reduce(everywhere, "min")
    return dict(errors=errors, unchanged=bool(everywhere[0]), stepped=not np.array_equal(before, after),
                rank_spread=spread(after))


def interrupts_case(opts):
    """A Ctrl-C (SIGINT) that one rank catches: held until the ranks next agree, where every rank
    raises (that one KeyboardInterrupt), after the same steps; the group goes on in step. And
    ranks whose loss scalers differ raise before fit's first step."""
    import signal
    from cmlp import _fit_loop

    r = D.get_rank()
    out = {}
    x, y = data(1200)

    def trained(**kw):
        m = cmlp.MLP(SIZES, seed=0)
        return m, cmlp.Trainer(m, cmlp.optim.Adam(m, lr=1e-3), batch_size=2, **kw)

    def fit_together(m, trainer, key):  # every rank again, in step
        trainer.fit(x[:400], y[:400], epochs=1, progress=False)
        out[key + "_spread"] = spread(np.concatenate([params(m), [trainer.epochs]]))

    def interrupted(key, call):
        try:
            call()
            out[key] = "returned"
        except (KeyboardInterrupt, RuntimeError) as e:
            out[key] = f"{type(e).__name__}: {e}"
        errors = [None] * D.get_world_size()
        D.all_gather_object(errors, out[key])
        out[key] = errors

    # in fit's steps: rank 1 is interrupted after its third call into the epoch loop
    paced, calls = _fit_loop._paced, [0]

    def pacing(chunk, seconds):
        calls[0] += 1
        if r == 1 and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return paced(chunk, seconds)

    _fit_loop._paced = pacing
    m, trainer = trained()
    interrupted("steps", lambda: trainer.fit(x, y, epochs=2, progress=False))
    _fit_loop._paced = paced
    out["steps_epochs"] = trainer.epochs
    out["steps_state"] = spread(np.concatenate([params(m), [trainer.optimizer._c.get_state()[0]]]))
    fit_together(m, trainer, "steps")
    # at an epoch's end (in its warning's check, which every rank makes)
    m, trainer = trained()
    if r == 1:
        warn = trainer._warn_if_split
        trainer._warn_if_split = lambda *a, **k: (os.kill(os.getpid(), signal.SIGINT), warn(*a, **k))
    interrupted("epoch_end", lambda: trainer.fit(x[:400], y[:400], epochs=2, progress=False))
    trainer.__dict__.pop("_warn_if_split", None)
    out["epoch_end_epochs"] = trainer.epochs
    fit_together(m, trainer, "epoch_end")
    # in a step: before the ranks agree to take it (none does), and after (all do; rank 1 raises)
    for key, where in (("step_before", "_start_step"), ("step_after", "_push_scaler")):
        m, trainer = trained()
        before = params(m).copy()
        if r == 1:
            own = getattr(trainer, where)
            setattr(trainer, where, lambda *a, own=own: (os.kill(os.getpid(), signal.SIGINT), own(*a))[1])
        interrupted(key, lambda: trainer.step(x[r * 2:r * 2 + 2], y[r * 2:r * 2 + 2]))
        trainer.__dict__.pop(where, None)
        out[key + "_taken"] = not np.array_equal(before, params(m))
        fit_together(m, trainer, key)
    # loss scalers that differ (a scale loaded on one rank only): every rank raises before a step
    for key, scale in (("scaler_init", 2.0**10 * (1 + r)), ("scaler_update", 2.0**10)):
        scaler = cmlp.amp.GradScaler(init_scale=scale)
        m, trainer = trained(amp="fp16", scaler=scaler)
        if key == "scaler_update" and r == 1:
            scaler.update(4.0)
        before = params(m).copy()
        try:
            trainer.fit(x[:400], y[:400], epochs=1, progress=False)
            out[key] = "returned"
        except ValueError as e:
            out[key] = str(e)
        out[key + "_unchanged"] = bool(np.array_equal(before, params(m))) and trainer.epochs == 0
    return out


def checked_calls_case(opts):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: ranks that make different collective calls all raise,
    naming their own, and go on in step; a fit trains as without the checks."""
    r = D.get_rank()
    out = {}
    x, y = data(256)
    m = cmlp.MLP(SIZES, seed=0)
    trainer = cmlp.Trainer(m, cmlp.optim.Adam(m, lr=1e-3), batch_size=8)
    before = params(m).copy()
    for key, call in (("fit_vs_all_reduce", (lambda: trainer.fit(x, y, epochs=1, progress=False)) if r == 0 else
                       (lambda: D.all_reduce(np.zeros(3)))),
                      ("broadcast_vs_barrier", (lambda: D.broadcast(np.zeros(4), src=0)) if r == 0 else D.barrier),
                      ("sizes", lambda: D.all_reduce(np.zeros(3 + r))),
                      ("ops", lambda: D.all_reduce(np.zeros(3), "max" if r else "sum"))):
        try:
            call()
            error = "returned"
        except (RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        errors = [None] * D.get_world_size()
        D.all_gather_object(errors, error)
        out[key] = errors
    out["unchanged"] = bool(np.array_equal(before, params(m))) and trainer.epochs == 0
    trainer.fit(x, y, epochs=1, progress=False)
    out["spread"] = spread(params(m))
    return out


CASES = {"checked_calls": checked_calls_case, "interrupts": interrupts_case, "late_launch": late_launch_case, "zero_partial_inf": zero_partial_inf_case, "fork": fork_case, "zero": zero_case, "zero_errors": zero_errors_case, "zero_plan": zero_plan_case, "regroup": regroup_case, "backend": backend_case,
         "evaluation": evaluation_case, "uncaught": uncaught_case, "fit": fit_case, "step": step_case, "calls": calls_case,
         "small_data": small_data_case,
         "failure": failure_case, "mismatch": mismatch_case, "changed": changed_case, "collectives": collectives_case,
         "exit_early": exit_early_case}


def main():
    name = sys.argv[1]
    opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    timeout = datetime.timedelta(seconds=opts["timeout"]) if "timeout" in opts else None
    if "debug" in opts:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = opts["debug"]
    D.init_process_group(opts.get("backend", "mpi"), timeout=timeout)
    out = CASES[name](opts)
    D.barrier()
    rank = D.get_rank()
    if rank == 0:
        print(json.dumps(out), flush=True)
    if not opts.get("keep_group"):
        D.destroy_process_group()
    if rank == 0:  # the other ranks end first, and wait for this one at their end
        time.sleep(opts.get("linger", 0))


if __name__ == "__main__":
    main()
