"""cmlp.optim.lr_scheduler: torch.optim.lr_scheduler's schedules, with torch's names, defaults,
formulas (the same recursive forms, so the rates are torch's to the last bit; the exceptions are
rates torch goes below 0 with, which the optimizer here refuses: one step past its end
OneCycleLR's linear strategy gives torch a negative rate (never trained with) and a momentum past
its range, here 0 and the range's end; a group at rate 0 under CosineAnnealingLR's eta_min > 0
rounds to about -1e-15 in torch's form, 0 here, and its later rates then differ from torch's in
the last bits) and state_dict, over a cmlp optimizer's learning rates.

    opt = cmlp.optim.Adam(model.parameters(), lr=1e-3)
    sched = cmlp.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    for epoch in range(5):
        trainer.fit(x, y, epochs=1)      # or: Trainer.fit(..., epochs=5, scheduler=sched)
        sched.step()

A schedule sets the rate of every param group (`optimizer.param_groups[i]["lr"]`, each from the
group's own 'initial_lr', as in torch; `optimizer.lr` is the first group's). OneCycleLR and
CyclicLR also move each group's momentum (Adam's beta1, SGD's momentum), between momenta given
once for all groups or one per group. `Trainer.fit(..., scheduler=sched)` steps a schedule after each
epoch, or with `scheduler_interval="step"` after each optimizer step (warm-up):

    sched = cmlp.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 500))
    trainer.fit(x, y, epochs=5, scheduler=sched, scheduler_interval="step")

Off the CPU a step reads its rates (and momentum, which OneCycleLR and CyclicLR move) on the device, so a step
captured as a CUDA graph replays at every rate.
"""
import functools
import math
import numbers
import types
import warnings
from bisect import bisect_right
from math import inf
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from .._arrays import as_flag, as_number

__all__ = ["LRScheduler", "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
           "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
           "CyclicLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"]


def _optimizer(optimizer: Any) -> Any:
    from . import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a cmlp optimizer")
    return optimizer


def _is_int(value: Any) -> bool:
    """An int (NumPy's too, as torch takes them), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _deprecated_epoch(epoch: Any) -> Union[int, float]:
    """step(epoch)'s epoch (an int, or a float as torch takes it: last_epoch then is that float),
    with torch's warning that the argument is going away."""
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Real) or not 0 <= epoch < math.inf:
        raise ValueError(f"epoch must be a finite number >= 0, got {epoch!r}")
    warnings.warn("step(epoch) is deprecated, as in torch: call step() to move the schedule on (with an epoch "
                  "the rate is the schedule's closed form for it where there is one, else its next form)",
                  UserWarning, stacklevel=3)
    return int(epoch) if _is_int(epoch) else float(epoch)


def _warn_outside_step(get_lr: Callable[[Any], List[float]]) -> Callable[[Any], List[float]]:
    @functools.wraps(get_lr)
    def checked(self: Any) -> List[float]:
        if not getattr(self, "_get_lr_called_within_step", True):
            warnings.warn("To get the last learning rate computed by the scheduler, please use `get_last_lr()`.",
                          UserWarning, stacklevel=2)
        return get_lr(self)

    return checked


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


def _per_group(name: str, value: Any, optimizer: Any) -> List[float]:
    """A per-group argument (torch's _format_param): a number for every group, or a list or
    tuple with one per param group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must have the same length as optimizer.param_groups. {name} has "
                             f"{len(value)} values, param_groups has {n}.")
        values = list(value)
    else:
        values = [value] * n
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")
    return [float(v) for v in values]


class LRScheduler:
    """Base: last_epoch counts step() calls (-1 before the first, which the constructor makes);
    base_lrs holds each param group's rate when the schedule began (torch's 'initial_lr')."""

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        self.optimizer = _optimizer(optimizer)
        # an int, or a float as a deprecated step(epoch) can leave it (torch takes it back too)
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, numbers.Real) \
                or not -1 <= last_epoch < math.inf:
            raise ValueError(f"last_epoch must be an int >= -1 (or a float one, as step(epoch) can leave it), got "
                             f"{last_epoch!r}")
        last_epoch = int(last_epoch) if _is_int(last_epoch) else float(last_epoch)
        if last_epoch == -1:  # the first schedule of the optimizer sets them (torch's setdefault)
            optimizer._initial_lrs = [lr if initial is None else initial
                                      for initial, lr in zip(optimizer._initial_lrs, optimizer._group_lrs())]
        else:
            for i, initial in enumerate(optimizer._initial_lrs):
                if initial is None:
                    raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming an "
                                   "optimizer")
        self.base_lrs: List[float] = list(optimizer._initial_lrs)
        self.last_epoch = last_epoch
        self._get_lr_called_within_step = False
        self._initial_step()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The schedules of this module warn, as torch's, when get_lr() is called outside step()
        (it computes the next rate from the current one: get_last_lr() is what was set)."""
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__ and "get_lr" in cls.__dict__:
            cls.get_lr = _warn_outside_step(cls.__dict__["get_lr"])

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
        before, momentum = self.last_epoch, self.optimizer._momenta()
        self._get_lr_called_within_step = True
        try:
            if epoch is None:
                self.last_epoch += 1
                lrs = self.get_lr()
            else:
                self.last_epoch = epoch
                closed = getattr(self, "_get_closed_form_lr", None)
                lrs = closed() if closed is not None else self.get_lr()
            self.optimizer._set_group_lrs(lrs)  # all or nothing
        except BaseException as e:  # the optimizer as it was: get_lr may have moved the momentum
            self.last_epoch = before
            self.optimizer._set_momentum(momentum)
            if isinstance(e, (ZeroDivisionError, OverflowError)):
                at = before + 1 if epoch is None else epoch
                raise ValueError(f"{type(self).__name__} cannot compute the rate of epoch {at} with these "
                                 f"arguments ({type(e).__name__}: {e})") from e
            raise
        finally:
            self._get_lr_called_within_step = False
        self._last_lr = self.optimizer._group_lrs()

    def state_dict(self) -> Dict[str, Any]:
        """Everything but the optimizer; as in torch, of a LambdaLR's or MultiplicativeLR's
        function only the attributes of a callable object that is not a plain function (the
        state it keeps), None for a function."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}
        if "lr_lambdas" in self.__dict__:
            state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else dict(fn.__dict__)
                                   for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})
        for fn, saved in zip(getattr(self, "lr_lambdas", ()), state_dict.get("lr_lambdas") or ()):
            if saved is not None:
                fn.__dict__.update(saved)

    def _lrs(self) -> List[float]:
        """Every param group's rate."""
        return self.optimizer._group_lrs()


_LRScheduler = LRScheduler  # torch's older name, still exported


class _LambdaSchedule(LRScheduler):
    """A schedule of a function of the epoch: one for every param group, or a list or tuple
    with one per group."""

    def __init__(self, optimizer: Any, lr_lambda: Any, last_epoch: int = -1) -> None:
        n = len(_optimizer(optimizer).param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != n:
                raise ValueError(f"Expected {n} lr_lambdas, but got {len(lr_lambda)}")
            lambdas = list(lr_lambda)
        else:
            lambdas = [lr_lambda] * n
        for fn in lambdas:
            if not callable(fn):
                raise TypeError(f"lr_lambda must be callable, got {fn!r}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)


class LambdaLR(_LambdaSchedule):
    """lr = base_lr * lr_lambda(last_epoch)."""

    def get_lr(self) -> List[float]:
        return [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs)]


class StepLR(LRScheduler):
    """The rate times gamma every step_size epochs."""

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size = _length("step_size", step_size, 1)
        self.gamma = as_number("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._lrs()
        return [lr * self.gamma for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """The rate times gamma at each milestone (gamma**k at a milestone given k times)."""

    def __init__(self, optimizer: Any, milestones: Iterable[int], gamma: float = 0.1, last_epoch: int = -1) -> None:
        counts: Dict[int, int] = {}
        for m in milestones:
            m = _int("milestones", m, 0)
            counts[m] = counts.get(m, 0) + 1
        self.milestones = dict(sorted(counts.items()))
        self.gamma = as_number("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch not in self.milestones:
            return self._lrs()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        milestones = sorted(m for m, count in self.milestones.items() for _ in range(count))
        return [base * self.gamma ** bisect_right(milestones, self.last_epoch) for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """The rate times gamma every epoch."""

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = as_number("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self._is_initial:
            return self._lrs()
        return [lr * self.gamma for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """eta_min + (base_lr - eta_min) (1 + cos(pi t / T_max)) / 2, in torch's recursive form."""

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max = _length("T_max", T_max, 1)
        self.eta_min = as_number("eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, T, lo, lrs = self.last_epoch, self.T_max, self.eta_min, self._lrs()
        if self._is_initial:
            return lrs
        if self._step_count == 1 and t > 0:
            return [lo + (base - lo) * (1 + math.cos(t * math.pi / T)) / 2 for base in self.base_lrs]
        if (t - 1 - T) % (2 * T) == 0:
            new = [lr + (base - lo) * (1 - math.cos(math.pi / T)) / 2 for base, lr in zip(self.base_lrs, lrs)]
        else:
            new = [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (lr - lo) + lo
                   for lr in lrs]
        # between two rates >= 0 the curve never goes below 0: a group frozen at 0 under an eta_min
        # > 0 rounds to -1e-19 in torch's form, taken as 0 here (the optimizer takes no negative rate)
        return [0.0 if v < 0.0 and lo >= 0.0 and base >= 0.0 else v for v, base in zip(new, self.base_lrs)]

    def _get_closed_form_lr(self) -> List[float]:
        lo = self.eta_min
        return [lo + (base - lo) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base in self.base_lrs]


class LinearLR(LRScheduler):
    """The rate's factor moves linearly from start_factor to end_factor over total_iters
    epochs (a warm-up with the defaults)."""

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        if not 0 < start_factor <= 1:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if not 0 <= end_factor <= 1:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor = as_number("start_factor", start_factor)
        self.end_factor = as_number("end_factor", end_factor)
        self.total_iters = _length("total_iters", total_iters, 1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        lrs, t = self._lrs(), self.last_epoch
        if t == 0:
            return [lr * self.start_factor for lr in lrs]
        if self._is_initial or t > self.total_iters:
            return lrs
        d = self.end_factor - self.start_factor
        # the factor never goes below 0 (its ends are >= 0): a decay to end_factor=0 that rounds to
        # -4e-20 at its end in torch's form is 0 here (the optimizer takes no negative rate)
        return [max(lr * (1.0 + d / (self.total_iters * self.start_factor + (t - 1) * d)), 0.0) for lr in lrs]

    def _get_closed_form_lr(self) -> List[float]:
        d = self.end_factor - self.start_factor  # (a factor >= 0, as get_lr's)
        return [max(base * (self.start_factor + d * min(self.total_iters, self.last_epoch) / self.total_iters), 0.0)
                for base in self.base_lrs]


class MultiplicativeLR(_LambdaSchedule):
    """The rate times lr_lambda(epoch) at each step after the first."""

    def get_lr(self) -> List[float]:
        if self._is_initial:
            return self._lrs()
        return [lr * fn(self.last_epoch) for fn, lr in zip(self.lr_lambdas, self._lrs())]


class ConstantLR(LRScheduler):
    """The rate times factor for the first total_iters epochs, then the rate itself."""

    def __init__(self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1) -> None:
        if not 0 <= factor <= 1:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        self.factor = as_number("factor", factor)
        self.total_iters = _length("total_iters", total_iters, 0)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0:
            return [lr * self.factor for lr in self._lrs()]
        if self.last_epoch != self.total_iters:
            return self._lrs()
        if self.factor == 0:  # torch divides by it; the rates it comes back to are the initial ones
            return list(self.base_lrs)
        return [lr * (1.0 / self.factor) for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * (self.factor + (self.last_epoch >= self.total_iters) * (1 - self.factor))
                for base in self.base_lrs]


class PolynomialLR(LRScheduler):
    """base_lr (1 - t / total_iters)^power, reaching 0 at total_iters, in torch's recursive form."""

    def __init__(self, optimizer: Any, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1) -> None:
        self.total_iters = _length("total_iters", total_iters, 1)
        self.power = as_number("power", power)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, T = self.last_epoch, self.total_iters
        if self._is_initial or t > T:
            return self._lrs()
        decay = ((1.0 - t / T) / (1.0 - (t - 1) / T)) ** self.power
        return [lr * decay for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        decay = (1.0 - min(self.total_iters, self.last_epoch) / self.total_iters) ** self.power
        return [base * decay for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing from base_lr to eta_min over T_i epochs, then again (a warm restart),
    each period T_mult times the last (SGDR)."""

    def __init__(self, optimizer: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        if not _is_int(T_0) or T_0 <= 0:
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if not _is_int(T_mult) or T_mult < 1:
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        T_0, T_mult = int(T_0), int(T_mult)
        if isinstance(eta_min, bool) or not isinstance(eta_min, numbers.Real):
            raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}")
        self.T_0, self.T_i, self.T_mult, self.eta_min = T_0, T_0, T_mult, eta_min
        self.T_cur: Any = last_epoch
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        lo = self.eta_min
        return [lo + (base - lo) * (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2 for base in self.base_lrs]

    def step(self, epoch: Any = None) -> None:  # type: ignore[override]
        """The next epoch, or (torch's older form) the given one, fractions allowed."""
        saved = (self.T_cur, self.T_i, self.last_epoch)
        self._get_lr_called_within_step = True
        try:
            if epoch is None and self.last_epoch < 0:
                epoch = 0
            if epoch is None:
                epoch = self.last_epoch + 1
                self.T_cur = self.T_cur + 1
                if self.T_cur >= self.T_i:
                    self.T_cur = self.T_cur % self.T_i
                    self.T_i = self.T_i * self.T_mult
            else:
                if isinstance(epoch, bool) or not isinstance(epoch, numbers.Real) or math.isnan(epoch) \
                        or math.isinf(epoch):
                    raise ValueError(f"epoch must be a finite number >= 0, got {epoch!r}")
                if epoch < 0:
                    raise ValueError(f"Expected non-negative epoch, but got {epoch}")
                if epoch >= self.T_0:
                    if self.T_mult == 1:
                        self.T_cur = epoch % self.T_0
                    else:
                        n = int(math.log(epoch / self.T_0 * (self.T_mult - 1) + 1, self.T_mult))
                        self.T_cur = epoch - self.T_0 * (self.T_mult ** n - 1) / (self.T_mult - 1)
                        self.T_i = self.T_0 * self.T_mult ** n
                else:
                    self.T_i = self.T_0
                    self.T_cur = epoch
            self.last_epoch = math.floor(epoch)
            self.optimizer._set_group_lrs(self.get_lr())
        except BaseException:
            self.T_cur, self.T_i, self.last_epoch = saved
            raise
        finally:
            self._get_lr_called_within_step = False
        self._last_lr = self.optimizer._group_lrs()

    def _update_lr(self, epoch: Optional[int]) -> None:
        self.step(epoch)


class OneCycleLR(LRScheduler):
    """The 1cycle policy, stepped after every optimizer step: the rate rises from
    max_lr / div_factor to max_lr over pct_start of total_steps, then anneals to
    initial_lr / final_div_factor (three_phase: back down to the initial rate first), cosine or
    linear, in every param group (max_lr: a number, or a list with one per group); with
    cycle_momentum the momentum (Adam's beta1, SGD's momentum) moves the other way, between
    max_momentum and base_momentum (each a number, or a list with one per group). As torch's, it keeps max_lr, min_lr and
    the momenta in each param group too (optimizer.param_groups[i]["max_lr"], ...), so that the
    optimizer's state_dict carries them: a value set or loaded there is the one the next step
    takes."""

    _GROUP_KEYS = ("max_lr", "min_lr", "max_momentum", "base_momentum")

    def __init__(self, optimizer: Any, max_lr: Any, total_steps: Optional[int] = None, epochs: Optional[int] = None,
                 steps_per_epoch: Optional[int] = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum: Any = 0.85, max_momentum: Any = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1) -> None:
        optimizer = _optimizer(optimizer)
        if total_steps is not None:
            if not _is_int(total_steps) or total_steps <= 0:
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            self.total_steps = int(total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            if not _is_int(epochs) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not _is_int(steps_per_epoch) or steps_per_epoch <= 0:
                raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            self.total_steps = int(epochs) * int(steps_per_epoch)
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        n = self.total_steps
        if three_phase:
            self._schedule_phases = [
                {"end_step": float(pct_start * n) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
                 "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
                {"end_step": float(2 * pct_start * n) - 2, "start_lr": "max_lr", "end_lr": "initial_lr",
                 "start_momentum": "base_momentum", "end_momentum": "max_momentum"},
                {"end_step": n - 1, "start_lr": "initial_lr", "end_lr": "min_lr",
                 "start_momentum": "max_momentum", "end_momentum": "max_momentum"}]
        else:
            self._schedule_phases = [
                {"end_step": float(pct_start * n) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
                 "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
                {"end_step": n - 1, "start_lr": "max_lr", "end_lr": "min_lr",
                 "start_momentum": "base_momentum", "end_momentum": "max_momentum"}]
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
        self._anneal_func_type = anneal_strategy
        tops = _per_group("max_lr", max_lr, optimizer)
        for top in tops:
            if not 0 <= top < math.inf:
                raise ValueError(f"max_lr must be a finite rate >= 0 (each group's), got {max_lr!r}")
        for name, v in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        div_factor = as_number("div_factor", div_factor)
        final_div_factor = as_number("final_div_factor", final_div_factor)
        # torch keeps these in each param group; here the schedule keeps them (and its state_dict)
        self._groups = [{"initial_lr": top / div_factor, "max_lr": top, "min_lr": top / div_factor / final_div_factor}
                        for top in tops]
        if last_epoch != -1:
            for group, initial in zip(self._groups, optimizer._initial_lrs):
                if initial is not None:
                    group["initial_lr"] = initial
        self.cycle_momentum = as_flag("cycle_momentum", cycle_momentum)
        if self.cycle_momentum:
            self.use_beta1 = optimizer._kind == "adam"
            tops = _per_group("max_momentum", max_momentum, optimizer)
            bottoms = _per_group("base_momentum", base_momentum, optimizer)
            for group, top, bottom in zip(self._groups, tops, bottoms):
                group["max_momentum"], group["base_momentum"] = top, bottom
        # the optimizer changes only once everything is checked, and goes back when the first step fails
        before = (list(optimizer._initial_lrs), optimizer._group_lrs(), optimizer._momenta(),
                  [dict(g._extra) for g in optimizer.param_groups])
        try:
            if self.cycle_momentum:
                for key in ("base_momentum", "max_momentum"):  # refused here if the optimizer cannot take them
                    optimizer._set_momentum([g[key] for g in self._groups])
            if last_epoch == -1:
                optimizer._initial_lrs = [group["initial_lr"] for group in self._groups]
                self._mirror(optimizer)  # torch sets them in the groups; resuming, it takes the groups' values
            super().__init__(optimizer, last_epoch)
            self._mirror()
        except BaseException:
            optimizer._initial_lrs = before[0]
            optimizer._set_group_lrs(before[1])
            optimizer._set_momentum(before[2])
            for g, extra in zip(optimizer.param_groups, before[3]):
                g._extra = extra
            raise

    def _mirror(self, optimizer: Any = None, only_unchanged: bool = False) -> None:
        """The schedule's max_lr, min_lr and momenta written into the param groups, as torch keeps
        them; only_unchanged: only where a group still holds what was last written or read there
        (a value set in the group, or loaded with the optimizer's state_dict, stays)."""
        optimizer = optimizer or self.optimizer
        seen = getattr(self, "_seen", None)
        for i, (group, mine) in enumerate(zip(optimizer.param_groups, self._groups)):
            for k in self._GROUP_KEYS:
                if k not in mine or (only_unchanged and seen and group._extra.get(k, mine[k]) != seen[i].get(k)):
                    continue
                group._extra[k] = mine[k]
        self._note_seen(optimizer)

    def _adopt(self) -> None:
        """The param groups' values, where code set or loaded them there (torch reads them from the
        groups at each step), checked all together before any is taken."""
        taken = []
        for i, (group, mine) in enumerate(zip(self.optimizer.param_groups, self._groups)):
            initial = self.optimizer._initial_lrs[i]
            found = {k: group._extra[k] for k in self._GROUP_KEYS if k in mine and k in group._extra}
            if initial is not None:
                found["initial_lr"] = initial
            for key, value in found.items():
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                    raise ValueError(f"param_groups[{i}][{key!r}] must be a finite number >= 0, got {value!r}")
            taken.append({k: float(v) for k, v in found.items()})
        for mine, found in zip(self._groups, taken):
            mine.update(found)
        self._note_seen(self.optimizer)

    def _note_seen(self, optimizer: Any) -> None:
        """What the groups hold now of the keys this schedule keeps there (see _mirror)."""
        self._seen = [{k: g._extra[k] for k in self._GROUP_KEYS if k in g._extra} for g in optimizer.param_groups]

    @staticmethod
    def _annealing_cos(start: float, end: float, pct: float) -> float:
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)

    @staticmethod
    def _annealing_linear(start: float, end: float, pct: float) -> float:
        return (end - start) * pct + start

    def get_lr(self) -> List[float]:
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times. The specified number of total steps is {self.total_steps}")
        anneal = self._annealing_cos if self._anneal_func_type == "cos" else self._annealing_linear
        self._adopt()
        start = 0.0
        for i, phase in enumerate(self._schedule_phases):
            end = phase["end_step"]
            if step <= end or i == len(self._schedule_phases) - 1:
                pct = (step - start) / (end - start)
                break
            start = phase["end_step"]
        # one step past the last (total_steps: the step torch code takes after its last optimizer
        # step) the linear strategy extrapolates below 0, which torch sets and never trains with;
        # the optimizer here takes no negative rate, so that step's rate is 0
        lrs = [max(anneal(g[phase["start_lr"]], g[phase["end_lr"]], pct), 0.0) for g in self._groups]
        if self.cycle_momentum:
            momenta = []
            for g in self._groups:
                a, b = g[phase["start_momentum"]], g[phase["end_momentum"]]
                # likewise, that step's linear momentum goes past the phase's end (Adam's beta1 to 1
                # and over, which Adam refuses): it stays at the end's value
                momenta.append(min(max(anneal(a, b, pct), min(a, b)), max(a, b)))
            self.optimizer._set_momentum(momenta)
        return lrs

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Also takes the state_dict of an older one-group schedule, which kept "_group"."""
        if "_group" in state_dict and "_groups" not in state_dict:
            state_dict = {**{k: v for k, v in state_dict.items() if k != "_group"}, "_groups": [state_dict["_group"]]}
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_seen"})
        # the loaded values go into the groups where they hold what this schedule put there; a value
        # set in a group since, or loaded with the optimizer's state_dict, wins, as torch reads the groups
        self._mirror(only_unchanged=True)

    def state_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "_seen"}


def _steps(name: str, value: Any) -> float:
    """A number of steps (an int, or a float as torch allows): finite, >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of steps, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number of steps >= 0, got {value!r}") from None
    if not 0 <= v < math.inf:
        raise ValueError(f"{name} must be a finite number of steps >= 0, got {value!r}")
    return v


class CyclicLR(LRScheduler):
    """Cyclical learning rates, stepped after every optimizer step: the rate goes from base_lr up
    to max_lr over step_size_up steps and back over step_size_down (default: the same), the
    cycle's height scaled by mode ("triangular": 1, "triangular2": halved each cycle,
    "exp_range": gamma ** step) or by scale_fn (of the cycle, or with scale_mode="iterations" of
    the step), in every param group (base_lr, max_lr: a number, or a list with one per group);
    with cycle_momentum the momentum (Adam's beta1, SGD's momentum) moves the other way, between
    max_momentum and base_momentum (each a number, or a list with one per group)."""

    def __init__(self, optimizer: Any, base_lr: Any, max_lr: Any, step_size_up: int = 2000,
                 step_size_down: Optional[int] = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_fn: Optional[Callable[[float], float]] = None, scale_mode: str = "cycle",
                 cycle_momentum: bool = True, base_momentum: Any = 0.8, max_momentum: Any = 0.9,
                 last_epoch: int = -1) -> None:
        optimizer = _optimizer(optimizer)
        lows, self.max_lrs = _per_group("base_lr", base_lr, optimizer), _per_group("max_lr", max_lr, optimizer)
        up = _steps("step_size_up", step_size_up)
        down = _steps("step_size_down", step_size_down) if step_size_down is not None else up
        if up == 0:
            raise ValueError("step_size_up must be > 0 (the cycle's first half divides by it)")
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        if mode not in ("triangular", "triangular2", "exp_range") and scale_fn is None:
            raise ValueError("mode is invalid and scale_fn is None")
        if scale_fn is not None and not callable(scale_fn):
            raise TypeError(f"scale_fn must be callable, got {type(scale_fn).__name__}")
        self.mode, self.gamma, self._scale_fn_custom = mode, as_number("gamma", gamma), scale_fn
        self.scale_mode = scale_mode if scale_fn is not None else "iterations" if mode == "exp_range" else "cycle"
        self.cycle_momentum = as_flag("cycle_momentum", cycle_momentum)
        if self.cycle_momentum:
            self.use_beta1 = optimizer._kind == "adam"
            self.base_momentums = _per_group("base_momentum", base_momentum, optimizer)
            self.max_momentums = _per_group("max_momentum", max_momentum, optimizer)
        # the optimizer changes only once everything is checked, and goes back when the first step fails
        before = (list(optimizer._initial_lrs), optimizer._group_lrs(), optimizer._momenta(),
                  [dict(g._extra) for g in optimizer.param_groups])
        try:
            if self.cycle_momentum:
                for ms in (self.base_momentums, self.max_momentums):
                    optimizer._set_momentum(list(ms))  # refused here if the optimizer cannot take them
            if last_epoch == -1:
                optimizer._set_group_lrs(lows)
                if self.cycle_momentum:  # kept in the groups, as torch's (which reads them no more)
                    for group, top, bottom in zip(optimizer.param_groups, self.max_momentums, self.base_momentums):
                        group["max_momentum"], group["base_momentum"] = top, bottom
            super().__init__(optimizer, last_epoch)
        except BaseException:
            optimizer._initial_lrs = before[0]
            optimizer._set_group_lrs(before[1])
            optimizer._set_momentum(before[2])
            for group, extra in zip(optimizer.param_groups, before[3]):
                group._extra = extra
            raise
        self.base_lrs = lows  # after the first step, as in torch (which takes initial_lr for it)

    def scale_fn(self, x: float) -> float:
        if self._scale_fn_custom is not None:
            return self._scale_fn_custom(x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma ** x

    def get_lr(self) -> List[float]:
        cycle = math.floor(1 + self.last_epoch / self.total_size)
        x = 1.0 + self.last_epoch / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
        at = cycle if self.scale_mode == "cycle" else self.last_epoch
        lrs = [base + (top - base) * scale_factor * self.scale_fn(at) for base, top in zip(self.base_lrs, self.max_lrs)]
        if self.cycle_momentum:
            self.optimizer._set_momentum([top - (top - bottom) * scale_factor * self.scale_fn(at)
                                          for top, bottom in zip(self.max_momentums, self.base_momentums)])
        return lrs

    def state_dict(self) -> Dict[str, Any]:
        """As torch's: scale_fn is kept only as the attributes of a callable object that is not a
        plain function (None otherwise)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_scale_fn_custom")}
        fn = self._scale_fn_custom
        state["_scale_fn_custom"] = None if fn is None or isinstance(fn, types.FunctionType) else dict(fn.__dict__)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("_scale_fn_custom")
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "_scale_fn_custom"})
        if saved is not None and self._scale_fn_custom is not None:
            self._scale_fn_custom.__dict__.update(saved)


def _check_parts(kind: str, optimizer: Any, schedulers: Sequence[Any]) -> None:
    """The schedules a SequentialLR or ChainedScheduler is made of: at least one, of one optimizer,
    none that steps with a metric."""
    if len(schedulers) < 1:
        raise ValueError(f"{kind} expects at least one scheduler, but got no scheduler.")
    for i, s in enumerate(schedulers):
        if not isinstance(s, LRScheduler):
            raise TypeError(f"{kind} at index {i} should be a cmlp.optim.lr_scheduler schedule, got "
                            f"{type(s).__name__}")
        if isinstance(s, ReduceLROnPlateau):
            raise ValueError(f"{kind} does not support `ReduceLROnPlateau` scheduler as it requires additional "
                             f"kwargs to be specified when calling `step`, but got one at index {i} in the given "
                             "schedulers sequence.")
        if s.optimizer is not optimizer:
            raise ValueError(f"{kind} expects all schedulers to belong to the same optimizer, but got scheduler "
                             f"{type(s).__name__} at index {i} of another")


class _Composite(LRScheduler):
    """A schedule made of schedules: its state_dict holds theirs."""

    _schedulers: List[LRScheduler]

    def state_dict(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        parts = state_dict["_schedulers"]
        if len(parts) != len(self._schedulers):
            raise ValueError(f"the state_dict holds {len(parts)} schedules; this one is made of "
                             f"{len(self._schedulers)}")
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "_schedulers"})
        for s, part in zip(self._schedulers, parts):
            s.load_state_dict(part)


class SequentialLR(_Composite):
    """One schedule after another: schedulers[i] from milestones[i - 1] on, each started afresh
    at its milestone (the usual warm-up, then decay:
    SequentialLR(opt, [LinearLR(opt, 0.01, total_iters=500), CosineAnnealingLR(opt, T_max=9500)],
    milestones=[500]))."""

    def __init__(self, optimizer: Any, schedulers: Sequence[Any], milestones: Sequence[int],
                 last_epoch: int = -1) -> None:
        optimizer = _optimizer(optimizer)
        schedulers = list(schedulers)
        _check_parts("SequentialLR", optimizer, schedulers)
        milestones = [_int("milestones", m, 0) for m in milestones]
        if len(milestones) != len(schedulers) - 1:
            raise ValueError("Sequential Schedulers expects number of schedulers provided to be one more than the "
                             f"number of milestone points, but got number of schedulers {len(schedulers)} and the "
                             f"number of milestones to be equal to {len(milestones)}")
        self._schedulers, self._milestones = schedulers, milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for i, initial in enumerate(optimizer._initial_lrs):
            if initial is None:
                raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}]")
        # the parts' first steps are undone, and only the first's made again
        optimizer._set_group_lrs(optimizer._initial_lrs)
        self._undo(self)
        first = self._schedulers[bisect_right(milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def _undo(self, sched: Any) -> None:
        if hasattr(sched, "_schedulers"):
            for s in sched._schedulers:
                self._undo(s)
        elif hasattr(sched, "last_epoch"):
            sched.last_epoch -= 1

    def step(self) -> None:
        self.last_epoch += 1
        i = bisect_right(self._milestones, self.last_epoch)
        sched = self._schedulers[i]
        try:
            if i > 0 and self._milestones[i - 1] == self.last_epoch:
                sched._update_lr(0)
            else:
                sched.step()
        except BaseException:
            self.last_epoch -= 1
            raise
        self._last_lr = sched.get_last_lr()

    def _update_lr(self, epoch: Optional[int]) -> None:
        raise TypeError("a SequentialLR cannot be placed at an epoch")


class ChainedScheduler(_Composite):
    """Several schedules stepped together, each on the rate the one before it set (their
    factors multiply)."""

    def __init__(self, schedulers: Sequence[Any], optimizer: Any = None) -> None:
        schedulers = list(schedulers)
        if schedulers and optimizer is None:
            optimizer = getattr(schedulers[0], "optimizer", None)
        optimizer = _optimizer(optimizer)
        _check_parts("ChainedScheduler", optimizer, schedulers)
        self._schedulers = schedulers
        self.optimizer = optimizer
        self._last_lr = optimizer._group_lrs()

    def step(self) -> None:
        """Steps every schedule; one that refuses its rate leaves them all (and the optimizer's
        rates and momentum) where they were."""
        saved = [s.state_dict() for s in self._schedulers]
        lrs, momentum = self.optimizer._group_lrs(), self.optimizer._momenta()
        try:
            for s in self._schedulers:
                s.step()
        except BaseException:
            for s, state in zip(self._schedulers, saved):
                s.load_state_dict(state)
            self.optimizer._set_group_lrs(lrs)
            self.optimizer._set_momentum(momentum)
            raise
        self._last_lr = self.optimizer._group_lrs()

    def _update_lr(self, epoch: Optional[int]) -> None:
        raise TypeError("a ChainedScheduler cannot be placed at an epoch")


class ReduceLROnPlateau(LRScheduler):
    """The rate times factor once the metric given to step() has not improved (by threshold,
    relative or absolute) for more than patience epochs, then cooldown epochs of rest; each
    param group's rate never below its min_lr (a number, or a list with one per group), and not
    by less than eps. Trainer.fit steps it with each epoch's val_loss
    (the training loss without validation data)."""

    def __init__(self, optimizer: Any, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: Any = 0,
                 eps: float = 1e-8) -> None:
        if not factor < 1.0:  # NaN too
            raise ValueError("Factor should be < 1.0.")
        self.optimizer = _optimizer(optimizer)
        n = len(optimizer.param_groups)
        if isinstance(min_lr, (list, tuple)):
            if len(min_lr) != n:
                raise ValueError(f"expected {n} min_lrs, got {len(min_lr)}")
            min_lrs = list(min_lr)
        else:
            min_lrs = [min_lr] * n
        for lo in min_lrs:
            if not 0.0 <= as_number("min_lr", lo) < inf:
                raise ValueError(f"min_lr must be a finite number >= 0 (a rate), got {lo!r}")
        self.factor, self.min_lrs = as_number("factor", factor), [float(lo) for lo in min_lrs]
        # torch's: the min_lr every group takes when the optimizer's groups change (None for a list)
        self.default_min_lr = None if isinstance(min_lr, (list, tuple)) else float(min_lr)
        self.patience = _int("patience", patience, 0)
        self.cooldown = _int("cooldown", cooldown, 0)
        self.eps = as_number("eps", eps)
        self.last_epoch = 0
        self._last_lr = optimizer._group_lrs()
        self._init_is_better(mode, threshold, threshold_mode)
        self._reset()

    def _init_is_better(self, mode: str, threshold: float, threshold_mode: str) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        self.mode_worse = inf if mode == "min" else -inf
        self.mode, self.threshold, self.threshold_mode = mode, as_number("threshold", threshold), threshold_mode

    def _reset(self) -> None:
        self.best = self.mode_worse
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    def _is_better(self, a: float, best: float) -> bool:
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min":
            return a < best - self.threshold
        if self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    @property
    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def step(self, metrics: Any, epoch: Optional[int] = None) -> None:  # type: ignore[override]
        """A rate the optimizer refuses raises and leaves the schedule where it was. epoch
        (deprecated, as in torch): the epoch this one counts as."""
        current = float(metrics)
        if epoch is not None:
            epoch = _deprecated_epoch(epoch)
        saved = {k: v for k, v in self.__dict__.items() if k != "optimizer"}
        try:
            self._step(current, epoch)
        except BaseException:
            self.__dict__.update(saved)
            raise

    def _step(self, current: float, epoch: Optional[int] = None) -> None:
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self._is_better(current, self.best):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            self._reduce_lr()
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = self.optimizer._group_lrs()

    def _reduce_lr(self) -> None:
        """Each group's rate times factor, not below its min_lr; a group whose rate would fall by
        eps or less keeps it."""
        lrs = self.optimizer._group_lrs()
        reduced = []
        for old, lo in zip(lrs, self.min_lrs):
            old = float(old)
            new = max(old * self.factor, lo)
            reduced.append(new if old - new > self.eps else old)
        if reduced != lrs:
            self.optimizer._set_group_lrs(reduced)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.__dict__.update(state_dict)
        self._init_is_better(self.mode, self.threshold, self.threshold_mode)
