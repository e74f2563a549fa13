"""Arguments the memory functions and the planner share: a device as torch names it, NumPy
integers, and sizes written as text ("512MB") and for people ("1.50 MiB")."""
import re
from fractions import Fraction
from typing import Any, Optional, Protocol, Union

import numpy as np

from . import _cmlp


class _NamedDevice(Protocol):
    """A torch.device: its type ("cpu", "cuda") and index."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> Optional[int]: ...


class _DeviceBlock(Protocol):
    """A device block (cmlp.cuda.device, torch.cuda.device): its GPU's index."""

    @property
    def idx(self) -> int: ...


# What a device argument may be: "cpu", "cuda", "cuda:N", a GPU's index, a torch.device, a
# device block
Device = Union[str, int, _NamedDevice, _DeviceBlock]


def _device_text(device: Any) -> Any:
    """torch's other ways of naming a device, as a string: an int N is "cuda:N" (as torch.cuda's
    functions take it), a torch.device (anything with a str .type and an int or None .index) its
    "type[:index]". Anything else is returned as it is."""
    if isinstance(device, (int, np.integer)) and not isinstance(device, (bool, np.bool_)):
        if device < 0:  # (as torch's allocator)
            raise ValueError(f"Invalid device argument {int(device)}: a GPU's index is >= 0")
        return f"cuda:{int(device)}"
    idx = getattr(device, "idx", None)  # a device block (cmlp.cuda.device, torch.cuda.device): its GPU
    if isinstance(idx, int) and not isinstance(idx, bool) and not hasattr(device, "type"):
        return _device_text(idx)
    kind, index = getattr(device, "type", None), getattr(device, "index", 0)
    if not isinstance(device, str) and isinstance(kind, str) and (index is None or isinstance(index, int)):
        return kind if index is None else f"{kind}:{index}"
    return device


def _numpy_int(value: Any) -> Any:
    """A NumPy integer as the int it holds (as torch takes them); anything else as it is."""
    return int(value) if isinstance(value, np.integer) else value


def _device(device: Any) -> str:
    if device is None:
        # a child forked after CUDA started cannot use it: its default is the CPU
        if _cmlp.cuda_device_count() > 0 and not _cmlp.cuda_forked():
            return f"cuda:{_cmlp.cuda_current_device()}"  # (cmlp.cuda.set_device's, 0 by default)
        return "cpu"
    device = _device_text(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0' (or an index, or a torch.device), "
                        f"got {device!r}")
    return _cmlp.parse_device(device)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: Union[str, int, float]) -> int:
    """'256MB', '1.5GiB', '4096' -> bytes (K/M/G/T are powers of 1024, as for memory), exactly:
    a fraction of a unit rounds down to whole bytes; a fraction of a byte is refused."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 512MB, 2GB or a number of bytes")
    unit = (m.group(2) or "B").upper()
    scale = 1 if unit == "B" else 1024 ** ("KMGT".index(unit[0]) + 1)
    value = Fraction(m.group(1)) * scale
    if scale == 1 and value.denominator != 1:
        raise ValueError(f"cannot read {text!r} as a size: a number of bytes is a whole number")
    return int(value)


def _fmt(n: int) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v, u = float(n), 0
    while u < 4 and abs(v) >= 1024.0:
        v, u = v / 1024.0, u + 1
    return f"{v:.2f} {units[u]}"
