"""Every kind of cmlp kernel launched at least once, on small odd shapes, for a run under NVIDIA's
compute-sanitizer (scripts/device_check.sh: memcheck for out-of-bounds and misaligned accesses,
racecheck for shared-memory hazards), which makes each launch many times slower: the paths of
gpu_smoke.py and the test suite, at a size that finishes in seconds. A loss that is not finite
makes the exit status 1; the sanitizer's own verdict is its exit status.

    compute-sanitizer --tool memcheck --error-exitcode 86 python3 scripts/gpu_sanitize.py [cuda:0]
"""
import sys

import numpy as np

import cmlp

FAILED = []


def say(what):
    print("sanitize:", what, flush=True)


def finite(what, values):
    values = np.asarray(values, dtype=np.float64)
    if not np.isfinite(values).all():
        FAILED.append(what)
    say(f"{what}: {np.round(values, 5).tolist()}")


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    rng = np.random.default_rng(0)
    sizes = [20, 33, 7, 5]
    x = rng.integers(0, 256, (1100, sizes[0]), dtype=np.uint8)
    y = rng.integers(0, sizes[-1], 1100)
    xf = rng.standard_normal((1100, sizes[0])).astype(np.float32)

    # forward and backward alone: a batch that takes the second stream (<= 1024 rows), one that does
    # not, in each precision
    for rows in (31, 1025):
        for amp in (None, "fp16", "bf16"):
            model = cmlp.MLP(sizes, device=device, seed=1)
            loss = model.forward_backward(xf[:rows], y[:rows], amp=amp)
            finite(f"forward_backward rows={rows} amp={amp}", [loss, float(np.abs(model.forward(xf[:rows])).max())])

    # fit: the data set on the device (uint8, gathered and normalised there), shuffled, three epochs
    # so that a step is captured and replayed; then evaluate and predict
    configs = [
        dict(opt=("adam", dict(amsgrad=True)), amp=None, max_grad_norm=1.0, label_smoothing=0.1),
        dict(opt=("adamw", {}), amp="fp16", accumulation_steps=2),
        dict(opt=("sgd", dict(momentum=0.9, nesterov=True)), amp="bf16", recompute=True),
        dict(opt=("groups", {}), amp=None, max_grad_norm=0.5),
    ]
    for cfg in configs:
        kind, kwargs = cfg.pop("opt")
        model = cmlp.MLP(sizes, device=device, seed=2)
        if kind == "adam":
            opt = cmlp.optim.Adam(model, lr=1e-3, **kwargs)
        elif kind == "adamw":
            opt = cmlp.optim.AdamW(model, lr=1e-3, **kwargs)
        elif kind == "sgd":
            opt = cmlp.optim.SGD(model, lr=0.05, **kwargs)
        else:  # param groups: the first layer at its own rate and momentum, the rest at the default
            groups = [{"params": ["fc1.weight", "fc1.bias"], "lr": 0.01, "momentum": 0.5},
                      {"params": ["fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]}]
            opt = cmlp.optim.SGD(model, lr=0.05, momentum=0.9, param_groups=groups)
        trainer = cmlp.Trainer(model, opt, batch_size=64, seed=3, **cfg)
        history = trainer.fit(x, y, epochs=3, progress=False)
        scores = model.evaluate(x[:300], y[:300], batch_size=128)
        predicted = model.predict(xf[:77])
        finite(f"fit {kind} {cfg}", [e["loss"] for e in history] + list(scores.values()) + [float(predicted.sum())])

    cmlp.cuda.synchronize(device)
    say("done" if not FAILED else f"not finite: {'; '.join(FAILED)}")
    if FAILED:
        sys.exit(1)


if __name__ == "__main__":
    main()
