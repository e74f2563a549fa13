"""SGD with momentum, dampening and Nesterov (torch.optim's), on the base optimizer."""
from typing import Any, Dict, Mapping, Tuple

from .._arrays import as_flag as _flag
from .._arrays import as_number as _num
from ..model import MLP
from ._groups import _bool_setting, _implementation_flags, _setting, _unsupported_flag
from .optimizer import Optimizer, Params


class SGD(Optimizer):
    """torch.optim.SGD: momentum (buffer = gradient at the first step), dampening, nesterov,
    L2 weight decay, maximize (steps climb the objective). param_groups: as Adam's (each group its
    own "lr", "weight_decay", "momentum", "dampening", "nesterov" and "maximize"). A group's
    momentum buffer starts from the gradient at its first step with momentum, as torch's; until
    then state_dict() has none for its parameters, as torch's."""

    _buffers = ("momentum_buffer",)
    _per_group = ("momentum", "dampening", "nesterov", "maximize")

    def __init__(self, model: Params, lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
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

    _nan_refused = {0: "Invalid momentum value: nan (must be >= 0 and finite in float32)",
                    3: "Invalid dampening value: nan (must be finite in float32)"}

    def _with_momentum(self, own: Dict[str, Any], value: float) -> Dict[str, Any]:
        new = own.copy()  # (as Adam's: faster than {**own, ...})
        new["momentum"] = value
        return new

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
