"""The base of every schedule (LRScheduler: last_epoch, base_lrs, the all-or-nothing step, state_dict)
and the argument checks the schedules share."""
import functools
import math
import numbers
import os
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Union, cast

import numpy as np

from ..._arrays import as_number, is_scalar


def _optimizer(optimizer: Any) -> Any:
    from .. import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a cmlp optimizer")
    return optimizer


def _is_int(value: Any) -> bool:
    """An int (NumPy's too, as torch takes them), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _deprecated_epoch(epoch: Any) -> Union[int, float]:
    """step(epoch)'s epoch (an int, or a float as torch takes it: last_epoch then is that float),
    with torch's warning that the argument is going away."""
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Real) or not 0 <= cast(float, epoch) < math.inf:
        raise ValueError(f"epoch must be a finite number >= 0, got {epoch!r}")
    warnings.warn("step(epoch) is deprecated, as in torch: call step() to move the schedule on (with an epoch "
                  "the rate is the schedule's closed form for it where there is one, else its next form)",
                  UserWarning, stacklevel=3)
    return int(cast(int, epoch)) if _is_int(epoch) else float(epoch)


def _warn_outside_step(get_lr: Callable[[Any], List[float]]) -> Callable[[Any], List[float]]:
    @functools.wraps(get_lr)
    def checked(self: Any) -> List[float]:
        if not self._get_lr_called_within_step:
            warnings.warn("To get the last learning rate computed by the scheduler, please use `get_last_lr()`.",
                          UserWarning, stacklevel=2)
        return get_lr(self)

    return checked


_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # cmlp's own files


def _raised_here(e: BaseException) -> bool:
    """Whether e comes from this package's own code (a schedule's formula), not from a function
    of the caller's that it called (a LambdaLR's: its error is the caller's, raised as it is, as
    torch's)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


def _length(name: str, value: Any, lo: int) -> Any:
    """A schedule's length (step_size, T_max, total_iters): an int >= lo, or as torch takes it too,
    a finite float >= lo (T_max=total_steps / 2), kept as given so that the formulas are torch's."""
    if _is_int(value):
        return _int(name, value, lo)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and lo <= float(value) < math.inf:
        return float(value)
    raise ValueError(f"{name} must be a number >= {lo}, got {value!r}")


def _int(name: str, value: Any, lo: int) -> int:
    if not _is_int(value) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def _one_per_group(value: Any, n: int, mismatch: Callable[[int], str]) -> List[Any]:
    """value for each of n param groups, or a list or tuple of one per group (a ValueError with
    mismatch(its length) otherwise)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(mismatch(len(value)))
        return list(value)
    return [value] * n


def _non_negative(name: str, value: Any) -> float:
    """A factor or bound a schedule's rates are made of (gamma, eta_min, power, max_lr): finite
    and >= 0, since the rates it would make otherwise are ones the optimizer refuses, at some
    step well into a run (torch takes them, and trains with a negative or NaN rate)."""
    number = as_number(name, value)
    if not 0.0 <= number < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0 (the rates it makes must be rates), got {value!r}")
    return number


def _per_group(name: str, value: Any, optimizer: Any) -> List[float]:
    """A per-group argument (torch's _format_param): a number for every group, or a list or
    tuple with one per param group."""
    n = len(optimizer.param_groups)
    values = _one_per_group(value, n, lambda k: f"{name} must have the same length as optimizer.param_groups. "
                                                f"{name} has {k} values, param_groups has {n}.")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")
    try:
        return [float(v) for v in values]
    except OverflowError:  # an int beyond every float
        raise ValueError(f"{name} must be finite in float32, got {values!r:.60}") from None


def _mismatch(was: Any, new: Any) -> bool:
    """Whether a loaded value cannot stand where `was` stands: another kind of value (a number's
    place takes a number, a text's a text, a list's a list, a dict's a mapping, of matching items
    as far as both go); None stands where None stood, and replaces a value (torch's
    ReduceLROnPlateau holds default_min_lr, or None with one min_lr per group)."""
    if was is None or new is None:
        return False
    if isinstance(was, (bool, np.bool_)):
        return not isinstance(new, (bool, np.bool_))
    if isinstance(was, numbers.Real):  # (or a 0-d array or tensor: torch's rates may be tensors)
        return isinstance(new, bool) or not (isinstance(new, numbers.Real) or is_scalar(new))
    if isinstance(was, str):
        return not isinstance(new, str)
    if isinstance(was, (list, tuple)):
        return not isinstance(new, (list, tuple)) or any(_mismatch(a, b) for a, b in zip(was, new))
    if isinstance(was, dict):
        return not isinstance(new, Mapping) or any(_mismatch(was[k], new[k]) for k in was if k in new)
    return False


def _unfit(key: str, was: Any, new: Any, none_ok: frozenset, inf_ok: frozenset) -> Optional[str]:
    """Why a loaded value of the right kind (_mismatch) still cannot stand where `was` stands, or
    None: None for a number, list or dict (only where the schedule may hold None there; a
    function's place takes None, as state_dict() gives for one); a number beyond every
    float, NaN, or infinite where the schedule's is finite (only where it may hold an infinity);
    an empty list for a list of some; each item of a list of dicts as its first, others pairwise
    (the keys a dict must have are the schedule's to say: _check_loaded)."""
    held = isinstance(was, (numbers.Real, list, tuple, dict)) and not isinstance(was, (bool, np.bool_))
    if new is None:
        return "None where the schedule holds a value" if held and key not in none_ok else None
    if was is None:
        return None
    if isinstance(was, numbers.Real) and not isinstance(was, (bool, np.bool_)):
        try:
            f = float(new)
        except (OverflowError, TypeError, ValueError):
            return "a number beyond every float"
        if math.isnan(f) or (math.isinf(f) and math.isfinite(float(was)) and key not in inf_ok):
            return "not a finite number"
        return None
    if isinstance(was, (list, tuple)) and isinstance(new, (list, tuple)):
        if was and not new:
            return "empty, where the schedule holds some"
        pairs = [(was[0], item) for item in new] if was and all(isinstance(w, dict) for w in was) \
            else list(zip(was, new))
        for a, b in pairs:
            why = _unfit(key, a, b, none_ok, inf_ok)
            if why:
                return why
        return None
    if isinstance(was, dict) and not isinstance(new, Mapping):
        return "not a dict"
    if isinstance(was, dict):
        for k in was:
            why = _unfit(key, was[k], new[k], none_ok, inf_ok) if k in new else None
            if why:
                return why
    return None


def _ours(module: str) -> bool:
    """Whether a class of this module is this package's own schedule (its submodules' classes are
    shown as the package's once it is imported), not one defined elsewhere."""
    return module == __package__ or module.startswith(__package__ + ".")


def _check_state(schedule: Any, state_dict: Any) -> Mapping:
    """A state_dict as load_state_dict takes it, and what it loads of it: a mapping whose values are
    of the kinds this schedule holds under the same names and, for this module's schedules, usable
    where they stand (_unfit), within the ranges the constructor checks (_LOADED_AT_LEAST) and
    whole (_check_loaded); a schedule defined elsewhere may hold None or an infinity at one step
    and a number at another, and is held to the kinds only. Checked before any is taken: a
    refused one loads nothing, and the schedule goes on as it was, rather than failing at its next
    step. A state saved with an optimizer of other param groups loads as torch's does where
    torch's steps on (_for_these_groups), and is refused where they would fail."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict (a schedule's state_dict()), got {type(state_dict).__name__}")
    name = type(schedule).__name__
    ours = _ours(type(schedule).__module__)
    if ours:
        state_dict = _for_these_groups(schedule, state_dict)
    for key, value in state_dict.items():
        if key not in schedule.__dict__:
            continue
        was = schedule.__dict__[key]
        if _mismatch(was, value):
            raise TypeError(f"state_dict[{key!r}] must be like {was!r} (this {name}'s), got {value!r}")
        if not ours:
            continue
        why = _unfit(key, was, value, schedule._LOADED_NONE_OK, schedule._LOADED_INF_OK)
        if why:
            raise ValueError(f"state_dict[{key!r}] cannot stand for this {name}'s {was!r:.200}: {why}, got "
                             f"{value!r:.200}")
        lo = schedule._LOADED_AT_LEAST.get(key)
        if lo is not None and value is not None and not float(value) >= lo:
            raise ValueError(f"state_dict[{key!r}] must be {'> 0' if lo == _ABOVE_ZERO else f'>= {lo}'} (as this "
                             f"{name}'s constructor takes it), got {value!r}")
    if ours:
        schedule._check_loaded(state_dict)
    return state_dict


def _for_these_groups(schedule: Any, state_dict: Mapping) -> Mapping:
    """A state saved with an optimizer of another number of param groups: what the schedule's steps
    read of one value per group (_LOADED_PER_GROUP) is refused, as torch's next step would fail
    (its lists are cut short); its last rates, and its base rates where only step(epoch)'s closed
    form reads them, are this optimizer's own (torch keeps the saved ones, which its next step
    rewrites, and its closed form cuts short)."""
    groups = len(schedule.optimizer.param_groups)
    name = type(schedule).__name__
    wrong = [key for key in state_dict if key in schedule.__dict__ and isinstance(state_dict[key], (list, tuple))
             and isinstance(schedule.__dict__[key], (list, tuple)) and len(schedule.__dict__[key]) == groups
             and len(state_dict[key]) != groups]
    for key in sorted(wrong):
        if key in schedule._LOADED_PER_GROUP:
            raise ValueError(f"state_dict[{key!r}] has {len(state_dict[key])} entries, one per param group of the "
                             f"optimizer it was saved with; this {name}'s optimizer has {groups} param groups")
    own = {}
    if "_last_lr" in wrong:
        own["_last_lr"] = schedule.optimizer._group_lrs()
    if "base_lrs" in wrong:
        initial = list(schedule.optimizer._initial_lrs)
        own["base_lrs"] = initial if None not in initial else schedule.optimizer._group_lrs()
    return {**state_dict, **own} if own else state_dict


_ABOVE_ZERO = 5e-324  # the least float above 0: a lower bound "> 0" in _LOADED_AT_LEAST


class LRScheduler:
    """Base: last_epoch counts step() calls (-1 before the first, which the constructor makes);
    base_lrs holds each param group's rate when the schedule began (torch's 'initial_lr')."""

    # what a loaded state_dict is held to (_check_state): the least value of each number the
    # constructor bounds, and the names under which None, or an infinity, may replace a number
    _LOADED_AT_LEAST: Dict[str, float] = {"last_epoch": -1, "gamma": 0, "eta_min": 0, "power": 0}  # (where held)
    _LOADED_NONE_OK: frozenset = frozenset()
    _LOADED_INF_OK: frozenset = frozenset()
    # the lists of one value per param group that its steps read (_for_these_groups)
    _LOADED_PER_GROUP: frozenset = frozenset()

    # whether get_lr may set the optimizer's momenta itself (put back when a step fails): LambdaLR
    # (its functions may) and any schedule defined elsewhere (__init_subclass__); this module's
    # cyclic schedules hand theirs to the step, which sets them with the rates (_move_momenta)
    _MOVES_MOMENTUM = False
    # an instance's is False but within step(), from the constructor on (get_lr warns outside it)
    _get_lr_called_within_step = True
    # OneCycleLR's and CyclicLR's: within this module's step() their get_lr leaves its momenta in
    # _momenta_due (a list there while the step runs, None otherwise), for the step to set with the
    # rates (_move_momenta); not for a class defined elsewhere that has its own get_lr, step or
    # _update_lr: its code may read or set what get_lr set, as with torch's (__init_subclass__)
    _DEFERS_MOMENTA = False
    _momenta_due: Optional[List[float]] = None

    if TYPE_CHECKING:
        lr_lambdas: List[Any]  # LambdaLR's and MultiplicativeLR's functions

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        self.optimizer = _optimizer(optimizer)
        # an int, or a float as a deprecated step(epoch) can leave it (torch takes it back too)
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, numbers.Real) \
                or not -1 <= last_epoch < math.inf:
            raise ValueError(f"last_epoch must be an int >= -1 (or a float one, as step(epoch) can leave it), got "
                             f"{last_epoch!r}")
        last_epoch = int(last_epoch) if _is_int(last_epoch) else float(last_epoch)
        initial_before = list(optimizer._initial_lrs)
        if last_epoch == -1:  # the first schedule of the optimizer sets them (torch's setdefault)
            optimizer._initial_lrs = [lr if initial is None else initial
                                      for initial, lr in zip(optimizer._initial_lrs, optimizer._group_lrs())]
        else:
            for i, initial in enumerate(optimizer._initial_lrs):
                if initial is None:
                    raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming an "
                                   "optimizer")
        self.base_lrs: List[float] = list(optimizer._initial_lrs)
        self.last_epoch: Union[int, float] = last_epoch
        self._get_lr_called_within_step = False
        try:
            self._initial_step()
        except BaseException:  # a schedule refused at its first rate leaves the optimizer as it was
            optimizer._initial_lrs = initial_before
            raise

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The schedules of this module warn, as torch's, when get_lr() is called outside step()
        (it computes the next rate from the current one: get_last_lr() is what was set)."""
        super().__init_subclass__(**kwargs)
        if _ours(cls.__module__) and "get_lr" in cls.__dict__:
            cast(Any, cls).get_lr = _warn_outside_step(cls.__dict__["get_lr"])  # (its own method, wrapped)
        if not _ours(cls.__module__) and "_MOVES_MOMENTUM" not in cls.__dict__:
            cls._MOVES_MOMENTUM = True  # a schedule of the caller's may set momenta in its get_lr
        if not _ours(cls.__module__) and any(k in cls.__dict__ for k in ("get_lr", "step", "_update_lr")):
            cls._DEFERS_MOMENTA = False

    def _check_loaded(self, state_dict: Mapping) -> None:
        """What this schedule's own state needs beyond _check_state's rules (dicts' keys)."""

    def _initial_step(self) -> None:
        """The constructor's step (torch's): the step count starts again from it."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def get_last_lr(self) -> List[float]:
        """The rates the last step() set, one per param group."""
        return self._last_lr

    def step(self, epoch: Optional[float] = None) -> None:
        """Moves the schedule one epoch (or step) on and sets every param group's rate. A rate
        the optimizer refuses (negative, not finite) raises and leaves the schedule and every
        group's rate where they were.
        epoch (deprecated, as in torch, which warns): that epoch's rate instead, from the
        schedule's closed form where it has one; a float (2.5) is last_epoch from there on, as
        torch keeps it."""
        if self._step_count == 1 and not getattr(self.optimizer, "_opt_called", False):
            warnings.warn("Detected call of `lr_scheduler.step()` before `optimizer.step()`: call them in the "
                          "opposite order, optimizer.step() and then lr_scheduler.step(), or the first value of "
                          "the schedule is skipped (as in torch)", UserWarning, stacklevel=2)
        if epoch is not None:
            epoch = _deprecated_epoch(epoch)
        self._step_count += 1
        try:
            self._update_lr(epoch)
        except BaseException:
            self._step_count -= 1
            raise

    def _update_lr(self, epoch: Optional[float]) -> None:
        """The next epoch's rate (torch's recursive form), or with epoch that epoch's (the closed
        form where there is one): what SequentialLR asks of a schedule at its milestone."""
        before, optimizer = self.last_epoch, self.optimizer
        # the groups' settings as they are (each change makes a new list of new dicts): their
        # momenta are read from it only when the step fails
        owns = optimizer._owns if self._MOVES_MOMENTUM else None
        defers = self._DEFERS_MOMENTA
        if defers:
            self._momenta_due = []
        self._get_lr_called_within_step = True
        try:
            if epoch is None:
                self.last_epoch += 1
                lrs = self.get_lr()
            else:
                self.last_epoch = epoch
                closed = getattr(self, "_get_closed_form_lr", None)
                lrs = closed() if closed is not None else self.get_lr()
            # all or nothing, with the momenta get_lr left (_DEFERS_MOMENTA)
            optimizer._take_schedule(lrs, self._momenta_due or None)
        except BaseException as e:  # the optimizer as it was: get_lr may have moved the momentum
            self.last_epoch = before
            if owns is not None:
                optimizer._set_momentum([optimizer._part_fields(own)[0] for own in owns])
            if isinstance(e, (ZeroDivisionError, OverflowError)) and _raised_here(e):
                at = before + 1 if epoch is None else epoch
                raise ValueError(f"{type(self).__name__} cannot compute the rate of epoch {at} with these "
                                 f"arguments ({type(e).__name__}: {e})") from e
            raise
        finally:
            self._get_lr_called_within_step = False
            if defers:
                del self._momenta_due
        self._last_lr = list(optimizer._lrs)  # (what _group_lrs() gives, without the call)

    def _move_momenta(self, momenta: List[float]) -> None:
        """The momenta get_lr computed: within step() they go to the optimizer with the rates, as
        one (_DEFERS_MOMENTA); called alone, get_lr sets them at once, as torch's sets them in the groups."""
        if self._momenta_due is not None:
            self._momenta_due = momenta
        else:
            self.optimizer._set_momentum(momenta)

    def state_dict(self) -> Dict[str, Any]:
        """Everything but the optimizer; as in torch, of a LambdaLR's or MultiplicativeLR's
        function only the attributes of a callable object that is not a plain function (the
        state it keeps), None for a function."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}
        if "lr_lambdas" in self.__dict__:
            state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else dict(fn.__dict__)
                                   for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state_dict = _check_state(self, state_dict)
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})
        for fn, saved in zip(getattr(self, "lr_lambdas", ()), state_dict.get("lr_lambdas") or ()):
            if saved is not None:
                fn.__dict__.update(saved)

    def _lrs(self) -> List[float]:
        """Every param group's rate."""
        return self.optimizer._group_lrs()

