"""cmlp.distributed: data parallelism over MPI and NCCL, with torch.distributed's names.

Start one process per rank with mpirun (or any launcher that sets the MPI environment)::

    mpirun -np 4 python train.py

and in train.py::

    import cmlp
    cmlp.distributed.init_process_group("mpi")
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    trainer = cmlp.Trainer(model, cmlp.optim.Adam(model), batch_size=32)   # data-parallel now
    history = trainer.fit(x, y, epochs=5)    # every rank passes the same data set

A Trainer made while the group exists is data-parallel (as a model wrapped in PyTorch's
DistributedDataParallel and fed by a DistributedSampler): it starts every rank from rank 0's
parameters, batch_size is per rank, each optimizer step takes batch_size * accumulation_steps *
world_size samples of the epoch's order (the same shuffle on every rank), each rank computes the
gradients of its own share, and the gradients are summed over the ranks with one all-reduce of
the flat gradient buffer before the update, every sample weighted by 1 / (samples in the step).
The update therefore equals that of one process training on all the step's samples, up to
summation order, and the ranks' parameters stay identical. Under fp16 loss scaling every rank
checks the summed gradients, so all ranks skip the same steps. Out of memory on one rank is
handled there (automatic micro-batching) before the ranks agree on the step; a rank that cannot
compute its share makes every rank raise for that step instead of hanging.

Collectives (`all_reduce`, `broadcast`, `barrier`, `all_gather`, `all_gather_object`,
`broadcast_object_list`, and every call of a data-parallel Trainer,
its construction included) must be made by every rank in the same order, as MPI requires, and
from one thread at a time per process. A Trainer for one rank alone takes distributed=False. An
exception that nothing catches on one rank ends the whole job (MPI_Abort, after its traceback),
as the other ranks would otherwise wait for that rank forever.

Backends: "mpi" sums the gradients of models on the CPU with MPI_Allreduce; "nccl" also trains
models on CUDA devices, one GPU per rank (e.g. device=f"cuda:{get_local_rank()}"), summing their
gradients with NCCL on the device's stream (inside the captured training step), its id sent over
MPI. NCCL is loaded when first used: $CMLP_NCCL_LIBRARY, else the nvidia-nccl wheel's library
where one is installed (PyTorch brings one), else libnccl.so.2 from the library path.

optim.ZeroRedundancyOptimizer shards the optimizer's state over the ranks (ZeRO stage 1).
"""
import atexit
import ctypes
import datetime
import glob
import os
import sys
import zlib
from typing import Any, Optional

import numpy as np

from .. import _cmlp

__all__ = ["ReduceOp", "group", "GroupMember",
           "is_available", "is_mpi_available", "is_nccl_available", "init_process_group",
           "is_initialized", "get_rank", "get_world_size", "get_backend", "all_reduce", "broadcast", "barrier",
           "destroy_process_group", "library_version", "get_local_rank", "get_local_world_size", "optim",
           "all_gather", "all_gather_object", "broadcast_object_list"]

BACKENDS = {"mpi": 0, "nccl": 1}


class ReduceOp:
    """Reductions of all_reduce (torch.distributed.ReduceOp's names): AVG of floating-point
    arrays (each rank's part divided by the number of ranks, then summed, as NCCL's), the
    bitwise ones of int64."""
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MAX = "max"
    MIN = "min"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


_OPS = {ReduceOp.SUM: 0, ReduceOp.MAX: 1, ReduceOp.MIN: 2, ReduceOp.PRODUCT: 3, ReduceOp.BAND: 4, ReduceOp.BOR: 5,
        ReduceOp.BXOR: 6, ReduceOp.AVG: 7}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


class _World:
    def __repr__(self) -> str:
        return "cmlp.distributed.group.WORLD"


class group:  # noqa: N801 - torch.distributed.group's name
    """torch.distributed.group: WORLD, the one process group cmlp makes (which group=None, the
    default of every call that takes a group, names too)."""
    WORLD = _World()


GroupMember = group


def _one_group(group_: Any) -> bool:
    return group_ is None or group_ is group.WORLD


def _check_args(group_: Any, async_op: bool = False) -> None:
    """Refuses a group other than the one cmlp makes and an async_op that is not a bool."""
    if not _one_group(group_):
        raise ValueError(f"cmlp has one process group, the default: group must be None or group.WORLD, got "
                         f"{group_!r}")
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool, got {async_op!r}")


def _good_args(group_: Any, async_op: Any) -> bool:
    return _one_group(group_) and isinstance(async_op, bool)


class _Work:
    """What a collective called with async_op=True gives (torch's Work): cmlp's collectives have
    ended when the call returns, so it is complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None


def _done(async_op: bool) -> Optional[_Work]:
    return _Work() if async_op else None


class _GroupTwice(ValueError, RuntimeError):
    """init_process_group while the group exists: torch's ValueError, and the RuntimeError
    cmlp raised before, so that code written for either catches it."""
_finalize_registered = False
_previous_excepthook = None


def _abort_on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
    """An uncaught exception on one rank ends the job: the others would wait for it forever."""
    assert _previous_excepthook is not None
    _previous_excepthook(exc_type, exc, tb)
    state = _cmlp.dist_state()
    if state[0] and state[2] > 1 and not state[6]:  # a child forked from a rank ends alone
        sys.stderr.write(f"cmlp.distributed: rank {state[1]} ends the job of {state[2]} ranks (MPI_Abort): an "
                         "exception nothing caught, which the other ranks would wait for\n")
        sys.stderr.flush()
        _cmlp.dist_abort(1)


def _mpi_module_present() -> bool:
    path = os.environ.get("CMLP_MPI_LIBRARY") or os.path.join(os.path.dirname(_cmlp.__file__), "_cmlp_mpi.so")
    return os.path.exists(path)


def is_available() -> bool:
    """True when this build of cmlp has a communication backend (its MPI module)."""
    return _mpi_module_present()


def is_mpi_available() -> bool:
    return _mpi_module_present()


def _nccl_library() -> Optional[str]:
    """Where NCCL is: $CMLP_NCCL_LIBRARY, an nvidia-nccl wheel's (nvidia/nccl/lib, or another
    folder of nvidia/ in a later layout), or libnccl.so.2 by name."""
    env = os.environ.get("CMLP_NCCL_LIBRARY")
    if env:
        return env
    for base in sys.path:
        path = os.path.join(base or ".", "nvidia", "nccl", "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    for base in sys.path:
        found = sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib", "libnccl.so.2")))
        if found:
            return found[0]
    return "libnccl.so.2"


# The first NCCL that runs collectives a CUDA graph captured (the training step) beside ones it did
# not on one communicator (the C backend's NCCL_MIN_VERSION).
_NCCL_MIN_VERSION = 21300  # 2.13.0, NCCL's code: major * 10000 + minor * 100 + patch


def is_nccl_available() -> bool:
    """True when this build has the CUDA backend and an NCCL it can use (2.13 or later) can be
    loaded (with no MPI module, for a group of one)."""
    if not _cmlp.build_info()["cuda_compiled"]:
        return False
    try:
        lib = ctypes.CDLL(_nccl_library())
        version = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(version)) != 0:
            return False
    except (OSError, AttributeError):  # no library, or one without ncclGetVersion
        return False
    return version.value >= _NCCL_MIN_VERSION


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, device_id: Any = None) -> None:
    """Makes the process group: MPI_COMM_WORLD of the job mpirun started (MPI is initialised
    here unless something else did it first, and then finalised at exit). backend: "mpi" (the
    default: models on the CPU) or "nccl" (models on CUDA devices too). Torch's other arguments:
    the launcher gives the ranks, so init_method is None or "env://", and world_size and rank,
    where given, must be the launcher's; timeout (a datetime.timedelta), as torch's, bounds how
    long a collective waits for the other ranks, MPI's on the host and NCCL's on a GPU (watched
    from when it is queued): past it, the job ends (MPI_Abort), as when a rank ended (sys.exit)
    while the others wait for it. Without it, they wait as long as it
    takes (a rank that ended while the group is there says so on stderr after 10 s). device_id
    (torch's: the GPU this rank binds to, an index, "cuda:N" or a torch.device) is checked and
    changes nothing: a rank's NCCL communicator is made for the device of the model it trains."""
    global _finalize_registered
    if backend is None:
        backend = "mpi"
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    backend = backend.lower()
    if init_method not in (None, "env://"):
        raise ValueError(f"cmlp's ranks are the MPI launcher's (mpirun): init_method must be None or 'env://', got "
                         f"{init_method!r}")
    seconds = _timeout_seconds(timeout)
    check = _debug_level() == "DETAIL"
    device_ok = device_id is None
    if device_id is not None:  # (each rank's own GPU: refused on every rank, once the group is made)
        text = device_id if isinstance(device_id, str) else \
            f"cuda:{device_id}" if isinstance(device_id, (int, np.integer)) and not isinstance(device_id, bool) else \
            f"{getattr(device_id, 'type', '')}:{getattr(device_id, 'index', '')}"
        kind, _, index = text.partition(":")
        device_ok = kind == "cuda" and index.isdigit() and index.isascii()
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < -1:
            raise ValueError(f"{name} must be an int >= 0 (the launcher's), or -1, got {value!r}")
    if _cmlp.dist_state()[6]:  # forked from a rank: the core says why this process cannot
        _cmlp.dist_init(BACKENDS[backend])
    if is_initialized():
        raise _GroupTwice("trying to initialize the default process group twice!")
    if backend == "nccl":
        if not _cmlp.build_info()["cuda_compiled"]:
            raise RuntimeError("backend 'nccl' needs cmlp's CUDA backend, and this build has none")
        try:  # as torch's, which refuses it without a GPU
            _cmlp.parse_device("cuda")
        except RuntimeError as e:
            raise RuntimeError(f"backend 'nccl' sums gradients on GPUs, and there is none here: {e} (backend "
                               "'mpi' trains models on the CPU)") from None
        if not os.environ.get("CMLP_NCCL_LIBRARY"):
            os.environ["CMLP_NCCL_LIBRARY"] = _nccl_library() or "libnccl.so.2"
            try:  # NCCL is loaded when a device first joins the group: the variable stays set
                _cmlp.dist_init(BACKENDS[backend])
            except BaseException:  # a failed call leaves the environment as it was
                del os.environ["CMLP_NCCL_LIBRARY"]
                raise
        else:
            _cmlp.dist_init(BACKENDS[backend])
    else:
        _cmlp.dist_init(BACKENDS[backend])
    global _previous_excepthook
    if not _finalize_registered:
        atexit.register(_cmlp.dist_finalize)
        _finalize_registered = True
        _previous_excepthook = sys.excepthook
        sys.excepthook = _abort_on_uncaught
    _cmlp.dist_set_timeout(seconds)
    _cmlp.dist_set_check(check)
    # the launcher's ranks, or every rank refuses (one alone would leave the others in the group)
    state = _cmlp.dist_state()
    wrong = [f"{name}={value}" for name, value, mine in (("world_size", world_size, state[2]), ("rank", rank, state[1]))
             if value != -1 and value != mine]
    anyone = np.array([len(wrong) + (not device_ok)], dtype=np.int64)
    _cmlp.dist_all_reduce(anyone, 1)
    if anyone[0]:
        _cmlp.dist_set_timeout(0.0)
        _cmlp.dist_destroy()
        if wrong:
            raise ValueError(f"{', '.join(wrong)}, but the launcher made this process rank {state[1]} of {state[2]}: "
                             "cmlp's ranks are the launcher's")
        if not device_ok:
            raise ValueError(f"device_id must name one GPU (an index, 'cuda:N' or a torch.device), got "
                             f"{device_id!r}")
        raise ValueError("another rank was given a world_size, rank or device_id it cannot take, so no rank made "
                         "the group (cmlp's ranks are the launcher's)")


def _debug_level() -> str:
    """TORCH_DISTRIBUTED_DEBUG (CMLP_DISTRIBUTED_DEBUG first, where set), as torch reads it: OFF
    (the default), INFO or DETAIL, where every collective first checks that the ranks make the
    same call (the kind, the size, the element type and the reduction, parts or root), so that
    ranks whose calls differ raise an error naming it instead of pairing them."""
    for name in ("CMLP_DISTRIBUTED_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        value = os.environ.get(name)
        if value:
            if value not in ("OFF", "INFO", "DETAIL"):
                raise ValueError(f"{name} must be OFF, INFO or DETAIL, got {value!r}")
            return value
    return "OFF"


def is_initialized() -> bool:
    return _cmlp.dist_state()[0]


def _require() -> None:
    if not is_initialized():
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "cmlp.distributed.init_process_group()")


def get_rank(group: Any = None) -> int:
    _check_args(group)
    _require()
    return _cmlp.dist_state()[1]


def get_world_size(group: Any = None) -> int:
    _check_args(group)
    _require()
    return _cmlp.dist_state()[2]


def get_backend(group: Any = None) -> str:
    _check_args(group)
    _require()
    return "nccl" if _cmlp.dist_state()[5] == BACKENDS["nccl"] else "mpi"


def get_local_rank() -> int:
    """This rank's place among the ranks on its machine (which GPU it takes)."""
    _require()
    return _cmlp.dist_state()[3]


def get_local_world_size() -> int:
    _require()
    return _cmlp.dist_state()[4]


def library_version() -> str:
    """The MPI library in use (empty before init_process_group)."""
    return _cmlp.dist_library_version()


def all_reduce(tensor: np.ndarray, op: str = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Optional[_Work]:
    """Reduces a float32, float64 or int64 array over all ranks, in place (the array must be
    writable and C-contiguous, with the same shape on every rank: checked first, collectively).
    group: None (or group.WORLD); async_op=True gives a Work that has completed."""
    _require()
    code = _OPS.get(op, -1) if isinstance(op, str) and _good_args(group, async_op) else -1
    _same_array_on_every_rank("all_reduce", tensor, code)
    _check_args(group, async_op)  # (refusals after the ranks agreed on the arguments: on every rank)
    if code < 0:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    floating = isinstance(tensor, np.ndarray) and tensor.dtype.kind == "f"  # (not an array: refused below)
    if op in _BITWISE and floating:  # (the dtype is every rank's: all raise)
        raise TypeError(f"all_reduce: {op} is a bitwise reduction, of int64 arrays, got {tensor.dtype}")
    if op == ReduceOp.AVG and isinstance(tensor, np.ndarray) and not floating:
        raise TypeError(f"all_reduce: avg takes float32 or float64 arrays, got {tensor.dtype} (of integers: use "
                        "sum, and divide as it should round)")
    if op == ReduceOp.AVG:  # each rank's part scaled first, then summed: as NCCL's, no overflow on the way
        part = tensor * tensor.dtype.type(1.0 / get_world_size())
        _cmlp.dist_all_reduce(part, 0)
        tensor[...] = part
    else:
        _cmlp.dist_all_reduce(tensor, code)
    return _done(async_op)


def broadcast(tensor: np.ndarray, src: int = 0, group: Any = None, async_op: bool = False) -> Optional[_Work]:
    """Copies rank src's array into every rank's (in place; same shape and dtype everywhere:
    checked first, collectively). group: None (or group.WORLD); async_op=True gives a Work
    that has completed."""
    _require()
    whole = not isinstance(src, bool) and isinstance(src, (int, np.integer))
    _same_array_on_every_rank("broadcast", tensor,
                              int(src) if whole and -2**62 < src < 2**62 and _good_args(group, async_op) else -1)
    _check_args(group, async_op)
    if not whole:
        raise TypeError(f"src must be an int, got {src!r}")
    if not 0 <= src < get_world_size():
        raise ValueError(f"src must be a rank in [0, {get_world_size()}), got {src}")
    _cmlp.dist_broadcast(tensor, int(src))
    return _done(async_op)


_ARRAY_FIELDS = ("being an array", "dtype", "element count", "shape", "C-contiguity", "writability",
                 "other arguments (op, src, an output list)", "alignment", "call (all_reduce, broadcast, ...)")


def _where_ranks_differ(values: np.ndarray) -> np.ndarray:
    """The indices where the ranks' int64 values differ (a collective: one all-reduce of the
    values' largest and, through ~, smallest on any rank)."""
    both = np.concatenate([values, ~values])
    _cmlp.dist_all_reduce(both, 1)
    return np.flatnonzero(both[:values.size] != ~both[values.size:])


def _same_array_on_every_rank(what: str, tensor: Any, code: int) -> None:
    """A collective's arguments, the same on every rank (a collective): an array of other sizes
    would pair the wrong elements (one rank's MPI error, another's garbage), and a refusal on
    one rank alone would leave the others waiting in it. Every rank raises where they differ."""
    is_array = isinstance(tensor, np.ndarray)
    # (a structured dtype by its fields: two of one size have the same str)
    dtype = zlib.crc32((tensor.dtype.str + repr(tensor.dtype.descr)).encode()) if is_array else 0
    shape = zlib.crc32(repr(tensor.shape).encode()) if is_array else 0
    flags = tensor.flags if is_array else None
    v = np.array([is_array, dtype, tensor.size if is_array else 0, shape, bool(flags and flags.c_contiguous),
                  bool(flags and flags.writeable), code, bool(flags and flags.aligned), zlib.crc32(what.encode())],
                 dtype=np.int64)
    differ = [_ARRAY_FIELDS[i] for i in _where_ranks_differ(v)]
    if differ:
        raise ValueError(f"{what}: the ranks' arguments differ in their {', '.join(differ)}: every rank must give "
                         "alike arguments (arrays of the same shape and dtype, the same op or src)")


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Optional[_Work]:
    """Waits for every rank. group: None (or group.WORLD); device_ids (torch's, for NCCL: the
    GPUs this rank uses) is checked and changes nothing. The barrier is the ranks' word on their
    arguments (an all-reduce, on the host): a rank that refused alone would leave the others
    waiting in it."""
    _require()
    ids_ok = device_ids is None or (isinstance(device_ids, (list, tuple)) and all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in device_ids))
    _same_array_on_every_rank("barrier", None, 0 if _good_args(group, async_op) and ids_ok else 1)
    _check_args(group, async_op)
    if not ids_ok:
        raise TypeError(f"device_ids must be None or a list of GPU indices, got {device_ids!r}")
    return _done(async_op)


from ._gather import all_gather, all_gather_object, broadcast_object_list  # noqa: E402 (they use the above)


def _timeout_seconds(timeout: Any) -> float:
    """init_process_group's timeout (a datetime.timedelta, as torch's) in seconds; 0 for None."""
    if timeout is None:
        return 0.0
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    seconds = timeout.total_seconds()
    if not seconds > 0:
        raise ValueError(f"timeout must be longer than 0, got {timeout!r}")
    return seconds


def destroy_process_group(group: Any = None) -> None:
    """Ends the process group and its NCCL communicators (MPI stays initialised until the
    process exits). No data-parallel call may be running in another thread; a Trainer that
    outlives the group joins the next one (made with init_process_group) when it next trains.
    group: None (or group.WORLD)."""
    _check_args(group)
    _require()
    _cmlp.dist_destroy()


from . import optim  # noqa: E402 (it needs the functions above)
