"""Copies of an optimizer: copy.copy, copy.deepcopy (alone or with its model) and pickling
(torch.save of a whole optimizer), each made again by the optimizer's own constructor with its
settings, groups and state."""
import copy
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Type, TypeVar

from ..model import MLP

if TYPE_CHECKING:
    from ._groups import _ParamGroup

_T = TypeVar("_T", bound="_Copying")


class _Copying:
    """Optimizer's copy and pickle protocols, over its constructor's arguments (_init_args),
    its state_dict and its param groups' extra keys."""

    if TYPE_CHECKING:  # Optimizer's
        model: MLP
        _param_groups: List[_ParamGroup]
        _take_nonfinite: bool

        def state_dict(self) -> Dict[str, Any]: ...
        def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...

    def __deepcopy__(self: _T, memo: Dict[int, Any]) -> _T:
        """copy.deepcopy (alone, or with its model, as torch's): the same kind of optimizer, with
        the same settings and state, on a deep copy of the model (the one copied alongside)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # before the model, which may refer to this optimizer
        model = copy.deepcopy(self.model, memo)
        self._init_like(twin, model)
        twin._load_own(self.state_dict())
        for mine, theirs in zip(self._param_groups, twin._param_groups):
            theirs._extra = copy.deepcopy(mine._extra, memo)
        twin.defaults = copy.deepcopy(self.defaults, memo)
        return twin

    def _load_own(self, state_dict: Dict[str, Any]) -> None:
        """load_state_dict of a state this library's optimizer gave: as it was, NaN and inf too."""
        self._take_nonfinite = True
        try:
            self.load_state_dict(state_dict)
        finally:
            del self._take_nonfinite

    def _init_like(self, twin: "_Copying", model: MLP) -> None:
        """Runs the constructor of this kind of optimizer on twin, with this one's settings."""
        self._construct(twin, model, self._init_args())

    def _init_args(self) -> Dict[str, Any]:
        """The constructor's arguments that make this optimizer's settings and groups again."""
        raise NotImplementedError

    @staticmethod
    def _construct(twin: Any, model: MLP, args: Dict[str, Any]) -> None:
        raise NotImplementedError

    def __copy__(self: _T) -> _T:
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
        self._load_own(state["state_dict"])
        for group, extra in zip(self._param_groups, state["extras"]):
            group._extra = extra
        self.defaults = state["defaults"]


def _unpickled(cls: Type[_Copying], model: MLP, args: Dict[str, Any]) -> _Copying:
    """An optimizer of class cls made on model with args (Optimizer.__reduce__'s); its state
    follows (__setstate__)."""
    twin = cls.__new__(cls)
    cls._construct(twin, model, args)
    return twin
