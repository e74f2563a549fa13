"""cmlp.optim: Adam, AdamW and SGD with PyTorch's defaults, validation and update rules, applied
by one fused pass over the model's flat buffers. state_dict() mirrors torch.optim's layout, with
one entry per parameter tensor in the model's state_dict order. lr_scheduler holds torch's
learning-rate schedules."""
import copy
import weakref
from typing import Any, Dict, Iterator, List, Mapping, MutableMapping, Tuple

import numpy as np

from .. import _cmlp
from .._arrays import as_flag as _flag
from .._arrays import as_number as _num
from ..model import MLP, model_of


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
    """torch's amsgrad, maximize and differentiable: only False (their default) is supported."""
    if _flag(name, value):
        raise ValueError(f"{name}=True is not supported by cmlp's optimizers")
    return False


def _initial_lr_of(value: Any) -> float:
    """torch's 'initial_lr' (the rate a schedule starts from): a finite number >= 0, as a rate."""
    v = _num("initial_lr", value)
    if not 0.0 <= v < float("inf"):
        raise ValueError(f"initial_lr must be a finite number >= 0, got {value!r}")
    return v


def _setting(key: str, doc: str) -> Any:
    """A param-group setting as an attribute: read, or set as torch's param_groups[0][key] = value
    sets it (checked, and applied from the next step on)."""

    def get(self: "Optimizer") -> Any:
        return self._settings[key]

    def set(self: "Optimizer", value: Any) -> None:
        self._apply(self._group_config({key: value}))

    return property(get, set, doc=doc)


class _ParamGroup(MutableMapping):
    """torch's param_groups[0]: the optimizer's settings as a dict. Setting "lr", a
    hyperparameter or "initial_lr" sets the optimizer's (checked, applied from the next step on,
    as torch reads its groups at each step); other keys are kept as given, as torch keeps them.
    "params" is the model's parameter tensors (indices in state_dict order) and cannot change."""

    def __init__(self, opt: "Optimizer") -> None:
        self._ref = weakref.ref(opt)  # not a cycle: a deleted optimizer (and model) is freed at once
        self._extra: Dict[Any, Any] = {}

    @property
    def _opt(self) -> "Optimizer":
        opt = self._ref()
        if opt is None:
            raise ReferenceError("the optimizer of this param group no longer exists")
        return opt

    def _known(self) -> Dict[str, Any]:
        group = self._opt._group()
        group["params"] = list(range(2 * (len(self._opt.model.layer_sizes) - 1)))
        return group

    def __getitem__(self, key: Any) -> Any:
        known = self._known()
        return known[key] if key in known else self._extra[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        opt = self._opt
        if key == "params":
            raise ValueError("a cmlp optimizer's param group is its model's parameters: 'params' cannot change")
        if key == "lr":
            opt.lr = value
        elif key in opt._flags:  # foreach, fused (and Adam's capturable)
            opt._flags[key] = _implementation_flag(key, value)
        elif key == "initial_lr":
            opt._initial_lr = _initial_lr_of(value)
        elif key in opt._settings:
            setattr(opt, key, value)
        elif key in opt._group():  # amsgrad, maximize, differentiable: only their defaults
            _unsupported_flag(key, value)
        elif key in opt._foreign_keys:
            raise ValueError(f"{type(opt).__name__} has no {key!r} setting")
        else:
            self._extra[key] = value

    def update(self, *args: Any, **kwargs: Any) -> None:
        """dict.update, all or nothing: a refused key leaves every setting as it was."""
        opt = self._opt
        before = (opt._group_config(opt._group()), opt.lr, opt._initial_lr, dict(opt._flags), dict(self._extra))
        try:
            for key, value in dict(*args, **kwargs).items():
                self[key] = value
        except BaseException:
            config, lr, opt._initial_lr, flags, self._extra = before
            opt._apply(config)
            opt.lr = lr
            opt._flags.clear()
            opt._flags.update(flags)
            raise

    def __delitem__(self, key: Any) -> None:
        if key in self._extra:
            del self._extra[key]
        elif key == "initial_lr" and self._opt._initial_lr is not None:
            self._opt._initial_lr = None
        else:
            raise KeyError(f"{key!r} cannot be removed from a cmlp optimizer's param group")

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._known()) + list(self._extra))

    def __len__(self) -> int:
        return len(self._known()) + len(self._extra)

    def __repr__(self) -> str:
        return repr(dict(self))


class Optimizer:
    """Base: holds the C optimizer bound to one model."""

    _buffers: Tuple[str, ...] = ()

    def __init__(self, model: MLP, kind: str, flags: Dict[str, Any], **config: Any) -> None:
        model = model_of(model, "the first argument")
        self.model = model
        self._kind = kind
        self._c = _cmlp.Optimizer(model._c, kind, **config)
        self._initial_lr: Any = None  # set by the first lr_scheduler made for it (torch's 'initial_lr')
        self._settings: Dict[str, Any] = {}  # the hyperparameters, as _apply last set them
        self._flags = flags  # torch's foreach, capturable and fused, as given
        self._param_groups = [_ParamGroup(self)]
        model._optimizers.add(self)

    @property
    def param_groups(self) -> List[MutableMapping]:
        """torch's param_groups: one group, the model's parameters (see _ParamGroup); e.g.
        opt.param_groups[0]["lr"] = 1e-4, or ["weight_decay"], which the next step uses."""
        return self._param_groups

    @property
    def lr(self) -> float:
        return self._c.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._c.lr = _num("lr", value)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Optimizer":
        """copy.deepcopy (alone, or with its model, as torch's): the same kind of optimizer, with
        the same settings and state, on a deep copy of the model (the one copied alongside)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # before the model, which may refer to this optimizer
        model = copy.deepcopy(self.model, memo)
        self._init_like(twin, model)
        twin.load_state_dict(self.state_dict())
        twin._param_groups[0]._extra = copy.deepcopy(self._param_groups[0]._extra, memo)
        twin.defaults = copy.deepcopy(self.defaults, memo)
        return twin

    def _init_like(self, twin: "Optimizer", model: MLP) -> None:
        """Runs the constructor of this kind of optimizer on twin, with this one's settings."""
        raise NotImplementedError

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
        if self.model._grads_none:
            self._c.lr  # noqa: B018 - refuses, as every call, where the model was lost to a fork
            return loss
        self._c.step()
        return loss

    @property
    def state(self) -> Dict[int, Dict[str, Any]]:
        """torch's optimizer.state, keyed as param_groups[0]["params"] (the parameter tensors'
        indices in state_dict order): copies of each tensor's step and buffers, as in
        state_dict()["state"]; empty before the first step."""
        return self.state_dict()["state"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    def _group(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _initial(self) -> Dict[str, Any]:
        """torch's 'initial_lr' group entry, once a schedule has set it."""
        return {} if self._initial_lr is None else {"initial_lr": self._initial_lr}

    def state_dict(self) -> Dict[str, Any]:
        return self._state_dict_of(*self._c.get_state())

    def _state_dict_of(self, step: int, bufs: List[np.ndarray]) -> Dict[str, Any]:
        """torch.optim's layout of a step count and flat state buffers."""
        names = list(self.model.state_dict().keys())
        state: Dict[int, Dict[str, Any]] = {}
        if bufs or (step > 0 and self._kind == "adam"):  # SGD without momentum keeps nothing, as torch's
            for i, name in enumerate(names):
                entry: Dict[str, Any] = {}
                if self._kind == "adam":
                    entry["step"] = float(step)
                for bname, flat in zip(self._buffers, bufs):
                    entry[bname] = self.model._split(flat)[name].copy()
                state[i] = entry
        group = {**self._param_groups[0]._extra, **self._group()}  # the keys a user added too, as torch
        group["params"] = list(range(len(names)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Takes over a state_dict of the same kind of optimizer (this library's or torch.optim's
        layout). Everything is checked before anything changes: a ValueError leaves the
        optimizer as it was."""
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state_dict must be a dict with 'state' and 'param_groups'")
        state, groups = state_dict["state"], state_dict["param_groups"]
        names = list(self.model.state_dict().keys())
        if not isinstance(groups, (list, tuple)) or len(groups) != 1 or not isinstance(groups[0], Mapping):
            raise ValueError("optimizer state_dict's param_groups must be a list of one dict")
        group = groups[0]
        order = group.get("params", ())
        if isinstance(order, np.ndarray) and order.ndim == 1:  # torch takes any sequence of indices
            order = order.tolist()
        if not isinstance(order, (list, tuple)) or len(order) != len(names):
            raise ValueError(f"optimizer state_dict must have one param group of {len(names)} parameters")
        foreign = sorted(set(group) & set(self._foreign_keys))
        if foreign:
            raise ValueError(f"this state_dict is not from {type(self).__name__}: its param group has {foreign}")
        config = self._group_config(group)
        if not isinstance(state, Mapping):
            raise ValueError("optimizer state_dict's 'state' must be a dict")
        step, bufs = self._parse_state(state, list(order), names) if state else (0, [])
        if len(bufs) > self._buffers_for(config):
            raise ValueError(f"optimizer state_dict has {len(bufs)} state buffers per parameter, but its settings "
                             f"keep {self._buffers_for(config)}")
        initial = group.get("initial_lr", self._initial_lr)
        if initial is not None:
            initial = _initial_lr_of(initial)
        flags = {k: _implementation_flag(k, group[k]) for k in self._flags if k in group}
        known = set(self._group()) | {"params", "initial_lr"}
        extra = {k: v for k, v in group.items() if k not in known}
        before, before_state = self._group_config(self._group()), self._c.get_state()
        self._apply(config)
        try:
            self._c.set_state(step, bufs)
        except BaseException:
            self._apply(before)
            self._c.set_state(*before_state)
            raise
        self._initial_lr = initial
        self._flags.update(flags)
        self._param_groups[0]._extra = extra

    def _buffers_for(self, config: Dict[str, Any]) -> int:
        """State buffers per parameter that these settings keep."""
        if self._kind == "adam":
            return 2
        return 1  # SGD's momentum buffer is kept at momentum 0 too (as torch keeps it)

    def _parse_state(self, state: Mapping, order: List[Any], names: List[str]) -> Tuple[int, List[np.ndarray]]:
        """(step, flat buffers) from per-parameter entries, checked."""
        if len(state) != len(order) or any(k not in state for k in order):
            raise ValueError("optimizer state_dict's state does not cover every parameter")
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
        for bname in self._buffers:
            # torch.optim.SGD of some versions keeps momentum_buffer None until it has one
            present = [state[k].get(bname) is not None for k in order]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"optimizer state {bname} is given for some parameters only")
            flat = np.empty(self.model.num_parameters(), dtype=np.float32)
            views = self.model._split(flat)
            for k, name in zip(order, names):
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
                views[name][...] = arr
            if not np.isfinite(flat).all():
                raise ValueError(f"optimizer state {bname} holds inf or NaN")
            if bname == "exp_avg_sq" and not (flat >= 0).all():
                raise ValueError("optimizer state exp_avg_sq must be >= 0 everywhere (a running mean of squares)")
            bufs.append(flat)
        if self._kind == "adam" and step > 0 and len(bufs) != 2:
            raise ValueError("optimizer state_dict has an Adam step count without exp_avg and exp_avg_sq")
        if self._kind == "sgd" and not bufs:
            step = 0
        return step, bufs

    # the param-group keys of the other optimizer: a state_dict that has them is not this one's
    _foreign_keys: Tuple[str, ...] = ()

    def _group_config(self, group: Mapping) -> Dict[str, Any]:
        """The C optimizer's configuration from a param group (missing keys keep their values)."""
        raise NotImplementedError

    def _apply(self, config: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _momentum(self) -> float:
        """The momentum a schedule cycles (OneCycleLR): Adam's beta1, SGD's momentum."""
        return self.betas[0] if self._kind == "adam" else self.momentum  # type: ignore[attr-defined]

    def _set_momentum(self, value: float) -> None:
        """Sets what _momentum() reads (as a schedule does at each step): a step on a device reads
        it there, so, like the rate, it changes no captured step."""
        self._c.momentum = _num("momentum", value)
        if self._kind == "adam":
            self._settings["betas"] = (self._c.momentum, self._settings["betas"][1])
        else:
            self._settings["momentum"] = self._c.momentum


class Adam(Optimizer):
    """torch.optim.Adam, bias-corrected: weight_decay is L2, added to the gradient, unless
    decoupled_weight_decay=True, which makes it AdamW's (the parameters multiplied by
    1 - lr * weight_decay before each update)."""

    _buffers = ("exp_avg", "exp_avg_sq")

    def __init__(self, model: MLP, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Any = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False, fused: Any = None,
                 decoupled_weight_decay: bool = False) -> None:
        b1, b2 = self._betas(betas)
        decoupled_weight_decay = _flag("decoupled_weight_decay", decoupled_weight_decay)
        for name, value in (("amsgrad", amsgrad), ("maximize", maximize), ("differentiable", differentiable)):
            _unsupported_flag(name, value)
        flags = _implementation_flags(("foreach", "capturable", "fused"),
                                      {"foreach": foreach, "capturable": capturable, "fused": fused})
        super().__init__(model, "adam", flags, lr=_num("lr", lr), beta1=b1, beta2=b2, eps=_num("eps", eps),
                         weight_decay=_num("weight_decay", weight_decay), decoupled_weight_decay=decoupled_weight_decay)
        self._settings.update(betas=(b1, b2), eps=float(eps), weight_decay=float(weight_decay),
                              decoupled_weight_decay=decoupled_weight_decay)
        self.defaults = {k: v for k, v in self._group().items() if k != "initial_lr"}  # as constructed, as torch's

    def _init_like(self, twin: Optimizer, model: MLP) -> None:
        Adam.__init__(twin, model, self.lr, self.betas, self.eps, self.weight_decay, **self._flags,  # type: ignore
                      decoupled_weight_decay=self.decoupled_weight_decay)

    betas = _setting("betas", "(beta1, beta2); settable, as param_groups[0]['betas']")
    eps = _setting("eps", "the denominator's epsilon; settable")
    weight_decay = _setting("weight_decay", "L2 (or, decoupled, AdamW's) weight decay; settable")
    decoupled_weight_decay = _setting("decoupled_weight_decay", "AdamW's weight decay when True; settable")

    @staticmethod
    def _betas(betas: Any) -> Tuple[float, float]:
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise TypeError(f"betas must be a pair of floats, got {betas!r}") from None
        return _num("betas[0]", b1), _num("betas[1]", b2)

    def _group(self) -> Dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "amsgrad": False, "maximize": False, "differentiable": False, **self._flags,
                "decoupled_weight_decay": self.decoupled_weight_decay, **self._initial()}

    _foreign_keys = ("momentum", "dampening", "nesterov")

    def _group_config(self, group: Mapping) -> Dict[str, Any]:
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"{flag}=True is not supported by cmlp's optimizers")
        b1, b2 = self._betas(group.get("betas", self.betas))
        # torch's AdamW state_dicts say decoupled_weight_decay=True; older ones say nothing
        decoupled = group.get("decoupled_weight_decay", self.decoupled_weight_decay)
        if not isinstance(decoupled, (bool, np.bool_)):
            raise ValueError(f"decoupled_weight_decay must be a bool, got {decoupled!r}")
        return {"lr": _num("lr", group.get("lr", self.lr)), "beta1": b1, "beta2": b2,
                "eps": _num("eps", group.get("eps", self.eps)),
                "weight_decay": _num("weight_decay", group.get("weight_decay", self.weight_decay)),
                "decoupled_weight_decay": bool(decoupled)}

    def _apply(self, config: Dict[str, Any]) -> None:
        self._c.configure(**config)
        self._settings.update(betas=(config["beta1"], config["beta2"]), eps=config["eps"],
                              weight_decay=config["weight_decay"], decoupled_weight_decay=config["decoupled_weight_decay"])


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (default 1e-2): each update first
    multiplies the parameters by 1 - lr * weight_decay, then takes Adam's step without it."""

    def __init__(self, model: MLP, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, foreach: Any = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Any = None) -> None:
        super().__init__(model, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)

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
    L2 weight decay."""

    _buffers = ("momentum_buffer",)

    def __init__(self, model: MLP, lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
                 *args: Any, nesterov: bool = False, weight_decay: float = 0.0, maximize: bool = False,
                 foreach: Any = None, differentiable: bool = False, fused: Any = None) -> None:
        if args:  # torch's fifth is weight_decay, this library's was nesterov: by name only
            raise TypeError("SGD takes nesterov and weight_decay by name only (torch's positional order puts "
                            "weight_decay before nesterov): e.g. SGD(model, 0.1, 0.9, weight_decay=1e-4)")
        for name, value in (("maximize", maximize), ("differentiable", differentiable)):
            _unsupported_flag(name, value)
        flags = _implementation_flags(("foreach", "fused"), {"foreach": foreach, "fused": fused})
        super().__init__(model, "sgd", flags, lr=_num("lr", lr), momentum=_num("momentum", momentum),
                         dampening=_num("dampening", dampening), nesterov=_flag("nesterov", nesterov),
                         weight_decay=_num("weight_decay", weight_decay))
        self._settings.update(momentum=float(momentum), dampening=float(dampening), nesterov=_flag("nesterov", nesterov),
                              weight_decay=float(weight_decay))
        self.defaults = {k: v for k, v in self._group().items() if k != "initial_lr"}

    def _init_like(self, twin: Optimizer, model: MLP) -> None:
        # Nesterov's needs are checked when an optimizer is made only (as torch's): a schedule or a
        # setting may have moved the momentum to 0 since; load_state_dict sets nesterov
        SGD.__init__(twin, model, self.lr, self.momentum, self.dampening, nesterov=False,  # type: ignore
                     weight_decay=self.weight_decay, **self._flags)

    momentum = _setting("momentum", "settable, as param_groups[0]['momentum']")
    dampening = _setting("dampening", "settable")
    nesterov = _setting("nesterov", "settable")
    weight_decay = _setting("weight_decay", "L2 weight decay; settable")

    def _group(self) -> Dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov, "maximize": False, **self._flags,
                "differentiable": False, **self._initial()}

    _foreign_keys = ("betas", "eps", "amsgrad")

    def _group_config(self, group: Mapping) -> Dict[str, Any]:
        for flag in ("maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"{flag}=True is not supported by cmlp's optimizers")
        return {"lr": _num("lr", group.get("lr", self.lr)),
                "momentum": _num("momentum", group.get("momentum", self.momentum)),
                "dampening": _num("dampening", group.get("dampening", self.dampening)),
                "nesterov": self._nesterov_of(group),
                "weight_decay": _num("weight_decay", group.get("weight_decay", self.weight_decay))}

    def _nesterov_of(self, group: Mapping) -> bool:
        value = group.get("nesterov", self.nesterov)
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"nesterov must be a bool, got {value!r}")
        return bool(value)

    def _apply(self, config: Dict[str, Any]) -> None:
        self._c.configure(**config)
        self._settings.update(momentum=config["momentum"], dampening=config["dampening"], nesterov=config["nesterov"],
                              weight_decay=config["weight_decay"])


from . import lr_scheduler  # noqa: E402 (it needs Optimizer)

__all__ = ["Optimizer", "Adam", "AdamW", "SGD", "lr_scheduler"]
