"""Checks shared by the test files: the allocator's statistics against its snapshot, and deep
bitwise equality of state dicts."""
import gc

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


def same(a, b):
    """Deep equality of state dicts: arrays bitwise, containers recursively."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b
