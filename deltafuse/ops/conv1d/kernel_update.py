"""Triton causal conv1d decoding step: one launch reads the state window and the new inputs and writes the
outputs and the shifted state in place (no host synchronisation). The tunables (``update_block_c``,
``update_warps``) are fields of ``options.ConvOptions``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.ops.conv1d.kernel import TL_DTYPES, check_dtypes
from deltafuse.ops.conv1d.options import ConvOptions, resolve


@triton.jit
def _window(X, STATE, b, c64, cm, k: tl.constexpr, sxb, sxc, sxt, ssb, ssc, sss, S: tl.constexpr, W_DT: tl.constexpr):
    """Column k of [conv_state, x] (the update's window), rounded to weight's dtype, as fp32."""
    if k < S:
        v = tl.load(STATE + b * ssb + c64 * ssc + k * sss, mask=cm, other=0.0)
    else:
        v = tl.load(X + b * sxb + c64 * sxc + (k - S) * sxt, mask=cm, other=0.0)
    return v.to(tl.float32).to(W_DT).to(tl.float32)


@triton.jit
def _conv_update_kernel(X, STATE, WGT, BIAS, Y, C, sxb, sxc, sxt, ssb, ssc, sss, syb, syc, syt,
                        W: tl.constexpr, S: tl.constexpr, T_NEW: tl.constexpr, HAS_BIAS: tl.constexpr,
                        ACT: tl.constexpr, W_DT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = c < C
    c64 = c.to(tl.int64)
    if HAS_BIAS:
        bias = tl.load(BIAS + c64, mask=cm, other=0.0).to(tl.float32)
    # outputs first (they read the state before it is overwritten): out[u] = sum_j w[j] window[S-W+1+u+j]
    for u in tl.static_range(T_NEW):
        acc = tl.zeros((BC,), dtype=tl.float32)
        for j in tl.static_range(W):
            v = _window(X, STATE, b, c64, cm, S - W + 1 + u + j, sxb, sxc, sxt, ssb, ssc, sss, S, W_DT)
            acc += v * tl.load(WGT + c64 * W + j, mask=cm, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += bias
        pre = acc.to(W_DT).to(tl.float32)
        if ACT:
            pre = (pre / (1.0 + tl.exp(-pre))).to(W_DT).to(tl.float32)
        tl.store(Y + b * syb + c64 * syc + u * syt, pre.to(Y.dtype.element_ty), mask=cm)
    # then the state shifts left by T_NEW: column i takes window column i + T_NEW. Columns go in increasing
    # order, so no column is read after it was written (whichever thread holds it).
    for i in tl.static_range(S):
        v = _window(X, STATE, b, c64, cm, i + T_NEW, sxb, sxc, sxt, ssb, ssc, sss, S, W_DT)
        tl.store(STATE + b * ssb + c64 * ssc + i * sss, v.to(STATE.dtype.element_ty), mask=cm)


def causal_conv1d_update_triton(x, conv_state, weight, bias=None, activation=None, *,
                                options: ConvOptions | None = None):
    """Same contract as ``reference.causal_conv1d_update_torch``, in one kernel launch: x [B, C, T_new] (or
    [B, C], one token, returned as [B, C]); conv_state [B, C, S >= W-1] is shifted left by T_new with the new
    inputs appended, in place, values passing through weight's dtype as in the torch function. No autograd
    (the state is written in place): a differentiable step takes the torch route. ``options``: the tunables
    (default: ``options.current_options()``), read once, here."""
    check_dtypes(x=x, conv_state=conv_state, weight=weight, bias=bias)
    options = resolve(options)
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    if x.dim() != 3 or conv_state.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"the Triton conv update needs x [B, C, T_new] or [B, C], conv_state [B, C, S] and "
                         f"weight [C, W], got x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, weight "
                         f"{tuple(weight.shape)}")
    B, C, T_new = x.shape
    W = weight.shape[1]
    S = conv_state.shape[2]
    if conv_state.shape[:2] != (B, C) or S < W - 1 or weight.shape[0] != C:
        raise ValueError(f"conv_state must be [B, C, S] with B={B}, C={C}, S >= W-1 = {W - 1} and weight [C, W], "
                         f"got conv_state {tuple(conv_state.shape)}, weight {tuple(weight.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r} is not supported; allowed: None, 'silu', 'swish'")
    y = torch.empty((B, C, T_new), dtype=x.dtype, device=x.device)
    if B and C:  # T_new = 0 still rounds the state through weight's dtype, as the torch function does
        weight_c = weight.contiguous()
        opts = options
        _conv_update_kernel[(triton.cdiv(C, opts.update_block_c), B)](
            x, conv_state, weight_c, bias if bias is not None else weight_c, y, C, *x.stride(),
            *conv_state.stride(), *y.stride(), W=W, S=S, T_NEW=T_new, HAS_BIAS=bias is not None,
            ACT=activation is not None, W_DT=TL_DTYPES[weight.dtype], BC=opts.update_block_c,
            num_warps=opts.update_warps)
    return y[..., 0] if squeeze else y
