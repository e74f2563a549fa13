"""Where a Trainer's fit starts under a memory limit: the largest micro-batch that the planner
says fits beside what is allocated already, and whether the data set stays on the device."""
import warnings
from typing import Any, Optional, Tuple, cast

import numpy as np

from . import memory
from . import distributed as _dist


def start_under_limit(trainer: Any, xa: Optional[np.ndarray] = None, batch_rows: int = 0,
                      stacklevel: int = 6, keep_micro: bool = False) -> None:
    """Under a memory limit, start from the largest micro-batch (the fewest of a step) that fits
    next to what is allocated now, up to the one asked for. A fit on a GPU has copied
    its data set xa to the device: where the step would fit a larger micro-batch without it
    (or, without auto_microbatch, only without it), the copy goes and the batches are staged
    from host memory, so that the data set never costs the step its room. trainer.step gives
    batch_rows instead of xa: the rows of its one step, this rank's, staged from host memory.
    keep_micro: the fit goes on from a checkpoint taken inside one (Trainer.load_state_dict),
    whose micro-batch state is that of the epochs done: where the data set is is decided, and the
    micro-batch stays."""
    device = trainer.model.device
    limit = memory.get_memory_limit(device)
    if limit is None and keep_micro:
        return
    if limit is None:
        # the limit gone: a micro-batch that a planned start cut for it is the one asked for
        # again (one that an out-of-memory has made smaller since is the device's own: it stays)
        cut, trainer._limit_micro = trainer._limit_micro, None
        if cut is not None and trainer.auto_microbatch and trainer.microbatch_size >= cut:
            trainer._c.start_microbatch(trainer._c.microbatch_state()[1])
        return
    # what is in memory already, the plan's requests not to make again: the parameters and
    # gradients, the optimizer state where it is (a step skipped for inf/NaN gradients made it
    # before any step counted), the half-precision weights where a mixed-precision pass made them
    held: Tuple[str, ...] = ("model",)
    if trainer.optimizer._c.state_counts()[2] > 0:
        held += ("optimizer_state",)
    if trainer.amp is not None and trainer.model._c.half_weights_held():
        held += ("half_weights",)
    if trainer.optimizer._c.parts_on_device():  # the param groups' settings, made as they were given
        held += ("optimizer_parts",)
    trainer.model._c.release_workspace()  # the plan counts the workspace; it goes back to the cache
    resident = xa is not None and trainer._c.data_resident()
    room = limit - memory.memory_allocated(device)

    # a data set smaller than a micro-batch is each step's one micro-batch; data-parallel,
    # every rank has the whole data set and a step of it is shared out, the first ranks
    # taking one sample more: a rank computes at most ceil(rows / world_size) of a step
    rows = xa.shape[0] if xa is not None else batch_rows
    if trainer.distributed and xa is not None:
        rows = -(-rows // _dist.get_world_size())

    def planned(b: int, with_data: bool) -> Any:
        if 0 < rows < b:
            b = rows
        data = cast(np.ndarray, xa)  # (with_data: the fit's, on the device)
        try:
            return memory.plan(list(trainer.model.layer_sizes), b, trainer.optimizer, trainer.amp, trainer.recompute,
                               scaler=trainer.scaler is not None and trainer.scaler.is_enabled(), device=device,
                               accumulation_steps=-(-(batch_rows or trainer.batch_size * trainer.accumulation_steps)
                                                    // b) if b != rows else 1,
                               data_rows=data.shape[0] if with_data else 0,
                               data_dtype=data.dtype if with_data else "uint8", shuffle=trainer.shuffle)
        except ValueError:  # too large to plan: it does not fit either
            return None

    def fits(p: Any, with_data: bool) -> bool:
        """Whether the run's requests still to come (the plan's, but for what is held already
        and the data set, which is on the device or never will be) are served now, in their
        order: tried on a copy of the device's allocator, with its cache, settings and limit,
        and the device copy of the data set freed first where the batches would come from the
        host instead. The limit caps reserved memory, whatever else (another model, a user's
        tensors) holds it, and new segments come rounded up: the copy decides as the step will."""
        if p is None:
            return False
        return trainer._c.try_requests([n for what, n in p._requests if what not in held + ("data",)],
                                       resident and not with_data)

    # the rows of a step this rank computes (batch_size is per rank), cut into micro-batches
    step_rows = trainer.batch_size * trainer.accumulation_steps
    if rows:
        step_rows = rows if batch_rows else min(step_rows, rows)  # trainer.step's step is its batch

    # the micro-batch asked for (trainer.microbatch_size may be one a limit or an OOM made smaller):
    # each planned start tries from it, so that a fit after the limit rose or memory was freed
    # takes what fits now; without auto_microbatch only the one in use is tried
    target = trainer._c.microbatch_state()[1]
    first = min(target, step_rows) if trainer.auto_microbatch else trainer.microbatch_size

    def largest(with_data: bool) -> Tuple[int, Any, bool]:
        """The largest micro-batch that fits, of the fewest equal micro-batches of the step (a
        step of 8000 in 3 of 2667, not 4 of 2000), as `python -m cmlp plan --budget` offers,
        with its plan and whether it fits. Each size from `first` down is tried, for whether one
        fits is not monotonic in its size: a step's buffers of 1 to 10 MiB take a 20 MiB segment
        where 11 MiB take 12, those of at most 1 MiB the small pool's segments, and a free block
        in the cache may hold one and not a smaller one of the other pool (about 2 sqrt(rows)
        tries). The micro-batch asked for comes first, as the step computes it (its rows in
        micro-batches of it and the rest). Where none fits, 1: the step will try, in micro-batches
        of 1."""
        p = planned(first, with_data)
        ok = fits(p, with_data)
        if ok or not trainer.auto_microbatch:  # (a step of 339 rows in 220 and 119, where they fit, not 2 of 170)
            return first, p, ok
        k = -(-step_rows // first)
        while k <= step_rows:
            c = -(-step_rows // k)
            p = planned(c, with_data) if c != first else None
            if fits(p, with_data):
                return c, p, True
            k = max(k + 1, -(-step_rows // (c - 1))) if c > 1 else step_rows + 1
        return 1, planned(1, with_data), False

    b, p, fits_one = largest(resident)
    if resident and not (fits_one and b == first):
        b_host, p_host, fits_host = largest(False)
        if fits_host and (not fits_one or b_host > b):
            trainer._c.set_host_data(True)  # the batches come from host memory for the rest of this fit
            b, p, fits_one = b_host, p_host, fits_host
    if not trainer.auto_microbatch or keep_micro:
        return
    if b == first < target and batch_rows:
        # trainer.step's batch, shorter than the micro-batch asked for, fits whole: the micro-batch
        # in use stays (one cut for the full batches serves them; this step computes its rows)
        return
    start = target if b == first else b  # (all the step fits: the micro-batch asked for, as without a limit)
    if start != trainer.microbatch_size:
        trainer._c.start_microbatch(start)
    trainer._limit_micro = start if start < target else None
    if b < first:
        if trainer._warned is None or b < trainer._warned:  # said once, and again for a smaller one
            trainer._warned = b
            said = f"fits micro-batches of {b}, not {first}: the trainer accumulates them (the update is the same)"
            if not fits_one:
                state = ""
                own = None if p is None else p.peak_bytes - sum(p._allocated.get(k, 0) for k in held + ("data",))
                if own is not None and own <= room:
                    # the bytes may fit where the segments (or pages) that hold them do not
                    unit = "pages of 2 MiB" if memory.get_config()["expandable_segments"] else \
                        "whole segments, which configure('expandable_segments:True') makes pages"
                    standing = f" beside the {memory._fmt(p.standing_reserved_bytes)} the device holds from its " \
                        "start" if p.standing_reserved_bytes else ""
                    state = (f" (its requests would take {memory._fmt(own)} of the {memory._fmt(room)} left, but "
                             f"memory is reserved in {unit}: the run would reserve {memory._fmt(p.reserved_bytes)}"
                             f"{standing})")
                elif p is not None:
                    kept = sum(p.breakdown[k] for k in ("parameters", "gradients", "optimizer_state",
                                                        "half_weights"))
                    state = f" (the parameters, gradients and optimizer state take {memory._fmt(kept)})"
                said = f"fits no micro-batch, not even of 1 sample{state}: the step will try, in micro-batches of 1"
            warnings.warn(f"under the memory limit of {memory._fmt(limit)} the planner {said}",
                          memory.MemoryWarning, stacklevel=stacklevel)  # the user's call of fit or step
