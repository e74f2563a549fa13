"""A learning-rate schedule stepped with every optimizer step (warm-up, then cosine decay), on
the CPU, for the reference model (MLP 784-512-256-10, Adam) at batch 32 and 512.

Measured in one process, each number the best of 5 interleaved runs:
  - Trainer.fit throughput with scheduler_interval="step" and a SequentialLR of LinearLR
    (warm-up over the first 100 steps) and CosineAnnealingLR, against the same fit without a
    schedule: the rates are drawn in Python before each call into the C loop and travel with
    the call's scalars;
  - the same for PyTorch's loop (scheduler.step() after each fused Adam step), both with 2
    threads, on Fashion-MNIST (or random uint8 images when it is not installed).
Target: the schedule adds no more time to a cmlp step than it adds to a PyTorch step.

Run from the repository root:  PYTHONPATH=python python3 bench/bench_schedule.py
"""
import sys
import time

import numpy as np

import cmlp
from cmlp.optim import lr_scheduler as S

SIZES = [784, 512, 256, 10]
REPEATS = 5
WARMUP = 100  # steps of linear warm-up

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    torch = None


def data():
    try:
        (x, y), _ = cmlp.datasets.fashion_mnist()
        return x, y, "Fashion-MNIST (60,000 images)"
    except FileNotFoundError:
        rng = np.random.default_rng(0)
        return (rng.integers(0, 256, (60000, 784), dtype=np.uint8), rng.integers(0, 10, 60000),
                "random uint8 images (Fashion-MNIST is not installed)")


def schedule(lib, opt, steps):
    return lib.SequentialLR(opt, [lib.LinearLR(opt, start_factor=0.01, total_iters=WARMUP),
                                  lib.CosineAnnealingLR(opt, T_max=steps - WARMUP)], milestones=[WARMUP])


def cmlp_fit(x, y, batch, scheduled):
    model = cmlp.MLP(SIZES, seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=batch)
    trainer.fit(x[:2048], y[:2048], epochs=1, progress=False)  # warm-up
    kw = dict(scheduler=schedule(S, opt, len(x) // batch + 1), scheduler_interval="step") if scheduled else {}
    return trainer.fit(x, y, epochs=1, progress=False, **kw)[0]["samples_per_second"]


def torch_fit(xt, yt, batch, scheduled):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    sched = schedule(torch.optim.lr_scheduler, opt, xt.shape[0] // batch + 1) if scheduled else None

    def steps(n):
        perm = torch.randperm(xt.shape[0])
        for i in range(0, n, batch):
            idx = perm[i:i + batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
            if sched is not None:
                sched.step()

    steps(2048)
    t0 = time.perf_counter()
    steps(xt.shape[0])
    return xt.shape[0] / (time.perf_counter() - t0)


def main():
    x, y, what = data()
    print(f"cmlp {cmlp.__version__}, {cmlp.build_info()['blas']}")
    xt = yt = None
    if torch is not None:
        torch.set_num_threads(2)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        xt = torch.from_numpy((x.astype(np.float32) / 255.0 - 0.5) / 0.5)
        yt = torch.from_numpy(y.astype(np.int64))
    print(f"training data: {what}")
    print()
    print("| batch | cmlp samples/s | with a schedule per step | added per step | PyTorch samples/s | "
          "with a schedule per step | added per step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    met = True
    for batch in (32, 512):
        runs = {}
        n = 20000 if batch == 32 else 60000  # about a second a run
        for _ in range(REPEATS):  # interleaved: a busy moment spoils one sample of each
            for scheduled in (False, True):
                runs.setdefault(("cmlp", scheduled), []).append(cmlp_fit(x[:n], y[:n], batch, scheduled))
                if torch is not None:
                    runs.setdefault(("torch", scheduled), []).append(torch_fit(xt[:n], yt[:n], batch, scheduled))
        c0, c1 = max(runs[("cmlp", False)]), max(runs[("cmlp", True)])
        cost = batch * (1 / c1 - 1 / c0)  # seconds the schedule adds to a step
        line = f"| {batch} | {c0:,.0f} | {c1:,.0f} | {1e6 * cost:+.1f} us |"
        if torch is not None:
            t0, t1 = max(runs[("torch", False)]), max(runs[("torch", True)])
            torch_cost = batch * (1 / t1 - 1 / t0)
            line += f" {t0:,.0f} | {t1:,.0f} | {1e6 * torch_cost:+.1f} us |"
            met = met and cost <= max(torch_cost, 0.0) + 1e-6  # within a microsecond: timing noise
        else:
            line += " - | - | - |"
        print(line)
    print(f"target: a schedule stepped per step adds no more to a cmlp step than to a PyTorch step: "
          f"{'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
