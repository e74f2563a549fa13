"""CPU benchmark of the reference workload: MLP 784-512-256-10 (ReLU), cross-entropy, Adam lr=1e-3,
Fashion-MNIST training set (60,000 uint8 images normalised with mean 0.5, std 0.5).

Measured in one process, for batch sizes 32, 128 and 512 (each number the best of 3 interleaved
runs, since the machine is shared):
  - cmlp's training throughput: samples/s of Trainer.fit over full epochs (1 at batch 32, 2 at
    128, 4 at 512, so each run lasts a few seconds), after a warm-up;
  - PyTorch's throughput on the same data: the loop a competent user writes for speed on the CPU
    (data normalised once into a float32 tensor, a random permutation per epoch, fused Adam,
    zero_grad(set_to_none=True), 2 threads); the same epochs, after a 50-step warm-up;
  - the sgemm throughput of the OpenBLAS cmlp links (scipy-openblas32) on the 8 GEMM shapes of
    one training step at that batch size, looped for >= 2 s; and the share of it that a whole
    cmlp step reaches (2,407,424 GEMM FLOP per sample: forward 1,070,080, weight gradients
    1,070,080, input gradients of layers 2-3 267,264);
  - PyTorch's GEMM throughput (its MKL) on the same 8 shapes, looped for >= 2 s, and the share of
    it that PyTorch's step reaches: with both shares, the ratio a step could reach if each ran at
    its BLAS's speed is (sgemm / PyTorch GEMM) and what is left is the passes around the GEMMs.
With --accuracy it also trains 5 epochs at batch 32 (cmlp seed 0, and the PyTorch loop) and
reports test accuracy.

Run from the repository root:  PYTHONPATH=python python3 bench/bench_cpu.py [--accuracy]
"""
import argparse
import ctypes
import os
import re
import sys
import time

import numpy as np

import cmlp

SIZES = [784, 512, 256, 10]
EPOCHS = {32: 1, 128: 2, 512: 4}  # epochs timed per run: about 2-5 s each
FLOP_PER_SAMPLE = 2_407_424  # GEMM FLOP of one training step, per sample
REPEATS = 3  # each number is the best of this many runs
TARGETS = "batch 32 >= 2x PyTorch; batch 512 >= 1.2x PyTorch and >= 60% of sgemm throughput"

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    torch = None


# ---------------------------------------------------------------- cmlp

def cmlp_epoch(x, y, batch, epochs=1, seed=0, warmup=True):
    """Returns (samples/s over the epochs, model)."""
    model = cmlp.MLP(SIZES, seed=seed)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, seed=seed)
    if warmup:
        trainer.fit(x[:8192], y[:8192], epochs=1, progress=False)
    history = trainer.fit(x, y, epochs=epochs, progress=False)
    seconds = sum(h["seconds"] for h in history)
    return epochs * x.shape[0] / seconds, model


# ---------------------------------------------------------------- PyTorch

if torch is not None:
    class TorchMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(784, 512)
            self.fc2 = nn.Linear(512, 256)
            self.fc3 = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def to_torch(x, y):
    xt = torch.from_numpy(x).float().div_(255.0).sub_(0.5).div_(0.5)
    return xt, torch.from_numpy(y.astype(np.int64))


def torch_train(xt, yt, model, opt, batch, max_steps=None):
    """One epoch of shuffled mini-batches (or its first max_steps steps); returns samples seen."""
    loss_fn = nn.CrossEntropyLoss()
    n = xt.shape[0]
    perm = torch.randperm(n)
    seen = 0
    for step, start in enumerate(range(0, n, batch)):
        if max_steps is not None and step == max_steps:
            break
        idx = perm[start:start + batch]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xt[idx]), yt[idx])
        loss.backward()
        opt.step()
        seen += idx.shape[0]
    return seen


def torch_epoch(xt, yt, batch, epochs=1, seed=0, warmup=True):
    """Returns (samples/s over the epochs, model), after a warm-up of 50 steps."""
    torch.manual_seed(seed)
    model = TorchMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    if warmup:
        torch_train(xt, yt, model, opt, batch, max_steps=50)
    seen, start = 0, time.perf_counter()
    for _ in range(epochs):
        seen += torch_train(xt, yt, model, opt, batch)
    return seen / (time.perf_counter() - start), model


def torch_accuracy(model, xt, yt):
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item()


# ---------------------------------------------------------------- sgemm

def load_sgemm():
    import scipy_openblas32 as sob
    lib = ctypes.CDLL(os.path.join(sob.get_lib_dir(), "libscipy_openblas.so"))
    f = lib.scipy_cblas_sgemm
    i, fl, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [i, i, i, i, i, i, fl, p, i, p, i, fl, p, i]
    f.restype = None
    return f


def step_gemms(batch):
    """The 8 GEMMs of one training step as (transA, transB, M, N, K, beta), row-major, weights
    [out, in], as cmlp calls them (weight gradients accumulate: beta = 1)."""
    NT, T = 111, 112
    layers = list(zip(SIZES[:-1], SIZES[1:]))
    fwd = [(NT, T, batch, o, i, 0.0) for i, o in layers]        # Y[B,out] = X[B,in] W^T
    wgrad = [(T, NT, o, i, batch, 1.0) for i, o in layers]      # dW[out,in] += dY^T X
    igrad = [(NT, NT, batch, i, o, 0.0) for i, o in layers[1:]]  # dX[B,in] = dY[B,out] W
    return fwd + wgrad + igrad


def sgemm_gflops(sgemm, batch, seconds=2.0):
    rng = np.random.default_rng(0)
    calls = []
    for ta, tb, m, n, k, beta in step_gemms(batch):
        a = rng.standard_normal(m * k, dtype=np.float32)
        b = rng.standard_normal(k * n, dtype=np.float32)
        c = np.zeros(m * n, dtype=np.float32)  # with beta = 1 it grows like a random walk: no overflow
        lda = m if ta == 112 else k
        ldb = k if tb == 112 else n
        calls.append((ta, tb, m, n, k, a, lda, b, ldb, beta, c))
    flop = sum(2.0 * m * n * k for _, _, m, n, k, *_ in calls)

    def run(reps):
        for _ in range(reps):
            for ta, tb, m, n, k, a, lda, b, ldb, beta, c in calls:
                sgemm(101, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb,
                      beta, c.ctypes.data, n)

    run(10)  # warm-up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run(10)
        reps += 10
    return reps * flop / (time.perf_counter() - start) / 1e9


def torch_gemm_gflops(batch, seconds=2.0):
    """PyTorch's GEMMs on the shapes of step_gemms (mm for the products written over, addmm_ for
    the weight gradients that accumulate)."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for ta, tb, m, n, k, beta in step_gemms(batch):
        a = torch.randn(k, m, generator=gen).t() if ta == 112 else torch.randn(m, k, generator=gen)
        b = torch.randn(n, k, generator=gen).t() if tb == 112 else torch.randn(k, n, generator=gen)
        c = torch.zeros(m, n)
        calls.append((a, b, c, beta))
    flop = sum(2.0 * a.shape[0] * b.shape[1] * a.shape[1] for a, b, _, _ in calls)

    def run(reps):
        for _ in range(reps):
            for a, b, c, beta in calls:
                if beta:
                    c.addmm_(a, b)
                else:
                    torch.mm(a, b, out=c)

    run(10)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run(10)
        reps += 10
    return reps * flop / (time.perf_counter() - start) / 1e9


# ---------------------------------------------------------------- report

def machine_lines():
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    lines = [f"machine: {model}, nproc {os.cpu_count()}",
             f"cmlp {cmlp.__version__}, BLAS: {cmlp.build_info()['blas']}"]
    if torch is None:
        lines.append("torch: not importable; PyTorch columns are empty")
    else:
        config = torch.__config__.show()
        blas = re.search(r"BLAS_INFO=(\w+)", config)
        mkl = re.search(r"Math Kernel Library Version ([^ ]+)", config)
        lines.append(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
                     f"BLAS: {blas.group(1) if blas else 'unknown'}"
                     + (f" (MKL {mkl.group(1)})" if mkl else ""))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accuracy", action="store_true",
                        help="also train 5 epochs at batch 32 and report test accuracy")
    args = parser.parse_args()

    (x, y), (x_test, y_test) = cmlp.datasets.fashion_mnist()
    if torch is not None:
        torch.set_num_threads(2)
        xt, yt = to_torch(x, y)
    sgemm = load_sgemm()

    # Best of REPEATS interleaved runs: the machine is shared, and slow outliers are noise.
    best = {batch: [0.0, 0.0, 0.0, 0.0] for batch in EPOCHS}  # cmlp, PyTorch, sgemm, PyTorch's GEMMs
    for _ in range(REPEATS):
        for batch, epochs in EPOCHS.items():
            runs = [cmlp_epoch(x, y, batch, epochs)[0],
                    torch_epoch(xt, yt, batch, epochs)[0] if torch is not None else 0.0,
                    sgemm_gflops(sgemm, batch),
                    torch_gemm_gflops(batch) if torch is not None else 0.0]
            best[batch] = [max(a, b) for a, b in zip(best[batch], runs)]
            print(f"batch {batch}: cmlp {runs[0]:,.0f}/s, PyTorch {runs[1] or float('nan'):,.0f}/s, "
                  f"sgemm {runs[2]:.1f} GFLOP/s, PyTorch GEMMs {runs[3] or float('nan'):.1f} GFLOP/s",
                  file=sys.stderr, flush=True)
    rows = [(batch, *best[batch]) for batch in EPOCHS]

    print("| batch | cmlp samples/s | PyTorch samples/s | ratio | cmlp step GFLOP/s "
          "| sgemm GFLOP/s at those shapes | share of sgemm | PyTorch GEMM GFLOP/s | PyTorch's share |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, ours, theirs, gemm, tgemm in rows:
        step = FLOP_PER_SAMPLE * ours / 1e9
        torch_col = f"{theirs:,.0f}" if theirs else "-"
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        tgemm_col = f"{tgemm:.1f}" if tgemm else "-"
        tshare = f"{100 * FLOP_PER_SAMPLE * theirs / 1e9 / tgemm:.0f}%" if theirs and tgemm else "-"
        print(f"| {batch} | {ours:,.0f} | {torch_col} | {ratio} | {step:.1f} | {gemm:.1f} "
              f"| {100 * step / gemm:.0f}% | {tgemm_col} | {tshare} |")
    print()
    for line in machine_lines():
        print(line)
    print(f"targets: {TARGETS}")
    ratio = {batch: ours / theirs if theirs else None for batch, ours, theirs, _, _ in rows}
    share = {batch: FLOP_PER_SAMPLE * ours / 1e9 / gemm for batch, ours, _, gemm, _ in rows}
    checks = [("batch 32 vs PyTorch", ratio[32], 2.0), ("batch 512 vs PyTorch", ratio[512], 1.2),
              ("batch 512 share of sgemm", share[512], 0.6)]
    print("; ".join(f"{name}: {value:.2f} ({'met' if value >= goal else 'NOT met'})"
                    for name, value, goal in checks if value is not None))

    if args.accuracy:
        _, model = cmlp_epoch(x, y, 32, epochs=5, warmup=False)
        acc = model.evaluate(x_test, y_test)["accuracy"]
        line = f"test accuracy after 5 epochs at batch 32: cmlp {100 * acc:.2f}%"
        if torch is not None:
            _, tmodel = torch_epoch(xt, yt, 32, epochs=5, warmup=False)
            line += f", PyTorch {100 * torch_accuracy(tmodel, *to_torch(x_test, y_test)):.2f}%"
        print(line)


if __name__ == "__main__":
    main()
