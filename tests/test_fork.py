"""fork(): a child process made while other threads are inside cmlp.

A forked child has only the thread that forked. A model another thread was using at that moment
has its lock held for good and its state halfway through the call: in the child it is refused
with a RuntimeError (never a wait that does not end), and it is freed without being touched. The
models no thread was using work in the child, on the CPU, exactly as in the parent. The scripts
run in subprocesses with a timeout, so that a child that hangs fails the test instead of the run.
(A rank's child and the process group: tests/test_distributed.py; CUDA in a child:
tests/test_cuda.py.)
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_PYTHON = os.path.join(os.path.dirname(HERE), "python")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

_SCRIPT = r"""
import json, os, sys, threading, time
import numpy as np
import cmlp

rng = np.random.default_rng(0)
big = cmlp.MLP([784, 1024, 1024, 10], seed=0)
big_opt = cmlp.optim.SGD(big, lr=0.1)
big_trainer = cmlp.Trainer(big, big_opt, batch_size=8)
xb = rng.random((4096, 784), dtype=np.float32)
idle = cmlp.MLP([16, 32, 4], seed=1)
trainer = cmlp.Trainer(idle, cmlp.optim.Adam(idle, lr=1e-2), batch_size=8, seed=2)
x = rng.random((64, 16), dtype=np.float32)
y = rng.integers(0, 4, 64)

stop = False
def work():  # the big model's lock is held nearly all the time
    while not stop:
        big.forward(xb)
t = threading.Thread(target=work, daemon=True)
t.start()
time.sleep(0.3)

def in_child():
    said = {}
    for name, call in (("forward", lambda: big.forward(xb[:2])), ("step", big_opt.step),
                       ("fit", lambda: big_trainer.fit(xb[:8], y[:8], progress=False)),
                       ("lr", lambda: setattr(big_opt, "lr", 0.5))):
        try:
            call()
            said[name] = "ran"
        except RuntimeError as e:
            said[name] = str(e)
    said["sizes"] = list(big.layer_sizes)  # what needs no call into the core still answers
    trainer.fit(x, y, epochs=2, progress=False)
    said["idle_params"] = idle._c.get_params().tolist()
    del big_trainer_ref[:]  # the lost model, its optimizer and trainer go away untouched
    return said

big_trainer_ref = [big_trainer]
said, attempts = None, 0
while attempts < 20:
    attempts += 1
    sys.stdout.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                said = in_child()
            except BaseException as e:
                said = {"forward": "failed", "error": repr(e)}
            os.write(w, json.dumps(said).encode())
        finally:
            os._exit(0)
    os.close(w)
    text = b""
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        text += b
    os.close(r)
    _, status = os.waitpid(pid, 0)
    said = json.loads(text)
    said["exit"] = os.waitstatus_to_exitcode(status)
    if said["forward"] != "ran":  # the fork came while the other thread held the model
        break
stop = True
t.join()
trainer.fit(x, y, epochs=2, progress=False)
print(json.dumps({"child": said, "attempts": attempts, "parent_params": idle._c.get_params().tolist(),
                  "parent_works": bool(np.isfinite(big.forward(xb[:2])).all())}))
"""


def test_a_model_in_use_when_the_process_forks_is_refused_in_the_child_and_the_others_work():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    child = out["child"]
    assert child["exit"] == 0 and "error" not in child, child
    assert child["forward"] != "ran", f"no fork in {out['attempts']} came while the model was in use"
    for name in ("forward", "step", "fit", "lr"):
        assert "another thread was using them when the process was forked" in child[name], (name, child[name])
    assert child["sizes"] == [784, 1024, 1024, 10]
    # the model no thread was using trains in the child exactly as in the parent
    assert child["idle_params"] == out["parent_params"]
    assert out["parent_works"]
