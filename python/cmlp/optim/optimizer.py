"""The base of cmlp.optim's optimizers: a C optimizer bound to one model, stepping its flat
buffers in one fused pass, with torch's param groups over it."""
import contextlib
import functools
import os
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, MutableMapping, Tuple, TypeVar, Union

import numpy as np

from .. import _cmlp
from .._cmlp import CoreLock
from .._arrays import as_number as _num
from ..model import MLP, Parameters, model_of, parameter_of
from ._groups import _FLT_MAX, _INHERIT, _GroupList, _ParamGroup, _initial_lr_of, _rate, _unnamed, _unsupported_flag
from ._copying import _Copying
from ._state import _StateDict

# What an optimizer is given: the model, model.parameters(), or (as torch's) an iterable of its
# parameters or of param-group dicts
Params = Union[MLP, Parameters, Iterable[Any]]


_F = TypeVar("_F", bound=Callable[..., Any])

# An optimizer whose settings another thread was changing when the process forked is half changed
# in the child: there it is refused, rather than waiting for ever for that thread's lock.
_live: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_TORN = ("this optimizer's settings were being changed by another thread when the process was forked; the change "
         "never finishes in the child, so the optimizer cannot be used in this process (fork while no thread "
         "changes it, or start processes with 'spawn')")


def _after_fork_in_child() -> None:
    fresh: Dict[int, Any] = {}  # id of a lock (copy.copy's twins share one) -> (its new lock, torn)
    opts = list(_live)
    old = [opt.__dict__.get("_lock") for opt in opts]  # (alive: their ids stay theirs)
    for opt, lock in zip(opts, old):
        if lock is None:
            continue
        if id(lock) not in fresh:
            held = not lock.acquire(blocking=False)  # (free, or this thread's: taken)
            if not held:
                lock.release()
            fresh[id(lock)] = (CoreLock(), held)  # held: by a thread the child does not have
        opt._lock, torn = fresh[id(lock)]
        if torn:
            opt._torn = True


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _holding(opt: Any) -> Iterator[None]:
    """The optimizer's lock, held (an optimizer torn by a fork raises)."""
    with opt._lock:
        if opt._torn:
            raise RuntimeError(_TORN)
        yield


def _locked(method: _F) -> _F:
    """A method run under the optimizer's lock: what it reads of the groups' settings, and what it
    sets of them and of the C optimizer, is not another thread's half-made change (torch's groups
    are dicts of their own: two threads that set two groups' values both take). No code of the
    caller's runs under it (a closure, a schedule's function)."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # (_holding's, written out: a schedule's step comes here each time)
            if self._torn:
                raise RuntimeError(_TORN)
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class Optimizer(_Copying, _StateDict):
    """Base: holds the C optimizer bound to one model. The param groups' own rates, weight decays
    and hyperparameters are kept here; the C optimizer is configured as the first group and steps
    at a base rate (the largest group rate), and each group's part of the parameters at its
    multiple of it, with its weight decay and the hyperparameters in which it differs from the
    first group's."""

    _buffers: Tuple[str, ...] = ()
    _torn = False  # True in a forked child where another thread held the lock (_after_fork_in_child)
    # the hyperparameters a param group holds for itself beside lr and weight_decay (torch's keys)
    _per_group: Tuple[str, ...] = ()

    def __init__(self, model: Params, kind: str, flags: Dict[str, Any], param_groups: Any = None, **config: Any) -> None:
        self._lock = CoreLock()  # the groups' settings, read, changed and given to C as one (_locked)
        _live.add(self)
        model, param_groups = self._model_and_groups(model, param_groups)
        self.model = model
        self._kind = kind
        names = [f"fc{i + 1}.{k}" for i in range(len(model._sizes) - 1) for k in ("weight", "bias")]
        specs = self._group_specs(param_groups, names, config)
        self._c_wd = specs[0]["weight_decay"]  # the C configuration's (the first group's)
        self._c_own = self._own_of_config(config)  # likewise its hyperparameters
        self._owns = [spec["own"] for spec in specs]  # each group's hyperparameters
        self._own_parts: Any = None  # their parts' settings (_part_settings), as last given
        self._c_parts: Any = None  # the parts last given to the C optimizer
        self._synced: Any = None  # the (scales, weight decays) they were made of
        self._scales: Any = None  # the groups' multiples of the base rate last used
        self._split_memo: Any = None  # (rates, base, scales) of the last split
        self._rates_only: Any = None  # what _take_lrs last found to move the base rate alone (see there)
        self._momenta_memo: Any = None  # (the groups' settings, their momenta) of _momenta()
        self._runs_made: Any = None  # _runs()
        with model._optimizers_lock:  # made and known to the model as one (a move elsewhere takes it along)
            self._c = _cmlp.Optimizer(model._c, kind, **{**config, "weight_decay": self._c_wd})
            if not hasattr(self, "_settings"):  # the hyperparameters every group shares, as _apply last set them
                self._settings: Dict[str, Any] = {}
            self._flags = flags  # torch's foreach, capturable and fused, as given
            self._param_groups = [_ParamGroup(self, i, spec["names"]) for i, spec in enumerate(specs)]
            for group, spec in zip(self._param_groups, specs):
                group._extra = spec["extra"]
            self._lrs = [spec["lr"] for spec in specs]
            self._wds = [spec["weight_decay"] for spec in specs]
            # torch's 'initial_lr' of each group: set by the first lr_scheduler made for the optimizer
            self._initial_lrs: List[Any] = [spec["initial_lr"] for spec in specs]
            self._push_groups()
            model._optimizers.add(self)

    @staticmethod
    def _model_and_groups(first: Any, param_groups: Any) -> Tuple[MLP, Any]:
        """The model and the param groups from the first argument: the model, its parameters(),
        or torch's params: a list of param-group dicts, or of the copies parameters() and
        named_parameters() give out (one group), whose model it is."""
        if isinstance(first, (MLP, Parameters)) or isinstance(first, (str, bytes, Mapping)) \
                or not isinstance(first, Iterable):
            return model_of(first, "the first argument"), param_groups
        if param_groups is not None:
            raise TypeError("param groups are given once: as the first argument (torch's params) or as param_groups")
        items = list(first)  # named_parameters()' pairs as torch takes them too (their names kept)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        groups = items if all(isinstance(g, Mapping) for g in items) else [{"params": items}]
        models = set()
        for i, g in enumerate(groups):
            params = g.get("params", ()) if isinstance(g, Mapping) else ()
            if isinstance(params, np.ndarray) or not isinstance(params, Iterable) or isinstance(params, str):
                params = [params]
            elif isinstance(params, Parameters):
                models.add(params.model)
                continue
            elif not isinstance(params, (set, frozenset)):  # a generator is read once: here
                params = list(params)
                groups[i] = {**g, "params": params}
            for p in params:
                owner = parameter_of(_unnamed(p))
                if owner is not None:
                    models.add(owner[0])
        if len(models) > 1:
            raise ValueError("the param groups hold parameters of more than one model")
        if not models:
            raise TypeError("the first argument must be a cmlp.MLP, its parameters(), or torch's params: param groups "
                            "(or a list) of the copies model.parameters() / named_parameters() give out, of one model; "
                            "with parameter names, give the model too: Adam(model, param_groups=[...])")
        return models.pop(), list(groups)

    def _group_specs(self, param_groups: Any, names: List[str], config: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The param groups asked for, checked: each a dict with "params" (names as in
        state_dict(), or their indices) and the group's own "lr" and "weight_decay" (default: the
        optimizer's); every parameter tensor in exactly one group."""
        lr, wd, own = config["lr"], config["weight_decay"], self._own_of_config(config)
        if param_groups is None:
            return [{"names": names, "lr": lr, "weight_decay": wd, "initial_lr": None, "own": own, "extra": {}}]
        if isinstance(param_groups, Mapping) or not isinstance(param_groups, (list, tuple)):
            raise TypeError("param_groups must be a list of dicts, each with 'params' (parameter names, as in "
                            f"model.state_dict(), or their indices), got {type(param_groups).__name__}")
        if not param_groups:
            raise ValueError("optimizer got an empty parameter list")
        shared = self._shared_defaults(config)
        specs: List[Dict[str, Any]] = []
        seen: Dict[str, int] = {}  # name -> group
        for gi, group in enumerate(param_groups):
            if not isinstance(group, Mapping) or "params" not in group:
                raise TypeError(f"param_groups[{gi}] must be a dict with 'params', got {group!r}")
            params = group["params"]
            params = [params] if isinstance(params, (str, int, np.integer, np.ndarray)) else params
            if isinstance(params, (set, frozenset)) or not isinstance(params, Iterable):
                raise TypeError(f"param_groups[{gi}]['params'] must be a list of parameter names or indices (a set "
                                "has no order), got " + type(params).__name__)
            params = list(params)
            mine, named = [], [_unnamed(p) is not p for p in params]
            if any(named) and not all(named):
                raise ValueError(f"param_groups[{gi}]: all optimizer params should be with/without names (pairs "
                                 "from named_parameters(), or the copies parameters() gives out). Some param names "
                                 "are missing")
            if any(named) and "param_names" not in group:  # torch records them in the group
                group = {**group, "param_names": [p[0] for p in params]}
            for p in params:
                p = _unnamed(p)
                if isinstance(p, np.ndarray):  # a copy parameters() or named_parameters() gave out
                    owner = parameter_of(p)
                    if owner is None or owner[0] is not self.model:
                        raise ValueError(f"param_groups[{gi}]: an array that is not one of this model's parameters "
                                         "as model.parameters() or named_parameters() gave them out (or name them: "
                                         f"{names[:2]}, ...)")
                    p = owner[1]
                if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
                    if not 0 <= p < len(names):
                        raise ValueError(f"param_groups[{gi}]: parameter index {p} is not one of the model's "
                                         f"{len(names)} tensors")
                    p = names[int(p)]
                if not isinstance(p, str) or p not in names:
                    raise ValueError(f"param_groups[{gi}]: {p!r} is not one of the model's parameters {names}")
                if p in seen:
                    raise ValueError(f"some parameters appear in more than one parameter group: {p!r} is in groups "
                                     f"{seen[p]} and {gi}")
                seen[p] = gi
                mine.append(p)
            if not mine:
                raise ValueError(f"param_groups[{gi}] has no parameters")
            for key, value in group.items():
                if key in shared and not self._same_setting(key, value, shared[key]):
                    raise ValueError(f"param_groups[{gi}] sets {key}={value!r}: cmlp's param groups share "
                                     f"{', '.join(shared)} (set it on the optimizer: {key}={shared[key]!r} now)")
                if key == "differentiable":
                    _unsupported_flag(key, value)
                if key in self._foreign_keys:
                    raise ValueError(f"{type(self).__name__} has no {key!r} setting (param_groups[{gi}])")
            initial = group.get("initial_lr")
            known = set(shared) | set(self._per_group) | {"params", "lr", "weight_decay", "initial_lr",
                                                          "differentiable", "foreach", "fused", "capturable"}
            try:
                mine_own = self._own_from(group, own)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param_groups[{gi}]: {e}") from None
            specs.append({"names": mine, "lr": _rate("lr", group.get("lr", lr)),
                          "weight_decay": _rate("weight_decay", group.get("weight_decay", wd)),
                          "initial_lr": None if initial is None else _initial_lr_of(initial), "own": mine_own,
                          "extra": {k: v for k, v in group.items() if k not in known}})
        if len({"param_names" in spec["extra"] for spec in specs}) > 1:
            raise ValueError("all optimizer param groups should be with/without names (torch's rule): some groups "
                             "were given named_parameters() pairs and some were not")
        missing = [n for n in names if n not in seen]
        if missing:
            raise ValueError(f"every parameter must be in a param group (a frozen one takes lr=0): {missing} are in "
                             "none")
        return specs

    def _shared_defaults(self, config: Dict[str, Any]) -> Dict[str, Any]:
        """The settings all groups share, as the constructor got them (the key in torch's group)."""
        return {}

    def _own_of_config(self, config: Mapping) -> Dict[str, Any]:
        """A group's hyperparameters (_per_group's keys, torch's values) from a C configuration."""
        raise NotImplementedError

    def _own_from(self, group: Mapping, base: Mapping) -> Dict[str, Any]:
        """A group's hyperparameters: the group's where it has them (checked), else base's."""
        raise NotImplementedError

    def _part_fields(self, own: Mapping) -> Tuple[Any, ...]:
        """A group's hyperparameters as the C optimizer's parts take them: (momentum, beta2, eps,
        dampening, nesterov, maximize, amsgrad), None for what this kind of optimizer does not
        have."""
        raise NotImplementedError

    _nan_refused: Dict[int, str] = {}  # the C configuration's words for a NaN in _part_fields' i-th

    def _part_settings(self, owns: List[Dict[str, Any]]) -> List[Tuple[Any, ...]]:
        """Each group's settings for its parts: its own where they differ from the first group's
        (the C configuration's), else _INHERIT (-1 for the flags)."""
        first = self._part_fields(owns[0])
        out = []
        for g, own in enumerate(owns):
            fields = self._part_fields(own)
            for i, v in enumerate(fields[:4]):  # NaN is the parts' mark for the first group's setting
                if v is not None and v != v:
                    raise ValueError(("" if g == 0 else f"param_groups[{g}]: ") + self._nan_refused[i])
            out.append(tuple((-1 if i >= 4 else _INHERIT) if v is None or v == f else (int(v) if i >= 4 else v)
                             for i, (v, f) in enumerate(zip(fields, first))))
        return out

    @staticmethod
    def _same_setting(key: str, value: Any, shared: Any) -> bool:
        try:
            if key == "betas":
                return tuple(float(v) for v in value) == tuple(shared)
            return type(shared)(value) == shared if not isinstance(shared, bool) else value is shared or value == shared
        except (TypeError, ValueError):
            return False

    def __copy__(self) -> "Optimizer":
        twin = super().__copy__()
        _live.add(twin)  # (a fork gives it its new lock too)
        return twin

    def __del__(self) -> None:
        for group in self.__dict__.get("_param_groups", ()):  # (none where the constructor failed)
            try:
                group._orphan()
            except Exception:  # (at interpreter exit, what it reads may be gone: it is no matter then)
                pass

    @property
    def param_groups(self) -> List[MutableMapping]:
        """torch's param_groups (see _ParamGroup): by default one group, the model's parameters;
        e.g. opt.param_groups[0]["lr"] = 1e-4, or ["weight_decay"], which the next step uses. The
        groups are given when the optimizer is made: the list refuses to change (TypeError)."""
        return _GroupList(self._param_groups)

    def add_param_group(self, param_group: Any) -> None:
        """torch's add_param_group: every parameter tensor of the model is in a group from the
        start (param_groups=... when the optimizer is made), so none can be added."""
        raise ValueError("every parameter of the model is in a param group already: a cmlp optimizer's groups are "
                         "given when it is made (param_groups=[{'params': [...], 'lr': ...}, ...])")

    # the groups' rates and weight decays, and how the C optimizer steps them

    @_locked
    def _push_groups(self, lrs: Any = None, wds: Any = None, owns: Any = None) -> None:
        """Sets the groups' rates, weight decays and hyperparameters (checked first: all or
        nothing): the C optimizer is configured as the first group, its rate is the largest one,
        and each group's part steps at its multiple of it with its own settings."""
        lrs = [_rate("lr", v) for v in (self._lrs if lrs is None else lrs)]
        wds = [_rate("weight_decay", v) for v in (self._wds if wds is None else wds)]
        same_owns = owns is None  # (a schedule's rates: the groups' other settings as they are)
        owns = self._owns if same_owns else [dict(o) for o in owns]
        if any(len(v) != len(self._param_groups) for v in (lrs, wds, owns)):
            raise ValueError(f"expected {len(self._param_groups)} values, one per param group")
        base, scales = self._split_rates(lrs)
        own_parts = self._own_parts if same_owns and self._own_parts is not None else self._part_settings(owns)
        before = (self._c.lr, self._c_wd, self._c_parts, self._c_own)
        python_before = (self._lrs, self._wds, self._owns, self._own_parts)
        try:
            if wds[0] != self._c_wd or owns[0] != self._c_own:
                self._configure_first(wds[0], owns[0])
            self._sync_parts(scales, wds, own=own_parts)
            self._c.lr = base
            # in the try: a KeyboardInterrupt before it takes the C side back too
            self._lrs, self._wds, self._owns, self._own_parts = lrs, wds, owns, own_parts
        except BaseException:
            self._lrs, self._wds, self._owns, self._own_parts = python_before
            self._c.lr = before[0]
            if self._c_wd != before[1] or self._c_own != before[3]:
                self._configure_first(before[1], before[3])
            if self._c_parts != before[2]:
                self._c.set_parts(before[2])
                self._c_parts = before[2]
                self._synced = None
            raise

    @_locked
    def _sync_parts(self, scales: Any, wds: Any = None, parts: bool = False, own: Any = None) -> None:
        """Gives the C optimizer each group's rate scale, weight decay and settings (own:
        _part_settings'), as parts of the flat parameters (none where every group has the same
        settings at scale 1: the plain step, unless parts, for steps whose groups' multiples
        differ from these)."""
        wds = self._wds if wds is None else wds
        if own is None:
            if self._own_parts is None:  # the momenta moved (_set_momentum)
                self._own_parts = self._part_settings(self._owns)
            own = self._own_parts
        key = (tuple(scales), tuple(wds), tuple(own), parts)
        if key == self._synced:  # as last given (a call of the trainer's each step)
            return
        if len(set(zip(scales, wds, own))) == 1 and scales[0] == 1.0 and not parts:
            c_parts: List[Tuple[Any, ...]] = []
        else:
            c_parts = [(end, scales[g], wds[g]) + own[g] for end, g in self._runs()]
        if c_parts != self._c_parts:
            self._c.set_parts(c_parts)
            self._c_parts = c_parts
        self._synced = key

    def _runs(self) -> List[Tuple[int, int]]:
        """(end, group) of each run of one group's tensors in the flat buffer: a part each (other
        scales are then other values, never other launches). Made once: the groups stay."""
        runs = self._runs_made
        if runs is None:
            group_of = {name: gi for gi, g in enumerate(self._param_groups) for name in g._names}
            m = self.model
            spans = []  # (start, end, name) of each tensor in the flat buffer
            for i, (w, b) in enumerate(m._offsets):
                fan_in, fan_out = m._sizes[i], m._sizes[i + 1]
                spans += [(w, w + fan_in * fan_out, f"fc{i + 1}.weight"), (b, b + fan_out, f"fc{i + 1}.bias")]
            runs = []
            for _, end, name in sorted(spans):
                if runs and runs[-1][1] == group_of[name]:
                    runs[-1] = (end, group_of[name])
                else:
                    runs.append((end, group_of[name]))
            self._runs_made = runs
        return runs

    def _split_rates(self, lrs: List[float]) -> Tuple[float, List[float]]:
        """(base, scales): the rate the C optimizer steps at (the largest group rate, so that no
        multiple of it overflows however far the others fall) and each group's multiple of it,
        <= 1. The multiples last used are kept where every rate is 0, and while the groups keep
        their proportions to 1e-12 (a schedule's rates, base * f(t) for each group, divide to
        multiples that move in the last bits only): a step then rounds the same rates to float,
        and a captured step goes on replaying with them."""
        if len(lrs) == 1 and self._scales is not None:  # one group: its multiple is 1 (v / v), kept where v is 0
            return lrs[0], self._scales
        memo = self._split_memo
        if memo is not None and memo[0] == lrs:  # asked again for the same rates (each step, several times)
            return memo[1], memo[2]
        base = max(lrs)
        kept = self._scales
        if kept is not None and len(kept) != len(lrs):
            kept = None
        if base == 0.0:
            scales = kept if kept is not None else [1.0] * len(lrs)
        else:
            scales = [v / base for v in lrs]
            if kept is not None and (scales == kept or all(abs(s - k) <= 1e-12 * k for s, k in zip(scales, kept))):
                scales = kept
        self._scales = scales
        self._split_memo = (list(lrs), base, scales)
        return base, scales

    def _rates(self) -> Tuple[float, Tuple[float, ...]]:
        """What a step of the C optimizer reads: its base rate and the groups' scales."""
        base, scales = self._split_rates(self._lrs)
        return base, tuple(scales)

    def _configure_first(self, wd: float, own: Dict[str, Any]) -> None:
        """The C configuration's weight decay and hyperparameters: the first group's (the parts
        carry every group's)."""
        self._apply_config({**self._group_config(own), "lr": self._c.lr, "weight_decay": wd})
        self._c_wd = wd

    @_locked
    def _apply(self, config: Dict[str, Any]) -> None:
        """Sets the shared hyperparameters from a configuration (_group_config's), and its rate
        and weight decay as the first group's."""
        self._apply_config({**config, "lr": self._c.lr, "weight_decay": self._c_wd})
        self._push_groups([config["lr"]] + self._lrs[1:], [config["weight_decay"]] + self._wds[1:])

    def _apply_config(self, config: Dict[str, Any]) -> None:
        """Configures the C optimizer and records the shared settings."""
        raise NotImplementedError

    @property
    def weight_decay(self) -> float:
        """The first param group's weight decay (all of them, with one group); settable."""
        return self._wds[0]

    @weight_decay.setter
    @_locked
    def weight_decay(self, value: float) -> None:
        self._set_group_wds([value] + self._wds[1:])

    def _group_lrs(self) -> List[float]:
        return list(self._lrs)

    @_locked
    def _set_group_lrs(self, lrs: Any) -> None:
        """Every group's rate at once (checked: a refused one changes none)."""
        self._take_lrs(lrs)

    def _take_lrs(self, lrs: Any) -> None:
        """_set_group_lrs, with the lock held. Where the new rates move the base rate alone (a
        schedule's step: the C configuration is the first group's, and the parts it has are those of
        these rates' multiples), only that is set; else _push_groups sets everything."""
        if type(lrs) is list and len(lrs) == 1 and type(lrs[0]) is float and 0.0 <= lrs[0] <= _FLT_MAX:
            lrs = lrs[:]  # (one group's rate, as a schedule's step gives it: nothing to convert)
        else:
            lrs = [v if type(v) is float and 0.0 <= v <= _FLT_MAX else _rate("lr", v) for v in lrs]
        if self._own_parts is None or len(lrs) != len(self._lrs):
            self._push_groups(lrs=lrs)
            return
        scales = self._scales
        if len(lrs) == 1 and scales is not None:  # (_split_rates' first case, written out: each step comes here)
            base = lrs[0]
        else:
            base, scales = self._split_rates(lrs)
        # the first group's settings are the C configuration's (found equal, they become one object:
        # dicts of settings never change in place), and the parts are of these multiples: the
        # check depends on these values alone, so made once for them it holds while they are equal
        # (each step of a schedule: the same objects, which the comparison finds equal at once)
        own = self._owns[0]
        if own is not self._c_own:
            if own != self._c_own:
                self._push_groups(lrs=lrs)
                return
            self._c_own = own
        seen = (self._synced, scales, self._wds, self._own_parts, self._c_wd)
        if seen != self._rates_only:
            if self._wds[0] != self._c_wd \
                    or self._synced != (tuple(scales), tuple(self._wds), tuple(self._own_parts), False):
                self._push_groups(lrs=lrs)
                return
            self._rates_only = seen
        self._c.lr = base
        self._lrs = lrs

    @_locked
    def _set_group_wds(self, wds: Any) -> None:
        self._push_groups(wds=list(wds))

    @property
    def _initial_lr(self) -> Any:
        """The first group's 'initial_lr' (torch's), None before a schedule set it."""
        return self._initial_lrs[0]

    def _snapshot(self) -> Tuple[Any, ...]:
        """Everything a param group's update may change, for _restore."""
        return (self._group_config(self._group(0)), list(self._lrs), list(self._wds), list(self._initial_lrs),
                dict(self._flags), [dict(o) for o in self._owns])

    @_locked
    def _restore(self, saved: Tuple[Any, ...]) -> None:
        config, lrs, wds, initial, flags, owns = saved
        self._apply(config)
        self._push_groups(lrs, wds, owns)
        self._initial_lrs = initial
        self._flags.clear()
        self._flags.update(flags)

    @property
    def lr(self) -> float:
        """The first param group's learning rate (all of them, with one group)."""
        self._c.lr  # noqa: B018 - refuses, as every call, where the model was lost to a fork
        return self._lrs[0]

    @lr.setter
    @_locked
    def lr(self, value: float) -> None:
        self._set_group_lrs([value] + self._lrs[1:])

    def _groups_spec(self) -> Any:
        """The param_groups argument that makes these groups again (None: the default one)."""
        if len(self._param_groups) == 1:
            return None
        return [{"params": list(g._names), "lr": lr, "weight_decay": wd, **own}
                for g, lr, wd, own in zip(self._param_groups, self._lrs, self._wds, self._owns)]

    def step(self, closure: Any = None) -> Any:
        """One update from the gradients accumulated in the model. Without gradients (none
        since the model was made, or since zero_grad() with set_to_none) nothing changes, no state
        is made and the step count stays, as torch's step skips parameters whose .grad is None.
        closure: torch's, a callable that computes the gradients (zero_grad, forward_backward)
        and returns the loss, called first; its result is returned (else None)."""
        loss = None
        if closure is not None:
            if not callable(closure):
                raise TypeError(f"closure must be callable, got {type(closure).__name__}")
            loss = closure()  # (not under the lock: it may wait for another thread that sets a rate)
        with _holding(self):
            self._opt_called = True  # torch's mark, which a schedule's first step looks for
            self._sync_parts(self._rates()[1])  # as the groups' rates say (a no-op unless a call failed midway)
            if self.model._grads_none:
                self._c.lr  # noqa: B018 - refuses, as every call, where the model was lost to a fork
                return loss
            self._c.step()
        return loss

    @property
    def state(self) -> Dict[int, Dict[str, Any]]:
        """torch's optimizer.state, keyed as the param groups' "params" (the parameter tensors
        numbered group after group, as torch's state_dict numbers them): copies of each tensor's
        step and buffers, as in state_dict()["state"]; empty before the first step."""
        return self.state_dict()["state"]

    def __repr__(self) -> str:
        """As torch's: the class, then each param group's settings by key ("params" left out)."""
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {key}: {group[key]}" for key in sorted(group) if key != "params"]
        return "\n".join(lines) + "\n)"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    def _group(self, i: int = 0) -> Dict[str, Any]:
        """Param group i's settings (torch's keys, but for "params")."""
        raise NotImplementedError

    def _initial(self, i: int) -> Dict[str, Any]:
        """torch's 'initial_lr' group entry, once a schedule has set it."""
        return {} if self._initial_lrs[i] is None else {"initial_lr": self._initial_lrs[i]}

    def _group_config(self, group: Mapping, index: int = 0) -> Dict[str, Any]:
        """The C optimizer's configuration from param group `index`'s settings (missing keys keep
        that group's values)."""
        raise NotImplementedError

    def _momentum(self) -> float:
        """The momentum a schedule cycles (OneCycleLR): Adam's beta1, SGD's momentum (the first
        group's, which the steps of groups that have no other take)."""
        return self._momenta()[0]

    def _momenta(self) -> List[float]:
        """Every group's momentum, for _set_momentum to put back (read once for each list of the
        groups' settings: a change makes a new one; fit asks at every step)."""
        owns, memo = self._owns, self._momenta_memo
        if memo is None or memo[0] is not owns:
            memo = self._momenta_memo = (owns, [self._part_fields(own)[0] for own in owns])
        return list(memo[1])

    def _with_momentum(self, own: Dict[str, Any], value: float) -> Dict[str, Any]:
        raise NotImplementedError

    @_locked
    def _set_momentum(self, value: Any) -> None:
        """Sets every group's momentum to value (as a schedule does at each step), or each group's
        to its own of a list (a schedule's per-group momenta, or _momenta()'s): the first group's is
        the configuration's, the others' go with their parts where they differ from it. A step on a
        device reads them there, so, like the rates, they change no captured step."""
        self._take_momenta(value)

    def _take_momenta(self, value: Any) -> None:
        """_set_momentum, with the lock held."""
        owns, with_momentum = self._owns, self._with_momentum
        if type(value) is list and len(value) == 1 == len(owns) and type(value[0]) is float:
            values = value  # (a one-group schedule's step: nothing to convert, and no other to check)
        else:
            values = [v if type(v) is float else _num("momentum", v)
                      for v in (value if isinstance(value, list) else [value] * len(owns))]
            if len(values) != len(owns):
                raise ValueError(f"expected {len(owns)} momenta, one per param group, got {len(values)}")
            for v in values[1:]:  # as the C optimizer checks the first (and the parts, when they get them)
                if not (0.0 <= v < 1.0 if self._kind == "adam" else 0.0 <= v <= _FLT_MAX):
                    raise ValueError(f"Invalid beta parameter at index 0: {v}" if self._kind == "adam" else
                                     f"Invalid momentum value: {v} (must be >= 0 and finite in float32)")
        before, first = self._c_own, values[0]
        self._c.momentum = first  # (kept as given: a float's double)
        own = self._c_own = with_momentum(before, first)
        if len(owns) == 1:  # (where it held the configuration's, it holds the new one: see _take_lrs)
            self._owns = [own if owns[0] is before else with_momentum(owns[0], first)]
        else:
            self._owns = [with_momentum(own, v) for own, v in zip(owns, values)]
            self._own_parts = None  # the parts get them before the next step (_sync_parts); one group's
            # part takes the configuration's settings whatever they are

    def _take_schedule(self, lrs: Any, momenta: Any = None) -> None:
        """A schedule's step: every group's new rate and, from one that cycles them, momentum
        (None: as they are), set as one, under one hold of the lock: a refused value changes
        nothing."""
        with self._lock:
            if self._torn:
                raise RuntimeError(_TORN)
            if momenta is None:
                self._take_lrs(lrs)
                return
            owns = self._owns
            self._take_momenta(momenta)
            try:
                self._take_lrs(lrs)
            except BaseException:
                self._take_momenta([self._part_fields(own)[0] for own in owns])
                raise
