"""A first pass over cmlp's main GPU paths, one line per path, for scripts/device_check.sh.

Run with CMLP_CUDA_SYNC=1 (the device check does) so that every operation is synchronised and
an error names the operation that caused it; with `python3 -X faulthandler` a crash prints the
Python stack. Where the output stops is where to look. Each path is compared with the CPU, so
a wrong result shows here too, before the full tests.

    CMLP_CUDA_SYNC=1 PYTHONPATH=python python3 -X faulthandler scripts/gpu_smoke.py [cuda:0]
"""
import sys

import numpy as np

import cmlp

SIZES = [784, 512, 256, 10]


def say(what):
    print("smoke:", what, flush=True)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (1000, 784), dtype=np.uint8)
    y = rng.integers(0, 10, 1000)

    gpu, cpu = cmlp.MLP(SIZES, device=device, seed=0), cmlp.MLP(SIZES, seed=0)
    say(f"model on {gpu.device}, {gpu.num_parameters()} parameters")
    xf = x[:64].astype(np.float32) / 255.0
    say(f"forward: relative difference from the CPU {rel(gpu.forward(xf), cpu.forward(xf)):.2e}")
    for model in (gpu, cpu):
        model.zero_grad()
    lg, lc = gpu.forward_backward(xf, y[:64]), cpu.forward_backward(xf, y[:64])
    g, c = np.concatenate([v.ravel() for v in gpu.grads().values()]), np.concatenate(
        [v.ravel() for v in cpu.grads().values()])
    say(f"forward_backward: loss {lg:.6f} (CPU {lc:.6f}), gradients {rel(g, c):.2e}")

    for amp in (None, "fp16", "bf16"):
        runs = []
        for dev in (device, "cpu"):
            model = cmlp.MLP(SIZES, device=dev, seed=0)
            trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, amp=amp, seed=0)
            loss = trainer.step(x[:64], y[:64])
            history = trainer.fit(x, y, epochs=2, progress=False)
            runs.append((loss, [e["loss"] for e in history]))
        say(f"amp={amp}: Trainer.step loss {runs[0][0]:.5f} (CPU {runs[1][0]:.5f}); fit epoch losses "
            f"{[round(v, 5) for v in runs[0][1]]} (CPU {[round(v, 5) for v in runs[1][1]]})")

    cmlp.cuda.synchronize(device)
    say(f"memory: {cmlp.memory.memory_allocated(device)} bytes allocated, "
        f"{cmlp.memory.memory_reserved(device)} reserved")
    say("done")


if __name__ == "__main__":
    main()
