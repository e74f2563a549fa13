"""cmlp.memory._record_memory_history / _snapshot / _dump_snapshot on "cpu": the history replays
to the memory the allocator ends with (for training in fp32, mixed precision, recomputation,
expandable segments and out-of-memory retries), every allocation says what it holds and which
Python call made it, the settings keep what torch's do, and PyTorch's own snapshot tools read
the result. Every test stops recording afterwards.
"""
import gc
import os
import pickle
import stat
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import cmlp
from checks import assert_history_explains, unplanned

M = cmlp.memory
DEV = "cpu"
LAYERS = [784, 128, 64, 10]
HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def stop_recording():
    gc.collect()
    try:
        yield
    finally:
        M._record_memory_history(None, device=DEV)
        M.set_memory_limit(None, DEV)
        M.configure("")


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, LAYERS[0]), dtype=np.uint8), rng.integers(0, 10, n)


def begin(**kw):
    """Records from now on; the first snapshot (the history's first entry) is the start."""
    M._record_memory_history(clear_history=True, device=DEV, **kw)
    return M._snapshot(DEV)


def names(frames):
    return [f["name"] for f in frames]


def train(amp=None, recompute=False, epochs=1, n=256):
    x, y = data(n)
    model = cmlp.MLP(LAYERS, seed=0)
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=32, amp=amp, recompute=recompute)
    trainer.fit(x, y, epochs=epochs, progress=False)
    return model, opt, trainer


@pytest.mark.parametrize("amp,recompute,conf", [
    (None, False, ""), ("fp16", True, ""), ("bf16", False, "expandable_segments:True"),
    (None, True, "max_split_size_mb:21,roundup_power2_divisions:4"),
])
def test_the_history_replays_to_the_memory_held(amp, recompute, conf):
    M.configure(conf)
    M.empty_cache(DEV)
    start = begin()
    model, opt, trainer = train(amp, recompute)
    model.evaluate(*data(100), batch_size=30)
    middle = M._snapshot(DEV)
    entries = assert_history_explains(start, middle)
    held = {names(e["frames"])[0] for e in entries if e["action"] == "alloc"}
    expect = {"parameters", "gradients", "optimizer state"}
    expect.add("activations (mixed precision)" if amp else "activations (recomputed)" if recompute else "activations")
    if amp:
        expect.add("half-precision weights")
    assert expect <= held, held
    if conf.startswith("expandable"):
        assert any(e["action"] == "segment_map" for e in entries)
    del model, opt, trainer
    gc.collect()
    M.empty_cache(DEV)
    end = M._snapshot(DEV)
    entries = assert_history_explains(start, end)
    frees = [e for e in entries if e["action"] == "free_requested"]
    assert {names(e["frames"])[0] for e in frees} >= expect
    assert any(e["action"] in ("segment_free", "segment_unmap") for e in entries)


def test_an_oom_survived_by_micro_batches_is_in_the_history():
    layers = [784, 512, 256, 10]
    x, y = data(4096)
    model = cmlp.MLP(layers, seed=0)
    opt = cmlp.optim.Adam(model)
    trainer = cmlp.Trainer(model, opt, batch_size=4096, auto_microbatch=True)
    trainer.step(x[:1], y[:1])  # the optimizer state exists
    model._c.release_workspace()
    start = begin()
    M.set_memory_limit(M.memory_reserved(DEV) + M.plan(layers, 4096, opt).breakdown["activations"] // 3, DEV)
    unplanned(trainer, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cmlp.MemoryWarning)
        trainer.step(x, y)  # runs out of memory, then splits the step
    assert trainer.microbatch_size < 4096
    entries = assert_history_explains(start, M._snapshot(DEV))
    ooms = [e for e in entries if e["action"] == "oom"]
    assert ooms and all(e["size"] > 0 and e["device_free"] >= 0 and "addr" not in e for e in ooms)
    assert names(ooms[0]["frames"])[0] == "activations"
    assert M.memory_stats(DEV)["num_ooms"] >= len(ooms)


def test_frames_name_the_memory_then_the_python_calls_innermost_first():
    begin()
    model = cmlp.MLP(LAYERS, seed=0)
    ptr = M.caching_allocator_alloc(1000, DEV)
    M.caching_allocator_delete(ptr)
    trace = M._snapshot(DEV)["device_traces"][0]
    params = next(e for e in trace if e["action"] == "alloc")
    frames = params["frames"]
    assert frames[0] == {"filename": "cmlp", "line": 0, "name": "parameters"}
    assert frames[1]["filename"].endswith(os.path.join("cmlp", "model.py")) and frames[1]["name"] == "__init__"
    mine = [f for f in frames if f["filename"].endswith(HERE)]
    assert mine and mine[0]["name"] == "test_frames_name_the_memory_then_the_python_calls_innermost_first"
    raw = [e for e in trace if e.get("addr") == ptr]
    assert [e["action"] for e in raw] == ["alloc", "free_requested", "free_completed"]
    assert raw[0]["size"] == 1000 and names(raw[0]["frames"])[:2] == ["caching_allocator_alloc",
                                                                        "caching_allocator_alloc"]
    assert all(e["stream"] == 0 and e["time_us"] > 1.6e15 for e in trace)
    blocks = [b for s in M.memory_snapshot(DEV) for b in s["blocks"] if b["state"] == "active_allocated"]
    assert {names(b["frames"])[0] for b in blocks} >= {"parameters", "gradients"}
    del model


def test_code_compiled_for_each_call_adds_no_stack_and_is_freed():
    # a notebook's cells, exec's code: a new code object for each call, at the same lines
    import weakref

    begin(max_entries=10)
    model = cmlp.MLP([8, 4], seed=0)
    x = np.zeros((2, 8), np.float32)
    codes = []

    def run_cell():
        code = compile("model.predict(x)\nmodel.predict(x)\n", "<cell>", "exec")
        codes.append(weakref.ref(code))
        exec(code, {"model": model, "x": x})

    before = {}
    for i in range(3001):
        run_cell()
        if i == 0:  # (after a first call from this line)
            before = cmlp._cmlp.stack_tables()
    gc.collect()
    after = cmlp._cmlp.stack_tables()
    assert after["stacks"] == before["stacks"] and after["frames"] == before["frames"], (before, after)
    assert after["entries"] < before["entries"] + 4096 + 10  # (swept as it grows)
    assert not [r for r in codes if r() is not None]  # no code object kept alive
    trace = M._snapshot(DEV)["device_traces"][0]
    cells = [e for e in trace if e["action"] == "alloc" and any(f["filename"] == "<cell>" for f in e["frames"])]
    assert cells and {f["line"] for e in cells for f in e["frames"] if f["filename"] == "<cell>"} <= {1, 2}


@pytest.mark.parametrize("context,stacks", [(None, "all"), ("state", "all"), ("alloc", "python"), ("all", "all")])
def test_context_and_stacks_keep_what_torch_keeps(context, stacks):
    begin(context=context, stacks=stacks)
    model = cmlp.MLP(LAYERS, seed=0)
    snap = M._snapshot(DEV)
    del model
    gc.collect()
    trace = M._snapshot(DEV)["device_traces"][0]

    def python(frames):
        return [f for f in frames if f["filename"] != "cmlp"]

    alloc = next(e for e in trace if e["action"] == "alloc")
    free = next(e for e in trace if e["action"] == "free_requested" and e["addr"] == alloc["addr"])
    block = next(b for s in snap["segments"] for b in s["blocks"] if b["address"] == alloc["addr"])
    assert bool(python(block["frames"])) == (context is not None)
    assert bool(python(alloc["frames"])) == (context in ("alloc", "all"))
    # a free has its own stack with context "all", else (torch's) the allocation's where entries keep any
    assert bool(python(free["frames"])) == (context in ("alloc", "all"))
    assert (python(free["frames"]) == python(alloc["frames"])) == (context != "all")
    for frames in (alloc["frames"], free["frames"], block["frames"]):
        assert (frames[:1] == [{"filename": "cmlp", "line": 0, "name": "parameters"}]) == (stacks == "all")


@pytest.mark.parametrize("context", [None, "state", "alloc", "all"])
def test_a_segment_keeps_the_frames_of_the_request_it_was_made_for(context):
    """As torch's: a snapshot's segment has the frames of the request that made it (its stack
    where any context is kept), and its segment_free entry has them too where the free keeps no
    stack of its own: with context "all" it has the empty_cache call's."""
    begin(context=context)
    M.empty_cache(DEV)
    ptr = M.caching_allocator_alloc(40 << 20, DEV)  # a segment of its own
    seg = next(s for s in M._snapshot(DEV)["segments"] if s["address"] == ptr)
    M.caching_allocator_delete(ptr)
    M.empty_cache(DEV)
    trace = M._snapshot(DEV)["device_traces"][0]
    made = next(e for e in trace if e["action"] == "segment_alloc" and e["addr"] == ptr)
    freed = next(e for e in trace if e["action"] == "segment_free" and e["addr"] == ptr)

    def python(frames):
        return [f for f in frames if f["filename"] != "cmlp"]

    def here(frames):  # the line of this function's call
        return next(f["line"] for f in frames if f["filename"].endswith(HERE))

    mine = python(seg["frames"])
    assert bool(mine) == (context is not None)
    for frames in (seg["frames"], made["frames"], freed["frames"]):
        assert frames[0] == {"filename": "cmlp", "line": 0, "name": "caching_allocator_alloc"}
    assert python(made["frames"]) == (mine if context in ("alloc", "all") else [])
    if context == "all":  # the empty_cache call's own stack, a line further on
        assert here(freed["frames"]) > here(mine) and python(freed["frames"])[0]["name"] == "empty_cache"
    else:
        assert python(freed["frames"]) == (mine if context == "alloc" else [])


def test_state_mode_keeps_stacks_and_no_history():
    M._record_memory_history("state", device=DEV)
    model = cmlp.MLP(LAYERS, seed=0)
    snap = M._snapshot(DEV)
    assert snap["device_traces"] == [[]]
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert any(f["filename"].endswith(HERE) for b in blocks for f in b["frames"])
    M._record_memory_history(None, device=DEV)
    kept = [b for s in M._snapshot(DEV)["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert any(f["filename"].endswith(HERE) for b in kept for f in b["frames"]), "live blocks keep their stacks"
    del model


def test_max_entries_keeps_the_newest_and_skip_actions_leaves_out():
    M._record_memory_history(max_entries=np.int64(3), device=DEV, skip_actions=["snapshot"])  # a NumPy int too
    ptrs = [M.caching_allocator_alloc(100 * (i + 1), DEV) for i in range(5)]
    trace = M._snapshot(DEV)["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace] == [("alloc", 300), ("alloc", 400), ("alloc", 500)]
    M._record_memory_history(max_entries=2, device=DEV, skip_actions=["snapshot", "free_requested"])
    for p in ptrs:
        M.caching_allocator_delete(p)
    trace = M._snapshot(DEV)["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace] == [("free_completed", 400), ("free_completed", 500)]
    M._record_memory_history(max_entries=10, device=DEV, clear_history=True)
    # a snapshot's own entry follows the history it returns (torch's order): the next one shows it
    assert [e["action"] for e in M._snapshot(DEV)["device_traces"][0]] == []
    assert [e["action"] for e in M._snapshot(DEV)["device_traces"][0]] == ["snapshot"]
    M._record_memory_history(True, device=DEV)  # torch's older form: a history of 1 entry by default
    M.caching_allocator_delete(M.caching_allocator_alloc(512, DEV))
    assert [e["action"] for e in M._snapshot(DEV)["device_traces"][0]] == ["free_completed"]
    assert [e["action"] for e in M._snapshot(DEV)["device_traces"][0]] == ["snapshot"]
    M._record_memory_history(True, True, 100, True, DEV)  # ... of 100, with stacks for allocations
    M.caching_allocator_delete(M.caching_allocator_alloc(512, DEV))
    trace = M._snapshot(DEV)["device_traces"][0]
    assert [e["action"] for e in trace][-3:] == ["alloc", "free_requested", "free_completed"]
    assert any(f["filename"].endswith(HERE) for f in trace[-3]["frames"])
    # a free keeps the allocation's stack (torch's, with stacks for allocations only)
    assert trace[-2]["frames"] == trace[-1]["frames"] == trace[-3]["frames"]
    M._record_memory_history(False, device=DEV)
    assert M._snapshot(DEV)["device_traces"] == [[]]
    M._record_memory_history(max_entries=10, device=DEV, clear_history=1, skip_actions=["annotate"])


@pytest.mark.parametrize("kwargs,error", [
    ({"enabled": "everything"}, ValueError), ({"enabled": 1}, TypeError), ({"context": "some"}, ValueError),
    ({"stacks": "cpp"}, ValueError), ({"max_entries": 0}, ValueError), ({"max_entries": 2.5}, TypeError),
    ({"max_entries": True}, TypeError), ({"skip_actions": ["malloc"]}, ValueError),
    ({"skip_actions": "alloc"}, TypeError), ({"skip_actions": 5}, TypeError), ({"clear_history": "yes"}, TypeError),
    ({"clear_history": [True]}, TypeError), ({"device": "gpu"}, ValueError), ({"device": 0.5}, TypeError),
    ({"compile_context": "no"}, TypeError), ({"global_record_annotations": []}, TypeError),
    ({"record_pinned_host_memory": "True"}, TypeError), ({"record_cuda": "False"}, TypeError),
])
def test_bad_settings_raise_and_change_nothing(kwargs, error):
    M._record_memory_history(max_entries=100, device=DEV, context=None, skip_actions=["snapshot"])
    p = M.caching_allocator_alloc(512, DEV)
    with pytest.raises(error):
        M._record_memory_history(**kwargs)
    M.caching_allocator_delete(p)
    trace = M._snapshot(DEV)["device_traces"][0]
    assert [e["action"] for e in trace] == ["alloc", "free_requested", "free_completed"]
    assert all(f["filename"] == "cmlp" for e in trace for f in e["frames"]), "still no Python stacks"


def test_torchs_whole_signature_is_taken_in_its_order():
    # (enabled, context, stacks, max_entries, device, clear_history, compile_context,
    #  global_record_annotations, skip_actions, record_pinned_host_memory, record_cuda)
    M._record_memory_history("all", "all", "all", 100, DEV, True, False, False, ["snapshot"], False, True)
    M.caching_allocator_delete(M.caching_allocator_alloc(512, DEV))
    assert [e["action"] for e in M._snapshot(DEV)["device_traces"][0]] == ["alloc", "free_requested", "free_completed"]
    # record_cuda=False (torch's: pinned host memory alone) leaves the device's recording as it is
    M._record_memory_history(None, device=DEV, record_cuda=False, record_pinned_host_memory=True)
    M.caching_allocator_delete(M.caching_allocator_alloc(512, DEV))
    assert len(M._snapshot(DEV)["device_traces"][0]) == 6, "still recording"
    # the older form, enabled a bool, with the same tail
    M._record_memory_history(True, True, 10, False, DEV, False, True, True, False, ["snapshot"], False, True)
    M.caching_allocator_delete(M.caching_allocator_alloc(512, DEV))
    assert [e["action"] for e in M._snapshot(DEV)["device_traces"][0]][-3:] == \
        ["alloc", "free_requested", "free_completed"]


def test_the_snapshot_lists_the_allocators_settings_as_torchs():
    text = "max_split_size_mb:64, roundup_power2_divisions:[256:1,>:4],pinned_num_register_threads:4," \
           "release_lock_on_cudamalloc:True,garbage_collection_threshold:0.5"
    M.configure(text)
    snap = M._snapshot(DEV, augment_with_fx_traces=False)
    assert sorted(snap) == ["allocator_settings", "device_traces", "external_annotations", "segments"]
    assert snap["external_annotations"] == []
    settings = snap["allocator_settings"]
    assert settings == {
        "PYTORCH_CUDA_ALLOC_CONF": text, "max_split_size": 64 << 20, "garbage_collection_threshold": 0.5,
        "expandable_segments": False, "pinned_num_register_threads": 4, "release_lock_on_cudamalloc": True,
        "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False,
        "roundup_power2_divisions": {str(1 << i): 1 if i <= 8 else 4 for i in range(16)}}
    M.configure({"expandable_segments": True})  # a dict is read as the text it makes
    settings = M._snapshot(DEV)["allocator_settings"]
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and settings["expandable_segments"]
    M.configure("")
    settings = M._snapshot(DEV)["allocator_settings"]
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "" and settings["max_split_size"] == -1
    assert settings["pinned_num_register_threads"] == 1 and set(settings["roundup_power2_divisions"].values()) == {0}
    with pytest.raises(TypeError, match="augment_with_fx_traces"):
        M._snapshot(DEV, "yes")


def test_threads_note_their_own_stacks():
    M._record_memory_history(device=DEV, skip_actions=["snapshot"])
    barrier = threading.Barrier(2)

    def worker_a():
        barrier.wait()
        for _ in range(200):
            M.caching_allocator_delete(M.caching_allocator_alloc(1000, DEV))

    def worker_b():
        barrier.wait()
        for _ in range(200):
            M.caching_allocator_delete(M.caching_allocator_alloc(3000, DEV))

    threads = [threading.Thread(target=worker_a), threading.Thread(target=worker_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trace = M._snapshot(DEV)["device_traces"][0]
    assert len(trace) == 1200
    for e in trace:
        mine = [f["name"] for f in e["frames"] if f["filename"].endswith(HERE)]
        assert mine == ["worker_a" if e["size"] == 1000 else "worker_b"], e


def test_a_model_freed_while_an_exception_propagates_keeps_it():
    """The model dies while its TypeError is on its way up: the frees note their stack (with the
    exception set, which the capture must keep), and the caller gets its TypeError."""
    M._record_memory_history(device=DEV, skip_actions=["snapshot"])

    def g():
        return cmlp.MLP(LAYERS, seed=0)._c + 1

    with pytest.raises(TypeError, match="unsupported operand"):
        g()
    gc.collect()
    frees = [e for e in M._snapshot(DEV)["device_traces"][0] if e["action"] == "free_requested"]
    assert {names(e["frames"])[0] for e in frees} == {"parameters", "gradients"}
    for e in frees:
        mine = [f["name"] for f in e["frames"] if f["filename"].endswith(HERE)]
        assert mine[:2] == ["g", "test_a_model_freed_while_an_exception_propagates_keeps_it"], e["frames"]


def plain(v):
    """Only what PyTorch's viewer unpickles: dicts, lists, tuples (segment_pool_id), str, int,
    float, bool, None."""
    if isinstance(v, dict):
        return all(isinstance(k, str) and plain(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(plain(x) for x in v)
    return v is None or isinstance(v, (str, int, float, bool))


def test_dump_snapshot_writes_a_pickle_pytorchs_viewer_reads(tmp_path):
    begin()
    model, opt, trainer = train()
    path = tmp_path / "snap.pickle"
    M._dump_snapshot(path, device=DEV)
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04", "protocol 4: the viewer reads protocols 2 to 4"
    data = pickle.loads(raw)
    assert plain(data) and set(data) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    entries = data["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc" and e["frames"][0]["name"] == "activations"]
    assert len(allocs) >= 1 and all(e["frames"] is allocs[0]["frames"] for e in allocs), "one list, shared"
    assert all(s["device"] == 0 and s["stream"] == 0 and s["blocks"] for s in data["segments"])
    for s in data["segments"]:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert all({"size", "requested_size", "state", "frames", "address"} <= set(b) for b in s["blocks"])
    with pytest.raises(IsADirectoryError):
        M._dump_snapshot(tmp_path, device=DEV)
    assert not [p for p in os.listdir(tmp_path) if p != "snap.pickle"], "no temporary file left"
    del model, opt, trainer


def test_pytorchs_snapshot_tools_read_it():
    viz = pytest.importorskip("torch.cuda._memory_viz")
    M.empty_cache(DEV)
    begin()
    model, opt, trainer = train()
    data = M._snapshot(DEV)
    assert "total_allocated" in viz.segsum(data)
    text = viz.trace(data)
    assert "= cudaMalloc(" in text and "[0:" in text
    flame = viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "cmlp:0:optimizer state" in flame
    assert "stream_0;seg_" in viz.segments(data, format_flamegraph=lambda lines: lines)
    assert "snapshot.pickle" in viz.trace_plot(data)
    del model, opt, trainer


DEVICE_PATH = r"""
import gc, sys
import numpy as np
import cmlp
M = cmlp.memory
sys.path.insert(0, sys.argv[1])
from checks import assert_history_explains
M._record_memory_history(device="cpu")
start = M._snapshot("cpu")
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (200, 784), dtype=np.uint8), rng.integers(0, 10, 200)
model = cmlp.MLP([784, 64, 10], seed=0)
cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.1, momentum=0.9), batch_size=32).fit(x, y, epochs=2, progress=False)
entries = assert_history_explains(start, M._snapshot("cpu"))
print(sorted({e["frames"][0]["name"] for e in entries if e["action"] == "alloc"}))
"""


def test_the_data_set_on_the_device_is_named():
    env = dict(os.environ, CMLP_TRAIN_DEVICE_PATH="1")
    r = subprocess.run([sys.executable, "-c", DEVICE_PATH, os.path.dirname(__file__)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    held = eval(r.stdout)
    assert {"data set", "data set labels", "data set order", "optimizer state", "activations"} <= set(held)


def test_the_report_finds_the_peak_and_what_held_it(tmp_path):
    begin(skip_actions=["snapshot"])
    base = sum(M.memory_breakdown(DEV).values())
    a = M.caching_allocator_alloc(100_000, DEV)
    b = M.caching_allocator_alloc(300_000, DEV)
    M.caching_allocator_delete(a)
    c = M.caching_allocator_alloc(50_000, DEV)
    text = M.snapshot_report(M._snapshot(DEV))
    peak = base + 400_000
    assert f"peak allocated (requested bytes) over the history: {fmt(peak)} at entry" in text, text
    assert "caching_allocator_alloc" in text and "test_the_report_finds_the_peak_and_what_held_it" in text
    assert "no request ran out of memory" in text
    path = tmp_path / "s.pickle"
    M._dump_snapshot(path, device=DEV)
    assert M.snapshot_report(path) == M.snapshot_report(os.fspath(path))
    M.caching_allocator_delete(b)
    M.caching_allocator_delete(c)
    # a history cut short still reads: the blocks live at its start come from undoing it
    M._record_memory_history(max_entries=2, device=DEV, skip_actions=["snapshot"])
    d = M.caching_allocator_alloc(700_000, DEV)
    M.caching_allocator_delete(d)
    text = M.snapshot_report(M._snapshot(DEV))
    assert f"{fmt(base + 700_000)} before its first entry" in text, text


def test_the_report_names_the_requests_that_ran_out_of_memory():
    """The model's first large request that the cache cannot serve fails (its parameters, or its
    gradients when a cached block took the parameters): the report names it, with its size."""
    gc.collect()
    M.empty_cache(DEV)  # what stays cached lies in segments with live blocks
    begin()
    M.set_memory_limit(M.memory_reserved(DEV), DEV)
    with pytest.raises(cmlp.OutOfMemoryError):
        cmlp.MLP([784, 16384, 10])  # 51 MiB of parameters
    M.set_memory_limit(None, DEV)
    snap = M._snapshot(DEV)
    text = M.snapshot_report(snap, top=1)
    assert "out of memory: 1 request failed" in text
    (oom,) = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    what = oom["frames"][0]["name"]
    assert what in ("parameters", "gradients") and oom["size"] >= 4 * (784 * 16384 + 16384 + 16384 * 10 + 10)
    assert f"{fmt(oom['size'])} for {what}" in text
    assert "model.py:" in text and HERE in text
    counted = M.snapshot_report(snap, top=0)  # no blocks and no requests listed: the counts alone
    assert "out of memory: 1 request failed" in counted and f"for {what}" not in counted


def fmt(n):
    v, units, u = float(n), ["B", "KiB", "MiB", "GiB", "TiB"], 0
    while u < 4 and v >= 1024.0:
        v, u = v / 1024.0, u + 1
    return f"{v:.2f} {units[u]}"


class Evil:
    def __reduce__(self):
        return (os.system, ("echo hacked",))


@pytest.mark.parametrize("content,needle", [
    (pickle.dumps({"segments": [], "device_traces": [], "x": Evil()}), "names os.system|names posix.system"),
    (pickle.dumps([1, 2]), "a dict with lists"),
    (b"not a pickle", "not a memory snapshot"),
    # a few KB naming one block 36 million times (pickle's memo)
    (pickle.dumps({"segments": [{"device": 0, "total_size": 1, "blocks": [{"address": 1, "size": 1}] * 6000}] * 6000,
                   "device_traces": [[]]}), "6000 segments of 36000000 blocks .* more than 16777216"),
])
def test_the_report_refuses_what_is_not_a_snapshot(tmp_path, content, needle):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=needle):
        M.snapshot_report(path)
    with pytest.raises(ValueError, match="device index"):
        M.snapshot_report({"segments": [], "device_traces": []}, device=-1)


def test_the_report_of_a_device_the_snapshot_lacks_lists_those_it_has():
    seg = {"device": 2, "address": 4096, "total_size": 2 << 20, "blocks": []}
    snap = {"segments": [seg], "device_traces": [[], []]}  # devices 0 and 1 traced (nothing), 2 with a segment
    assert M.snapshot_report(snap, device=1).startswith("device 1: 0 segments")
    assert M.snapshot_report(snap, device=2).startswith("device 2: 1 segment,")
    with pytest.raises(ValueError, match="the snapshot has no device 5: it has devices 0, 1, 2"):
        M.snapshot_report(snap, device=5)
    with pytest.raises(ValueError, match="the snapshot has no device 0: it has no device"):
        M.snapshot_report({"segments": [], "device_traces": []}, device=0)


def test_saving_keeps_links_pipes_and_permissions(tmp_path):
    """The snapshot (and a model) go through a symbolic link to its target, which is replaced
    whole; into a pipe as open() would write; and a new file gets the umask's permissions."""
    target = tmp_path / "target.pickle"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.pickle"
    os.symlink(target.name, link)
    M._dump_snapshot(link, device=DEV)
    assert os.path.islink(link) and pickle.loads(target.read_bytes())["segments"] is not None
    assert os.stat(target).st_mode & 0o777 == 0o640, "the old file's permissions stay"
    fresh = tmp_path / "fresh.pickle"
    mask = os.umask(0o027)
    try:
        M._dump_snapshot(fresh, device=DEV)
    finally:
        os.umask(mask)
    assert os.stat(fresh).st_mode & 0o777 == 0o640
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    M._dump_snapshot(fifo, device=DEV)
    reader.join(timeout=30)
    assert got and pickle.loads(got[0])["device_traces"] is not None
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the pipe is still a pipe"
    model = cmlp.MLP([4, 3], seed=0)
    model.save(link)
    assert os.path.islink(link) and cmlp.MLP.load(target).layer_sizes == (4, 3)
    os.chmod(target, 0o4750)
    M._dump_snapshot(target, device=DEV)
    assert os.stat(target).st_mode & 0o7777 == 0o750, "set-id bits are not carried over"
    with pytest.raises(IsADirectoryError, match="names a directory"):
        M._dump_snapshot(os.path.join(tmp_path, "newdir") + os.sep, device=DEV)
    assert not os.path.exists(tmp_path / "newdir")
    os.symlink("loop_b", tmp_path / "loop_a")
    os.symlink("loop_a", tmp_path / "loop_b")
    with pytest.raises(OSError, match="symbolic links"):
        M._dump_snapshot(tmp_path / "loop_a", device=DEV)
    assert os.path.islink(tmp_path / "loop_a") and os.path.islink(tmp_path / "loop_b")


@pytest.mark.parametrize("data", [
    {"segments": [None], "device_traces": []},
    {"segments": [], "device_traces": [[{"action": "alloc", "size": 8}]]},
    {"segments": [{"blocks": [{"state": "active_allocated", "address": 1, "size": 8, "frames": {"a": 1}}]}],
     "device_traces": []},
    {"segments": [], "device_traces": [[{"action": "oom", "size": 10**400, "time_us": 1}]]},
    {"segments": [{"blocks": [{"state": "active_allocated", "address": 1, "size": 8, "frames": [None]}]}],
     "device_traces": []},
    # the header would count two blocks and the held lines one
    {"segments": [{"blocks": [{"state": "active_allocated", "address": 512, "size": 8, "frames": []}]},
                  {"blocks": [{"state": "active_allocated", "address": 512, "size": 16, "frames": []}]}],
     "device_traces": []},
])
def test_the_report_says_a_malformed_snapshot_is_one(data):
    with pytest.raises(ValueError, match="not a well-formed memory snapshot"):
        M.snapshot_report(data)


def test_the_report_says_a_snapshot_nested_too_deep_is_malformed():
    name: list = []
    for _ in range(100_000):  # a frame's file name a list in a list in a list ...
        name = [name]
    data = {"segments": [{"blocks": [{"state": "active_allocated", "address": 1, "size": 8,
                                      "frames": [{"filename": name, "line": 1, "name": "f"}]}]}], "device_traces": []}
    with pytest.raises(ValueError, match="not a well-formed memory snapshot: RecursionError"):
        M.snapshot_report(data)


def test_the_report_reads_entries_that_share_a_long_stack_once_each():
    """A pickle can name one list of frames from every entry: a history of n frees whose stacks
    are one list of n frames reads in time linear in n (each list's frames are read once), not
    n * n; an alarm ends a report that would take minutes."""
    import signal

    n = 200_000
    frames = [{"filename": "cmlp", "line": 0, "name": "x"}] + [{"filename": "a.py", "line": i, "name": "f"}
                                                              for i in range(n)]
    trace = [{"action": "free_requested", "addr": 512 * i, "size": 512, "frames": frames} for i in range(n)]
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("the report took 60 s")))
    signal.alarm(60)
    try:
        text = M.snapshot_report({"segments": [], "device_traces": [trace]})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert f"{n * 512 / 2**20:.2f} MiB before its first entry" in text, text


def test_the_report_refuses_a_stream_that_claims_too_much(tmp_path):
    path = tmp_path / "huge.pickle"
    path.write_bytes(b"\x80\x04\x95" + (1 << 62).to_bytes(8, "little") + b".")
    with pytest.raises(ValueError, match="not a memory snapshot"):
        M.snapshot_report(path)


def test_the_report_counts_blocks_pending_free_and_histories_without_completions():
    """PyTorch's snapshots keep blocks "active_pending_free" until their free completes: they are
    still allocated. A block found at the start by undoing a free is not credited to the free's
    stack. Without free_completed entries (skip_actions), free_requested ends a block."""
    mib = 1 << 20
    frames = [{"filename": "train.py", "line": 3, "name": "step"}]
    seg = {"device": 0, "address": 0, "total_size": 8 * mib, "stream": 0, "blocks": [
        {"address": 0, "size": 4 * mib, "requested_size": 4 * mib, "state": "active_pending_free", "frames": frames},
        {"address": 4 * mib, "size": 4 * mib, "requested_size": 4 * mib, "state": "inactive", "frames": []}]}
    trace = [{"action": "free_requested", "addr": 4 * mib, "size": 1 * mib, "frames": frames},
             {"action": "free_completed", "addr": 4 * mib, "size": 1 * mib, "frames": frames}]
    text = M.snapshot_report({"segments": [seg], "device_traces": [trace]})
    assert "peak allocated (requested bytes) over the history: 5.00 MiB before its first entry" in text, text
    assert "(history):0:allocated before the history began" in text and "train.py:3:step <-" not in text.split(
        "1.00 MiB  (history)")[-1][:60]
    text = M.snapshot_report({"segments": [seg], "device_traces": [trace[:1]]})
    assert "5.00 MiB before its first entry" in text, text
    alloc = [{"action": "alloc", "addr": 4 * mib, "size": 2 * mib, "frames": frames},
             {"action": "free_requested", "addr": 4 * mib, "size": 2 * mib, "frames": frames}]
    text = M.snapshot_report({"segments": [seg], "device_traces": [alloc]})
    assert "6.00 MiB at entry 0" in text, text


def test_memory_snapshot_gives_torchs_segments():
    # torch.cuda.memory_snapshot() is _snapshot()["segments"]: the same keys and values
    model = cmlp.MLP([20, 30, 5], seed=0)
    segs = M.memory_snapshot(DEV)
    assert segs and all(set(s) == {"device", "address", "total_size", "allocated_size", "active_size",
                                   "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                                   "frames", "blocks"} for s in segs)
    assert all(s["device"] == 0 and s["segment_pool_id"] == (0, 0) and s["is_expandable"] in (True, False)
               for s in segs)
    assert segs == M._snapshot(DEV)["segments"]
    del model
