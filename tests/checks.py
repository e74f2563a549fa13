"""Checks shared by the test files: the allocator's statistics against its snapshot, deep
bitwise equality of state dicts, an interpreter's exit with daemon threads still training, and
a fork inside a subprocess script."""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np

import cmlp

M = cmlp.memory


def snapshot_sums(snap):
    """Per pool: segments, reserved, allocations, allocated, requested, inactive split blocks/bytes."""
    out = {p: dict.fromkeys(["segment", "reserved_bytes", "allocation", "allocated_bytes", "requested_bytes",
                             "inactive_split", "inactive_split_bytes"], 0) for p in ("large_pool", "small_pool")}
    for seg in snap:
        s = out["small_pool" if seg["segment_type"] == "small" else "large_pool"]
        s["segment"] += 1
        s["reserved_bytes"] += seg["total_size"]
        assert seg["total_size"] == sum(b["size"] for b in seg["blocks"])
        split = len(seg["blocks"]) > 1
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                s["allocation"] += 1
                s["allocated_bytes"] += b["size"]
                s["requested_bytes"] += b["requested_size"]
            elif split:
                s["inactive_split"] += 1
                s["inactive_split_bytes"] += b["size"]
    return out


def assert_stats_match_snapshot(device):
    """The statistics are exactly what the snapshot adds up to, and the allocator validates."""
    gc.collect()
    stats, snap = M.memory_stats(device), M.memory_snapshot(device)
    addresses = [s["address"] for s in snap]
    assert addresses == sorted(addresses)
    for pool, sums in snapshot_sums(snap).items():
        for key, value in sums.items():
            assert stats[f"{key}.{pool}.current"] == value, (key, pool)
    for key in ("segment", "reserved_bytes", "allocation", "allocated_bytes", "inactive_split_bytes"):
        assert stats[f"{key}.all.current"] == stats[f"{key}.large_pool.current"] + stats[f"{key}.small_pool.current"]
    M._validate(device)


def unplanned(trainer, rows):
    """Trainer.step starts from the planner's micro-batch under a memory limit, as fit does; for
    a real out-of-memory inside a step, mark a step of rows under the limit set now as planned."""
    device = trainer.model.device
    trainer._step_planned = ((device, cmlp.memory.get_memory_limit(device)), frozenset({rows}))


def same(a, b):
    """Deep equality of state dicts: arrays bitwise, containers recursively."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


PAGE = 2 << 20  # the granule of expandable segments


def _state(snapshot):
    """Live blocks {address: bytes requested}, whole segments {address: size} and mapped pages of
    expandable segments, from a snapshot in PyTorch's format."""
    blocks, segments, pages = {}, {}, set()
    for seg in snapshot["segments"]:
        if seg["is_expandable"]:
            pages.update(range(seg["address"], seg["address"] + seg["total_size"], PAGE))
        else:
            segments[seg["address"]] = seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                blocks[b["address"]] = b["requested_size"]
    return blocks, segments, pages


def assert_history_explains(before, after):
    """`after`'s history, replayed from `before` (a snapshot taken just after recording began,
    whose own entry is the history's first), ends where `after` says memory is: every free names
    a live block of its size, every allocation a free place, and segments and pages come and go
    once. Returns the entries replayed."""
    trace = after["device_traces"][-1]
    assert trace and trace[0]["action"] == "snapshot", "the history must begin with the first snapshot"
    blocks, segments, pages = _state(before)
    entries = trace[1:]
    for i, e in enumerate(entries):
        act = e["action"]
        if act == "alloc":
            assert e["addr"] not in blocks, (i, e)
            blocks[e["addr"]] = e["size"]
        elif act == "free_requested":
            assert blocks.pop(e["addr"], None) == e["size"], (i, e)
            nxt = entries[i + 1]
            assert (nxt["action"], nxt["addr"], nxt["size"]) == ("free_completed", e["addr"], e["size"]), (i, e)
        elif act == "segment_alloc":
            assert e["addr"] not in segments, (i, e)
            segments[e["addr"]] = e["size"]
        elif act == "segment_free":
            assert segments.pop(e["addr"], None) == e["size"], (i, e)
        elif act in ("segment_map", "segment_unmap"):
            assert e["size"] > 0 and e["size"] % PAGE == 0, (i, e)
            span = set(range(e["addr"], e["addr"] + e["size"], PAGE))
            if act == "segment_map":
                assert not span & pages, (i, e)
                pages |= span
            else:
                assert span <= pages, (i, e)
                pages -= span
        else:
            assert act in ("free_completed", "oom", "snapshot"), (i, e)
    assert (blocks, segments, pages) == _state(after)
    return entries


def fill_cache_but(device, room):
    """Takes the cache's free blocks (caching_allocator_alloc) but `room` bytes of the largest,
    so that under a limit at what is allocated, where no new segment may be made, a run has that
    room and no more. The pointers taken are returned: caching_allocator_delete each after."""
    free = sorted((b["size"], s["segment_type"]) for s in M.memory_snapshot(device) for b in s["blocks"]
                  if b["state"] == "inactive")
    taken = []
    for i, (size, pool) in enumerate(free):
        size -= room if i == len(free) - 1 else 0
        # a small segment's block is taken by requests of the small pool (up to 1 MiB), a large
        # one's by one request of the large pool (over 1 MiB)
        assert pool == "small" or size == 0 or size > 1 << 20, (size, pool)
        while size > 0:
            n = min(size, 1 << 20) if pool == "small" else size
            taken.append(M.caching_allocator_alloc(n, device))
            size -= n
    return taken


def room_for(plan, kinds=("model", "optimizer_state", "optimizer_parts", "step")):
    """The bytes a plan's requests of those kinds take as the allocator rounds them (512)."""
    return sum(-(-n // 512) * 512 for what, n in plan._requests if what in kinds)


class CountedCalls:
    """A trainer's C object (trainer._c = CountedCalls(trainer._c)), recording the steps each
    epoch_run call is asked for."""

    def __init__(self, c):
        self._inner, self.asked = c, []

    def epoch_run(self, steps, *args):
        self.asked.append(steps)
        return self._inner.epoch_run(steps, *args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


# For a subprocess script that forks: forked(fn) runs fn in a child and returns what it returned
# (through a pipe and JSON, None where the child wrote nothing) and the child's exit code.
FORKED = textwrap.dedent("""
    import json as _json, os as _os, sys as _sys

    def forked(fn):
        _sys.stdout.flush()  # the child's copy of the buffer is not printed twice
        r, w = _os.pipe()
        pid = _os.fork()
        if pid == 0:
            try:
                _os.close(r)
                data = _json.dumps(fn()).encode()
                while data:
                    data = data[_os.write(w, data):]
            finally:
                _os._exit(0)
        _os.close(w)
        with _os.fdopen(r, "rb") as f:  # to the child's end
            text = f.read()
        _, status = _os.waitpid(pid, 0)
        return (_json.loads(text) if text else None), _os.waitstatus_to_exitcode(status)
""")


# Daemon threads training (one model in bf16) and one making models, stepping, predicting and
# taking snapshots, while the script ends: argv is the device, the inputs' width and rows, and
# how long the threads run before the end. An exit callback registered before cmlp's own (so run
# after it) saves a model, and logging's (which lets go of the GIL) lets the threads run on.
EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys, tempfile, threading, time
    device, features, rows, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

    def save_at_exit():
        path = os.path.join(tempfile.mkdtemp(), "late.npz")
        cmlp.MLP([4, 8, 2], seed=0, device=device).save(path)
        print("saved at exit:", os.path.getsize(path) > 0, flush=True)

    atexit.register(save_at_exit)
    import logging  # noqa: F401
    import numpy as np
    import cmlp
    rng = np.random.default_rng(0)
    x, y = rng.random((rows, features), dtype=np.float32), rng.integers(0, 10, rows)

    def train(seed):
        m = cmlp.MLP([features, 256, 10], seed=seed, device=device)
        t = cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=32, amp="bf16" if seed % 2 else None)
        while True:
            t.fit(x, y, epochs=1, progress=False)

    def churn():
        while True:
            m = cmlp.MLP([features, 32, 10], seed=7, device=device)
            cmlp.Trainer(m, cmlp.optim.Adam(m), batch_size=32).step(x[:32], y[:32])
            m.predict(x[:100])
            cmlp.memory.memory_snapshot(device)
            cmlp.memory.empty_cache(device)

    for seed in range(3):
        threading.Thread(target=train, args=(seed,), daemon=True).start()
    threading.Thread(target=churn, daemon=True).start()
    time.sleep(wait)
    print("end of script")
""")


def assert_exits_with_daemon_threads(tmp_path, env, device, features, rows, wait, runs):
    """EXIT_SCRIPT, runs times: every exit clean (status 0, the last lines printed, no thread's
    traceback), none hung."""
    script = tmp_path / "exit_with_daemons.py"
    script.write_text(EXIT_SCRIPT)
    # the package this process imported (the source tree's build, or an installed copy)
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(cmlp.__file__)))] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(env, PYTHONPATH=os.pathsep.join(paths))
    for run in range(runs):
        try:
            done = subprocess.run([sys.executable, "-X", "faulthandler", str(script), device, str(features), str(rows),
                                   str(wait)], env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run {run}: the exit hung")
        assert done.returncode == 0 and "end of script" in done.stdout, (run, done.returncode, done.stderr[-3000:])
        assert "saved at exit: True" in done.stdout and "Traceback" not in done.stderr, (run, done.stdout[-500:],
                                                                                         done.stderr[-3000:])


def assert_non_finite_values_as_torch(device):
    """A model with infinite or NaN values, kept as they were loaded, against torch on `device`:
    a logit of -inf at the label is an infinite loss (not 0 * inf's NaN, without smoothing); the
    prediction that evaluate counts is torch.argmax's (a NaN's column), as predict's; and an
    optimizer without weight decay leaves an infinite weight whose gradient is 0 infinite (torch
    adds no decay term at 0: 0 * inf would be NaN), its state finite."""
    import io

    import torch

    def load(state, sizes):
        buf = io.BytesIO()
        np.savez(buf, **state, __layer_sizes__=np.array(sizes))
        buf.seek(0)
        return cmlp.MLP.load(buf).to(device)

    m = load({"fc1.weight": np.zeros((3, 2), np.float32), "fc1.bias": np.array([-np.inf, 0, 1], np.float32)}, [2, 3])
    x, y = np.zeros((2, 2), np.float32), np.array([0, 2])
    want = torch.nn.functional.cross_entropy(torch.from_numpy(m.forward(x)), torch.from_numpy(y)).item()
    assert want == np.inf and m.evaluate(x, y)["loss"] == want and m.forward_backward(x, y) == want
    m.zero_grad()
    assert m.forward_backward(x, y, label_smoothing=0.1) == np.inf
    m = load({"fc1.weight": np.zeros((3, 2), np.float32), "fc1.bias": np.array([1, np.nan, np.nan], np.float32)},
             [2, 3])
    x, y = np.zeros((4, 2), np.float32), np.array([1, 1, 2, 0])
    assert torch.argmax(torch.from_numpy(m.forward(x)), 1).tolist() == m.predict(x).tolist() == [1, 1, 1, 1]
    assert m.evaluate(x, y)["accuracy"] == 0.5
    rng = np.random.default_rng(0)
    state = {"fc1.weight": rng.standard_normal((2, 2)).astype(np.float32),
             "fc1.bias": np.array([-np.inf, 0], np.float32),  # unit 0 dead: its gradients are 0
             "fc2.weight": rng.standard_normal((2, 2)).astype(np.float32), "fc2.bias": np.zeros(2, np.float32)}
    x, y = rng.standard_normal((4, 2)).astype(np.float32), np.array([0, 1, 0, 1])
    for make in (lambda m: cmlp.optim.SGD(m, lr=0.1), lambda m: cmlp.optim.SGD(m, lr=0.1, momentum=0.9),
                 lambda m: cmlp.optim.Adam(m), lambda m: cmlp.optim.Adam(m, amsgrad=True)):
        m = load(state, [2, 2, 2])
        opt = make(m)
        for _ in range(2):
            m.zero_grad()
            m.forward_backward(x, y)
            opt.step()
        assert m.state_dict()["fc1.bias"][0] == -np.inf, type(opt).__name__
        assert np.isfinite(m.evaluate(x, y)["loss"])
        for buffers in opt.state_dict()["state"].values():
            assert all(np.isfinite(v).all() for v in buffers.values() if isinstance(v, np.ndarray))
