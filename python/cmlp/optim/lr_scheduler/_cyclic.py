"""The schedules stepped after every optimizer step that move the momentum too: OneCycleLR and
CyclicLR."""
import math
import numbers
import operator
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, cast

from ..._arrays import as_flag, as_number
from ._base import _ABOVE_ZERO, LRScheduler, _check_state, _is_int, _non_negative, _optimizer, _per_group


def _settings(optimizer: Any) -> Tuple[Any, ...]:
    """What a cyclic schedule's constructor changes in the optimizer (its initial rates, rates,
    momentum and the values kept in its groups), for _restore when the constructor fails."""
    return (list(optimizer._initial_lrs), optimizer._group_lrs(), optimizer._momenta(),
            [dict(g._extra) for g in optimizer.param_groups])


def _restore(optimizer: Any, before: Tuple[Any, ...]) -> None:
    optimizer._initial_lrs = before[0]
    optimizer._set_group_lrs(before[1])
    optimizer._set_momentum(before[2])
    for group, extra in zip(optimizer.param_groups, before[3]):
        group._extra = extra


_ABSENT = object()  # a key a group does not hold
_STAMP = operator.attrgetter("_stamp")  # a param group's (see _ParamGroup._changed)


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

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "total_steps": 1}
    _LOADED_PER_GROUP = frozenset({"_groups"})

    _GROUP_KEYS = ("max_lr", "min_lr", "max_momentum", "base_momentum")
    _noted: Optional[Tuple[Any, ...]] = None  # what the groups held at the last step (_note_seen)
    _DEFERS_MOMENTA = True

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
        if n >= 1 << 63:  # (the phases' ends are floats)
            raise ValueError(f"total_steps must be below 2**63, got {n}")
        if three_phase:
            self._schedule_phases: List[Dict[str, Any]] = [
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
        before = _settings(optimizer)
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
            _restore(optimizer, before)
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
            group._changed()  # (other schedules of the optimizer read them again)
        self._note_seen(optimizer)

    def _adopt(self, optimizer: Any) -> None:
        """The param groups' values, where code set or loaded them there (torch reads them from the
        groups at each step), checked all together before any is taken (get_lr calls it where the
        groups and this schedule may not hold what was last noted: see _note_seen)."""
        taken = []
        for i, (group, mine) in enumerate(zip(optimizer.param_groups, self._groups)):
            initial = optimizer._initial_lrs[i]
            found = {k: group._extra[k] for k in self._GROUP_KEYS if k in mine and k in group._extra}
            if initial is not None:
                found["initial_lr"] = initial
            for key, value in found.items():  # (a float first: the values the schedule wrote there)
                if (type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real))
                        or not 0 <= cast(float, value) < math.inf):
                    raise ValueError(f"param_groups[{i}][{key!r}] must be a finite number >= 0, got {value!r}")
            taken.append({k: float(v) for k, v in found.items()})
        for mine, found in zip(self._groups, taken):
            mine.update(found)
        self._note_seen(optimizer)

    def _note_seen(self, optimizer: Any) -> None:
        """What the groups hold now of the keys this schedule keeps there (see _mirror); and where
        each is a valid float that this schedule holds too (the same object: what _adopt's float()
        gives, -0.0 kept apart from 0.0), as is each group's initial rate: the list of initial
        rates (replaced where they are, or changed in place through a group), a copy of this
        schedule's values (one that changed, however, is seen) and each group's stamp (a key of it
        set, removed or loaded since makes a new one; see _ParamGroup._changed), for get_lr's look."""
        self._seen = [{k: g._extra[k] for k in self._GROUP_KEYS if k in g._extra} for g in optimizer.param_groups]
        self._noted = None
        if len(optimizer.param_groups) != len(self._groups):
            return
        for group, mine, initial in zip(optimizer.param_groups, self._groups, optimizer._initial_lrs):
            if initial is not None and (type(initial) is not float or mine.get("initial_lr") is not initial
                                        or not 0 <= initial < math.inf):
                return
            for k in self._GROUP_KEYS:
                v = group._extra.get(k, _ABSENT)
                if v is not _ABSENT and k in mine and (type(v) is not float or v is not mine[k] or not 0 <= v < math.inf):
                    return
        self._noted = (optimizer._initial_lrs, [dict(mine) for mine in self._groups],
                       list(map(_STAMP, optimizer._param_groups)))

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
        # nothing to take from the groups where they and this schedule hold what was last noted
        # (_note_seen: the common case, each step one look at each stamp)
        noted, optimizer = self._noted, self.optimizer
        groups = optimizer._param_groups
        if noted is None or noted[0] is not optimizer._initial_lrs or noted[1] != self._groups \
                or not (noted[2][0] is groups[0]._stamp if len(groups) == 1 == len(noted[2])
                        else noted[2] == list(map(_STAMP, groups))):
            self._adopt(optimizer)
        start, phases = 0.0, self._schedule_phases
        for phase in phases:
            end = phase["end_step"]
            if step <= end or phase is phases[-1]:
                break
            start = end
        pct = (step - start) / (end - start)
        # _annealing_cos and _annealing_linear written out, with the same operations in the same
        # order (the same floats): each step calls this, for the rate and the momentum of each group
        cos = self._anneal_func_type == "cos"
        weight = math.cos(math.pi * pct) + 1 if cos else pct
        # one step past the last (total_steps: the step torch code takes after its last optimizer
        # step) the linear strategy extrapolates below 0, which torch sets and never trains with;
        # the optimizer here takes no negative rate, so that step's rate is 0
        lo, hi = phase["start_lr"], phase["end_lr"]
        lrs = []
        for g in self._groups:
            a, b = g[lo], g[hi]
            lr = b + (a - b) / 2.0 * weight if cos else (b - a) * weight + a
            lrs.append(lr if lr >= 0.0 else 0.0)
        if self.cycle_momentum:
            lo, hi = phase["start_momentum"], phase["end_momentum"]
            momenta = []
            for g in self._groups:
                a, b = g[lo], g[hi]
                # likewise, that step's linear momentum goes past the phase's end (Adam's beta1 to 1
                # and over, which Adam refuses): it stays at the end's value
                m = b + (a - b) / 2.0 * weight if cos else (b - a) * weight + a
                momenta.append(m if a <= m <= b or b <= m <= a else min(max(m, min(a, b)), max(a, b)))
            if self._momenta_due is not None:  # (_move_momenta, written out: each step comes here)
                self._momenta_due = momenta
            else:
                self.optimizer._set_momentum(momenta)
        return lrs

    def _check_loaded(self, state_dict: Any) -> None:
        """Each phase names its end and the group keys its rates (and, cycling momentum, its
        momenta) run between; each group holds every key a phase names."""
        cycle = state_dict.get("cycle_momentum", self.cycle_momentum)
        phases = state_dict.get("_schedule_phases", self._schedule_phases)
        groups = state_dict.get("_groups", [state_dict["_group"]] if "_group" in state_dict else self._groups)
        needs = ("end_step", "start_lr", "end_lr") + (("start_momentum", "end_momentum") if cycle else ())
        for i, phase in enumerate(phases):
            missing = [k for k in needs if k not in phase]
            if missing:
                raise ValueError(f"state_dict['_schedule_phases'][{i}] has no {missing[0]!r}")
            for k in needs[1:]:
                for j, group in enumerate(groups):
                    if not isinstance(phase[k], str) or phase[k] not in group:
                        raise ValueError(f"state_dict['_schedule_phases'][{i}][{k!r}] names {phase[k]!r}, which "
                                         f"the schedule's group {j} does not hold")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Also takes the state_dict of an older one-group schedule, which kept "_group"."""
        state_dict = _check_state(self, state_dict)
        if "_group" in state_dict and "_groups" not in state_dict:
            state_dict = {**{k: v for k, v in state_dict.items() if k != "_group"}, "_groups": [state_dict["_group"]]}
        state = {k: v for k, v in state_dict.items() if k not in ("_seen", "_noted")}
        if "_groups" in state:  # its own dicts: the schedule it came from goes on with its own
            state["_groups"] = [dict(g) for g in state["_groups"]]
        self._noted = None  # (read again at the next step, however far the load gets)
        super().load_state_dict(state)
        # the loaded values go into the groups where they hold what this schedule put there; a value
        # set in a group since, or loaded with the optimizer's state_dict, wins, as torch reads the groups
        self._mirror(only_unchanged=True)

    def state_dict(self) -> Dict[str, Any]:
        """The schedule's state; its groups' values as copies (the state does not change when
        the schedule later takes a value set in a group)."""
        state = {k: v for k, v in super().state_dict().items() if k not in ("_seen", "_noted")}
        state["_groups"] = [dict(g) for g in state["_groups"]]
        return state


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

    _LOADED_AT_LEAST = {**LRScheduler._LOADED_AT_LEAST, "total_size": _ABOVE_ZERO, "step_ratio": _ABOVE_ZERO}
    _LOADED_PER_GROUP = frozenset({"base_lrs", "max_lrs", "base_momentums", "max_momentums"})
    _DEFERS_MOMENTA = True

    def __init__(self, optimizer: Any, base_lr: Any, max_lr: Any, step_size_up: int = 2000,
                 step_size_down: Optional[int] = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_fn: Optional[Callable[[float], float]] = None, scale_mode: str = "cycle",
                 cycle_momentum: bool = True, base_momentum: Any = 0.8, max_momentum: Any = 0.9,
                 last_epoch: int = -1) -> None:
        optimizer = _optimizer(optimizer)
        lows, self.max_lrs = _per_group("base_lr", base_lr, optimizer), _per_group("max_lr", max_lr, optimizer)
        for top in self.max_lrs:
            _non_negative("max_lr", top)
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
        self.mode, self.gamma, self._scale_fn_custom = mode, _non_negative("gamma", gamma), scale_fn
        self.scale_mode = scale_mode if scale_fn is not None else "iterations" if mode == "exp_range" else "cycle"
        self.cycle_momentum = as_flag("cycle_momentum", cycle_momentum)
        if self.cycle_momentum:
            self.use_beta1 = optimizer._kind == "adam"
            self.base_momentums = _per_group("base_momentum", base_momentum, optimizer)
            self.max_momentums = _per_group("max_momentum", max_momentum, optimizer)
        # the optimizer changes only once everything is checked, and goes back when the first step fails
        before = _settings(optimizer)
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
            _restore(optimizer, before)
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
            self._move_momenta([top - (top - bottom) * scale_factor * self.scale_fn(at)
                                for top, bottom in zip(self.max_momentums, self.base_momentums)])
        return lrs

    def state_dict(self) -> Dict[str, Any]:
        """As torch's: scale_fn is kept only as the attributes of a callable object that is not a
        plain function (None otherwise)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_scale_fn_custom")}
        fn = self._scale_fn_custom
        state["_scale_fn_custom"] = None if fn is None or isinstance(fn, types.FunctionType) else dict(fn.__dict__)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state_dict = _check_state(self, state_dict)
        saved = state_dict.get("_scale_fn_custom")
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "_scale_fn_custom"})
        if saved is not None and self._scale_fn_custom is not None:
            self._scale_fn_custom.__dict__.update(saved)
