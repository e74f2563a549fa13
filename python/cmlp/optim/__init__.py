"""cmlp.optim: Adam, AdamW and SGD with PyTorch's defaults, validation and update rules, applied
by one fused pass over the model's flat buffers. state_dict() mirrors torch.optim's layout, with
one entry per parameter tensor in the model's state_dict order. lr_scheduler holds torch's
learning-rate schedules."""
from .adam import Adam, AdamW
from ._copying import _unpickled
from .optimizer import Optimizer
from .sgd import SGD

# pickles name them here, where they are public (and where pickles of earlier versions found them)
for _public in (Optimizer, Adam, AdamW, SGD, _unpickled):
    _public.__module__ = __name__
del _public

from . import lr_scheduler  # noqa: E402 (it needs Optimizer)

__all__ = ["Optimizer", "Adam", "AdamW", "SGD", "lr_scheduler"]
