"""Token-by-token gated delta rule in Triton, for decoding (few tokens per call, state in and out).

The kernel has no backward: called directly with inputs that require grad it raises a ``RuntimeError`` rather
than silently cutting the graph. The op's Triton candidate is ``recurrent_or_chunked``: calls without gradients run
this kernel, calls that need gradients run the chunked kernels (``kernel.py``, forward and backward), which
evaluate the same recurrence in chunks of 64 tokens (equal up to rounding; both are held to the float64 oracle).

One program owns one (sequence, value head, V block) and walks its tokens in order, keeping the state
block [K, BV] in fp32 registers; the state is read once and written once per call:

    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale S^T q_t

Per token both reductions over K read the *old* state (so they run side by side and the update is one
elementwise pass): with d = exp(g_t), delta = beta_t (v_t - d S^T k_t) and
o_t = scale (d S^T q_t + (k_t . q_t) delta), the same quantities in exact arithmetic.

What decoding costs here, and what the host side avoids. At batch 1 a call moves ~4 MB (Qwen3.5: 32 heads
of a 128x128 fp32 state, read and written) and is bound by launch latency; at batch 128 it moves ~0.5 GB and
is bound by memory bandwidth. So: q, k, v, g, beta are read through their strides (transformers hands
q/k/v as strided views of the conv output: no ``.contiguous()`` copies), equal-length rows need no offsets
tensor (none is built), and the final state can be written over the initial one (``inplace_final_state``),
which makes the cache's ``copy_`` of the new state a no-op (torch skips a copy onto itself) and halves the
state traffic of a decoding step. Tile sizes and warps are fields of ``RecurrentOptions``.

FLA's in-kernel gate options (``gates=Gates(...)``, see ``gates.py``) are computed here per token, in fp32, from
what the call hands the kernel: with ``gate``, g holds the raw gate a and the decay is
g = -exp(A_log[hv]) * softplus(a + dt_bias[hv]) (A_log and dt_bias read once per program); with
``beta_sigmoid``, beta holds logits and beta = sigmoid(beta). Without them the kernel is the plain one.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops._scoped import ScopedDefault
from deltafuse.ops.gated_delta.gates import Gates
from deltafuse.ops.gated_delta.kernel import chunk_gated_delta_rule_triton
from deltafuse.ops.gated_delta.kernel_fwd import sigmoid, softplus


@dataclasses.dataclass(frozen=True)
class RecurrentOptions:
    """Tunables of the recurrent kernel on a GPU (the interpreter uses its own small fixed tiles).

    ``bv``: value-tile width (columns of the state one program owns) when the call has enough programs;
    ``bv_min`` / ``min_programs``: when N * HV * ceil(V / bv) programs are fewer than ``min_programs`` (batch 1
    has 32 heads: 128 programs at bv=32 on a GPU of 132 SMs), the tile is halved down to ``bv_min`` so that
    more programs share the state's bytes. ``warps``: warps per program, 0 = one warp per 1024 state
    elements (at most 8); head sizes under 64 use at most 2 (4-8 warps gave wrong results on the H200 for
    the chunked kernels). ``stages``: software-pipelining stages of the token loop.
    """

    bv: int = 32
    bv_min: int = 8
    min_programs: int = 512
    warps: int = 0
    stages: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "warps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RecurrentOptions.{f.name}={value!r}; allowed: an int >= {low}")
        for name in ("bv", "bv_min", "warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"RecurrentOptions.{name}={value!r}; allowed: a power of two"
                                 + (" or 0 (automatic)" if name == "warps" else ""))
        if self.bv_min > self.bv:
            raise ValueError(f"RecurrentOptions.bv_min={self.bv_min} is over bv={self.bv}; allowed: bv_min <= bv")


DEFAULT_OPTIONS = RecurrentOptions()
# the options of calls that pass none: the defaults, except where a ``configured`` block reaches (ops._scoped)
_DEFAULT: ScopedDefault[RecurrentOptions] = ScopedDefault("deltafuse_recurrent_options", DEFAULT_OPTIONS)


def options_in_effect() -> RecurrentOptions:
    """The options a call that passes none runs with now (the defaults outside a ``configured`` block)."""
    return _DEFAULT.get()


def _resolve(options) -> RecurrentOptions:
    """``options`` when given (checked), else those in effect."""
    if options is None:
        return _DEFAULT.get()
    if not isinstance(options, RecurrentOptions):
        raise TypeError(f"options must be a RecurrentOptions or None, got {type(options).__name__}")
    return options


def configured(options: RecurrentOptions | None = None):
    """Calls of the recurrent kernel inside the block that pass no ``options`` run with these (a benchmark's
    sweep); each call reads them once, at its start. What was in effect before is restored on exit. The block also
    reaches calls during a backward that no block of their own reaches (a checkpoint's recompute on autograd's
    thread; ``deltafuse.ops._scoped``)."""
    return _DEFAULT.block(DEFAULT_OPTIONS if options is None else _resolve(options))


def _pow2(n: int) -> int:
    """The smallest power of two >= n (host-side; Triton's helpers are slow to call from Python)."""
    return 1 << max(0, int(n) - 1).bit_length()


def launch_config(N: int, HV: int, K: int, V: int, options: RecurrentOptions | None = None,
                  interpreting: bool | None = None) -> tuple[int, int, int, int]:
    """(BK, BV, warps, stages) the kernel runs with for N sequences of HV heads of size K x V. The interpreter
    uses small fixed tiles unless options other than the defaults are given (tests of the options)."""
    opts = _resolve(options)
    interp = triton_interpreting() if interpreting is None else interpreting
    return _launch_config(N, HV, K, V, opts, bool(interp))


@functools.lru_cache(maxsize=1024)
def _launch_config(N: int, HV: int, K: int, V: int, opts: RecurrentOptions, interp: bool):
    BK = max(16, _pow2(K))
    vmax = max(8, _pow2(V))
    if interp and opts == DEFAULT_OPTIONS:
        return BK, min(vmax, 16), 1, 1
    bv = min(vmax, opts.bv)
    floor = min(vmax, opts.bv_min)
    while bv > floor and N * HV * -(-V // bv) < opts.min_programs:
        bv //= 2
    warps = opts.warps or max(1, min(8, BK * bv // 1024))
    if min(BK, _pow2(V)) < 64:
        warps = min(warps, 2)
    return BK, bv, warps, opts.stages


@triton.jit
def _recurrent_fwd(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, o_ptr, ht_ptr, cu_ptr, alog_ptr, dtb_ptr, scale,
                   T, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sb_b, sb_t,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, IS_VARLEN: tl.constexpr,
                   HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STAGES: tl.constexpr,
                   GATE: tl.constexpr, HAS_DT: tl.constexpr, BSIG: tl.constexpr):
    # one grid axis, V blocks fastest: a second axis is limited to 65,535 programs, fewer than sequences x
    # heads of a row of many short sequences
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    pid_v = pid % NV
    pid_nh = pid // NV
    n = (pid_nh // HV).to(tl.int64)
    hv = pid_nh % HV
    h = hv // (HV // H)
    if IS_VARLEN:  # B = 1: sequence n is tokens [bos, eos) of the row
        bos = tl.load(cu_ptr + n).to(tl.int64)
        length = tl.load(cu_ptr + n + 1).to(tl.int64) - bos
        p_q = q_ptr + bos * sq_t + h * sq_h
        p_k = k_ptr + bos * sk_t + h * sk_h
        p_v = v_ptr + bos * sv_t + hv * sv_h
        p_g = g_ptr + bos * sg_t + hv
        p_b = beta_ptr + bos * sb_t + hv
        p_o = o_ptr + (bos * HV + hv) * V
    else:  # sequence n is row n
        length = T
        p_q = q_ptr + n * sq_b + h * sq_h
        p_k = k_ptr + n * sk_b + h * sk_h
        p_v = v_ptr + n * sv_b + hv * sv_h
        p_g = g_ptr + n * sg_b + hv
        p_b = beta_ptr + n * sb_b + hv
        p_o = o_ptr + (n * T * HV + hv) * V
    ck = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    mk = ck < K
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    state_off = (n * HV + hv) * (K * V) + ck[:, None] * V + cv[None, :]
    if HAS_H0:
        st = tl.load(h0_ptr + state_off, mask=mkv, other=0.0).to(tl.float32)
    else:
        st = tl.zeros([BK, BV], dtype=tl.float32)
    if GATE:  # per head: -exp(A_log) and dt_bias, once per program
        neg_a = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
        if HAS_DT:
            dtb = tl.load(dtb_ptr + hv).to(tl.float32)
    for t in tl.range(0, length, num_stages=STAGES):
        q = tl.load(p_q + t * sq_t + ck, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(p_k + t * sk_t + ck, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(p_v + t * sv_t + cv, mask=mv, other=0.0).to(tl.float32)
        if GATE:  # g holds the raw gate a: g = -exp(A_log) * softplus(a + dt_bias)
            x = tl.load(p_g + t * sg_t).to(tl.float32)
            if HAS_DT:
                x = x + dtb
            d = tl.exp(neg_a * softplus(x))  # softplus as torch's (kernel_fwd.softplus)
        else:
            d = tl.exp(tl.load(p_g + t * sg_t).to(tl.float32))
        b = tl.load(p_b + t * sb_t).to(tl.float32)
        if BSIG:  # beta holds logits
            b = sigmoid(b)
        if L2:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        # both reductions read the old state; the update is then one elementwise pass
        sk = tl.sum(st * k[:, None], 0) * d
        sq = tl.sum(st * q[:, None], 0) * d
        delta = b * (v - sk)
        o = (sq + tl.sum(k * q, 0) * delta) * scale
        st = st * d + k[:, None] * delta[None, :]
        tl.store(p_o + t * (HV * V) + cv, o.to(o_ptr.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(ht_ptr + state_off, st, mask=mkv)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is dense (the kernel reads the others through their strides), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def fused_recurrent_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                            beta: torch.Tensor, scale: float,
                                            initial_state: torch.Tensor | None = None,
                                            output_final_state: bool = False,
                                            use_qk_l2norm_in_kernel: bool = False,
                                            cu_seqlens: torch.Tensor | None = None,
                                            inplace_final_state: bool = False,
                                            options: RecurrentOptions | None = None,
                                            gates: Gates | None = None,
                                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule one token at a time (decoding), forward only; use under ``torch.no_grad()``.

    Same layouts as the chunked op: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (any strides; a
    head dimension that is not dense is copied); initial_state [N, HV, K, V] (N = B, or len(cu_seqlens) - 1
    with B = 1). Returns (o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32 or None). The work per
    call grows linearly with T, so it suits decoding and short prefills; use the chunked op for long sequences
    and for training.

    ``inplace_final_state=True`` (with ``output_final_state`` and an fp32 contiguous ``initial_state``) writes
    the final state over ``initial_state`` and returns that tensor: what a decoding cache that replaces its
    state with the new one wants (no allocation, and the cache's copy of the result onto its state is a copy
    onto itself). ``options``: the tunables (default: those in effect, see ``configured``), read once, here.

    ``gates``: FLA's in-kernel gate options (``Gates``), computed in the kernel in fp32: with ``gates.gate``, g
    holds the raw gate a and the decay is -exp(A_log) * softplus(a + dt_bias) (A_log, dt_bias [HV], any float
    dtype; dt_bias may be None); with ``gates.beta_sigmoid``, beta holds logits. None: g and beta as they are.
    """
    gate = gates is not None and bool(gates.gate)
    bsig = gates is not None and bool(gates.beta_sigmoid)
    a_log = gates.A_log if gate else None
    dt_bias = gates.dt_bias if gate else None
    if gate and a_log is None:
        raise ValueError("fused_recurrent_gated_delta_rule_triton: gates.gate=True needs gates.A_log ([HV]); "
                         "got A_log=None")
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                        ("gates.A_log", a_log), ("gates.dt_bias", dt_bias)):
            if x is not None and x.requires_grad:
                raise RuntimeError(
                    f"fused_recurrent_gated_delta_rule_triton: {name} requires grad, but this kernel has no "
                    "backward; call it under torch.no_grad() or use chunk_gated_delta_rule for training")
    options = _resolve(options)
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if K > 256:
        raise ValueError(f"fused_recurrent_gated_delta_rule_triton: q/k head dim K={K} is not supported; "
                         "allowed: K <= 256")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    inplace = bool(inplace_final_state) and bool(output_final_state)
    if inplace:
        if initial_state is None:
            raise ValueError("fused_recurrent_gated_delta_rule_triton: inplace_final_state=True needs an "
                             "initial_state to write the final state into; got initial_state=None")
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("fused_recurrent_gated_delta_rule_triton: inplace_final_state=True needs a "
                             "contiguous fp32 initial_state; got "
                             f"{str(initial_state.dtype).replace('torch.', '')} with strides "
                             f"{tuple(initial_state.stride())}")
    q, k, v, g, beta = (_strided(x) for x in (q, k, v, g, beta))
    if gate:  # [HV], read at hv: a dense copy only of a strided one
        a_log = a_log if a_log.is_contiguous() else a_log.contiguous()
        dt_bias = dt_bias if dt_bias is None or dt_bias.is_contiguous() else dt_bias.contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    o = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    if inplace:
        ht = h0
    elif output_final_state:
        ht = torch.empty(N, HV, K, V, device=q.device, dtype=torch.float32)
    else:
        ht = None
    if B * T == 0 or N == 0:
        if ht is not None and h0 is None:
            ht.zero_()
        elif ht is not None and ht is not h0:
            ht.copy_(h0)
        return o, ht
    BK, BV, warps, stages = launch_config(N, HV, K, V, options)
    grid = (-(-V // BV) * N * HV,)
    sq, sk, sv, sg, sb = q.stride(), k.stride(), v.stride(), g.stride(), beta.stride()
    _recurrent_fwd[grid](q, k, v, g, beta, o if h0 is None else h0, o, o if ht is None else ht,
                         o if cu_seqlens is None else cu_seqlens, o if a_log is None else a_log,
                         o if dt_bias is None else dt_bias, float(scale), T,
                         sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sg[0], sg[1], sb[0], sb[1],
                         H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2=bool(use_qk_l2norm_in_kernel),
                         IS_VARLEN=cu_seqlens is not None, HAS_H0=h0 is not None, STORE_HT=ht is not None,
                         STAGES=stages, GATE=gate, HAS_DT=dt_bias is not None, BSIG=bsig, num_warps=warps)
    return o, ht


# the op layer passes inplace_final_state=True only to implementations that declare they take it
fused_recurrent_gated_delta_rule_triton.inplace_final_state = True
# ... and ``gates=`` (FLA's in-kernel gate options, computed in the kernel) only to those that declare that
fused_recurrent_gated_delta_rule_triton.gates_in_kernel = True


def recurrent_or_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                         use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                         inplace_final_state: bool = False, gates: Gates | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrent op's Triton candidate: this kernel for a call that autograd will not differentiate
    (decoding), the chunked Triton kernels, forward and backward, for one it will (training through the recurrent
    op, as FLA's ``fused_recurrent_gated_delta_rule`` allows). Same arguments and results as
    ``fused_recurrent_gated_delta_rule_triton``; ``inplace_final_state`` applies to the first route only (the op
    refuses it with gradients)."""
    if torch.is_grad_enabled() and any(
            x is not None and x.requires_grad
            for x in (q, k, v, g, beta, initial_state, *((gates.A_log, gates.dt_bias) if gates is not None else ()))):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, cu_seqlens, gates=gates)
    return fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                   use_qk_l2norm_in_kernel, cu_seqlens,
                                                   inplace_final_state=inplace_final_state, gates=gates)


recurrent_or_chunked.inplace_final_state = True
recurrent_or_chunked.gates_in_kernel = True
