"""The caching allocator seen from Python: statistics against snapshots, caching and
empty_cache, settings (configure / get_config / environment), the OOM message, the retry ladder
through the fault hook. The allocator's own C tests (tests/c/test_alloc.c) cover its rules
and a randomised stress under sanitizers."""
import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cmlp

sys.path.insert(0, os.path.dirname(__file__))
from checks import assert_stats_match_snapshot  # noqa: E402

M = cmlp.memory
DEV = "cpu"
MIB = 1 << 20


@pytest.fixture(autouse=True)
def clean_allocator():
    M.configure("")
    M.set_memory_limit(None, DEV)
    M._fail_raw_alloc(0, DEV)
    yield
    M.configure("")
    M.set_memory_limit(None, DEV)
    M._fail_raw_alloc(0, DEV)
    gc.collect()
    M._validate(DEV)


def test_statistics_equal_the_snapshot_through_a_model_lifetime():
    gc.collect()
    base = M.memory_allocated(DEV)
    assert_stats_match_snapshot(DEV)
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    opt = cmlp.optim.Adam(model)
    assert_stats_match_snapshot(DEV)
    rng = np.random.default_rng(0)
    x, y = rng.random((300, 784), dtype=np.float32), rng.integers(0, 10, 300)
    trainer = cmlp.Trainer(model, opt, batch_size=64)
    trainer.fit(x, y, epochs=1, progress=False)
    assert_stats_match_snapshot(DEV)
    del trainer, opt, model
    gc.collect()
    assert M.memory_allocated(DEV) == base
    assert_stats_match_snapshot(DEV)


def test_freed_blocks_are_cached_and_reused_without_a_device_call():
    p = M.caching_allocator_alloc(3 * MIB, DEV)
    M.caching_allocator_delete(p)
    before = M.memory_stats(DEV)
    q = M.caching_allocator_alloc(3 * MIB, DEV)
    after = M.memory_stats(DEV)
    assert q == p
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    M.caching_allocator_delete(q)


def test_pools_and_segment_sizes():
    M.empty_cache(DEV)
    before = M.memory_stats(DEV)
    small = M.caching_allocator_alloc(1000, DEV)  # 1024 bytes from a new 2 MiB small segment
    large = M.caching_allocator_alloc(5 * MIB, DEV)  # a 20 MiB large segment
    huge = M.caching_allocator_alloc(30 * MIB + 1, DEV)  # its own segment, 2 MiB rounded
    s = M.memory_stats(DEV)
    d = lambda k: s[k] - before[k]  # noqa: E731
    assert d("allocated_bytes.small_pool.current") == 1024
    assert d("requested_bytes.small_pool.current") == 1000
    assert d("segment.small_pool.current") <= 1  # 0 when a cached small segment had room
    assert d("reserved_bytes.large_pool.current") == 20 * MIB + 32 * MIB
    assert d("segment.large_pool.current") == 2
    for p in (small, large, huge):
        M.caching_allocator_delete(p)
    assert_stats_match_snapshot(DEV)


def test_empty_cache_keeps_only_segments_in_use():
    M.empty_cache(DEV)
    gc.collect()
    base_reserved = M.memory_reserved(DEV)
    keep = M.caching_allocator_alloc(4 * MIB, DEV)
    drop = M.caching_allocator_alloc(4 * MIB, DEV)  # same 20 MiB segment
    gone = M.caching_allocator_alloc(40 * MIB, DEV)  # a segment of its own
    M.caching_allocator_delete(drop)
    M.caching_allocator_delete(gone)
    assert M.memory_reserved(DEV) == base_reserved + 60 * MIB
    M.empty_cache(DEV)
    s = M.memory_stats(DEV)
    assert s["reserved_bytes.all.current"] == base_reserved + 20 * MIB  # the partly used segment stays
    # its free part is the non-releasable memory
    seg = next(x for x in M.memory_snapshot(DEV) if x["address"] <= keep < x["address"] + x["total_size"])
    free_part = sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
    assert free_part == 16 * MIB
    assert s["inactive_split_bytes.all.current"] >= free_part
    M.caching_allocator_delete(keep)
    M.empty_cache(DEV)
    assert M.memory_reserved(DEV) == base_reserved
    assert_stats_match_snapshot(DEV)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from Linux's /proc")
def test_empty_cache_gives_the_cpus_segments_back_to_the_system():
    # (a fresh process: the resident set of this one holds whatever ran before)
    code = """
import cmlp
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = resident()
for _ in range(4):  # segments made and freed again and again (the heap would keep them)
    models = [cmlp.MLP([2048, 2048, 10], seed=0) for _ in range(3)]  # 16 MiB of weights each, written
    del models
    cmlp.memory.empty_cache("cpu")
    assert cmlp.memory.memory_reserved("cpu") == 0
print(resident() - base)
"""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="", CMLP_ALLOC_CONF="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 8 * MIB  # 3 x 16 MiB were held each round


def test_limit_gives_a_detailed_out_of_memory_error_and_the_allocator_recovers():
    M.empty_cache(DEV)
    gc.collect()
    base = M.memory_allocated(DEV)
    ooms = M.memory_stats(DEV)["num_ooms"]
    limit = M.memory_reserved(DEV) + 8 * MIB
    M.set_memory_limit(limit, DEV)
    with pytest.raises(cmlp.OutOfMemoryError) as info:
        cmlp.MLP([4096, 1024, 10])  # 16 MiB of parameters
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    # what it tried to get from the device, as PyTorch's says: the segment (a request over 10 MiB's
    # is rounded to 2 MiB), then the request as made
    for needle in ("out of memory", "Tried to allocate 18.00 MiB.", "16822312 bytes requested, rounded to 16822784",
                   "allowed (the memory limit", "allocated by cmlp", "largest free block", "fragmentation",
                   "It needs a new segment of 18.00 MiB"):
        assert needle in msg, (needle, msg)
    # the parameters do not shrink with the batch: no advice about batches
    assert "do not shrink with the batch" in msg and "micro-batches" not in msg, msg
    s = M.memory_stats(DEV)
    assert s["num_ooms"] == ooms + 1
    assert M.memory_allocated(DEV) == base
    M.set_memory_limit(None, DEV)
    model = cmlp.MLP([4096, 1024, 10])
    # a step's activations do: those are what micro-batches, amp and recomputation make smaller
    trainer = cmlp.Trainer(model, cmlp.optim.SGD(model, lr=0.01), batch_size=4096, auto_microbatch=False)
    M.set_memory_limit(M.memory_reserved(DEV) + 8 * MIB, DEV)
    try:
        with pytest.raises(cmlp.OutOfMemoryError) as info:
            trainer.step(np.zeros((4096, 4096), np.float32), np.zeros(4096, np.int64))
    finally:
        M.set_memory_limit(None, DEV)
    msg = str(info.value)
    for needle in ("Try micro-batches", "amp", "recompute"):
        assert needle in msg, (needle, msg)
    assert "do not shrink" not in msg, msg
    del model, trainer
    assert_stats_match_snapshot(DEV)


def test_a_model_larger_than_the_machine_is_an_out_of_memory_error_not_a_killed_process():
    """Without a limit the CPU's capacity is the machine's memory: a model whose parameters and
    gradients pass it is refused up front (the kernel would grant the address range, then end
    the process as the pages are touched), and nothing of it stays allocated."""
    M.empty_cache(DEV)
    gc.collect()
    base, total = M.memory_allocated(DEV), M.mem_get_info(DEV)[1]
    width = int((0.15 * total) ** 0.5)  # parameters of 0.6 x the memory, the same again in gradients
    with pytest.raises(cmlp.OutOfMemoryError) as info:
        cmlp.MLP([width, width, 2])
    assert str(info.value).startswith("cpu out of memory. Tried to allocate "), str(info.value)[:200]
    assert "total capacity" in str(info.value)
    assert M.memory_allocated(DEV) == base
    M.empty_cache(DEV)
    assert_stats_match_snapshot(DEV)


def test_a_request_that_fits_where_its_segment_does_not_names_expandable_segments():
    M.empty_cache(DEV)
    gc.collect()
    M.set_memory_limit(M.memory_reserved(DEV) + 5 * MIB, DEV)  # 2.04 MiB of parameters, in a 20 MiB segment
    try:
        with pytest.raises(cmlp.OutOfMemoryError) as info:
            cmlp.MLP([784, 512, 256, 10])
    finally:
        M.set_memory_limit(None, DEV)
    msg = str(info.value)
    assert "It needs a new segment of 20.00 MiB" in msg, msg
    assert "its segment does not: expandable_segments:True" in msg and "PYTORCH_CUDA_ALLOC_CONF" in msg, msg


def test_fault_hook_drives_the_retry_ladder():
    M.empty_cache(DEV)
    cached = M.caching_allocator_alloc(30 * MIB, DEV)
    M.caching_allocator_delete(cached)  # a cached 30 MiB segment that cannot serve 50 MiB
    before = M.memory_stats(DEV)
    M._fail_raw_alloc(1, DEV)  # the next device allocation fails once
    p = M.caching_allocator_alloc(50 * MIB, DEV)
    after = M.memory_stats(DEV)
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert after["num_ooms"] == before["num_ooms"]
    assert after["num_device_free"] == before["num_device_free"] + 1  # the cache was released first
    assert after["num_raw_alloc_calls"] == before["num_raw_alloc_calls"] + 2
    M.caching_allocator_delete(p)
    assert_stats_match_snapshot(DEV)


def test_configure_round_trips_and_resets_other_keys():
    text = "max_split_size_mb:128,garbage_collection_threshold:0.8,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    M.configure(text)
    c = M.get_config()
    assert c["max_split_size_mb"] == 128
    assert c["garbage_collection_threshold"] == 0.8
    # PyTorch's parser: "256:1" sets [256, 512) MiB and, the first, every interval below it;
    # ">:8" those after the last size given
    assert c["roundup_power2_divisions"][:9] == [1] * 9
    assert c["roundup_power2_divisions"][9:] == [2, 4] + [8] * 5
    assert c["expandable_segments"] is False
    assert M.memory_stats(DEV)["max_split_size"] == 128 * MIB
    M.configure(c)
    assert M.get_config() == c and c["memory_caching"] is True
    with pytest.raises(ValueError, match=r"memory_caching is True now.*caching_allocator_enable\(False\)"):
        M.configure({**c, "memory_caching": False})  # caching_allocator_enable's
    M.configure("expandable_segments:True")
    c2 = M.get_config()
    assert c2["expandable_segments"] is True and c2["max_split_size_mb"] is None
    assert c2["garbage_collection_threshold"] == 0.0
    M.configure("roundup_power2_divisions:4")
    assert M.get_config()["roundup_power2_divisions"] == [4] * 16


@pytest.mark.parametrize("text, needle", [
    ("foo:1", "Unrecognized CachingAllocator option: foo"),
    ("max_split_size_mb:19", "max_split_size_mb too small, must be >= 20"),
    ("large_segment_size_mb:10", "large_segment_size_mb too small, must be > 10"),
    ("large_segment_size_mb:64,max_split_size_mb:40", "max_split_size_mb too small, must be >= 64"),
    ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb too small"),
    ("per_process_memory_fraction:1.5", "per_process_memory_fraction"),
    ("roundup_power2_divisions:0", "power of 2"),
    ("roundup_power2_divisions:[256:1", "roundup_power2_divisions"),
    (",max_split_size_mb:128", "Unrecognized CachingAllocator option: ,"),
    ("max_split_size_mb:128,,garbage_collection_threshold:0.5", "Unrecognized"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads"),
    ("max_split_size_mb:abc", "max_split_size_mb"),
    ("garbage_collection_threshold:1.0", "garbage_collection_threshold"),
    ("garbage_collection_threshold:0", "garbage_collection_threshold"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2"),
    ("roundup_power2_divisions:[300:2]", "powers of 2"),
    ("expandable_segments:maybe", "expandable_segments"),
    ("expandable_segments:true", "expected True or False, as PyTorch spells them"),  # PyTorch refuses it too
    ("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc: invalid value '1'"),
    ("max_split_size_mb", "max_split_size_mb: expected ':'"),
    ("max_split_size_mb:", "max_split_size_mb"),
    ("backend:cudaMallocAsync2", "backend"),
])
def test_configure_rejects_bad_settings_and_changes_nothing(text, needle):
    M.configure("max_split_size_mb:64")
    with pytest.raises(ValueError, match=needle):
        M.configure(text)
    assert M.get_config()["max_split_size_mb"] == 64
    with pytest.raises(TypeError):
        M.configure(42)
    with pytest.raises(ValueError, match="Unrecognized"):
        M.configure({"bogus": 1})


def test_pytorch_only_host_options_are_accepted():
    M.configure("pinned_use_cuda_host_register:True,backend:native,max_split_size_mb:40")
    assert M.get_config()["max_split_size_mb"] == 40
    # every option of PyTorch's parser is taken (these have no effect here), with its syntax:
    # spaces anywhere, a list's sizes in any order, a trailing comma
    M.configure("pinned_use_background_threads:True, release_lock_on_cudamalloc:False,"
                "graph_capture_record_stream_reuse:True,pinned_max_cached_size_mb:64,pinned_max_round_threshold_mb:8,"
                "pinned_reserve_segment_size_mb:16,throw_on_cudamalloc_oom:True,pinned_num_register_threads:8,"
                "roundup_power2_divisions:[ 512:4 , 64:2 ],max_split_size_mb:20,")
    c = M.get_config()
    assert c["max_split_size_mb"] == 20
    assert c["roundup_power2_divisions"] == [4] * 6 + [2] + [4] * 3 + [0] * 6  # the first fills below it
    # the reserve of expandable segments (cmlp reserves as they grow): a fraction, GiB, a list by class
    M.configure("expandable_segments_reserve:0.5,expandable_segments_handle_type:fabric_handle,"
                "expandable_segments_reserve_by_class:[a:0.5,b:40G],max_split_size_mb:30")
    assert M.get_config()["max_split_size_mb"] == 30
    M.configure("expandable_segments_reserve_by_class:[],expandable_segments_reserve:40G")
    for bad in ("expandable_segments_reserve_by_class:0.5", "expandable_segments_reserve_by_class:[a]",
                "expandable_segments_reserve_by_class:[a:1", "expandable_segments_reserve_by_class:[a:1,]",
                "expandable_segments_reserve_by_class:[a:1 b:2]", "expandable_segments_reserve:"):
        with pytest.raises(ValueError, match="expandable_segments_reserve"):
            M.configure(bad)
    M.configure(" max_split _size_mb : 1 28 , release_lock_on_hipmalloc:True")  # spaces are dropped, as PyTorch's
    assert M.get_config()["max_split_size_mb"] == 128
    M.configure("roundup_power2_divisions:[" + ",".join(["64:2"] * 300) + "]")  # no limit on the length
    assert M.get_config()["roundup_power2_divisions"][6] == 2
    M.configure("")


def test_a_segment_size_past_any_device_is_taken_as_the_largest():
    M.configure("large_segment_size_mb:8796093022207")
    try:
        assert M.get_config()["large_segment_size_mb"] == 2**36
        M.empty_cache(DEV)
        M.set_memory_limit(M.memory_reserved(DEV) + (1 << 30), DEV)
        with pytest.raises(cmlp.OutOfMemoryError, match="a new segment of 67108864.00 GiB"):
            p = M.caching_allocator_alloc(5 << 20, DEV)  # a segment of 2**36 MiB cannot fit
            M.caching_allocator_delete(p)
    finally:
        M.set_memory_limit(None, DEV)
        M.configure("")


def _allocated_for(nbytes):
    before = M.memory_allocated(DEV)
    p = M.caching_allocator_alloc(nbytes, DEV)
    got = M.memory_allocated(DEV) - before
    M.caching_allocator_delete(p)
    return got


def test_roundup_divisions_follow_pytorch_intervals():
    M.configure("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    try:
        assert _allocated_for(300 * MIB + 5) == 300 * MIB + 512  # [256, 512) MiB: 1 division, 512-byte rounding
        assert _allocated_for(600 * MIB + 1) == 768 * MIB        # [512, 1024) MiB: 2 divisions
        assert _allocated_for(1100 * MIB) == 1280 * MIB          # [1, 2) GiB: 4 divisions
        assert _allocated_for(2100 * MIB) == 2304 * MIB          # past the last size: 8 divisions
    finally:
        M.configure("")
        M.empty_cache(DEV)


def test_large_segment_size_sets_the_segment_of_middle_requests():
    M.empty_cache(DEV)
    try:
        for conf, segment in (("", 20 * MIB), ("large_segment_size_mb:32", 32 * MIB)):
            M.configure(conf)
            M.empty_cache(DEV)
            before = M.memory_reserved(DEV)
            p = M.caching_allocator_alloc(5 * MIB, DEV)
            assert M.memory_reserved(DEV) - before == segment
            M.caching_allocator_delete(p)
            assert_stats_match_snapshot(DEV)
        assert M.get_config()["max_non_split_rounding_mb"] == 32  # its default follows
    finally:
        M.configure("")
        M.empty_cache(DEV)


def test_max_non_split_rounding_lets_a_larger_oversize_block_serve():
    # a cached 100 MiB oversize block serves a 60 MiB request only if it is at most
    # max_non_split_rounding_mb larger (20 MiB by default)
    try:
        for conf, reused in (("max_split_size_mb:40", False), ("max_split_size_mb:40,max_non_split_rounding_mb:64", True)):
            M.configure(conf)
            M.empty_cache(DEV)
            big = M.caching_allocator_alloc(100 * MIB, DEV)
            M.caching_allocator_delete(big)
            allocs = M.memory_stats(DEV)["num_device_alloc"]
            p = M.caching_allocator_alloc(60 * MIB, DEV)
            assert (M.memory_stats(DEV)["num_device_alloc"] == allocs) == reused, conf
            assert M.memory_allocated(DEV) >= (100 if reused else 60) * MIB
            M.caching_allocator_delete(p)
            assert_stats_match_snapshot(DEV)
    finally:
        M.configure("")
        M.empty_cache(DEV)


def test_settings_set_after_import_are_left_for_the_first_gpu():
    """Set after the import, the variable waits for a GPU to open (as PyTorch's for CUDA's start):
    the CPU's allocator keeps the settings of the import."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CMLP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    code = ("import os, json, cmlp; os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'; "
            "m = cmlp.MLP([4, 3]); cmlp.memory.memory_allocated('cpu'); print(json.dumps(cmlp.memory.get_config()))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["expandable_segments"] is False


def _import_with(env_extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CMLP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(env_extra)
    code = "import cmlp, json; print(json.dumps(cmlp.memory.get_config()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_settings_are_honoured_at_import():
    r = _import_with({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True"})
    assert r.returncode == 0, r.stderr
    assert '"max_split_size_mb": 256' in r.stdout and '"expandable_segments": true' in r.stdout
    r = _import_with({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256", "CMLP_ALLOC_CONF": "max_split_size_mb:512"})
    assert r.returncode == 0, r.stderr
    assert '"max_split_size_mb": 512' in r.stdout  # cmlp's own variable wins
    # PyTorch's newer variable is read too; the older one, when both are set, first (as PyTorch)
    r = _import_with({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"})
    assert r.returncode == 0 and '"max_split_size_mb": 128' in r.stdout, r.stderr
    r = _import_with({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"})
    assert r.returncode == 0 and '"max_split_size_mb": 256' in r.stdout, r.stderr
    # settings written for PyTorch's CUDA allocator import
    r = _import_with({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.5,"
                                                "max_non_split_rounding_mb:64,large_segment_size_mb:12"})
    assert r.returncode == 0, r.stderr
    assert '"per_process_memory_fraction": 0.5' in r.stdout and '"large_segment_size_mb": 12' in r.stdout
    r = _import_with({"CMLP_ALLOC_CONF": "max_split_size_mb:1"})
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "CMLP_ALLOC_CONF" in r.stderr and "max_split_size_mb" in r.stderr
    # a PyTorch setting cmlp cannot read says how to give cmlp its own; an empty one overrides it
    r = _import_with({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:10"})
    assert r.returncode != 0 and "PYTORCH_CUDA_ALLOC_CONF" in r.stderr and "set CMLP_ALLOC_CONF" in r.stderr
    r = _import_with({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:10", "CMLP_ALLOC_CONF": ""})
    assert r.returncode == 0, r.stderr
    assert '"max_split_size_mb": null' in r.stdout  # the defaults
    # PyTorch's other allocator is asked for: cmlp's own serves, and says so
    r = _import_with({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,max_split_size_mb:64"})
    assert r.returncode == 0 and '"max_split_size_mb": 64' in r.stdout, r.stderr
    assert "MemoryWarning" in r.stderr and "cudaMallocAsync is ignored" in r.stderr


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "expandable_segments:True",
                                  "roundup_power2_divisions:4", "garbage_collection_threshold:0.5"])
def test_training_under_each_setting_is_identical_and_consistent(conf):
    M.configure(conf)
    if "garbage" in conf:
        M.set_memory_limit(M.memory_reserved(DEV) + 256 * MIB, DEV)
    rng = np.random.default_rng(1)
    x, y = rng.random((256, 784), dtype=np.float32), rng.integers(0, 10, 256)
    model = cmlp.MLP([784, 128, 10], seed=3)
    cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=64, shuffle=False).fit(x, y, epochs=1, progress=False)
    w = model.state_dict()["fc1.weight"]
    assert_stats_match_snapshot(DEV)
    del model
    M.configure("")
    M.set_memory_limit(None, DEV)
    ref = cmlp.MLP([784, 128, 10], seed=3)
    cmlp.Trainer(ref, cmlp.optim.Adam(ref), batch_size=64, shuffle=False).fit(x, y, epochs=1, progress=False)
    np.testing.assert_array_equal(w, ref.state_dict()["fc1.weight"])


def test_expandable_segments_grow_one_segment_and_release_its_tail():
    M.configure("expandable_segments:True")
    M.empty_cache(DEV)
    before = M.memory_stats(DEV)
    blocks = [M.caching_allocator_alloc(3 * MIB, DEV) for _ in range(5)]
    s = M.memory_stats(DEV)
    segs = [x for x in M.memory_snapshot(DEV) if x["is_expandable"] and x["segment_type"] == "large"]
    assert len(segs) == 1
    grown = s["reserved_bytes.large_pool.current"] - before["reserved_bytes.large_pool.current"]
    assert 15 * MIB <= grown <= 16 * MIB  # 2 MiB pages, no 20 MiB segments
    for p in blocks:
        M.caching_allocator_delete(p)
    M.empty_cache(DEV)
    assert M.memory_stats(DEV)["reserved_bytes.large_pool.current"] <= before["reserved_bytes.large_pool.current"]
    assert_stats_match_snapshot(DEV)


def test_summary_reports_fragmentation_and_largest_free_block():
    p = M.caching_allocator_alloc(4 * MIB, DEV)
    text = M.memory_summary(DEV)
    assert "Fragmentation" in text and "Largest free block" in text and "Non-releasable memory" in text
    assert M.memory_stats(DEV)["largest_free_block"] >= 16 * MIB

    def fragmentation():
        line = [x for x in M.memory_summary(DEV).splitlines() if "Fragmentation" in x][0]
        s = M.memory_stats(DEV)
        want = 100.0 * s["inactive_split_bytes.all.current"] / s["reserved_bytes.all.current"]
        assert line.startswith(f"| Fragmentation (free inside segments in use): {want:.1f}% "), line
        return want

    assert fragmentation() > 0  # the segment's free rest beside the block
    M.caching_allocator_delete(p)
    M.empty_cache(DEV)
    q = M.caching_allocator_alloc(20 * MIB, DEV)  # a whole segment, then a whole free one: no fragmentation
    M.caching_allocator_delete(q)
    assert M.memory_stats(DEV)["reserved_bytes.all.current"] > 0 and fragmentation() == 0.0
    M.empty_cache(DEV)


def test_configure_from_a_dict_reads_flags_and_thresholds_as_text_too():
    try:
        for value, want in (("False", False), ("true", True), (False, False), (True, True), (None, False), (1, True),
                            (0, False), (np.True_, True), (np.False_, False)):
            cmlp.memory.configure({"expandable_segments": value})
            assert cmlp.memory.get_config()["expandable_segments"] is want, value
        with pytest.raises(ValueError, match="expandable_segments must be True or False"):
            cmlp.memory.configure({"expandable_segments": "maybe"})
        cmlp.memory.configure({"garbage_collection_threshold": "0"})
        assert cmlp.memory.get_config()["garbage_collection_threshold"] == 0.0
        cmlp.memory.configure({"garbage_collection_threshold": "0.5"})
        assert cmlp.memory.get_config()["garbage_collection_threshold"] == 0.5
        with pytest.raises(ValueError, match="garbage_collection_threshold must be a number"):
            cmlp.memory.configure({"garbage_collection_threshold": "half"})
    finally:
        cmlp.memory.configure("")
