"""Float64 oracles for the RMSNorms, written directly from the formulas (no shared code with the ops)."""

from __future__ import annotations

import torch


def naive_rms_norm_zero_centered(x, weight, eps, dtype=torch.float64):
    """x / sqrt(mean(x^2) + eps) * (1 + w) entirely in ``dtype``; differentiable."""
    x, weight = x.to(dtype), weight.to(dtype)
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return x / rms * (1 + weight)


def naive_rms_norm_gated(x, gate, weight, eps, dtype=torch.float64):
    """w * x / sqrt(mean(x^2) + eps) * gate * sigmoid(gate) entirely in ``dtype``; differentiable."""
    x, gate, weight = x.to(dtype), gate.to(dtype), weight.to(dtype)
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return weight * (x / rms) * (gate * torch.sigmoid(gate))
