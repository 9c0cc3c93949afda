"""Token-by-token gated delta rule in Triton, for decoding (few tokens per call, state in and out).

Inference only: there is no backward. Call it under ``torch.no_grad()`` (or with inputs that do not
require grad); inputs that require grad raise a ``RuntimeError`` rather than silently cutting the graph.

One program owns one (sequence, value head, V block) and walks its tokens in order, keeping the state
block [K, BV] in fp32 registers:

    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale S^T q_t
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting


@triton.jit
def _recurrent_fwd(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, o_ptr, ht_ptr, cu_ptr, scale,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
                   HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
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
    ck = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    mk = ck < K
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    state_off = ck[:, None] * V + cv[None, :]
    st = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        st = tl.load(h0_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, mask=mkv, other=0.0).to(tl.float32)
    for t in range(eos - bos):
        tok = bos + t
        q = tl.load(q_ptr + tok * (H * K) + h * K + ck, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * (H * K) + h * K + ck, mask=mk, other=0.0).to(tl.float32)
        if L2:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(v_ptr + tok * (HV * V) + hv * V + cv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * HV + hv).to(tl.float32)
        b = tl.load(beta_ptr + tok * HV + hv).to(tl.float32)
        st = st * tl.exp(g)
        delta = b * (v - tl.sum(st * k[:, None], 0))
        st = st + k[:, None] * delta[None, :]
        o = tl.sum(st * q[:, None], 0) * scale
        tl.store(o_ptr + tok * (HV * V) + hv * V + cv, o.to(o_ptr.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(ht_ptr + (n * HV + hv).to(tl.int64) * (K * V) + state_off, st, mask=mkv)


def fused_recurrent_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                            beta: torch.Tensor, scale: float,
                                            initial_state: torch.Tensor | None = None,
                                            output_final_state: bool = False,
                                            use_qk_l2norm_in_kernel: bool = False,
                                            cu_seqlens: torch.Tensor | None = None
                                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule one token at a time (decoding), forward only; use under ``torch.no_grad()``.

    Same layouts as the chunked op: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV];
    initial_state [N, HV, K, V] fp32 (N = B, or len(cu_seqlens) - 1 with B = 1). Returns (o [B, T, HV, V]
    in q's dtype, final state [N, HV, K, V] fp32 or None). The work per call grows linearly with T, so it
    suits decoding and short prefills; use the chunked op for long sequences and for training.
    """
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
            if x is not None and x.requires_grad:
                raise RuntimeError(
                    f"fused_recurrent_gated_delta_rule_triton: {name} requires grad, but this kernel has no "
                    "backward; call it under torch.no_grad() or use chunk_gated_delta_rule for training")
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if K > 256:
        raise ValueError(f"fused_recurrent_gated_delta_rule_triton: q/k head dim K={K} is not supported; "
                         "allowed: K <= 256")
    if cu_seqlens is None:
        N = B
        cu = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int32)
    else:
        N = cu_seqlens.numel() - 1
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    qf = q.reshape(B * T, H, K).contiguous()
    kf = k.reshape(B * T, H, K).contiguous()
    vf = v.reshape(B * T, HV, V).contiguous()
    gf = g.reshape(B * T, HV).contiguous()
    bf = beta.reshape(B * T, HV).contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = torch.empty(B * T, HV, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(N, HV, K, V, device=q.device, dtype=torch.float32) if output_final_state else None
    interp = triton_interpreting()
    BK = max(16, triton.next_power_of_2(K))
    BV = min(triton.next_power_of_2(V), 16 if interp else 32)
    grid = (triton.cdiv(V, BV) * N * HV,)
    _recurrent_fwd[grid](qf, kf, vf, gf, bf, h0 if h0 is not None else o, o, ht if ht is not None else o, cu,
                         float(scale), H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2=bool(use_qk_l2norm_in_kernel),
                         HAS_H0=h0 is not None, STORE_HT=ht is not None, num_warps=1 if interp else 4)
    return o.view(B, T, HV, V), ht
