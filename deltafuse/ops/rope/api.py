"""Public partial RoPE op with transformers' ``apply_rotary_pos_emb`` signature (Qwen3.5 family)."""

from __future__ import annotations

import torch

from deltafuse import backends
from deltafuse.ops.rope.candidates import ROPE
from deltafuse.ops import _library
from deltafuse.ops import _checks as check

UNSQUEEZE = {1: 1, 2: 2, -3: 1, -2: 2}


@check.public_op(ROPE)
def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1, *, backend: str | None = None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim channels of every q and k head; pass the other channels through.

    q: [B, HQ, T, D] and k: [B, HK, T, D] (unsqueeze_dim=1, transformers' layout) or [B, T, H, D]
    (unsqueeze_dim=2); cos, sin: [B or 1, T, rotary_dim] with rotary_dim even and <= D, as the text
    rotary embedding returns them (rotary_dim = head_dim * partial_rotary_factor; the interleaved mrope
    layout is already folded into cos/sin). Uses the rotate-half pairing (i, i + rotary_dim/2):
    ``out = x * cos + rotate_half(x) * sin`` on the rotated channels. Returns (q_embed, k_embed) in the
    promoted dtype of q and cos. ``backend=`` may force 'triton' or 'torch'.
    """
    if kwargs:
        check.fail(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed: unsqueeze_dim, backend")
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in UNSQUEEZE:
        check.fail(f"unsqueeze_dim={unsqueeze_dim!r} is not supported; allowed: 1 (q/k are [B, H, T, D]) "
                   f"or 2 (q/k are [B, T, H, D]) (or -3 / -2)")
    ud = UNSQUEEZE[unsqueeze_dim]
    check.tensor("q", q, 4)
    check.tensor("k", k, 4)
    check.tensor("cos", cos, 3)
    check.tensor("sin", sin, 3)
    if k.dtype != q.dtype:
        check.fail(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if sin.dtype != cos.dtype:
        check.fail(f"sin has dtype {sin.dtype} but cos has {cos.dtype}; they must match")
    t_dim = 3 - ud  # where T sits in q/k
    B, T, D = q.shape[0], q.shape[t_dim], q.shape[3]
    layout = "[B, H, T, D]" if ud == 1 else "[B, T, H, D]"
    if k.shape[0] != B or k.shape[t_dim] != T or k.shape[3] != D:
        check.fail(f"k must be {layout} with B={B}, T={T}, D={D} as q {check.shape(q)}, got {check.shape(k)}")
    if sin.shape != cos.shape:
        check.fail(f"sin must have cos's shape {check.shape(cos)}, got {check.shape(sin)}")
    rd = cos.shape[2]
    if cos.shape[0] not in (1, B) or cos.shape[1] != T:
        check.fail(f"cos must be [B or 1, T, rotary_dim] with B={B}, T={T} (q is {layout} {check.shape(q)}), "
                   f"got {check.shape(cos)}")
    if rd == 0 or rd % 2 or rd > D:
        check.fail(f"cos/sin last dimension (rotary_dim) must be even and in [2, D={D}], got {rd}")
    check.same_device("q", q, k=k, cos=cos, sin=sin)
    if backend is not None:
        backends.call_backend(ROPE, backend)
    out = _rope_op(q, k, cos, sin, ud, backend, _library.grad_mask(q, k, cos, sin))
    return out[0], out[1]


def _rope_fake(q, k, cos, sin, unsqueeze_dim, backend, grad_mask):
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return _library.fake_outputs(torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype), like=q)


@_library.define(ROPE, ("q", "k", "cos", "sin"), _rope_fake)
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
             backend: str | None, grad_mask: list[bool]) -> list[torch.Tensor]:
    impl = _library.select(ROPE, backend, grad_mask, q, k, cos, sin)

    def run(q_, k_, cos_, sin_):
        q_out, k_out = impl(q_, k_, cos_, sin_, unsqueeze_dim)
        return _library.in_layout_of(q_out, q_), _library.in_layout_of(k_out, k_)  # the fake's layouts

    return _library.run_forward([q, k, cos, sin], grad_mask, run, q.device.type)
