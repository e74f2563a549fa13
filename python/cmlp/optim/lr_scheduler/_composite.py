"""Schedules made of schedules: SequentialLR (one after another) and ChainedScheduler (all
together)."""
from bisect import bisect_right
from typing import Any, Dict, List, Mapping, Optional, Sequence
from ._base import LRScheduler, _check_state, _int, _optimizer
from ._plateau import ReduceLROnPlateau


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

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state_dict = _check_state(self, state_dict)
        parts = state_dict.get("_schedulers")
        if not isinstance(parts, (list, tuple)) or len(parts) != len(self._schedulers):
            raise ValueError(f"the state_dict holds {len(parts) if isinstance(parts, (list, tuple)) else 'no'} "
                             f"schedules; this one is made of {len(self._schedulers)}")
        for s, part in zip(self._schedulers, parts):  # all checked before any is loaded (and again as loaded)
            _check_state(s, part)
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
        for i, s in enumerate(schedulers[1:], 1):  # refused now, not at its milestone (torch's: an epoch in)
            if isinstance(s, _Composite):
                raise TypeError(f"SequentialLR starts schedulers[{i}] afresh, at epoch 0, at its milestone, and a "
                                f"{type(s).__name__} cannot be placed at an epoch: only the first scheduler may be one")
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

    def step(self) -> None:  # type: ignore[override]  # as torch's: no epoch
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

    def _update_lr(self, epoch: Optional[float]) -> None:
        raise TypeError("a SequentialLR cannot be placed at an epoch")


class ChainedScheduler(_Composite):
    """Several schedules stepped together, each on the rate the one before it set (their
    factors multiply)."""

    def __init__(self, schedulers: Sequence[Any], optimizer: Any = None) -> None:
        schedulers = list(schedulers)
        if optimizer is None:  # the first schedule's: there must be one
            first = schedulers[0] if schedulers else None
            _check_parts("ChainedScheduler", getattr(first, "optimizer", None), schedulers[:1])
            optimizer = schedulers[0].optimizer
        optimizer = _optimizer(optimizer)
        _check_parts("ChainedScheduler", optimizer, schedulers)
        self._schedulers = schedulers
        self.optimizer = optimizer
        self._last_lr = optimizer._group_lrs()

    def step(self) -> None:  # type: ignore[override]  # as torch's: no epoch
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

    def _update_lr(self, epoch: Optional[float]) -> None:
        raise TypeError("a ChainedScheduler cannot be placed at an epoch")
