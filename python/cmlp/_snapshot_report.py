"""A memory snapshot in words: what held the memory at its peak, and what ran out of it.

Reads the dict _snapshot() returns, or a file _dump_snapshot() (or PyTorch's
torch.cuda.memory._dump_snapshot) wrote. The live blocks at the start of the history are found
by undoing it from the snapshot's blocks, so a history cut short by max_entries reads as well."""
import io
import itertools
import os
import pickle
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple, Union

Snapshot = Dict[str, Any]


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots hold dicts, lists, tuples, str, numbers: anything that names a class is refused
    (unpickling such a name could run code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a memory snapshot holds no objects of classes, but this file names "
                                     f"{module}.{name}")


def load(source: Union[Snapshot, "os.PathLike[str]", str]) -> Snapshot:
    if isinstance(source, dict):
        data = source
    else:
        with open(os.fsdecode(source), "rb") as f:
            try:
                data = _PlainUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError, AttributeError, TypeError,
                    OverflowError, MemoryError, RecursionError) as e:  # a malformed or hostile stream
                raise ValueError(f"{os.fsdecode(source)!r} is not a memory snapshot: {type(e).__name__}: {e}") \
                    from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list) or \
            not isinstance(data.get("device_traces"), list):
        raise ValueError("a memory snapshot is a dict with lists under 'segments' and 'device_traces'")
    # a pickle can name one object many times over (a few KB of file, 10**8 blocks to go through)
    blocks = sum(len(s["blocks"]) for s in data["segments"] if isinstance(s, dict) and isinstance(s.get("blocks"), list))
    entries = sum(len(t) for t in data["device_traces"] if isinstance(t, list))
    if max(blocks + len(data["segments"]), entries) > _MOST_ITEMS:
        raise ValueError(f"the snapshot holds {len(data['segments'])} segments of {blocks} blocks and {entries} history "
                         f"entries, more than {_MOST_ITEMS} of either: not one an allocator's history makes")
    return data


_MOST_ITEMS = 1 << 24  # blocks (with their segments), and history entries, of a snapshot read


def _fmt(n: float) -> str:
    v, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB"]
    u = 0
    while u < 4 and abs(v) >= 1024.0:
        v, u = v / 1024.0, u + 1
    return f"{v:.2f} {units[u]}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _where(frame: Dict[str, Any]) -> str:
    return f"{os.path.basename(str(frame.get('filename', '?')))}:{frame.get('line', 0)}:{frame.get('name', '?')}"


def _holder(frames: List[Dict[str, Any]]) -> str:
    """What a block holds: cmlp's own first frame, else the innermost frame (PyTorch's snapshots)."""
    if not frames:
        return "(no stack recorded)"
    first = frames[0]
    return str(first.get("name")) if first.get("filename") == "cmlp" else _where(first)


def _python_frames(frames: List[Dict[str, Any]], depth: int) -> List[str]:
    return [_where(f) for f in itertools.islice((f for f in frames if f.get("filename") != "cmlp"), depth)]


Block = Tuple[int, List[Dict[str, Any]]]  # bytes requested, frames
LIVE = ("active_allocated", "active_pending_free")  # allocated until the free completes
BEFORE = {"filename": "(history)", "line": 0, "name": "allocated before the history began"}
_NO_FRAMES: List[Dict[str, Any]] = []


def _release(trace: List[Dict[str, Any]]) -> str:
    """The action that ends a block: free_completed, or free_requested where the history kept no
    completions (skip_actions)."""
    return "free_completed" if any(e.get("action") == "free_completed" for e in trace) else "free_requested"


def _replay(segments: List[Dict[str, Any]], trace: List[Dict[str, Any]]) -> Tuple[Dict[int, Block], int, int]:
    """The live blocks before the history's first entry, and where (entry index, -1: before the
    first) and how high the allocated bytes peaked. A block found live at the start by undoing a
    free keeps only what it holds (cmlp's frame): the free's stack did not allocate it."""
    live: Dict[int, Block] = {}
    for seg in segments:
        for b in seg.get("blocks", []):
            if b.get("state") in LIVE:
                live[b["address"]] = (b.get("requested_size", b.get("size", 0)), b.get("frames", []))
    release = _release(trace)
    owns: Dict[int, List[Dict[str, Any]]] = {}  # by the frames list: entries share them (a pickle, any number of times)
    for e in reversed(trace):
        if e.get("action") == "alloc":
            live.pop(e.get("addr"), None)
        elif e.get("action") == release:
            frames = e.get("frames", _NO_FRAMES)  # (one object: its id is its own)
            own = owns.get(id(frames))
            if own is None:
                own = owns[id(frames)] = [f for f in frames if f.get("filename") == "cmlp"] + [BEFORE]
            live[e["addr"]] = (e.get("size", 0), own)
    start = dict(live)
    total = peak = sum(size for size, _ in live.values())
    peak_at = -1
    for i, e in enumerate(trace):
        act = e.get("action")
        if act == "alloc":
            total += e.get("size", 0) - (live[e["addr"]][0] if e["addr"] in live else 0)
            live[e["addr"]] = (e.get("size", 0), e.get("frames", []))
        elif act == release and e.get("addr") in live:
            total -= live.pop(e["addr"])[0]
        if total > peak:
            peak, peak_at = total, i
    return start, peak_at, peak


def _live_at(start: Dict[int, Block], trace: List[Dict[str, Any]], at: int) -> Dict[int, Block]:
    live: Dict[Any, Block] = dict(start)  # (an entry without an address pops None: nothing)
    release = _release(trace)
    for e in trace[:at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = (e.get("size", 0), e.get("frames", []))
        elif e.get("action") == release:
            live.pop(e.get("addr"), None)
    return live


def _held_lines(live: Dict[int, Block], top: int, out: io.StringIO) -> None:
    if not live:
        out.write("    nothing\n")
        return
    groups: Dict[str, List[int]] = {}
    for size, frames in live.values():
        groups.setdefault(_holder(frames), []).append(size)
    for what, sizes in sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0])):
        out.write(f"    {_fmt(sum(sizes)):>12}  {what}  ({_count(len(sizes), 'block')})\n")
    biggest = sorted(live.values(), key=lambda b: -b[0])[:top]
    if biggest and any(_python_frames(f, 1) for _, f in biggest):
        out.write(f"  the largest {len(biggest)} blocks and the calls that made them:\n")
        for size, frames in biggest:
            calls = " <- ".join(_python_frames(frames, 3)) or "(no Python stack recorded)"
            out.write(f"    {_fmt(size):>12}  {_holder(frames)}: {calls}\n")


def report(source: Union[Snapshot, "os.PathLike[str]", str], device: Optional[int] = None, top: int = 5) -> str:
    """The snapshot's device (by default the one with the longest history): its segments and
    blocks now; over the history, the peak of allocated bytes, what held them then (grouped by
    what each block holds) and the largest blocks with the calls that made them; every request
    that ran out of memory, with what it was for, what was free and its calls."""
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise ValueError(f"device must be a device index >= 0, got {device!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an int >= 0, got {top!r}")
    data = load(source)
    try:
        return _report(data, device, top)
    except LookupError as e:
        if type(e) is not LookupError:  # KeyError, IndexError: a malformed snapshot
            raise ValueError(f"not a well-formed memory snapshot: {type(e).__name__}: {e}") from None
        raise ValueError(str(e)) from None
    except (AttributeError, KeyError, TypeError, IndexError, ValueError, OverflowError, RecursionError) as e:
        raise ValueError(f"not a well-formed memory snapshot: {type(e).__name__}: {e}") from None


def _report(data: Snapshot, device: Optional[int], top: int) -> str:
    traces = data["device_traces"]
    devices = sorted({s.get("device", 0) for s in data["segments"]} | {i for i, t in enumerate(traces) if t})
    devices = [d for d in devices if isinstance(d, int) and d >= 0]
    if device is None:
        device = max(devices, key=lambda d: (len(traces[d]) if d < len(traces) else 0, -d), default=0)
    elif device not in devices and device >= len(traces):
        known = sorted(set(devices) | set(range(len(traces))))
        has = f"devices {', '.join(map(str, known))}" if known else "no device"
        raise LookupError(f"the snapshot has no device {device}: it has {has}")
    segments = [s for s in data["segments"] if s.get("device", 0) == device]
    trace = traces[device] if device < len(traces) else []
    out = io.StringIO()
    reserved = sum(s.get("total_size", 0) for s in segments)
    blocks = [b for s in segments for b in s.get("blocks", []) if b.get("state") in LIVE]
    out.write(f"device {device}: {_count(len(segments), 'segment')}, {_fmt(reserved)} reserved; "
              f"{_count(len(blocks), 'block')}, "
              f"{_fmt(sum(b.get('requested_size', b.get('size', 0)) for b in blocks))} allocated (requested)\n")
    now = {b["address"]: (b.get("requested_size", b.get("size", 0)), b.get("frames", [])) for b in blocks}
    if len(now) < len(blocks):  # what the header counts and what the held lines group must be the same blocks
        twice = next(a for a, n in Counter(b["address"] for b in blocks).items() if n > 1)
        where = f"{twice:#x}" if isinstance(twice, int) else repr(twice)
        raise LookupError(f"not a well-formed memory snapshot: device {device} has two live blocks at address {where}")
    if not trace:
        out.write("no history (record it with cmlp.memory._record_memory_history()); what is allocated holds:\n")
        _held_lines(now, top, out)
        return out.getvalue()
    times = [e["time_us"] for e in trace if isinstance(e.get("time_us"), (int, float))]
    t0 = times[0] if times else None
    span = f" over {(times[-1] - times[0]) / 1e6:.3f} s" if len(times) > 1 else ""
    out.write(f"history: {len(trace)} entries{span}\n")

    def when(e: Dict[str, Any]) -> str:
        t = e.get("time_us")
        return f", {(t - t0) / 1e6:.3f} s in" if t0 is not None and isinstance(t, (int, float)) else ""

    start, peak_at, peak = _replay(segments, trace)
    at = "before its first entry" if peak_at < 0 else f"at entry {peak_at}{when(trace[peak_at])}"
    out.write(f"peak allocated (requested bytes) over the history: {_fmt(peak)} {at}; it held:\n")
    _held_lines(_live_at(start, trace, peak_at), top, out)
    ooms = [(i, e) for i, e in enumerate(trace) if e.get("action") == "oom"]
    if ooms:
        out.write(f"out of memory: {_count(len(ooms), 'request')} failed\n")
        for i, e in ooms[:top]:  # as many as the blocks shown (top=0: the count alone)
            frames = e.get("frames", [])
            free = f"; {_fmt(e['device_free'])} was free on the device" if "device_free" in e else ""
            out.write(f"    entry {i}{when(e)}: {_fmt(e.get('size', 0))} for {_holder(frames)}{free}\n")
            for call in _python_frames(frames, 4):
                out.write(f"        {call}\n")
        if top and len(ooms) > top:
            out.write(f"    ... and {len(ooms) - top} more\n")
    else:
        out.write("no request ran out of memory in the history\n")
    return out.getvalue()
