"""cmlp.optim: Adam, AdamW and SGD with PyTorch's defaults, validation and update rules, applied
by one fused pass over the model's flat buffers. state_dict() mirrors torch.optim's layout, with
one entry per parameter tensor in the model's state_dict order. lr_scheduler holds torch's
learning-rate schedules."""
import copy
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Mapping, MutableMapping, Tuple

import numpy as np

from .. import _cmlp
from .._arrays import as_flag as _flag
from .._arrays import as_number as _num
from ..model import MLP, Parameters, model_of, parameter_of


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
    """A param group's boolean setting (nesterov, amsgrad, maximize, ...): a bool, else default."""
    value = group.get(key, default)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{key} must be a bool, got {value!r}")
    return bool(value)


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
# buffer NaN, AMSGrad's maximum negative (a maximum of squares; a step takes its exp_avg_sq there)
_UNSTARTED = {"momentum_buffer": np.nan, "max_exp_avg_sq": -1.0}
_INHERIT = float("nan")  # a part's setting that is the C configuration's (one object: tuples of it compare equal)


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
        self._extra: Dict[Any, Any] = {}

    @property
    def _opt(self) -> "Optimizer":
        opt = self._ref()
        if opt is None:
            raise ReferenceError("the optimizer of this param group no longer exists")
        return opt

    def _known(self) -> Dict[str, Any]:
        opt = self._opt
        group = opt._group(self._index)
        first = sum(len(g._names) for g in opt._param_groups[:self._index])
        group["params"] = list(range(first, first + len(self._names)))
        return group

    def __getitem__(self, key: Any) -> Any:
        known = self._known()
        return known[key] if key in known else self._extra[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        opt, i = self._opt, self._index
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

    def __delitem__(self, key: Any) -> None:
        if key in self._extra:
            del self._extra[key]
        elif key == "initial_lr" and self._opt._initial_lrs[self._index] is not None:
            self._opt._initial_lrs[self._index] = None
        else:
            raise KeyError(f"{key!r} cannot be removed from a cmlp optimizer's param group")

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


class Optimizer:
    """Base: holds the C optimizer bound to one model. The param groups' own rates, weight decays
    and hyperparameters are kept here; the C optimizer is configured as the first group and steps
    at a base rate (the largest group rate), and each group's part of the parameters at its
    multiple of it, with its weight decay and the hyperparameters in which it differs from the
    first group's."""

    _buffers: Tuple[str, ...] = ()
    # the hyperparameters a param group holds for itself beside lr and weight_decay (torch's keys)
    _per_group: Tuple[str, ...] = ()

    def __init__(self, model: MLP, kind: str, flags: Dict[str, Any], param_groups: Any = None, **config: Any) -> None:
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
        self._runs_made: Any = None  # _runs()
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
        specs, seen = [], {}
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

    def _part_settings(self, owns: List[Dict[str, Any]]) -> List[Tuple[Any, ...]]:
        """Each group's settings for its parts: its own where they differ from the first group's
        (the C configuration's), else _INHERIT (-1 for the flags)."""
        first = self._part_fields(owns[0])
        out = []
        for own in owns:
            fields = self._part_fields(own)
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

    @property
    def param_groups(self) -> List[MutableMapping]:
        """torch's param_groups (see _ParamGroup): by default one group, the model's parameters;
        e.g. opt.param_groups[0]["lr"] = 1e-4, or ["weight_decay"], which the next step uses. The
        list is a new one each time (the groups are given when the optimizer is made)."""
        return list(self._param_groups)

    def add_param_group(self, param_group: Any) -> None:
        """torch's add_param_group: every parameter tensor of the model is in a group from the
        start (param_groups=... when the optimizer is made), so none can be added."""
        raise ValueError("every parameter of the model is in a param group already: a cmlp optimizer's groups are "
                         "given when it is made (param_groups=[{'params': [...], 'lr': ...}, ...])")

    # the groups' rates and weight decays, and how the C optimizer steps them

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
        try:
            if wds[0] != self._c_wd or owns[0] != self._c_own:
                self._configure_first(wds[0], owns[0])
            self._sync_parts(scales, wds, own=own_parts)
            self._c.lr = base
        except BaseException:
            self._c.lr = before[0]
            if self._c_wd != before[1] or self._c_own != before[3]:
                self._configure_first(before[1], before[3])
            if self._c_parts != before[2]:
                self._c.set_parts(before[2])
                self._c_parts = before[2]
                self._synced = None
            raise
        self._lrs, self._wds, self._owns, self._own_parts = lrs, wds, owns, own_parts

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
            parts: List[Tuple[Any, ...]] = []
        else:
            parts = [(end, scales[g], wds[g]) + own[g] for end, g in self._runs()]
        if parts != self._c_parts:
            self._c.set_parts(parts)
            self._c_parts = parts
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
            if kept is not None and all(abs(s - k) <= 1e-12 * k for s, k in zip(scales, kept)):
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
    def weight_decay(self, value: float) -> None:
        self._set_group_wds([value] + self._wds[1:])

    def _group_lrs(self) -> List[float]:
        return list(self._lrs)

    def _set_group_lrs(self, lrs: Any) -> None:
        """Every group's rate at once (checked: a refused one changes none)."""
        self._push_groups(lrs=list(lrs))

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
    def lr(self, value: float) -> None:
        self._set_group_lrs([value] + self._lrs[1:])

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Optimizer":
        """copy.deepcopy (alone, or with its model, as torch's): the same kind of optimizer, with
        the same settings and state, on a deep copy of the model (the one copied alongside)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # before the model, which may refer to this optimizer
        model = copy.deepcopy(self.model, memo)
        self._init_like(twin, model)
        twin.load_state_dict(self.state_dict())
        for mine, theirs in zip(self._param_groups, twin._param_groups):
            theirs._extra = copy.deepcopy(mine._extra, memo)
        twin.defaults = copy.deepcopy(self.defaults, memo)
        return twin

    def _groups_spec(self) -> Any:
        """The param_groups argument that makes these groups again (None: the default one)."""
        if len(self._param_groups) == 1:
            return None
        return [{"params": list(g._names), "lr": lr, "weight_decay": wd, **own}
                for g, lr, wd, own in zip(self._param_groups, self._lrs, self._wds, self._owns)]

    def _init_like(self, twin: "Optimizer", model: MLP) -> None:
        """Runs the constructor of this kind of optimizer on twin, with this one's settings."""
        self._construct(twin, model, self._init_args())

    def _init_args(self) -> Dict[str, Any]:
        """The constructor's arguments that make this optimizer's settings and groups again."""
        raise NotImplementedError

    @staticmethod
    def _construct(twin: "Optimizer", model: MLP, args: Dict[str, Any]) -> None:
        raise NotImplementedError

    def __copy__(self) -> "Optimizer":
        """copy.copy: another Python object of the same optimizer (as before pickling was defined)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __reduce__(self) -> Tuple[Any, ...]:
        """pickle (torch.save of a whole optimizer): the same kind of optimizer, with the same
        settings, groups and state, on the model pickled with it (or alongside it)."""
        return (_unpickled, (type(self), self.model, self._init_args()),
                {"state_dict": self.state_dict(), "extras": [dict(g._extra) for g in self._param_groups],
                 "defaults": self.defaults})

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.load_state_dict(state["state_dict"])
        for group, extra in zip(self._param_groups, state["extras"]):
            group._extra = extra
        self.defaults = state["defaults"]

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
            loss = closure()
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    def _group(self, i: int = 0) -> Dict[str, Any]:
        """Param group i's settings (torch's keys, but for "params")."""
        raise NotImplementedError

    def _initial(self, i: int) -> Dict[str, Any]:
        """torch's 'initial_lr' group entry, once a schedule has set it."""
        return {} if self._initial_lrs[i] is None else {"initial_lr": self._initial_lrs[i]}

    def state_dict(self) -> Dict[str, Any]:
        return self._state_dict_of(*self._c.get_state())

    def _state_dict_of(self, step: int, bufs: List[np.ndarray]) -> Dict[str, Any]:
        """torch.optim's layout of a step count and flat state buffers."""
        names = [name for g in self._param_groups for name in g._names]  # numbered group after group
        state: Dict[int, Dict[str, Any]] = {}
        if bufs or (step > 0 and self._kind == "adam"):  # SGD without momentum keeps nothing, as torch's
            views = [self.model._split(flat) for flat in bufs]
            for i, name in enumerate(names):
                entry: Dict[str, Any] = {}
                if self._kind == "adam":
                    entry["step"] = float(step)
                for bname, view in zip(self._buffers, views):
                    entry[bname] = view[name].copy()
                # SGD's buffer not started (NaN: a group that has had no momentum): none in torch's state
                if self._kind == "sgd" and np.isnan(entry["momentum_buffer"]).all():
                    continue
                # likewise AMSGrad's maximum (negative: a group that has had no amsgrad)
                if "max_exp_avg_sq" in entry and (entry["max_exp_avg_sq"] < 0).all():
                    del entry["max_exp_avg_sq"]
                state[i] = entry
        groups = []
        for g in self._param_groups:
            group = {**g._extra, **g._known()}  # the keys a user added too, as torch
            groups.append(group)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Takes over a state_dict of the same kind of optimizer (this library's or torch.optim's
        layout). Everything is checked before anything changes: a ValueError leaves the
        optimizer as it was."""
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state_dict must be a dict with 'state' and 'param_groups'")
        state, groups = state_dict["state"], state_dict["param_groups"]
        mine = self._param_groups
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
            raise ValueError("optimizer state_dict's param_groups must be a list of dicts")
        if len(groups) != len(mine):
            raise ValueError(f"loaded state dict has a different number of parameter groups ({len(groups)}) than "
                             f"this optimizer ({len(mine)}): make it with the same param_groups")
        order: List[Any] = []
        for gi, (group, g) in enumerate(zip(groups, mine)):
            ids = group.get("params", ())
            if isinstance(ids, np.ndarray) and ids.ndim == 1:  # torch takes any sequence of indices
                ids = ids.tolist()
            if not isinstance(ids, (list, tuple)) or len(ids) != len(g._names):
                raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group: param group {gi} must have {len(g._names)} parameters")
            order += list(ids)
            foreign = sorted(set(group) & set(self._foreign_keys))
            if foreign:
                raise ValueError(f"this state_dict is not from {type(self).__name__}: its param group has {foreign}")
        # a flag a loaded group does not have is False, as torch's loading sets it (setdefault)
        configs = [self._group_config({**{k: False for k in self._flags_off}, **group}, i)
                   for i, group in enumerate(groups)]
        config = configs[0]
        owns = [self._own_of_config(c) for c in configs]
        shared = self._shared_defaults(config)
        for gi, other in enumerate(configs[1:], 1):
            differ = sorted(k for k, v in self._shared_defaults(other).items() if shared[k] != v)
            if differ:
                raise ValueError(f"loaded param group {gi} has other {differ} than group 0: cmlp's param groups "
                                 f"share {', '.join(shared)}")
        lrs = [_rate("lr", c["lr"]) for c in configs]
        wds = [_rate("weight_decay", c["weight_decay"]) for c in configs]
        if not isinstance(state, Mapping):
            raise ValueError("optimizer state_dict's 'state' must be a dict")
        names = [name for g in mine for name in g._names]
        step, bufs = self._parse_state(state, order, names) if state else (0, [])
        if len(bufs) > self._buffers_for(config):
            raise ValueError(f"optimizer state_dict has {len(bufs)} state buffers per parameter, but its settings "
                             f"keep {self._buffers_for(config)}")
        initial = []
        for group, own in zip(groups, self._initial_lrs):
            v = group.get("initial_lr", own)
            initial.append(None if v is None else _initial_lr_of(v))
        flags = {k: _implementation_flag(k, groups[0][k]) for k in self._flags if k in groups[0]}
        extras = []
        for gi, group in enumerate(groups):
            known = set(self._group(gi)) | {"params", "initial_lr"}
            extras.append({k: v for k, v in group.items() if k not in known})
        before, before_state = self._snapshot(), self._c.get_state()
        try:
            self._apply_config({**config, "lr": self._c.lr, "weight_decay": self._c_wd})  # the shared settings
            self._push_groups(lrs, wds, owns)  # and every group's, at once
            self._c.set_state(step, bufs)
        except BaseException:
            self._restore(before)
            self._c.set_state(*before_state)
            raise
        self._initial_lrs = initial
        self._flags.update(flags)
        for g, extra in zip(mine, extras):
            g._extra = extra

    def _buffers_for(self, config: Dict[str, Any]) -> int:
        """State buffers per parameter that these settings may keep."""
        if self._kind == "adam":
            return 3  # AMSGrad's max_exp_avg_sq is kept when amsgrad is turned off (as torch keeps it)
        return 1  # SGD's momentum buffer is kept at momentum 0 too (as torch keeps it)

    def _parse_state(self, state: Mapping, order: List[Any], names: List[str]) -> Tuple[int, List[np.ndarray]]:
        """(step, flat buffers) from per-parameter entries, checked. SGD's may leave parameters
        out (torch's state has none for those whose group has had no momentum): their buffer has
        not started (NaN); so may Adam's max_exp_avg_sq (for those whose group has had no amsgrad:
        negative, not started)."""
        if self._kind == "sgd" and all(k in order for k in state):
            state = {k: state.get(k, {}) for k in order}
        if len(state) != len(order) or any(k not in state for k in order):
            raise ValueError("optimizer state_dict's state does not cover every parameter (the parameters here step "
                             "together, at one step count: a torch state in which some parameters have not stepped "
                             "cannot be taken over)")
        allowed = set(self._buffers) | ({"step"} if self._kind == "adam" else set())
        steps = set()
        for k in order:
            entry = state[k]
            if not isinstance(entry, Mapping):
                raise ValueError(f"optimizer state of parameter {k!r} must be a dict, got {type(entry).__name__}")
            extra = sorted(map(str, set(entry) - allowed))
            if extra:
                raise ValueError(f"this state_dict is not from {type(self).__name__}: parameter {k!r} has state "
                                 f"{extra}")
            raw = np.asarray(entry.get("step", 0))  # a number, or torch's one-element tensor
            if raw.dtype.kind not in "iuf" or raw.size != 1:  # not a bool, a string or a complex
                raise ValueError(f"optimizer state of parameter {k!r}: step must be a number, got "
                                 f"{entry.get('step')!r}")
            value = float(raw.reshape(()))
            if not (0 <= value < 2**53 and value.is_integer()):
                raise ValueError(f"optimizer state of parameter {k!r}: step must be a whole number >= 0, got {value}")
            steps.add(int(value))
        if len(steps) != 1:
            raise ValueError("optimizer state_dict has different step counts per parameter")
        step = steps.pop()
        bufs: List[np.ndarray] = []
        given = []
        for bname in self._buffers:
            # torch.optim.SGD of some versions keeps momentum_buffer None until it has one
            present = [state[k].get(bname) is not None for k in order]
            if not any(present):
                continue
            unstarted = _UNSTARTED.get(bname)  # SGD's and AMSGrad's: where not started
            if not all(present) and unstarted is None:
                raise ValueError(f"optimizer state {bname} is given for some parameters only")
            flat = np.full(self.model.num_parameters(), 0.0 if unstarted is None else unstarted, dtype=np.float32)
            views = self.model._split(flat)  # where the state_dict gives none: not started
            for k, name, here in zip(order, names, present):
                if not here:
                    continue
                try:
                    arr = np.asarray(state[k][bname])
                    if arr.dtype.kind not in "iuf":  # bools and complex numbers are not state
                        raise TypeError
                    arr = arr.astype(np.float32)
                except (TypeError, ValueError):
                    raise ValueError(f"optimizer state {bname} of {name} must be an array of real numbers") from None
                if arr.shape != views[name].shape:
                    raise ValueError(f"optimizer state {bname} of {name} has shape {arr.shape}, "
                                     f"expected {views[name].shape}")
                if not np.isfinite(arr).all():
                    raise ValueError(f"optimizer state {bname} holds inf or NaN")
                if bname in ("exp_avg_sq", "max_exp_avg_sq") and not (arr >= 0).all():
                    raise ValueError(f"optimizer state {bname} must be >= 0 everywhere (a running mean of squares)")
                views[name][...] = arr
            bufs.append(flat)
            given.append(bname)
        if self._kind == "adam" and given and given[:2] != ["exp_avg", "exp_avg_sq"]:
            raise ValueError(f"optimizer state_dict has Adam state {given} without exp_avg and exp_avg_sq")
        if self._kind == "adam" and step > 0 and not bufs:
            raise ValueError("optimizer state_dict has an Adam step count without exp_avg and exp_avg_sq")
        if self._kind == "sgd" and not bufs:
            step = 0
        return step, bufs

    # the param-group keys of the other optimizer: a state_dict that has them is not this one's
    _foreign_keys: Tuple[str, ...] = ()
    # the flags torch's load_state_dict sets to False in a loaded group that does not have them
    _flags_off: Tuple[str, ...] = ()

    def _group_config(self, group: Mapping, index: int = 0) -> Dict[str, Any]:
        """The C optimizer's configuration from param group `index`'s settings (missing keys keep
        that group's values)."""
        raise NotImplementedError

    def _momentum(self) -> float:
        """The momentum a schedule cycles (OneCycleLR): Adam's beta1, SGD's momentum (the first
        group's, which the steps of groups that have no other take)."""
        return self._part_fields(self._owns[0])[0]

    def _momenta(self) -> List[float]:
        """Every group's momentum, for _set_momentum to put back."""
        return [self._part_fields(own)[0] for own in self._owns]

    def _with_momentum(self, own: Dict[str, Any], value: float) -> Dict[str, Any]:
        raise NotImplementedError

    def _set_momentum(self, value: Any) -> None:
        """Sets every group's momentum to value (as a schedule does at each step), or each group's
        to its own of a list (a schedule's per-group momenta, or _momenta()'s): the first group's is
        the configuration's, the others' go with their parts where they differ from it. A step on a
        device reads them there, so, like the rates, they change no captured step."""
        values = [_num("momentum", v) for v in (value if isinstance(value, list) else [value] * len(self._owns))]
        if len(values) != len(self._owns):
            raise ValueError(f"expected {len(self._owns)} momenta, one per param group, got {len(values)}")
        for v in values[1:]:  # as the C optimizer checks the first (and the parts, when they get them)
            if not (0.0 <= v < 1.0 if self._kind == "adam" else 0.0 <= v <= _FLT_MAX):
                raise ValueError(f"Invalid beta parameter at index 0: {v}" if self._kind == "adam" else
                                 f"Invalid momentum value: {v} (must be >= 0 and finite in float32)")
        self._c.momentum = values[0]
        self._c_own = self._with_momentum(self._c_own, self._c.momentum)
        self._owns = [self._with_momentum(own, v) for own, v in zip(self._owns, values)]
        self._own_parts = None  # the parts get them before the next step (_sync_parts)


class Adam(Optimizer):
    """torch.optim.Adam, bias-corrected: weight_decay is L2, added to the gradient, unless
    decoupled_weight_decay=True, which makes it AdamW's (the parameters multiplied by
    1 - lr * weight_decay before each update). amsgrad=True: AMSGrad, the denominator made of the
    largest exp_avg_sq so far (a third state buffer, max_exp_avg_sq, which spans every group once
    one has amsgrad); maximize=True: each step
    climbs the objective (the gradient's sign flipped). param_groups: torch's param groups, e.g.
    [{"params": ["fc1.weight", "fc2.weight", "fc3.weight"]},
     {"params": ["fc1.bias", "fc2.bias", "fc3.bias"], "weight_decay": 0.0}]: each its own
    "lr", "weight_decay", "betas", "eps", "amsgrad" and "maximize" (default: the arguments');
    decoupled_weight_decay is every group's; every parameter in one group."""

    _buffers = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _per_group = ("betas", "eps", "amsgrad", "maximize")

    def __init__(self, model: MLP, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Any = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False, fused: Any = None,
                 decoupled_weight_decay: bool = False, param_groups: Any = None) -> None:
        b1, b2 = self._betas(betas)
        decoupled_weight_decay = _flag("decoupled_weight_decay", decoupled_weight_decay)
        amsgrad, maximize = _flag("amsgrad", amsgrad), _flag("maximize", maximize)
        _unsupported_flag("differentiable", differentiable)
        flags = _implementation_flags(("foreach", "capturable", "fused"),
                                      {"foreach": foreach, "capturable": capturable, "fused": fused})
        self._settings = {"decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(model, "adam", flags, param_groups, lr=_num("lr", lr), beta1=b1, beta2=b2,
                         eps=_num("eps", eps), weight_decay=_num("weight_decay", weight_decay),
                         decoupled_weight_decay=decoupled_weight_decay, amsgrad=amsgrad, maximize=maximize)
        # as constructed, as torch's
        self.defaults = {**{k: v for k, v in self._group(0).items() if k != "initial_lr"},
                         "lr": float(lr), "betas": (b1, b2), "eps": float(eps), "weight_decay": float(weight_decay),
                         "amsgrad": amsgrad, "maximize": maximize}

    def _init_args(self) -> Dict[str, Any]:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, amsgrad=self.amsgrad,
                    maximize=self.maximize, **self._flags, decoupled_weight_decay=self.decoupled_weight_decay,
                    param_groups=self._groups_spec())

    @staticmethod
    def _construct(twin: Optimizer, model: MLP, args: Dict[str, Any]) -> None:
        Adam.__init__(twin, model, **args)  # type: ignore  # AdamW's too (its decoupled weight decay given)

    betas = _setting("betas", "(beta1, beta2): param_groups[0]['betas']; setting it sets every group's")
    eps = _setting("eps", "the denominator's epsilon: the first group's; setting it sets every group's")
    amsgrad = _setting("amsgrad", "AMSGrad when True: the first group's; setting it sets every group's (turned on "
                                  "after steps were taken, its maximum of exp_avg_sq starts at the next step)")
    maximize = _setting("maximize", "steps climb the objective when True: the first group's; setting it sets "
                                    "every group's")
    decoupled_weight_decay = _setting("decoupled_weight_decay", "AdamW's weight decay when True; settable")

    @staticmethod
    def _betas(betas: Any) -> Tuple[float, float]:
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise TypeError(f"betas must be a pair of floats, got {betas!r}") from None
        return _num("betas[0]", b1), _num("betas[1]", b2)

    def _shared_defaults(self, config: Dict[str, Any]) -> Dict[str, Any]:
        return {"decoupled_weight_decay": config["decoupled_weight_decay"]}

    def _own_of_config(self, config: Mapping) -> Dict[str, Any]:
        return {"betas": (config["beta1"], config["beta2"]), "eps": config["eps"], "amsgrad": config["amsgrad"],
                "maximize": config["maximize"]}

    def _own_from(self, group: Mapping, base: Mapping) -> Dict[str, Any]:
        return {"betas": self._betas(group.get("betas", base["betas"])),
                "eps": _num("eps", group.get("eps", base["eps"])),
                "amsgrad": _bool_setting(group, "amsgrad", base["amsgrad"]),
                "maximize": _bool_setting(group, "maximize", base["maximize"])}

    def _part_fields(self, own: Mapping) -> Tuple[Any, ...]:
        return own["betas"][0], own["betas"][1], own["eps"], None, None, own["maximize"], own["amsgrad"]

    def _with_momentum(self, own: Dict[str, Any], value: float) -> Dict[str, Any]:
        return {**own, "betas": (value, own["betas"][1])}

    def _group(self, i: int = 0) -> Dict[str, Any]:
        own = self._owns[i]
        return {"lr": self._lrs[i], "betas": own["betas"], "eps": own["eps"], "weight_decay": self._wds[i],
                "amsgrad": own["amsgrad"], "maximize": own["maximize"], "differentiable": False, **self._flags,
                "decoupled_weight_decay": self.decoupled_weight_decay, **self._initial(i)}

    _foreign_keys = ("momentum", "dampening", "nesterov")
    _flags_off = ("amsgrad", "maximize")

    def _group_config(self, group: Mapping, index: int = 0) -> Dict[str, Any]:
        if group.get("differentiable"):
            raise ValueError("differentiable=True is not supported by cmlp's optimizers")
        own = self._own_from(group, self._owns[index])
        # torch's AdamW state_dicts say decoupled_weight_decay=True; older ones say nothing
        decoupled = _bool_setting(group, "decoupled_weight_decay", self.decoupled_weight_decay)
        return {"lr": _num("lr", group.get("lr", self._lrs[index])), "beta1": own["betas"][0],
                "beta2": own["betas"][1], "eps": own["eps"],
                "weight_decay": _num("weight_decay", group.get("weight_decay", self._wds[index])),
                "decoupled_weight_decay": decoupled, "amsgrad": own["amsgrad"], "maximize": own["maximize"]}

    def _apply_config(self, config: Dict[str, Any]) -> None:
        self._c.configure(**config)
        self._c_own = self._own_of_config(config)
        self._settings.update(decoupled_weight_decay=config["decoupled_weight_decay"])


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (default 1e-2): each update first
    multiplies the parameters by 1 - lr * weight_decay, then takes Adam's step without it."""

    def __init__(self, model: MLP, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, foreach: Any = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Any = None, param_groups: Any = None) -> None:
        super().__init__(model, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, param_groups=param_groups)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As Adam's, but the weight decay stays decoupled whatever the state_dict says (torch's
        AdamW forces it when it loads, so an Adam checkpoint does not make it Adam); a deepcopy
        loads too."""
        if isinstance(state_dict, Mapping) and isinstance(state_dict.get("param_groups"), (list, tuple)):
            groups = [{**g, "decoupled_weight_decay": True} if isinstance(g, Mapping) else g
                      for g in state_dict["param_groups"]]
            state_dict = {**state_dict, "param_groups": groups}
        super().load_state_dict(state_dict)


class SGD(Optimizer):
    """torch.optim.SGD: momentum (buffer = gradient at the first step), dampening, nesterov,
    L2 weight decay, maximize (steps climb the objective). param_groups: as Adam's (each group its
    own "lr", "weight_decay", "momentum", "dampening", "nesterov" and "maximize"). A group's
    momentum buffer starts from the gradient at its first step with momentum, as torch's; until
    then state_dict() has none for its parameters, as torch's."""

    _buffers = ("momentum_buffer",)
    _per_group = ("momentum", "dampening", "nesterov", "maximize")

    def __init__(self, model: MLP, lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
                 *args: Any, nesterov: bool = False, weight_decay: float = 0.0, maximize: bool = False,
                 foreach: Any = None, differentiable: bool = False, fused: Any = None,
                 param_groups: Any = None) -> None:
        if args:  # torch's fifth is weight_decay, this library's was nesterov: by name only
            raise TypeError("SGD takes nesterov and weight_decay by name only (torch's positional order puts "
                            "weight_decay before nesterov): e.g. SGD(model, 0.1, 0.9, weight_decay=1e-4)")
        _unsupported_flag("differentiable", differentiable)
        maximize = _flag("maximize", maximize)
        flags = _implementation_flags(("foreach", "fused"), {"foreach": foreach, "fused": fused})
        nesterov = _flag("nesterov", nesterov)
        self._settings = {}
        super().__init__(model, "sgd", flags, param_groups, lr=_num("lr", lr), momentum=_num("momentum", momentum),
                         dampening=_num("dampening", dampening), nesterov=nesterov,
                         weight_decay=_num("weight_decay", weight_decay), maximize=maximize)
        self.defaults = {**{k: v for k, v in self._group(0).items() if k != "initial_lr"},
                         "lr": float(lr), "momentum": float(momentum), "dampening": float(dampening),
                         "weight_decay": float(weight_decay), "nesterov": nesterov, "maximize": maximize}

    def _init_args(self) -> Dict[str, Any]:
        # Nesterov's needs are checked when an optimizer is made only (as torch's): a schedule or a
        # setting may have moved the momentum to 0 since; load_state_dict sets nesterov
        return dict(lr=self.lr, momentum=self.momentum, dampening=self.dampening, nesterov=False,
                    weight_decay=self.weight_decay, maximize=self.maximize, **self._flags,
                    param_groups=self._groups_spec())

    @staticmethod
    def _construct(twin: Optimizer, model: MLP, args: Dict[str, Any]) -> None:
        SGD.__init__(twin, model, **args)  # type: ignore

    momentum = _setting("momentum", "param_groups[0]['momentum']; setting it sets every group's")
    dampening = _setting("dampening", "the first group's; setting it sets every group's")
    nesterov = _setting("nesterov", "the first group's; setting it sets every group's")
    maximize = _setting("maximize", "steps climb the objective when True: the first group's; setting it sets "
                                    "every group's")

    def _own_of_config(self, config: Mapping) -> Dict[str, Any]:
        return {"momentum": config["momentum"], "dampening": config["dampening"], "nesterov": config["nesterov"],
                "maximize": config["maximize"]}

    def _own_from(self, group: Mapping, base: Mapping) -> Dict[str, Any]:
        return {"momentum": _num("momentum", group.get("momentum", base["momentum"])),
                "dampening": _num("dampening", group.get("dampening", base["dampening"])),
                "nesterov": _bool_setting(group, "nesterov", base["nesterov"]),
                "maximize": _bool_setting(group, "maximize", base["maximize"])}

    def _part_fields(self, own: Mapping) -> Tuple[Any, ...]:
        return own["momentum"], None, None, own["dampening"], own["nesterov"], own["maximize"], None

    def _with_momentum(self, own: Dict[str, Any], value: float) -> Dict[str, Any]:
        return {**own, "momentum": value}

    def _group(self, i: int = 0) -> Dict[str, Any]:
        own = self._owns[i]
        return {"lr": self._lrs[i], "momentum": own["momentum"], "dampening": own["dampening"],
                "weight_decay": self._wds[i], "nesterov": own["nesterov"], "maximize": own["maximize"],
                **self._flags, "differentiable": False, **self._initial(i)}

    _foreign_keys = ("betas", "eps", "amsgrad")
    _flags_off = ("nesterov", "maximize")

    def _group_config(self, group: Mapping, index: int = 0) -> Dict[str, Any]:
        if group.get("differentiable"):
            raise ValueError("differentiable=True is not supported by cmlp's optimizers")
        own = self._own_from(group, self._owns[index])
        return {"lr": _num("lr", group.get("lr", self._lrs[index])), "momentum": own["momentum"],
                "dampening": own["dampening"], "nesterov": own["nesterov"],
                "weight_decay": _num("weight_decay", group.get("weight_decay", self._wds[index])),
                "maximize": own["maximize"]}

    def _apply_config(self, config: Dict[str, Any]) -> None:
        self._c.configure(**config)
        self._c_own = self._own_of_config(config)


def _unpickled(cls: type, model: MLP, args: Dict[str, Any]) -> Optimizer:
    """An optimizer of class cls made on model with args (Optimizer.__reduce__'s); its state
    follows (__setstate__)."""
    twin = cls.__new__(cls)
    cls._construct(twin, model, args)
    return twin


from . import lr_scheduler  # noqa: E402 (it needs Optimizer)

__all__ = ["Optimizer", "Adam", "AdamW", "SGD", "lr_scheduler"]
