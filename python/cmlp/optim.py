"""cmlp.optim: Adam and SGD with PyTorch's defaults, validation and update rules, applied by
one fused pass over the model's flat buffers. state_dict() mirrors torch.optim's layout, with
one entry per parameter tensor in the model's state_dict order."""
from typing import Any, Dict, List, Tuple

import numpy as np

from . import _cmlp
from .model import MLP


def _num(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


class Optimizer:
    """Base: holds the C optimizer bound to one model."""

    _buffers: Tuple[str, ...] = ()

    def __init__(self, model: MLP, kind: str, **config: Any) -> None:
        if not isinstance(model, MLP):
            raise TypeError(f"the first argument must be a cmlp.MLP, got {type(model).__name__}")
        self.model = model
        self._kind = kind
        self._c = _cmlp.Optimizer(model._c, kind, **config)
        model._optimizers.add(self)

    @property
    def lr(self) -> float:
        return self._c.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._c.lr = _num("lr", value)

    def step(self) -> None:
        """One update from the gradients accumulated in the model."""
        self._c.step()

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def _group(self) -> Dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        step, bufs = self._c.get_state()
        names = list(self.model.state_dict().keys())
        state: Dict[int, Dict[str, Any]] = {}
        if step > 0 or bufs:
            for i, name in enumerate(names):
                entry: Dict[str, Any] = {}
                if self._kind == "adam":
                    entry["step"] = float(step)
                for bname, flat in zip(self._buffers, bufs):
                    entry[bname] = self.model._split(flat)[name].copy()
                state[i] = entry
        group = self._group()
        group["params"] = list(range(len(names)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        try:
            state, groups = state_dict["state"], state_dict["param_groups"]
        except (KeyError, TypeError):
            raise ValueError("optimizer state_dict must have 'state' and 'param_groups'") from None
        names = list(self.model.state_dict().keys())
        if len(groups) != 1 or len(groups[0].get("params", ())) != len(names):
            raise ValueError(f"optimizer state_dict must have one param group of {len(names)} parameters")
        group = groups[0]
        self._load_group(group)
        step = 0
        bufs: List[np.ndarray] = []
        if state:
            order = list(group["params"])
            if sorted(state.keys()) != sorted(order):
                raise ValueError("optimizer state_dict's state does not cover every parameter")
            steps = {int(float(np.asarray(state[k].get("step", 0)))) for k in order}
            if len(steps) != 1:
                raise ValueError("optimizer state_dict has different step counts per parameter")
            step = steps.pop()
            for bname in self._buffers:
                if any(bname not in state[k] for k in order):
                    continue
                flat = np.empty(self.model.num_parameters(), dtype=np.float32)
                views = self.model._split(flat)
                for k, name in zip(order, names):
                    arr = np.asarray(state[k][bname])
                    if arr.shape != views[name].shape:
                        raise ValueError(f"optimizer state {bname} of {name} has shape {arr.shape}, "
                                         f"expected {views[name].shape}")
                    views[name][...] = arr
                bufs.append(flat)
            if self._kind == "sgd" and not bufs:
                step = 0
        self._c.set_state(step, bufs)

    def _load_group(self, group: Dict[str, Any]) -> None:
        raise NotImplementedError


class Adam(Optimizer):
    """torch.optim.Adam: L2 weight decay added to the gradient (not AdamW), bias-corrected."""

    _buffers = ("exp_avg", "exp_avg_sq")

    def __init__(self, model: MLP, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        b1, b2 = self._betas(betas)
        super().__init__(model, "adam", lr=_num("lr", lr), beta1=b1, beta2=b2, eps=_num("eps", eps),
                         weight_decay=_num("weight_decay", weight_decay))
        self.betas, self.eps, self.weight_decay = (b1, b2), float(eps), float(weight_decay)

    @staticmethod
    def _betas(betas: Any) -> Tuple[float, float]:
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise TypeError(f"betas must be a pair of floats, got {betas!r}") from None
        return _num("betas[0]", b1), _num("betas[1]", b2)

    def _group(self) -> Dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "amsgrad": False, "maximize": False}

    def _load_group(self, group: Dict[str, Any]) -> None:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("amsgrad and maximize are not supported")
        b1, b2 = self._betas(group.get("betas", self.betas))
        lr, eps = _num("lr", group.get("lr", self.lr)), _num("eps", group.get("eps", self.eps))
        wd = _num("weight_decay", group.get("weight_decay", self.weight_decay))
        self._c.configure(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        self.betas, self.eps, self.weight_decay = (b1, b2), eps, wd


class SGD(Optimizer):
    """torch.optim.SGD: momentum (buffer = gradient at the first step), dampening, nesterov,
    L2 weight decay."""

    _buffers = ("momentum_buffer",)

    def __init__(self, model: MLP, lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0) -> None:
        super().__init__(model, "sgd", lr=_num("lr", lr), momentum=_num("momentum", momentum),
                         dampening=_num("dampening", dampening), nesterov=bool(nesterov),
                         weight_decay=_num("weight_decay", weight_decay))
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.nesterov, self.weight_decay = bool(nesterov), float(weight_decay)

    def _group(self) -> Dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov, "maximize": False}

    def _load_group(self, group: Dict[str, Any]) -> None:
        if group.get("maximize"):
            raise ValueError("maximize is not supported")
        lr = _num("lr", group.get("lr", self.lr))
        momentum = _num("momentum", group.get("momentum", self.momentum))
        dampening = _num("dampening", group.get("dampening", self.dampening))
        nesterov = bool(group.get("nesterov", self.nesterov))
        wd = _num("weight_decay", group.get("weight_decay", self.weight_decay))
        self._c.configure(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
        self.momentum, self.dampening, self.nesterov, self.weight_decay = momentum, dampening, nesterov, wd


__all__ = ["Optimizer", "Adam", "SGD"]
