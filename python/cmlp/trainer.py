"""cmlp.Trainer: the training loop users drive. The epoch loop itself runs in C with the GIL
released (seeded shuffle, micro-batches, exact accumulation, optimizer step); Python only asks
for a slice of steps at a time to draw the progress bar and collects the history."""
import contextlib
import os
import signal
import threading
import warnings
import weakref
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from . import _cmlp, memory
from . import distributed as _dist
from ._arrays import as_flag, as_inputs, as_labels, as_normalize, as_number, check_amp, check_seed, pinned
from ._fit_limit import start_under_limit
from ._fit_loop import _AGREE_OK, _AGREE_RANKS, _INTERRUPTED, FitLoop
from .model import MLP
from .optim import Optimizer
from .optim.lr_scheduler import LRScheduler, ReduceLROnPlateau


# the most samples one step may have (batch_size * accumulation_steps), as in the C core
MAX_STEP_SAMPLES = 2**62


# A trainer running fit or step in another thread when the process forks never finishes that call
# in the child: there it is marked lost (the call's state is half there).
_live: "weakref.WeakSet[Trainer]" = weakref.WeakSet()
EVALUATION_ROWS = 1000  # fit's validation chunk (cmlp.memory.plan's too)

_LOST = ("this Trainer was running fit or step in another thread when the process was forked; that call "
         "never finishes in the child, so the trainer cannot be used in this process (fork while no thread "
         "uses it, or start processes with 'spawn')")


def _after_fork_in_child() -> None:
    for trainer in list(_live):
        # the call of the thread that forked (from a callback inside fit, say) goes on in the child
        me, owner = threading.get_ident(), trainer._owner()
        for call, thread in list(trainer._claims.items()):
            if thread != me:  # the other threads' calls are not in the child
                del trainer._claims[call]
        if owner is not None and owner != me:
            trainer._lost = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _fixed(name: str, doc: str) -> property:
    """A setting the trainer is made with: readable, and refused when assigned (the C trainer's
    buffers, schedule and state follow it), so that what reads back is what trains."""
    key = "_" + name

    def get(self: "Trainer") -> Any:
        return self.__dict__[key]

    def refuse(self: "Trainer", value: Any) -> None:
        raise AttributeError(f"Trainer.{name} is fixed when the trainer is made: make a new cmlp.Trainer with "
                             f"{name}={value!r}")

    return property(get, refuse, doc=doc)


def _contents_hash(xy: Optional[Tuple[np.ndarray, np.ndarray]]) -> int:
    """A hash of a data set's type, labels and up to 256 rows spread over it (first, last and
    evenly between; the C core samples the training set so), never 0; 0 for none. Data-parallel,
    fit compares it over the ranks: each evaluates its share of one validation set."""
    if xy is None:
        return 0
    x, y = xy
    n = x.shape[0]
    rows = np.linspace(0, n - 1, min(n, 256)).round().astype(np.int64) if n else np.zeros(0, np.int64)
    h = zlib.crc32(str(x.dtype).encode())
    h = zlib.crc32(np.ascontiguousarray(x[rows]).tobytes(), h)
    return zlib.crc32(np.ascontiguousarray(y).tobytes(), h) + 1


def _positive_int(name: str, value: Any, limit: int = MAX_STEP_SAMPLES) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= limit:
        bound = f"2**{limit.bit_length() - 1}" if limit & (limit - 1) == 0 else str(limit)
        raise ValueError(f"{name} must be an int in [1, {bound}], got {value!r}")
    return int(value)


class Trainer(FitLoop):
    """One optimizer step consumes batch_size * accumulation_steps samples as accumulation_steps
    distinct micro-batches, each sample's gradient weighted by 1 / (samples in the step), so the
    update equals one big batch (a short last batch is normalised by its own size).

    distributed: None (the default) trains data-parallel when a process group exists
    (cmlp.distributed.init_process_group), True requires one, False trains this process alone.
    Data-parallel, batch_size is per rank and a step takes batch_size * accumulation_steps *
    world_size samples (see cmlp.distributed).

    normalize: the (mean, std) of uint8 images; given, it becomes the model's too (model.normalize,
    which None keeps), so that the model's evaluate, predict and save see images as training did.
    trainer.normalize is the model's.

    max_grad_norm: when set, before each update the L2 norm of the step's gradients (summed
    over its micro-batches and ranks, unscaled) is clipped to it, as
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) would do, on the device
    and inside a captured step; `fit`'s history then gives each epoch's mean norm before
    clipping ("grad_norm") and `last_grad_norm` the last step's."""

    def __init__(self, model: MLP, optimizer: Optimizer, batch_size: int = 32, accumulation_steps: int = 1,
                 amp: Optional[str] = None, scaler: Any = None, auto_microbatch: bool = True,
                 recompute: bool = False, shuffle: bool = True, seed: int = 0,
                 normalize: Optional[Tuple[float, float]] = None, microbatch_size: Optional[int] = None,
                 label_smoothing: float = 0.0, grow_interval: int = 100,
                 distributed: Optional[bool] = None, max_grad_norm: Optional[float] = None) -> None:
        if distributed is not None and not isinstance(distributed, bool):
            raise TypeError(f"distributed must be None, True or False, got {distributed!r}")
        group = _dist.is_initialized() if distributed is None else distributed
        if group and not _dist.is_initialized():
            raise RuntimeError("distributed=True needs a process group: call cmlp.distributed.init_process_group() "
                               "first")
        self._distributed = bool(group)
        self._interrupt_held = False  # (_interrupts_held)
        error: Optional[Exception] = None
        try:
            self._setup(model, optimizer, batch_size, accumulation_steps, amp, scaler, auto_microbatch, recompute,
                        shuffle, seed, normalize, microbatch_size, label_smoothing, grow_interval, max_grad_norm)
        except (TypeError, ValueError) as e:
            error = e
        self._agree(error)  # data-parallel, a rank whose arguments were refused makes all raise
        if self._given_normalize is not None:  # (once every argument is taken: a refused one changes nothing)
            model.normalize = self._given_normalize
        if self.distributed:
            self._c.set_distributed(True)  # (every rank starts from rank 0's parameters)

    def _setup(self, model: MLP, optimizer: Optimizer, batch_size: int, accumulation_steps: int, amp: Optional[str],
               scaler: Any, auto_microbatch: bool, recompute: bool, shuffle: bool, seed: int,
               normalize: Optional[Tuple[float, float]], microbatch_size: Optional[int], label_smoothing: float,
               grow_interval: int, max_grad_norm: Optional[float]) -> None:
        if not isinstance(model, MLP):
            raise TypeError(f"model must be a cmlp.MLP, got {type(model).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a cmlp.optim optimizer, got {type(optimizer).__name__}")
        if optimizer.model is not model:
            raise ValueError("optimizer was created for another model")
        if optimizer._c.shards()[0] and not self.distributed:
            if not _dist.is_initialized():
                raise ValueError("the optimizer's state is sharded over a process group that no longer exists "
                                 "(destroy_process_group): make one with cmlp.distributed.init_process_group()")
            raise ValueError("a ZeroRedundancyOptimizer updates each rank's part from the gradients summed over the "
                             "ranks: its Trainer must be data-parallel (distributed=None or True)")
        amp_code = check_amp(amp)
        from .amp import GradScaler

        if scaler is None and amp == "fp16":
            scaler = GradScaler()
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a cmlp.amp.GradScaler or None, got {type(scaler).__name__}")
        self._warned: Optional[int] = None  # the micro-batch the last MemoryWarning named (each is smaller)
        self._step_planned: Any = None  # ((device, limit), the batch sizes of steps that planned under it)
        self._limit_micro: Optional[int] = None  # the micro-batch a limit's planned start cut to (_fit_limit)
        self._resume_in_fit = False  # state loaded from inside a fit: the next fit goes on with its micro-batch
        self._bar_epochs: Optional[Tuple[int, int]] = None  # (first, total): a loop of fits that draws one run's bars
        self._parts_kept = False  # a fit's param-group parts kept for the rest of it (_run_scheduled)
        self._model, self._optimizer = model, optimizer
        self._batch_size = _positive_int("batch_size", batch_size)
        self._accumulation_steps = _positive_int("accumulation_steps", accumulation_steps)
        if self.batch_size * self.accumulation_steps > MAX_STEP_SAMPLES:
            raise ValueError(f"batch_size * accumulation_steps must be at most 2**62, got {self.batch_size} * "
                             f"{self.accumulation_steps}")
        micro = self.batch_size if microbatch_size is None else self._micro_of("microbatch_size", microbatch_size)
        seed = check_seed(seed)
        label_smoothing = as_number("label_smoothing", label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self._amp, self._scaler, self._label_smoothing = amp, scaler, label_smoothing
        auto_microbatch, recompute = as_flag("auto_microbatch", auto_microbatch), as_flag("recompute", recompute)
        shuffle = as_flag("shuffle", shuffle)
        self._auto_microbatch, self._recompute, self._shuffle = auto_microbatch, recompute, shuffle
        self._seed = seed
        self._grow_interval = grow_interval = _positive_int("grow_interval", grow_interval)
        if max_grad_norm is not None:
            max_grad_norm = as_number("max_grad_norm", max_grad_norm)
            if not max_grad_norm > 0.0:
                raise ValueError(f"max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
        self._max_grad_norm = max_grad_norm
        # fit and step use the C trainer's state from start to end: one call at a time (_claim)
        self._claims: Dict[object, int] = {}
        self._lost = False
        _live.add(self)
        self._eval_rows = EVALUATION_ROWS  # validation's chunk of rows (halved when it runs out of memory)
        self._given_normalize: Optional[Tuple[float, float]] = None if normalize is None else as_normalize(normalize)
        self._c = _cmlp.Trainer(optimizer._c, self.batch_size, self.accumulation_steps, micro, shuffle,
                                self.seed, label_smoothing, amp_code, auto_microbatch, int(grow_interval),
                                recompute, 0.0 if max_grad_norm is None else max_grad_norm)
        self._fresh_microbatch = self._c.microbatch_state()  # a new trainer's (load_state_dict of another batch)

    model = _fixed("model", "The model it trains.")
    optimizer = _fixed("optimizer", "The optimizer that steps it.")
    batch_size = _fixed("batch_size", "Samples in each of a step's accumulation_steps batches (per rank).")
    accumulation_steps = _fixed("accumulation_steps", "Micro-batches a step accumulates.")
    amp = _fixed("amp", 'None, "fp16" or "bf16".')
    scaler = _fixed("scaler", "The GradScaler of an fp16 run (None without one).")
    auto_microbatch = _fixed("auto_microbatch", "Whether an out-of-memory step is retried in smaller micro-batches.")
    recompute = _fixed("recompute", "Whether backward recomputes activations instead of keeping them.")
    shuffle = _fixed("shuffle", "Whether each epoch takes the samples in a new seeded order.")
    seed = _fixed("seed", "The seed of the epochs' orders.")
    label_smoothing = _fixed("label_smoothing", "The cross-entropy's label smoothing.")
    grow_interval = _fixed("grow_interval", "Good steps before automatic micro-batching tries a larger micro-batch "
                           "(twice as many after each try that ran out of memory).")
    max_grad_norm = _fixed("max_grad_norm", "The L2 norm gradients are clipped to (None: no clipping).")
    distributed = _fixed("distributed", "Whether it trains data-parallel over the process group.")

    @property
    def normalize(self) -> Tuple[float, float]:
        """The (mean, std) uint8 images are normalised with: the model's (one normalisation for
        training, evaluate, predict and save)."""
        return self.model.normalize

    @normalize.setter
    def normalize(self, value: Tuple[float, float]) -> None:
        self.model.normalize = as_normalize(value)

    @property
    def last_grad_norm(self) -> Optional[float]:
        """With max_grad_norm: the L2 norm of the last step's gradients before clipping (None
        before the first step, or without clipping)."""
        return self._c.last_grad_norm()

    def _micro_of(self, name: str, value: Any) -> int:
        """A micro-batch: at least 1 row and at most a step's rows (batch_size * accumulation_steps,
        which a step may compute at once)."""
        value = _positive_int(name, value)
        most = self.batch_size * self.accumulation_steps
        if value > most:
            raise ValueError(f"{name} must be at most batch_size * accumulation_steps ({most}), the rows of a "
                             f"step, got {value}")
        return value

    @property
    def microbatch_size(self) -> int:
        """Rows computed at once (batch_size unless set smaller)."""
        return self._c.microbatch_size

    @microbatch_size.setter
    def microbatch_size(self, value: int) -> None:
        value = self._micro_of("microbatch_size", value)
        call = object()
        try:
            self._claim(call, "setting microbatch_size")
            self._c.microbatch_size = value
            self._limit_micro = None
        finally:
            self._claims.pop(call, None)

    @property
    def epochs(self) -> int:
        """Epochs fit has begun with this trainer: the next one shuffles with (seed, epochs)."""
        return self._c.epochs

    def __copy__(self) -> "Trainer":
        """copy.copy: another Python object of the same trainer."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __reduce__(self) -> Tuple[Any, ...]:
        raise TypeError("a cmlp.Trainer cannot be pickled or deep-copied (it holds its training loop): pickle or copy "
                        "its model and optimizer (and scaler), and trainer.state_dict(), and make a new Trainer of "
                        "them (load_state_dict)")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Trainer":
        self.__reduce__()
        raise AssertionError  # not reached

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint needs beside the model's, optimizer's and schedule's state_dicts so
        that a run resumed from it trains as the uninterrupted run would, bit for bit: the epochs
        begun (the next epoch's order), what automatic micro-batching moves (the micro-batch in
        use, the one it grows back to, the good steps toward the next growth, the micro-batch the
        last growth started from, which an out-of-memory goes back to, the good steps the next
        growth waits for; under a memory limit, the limit and the batch sizes whose steps have
        planned their start under it, which later steps of those sizes do not plan again, and the
        micro-batch the plan cut to) and the loss scaler's state. Not while another thread's fit
        or step runs on the trainer (its state then is half an epoch's, which no run resumes from
        exactly); from inside it (a callback between epochs), it is the state of the epochs done,
        and says so ("in_fit"): a fit resumed from it goes on with its micro-batch, where a new
        fit call plans its start afresh."""
        if self._lost:
            raise RuntimeError(_LOST)
        owner = self._owner()
        if owner is not None and owner != threading.get_ident():
            raise self._busy_error("state_dict", owner)
        size, target, good, grown_from, wait = self._c.microbatch_state()
        planned = None
        if self._step_planned is not None:
            (_, limit), rows = self._step_planned
            planned = {"limit": limit, "batch_rows": sorted(rows)}
        return {"epochs": self._c.epochs, "microbatch_size": size, "microbatch_target": target,
                "microbatch_good_steps": good, "microbatch_grown_from": grown_from, "microbatch_grow_wait": wait,
                "microbatch_planned": planned, "microbatch_limit_cut": self._limit_micro,
                "in_fit": owner == threading.get_ident(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "batch_size": self.batch_size, "accumulation_steps": self.accumulation_steps}

    _STATE_KEYS = {"epochs", "microbatch_size", "microbatch_target", "microbatch_good_steps",
                   "microbatch_grown_from", "microbatch_grow_wait", "microbatch_planned", "microbatch_limit_cut",
                   "in_fit", "scaler", "batch_size", "accumulation_steps"}
    _OPTIONAL_STATE_KEYS = ("microbatch_grown_from", "microbatch_grow_wait", "microbatch_planned",
                            "microbatch_limit_cut", "in_fit", "batch_size", "accumulation_steps")  # newer than the rest

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores what state_dict() gave, into a trainer made with the same arguments; a bad
        dict raises and changes nothing. A state_dict without "microbatch_grown_from" or
        "microbatch_grow_wait" (of an earlier cmlp) loads as one whose last growth is not known,
        and whose next growth waits grow_interval good steps. The state_dict of a trainer with
        another batch_size or accumulation_steps (a run resumed with a new batch) gives its
        epochs and loss scaler; its micro-batches were those of its own steps, and this
        trainer's start afresh, as a new trainer's would."""
        if self._lost:
            raise RuntimeError(_LOST)
        keys = set(state_dict) if isinstance(state_dict, dict) else None
        if keys is None or not self._STATE_KEYS - set(self._OPTIONAL_STATE_KEYS) <= keys <= self._STATE_KEYS:
            raise ValueError(f"a trainer state_dict is a dict with the keys {sorted(self._STATE_KEYS)}")
        counts = {}
        for key in ("epochs", "microbatch_good_steps", "microbatch_grown_from", "microbatch_grow_wait"):
            v = state_dict.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= 2**63 - 1 or (
                    v > MAX_STEP_SAMPLES and key != "microbatch_grow_wait"):
                bound = "2**63 - 1" if key == "microbatch_grow_wait" else "2**62"
                raise ValueError(f"state_dict[{key!r}] must be an int in [0, {bound}], got {v!r}")
            counts[key] = int(v)
        batch = {key: _positive_int(f"state_dict[{key!r}]", state_dict[key]) for key in ("batch_size",
                 "accumulation_steps") if key in state_dict}
        own = all(v == getattr(self, key) for key, v in batch.items())  # its micro-batches are this trainer's
        micro = self._micro_of if own else _positive_int
        target = micro("state_dict['microbatch_target']", state_dict["microbatch_target"])
        size = micro("state_dict['microbatch_size']", state_dict["microbatch_size"])
        if size > target:
            raise ValueError(f"state_dict's micro-batch in use ({size}) is larger than its target ({target})")
        if counts["microbatch_grown_from"] >= size:
            raise ValueError(f"state_dict's micro-batch grown from ({counts['microbatch_grown_from']}) must be "
                             f"smaller than the one in use ({size}), or 0 (none)")
        planned, cut = self._planned_of(state_dict.get("microbatch_planned"), state_dict.get("microbatch_limit_cut"),
                                        target)
        in_fit = as_flag("state_dict['in_fit']", state_dict.get("in_fit", False))
        scaler = state_dict["scaler"]
        if (scaler is None) != (self.scaler is None):
            raise ValueError("the state_dict's loss scaler does not match this trainer's: "
                             + ("it has none" if scaler is None else "this trainer has none"))
        call = object()
        try:
            self._claim(call, "load_state_dict")
            if scaler is not None:
                before = self.scaler.state_dict()
                self.scaler.load_state_dict(scaler)
            try:
                if own:
                    self._c.set_microbatch_state(size, target, counts["microbatch_good_steps"],
                                                 counts["microbatch_grown_from"], counts["microbatch_grow_wait"])
                    self._step_planned, self._limit_micro = planned, cut
                else:
                    self._c.set_microbatch_state(*self._fresh_microbatch)
                    self._step_planned = self._limit_micro = None
                self._resume_in_fit = own and in_fit
            except BaseException:
                if scaler is not None:
                    self.scaler.load_state_dict(before)
                raise
            self._c.epochs = counts["epochs"]
        finally:
            self._claims.pop(call, None)

    def _planned_of(self, planned: Any, cut: Any, target: int) -> Tuple[Any, Optional[int]]:
        """A state_dict's "microbatch_planned" ({"limit": bytes, "batch_rows": [...]}, or None) as
        _step_planned (on this trainer's device), and its "microbatch_limit_cut" (None or a
        micro-batch up to the target), checked."""
        if cut is not None:
            cut = _positive_int("state_dict['microbatch_limit_cut']", cut)
            if cut > target:
                raise ValueError(f"state_dict's micro-batch a limit cut to ({cut}) is larger than its target "
                                 f"({target})")
        if planned is None:
            return None, cut
        what = "state_dict['microbatch_planned'] must be None or a dict of a limit in bytes and the batch_rows planned"
        if not isinstance(planned, dict) or set(planned) != {"limit", "batch_rows"} or \
                not isinstance(planned["batch_rows"], (list, tuple)):
            raise ValueError(what)
        limit = _positive_int("state_dict['microbatch_planned']['limit']", planned["limit"])
        rows = frozenset(_positive_int("state_dict['microbatch_planned']['batch_rows']", r)
                         for r in planned["batch_rows"])
        return ((self.model.device, limit), rows), cut

    def _push_scaler(self) -> None:
        """The scaler's state into the C loop, which scales, checks, skips and updates."""
        s = self.scaler
        if s is None or not s.is_enabled():
            self._c.set_scaler(False, 1.0, 2.0, 0.5, 1, 0)
            return
        d = s.state_dict()
        from .amp import _MIN_SCALE, underflow_message
        scale = s._scale  # (the float32 value; get_scale() reads it from this first use on)
        if scale < _MIN_SCALE:  # every step would be skipped
            raise ValueError(underflow_message(scale))
        self._c.set_scaler(True, scale, d["growth_factor"], d["backoff_factor"], d["growth_interval"],
                           d["_growth_tracker"])
        s._use()

    def _pull_scaler(self) -> None:
        s = self.scaler
        if s is None or not s.is_enabled():
            return
        s._set_state(*self._c.get_scaler())
        s._note_underflow(5)  # backed off in the C loop: fit -> _fit -> _pull_scaler -> here

    def _warn_if_split(self, before: int, stacklevel: int = 4) -> None:
        if self._c.oom_retries() <= before:  # (a step's only call where nothing ran out of memory)
            return
        # the size the steps ran at (microbatch_size may be a growth, not tried yet)
        ran = self._c.last_microbatch() or self.microbatch_size
        if ran >= self._c.microbatch_state()[1]:  # the one asked for: the retry took other room (the data set's)
            return
        if self._warned is None or ran < self._warned:
            self._warned = ran
            warnings.warn(f"out of memory inside a training step: the trainer now computes it in micro-batches of "
                          f"{ran} (the update is the same; see cmlp.memory.plan)",
                          memory.MemoryWarning, stacklevel=stacklevel)

    def _data(self, x: Any, y: Any, what: str) -> Tuple[np.ndarray, np.ndarray]:
        """The arrays as the core takes them, checked, with what they are for named in errors
        (a float x's NaN or inf too, before any step)."""
        sizes = self.model.layer_sizes
        xa = as_inputs(x, sizes[0], f"{what} x")
        if xa.dtype == np.float32:
            rows = max(1, (1 << 22) // max(1, sizes[0]))  # in blocks: no temporary the size of the data
            for start in range(0, xa.shape[0], rows):
                bad = ~np.isfinite(xa[start:start + rows])
                if bad.any():
                    sample, feature = np.argwhere(bad)[0]
                    raise ValueError(f"{what} x contains NaN or inf (first at sample {start + sample}, feature "
                                     f"{feature})")
        return xa, as_labels(y, xa.shape[0], sizes[-1], f"{what} y")

    def _busy_error(self, what: str, owner: Optional[int] = None) -> RuntimeError:
        """owner: the thread that had the trainer when the call was refused (default: now)."""
        if (self._owner() if owner is None else owner) == threading.get_ident():
            return RuntimeError(f"this Trainer's fit or step is still running: {what} was called from inside it (a "
                                "schedule's function, a callback or a progress bar), which cannot be done")
        return RuntimeError(f"this Trainer is already running fit or step in another thread; {what} must wait "
                            "for it (or use a Trainer per thread)")

    def _claim(self, call: object, what: str) -> None:
        """Claims the trainer for a call, named by a new object: the call's key enters the claims
        in one step (with its thread), and the call has the trainer when its key is the first.
        Called inside the call's try, whose finally gives it back with self._claims.pop(call,
        None), one step too: a KeyboardInterrupt between any two lines leaves no claim behind."""
        if self._lost:
            raise RuntimeError(_LOST)
        self._claims[call] = threading.get_ident()
        claims = list(self._claims.items())  # one look: the owner may give it back meanwhile
        if claims[0][0] is not call:
            raise self._busy_error(what, claims[0][1])

    def _owner(self) -> Optional[int]:
        """The thread of the call that has the trainer, None when none has."""
        owners = list(self._claims.values())
        return owners[0] if owners else None

    def _agree(self, error: Optional[BaseException], what: Optional[str] = None, ok: int = _AGREE_OK) -> int:
        """Raises error if there is one; data-parallel, first every rank learns whether some
        rank refused its arguments (or failed `what`), or was interrupted (an interrupt held by
        _interrupts_held counts as this rank's error), so that all raise rather than wait for it.
        Returns the least of the ranks' `ok` values (below _AGREE_OK: _slowest's times)."""
        if not self.distributed:
            if error is not None:
                raise error
            return ok
        held = error is None and self._interrupt_held
        if held:
            self._interrupt_held = False
            error = KeyboardInterrupt()
        mine = ok if error is None else _dist.get_rank() + (_INTERRUPTED if held else 0)
        least = np.array([mine], dtype=np.int64)
        _cmlp.dist_all_reduce(least, 2)  # the lowest rank that refused (one that failed before one held a Ctrl-C)
        first = int(least[0])
        if error is None and first < _AGREE_RANKS:
            if first >= _INTERRUPTED:
                raise RuntimeError(f"rank {first - _INTERRUPTED} of the process group was interrupted "
                                   "(KeyboardInterrupt), so every rank stopped its call there")
            if what is not None:
                raise RuntimeError(f"rank {first} of the process group {what} (its own error says why)")
            raise RuntimeError(f"rank {first} of the process group refused its arguments to this call (its "
                               "own error says why), so no rank ran it")
        if error is not None:
            raise error
        return first

    @contextlib.contextmanager
    def _interrupts_held(self) -> Iterator[None]:
        """Data-parallel, a Ctrl-C (SIGINT) during a call is held until the ranks next agree
        (_agree: each of fit's calls into the epoch loop, its epochs' ends), where every rank
        raises, this one KeyboardInterrupt: an interrupt raised between two collectives on one
        rank would leave the others waiting in the next. A second Ctrl-C before then is raised
        at once. One that comes after the call's last agreement is raised as it returns. Only in
        the main thread (where Python runs signal handlers) and where SIGINT has Python's own handler."""
        if not self.distributed or threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return

        def hold(signum: int, frame: Any) -> None:
            if self._interrupt_held:  # a second one: now
                signal.default_int_handler(signum, frame)
            self._interrupt_held = True

        self._interrupt_held = False
        signal.signal(signal.SIGINT, hold)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            held, self._interrupt_held = self._interrupt_held, False
            if held:
                raise KeyboardInterrupt

    def _claim_agreed(self, call: object, what: str, error: Optional[BaseException], then: Any = None) -> None:
        """_claim and then() (this rank's work before the call), then (data-parallel) every rank
        learns whether all could start the call."""
        if error is None:
            try:
                self._claim(call, what)
            except RuntimeError as e:
                error = e
        if error is None and then is not None:
            try:
                then()
            except BaseException as e:  # noqa: BLE001 - raised again on every rank by _agree (an interrupt too)
                if not self.distributed:
                    raise
                error = e
        self._agree(error)

    def _together(self, fn: Any, what: Optional[str] = None) -> Any:
        """Runs fn (work of this rank alone); data-parallel, an exception there is raised on every
        rank, so that none waits for the others in the next collective (what: what the others'
        error says that rank failed)."""
        if not self.distributed:
            return fn()
        error: Optional[BaseException] = None
        result = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on every rank by _agree (an interrupt too: a
            error = e  # rank that caught it would meet the others' next collective with another)
        self._agree(error, what)
        return result

    def step(self, x_batch: Any, y_batch: Any) -> float:
        """One optimizer step on the whole given (effective) batch; returns its mean loss.
        Data-parallel, each rank gives its own batch and the step is that of all of them."""
        error: Optional[Exception] = None
        try:
            xa, ya = self._data(x_batch, y_batch, "batch")
        except (TypeError, ValueError) as e:
            error = e
        call = object()
        before = None

        def start() -> None:
            nonlocal before
            before = self._c.microbatch_state(), self._step_planned, self._limit_micro
            self._start_step(xa.shape[0])

        try:
            with self._interrupts_held():
                try:
                    self._claim_agreed(call, "step", error, start)
                    loss = self._step(xa, ya)
                except BaseException:
                    if before is not None:  # a step that failed keeps not the micro-batch it started from
                        self._step_planned, self._limit_micro = before[1], before[2]
                        try:
                            self._c.set_microbatch_state(*before[0])
                        except Exception:  # noqa: BLE001 - (a lost model refuses it) the step's error is raised
                            pass
                    raise
                self.model._grads_none = False  # the step's gradients are in the buffer, as after torch's loop
                return loss
        finally:
            self._claims.pop(call, None)

    def _start_step(self, rows: int) -> None:
        """Under a memory limit, a step of rows starts from the planner's micro-batch, as fit's
        epochs do (once for each limit and batch size: later steps grow back from there)."""
        self._resume_in_fit = False  # (a fit's state, loaded, and then a step: the next fit plans)
        limit = memory.get_memory_limit(self.model.device)
        key = (self.model.device, limit)  # (a model moved to a GPU with the same limit plans again)
        planned = self._step_planned
        if limit is None:
            self._step_planned = None
            start_under_limit(self, batch_rows=rows)  # (a micro-batch the limit cut is the one asked for again)
            return
        if planned is not None and planned[0] == key and rows in planned[1]:
            return
        start_under_limit(self, batch_rows=rows)
        sizes = planned[1] if planned is not None and planned[0] == key else frozenset()
        self._step_planned = (key, sizes | {rows})

    def _step(self, xa: np.ndarray, ya: np.ndarray) -> float:
        self._push_scaler()
        retries = self._c.oom_retries()
        try:
            self.optimizer._sync_parts(self.optimizer._rates()[1])  # a no-op unless a call failed midway
            loss = self._c.step(xa, ya, *self.normalize)
        finally:
            self._pull_scaler()
        self.optimizer._opt_called = True  # a schedule stepped after it is in torch's order
        self._warn_if_split(retries)
        return loss

    def fit(self, x: Any, y: Any, epochs: int = 5, validation_data: Optional[Tuple[Any, Any]] = None,
            progress: bool = True, scheduler: Any = None, scheduler_interval: str = "epoch") -> List[Dict[str, Any]]:
        """Trains for `epochs` passes over (x, y); returns one dict per epoch. Data-parallel, every
        rank gives the same data set. scheduler: a cmlp.optim.lr_scheduler schedule of this
        trainer's optimizer, stepped after each epoch (as torch code calls scheduler.step() at
        the end of an epoch; ReduceLROnPlateau with the epoch's val_loss, or its loss without
        validation data), or with scheduler_interval="step" after each optimizer step (warm-up,
        OneCycleLR: as torch code calls it after optimizer.step()). Each epoch's record holds the
        rate its first step trained with ("lr")."""
        error: Optional[Exception] = None
        try:
            epochs, xa, ya, val = self._fit_args(x, y, epochs, validation_data)
            progress = as_flag("progress", progress)
            if scheduler_interval not in ("epoch", "step"):
                raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
            if scheduler is not None:
                if not isinstance(scheduler, LRScheduler):
                    raise TypeError(f"scheduler must be a cmlp.optim.lr_scheduler schedule, got "
                                    f"{type(scheduler).__name__}")
                if scheduler.optimizer is not self.optimizer:
                    raise ValueError("scheduler belongs to another optimizer than this trainer's")
                if scheduler_interval == "step" and isinstance(scheduler, ReduceLROnPlateau):
                    raise ValueError("ReduceLROnPlateau steps with a metric once per epoch: "
                                     "use scheduler_interval='epoch'")
        except (TypeError, ValueError) as e:
            error = e
        call = object()
        try:
            with self._interrupts_held():
                self._claim_agreed(call, "fit", error)
                per_step = scheduler is not None and scheduler_interval == "step"
                # data-parallel, each epoch's start compares these over the ranks with the settings
                self._c.set_fit_call(epochs, -1 if val is None else val[0].shape[0], _contents_hash(val), per_step)
                with pinned(xa, *(val or ())):  # read in place by every epoch's steps
                    return self._fit(xa, ya, epochs, val, progress, scheduler, per_step)
        finally:
            self._claims.pop(call, None)

    def _fit_args(self, x: Any, y: Any, epochs: int, validation_data: Optional[Tuple[Any, Any]]) -> Tuple[
            int, np.ndarray, np.ndarray, Optional[Tuple[np.ndarray, np.ndarray]]]:
        epochs = _positive_int("epochs", epochs, 2**31 - 1)
        xa, ya = self._data(x, y, "training")
        val = None
        if validation_data is not None:
            try:
                vx, vy = validation_data
            except (TypeError, ValueError):
                raise TypeError("validation_data must be a pair (x, y)") from None
            val = self._data(vx, vy, "validation")
        return epochs, xa, ya, val
