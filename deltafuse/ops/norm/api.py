"""Public RMSNorm ops of the Qwen3.5 family; the registry picks the implementation per call."""

from __future__ import annotations

import math

import torch

from deltafuse import backends
from deltafuse.ops.norm.candidates import RMS_NORM, RMS_NORM_GATED
from deltafuse.ops import _library
from deltafuse.ops import _checks as check


def _eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        check.fail(f"eps must be a finite float >= 0, got {eps!r}")
    return float(eps)


def _x_weight(x, weight):
    check.tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        check.fail(f"x must have a non-empty last dimension to normalise over, got shape {check.shape(x)}")
    check.tensor("weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        check.fail(f"weight must be [D] = ({x.shape[-1]},) for x of shape {check.shape(x)}, "
                   f"got {check.shape(weight)}")


@check.public_op(RMS_NORM)
def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                           *, backend: str | None = None, **kwargs) -> torch.Tensor:
    """Qwen3.5's RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * (1 + weight)`` in fp32, cast to x's dtype.

    x: [..., D] (any float dtype); weight: [D] (initialised to zeros by transformers). Returns x's shape
    and dtype. ``backend=`` may force 'triton' or 'torch'.
    """
    if kwargs:
        check.fail(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed: backend")
    _x_weight(x, weight)
    eps = _eps(eps)
    check.same_device("x", x, weight=weight)
    if backend is not None:
        backends.call_backend(RMS_NORM, backend)
    return _rms_norm_op(x, weight, eps, backend, _library.grad_mask(x, weight))[0]


@check.public_op(RMS_NORM_GATED)
def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   *, backend: str | None = None, **kwargs) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm: ``(weight * norm(x).to(x.dtype)) * silu(gate.float())``, cast to x's dtype.

    norm(x) = x * rsqrt(mean(x^2, -1) + eps) in fp32. x, gate: [..., D] of the same shape; weight: [D]
    (initialised to ones). ``backend=`` may force 'triton' or 'torch'.
    """
    if kwargs:
        check.fail(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed: backend")
    _x_weight(x, weight)
    check.tensor("gate", gate)
    if gate.shape != x.shape:
        check.fail(f"gate must have x's shape {check.shape(x)}, got {check.shape(gate)}")
    eps = _eps(eps)
    check.same_device("x", x, gate=gate, weight=weight)
    if backend is not None:
        backends.call_backend(RMS_NORM_GATED, backend)
    return _rms_norm_gated_op(x, gate, weight, eps, backend, _library.grad_mask(x, gate, weight))[0]


def _like_x(x, *args):
    return _library.fake_outputs(torch.empty_like(x), like=x)


@_library.define(RMS_NORM, ("x", "weight"), _like_x)
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str | None,
                 grad_mask: list[bool]) -> list[torch.Tensor]:
    impl = _library.select(RMS_NORM, backend, grad_mask, x, weight)
    return _library.run_forward([x, weight], grad_mask, lambda x_, w: (impl(x_, w, eps),), x.device.type)


@_library.define(RMS_NORM_GATED, ("x", "gate", "weight"), _like_x)
def _rms_norm_gated_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       backend: str | None, grad_mask: list[bool]) -> list[torch.Tensor]:
    impl = _library.select(RMS_NORM_GATED, backend, grad_mask, x, gate, weight)
    return _library.run_forward([x, gate, weight], grad_mask, lambda x_, g, w: (impl(x_, g, w, eps),),
                                x.device.type)
