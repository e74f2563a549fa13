"""Memory history with torch.cuda.memory's names: _record_memory_history, _snapshot and
_dump_snapshot. The snapshot has PyTorch's format, so PyTorch's viewer (pytorch.org/memory_viz)
and torch.cuda._memory_viz read it.

Every allocation says what it holds ("parameters", "gradients", "activations", "optimizer
state", ...): that is its innermost frame (file "cmlp"), followed by the Python stack of the call
that allocated it, innermost first. Each distinct stack is stored once, for the life of the
process (a live block may refer to it long after recording stops).

Differences from torch, on purpose: enabled="state" keeps no history at all (torch keeps one
entry), and cmlp's own first frame is there with stacks="all" whatever the older form's
record_context_cpp says."""
import inspect
import numbers
import os
import pickle
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _cmlp
from ._args import Device
from ._files import atomic_write
from ._cmlp import CoreLock

_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "oom", "snapshot")
_MODES = {None: 0, "state": 1, "all": 2}
_CONTEXTS = {None: 0, "state": 1, "alloc": 2, "all": 3}
_STACKS = ("python", "all")

_lock = CoreLock()


def _new_lock_in_child() -> None:  # a thread the forked child lacks may have held it
    global _lock
    _lock = CoreLock()


os.register_at_fork(after_in_child=_new_lock_in_child)
_settings: Dict[str, Tuple[Optional[str], Optional[str], str]] = {}  # device -> (enabled, context, stacks)
_stacks: Dict[int, List[Dict[str, Any]]] = {}  # stack number -> frames
_Shared = Dict[Tuple[Optional[str], int, str], List[Dict[str, Any]]]  # a snapshot's frames lists


def _choice(name: str, value: Any, allowed: Any) -> Any:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    if value not in allowed:
        names = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {names}, got {value!r}")
    return value


def _cpp_bool(name: str, value: Any) -> bool:
    """What a C++ bool of torch's takes: None (False), a bool or a number's truth; not a text."""
    if value is not None and not isinstance(value, (bool, np.bool_, numbers.Number)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _record(enabled: Optional[str] = "all", context: Optional[str] = "all", stacks: str = "all",
            max_entries: int = sys.maxsize, device: Optional[Device] = None, clear_history: bool = False,
            compile_context: bool = False, global_record_annotations: bool = False,
            skip_actions: Optional[List[str]] = None, record_pinned_host_memory: bool = False,
            record_cuda: bool = True) -> None:
    _choice("enabled", enabled, tuple(_MODES))
    _choice("context", context, tuple(_CONTEXTS))
    _choice("stacks", stacks, _STACKS)
    if isinstance(max_entries, (bool, np.bool_)) or not isinstance(max_entries, numbers.Integral):
        raise TypeError(f"max_entries must be an int, got {type(max_entries).__name__}")
    max_entries = int(max_entries)  # (a NumPy int as well, as the other memory functions take)
    if enabled is not None and not 1 <= max_entries <= sys.maxsize:
        raise ValueError(f"max_entries must be between 1 and sys.maxsize, got {max_entries}")
    max_entries = max(1, min(max_entries, sys.maxsize))  # stopping reads none of it
    if isinstance(skip_actions, (str, bytes)):
        raise TypeError(f"skip_actions must be a list of action names, got the string {skip_actions!r}")
    try:
        if skip_actions is not None and not hasattr(skip_actions, "__len__"):  # a list, as torch's (no iterator)
            raise TypeError
        skipped = list(skip_actions or ())
    except TypeError:
        raise TypeError(f"skip_actions must be a list of action names, got {skip_actions!r}") from None
    clear_history = _cpp_bool("clear_history", clear_history)
    # torch.compile's frames, annotations and pinned host memory: cmlp has none of them to record
    for name, value in (("compile_context", compile_context), ("global_record_annotations", global_record_annotations),
                        ("record_pinned_host_memory", record_pinned_host_memory)):
        _cpp_bool(name, value)
    skip = 0
    for action in skipped:
        if action == "annotate":  # torch's, for annotations cmlp does not make
            continue
        if action not in _ACTIONS:
            raise ValueError(f"skip_actions: unknown action {action!r}; the actions are {', '.join(_ACTIONS)}")
        skip |= 1 << _ACTIONS.index(action)
    from ._args import _device

    dev = _device(device)
    if not _cpp_bool("record_cuda", record_cuda):  # as torch's: the device's recording stays as it is
        return
    if enabled is None:
        context = None
    with _lock:
        _cmlp.record_history(dev, _MODES[enabled], _CONTEXTS[context], max_entries, skip, clear_history)
        if enabled is None:
            _settings.pop(dev, None)
        else:
            _settings[dev] = (enabled, context, stacks)
        _cmlp.capture_stacks(any(c is not None for _, c, _ in _settings.values()))


def _record_legacy(enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1,
                   trace_alloc_record_context: bool = False, device: Optional[Device] = None,
                   record_context_cpp: bool = False, clear_history: bool = False, compile_context: bool = False,
                   global_record_annotations: bool = False, skip_actions: Optional[List[str]] = None,
                   record_pinned_host_memory: bool = False, record_cuda: bool = True) -> None:
    """torch's older form, enabled a bool: a history of trace_alloc_max_entries actions (1 by
    default), stacks for live blocks with record_context and for allocations too with
    trace_alloc_record_context. (record_context_cpp: cmlp's own first frame is always there.)"""
    context = ("alloc" if trace_alloc_record_context else "state") if record_context else None
    _record("all" if enabled else None, context, "all", trace_alloc_max_entries, device, clear_history,
            compile_context, global_record_annotations, skip_actions, record_pinned_host_memory, record_cuda)


def record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """Starts (or changes, or with enabled=None stops) recording what the device's allocator does,
    as torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all",
    max_entries=sys.maxsize, device=None, clear_history=False, compile_context=False,
    global_record_annotations=False, skip_actions=None, record_pinned_host_memory=False,
    record_cuda=True).

    enabled: None (stop; the history is dropped), "state" (live blocks keep the stack that
    allocated them; no history) or "all" (also a history of every action: alloc, free_requested,
    free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom, snapshot). A
    bool takes torch's older arguments (enabled, record_context=True, trace_alloc_max_entries=1,
    trace_alloc_record_context=False, device=None, record_context_cpp=False, clear_history=False).
    context: which entries keep a Python stack: None, "state" (live blocks and segments: the
    request's that made them), "alloc" (+ allocations and segments made; a free, and a segment
    given back, has the stack of what it frees, as torch's), "all" (+ each free its own caller's,
    empty_cache's among them). A snapshot's own entry follows the history it returns (torch's
    order: the next one shows it). stacks: "python" (the Python frames only) or "all" (also a
    first frame naming what the memory holds). max_entries: the history keeps the newest
    max_entries actions. skip_actions: actions not to record. device: None means the current
    device, as everywhere in cmlp.memory. record_cuda=False leaves the device's recording as it
    is (torch's records only pinned host memory then). compile_context, global_record_annotations
    and record_pinned_host_memory are checked and change nothing: cmlp has no torch.compile
    frames, annotations or pool of pinned host memory to record."""
    if isinstance(enabled, bool):
        _record_legacy(enabled, *args, **kwargs)
    else:
        _record(enabled, *args, **kwargs)


record_memory_history.__signature__ = inspect.signature(_record)  # type: ignore[attr-defined]


def _stack(number: int) -> List[Dict[str, Any]]:
    frames = _stacks.get(number)
    if frames is None:
        frames = [{"filename": f, "line": line, "name": n} for f, line, n in _cmlp.stack_frames(number)]
        _stacks[number] = frames
    return frames


def _frames(what: Optional[str], context: int, stacks: str, shared: _Shared) -> List[Dict[str, Any]]:
    """One list per (what, context, stacks) in a snapshot, shared by its entries and blocks that
    have them (so that a pickled snapshot holds each once)."""
    key = (what, context, stacks)
    frames = shared.get(key)
    if frames is None:
        frames = [{"filename": "cmlp", "line": 0, "name": what}] if what is not None and stacks == "all" else []
        if context:
            frames += [dict(f) for f in _stack(context)]
        shared[key] = frames
    return frames


def _stacks_of(dev: str) -> str:
    return _settings.get(dev, (None, None, "all"))[2]


def blocks_with_frames(dev: str, segments: List[Dict[str, Any]], shared: Optional[_Shared] = None
                       ) -> List[Dict[str, Any]]:
    """The raw snapshot's blocks with "frames" in place of what and context."""
    stacks, shared = _stacks_of(dev), {} if shared is None else shared
    for seg in segments:
        seg["stream"] = 0
        for b in seg["blocks"]:
            b["frames"] = _frames(b.pop("what"), b.pop("context"), stacks, shared)
    return segments


def torch_segments(dev: str, raw: List[Dict[str, Any]], shared: Optional[_Shared] = None) -> List[Dict[str, Any]]:
    """The raw snapshot's segments with PyTorch's keys (torch.cuda.memory_snapshot()'s): device
    as an index, stream, segment_type, segment_pool_id, is_expandable, frames (those of the
    request the segment was made for, an expandable one's run: its first page), and blocks with
    frames."""
    index, stacks, shared = _device_index(dev), _stacks_of(dev), {} if shared is None else shared
    return [{"device": index, "address": seg["address"], "total_size": seg["total_size"],
             "allocated_size": seg["allocated_size"], "active_size": seg["active_size"],
             "requested_size": seg["requested_size"], "stream": 0, "segment_type": seg["segment_type"],
             "segment_pool_id": (0, 0), "is_expandable": seg["expandable"],
             "frames": _frames(seg["what"], seg["context"], stacks, shared), "blocks": seg["blocks"]}
            for seg in blocks_with_frames(dev, raw, shared)]


def _device_index(dev: str) -> int:
    return 0 if dev == "cpu" else int(dev.partition(":")[2])


def _entry(e: Tuple[str, int, int, int, Optional[str], int, int], stacks: str, shared: _Shared) -> Dict[str, Any]:
    action, addr, size, time_us, what, context, device_free = e
    out: Dict[str, Any] = {"action": action}
    if action != "oom":
        out["addr"] = addr
    out.update(size=size, stream=0, time_us=time_us, frames=_frames(what, context, stacks, shared))
    if action == "oom":
        out["device_free"] = device_free
    return out


def allocator_settings() -> Dict[str, Any]:
    """The settings in force as a PyTorch snapshot lists them: the text they were read from
    (under "PYTORCH_CUDA_ALLOC_CONF", as torch names it, whatever gave it), max_split_size in
    bytes (-1: none), the flags and roundup_power2_divisions by each interval's first MiB ("1",
    "2", "4", ...)."""
    c = _cmlp.get_settings()
    return {"PYTORCH_CUDA_ALLOC_CONF": c["text"], "max_split_size": c["max_split_size"],
            "garbage_collection_threshold": c["garbage_collection_threshold"],
            "expandable_segments": c["expandable_segments"],
            "pinned_num_register_threads": c["pinned_num_register_threads"],
            "release_lock_on_cudamalloc": c["release_lock_on_cudamalloc"],
            "pinned_use_cuda_host_register": c["pinned_use_host_register"],
            "graph_capture_record_stream_reuse": c["graph_capture_record_stream_reuse"],
            "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(c["roundup_power2_divisions"])}}


def snapshot(device: Optional[Device] = None, augment_with_fx_traces: bool = False) -> Dict[str, Any]:
    """torch.cuda.memory._snapshot(): {"segments": [...], "device_traces": [[...], ...],
    "allocator_settings": {...}, "external_annotations": []}, the segments and the history taken
    at one instant, with the allocator's settings. Segments carry PyTorch's keys (device as an
    index, stream, segment_type, is_expandable, blocks with frames); device_traces has one list per
    device index up to this device's, the others empty. On "cpu" the index is 0. Entries and
    blocks with the same frames share one list of them. augment_with_fx_traces is checked and
    changes nothing (cmlp has no torch.fx graphs)."""
    from ._args import _device

    _cpp_bool("augment_with_fx_traces", augment_with_fx_traces)
    dev = _device(device)
    with _lock:
        raw, history = _cmlp.snapshot_history(dev)
        stacks = _stacks_of(dev)
        shared: _Shared = {}
        index = _device_index(dev)
        segments = torch_segments(dev, raw, shared)
        trace = [_entry(e, stacks, shared) for e in history]
    return {"segments": segments, "device_traces": [[] for _ in range(index)] + [trace],
            "allocator_settings": allocator_settings(), "external_annotations": []}


def dump_snapshot(filename: "os.PathLike[str] | str" = "dump_snapshot.pickle", augment_with_fx_traces: bool = False,
                  *, device: Optional[Device] = None) -> None:
    """torch.cuda.memory._dump_snapshot(): the snapshot, pickled (protocol 4, which PyTorch's
    viewer reads) into filename, atomically; device (by keyword: torch's arguments come first)
    as _snapshot's."""
    data = snapshot(device, augment_with_fx_traces)
    atomic_write(filename, lambda f: pickle.dump(data, f, protocol=4))
