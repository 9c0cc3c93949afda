"""Torch partial RoPE exactly as transformers applies it in the Qwen3.5 family (``apply_rotary_pos_emb``).

cos/sin: [B or 1, T, rotary_dim]; the first rotary_dim channels of each head are rotated with the
rotate-half convention (pairs i and i + rotary_dim/2), the rest pass through. Same operations in the same
order as the stock function, so the result is bit-identical to it.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb_torch(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rd = cos.shape[-1]
    out = []
    for x in (q, k):
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        out.append(torch.cat([(x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass], dim=-1))
    return out[0], out[1]
