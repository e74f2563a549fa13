"""torch.distributed's gathering collectives over cmlp's broadcast: all_gather (arrays), and
all_gather_object and broadcast_object_list (picklable objects, sent as their pickles). Each
rank's part goes to every rank in turn, one broadcast from each; a rank that cannot take part
(a wrong output list, an object pickle refuses) makes every rank raise before any is sent."""
import pickle
from typing import Any, List

import numpy as np

from .. import _cmlp


def _group() -> "tuple[int, int]":
    from . import get_rank, get_world_size

    return get_rank(), get_world_size()


def all_gather(tensor_list: List[np.ndarray], tensor: np.ndarray, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's array into tensor_list (one writable, C-contiguous array of the array's shape
    and dtype per rank, in rank order), on every rank, as torch.distributed.all_gather (group:
    None or group.WORLD; async_op=True gives a Work that has completed)."""
    from . import _check_args, _done, _good_args, _same_array_on_every_rank

    rank, size = _group()
    error = None if _good_args(group, async_op) else ValueError("")
    if not isinstance(tensor_list, list) or len(tensor_list) != size:
        error = ValueError(f"all_gather: tensor_list must be a list of {size} arrays (one per rank), got "
                           f"{type(tensor_list).__name__} of {len(tensor_list) if hasattr(tensor_list, '__len__') else '?'}")
    elif isinstance(tensor, np.ndarray):
        for i, out in enumerate(tensor_list):
            if not (isinstance(out, np.ndarray) and out.shape == tensor.shape and out.dtype == tensor.dtype
                    and out.flags.c_contiguous and out.flags.writeable and out.flags.aligned):
                error = ValueError(f"all_gather: tensor_list[{i}] must be a writable, aligned, C-contiguous array of "
                                   f"the array's shape {tensor.shape} and dtype {tensor.dtype}")
                break
    _same_array_on_every_rank("all_gather", tensor, 0 if error is None else 1)
    _check_args(group, async_op)
    if error is not None:  # (on every rank: the check above agreed on it)
        raise error
    if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous:
        raise ValueError("all_gather: the array must be a C-contiguous NumPy array")
    for src in range(size):
        if src == rank:
            tensor_list[src][...] = tensor
        _cmlp.dist_broadcast(tensor_list[src], src)
    return _done(async_op)


def _pickled(obj: Any) -> "tuple[bytes, Exception | None]":
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as e:  # noqa: BLE001 - raised on this rank, once every rank knows
        return b"", e


def broadcast_object_list(object_list: List[Any], src: int = 0, group: Any = None, device: Any = None) -> None:
    """Rank src's objects into every rank's object_list (in place, the same length on every
    rank), as torch.distributed.broadcast_object_list: pickled on src, unpickled elsewhere
    (group: None or group.WORLD; device, where torch stages the pickles, changes nothing)."""
    from . import _check_args, _one_group, _same_array_on_every_rank

    rank, size = _group()
    whole = not isinstance(src, bool) and isinstance(src, (int, np.integer)) and 0 <= src < size
    length = len(object_list) if isinstance(object_list, list) else -1
    _same_array_on_every_rank("broadcast_object_list", np.zeros(max(length, 0), np.uint8),
                              int(src) if whole and _one_group(group) and length >= 0 else -1)
    _check_args(group)
    if length < 0:
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    if not whole:
        raise ValueError(f"src must be a rank in [0, {size}), got {src!r}")
    data, error = _pickled(object_list) if rank == src else (b"", None)
    n = np.array([len(data) if error is None else -1], dtype=np.int64)
    _cmlp.dist_broadcast(n, int(src))
    if n[0] < 0:
        raise error if error is not None else RuntimeError(
            f"broadcast_object_list: rank {src} could not pickle its objects (its own error says why)")
    buf = np.frombuffer(data, dtype=np.uint8).copy() if rank == src else np.empty(int(n[0]), dtype=np.uint8)
    if buf.size:
        _cmlp.dist_broadcast(buf, int(src))
    if rank != src:
        object_list[:] = pickle.loads(buf.tobytes())


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    """Every rank's obj into object_list (a list of one entry per rank, filled in rank order),
    on every rank, as torch.distributed.all_gather_object: pickled, then unpickled (group: None
    or group.WORLD)."""
    from . import _check_args, _one_group, _same_array_on_every_rank

    rank, size = _group()
    good = isinstance(object_list, list) and len(object_list) == size
    _same_array_on_every_rank("all_gather_object", np.zeros(0, np.uint8), 0 if good and _one_group(group) else 1)
    _check_args(group)
    if not good:
        raise ValueError(f"all_gather_object: object_list must be a list of {size} entries (one per rank)")
    data, error = _pickled(obj)
    sizes = np.zeros(size, dtype=np.int64)
    sizes[rank] = len(data) if error is None else -1
    _cmlp.dist_all_reduce(sizes, 0)
    if (sizes < 0).any():
        if error is not None:
            raise error
        raise RuntimeError(f"all_gather_object: rank {int(np.flatnonzero(sizes < 0)[0])} could not pickle its "
                           "object (its own error says why)")
    received = []
    for src in range(size):  # every pickle first: a rank that cannot unpickle one leaves no other waiting
        buf = np.frombuffer(data, dtype=np.uint8).copy() if src == rank else np.empty(int(sizes[src]), np.uint8)
        if buf.size:
            _cmlp.dist_broadcast(buf, src)
        received.append(data if src == rank else buf.tobytes())
    for src in range(size):
        object_list[src] = pickle.loads(received[src])  # a copy of its own too, as torch's
