"""Input conversion at the API boundary: any array-like in, a C-contiguous float32 or uint8
matrix and int32 labels out, copying only when needed, with errors that name the argument."""
import contextlib
import itertools
import reprlib
import weakref
from typing import Any, Iterator, Tuple

import numpy as np


@contextlib.contextmanager
def pinned(*arrays: np.ndarray) -> Iterator[None]:
    """While it lasts, NumPy refuses to resize the arrays, and the arrays whose memory they view,
    even with refcheck=False (an array a weak reference points to is never resized): the core
    reads them in place across calls, between which Python code runs (a schedule, a callback)."""
    refs = []
    for a in arrays:
        view: Any = a
        while isinstance(view, np.ndarray):
            refs.append(weakref.ref(view))
            view = view.base
    try:
        yield
    finally:
        del refs


def as_inputs(x: Any, features: int, name: str = "x") -> np.ndarray:
    """[N, features] float32 (any float dtype converted) or uint8 images, C-contiguous; [N, ...]
    with `features` values a sample is read as [N, features] (C order, as torch's view)."""
    arr = _as_array(x, name)
    kind = arr.dtype.kind
    if arr.dtype == np.uint8:
        pass
    elif kind != "f":
        raise TypeError(f"{name} must be a floating-point array or uint8 images, got dtype {arr.dtype}")
    if arr.ndim > 2 and int(np.prod(arr.shape[1:])) == features:
        arr = arr.reshape(arr.shape[0], features)  # [N, 1, 28, 28] images: torch's x.view(-1, features)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, {features}] (or [N, ...] with {features} values a sample), got "
                         f"shape {tuple(arr.shape)}")
    if arr.shape[1] != features:
        raise ValueError(f"{name} has {arr.shape[1]} features per sample; the model expects {features} "
                         f"(shape {tuple(arr.shape)})")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty: at least one sample is needed")
    # C order and the dtype's alignment (a view into a byte buffer may have neither)
    if arr.dtype == np.uint8:
        return np.require(arr, requirements=("C", "A"))
    try:  # (NaN and inf stay as they are, for the core's check to name)
        with np.errstate(over="raise", invalid="ignore", under="ignore"):
            return np.require(arr, dtype=np.float32, requirements=("C", "A"))
    except FloatingPointError:
        big = float(np.max(np.abs(arr[np.isfinite(arr)])))
        raise ValueError(f"{name} holds values outside float32's range, which cmlp computes in (|v| up to "
                         f"{big:.4g}; float32's largest is {float(np.finfo(np.float32).max):.8g})") from None


def _tensor_as_array(t: Any, name: str) -> np.ndarray:
    """A torch tensor's values, whatever torch's own conversion refuses: one that requires
    grad, on a GPU, or of bfloat16 (which NumPy lacks: float32 holds every value of it)."""
    try:
        t = t.detach().cpu()
    except NotImplementedError as e:  # a meta tensor, which has no values (a GPU's error is its own)
        raise TypeError(f"{name} must be an array of numbers; the tensor given cannot be one ({e})") from None
    if str(t.dtype) == "torch.bfloat16":
        t = t.float()
    try:
        return np.asarray(t.numpy())
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"{name} must be an array of numbers; the tensor given cannot be one ({e})") from None


def _as_array(x: Any, name: str, shape: str = "[N, features]") -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch") and callable(getattr(x, "detach", None)):
        return _tensor_as_array(x, name)
    try:
        return np.asarray(x)
    except ValueError as e:  # a ragged nested list
        raise ValueError(f"{name} must be a rectangular array, {shape}: {e}") from None


def as_labels(y: Any, n: int, classes: int, name: str = "y") -> np.ndarray:
    """[n] int32 class indices in [0, classes): a copy of the caller's, so that the checked
    labels are the ones used (the C core reads them with the GIL released)."""
    arr = _as_array(y, name, "[N]")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer class indices, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(arr.shape)}")
    if arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} labels for {n} samples")
    # copied as they are, checked, then converted: int32 cannot wrap a checked value into range
    labels = np.array(arr, order="C", copy=True)
    _check_labels(labels, classes, name)
    return labels.astype(np.int32, copy=labels.dtype != np.int32)


def _check_labels(arr: np.ndarray, classes: int, name: str) -> None:
    if arr.shape[0]:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= classes:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds label {bad}, outside [0, {classes}): labels must be class indices")


def _shown(value: Any) -> str:
    """repr(value) for a message, short (an int of 5000 digits has no repr in Python 3.11)."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__


def as_normalize(normalize: Any) -> Tuple[float, float]:
    def refused() -> TypeError:
        return TypeError(f"normalize must be a pair (mean, std) of numbers, got {_shown(normalize)}")

    if isinstance(normalize, (str, bytes, bytearray)):  # sequences, of characters and of ints
        raise refused()
    try:
        pair = tuple(itertools.islice(iter(normalize), 3))  # (an endless iterator: refused too)
    except TypeError:
        raise refused() from None
    if len(pair) != 2:
        raise refused()
    try:
        mean, std = (as_number("normalize", v) for v in pair)  # (a number too large: its ValueError)
    except TypeError:
        raise refused() from None
    with np.errstate(over="ignore"):
        m32, s32 = np.float32(mean), np.float32(std)
    if not (np.isfinite(m32) and np.isfinite(s32)) or s32 == 0.0:
        raise ValueError(f"normalize=(mean, std) must be finite in float32 with std != 0, got {normalize!r}")
    # a pixel v becomes v * scale + shift in float32, as the C core computes them
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        scale = np.float32(1.0) / (np.float32(255.0) * s32)
        shift = -m32 / s32
        top = np.float32(255.0) * scale + shift
    if not (np.isfinite(scale) and np.isfinite(shift) and np.isfinite(top)):
        raise ValueError(f"normalize=(mean, std) = {normalize!r} maps pixels outside float32's range (v / (255 std) "
                         "- mean / std overflows)")
    return mean, std


def check_seed(seed: Any) -> int:
    """A seed as torch.manual_seed takes one, non-negative here: an int in [0, 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return int(seed)


_AMP_CODES = {None: 0, "fp16": 1, "bf16": 2}


def check_amp(amp: Any) -> int:
    """The C core's code for amp=None / "fp16" / "bf16"."""
    if not (amp is None or isinstance(amp, str)) or amp not in _AMP_CODES:
        raise ValueError(f"amp must be None, 'fp16' or 'bf16', got {amp!r}")
    return _AMP_CODES[amp]


def as_flag(name: str, value: Any) -> bool:
    """A setting that is on or off: a bool (Python's or NumPy's), or the int 0 or 1; anything else
    (a string such as "no", None, a float) is a TypeError rather than its truthiness."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def is_scalar(value: Any) -> bool:
    """A 0-d array or tensor holding a real number."""
    return (getattr(value, "ndim", None) == 0 and hasattr(value, "__float__")
            and getattr(getattr(value, "dtype", None), "kind", "f") in "iuf")


def as_number(name: str, value: Any) -> float:
    """A number, or a 0-d array or tensor holding one (torch.optim may keep lr as a tensor), as a
    float; the C core checks its range."""
    if type(value) is float:  # (a schedule's rates, each step: the common case first)
        return value
    if isinstance(value, bool) or not (isinstance(value, (int, float, np.integer, np.floating)) or is_scalar(value)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite in float32, got {_shown(value)}") from None
