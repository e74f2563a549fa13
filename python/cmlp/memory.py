"""Memory statistics and controls, with torch.cuda's names and meanings, for every device
("cpu" included). All numbers come from the device's allocator, which owns every byte."""
import re
import threading
from typing import Dict, Optional, Union

from . import _cmlp

_raw_blocks: Dict[int, str] = {}
_raw_lock = threading.Lock()


def _device(device: Optional[str]) -> str:
    if device is None:
        return "cuda:0" if _cmlp.cuda_device_count() > 0 else "cpu"
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {device!r}")
    return _cmlp.parse_device(device)


def memory_stats(device: Optional[str] = None) -> Dict[str, int]:
    """PyTorch's keys: "<stat>.<pool>.<metric>" plus num_alloc_retries, num_ooms, ..."""
    stats = _cmlp.memory_stats(_device(device))
    return dict(sorted(stats.items()))


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


def empty_cache(device: Optional[str] = None) -> None:
    """Returns cached, unused memory to the device."""
    _cmlp.empty_cache(_device(device))


def set_memory_limit(nbytes: Optional[int], device: Optional[str] = None) -> None:
    """Caps what the device's allocator may reserve (None removes the cap)."""
    if nbytes is None:
        _cmlp.set_memory_limit(_device(device), -1)
        return
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int or None, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0 or None, got {nbytes}")
    _cmlp.set_memory_limit(_device(device), nbytes)


def set_per_process_memory_fraction(fraction: float, device: Optional[str] = None) -> None:
    """Caps reserved memory at fraction x the device's total memory (physical memory for "cpu")."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    dev = _device(device)
    total = _cmlp.memory_stats(dev)["total_memory"]
    _cmlp.set_memory_limit(dev, int(fraction * total))


def get_memory_limit(device: Optional[str] = None) -> Optional[int]:
    limit = _cmlp.memory_stats(_device(device))["limit"]
    return None if limit < 0 else limit


def caching_allocator_alloc(nbytes: int, device: Optional[str] = None) -> int:
    """A raw block of nbytes from the device's allocator; give it back with caching_allocator_delete."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    dev = _device(device)
    ptr = _cmlp.alloc(dev, nbytes)
    if ptr:
        with _raw_lock:
            _raw_blocks[ptr] = dev
    return ptr


def caching_allocator_delete(ptr: int) -> None:
    with _raw_lock:
        dev = _raw_blocks.pop(ptr, None)
    if dev is None:
        if ptr == 0:
            return
        raise ValueError(f"pointer {ptr:#x} was not returned by caching_allocator_alloc (or was already deleted)")
    _cmlp.free(dev, ptr)


def _fmt(n: int) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v, u = float(n), 0
    while u < 4 and abs(v) >= 1024.0:
        v, u = v / 1024.0, u + 1
    return f"{v:.2f} {units[u]}"


def memory_summary(device: Optional[str] = None) -> str:
    """A table of current, peak, allocated and freed for each statistic, as PyTorch prints it."""
    dev = _device(device)
    s = _cmlp.memory_stats(dev)
    rows = [("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True), ("GPU reserved memory" if dev != "cpu" else
                                                            "Reserved memory", "reserved_bytes", True),
            ("Non-releasable memory", "inactive_split_bytes", True), ("Allocations", "allocation", False),
            ("Active allocs", "active", False), ("Segments", "segment", False),
            ("Non-releasable allocs", "inactive_split", False)]
    width = 75
    line = "|" + "=" * width + "|"
    out = [line, f"|{'cmlp memory summary, device ' + dev:^{width}}|", line,
           f"| {'Metric':<26}| {'Cur Usage':>10} | {'Peak Usage':>10} | {'Tot Alloc':>10} | {'Tot Freed':>7} |",
           "|" + "-" * width + "|"]
    for title, key, is_bytes in rows:
        for pool, label in (("all", title), ("large_pool", "      from large pool"), ("small_pool", "      from small pool")):
            vals = [s[f"{key}.{pool}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            txt = [_fmt(v) if is_bytes else str(v) for v in vals]
            out.append(f"| {label:<26}| {txt[0]:>10} | {txt[1]:>10} | {txt[2]:>10} | {txt[3]:>9} |")
        out.append("|" + "-" * width + "|")
    limit = s["limit"]
    out.append(f"| {'Memory limit':<26}| {('none' if limit < 0 else _fmt(limit)):>10} |"
               f" OOMs: {s['num_ooms']:<6} Retries: {s['num_alloc_retries']:<6} Device allocs: {s['num_device_alloc']:<6}|")
    out.append(line)
    return "\n".join(out)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)


def parse_size(text: Union[str, int]) -> int:
    """'256MB', '1.5GiB', '4096' -> bytes (K/M/G/T are powers of 1024, as for memory)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 512MB, 2GB or a number of bytes")
    unit = (m.group(2) or "B").upper()
    scale = {"": 1, "B": 1}.get(unit)
    if scale is None:
        scale = 1024 ** ("KMGT".index(unit[0]) + 1)
    return int(float(m.group(1)) * scale)
