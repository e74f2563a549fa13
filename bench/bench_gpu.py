"""GPU benchmark of the reference workload: MLP 784-512-256-10 (ReLU), cross-entropy, Adam lr=1e-3,
synthetic uint8 images 784 wide (normalised with mean 0.5, std 0.5) and int labels.

Measured in one process on one GPU, for batch 32, 8192 and 65536, in fp32 and fp16 (amp):
  - cmlp ms/step: Trainer.fit over E epochs of S steps after a warm-up epoch, from the C loop's
    own clock (the history's "seconds", which leaves out each epoch's set-up) plus whatever was
    still queued when fit returned (a cmlp.cuda.synchronize() timed after it); "fit wall" is
    the synchronised wall clock of the whole fit call per step, set-up included; "step()" is
    the per-call path: Trainer.step on a host batch, each call returning its loss;
  - PyTorch ms/step: nn.Sequential(Linear, ReLU, Linear, ReLU, Linear), nn.CrossEntropyLoss,
    torch.optim.Adam(lr=1e-3, fused=True where supported), for fp16 torch.autocast(float16) and
    torch.amp.GradScaler; the eager loop a competent user writes for speed: images normalised
    once into a float32 tensor on the GPU, one torch.randperm per epoch on the GPU indexing it,
    zero_grad(set_to_none=True), no .item() per step; synchronised before and after;
  - ratio: cmlp steps/s (fit) over PyTorch's;
  - peak memory of one configuration, from a fresh model: three Trainer.step calls on one
    uint8 batch, cmlp.memory.max_memory_allocated("cuda") after reset_peak_memory_stats minus
    what was allocated before; against torch.cuda.max_memory_allocated() for three steps of
    its loop on the same batch held as uint8 on the GPU and normalised each step. Allocations
    that outlive a model (per-process workspaces) are in the baseline on both sides;
  - cuBLAS alone at batch 65536 in fp16: the 8 GEMMs of one step (forward [B,in]x[in,out] for
    3 layers; weight gradients [out,B]x[B,in] for 3 layers; input gradients [B,out]x[out,in]
    for layers 2 and 3) through torch.mm (cuBLAS), fp16 in and out, timed with CUDA events;
    the share is (FLOP of a step / cmlp step time) / (the same FLOP / cuBLAS time);
  - a per-step schedule: cmlp ms/step at the smallest batch in fp32 with a OneCycleLR stepped
    after every step (fit's scheduler_interval="step"), against the same fit without it;
  - one stream: cmlp ms/step at the smallest batch with CMLP_CUDA_STREAMS=1 (a child process:
    the setting is read when a device opens), where a step otherwise makes its weight gradients on
    a second stream beside the input-gradient chain; the gain is one stream's time over two's.
Every timing is the best of REPEATS interleaved runs. 2,407,424 GEMM FLOP per sample per step.

Run from the repository root with the in-place CUDA build:
    PYTHONPATH=python python3 bench/bench_gpu.py [--quick]
Without PyTorch it prints cmlp's numbers and says so; without a GPU it says so and exits 0.
`--smoke` runs small batches (a smoke test of this script, whose numbers mean nothing); with
`--device cpu` both sides run on the CPU, memory unmeasured. tests/test_cuda_emulated.py runs the
smoke test on the emulated CUDA backend.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

import cmlp

SIZES = [784, 512, 256, 10]
FLOP_PER_SAMPLE = 2_407_424  # GEMM FLOP of one training step, per sample
PRECISIONS = (None, "fp16")  # amp: None is fp32
# batch (32, 8192, 65536): (steps per epoch S, timed epochs E, PyTorch timed steps)
PLAN = {32: (2000, 3, 1500), 8192: (16, 4, 48), 65536: (6, 4, 18)}
QUICK = {32: (400, 2, 300), 8192: (6, 2, 12), 65536: (3, 2, 6)}
SMOKE = {32: (6, 1, 6), 256: (3, 1, 3), 1024: (2, 1, 2)}  # --smoke (implied by --device cpu)
STEP_CALLS = {32: 300, 8192: 12, 65536: 4}  # Trainer.step calls timed
MEMORY_STEPS = 3
TARGETS = ("batch 32 >= 10x PyTorch steps/s; batch 65536 fp16 step >= 50% of cuBLAS throughput on its GEMMs; "
           "peak memory <= PyTorch's")

CHILD = "--one-stream-child"  # cmlp's rows of the smallest batch only, as JSON
try:
    # the child imports torch too, though it does not use it: cmlp's backend then binds the same
    # libcublasLt.so.13 as the parent's (torch's wheel's, loaded first), not the toolkit's
    import torch
    import torch.nn as nn
except ImportError:
    torch = None

M = cmlp.memory


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def precision_name(amp):
    return amp or "fp32"


# ---------------------------------------------------------------- cmlp

class CmlpBench:
    def __init__(self, device, step_calls):
        self.device = device
        self.step_calls = step_calls
        self.sync = (lambda: cmlp.cuda.synchronize(device)) if device != "cpu" else (lambda: None)

    def trainer(self, batch, amp):
        model = cmlp.MLP(SIZES, device=self.device, seed=0)
        return cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, amp=amp, seed=0)

    def timed_fit(self, trainer, x, y, epochs, **options):
        """One warm-up epoch (first use, captures, uploads), then `epochs` timed: (history, seconds by
        the loop's clock plus the wait for the queued work after it returns, seconds wall)."""
        trainer.fit(x, y, epochs=1, progress=False, **options)
        self.sync()
        start = time.perf_counter()
        history = trainer.fit(x, y, epochs=epochs, progress=False, **options)
        returned = time.perf_counter()
        self.sync()
        end = time.perf_counter()
        return history, sum(h["seconds"] for h in history) + (end - returned), end - start

    def fit_ms(self, x, y, batch, amp, epochs):
        """(ms/step by the loop's clock, ms/step wall, ms/step of Trainer.step, micro-batch)."""
        trainer = self.trainer(batch, amp)
        history, loop, wall = self.timed_fit(trainer, x, y, epochs)
        steps = epochs * (x.shape[0] // batch)
        calls = self.step_calls.get(batch, 3)
        rows = x.shape[0] // batch
        trainer.step(x[:batch], y[:batch])
        self.sync()
        t0 = time.perf_counter()
        for i in range(calls):
            j = i % rows
            trainer.step(x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch])
        self.sync()
        step_ms = 1e3 * (time.perf_counter() - t0) / calls
        micro = min(h["microbatch_size"] for h in history)
        del trainer
        gc.collect()
        return 1e3 * loop / steps, 1e3 * wall / steps, step_ms, micro

    def scheduled_ms(self, x, y, batch, amp, epochs):
        """ms/step by the loop's clock of the same fit with a OneCycleLR stepped after every step
        (scheduler_interval="step": the rates and momenta travel with each call's scalars)."""
        trainer = self.trainer(batch, amp)
        steps = x.shape[0] // batch
        sched = cmlp.optim.lr_scheduler.OneCycleLR(trainer.optimizer, max_lr=1e-3, total_steps=(epochs + 1) * steps)
        _, loop, _ = self.timed_fit(trainer, x, y, epochs, scheduler=sched, scheduler_interval="step")
        del trainer, sched
        gc.collect()
        return 1e3 * loop / (epochs * steps)

    def peak_bytes(self, x, y, batch, amp):
        gc.collect()
        M.empty_cache(self.device)
        base = M.memory_allocated(self.device)
        M.reset_peak_memory_stats(self.device)
        trainer = self.trainer(batch, amp)
        for _ in range(MEMORY_STEPS):
            trainer.step(x[:batch], y[:batch])
        self.sync()
        peak = M.max_memory_allocated(self.device) - base
        del trainer
        gc.collect()
        return peak


# ---------------------------------------------------------------- PyTorch

def torch_model():
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def torch_adam(model):
    try:
        return torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(model.parameters(), lr=1e-3)


def torch_sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class TorchBench:
    """The PyTorch side, on "cuda" (or "cpu" for --device cpu, where memory is not measured)."""

    def __init__(self, dev):
        self.dev = torch.device(dev)
        self.loss_fn = nn.CrossEntropyLoss()
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as in cmlp
        torch.backends.cudnn.allow_tf32 = False

    def setup(self, amp):
        torch.manual_seed(0)
        model = torch_model().to(self.dev)
        opt = torch_adam(model)
        scaler = torch.amp.GradScaler(self.dev.type, enabled=amp == "fp16")
        return model, opt, scaler

    def step(self, model, opt, scaler, xb, yb, amp):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(self.dev.type, dtype=torch.float16, enabled=amp == "fp16"):
            loss = self.loss_fn(model(xb), yb)
        if amp == "fp16":
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    def loop(self, model, opt, scaler, xt, yt, batch, amp, steps):
        n = xt.shape[0]
        perm, pos = torch.randperm(n, device=self.dev), 0
        for _ in range(steps):
            if pos + batch > n:
                perm, pos = torch.randperm(n, device=self.dev), 0
            idx = perm[pos:pos + batch]
            pos += batch
            self.step(model, opt, scaler, xt[idx], yt[idx], amp)

    def ms(self, xt, yt, batch, amp, steps, warmup):
        model, opt, scaler = self.setup(amp)
        self.loop(model, opt, scaler, xt, yt, batch, amp, warmup)
        torch_sync(self.dev)
        start = time.perf_counter()
        self.loop(model, opt, scaler, xt, yt, batch, amp, steps)
        torch_sync(self.dev)
        ms = 1e3 * (time.perf_counter() - start) / steps
        del model, opt, scaler
        return ms

    def peak_bytes(self, x, y, batch, amp):
        if self.dev.type != "cuda":
            return None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model, opt, scaler = self.setup(amp)
        xb8 = torch.from_numpy(x[:batch]).to(self.dev)
        yb = torch.from_numpy(y[:batch].astype(np.int64)).to(self.dev)
        for _ in range(MEMORY_STEPS):
            xb = xb8.float().mul_(2.0 / 255.0).sub_(1.0)  # (x / 255 - 0.5) / 0.5
            self.step(model, opt, scaler, xb, yb, amp)
            del xb
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del model, opt, scaler, xb8, yb
        gc.collect()
        torch.cuda.empty_cache()
        return peak


def step_gemms(batch):
    """The 8 GEMMs of one training step as (M, N, K, kind): forward [B,in]x[in,out], weight
    gradients [out,B]x[B,in], input gradients [B,out]x[out,in] (layers 2 and 3)."""
    layers = list(zip(SIZES[:-1], SIZES[1:]))
    return ([(batch, o, i, "fwd") for i, o in layers] + [(o, i, batch, "wgrad") for i, o in layers]
            + [(batch, i, o, "igrad") for i, o in layers[1:]])


def cublas_ms(batch, dtype, dev, reps=30, rounds=3):
    """Best time of the 8 GEMMs of one step (dtype in and out) through torch.mm: cuBLAS on "cuda"
    (timed with CUDA events), the CPU BLAS on "cpu"."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (0.1 * torch.randn(*shape, generator=g, device=dev)).to(dtype)

    calls = []
    for m, n, k, kind in step_gemms(batch):
        if kind == "fwd":  # y[B,out] = x[B,in] w[out,in]^T
            a, b = rand(m, k), rand(n, k).t()
        elif kind == "wgrad":  # dw[out,in] = dy[B,out]^T x[B,in]
            a, b = rand(k, m).t(), rand(k, n)
        else:  # dx[B,in] = dy[B,out] w[out,in]
            a, b = rand(m, k), rand(k, n)
        calls.append((a, b, torch.empty(m, n, dtype=dtype, device=dev)))
    flop = sum(2.0 * m * n * k for m, n, k, _ in step_gemms(batch))
    assert flop == FLOP_PER_SAMPLE * batch, flop

    def run():
        for a, b, c in calls:
            torch.mm(a, b, out=c)

    for _ in range(3):
        run()
    torch_sync(dev)
    best = float("inf")
    for _ in range(rounds):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                run()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            best = min(best, 1e3 * (time.perf_counter() - t0) / reps)
    return best


def one_stream(args, device, failures):
    """{precision: ms/step} of the smallest batch with every step on one stream, from a child
    process; None on the CPU."""
    if device == "cpu":
        return None
    cmd = [sys.executable, os.path.abspath(__file__), CHILD, "--device", device]
    cmd += ["--smoke"] * args.smoke + ["--quick"] * args.quick
    try:
        r = subprocess.run(cmd, env=dict(os.environ, CMLP_CUDA_STREAMS="1"), capture_output=True, text=True,
                           timeout=100 if device != "cpu" and not args.smoke else 600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip()[-500:])
        one = json.loads(r.stdout.strip().splitlines()[-1])
        log(f"one stream: {one}")
        return one
    except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
        failures.append(f"one stream: {type(e).__name__}: {e}")
        log(f"bench_gpu: FAILED {failures[-1]}")
        return None


# ---------------------------------------------------------------- report

def mib(n):
    return f"{n / 2**20:,.1f}" if n is not None else "-"


def environment_lines(device, have_torch):
    info = cmlp.build_info()
    lines = [f"cmlp {cmlp.__version__}, CUDA {info.get('cuda')}, BLAS: {info.get('blas')}"]
    if torch is None:
        lines.append("torch: not importable; PyTorch and cuBLAS columns are empty")
    else:
        gpu = f", GPU {torch.cuda.get_device_name(0)}" if have_torch and device != "cpu" else ""
        lines.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}){gpu}"
                     + ("" if have_torch else ", not used"))
    lines.append(f"device: {device}; TF32 off in PyTorch; times are the best of the repeats")
    try:  # which cuBLASLt this process loaded (PyTorch's wheel brings its own)
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
        lines.append(f"cuBLASLt loaded: {', '.join(libs) or 'none'}")
    except OSError:
        pass
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and one repeat (about a third of the time)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (default); cpu: small batches on the CPU, a smoke test of this script")
    parser.add_argument("--smoke", action="store_true", help="small batches: a smoke test of this script")
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = args.device
    smoke = args.smoke or device == "cpu"
    started = time.perf_counter()

    if device != "cpu" and not cmlp.cuda.is_available():
        why = "has no CUDA backend" if not cmlp.build_info().get("cuda_compiled") else "finds no usable GPU"
        print(f"bench_gpu: nothing measured: this cmlp {why} (cmlp.cuda.is_available() is False); "
              "build with CMLP_CUDA=1 on a GPU machine")
        return 0
    have_torch = torch is not None and (device == "cpu" or torch.cuda.is_available())
    if torch is not None and not have_torch:
        log("bench_gpu: torch sees no GPU: PyTorch and cuBLAS columns are empty")
    plan = SMOKE if smoke else (QUICK if args.quick else PLAN)
    repeats = 1 if args.quick or smoke else 2

    rows_needed = max(s * b for b, (s, _, _) in plan.items())
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (rows_needed, SIZES[0]), dtype=np.uint8)
    y = rng.integers(0, SIZES[-1], rows_needed).astype(np.int32)
    log(f"bench_gpu: {rows_needed:,} synthetic samples ({x.nbytes / 2**20:,.0f} MiB uint8)")

    ours = CmlpBench(device, {} if smoke else STEP_CALLS)
    if args.one_stream_child:
        batch = min(plan)
        steps, epochs, _ = plan[batch]
        n = steps * batch
        print(json.dumps({precision_name(amp): min(ours.fit_ms(x[:n], y[:n], batch, amp, epochs)[0]
                                                   for _ in range(repeats)) for amp in PRECISIONS}))
        return 0
    theirs = TorchBench("cpu" if device == "cpu" else "cuda") if have_torch else None
    xt = yt = None
    if theirs is not None:
        xt = torch.from_numpy(x).to(theirs.dev).float().mul_(2.0 / 255.0).sub_(1.0)
        yt = torch.from_numpy(y.astype(np.int64)).to(theirs.dev)

    results, failures = {}, []
    for batch, (steps, epochs, torch_steps) in plan.items():
        n = steps * batch
        for amp in PRECISIONS:
            try:  # one broken configuration must not hide the others
                best = None
                torch_best = float("inf")
                for _ in range(repeats):
                    run = ours.fit_ms(x[:n], y[:n], batch, amp, epochs)
                    best = run if best is None or run[0] < best[0] else best
                    if theirs is not None:
                        torch_best = min(torch_best, theirs.ms(xt[:n], yt[:n], batch, amp, torch_steps,
                                                               warmup=min(steps, 50)))
                peak = ours.peak_bytes(x, y, batch, amp)
                torch_peak = theirs.peak_bytes(x, y, batch, amp) if theirs is not None else None
            except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
                failures.append(f"batch {batch} {precision_name(amp)}: {type(e).__name__}: {e}")
                log(f"bench_gpu: FAILED {failures[-1]}")
                gc.collect()
                continue
            results[(batch, amp)] = dict(ms=best[0], wall=best[1], step=best[2], micro=best[3],
                                         torch=torch_best if theirs is not None else None, peak=peak,
                                         torch_peak=torch_peak)
            r = results[(batch, amp)]
            log(f"batch {batch} {precision_name(amp)}: cmlp {r['ms']:.4f} ms/step (fit wall {r['wall']:.4f}, "
                f"step() {r['step']:.4f}), PyTorch {r['torch'] or float('nan'):.4f} ms/step; peak {mib(peak)} MiB "
                f"vs {mib(torch_peak)} MiB")

    cublas = None
    big = max(plan)
    if theirs is not None and (big, "fp16") in results:
        try:
            cublas = cublas_ms(big, torch.float16 if device != "cpu" else torch.float32, theirs.dev,
                               reps=3 if smoke else 10 if args.quick else 30)
            log(f"cuBLAS alone, batch {big} fp16: {cublas:.4f} ms for the 8 GEMMs of a step")
        except Exception as e:  # noqa: BLE001
            failures.append(f"cuBLAS alone: {type(e).__name__}: {e}")
            log(f"bench_gpu: FAILED {failures[-1]}")

    print("| batch | precision | cmlp ms/step | cmlp fit wall ms/step | cmlp step() ms | PyTorch ms/step "
          "| steps/s ratio | cmlp TFLOP/s | cmlp peak MiB | PyTorch peak MiB | peak ratio |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (batch, amp), r in results.items():
        micro = "" if r["micro"] == batch else f" (micro-batch {r['micro']})"
        cells = [str(batch), precision_name(amp) + micro, f"{r['ms']:.4f}", f"{r['wall']:.4f}", f"{r['step']:.4f}",
                 f"{r['torch']:.4f}" if r["torch"] else "-",
                 f"{r['torch'] / r['ms']:.2f}x" if r["torch"] else "-",
                 f"{FLOP_PER_SAMPLE * batch / (r['ms'] * 1e-3) / 1e12:.2f}", mib(r["peak"]), mib(r["torch_peak"]),
                 f"{r['peak'] / r['torch_peak']:.2f}" if r["torch_peak"] else "-"]
        print("| " + " | ".join(cells) + " |")
    share = None
    if cublas is not None:
        flop = FLOP_PER_SAMPLE * big
        step_ms = results[(big, "fp16")]["ms"]
        share = cublas / step_ms
        print()
        print("| batch | precision | cuBLAS GEMMs alone ms | cuBLAS TFLOP/s | cmlp step ms | cmlp step TFLOP/s "
              "| share of cuBLAS |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        print(f"| {big} | fp16 | {cublas:.4f} | {flop / (cublas * 1e-3) / 1e12:.1f} | {step_ms:.4f} "
              f"| {flop / (step_ms * 1e-3) / 1e12:.1f} | {100 * share:.0f}% |")
    print()
    for line in environment_lines(device, have_torch):
        print(line)
    print(f"targets: {TARGETS}")
    checks = []  # (what, value as text, met)
    for amp in PRECISIONS:
        r = results.get((32, amp))
        if r and r["torch"]:
            ratio = r["torch"] / r["ms"]
            checks.append((f"batch 32 {precision_name(amp)} steps/s vs PyTorch", f"{ratio:.2f}x", ratio >= 10.0))
    if share is not None:
        checks.append((f"batch {big} fp16 share of cuBLAS", f"{100 * share:.0f}%", share >= 0.5))
    for (batch, amp), r in results.items():
        if r["torch_peak"]:
            ratio = r["peak"] / r["torch_peak"]
            checks.append((f"batch {batch} {precision_name(amp)} peak memory / PyTorch's", f"{ratio:.2f}",
                           ratio <= 1.0))
    if smoke:  # (the targets are of the full batches on a GPU)
        print("targets not checked: a smoke test's numbers mean nothing")
    elif not checks:
        print("targets not checked: they need PyTorch on a GPU")
    for what, value, met in checks if not smoke else ():
        print(f"{what}: {value} ({'met' if met else 'MISSED'})")
    small = min(plan)
    if (small, None) in results:  # what a schedule stepped with every step adds (Python per step)
        steps, epochs, _ = plan[small]
        try:
            ms = min(ours.scheduled_ms(x[:steps * small], y[:steps * small], small, None, epochs)
                     for _ in range(repeats))
            plain = results[(small, None)]["ms"]
            print()
            print("| batch | precision | cmlp ms/step | with OneCycleLR per step | added per step |")
            print("|---:|---|---:|---:|---:|")
            print(f"| {small} | fp32 | {plain:.4f} | {ms:.4f} | {1e3 * (ms - plain):+.1f} us |")
        except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
            failures.append(f"per-step schedule: {type(e).__name__}: {e}")
            log(f"bench_gpu: FAILED {failures[-1]}")
    # last, in a child process that a time limit may cut short: the results above are printed
    one = one_stream(args, device, failures)
    if one:
        print()
        print("| batch | precision | cmlp ms/step, two streams | one stream | gain of two |")
        print("|---:|---|---:|---:|---:|")
        for amp in PRECISIONS:
            r, ms = results.get((small, amp)), one.get(precision_name(amp))
            if r and ms:
                print(f"| {small} | {precision_name(amp)} | {r['ms']:.4f} | {ms:.4f} | {ms / r['ms']:.2f}x |")
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"bench_gpu: {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
