"""Where the time of one small training step goes on the GPU: every kernel of cmlp's captured step
and of PyTorch's eager step (reference model, Adam, batch 32 by default, fp32 and fp16), from
the CUDA profiler: torch.profiler over CUPTI, which records each kernel the process runs, cmlp's
(inside its CUDA graph) included.

For each side and precision: the kernels by GPU time (launches per step, microseconds per launch
and per step), then the kernels' total per step against the synchronised wall time per step
measured without the profiler; the difference is time the GPU waits (launch latency, the host).
The batch-32 target of bench_gpu.py (10x PyTorch's steps per second) is decided there; this shows
what a step of either side is made of.

    PYTHONPATH=python python3 bench/profile_gpu.py [--batch 32] [--steps 300]

Without a GPU, or without PyTorch, it says so and exits 0. `--device cpu` profiles PyTorch's
operators on the CPU instead (cmlp's C loop is invisible to the profiler there): a smoke test of
this script, which tests/test_cuda_emulated.py runs.
"""
import argparse
import os
import sys
import time

import numpy as np

import cmlp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import SIZES, TorchBench, torch  # noqa: E402

NAME_WIDTH = 70


def short(name):
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."


def event_rows(prof, steps, on_gpu):
    """(name, launches per step, us per launch, us per step) of each kernel (on_gpu) or CPU
    operator, largest share first."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if on_gpu:
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = e.self_cuda_time_total
        else:
            if e.device_type != DeviceType.CPU or e.key.startswith("ProfilerStep"):
                continue
            us = e.self_cpu_time_total
        if e.count and us > 0:
            rows.append((e.key, e.count / steps, us / e.count, us / steps))
    return sorted(rows, key=lambda r: -r[3])


def print_side(title, rows, wall_us, top, on_gpu):
    busy = sum(r[3] for r in rows)
    launches = sum(r[1] for r in rows)
    what = "kernel" if on_gpu else "operator (CPU, self time)"
    print(f"### {title}")
    print()
    print(f"| {what} | per step | us each | us per step |")
    print("|---|---:|---:|---:|")
    for name, per_step, each, total in rows[:top]:
        print(f"| `{short(name)}` | {per_step:.2f} | {each:.2f} | {total:.2f} |")
    if len(rows) > top:
        rest = rows[top:]
        print(f"| ({len(rest)} more) | {sum(r[1] for r in rest):.2f} | | {sum(r[3] for r in rest):.2f} |")
    print()
    share = f", {100 * busy / wall_us:.0f}% of the wall time" if wall_us > 0 else ""
    print(f"{title}: {launches:.1f} {'launches' if on_gpu else 'calls'} and {busy:.1f} us of "
          f"{'kernels' if on_gpu else 'operators'} per step; wall {wall_us:.1f} us per step{share}")
    print()


def cmlp_side(device, batch, amp, steps, x, y, profile):
    model = cmlp.MLP(SIZES, device=device, seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model, lr=1e-3), batch_size=batch, amp=amp, seed=0)
    sync = (lambda: cmlp.cuda.synchronize(device)) if device != "cpu" else (lambda: None)
    trainer.fit(x, y, epochs=1, progress=False)  # warm-up: uploads, the capture
    sync()
    start = time.perf_counter()
    trainer.fit(x, y, epochs=1, progress=False)
    sync()
    wall_us = 1e6 * (time.perf_counter() - start) / steps
    with profile() as prof:
        trainer.fit(x, y, epochs=1, progress=False)
        sync()
    return prof, wall_us


def torch_side(bench, batch, amp, steps, xt, yt, profile):
    model, opt, scaler = bench.setup(amp)
    bench.loop(model, opt, scaler, xt, yt, batch, amp, min(steps, 50))  # warm-up
    sync = (lambda: torch.cuda.synchronize()) if bench.dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    bench.loop(model, opt, scaler, xt, yt, batch, amp, steps)
    sync()
    wall_us = 1e6 * (time.perf_counter() - start) / steps
    with profile() as prof:
        bench.loop(model, opt, scaler, xt, yt, batch, amp, steps)
        sync()
    return prof, wall_us


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="steps profiled per side and precision")
    parser.add_argument("--top", type=int, default=14, help="rows per table")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu: PyTorch's CPU operators only")
    args = parser.parse_args()
    if torch is None:
        print("profile_gpu: nothing profiled: PyTorch is not importable (its profiler records the kernels)")
        return 0
    on_gpu = args.device != "cpu"
    if on_gpu and not (torch.cuda.is_available() and cmlp.cuda.is_available()):
        print(f"profile_gpu: nothing profiled: torch.cuda.is_available() is {torch.cuda.is_available()}, "
              f"cmlp.cuda.is_available() is {cmlp.cuda.is_available()}")
        return 0
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]

    def profile():
        return torch_profile(activities=activities)

    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.integers(0, 256, (n, SIZES[0]), dtype=np.uint8)
    y = rng.integers(0, SIZES[-1], n).astype(np.int32)
    bench = TorchBench(args.device)
    xt = torch.from_numpy(x).to(bench.dev).float().mul_(2.0 / 255.0).sub_(1.0)
    yt = torch.from_numpy(y.astype(np.int64)).to(bench.dev)
    gpu = f", {torch.cuda.get_device_name(0)}" if on_gpu else ""
    print(f"profile_gpu: MLP {'-'.join(map(str, SIZES))}, Adam, batch {args.batch}, {args.steps} steps per run; "
          f"cmlp {cmlp.__version__}, torch {torch.__version__}{gpu}")
    print()
    unrecorded = []
    for amp in (None, "fp16"):
        name = amp or "fp32"
        if on_gpu:
            prof, wall = cmlp_side(args.device, args.batch, amp, args.steps, x, y, profile)
            rows = event_rows(prof, args.steps, True)
            print_side(f"cmlp, {name}", rows, wall, args.top, on_gpu)
            if not rows:  # graphs captured before the profiler first started may be invisible to it
                unrecorded.append(f"cmlp, {name}")
        prof, wall = torch_side(bench, args.batch, amp, args.steps, xt, yt, profile)
        print_side(f"PyTorch, {name}", event_rows(prof, args.steps, on_gpu), wall, args.top, on_gpu)
    if unrecorded:
        print(f"profile_gpu: no kernels recorded for {', '.join(unrecorded)}: the profiler did not see them "
              "(their times above are not measurements)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
