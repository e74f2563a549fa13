"""CUDA device queries, named as in torch.cuda.

The CUDA driver does not survive fork(): once a process has started it, its forked children
cannot use CUDA. As torch.cuda's, device_count() asks NVML, which starts nothing, until this
process starts CUDA (and asks CUDA where NVML is not there); is_available() asks CUDA itself,
unless CMLP_NVML_BASED_CUDA_CHECK (or, where that is unset, PYTORCH_NVML_BASED_CUDA_CHECK) is "1".
"""
import collections
import os
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import _cmlp
from ._arrays import as_flag


OutOfMemoryError = _cmlp.OutOfMemoryError  # torch.cuda's name too: `except cmlp.cuda.OutOfMemoryError` ports


def is_available() -> bool:
    """True when this build has the CUDA backend and a usable GPU is present. This starts the
    CUDA driver (so children forked afterwards cannot use CUDA), except with
    CMLP_NVML_BASED_CUDA_CHECK=1, where it is device_count() > 0: NVML's weaker check (it sees
    the GPUs, not whether CUDA can use them), which leaves CUDA unstarted."""
    var = os.environ.get("CMLP_NVML_BASED_CUDA_CHECK")
    if var is None:
        var = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    if var == "1":
        return device_count() > 0
    return _cmlp.cuda_device_count() > 0


def device_count() -> int:
    """The number of GPUs this process can use. Until CUDA is started here: the GPUs NVML reports,
    as CUDA_VISIBLE_DEVICES selects them, without starting CUDA (where NVML is missing or fails,
    CUDA's count, which starts it); afterwards CUDA's own count."""
    if _cmlp.cuda_started() or not _cmlp.cuda_loadable():
        return _cmlp.cuda_device_count()
    n = _nvml_count(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _cmlp.cuda_device_count() if n < 0 else n


def _nvml_count(visible: Optional[str]) -> int:
    """NVML's GPUs as CUDA_VISIBLE_DEVICES (visible) selects them; -1 where NVML cannot tell."""
    devices = _visible_devices(visible)
    if not devices:
        return 0
    if isinstance(devices[0], str) and devices[0].startswith("MIG-"):
        return -1  # MIG instances are CUDA's to count
    uuids = _cmlp.nvml_devices()
    if uuids is None:
        return -1
    if isinstance(devices[0], str):
        return len(_uuid_ordinals(devices, uuids))
    for i, d in enumerate(devices):
        if d >= len(uuids):  # the first ordinal past the last GPU ends the list
            return i
    return len(devices)


def _visible_devices(var: Optional[str]) -> "Union[List[int], List[str]]":
    """CUDA_VISIBLE_DEVICES as the CUDA runtime reads it (and torch.cuda): unset, every device;
    otherwise comma-separated ordinals, each read as strtoul reads a number ("1gpu" is 1), up to
    the first that is not one (or is negative); or UUIDs ("GPU-..." or "MIG-...", whole or
    a prefix) up to the first without that prefix. A repeated entry hides every device."""
    if var is None:
        return list(range(64))
    if var.startswith("GPU-") or var.startswith("MIG-"):
        prefix, names = var[:4], []
        for item in var.split(","):
            if item in names:
                return []
            if not item.startswith(prefix):
                break
            names.append(item)
        return names
    ordinals: List[int] = []
    for item in var.split(","):
        x = _leading_number(item.strip())
        if x in ordinals:
            return []
        if x < 0:
            break
        ordinals.append(x)
    return ordinals


def _leading_number(s: str) -> int:
    """The integer that s starts with (an optional sign, then digits), or -1 where there is none."""
    digits = 1 if s[:1] in ("+", "-") else 0
    while digits < len(s) and "0" <= s[digits] <= "9":
        digits += 1
    if digits == 0 or not s[digits - 1].isdigit():
        return -1
    return int(s[:digits])


def _uuid_ordinals(names: List[str], uuids: List[str]) -> List[int]:
    """The GPUs that UUIDs or unique UUID prefixes name, up to the first that names none or more
    than one; a GPU named twice hides every device."""
    ordinals: List[int] = []
    for name in names:
        matches = [i for i, u in enumerate(uuids) if u.startswith(name)]
        if len(matches) != 1:
            break
        if matches[0] in ordinals:
            return []
        ordinals.append(matches[0])
    return ordinals


class _CudaDeviceProperties(NamedTuple):
    """torch.cuda.get_device_properties' first fields (total_memory in bytes)."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    max_threads_per_multi_processor: int
    warp_size: int
    L2_cache_size: int
    uuid: str  # as NVML writes it, without its "GPU-" prefix

    def __repr__(self) -> str:  # as torch's: the memory in MB
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1024 * 1024)}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"L2_cache_size={self.L2_cache_size // (1024 * 1024)}MB)")


def _device_index(device: "Optional[str | int]") -> int:
    """torch.cuda's device argument: None or "cuda" (the current GPU: see set_device), an index,
    "cuda:N" or a torch.device."""
    if device is None:
        return _cmlp.cuda_current_device()
    idx = getattr(device, "idx", None)  # a device block (this module's or torch.cuda's), as torch takes one
    if isinstance(idx, int) and not isinstance(idx, bool) and not hasattr(device, "type"):
        return idx
    if not isinstance(device, (str, int, np.integer)) and hasattr(device, "type"):  # a torch.device
        from ._args import _device_text

        device = _device_text(device)
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        index = int(device)
    elif isinstance(device, str):
        kind, sep, text = device.partition(":")
        if kind != "cuda" or (sep and not (text.isdigit() and text.isascii())):
            raise ValueError(f"Expected a cuda device, but got: {device}")
        index = int(text) if sep else _cmlp.cuda_current_device()
    else:
        raise TypeError(f"device must be an int, a str such as 'cuda:0' or None, got {device!r}")
    if not -2**31 <= index < 2**31:  # no GPU has it, and C's int does not hold it
        raise ValueError(f"Invalid device index {index}: no GPU has an index that large")
    return index


def is_initialized() -> bool:
    """Whether CUDA was started in this process and can be used here (torch.cuda.is_initialized):
    False before anything asked CUDA for its GPUs, where it found none, and in a child forked
    after it started."""
    return _cmlp.cuda_started() and not _cmlp.cuda_forked() and _cmlp.cuda_device_count() > 0


def init() -> None:
    """Starts CUDA now rather than at its first use (torch.cuda.init); nothing where it was started.
    RuntimeError saying why where CUDA is not available."""
    _cmlp.parse_device("cuda")


def current_device() -> int:
    """The index of the current GPU, as torch.cuda.current_device(): the one "cuda" (and device
    None) names in this thread; 0 until set_device or a `device` block changes it. RuntimeError
    saying why where CUDA is not available."""
    _cmlp.parse_device("cuda")  # (raises where there is no GPU)
    return _cmlp.cuda_current_device()


def set_device(device: "str | int") -> None:
    """Makes GPU `device` (an index, "cuda:N" or a torch.device) the current one in this thread, as
    torch.cuda.set_device: "cuda" and device None then name it, in cmlp's calls (MLP(device="cuda"),
    model.cuda(), cmlp.memory's and cmlp.cuda's functions). A negative index does nothing, as in
    torch. RuntimeError where that GPU is not there. CUDA's own current device, which other
    libraries read, stays as it is (cmlp's calls make the device they use current and put the
    caller's back)."""
    if device is None or (isinstance(device, str) and device == "cuda") \
            or (getattr(device, "type", None) == "cuda" and getattr(device, "index", 0) is None):
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    index = _device_index(device)
    if index >= 0:
        _cmlp.cuda_set_device(index)


class device:
    """Context manager that makes a GPU the current one inside its block (see set_device) and puts
    the one before back after it, as torch.cuda.device; None or a negative index changes nothing."""

    def __init__(self, device: "Optional[str | int]") -> None:
        self.idx = -1 if device is None else _device_index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = -1
        if self.idx >= 0:
            before = _cmlp.cuda_current_device()
            _cmlp.cuda_set_device(self.idx)
            self.prev_idx = before

    def __exit__(self, *exc: Any) -> None:
        if self.prev_idx >= 0:
            _cmlp.cuda_set_device(self.prev_idx)


class device_of(device):
    """torch.cuda.device_of: the `device` block of the GPU an object is on (a cmlp model, or anything
    with a .device such as "cuda:1" or a torch.device); a no-op for one on the CPU."""

    def __init__(self, obj: Any) -> None:
        from ._args import _device_text

        where = _device_text(getattr(obj, "device", None))
        super().__init__(_device_index(where) if isinstance(where, str) and where.startswith("cuda") else None)


def get_device_properties(device: "Optional[str | int]" = None) -> _CudaDeviceProperties:
    """A GPU's name, compute capability, memory and multiprocessors, as torch.cuda's (this starts
    CUDA). RuntimeError where CUDA is not available; AssertionError for an index that is not a
    GPU here, as torch's."""
    index = _device_index(device)
    count = _cmlp.cuda_device_count()
    if count > 0 and not 0 <= index < count:
        raise AssertionError("Invalid device id")
    return _CudaDeviceProperties(**_cmlp.cuda_device_properties(index if 0 <= index < 2**31 else -1))


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """torch.cuda's: whether the current GPU computes in bfloat16 (amp="bf16"): compute capability
    8.0 or later, which every GPU cmlp's kernels are built for has; False where CUDA is not
    available. (including_emulation: torch's, for older GPUs, on which cmlp does not run.)"""
    as_flag("including_emulation", including_emulation)
    return is_available() and get_device_properties().major >= 8


def get_device_name(device: "Optional[str | int]" = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: "Optional[str | int]" = None) -> Tuple[int, int]:
    p = get_device_properties(device)
    return p.major, p.minor


def list_gpu_processes(device: "Optional[str | int]" = None) -> str:
    """torch.cuda.list_gpu_processes: the processes holding memory on a GPU and how much, from
    NVML ("GPU:N", N NVML's index of the GPU, then a line per process; "?" where NVML does not
    say how much). This starts CUDA. As torch's, a machine that cannot tell (no GPU, no CUDA
    driver) gets a line saying why instead."""
    try:
        index = _device_index(device)
        procs = _cmlp.gpu_processes(f"cuda:{index}")
    except RuntimeError as e:  # (not a bad argument's ValueError or TypeError)
        if is_available():  # a GPU that is not there, ...
            raise
        return f"cannot list the processes on the GPU: {e}"
    if procs is None:
        return "NVML (libnvidia-ml.so.1) is not available here: cannot list the processes on the GPU"
    uuids = _cmlp.nvml_devices() or []
    uuid = "GPU-" + get_device_properties(index).uuid
    lines = [f"GPU:{uuids.index(uuid) if uuid in uuids else index}"]
    lines += [f"process {pid:>10d} uses {f'{used / 2**20:.3f}' if used >= 0 else '?':>12} MB GPU memory"
              for pid, used in procs]
    if not procs:
        lines.append("no processes are running")
    return "\n".join(lines)


def synchronize(device: Optional[str] = None) -> None:
    """Waits for the device's queued work. Raises RuntimeError when CUDA is unavailable."""
    _cmlp.synchronize(f"cuda:{_device_index(device)}")


def mem_get_info(device: "Optional[str | int]" = None) -> Tuple[int, int]:
    """(free, total) bytes of a GPU (default "cuda"; an int N is "cuda:N", as torch.cuda takes
    it), as torch.cuda.mem_get_info; see cmlp.memory.mem_get_info. Raises RuntimeError when CUDA
    is unavailable."""
    from .memory import mem_get_info as info

    return info(f"cuda:{_device_index(device)}")


# torch.cuda's memory functions, as cmlp.memory's for a GPU: device None is "cuda" (the current
# GPU, as torch.cuda has it). As torch.cuda's, the readers of the statistics return 0, {} or []
# for a GPU this process has not opened (and where there is no CUDA at all) rather than open it;
# the others open it, and raise RuntimeError saying why where CUDA is unavailable. Once another GPU
# is open, memory_stats of one not opened is torch's of a GPU it has not used: its keys, all 0.
def _opened(device: "Optional[str | int]") -> bool:
    """Whether the GPU `device` names is open here (an index past the GPUs raises, as torch's,
    once CUDA has started); opens nothing."""
    index = _device_index(device)
    if _cmlp.cuda_device_opened(index):
        return True
    count = _cmlp.cuda_device_count() if _cmlp.cuda_started() else 0
    if count > 0 and not 0 <= index < count:
        from . import memory as _memory

        _memory.memory_allocated(f"cuda:{index}")  # raises: that GPU is not there
    return False


def _on_gpu(name: str, unopened: Any = None):  # type: ignore[no-untyped-def]
    def call(device: "Optional[str | int]" = None):  # type: ignore[no-untyped-def]
        from . import memory as _memory

        index = _device_index(device)
        if index < 0:  # (as torch's allocator: no GPU has it)
            raise ValueError(f"Invalid device argument {index}: a GPU's index is >= 0")
        if unopened is not None and not _opened(index):
            return unopened(index)
        return getattr(_memory, name)(f"cuda:{index}")

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"cmlp.memory.{name} of a GPU (default: \"cuda\"), as torch.cuda.{name}" + (
        " (of a GPU not opened here, which this opens not: what torch's gives of a GPU it has not used)."
        if unopened is not None else ".")
    return call


def _unused_stats(index: int) -> Dict[str, int]:
    """torch.cuda.memory_stats of a GPU not opened here: {} until CUDA starts (no GPU opened
    yet); after, as torch's of a GPU it has not used since, every statistic 0 with the settings
    it would open with (max_split_size, the limit per_process_memory_fraction makes, its memory)."""
    count = _cmlp.cuda_device_count() if _cmlp.cuda_started() else 0
    if not any(_cmlp.cuda_device_opened(i) for i in range(count)):
        return collections.OrderedDict()
    from . import memory as _memory

    stats = collections.OrderedDict((key, 0) for key in _memory.memory_stats("cpu"))  # every device's keys
    settings = _cmlp.get_settings()
    total = get_device_properties(index).total_memory
    fraction = settings["per_process_memory_fraction"]
    stats.update(max_split_size=settings["max_split_size"], total_memory=total,
                 limit=int(fraction * total) if fraction >= 0 else -1)
    return stats


def _unused_nested(index: int) -> Dict[str, Any]:
    from . import memory as _memory

    stats = _unused_stats(index)
    return _memory._nested(stats) if stats else {}


def _zero(index: int) -> int:
    return 0


memory_allocated = _on_gpu("memory_allocated", _zero)
max_memory_allocated = _on_gpu("max_memory_allocated", _zero)
memory_reserved = _on_gpu("memory_reserved", _zero)
max_memory_reserved = _on_gpu("max_memory_reserved", _zero)
memory_stats = _on_gpu("memory_stats", _unused_stats)
memory_stats_as_nested_dict = _on_gpu("memory_stats_as_nested_dict", _unused_nested)


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> List[Dict[str, Any]]:
    """torch.cuda.memory_snapshot(): the segments of every GPU opened here, by device index, then
    address (cmlp.memory.memory_snapshot(device) gives one device's). Each GPU has one pool,
    (0, 0): mempool_id None or (0, 0) gives them all, another id none. include_traces is checked
    and changes nothing (the segments carry no history; _snapshot() gives it)."""
    from . import memory as _memory

    as_flag("include_traces", include_traces)
    if mempool_id is not None:
        if (not isinstance(mempool_id, (tuple, list)) or len(mempool_id) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in mempool_id)):
            raise TypeError(f"mempool_id must be None or a pair of ints (a pool's id), got {mempool_id!r}; "
                            "cmlp.memory.memory_snapshot(device) gives one device's segments")
        if tuple(mempool_id) != (0, 0):
            return []
    count = _cmlp.cuda_device_count() if _cmlp.cuda_started() else 0
    return [seg for i in range(count) if _cmlp.cuda_device_opened(i) for seg in _memory.memory_snapshot(f"cuda:{i}")]


reset_peak_memory_stats = _on_gpu("reset_peak_memory_stats")
reset_accumulated_memory_stats = _on_gpu("reset_accumulated_memory_stats")
get_per_process_memory_fraction = _on_gpu("get_per_process_memory_fraction")


def _deprecated(name: str, instead: str, fn: Any) -> Any:
    def alias(device: "Optional[str | int]" = None) -> Any:
        import warnings

        warnings.warn(f"cmlp.cuda.{name} is deprecated (as in torch): use {instead}", FutureWarning, stacklevel=2)
        return fn(device)

    alias.__name__ = alias.__qualname__ = name
    alias.__doc__ = f"Deprecated alias of {instead} (torch.cuda's)."
    return alias


memory_cached = _deprecated("memory_cached", "memory_reserved", memory_reserved)
max_memory_cached = _deprecated("max_memory_cached", "max_memory_reserved", max_memory_reserved)
reset_max_memory_allocated = _deprecated("reset_max_memory_allocated", "reset_peak_memory_stats",
                                         reset_peak_memory_stats)
reset_max_memory_cached = _deprecated("reset_max_memory_cached", "reset_peak_memory_stats", reset_peak_memory_stats)


def memory_summary(device: "Optional[str | int]" = None, abbreviated: bool = False) -> str:
    """cmlp.memory.memory_summary of a GPU (default: "cuda"), as torch.cuda.memory_summary."""
    from . import memory as _memory

    return _memory.memory_summary(f"cuda:{_device_index(device)}", abbreviated=abbreviated)


def empty_cache() -> None:
    """Returns every GPU's cached, unused segments, as torch.cuda.empty_cache; a no-op for the
    GPUs not opened here (without CUDA, for all), as torch's is before CUDA starts, and in a child
    forked after it started (which cannot use it)."""
    from . import memory as _memory

    count = _cmlp.cuda_device_count() if _cmlp.cuda_started() and not _cmlp.cuda_forked() else 0
    for index in range(count):
        if _cmlp.cuda_device_opened(index):
            _memory.empty_cache(f"cuda:{index}")


def set_per_process_memory_fraction(fraction: float, device: "Optional[str | int]" = None) -> None:
    """cmlp.memory.set_per_process_memory_fraction of a GPU (default: "cuda")."""
    from . import memory as _memory

    _memory.set_per_process_memory_fraction(fraction, f"cuda:{_device_index(device)}")


def caching_allocator_alloc(size: Any, device: "Optional[str | int]" = None, stream: Any = None) -> int:
    """cmlp.memory.caching_allocator_alloc on a GPU (default: "cuda"), as torch.cuda's."""
    from . import memory as _memory

    return _memory.caching_allocator_alloc(size, f"cuda:{_device_index(device)}", stream)


def caching_allocator_delete(mem_ptr: int) -> None:
    """Gives back a block of caching_allocator_alloc, as torch.cuda's."""
    from . import memory as _memory

    _memory.caching_allocator_delete(mem_ptr)


def caching_allocator_enable(value: bool = True) -> None:
    """cmlp.memory.caching_allocator_enable, as torch.cuda's (every device's allocator)."""
    from . import memory as _memory

    _memory.caching_allocator_enable(value)


def get_allocator_backend() -> str:
    """cmlp.memory.get_allocator_backend, as torch.cuda's."""
    from . import memory as _memory

    return _memory.get_allocator_backend()


if TYPE_CHECKING:  # (a checker sees the submodule; at run time it is imported on first use)
    from . import memory as memory

    __all_for_checkers__ = (memory,)  # (the import is this module's attribute, not an unused name)
else:
    def __getattr__(name: str) -> Any:
        """cmlp.cuda.memory is cmlp.memory (torch.cuda.memory, where torch keeps
        _record_memory_history, _snapshot and _dump_snapshot): its device=None is the current GPU
        wherever there is one."""
        if name == "memory":
            from . import memory as _memory

            return _memory
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
