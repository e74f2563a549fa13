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
from typing import Any, Optional

from .._arrays import as_number
from ..model import model_of


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
    Returns the total norm before clipping, as a float (torch returns a 0-d tensor). A NaN or
    inf norm scales the gradients by it, unless error_if_nonfinite=True, which raises
    RuntimeError and changes nothing. parameters: a cmlp.MLP or its parameters(); foreach is
    accepted for compatibility (one fused pass either way)."""
    model = model_of(parameters, "parameters")
    max_norm = as_number("max_norm", max_norm)
    return model._c.clip_grad_norm(max_norm, _norm_type(norm_type), bool(error_if_nonfinite))


def clip_grad_value_(parameters: Any, clip_value: float, foreach: Optional[bool] = None) -> None:
    """Clamps every gradient to [-clip_value, clip_value] (a NaN stays NaN)."""
    model = model_of(parameters, "parameters")
    model._c.clip_grad_value(as_number("clip_value", clip_value))


__all__ = ["clip_grad_norm_", "clip_grad_value_"]
