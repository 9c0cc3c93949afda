"""Triton causal depthwise conv1d: the kernels of the forward and of the backward.

The indexing, the formulas and the way both passes walk the time axis are described in ``kernel.py`` (the op's
Triton entry, which launches these kernels); the decoding step is in ``kernel_update.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _advance(row, t, T, st, cm, n1, n2, n3, n4, PF: tl.constexpr):
    """Row t of a stream and the rows loaded ahead after this step. With PF > 0 row t is the first of the PF rows
    loaded ahead (n1) and row t + PF is loaded behind the others; with PF = 0 row t is loaded now."""
    if PF == 0:
        cur = _raw_row(row, t, T, st, cm)
    else:
        cur = n1
        if PF == 1:
            n1 = _raw_row(row, t + 1, T, st, cm)
        elif PF == 2:
            n1 = n2
            n2 = _raw_row(row, t + 2, T, st, cm)
        elif PF == 3:
            n1 = n2
            n2 = n3
            n3 = _raw_row(row, t + 3, T, st, cm)
        else:
            n1 = n2
            n2 = n3
            n3 = n4
            n4 = _raw_row(row, t + 4, T, st, cm)
    return cur, n1, n2, n3, n4


@triton.jit
def _bias(BIAS, c64, cm, HAS_BIAS: tl.constexpr, BC: tl.constexpr):
    if HAS_BIAS:
        return tl.load(BIAS + c64, mask=cm, other=0.0).to(tl.float32)
    else:
        return tl.zeros((BC,), dtype=tl.float32)


@triton.jit
def _in_sequence(h1, h2, h3, s0, s1, s2, s3):
    """The inputs of lags 1..3, 0 where they belong to another sequence than the newest input (id s0)."""
    return tl.where(s1 == s0, h1, 0.0), tl.where(s2 == s0, h2, 0.0), tl.where(s3 == s0, h3, 0.0)


@triton.jit
def _window(w0, w1, w2, w3, a0, m1, m2, m3, bias, W: tl.constexpr, HAS_BIAS: tl.constexpr, W_DT: tl.constexpr,
            BC: tl.constexpr):
    """One token's convolution before the activation, rounded to the weight dtype: the taps oldest first, then
    the bias (m_k: the input of lag k, a0 the newest)."""
    acc = tl.zeros((BC,), dtype=tl.float32)
    if W > 3:
        acc += w3 * m3
    if W > 2:
        acc += w2 * m2
    if W > 1:
        acc += w1 * m1
    acc += w0 * a0
    if HAS_BIAS:
        acc += bias
    return acc.to(W_DT).to(tl.float32)


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
def _taps(WGT, c64, cm, W: tl.constexpr):
    """The weights of lags 0..3 (0 past W-1)."""
    return _tap(WGT, c64, cm, 0, W), _tap(WGT, c64, cm, 1, W), _tap(WGT, c64, cm, 2, W), _tap(WGT, c64, cm, 3, W)


@triton.jit
def _history(X, INIT, b, c64, cm, q, T, sxb, sxc, sxt, sib, sic, sis, W: tl.constexpr, HAS_INIT: tl.constexpr,
             X_DT: tl.constexpr, W_DT: tl.constexpr, BC: tl.constexpr):
    """xe at the extended positions q-1, q-2, q-3 (the inputs of lags 1..3 when q is the newest; 0 past W-1)."""
    h1 = tl.zeros((BC,), dtype=tl.float32)
    h2 = tl.zeros((BC,), dtype=tl.float32)
    h3 = tl.zeros((BC,), dtype=tl.float32)
    if W > 1:
        h1 = _xe_row(X, INIT, b, c64, cm, q - 1, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if W > 2:
        h2 = _xe_row(X, INIT, b, c64, cm, q - 2, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    if W > 3:
        h3 = _xe_row(X, INIT, b, c64, cm, q - 3, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT)
    return h1, h2, h3


@triton.jit
def _seq_history(SID, b, q, T, ssb, W: tl.constexpr):
    """Sequence ids of the extended positions q-1, q-2, q-3."""
    return _seq_row(SID, b, q - 1, T, ssb, W), _seq_row(SID, b, q - 2, T, ssb, W), _seq_row(SID, b, q - 3, T, ssb, W)


@triton.jit
def conv_fwd_kernel(X, INIT, SID, WGT, BIAS, Y, T, C, sxb, sxc, sxt, sib, sic, sis, ssb, syb, syc, syt,
                    W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SID: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ACT: tl.constexpr, X_DT: tl.constexpr, W_DT: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr, PF: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(0) * BT
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    c64 = c.to(tl.int64)
    w0, w1, w2, w3 = _taps(WGT, c64, cm, W)
    bias = _bias(BIAS, c64, cm, HAS_BIAS, BC)
    # the W-1 inputs before token t0's newest one (extended positions t0 + W-1 - k, lag k = 1..3)
    h1, h2, h3 = _history(X, INIT, b, c64, cm, t0 + W - 1, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT,
                          W_DT, BC)
    if HAS_SID:
        s1, s2, s3 = _seq_history(SID, b, t0 + W - 1, T, ssb, W)
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
        raw, n1, n2, n3, n4 = _advance(xrow, t, T, sxt, cm, n1, n2, n3, n4, PF)
        a0 = raw.to(W_DT).to(tl.float32)
        m1 = h1
        m2 = h2
        m3 = h3
        if HAS_SID:
            s0 = _seq_row(SID, b, t + W - 1, T, ssb, W)
            m1, m2, m3 = _in_sequence(h1, h2, h3, s0, s1, s2, s3)
            s3 = s2
            s2 = s1
            s1 = s0
        pre = _window(w0, w1, w2, w3, a0, m1, m2, m3, bias, W, HAS_BIAS, W_DT, BC)
        if ACT:
            pre = (pre / (1.0 + tl.exp(-pre))).to(W_DT).to(tl.float32)
        tl.store(yrow + tl.minimum(t, T - 1).to(tl.int64) * syt, pre.to(Y.dtype.element_ty), mask=_both(cm, ok))
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
def conv_bwd_kernel(X, INIT, SID, WGT, BIAS, DY, DX, DINIT, DW_PART, DB_PART, T, C, n_qt,
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
    w0, w1, w2, w3 = _taps(WGT, c64, cm, W)
    bias = _bias(BIAS, c64, cm, HAS_BIAS, BC)
    # inputs of lag 1..3 before the first step's newest position (q0): extended positions q0 - k
    h1, h2, h3 = _history(X, INIT, b, c64, cm, q0, T, sxb, sxc, sxt, sib, sic, sis, W, HAS_INIT, X_DT, W_DT, BC)
    if HAS_SID:
        s1, s2, s3 = _seq_history(SID, b, q0, T, ssb, W)
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
        rx, nx1, nx2, nx3, nx4 = _advance(xrow, t, T, sxt, cm, nx1, nx2, nx3, nx4, PF)
        ry, ny1, ny2, ny3, ny4 = _advance(dyrow, t, T, sdyt, cm, ny1, ny2, ny3, ny4, PF)
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
            m1, m2, m3 = _in_sequence(h1, h2, h3, s0, s1, s2, s3)
        pre = _window(w0, w1, w2, w3, a0, m1, m2, m3, bias, W, HAS_BIAS, W_DT, BC)  # as in the forward
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
