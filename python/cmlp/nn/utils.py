"""Gradient clipping with torch.nn.utils' names, defaults and results, over the model's flat
gradient buffer in one pass each (on the model's device; the norm is computed in double and in
an order fixed by the parameter count, so the CPU and the GPU give the same bits for the 1-, 2-
and inf-norms).

    loss = model.forward_backward(x, y, amp="fp16", loss_scale=scaler.get_scale())
    scaler.unscale_(opt)
    cmlp.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(opt)
    scaler.update()
"""
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np

from .._arrays import as_flag, as_number
from ..model import MLP, Parameters, model_of, parameter_of


def _clipped(parameters: Any) -> Optional[MLP]:
    """The model whose gradients a clip covers (None for no parameters, which torch takes): a
    cmlp.MLP, its parameters(), or torch's parameters as an iterable (or one array) of the copies
    parameters() or named_parameters() gave out, all of one model's (its gradients are one
    buffer, clipped whole)."""
    if isinstance(parameters, (MLP, Parameters)) or isinstance(parameters, (str, bytes, Mapping)) \
            or not isinstance(parameters, (Iterable, np.ndarray)):
        return model_of(parameters, "parameters")
    items = [parameters] if isinstance(parameters, np.ndarray) else list(parameters)
    if not items:
        return None
    owners = []
    for p in items:  # (named_parameters()' pairs too)
        p = p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p
        owner = parameter_of(p)
        if owner is None:
            raise TypeError("parameters must be a cmlp.MLP, its parameters(), or the arrays parameters() gave out "
                            f"(the model's gradients live in one buffer), got {type(p).__name__} among them")
        owners.append(owner)
    model = owners[0][0]
    if any(m is not model for m, _ in owners):
        raise ValueError("parameters: the arrays are parameters of more than one model")
    names, total = {name for _, name in owners}, 2 * (len(model.layer_sizes) - 1)
    if len(names) != total:
        raise ValueError(f"parameters: {len(names)} of the model's {total} parameters, but a clip covers all of its "
                         "gradients (one buffer): pass all of them, or model.parameters()")
    return model


def _norm_type(norm_type: Any) -> float:
    if isinstance(norm_type, str):  # torch takes "inf" and "-inf" too
        try:
            return float(norm_type)
        except ValueError:
            raise ValueError(f"norm_type must be a number or +-inf, got {norm_type!r}") from None
    return as_number("norm_type", norm_type)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: Any = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> float:
    """Scales the gradients so that their total norm (of order norm_type, over all parameters
    as one vector) is at most max_norm: each is multiplied by min(1, max_norm / (norm + 1e-6)).
    norm_type is any number but NaN, as torch's: inf is max |g|, -inf min |g|, a negative p with
    a zero gradient gives 0, and 0 (torch's norm of the per-tensor norms) counts the weight and
    bias tensors whose gradient is not all zeros.
    Returns the total norm before clipping, as a NumPy float64: a Python float that has torch's
    0-d tensor's .item(), for code that logs clip_grad_norm_(...).item(). A NaN or
    inf norm scales the gradients by it, unless error_if_nonfinite=True, which raises
    RuntimeError and changes nothing. parameters: a cmlp.MLP, its parameters(), or all the
    arrays parameters() gave out (none: the norm is 0); foreach is accepted for compatibility
    (one fused pass either way)."""
    model = _clipped(parameters)
    max_norm = as_number("max_norm", max_norm)
    if model is None:
        return np.float64(0.0)
    return np.float64(model._c.clip_grad_norm(max_norm, _norm_type(norm_type),
                                              as_flag("error_if_nonfinite", error_if_nonfinite)))


def _nonfinite(norm_type: float, total: float) -> RuntimeError:
    # (torch's words where code may look for them: "is non-finite", "error_if_nonfinite=False")
    return RuntimeError(f"The total norm of order {norm_type:g} of the gradients is non-finite ({total}), so it "
                        "cannot be clipped; set error_if_nonfinite=False to scale the gradients by it anyway")


def _array_norm(a: np.ndarray, p: float) -> float:
    """torch's vector_norm of one array in float64 (0: the count of nonzeros)."""
    a = np.abs(a.astype(np.float64).ravel())
    if a.size == 0:
        return 0.0
    if p == 0:
        return float(np.count_nonzero(a))
    if p == math.inf:
        return float(a.max()) if not np.isnan(a).any() else math.nan
    if p == -math.inf:
        return float(a.min()) if not np.isnan(a).any() else math.nan
    with np.errstate(divide="ignore", over="ignore"):
        return float(np.sum(a ** p) ** (1.0 / p))


def get_total_norm(tensors: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> float:
    """torch.nn.utils.get_total_norm: the norm of order norm_type of the norms of tensors, as a
    NumPy float64 (a float with .item(), as clip_grad_norm_'s), nothing changed. tensors: a cmlp.MLP or its parameters() (their gradients, as
    clip_grad_norm_ computes the norm, on the model's device), or arrays (e.g.
    model.grads().values()), each array's norm computed in float64. With error_if_nonfinite a
    NaN or inf norm raises RuntimeError."""
    p = _norm_type(norm_type)
    error_if_nonfinite = as_flag("error_if_nonfinite", error_if_nonfinite)
    if isinstance(tensors, (str, bytes, bytearray)):  # (whose items would read as numbers)
        raise TypeError(f"tensors must be a cmlp.MLP, its parameters() or arrays, got {type(tensors).__name__}")
    if isinstance(tensors, (MLP, Parameters)):
        total = model_of(tensors, "tensors")._c.grad_norm(p)
    else:
        arrays = [tensors] if isinstance(tensors, np.ndarray) else list(tensors)
        norms = []
        for i, t in enumerate(arrays):
            a = np.asarray(t)
            if a.dtype == np.bool_ or a.dtype.kind not in "iuf":
                raise TypeError(f"tensors[{i}] must be an array of real numbers, got dtype {a.dtype}")
            norms.append(_array_norm(a, p))
        total = _array_norm(np.asarray(norms, dtype=np.float64), p) if norms else 0.0
    if error_if_nonfinite and not math.isfinite(total):
        raise _nonfinite(p, total)
    return np.float64(total)


def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: Any, foreach: Optional[bool] = None) -> None:
    """torch.nn.utils.clip_grads_with_norm_: every gradient multiplied by
    min(1, max_norm / (total_norm + 1e-6)) in float32, as torch rounds it (total_norm from
    get_total_norm, or any number >= 0; a NaN or inf one scales by it, as torch's; a negative
    one, which torch takes and turns every gradient round with, is refused)."""
    model = _clipped(parameters)
    if model is None:
        as_number("max_norm", max_norm), as_number("total_norm", total_norm)
        return
    model._c.clip_grads_with_norm(as_number("max_norm", max_norm), as_number("total_norm", total_norm))


def clip_grad_norm(parameters: Any, max_norm: float, norm_type: Any = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> float:
    """Deprecated, as torch's: clip_grad_norm_ (which it calls, with torch's FutureWarning)."""
    warnings.warn("`cmlp.nn.utils.clip_grad_norm` is now deprecated in favor of `cmlp.nn.utils.clip_grad_norm_`.",
                  FutureWarning, stacklevel=2)
    return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def clip_grad_value_(parameters: Any, clip_value: float, foreach: Optional[bool] = None) -> None:
    """Clamps every gradient to [-clip_value, clip_value] (a NaN stays NaN)."""
    model = _clipped(parameters)
    if model is None:
        as_number("clip_value", clip_value)
        return
    model._c.clip_grad_value(as_number("clip_value", clip_value))


__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_", "clip_grad_norm"]
