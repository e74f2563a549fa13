"""A learning-rate schedule stepped with every optimizer step (warm-up, then cosine decay), on
the CPU, for the reference model (MLP 784-512-256-10, Adam) at batch 32 and 512.

Measured in one process:
  - scheduler.step() of that schedule, and of OneCycleLR (which moves Adam's beta1 too),
    cmlp's against torch's (the Python work a step adds), the best of 5 interleaved runs;
  - Trainer.fit throughput with scheduler_interval="step" and a SequentialLR of LinearLR
    (warm-up over the first 100 steps) and CosineAnnealingLR, against the same fit without a
    schedule: the rates are drawn in Python before each call into the C loop and travel with
    the call's scalars;
  - the same for PyTorch's loop (scheduler.step() after each fused Adam step), both with 2
    threads, on Fashion-MNIST (or random uint8 images when it is not installed).
  The fits run in 9 interleaved pairs (without, with the schedule); the throughputs shown are the
  best of each, and the slowdown is the median of the pairs' slowdowns (robust to a busy moment).
  A cmlp fit's time outside its C loop (its Python: the total less the epoch_run calls) is also
  shown per step, without and with the schedule, and the median of the pairs' differences: what
  the schedule adds, without the C loop's run-to-run spread (1-3% here, as large as the effect).
Targets: cmlp's scheduler.step() at least as fast as torch's (each schedule); the schedule slows a
cmlp fit by under 2%, judged by the Python it adds per step against the step's time (the
wall-clock slowdown beside it, and PyTorch's, move by the machine's spread).

Run from the repository root:  PYTHONPATH=python python3 bench/bench_schedule.py
"""
import sys
import time

import numpy as np

import cmlp
from bench_clip import SIZES, data, torch_data, torch_net  # the models and the data (this script's directory)
from cmlp.optim import lr_scheduler as S

REPEATS = 5
PAIRS = 9
WARMUP = 100  # steps of linear warm-up

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None


def schedule(lib, opt, steps):
    return lib.SequentialLR(opt, [lib.LinearLR(opt, start_factor=0.01, total_iters=WARMUP),
                                  lib.CosineAnnealingLR(opt, T_max=steps - WARMUP)], milestones=[WARMUP])


def one_cycle(lib, opt, steps):
    return lib.OneCycleLR(opt, max_lr=1e-2, total_steps=steps)


def step_time(lib, opt, make=schedule):
    """Seconds per scheduler.step() of the schedule, past its warm-up."""
    sched = make(lib, opt, 10**6)
    for _ in range(WARMUP + 1):
        sched.step()
    n, t0 = 20000, time.perf_counter()
    for _ in range(n):
        sched.step()
    return (time.perf_counter() - t0) / n


class TimedC:
    """A trainer's C object that adds up the time its epoch_run calls (the C training loop) take:
    the rest of a fit's time is its Python, which a schedule's steps add to."""

    def __init__(self, c):
        object.__setattr__(self, "c", c)
        object.__setattr__(self, "seconds", 0.0)

    def __getattr__(self, name):
        return getattr(self.c, name)

    def __setattr__(self, name, value):
        setattr(self.c, name, value)

    def epoch_run(self, *args):
        t0 = time.perf_counter()
        try:
            return self.c.epoch_run(*args)
        finally:
            object.__setattr__(self, "seconds", self.seconds + time.perf_counter() - t0)


def cmlp_fit(x, y, batch, scheduled):
    """(samples per second, seconds of Python per step: the fit's time outside the C loop)."""
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=batch)
    trainer.fit(x[:2048], y[:2048], epochs=1, progress=False)  # warm-up
    kw = dict(scheduler=schedule(S, opt, len(x) // batch + 1), scheduler_interval="step") if scheduled else {}
    timed = trainer._c = TimedC(trainer._c)
    t0 = time.perf_counter()
    record = trainer.fit(x, y, epochs=1, progress=False, **kw)[0]
    wall = time.perf_counter() - t0
    trainer._c = timed.c
    return record["samples_per_second"], (wall - timed.seconds) / -(-len(x) // batch)


def torch_fit(xt, yt, batch, scheduled):
    net = torch_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    sched = None

    def steps(n):
        perm = torch.randperm(xt.shape[0])
        for i in range(0, n, batch):
            idx = perm[i:i + batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
            if sched is not None:
                sched.step()

    steps(2048)  # warm-up, without the schedule (as cmlp_fit's)
    if scheduled:
        sched = schedule(torch.optim.lr_scheduler, opt, xt.shape[0] // batch + 1)
    t0 = time.perf_counter()
    steps(xt.shape[0])
    return xt.shape[0] / (time.perf_counter() - t0)


def main():
    x, y, what = data()
    print(f"cmlp {cmlp.__version__}, {cmlp.build_info()['blas']}")
    xt, yt = torch_data(x, y)
    print(f"training data: {what}")
    import warnings
    warnings.simplefilter("ignore")  # both warn of scheduler.step() without optimizer.step() here
    met = True
    for name, make in (("SequentialLR(LinearLR, CosineAnnealingLR)", schedule),
                       ("OneCycleLR (the rate and Adam's beta1)", one_cycle)):
        mine, theirs = [], []
        for _ in range(REPEATS):  # interleaved: a slow moment of the machine hits both
            mine.append(step_time(S, cmlp.optim.Adam(cmlp.MLP(SIZES)), make))
            if torch is not None:
                theirs.append(step_time(torch.optim.lr_scheduler, torch.optim.Adam(torch_net().parameters()), make))
        mine = min(mine)
        line = f"scheduler.step() of {name}: cmlp {mine * 1e6:.2f} us"
        if torch is not None:
            theirs = min(theirs)
            line += f", PyTorch {theirs * 1e6:.2f} us ({theirs / mine:.2f}x)"
            met = met and mine <= theirs
        print(line)
    print()
    print("| batch | cmlp samples/s | with a schedule per step | added per step | Python per step, without / with "
          "| added Python per step | PyTorch samples/s | with a schedule per step | added per step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (32, 512):
        runs, python = {}, {False: [], True: []}
        n = 20000 if batch == 32 else 60000  # about a second a run
        for _ in range(PAIRS):  # interleaved pairs: a busy moment spoils one pair
            for scheduled in (False, True):
                rate, outside = cmlp_fit(x[:n], y[:n], batch, scheduled)
                runs.setdefault(("cmlp", scheduled), []).append(rate)
                python[scheduled].append(outside)
                if torch is not None:
                    runs.setdefault(("torch", scheduled), []).append(torch_fit(xt[:n], yt[:n], batch, scheduled))

        def cost(lib):
            """The best throughputs, and the median of the pairs' time added per step and slowdown."""
            a, b = runs[(lib, False)], runs[(lib, True)]
            added = float(np.median([batch * (1 / u - 1 / v) for u, v in zip(b, a)]))
            slower = float(np.median([1 - u / v for u, v in zip(b, a)]))
            return max(a), max(b), added, slower

        c0, c1, added, slower = cost("cmlp")
        # the Python a schedule adds, against the step's time: the slowdown without the C loop's noise
        plain, scheduled = float(np.median(python[False])), float(np.median(python[True]))
        more = float(np.median([b - a for a, b in zip(python[False], python[True])]))
        share = more / (batch / c0)
        line = (f"| {batch} | {c0:,.0f} | {c1:,.0f} | {1e6 * added:+.1f} us ({100 * slower:+.1f}%) | "
                f"{1e6 * plain:.1f} / {1e6 * scheduled:.1f} us | {1e6 * more:+.1f} us ({100 * share:+.2f}%) |")
        met = met and share < 0.02
        if torch is not None:
            t0, t1, added, slower = cost("torch")
            line += f" {t0:,.0f} | {t1:,.0f} | {1e6 * added:+.1f} us ({100 * slower:+.1f}%) |"
        else:
            line += " - | - | - |"
        print(line)
    print(f"targets: scheduler.step() at least as fast as PyTorch's; a schedule per step slows fit by under 2%: "
          f"{'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
