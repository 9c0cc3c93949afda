"""Chunked gated delta rule in portable Triton: forward, backward and autograd wrapper.

Per value head the recurrence is (state S of shape [K, V], decay ``g`` in log space)

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

It is evaluated over chunks of ``BT = 64`` tokens (the WY / UT-transform form). Inside a chunk, with
``gc`` the chunk-local cumulative sum of ``g`` and ``D_ij = exp(gc_i - gc_j)``:

    A  = strictly_lower(beta_i (k_i . k_j) D_ij)          T = (I + A)^-1
    w  = T (beta k exp(gc))                               u = T (beta v)
    v' = u - w h                                          (h: state at the chunk start)
    o  = scale ((q exp(gc)) h + lower_incl(q k^T o D) v')
    h_next = exp(gc_last) h + (k exp(gc_last - gc))^T v'

Kernels (grid axes in brackets):

* ``_l2norm_rstd`` [token block, q/k head]: the l2norm factors rsqrt(|x|^2 + eps) of q and k rows. The
  other kernels read q and k as given and apply these factors to their products, so normalised rows are
  never rounded to 16 bits or stored.
* ``_intra_fwd``   [chunk, value head]: gc, A, T, w, u (and T itself for the backward).
* ``_state_fwd``   [V block x sequence x value head, one axis]: the sequential pass over chunks with the state in
  fp32 registers; in the forward it also writes o, in the backward it stores the chunk-start states
  (``hs``) and v'.
* ``_dv_local``    [chunk, value head]: the intra-chunk part of dv', scale lower_incl(q k^T o D)^T do.
* ``_state_bwd``   [V block x sequence x value head, one axis]: the reverse pass; stores the gradient of the
  state at every chunk end (``dhs``), the full gradient of v' (``dvn``) and the initial-state gradient.
* ``_bwd_wy``      [chunk, value head]: back through w, u and T (dv, dbeta, WY parts of dk and dg).
* ``_bwd_out``     [chunk, q/k head]: the output and state parts of dq, dk, dg; sums the value heads
  that share the q/k head (no repeated q/k is ever materialised), then goes back through the l2norm.

Products of a 16-bit operand (inputs, stored intermediates) with an fp32 one split the fp32 operand into
two 16-bit parts, so 16-bit tensor cores give close to fp32 accuracy without fp32 copies of the large
tiles.

The backward recomputes w, u, the chunk states and v' from the inputs instead of keeping them from the
forward pass, so only the inputs are saved between forward and backward.

All sequences, batched or packed (``cu_seqlens``), go through one flattened token axis: a batch of B
sequences of length T is the packed batch with boundaries 0, T, 2T, ...; a chunk never crosses a
sequence boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.backends.probes import triton_interpreting
from deltafuse.ops._checks import host_offsets

BT = 64  # chunk length; the in-chunk inverse below is written for 4 blocks of 16

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreting() -> bool:
    return triton_interpreting()


# --------------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _unit_lower_inverse(A, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular fp32 [64, 64] tile A.

    The four diagonal 16x16 blocks are inverted by forward substitution (all four at once, as a
    [4, 16, 16] batch). With D the block-diagonal part of I + A and L the rest, I + A = D (I + N) with
    N = D^-1 L strictly block-lower, so N^4 = 0 and (I + A)^-1 = (I - N)(I + N^2) D^-1.
    """
    r64 = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    r4 = tl.arange(0, 4)
    same_blk = r4[:, None, None, None] == r4[None, None, :, None]  # [4, 1, 4, 1]
    A4 = tl.reshape(A, [4, 16, 4, 16])
    A3 = tl.sum(tl.where(same_blk, A4, 0.0), axis=2)  # [4, 16, 16]: diagonal blocks
    Ti = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in tl.static_range(16):
        a_row = tl.sum(tl.where(r16[None, :, None] == i, A3, 0.0), axis=1)  # [4, 16] = A3[:, i, :]
        new = tl.where(r16[None, :] == i, 1.0, 0.0) - tl.sum(a_row[:, :, None] * Ti, axis=1)
        Ti = tl.where(r16[None, :, None] == i, new[:, None, :], Ti)
    Dinv = tl.reshape(tl.where(same_blk, Ti[:, :, None, :], 0.0), [64, 64])
    blk = r64 // 16
    L = tl.where(blk[:, None] > blk[None, :], A, 0.0)
    eye = tl.where(r64[:, None] == r64[None, :], 1.0, 0.0)
    N = tl.dot(Dinv, L, input_precision=PREC)
    N2 = tl.dot(N, N, input_precision=PREC)
    P = eye - N + N2 - tl.dot(N, N2, input_precision=PREC)
    return tl.dot(P, Dinv, input_precision=PREC)


@triton.jit
def _chunk_decay(gc, valid, STRICT: tl.constexpr):
    """exp(gc_i - gc_j) on the lower triangle (strict or inclusive) of valid rows/cols, else 0."""
    r = tl.arange(0, 64)
    if STRICT:
        m = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
    else:
        m = (r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :]
    d = tl.where(m, gc[:, None] - gc[None, :], 0.0)
    return tl.where(m, tl.exp(d), 0.0)


@triton.jit
def _dot_x(a, b, X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """a @ b for ``a`` exact in DT (loaded inputs or stored values) and fp32 ``b``.

    X2: ``b`` is split into two DT parts (hi + lo) and both go through 16-bit tensor-core products, which
    keeps about 16 mantissa bits of ``b``; otherwise one fp32 product at precision PREC.
    """
    if X2 and a.dtype != tl.float32:
        bh = b.to(DT)
        bl = (b - bh.to(tl.float32)).to(DT)
        return tl.dot(a, bl, acc=tl.dot(a, bh))
    else:
        return tl.dot(a.to(tl.float32), b, input_precision=PREC)


@triton.jit
def _dot_xa(a, b, X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """a @ b for fp32 ``a`` and ``b`` exact in DT (the mirror of _dot_x)."""
    if X2 and b.dtype != tl.float32:
        ah = a.to(DT)
        al = (a - ah.to(tl.float32)).to(DT)
        return tl.dot(al, b, acc=tl.dot(ah, b))
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


@triton.jit
def _rows(r_ptr, tok, H: tl.constexpr, h, valid, L2: tl.constexpr):
    """Per-row l2norm factors rsqrt(|x|^2 + eps) of q or k (ones when the l2norm is off)."""
    if L2:
        return tl.load(r_ptr + tok * H + h, mask=valid, other=0.0)
    else:
        return tl.where(valid, 1.0, 0.0)


# --------------------------------------------------------------------------------------------------
# forward kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _l2norm_rstd(q_ptr, k_ptr, rq_ptr, rk_ptr, TT, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """rsqrt(|x|^2 + eps) per row of q and of k. Kernels scale products by these factors instead of
    reading normalised copies, so the normalised rows are never rounded to 16 bits."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    tok = pid_t.to(tl.int64) * 64 + tl.arange(0, 64)
    valid = tok < TT
    ck = tl.arange(0, BK)
    m = valid[:, None] & (ck[None, :] < K)
    off = tok[:, None] * (H * K) + h * K + ck[None, :]
    x = tl.load(q_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(rq_ptr + tok * H + h, 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6), mask=valid)
    x = tl.load(k_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(rk_ptr + tok * H + h, 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6), mask=valid)


@triton.jit
def _intra_fwd(k_ptr, rk_ptr, v_ptr, g_ptr, beta_ptr, gc_ptr, w_ptr, u_ptr, tinv_ptr, chunks_ptr,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, STORE_T: tl.constexpr,
               X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    pid_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    start = tl.load(chunks_ptr + pid_c * 3 + 1).to(tl.int64)
    end = tl.load(chunks_ptr + pid_c * 3 + 2).to(tl.int64)
    rows = tl.arange(0, 64)
    tok = start + rows
    valid = tok < end
    ck = tl.arange(0, BK)
    g = tl.load(g_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)
    tl.store(gc_ptr + tok * HV + hv, gc, mask=valid)
    b = tl.load(beta_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + h * K + ck[None, :],
                mask=valid[:, None] & (ck[None, :] < K), other=0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=PREC) * rk[:, None] * rk[None, :]
    Tm = _unit_lower_inverse(kk * _chunk_decay(gc, valid, True) * b[:, None], PREC)
    if STORE_T:
        tl.store(tinv_ptr + tok[:, None] * (HV * 64) + hv * 64 + rows[None, :], Tm, mask=valid[:, None])
    eg = tl.where(valid, tl.exp(gc), 0.0)
    # w = T diag(beta exp(gc) rk) k;  u = T diag(beta) v
    w = _dot_xa(Tm * (b * eg * rk)[None, :], k, X2, PREC, DT)
    tl.store(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], w.to(w_ptr.dtype.element_ty),
             mask=valid[:, None] & (ck[None, :] < K))
    Tb = Tm * b[None, :]
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        v = tl.load(v_ptr + tok[:, None] * (HV * V) + hv * V + cv[None, :], mask=mv, other=0.0)
        u = _dot_xa(Tb, v, X2, PREC, DT)
        tl.store(u_ptr + tok[:, None] * (HV * V) + hv * V + cv[None, :], u.to(u_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _state_fwd(q_ptr, k_ptr, rq_ptr, rk_ptr, w_ptr, u_ptr, gc_ptr, h0_ptr, hs_ptr, vn_ptr, o_ptr, ht_ptr,
               cu_ptr, coff_ptr, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
               HAS_H0: tl.constexpr, STORE_HS: tl.constexpr, WRITE_O: tl.constexpr, STORE_HT: tl.constexpr,
               X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """The sequential pass over chunks. WRITE_O: also the output of each chunk, from the fp32 state in
    registers (forward). STORE_HS: store the state at each chunk start and v' (backward recompute)."""
    # one grid axis, V blocks fastest (the order of the former [V block, sequence x head] grid): a second
    # axis is limited to 65,535 programs, fewer than sequences x heads of a row of many short sequences
    pid = tl.program_id(0)
    pid_v = pid % ((V + BV - 1) // BV)
    pid_nh = pid // ((V + BV - 1) // BV)
    n = pid_nh // HV
    hv = pid_nh % HV
    h = hv // (HV // H)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    nt = tl.cdiv(eos - bos, 64)
    rows = tl.arange(0, 64)
    ck = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    state_off = ck[:, None] * V + cv[None, :]
    st = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        st = tl.load(h0_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, mask=mkv, other=0.0).to(tl.float32)
    for i in range(nt):
        start = bos + i * 64
        tok = start + rows
        valid = tok < eos
        if STORE_HS:
            tl.store(hs_ptr + ((coff + i) * HV + hv) * (K * V) + state_off, st.to(hs_ptr.dtype.element_ty), mask=mkv)
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        tv_off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
        w = tl.load(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        vn = u - _dot_x(w, st, X2, PREC, DT)
        if STORE_HS:
            tl.store(vn_ptr + tv_off, vn.to(vn_ptr.dtype.element_ty), mask=mv)
        k = tl.load(k_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
        rk = _rows(rk_ptr, tok, H, h, valid, L2)
        gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
        last = tl.minimum(start + 63, eos - 1)
        gl = tl.load(gc_ptr + last * HV + hv)
        if WRITE_O:
            q = tl.load(q_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
            rq = _rows(rq_ptr, tok, H, h, valid, L2)
            eg = tl.where(valid, tl.exp(gc), 0.0)
            o = _dot_x(q, st, X2, PREC, DT) * (rq * eg)[:, None]
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * _chunk_decay(gc, valid, False)
            s = s * rq[:, None] * rk[None, :]
            o += tl.dot(s, vn, input_precision=PREC)
            tl.store(o_ptr + tv_off, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
        # h_next = exp(gl) h + k^T diag(rk exp(gl - gc)) v'
        vd = vn * (rk * tl.where(valid, tl.exp(gl - gc), 0.0))[:, None]
        st = st * tl.exp(gl) + _dot_x(tl.trans(k), vd, X2, PREC, DT)
    if STORE_HT:
        tl.store(ht_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, st, mask=mkv)


# --------------------------------------------------------------------------------------------------
# backward kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dv_local(q_ptr, k_ptr, rq_ptr, rk_ptr, gc_ptr, do_ptr, dvl_ptr, chunks_ptr, scale,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
              X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    pid_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    start = tl.load(chunks_ptr + pid_c * 3 + 1).to(tl.int64)
    end = tl.load(chunks_ptr + pid_c * 3 + 2).to(tl.int64)
    rows = tl.arange(0, 64)
    tok = start + rows
    valid = tok < end
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    q = tl.load(q_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
    rq = _rows(rq_ptr, tok, H, h, valid, L2)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
    # st[j, i] = (khat_j . qhat_i) exp(gc_i - gc_j) for i >= j: the transposed intra-chunk attention
    st = tl.dot(k, tl.trans(q), input_precision=PREC) * tl.trans(_chunk_decay(gc, valid, False))
    st = st * (rk * scale)[:, None] * rq[None, :]
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
        do = tl.load(do_ptr + off, mask=mv, other=0.0)
        tl.store(dvl_ptr + off, _dot_xa(st, do, X2, PREC, DT).to(dvl_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _state_bwd(q_ptr, k_ptr, rq_ptr, rk_ptr, w_ptr, gc_ptr, do_ptr, dvl_ptr, dht_ptr, dhs_ptr, dvn_ptr, dh0_ptr,
               cu_ptr, coff_ptr, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, HAS_DHT: tl.constexpr,
               STORE_DH0: tl.constexpr, X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    # one grid axis, V blocks fastest (the order of the former [V block, sequence x head] grid): a second
    # axis is limited to 65,535 programs, fewer than sequences x heads of a row of many short sequences
    pid = tl.program_id(0)
    pid_v = pid % ((V + BV - 1) // BV)
    pid_nh = pid // ((V + BV - 1) // BV)
    n = pid_nh // HV
    hv = pid_nh % HV
    h = hv // (HV // H)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    nt = tl.cdiv(eos - bos, 64)
    rows = tl.arange(0, 64)
    ck = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    state_off = ck[:, None] * V + cv[None, :]
    dst = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dst = tl.load(dht_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, mask=mkv, other=0.0).to(tl.float32)
    for i in range(nt):
        c = nt - 1 - i
        start = bos + c * 64
        tok = start + rows
        valid = tok < eos
        tl.store(dhs_ptr + ((coff + c) * HV + hv) * (K * V) + state_off, dst.to(dhs_ptr.dtype.element_ty), mask=mkv)
        mk = valid[:, None] & (ck[None, :] < K)
        mv = valid[:, None] & (cv[None, :] < V)
        tv_off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
        k = tl.load(k_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
        rk = _rows(rk_ptr, tok, H, h, valid, L2)
        gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
        last = tl.minimum(start + 63, eos - 1)
        gl = tl.load(gc_ptr + last * HV + hv)
        dvl = tl.load(dvl_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        # dv' = dv_local + diag(rk exp(gl - gc)) k dh_next
        dvn = dvl + _dot_x(k, dst, X2, PREC, DT) * (rk * tl.where(valid, tl.exp(gl - gc), 0.0))[:, None]
        tl.store(dvn_ptr + tv_off, dvn.to(dvn_ptr.dtype.element_ty), mask=mv)
        q = tl.load(q_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
        rq = _rows(rq_ptr, tok, H, h, valid, L2)
        do = tl.load(do_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], mask=mk, other=0.0)
        dog = do * (rq * tl.where(valid, tl.exp(gc), 0.0) * scale)[:, None]
        dst = dst * tl.exp(gl) + _dot_x(tl.trans(q), dog, X2, PREC, DT) - _dot_x(tl.trans(w), dvn, X2, PREC, DT)
    if STORE_DH0:
        tl.store(dh0_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, dst, mask=mkv)


@triton.jit
def _bwd_wy(k_ptr, rk_ptr, v_ptr, beta_ptr, gc_ptr, tinv_ptr, hs_ptr, dvn_ptr, dv_ptr, db_ptr, dgc_ptr, dkw_ptr,
            chunks_ptr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
            X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Back through v' = u - w h, w = T diag(beta exp(gc)) khat, u = T diag(beta) v and T = (I + A)^-1:
    dv and dbeta (complete), and the WY parts of dkhat and dgc (per value head, summed later)."""
    pid_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    start = tl.load(chunks_ptr + pid_c * 3 + 1).to(tl.int64)
    end = tl.load(chunks_ptr + pid_c * 3 + 2).to(tl.int64)
    rows = tl.arange(0, 64)
    tok = start + rows
    valid = tok < end
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=mk, other=0.0)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
    b = tl.load(beta_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
    Tm = tl.load(tinv_ptr + tok[:, None] * (HV * 64) + hv * 64 + rows[None, :], mask=valid[:, None], other=0.0)
    Tt = tl.trans(Tm)
    dwa = tl.zeros([64, BK], dtype=tl.float32)
    dT = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    st_base = (pid_c.to(tl.int64) * HV + hv) * (K * V)
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        tv_off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
        st = tl.load(hs_ptr + st_base + ck[:, None] * V + cv[None, :],
                     mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)
        dvn = tl.load(dvn_ptr + tv_off, mask=mv, other=0.0)
        v = tl.load(v_ptr + tv_off, mask=mv, other=0.0)
        dwa += tl.dot(dvn, tl.trans(st), input_precision=PREC)
        dT += tl.dot(dvn, tl.trans(v.to(dvn.dtype)), input_precision=PREC)  # columns scaled by beta below
        dY = _dot_xa(Tt, dvn, X2, PREC, DT)
        tl.store(dv_ptr + tv_off, (dY * b[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
        db += tl.sum(v.to(tl.float32) * dY, 1)
    eg = tl.where(valid, tl.exp(gc), 0.0)
    beg = b * eg
    # x = diag(beta exp(gc) rk) k;  dw = -dwa;  dx = T^T dw;  dT += dw x^T
    dT = dT * b[None, :] - _dot_xa(dwa, tl.trans(k), X2, PREC, DT) * (beg * rk)[None, :]
    dx = -tl.dot(Tt, dwa, input_precision=PREC)
    kdx = tl.sum(k.to(tl.float32) * dx, 1) * rk
    db += kdx * eg
    dgc = kdx * beg
    dk = dx * beg[:, None]
    # dA = -T^T dT T^T on the strict lower triangle;  A = diag(beta) (khat khat^T o decay)
    dA = -tl.dot(tl.dot(Tt, dT, input_precision=PREC), Tt, input_precision=PREC)
    dA = tl.where(rows[:, None] > rows[None, :], dA, 0.0) * _chunk_decay(gc, valid, True)
    kk = tl.dot(k, tl.trans(k), input_precision=PREC) * rk[:, None] * rk[None, :]
    dAk = dA * kk
    db += tl.sum(dAk, 1)
    qa = dAk * b[:, None]
    dgc += tl.sum(qa, 1) - tl.sum(qa, 0)
    p = dA * b[:, None]
    dk += _dot_xa(p * rk[None, :], k, X2, PREC, DT) + _dot_xa(tl.trans(p) * rk[None, :], k, X2, PREC, DT)
    tl.store(db_ptr + tok * HV + hv, db.to(db_ptr.dtype.element_ty), mask=valid)
    tl.store(dgc_ptr + tok * HV + hv, dgc, mask=valid)
    tl.store(dkw_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], dk, mask=mk)


@triton.jit
def _bwd_out(q_ptr, k_ptr, rq_ptr, rk_ptr, gc_ptr, hs_ptr, dhs_ptr, vn_ptr, do_ptr, dgc_ptr, dkw_ptr,
             dq_acc_ptr, dk_acc_ptr, dq_ptr, dk_ptr, dg_ptr, chunks_ptr, scale,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
             X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Output and state terms of dq, dk, dg; sums the value heads of the group; back through the l2norm."""
    pid_c = tl.program_id(0)
    h = tl.program_id(1)
    G: tl.constexpr = HV // H
    start = tl.load(chunks_ptr + pid_c * 3 + 1).to(tl.int64)
    end = tl.load(chunks_ptr + pid_c * 3 + 2).to(tl.int64)
    rows = tl.arange(0, 64)
    tok = start + rows
    valid = tok < end
    last_row = tl.minimum(end - start, 64) - 1
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    qk_off = tok[:, None] * (H * K) + h * K + ck[None, :]
    q = tl.load(q_ptr + qk_off, mask=mk, other=0.0)
    k = tl.load(k_ptr + qk_off, mask=mk, other=0.0)
    rq = _rows(rq_ptr, tok, H, h, valid, L2)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    for j in tl.static_range(G):
        hv = h * G + j
        gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
        gl = tl.load(gc_ptr + (start + last_row) * HV + hv)
        dqi = tl.zeros([64, BK], dtype=tl.float32)
        dkh = tl.zeros([64, BK], dtype=tl.float32)
        ds = tl.zeros([64, 64], dtype=tl.float32)
        dgl = tl.zeros([BK], dtype=tl.float32)
        st_base = (pid_c.to(tl.int64) * HV + hv) * (K * V)
        for vb in range(tl.cdiv(V, BV)):
            cv = vb * BV + tl.arange(0, BV)
            mv = valid[:, None] & (cv[None, :] < V)
            mkv = (ck[:, None] < K) & (cv[None, :] < V)
            tv_off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
            st = tl.load(hs_ptr + st_base + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0)
            dst = tl.load(dhs_ptr + st_base + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0)
            vn = tl.load(vn_ptr + tv_off, mask=mv, other=0.0)
            do = tl.load(do_ptr + tv_off, mask=mv, other=0.0).to(vn.dtype)
            dqi += tl.dot(do, tl.trans(st), input_precision=PREC)
            ds += tl.dot(do, tl.trans(vn), input_precision=PREC)
            dkh += tl.dot(vn, tl.trans(dst), input_precision=PREC)
            dgl += tl.sum(st.to(tl.float32) * dst.to(tl.float32), 1)
        eg = tl.where(valid, tl.exp(gc), 0.0)
        egl = tl.where(valid, tl.exp(gl - gc), 0.0)
        dsd = ds * _chunk_decay(gc, valid, False) * scale
        dmd = dsd * tl.dot(q, tl.trans(k), input_precision=PREC) * rq[:, None] * rk[None, :]
        dgc = tl.sum(dmd, 1) - tl.sum(dmd, 0)
        # dqhat: inter-chunk term diag(scale exp(gc)) do h^T, intra-chunk term (ds o D) khat
        dgc += tl.sum(q.to(tl.float32) * dqi, 1) * rq * eg * scale
        dq = dqi * (eg * scale)[:, None] + _dot_xa(dsd * rk[None, :], k, X2, PREC, DT)
        if j > 0:
            dq += tl.load(dq_acc_ptr + qk_off, mask=mk, other=0.0)
        tl.store(dq_acc_ptr + qk_off, dq, mask=mk)
        # dkhat: through h_next = exp(gl) h + khat^T diag(exp(gl - gc)) v', the intra-chunk term and
        # the WY part from _bwd_wy
        e = egl * rk * tl.sum(k.to(tl.float32) * dkh, 1)
        dk = dkh * egl[:, None] + _dot_xa(tl.trans(dsd) * rq[None, :], q, X2, PREC, DT)
        dk += tl.load(dkw_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], mask=mk, other=0.0)
        if j > 0:
            dk += tl.load(dk_acc_ptr + qk_off, mask=mk, other=0.0)
        tl.store(dk_acc_ptr + qk_off, dk, mask=mk)
        dgc -= e
        dgc += tl.where(rows == last_row, tl.exp(gl) * tl.sum(dgl, 0) + tl.sum(e, 0), 0.0)
        dgc += tl.load(dgc_ptr + tok * HV + hv, mask=valid, other=0.0)
        dg = tl.cumsum(tl.where(valid, dgc, 0.0), 0, reverse=True)
        tl.store(dg_ptr + tok * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid)
        tl.debug_barrier()
    dq = tl.load(dq_acc_ptr + qk_off, mask=mk, other=0.0)
    dk = tl.load(dk_acc_ptr + qk_off, mask=mk, other=0.0)
    if L2:
        # xhat = x r with r = rsqrt(|x|^2 + eps):  dx = r (dxhat - xhat (xhat . dxhat))
        yq = q.to(tl.float32) * rq[:, None]
        yk = k.to(tl.float32) * rk[:, None]
        dq = (dq - yq * tl.sum(yq * dq, 1)[:, None]) * rq[:, None]
        dk = (dk - yk * tl.sum(yk * dk, 1)[:, None]) * rk[:, None]
    tl.store(dq_ptr + qk_off, dq.to(dq_ptr.dtype.element_ty), mask=mk)
    tl.store(dk_ptr + qk_off, dk.to(dk_ptr.dtype.element_ty), mask=mk)


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------


class _Plan:
    """Sequence and chunk bookkeeping for one call (int32 tables on the inputs' device).

    Built with tensor operations on the host (no per-sequence or per-chunk Python loop: a packed row of
    thousands of short sequences gets a new plan every step) and copied to the device in one transfer.
    """

    def __init__(self, bounds: list[int], device: torch.device):
        b = torch.tensor(bounds, dtype=torch.int64)
        starts, ends = b[:-1], b[1:]
        counts = (ends - starts + BT - 1) // BT  # chunks per sequence
        offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        self.N = counts.numel()
        self.NC = int(offsets[-1])
        seq = torch.repeat_interleave(torch.arange(self.N), counts)  # sequence of every chunk
        within = torch.arange(self.NC) - offsets[:-1][seq]  # chunk index inside its sequence
        rows = torch.stack([seq, starts[seq] + within * BT, ends[seq]], 1)  # (sequence, start, end)
        if not self.NC:
            rows = rows.new_zeros(1, 3)
        table = torch.cat([b, offsets, rows.reshape(-1)]).to(torch.int32).to(device, non_blocking=True)
        n1 = len(bounds)
        self.cu = table[:n1]
        self.coff = table[n1:2 * n1]
        self.chunks = table[2 * n1:]


_PLANS: dict = {}


def _plan(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> _Plan:
    """Chunk tables, cached by sequence layout (they depend on lengths only, never on values)."""
    bounds = tuple(n * T for n in range(B + 1)) if cu_seqlens is None else host_offsets(cu_seqlens)
    key = (bounds, str(device))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 64:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = _Plan(list(bounds), device)
    return plan


# Tunables, read at call time (the benchmark may override them). ``*_store``: dtype of the stored
# per-token / per-chunk intermediates (w, u, v', chunk states and their gradients): "input" (the inputs'
# 16-bit dtype) or "fp32". ``*_x2``: products of an fp32 operand with a 16-bit one split the fp32 operand
# into two 16-bit parts (about 16 mantissa bits) instead of rounding it to 16 bits or using tf32.
# fp32 inputs always use fp32 storage and three-pass tf32 products.
OPTIONS = {
    "fwd_store": "input",
    "bwd_store": "input",
    "fwd_x2": True,
    "bwd_x2": True,
    "bv_intra": 128, "warps_intra": 4,
    "bv_state": 32, "warps_state": 8,
    "bv_dvl": 128, "warps_dvl": 4,
    "bv_wy": 32, "warps_wy": 8,
    "bv_bo": 32, "warps_bo": 8,
    "stages": 2,
}


class _Cfg:
    """Compile-time choices for one pass ("fwd" or "bwd") of one dtype / head-size family."""

    def __init__(self, dtype: torch.dtype, K: int, V: int, which: str):
        interp = _interpreting()
        self.BK = max(16, triton.next_power_of_2(K))
        self.DT = _TL_DTYPE[dtype]
        full = dtype == torch.float32
        # precision of fp32-operand products: exact in the interpreter, three-pass tf32 for fp32 inputs
        self.PREC = "ieee" if interp else ("tf32x3" if full else "tf32")
        self.X2 = (not full) and bool(OPTIONS[which + "_x2"])
        self.store = torch.float32 if (full or OPTIONS[which + "_store"] == "fp32") else dtype
        vmax = max(16, triton.next_power_of_2(V))
        names = ("intra", "state", "dvl", "wy", "bo")
        self.bv = {n: min(vmax, 16 if interp else OPTIONS["bv_" + n]) for n in names}
        # Head sizes under 64 (tiles of 16 or 32 columns) gave wrong outputs with 8 warps and illegal memory
        # accesses with 4 on the H200 (Triton 3.6); 2 warps are correct there (BENCHMARKS.md, small heads).
        small = min(self.BK, vmax) < 64
        self.nw = {n: 1 if interp else (min(2, OPTIONS["warps_" + n]) if small else OPTIONS["warps_" + n])
                   for n in names}
        self.stages = 1 if interp else OPTIONS["stages"]
        # fp32 states in the reverse pass need the shared memory that load pipelining would take
        self.stages_state = 1 if (interp or (which == "bwd" and self.store == torch.float32)) else self.stages


# Optional callback ``hook(stage_name)`` called after each kernel launch (the benchmark's per-stage
# timing uses it); None in normal use.
STAGE_HOOK = None


def _mark(name: str) -> None:
    if STAGE_HOOK is not None:
        STAGE_HOOK(name)


def _rstd(q, k, L2):
    """rsqrt(|x|^2 + eps) per row of q and k, or (None, None) when the l2norm is off."""
    if not L2:
        return None, None
    TT, H, K = q.shape
    rq = torch.empty(TT, H, device=q.device, dtype=torch.float32)
    rk = torch.empty(TT, H, device=q.device, dtype=torch.float32)
    if TT:
        _l2norm_rstd[(triton.cdiv(TT, 64), H)](q, k, rq, rk, TT, H=H, K=K, BK=max(16, triton.next_power_of_2(K)),
                                               num_warps=1 if _interpreting() else 4)
    _mark("l2norm")
    return rq, rk


def _prepare(k, rk, v, g, beta, plan, cfg, L2, store_t):
    TT, H, K = k.shape
    HV, V = v.shape[-2:]
    dev = k.device
    gc = torch.empty(TT, HV, device=dev, dtype=torch.float32)
    w = torch.empty(TT, HV, K, device=dev, dtype=cfg.store)
    u = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    tinv = torch.empty(TT, HV, BT, device=dev, dtype=torch.float32) if store_t else None
    if plan.NC:
        _intra_fwd[(plan.NC, HV)](k, rk if L2 else gc, v, g, beta, gc, w, u, tinv if store_t else gc, plan.chunks,
                                  H=H, HV=HV, K=K, V=V, BK=cfg.BK, BV=cfg.bv["intra"], L2=L2, STORE_T=store_t,
                                  X2=cfg.X2, PREC=cfg.PREC, DT=cfg.DT, num_warps=cfg.nw["intra"],
                                  num_stages=cfg.stages)
    _mark("intra")
    return gc, w, u, tinv


def _forward(q, k, v, g, beta, scale, h0, want_ht, L2, plan):
    TT, H, K = q.shape
    HV, V = v.shape[-2:]
    cfg = _Cfg(q.dtype, K, V, "fwd")
    rq, rk = _rstd(q, k, L2)
    gc, w, u, _ = _prepare(k, rk, v, g, beta, plan, cfg, L2, False)
    o = torch.empty(TT, HV, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(plan.N, HV, K, V, device=q.device, dtype=torch.float32) if want_ht else None
    grid = (triton.cdiv(V, cfg.bv["state"]) * plan.N * HV,)
    _state_fwd[grid](q, k, rq if L2 else gc, rk if L2 else gc, w, u, gc, h0 if h0 is not None else gc, gc, gc, o,
                     ht if want_ht else gc, plan.cu, plan.coff, scale, H=H, HV=HV, K=K, V=V, BK=cfg.BK,
                     BV=cfg.bv["state"], L2=L2, HAS_H0=h0 is not None, STORE_HS=False, WRITE_O=True,
                     STORE_HT=want_ht, X2=cfg.X2, PREC=cfg.PREC, DT=cfg.DT, num_warps=cfg.nw["state"],
                     num_stages=cfg.stages_state)
    _mark("state_out")
    return o, ht


def _backward(q, k, v, g, beta, scale, h0, do, dht, L2, plan, need_dh0):
    TT, H, K = q.shape
    HV, V = v.shape[-2:]
    dev = q.device
    cfg = _Cfg(q.dtype, K, V, "bwd")
    common = dict(H=H, HV=HV, K=K, V=V, BK=cfg.BK, L2=L2, X2=cfg.X2, PREC=cfg.PREC, DT=cfg.DT)
    rq, rk = _rstd(q, k, L2)
    gc, w, u, tinv = _prepare(k, rk, v, g, beta, plan, cfg, L2, True)
    rq, rk = (rq, rk) if L2 else (gc, gc)
    hs = torch.empty(max(plan.NC, 1), HV, K, V, device=dev, dtype=cfg.store)
    vn = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    grid = (triton.cdiv(V, cfg.bv["state"]) * plan.N * HV,)
    _state_fwd[grid](q, k, rq, rk, w, u, gc, h0 if h0 is not None else gc, hs, vn, gc, gc, plan.cu, plan.coff,
                     scale, BV=cfg.bv["state"], HAS_H0=h0 is not None, STORE_HS=True, WRITE_O=False,
                     STORE_HT=False, **common, num_warps=cfg.nw["state"], num_stages=cfg.stages_state)
    _mark("state_fwd")
    del u
    dvl = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    if plan.NC:
        _dv_local[(plan.NC, HV)](q, k, rq, rk, gc, do, dvl, plan.chunks, scale, BV=cfg.bv["dvl"], **common,
                                 num_warps=cfg.nw["dvl"], num_stages=cfg.stages)
    _mark("dv_local")
    dhs = torch.empty(max(plan.NC, 1), HV, K, V, device=dev, dtype=cfg.store)
    dvn = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    dh0 = torch.empty(plan.N, HV, K, V, device=dev, dtype=torch.float32) if need_dh0 else None
    _state_bwd[grid](q, k, rq, rk, w, gc, do, dvl, dht if dht is not None else gc, dhs, dvn,
                     dh0 if need_dh0 else gc, plan.cu, plan.coff, scale, BV=cfg.bv["state"], HAS_DHT=dht is not None,
                     STORE_DH0=need_dh0, **common, num_warps=cfg.nw["state"], num_stages=cfg.stages_state)
    _mark("state_bwd")
    del w, dvl
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty(g.shape, device=dev, dtype=g.dtype)
    db = torch.empty(beta.shape, device=dev, dtype=beta.dtype)
    if not plan.NC:
        for t in (dq, dk, dv, dg, db):
            t.zero_()
        return dq, dk, dv, dg, db, dh0
    dgc = torch.empty(TT, HV, device=dev, dtype=torch.float32)
    dkw = torch.empty(TT, HV, K, device=dev, dtype=torch.float32)
    _bwd_wy[(plan.NC, HV)](k, rk, v, beta, gc, tinv, hs, dvn, dv, db, dgc, dkw, plan.chunks, BV=cfg.bv["wy"],
                           **common, num_warps=cfg.nw["wy"], num_stages=cfg.stages)
    _mark("bwd_wy")
    del dvn, tinv
    dq_acc = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    dk_acc = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    _bwd_out[(plan.NC, H)](q, k, rq, rk, gc, hs, dhs, vn, do, dgc, dkw, dq_acc, dk_acc, dq, dk, dg, plan.chunks,
                           scale, BV=cfg.bv["bo"], **common, num_warps=cfg.nw["bo"], num_stages=cfg.stages)
    _mark("bwd_out")
    return dq, dk, dv, dg, db, dh0


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens):
        B, T, H, K = q.shape
        HV, V = v.shape[-2:]
        plan = _plan(B, T, cu_seqlens, q.device)
        qf = q.reshape(B * T, H, K).contiguous()
        kf = k.reshape(B * T, H, K).contiguous()
        vf = v.reshape(B * T, HV, V).contiguous()
        gf = g.reshape(B * T, HV).contiguous()
        bf = beta.reshape(B * T, HV).contiguous()
        h0 = initial_state.contiguous() if initial_state is not None else None
        o, ht = _forward(qf, kf, vf, gf, bf, scale, h0, output_final_state, l2, plan)
        ctx.save_for_backward(qf, kf, vf, gf, bf, h0)
        ctx.meta = (B, T, scale, l2, plan, initial_state is not None)
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        qf, kf, vf, gf, bf, h0 = ctx.saved_tensors
        B, T, scale, l2, plan, has_h0 = ctx.meta
        H, K = qf.shape[-2:]
        HV, V = vf.shape[-2:]
        if do is None:
            do = torch.zeros(B * T, HV, V, device=qf.device, dtype=qf.dtype)
        do = do.reshape(B * T, HV, V).contiguous()
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dg, db, dh0 = _backward(qf, kf, vf, gf, bf, scale, h0, do, dht, l2, plan,
                                            need_dh0=has_h0 and ctx.needs_input_grad[6])
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
                db.view(B, T, HV), None, dh0, None, None, None)


def chunk_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None = None,
                                  output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                  cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (forward and backward) in Triton.

    q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head hv reads q/k head
    hv // (HV // H)); g [B, T, HV] log-space decay; beta [B, T, HV]; initial_state [N, HV, K, V] fp32
    with N = B, or N = len(cu_seqlens) - 1 and B = 1 for packed sequences. Returns (o [B, T, HV, V] in
    q's dtype, final state [N, HV, K, V] fp32 or None). Differentiable in q, k, v, g, beta and
    initial_state, and through the final state when it is returned. Inputs are assumed validated.
    """
    K = q.shape[-1]
    if K > 256:
        raise ValueError(f"chunk_gated_delta_rule_triton: q/k head dim K={K} is not supported; allowed: K <= 256")
    if q.dtype not in _TL_DTYPE:
        raise ValueError(f"chunk_gated_delta_rule_triton: q.dtype={q.dtype} is not supported; "
                         f"allowed: {sorted(str(d) for d in _TL_DTYPE)}")
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, float(scale), initial_state, bool(output_final_state),
                                      bool(use_qk_l2norm_in_kernel), cu_seqlens)
