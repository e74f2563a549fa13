"""ReduceLROnPlateau: the rate cut once a metric stops improving."""
from math import inf
from typing import Any, Mapping, Optional

from ..._arrays import as_number
from ._base import LRScheduler, _check_state, _deprecated_epoch, _int, _one_per_group, _optimizer


class ReduceLROnPlateau(LRScheduler):
    """The rate times factor once the metric given to step() has not improved (by threshold,
    relative or absolute) for more than patience epochs, then cooldown epochs of rest; each
    param group's rate never below its min_lr (a number, or a list with one per group), and not
    by less than eps. Trainer.fit steps it with each epoch's val_loss
    (the training loss without validation data)."""

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "patience": 0, "cooldown": 0, "factor": 0, "eps": 0}
    _LOADED_NONE_OK = frozenset({"default_min_lr"})  # None with one min_lr per group
    _LOADED_INF_OK = frozenset({"best", "mode_worse"})  # the worst value, where no epoch was seen
    _LOADED_PER_GROUP = frozenset({"min_lrs"})

    def __init__(self, optimizer: Any, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: Any = 0,
                 eps: float = 1e-8) -> None:
        if not factor < 1.0:  # NaN too
            raise ValueError("Factor should be < 1.0.")
        if not as_number("factor", factor) >= 0.0:  # (a rate times a negative one is min_lr's at once)
            raise ValueError(f"factor must be in [0, 1) (the rates it makes must be rates), got {factor!r}")
        self.optimizer = _optimizer(optimizer)
        n = len(optimizer.param_groups)
        min_lrs = _one_per_group(min_lr, n, lambda k: f"expected {n} min_lrs, got {k}")
        for lo in min_lrs:
            if not 0.0 <= as_number("min_lr", lo) < inf:
                raise ValueError(f"min_lr must be a finite number >= 0 (a rate), got {lo!r}")
        self.factor, self.min_lrs = as_number("factor", factor), [float(lo) for lo in min_lrs]
        # torch's: the min_lr every group takes when the optimizer's groups change (None for a list)
        self.default_min_lr = None if isinstance(min_lr, (list, tuple)) else float(min_lr)
        self.patience = _int("patience", patience, 0)
        self.cooldown = _int("cooldown", cooldown, 0)
        self.eps = as_number("eps", eps)
        if not 0.0 <= self.eps < inf:  # (NaN: no rate would ever fall)
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
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
        threshold = as_number("threshold", threshold)
        if not abs(threshold) < inf:  # (NaN: no epoch would ever be better)
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        self.mode, self.threshold, self.threshold_mode = mode, threshold, threshold_mode

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

    def step(self, metrics: Any, epoch: Optional[float] = None) -> None:  # type: ignore[override]
        """A rate the optimizer refuses raises and leaves the schedule where it was. epoch
        (deprecated, as in torch): the epoch this one counts as."""
        try:
            current = float(metrics)
        except OverflowError:  # an int beyond every float compares as an infinity of its sign
            current = inf if metrics > 0 else -inf
        if epoch is not None:
            epoch = _deprecated_epoch(epoch)
        saved = {k: v for k, v in self.__dict__.items() if k != "optimizer"}
        try:
            self._step(current, epoch)
        except BaseException:
            self.__dict__.update(saved)
            raise

    def _step(self, current: float, epoch: Optional[float] = None) -> None:
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

    def _check_loaded(self, state_dict: Any) -> None:
        """The modes it compares by and its factor below 1 (checked before anything is taken)."""
        mode, threshold_mode = state_dict.get("mode", self.mode), state_dict.get("threshold_mode", self.threshold_mode)
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        if "factor" in state_dict and not float(state_dict["factor"]) < 1.0:
            raise ValueError(f"state_dict['factor'] must be < 1 (as this ReduceLROnPlateau's constructor takes it), "
                             f"got {state_dict['factor']!r}")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """A state saved with another optimizer's param groups takes its min_lr for each of this
        one's groups where it was made with one for all (torch's default_min_lr); its last rates
        are this optimizer's own. With one min_lr per group it is refused."""
        if isinstance(state_dict, Mapping):
            n = len(self.optimizer.param_groups)
            default, lows = state_dict.get("default_min_lr", self.default_min_lr), state_dict.get("min_lrs")
            if default is not None and isinstance(lows, (list, tuple)) and len(lows) != n:
                state_dict = {**state_dict, "min_lrs": [default] * n}
        state_dict = _check_state(self, state_dict)
        self.__dict__.update(state_dict)
        self._init_is_better(self.mode, self.threshold, self.threshold_mode)
