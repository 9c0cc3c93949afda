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

The decoding step (``causal_conv1d_update_triton``) is in ``kernel_update.py``.

Tunables live in ``ConvOptions`` (``configured`` swaps them for a benchmark's sweep); the interpreter uses
``INTERPRET_OPTIONS`` (tiny blocks, so tests cross block edges) unless a ``configured`` block says otherwise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops._amp import no_autocast_backward
from deltafuse.ops.conv1d.candidates import TRITON_MAX_W

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# --- options ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvOptions:
    """Tunables of the conv kernels on a GPU.

    ``*_block_c``: channels per program (a power of two); ``*_block_t``: tokens per program (any int >= 1;
    the backward adds W-1 warm-up steps); ``*_warps``: warps per program (a power of two); ``*_stages``:
    Triton's software-pipelining depth of the token loop (1: none); ``*_prefetch``: rows loaded ahead by the
    kernel itself, 0 to 4 (each step then waits only for a load issued that many steps earlier: the loads in
    flight that keep memory busy). ``update_*``: the decoding kernel.
    """

    fwd_block_c: int = 256
    fwd_block_t: int = 64
    fwd_warps: int = 1
    fwd_stages: int = 1
    fwd_prefetch: int = 4
    bwd_block_c: int = 128
    bwd_block_t: int = 64
    bwd_warps: int = 1
    bwd_stages: int = 1
    bwd_prefetch: int = 4
    update_block_c: int = 256
    update_warps: int = 2

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name.endswith("_prefetch") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ConvOptions.{f.name}={value!r}; allowed: an int >= {low}")
            if f.name.endswith("_prefetch") and value > 4:
                raise ValueError(f"ConvOptions.{f.name}={value!r}; allowed: 0 to 4")
            if f.name.endswith(("_block_c", "_warps")) and value & (value - 1):
                raise ValueError(f"ConvOptions.{f.name}={value!r}; allowed: a power of two")


DEFAULT_OPTIONS = ConvOptions()
# Under the interpreter: blocks of 8 channels and 4 tokens, so that tiny test shapes cross block edges.
INTERPRET_OPTIONS = ConvOptions(fwd_block_c=8, fwd_block_t=4, fwd_warps=1, fwd_stages=1, bwd_block_c=8,
                                bwd_block_t=4, bwd_warps=1, bwd_stages=1, update_block_c=8, update_warps=1,
                                fwd_prefetch=2, bwd_prefetch=3)
_in_effect: list = [None]  # options set by ``configured``, else None (the defaults for the device)


@contextlib.contextmanager
def configured(options: ConvOptions | None = None):
    """Run the conv kernels with ``options`` inside the block (also under the interpreter); what was in effect
    before is restored on exit. A forward records the options it ran with for its backward."""
    if options is not None and not isinstance(options, ConvOptions):
        raise TypeError(f"options must be a ConvOptions or None, got {type(options).__name__}")
    saved = _in_effect[0]
    _in_effect[0] = options
    try:
        yield
    finally:
        _in_effect[0] = saved


def current_options() -> ConvOptions:
    if _in_effect[0] is not None:
        return _in_effect[0]
    return INTERPRET_OPTIONS if triton_interpreting() else DEFAULT_OPTIONS


# --- kernels ------------------------------------------------------------------------------------------------
@triton.jit
def _both(cm, ok):
    """The channel mask where the scalar condition ``ok`` holds (a select: the interpreter's ``&`` of a scalar
    and a vector yields integers)."""
    return tl.where(ok, cm, False)


@triton.jit
def _xe_row(X, INIT, b, c64, cm, q, T, sxb, sxc, sxt, sib, sic, sis,
            W: tl.constexpr, HAS_INIT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr):
    """xe[b, c, q] for a scalar extended position q, as fp32 after the reference's casts; 0 outside [0, W-1+T)."""
    p = q - (W - 1)
    v = tl.load(X + b * sxb + c64 * sxc + tl.maximum(p, 0).to(tl.int64) * sxt, mask=_both(cm, (p >= 0) & (p < T)),
                other=0.0).to(W_DT).to(tl.float32)
    if HAS_INIT:
        h = tl.load(INIT + b * sib + c64 * sic + tl.minimum(tl.maximum(q, 0), W - 2).to(tl.int64) * sis,
                    mask=_both(cm, (q >= 0) & (q < W - 1)), other=0.0)
        v += h.to(X_DT).to(W_DT).to(tl.float32)
    return v


@triton.jit
def _raw_row(row, t, T, st, cm):
    """Row t of a [T, BC] stream (x or dy) as stored; 0 outside [0, T)."""
    return tl.load(row + tl.minimum(tl.maximum(t, 0), T - 1).to(tl.int64) * st, mask=_both(cm, (t >= 0) & (t < T)),
                   other=0.0)


@triton.jit
def _prefetch(row, t, T, st, cm, k: tl.constexpr, PF: tl.constexpr):
    """Row t + k - 1 when it is one of the PF rows loaded ahead (k <= PF), else nothing (an unused 0)."""
    if k <= PF:
        return _raw_row(row, t + k - 1, T, st, cm)
    else:
        return 0.0


@triton.jit
def _seq_row(SID, b, q, T, ssb, W: tl.constexpr):
    """Sequence id of extended position q (history positions take the row's first token's id)."""
    return tl.load(SID + b * ssb + tl.minimum(tl.maximum(q - (W - 1), 0), T - 1))


@triton.jit
def _tap(WGT, c64, cm, k: tl.constexpr, W: tl.constexpr):
    """Weight of lag k (the input k positions before the newest one): w[W-1-k], 0 for k >= W."""
    if k < W:
        return tl.load(WGT + c64 * W + (W - 1 - k), mask=cm, other=0.0).to(tl.float32)
    else:
        return tl.zeros(c64.shape, dtype=tl.float32)


@triton.jit
def _conv_fwd_kernel(X, INIT, SID, WGT, BIAS, Y, T, C, sxb, sxc, sxt, sib, sic, sis, ssb, syb, syc, syt,
                     W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SID: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr, PF: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(0) * BT
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    c64 = c.to(tl.int64)
    w0 = _tap(WGT, c64, cm, 0, W)
    w1 = _tap(WGT, c64, cm, 1, W)
    w2 = _tap(WGT, c64, cm, 2, W)
    w3 = _tap(WGT, c64, cm, 3, W)
    if HAS_BIAS:
        bias = tl.load(BIAS + c64, mask=cm, other=0.0).to(tl.float32)
    # the W-1 inputs before token t0's newest one (extended positions t0 + W-1 - k, lag k = 1..3)
    h1 = tl.zeros((BC,), dtype=tl.float32)
    h2 = tl.zeros((BC,), dtype=tl.float32)
    h3 = tl.zeros((BC,), dtype=tl.float32)
    if W > 1:
        h1 = _xe_row(X, INIT, b, c64, cm, t0 + W - 2, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if W > 2:
        h2 = _xe_row(X, INIT, b, c64, cm, t0 + W - 3, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if W > 3:
        h3 = _xe_row(X, INIT, b, c64, cm, t0 + W - 4, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if HAS_SID:
        s1 = _seq_row(SID, b, t0 + W - 2, T, ssb, W)
        s2 = _seq_row(SID, b, t0 + W - 3, T, ssb, W)
        s3 = _seq_row(SID, b, t0 + W - 4, T, ssb, W)
    xrow = X + b * sxb + c64 * sxc
    yrow = Y + b * syb + c64 * syc
    # rows t0 .. t0+PF-1 loaded ahead; each step loads the row PF ahead, so PF loads are in flight
    n1 = _prefetch(xrow, t0, T, sxt, cm, 1, PF)
    n2 = _prefetch(xrow, t0, T, sxt, cm, 2, PF)
    n3 = _prefetch(xrow, t0, T, sxt, cm, 3, PF)
    n4 = _prefetch(xrow, t0, T, sxt, cm, 4, PF)
    for i in tl.range(0, BT, num_stages=STAGES):
        t = t0 + i
        ok = t < T
        t64 = tl.minimum(t, T - 1).to(tl.int64)
        if PF == 0:
            raw = _raw_row(xrow, t, T, sxt, cm)
        else:
            raw = n1
            if PF == 1:
                n1 = _raw_row(xrow, t + 1, T, sxt, cm)
            elif PF == 2:
                n1 = n2
                n2 = _raw_row(xrow, t + 2, T, sxt, cm)
            elif PF == 3:
                n1 = n2
                n2 = n3
                n3 = _raw_row(xrow, t + 3, T, sxt, cm)
            else:
                n1 = n2
                n2 = n3
                n3 = n4
                n4 = _raw_row(xrow, t + 4, T, sxt, cm)
        a0 = raw.to(W_DT).to(tl.float32)
        acc = tl.zeros((BC,), dtype=tl.float32)
        if HAS_SID:
            s0 = tl.load(SID + b * ssb + t64)
            if W > 3:
                acc += w3 * tl.where(s3 == s0, h3, 0.0)
            if W > 2:
                acc += w2 * tl.where(s2 == s0, h2, 0.0)
            if W > 1:
                acc += w1 * tl.where(s1 == s0, h1, 0.0)
            s3 = s2
            s2 = s1
            s1 = s0
        else:
            if W > 3:
                acc += w3 * h3
            if W > 2:
                acc += w2 * h2
            if W > 1:
                acc += w1 * h1
        acc += w0 * a0
        if HAS_BIAS:
            acc += bias
        pre = acc.to(W_DT).to(tl.float32)
        if ACT:
            pre = (pre / (1.0 + tl.exp(-pre))).to(W_DT).to(tl.float32)
        tl.store(yrow + t64 * syt, pre.to(Y.dtype.element_ty), mask=_both(cm, ok))
        h3 = h2
        h2 = h1
        h1 = a0


@triton.jit
def _lagged(W: tl.constexpr, e0, e1, e2, e3):
    """The accumulator of lag W-1 (the oldest position of the window)."""
    if W == 1:
        return e0
    elif W == 2:
        return e1
    elif W == 3:
        return e2
    else:
        return e3


@triton.jit
def _conv_bwd_kernel(X, INIT, SID, WGT, BIAS, DY, DX, DINIT, DW_PART, DB_PART, T, C, n_qt,
                     sxb, sxc, sxt, sib, sic, sis, ssb, sdyb, sdyc, sdyt, sdxb, sdxc, sdxt, sdib, sdic, sdis,
                     W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SID: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr, PF: tl.constexpr):
    """Owns extended positions (dx, d initial_states) and tokens (dw, dbias) q0 <= q < q0 + BT. Steps tokens
    t = q0-(W-1) .. q0+BT-1: the first W-1 only send their input gradient into the owned positions."""
    b = tl.program_id(2).to(tl.int64)
    q0 = tl.program_id(0) * BT
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    c64 = c.to(tl.int64)
    w0 = _tap(WGT, c64, cm, 0, W)
    w1 = _tap(WGT, c64, cm, 1, W)
    w2 = _tap(WGT, c64, cm, 2, W)
    w3 = _tap(WGT, c64, cm, 3, W)
    if HAS_BIAS:
        bias = tl.load(BIAS + c64, mask=cm, other=0.0).to(tl.float32)
    # inputs of lag 1..3 before the first step's newest position (q0): extended positions q0 - k
    h1 = tl.zeros((BC,), dtype=tl.float32)
    h2 = tl.zeros((BC,), dtype=tl.float32)
    h3 = tl.zeros((BC,), dtype=tl.float32)
    if W > 1:
        h1 = _xe_row(X, INIT, b, c64, cm, q0 - 1, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if W > 2:
        h2 = _xe_row(X, INIT, b, c64, cm, q0 - 2, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if W > 3:
        h3 = _xe_row(X, INIT, b, c64, cm, q0 - 3, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if HAS_SID:
        s1 = _seq_row(SID, b, q0 - 1, T, ssb, W)
        s2 = _seq_row(SID, b, q0 - 2, T, ssb, W)
        s3 = _seq_row(SID, b, q0 - 3, T, ssb, W)
    # input-gradient accumulators of the window's positions, by lag from the newest (e0) to the oldest
    e0 = tl.zeros((BC,), dtype=tl.float32)
    e1 = tl.zeros((BC,), dtype=tl.float32)
    e2 = tl.zeros((BC,), dtype=tl.float32)
    e3 = tl.zeros((BC,), dtype=tl.float32)
    dw0 = tl.zeros((BC,), dtype=tl.float32)
    dw1 = tl.zeros((BC,), dtype=tl.float32)
    dw2 = tl.zeros((BC,), dtype=tl.float32)
    dw3 = tl.zeros((BC,), dtype=tl.float32)
    db = tl.zeros((BC,), dtype=tl.float32)
    xrow = X + b * sxb + c64 * sxc
    dyrow = DY + b * sdyb + c64 * sdyc
    dxrow = DX + b * sdxb + c64 * sdxc
    # the step of token t reads x row t (its newest input) and dy row t: both streams are loaded PF rows ahead
    ts = q0 - (W - 1)
    nx1 = _prefetch(xrow, ts, T, sxt, cm, 1, PF)
    nx2 = _prefetch(xrow, ts, T, sxt, cm, 2, PF)
    nx3 = _prefetch(xrow, ts, T, sxt, cm, 3, PF)
    nx4 = _prefetch(xrow, ts, T, sxt, cm, 4, PF)
    ny1 = _prefetch(dyrow, ts, T, sdyt, cm, 1, PF)
    ny2 = _prefetch(dyrow, ts, T, sdyt, cm, 2, PF)
    ny3 = _prefetch(dyrow, ts, T, sdyt, cm, 3, PF)
    ny4 = _prefetch(dyrow, ts, T, sdyt, cm, 4, PF)
    for i in tl.range(0, BT + W - 1, num_stages=STAGES):
        t = ts + i  # the token of this step; its newest input is at extended position t + W-1 (x row t)
        if PF == 0:
            rx = _raw_row(xrow, t, T, sxt, cm)
            ry = _raw_row(dyrow, t, T, sdyt, cm)
        else:
            rx = nx1
            ry = ny1
            if PF == 1:
                nx1 = _raw_row(xrow, t + 1, T, sxt, cm)
                ny1 = _raw_row(dyrow, t + 1, T, sdyt, cm)
            elif PF == 2:
                nx1 = nx2
                ny1 = ny2
                nx2 = _raw_row(xrow, t + 2, T, sxt, cm)
                ny2 = _raw_row(dyrow, t + 2, T, sdyt, cm)
            elif PF == 3:
                nx1 = nx2
                ny1 = ny2
                nx2 = nx3
                ny2 = ny3
                nx3 = _raw_row(xrow, t + 3, T, sxt, cm)
                ny3 = _raw_row(dyrow, t + 3, T, sdyt, cm)
            else:
                nx1 = nx2
                ny1 = ny2
                nx2 = nx3
                ny2 = ny3
                nx3 = nx4
                ny3 = ny4
                nx4 = _raw_row(xrow, t + 4, T, sxt, cm)
                ny4 = _raw_row(dyrow, t + 4, T, sdyt, cm)
        a0 = rx.to(W_DT).to(tl.float32)
        if HAS_INIT:  # the first W-1 steps of the row's first block read initial_states instead
            q = t + W - 1
            h = tl.load(INIT + b * sib + c64 * sic + tl.minimum(tl.maximum(q, 0), W - 2).to(tl.int64) * sis,
                        mask=_both(cm, (q >= 0) & (q < W - 1)), other=0.0)
            a0 += h.to(X_DT).to(W_DT).to(tl.float32)
        dy = ry.to(tl.float32)
        m1 = h1
        m2 = h2
        m3 = h3
        if HAS_SID:
            s0 = _seq_row(SID, b, t + W - 1, T, ssb, W)
            m1 = tl.where(s1 == s0, h1, 0.0)
            m2 = tl.where(s2 == s0, h2, 0.0)
            m3 = tl.where(s3 == s0, h3, 0.0)
        acc = tl.zeros((BC,), dtype=tl.float32)  # the taps oldest first, as in the forward
        if W > 3:
            acc += w3 * m3
        if W > 2:
            acc += w2 * m2
        if W > 1:
            acc += w1 * m1
        acc += w0 * a0
        if HAS_BIAS:
            acc += bias
        pre = acc.to(W_DT).to(tl.float32)
        if ACT:
            sig = 1.0 / (1.0 + tl.exp(-pre))
            dpre = dy * (sig * (1.0 + pre * (1.0 - sig)))
        else:
            dpre = dy
        # weight / bias gradients: owned tokens only (the warm-up steps belong to the previous block)
        dpo = tl.where(t >= q0, dpre, 0.0)
        dw0 += dpo * a0
        dw1 += dpo * m1
        dw2 += dpo * m2
        dw3 += dpo * m3
        db += dpo
        # input gradients of the window's positions (lag k gets w[W-1-k] where it shares token t's sequence)
        e0 += w0 * dpre
        if HAS_SID:
            e1 += w1 * tl.where(s1 == s0, dpre, 0.0)
            e2 += w2 * tl.where(s2 == s0, dpre, 0.0)
            e3 += w3 * tl.where(s3 == s0, dpre, 0.0)
            s3 = s2
            s2 = s1
            s1 = s0
        else:
            e1 += w1 * dpre
            e2 += w2 * dpre
            e3 += w3 * dpre
        # position t (lag W-1) has all its contributions now: store it when owned
        done = _lagged(W, e0, e1, e2, e3)
        own = (t >= q0) & (t < T + W - 1)
        tl.store(dxrow + tl.maximum(t - (W - 1), 0).to(tl.int64) * sdxt, done.to(DX.dtype.element_ty),
                 mask=_both(cm, own & (t >= W - 1)))
        if HAS_INIT:
            tl.store(DINIT + b * sdib + c64 * sdic + tl.minimum(tl.maximum(t, 0), W - 2).to(tl.int64) * sdis,
                     done.to(DINIT.dtype.element_ty), mask=_both(cm, own & (t < W - 1)))
        e3 = e2
        e2 = e1
        e1 = e0
        e0 = tl.zeros((BC,), dtype=tl.float32)
        h3 = h2
        h2 = h1
        h1 = a0
    part = b * n_qt + tl.program_id(0)
    dwp = DW_PART + part * W * C + c64
    tl.store(dwp + (W - 1) * C, dw0, mask=cm)
    if W > 1:
        tl.store(dwp + (W - 2) * C, dw1, mask=cm)
    if W > 2:
        tl.store(dwp + (W - 3) * C, dw2, mask=cm)
    if W > 3:
        tl.store(dwp + (W - 4) * C, dw3, mask=cm)
    if HAS_BIAS:
        tl.store(DB_PART + part * C + c64, db, mask=cm)


# --- host side ----------------------------------------------------------------------------------------------
def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, C, T] with channels contiguous (stride 1 along C): as is when it already is, else a copy."""
    if t.shape[1] <= 1 or t.stride(1) == 1:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _check_dtypes(**tensors):
    for name, t in tensors.items():
        if t is not None and t.dtype not in _TL:
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
                     ACT=activation, X_DT=_TL[x.dtype], W_DT=_TL[weight.dtype])
        if y.numel():
            _conv_fwd_kernel[(triton.cdiv(T, opts.fwd_block_t), triton.cdiv(C, opts.fwd_block_c), B)](
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
            _conv_bwd_kernel[(n_qt, triton.cdiv(C, opts.bwd_block_c), B)](
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
                            initial_states=None, return_final_states=False, final_states_out=None):
    """Same contract as ``reference.causal_conv1d_fn_torch`` (see there), computed by Triton kernels
    (kernel widths W <= 4)."""
    _check_dtypes(x=x, weight=weight)
    B, C, T = x.shape
    W = weight.shape[1]
    _check_width(W)
    sid = None
    if (seq_idx is not None or cu_seqlens is not None) and T > 0:
        sid = _sequence_ids(seq_idx, cu_seqlens, B, T, x.device).expand(B, T)
        if sid.stride(0) == 0 and B > 1:
            sid = sid.contiguous()
    out = _CausalConv1d.apply(x, weight, bias, initial_states, sid, activation in ("silu", "swish"),
                              current_options())
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
