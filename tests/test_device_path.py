"""The GPU's training path, run on the CPU: with CMLP_TRAIN_DEVICE_PATH=1 the trainer copies the
data set into device memory and gathers each batch there, keeps the epoch position and the
optimizer's step count on the device, and reads them back once per call. It must train
bit for bit as the host path does."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import hashlib, json, sys
import numpy as np
import cmlp

rng = np.random.default_rng(0)
x8 = rng.integers(0, 256, (700, 30), dtype=np.uint8)
xf = rng.standard_normal((700, 30)).astype(np.float32)
y = rng.integers(0, 4, 700)
out = []
for amp, opt, recompute, shuffle, xs, smoothing, per_step in json.loads(sys.argv[1]):
    m = cmlp.MLP([30, 16, 4], seed=1)
    o = (cmlp.optim.Adam(m, weight_decay=0.01) if opt == "adam" else
         cmlp.optim.AdamW(m, lr=0.01, weight_decay=0.1) if opt == "adamw" else
         cmlp.optim.SGD(m, lr=0.05, momentum=0.9, dampening=0.1, nesterov=False))
    t = cmlp.Trainer(m, o, batch_size=64, accumulation_steps=2, microbatch_size=48, amp=amp, seed=3,
                     recompute=recompute, shuffle=shuffle, label_smoothing=smoothing)
    # a rate per step (warm-up, then a decay every other step): on the device path the rates
    # travel with each call's scalars and the step reads its own there
    S = cmlp.optim.lr_scheduler
    kw = {}
    if per_step == "warmup":
        kw = dict(scheduler=S.LambdaLR(o, lambda k: min(1.0, (k + 1) / 4) * 0.9 ** (k // 2)), scheduler_interval="step")
    elif per_step == "one-cycle":  # the momentum moves too, through 0 (SGD keeps its buffer)
        kw = dict(scheduler=S.OneCycleLR(o, max_lr=0.05, total_steps=12, pct_start=0.25, base_momentum=0.0),
                  scheduler_interval="step")
    h = t.fit(x8 if xs == "u8" else xf, y, epochs=2, progress=False, **kw)
    h += t.fit(xf, y, epochs=1, progress=False)
    weights = b"".join(v.tobytes() for v in m.state_dict().values())
    out.append({"weights": hashlib.sha1(weights).hexdigest(), "loss": [e["loss"] for e in h],
                "step": int(o._c.get_state()[0]), "skipped": [e.get("skipped_steps", 0) for e in h],
                "scale": t.scaler.get_scale() if t.scaler is not None else None})
# a run resumed from state dicts continues as the original does (SGD's loaded momentum included)
resumed = {}
for opt in ("sgd", "adam"):
    def make(m):
        return cmlp.optim.Adam(m) if opt == "adam" else cmlp.optim.SGD(m, lr=0.05, momentum=0.9)
    runs = []
    m = cmlp.MLP([30, 16, 4], seed=1)
    o = make(m)
    cmlp.Trainer(m, o, batch_size=64, shuffle=False).fit(xf, y, epochs=1, progress=False)
    m2 = cmlp.MLP([30, 16, 4], seed=2)
    m2.load_state_dict(m.state_dict())
    o2 = make(m2)
    o2.load_state_dict(o.state_dict())
    for mm, oo in ((m, o), (m2, o2)):
        cmlp.Trainer(mm, oo, batch_size=64, shuffle=False).fit(xf, y, epochs=1, progress=False)
        runs.append(b"".join(v.tobytes() for v in mm.state_dict().values()))
    resumed[opt] = runs[0] == runs[1]
# the device copy of the data set lives for one fit call, whatever its size
m = cmlp.MLP([30, 16, 4], seed=1)
t = cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=64)
t.fit(xf[:100], y[:100], epochs=2, progress=False)
small = cmlp.memory.memory_allocated("cpu")
t.fit(np.concatenate([xf] * 10), np.concatenate([y] * 10), epochs=2, progress=False)
released = cmlp.memory.memory_allocated("cpu") == small
print(json.dumps({"cases": out, "resumed": resumed, "released": released}))
'''

CASES = [
    [None, "adam", False, True, "u8", 0.0, False],
    [None, "sgd", False, False, "f32", 0.1, False],
    [None, "adam", True, True, "f32", 0.0, False],
    ["fp16", "sgd", False, True, "u8", 0.0, False],
    ["bf16", "adam", False, False, "u8", 0.05, False],
    ["fp16", "adam", True, True, "f32", 0.0, False],
    [None, "adamw", False, True, "u8", 0.0, "warmup"],
    [None, "sgd", False, False, "f32", 0.0, "warmup"],
    ["fp16", "adamw", False, True, "f32", 0.0, "warmup"],
    [None, "sgd", False, True, "u8", 0.0, "one-cycle"],
    ["fp16", "adam", False, False, "f32", 0.0, "one-cycle"],
]


def run(forced):
    env = dict(os.environ)
    env.pop("CMLP_TRAIN_DEVICE_PATH", None)
    if forced:
        env["CMLP_TRAIN_DEVICE_PATH"] = "1"
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def both():
    return run(False), run(True)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_the_device_path_trains_as_the_host_path(both, case):
    host, device = both[0]["cases"][case], both[1]["cases"][case]
    assert device["weights"] == host["weights"]
    assert device["step"] == host["step"] and device["skipped"] == host["skipped"]
    assert device["scale"] == host["scale"]
    for a, b in zip(device["loss"], host["loss"]):
        assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_run_resumed_from_state_dicts_continues_as_the_original(both, path, opt):
    assert both[path == "device"]["resumed"][opt]


@pytest.mark.parametrize("path", ["host", "device"])
def test_fit_frees_the_data_sets_device_copy_when_it_returns(both, path):
    assert both[path == "device"]["released"]
