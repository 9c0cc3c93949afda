"""Torch RMSNorms written exactly as transformers writes them for the Qwen3.5 family.

For fp16 / bf16 / fp32 inputs these are the same operations in the same order as ``Qwen3_5RMSNorm`` and
``Qwen3_5RMSNormGated`` (and their Qwen3.5-MoE / Qwen3-Next copies), so they agree with the stock modules
bit for bit. The only departure: a float64 input is computed in float64 (transformers would compute it in
fp32), so the same function serves as a high-precision check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm_zero_centered_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 (or fp64), cast back to x's dtype."""
    ct = _compute_dtype(x.dtype)
    h = x.to(ct)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (1.0 + weight.to(ct))
    return h.type_as(x)


def rms_norm_gated_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(w * norm(x).to(x.dtype)) * silu(gate in fp32), cast back to x's dtype."""
    dt = x.dtype
    ct = _compute_dtype(dt)
    h = x.to(ct)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = weight * h.to(dt)
    h = h * F.silu(gate.to(_compute_dtype(gate.dtype)))
    return h.to(dt)
