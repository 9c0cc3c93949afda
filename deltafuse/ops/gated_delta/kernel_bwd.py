"""Chunked gated delta rule in Triton: the backward kernels.

The recurrence, the chunk algebra and the grid of every kernel are described in ``kernel.py`` (the op's Triton
entry); ``chunk_launch.py`` launches these kernels; the device helpers and the forward kernels are in ``kernel_fwd.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltafuse.ops.gated_delta.kernel_fwd import (_chunk_decay, _dot_m, _dot_xa, _rows, _unit_lower_inverse,
                                                chunk_tokens, gate_terms, sequence_program, sigmoid, state_chunk,
                                                state_tile)

# --------------------------------------------------------------------------------------------------
# backward device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _mix_a(a, b, MODE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """a @ b for a computed fp32 ``a`` and ``b`` exact in DT (loaded inputs or stored values).

    MODE (chunk_options.PROD_MODES) 0: one fp32 product at precision PREC; 2 ("x2"): ``a`` split into two DT
    parts (hi + lo, about 16 mantissa bits) and two 16-bit products; 1 ("16"): ``a`` rounded to DT, one 16-bit
    product. An fp32 ``b`` (fp32 storage) always takes the fp32 product.
    """
    if MODE == 2 and b.dtype != tl.float32:
        ah = a.to(DT)
        al = (a - ah.to(tl.float32)).to(DT)
        return tl.dot(al, b, acc=tl.dot(ah, b))
    elif MODE == 1 and b.dtype != tl.float32:
        return tl.dot(a.to(DT), b)
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


@triton.jit
def _mix_b(a, b, MODE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """a @ b for ``a`` exact in DT and a computed fp32 ``b`` (the mirror of _mix_a)."""
    if MODE == 2 and a.dtype != tl.float32:
        bh = b.to(DT)
        bl = (b - bh.to(tl.float32)).to(DT)
        return tl.dot(a, bl, acc=tl.dot(a, bh))
    elif MODE == 1 and a.dtype != tl.float32:
        return tl.dot(a, b.to(DT))
    else:
        return tl.dot(a.to(tl.float32), b, input_precision=PREC)


@triton.jit
def _dot_ff(a, b, MODE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """a @ b for two computed fp32 tiles. MODE (chunk_options.PROD_MODES) 0: one fp32 product at precision PREC
    (tf32 for 16-bit inputs); 2 ("x2"): both split into two DT parts, three 16-bit products (hi hi, hi lo, lo hi);
    1 ("16"): both rounded to DT, one 16-bit product."""
    if MODE == 2:
        ah = a.to(DT)
        al = (a - ah.to(tl.float32)).to(DT)
        bh = b.to(DT)
        bl = (b - bh.to(tl.float32)).to(DT)
        return tl.dot(ah, bl, acc=tl.dot(al, bh, acc=tl.dot(ah, bh)))
    elif MODE == 1:
        return tl.dot(a.to(DT), b.to(DT))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _l2norm_bwd(dy, x, r, L2: tl.constexpr):
    """Back through y = x r with r = rsqrt(|x|^2 + eps) per row: dx = r (dy - y (y . dy)); dy itself when the
    l2norm is off."""
    if L2:
        y = x.to(tl.float32) * r[:, None]
        return (dy - y * tl.sum(y * dy, 1)[:, None]) * r[:, None]
    else:
        return dy


@triton.jit
def _chunk_head(H: tl.constexpr, HV: tl.constexpr, GLOOP: tl.constexpr):
    """(chunk, q/k head, value head) of a program of ``_bwd_wy`` or ``_bwd_out``, on one grid axis with the value
    heads fastest, so that the value heads of one q/k head read the same q/k rows back to back. GLOOP: one program
    per chunk and q/k head, which runs the G value heads sharing it in turn (the value head returned is the
    first of them)."""
    pid = tl.program_id(0)
    G: tl.constexpr = HV // H
    if GLOOP:
        h = pid % H
        c = pid // H
        hv = h * G
    else:
        hv = pid % HV
        c = pid // HV
        h = hv // G
    return c, h, hv


# --------------------------------------------------------------------------------------------------
# backward kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dv_local(q_ptr, k_ptr, rq_ptr, rk_ptr, gc_ptr, do_ptr, dvl_ptr, chunks_ptr, scale, sq, sk,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
              X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    pid_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    start, end, tok, valid = chunk_tokens(chunks_ptr, pid_c)
    if start >= end:  # an empty row of a device-built chunk table (chunk_launch.DevicePlan)
        return
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    q = tl.load(q_ptr + tok[:, None] * sq + h * K + ck[None, :], mask=mk, other=0.0)
    k = tl.load(k_ptr + tok[:, None] * sk + h * K + ck[None, :], mask=mk, other=0.0)
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
def _state_bwd(q_ptr, k_ptr, rq_ptr, rk_ptr, w_ptr, tinv_ptr, beta_ptr, gc_ptr, do_ptr, dvl_ptr, dht_ptr, dhs_ptr,
               dvn_ptr, dh0_ptr, cu_ptr, coff_ptr, scale, SQ: tl.constexpr, SK: tl.constexpr, H: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               L2: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, KD: tl.constexpr, QD: tl.constexpr,
               WD: tl.constexpr, FROM_T: tl.constexpr, TD: tl.constexpr, BSIG: tl.constexpr, PREC: tl.constexpr,
               DT: tl.constexpr):
    """The reverse pass: dh at every chunk end into ``dhs``, the full dv' into ``dvn`` (which may be ``dvl``: each
    program reads a chunk's dv_local tile before it writes the same elements) and the initial-state gradient.
    KD / QD / WD: product modes (kernel_fwd._dot_m) of k dh (for dv'), of q^T times the decayed do and of w^T dv'
    (the state gradient's update).

    FROM_T: w is not read; w^T dv' is formed from T = (I + A)^-1 (``tinv``, fp32 [tokens, HV, 64], transposed on
    load) as khat^T diag(beta exp(gc)) (T^T dv'), since w = T diag(beta exp(gc)) khat. TD: product mode of T^T
    with the fp32 dv' (``_dot_ff``); WD is then the mode of k^T times that. BSIG: beta holds logits.

    The token strides of q and k are compile-time constants here (one compilation per layout: contiguous rows, or
    the views of a fused projection). With them as run-time arguments, its only change, this pass took 18 % longer
    on the H200 (3.30 -> 3.89 ms at 1x65,536 tokens, bf16, H=16, HV=32, D=128), while the forward's sequential pass
    and the parallel kernels lost nothing."""
    pid_v, n, hv, h, bos, eos, coff, nt = sequence_program(cu_ptr, coff_ptr, H, HV, V, BV)
    ck, cv, mkv, state_off, dst = state_tile(dht_ptr, n, hv, pid_v, HAS_DHT, HV, K, V, BK, BV)
    for i in range(nt):
        c = nt - 1 - i
        tok, valid, mk, mv, tv_off, gc, gl, dec = state_chunk(rk_ptr, gc_ptr, bos + c * 64, eos, ck, cv, h, hv, H,
                                                              HV, K, V, L2)
        tl.store(dhs_ptr + ((coff + c) * HV + hv) * (K * V) + state_off, dst.to(dhs_ptr.dtype.element_ty), mask=mkv)
        k = tl.load(k_ptr + tok[:, None] * SK + h * K + ck[None, :], mask=mk, other=0.0)
        dvl = tl.load(dvl_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        # dv' = dv_local + diag(rk exp(gl - gc)) k dh_next
        dvn = dvl + _dot_m(k, dst, tl.zeros([64, BV], dtype=tl.float32), KD, PREC, DT) * dec[:, None]
        tl.store(dvn_ptr + tv_off, dvn.to(dvn_ptr.dtype.element_ty), mask=mv)
        q = tl.load(q_ptr + tok[:, None] * SQ + h * K + ck[None, :], mask=mk, other=0.0)
        rq = _rows(rq_ptr, tok, H, h, valid, L2)
        do = tl.load(do_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        eg = tl.where(valid, tl.exp(gc), 0.0)
        dog = do * (rq * eg * scale)[:, None]
        # dh_prev = exp(gl) dh + q^T diag(rq exp(gc) scale) do - w^T dv'
        dst = _dot_m(tl.trans(q), dog, dst * tl.exp(gl), QD, PREC, DT)
        if FROM_T:
            rows = tl.arange(0, 64)
            Tt = tl.load(tinv_ptr + tok[None, :] * (HV * 64) + hv * 64 + rows[:, None], mask=valid[None, :],
                         other=0.0)
            b = tl.load(beta_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
            if BSIG:
                b = tl.where(valid, sigmoid(b), 0.0)
            rk = _rows(rk_ptr, tok, H, h, valid, L2)
            y = _dot_ff(Tt, dvn, TD, PREC, DT) * (b * eg * rk)[:, None]
            dst = _dot_m(tl.trans(k), -y, dst, WD, PREC, DT)
        else:
            w = tl.load(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], mask=mk, other=0.0)
            dst = _dot_m(tl.trans(w), -dvn, dst, WD, PREC, DT)
    if STORE_DH0:
        tl.store(dh0_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, dst, mask=mkv)


@triton.jit
def _bwd_wy(k_ptr, rk_ptr, v_ptr, beta_ptr, gc_ptr, tinv_ptr, hs_ptr, dvn_ptr, dv_ptr, db_ptr, dgc_ptr, dkp_ptr,
            chunks_ptr, sk, sv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
            MODE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, BSIG: tl.constexpr,
            RECOMP_T: tl.constexpr, INV: tl.constexpr, GLOOP: tl.constexpr):
    """Back through v' = u - w h, w = T diag(beta exp(gc)) khat, u = T diag(beta) v and T = (I + A)^-1:
    dv and dbeta (complete; with BSIG beta holds logits and db is theirs), the WY part of dgc and the WY part of
    dkhat, which starts this value head's dk partial (``dkp``; ``_bwd_out`` adds the rest). ``dv_ptr`` may be
    ``dvn_ptr``: each V block of dv' is read before the same elements of dv are written, and not read again.

    T^T is the left operand of every product with T. Without RECOMP_T it is loaded from ``tinv`` (transposed by
    swapped strides). With RECOMP_T it is computed here, and the program works on its chunk's tokens in reverse
    order (row r holds token last - r): with P that reversal, P T^T P = (I + A')^-1 for the strictly lower
    A' = (P A P)^T, A'_rj = beta_j (khat_r . khat_j) exp(gc_j - gc_r) (r > j, in the reversed rows), so the
    forward's unit-lower inverse gives it in registers and no computed tile is ever transposed for a product.
    Every other product and row reduction is the same in either order; only dA's triangle flips (strictly
    upper in reversed rows). INV: that inverse's method (_unit_lower_inverse).

    GLOOP: one program per chunk and q/k head runs the G value heads that share it, one after another, and writes
    the sum of their WY parts of dkhat to ``dkp`` laid out [tokens, H, K] (else one program per value head, dkp
    [tokens, HV, K])."""
    pid_c, h, hv0 = _chunk_head(H, HV, GLOOP)
    G: tl.constexpr = HV // H
    start, end, tok, valid = chunk_tokens(chunks_ptr, pid_c)
    if start >= end:  # an empty row of a device-built chunk table (chunk_launch.DevicePlan)
        return
    rows = tl.arange(0, 64)
    if RECOMP_T:
        # the same valid rows (the chunk's first min(end - start, 64)), holding its tokens last to first
        tok = tl.where(valid, start + tl.minimum(end - start, 64) - 1 - rows, start)
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    k = tl.load(k_ptr + tok[:, None] * sk + h * K + ck[None, :], mask=mk, other=0.0)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    if RECOMP_T:  # needed for T first (else formed after the V loop, not held across it)
        kk = tl.dot(k, tl.trans(k), input_precision=PREC) * rk[:, None] * rk[None, :]
    dk_sum = tl.zeros([64, BK], dtype=tl.float32)  # GLOOP only
    for gi in range(G if GLOOP else 1):
        hv = hv0 + gi
        gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
        b = tl.load(beta_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
        if BSIG:
            b = tl.where(valid, sigmoid(b), 0.0)
        if RECOMP_T:
            # (P T^T P) = (I + A')^-1; _chunk_decay of -gc is exp(gc_j - gc_r) below the diagonal
            Tt = _unit_lower_inverse(kk * _chunk_decay(-gc, valid, True) * b[None, :], PREC, INV)
        else:
            # T^T, transposed on load (swapped strides): no transpose of a tile in registers
            Tt = tl.load(tinv_ptr + tok[None, :] * (HV * 64) + hv * 64 + rows[:, None], mask=valid[None, :],
                         other=0.0)
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
            v = tl.load(v_ptr + tok[:, None] * sv + hv * V + cv[None, :], mask=mv, other=0.0)
            dwa += tl.dot(dvn, tl.trans(st), input_precision=PREC)
            dT += tl.dot(dvn, tl.trans(v.to(dvn.dtype)), input_precision=PREC)  # columns scaled by beta below
            dY = _mix_a(Tt, dvn, MODE, PREC, DT)
            tl.store(dv_ptr + tv_off, (dY * b[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
            db += tl.sum(v.to(tl.float32) * dY, 1)
        eg = tl.where(valid, tl.exp(gc), 0.0)
        beg = b * eg
        # x = diag(beta exp(gc) rk) k;  dw = -dwa;  dx = T^T dw;  dT += dw x^T
        dT = dT * b[None, :] - _mix_a(dwa, tl.trans(k), MODE, PREC, DT) * (beg * rk)[None, :]
        dx = -tl.dot(Tt, dwa, input_precision=PREC)
        kdx = tl.sum(k.to(tl.float32) * dx, 1) * rk
        db += kdx * eg
        dgc = kdx * beg
        dk = dx * beg[:, None]
        # dA = -T^T dT T^T on the strict lower triangle;  A = diag(beta) (khat khat^T o decay)
        dA = -tl.dot(tl.dot(Tt, dT, input_precision=PREC), Tt, input_precision=PREC)
        if RECOMP_T:  # reversed rows: dA's triangle is the strict upper one, its decay that of A' transposed
            dA = dA * tl.trans(_chunk_decay(-gc, valid, True))  # elementwise (a transpose only a dot must avoid)
        else:
            dA = tl.where(rows[:, None] > rows[None, :], dA, 0.0) * _chunk_decay(gc, valid, True)
            kk = tl.dot(k, tl.trans(k), input_precision=PREC) * rk[:, None] * rk[None, :]
        dAk = dA * kk
        db += tl.sum(dAk, 1)
        qa = dAk * b[:, None]
        dgc += tl.sum(qa, 1) - tl.sum(qa, 0)
        p = dA * b[:, None]
        # dkhat += p khat + p^T khat; the second as (khat^T p)^T, a product of the loaded k (transposed on the
        # operand side) with p, whose result is transposed back: p itself is never a transposed dot operand
        dk += _mix_a(p * rk[None, :], k, MODE, PREC, DT)
        dk += tl.trans(_mix_b(tl.trans(k), p * rk[:, None], MODE, PREC, DT))
        if BSIG:
            db = db * b * (1.0 - b)
        tl.store(db_ptr + tok * HV + hv, db.to(db_ptr.dtype.element_ty), mask=valid)
        tl.store(dgc_ptr + tok * HV + hv, dgc, mask=valid)
        if GLOOP:
            dk_sum += dk
        else:
            tl.store(dkp_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], dk.to(dkp_ptr.dtype.element_ty),
                     mask=mk)
    if GLOOP:  # the group's sum: dkp is [tokens, H, K]
        tl.store(dkp_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], dk_sum.to(dkp_ptr.dtype.element_ty),
                 mask=mk)


@triton.jit
def _bwd_out(q_ptr, k_ptr, rq_ptr, rk_ptr, gc_ptr, hs_ptr, dhs_ptr, vn_ptr, do_ptr, dgc_ptr, dkp_ptr, dqp_ptr,
             dq_ptr, dk_ptr, dg_ptr, chunks_ptr, scale, g_ptr, alog_ptr, dtb_ptr, pa_ptr, pd_ptr, sq, sk,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
             MODE: tl.constexpr, TWO_PASS: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
             GATE: tl.constexpr, HAS_DT: tl.constexpr, GLOOP: tl.constexpr):
    """Output and state terms of dq, dk and all of dg for one (chunk, value head).

    GATE: g (``g_ptr``) holds FLA's raw gate a (``gate_terms``): dg is written for a, and this chunk's parts of
    dA_log (sum of dg g) and of d dt_bias (sum of da) go to ``pa`` and ``pd`` [NC, HV] (summed by the caller).

    With one value head per q/k head (G = 1) dq and dk are finished here (back through the l2norm, cast).
    Otherwise this value head's dq partial is written to ``dqp`` and its dk terms are added to the WY part
    already in ``dkp``; ``_bwd_reduce`` sums the G partials of each q/k head. GLOOP (``_bwd_wy``'s too, so
    ``dkp`` holds the group's WY part [tokens, H, K]): one program per chunk and q/k head runs the G value heads
    one after another and finishes dq and dk itself; ``dk_ptr`` may be ``dkp_ptr`` (each program reads its dkp
    tile before it writes the same elements of dk).
    TWO_PASS: two passes over the value blocks, the first for dq (reading do, h, v'), the second for dk (reading
    v', dh, h again), so one [64, BK] fp32 accumulator is live at a time instead of two.
    """
    pid_c, h, hv0 = _chunk_head(H, HV, GLOOP)
    G: tl.constexpr = HV // H
    start, end, tok, valid = chunk_tokens(chunks_ptr, pid_c)
    if start >= end:  # an empty row of a device-built chunk table (chunk_launch.DevicePlan)
        return
    rows = tl.arange(0, 64)
    last_row = tl.minimum(end - start, 64) - 1
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    q_off = tok[:, None] * sq + h * K + ck[None, :]
    k_off = tok[:, None] * sk + h * K + ck[None, :]
    qk_off = tok[:, None] * (H * K) + h * K + ck[None, :]  # dq, dk (and dkp with GLOOP): [tokens, H, K]
    dq_sum = tl.zeros([64, BK], dtype=tl.float32)  # GLOOP only
    dk_sum = tl.zeros([64, BK], dtype=tl.float32)
    for gi in range(G if GLOOP else 1):
        hv = hv0 + gi
        part_off = tok[:, None] * (HV * K) + hv * K + ck[None, :]
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
            vn = tl.load(vn_ptr + tv_off, mask=mv, other=0.0)
            do = tl.load(do_ptr + tv_off, mask=mv, other=0.0).to(vn.dtype)
            dqi += tl.dot(do, tl.trans(st), input_precision=PREC)
            ds += tl.dot(do, tl.trans(vn), input_precision=PREC)
            if not TWO_PASS:
                dst = tl.load(dhs_ptr + st_base + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0)
                dkh += tl.dot(vn, tl.trans(dst), input_precision=PREC)
                dgl += tl.sum(st.to(tl.float32) * dst.to(tl.float32), 1)
        # q, k and the per-row factors are loaded after the loop: they are not held in registers across it
        q = tl.load(q_ptr + q_off, mask=mk, other=0.0)
        k = tl.load(k_ptr + k_off, mask=mk, other=0.0)
        rq = _rows(rq_ptr, tok, H, h, valid, L2)
        rk = _rows(rk_ptr, tok, H, h, valid, L2)
        gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
        gl = tl.load(gc_ptr + (start + last_row) * HV + hv)
        eg = tl.where(valid, tl.exp(gc), 0.0)
        egl = tl.where(valid, tl.exp(gl - gc), 0.0)
        dsd = ds * _chunk_decay(gc, valid, False) * scale
        dmd = dsd * tl.dot(q, tl.trans(k), input_precision=PREC) * rq[:, None] * rk[None, :]
        dgc = tl.sum(dmd, 1) - tl.sum(dmd, 0)
        # dqhat: inter-chunk term diag(scale exp(gc)) do h^T, intra-chunk term (ds o D) khat
        dgc += tl.sum(q.to(tl.float32) * dqi, 1) * rq * eg * scale
        dq = dqi * (eg * scale)[:, None] + _mix_a(dsd * rk[None, :], k, MODE, PREC, DT)
        if GLOOP:
            dq_sum += dq
        elif G == 1:
            tl.store(dq_ptr + qk_off, _l2norm_bwd(dq, q, rq, L2).to(dq_ptr.dtype.element_ty), mask=mk)
        else:
            tl.store(dqp_ptr + part_off, dq.to(dqp_ptr.dtype.element_ty), mask=mk)
        if TWO_PASS:
            for vb in range(tl.cdiv(V, BV)):
                cv = vb * BV + tl.arange(0, BV)
                mkv = (ck[:, None] < K) & (cv[None, :] < V)
                st = tl.load(hs_ptr + st_base + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0)
                dst = tl.load(dhs_ptr + st_base + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0)
                vn = tl.load(vn_ptr + tok[:, None] * (HV * V) + hv * V + cv[None, :],
                             mask=valid[:, None] & (cv[None, :] < V), other=0.0)
                dkh += tl.dot(vn, tl.trans(dst), input_precision=PREC)
                dgl += tl.sum(st.to(tl.float32) * dst.to(tl.float32), 1)
        # dkhat: through h_next = exp(gl) h + khat^T diag(exp(gl - gc)) v', the intra-chunk term
        # (ds o D)^T qhat (as (qhat^T (ds o D))^T from the loaded q: no transposed computed dot operand) and the
        # WY part from _bwd_wy
        e = egl * rk * tl.sum(k.to(tl.float32) * dkh, 1)
        dk = dkh * egl[:, None] + tl.trans(_mix_b(tl.trans(q), dsd * rq[:, None], MODE, PREC, DT))
        if GLOOP:
            dk_sum += dk
        else:
            dk += tl.load(dkp_ptr + part_off, mask=mk, other=0.0).to(tl.float32)
            if G == 1:
                tl.store(dk_ptr + qk_off, _l2norm_bwd(dk, k, rk, L2).to(dk_ptr.dtype.element_ty), mask=mk)
            else:
                tl.store(dkp_ptr + part_off, dk.to(dkp_ptr.dtype.element_ty), mask=mk)
        dgc -= e
        dgc += tl.where(rows == last_row, tl.exp(gl) * tl.sum(dgl, 0) + tl.sum(e, 0), 0.0)
        dgc += tl.load(dgc_ptr + tok * HV + hv, mask=valid, other=0.0)
        dg = tl.cumsum(tl.where(valid, dgc, 0.0), 0, reverse=True)
        if GATE:
            x, A, g = gate_terms(g_ptr, alog_ptr, dtb_ptr, tok, valid, hv, HV, HAS_DT)
            tl.store(pa_ptr + pid_c * HV + hv, tl.sum(tl.where(valid, dg * g, 0.0), 0))
            dg = tl.where(valid, dg * A * sigmoid(x), 0.0)
            tl.store(pd_ptr + pid_c * HV + hv, tl.sum(dg, 0))
        tl.store(dg_ptr + tok * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid)
    if GLOOP:  # the group's sums, finished; dkp holds the group's WY part [tokens, H, K]
        q = tl.load(q_ptr + q_off, mask=mk, other=0.0)
        k = tl.load(k_ptr + k_off, mask=mk, other=0.0)
        rq = _rows(rq_ptr, tok, H, h, valid, L2)
        rk = _rows(rk_ptr, tok, H, h, valid, L2)
        tl.store(dq_ptr + qk_off, _l2norm_bwd(dq_sum, q, rq, L2).to(dq_ptr.dtype.element_ty), mask=mk)
        dk_sum += tl.load(dkp_ptr + qk_off, mask=mk, other=0.0).to(tl.float32)
        tl.store(dk_ptr + qk_off, _l2norm_bwd(dk_sum, k, rk, L2).to(dk_ptr.dtype.element_ty), mask=mk)


@triton.jit(do_not_specialize=["TT"])
def _bwd_reduce(q_ptr, k_ptr, rq_ptr, rk_ptr, dqp_ptr, dkp_ptr, dq_ptr, dk_ptr, TT, sq, sk,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                L2: tl.constexpr):
    """dq and dk of one q/k head: the sum of the per-value-head partials of its G value heads, back through
    the l2norm, cast to the inputs' dtype."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    G: tl.constexpr = HV // H
    tok = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
    valid = tok < TT
    ck = tl.arange(0, BK)
    mk = valid[:, None] & (ck[None, :] < K)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    for j in tl.static_range(G):
        off = tok[:, None] * (HV * K) + (h * G + j) * K + ck[None, :]
        dq += tl.load(dqp_ptr + off, mask=mk, other=0.0).to(tl.float32)
        dk += tl.load(dkp_ptr + off, mask=mk, other=0.0).to(tl.float32)
    qk_off = tok[:, None] * (H * K) + h * K + ck[None, :]
    if L2:
        q = tl.load(q_ptr + tok[:, None] * sq + h * K + ck[None, :], mask=mk, other=0.0)
        k = tl.load(k_ptr + tok[:, None] * sk + h * K + ck[None, :], mask=mk, other=0.0)
        dq = _l2norm_bwd(dq, q, _rows(rq_ptr, tok, H, h, valid, L2), L2)
        dk = _l2norm_bwd(dk, k, _rows(rk_ptr, tok, H, h, valid, L2), L2)
    tl.store(dq_ptr + qk_off, dq.to(dq_ptr.dtype.element_ty), mask=mk)
    tl.store(dk_ptr + qk_off, dk.to(dk_ptr.dtype.element_ty), mask=mk)
