"""Triton causal depthwise conv1d (+ optional SiLU) with sequence resets: forward, backward, decoding update.

Same semantics and numerics as ``reference.causal_conv1d_fn_torch``: x [B, C, T] (the [B, T, C]-major
transposed view transformers passes is read in place and the output keeps that layout; other layouts are
copied to it first), weight [C, W] with W <= 4, optional bias [C], optional sequence ids per token (from
seq_idx or cu_seqlens), optional initial states [B, C, W-1] that continue the row's first sequence. Inputs
are rounded to weight's dtype, the taps accumulate in fp32, the sum is rounded to weight's dtype, SiLU is
applied and rounded to weight's dtype, the result is stored in x's dtype.

Indexing: extended positions q in [0, W-1+T) cover the history (q < W-1, from initial_states) and the row
(q >= W-1, x at q-(W-1)); history positions belong to the row's first sequence. Then

    pre[t]  = bias + sum_j w[j] * xe[t + j] * [seq(t + j) == seq(t)]
    dxe[q]  = sum_j w[j] * dpre[q - j] * [0 <= q - j < T and seq(q - j) == seq(q)]
    dw[j]   = sum_t dpre[t] * xe[t + j] * [seq(t + j) == seq(t)],   dbias = sum_t dpre[t]

with dpre = dy * silu'(pre) in fp32 (pre rounded as in the forward).

Both passes walk the time axis: a program owns a block of channels (one [BC] vector, contiguous in memory in
the [B, T, C] layout, so every load and store is a coalesced row) and a block of BT tokens, and steps token
by token keeping the last W-1 inputs (and in the backward the W pending input gradients) in registers. So
each input element is read once from memory (plus a halo of W-1 rows per block, 2(W-1) in the backward), pre
and its sigmoid are computed once per element, and the output is written once. The loops load their rows
``prefetch`` steps ahead themselves (Triton's pipeliner does not take loads that feed no dot), so a step
waits only on a load issued steps earlier. dw / dbias accumulate per channel in registers (no reduction
inside a program) and each program writes one fp32 partial [W, BC]; one torch sum over the blocks finishes
them. The incoming gradient is read in place when it has x's layout (the GDN layer's transposed view).

The kernels are in ``kernel_fwd_bwd.py``; the decoding step (``causal_conv1d_update_triton``) is in
``kernel_update.py``.

Tunables live in ``ConvOptions`` (``options.py``): an argument of a call, read once at its start (the
``configured`` block's when it passes none, else the device's defaults: ``INTERPRET_OPTIONS`` under the
interpreter, tiny blocks so that tests cross block edges); the forward's autograd context keeps them for its
backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.ops._amp import no_autocast_backward
from deltafuse.ops.conv1d.candidates import TRITON_MAX_W
from deltafuse.ops.conv1d.kernel_fwd_bwd import conv_bwd_kernel, conv_fwd_kernel
from deltafuse.ops.conv1d.options import DEFAULT_OPTIONS, INTERPRET_OPTIONS, ConvOptions, configured, resolve

# the tunables' names, for callers that reach them through the op's entry (benchmarks, tests)
__all__ = ["ConvOptions", "DEFAULT_OPTIONS", "INTERPRET_OPTIONS", "TL_DTYPES", "causal_conv1d_fn_triton",
           "check_dtypes", "configured"]

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# --- host side ----------------------------------------------------------------------------------------------
def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, C, T] with channels contiguous (stride 1 along C): as is when it already is, else a copy."""
    if t.shape[1] <= 1 or t.stride(1) == 1:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def check_dtypes(**tensors):
    """Refuse, by name, a tensor of a dtype the conv kernels do not take (None: not passed)."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in TL_DTYPES:
            raise ValueError(f"the Triton conv1d supports fp16, bf16 and fp32, got {name} of dtype {t.dtype}")


def _check_width(W: int):
    if not 1 <= W <= TRITON_MAX_W:
        raise ValueError(f"the Triton conv1d takes kernel widths W from 1 to {TRITON_MAX_W}, got W={W}")


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_states, sid, activation, opts):
        B, C, T = x.shape
        W = weight.shape[1]
        xc = _channels_last(x)  # rows of channels are what the kernels read
        weight_c = weight.contiguous()
        y = torch.empty_like(xc)
        init = initial_states if W > 1 else None  # W = 1: [B, C, 0], nothing to read
        dummy = weight_c
        flags = dict(W=W, HAS_INIT=init is not None, HAS_SID=sid is not None, HAS_BIAS=bias is not None,
                     ACT=activation, X_DT=TL_DTYPES[x.dtype], W_DT=TL_DTYPES[weight.dtype])
        if y.numel():
            conv_fwd_kernel[(triton.cdiv(T, opts.fwd_block_t), triton.cdiv(C, opts.fwd_block_c), B)](
                xc, init if init is not None else dummy, sid if sid is not None else dummy, weight_c,
                bias if bias is not None else dummy, y, T, C, *xc.stride(),
                *(init.stride() if init is not None else (0, 0, 0)), sid.stride(0) if sid is not None else 0,
                *y.stride(), BT=opts.fwd_block_t, BC=opts.fwd_block_c, STAGES=opts.fwd_stages, PF=opts.fwd_prefetch,
                num_warps=opts.fwd_warps, **flags)
        ctx.save_for_backward(xc, weight_c, bias, init, sid)
        ctx.flags = flags
        ctx.opts = opts
        ctx.init_meta = (initial_states.shape, initial_states.dtype) if initial_states is not None else None
        return y if xc is x else torch.empty_like(x).copy_(y)

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        x, weight, bias, init, sid = ctx.saved_tensors
        flags, opts = ctx.flags, ctx.opts
        B, C, T = x.shape
        W = weight.shape[1]
        dy = _channels_last(dy)  # read in place when it has x's layout (the GDN layer's transposed view)
        n_qt = triton.cdiv(T + W - 1, opts.bwd_block_t)
        dx = torch.empty_like(x)
        dinit = torch.empty(init.shape, dtype=init.dtype, device=x.device) if init is not None else None
        dw_part = torch.empty((B * n_qt, W, C), dtype=torch.float32, device=x.device)
        db_part = torch.empty((B * n_qt, C), dtype=torch.float32, device=x.device) if bias is not None else None
        dummy = weight
        if x.numel():
            conv_bwd_kernel[(n_qt, triton.cdiv(C, opts.bwd_block_c), B)](
                x, init if init is not None else dummy, sid if sid is not None else dummy, weight,
                bias if bias is not None else dummy, dy, dx, dinit if dinit is not None else dummy, dw_part,
                db_part if db_part is not None else dummy, T, C, n_qt, *x.stride(),
                *(init.stride() if init is not None else (0, 0, 0)), sid.stride(0) if sid is not None else 0,
                *dy.stride(), *dx.stride(), *(dinit.stride() if dinit is not None else (0, 0, 0)),
                BT=opts.bwd_block_t, BC=opts.bwd_block_c, STAGES=opts.bwd_stages, PF=opts.bwd_prefetch,
                num_warps=opts.bwd_warps,
                **flags)
        else:
            dx.zero_()
            dw_part.zero_()
            if db_part is not None:
                db_part.zero_()
            if dinit is not None:
                dinit.zero_()
        dw = dw_part.sum(0).t().to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = db_part.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        if ctx.init_meta is not None:
            shape, dtype = ctx.init_meta
            dinit = dinit.to(dtype) if dinit is not None else torch.zeros(shape, dtype=dtype, device=x.device)
        return dx, dw, db, dinit if ctx.needs_input_grad[3] else None, None, None, None


def _sequence_ids(seq_idx, cu_seqlens, B, T, device):
    if seq_idx is not None:
        return seq_idx.to(torch.int32).contiguous()
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return torch.searchsorted(cu[1:], torch.arange(T, device=device), right=True).to(torch.int32)[None]


def causal_conv1d_fn_triton(x, weight, bias=None, activation=None, seq_idx=None, cu_seqlens=None,
                            initial_states=None, return_final_states=False, final_states_out=None, *,
                            options: ConvOptions | None = None):
    """Same contract as ``reference.causal_conv1d_fn_torch`` (see there), computed by Triton kernels
    (kernel widths W <= 4). ``options``: the kernels' tunables (default: ``options.current_options()``), read once,
    here; the backward runs with them."""
    check_dtypes(x=x, weight=weight)
    options = resolve(options)
    B, C, T = x.shape
    W = weight.shape[1]
    _check_width(W)
    sid = None
    if (seq_idx is not None or cu_seqlens is not None) and T > 0:
        sid = _sequence_ids(seq_idx, cu_seqlens, B, T, x.device).expand(B, T)
        if sid.stride(0) == 0 and B > 1:
            sid = sid.contiguous()
    out = _CausalConv1d.apply(x, weight, bias, initial_states, sid, activation in ("silu", "swish"), options)
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
