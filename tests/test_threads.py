"""Threads and interrupts: daemon threads still training when the interpreter exits, a
KeyboardInterrupt at any line of a Trainer's claim and release of its busy lock, and one
inside the optimizer's push of its groups' settings.
"""

import os
import sys

import numpy as np

import cmlp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import assert_exits_with_daemon_threads  # noqa: E402


def test_daemon_threads_training_when_the_interpreter_exits_let_it_exit(tmp_path):
    """After Python's finalisation, threads that released the GIL go on with their GEMMs while
    the shared libraries' destructors run (OpenBLAS unmaps its buffers and joins its threads):
    the exit crashed or hung about one run in four. cmlp's exit handler now waits for the calls
    under way and refuses new ones."""
    assert_exits_with_daemon_threads(tmp_path, os.environ, "cpu", 784, 20000, 0.05, runs=6)


_EXIT_HOOK_FIRST = r"""
import atexit, sys, threading, time
state = {}

def at_exit():  # registered before cmlp's own hook, so it runs after it
    m, opt = state["model"], state["opt"]
    m.to("cpu")
    opt.lr = 1e-3
    cmlp.memory._record_memory_history(None)
    print("hook done", m(np.ones((2, 64), np.float32)).shape, opt.lr, flush=True)

atexit.register(at_exit)
import numpy as np
import cmlp
m = cmlp.MLP([64, 256, 10]); opt = cmlp.optim.Adam(m)
state.update(model=m, opt=opt)

def forever(step):
    while True:
        step()

for step in (lambda: m.to("cpu"), lambda: setattr(opt, "lr", 2e-3),
             lambda: cmlp.memory._record_memory_history("all", device="cpu")):
    threading.Thread(target=forever, args=(step,), daemon=True).start()
time.sleep(0.3)
"""


def test_an_exit_callback_takes_the_locks_a_parked_daemon_thread_holds():
    """Once the exit has begun, a daemon thread's next call into the core waits for the
    process's end, holding the Python locks its frames hold (a model's move, an optimizer's
    settings, the memory history's): an exit callback that runs after cmlp's own hook (registered
    before cmlp was imported) and needs one of them waited for ever. It takes them over."""
    import subprocess
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", _EXIT_HOOK_FIRST], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "hook done (2, 10) 0.001\n", (r.returncode, r.stdout, r.stderr[-2000:])


def test_the_core_lock_is_a_reentrant_lock_as_threading_s():
    """Outside an exit it is threading.RLock: reentrant, released by its holder alone (a release
    too many raises and changes nothing), with RLock's timeout and non-blocking acquire."""
    import threading
    import time

    import pytest
    lock = cmlp._cmlp.CoreLock()
    with lock:
        with lock:
            pass
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        lock.release()
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    start = time.monotonic()
    assert lock.acquire(timeout=0.2) is False and time.monotonic() - start >= 0.19
    assert lock.acquire(False) is False
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        lock.release()
    done.set()
    t.join()
    assert lock.acquire(False) is True
    lock.release()
    for bad, match in ((dict(blocking=False, timeout=1), "non-blocking"), (dict(timeout=-2), "non-negative"),
                       (dict(timeout=float("nan")), "non-negative")):
        with pytest.raises(ValueError, match=match):
            lock.acquire(**bad)
    with pytest.raises(OverflowError, match="too large"):
        lock.acquire(timeout=float("inf"))


_FORK_TWINS = r"""
import copy, os, threading
import cmlp
m = cmlp.MLP([2, 3, 1]); opt = cmlp.optim.SGD(m, lr=0.1)
mc, oc = copy.copy(m), copy.copy(opt)
held = threading.Event()
def hold():
    with m._optimizers_lock, opt._lock:
        held.set(); threading.Event().wait()
threading.Thread(target=hold, daemon=True).start(); held.wait()
pid = os.fork()
if pid == 0:
    out = [mc._optimizers_lock is m._optimizers_lock, oc._lock is opt._lock]
    for o in (opt, oc):
        try:
            o.lr = 0.2
            out.append("set")
        except RuntimeError as e:
            out.append("torn" if "forked" in str(e) else str(e))
    m.to("cpu"); mc.to("cpu")
    print(*out, flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.WEXITSTATUS(status))
"""


def test_copy_copy_twins_take_the_same_new_locks_in_a_forked_child():
    """copy.copy's twin of a model or optimizer shares its locks: in a child forked while another
    thread held them, it took none (a move or a setting through it waited for ever), and the
    original took one of its own, so that the two no longer excluded each other."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _FORK_TWINS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "True True torn torn\n0\n", (r.stdout, r.stderr[-2000:])


# ---- a KeyboardInterrupt at any line of a call's claim, and of the optimizer's settings ----

def _injectable_lines(functions):
    """(file, line) of every line the functions run, but those of their except and finally
    blocks: a signal is delivered where the interpreter checks for one (a call's return, a loop's
    jump back), and the first thing such a block does (the claim's pop, the rollback) is a call."""
    import inspect
    lines = set()
    for fn in functions:
        source, first = inspect.getsourcelines(fn)
        handler_indent = None
        for k, text in enumerate(source):
            stripped, indent = text.strip(), len(text) - len(text.lstrip())
            if handler_indent is not None and stripped and indent <= handler_indent:
                handler_indent = None
            if stripped.startswith(("except", "finally:")):
                handler_indent = indent
                continue
            if handler_indent is None and stripped and not stripped.startswith(("#", "def ", '"""', "@")):
                lines.add((fn.__code__.co_filename, first + k))
    return lines


class _Interrupt(KeyboardInterrupt):
    pass


def _fit_interrupted_at(where, build, x, y):
    """Runs fit with a KeyboardInterrupt raised at the where-th time any of `where`'s lines runs
    (where: ((file, line), hit)); returns the model, optimizer, scheduler and trainer."""
    (target, hit) = where
    m, o, s, t = build()
    seen = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != target[0]:
            return None

        def local(fr, ev, a):
            if ev == "line" and (fr.f_code.co_filename, fr.f_lineno) == target:
                seen[0] += 1
                if seen[0] == hit:
                    raise _Interrupt()
            return local
        return local

    sys.settrace(tracer)
    try:
        t.fit(x, y, epochs=2, progress=False, scheduler=s)
    except _Interrupt:
        pass
    finally:
        sys.settrace(None)
    return m, o, s, t


def test_an_interrupt_at_any_line_of_fit_s_claim_or_of_the_optimizer_s_settings_loses_nothing():
    """Ctrl-C just after fit took the trainer left it taken for good ("already running fit in
    another thread" ever after), and one inside the push of a schedule's rate left the C optimizer
    at another rate than the Python one. At every line (first and last time it runs) of the
    claim, of fit and of the push, an interrupt now leaves the trainer free, the two rates equal,
    and the next fit training."""
    from cmlp import trainer as trainer_module
    from cmlp.optim import optimizer as optimizer_module

    rng = np.random.default_rng(0)
    x, y = rng.random((64, 20), dtype=np.float32), rng.integers(0, 4, 64)

    def build():
        m = cmlp.MLP([20, 16, 4], seed=1)
        o = cmlp.optim.Adam(m, lr=1e-3)
        return m, o, cmlp.optim.lr_scheduler.StepLR(o, 1, 0.5), cmlp.Trainer(m, o, batch_size=32)

    T = trainer_module.Trainer
    lines = _injectable_lines([T.fit, T._claim_agreed, T._claim, T._owner, T._agree,
                               optimizer_module.Optimizer._push_groups])
    hits = {}

    def count(frame, event, arg):
        def local(fr, ev, a):
            key = (fr.f_code.co_filename, fr.f_lineno)
            if ev == "line" and key in lines:
                hits[key] = hits.get(key, 0) + 1
            return local
        return local

    m, o, s, t = build()
    sys.settrace(count)
    try:
        t.fit(x, y, epochs=2, progress=False, scheduler=s)
    finally:
        sys.settrace(None)
    assert len(hits) > 20, hits
    for key, n in sorted(hits.items()):
        for hit in sorted({1, n}):
            m, o, s, t = _fit_interrupted_at((key, hit), build, x, y)
            where = f"{os.path.basename(key[0])}:{key[1]} (time {hit})"
            assert t._owner() is None and not t._claims, where
            assert o._c.lr == o._rates()[0] and o.lr == o.param_groups[0]["lr"], where
            history = t.fit(x, y, epochs=1, progress=False, scheduler=s)
            assert np.isfinite(history[-1]["loss"]), where
