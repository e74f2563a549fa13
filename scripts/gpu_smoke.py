"""A first pass over cmlp's main GPU paths, one line per path, for scripts/device_check.sh.

Run with CMLP_CUDA_SYNC=1 (the device check does) so that every operation is synchronised and
an error names the operation that caused it; a crash, or the SIGTERM of a timeout, prints every
thread's Python stack. Where the output stops is where to look. Each path is compared with the
CPU, and a result outside its tolerance (tests/test_cuda.py's: fp32 forward 1e-5, gradients
1e-4, epoch losses 1e-3; half precision epoch losses 3e-2) or not finite makes the exit status
1.

    CMLP_CUDA_SYNC=1 PYTHONPATH=python python3 -X faulthandler scripts/gpu_smoke.py [cuda:0]
"""
import faulthandler
import signal
import sys

import numpy as np

import cmlp

SIZES = [784, 512, 256, 10]


FAILED = []


def say(what):
    print("smoke:", what, flush=True)


def expect(ok, what):
    if not ok:
        FAILED.append(what)
        say(f"WRONG: {what}")


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


def main():
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (1000, 784), dtype=np.uint8)
    y = rng.integers(0, 10, 1000)

    gpu, cpu = cmlp.MLP(SIZES, device=device, seed=0), cmlp.MLP(SIZES, seed=0)
    say(f"model on {gpu.device}, {gpu.num_parameters()} parameters")
    xf = x[:64].astype(np.float32) / 255.0
    d = rel(gpu.forward(xf), cpu.forward(xf))
    say(f"forward: relative difference from the CPU {d:.2e}")
    expect(d <= 1e-5, f"forward differs from the CPU by {d:.2e}")
    for model in (gpu, cpu):
        model.zero_grad()
    lg, lc = gpu.forward_backward(xf, y[:64]), cpu.forward_backward(xf, y[:64])
    g, c = np.concatenate([v.ravel() for v in gpu.grads().values()]), np.concatenate(
        [v.ravel() for v in cpu.grads().values()])
    d = rel(g, c)
    say(f"forward_backward: loss {lg:.6f} (CPU {lc:.6f}), gradients {d:.2e}")
    expect(abs(lg - lc) <= 1e-4 * abs(lc) and d <= 1e-4, f"forward_backward: loss {lg} vs {lc}, gradients {d:.2e}")

    for amp in (None, "fp16", "bf16"):
        for recompute in (False, True):
            runs = []
            for dev in (device, "cpu"):
                model = cmlp.MLP(SIZES, device=dev, seed=0)
                trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp, seed=0,
                                       recompute=recompute)
                loss = trainer.step(x[:64], y[:64])
                history = trainer.fit(x, y, epochs=2, progress=False)
                runs.append([loss] + [e["loss"] for e in history])
                if dev == device and dev.startswith("cuda"):  # fit's steps captured once, then replayed
                    kept, replays, dropped = trainer._c.graph_counts()
                    say(f"amp={amp} recompute={recompute}: graphs: {kept} captured, {replays} replays, "
                        f"{dropped} dropped")
                    expect(kept >= 1 and replays >= 1 and dropped == 0,
                           f"amp={amp} recompute={recompute}: graphs {kept} captured, {replays} replays, {dropped} "
                           "dropped (fit's steps ran eagerly)")
            got, want = np.array(runs[0]), np.array(runs[1])
            say(f"amp={amp} recompute={recompute}: Trainer.step then fit, losses {np.round(got, 5).tolist()} "
                f"(CPU {np.round(want, 5).tolist()})")
            tol = 1e-3 if amp is None else 3e-2
            expect(np.isfinite(got).all() and (np.abs(got - want) <= tol * np.abs(want)).all(),
                   f"amp={amp} recompute={recompute}: losses {got.tolist()} vs the CPU's {want.tolist()}")

    cmlp.cuda.synchronize(device)
    say(f"memory: {cmlp.memory.memory_allocated(device)} bytes allocated, "
        f"{cmlp.memory.memory_reserved(device)} reserved")
    say("done" if not FAILED else f"{len(FAILED)} wrong: " + "; ".join(FAILED))
    if FAILED:
        sys.exit(1)


if __name__ == "__main__":
    main()
