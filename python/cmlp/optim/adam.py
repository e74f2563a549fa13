"""Adam and AdamW (torch.optim's), on the base optimizer."""
from typing import Any, Dict, Mapping, Tuple

from .._arrays import as_flag as _flag
from .._arrays import as_number as _num
from ..model import MLP
from ._groups import _bool_setting, _implementation_flags, _setting, _unsupported_flag
from .optimizer import Optimizer, Params


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

    def __init__(self, model: Params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
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
        try:  # a sequence (torch reads betas[0], betas[1]): a set's order is no order
            if isinstance(betas, (set, frozenset, Mapping)) or not hasattr(type(betas), "__getitem__"):
                raise TypeError
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

    _nan_refused = {0: "Invalid beta parameter at index 0: nan (must be in [0, 1))",
                    1: "Invalid beta parameter at index 1: nan (must be in [0, 1))",
                    2: "Invalid epsilon value: nan (must be >= 0 and finite in float32)"}

    def _with_momentum(self, own: Dict[str, Any], value: float) -> Dict[str, Any]:
        new = own.copy()  # (a copy and a key set: faster than {**own, ...}, once a step under OneCycleLR)
        new["betas"] = (value, own["betas"][1])
        return new

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

    def __init__(self, model: Params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
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
