"""An optimizer's state_dict in torch.optim's layout (one entry per parameter tensor, in the
model's state_dict order) and its loading, checked whole before anything changes."""
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Tuple

import numpy as np

from ._groups import _UNSTARTED, _implementation_flag, _initial_lr_of, _not_started, _rate

if TYPE_CHECKING:
    from .. import _cmlp
    from ..model import MLP
    from ._groups import _ParamGroup


class _StateDict:
    """Optimizer's state_dict and load_state_dict, over the attributes Optimizer keeps (the C
    optimizer, the param groups, their settings)."""

    # loading takes NaN and inf in the state as they are: set while a copy of this library's own
    # optimizer loads its original's state (a diverged run's, copied or pickled, comes back as it was)
    _take_nonfinite = False

    if TYPE_CHECKING:  # Optimizer's
        model: MLP
        _c: _cmlp.Optimizer
        _kind: str
        _param_groups: List[_ParamGroup]
        _buffers: Tuple[str, ...]
        _flags: Dict[str, Any]
        _initial_lrs: List[Any]
        _c_wd: float

        def _group(self, i: int = 0) -> Dict[str, Any]: ...
        def _group_config(self, group: Mapping, index: int = 0) -> Dict[str, Any]: ...
        def _own_of_config(self, config: Mapping) -> Dict[str, Any]: ...
        def _shared_defaults(self, config: Dict[str, Any]) -> Dict[str, Any]: ...
        def _apply_config(self, config: Dict[str, Any]) -> None: ...
        def _push_groups(self, lrs: Any = None, wds: Any = None, owns: Any = None) -> None: ...
        def _snapshot(self) -> Tuple[Any, ...]: ...
        def _restore(self, saved: Tuple[Any, ...]) -> None: ...

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
                # SGD's buffer not started (a group that has had no momentum): none in torch's state
                if self._kind == "sgd" and _not_started("momentum_buffer", entry["momentum_buffer"]).all():
                    continue
                # likewise AMSGrad's maximum (a group that has had no amsgrad)
                if "max_exp_avg_sq" in entry and _not_started("max_exp_avg_sq", entry["max_exp_avg_sq"]).all():
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
        from .optimizer import _holding

        with _holding(self):  # (the groups' settings: Optimizer's _locked)
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: Dict[str, Any]) -> None:
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
            for i in ids:  # torch pairs them with the parameters in a dict: any hashable id
                try:
                    hash(i)
                except TypeError:
                    raise ValueError(f"loaded state dict's param group {gi} must list its parameters' ids (ints, as "
                                     f"state_dict() gives), got {i!r}") from None
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
            self._c.set_state(step, bufs, not self._take_nonfinite)
        except BaseException:
            self._restore(before)
            self._c.set_state(*before_state, False)  # as it was, NaN and all
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
                if not self._take_nonfinite and not np.isfinite(arr).all():
                    raise ValueError(f"optimizer state {bname} holds inf or NaN")
                if bname in ("exp_avg_sq", "max_exp_avg_sq") and not ((arr >= 0) | np.isnan(arr)).all():
                    raise ValueError(f"optimizer state {bname} must be >= 0 everywhere (a running mean of squares)")
                views[name][...] = arr
                views[name][np.isnan(arr)] = np.nan  # a NaN given has started (one NaN is "not started")
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
