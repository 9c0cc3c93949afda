"""Triton causal depthwise conv1d (+ optional SiLU) with sequence resets, forward and backward.

Same semantics and numerics as ``reference.causal_conv1d_fn_torch``: x [B, C, T] (any strides; the
[B, T, C]-major transposed view transformers passes is read in place and the output keeps that layout),
weight [C, W], optional bias [C], optional sequence ids per token (from seq_idx or cu_seqlens), optional
initial states [B, C, W-1] that continue the row's first sequence. Inputs are rounded to weight's dtype,
the taps accumulate in fp32, the sum is rounded to weight's dtype, SiLU is applied and rounded to weight's
dtype, the result is stored in x's dtype.

Indexing: extended positions q in [0, W-1+T) cover the history (q < W-1, from initial_states) and the row
(q >= W-1, x at q-(W-1)); history positions belong to the row's first sequence. Then

    pre[t]  = bias + sum_j w[j] * xe[t + j] * [seq(t + j) == seq(t)]
    dxe[q]  = sum_j w[j] * dpre[q - j] * [0 <= q - j < T and seq(q - j) == seq(q)]
    dw[j]   = sum_t dpre[t] * xe[t + j] * [seq(t + j) == seq(t)],   dbias = sum_t dpre[t]

The backward recomputes pre at the W shifted positions it needs (W*W tile loads that hit the cache)
instead of storing it, so it keeps no activation besides the inputs. dw / dbias are reduced per tile in
fp32 and summed with one torch reduction. The final states for decoding are slices of the inputs and are
built in torch (autograd carries their gradient into x and initial_states).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.ops._amp import no_autocast_backward

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _load_ext(X, INIT, b, q, c, cm, T, sxb, sxc, sxt, sib, sic,
              W: tl.constexpr, HAS_INIT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr):
    """xe[b, c, q] as fp32 after the reference's casts; zero outside [0, W-1+T)."""
    in_x = (q >= W - 1) & (q < T + W - 1)
    p = tl.maximum(q - (W - 1), 0)
    v = tl.load(X + b * sxb + c[None, :].to(tl.int64) * sxc + p[:, None].to(tl.int64) * sxt,
                mask=in_x[:, None] & cm[None, :], other=0.0)
    v = v.to(W_DT).to(tl.float32)
    if HAS_INIT:
        in_h = (q >= 0) & (q < W - 1)
        h = tl.load(INIT + b * sib + c[None, :].to(tl.int64) * sic + tl.maximum(tl.minimum(q, W - 2), 0)[:, None],
                    mask=in_h[:, None] & cm[None, :], other=0.0)
        v += h.to(X_DT).to(W_DT).to(tl.float32)
    return v


@triton.jit
def _seq_ext(SID, b, q, T, ssb, W: tl.constexpr):
    """Sequence id of extended position q (history takes the row's first token's id)."""
    p = tl.minimum(tl.maximum(q - (W - 1), 0), T - 1)
    return tl.load(SID + b * ssb + p)


@triton.jit
def _pre(X, INIT, SID, WGT, BIAS, b, t, c, cm, T, sxb, sxc, sxt, sib, sic, ssb,
         W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SID: tl.constexpr, HAS_BIAS: tl.constexpr,
         X_DT: tl.constexpr, W_DT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """pre[t] (rounded to weight's dtype, as fp32) for a [BT] vector of tokens t and [BC] channels c."""
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    if HAS_SID:
        s_t = _seq_ext(SID, b, t + (W - 1), T, ssb, W)
    for j in tl.static_range(W):
        v = _load_ext(X, INIT, b, t + j, c, cm, T, sxb, sxc, sxt, sib, sic, W, HAS_INIT, X_DT, W_DT)
        if HAS_SID:
            v = tl.where((_seq_ext(SID, b, t + j, T, ssb, W) == s_t)[:, None], v, 0.0)
        w = tl.load(WGT + c * W + j, mask=cm, other=0.0).to(tl.float32)
        acc += v * w[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    return acc.to(W_DT).to(tl.float32)


@triton.jit
def _conv_fwd_kernel(X, INIT, SID, WGT, BIAS, Y, T, C, sxb, sxc, sxt, sib, sic, ssb, syb, syc, syt,
                     W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SID: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    pre = _pre(X, INIT, SID, WGT, BIAS, b, t, c, cm, T, sxb, sxc, sxt, sib, sic, ssb,
               W, HAS_INIT, HAS_SID, HAS_BIAS, X_DT, W_DT, BT, BC)
    if ACT:
        pre = (pre / (1.0 + tl.exp(-pre))).to(W_DT).to(tl.float32)
    tl.store(Y + b * syb + c[None, :].to(tl.int64) * syc + t[:, None].to(tl.int64) * syt,
             pre.to(Y.dtype.element_ty), mask=(t < T)[:, None] & cm[None, :])


@triton.jit
def _conv_bwd_kernel(X, INIT, SID, WGT, BIAS, DY, DX, DINIT, DW_PART, DB_PART, T, C, n_qt,
                     sxb, sxc, sxt, sib, sic, ssb, sdyb, sdyc, sdyt, sdxb, sdxc, sdxt, sdib, sdic,
                     W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SID: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    q = tl.program_id(0) * BT + tl.arange(0, BT)  # extended positions
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    if HAS_SID:
        s_q = _seq_ext(SID, b, q, T, ssb, W)
    dxe = tl.zeros((BT, BC), dtype=tl.float32)
    dpre0 = tl.zeros((BT, BC), dtype=tl.float32)
    for s in tl.static_range(W):
        t = q - s
        t_ok = (t >= 0) & (t < T)
        dy = tl.load(DY + b * sdyb + c[None, :].to(tl.int64) * sdyc + tl.maximum(t, 0)[:, None].to(tl.int64) * sdyt,
                     mask=t_ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
        if ACT:
            pre = _pre(X, INIT, SID, WGT, BIAS, b, t, c, cm, T, sxb, sxc, sxt, sib, sic, ssb,
                       W, HAS_INIT, HAS_SID, HAS_BIAS, X_DT, W_DT, BT, BC)
            sig = 1.0 / (1.0 + tl.exp(-pre))
            dpre = dy * (sig * (1.0 + pre * (1.0 - sig)))
        else:
            dpre = dy
        if s == 0:
            dpre0 = dpre
        w = tl.load(WGT + c * W + s, mask=cm, other=0.0).to(tl.float32)
        contrib = dpre * w[None, :]
        if HAS_SID:
            contrib = tl.where((_seq_ext(SID, b, t + (W - 1), T, ssb, W) == s_q)[:, None], contrib, 0.0)
        dxe += contrib
    # dx for row positions, d initial_states for history positions
    in_x = (q >= W - 1) & (q < T + W - 1)
    p = tl.maximum(q - (W - 1), 0)
    tl.store(DX + b * sdxb + c[None, :].to(tl.int64) * sdxc + p[:, None].to(tl.int64) * sdxt,
             dxe.to(DX.dtype.element_ty), mask=in_x[:, None] & cm[None, :])
    if HAS_INIT:
        in_h = q < W - 1
        tl.store(DINIT + b * sdib + c[None, :].to(tl.int64) * sdic + tl.minimum(q, W - 2)[:, None],
                 dxe.to(DINIT.dtype.element_ty), mask=in_h[:, None] & cm[None, :])
    # weight and bias partials: this tile's q positions taken as tokens t = q (dpre0 is dpre[q])
    tile = b * n_qt + tl.program_id(0)
    if HAS_SID:
        s_t = _seq_ext(SID, b, q + (W - 1), T, ssb, W)
    for j in tl.static_range(W):
        v = _load_ext(X, INIT, b, q + j, c, cm, T, sxb, sxc, sxt, sib, sic, W, HAS_INIT, X_DT, W_DT)
        if HAS_SID:
            v = tl.where((_seq_ext(SID, b, q + j, T, ssb, W) == s_t)[:, None], v, 0.0)
        tl.store(DW_PART + (tile * C + c) * W + j, tl.sum(dpre0 * v, axis=0), mask=cm)
    if HAS_BIAS:
        tl.store(DB_PART + tile * C + c, tl.sum(dpre0, axis=0), mask=cm)


def _cfg(C: int):
    bc = min(64, triton.next_power_of_2(C))
    return 32, bc, 4


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_states, sid, activation):
        B, C, T = x.shape
        W = weight.shape[1]
        weight_c = weight.contiguous()
        y = torch.empty_like(x)
        bt, bc, warps = _cfg(C)
        init = initial_states if W > 1 else None  # W = 1: [B, C, 0], nothing to read
        if init is not None and init.stride(-1) != 1:
            init = init.contiguous()
        dummy = weight_c
        flags = dict(W=W, HAS_INIT=init is not None, HAS_SID=sid is not None, HAS_BIAS=bias is not None,
                     ACT=activation, X_DT=_TL[x.dtype], W_DT=_TL[weight.dtype], BT=bt, BC=bc)
        if y.numel():
            _conv_fwd_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc), B)](
                x, init if init is not None else dummy, sid if sid is not None else dummy, weight_c,
                bias if bias is not None else dummy, y, T, C, *x.stride(),
                *(init.stride()[:2] if init is not None else (0, 0)), sid.stride(0) if sid is not None else 0,
                *y.stride(), num_warps=warps, **flags)
        ctx.save_for_backward(x, weight_c, bias, init, sid)
        ctx.flags = flags
        ctx.init_meta = (initial_states.shape, initial_states.dtype) if initial_states is not None else None
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        # The GDN layer hands back a transposed view; on the H200 the kernel gave wrong gradients for such a
        # dy (the interpreter did not), so read a dense copy until a GPU run shows the strided read is right.
        dy = dy.contiguous()
        x, weight, bias, init, sid = ctx.saved_tensors
        flags = ctx.flags
        B, C, T = x.shape
        W = weight.shape[1]
        bt, bc = flags["BT"], flags["BC"]
        n_qt = triton.cdiv(T + W - 1, bt)
        dx = torch.empty_like(x)
        dinit = torch.empty(init.shape, dtype=init.dtype, device=x.device) if init is not None else None
        dw_part = torch.empty((B * n_qt, C, W), dtype=torch.float32, device=x.device)
        db_part = torch.empty((B * n_qt, C), dtype=torch.float32, device=x.device) if bias is not None else None
        dummy = weight
        if x.numel():
            _conv_bwd_kernel[(n_qt, triton.cdiv(C, bc), B)](
                x, init if init is not None else dummy, sid if sid is not None else dummy, weight,
                bias if bias is not None else dummy, dy, dx, dinit if dinit is not None else dummy, dw_part,
                db_part if db_part is not None else dummy, T, C, n_qt, *x.stride(),
                *(init.stride()[:2] if init is not None else (0, 0)), sid.stride(0) if sid is not None else 0,
                *dy.stride(), *dx.stride(), *(dinit.stride()[:2] if dinit is not None else (0, 0)),
                num_warps=4, **flags)
        else:
            dx.zero_()
            dw_part.zero_()
            if db_part is not None:
                db_part.zero_()
            if dinit is not None:
                dinit.zero_()
        dw = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = db_part.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        if ctx.init_meta is not None:
            shape, dtype = ctx.init_meta
            dinit = dinit.to(dtype) if dinit is not None else torch.zeros(shape, dtype=dtype, device=x.device)
        return dx, dw, db, dinit if ctx.needs_input_grad[3] else None, None, None


def _sequence_ids(seq_idx, cu_seqlens, B, T, device):
    if seq_idx is not None:
        return seq_idx.to(torch.int32).contiguous()
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return torch.searchsorted(cu[1:], torch.arange(T, device=device), right=True).to(torch.int32)[None]


def causal_conv1d_fn_triton(x, weight, bias=None, activation=None, seq_idx=None, cu_seqlens=None,
                            initial_states=None, return_final_states=False, final_states_out=None):
    """Same contract as ``reference.causal_conv1d_fn_torch`` (see there), computed by Triton kernels."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _TL:
            raise ValueError(f"the Triton conv1d supports fp16, bf16 and fp32, got {name} of dtype {t.dtype}")
    B, C, T = x.shape
    W = weight.shape[1]
    sid = None
    if (seq_idx is not None or cu_seqlens is not None) and T > 0:
        sid = _sequence_ids(seq_idx, cu_seqlens, B, T, x.device).expand(B, T)
        if sid.stride(0) == 0 and B > 1:
            sid = sid.contiguous()
    out = _CausalConv1d.apply(x, weight, bias, initial_states, sid, activation in ("silu", "swish"))
    if not return_final_states:
        return out
    hist = initial_states.to(x.dtype) if initial_states is not None else x.new_zeros(B, C, W - 1)
    if T >= W - 1:
        final = x[..., T - (W - 1):]
    else:
        final = torch.cat([hist[..., T:], x], -1)
    if sid is not None:
        sid_ext = torch.cat([sid[:, :1].expand(B, W - 1), sid], -1)
        keep = (sid_ext[:, T:] == sid[:, -1:]).unsqueeze(1)
        final = torch.where(keep, final, torch.zeros_like(final))
    else:
        final = final.clone()  # never hand out a view of x
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final
