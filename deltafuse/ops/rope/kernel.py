"""Triton partial RoPE for q and k (forward and backward) with a torch autograd Function.

One program per (token, batch row) handles every head of q and of k: it reads the token's cos/sin row
once, rotates the first rotary_dim channels of each head (rotate-half pairs i, i + rotary_dim/2) and copies
the remaining channels. Any strides are accepted for q/k (the transposed [B, H, T, D] views transformers
passes are read in place); outputs keep the input's memory layout. The forward rounds each product and
the sum to the output dtype, as the stock ``q * cos + rotate_half(q) * sin`` does (compiled without
floating-point contraction, which would fuse a product into the sum), so low-precision outputs are the
stock ones. The backward is the transposed rotation (fp32, one rounding). Gradients for cos/sin,
needed only when they require grad (never for transformers' rotary embedding), are reduced in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.ops._amp import no_autocast_backward

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _rope_heads(X, Y, b, t, H, sx_b, sx_t, sx_h, sy_b, sy_t, sy_h, c1, c2, s1, s2, HALF, PASS,
                BACKWARD: tl.constexpr, OUT_DT: tl.constexpr, HAS_PASS: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    xrow = X + b.to(tl.int64) * sx_b + t.to(tl.int64) * sx_t
    yrow = Y + b.to(tl.int64) * sy_b + t.to(tl.int64) * sy_t
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        m = hm[:, None] & jm[None, :]
        xp = xrow + h.to(tl.int64)[:, None] * sx_h + j[None, :]
        yp = yrow + h.to(tl.int64)[:, None] * sy_h + j[None, :]
        x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:
            y1 = (x1 * c1[None, :]).to(OUT_DT).to(tl.float32) - (x2 * s1[None, :]).to(OUT_DT).to(tl.float32)
            y2 = (x2 * c2[None, :]).to(OUT_DT).to(tl.float32) + (x1 * s2[None, :]).to(OUT_DT).to(tl.float32)
        tl.store(yp, y1.to(Y.dtype.element_ty), mask=m)
        tl.store(yp + HALF, y2.to(Y.dtype.element_ty), mask=m)
        if HAS_PASS:
            for p0 in range(0, PASS, BLOCK_PASS):
                p = p0 + tl.arange(0, BLOCK_PASS)
                pm = hm[:, None] & (p < PASS)[None, :]
                off = 2 * HALF + p[None, :]
                v = tl.load(xrow + h.to(tl.int64)[:, None] * sx_h + off, mask=pm, other=0.0)
                tl.store(yrow + h.to(tl.int64)[:, None] * sy_h + off, v.to(Y.dtype.element_ty), mask=pm)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, HQ, HK, HALF, PASS,
                 sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sqo_b, sqo_t, sqo_h, sko_b, sko_t, sko_h,
                 sc_b, sc_t, ss_b, ss_t,
                 BACKWARD: tl.constexpr, OUT_DT: tl.constexpr, HAS_PASS: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cp = COS + b.to(tl.int64) * sc_b + t.to(tl.int64) * sc_t + j
    sp = SIN + b.to(tl.int64) * ss_b + t.to(tl.int64) * ss_t + j
    c1 = tl.load(cp, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cp + HALF, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sp, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sp + HALF, mask=jm, other=0.0).to(tl.float32)
    _rope_heads(Q, QO, b, t, HQ, sq_b, sq_t, sq_h, sqo_b, sqo_t, sqo_h, c1, c2, s1, s2, HALF, PASS,
                BACKWARD, OUT_DT, HAS_PASS, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    _rope_heads(K, KO, b, t, HK, sk_b, sk_t, sk_h, sko_b, sko_t, sko_h, c1, c2, s1, s2, HALF, PASS,
                BACKWARD, OUT_DT, HAS_PASS, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


def _btHd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """View a 4-D q/k as [B, T, H, D] (transformers' [B, H, T, D] is transposed, not copied)."""
    return x.transpose(1, 2) if unsqueeze_dim == 1 else x


def _launch(q, k, qo, ko, cos, sin, unsqueeze_dim, backward, out_dtype):
    q4, k4, qo4, ko4 = (_btHd(t, unsqueeze_dim) for t in (q, k, qo, ko))
    B, T, HQ, D = q4.shape
    HK = k4.shape[2]
    rd = cos.shape[-1]
    half, n_pass = rd // 2, D - rd
    cos3 = cos.expand(B, T, rd)
    sin3 = sin.expand(B, T, rd)
    if B == 0 or T == 0:
        return
    block_half = triton.next_power_of_2(half)
    block_pass = min(256, triton.next_power_of_2(max(n_pass, 1)))
    _rope_kernel[(T, B)](
        q4, k4, qo4, ko4, cos3, sin3, HQ, HK, half, n_pass,
        *q4.stride()[:3], *k4.stride()[:3], *qo4.stride()[:3], *ko4.stride()[:3],
        *cos3.stride()[:2], *sin3.stride()[:2],
        BACKWARD=backward, OUT_DT=_TL[out_dtype], HAS_PASS=n_pass > 0,
        BLOCK_HQ=min(16, triton.next_power_of_2(HQ)), BLOCK_HK=min(16, triton.next_power_of_2(HK)),
        BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=4,
        # the forward must round like stock (each product, then the sum): without this the compiler
        # contracts product + sum into one fused multiply-add (one rounding), which differed from stock
        # in the last bit on the H200; the fp32 backward may fuse
        enable_fp_fusion=backward)


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cs_grad(dq, dk, q, k, cos_shape, unsqueeze_dim, dtype):
    """Gradients of cos and sin (both [Bc, T, rd]) from the rotated parts, reduced over heads and batch."""
    rd = cos_shape[-1]
    h = rd // 2
    target = list(cos_shape)
    target.insert(unsqueeze_dim, 1)
    dc = ds = 0
    for dy, x in ((dq, q), (dk, k)):
        dy, x = dy[..., :rd].float(), x[..., :rd].float()
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        dc = dc + (dy * x).sum_to_size(target)
        ds = ds + (dy * rot).sum_to_size(target)
    return dc.squeeze(unsqueeze_dim).to(dtype), ds.squeeze(unsqueeze_dim).to(dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        q, k, cos, sin = (_last_dim_unit(t) for t in (q, k, cos, sin))
        out_dtype = torch.promote_types(q.dtype, cos.dtype)
        qo = torch.empty_like(q, dtype=out_dtype)
        ko = torch.empty_like(k, dtype=out_dtype)
        _launch(q, k, qo, ko, cos, sin, unsqueeze_dim, False, out_dtype)
        cs_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        ctx.save_for_backward(cos, sin, *((q, k) if cs_grad else ()))
        ctx.meta = (unsqueeze_dim, q.dtype, k.dtype, cs_grad)
        return qo, ko

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dqo, dko):
        unsqueeze_dim, q_dtype, k_dtype, cs_grad = ctx.meta
        cos, sin = ctx.saved_tensors[:2]
        dqo = _last_dim_unit(dqo)
        dko = _last_dim_unit(dko)
        dq = torch.empty_like(dqo, dtype=q_dtype)
        dk = torch.empty_like(dko, dtype=k_dtype)
        _launch(dqo, dko, dq, dk, cos, sin, unsqueeze_dim, True, torch.float32)
        dcos = dsin = None
        if cs_grad:
            q, k = ctx.saved_tensors[2:]
            dcos, dsin = _cs_grad(dqo, dko, q, k, cos.shape, unsqueeze_dim, cos.dtype)
        return dq, dk, dcos, dsin, None


def apply_rotary_pos_emb_triton(q, k, cos, sin, unsqueeze_dim: int = 1):
    for name, t in (("q", q), ("cos", cos)):
        if t.dtype not in _TL:
            raise ValueError(f"the Triton RoPE supports fp16, bf16 and fp32, got {name} of dtype {t.dtype}")
    return _Rope.apply(q, k, cos, sin, unsqueeze_dim)
