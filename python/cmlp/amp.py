"""cmlp.amp: dynamic loss scaling for fp16 training (torch.amp.GradScaler's rules, state and
errors) and the library's fp16/bf16 conversions. The scale is a float32 value, as PyTorch keeps
it in a float32 tensor from its first use on (until then, init_scale as given); unscaling and the
inf/NaN check are one fused pass in the C core."""
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _cmlp
from ._arrays import as_flag, as_number
from .optim import Optimizer

_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_HALF_DTYPES = ("fp16", "bf16")


def _f32(value: float) -> float:
    """value rounded to float32 (overflow gives inf, as a C cast does), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return as_number(name, value)  # (an int beyond every float: a ValueError)


# The smallest scale a scaler is given: float32's smallest normal number (compute that flushes
# subnormals, the CPU's here and the kernels', reads a smaller scale as 0, and the reciprocal of
# one below 2**-128 overflows). Repeated backoff, which has no lower bound (as torch's), may take
# the scale below it and to 0: restored state may hold such a scale.
_MIN_SCALE = 2.0**-126


def _check_scale(name: str, value: Any, underflowed: bool = False) -> float:
    """A finite scale >= _MIN_SCALE in float32 (or, with underflowed, any one >= 0)."""
    v = _f32(_real(name, value))
    if not (np.isfinite(v) and (v >= _MIN_SCALE or (underflowed and v >= 0.0))):
        bound = ">= 0" if underflowed else ">= 2**-126 (float32's smallest normal number)"
        raise ValueError(f"{name} must be a finite number {bound} in float32, got {value!r}")
    return v


def underflow_message(scale: float) -> str:
    """What a scale backed off below _MIN_SCALE means, and what to do."""
    return (f"the GradScaler's scale is {scale:g}, below float32's smallest normal number, where backoff takes it "
            "when step after step finds inf or NaN gradients (the parameters or the data hold inf or NaN, or the "
            "training diverged): every step would be skipped; set a new scale (scaler.update(new_scale=...)) or "
            "load a checkpoint")


class _FactorError(ValueError, AssertionError):
    """A growth or backoff factor out of range: a ValueError, and the AssertionError torch's
    GradScaler raises for it, so that code written for torch catches it too."""


def _check_factors(growth_factor: Any, backoff_factor: Any) -> Tuple[float, float]:
    g = _real("growth_factor", growth_factor)
    b = _real("backoff_factor", backoff_factor)
    if not (np.isfinite(g) and g > 1.0):
        raise _FactorError(f"The growth factor must be > 1.0 and finite: growth_factor={growth_factor!r}")
    if not 0.0 < b < 1.0:
        raise _FactorError(f"The backoff factor must be < 1.0 and > 0: backoff_factor={backoff_factor!r}")
    return g, b


_INT32_MAX = 2**31 - 1


def _check_count(name: str, value: Any, minimum: int) -> int:
    """An int in [minimum, 2**31 - 1]: the growth tracker is an int32, as PyTorch keeps it, and
    the interval is compared with it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not minimum <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be in [{minimum}, 2**31 - 1], got {value!r}")
    return int(value)


def _device_name(device: Any) -> str:
    """torch.amp.GradScaler's device argument: "cpu", "cuda" or "cuda:N" (a torch.device too)."""
    if device is None:
        return "cuda"
    if not isinstance(device, str) and hasattr(device, "type"):  # a torch.device
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cuda' or 'cpu', got {device!r}")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (index.isdigit() and (kind == "cuda" or index == "0"))):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


class GradScaler:
    """Loss scaling with PyTorch's growth/backoff rule. Per iteration: forward_backward with
    loss_scale=get_scale(), optionally unscale_(opt), step(opt) (skipped when a gradient is inf
    or NaN), update()."""

    # init_scale (or a loaded scale) exactly as given, until the scale is first used (scale(),
    # unscale_, step, update, a Trainer's run): get_scale() and state_dict() read it as torch's
    # do before its scale tensor exists; None from the first use on, when _scale (float32) holds
    _unused_scale: Optional[float] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """GradScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=2000, enabled=True), and torch.amp.GradScaler's form with a device first
        (GradScaler("cuda", init_scale=1024.0), or device=...): "cpu", "cuda" or "cuda:N". The
        scale is a host number, so the device only names where torch would keep it; unlike
        torch's, a "cuda" scaler stays enabled on a machine without a GPU (cmlp scales fp16 on
        the CPU too)."""
        device = kwargs.pop("device", None)
        if args and isinstance(args[0], str):
            if device is not None:
                raise TypeError("GradScaler got the device twice (first argument and device=)")
            device, args = args[0], args[1:]
        self._device = _device_name(device)
        self._init(*args, **kwargs)

    def _init(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
              growth_interval: int = 2000, enabled: bool = True) -> None:
        self._enabled = as_flag("enabled", enabled)
        self._scale = _check_scale("init_scale", init_scale)
        self._unused_scale = float(init_scale)
        self._growth_factor, self._backoff_factor = _check_factors(growth_factor, backoff_factor)
        self._growth_interval = _check_count("growth_interval", growth_interval, 1)
        self._growth_tracker = 0
        # id(optimizer) -> {"unscaled", "stepped", "found_inf"}, for the current iteration only
        self._per_optimizer: Dict[int, Dict[str, Optional[bool]]] = {}
        self._warned_unscaled = False
        self._warned_underflow = False

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _check_factors(new_factor, self._backoff_factor)[0]

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = _check_factors(self._growth_factor, new_factor)[1]

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """A run that has already had new_interval successful steps in a row grows at its next.
        (torch leaves its tracker at or above the new interval, and then never grows again.)"""
        interval = _check_count("growth_interval", new_interval, 1)
        self._growth_interval = interval
        self._growth_tracker = min(self._growth_tracker, interval - 1)

    @property
    def device(self) -> str:
        """torch.amp.GradScaler's device: where the scale would live ("cuda" by default)."""
        return self._device

    def _get_growth_tracker(self) -> int:
        return self._growth_tracker if self._enabled else 0

    def get_scale(self) -> float:
        """The current scale (a float32 value, or init_scale as given before its first use);
        1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._scale if self._unused_scale is None else self._unused_scale

    def _use(self) -> float:
        """The float32 scale, from now on also what get_scale() reads."""
        self._unused_scale = None
        return self._scale

    def scale(self, outputs: Any) -> Any:
        """outputs * get_scale() (unchanged when disabled); a list or tuple of them, each scaled,
        as torch's."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return outputs * self._use()

    def _state_of(self, optimizer: Any) -> Dict[str, Optional[bool]]:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a cmlp.optim optimizer, got {type(optimizer).__name__}")
        if optimizer._c.shards()[0]:  # before anything changes (each rank would decide on its own inf)
            raise RuntimeError("a ZeroRedundancyOptimizer steps in a data-parallel cmlp.Trainer (give it the scaler): "
                               "its gradients are summed and checked over the ranks there")
        # found_inf: None until gradients are checked
        return self._per_optimizer.setdefault(id(optimizer), {"unscaled": False, "stepped": False,
                                                              "found_inf": None})

    def unscale_(self, optimizer: Optimizer, _stacklevel: int = 2) -> None:
        """Divides the gradients of optimizer's model by the scale (multiplies by the float32
        reciprocal computed in float64) and records whether any is inf or NaN. At most once
        per optimizer between update()s, and not after step()."""
        if not self._enabled:
            return
        state = self._state_of(optimizer)
        if state["stepped"]:
            raise RuntimeError("unscale_() is being called after step().")
        if state["unscaled"]:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer.model._grads_none:  # no gradient: nothing checked (torch: no parameter has a .grad)
            state["found_inf"], state["unscaled"] = None, True
            self._use()
            return
        if getattr(optimizer.model, "_unscaled_grads", False) and self._scale != 1.0 \
                and not getattr(self, "_warned_unscaled", False):
            self._warned_unscaled = True
            warnings.warn(f"the gradients were made without loss_scale (forward_backward's default, 1.0), and "
                          f"this GradScaler divides them by its scale, {self._scale:g}: pass "
                          "loss_scale=scaler.get_scale() (torch's scaler.scale(loss).backward())",
                          stacklevel=_stacklevel)
        with np.errstate(divide="ignore"):
            inv_scale = _f32(1.0 / np.float64(self._scale))   # inf for a scale underflowed to 0
        state["found_inf"] = bool(optimizer.model._c.unscale_grads(inv_scale))
        state["unscaled"] = True
        self._use()

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscales (unless unscale_ was called), then runs optimizer.step(*args, **kwargs) unless
        a gradient was inf or NaN. Returns whether the step ran. As torch's, a disabled scaler
        passes the arguments on (a closure too); an enabled one refuses a closure."""
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            return True
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._state_of(optimizer)
        if state["stepped"]:
            raise RuntimeError("step() has already been called since the last update().")
        if optimizer.model._grads_none or (state["unscaled"] and state["found_inf"] is None):  # none checked
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if not state["unscaled"]:  # (its first use, where it is)
            self.unscale_(optimizer, _stacklevel=3)
        stepped = not state["found_inf"]
        if stepped:
            optimizer.step(*args, **kwargs)
        state["stepped"] = True
        return stepped

    def update(self, new_scale: Optional[Any] = None) -> None:
        """Ends the iteration. With new_scale (a number or 1-element array): sets the scale,
        tracker unchanged. Otherwise: any inf/NaN found since the last update -> scale *=
        backoff_factor, tracker = 0; else tracker += 1, and at growth_interval the scale grows
        by growth_factor if the result stays finite, tracker = 0."""
        if not self._enabled:
            return
        if new_scale is not None:
            arr = np.asarray(new_scale)
            if arr.dtype == np.bool_ or arr.dtype.kind not in "iuf" or arr.size != 1:
                raise TypeError(f"new_scale must be a number or a 1-element array, got {new_scale!r}")
            self._scale = _check_scale("new_scale", arr.reshape(()).item())
            self._use()
        else:
            found = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
            if not found:  # no unscale_ or step since the last update, or only ones without gradients
                raise AssertionError("No inf checks were recorded prior to update.")
            if any(found):
                self._scale = _f32(self._scale * self._backoff_factor)
                self._growth_tracker = 0
                self._note_underflow(3)
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    grown = _f32(self._scale * self._growth_factor)
                    if np.isfinite(grown):
                        self._scale = grown
                    self._growth_tracker = 0
        self._per_optimizer = {}

    def _note_underflow(self, stacklevel: int) -> None:
        """Warns, once, when backoff (update's, or a Trainer's loop's) has taken the scale below
        _MIN_SCALE."""
        if self._scale < _MIN_SCALE and not self._warned_underflow:
            self._warned_underflow = True
            warnings.warn(underflow_message(self._scale), RuntimeWarning, stacklevel=stacklevel)

    def __getstate__(self) -> Dict[str, Any]:
        """pickle and copy.deepcopy, as torch's: at an iteration's start or end only (what unscale_
        and step recorded belongs to the optimizers of this process)."""
        if self._enabled and self._per_optimizer:
            raise AssertionError("A GradScaler instance may only be pickled at the beginning of an iteration, or at "
                                 "the end after scaler.update().")
        return dict(self.__dict__)

    def state_dict(self) -> Dict[str, Any]:
        """{scale, growth_factor, backoff_factor, growth_interval, _growth_tracker}; {} when
        disabled."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores all five entries of state_dict() (a no-op when disabled, as in PyTorch)."""
        if not self._enabled:
            return
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"GradScaler state_dict is missing {missing}; it needs {list(_STATE_KEYS)}")
        scale = _check_scale("scale", state_dict["scale"], underflowed=True)
        factors = _check_factors(state_dict["growth_factor"], state_dict["backoff_factor"])
        interval = _check_count("growth_interval", state_dict["growth_interval"], 1)
        tracker = _check_count("_growth_tracker", state_dict["_growth_tracker"], 0)
        # a run's tracker goes back to 0 when it reaches the interval; torch's passes it after
        # set_growth_interval lowers the interval (and its scale never grows again): taken as
        # set_growth_interval takes it here, growing at the next successful step
        tracker = min(tracker, interval - 1)
        self._scale, (self._growth_factor, self._backoff_factor) = scale, factors
        if self._unused_scale is not None:  # still unused: kept as given, as torch keeps it
            self._unused_scale = float(state_dict["scale"])
        self._growth_interval, self._growth_tracker = interval, tracker

    # ---- for cmlp.Trainer, which runs the scaler's rule inside its C loop ----
    def _get_state(self) -> Tuple[float, int]:
        return self._use(), self._growth_tracker

    def _set_state(self, scale: float, growth_tracker: int) -> None:
        checked = _check_scale("scale", scale, underflowed=True)
        self._growth_tracker = _check_count("growth_tracker", growth_tracker, 0)
        self._scale = checked
        self._use()


def _half_dtype(dtype: Any) -> str:
    if dtype not in _HALF_DTYPES:
        raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")
    return dtype


def to_half(x: Any, dtype: str = "fp16") -> np.ndarray:
    """The uint16 bit patterns of x in fp16 (IEEE binary16) or bf16, same shape: round to
    nearest even, fp16 overflow to inf, subnormals kept, NaN stays NaN. x is converted to
    float32 first (the library rounds from float32 tensors), so a float64 input can differ
    from a direct float64 -> fp16 rounding where the float32 rounding lands on a tie."""
    dt = _half_dtype(dtype)
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iuf":
        raise TypeError(f"x must be a real numeric array, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        arr = np.asarray(arr, dtype=np.float32, order="C")
    return _cmlp.to_half(arr, dt)


def from_half(u16: Any, dtype: str = "fp16") -> np.ndarray:
    """float32 values of fp16 or bf16 bit patterns given as a uint16 array (exact)."""
    dt = _half_dtype(dtype)
    arr = np.asarray(u16)
    if arr.dtype != np.uint16:
        if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
            raise TypeError(f"u16 must hold uint16 bit patterns, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFF):
            raise ValueError("u16 holds values outside [0, 65535]: they are not 16-bit patterns")
        arr = arr.astype(np.uint16)
    return _cmlp.from_half(np.asarray(arr, order="C"), dt)


__all__ = ["GradScaler", "to_half", "from_half"]
