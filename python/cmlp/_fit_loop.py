"""Trainer.fit's epoch loop on the Python side: the calls into the C loop (paced to CALL_SECONDS,
with a per-step schedule's rates), the epoch's history and the validation between epochs. A mixin
of cmlp.Trainer, whose state it uses."""
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from . import _cmlp
from . import distributed as _dist
from ._fit_limit import start_under_limit
from ._progress import make_bar
from .optim.lr_scheduler import ReduceLROnPlateau

# Data-parallel agreements (Trainer._agree, the C core's cmlp_dist_agree): each rank gives
# _AGREE_OK (or less: a value to take the least of), its rank where it failed, or _INTERRUPTED plus
# its rank where it held a Ctrl-C (Trainer._interrupts_held); the least is the group's
_AGREE_OK = 2**63 - 1
_INTERRUPTED = 2**32
_AGREE_RANKS = 2**33  # below: a rank's failure
CALL_SECONDS = 0.1  # what one of fit's calls into the epoch loop aims to last (progress, Ctrl-C)


def _paced(chunk: int, seconds: float) -> int:
    """The next call's steps: twice as many after a call shorter than half of CALL_SECONDS,
    half as many after one longer than four times it (a step that slowed: micro-batching)."""
    if seconds < CALL_SECONDS / 2:
        return 2 * chunk
    if seconds > 4 * CALL_SECONDS:
        return max(1, chunk // 2)
    return chunk


class FitLoop:
    """Trainer's fit loop (see Trainer.fit)."""

    if TYPE_CHECKING:  # Trainer's
        model: Any  # (model, optimizer, distributed: Trainer's read-only properties)
        optimizer: Any
        distributed: Any
        normalize: Tuple[float, float]
        microbatch_size: int
        _c: _cmlp.Trainer
        _limit_micro: Optional[int]
        _resume_in_fit: bool
        _bar_epochs: Optional[Tuple[int, int]]
        _eval_rows: int

        def _push_scaler(self) -> None: ...
        def _pull_scaler(self) -> None: ...
        def _warn_if_split(self, before: int, stacklevel: int = 4) -> None: ...
        def _together(self, fn: Any, what: Optional[str] = None) -> Any: ...
        def _agree(self, error: Optional[BaseException], what: Optional[str] = None, ok: int = ...) -> int: ...

    def _fit(self, xa: np.ndarray, ya: np.ndarray, epochs: int, val: Optional[Tuple[np.ndarray, np.ndarray]],
             progress: bool, scheduler: Any = None, per_step: bool = False) -> List[Dict[str, Any]]:
        device = self.model.device
        history: List[Dict[str, Any]] = []
        self._c.set_host_data(False)  # each fit copies its data set to a GPU, where it has room (start_under_limit)
        self._parts_kept = False  # _run_scheduled's
        try:
            for epoch in range(1, epochs + 1):
                _cmlp.memory_window_peak(device, True)  # the epoch's own peak; the statistics' are the user's
                epochs_before, micro_before = self._c.epochs, (self._c.microbatch_state(), self._limit_micro)
                # the scaler's state first: data-parallel, epoch_begin compares it over the ranks
                # (it may refuse the scale: before a bar is drawn)
                self._push_scaler()
                # the later epochs of this call train on the same arrays: a device copy is kept
                total = self._c.epoch_begin(xa, ya, *self.normalize, same_data=epoch > 1)
                steps_done = 0
                try:
                    # data-parallel, the first rank draws the bar for all
                    show = progress and (not self.distributed or _dist.get_rank() == 0)
                    first, of = self._bar_epochs or (1, epochs)
                    bar = make_bar(total, f"epoch {first + epoch - 1}/{of}", show)
                    # a call's steps run without the host; each call begins and ends with a wait
                    # (its scalars), so a call of short steps (a GPU's, at a small batch) grows
                    # towards CALL_SECONDS (a per-step schedule's, up to MAX_RATES steps)
                    chunk = max(1, total // 200)
                    samples, loss_sum, skipped, norm_sum, norm_steps, steps_done = 0, 0.0, 0, 0.0, 0, 0
                    first_lr = self.optimizer.lr
                    self.optimizer._sync_parts(self.optimizer._rates()[1], parts=self._parts_kept)  # as in step()
                    start = time.perf_counter()
                    if epoch == 1:  # (a fit resumed from inside one goes on with its micro-batch)
                        keep, self._resume_in_fit = self._resume_in_fit, False
                        self._together(lambda: start_under_limit(self, xa, keep_micro=keep))
                    self.optimizer._opt_called = True  # its schedule steps after the optimizer's
                    retries = self._c.oom_retries()
                    try:
                        done = False
                        while not done:
                            called = time.perf_counter()
                            if per_step:
                                steps, n, loss, done, k, norms, counted = self._run_scheduled(
                                    scheduler, min(chunk, total - steps_done), steps_done)
                            else:
                                steps, n, loss, done, k, norms, counted = self._c.epoch_run(chunk)
                            if not done:
                                chunk = _paced(chunk, self._slowest(time.perf_counter() - called))
                                chunk = min(chunk, _cmlp.MAX_RATES) if per_step else chunk
                            steps_done += steps
                            if steps:
                                self.model._grads_none = False  # the steps' gradients are in the buffer
                            samples += n
                            loss_sum, norm_sum = loss, norms  # the epoch's so far, added up in step order
                            skipped += k
                            norm_steps += counted
                            if bar is not None:
                                bar.set_postfix_str(f"loss {loss_sum / max(samples, 1):.4f}")
                                bar.update(steps)
                    finally:
                        self._pull_scaler()
                        if bar is not None:
                            bar.close()
                except BaseException:
                    # an epoch that fails before any of its steps is taken is not begun: the next
                    # fit draws the same order, with the micro-batch of before (the state is as
                    # before the call)
                    if steps_done + self._c.run_steps() == 0:
                        self._c.epochs = epochs_before
                        self._c.set_microbatch_state(*micro_before[0])
                        self._limit_micro = micro_before[1]
                    else:
                        self.model._grads_none = False
                    raise
                # the warning is this rank's own (a rank retries its share alone): where it raises
                # (warnings as errors), every rank raises before the next collective
                self._together(lambda: self._warn_if_split(retries, stacklevel=6),
                               "raised in its warning that it computes its steps in micro-batches")
                seconds = time.perf_counter() - start
                record: Dict[str, Any] = {
                    "epoch": epochs_before + 1,  # the trainer's count (trainer.epochs), across fits and resumes
                    "lr": first_lr,
                    "loss": loss_sum / samples,
                    "val_loss": None,
                    "val_accuracy": None,
                    "seconds": seconds,
                    "samples_per_second": samples / seconds if seconds > 0 else float("inf"),
                    # the epoch's training peak (what cmlp.memory.plan predicts), without validation
                    "peak_memory_bytes": _cmlp.memory_window_peak(device, False),
                    # the micro-batch the epoch's last step ran with (a growth may be pending: the
                    # next step tries it, and trainer.microbatch_size says so)
                    "microbatch_size": self._c.last_microbatch() or self.microbatch_size,
                    "skipped_steps": skipped,
                    # with max_grad_norm: the mean L2 norm of the epoch's gradients before clipping
                    # (steps whose norm was inf or NaN left out)
                    "grad_norm": norm_sum / norm_steps if norm_steps else None,
                }
                if val is not None:
                    loss_sum, correct = self._together(lambda: self._evaluate(val))
                    if self.distributed:  # the group's sums (after _together: every rank got here)
                        sums = np.array([loss_sum])
                        count = np.array([correct], dtype=np.int64)
                        _cmlp.dist_all_reduce(sums, 0)
                        _cmlp.dist_all_reduce(count, 0)
                        loss_sum, correct = float(sums[0]), int(count[0])
                    self.model._c.release_workspace()  # evaluation's buffers go back to the cache
                    record["val_loss"] = loss_sum / val[0].shape[0]
                    record["val_accuracy"] = correct / val[0].shape[0]
                history.append(record)
                if isinstance(scheduler, ReduceLROnPlateau):
                    metric = record["val_loss"] if val is not None else record["loss"]
                    self._step_schedule(scheduler, lambda: scheduler.step(metric))
                elif scheduler is not None and not per_step:
                    self._step_schedule(scheduler, scheduler.step)
        finally:
            self._c.release_data()  # the device copy of the data set, kept between epochs
            # the activations go back to the cache, as torch frees them after backward: what stays
            # allocated is the model's and the optimizer's state
            self.model._c.release_workspace()
        return history

    def _step_schedule(self, scheduler: Any, step: Any) -> None:
        """The schedule's step after an epoch. It is this rank's own work between collectives:
        data-parallel, where it raises on one rank every rank raises (none waits in the next
        epoch's first collective), with its schedule and rates as they were (a schedule that
        raises leaves itself so)."""
        if not self.distributed:
            step()
            return
        rewind, stepped = _rewinder(scheduler, self.optimizer), False

        def stepping() -> None:
            nonlocal stepped
            step()
            stepped = True

        try:
            self._together(stepping, "raised in its schedule's step after the epoch")
        except BaseException:
            if stepped:  # another rank's raised: this one's step is undone, as there
                rewind(0)
            raise

    def _run_scheduled(self, scheduler: Any, steps: int, first: int) -> Tuple[int, int, float, bool, int, float, int]:
        """epoch_run for up to `steps` steps, each at the rate (and momentum: OneCycleLR) the
        schedule gives it, as torch's loop takes them (optimizer.step(), then scheduler.step()):
        the schedule is stepped once per step ahead of the call and its values reach the device
        with it. When the schedule raises, the steps before are taken, then the error is raised;
        when the call fails after j steps, the schedule is where it would be after j steps.
        With param groups each step's base rate comes with each group's multiple of it (the
        same for every step while the groups keep their proportions, else one row per step).
        first: the epoch's steps before these."""
        opt = self.optimizer
        k = min(steps, _cmlp.MAX_RATES)
        rewind = _rewinder(scheduler, opt)

        rates: List[float] = []
        momenta: List[float] = []
        rows: List[Tuple[float, ...]] = []  # each step's groups' multiples of its base rate
        mrows: List[List[float]] = []  # and their momenta
        raised: Optional[BaseException] = None
        base, scales = opt._rates()
        try:
            for _ in range(k):
                base, now = opt._rates()
                each = opt._momenta()
                rates.append(base)
                momenta.append(each[0])  # (the first group's: opt._momentum())
                rows.append(now)
                mrows.append(each)
                scheduler.step()
        except Exception as e:  # torch's loop has taken this step when the schedule raises
            raised = e
        except BaseException as e:  # an interrupt: single-process, no step is taken
            if not self.distributed:
                rewind(0)
                raise
            # data-parallel the ranks learn of it first, and take the steps whose rates are all in,
            # as where the schedule raised (the last one's schedule step undone): it may have come
            # between the lists' appends, or before the first
            whole = min(len(rates), len(momenta), len(rows), len(mrows))
            del rates[whole:], momenta[whole:], rows[whole:], mrows[whole:]
            rewind(max(whole - 1, 0))
            raised = e
        if self.distributed:  # every rank takes as many steps, at the same rates
            raised = _same_steps_on_every_rank(rates, momenta, rows, mrows, raised, rewind, first)
            if not rates and raised is not None:  # an interrupt before any step's rates: none is taken
                raise raised
        apart = any(row != scales for row in rows)
        # without a table of momenta a step's groups take the momentum of its first group, or the
        # one of their own they hold now (the schedule has moved them on): a table where that is not theirs
        held = opt._momenta()
        moved = any(m[g] != (m[0] if held[g] == held[0] else held[g]) for m in mrows for g in range(len(m)))
        # once a fit's groups have moved apart, their parts stay for the rest of it: a later call
        # whose groups meet again would drop them, and the next one's new parts make a new capture
        self._parts_kept = self._parts_kept or apart or moved
        try:
            opt._sync_parts(scales, parts=self._parts_kept)  # the call's multiples
        except BaseException:
            rewind(0)  # no step taken (the rewind gives the C optimizer the groups' rates again)
            raise
        table = part_momenta = None
        if apart or moved:  # the groups' rates or momenta moved apart: each step's, part by part
            runs = opt._runs()
            table = [row[g] for row in rows for _, g in runs]
            if moved:
                part_momenta = [m[g] for m in mrows for _, g in runs]
        try:
            result = self._c.epoch_run(len(rates), rates, momenta, table, part_momenta)
        except BaseException:
            rewind(self._c.run_steps())
            raise
        opt._sync_parts(opt._rates()[1], parts=self._parts_kept)  # the groups' multiples of now
        if raised is not None:
            raise raised
        return result

    def _evaluate(self, val: Tuple[np.ndarray, np.ndarray]) -> Tuple[float, int]:
        """(loss sum, correct) over the validation set; data-parallel, each rank evaluates its
        share of the rows (the ranks hold the same parameters) and the sums are the group's."""
        if not self.distributed:
            return self._evaluate_rows(val[0], val[1])
        n, rank, ranks = val[0].shape[0], _dist.get_rank(), _dist.get_world_size()
        lo, hi = n * rank // ranks, n * (rank + 1) // ranks
        return self._evaluate_rows(val[0][lo:hi], val[1][lo:hi]) if hi > lo else (0.0, 0)

    def _evaluate_rows(self, x: np.ndarray, y: np.ndarray) -> Tuple[float, int]:
        """(loss sum, correct) in chunks of up to 1000 rows, after the step's buffers went back.
        Out of memory (under a limit that training survives by micro-batching), the chunk
        shrinks as MLP._shrinking says, and the smaller chunk is kept for the next epochs.
        Nothing but the sums comes out."""
        self.model._c.release_workspace()

        def run(rows: int) -> Tuple[float, int]:
            return self.model._c.evaluate(x, y, *self.normalize, rows)

        sums, self._eval_rows = self.model._shrinking(run, self._eval_rows)
        return sums

    def _slowest(self, seconds: float) -> float:
        """The longest of the ranks' times for the call just made (this one's, alone): the ranks
        must make the same calls into the epoch loop, so they pace them on the same time."""
        if not self.distributed:
            return seconds
        # an agreement (the least of _AGREE_OK less each rank's microseconds): a held interrupt
        # is raised here on every rank, after the same steps
        micros = min(max(int(seconds * 1e6), 0), 2**40)
        return (_AGREE_OK - self._agree(None, "was interrupted", ok=_AGREE_OK - micros)) / 1e6


def _rewinder(scheduler: Any, opt: Any) -> Any:
    """rewind(done): the schedule and the optimizer's group rates and momenta as they are now,
    then `done` steps of the schedule on."""
    saved, lrs, momentum = scheduler.state_dict(), opt._group_lrs(), opt._momenta()

    def rewind(done: int) -> None:
        scheduler.load_state_dict(saved)
        opt._set_group_lrs(lrs)
        opt._set_momentum(momentum)
        for _ in range(done):
            scheduler.step()

    return rewind


_NO_RANK = 1 << 20  # (more ranks than a group has)


def _same_steps_on_every_rank(rates: List[float], momenta: List[float], rows: List[Tuple[float, ...]],
                              mrows: List[List[float]], raised: Optional[BaseException], rewind: Any,
                              first: int) -> Optional[BaseException]:
    """Data-parallel, a call's per-step rates as every rank takes them (a collective). Where a
    rank's schedule raised, every rank takes the steps before and its step, then raises (that
    rank its own error, the others one that names it), with the schedule where that rank's is:
    the steps were made and the one that raised was not. Rates that differ between the ranks
    (a schedule of the rank's own) raise on every rank before any step. Returns the error to
    raise after the steps, trimming the lists to the steps that all take. first: the epoch's
    steps before these (for the messages)."""
    rank, count = _dist.get_rank(), len(rates)
    groups, moments = len(rows[0]) if rows else 0, len(mrows[0]) if mrows else 0
    # the fewest steps, and the lowest rank that raised at that step; the groups' counts, both ways
    key = np.array([count * _NO_RANK + (rank if raised is not None else _NO_RANK - 1), groups, -groups, moments,
                    -moments], dtype=np.int64)
    _cmlp.dist_all_reduce(key, 2)
    if key[1] != -key[2] or key[3] != -key[4]:  # (the optimizers' settings agree: a safeguard)
        rewind(0)
        raise ValueError("the ranks' optimizers have different numbers of param groups")
    n, who = divmod(int(key[0]), _NO_RANK)
    if who != _NO_RANK - 1 and not (who == rank or (raised is not None and count == n)):
        del rates[n:], momenta[n:], rows[n:], mrows[n:]
        rewind(n - 1)  # as the rank that raised holds it: its n-th step of the schedule undone
        raised = RuntimeError(f"rank {who}'s schedule raised after the epoch's step {first + n} (its own error says "
                              "why): every rank took the steps up to it, then stopped")
    # each step's rates and momenta, bit for bit
    bits = np.array(rates + momenta + [v for row in rows for v in row] + [v for m in mrows for v in m],
                    dtype=np.float64).view(np.int64)
    differ = _dist._where_ranks_differ(bits)
    if differ.size:
        rewind(0)
        i = int(differ[0])  # in the rates, the momenta, the groups' rates or their momenta
        at = i % n if i < 2 * n else (i - 2 * n) // groups if i < (2 + groups) * n else \
            (i - (2 + groups) * n) // moments
        raise ValueError(f"the ranks' schedules give different rates or momenta for the epoch's step {first + at + 1}: "
                         "every rank must step the same schedule (a per-step schedule of the rank's own would "
                         "leave the ranks' parameters apart)")
    return raised
