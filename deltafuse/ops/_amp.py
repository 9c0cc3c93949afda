"""Autocast (``torch.autocast``, mixed precision) handling shared by the public ops.

Under autocast, transformers' stock modules run with fp32 master weights: ``nn.Linear`` computes in the
autocast dtype (bf16 / fp16), while the norms, RoPE and SwiGLU are elementwise code autocast does not change,
and the kernel libraries the GDN layer calls (FLA, causal-conv1d, transformers' grouped_mm experts) ignore it.
The public ops therefore never let autocast reach their implementations (whose torch paths would otherwise
change precision half-way, and whose Triton paths it cannot reach anyway): each op runs with autocast
disabled, and an op whose stock counterpart is a linear layer (the fused loss) first casts its inputs the
way autocast casts ``nn.Linear``'s. Backward passes run with autocast disabled as well, so a ``backward()``
called inside an autocast region computes the same gradients as one called outside.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# what autocast casts to the lower-precision dtype for ops on its lower-precision list (fp64 is left alone)
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype autocast computes linear layers in on this device type, or None when
    autocast is off there (or torch has no autocast for the device type)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return None


def cast_as_linear(dtype: torch.dtype | None, *tensors):
    """The tensors as autocast hands them to a linear layer computed in ``dtype``: fp32/fp16/bf16 tensors
    cast to it (differentiably: gradients flow back in the original dtype), others (fp64, None) unchanged."""
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE else t for t in tensors)


def disabled(device_type: str):
    """A context in which autocast is off on ``device_type`` (a no-op when it is off already)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def no_autocast_backward(backward):
    """Decorates an ``autograd.Function.backward`` so that it runs with autocast disabled on the gradients'
    device, whatever region ``backward()`` was called from."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), None)
        if device is None:
            return backward(ctx, *grads)
        with disabled(device):
            return backward(ctx, *grads)

    return wrapper
