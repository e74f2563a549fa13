"""Memory statistics and controls, with torch.cuda's names and meanings, for every device
("cpu" included). All numbers come from the device's allocator, which owns every byte."""
import collections
import itertools
import numbers
import os
import threading
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from . import _args, _cmlp, _history, _plan, _snapshot_report
from ._args import Device, _device, _fmt, _numpy_int
from ._arrays import as_flag

parse_size = _args.parse_size
Plan, plan, max_batch_size = _plan.Plan, _plan.plan, _plan.max_batch_size  # the planner


class MemoryWarning(UserWarning):
    """Issued when memory ran out (or a limit's plan says it would) and a trainer computes its steps
    in smaller micro-batches: once for each smaller micro-batch it goes to, not at every step."""


_raw_blocks: Dict[int, str] = {}
_fractions: Dict[str, Tuple[float, int]] = {}  # device -> (fraction set, the limit it made)
_raw_lock = threading.Lock()


def _new_lock_in_child() -> None:  # a thread the forked child lacks may have held it
    global _raw_lock
    _raw_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def memory_stats(device: Optional[Device] = None) -> Dict[str, int]:
    """PyTorch's keys: "<stat>.<pool>.<metric>" plus num_alloc_retries, num_ooms, ..., sorted,
    in an OrderedDict (as torch's)."""
    stats = _cmlp.memory_stats(_device(device))
    return collections.OrderedDict(sorted(stats.items()))


def mem_get_info(device: Optional[Device] = None) -> Tuple[int, int]:
    """(free, total) bytes of the device, as torch.cuda.mem_get_info: free is what the device's
    driver could still give (memory the caching allocator holds counts as used: see
    memory_reserved; empty_cache() returns what it caches); on "cpu", the memory the operating
    system reports available and the machine's total."""
    free, total = _cmlp.mem_get_info(_device(device))
    if free < 0:
        raise RuntimeError(f"{_device(device)} cannot say how much memory is free")
    return free, total


def memory_allocated(device: Optional[Device] = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Optional[Device] = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Optional[Device] = None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Optional[Device] = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Optional[Device] = None) -> None:
    _cmlp.reset_peak_memory_stats(_device(device))


def reset_accumulated_memory_stats(device: Optional[Device] = None) -> None:
    """Every statistic's "allocated" and "freed" totals, and num_alloc_retries, num_ooms,
    num_sync_all_streams, num_device_alloc and num_device_free, back to 0 (torch's)."""
    _cmlp.reset_accumulated_memory_stats(_device(device))


def memory_stats_as_nested_dict(device: Optional[Device] = None) -> Dict[str, Any]:
    """memory_stats() as torch.cuda.memory_stats_as_nested_dict gives it: each key's dotted parts
    as levels ({"allocated_bytes": {"all": {"current": ...}}, "num_ooms": ...})."""
    return _nested(memory_stats(device))


def _nested(stats: Mapping[str, int]) -> Dict[str, Any]:
    nested: Dict[str, Any] = {}
    for key, value in stats.items():
        *path, last = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    nested["reserved_bytes_by_private_pools"] = {}  # torch's: cmlp's allocators have no private pools
    return nested


def get_per_process_memory_fraction(device: Optional[Device] = None) -> float:
    """The fraction of the device's memory the allocator may reserve (torch's): the one set by
    set_per_process_memory_fraction while its limit stands, else the memory limit over the total
    memory, 1.0 without a limit."""
    dev = _device(device)
    limit = get_memory_limit(dev)
    if limit is None:
        return 1.0
    fraction = _fractions.get(dev)
    if fraction is not None and fraction[1] == limit:
        return fraction[0]
    return min(1.0, limit / _cmlp.memory_stats(dev)["total_memory"])  # a limit past the total caps nothing


def get_allocator_backend() -> str:
    """torch's name for the allocator in use: "native" (the caching allocator) everywhere."""
    return "native"


def _deprecated(name: str, instead: str, fn: Any) -> Any:
    def alias(device: Optional[Device] = None) -> Any:
        import warnings

        warnings.warn(f"cmlp.memory.{name} is deprecated (as in torch): use {instead}", FutureWarning, stacklevel=2)
        return fn(device)
    alias.__name__ = name
    alias.__doc__ = f"Deprecated alias of {instead} (torch's)."
    return alias


def empty_cache(device: Optional[Device] = None) -> None:
    """Returns cached, unused memory to the device."""
    _cmlp.empty_cache(_device(device))


def caching_allocator_enable(value: bool = True) -> None:
    """Turns caching on or off for every device's allocator (torch.cuda.memory's switch). Off,
    each request gets a segment of its exact size, given back to the device when it is freed
    (what CMLP_NO_MEMORY_CACHING=1 does from the start: for memory checkers); a trainer then runs
    its steps eagerly. What the cache holds when it goes off stays until its blocks are freed or
    empty_cache() gives it back. get_config()["memory_caching"] says which is in force."""
    _cmlp.set_caching(as_flag("value", value))


def set_memory_limit(nbytes: Optional[int], device: Optional[Device] = None) -> None:
    """Caps what the device's allocator may reserve (None removes the cap)."""
    if nbytes is None:
        _cmlp.set_memory_limit(_device(device), -1)
        return
    nbytes = _numpy_int(nbytes)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int or None, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0 or None, got {nbytes}")
    _cmlp.set_memory_limit(_device(device), min(nbytes, 2**63 - 1))  # more than anything: no cap in effect


def set_per_process_memory_fraction(fraction: float, device: Optional[Device] = None) -> None:
    """Caps reserved memory at fraction x the device's total memory (physical memory for "cpu")."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    dev = _device(device)
    total = _cmlp.memory_stats(dev)["total_memory"]
    _cmlp.set_memory_limit(dev, int(fraction * total))
    _fractions[dev] = (float(fraction), int(fraction * total))  # (a NumPy float is read back as a float)


def get_memory_limit(device: Optional[Device] = None) -> Optional[int]:
    limit = _cmlp.memory_limit(_device(device))
    return None if limit < 0 else limit


def caching_allocator_alloc(nbytes: Any = None, device: Optional[Device] = None, stream: Any = None, *,
                            size: Any = None) -> int:
    """A raw block of nbytes from the device's allocator; give it back with caching_allocator_delete.
    size= is torch's name for nbytes; stream is taken for torch's signature (None or 0: cmlp's
    allocator serves the device's one stream)."""
    if size is not None:
        if nbytes is not None:
            raise TypeError("caching_allocator_alloc got both nbytes and size (torch's name for it)")
        nbytes = size
    if stream is not None and not (isinstance(stream, int) and stream == 0):
        raise ValueError(f"cmlp's allocator serves each device's own stream: stream must be None, got {stream!r}")
    nbytes = _numpy_int(nbytes)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if not 0 <= nbytes < 2**63:
        shown = nbytes if nbytes.bit_length() <= 64 else f"an int of {nbytes.bit_length()} bits"
        raise ValueError(f"nbytes must be in [0, 2**63), got {shown}")
    dev = _device(device)
    ptr = _cmlp.alloc(dev, nbytes)
    if ptr:
        try:
            with _raw_lock:
                _raw_blocks[ptr] = dev
        except BaseException:  # (an interrupt before the block is known: it could never be deleted)
            _cmlp.free(dev, ptr)
            raise
    return ptr


class _InvalidPointer(ValueError, RuntimeError):
    """A pointer caching_allocator_delete does not know: a ValueError, and the RuntimeError
    torch's raises for it ("invalid device pointer"), for code written for torch."""


def caching_allocator_delete(mem_ptr: int) -> None:
    """Gives back a block of caching_allocator_alloc (mem_ptr: torch's name); 0 does nothing."""
    if isinstance(mem_ptr, bool) or not isinstance(mem_ptr, int):
        raise TypeError(f"mem_ptr must be an int from caching_allocator_alloc, got {type(mem_ptr).__name__}")
    with _raw_lock:
        dev = _raw_blocks.pop(mem_ptr, None)
    if dev is None:
        if mem_ptr == 0:
            return
        raise _InvalidPointer(f"invalid device pointer {mem_ptr:#x}: it was not returned by caching_allocator_alloc "
                              "(or was already deleted)")
    _cmlp.free(dev, mem_ptr)


def memory_snapshot(device: Optional[Device] = None, *, mempool_id: Any = None,
                    include_traces: bool = True) -> List[Dict[str, Any]]:
    """Every segment with its blocks, sorted by address, as torch.cuda.memory_snapshot() gives
    them: {device (the index; 0 for "cpu"), address, total_size, allocated_size, active_size,
    requested_size, stream (0), segment_type "small"/"large", segment_pool_id ((0, 0)),
    is_expandable, frames ([]), blocks: [{address, size, requested_size, state
    "active_allocated"/"inactive", frames}]}. An allocated block's frames say what it holds ({"filename": "cmlp", "line": 0,
    "name": "activations"}, ...) and, while _record_memory_history keeps contexts, the Python
    stack that allocated it, innermost first. An expandable segment appears as one entry per run
    of mapped pages. The statistics always equal what the snapshot adds up to. _snapshot() gives
    the same with the history, in PyTorch's format. torch's keywords are taken: mempool_id None or
    (0, 0) (each device has the one pool), include_traces (the segments have no trace entries)."""
    from ._arrays import as_flag

    as_flag("include_traces", include_traces)
    if mempool_id is not None and tuple(mempool_id) != (0, 0):
        raise ValueError(f"mempool_id must be None or (0, 0): cmlp keeps one memory pool per device, got {mempool_id!r}")
    dev = _device(device)
    return _history.torch_segments(dev, _cmlp.snapshot(dev))


def list_gpu_processes(device: Any = None) -> str:
    """torch.cuda.memory.list_gpu_processes: cmlp.cuda.list_gpu_processes."""
    from . import cuda

    return cuda.list_gpu_processes(device)


def memory_breakdown(device: Optional[Device] = None) -> Dict[str, int]:
    """The bytes allocated now (as requested, before rounding) by what they hold: "parameters",
    "gradients" (with the step's device scalars), "optimizer state" (on a GPU also "optimizer
    param groups", their settings, where the groups differ), "activations" (also "...
    (mixed precision)", "... (recomputed)"), "half-precision weights", "GEMM workspace", "data
    set", "caching_allocator_alloc", ..., largest first. Comparable with plan(...).breakdown."""
    totals: Dict[str, int] = {}
    for seg in _cmlp.snapshot(_device(device)):
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                totals[b["what"]] = totals.get(b["what"], 0) + b["requested_size"]
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


memory_cached = _deprecated("memory_cached", "memory_reserved", memory_reserved)
max_memory_cached = _deprecated("max_memory_cached", "max_memory_reserved", max_memory_reserved)
reset_max_memory_allocated = _deprecated("reset_max_memory_allocated", "reset_peak_memory_stats",
                                         reset_peak_memory_stats)
reset_max_memory_cached = _deprecated("reset_max_memory_cached", "reset_peak_memory_stats", reset_peak_memory_stats)

_record_memory_history = record_memory_history = _history.record_memory_history
_snapshot = _history.snapshot
snapshot_report = _snapshot_report.report
_dump_snapshot = dump_snapshot = _history.dump_snapshot


_INTERVALS = 16


def _divisions_text(div: List[int]) -> str:
    if all(d == div[0] for d in div) and div[0]:
        return str(div[0])
    # key 2^i MiB sets interval i ([2^i, 2^(i+1)) MiB, PyTorch's parser); ">" the last one
    items = [f"{1 << i}:{d}" for i, d in enumerate(div[:-1])] + [f">:{div[-1]}"]
    return "[" + ",".join(items) + "]"


_DEFAULT_LARGE_SEGMENT_MB = 20


def get_config() -> Dict[str, Any]:
    """The allocator options in force (shared by every device), in PyTorch's key names:
    max_split_size_mb (None: unlimited), garbage_collection_threshold (0.0: off),
    roundup_power2_divisions (divisions per power-of-two interval from 1 MiB; 0 or 1: none),
    expandable_segments, large_segment_size_mb (the segment of a request over 1 MiB and under
    10 MiB), max_non_split_rounding_mb (how much larger than a request at or over
    max_split_size_mb a cached block that serves it whole may be), per_process_memory_fraction
    (None, or the fraction of each GPU's memory set as its limit when it opens); and
    memory_caching, False where CMLP_NO_MEMORY_CACHING=1 (or PyTorch's
    PYTORCH_NO_CUDA_MEMORY_CACHING=1) turned caching off for this process, or
    caching_allocator_enable(False) since: each request then gets a segment of its exact size,
    returned to the device at its free (for memory checkers)."""
    s = _cmlp.get_settings()
    fraction = s["per_process_memory_fraction"]
    return {
        "max_split_size_mb": None if s["max_split_size"] < 0 else s["max_split_size"] >> 20,
        "garbage_collection_threshold": s["garbage_collection_threshold"],
        "roundup_power2_divisions": list(s["roundup_power2_divisions"]),
        "expandable_segments": bool(s["expandable_segments"]),
        "large_segment_size_mb": s["large_segment_size"] >> 20,
        "max_non_split_rounding_mb": s["max_non_split_rounding"] >> 20,
        "per_process_memory_fraction": None if fraction < 0 else fraction,
        "memory_caching": not s["caching_disabled"],
    }


def _config_text(config: Mapping[str, Any]) -> str:
    known = {"max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
             "large_segment_size_mb", "max_non_split_rounding_mb", "per_process_memory_fraction", "memory_caching"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"Unrecognized CachingAllocator option: {unknown[0]}")
    caching, on = config.get("memory_caching"), not _cmlp.get_settings()["caching_disabled"]
    if caching is not None and caching is not on:  # (get_config's, so that its dict comes back)
        raise ValueError(f"memory_caching is {on} now: configure() leaves it alone, and it cannot be set to "
                         f"{caching!r} there (caching_allocator_enable({not on}) switches it)")
    def flag(key: str) -> bool:  # a bool (NumPy's too), 0 or 1, or the text configure() reads ("True", ...)
        v = config.get(key)
        if v is None or isinstance(v, bool) or getattr(getattr(v, "dtype", None), "kind", "") == "b":
            return bool(v)
        if isinstance(v, numbers.Integral) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            return v.strip().lower() == "true"
        raise ValueError(f"{key} must be True or False, got {v!r}")

    def whole(key: str, v: Any) -> int:  # an int (NumPy's too), not a bool, a float or text
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{key} must be an int, got {v!r}")
        return int(v)

    def number(key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{key} must be a number, got {v!r}")
        return float(v)

    parts = []
    large = config.get("large_segment_size_mb")
    if large is not None and whole("large_segment_size_mb", large) != _DEFAULT_LARGE_SEGMENT_MB:
        parts.append(f"large_segment_size_mb:{int(large)}")
    if config.get("max_split_size_mb") is not None:
        parts.append(f"max_split_size_mb:{whole('max_split_size_mb', config['max_split_size_mb'])}")
    rounding = config.get("max_non_split_rounding_mb")
    if rounding is not None and whole("max_non_split_rounding_mb", rounding) != (
            _DEFAULT_LARGE_SEGMENT_MB if large is None else int(large)):
        parts.append(f"max_non_split_rounding_mb:{int(rounding)}")
    gc = config.get("garbage_collection_threshold")
    if gc is not None:
        try:
            gc = float(gc)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"garbage_collection_threshold must be a number in (0, 1), or 0 for off, got {gc!r}") \
                from None
        if gc:
            parts.append(f"garbage_collection_threshold:{gc!r}")
    div = config.get("roundup_power2_divisions")
    if div is not None:
        if isinstance(div, numbers.Integral) and not isinstance(div, bool):
            div = [div] * _INTERVALS
        if isinstance(div, (str, bytes)) or not hasattr(div, "__iter__"):
            raise ValueError(f"roundup_power2_divisions must be an int or {_INTERVALS} ints (one per interval), "
                             f"got {div!r}")
        div = [whole("roundup_power2_divisions", d) for d in itertools.islice(div, _INTERVALS + 1)]
        if len(div) != _INTERVALS:
            raise ValueError(f"roundup_power2_divisions must be an int or {_INTERVALS} ints (one per interval)")
        if any(div):
            parts.append(f"roundup_power2_divisions:{_divisions_text(div)}")
    if flag("expandable_segments"):
        parts.append("expandable_segments:True")
    fraction = config.get("per_process_memory_fraction")
    if fraction is not None:
        parts.append(f"per_process_memory_fraction:{number('per_process_memory_fraction', fraction)!r}")
    return ",".join(parts)


def configure(config: Union[str, Mapping[str, Any]]) -> None:
    """Sets the allocator options from PYTORCH_CUDA_ALLOC_CONF's syntax, e.g.
    "max_split_size_mb:128,garbage_collection_threshold:0.8,expandable_segments:True", or from a
    dict as get_config() returns (whose memory_caching must be the process's: see get_config).
    Options not given return to their defaults. An unknown key
    or bad value raises ValueError naming it, and nothing changes. PyTorch's options for pinned
    host memory and its other CUDA backends' details are checked and have no effect.
    per_process_memory_fraction sets the limit of every GPU in use and of each one opened later
    (set_per_process_memory_fraction's); leaving it out later lifts no limit."""
    if isinstance(config, Mapping):
        config = _config_text(config)
    if not isinstance(config, str):
        raise TypeError(f"configure takes a str or a dict, got {type(config).__name__}")
    _cmlp.configure(config)
    if _cmlp.get_settings()["backend_async"]:
        warnings.warn("backend:cudaMallocAsync is ignored: cmlp's memory comes from its own caching allocator "
                      "(PyTorch's native backend, with its statistics and limits)", MemoryWarning, stacklevel=2)


def _validate(device: Optional[Device] = None) -> None:
    """Checks every invariant of the device's allocator; RuntimeError names the first broken one."""
    _cmlp.validate(_device(device))


def _fail_raw_alloc(k: int, device: Optional[Device] = None) -> None:
    """Test hook: the k-th raw device allocation from now fails as if the device were full
    (k = 1: the next one); k <= 0 disables it."""
    _cmlp.fail_raw_alloc(_device(device), int(k))


def _summary_size(v: int, row_first: float) -> str:
    """A byte count in PyTorch's summary style: an int of 6 digits and a unit chosen from the
    row's first value (so the pools below a metric share its unit)."""
    unit = "B  "
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if row_first < 768 * 1024:
            break
        unit, v, row_first = bigger, v // 1024, row_first / 1024
    return f"{v:6d} {unit}"


def _summary_count(v: int, row_first: float) -> str:
    unit = " "
    for bigger in ("K", "M"):
        if row_first < 750 * 1000:
            break
        unit, v, row_first = bigger, v // 1000, row_first / 1000
    return f"{v:7d} {unit} "


_SUMMARY_METRICS = (("allocated_bytes", "Allocated memory", True), ("active_bytes", "Active memory", True),
                    ("requested_bytes", "Requested memory", True), ("reserved_bytes", "reserved memory", True),
                    ("inactive_split_bytes", "Non-releasable memory", True), ("allocation", "Allocations", False),
                    ("active", "Active allocs", False), ("segment", "reserved segments", False),
                    ("inactive_split", "Non-releasable allocs", False))


def memory_summary(device: Optional[Device] = None, abbreviated: bool = False) -> str:
    """A table of current, peak, allocated and freed for each statistic, laid out as PyTorch's
    torch.cuda.memory_summary (75 columns; each row's unit from its "all" value; abbreviated:
    without the large- and small-pool rows), then the limit, the largest free block, the
    fragmentation and what the allocated memory holds (memory_breakdown)."""
    from ._arrays import as_flag

    abbreviated = as_flag("abbreviated", abbreviated)
    dev = _device(device)
    s = _cmlp.memory_stats(dev)
    width = 75
    gpu = dev != "cpu"  # PyTorch's names say "GPU"; on the CPU they go without it
    rule, double = "-" * width, "=" * width
    # on a GPU the heading and the counts read as torch's ("CUDA OOMs", "cudaMalloc retries"), the
    # counts at torch's columns
    title = f"cmlp CUDA memory summary, device ID {_history._device_index(dev)}" if gpu else \
        "cmlp memory summary, device cpu"
    ooms, retries = ("CUDA OOMs: ", "cudaMalloc retries: ") if gpu else ("OOMs: ", "alloc retries: ")
    lines = [double, f"{title:^{width}}", rule,
             f"{ooms:>23}{s['num_ooms']:<12d} | {retries:>27}{s['num_alloc_retries']:<8d}  ", double,
             f"{'Metric':^23}| Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    for key, name, is_bytes in _SUMMARY_METRICS:
        lines.append(rule)
        first = None
        title = name if name[0].isupper() else f"GPU {name}" if gpu else name.capitalize()
        pools = (("all", title),) if abbreviated else (("all", title), ("large_pool", "      from large pool"),
                                                         ("small_pool", "      from small pool"))
        for pool, label in pools:
            vals = [s[f"{key}.{pool}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            first = first or vals
            cells = [(_summary_size if is_bytes else _summary_count)(v, f) for v, f in zip(vals, first)]
            lines.append(f" {label:<21} | " + " | ".join(cells) + " ")
    for key, name in (("oversize_allocations", "Oversize allocations"),
                      ("oversize_segments", "Oversize GPU segments" if gpu else "Oversize segments")):
        lines.append(rule)
        vals = [s[f"{key}.{m}"] for m in ("current", "peak", "allocated", "freed")]
        lines.append(f" {name:<21} | " + " | ".join(_summary_count(v, v) for v in vals) + " ")
    limit = s["limit"]
    reserved = s["reserved_bytes.all.current"]
    # the free bytes inside segments that hold allocations (whole free segments are cache, which
    # empty_cache gives back)
    frag = 100.0 * s["inactive_split_bytes.all.current"] / reserved if reserved else 0.0
    lines += [rule, f" Memory limit: {'none' if limit < 0 else _fmt(limit)}",
              f" Largest free block: {_fmt(s['largest_free_block'])}",
              f" Fragmentation (free inside segments in use): {frag:.1f}%",
              f" Device allocs/frees: {s['num_device_alloc']}/{s['num_device_free']}"]
    held = memory_breakdown(dev)
    if held:
        lines += [rule, " Allocated memory by what it holds (bytes requested):"]
        lines += [f"   {what:<40} {_fmt(n):>12}" for what, n in held.items()]
    lines.append(double)
    return "\n".join(f"|{line:<{width}}|" for line in lines) + "\n"
