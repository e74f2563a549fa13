"""cmlp.nn: the parts of torch.nn that apply to a cmlp.MLP (cmlp.nn.utils' gradient clipping),
under torch's names so that a training loop written for torch ports line by line."""
from . import utils

__all__ = ["utils"]
