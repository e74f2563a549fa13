"""Gradient clipping on the CPU, for the reference model (MLP 784-512-256-10, 535,818 parameters).

Measured in one process, each number the best of 5 interleaved runs:
  - clip_grad_norm_ on the model's gradients (L2 norm, then scaling by max_norm / norm):
    cmlp.nn.utils.clip_grad_norm_ on the flat gradient buffer, against
    torch.nn.utils.clip_grad_norm_ on the six gradient tensors of the same model (foreach, the
    default), both with 2 threads; also the time of one pass that reads the buffer (NumPy's
    sum of squares in float32) as the memory floor;
  - Trainer.fit throughput at batch 32 and 512 with max_grad_norm=0.1 (below the gradients'
    norm, about 0.6 at batch 32: every step computes the norm and scales) against without it, on
    Fashion-MNIST (or random uint8 images when it is not installed): the cost of clipping inside
    a training step;
  - the same for PyTorch's loop (clip_grad_norm_ between backward and the fused Adam step).
Targets: clip_grad_norm_ at least as fast as PyTorch's, and clipping adding no more time to a
cmlp step than it adds to a PyTorch step, at both batch sizes.

Run from the repository root:  PYTHONPATH=python python3 bench/bench_clip.py
"""
import sys
import time

import numpy as np

import cmlp

SIZES = [784, 512, 256, 10]
REPEATS = 5
CLIP = 0.1  # max_grad_norm in the training runs

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    torch = None


def best(fn, repeats=REPEATS):
    return min(fn() for _ in range(repeats))


def per_call(fn, seconds=0.5):
    """Seconds per call of fn, looped for about `seconds`."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def data():
    try:
        (x, y), _ = cmlp.datasets.fashion_mnist()
        return x, y, "Fashion-MNIST (60,000 images)"
    except FileNotFoundError:
        rng = np.random.default_rng(0)
        return (rng.integers(0, 256, (60000, 784), dtype=np.uint8), rng.integers(0, 10, 60000),
                "random uint8 images (Fashion-MNIST is not installed)")


def torch_net():
    """PyTorch's reference model (seed 0), as the loops of these benchmarks train it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def torch_data(x, y):
    """The training data as PyTorch's loop takes it (normalised as cmlp's fit does), with 2
    threads; (None, None) without torch."""
    if torch is None:
        return None, None
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    return torch.from_numpy((x.astype(np.float32) / 255.0 - 0.5) / 0.5), torch.from_numpy(y.astype(np.int64))


def cmlp_clip_time():
    model = cmlp.MLP(SIZES, seed=0)
    rng = np.random.default_rng(1)
    model.forward_backward(rng.standard_normal((64, 784)).astype(np.float32), rng.integers(0, 10, 64))
    # max_norm above the norm: the gradients stay as they are, so every call does the same work
    # (the norm); a second measurement scales them as well
    norm_only = per_call(lambda: cmlp.nn.utils.clip_grad_norm_(model, 1e30))
    g = model._c.get_grads()
    floor = per_call(lambda: np.dot(g, g))
    return norm_only, floor, model


def cmlp_clip_scaling_time(model):
    def run():
        model._c.clip_grad_norm(0.5, 2.0, False)  # scales: the norm is then 0.5, so ...
        model._c.clip_grad_norm(1.0, 2.0, False)  # ... this one scales nothing; count both as norm + scale + norm
    return per_call(run)


def torch_clip_times():
    net = torch_net()
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    F.cross_entropy(net(x), y).backward()
    params = list(net.parameters())
    norm_only = per_call(lambda: nn.utils.clip_grad_norm_(params, 1e30))

    def run():
        nn.utils.clip_grad_norm_(params, 0.5)
        nn.utils.clip_grad_norm_(params, 1.0)
    return norm_only, per_call(run)


def cmlp_fit(x, y, batch, clip):
    model = cmlp.MLP(SIZES, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, max_grad_norm=clip)
    trainer.fit(x[:2048], y[:2048], epochs=1, progress=False)  # warm-up
    return trainer.fit(x, y, epochs=1, progress=False)[0]["samples_per_second"]


def torch_fit(xt, yt, batch, clip):
    net = torch_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    params = list(net.parameters())

    def steps(n):
        perm = torch.randperm(xt.shape[0])
        for i in range(0, n, batch):
            idx = perm[i:i + batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(xt[idx]), yt[idx]).backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(params, clip)
            opt.step()

    steps(2048)
    t0 = time.perf_counter()
    steps(xt.shape[0])
    return xt.shape[0] / (time.perf_counter() - t0)


def main():
    x, y, what = data()
    print(f"cmlp {cmlp.__version__}, {cmlp.build_info()['blas']}")
    rows = []
    norm_c, floor, model = cmlp_clip_time()
    norm_c = min(norm_c, *(cmlp_clip_time()[0] for _ in range(REPEATS - 1)))
    scale_c = best(lambda: cmlp_clip_scaling_time(model))
    if torch is not None:
        torch.set_num_threads(2)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        norm_t, scale_t = min(torch_clip_times() for _ in range(REPEATS))
        rows.append(("clip_grad_norm_, norm only (us)", norm_c * 1e6, norm_t * 1e6, norm_t / norm_c))
        rows.append(("clip_grad_norm_ that scales, + one that does not (us)", scale_c * 1e6, scale_t * 1e6,
                     scale_t / scale_c))
    else:
        rows.append(("clip_grad_norm_, norm only (us)", norm_c * 1e6, None, None))
    print(f"one float32 pass over the 2.1 MB gradients (np.dot): {floor * 1e6:.0f} us")
    print(f"training data: {what}")
    xt = yt = None
    if torch is not None:
        xt = torch.from_numpy((x.astype(np.float32) / 255.0 - 0.5) / 0.5)
        yt = torch.from_numpy(y.astype(np.int64))
    costs, torch_costs = {}, {}
    for batch in (32, 512):
        runs = {}
        n = 20000 if batch == 32 else 60000  # about a second a run
        for _ in range(REPEATS):  # interleaved: a busy moment spoils one sample of each
            for clip in (None, CLIP):
                runs.setdefault(("cmlp", clip), []).append(cmlp_fit(x[:n], y[:n], batch, clip))
                if torch is not None:
                    runs.setdefault(("torch", clip), []).append(torch_fit(xt[:n], yt[:n], batch, clip))
        c0, c1 = max(runs[("cmlp", None)]), max(runs[("cmlp", CLIP)])
        costs[batch] = batch * (1 / c1 - 1 / c0)  # seconds clipping adds to a step
        line = (f"batch {batch}: cmlp {c0:,.0f} -> {c1:,.0f} samples/s with clipping "
                f"({100 * (1 - c1 / c0):+.1f}%, {1e6 * costs[batch]:+.0f} us a step)")
        if torch is not None:
            t0, t1 = max(runs[("torch", None)]), max(runs[("torch", CLIP)])
            torch_costs[batch] = batch * (1 / t1 - 1 / t0)
            line += (f"; PyTorch {t0:,.0f} -> {t1:,.0f} ({100 * (1 - t1 / t0):+.1f}%, "
                     f"{1e6 * torch_costs[batch]:+.0f} us); with clipping cmlp/PyTorch {c1 / t1:.2f}x")
        print(line)
    print()
    print("| measurement | cmlp | PyTorch | PyTorch / cmlp |")
    print("|---|---:|---:|---:|")
    for name, c, t, r in rows:
        print(f"| {name} | {c:.0f} | {'-' if t is None else f'{t:.0f}'} | {'-' if r is None else f'{r:.2f}x'} |")
    met = torch is None or (rows[0][3] >= 1.0 and all(costs[b] <= torch_costs[b] for b in costs))
    print(f"targets: clip_grad_norm_ >= PyTorch's speed; clipping adds no more to a step than in PyTorch: "
          f"{'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
