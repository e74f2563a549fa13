"""CUDA device queries, named as in torch.cuda."""
from typing import Optional, Tuple

from . import _cmlp


def is_available() -> bool:
    """True when this build has the CUDA backend and a usable GPU is present."""
    return device_count() > 0


def device_count() -> int:
    return _cmlp.cuda_device_count()


def synchronize(device: Optional[str] = None) -> None:
    """Waits for the device's queued work. Raises RuntimeError when CUDA is unavailable."""
    _cmlp.synchronize("cuda" if device is None else device)


def mem_get_info(device: "Optional[str | int]" = None) -> Tuple[int, int]:
    """(free, total) bytes of a GPU (default "cuda"; an int N is "cuda:N", as torch.cuda takes
    it), as torch.cuda.mem_get_info; see cmlp.memory.mem_get_info. Raises RuntimeError when CUDA
    is unavailable."""
    from .memory import mem_get_info as info

    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    return info("cuda" if device is None else device)
