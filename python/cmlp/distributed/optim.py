"""cmlp.distributed.optim: ZeroRedundancyOptimizer, torch.distributed.optim's ZeRO stage 1.

Under data parallelism every rank normally keeps the whole optimizer state: Adam's exp_avg and
exp_avg_sq are twice the parameters, so with the parameters and gradients it is four copies of
the model per rank. A ZeroRedundancyOptimizer keeps the state of 1/world_size of the parameters
on each rank (its part of the flat parameter buffer, in parts of equal length): each step sums the
gradients of each part on its owner (a reduce-scatter: an MPI_Reduce per part, or on CUDA devices
an NCCL reduce per part; with clipping, also the parts' norms), updates the rank's part, then sends every
rank's part to the others (MPI_Allgatherv, or an NCCL broadcast from each owner), inside the
captured training step on a GPU. The update is the same, element by element, as the optimizer's
own (up to the order in which more than two ranks' gradients are added); what is saved per rank
is (world_size - 1) / world_size of the state::

    cmlp.distributed.init_process_group("mpi")
    model = cmlp.MLP([784, 512, 256, 10])
    opt = cmlp.distributed.optim.ZeroRedundancyOptimizer(model, cmlp.optim.Adam, lr=1e-3)
    trainer = cmlp.Trainer(model, opt, batch_size=32)   # data-parallel

It is an instance of optimizer_class too (learning rate, schedules, settings as usual). It steps
in a data-parallel Trainer (fit, step), which sums the gradients over the ranks first; its own
step() refuses (cmlp has no other way to sum them). As in torch, state_dict() gives the whole
state only on the rank that consolidate_state_dict(to) (called on every rank) sent it to, with
the current settings; load_state_dict takes a whole state on every rank, and each keeps its part.
"""
from typing import Any, Dict, List, NoReturn, Optional, Tuple, Type

import numpy as np

from .._arrays import as_flag
from ..optim import Optimizer
from ..optim.optimizer import Params
from ..optim._groups import _UNSTARTED, _not_started
from . import all_reduce, broadcast, get_rank, get_world_size, is_initialized

__all__ = ["ZeroRedundancyOptimizer"]

_classes: Dict[type, type] = {}


class ZeroRedundancyOptimizer(Optimizer):
    """ZeroRedundancyOptimizer(model, optimizer_class, process_group=None,
    parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults): optimizer_class
    (cmlp.optim.Adam, AdamW or SGD) made with **defaults, its state sharded over the process
    group. parameters_as_bucket_view is accepted for torch's signature (cmlp's parameters are one
    flat buffer already); process_group must be None (the group) and overlap_with_ddp False."""

    def __new__(cls, model: Params, optimizer_class: Optional[Type[Optimizer]] = None, *args: Any,
                **kwargs: Any) -> "ZeroRedundancyOptimizer":
        if cls is not ZeroRedundancyOptimizer:
            return super().__new__(cls)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)) \
                or issubclass(optimizer_class, ZeroRedundancyOptimizer):
            raise TypeError("optimizer_class must be one of cmlp.optim's optimizers (e.g. cmlp.optim.Adam), got "
                            f"{optimizer_class!r}")
        if optimizer_class not in _classes:  # an instance of both: isinstance(opt, cmlp.optim.Adam) holds
            _classes[optimizer_class] = type(f"ZeroRedundancyOptimizer[{optimizer_class.__name__}]",
                                             (ZeroRedundancyOptimizer, optimizer_class),
                                             {"__module__": __name__})
        return super().__new__(_classes[optimizer_class])

    def __init__(self, model: Params, optimizer_class: Type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any) -> None:
        if process_group is not None:
            raise ValueError("process_group must be None: cmlp has one process group (init_process_group's)")
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True is not supported: the update follows the gradients' sum")
        parameters_as_bucket_view = as_flag("parameters_as_bucket_view", parameters_as_bucket_view)
        if not is_initialized():
            raise RuntimeError("ZeroRedundancyOptimizer shards its state over the process group: call "
                               "cmlp.distributed.init_process_group() first")
        optimizer_class.__init__(self, model, **defaults)
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._c.shard(True)
        self.world_size, self.rank = get_world_size(), get_rank()  # as torch's: the group it was cut for
        self._consolidated: Optional[Tuple[int, List[np.ndarray]]] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> NoReturn:
        raise TypeError("a ZeroRedundancyOptimizer cannot be copied or pickled: its state is sharded over the process "
                        "group (consolidate_state_dict, then load the state_dict into a new optimizer)")

    def __reduce__(self) -> Tuple[Any, ...]:
        return self.__deepcopy__({})

    @property
    def shard(self) -> slice:
        """The parameters (indices into the flat buffer, in state_dict order) whose state this
        rank keeps."""
        _, lo, hi, _ = self._c.shards()
        return slice(lo, hi)

    def step(self) -> None:  # type: ignore[override]  # takes no closure: it never steps
        raise RuntimeError("a ZeroRedundancyOptimizer steps in a data-parallel cmlp.Trainer (fit or step), which "
                           "sums the gradients over the ranks before each rank updates its part")

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: each rank's part of the state is sent from its owner (the host of every
        rank sees it go by, as in torch); rank `to` keeps the whole of it for state_dict()."""
        world = get_world_size()
        if not (isinstance(to, (int, np.integer)) and not isinstance(to, bool) and 0 <= to < world):
            raise ValueError(f"to must be a rank in [0, {world}), got {to!r}")
        if (world, get_rank()) != (self.world_size, self.rank):
            raise RuntimeError(f"this optimizer's state is sharded as rank {self.rank} of {self.world_size}, and "
                               f"this process is rank {get_rank()} of {world} now")
        parts, _, _, chunk = self._c.shards()
        n = self.model.num_parameters()
        step, bufs = self._c.get_state()  # this rank's part in place, zeros elsewhere
        # the ranks must hold the same kind of state at the same step, or their broadcasts would
        # not match (a state loaded on some ranks only): every rank refuses alike
        seen = np.array([len(bufs), step, -len(bufs), -step], dtype=np.int64)
        all_reduce(seen, "max")
        if seen[0] != -seen[2] or seen[1] != -seen[3]:
            raise RuntimeError(f"the ranks' optimizer states differ ({-seen[2]} to {seen[0]} state buffers, steps "
                               f"{-seen[3]} to {seen[1]}): load the same state on every rank before consolidate_state_dict")
        for buf in bufs:
            for r in range(parts):
                if r * chunk < n:
                    broadcast(buf[r * chunk:(r + 1) * chunk], src=r)
        self._consolidated = (step, bufs) if get_rank() == to else None

    @property
    def state(self) -> Dict[int, Dict[str, Any]]:
        """This rank's state, as torch's ZeroRedundancyOptimizer gives its local optimizer's:
        its part of each tensor's buffers in place, zeros elsewhere (no collective). As torch's
        state does, it leaves out SGD's momentum buffer and AMSGrad's max_exp_avg_sq of a tensor
        where they have not started: where its elements in this rank's part have not, or, with
        none there, where its group has no momentum (no amsgrad)."""
        step, bufs = self._c.get_state()
        if not bufs:
            return self._state_dict_of(step, bufs)["state"]
        which, key = (0, "momentum") if self._kind == "sgd" else (2, "amsgrad")
        if len(bufs) <= which:
            return self._state_dict_of(step, bufs)["state"]
        unstarted = _UNSTARTED[self._buffers[which]]
        _, lo, hi, _ = self._c.shards()
        buf = bufs[which] = bufs[which].copy()  # not started (this rank's part), zeros in the others' parts
        m = self.model
        spans = {}  # each tensor's [start, end) in the flat buffers
        for i, (w, b) in enumerate(m._offsets):
            spans[f"fc{i + 1}.weight"] = (w, w + m._sizes[i] * m._sizes[i + 1])
            spans[f"fc{i + 1}.bias"] = (b, b + m._sizes[i + 1])
        for g, own in zip(self._param_groups, self._owns):
            for name in g._names:
                first, last = spans[name]
                if last <= lo or first >= hi:  # none of it here
                    buf[first:last] = 0.0 if own[key] else unstarted
                else:  # its elements in the others' parts: as this rank's decide
                    buf[first:max(lo, first)] = unstarted
                    buf[min(hi, last):last] = unstarted
        state = self._state_dict_of(step, bufs)["state"]  # not started anywhere: left out
        name = self._buffers[which]
        for entry in state.values():
            if name in entry:  # elements not started (this rank's part of a tensor started elsewhere): zeros
                started = entry[name]
                started[_not_started(name, started)] = 0.0
        return state

    def state_dict(self) -> Dict[str, Any]:
        """The whole state as of the last consolidate_state_dict(to) that sent it to this rank,
        with the settings of now (as torch's)."""
        if self._consolidated is None:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please call "
                               "`consolidate_state_dict(to=...)` on all ranks beforehand")
        return self._state_dict_of(*self._consolidated)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """A whole state (this library's or torch.optim's layout), on every rank: each keeps its
        part. A consolidated state from before is forgotten."""
        super().load_state_dict(state_dict)
        self._consolidated = None
