"""Float64 oracle for partial RoPE, written pair by pair from the rotation it is."""

from __future__ import annotations

import torch


def naive_rotary(x, cos, sin, unsqueeze_dim=1, dtype=torch.float64):
    """Rotate channel pairs (i, i + rd/2) of each head of x by the angle given as (cos, sin); rest unchanged.

    x: 4-D with heads at ``unsqueeze_dim``; cos, sin: [B or 1, T, rd]. Differentiable in every argument.
    """
    x = x.to(dtype)
    c = cos.to(dtype).unsqueeze(unsqueeze_dim)
    s = sin.to(dtype).unsqueeze(unsqueeze_dim)
    rd = c.shape[-1]
    h = rd // 2
    a, b = x[..., :h], x[..., h:rd]
    first = a * c[..., :h] - b * s[..., :h]
    second = b * c[..., h:] + a * s[..., h:]
    return torch.cat([first, second, x[..., rd:]], dim=-1)
