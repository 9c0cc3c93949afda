"""Chunked gated delta rule in Triton: the device helpers and the forward kernels.

The recurrence, the chunk algebra and the grid of every kernel are described in ``kernel.py`` (the op's Triton
entry); ``chunk_launch.py`` launches these kernels; the backward kernels are in ``kernel_bwd.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _inv16_subst(A3):
    """(I + A)^-1 of each strictly lower [16, 16] block of the [4, 16, 16] batch A3, by forward substitution:
    16 dependent row steps, each two masked reductions over the batch tile."""
    r16 = tl.arange(0, 16)
    Ti = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in tl.static_range(16):
        a_row = tl.sum(tl.where(r16[None, :, None] == i, A3, 0.0), axis=1)  # [4, 16] = A3[:, i, :]
        new = tl.where(r16[None, :] == i, 1.0, 0.0) - tl.sum(a_row[:, :, None] * Ti, axis=1)
        Ti = tl.where(r16[None, :, None] == i, new[:, None, :], Ti)
    return Ti


@triton.jit
def _inv16_double(A3):
    """(I + A)^-1 of each strictly lower [16, 16] block of A3 by repeated squaring: A^16 = 0, so
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8); six batched [4, 16, 16] fp32 products. The powers of
    A grow like binomial coefficients when its entries approach 1 and cancel in the product, so this
    loses digits there (tests/ops/test_gdn_triton.py, test_intra_inverse)."""
    r16 = tl.arange(0, 16)
    eye = tl.where(r16[:, None] == r16[None, :], 1.0, 0.0)[None, :, :]
    A2 = tl.dot(A3, A3, input_precision="ieee")
    A4 = tl.dot(A2, A2, input_precision="ieee")
    A8 = tl.dot(A4, A4, input_precision="ieee")
    P = tl.dot(eye - A3, eye + A2, input_precision="ieee")
    P = tl.dot(P, eye + A4, input_precision="ieee")
    return tl.dot(P, eye + A8, input_precision="ieee")


@triton.jit
def _inv16_merge(M, A3, B: tl.constexpr):
    """One step of _inv16_recursive: M holds the inverses of the diagonal BxB blocks; returns those of the
    2Bx2B blocks, [[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]], i.e. M - M A_off M with A_off the
    lower-left BxB part of every 2Bx2B block."""
    r16 = tl.arange(0, 16)
    bi = r16[:, None] // B
    bj = r16[None, :] // B
    off = tl.where(((bi % 2) == 1) & (bj == bi - 1), A3, 0.0)
    return M - tl.dot(tl.dot(M, off, input_precision="ieee"), M, input_precision="ieee")


@triton.jit
def _inv16_recursive(A3):
    """(I + A)^-1 of each strictly lower [16, 16] block of A3 by doubling the inverted block size,
    1 -> 2 (no product) -> 4 -> 8 -> 16: six batched [4, 16, 16] fp32 products, and every intermediate is
    a block of the inverse itself (no cancelling powers), so it is as accurate as the substitution."""
    r16 = tl.arange(0, 16)
    i = r16[:, None]
    j = r16[None, :]
    M = tl.where(i == j, 1.0, 0.0)[None, :, :] - tl.where(((i % 2) == 1) & (j == i - 1), A3, 0.0)
    M = _inv16_merge(M, A3, 2)
    M = _inv16_merge(M, A3, 4)
    return _inv16_merge(M, A3, 8)


@triton.jit
def _unit_lower_inverse(A, PREC: tl.constexpr, INV: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular fp32 [64, 64] tile A.

    The four diagonal 16x16 blocks are inverted all four at once, as a [4, 16, 16] batch: INV 0 by
    forward substitution, 1 by repeated squaring, 2 by recursive doubling of the block size (the last two
    as batched fp32 products). With D the block-diagonal part of I + A and L the rest, I + A = D (I + N)
    with N = D^-1 L strictly block-lower, so N^4 = 0 and (I + A)^-1 = (I - N)(I + N^2) D^-1.
    """
    r64 = tl.arange(0, 64)
    r4 = tl.arange(0, 4)
    same_blk = r4[:, None, None, None] == r4[None, None, :, None]  # [4, 1, 4, 1]
    A4 = tl.reshape(A, [4, 16, 4, 16])
    A3 = tl.sum(tl.where(same_blk, A4, 0.0), axis=2)  # [4, 16, 16]: diagonal blocks
    if INV == 1:
        Ti = _inv16_double(A3)
    elif INV == 2:
        Ti = _inv16_recursive(A3)
    else:
        Ti = _inv16_subst(A3)
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
def _dot_xa(a, b, X2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """a @ b for fp32 ``a`` and ``b`` exact in DT (a loaded input or stored value). X2: ``a`` is split into two DT
    parts (hi + lo) and both go through 16-bit tensor-core products, which keeps about 16 mantissa bits of ``a``;
    otherwise one fp32 product at precision PREC."""
    if X2 and b.dtype != tl.float32:
        ah = a.to(DT)
        al = (a - ah.to(tl.float32)).to(DT)
        return tl.dot(al, b, acc=tl.dot(ah, b))
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


# product modes of a 16-bit operand with an fp32 one (ChunkOptions' "tf32" / "16" / "x2"); chunk_options.PROD_MODES
# maps the option strings to these numbers
MODE_FP32 = tl.constexpr(0)
MODE_16 = tl.constexpr(1)
MODE_X2 = tl.constexpr(2)


@triton.jit
def _dot_m(a, b, acc, MODE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b for ``a`` exact in DT (a loaded input or stored value) and fp32 ``b``, by product mode.

    MODE 2 (x2): ``b`` split into two DT parts (hi + lo), two 16-bit tensor-core products (about 16 mantissa
    bits of ``b`` kept). MODE 1 (16): ``b`` rounded to DT, one 16-bit product. MODE 0, or ``a`` in fp32: one
    fp32 product at precision PREC.
    """
    if MODE == 2 and a.dtype != tl.float32:
        bh = b.to(DT)
        bl = (b - bh.to(tl.float32)).to(DT)
        return tl.dot(a, bl, acc=tl.dot(a, bh, acc=acc))
    elif MODE == 1 and a.dtype != tl.float32:
        return tl.dot(a, b.to(DT), acc=acc)
    else:
        return tl.dot(a.to(tl.float32), b, acc=acc, input_precision=PREC)


@triton.jit
def _dot_ma(a, b, acc, MODE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b for fp32 ``a`` and ``b`` exact in DT (the mirror of _dot_m)."""
    if MODE == 2 and b.dtype != tl.float32:
        ah = a.to(DT)
        al = (a - ah.to(tl.float32)).to(DT)
        return tl.dot(al, b, acc=tl.dot(ah, b, acc=acc))
    elif MODE == 1 and b.dtype != tl.float32:
        return tl.dot(a.to(DT), b, acc=acc)
    else:
        return tl.dot(a, b.to(tl.float32), acc=acc, input_precision=PREC)


@triton.jit
def _rows(r_ptr, tok, H: tl.constexpr, h, valid, L2: tl.constexpr):
    """Per-row l2norm factors rsqrt(|x|^2 + eps) of q or k (ones when the l2norm is off)."""
    if L2:
        return tl.load(r_ptr + tok * H + h, mask=valid, other=0.0)
    else:
        return tl.where(valid, 1.0, 0.0)


@triton.jit
def chunk_tokens(chunks_ptr, c):
    """(start, end, tok, valid) of chunk c (a row of the plan's chunk table: sequence, start, end): its first
    token, the end of its sequence, the 64 token indices from start and which of them are in the sequence."""
    start = tl.load(chunks_ptr + c * 3 + 1).to(tl.int64)
    end = tl.load(chunks_ptr + c * 3 + 2).to(tl.int64)
    tok = start + tl.arange(0, 64)
    return start, end, tok, tok < end


@triton.jit
def sequence_program(cu_ptr, coff_ptr, H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """(pid_v, n, hv, h, bos, eos, coff, nt) of a program of a sequential pass: one grid axis, V blocks fastest
    (the order of the former [V block, sequence x head] grid; a second axis is limited to 65,535 programs, fewer
    than sequences x heads of a row of many short sequences). Its V block, sequence, value head and q/k head, the
    sequence's tokens [bos, eos), its first chunk's index and its number of chunks."""
    pid = tl.program_id(0)
    pid_v = pid % ((V + BV - 1) // BV)
    pid_nh = pid // ((V + BV - 1) // BV)
    n = pid_nh // HV
    hv = pid_nh % HV
    h = hv // (HV // H)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    return pid_v, n, hv, h, bos, eos, coff, tl.cdiv(eos - bos, 64)


@triton.jit
def state_tile(s_ptr, n, hv, pid_v, HAS: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr):
    """(ck, cv, mkv, state_off, st) of a sequential pass's [BK, BV] state tile: its key and value indices, its
    mask, its offsets in a [K, V] state, and the state of sequence n, value head hv loaded from s_ptr in fp32
    (zeros without HAS)."""
    ck = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    state_off = ck[:, None] * V + cv[None, :]
    st = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS:
        st = tl.load(s_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, mask=mkv, other=0.0).to(tl.float32)
    return ck, cv, mkv, state_off, st


@triton.jit
def state_chunk(rk_ptr, gc_ptr, start, eos, ck, cv, h, hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, L2: tl.constexpr):
    """(tok, valid, mk, mv, tv_off, gc, gl, dec) of the chunk from token start in a sequential pass: its tokens,
    which are in the sequence, the key and value masks, the value offsets, the cumulative gates, the gate at the
    chunk's last token and each row's decay to it, rk exp(gl - gc) (0 past the sequence)."""
    tok = start + tl.arange(0, 64)
    valid = tok < eos
    mk = valid[:, None] & (ck[None, :] < K)
    mv = valid[:, None] & (cv[None, :] < V)
    tv_off = tok[:, None] * (HV * V) + hv * V + cv[None, :]
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    gc = tl.load(gc_ptr + tok * HV + hv, mask=valid, other=0.0)
    gl = tl.load(gc_ptr + tl.minimum(start + 63, eos - 1) * HV + hv)
    return tok, valid, mk, mv, tv_off, gc, gl, rk * tl.where(valid, tl.exp(gl - gc), 0.0)


# --------------------------------------------------------------------------------------------------
# forward kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_rstd(x_ptr, sx, r_ptr, tok, valid, h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """rsqrt(|x|^2 + eps) of 64 rows of head h of x (token stride ``sx``) into ``r_ptr`` [tokens, H]."""
    ck = tl.arange(0, BK)
    x = tl.load(x_ptr + tok[:, None] * sx + h * K + ck[None, :], mask=valid[:, None] & (ck[None, :] < K),
                other=0.0).to(tl.float32)
    tl.store(r_ptr + tok * H + h, 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6), mask=valid)


@triton.jit
def _l2norm_rstd(q_ptr, k_ptr, rq_ptr, rk_ptr, TT, sq, sk, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """rsqrt(|x|^2 + eps) per row of q and of k (token strides ``sq`` and ``sk``). Kernels scale products by these
    factors instead of reading normalised copies, so the normalised rows are never rounded to 16 bits."""
    h = tl.program_id(1)
    tok = tl.program_id(0).to(tl.int64) * 64 + tl.arange(0, 64)
    valid = tok < TT
    _store_rstd(q_ptr, sq, rq_ptr, tok, valid, h, H, K, BK)
    _store_rstd(k_ptr, sk, rk_ptr, tok, valid, h, H, K, BK)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) in fp32 as torch computes it (x itself above 20), without overflow for any x: exp's
    argument is clamped, and log1p(e) = log(u) e / (u - 1) with u = 1 + e keeps the digits of e that u drops (e
    itself where u rounds to 1: very negative x)."""
    ex = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + ex
    um1 = u - 1.0
    l1p = tl.where(um1 == 0.0, ex, tl.log(u) * (ex / tl.where(um1 == 0.0, 1.0, um1)))
    return tl.where(x > 20.0, x, l1p)


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)) in fp32, without overflow for any x."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def gate_terms(g_ptr, alog_ptr, dtb_ptr, tok, valid, hv, HV: tl.constexpr, HAS_DT: tl.constexpr):
    """FLA's in-kernel gate of one chunk's tokens and value head ``hv`` from the raw gate a: (x = a + dt_bias,
    A = -exp(A_log), g = A softplus(x)), fp32, 0 on the tokens past the chunk."""
    x = tl.load(g_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
    if HAS_DT:
        x += tl.load(dtb_ptr + hv).to(tl.float32)
    A = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    return x, A, tl.where(valid, A * softplus(x), 0.0)


@triton.jit
def _intra_fwd(k_ptr, rk_ptr, v_ptr, g_ptr, beta_ptr, gc_ptr, w_ptr, u_ptr, tinv_ptr, chunks_ptr, alog_ptr, dtb_ptr,
               sk, sv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, STORE_T: tl.constexpr,
               MODE: tl.constexpr, INV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
               GATE: tl.constexpr, HAS_DT: tl.constexpr, BSIG: tl.constexpr):
    """gc, A, T = (I + A)^-1 (stored when STORE_T), w and u of one chunk and value head. INV: how the diagonal
    16x16 blocks of T are inverted (_unit_lower_inverse); MODE: product mode (_dot_ma) of the fp32 T tiles
    with the 16-bit k and v for w and u. GATE: g holds the raw gate (``gate_terms``, with dt_bias when HAS_DT);
    BSIG: beta holds logits (beta = sigmoid(beta))."""
    pid_c = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    start, end, tok, valid = chunk_tokens(chunks_ptr, pid_c)
    if start >= end:  # an empty row of a device-built chunk table (chunk_launch.DevicePlan)
        return
    rows = tl.arange(0, 64)
    ck = tl.arange(0, BK)
    if GATE:
        _x, _A, g = gate_terms(g_ptr, alog_ptr, dtb_ptr, tok, valid, hv, HV, HAS_DT)
    else:
        g = tl.load(g_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)
    tl.store(gc_ptr + tok * HV + hv, gc, mask=valid)
    b = tl.load(beta_ptr + tok * HV + hv, mask=valid, other=0.0).to(tl.float32)
    if BSIG:
        b = tl.where(valid, sigmoid(b), 0.0)
    rk = _rows(rk_ptr, tok, H, h, valid, L2)
    k = tl.load(k_ptr + tok[:, None] * sk + h * K + ck[None, :], mask=valid[:, None] & (ck[None, :] < K), other=0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=PREC) * rk[:, None] * rk[None, :]
    Tm = _unit_lower_inverse(kk * _chunk_decay(gc, valid, True) * b[:, None], PREC, INV)
    if STORE_T:
        tl.store(tinv_ptr + tok[:, None] * (HV * 64) + hv * 64 + rows[None, :], Tm, mask=valid[:, None])
    eg = tl.where(valid, tl.exp(gc), 0.0)
    # w = T diag(beta exp(gc) rk) k;  u = T diag(beta) v
    w = _dot_ma(Tm * (b * eg * rk)[None, :], k, tl.zeros([64, BK], dtype=tl.float32), MODE, PREC, DT)
    tl.store(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], w.to(w_ptr.dtype.element_ty),
             mask=valid[:, None] & (ck[None, :] < K))
    Tb = Tm * b[None, :]
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        v = tl.load(v_ptr + tok[:, None] * sv + hv * V + cv[None, :], mask=mv, other=0.0)
        u = _dot_ma(Tb, v, tl.zeros([64, BV], dtype=tl.float32), MODE, PREC, DT)
        tl.store(u_ptr + tok[:, None] * (HV * V) + hv * V + cv[None, :], u.to(u_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _state_fwd(k_ptr, rk_ptr, w_ptr, u_ptr, gc_ptr, h0_ptr, hs_ptr, vn_ptr, ht_ptr, cu_ptr, coff_ptr, sk,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
               WH: tl.constexpr, KV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """The sequential pass over chunks, the state in fp32 registers: stores the state at each chunk start (hs)
    and v' = u - w h (vn; ``vn_ptr`` may be ``u_ptr``: each program reads its u tile before it writes the same
    elements). WH / KV: product modes (_dot_m) of w h and of k^T (decayed v')."""
    pid_v, n, hv, h, bos, eos, coff, nt = sequence_program(cu_ptr, coff_ptr, H, HV, V, BV)
    ck, cv, mkv, state_off, st = state_tile(h0_ptr, n, hv, pid_v, HAS_H0, HV, K, V, BK, BV)
    for i in range(nt):
        start = bos + i * 64
        tok, valid, mk, mv, tv_off, gc, gl, dec = state_chunk(rk_ptr, gc_ptr, start, eos, ck, cv, h, hv, H, HV, K,
                                                              V, L2)
        tl.store(hs_ptr + ((coff + i) * HV + hv) * (K * V) + state_off, st.to(hs_ptr.dtype.element_ty), mask=mkv)
        w = tl.load(w_ptr + tok[:, None] * (HV * K) + hv * K + ck[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + tv_off, mask=mv, other=0.0).to(tl.float32)
        vn = u - _dot_m(w, st, tl.zeros([64, BV], dtype=tl.float32), WH, PREC, DT)
        tl.store(vn_ptr + tv_off, vn.to(vn_ptr.dtype.element_ty), mask=mv)
        # k transposed on load (no tl.trans of a tile)
        kt = tl.load(k_ptr + tok[None, :] * sk + h * K + ck[:, None], mask=(ck[:, None] < K) & valid[None, :],
                     other=0.0)
        # h_next = exp(gl) h + k^T diag(rk exp(gl - gc)) v'
        st = _dot_m(kt, vn * dec[:, None], st * tl.exp(gl), KV, PREC, DT)
    if STORE_HT:
        tl.store(ht_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, st, mask=mkv)
