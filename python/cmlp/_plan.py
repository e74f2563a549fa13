"""The planner: what a training run will hold on a device, predicted before it runs by replaying
its requests on an allocator with the device's rules (cmlp.memory.plan, max_batch_size)."""
import re
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _cmlp
from ._args import Device, _device, _device_text, _fmt, _numpy_int, parse_size

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


_CATEGORIES = ("parameters", "gradients", "optimizer_state", "half_weights", "activations", "workspace", "data",
               "evaluation")


class Plan:
    """What a training run will hold. breakdown: requested bytes per category; peak_bytes: what the
    run adds to max_memory_allocated (allocator rounding included); reserved_bytes: what it adds
    to max_memory_reserved, from an empty cache. Both are on top of what a device holds from the
    moment it opens (on CUDA, the GEMM workspace: 10 MiB, 34 MiB on compute capability 9.x to
    12.x), whose place the plan takes into account."""

    def __init__(self, layer_sizes: Iterable[int], batch_size: int, optimizer: str, amp: Optional[str],
                 recompute: bool, device: Device, raw: Dict[str, Any], optimizer_shards: int = 1,
                 described: Optional[Tuple[int, int]] = None) -> None:
        self.layer_sizes, self.batch_size, self.optimizer = list(layer_sizes), batch_size, optimizer
        self._described = described  # (major, total memory) of a GPU planned for without it
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
        if self._described:
            major, total = self._described
            head += f" (described: compute capability {major}.x{f', {_fmt(total)}' if total else ''})"
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
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or \
            not 1 <= accumulation_steps <= 2**62:  # (as the Trainer's)
        raise ValueError(f"accumulation_steps must be an int in [1, 2**62], got {accumulation_steps!r}")
    return accumulation_steps


def plan(layer_sizes: Iterable[int], batch_size: int = 32, optimizer: Any = "adam", amp: Optional[str] = None,
         recompute: bool = False, device: Device = "cpu", scaler: Optional[bool] = None,
         accumulation_steps: int = 1, optimizer_shards: Optional[int] = None, validation_rows: int = 0,
         validation_dtype: str = "uint8", data_rows: int = 0, data_dtype: "DTypeLike" = "uint8", shuffle: bool = True,
         epochs: int = 5, device_properties: Any = None, _budget: int = 0) -> Plan:
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
    they may come to under a schedule: plan such an optimizer after its groups have parted).
    device_properties: the GPU to plan for where it is not here (or another than the one that is),
    with device "cuda": cmlp.cuda.get_device_properties(...)'s or torch's, or a dict, of which
    "major" (the compute capability's, which sizes the GEMM workspace a device holds from the
    moment it opens) and "total_memory" (bytes or a size such as "80GB"; 0 or absent: no bound)
    are read; it is taken to have the driver's virtual memory API, as data-center GPUs have.
    _budget (bytes, 0: none): the validation runs under a memory limit of that much on top of
    what the device holds once open, as a fit's under it does (see max_batch_size)."""
    from .model import _as_sizes

    sizes = _as_sizes(layer_sizes)
    batch_size = _numpy_int(batch_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size < 2**63:
        raise ValueError(f"batch_size must be an int in [1, 2**63), got {batch_size!r}")
    name, _ = _optimizer_buffers(optimizer)
    dev, gpu = _planned_device(device, device_properties)
    args = _plan_args(optimizer, amp, recompute, scaler, accumulation_steps, optimizer_shards)
    data = _data_args(data_rows, data_dtype, shuffle, sizes[0])
    if 0 < data[0] <= batch_size:  # each step is the whole data set, in one micro-batch
        batch_size = data[0]
        args = _plan_args(optimizer, amp, recompute, scaler, 1, optimizer_shards)
    evaluation = _evaluation_args(validation_rows, validation_dtype, dev, epochs)
    raw = _cmlp.plan(list(sizes), batch_size, *args, *data, *evaluation, _budget, dev, gpu)
    return Plan(list(sizes), batch_size, name, amp, recompute, dev, raw, args[1], gpu)


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


def _planned_device(device: Any, properties: Any) -> Tuple[str, Optional[Tuple[int, int]]]:
    """The device a plan is for and, where properties describe the GPU (see plan), its compute
    capability's major and its memory in bytes (0: no bound); else None: the device is opened."""
    if properties is None:
        try:
            return _device(device), None
        except RuntimeError as e:
            raise RuntimeError(f"{e} (to plan for a GPU that is not here, describe it: device_properties="
                               "{'major': 9, 'total_memory': '80GB'})") from None
    text = _device_text(device)
    match = re.fullmatch(r"cuda(?::(\d{1,2}))?", text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"device_properties describe a GPU: device must be 'cuda' or 'cuda:N', got {device!r}")
    if isinstance(properties, Mapping):
        major, total = properties.get("major"), properties.get("total_memory")
    else:
        major, total = getattr(properties, "major", None), getattr(properties, "total_memory", None)
    major = _numpy_int(major)
    if isinstance(major, bool) or not isinstance(major, int) or not 1 <= major <= 99:
        raise ValueError(f"device_properties' major (the compute capability's, such as 9 for 9.0) must be an int "
                         f"from 1 to 99, got {major!r}")
    total = _numpy_int(0 if total is None else total)
    try:
        if isinstance(total, bool) or not isinstance(total, (int, str)):
            raise ValueError(f"expected a number of bytes or a size such as '80GB', got {total!r}")
        total = parse_size(total)
    except ValueError as e:
        raise ValueError(f"device_properties' total_memory: {e}") from None
    if not 0 <= total < 2**62:
        raise ValueError(f"device_properties' total_memory must be in [0, 2**62) bytes, got {total}")
    return f"cuda:{match.group(1) or 0}", (major, total)


def _evaluation_args(rows: Any, dtype: Any, device: Device, epochs: Any) -> Tuple[int, bool, int]:
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


def max_batch_size(layer_sizes: Iterable[int], budget_bytes: Union[int, float, str], optimizer: Any = "adam",
                   amp: Optional[str] = None, recompute: bool = False, device: Device = "cpu", limit: int = 1 << 24,
                   accumulation_steps: int = 1, optimizer_shards: Optional[int] = None, validation_rows: int = 0,
                   validation_dtype: str = "uint8", data_rows: int = 0, data_dtype: str = "uint8",
                   shuffle: bool = True, device_properties: Any = None) -> int:
    """The largest micro-batch whose planned reserved memory fits in budget_bytes (0 if none),
    for runs of accumulation_steps micro-batches per optimizer step (see plan: with more than
    one, a step needs more memory for the same micro-batch), the optimizer's state sharded
    over optimizer_shards ranks, a validation of validation_rows after each epoch (in fit's
    chunks of up to 1000 rows, as planned: fit halves a chunk that runs out of memory, but a
    batch that needs it, out of memory first, is not one that fits) and, on a GPU,
    a fit's data set of data_rows kept on the device (see plan) or, where that leaves the step
    room for a smaller micro-batch only, staged from host memory batch by batch, as fit does
    under a memory limit; at most data_rows, where given (a larger batch is the whole data set). The budget is a memory limit's: the segments that
    later epochs could add to the cache (see plan's epochs) would be given back at the limit,
    so the plan is of one epoch, and a validation of a few rows whose pool can make no segment
    under it takes a piece of a cached large-pool block, as fit's does. device_properties: a GPU
    that is not here (see plan)."""
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

    def largest(resident: bool) -> int:
        return _largest_batch(layer_sizes, budget, rows, resident, optimizer, amp, recompute, device, limit,
                              accumulation_steps, optimizer_shards, validation_rows, validation_dtype, data_dtype,
                              shuffle, device_properties)

    best = largest(True)
    if rows > 0 and _planned_device(device, device_properties)[0] != "cpu":
        # a fit whose data set would leave its step less room stages its batches from host memory
        # instead (see plan): the larger of the two is the micro-batch it runs at
        best = max(best, largest(False))
    return best


def _largest_batch(layer_sizes: Iterable[int], budget: int, rows: int, resident: bool, optimizer: Any,
                   amp: Optional[str], recompute: bool, device: Device, limit: int, accumulation_steps: int,
                   optimizer_shards: Optional[int], validation_rows: int, validation_dtype: str, data_dtype: str,
                   shuffle: bool, device_properties: Any) -> int:
    """max_batch_size's answer for a data set of `rows` (0: none) kept on the device (resident)
    or staged from host memory batch by batch; limit is at most rows where there are some. A
    batch of them all is one micro-batch, accumulation_steps or not."""
    def steps(b: int) -> int:
        return 1 if 0 < rows <= b else accumulation_steps

    def planned(b: int) -> Plan:
        return plan(layer_sizes, b, optimizer, amp, recompute, device, accumulation_steps=steps(b),
                    optimizer_shards=optimizer_shards, validation_rows=validation_rows,
                    validation_dtype=validation_dtype, data_rows=rows if resident else 0, data_dtype=data_dtype,
                    shuffle=shuffle, epochs=1, device_properties=device_properties)

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
    tail = [*_data_args(rows if resident else 0, data_dtype, shuffle, first.layer_sizes[0]),
            *_evaluation_args(validation_rows, validation_dtype, first.device, 1), min(budget, 1 << 62), first.device,
            _planned_device(device, device_properties)[1]]
    raws = {n: [list(first.layer_sizes), 0, *_plan_args(optimizer, amp, recompute, None, n, optimizer_shards), *tail]
            for n in {steps(lo), steps(1)}}
    for b in range(lo, 0, -1):
        raw = raws[steps(b)]
        raw[1] = b
        if _cmlp.plan(*raw)["peak_reserved"] <= budget:
            return b
    return 0
