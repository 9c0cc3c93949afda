"""Chunked gated delta rule in Triton: the forward's output kernels.

The chunk algebra and the grid of every kernel are described in ``kernel.py`` (the op's Triton entry;
``chunk_launch.py`` launches these kernels). The output of a chunk is

    o = scale ((q rq exp(gc)) h + lower_incl(q k^T rq rk D) v')

``_out_fwd`` forms it for every chunk at once from the chunk states and v' that the sequential pass
(``kernel_fwd._state_fwd``) stored; ``_state_out_fwd`` is that pass with the output formed inside it, from the
state in registers, so that neither is stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltafuse.ops.gated_delta.kernel_fwd import (_chunk_decay, _dot_m, _dot_ma, _rows, chunk_tokens, sequence_program,
                                                state_chunk, state_tile)


@triton.jit
def _out_fwd(q_ptr, k_ptr, rq_ptr, rk_ptr, gc_ptr, hs_ptr, vn_ptr, o_ptr, chunks_ptr, scale,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
             QH: tl.constexpr, SV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """One program per (chunk, value head, V block), on one grid axis with the V blocks fastest, then the value
    heads: the programs that read the same q/k rows run next to each other (L2 hits). The K axis is walked in
    blocks of BK (q h and q k^T accumulate over it). QH / SV: product modes (kernel_fwd._dot_m) of q h (when
    the states are stored in fp32; 16-bit states make it one exact 16-bit product) and of the scores with v'."""
    pid = tl.program_id(0)
    nv = (V + BV - 1) // BV
    pid_v = pid % nv
    pid_ch = pid // nv
    hv = pid_ch % HV
    c = pid_ch // HV
    h = hv // (HV // H)
    start, end, tok, valid = chunk_tokens(chunks_ptr, c)
    if start >= end:  # an empty row of a device-built chunk table (chunk_launch.DevicePlan)
        return
    cv = pid_v * BV + tl.arange(0, BV)
    h_base = hs_ptr + (c.to(tl.int64) * HV + hv) * (K * V)
    acc = tl.zeros([64, BV], dtype=tl.float32)
    s = tl.zeros([64, 64], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        q = tl.load(q_ptr + tok[:, None] * (H * K) + h * K + ck[None, :], mask=valid[:, None] & (ck[None, :] < K),
                    other=0.0)
        # k transposed on load (no tl.trans of a tile)
        kt = tl.load(k_ptr + tok[None, :] * (H * K) + h * K + ck[:, None], mask=(ck[:, None] < K) & valid[None, :],
                     other=0.0)
        hst = tl.load(h_base + ck[:, None] * V + cv[None, :], mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)
        if hst.dtype == tl.float32:
            acc = _dot_m(q, hst, acc, QH, PREC, DT)
        else:
            acc = tl.dot(q, hst, acc=acc)  # both exact in 16 bits: one exact product
        s = tl.dot(q, kt, acc=s, input_precision=PREC)
    gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
    rq = _rows(rq_ptr, tok, H, h, valid, L2)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    o = acc * (rq * tl.where(valid, tl.exp(gc), 0.0))[:, None]
    s = s * _chunk_decay(gc, valid, False) * rq[:, None] * rk[None, :]
    tv_off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
    mv = valid[:, None] & (cv[None, :] < V)
    vn = tl.load(vn_ptr + tv_off, mask=mv, other=0.0)
    o = _dot_ma(s, vn, o, SV, PREC, DT)
    tl.store(o_ptr + tv_off, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _state_out_fwd(q_ptr, k_ptr, rq_ptr, rk_ptr, w_ptr, u_ptr, gc_ptr, h0_ptr, o_ptr, ht_ptr, cu_ptr, coff_ptr, scale,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, HAS_H0: tl.constexpr,
                   STORE_HT: tl.constexpr, S16: tl.constexpr, WH: tl.constexpr, KV: tl.constexpr,
                   QH: tl.constexpr, SV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """The sequential pass and the output in one kernel (``ChunkOptions.fwd_fused``): the grid and the state
    recurrence of ``kernel_fwd._state_fwd``, and each chunk's output formed from the state in registers, so
    neither the chunk states nor v' are written to memory (a forward whose backward recomputes them needs
    neither).

    The products are those of the unfused pair: with 16-bit storage (S16) the state enters q h rounded to 16
    bits and v' enters the scores' product rounded to 16 bits, as ``_out_fwd`` reads them back from ``hs`` and
    v'; the state update takes the unrounded v', as ``_state_fwd`` does. The in-chunk scores q k^T are formed
    once per V block."""
    pid_v, n, hv, h, bos, eos, coff, nt = sequence_program(cu_ptr, coff_ptr, H, HV, V, BV)
    ck, cv, mkv, state_off, st = state_tile(h0_ptr, n, hv, pid_v, HAS_H0, HV, K, V, BK, BV)
    for i in range(nt):
        start = bos + i * 64
        tok, valid, mk, mv, tv_off, gc, gl, dec = state_chunk(rk_ptr, gc_ptr, start, eos, ck, cv, h, hv, H, HV, K,
                                                              V, L2)
        qk_off = tok[:, None] * (H * K) + h * K + ck[None, :]
        w = tl.load(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + qk_off, mask=mk, other=0.0)
        # k transposed on load (no tl.trans of a tile)
        kt = tl.load(k_ptr + tok[None, :] * (H * K) + h * K + ck[:, None], mask=(ck[:, None] < K) & valid[None, :],
                     other=0.0)
        if S16:
            # the state as _out_fwd reads it from 16-bit storage: q h is then one exact 16-bit product
            st16 = st.to(DT)
            acc = tl.dot(q, st16)
            if WH == 1:
                vn = u - tl.dot(w, st16)
            else:
                vn = u - _dot_m(w, st, tl.zeros([64, BV], dtype=tl.float32), WH, PREC, DT)
        else:
            acc = _dot_m(q, st, tl.zeros([64, BV], dtype=tl.float32), QH, PREC, DT)
            vn = u - _dot_m(w, st, tl.zeros([64, BV], dtype=tl.float32), WH, PREC, DT)
        s = tl.dot(q, kt, input_precision=PREC)
        rq = _rows(rq_ptr, tok, H, h, valid, L2)
        rk = _rows(rk_ptr, tok, H, h, valid, L2)
        o = acc * (rq * tl.where(valid, tl.exp(gc), 0.0))[:, None]
        s = s * _chunk_decay(gc, valid, False) * rq[:, None] * rk[None, :]
        o = _dot_ma(s, vn.to(u_ptr.dtype.element_ty), o, SV, PREC, DT)
        tl.store(o_ptr + tv_off, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
        # h_next = exp(gl) h + k^T diag(rk exp(gl - gc)) v'
        st = _dot_m(kt, vn * dec[:, None], st * tl.exp(gl), KV, PREC, DT)
    if STORE_HT:
        tl.store(ht_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, st, mask=mkv)
