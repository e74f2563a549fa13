"""cmlp.optim.lr_scheduler: torch.optim.lr_scheduler's schedules, with torch's names, defaults,
formulas (the same recursive forms, so the rates are torch's to the last bit) and state_dict,
over a cmlp optimizer's learning rate.

    opt = cmlp.optim.Adam(model.parameters(), lr=1e-3)
    sched = cmlp.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    for epoch in range(5):
        trainer.fit(x, y, epochs=1)      # or: Trainer.fit(..., epochs=5, scheduler=sched)
        sched.step()

A schedule only sets `optimizer.lr`; inside `Trainer.fit` the rate of an epoch is the one set
before it (a step captured as a CUDA graph is captured again when the rate changes).
"""
import math
from math import inf
from typing import Any, Callable, Dict, Iterable, List

__all__ = ["LRScheduler", "LambdaLR", "StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR",
           "ReduceLROnPlateau"]


def _optimizer(optimizer: Any) -> Any:
    from . import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a cmlp optimizer")
    return optimizer


def _int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


class LRScheduler:
    """Base: last_epoch counts step() calls (-1 before the first, which the constructor makes);
    base_lrs holds the optimizer's rate when the schedule began (torch's 'initial_lr')."""

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        self.optimizer = _optimizer(optimizer)
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"last_epoch must be an int >= -1, got {last_epoch!r}")
        if last_epoch == -1:
            if optimizer._initial_lr is None:  # the first schedule of the optimizer sets it (torch's setdefault)
                optimizer._initial_lr = optimizer.lr
        elif optimizer._initial_lr is None:
            raise KeyError("param 'initial_lr' is not specified in param_groups[0] when resuming an optimizer")
        self.base_lrs: List[float] = [optimizer._initial_lr]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._is_initial = True
        self.step()
        self._is_initial = False

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def get_last_lr(self) -> List[float]:
        """The rate the last step() set."""
        return self._last_lr

    def step(self) -> None:
        """Moves the schedule one epoch (or step) on and sets the optimizer's rate. A rate the
        optimizer refuses (negative, not finite) raises and leaves the schedule where it was."""
        self._step_count += 1
        self.last_epoch += 1
        try:
            self.optimizer.lr = self.get_lr()[0]
        except BaseException:
            self._step_count -= 1
            self.last_epoch -= 1
            raise
        self._last_lr = [self.optimizer.lr]

    def state_dict(self) -> Dict[str, Any]:
        """Everything but the optimizer (and, as in torch, a LambdaLR's functions)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})

    def _lr(self) -> float:
        return self.optimizer.lr


class LambdaLR(LRScheduler):
    """lr = base_lr * lr_lambda(last_epoch)."""

    def __init__(self, optimizer: Any, lr_lambda: Callable[[int], float], last_epoch: int = -1) -> None:
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != 1:
                raise ValueError(f"Expected 1 lr_lambdas (one param group), but got {len(lr_lambda)}")
            lr_lambda = lr_lambda[0]
        if not callable(lr_lambda):
            raise TypeError(f"lr_lambda must be callable, got {lr_lambda!r}")
        self.lr_lambdas = [lr_lambda]
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        return [self.base_lrs[0] * self.lr_lambdas[0](self.last_epoch)]


class StepLR(LRScheduler):
    """The rate times gamma every step_size epochs."""

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size = _int("step_size", step_size, 1)
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [self._lr()]
        return [self._lr() * self.gamma]


class MultiStepLR(LRScheduler):
    """The rate times gamma at each milestone (gamma**k at a milestone given k times)."""

    def __init__(self, optimizer: Any, milestones: Iterable[int], gamma: float = 0.1, last_epoch: int = -1) -> None:
        counts: Dict[int, int] = {}
        for m in milestones:
            m = _int("milestones", m, 0)
            counts[m] = counts.get(m, 0) + 1
        self.milestones = dict(sorted(counts.items()))
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch not in self.milestones:
            return [self._lr()]
        return [self._lr() * self.gamma ** self.milestones[self.last_epoch]]


class ExponentialLR(LRScheduler):
    """The rate times gamma every epoch."""

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self._is_initial:
            return [self._lr()]
        return [self._lr() * self.gamma]


class CosineAnnealingLR(LRScheduler):
    """eta_min + (base_lr - eta_min) (1 + cos(pi t / T_max)) / 2, in torch's recursive form."""

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max = _int("T_max", T_max, 1)
        self.eta_min = float(eta_min)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, T, lo, base, lr = self.last_epoch, self.T_max, self.eta_min, self.base_lrs[0], self._lr()
        if self._is_initial:
            return [lr]
        if self._step_count == 1 and t > 0:
            return [lo + (base - lo) * (1 + math.cos(t * math.pi / T)) / 2]
        if (t - 1 - T) % (2 * T) == 0:
            return [lr + (base - lo) * (1 - math.cos(math.pi / T)) / 2]
        return [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (lr - lo) + lo]


class LinearLR(LRScheduler):
    """The rate's factor moves linearly from start_factor to end_factor over total_iters
    epochs (a warm-up with the defaults)."""

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        if not 0 < start_factor <= 1:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if not 0 <= end_factor <= 1:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor, self.end_factor = float(start_factor), float(end_factor)
        self.total_iters = _int("total_iters", total_iters, 1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        lr, t = self._lr(), self.last_epoch
        if t == 0:
            return [lr * self.start_factor]
        if self._is_initial or t > self.total_iters:
            return [lr]
        d = self.end_factor - self.start_factor
        return [lr * (1.0 + d / (self.total_iters * self.start_factor + (t - 1) * d))]


class ReduceLROnPlateau(LRScheduler):
    """The rate times factor once the metric given to step() has not improved (by threshold,
    relative or absolute) for more than patience epochs, then cooldown epochs of rest; never
    below min_lr, and not by less than eps. Trainer.fit steps it with each epoch's val_loss
    (the training loss without validation data)."""

    def __init__(self, optimizer: Any, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: Any = 0,
                 eps: float = 1e-8) -> None:
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        self.optimizer = _optimizer(optimizer)
        if isinstance(min_lr, (list, tuple)):
            if len(min_lr) != 1:
                raise ValueError(f"expected 1 min_lrs, got {len(min_lr)}")
            min_lr = min_lr[0]
        self.factor, self.min_lrs = float(factor), [float(min_lr)]
        self.patience = _int("patience", patience, 0)
        self.cooldown = _int("cooldown", cooldown, 0)
        self.eps = float(eps)
        self.last_epoch = 0
        self._last_lr = [optimizer.lr]
        self._init_is_better(mode, threshold, threshold_mode)
        self._reset()

    def _init_is_better(self, mode: str, threshold: float, threshold_mode: str) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        self.mode_worse = inf if mode == "min" else -inf
        self.mode, self.threshold, self.threshold_mode = mode, float(threshold), threshold_mode

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

    def step(self, metrics: Any) -> None:  # type: ignore[override]
        current = float(metrics)
        self.last_epoch += 1
        if self._is_better(current, self.best):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            old = float(self.optimizer.lr)
            new = max(old * self.factor, self.min_lrs[0])
            if old - new > self.eps:
                self.optimizer.lr = new
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = [self.optimizer.lr]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.__dict__.update(state_dict)
        self._init_is_better(self.mode, self.threshold, self.threshold_mode)
