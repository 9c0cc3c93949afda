"""Chunked gated delta rule in Triton: the forward's output kernel.

The chunk algebra and the grid of every kernel are described in ``kernel.py`` (the op's Triton entry;
``chunk_launch.py`` launches this kernel). The sequential pass (``kernel_fwd._state_fwd``) stores the state at
every chunk start and v'; with them the chunks are independent, so the output runs over all chunks at once:

    o = scale ((q rq exp(gc)) h + lower_incl(q k^T rq rk D) v')
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltafuse.ops.gated_delta.kernel_fwd import _chunk_decay, _dot_m, _dot_ma, _rows, chunk_tokens


@triton.jit
def _out_fwd(q_ptr, k_ptr, rq_ptr, rk_ptr, gc_ptr, hs_ptr, vn_ptr, o_ptr, vk_ptr, chunks_ptr, scale, sq, sk,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
             QH: tl.constexpr, SV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, KEEP_V: tl.constexpr):
    """One program per (chunk, value head, V block), on one grid axis with the V blocks fastest, then the value
    heads: the programs that read the same q/k rows run next to each other (L2 hits). The K axis is walked in
    blocks of BK (q h and q k^T accumulate over it). QH / SV: product modes (kernel_fwd._dot_m) of q h (when
    the states are stored in fp32; 16-bit states make it one exact 16-bit product) and of the scores with v'.
    KEEP_V: v' is also written to ``vk_ptr`` in that buffer's dtype (the states' 16 bits, where the forward keeps
    them for the backward: ``ChunkOptions.keep_states``), as the backward's recompute would store it."""
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
        q = tl.load(q_ptr + tok[:, None] * sq + h * K + ck[None, :], mask=valid[:, None] & (ck[None, :] < K),
                    other=0.0)
        # k transposed on load (no tl.trans of a tile)
        kt = tl.load(k_ptr + tok[None, :] * sk + h * K + ck[:, None], mask=(ck[:, None] < K) & valid[None, :],
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
    if KEEP_V:
        tl.store(vk_ptr + tv_off, vn.to(vk_ptr.dtype.element_ty), mask=mv)
    o = _dot_ma(s, vn, o, SV, PREC, DT)
    tl.store(o_ptr + tv_off, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
