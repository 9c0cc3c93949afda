"""Ascend NPU route for partial RoPE through ``torch_npu.npu_rotary_mul``.

``npu_rotary_mul(x, r1, r2)`` computes x * r1 + rotate_half(x) * r2 (the rotate-half convention, as the
Qwen3.5 family uses) on 4-D inputs with the rotation over the whole last dimension. For partial RoPE the
first rotary_dim channels are passed as a contiguous slice and the rest concatenated back. Documented
limits that this route cannot check without hardware: some torch_npu releases accept only D = 128 for the
rotated width (Qwen3.5 rotates 64 channels), and r1/r2 layouts are documented as 11SD / 1S1D / S11D (a
cos with a batch dimension > 1 is outside them). Not run on NPU hardware here.
"""

from __future__ import annotations

import torch


def apply_rotary_pos_emb_npu(q, k, cos, sin, unsqueeze_dim: int = 1):
    import torch_npu

    dt = torch.promote_types(q.dtype, cos.dtype)
    cos = cos.unsqueeze(unsqueeze_dim).to(dt)
    sin = sin.unsqueeze(unsqueeze_dim).to(dt)
    rd = cos.shape[-1]
    out = []
    for x in (q, k):
        x = x.to(dt)
        rot = torch_npu.npu_rotary_mul(x[..., :rd].contiguous(), cos, sin)
        out.append(rot if rd == x.shape[-1] else torch.cat([rot, x[..., rd:]], dim=-1))
    return out[0], out[1]
