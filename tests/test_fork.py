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

import cmlp

sys.path.insert(0, os.path.dirname(__file__))
from checks import FORKED  # noqa: E402

REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))  # the package imported here

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

_SCRIPT = FORKED + r"""
import gc, json, os, sys, threading, time
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
    for name, call in (("forward", lambda: big.forward(xb[:2])), ("state", big_opt.state_dict), ("step", big_opt.step),
                       ("fit", lambda: big_trainer.fit(xb[:8], y[:8], progress=False)),
                       ("lr", lambda: setattr(big_opt, "lr", 0.5))):
        try:
            call()
            said[name] = "ran"
        except RuntimeError as e:
            said[name] = str(e)
    try:
        cmlp.optim.SGD(big)
        said["new_optimizer"] = "ran"
    except RuntimeError as e:
        said["new_optimizer"] = str(e)
    said["sizes"] = [list(big.layer_sizes), big.num_parameters(), big.device]  # these still answer
    trainer.fit(x, y, epochs=2, progress=False)
    said["idle_params"] = idle._c.get_params().tolist()
    return said
def child():
    global big, big_opt, big_trainer
    try:
        said = in_child()
        # the lost model, its optimizer and trainer go away without being touched
        del big, big_opt, big_trainer
        gc.collect()
    except BaseException as e:
        said = {"forward": "failed", "error": repr(e)}
    return said
said, attempts = None, 0
while attempts < 20:
    attempts += 1
    said, code = forked(child)
    said["exit"] = code
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
    for name in ("forward", "state", "step", "fit", "lr", "new_optimizer"):
        assert "another thread was using them when the process was forked" in child[name], (name, child[name])
    assert child["sizes"] == [[784, 1024, 1024, 10], 1_863_690, "cpu"]
    # the model no thread was using trains in the child exactly as in the parent
    assert child["idle_params"] == out["parent_params"]
    assert out["parent_works"]


_BUSY_SCRIPT = FORKED + r"""
import json, os, sys, threading
import numpy as np
import cmlp

rng = np.random.default_rng(0)
x, y = rng.random((64, 16), dtype=np.float32), rng.integers(0, 4, 64)
model = cmlp.MLP([16, 32, 4], seed=1)
opt = cmlp.optim.SGD(model, lr=0.1)
trainer = cmlp.Trainer(model, opt, batch_size=8)
inside, go_on = threading.Event(), threading.Event()

def rate(epoch):  # fit calls it between epochs, in Python, with the trainer claimed
    if epoch == 1:
        inside.set()
        go_on.wait()
    return 1.0

scheduler = cmlp.optim.lr_scheduler.LambdaLR(opt, rate)
t = threading.Thread(target=lambda: trainer.fit(x, y, epochs=2, progress=False, scheduler=scheduler))
t.start()
inside.wait()
from cmlp import _history
holder_has, holder_go = threading.Event(), threading.Event()
def hold():  # another thread inside the memory history's lock
    with _history._lock:
        holder_has.set()
        holder_go.wait()
h = threading.Thread(target=hold)
h.start()
holder_has.wait()
def in_child():
    said = {}
    for name, call in (("step", lambda: trainer.step(x[:8], y[:8])), ("fit", lambda: trainer.fit(x, y, progress=False)),
                       ("state_dict", trainer.state_dict)):
        try:
            call()
            said[name] = "ran"
        except RuntimeError as e:
            said[name] = str(e)
    said["forward"] = float(model.forward(x[:2]).sum())  # the model was not inside a call
    said["snapshot"] = len(cmlp.memory._snapshot("cpu")["segments"]) >= 0
    said["other"] = bool(cmlp.Trainer(model, opt, batch_size=8).fit(x, y, epochs=1, progress=False))
    return said
child, code = forked(in_child)
go_on.set()
holder_go.set()
t.join()
h.join()
print(json.dumps({"child": child, "exit": code}))
"""


def test_a_trainer_running_fit_when_the_process_forks_is_refused_in_the_child():
    # its fit was in Python (a schedule's rate) when the fork came, and the memory history's lock
    # was held by another thread: the trainer is refused, the rest works (nothing waits)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _BUSY_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    child = out["child"]
    assert out["exit"] == 0
    for name in ("step", "fit", "state_dict"):
        assert "was running fit or step in another thread when the process was forked" in child[name], child
    assert child["snapshot"] and child["other"]


_OWN_FORK_SCRIPT = r"""
import json, os
import numpy as np
import cmlp

rng = np.random.default_rng(0)
x, y = rng.random((64, 16), dtype=np.float32), rng.integers(0, 4, 64)
model = cmlp.MLP([16, 32, 4], seed=1)
opt = cmlp.optim.SGD(model, lr=0.1)
trainer = cmlp.Trainer(model, opt, batch_size=8)
child = []

def rate(epoch):  # inside fit, in the thread running it
    if epoch == 1 and not child:
        pid = os.fork()
        child.append(pid == 0)
        if pid:
            os.waitpid(pid, 0)
    return 1.0

scheduler = cmlp.optim.lr_scheduler.LambdaLR(opt, rate)
history = trainer.fit(x, y, epochs=2, progress=False, scheduler=scheduler)
after = trainer.step(x[:8], y[:8])
said = {"epochs": len(history), "step": after, "params": model._c.get_params().tolist()}
if child[0]:
    with open(os.environ["CHILD_OUT"], "w") as f:
        json.dump(said, f)
    os._exit(0)
print(json.dumps(said))
"""


def test_a_fork_from_inside_fit_lets_the_forking_threads_fit_go_on_in_the_child(tmp_path):
    # the thread that forked is the one running fit: in the child its call goes on and ends as in
    # the parent, and the trainer works afterwards
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CHILD_OUT"] = str(tmp_path / "child.json")
    r = subprocess.run([sys.executable, "-c", _OWN_FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    parent = json.loads(r.stdout.strip().splitlines()[-1])
    with open(env["CHILD_OUT"]) as f:
        child = json.load(f)
    assert parent["epochs"] == 2 and child == parent


_GEMM_SCRIPT = r"""
import faulthandler, os, threading, time
import numpy as np
import cmlp
faulthandler.dump_traceback_later(150, exit=True)  # a hang fails, with every thread's stack
rng = np.random.default_rng(0)
x = rng.random((20000, 256), dtype=np.float32)
y = rng.integers(0, 10, 20000)
model = cmlp.MLP([256, 256, 10])
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=8)
stop = False

def train():
    while not stop:
        trainer.fit(x, y, epochs=1, progress=False)

thread = threading.Thread(target=train)
thread.start()
for _ in range(30):
    time.sleep(0.03)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
stop = True
thread.join()
print("all forks returned")
"""


def test_a_fork_while_another_thread_runs_gemms_returns():
    # OpenBLAS's own pre-fork handler stops its threads and waits for a GEMM of another thread
    # for ever; cmlp's fork waits for the GEMM in flight first (OpenBLAS with 2 threads)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", CMLP_NUM_THREADS="2")
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _GEMM_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "all forks returned" in r.stdout, r.stderr[-3000:]


_SETTINGS_SCRIPT = FORKED + r"""
import json, os, signal, sys, threading
import numpy as np
import cmlp

model = cmlp.MLP([16, 64, 4], seed=1)
opt = cmlp.optim.Adam(model, lr=1e-3, param_groups=[{"params": [0, 1]}, {"params": [2, 3]}])
x, y = np.ones((8, 16), np.float32), np.arange(8) % 4
stop = False
def work():  # the optimizer's lock (and the model's move lock) held nearly all the time
    i = 0
    while not stop:
        i += 1
        opt.param_groups[i % 2]["betas"] = (0.5 + (i % 7) / 100, 0.999)
        opt.eps = 1e-8 * (1 + i % 3)
        model.to("cpu")
t = threading.Thread(target=work, daemon=True)
t.start()

def in_child():
    signal.alarm(20)  # a wait that does not end fails the test
    said = {}
    for name, call in (("lr", lambda: setattr(opt, "lr", 0.5)), ("group", lambda: opt.param_groups[0].update(lr=0.1)),
                       ("step", opt.step), ("load", lambda: opt.load_state_dict(opt.state_dict())),
                       ("move", lambda: model.to("cpu")), ("new", lambda: cmlp.optim.SGD(model, lr=0.1))):
        try:
            call()
            said[name] = "ran"
        except RuntimeError as e:
            said[name] = str(e)
    other = cmlp.MLP([16, 8, 4], seed=2)
    o2 = cmlp.optim.SGD(other, lr=0.1)
    other.forward_backward(x, y)
    o2.step()
    said["other"] = "ran"
    return said

said, torn = [], 0
for attempt in range(40):
    child, code = forked(in_child)
    child = child if child is not None else {"exit": code}
    said.append(child)
    if any("were being changed by another thread when the process was forked" in str(v) for v in child.values()):
        torn += 1
        if torn >= 2:
            break
stop = True
t.join()
model.forward_backward(x, y)
opt.step()
print(json.dumps({"said": said, "torn": torn}))
"""


def test_an_optimizer_whose_settings_another_thread_changes_at_the_fork_is_refused_in_the_child():
    # its lock (held for good by a thread the child lacks) would make every setting, step or load
    # wait for ever there; the child refuses that optimizer, and the rest works
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", _SETTINGS_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torn"] >= 1, out
    for child in out["said"]:
        assert child.get("other") == "ran", child  # no child hung (the alarm) or failed elsewhere
        for name, said in child.items():
            assert said == "ran" or "cannot be used in this process" in said, (name, said)
