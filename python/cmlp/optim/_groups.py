"""The param groups of cmlp.optim's optimizers as torch shows them (one dict-like view of each
group's settings), and the checks of the values a group or a constructor takes."""
import contextlib
import copy
import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Tuple, TypeVar

import numpy as np

from .._arrays import as_flag as _flag
from .._arrays import as_number as _num

if TYPE_CHECKING:
    from .optimizer import Optimizer


def _implementation_flag(name: str, value: Any) -> Any:
    """torch's foreach, fused (None or a bool) and capturable (a bool): how torch runs a step,
    taken and kept for the param group; cmlp's step is always one fused pass over the flat
    buffers, captured with the training step where the device has graphs."""
    if value is None and name != "capturable":
        return None
    return _flag(name, value)


def _implementation_flags(names: Tuple[str, ...], given: Dict[str, Any]) -> Dict[str, Any]:
    """The flags checked, in torch's order; fused and foreach not both True, as torch."""
    flags = {name: _implementation_flag(name, given[name]) for name in names}
    if flags.get("fused") and flags.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    return flags


def _unsupported_flag(name: str, value: Any) -> bool:
    """torch's differentiable (a step that autograd can differentiate through): only False, its
    default, is supported."""
    if _flag(name, value):
        raise ValueError(f"{name}=True is not supported by cmlp's optimizers")
    return False


def _bool_setting(group: Mapping, key: str, default: bool) -> bool:
    """A param group's boolean setting (nesterov, amsgrad, maximize, ...), else default: taken
    as the constructor takes it (a bool, or 0 or 1), and refused with the same TypeError."""
    return _flag(key, group.get(key, default))


def _initial_lr_of(value: Any) -> float:
    """torch's 'initial_lr' (the rate a schedule starts from): a finite number >= 0, as a rate."""
    v = _num("initial_lr", value)
    if not 0.0 <= v < float("inf"):
        raise ValueError(f"initial_lr must be a finite number >= 0, got {value!r}")
    return v


def _setting(key: str, doc: str) -> Any:
    """A hyperparameter as an attribute: read (the first param group's), or set (checked, and
    applied from the next step on) as torch's param_groups[i][key] = value sets it, for every
    group."""

    def get(self: "Optimizer") -> Any:
        return self._owns[0][key] if key in self._per_group else self._settings[key]

    def set(self: "Optimizer", value: Any) -> None:
        from .optimizer import _holding

        with _holding(self):  # (Optimizer's _locked: the groups' settings are read and set as one)
            if key in self._per_group:
                own = self._own_from({key: value}, self._owns[0])[key]
                self._push_groups(owns=[{**o, key: own} for o in self._owns])
            else:
                self._apply(self._group_config({key: value}))

    return property(get, set, doc=doc)


def _unnamed(p: Any) -> Any:
    """A parameter from a (name, copy) pair of named_parameters(), as torch takes them; else p."""
    if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], np.ndarray):
        return p[1]
    return p


def _rate(name: str, value: Any) -> float:
    """A learning rate or weight decay as the step takes it: a number >= 0, finite in float32."""
    v = _num(name, value)
    if not 0.0 <= v <= _FLT_MAX:
        what = "learning rate" if name == "lr" else f"{name} value"
        raise ValueError(f"Invalid {what}: {value!r} (must be >= 0 and finite in float32)")
    return v


_FLT_MAX = float(np.finfo(np.float32).max)
# a state buffer's value where it has not started (torch's state has none there): SGD's momentum
# buffer the NaN of bits 0xFFFFFFFF (the C core's CMLP_MOMENTUM_UNSTARTED_BITS, which no other
# NaN is: one that has started stays NaN, as torch's), AMSGrad's maximum negative (a maximum of
# squares; a step takes its exp_avg_sq there)
_UNSTARTED: Dict[str, Any] = {"momentum_buffer": np.array(0xFFFFFFFF, np.uint32).view(np.float32)[()],
                              "max_exp_avg_sq": -1.0}


def _not_started(bname: str, arr: np.ndarray) -> np.ndarray:
    """Where a float32 state buffer `bname` has not started (see _UNSTARTED)."""
    if bname == "momentum_buffer":
        return arr.view(np.uint32) == np.uint32(0xFFFFFFFF)
    return arr < 0
_INHERIT = float("nan")  # a part's setting that is the C configuration's (one object: tuples of it compare equal)


class _GroupList(list):
    """optimizer.param_groups: the groups, whose keys the caller sets (the next step uses them),
    in a list that refuses to change: a cmlp optimizer's groups are given when it is made, and a
    group added to or replaced in a copy would be silently lost."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("optimizer.param_groups cannot be changed: its groups are given when the optimizer is made "
                        "(param_groups=[{'params': [...], 'lr': ...}, ...]); set a group's settings instead, e.g. "
                        "optimizer.param_groups[0]['lr'] = 1e-4")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __reduce_ex__(self, protocol: Any) -> Tuple[Any, ...]:
        return (list, (list(self),))  # a copy is a plain list of the same groups


_F = TypeVar("_F", bound=Callable[..., Any])


def _group_locked(method: _F) -> _F:
    """A change to a param group made under its optimizer's lock (Optimizer's _locked): it reads
    the other groups' settings to set them all at once (a group whose optimizer is gone has no
    lock to take, and no setting of its own to change)."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        from .optimizer import _holding

        opt = self._ref()
        with _holding(opt) if opt is not None else contextlib.nullcontext():
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class _ParamGroup(MutableMapping):
    """One of torch's param_groups: a dict of the group's settings. Its "lr", "weight_decay",
    "initial_lr" and hyperparameters (Adam's betas, eps, amsgrad and maximize; SGD's momentum,
    dampening, nesterov and maximize) are the group's own; Adam's decoupled_weight_decay is shared
    by every group, and setting it in any group sets it for all. Setting a key checks it
    and applies it from the next step on (as torch reads its groups at each step); other keys are
    kept as given, as torch keeps them. "params" is the group's parameter tensors (indices, as in
    state_dict()) and cannot change."""

    def __init__(self, opt: "Optimizer", index: int, names: List[str]) -> None:
        self._ref = weakref.ref(opt)  # not a cycle: a deleted optimizer (and model) is freed at once
        self._index = index
        self._names = names  # the group's parameter tensors, in its order
        self._extra = {}
        self._last: Optional[Dict[str, Any]] = None  # the settings its optimizer ended with (_orphan)

    def _orphan(self) -> None:
        """Called as its optimizer ends: the group keeps the settings it had, to be read as a
        torch group outlives its optimizer (a list of param_groups kept by a logger); setting
        one then has no optimizer to apply to and raises."""
        self._last = self._known()

    @property
    def _extra(self) -> Dict[Any, Any]:
        """The keys the caller (or a schedule) keeps in the group, as given; assigning it, like
        setting or removing a key, marks the group as changed (_changed)."""
        return self._kept

    @_extra.setter
    def _extra(self, kept: Dict[Any, Any]) -> None:
        self._kept = kept
        self._changed()

    def _changed(self) -> None:
        """A new stamp: code that noted the group's values under the one before (OneCycleLR) reads
        them again. A new object each time, never the stamp of another group, nor of a copy."""
        self._stamp = object()

    @property
    def _opt(self) -> "Optimizer":
        opt = self._ref()
        if opt is None:
            raise ReferenceError("the optimizer of this param group no longer exists: its settings can be read, "
                                 "not changed")
        return opt

    def _known(self) -> Dict[str, Any]:
        if self._last is not None and self._ref() is None:
            return dict(self._last)
        opt = self._opt
        group = opt._group(self._index)
        first = sum(len(g._names) for g in opt._param_groups[:self._index])
        group["params"] = list(range(first, first + len(self._names)))
        return group

    def __getitem__(self, key: Any) -> Any:
        known = self._known()
        return known[key] if key in known else self._extra[key]

    @_group_locked
    def __setitem__(self, key: Any, value: Any) -> None:
        opt, i = self._opt, self._index
        self._changed()
        if key == "params":
            raise ValueError("a cmlp optimizer's param groups are set when it is made: 'params' cannot change")
        if key == "lr":
            opt._set_group_lrs([value if k == i else lr for k, lr in enumerate(opt._lrs)])
        elif key == "weight_decay":
            opt._set_group_wds([value if k == i else wd for k, wd in enumerate(opt._wds)])
        elif key in opt._flags:  # foreach, fused (and Adam's capturable)
            opt._flags[key] = _implementation_flag(key, value)
        elif key == "initial_lr":
            opt._initial_lrs[i] = _initial_lr_of(value)
        elif key in opt._per_group:
            own = opt._own_from({key: value}, opt._owns[i])
            opt._push_groups(owns=[own if k == i else o for k, o in enumerate(opt._owns)])
        elif key in opt._settings:
            setattr(opt, key, value)
        elif key in opt._group(i):  # differentiable: only its default
            _unsupported_flag(key, value)
        elif key in opt._foreign_keys:
            raise ValueError(f"{type(opt).__name__} has no {key!r} setting")
        else:
            self._extra[key] = value

    @_group_locked
    def update(self, *args: Any, **kwargs: Any) -> None:
        """dict.update, all or nothing: a refused key leaves every setting as it was."""
        opt = self._opt
        before = opt._snapshot()
        extra = dict(self._extra)
        try:
            for key, value in dict(*args, **kwargs).items():
                self[key] = value
        except BaseException:
            opt._restore(before)
            self._extra = extra
            raise

    @_group_locked
    def __delitem__(self, key: Any) -> None:
        self._changed()
        if key in self._extra:
            del self._extra[key]
        elif key == "initial_lr" and self._opt._initial_lrs[self._index] is not None:
            self._opt._initial_lrs[self._index] = None
        else:
            raise KeyError(f"{key!r} cannot be removed from a cmlp optimizer's param group")

    def clear(self) -> None:
        """Refused whole (MutableMapping's would stop, silently, at the first setting)."""
        raise KeyError("a cmlp optimizer's param group cannot be cleared: its params, lr and settings stay (del "
                       "removes a key of your own)")

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._known()) + list(self._extra))

    def __len__(self) -> int:
        return len(self._known()) + len(self._extra)

    def __repr__(self) -> str:
        return repr(dict(self))

    # a copy is a plain dict of the settings, as copying torch's groups gives (editing it changes no
    # optimizer; torch's way back is param_groups[i][key] = saved[i][key]); so is a pickled one
    def __copy__(self) -> Dict[Any, Any]:
        return dict(self)

    def copy(self) -> Dict[Any, Any]:
        """A plain dict of the group's settings, as dict.copy() of torch's group."""
        return dict(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Dict[Any, Any]:
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self) -> Tuple[Any, ...]:
        return dict, (dict(self),)
