"""Memory statistics and controls, with torch.cuda's names and meanings, for every device
("cpu" included). All numbers come from the device's allocator, which owns every byte."""
import numbers
import os
import re
import threading
import warnings
from fractions import Fraction
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _cmlp, _history, _snapshot_report

class MemoryWarning(UserWarning):
    """Issued (once per trainer) when memory ran out and the trainer changed how it computes."""


_raw_blocks: Dict[int, str] = {}
_fractions: Dict[str, Tuple[float, int]] = {}  # device -> (fraction set, the limit it made)
_raw_lock = threading.Lock()


def _new_lock_in_child() -> None:  # a thread the forked child lacks may have held it
    global _raw_lock
    _raw_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _device_text(device: Any) -> Any:
    """torch's other ways of naming a device, as a string: an int N is "cuda:N" (as torch.cuda's
    functions take it), a torch.device (anything with a str .type and an int or None .index) its
    "type[:index]". Anything else is returned as it is."""
    if isinstance(device, (int, np.integer)) and not isinstance(device, (bool, np.bool_)):
        return f"cuda:{int(device)}" if device >= 0 else device
    kind, index = getattr(device, "type", None), getattr(device, "index", 0)
    if not isinstance(device, str) and isinstance(kind, str) and (index is None or isinstance(index, int)):
        return kind if index is None else f"{kind}:{index}"
    return device


def _numpy_int(value: Any) -> Any:
    """A NumPy integer as the int it holds (as torch takes them); anything else as it is."""
    return int(value) if isinstance(value, np.integer) else value


def _device(device: Any) -> str:
    if device is None:
        # a child forked after CUDA started cannot use it: its default is the CPU
        return "cuda:0" if _cmlp.cuda_device_count() > 0 and not _cmlp.cuda_forked() else "cpu"
    device = _device_text(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0' (or an index, or a torch.device), "
                        f"got {device!r}")
    return _cmlp.parse_device(device)


def memory_stats(device: Optional[str] = None) -> Dict[str, int]:
    """PyTorch's keys: "<stat>.<pool>.<metric>" plus num_alloc_retries, num_ooms, ..."""
    stats = _cmlp.memory_stats(_device(device))
    return dict(sorted(stats.items()))


def mem_get_info(device: Optional[str] = None) -> Tuple[int, int]:
    """(free, total) bytes of the device, as torch.cuda.mem_get_info: free is what the device's
    driver could still give (memory the caching allocator holds counts as used: see
    memory_reserved; empty_cache() returns what it caches); on "cpu", the memory the operating
    system reports available and the machine's total."""
    free, total = _cmlp.mem_get_info(_device(device))
    if free < 0:
        raise RuntimeError(f"{_device(device)} cannot say how much memory is free")
    return free, total


def memory_allocated(device: Optional[str] = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Optional[str] = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Optional[str] = None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Optional[str] = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Optional[str] = None) -> None:
    _cmlp.reset_peak_memory_stats(_device(device))


def reset_accumulated_memory_stats(device: Optional[str] = None) -> None:
    """Every statistic's "allocated" and "freed" totals, and num_alloc_retries, num_ooms,
    num_sync_all_streams, num_device_alloc and num_device_free, back to 0 (torch's)."""
    _cmlp.reset_accumulated_memory_stats(_device(device))


def memory_stats_as_nested_dict(device: Optional[str] = None) -> Dict[str, Any]:
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


def get_per_process_memory_fraction(device: Optional[str] = None) -> float:
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
    def alias(device: Optional[str] = None) -> Any:
        import warnings

        warnings.warn(f"cmlp.memory.{name} is deprecated (as in torch): use {instead}", FutureWarning, stacklevel=2)
        return fn(device)
    alias.__name__ = name
    alias.__doc__ = f"Deprecated alias of {instead} (torch's)."
    return alias


def empty_cache(device: Optional[str] = None) -> None:
    """Returns cached, unused memory to the device."""
    _cmlp.empty_cache(_device(device))


def set_memory_limit(nbytes: Optional[int], device: Optional[str] = None) -> None:
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


def set_per_process_memory_fraction(fraction: float, device: Optional[str] = None) -> None:
    """Caps reserved memory at fraction x the device's total memory (physical memory for "cpu")."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    dev = _device(device)
    total = _cmlp.memory_stats(dev)["total_memory"]
    _cmlp.set_memory_limit(dev, int(fraction * total))
    _fractions[dev] = (fraction, int(fraction * total))


def get_memory_limit(device: Optional[str] = None) -> Optional[int]:
    limit = _cmlp.memory_stats(_device(device))["limit"]
    return None if limit < 0 else limit


def caching_allocator_alloc(nbytes: Any = None, device: Optional[str] = None, stream: Any = None, *,
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
        with _raw_lock:
            _raw_blocks[ptr] = dev
    return ptr


def caching_allocator_delete(ptr: int) -> None:
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"ptr must be an int from caching_allocator_alloc, got {type(ptr).__name__}")
    with _raw_lock:
        dev = _raw_blocks.pop(ptr, None)
    if dev is None:
        if ptr == 0:
            return
        raise ValueError(f"pointer {ptr:#x} was not returned by caching_allocator_alloc (or was already deleted)")
    _cmlp.free(dev, ptr)


def memory_snapshot(device: Optional[str] = None) -> List[Dict[str, Any]]:
    """Every segment with its blocks, sorted by address, as torch.cuda.memory_snapshot() gives
    them: {device (the index; 0 for "cpu"), address, total_size, allocated_size, active_size,
    requested_size, stream (0), segment_type "small"/"large", segment_pool_id ((0, 0)),
    is_expandable, frames ([]), blocks: [{address, size, requested_size, state
    "active_allocated"/"inactive", frames}]}. An allocated block's frames say what it holds ({"filename": "cmlp", "line": 0,
    "name": "activations"}, ...) and, while _record_memory_history keeps contexts, the Python
    stack that allocated it, innermost first. An expandable segment appears as one entry per run
    of mapped pages. The statistics always equal what the snapshot adds up to. _snapshot() gives
    the same with the history, in PyTorch's format."""
    dev = _device(device)
    return _history.torch_segments(dev, _cmlp.snapshot(dev))


def memory_breakdown(device: Optional[str] = None) -> Dict[str, int]:
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
    (None, or the fraction of each GPU's memory set as its limit when it opens)."""
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
    }


def _config_text(config: Mapping[str, Any]) -> str:
    known = {"max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
             "large_segment_size_mb", "max_non_split_rounding_mb", "per_process_memory_fraction"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"Unrecognized CachingAllocator option: {unknown[0]}")
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
        except (TypeError, ValueError):
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
        div = [whole("roundup_power2_divisions", d) for d in div]
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
    dict as get_config() returns. Options not given return to their defaults. An unknown key
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


def _validate(device: Optional[str] = None) -> None:
    """Checks every invariant of the device's allocator; RuntimeError names the first broken one."""
    _cmlp.validate(_device(device))


def _fail_raw_alloc(k: int, device: Optional[str] = None) -> None:
    """Test hook: the k-th raw device allocation from now fails as if the device were full
    (k = 1: the next one); k <= 0 disables it."""
    _cmlp.fail_raw_alloc(_device(device), int(k))


_CATEGORIES = ("parameters", "gradients", "optimizer_state", "half_weights", "activations", "workspace", "data",
               "evaluation")


class Plan:
    """What a training run will hold. breakdown: requested bytes per category; peak_bytes: what the
    run adds to max_memory_allocated (allocator rounding included); reserved_bytes: what it adds
    to max_memory_reserved, from an empty cache. Both are on top of what a device holds from the
    moment it opens (on CUDA, the GEMM workspace: 10 MiB, 34 MiB on compute capability 9.x, 10.x
    and 12.x), whose place the plan takes into account."""

    def __init__(self, layer_sizes: List[int], batch_size: int, optimizer: str, amp: Optional[str],
                 recompute: bool, device: str, raw: Dict[str, int], optimizer_shards: int = 1) -> None:
        self.layer_sizes, self.batch_size, self.optimizer = list(layer_sizes), batch_size, optimizer
        self.optimizer_shards = optimizer_shards
        self.amp, self.recompute, self.device = amp, recompute, device
        self.breakdown: Dict[str, int] = {k: raw[k] for k in _CATEGORIES}
        self.peak_bytes: int = raw["peak_allocated"]
        self.reserved_bytes: int = raw["peak_reserved"]
        # what the device reserves from the moment it opens (CUDA's GEMM workspace), under
        # the run: a memory limit counts it and reserved_bytes
        self.standing_reserved_bytes: int = raw["standing_reserved"]
        # bytes of the step's buffers that live in the gradient buffer (in no category above):
        # with one micro-batch per optimizer step, the first layer's weight gradient, written
        # last, holds the half weights and every buffer the step is done with before that
        self.in_gradients: int = raw["in_gradients"]
        # the blocks that stay between steps as the allocator hands them out (rounded): what a run
        # at another micro-batch keeps of what is allocated now (Trainer's planned start)
        self._allocated: Dict[str, int] = {"model": raw["allocated_model"], "optimizer_state": raw["allocated_state"],
                                           "half_weights": raw["allocated_half"], "data": raw["allocated_data"]}
        # the run's requests up to its first step's buffers, in order: (what it holds, bytes)
        self._requests: List[Tuple[str, int]] = raw["requests"]

    def __repr__(self) -> str:
        return (f"Plan(layers={self.layer_sizes}, batch_size={self.batch_size}, peak_bytes={self.peak_bytes}, "
                f"reserved_bytes={self.reserved_bytes})")

    def __str__(self) -> str:
        sharded = self.optimizer_shards > 1 and self.breakdown["optimizer_state"] > 0
        shards = f" (state sharded over {self.optimizer_shards} ranks)" if sharded else ""
        head = (f"MLP {'-'.join(map(str, self.layer_sizes))}, batch {self.batch_size}, {self.optimizer}{shards}, "
                f"{self.amp or 'fp32'}{', recompute' if self.recompute else ''}, {self.device}")
        rows = [(k.replace("_", " "), v) for k, v in self.breakdown.items()]
        if self.in_gradients:
            rows.append(("(in the gradients)", self.in_gradients))
        rows += [("peak allocated", self.peak_bytes), ("peak reserved", self.reserved_bytes)]
        width = max(len(r[0]) for r in rows)
        lines = [head] + [f"  {name:<{width}}  {_fmt(v):>12}" for name, v in rows]
        return "\n".join(lines)


def _optimizer_buffers(optimizer: Any) -> Tuple[str, int]:
    from .optim import SGD, Adam

    if isinstance(optimizer, (Adam, SGD)):  # the buffers it holds and those its next step makes
        return ("adam" if isinstance(optimizer, Adam) else "sgd"), optimizer._c.buffers_planned()
    names = {"adam": 2, "adamw": 2, "adam_amsgrad": 3, "adamw_amsgrad": 3, "sgd": 0, "sgd_momentum": 1}
    if optimizer not in names:
        raise ValueError(f"optimizer must be one of {', '.join(map(repr, names))} or a cmlp optimizer, got "
                         f"{optimizer!r}")
    return optimizer.replace("adamw", "adam"), names[optimizer]


def _check_accumulation(accumulation_steps: Any) -> int:
    accumulation_steps = _numpy_int(accumulation_steps)
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    return accumulation_steps


def plan(layer_sizes: List[int], batch_size: int = 32, optimizer: Any = "adam", amp: Optional[str] = None,
         recompute: bool = False, device: str = "cpu", scaler: Optional[bool] = None,
         accumulation_steps: int = 1, optimizer_shards: Optional[int] = None, validation_rows: int = 0,
         validation_dtype: str = "uint8", data_rows: int = 0, data_dtype: str = "uint8", shuffle: bool = True,
         epochs: int = 5) -> Plan:
    """Predicts a training run's memory before anything is allocated (batch_size: rows computed at
    once, i.e. the micro-batch; accumulation_steps: micro-batches per optimizer step). With one
    micro-batch per step (the default) a step keeps most of its buffers in the first layer's
    weight gradient where they fit (in_gradients); a run that accumulates cannot, so plan it
    with its accumulation_steps. scaler defaults to amp == "fp16". optimizer_shards: the ranks a
    cmlp.distributed.optim.ZeroRedundancyOptimizer shards the optimizer's state over (default:
    a ZeroRedundancyOptimizer given as optimizer says, else 1); the plan is then the first rank's,
    whose part is the largest. validation_rows: the validation samples Trainer.fit evaluates
    after each epoch (a rank's share, data-parallel; 0: none), in chunks of up to 1000 rows after
    the step's buffers went back; validation_dtype: theirs ("uint8" images are normalised into a
    buffer, as any input on a GPU; "float32" ones are read in place on the CPU). The plan is then
    the whole run's, validation included (breakdown["evaluation"]: its buffers), over `epochs`
    epochs (Trainer.fit's default, 5): each gives the step's buffers back for the validation and
    takes them again after it, which reserves new segments each time where a new segment for a
    request below max_split_size is at or above it (which no smaller request may take), as a
    20 MiB one is with max_split_size_mb:20 (reserved_bytes is then at most the device's
    memory, where the allocator empties its cache; under a memory limit it gives those cached
    segments back when it reaches the limit, which is why max_batch_size counts one epoch's).
    data_rows: the
    training samples of a fit, which on a GPU it copies to the device for the run (uint8 images
    as uint8, floats as float32; with their labels and, when shuffle, their order;
    breakdown["data"]), 0 on the CPU, where they stay in host memory (a fit whose data set would
    leave its step no room under a memory limit stages its batches from host memory instead: plan
    that one without data_rows). No more of them than batch_size make every step one micro-batch
    of them all, which the plan is then of (its batch_size; accumulation_steps then do not
    apply). An optimizer given as an
    object is planned as it is: the state buffers it holds or will make at its next step, and on
    a GPU its param groups' settings (kept on the device once the groups' settings differ, as
    they may come to under a schedule: plan such an optimizer after its groups have parted)."""
    from .model import _as_sizes

    sizes = _as_sizes(layer_sizes)
    batch_size = _numpy_int(batch_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size < 2**63:
        raise ValueError(f"batch_size must be an int in [1, 2**63), got {batch_size!r}")
    name, _ = _optimizer_buffers(optimizer)
    dev = _device(device)
    args = _plan_args(optimizer, amp, recompute, scaler, accumulation_steps, optimizer_shards)
    data = _data_args(data_rows, data_dtype, shuffle, sizes[0])
    if 0 < data[0] <= batch_size:  # each step is the whole data set, in one micro-batch
        batch_size = data[0]
        args = _plan_args(optimizer, amp, recompute, scaler, 1, optimizer_shards)
    evaluation = _evaluation_args(validation_rows, validation_dtype, dev, epochs)
    raw = _cmlp.plan(list(sizes), batch_size, *args, *data, *evaluation, dev)
    return Plan(list(sizes), batch_size, name, amp, recompute, dev, raw, args[1])


def _rows_of(what: str, rows: Any, dtype: Any) -> Tuple[int, np.dtype]:
    """A data set's rows (an int in [0, 2**56)) and images' dtype ('uint8' or a float), checked;
    what: the arguments' prefix ("data", "validation")."""
    rows = _numpy_int(rows)
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows < 2**56:
        raise ValueError(f"{what}_rows must be an int in [0, 2**56), got {rows!r}")
    try:
        if dtype is None:  # (which NumPy reads as float64)
            raise TypeError
        kind = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{what}_dtype must be 'uint8' or a float dtype, got {dtype!r}") from None
    if kind != np.uint8 and kind.kind != "f":
        raise ValueError(f"{what}_dtype must be 'uint8' or a float dtype, got {dtype!r}")
    return rows, kind


def _data_args(rows: Any, dtype: Any, shuffle: Any, features: int) -> Tuple[int, int, bool]:
    """(rows, bytes per row, shuffled) of a data set a fit keeps on a device."""
    from ._arrays import as_flag

    rows, kind = _rows_of("data", rows, dtype)
    return rows, features * (1 if kind == np.uint8 else 4), as_flag("shuffle", shuffle)


def _evaluation_args(rows: Any, dtype: Any, device: str, epochs: Any) -> Tuple[int, bool, int]:
    """(rows of an evaluation chunk, whether its input is staged, epochs) for a validation of
    `rows` after each of `epochs` epochs."""
    from .trainer import EVALUATION_ROWS

    rows, kind = _rows_of("validation", rows, dtype)
    epochs = _numpy_int(epochs)
    if isinstance(epochs, bool) or not isinstance(epochs, int) or not 1 <= epochs < 2**31:
        raise ValueError(f"epochs must be an int in [1, 2**31), got {epochs!r}")
    # floats are converted to float32 on the host, then read in place (CPU) or copied (GPU)
    return min(rows, EVALUATION_ROWS), kind == np.uint8 or device != "cpu", epochs


def _optimizer_shards(optimizer: Any, optimizer_shards: Optional[int]) -> int:
    from .optim import Optimizer

    own = optimizer._c.shards()[0] if isinstance(optimizer, Optimizer) else 0
    if optimizer_shards is None:
        return own or 1
    optimizer_shards = _numpy_int(optimizer_shards)
    if isinstance(optimizer_shards, bool) or not isinstance(optimizer_shards, int) \
            or not 1 <= optimizer_shards <= 2**20:
        raise ValueError(f"optimizer_shards must be an int in [1, 2**20], got {optimizer_shards!r}")
    if own and optimizer_shards != own:
        raise ValueError(f"optimizer_shards={optimizer_shards}, and the optimizer given is sharded over {own} ranks")
    return optimizer_shards


def _plan_args(optimizer: Any, amp: Optional[str], recompute: bool, scaler: Optional[bool],
               accumulation_steps: int, optimizer_shards: Optional[int]) -> Tuple[int, int, int, int, bool, bool, bool]:
    """The C planner's arguments between the batch size and the device, checked."""
    from ._arrays import as_flag, check_amp
    from .optim import Optimizer

    solo = _check_accumulation(accumulation_steps) == 1
    amp_code = check_amp(amp)
    if isinstance(optimizer, Optimizer):
        optimizer._sync_parts(optimizer._rates()[1])  # its groups' parts, as its next step has them
    _, nbuf = _optimizer_buffers(optimizer)
    shards = _optimizer_shards(optimizer, optimizer_shards)
    scaling = amp == "fp16" if scaler is None else as_flag("scaler", scaler)
    parts = len(optimizer._c_parts or ()) if isinstance(optimizer, Optimizer) else 0  # its param groups' parts
    return nbuf, shards, parts, amp_code, as_flag("recompute", recompute), scaling, solo


def max_batch_size(layer_sizes: List[int], budget_bytes: int, optimizer: Any = "adam", amp: Optional[str] = None,
                   recompute: bool = False, device: str = "cpu", limit: int = 1 << 24,
                   accumulation_steps: int = 1, optimizer_shards: Optional[int] = None, validation_rows: int = 0,
                   validation_dtype: str = "uint8", data_rows: int = 0, data_dtype: str = "uint8",
                   shuffle: bool = True) -> int:
    """The largest micro-batch whose planned reserved memory fits in budget_bytes (0 if none),
    for runs of accumulation_steps micro-batches per optimizer step (see plan: with more than
    one, a step needs more memory for the same micro-batch), the optimizer's state sharded
    over optimizer_shards ranks, a validation of validation_rows after each epoch and, on a GPU,
    a fit's data set of data_rows kept on the device (see plan); at most data_rows, where given
    (a larger batch is the whole data set). The budget is a memory limit's: the segments that
    later epochs could add to the cache (see plan's epochs) would be given back at the limit,
    so the plan is of one epoch."""
    budget_bytes = _numpy_int(budget_bytes)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float, str, np.floating)):
        raise TypeError(f"budget_bytes must be a number of bytes or a size such as '2GB', got {budget_bytes!r}")
    try:
        budget = parse_size(budget_bytes)
    except ValueError as e:
        raise ValueError(f"budget_bytes: {e}") from None
    _check_accumulation(accumulation_steps)
    limit = _numpy_int(limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit < 2**62:
        raise ValueError(f"limit must be an int in [1, 2**62), got {limit!r}")
    rows = _data_args(data_rows, data_dtype, shuffle, 1)[0]
    if rows > 0:
        limit = min(limit, rows)

    def planned(b: int) -> Plan:
        return plan(layer_sizes, b, optimizer, amp, recompute, device, accumulation_steps=accumulation_steps,
                    optimizer_shards=optimizer_shards, validation_rows=validation_rows,
                    validation_dtype=validation_dtype, data_rows=data_rows, data_dtype=data_dtype, shuffle=shuffle,
                    epochs=1)

    # Reserved memory is at least the peak allocated, which grows with the batch: the largest
    # batch whose allocated peak fits bounds the answer from above (a search).
    if planned(1).peak_bytes > budget:
        return 0
    lo, hi = 1, 2
    while hi <= limit and planned(hi).peak_bytes <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # peak(lo) fits, peak(hi) does not
        mid = (lo + hi) // 2
        if planned(mid).peak_bytes <= budget:
            lo = mid
        else:
            hi = mid
    # Reserved memory itself does not grow steadily with the batch (a request that reaches
    # 10 MiB takes a segment of its own size instead of a 20 MiB one, so a larger batch can
    # reserve less), so the batches below that bound are tried from the top down.
    first = planned(lo)
    args = _plan_args(optimizer, amp, recompute, None, accumulation_steps, optimizer_shards)
    raw = [list(first.layer_sizes), 0, *args, *_data_args(data_rows, data_dtype, shuffle, first.layer_sizes[0]),
           *_evaluation_args(validation_rows, validation_dtype, first.device, 1), first.device]
    for b in range(lo, 0, -1):
        raw[1] = b
        if _cmlp.plan(*raw)["peak_reserved"] <= budget:
            return b
    return 0


def _fmt(n: int) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v, u = float(n), 0
    while u < 4 and abs(v) >= 1024.0:
        v, u = v / 1024.0, u + 1
    return f"{v:.2f} {units[u]}"


def _summary_size(v: int, row_first: int) -> str:
    """A byte count in PyTorch's summary style: an int of 6 digits and a unit chosen from the
    row's first value (so the pools below a metric share its unit)."""
    unit = "B  "
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if row_first < 768 * 1024:
            break
        unit, v, row_first = bigger, v // 1024, row_first / 1024
    return f"{v:6d} {unit}"


def _summary_count(v: int, row_first: int) -> str:
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


def memory_summary(device: Optional[str] = None, abbreviated: bool = False) -> str:
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
    lines = [double, f"{'cmlp memory summary, device ' + dev:^{width}}", rule,
             f"{'OOMs: ' + str(s['num_ooms']):^37}|{'alloc retries: ' + str(s['num_alloc_retries']):^37}", double,
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
    reserved, allocated = s["reserved_bytes.all.current"], s["allocated_bytes.all.current"]
    frag = 100.0 * (reserved - allocated) / reserved if reserved else 0.0
    lines += [rule, f" Memory limit: {'none' if limit < 0 else _fmt(limit)}",
              f" Largest free block: {_fmt(s['largest_free_block'])}",
              f" Fragmentation (reserved but unallocated): {frag:.1f}%",
              f" Device allocs/frees: {s['num_device_alloc']}/{s['num_device_free']}"]
    held = memory_breakdown(dev)
    if held:
        lines += [rule, " Allocated memory by what it holds (bytes requested):"]
        lines += [f"   {what:<40} {_fmt(n):>12}" for what, n in held.items()]
    lines.append(double)
    return "\n".join(f"|{line:<{width}}|" for line in lines) + "\n"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: Union[str, int]) -> int:
    """'256MB', '1.5GiB', '4096' -> bytes (K/M/G/T are powers of 1024, as for memory), exactly:
    a fraction of a unit rounds down to whole bytes; a fraction of a byte is refused."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 512MB, 2GB or a number of bytes")
    unit = (m.group(2) or "B").upper()
    scale = 1 if unit == "B" else 1024 ** ("KMGT".index(unit[0]) + 1)
    value = Fraction(m.group(1)) * scale
    if scale == 1 and value.denominator != 1:
        raise ValueError(f"cannot read {text!r} as a size: a number of bytes is a whole number")
    return int(value)
