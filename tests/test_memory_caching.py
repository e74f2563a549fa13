"""Caching off, as PyTorch's PYTORCH_NO_CUDA_MEMORY_CACHING=1 turns it off (here also
CMLP_NO_MEMORY_CACHING=1, which wins where both are set): every request gets a segment of
exactly its bytes from the device, returned at its free, so that a memory checker sees each
buffer's own bounds. The statistics, snapshot, limit and planner go on as with caching; training
computes the same numbers. Read once per process: each case runs in a fresh one."""
import json
import os
import subprocess
import sys

import pytest

_RUN = r'''
import gc, json, numpy as np, cmlp
M = cmlp.memory
out = {"caching": M.get_config()["memory_caching"]}
M.configure(M.get_config())  # the dict comes back, in either mode
gc.collect()
s0 = M.memory_stats("cpu")
p = M.caching_allocator_alloc(1000, "cpu")
s1 = M.memory_stats("cpu")
segs = [s for s in M.memory_snapshot("cpu") if any(b["address"] == p for b in s["blocks"])]
out["segment"] = [segs[0]["total_size"], [b["size"] for b in segs[0]["blocks"]]]
M.caching_allocator_delete(p)
s2 = M.memory_stats("cpu")
out["reserved"] = [s1["reserved_bytes.all.current"] - s0["reserved_bytes.all.current"],
                   s2["reserved_bytes.all.current"] - s0["reserved_bytes.all.current"]]
out["device_calls"] = [s1["num_device_alloc"] - s0["num_device_alloc"], s2["num_device_free"] - s0["num_device_free"]]
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (300, 784), dtype=np.uint8), rng.integers(0, 10, 300)
M.reset_peak_memory_stats("cpu")
base = M.memory_stats("cpu")["allocated_bytes.all.current"]
model = cmlp.MLP([784, 96, 10], seed=0)
trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=32, shuffle=False)
out["losses"] = [e["loss"] for e in trainer.fit(x, y, epochs=2, progress=False)]
s = M.memory_stats("cpu")
out["measured_peak"] = s["allocated_bytes.all.peak"] - base
out["planned_peak"] = M.plan([784, 96, 10], 32, "adam", data_rows=300).peak_bytes
out["cached_bytes"] = s["reserved_bytes.all.current"] - s["allocated_bytes.all.current"]
out["weights"] = float(np.abs(model.state_dict()["fc1.weight"]).sum())
print(json.dumps(out))
'''


def _run(**env):
    full = dict(os.environ)
    for k in ("CMLP_NO_MEMORY_CACHING", "PYTORCH_NO_CUDA_MEMORY_CACHING", "CMLP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        full.pop(k, None)
    full.update(env)
    r = subprocess.run([sys.executable, "-c", _RUN], env=full, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cached():
    return _run()


@pytest.mark.parametrize("env", [{"CMLP_NO_MEMORY_CACHING": "1"}, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
                                 {"CMLP_NO_MEMORY_CACHING": "1", "PYTORCH_NO_CUDA_MEMORY_CACHING": "0"}])
def test_caching_off_gives_each_request_its_own_segment_and_trains_the_same(cached, env):
    off = _run(**env)
    assert cached["caching"] and not off["caching"]
    # a segment of exactly the request, handed back at its free
    assert off["segment"] == [1000, [1000]] and off["reserved"] == [1000, 0] and off["device_calls"] == [1, 1]
    assert cached["segment"][0] == 2 << 20 and cached["device_calls"][1] == 0
    assert off["cached_bytes"] == 0 and cached["cached_bytes"] > 0
    # the same numbers; the plan replays the run on an allocator with caching off too
    assert off["losses"] == cached["losses"] and off["weights"] == cached["weights"]
    assert off["planned_peak"] == off["measured_peak"] < cached["measured_peak"]
    assert cached["planned_peak"] == cached["measured_peak"]


@pytest.mark.parametrize("env", [{"PYTORCH_NO_CUDA_MEMORY_CACHING": "true"}, {"CMLP_NO_MEMORY_CACHING": "0"},
                                 {"CMLP_NO_MEMORY_CACHING": "0", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
                                 {"CMLP_NO_MEMORY_CACHING": ""}])
def test_only_1_turns_caching_off_and_cmlps_variable_wins(env):
    """As PyTorch reads its flag: "1" turns it off, anything else leaves caching on."""
    on = _run(**env)
    assert on["caching"] and on["device_calls"][1] == 0


def test_caching_allocator_enable_switches_it_while_running():
    """torch.cuda.memory.caching_allocator_enable: off from the next request on, for every
    allocator; a cached block freed then goes back to the device with its segment; on again,
    requests are cached as before. A training run computes the same numbers either way."""
    import gc

    import numpy as np

    import cmlp
    M = cmlp.memory
    was = M.get_config()["memory_caching"]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((96, 20)).astype(np.float32), rng.integers(0, 5, 96)

    def losses():
        model = cmlp.MLP([20, 48, 5], seed=0)
        return [e["loss"] for e in cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=16).fit(
            x, y, epochs=2, progress=False)]

    blocks = []
    try:
        M.caching_allocator_enable(True)
        cached_losses = losses()
        gc.collect()  # (garbage of tests before, collected now, would free blocks inside the counts below)
        M.empty_cache("cpu")
        kept = M.caching_allocator_alloc(12 << 20, "cpu")  # a cached segment of its own
        blocks.append(kept)
        seg = [s for s in M.memory_snapshot("cpu") if any(b["address"] == kept for b in s["blocks"])][0]
        assert seg["total_size"] == 12 << 20
        M.caching_allocator_enable(False)
        assert M.get_config()["memory_caching"] is False
        s0 = M.memory_stats("cpu")
        p = M.caching_allocator_alloc(1000, "cpu")
        seg = [s for s in M.memory_snapshot("cpu") if any(b["address"] == p for b in s["blocks"])][0]
        assert seg["total_size"] == 1000
        M.caching_allocator_delete(p)
        M.caching_allocator_delete(blocks.pop())  # its segment, now free, goes back too
        s1 = M.memory_stats("cpu")
        assert s1["num_device_free"] - s0["num_device_free"] == 2, "both segments went back"
        assert s1["reserved_bytes.all.current"] == s0["reserved_bytes.all.current"] - (12 << 20)
        assert losses() == cached_losses
        assert s1["reserved_bytes.all.current"] == M.memory_stats("cpu")["reserved_bytes.all.current"], \
            "nothing stays cached after a run with caching off"
        cmlp.cuda.caching_allocator_enable(True)  # torch.cuda's name too
        p = M.caching_allocator_alloc(1000, "cpu")
        seg = [s for s in M.memory_snapshot("cpu") if any(b["address"] == p for b in s["blocks"])][0]
        assert seg["total_size"] == 2 << 20 and M.get_config()["memory_caching"] is True
        M.caching_allocator_delete(p)
        with pytest.raises(TypeError, match="value must be a bool"):
            M.caching_allocator_enable("no")
    finally:
        for b in blocks:
            M.caching_allocator_delete(b)
        M.caching_allocator_enable(was)
