"""Input conversion at the API boundary: any array-like in, a C-contiguous float32 or uint8
matrix and int32 labels out, copying only when needed, with errors that name the argument."""
from typing import Any, Tuple

import numpy as np


def as_inputs(x: Any, features: int, name: str = "x") -> np.ndarray:
    """[N, features] float32 (any float dtype converted) or uint8 images, C-contiguous."""
    arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    kind = arr.dtype.kind
    if arr.dtype == np.uint8:
        pass
    elif kind != "f":
        raise TypeError(f"{name} must be a floating-point array or uint8 images, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, {features}], got shape {tuple(arr.shape)}")
    if arr.shape[1] != features:
        raise ValueError(f"{name} has {arr.shape[1]} features per sample; the model expects {features} "
                         f"(shape {tuple(arr.shape)})")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty: at least one sample is needed")
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ascontiguousarray(arr, dtype=np.float32)


def as_labels(y: Any, n: int, classes: int, name: str = "y") -> np.ndarray:
    """[n] int32 class indices in [0, classes)."""
    arr = y if isinstance(y, np.ndarray) else np.asarray(y)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer class indices, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(arr.shape)}")
    if arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} labels for {n} samples")
    if n:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= classes:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds label {bad}, outside [0, {classes}): labels must be class indices")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_normalize(normalize: Any) -> Tuple[float, float]:
    try:
        mean, std = (float(v) for v in normalize)
    except (TypeError, ValueError):
        raise TypeError(f"normalize must be a pair (mean, std) of numbers, got {normalize!r}") from None
    if not (np.isfinite(mean) and np.isfinite(std)) or std == 0.0:
        raise ValueError(f"normalize=(mean, std) must be finite with std != 0, got {normalize!r}")
    return mean, std


_AMP_CODES = {None: 0, "fp16": 1, "bf16": 2}


def check_amp(amp: Any) -> int:
    """The C core's code for amp=None / "fp16" / "bf16"."""
    if not (amp is None or isinstance(amp, str)) or amp not in _AMP_CODES:
        raise ValueError(f"amp must be None, 'fp16' or 'bf16', got {amp!r}")
    return _AMP_CODES[amp]
