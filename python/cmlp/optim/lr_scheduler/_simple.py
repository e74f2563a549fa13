"""The schedules whose rate is a rule of the epoch count alone: LambdaLR, MultiplicativeLR, StepLR,
MultiStepLR, ExponentialLR, CosineAnnealingLR and CosineAnnealingWarmRestarts, LinearLR,
ConstantLR, PolynomialLR."""
import math
import numbers
from bisect import bisect_right
from collections import Counter
from typing import Any, Iterable, List, Mapping, Optional

from ..._arrays import as_number
from ._base import _ABOVE_ZERO, LRScheduler, _int, _is_int, _length, _non_negative, _one_per_group, _optimizer


class _LambdaSchedule(LRScheduler):
    """A schedule of a function of the epoch: one for every param group, or a list or tuple
    with one per group."""

    _MOVES_MOMENTUM = True  # the caller's functions may set momenta in the param groups

    def __init__(self, optimizer: Any, lr_lambda: Any, last_epoch: int = -1) -> None:
        n = len(_optimizer(optimizer).param_groups)
        lambdas = _one_per_group(lr_lambda, n, lambda k: f"Expected {n} lr_lambdas, but got {k}")
        for fn in lambdas:
            if not callable(fn):
                raise TypeError(f"lr_lambda must be callable, got {fn!r}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)


class LambdaLR(_LambdaSchedule):
    _LOADED_PER_GROUP = frozenset({"base_lrs"})  # each step's rates are made of them

    """lr = base_lr * lr_lambda(last_epoch)."""

    def get_lr(self) -> List[float]:
        return [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs)]


class StepLR(LRScheduler):
    """The rate times gamma every step_size epochs."""

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "step_size": 1}

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size = _length("step_size", step_size, 1)
        self.gamma = _non_negative("gamma", gamma)
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
        # a Counter, as torch's (whose scheduler, given this state_dict, calls .elements())
        self.milestones: Counter[float] = Counter(sorted(_int("milestones", m, 0) for m in milestones))
        self.gamma = _non_negative("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.milestones = Counter(self.milestones)  # (also from a state_dict with a plain dict)

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
        self.gamma = _non_negative("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self._is_initial:
            return self._lrs()
        return [lr * self.gamma for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """eta_min + (base_lr - eta_min) (1 + cos(pi t / T_max)) / 2, in torch's recursive form."""

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "T_max": 1}
    _LOADED_PER_GROUP = frozenset({"base_lrs"})  # read at each restart of the cosine

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max = _length("T_max", T_max, 1)
        self.eta_min = _non_negative("eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, T, lo = self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return self._lrs()
        if self._step_count == 1 and t > 0:
            return [lo + (base - lo) * (1 + math.cos(t * math.pi / T)) / 2 for base in self.base_lrs]
        lrs = self.optimizer._lrs  # (read only)
        if (t - 1 - T) % (2 * T) == 0:
            new = [lr + (base - lo) * (1 - math.cos(math.pi / T)) / 2 for base, lr in zip(self.base_lrs, lrs)]
        else:
            ratio = (1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))  # (torch's order)
            new = [ratio * (lr - lo) + lo for lr in lrs]
        # between two rates >= 0 the curve never goes below 0: a group frozen at 0 under an eta_min
        # > 0 rounds to -1e-19 in torch's form, taken as 0 here (the optimizer takes no negative rate)
        if not min(new) >= 0.0:  # (a NaN as well: the list as it is then; eta_min is >= 0)
            new = [0.0 if v < 0.0 and base >= 0.0 else v for v, base in zip(new, self.base_lrs)]
        return new

    def _get_closed_form_lr(self) -> List[float]:
        lo = self.eta_min
        return [lo + (base - lo) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base in self.base_lrs]


class LinearLR(LRScheduler):
    """The rate's factor moves linearly from start_factor to end_factor over total_iters
    epochs (a warm-up with the defaults)."""

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "total_iters": 0, "start_factor": _ABOVE_ZERO}

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        if not 0 < start_factor <= 1:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if not 0 <= end_factor <= 1:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor = as_number("start_factor", start_factor)
        self.end_factor = as_number("end_factor", end_factor)
        self.total_iters = _length("total_iters", total_iters, 0)  # (0: torch's form stays at start_factor)
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
        if not self.total_iters:  # (torch's divides by 0) where get_lr's steps stay: start_factor
            return [base * self.start_factor for base in self.base_lrs]
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

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "total_iters": 0}

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

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "total_iters": 0}

    def __init__(self, optimizer: Any, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1) -> None:
        self.total_iters = _length("total_iters", total_iters, 0)  # (0: torch's form keeps the rate)
        self.power = _non_negative("power", power)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, T = self.last_epoch, self.total_iters
        if self._is_initial or t > T:
            return self._lrs()
        decay = ((1.0 - t / T) / (1.0 - (t - 1) / T)) ** self.power
        return [lr * decay for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        if not self.total_iters:  # (torch's divides by 0) where get_lr's steps stay: the rate
            return list(self.base_lrs)
        decay = (1.0 - min(self.total_iters, self.last_epoch) / self.total_iters) ** self.power
        return [base * decay for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing from base_lr to eta_min over T_i epochs, then again (a warm restart),
    each period T_mult times the last (SGDR)."""

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "T_0": 1, "T_i": 1, "T_mult": 1}
    _LOADED_PER_GROUP = frozenset({"base_lrs"})

    def __init__(self, optimizer: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        if not _is_int(T_0) or T_0 <= 0:
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if not _is_int(T_mult) or T_mult < 1:
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        T_0, T_mult = int(T_0), int(T_mult)
        if max(T_0, T_mult) >= 1 << 63:  # (the periods' ratios are floats)
            raise ValueError(f"T_0 and T_mult must be below 2**63, got {T_0} and {T_mult}")
        if isinstance(eta_min, bool) or not isinstance(eta_min, numbers.Real):
            raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}")
        _non_negative("eta_min", eta_min)
        self.T_0: int = T_0
        self.T_i: int = T_0
        self.T_mult: int = T_mult
        self.eta_min: float = eta_min
        self.T_cur: Any = last_epoch
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        lo = self.eta_min
        return [lo + (base - lo) * (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2 for base in self.base_lrs]

    def step(self, epoch: Optional[float] = None) -> None:
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

    def _update_lr(self, epoch: Optional[float]) -> None:
        self.step(epoch)
