"""Step-by-step gated delta rule, written for clarity and float64 use in tests.

This is the oracle every fast implementation is compared with. It follows the recurrence literally,
one token at a time, one sequence at a time, so it is slow and obviously right:

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T (scale * q_t)

with S of shape [K, V] per value head; value head ``hv`` reads query/key head ``hv // (HV // H)``.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's and transformers' definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference gated delta rule computed in ``dtype`` (float64 by default).

    Layouts follow FLA: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; states [N, HV, K, V].
    Returns (o [B, T, HV, V] in ``dtype``, final state [N, HV, K, V] in ``dtype`` or None). Differentiable.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    group = HV // H
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    outs = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(spans):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = torch.zeros(HV, K, V, dtype=dtype, device=q.device)
        for t in range(start, end):
            S = S * g[b, t].exp()[:, None, None]
            kt = k[b, t]  # [HV, K]
            pred = torch.einsum("hkv,hk->hv", S, kt)
            delta = beta[b, t][:, None] * (v[b, t] - pred)
            S = S + kt[:, :, None] * delta[:, None, :]
            outs[b][t] = torch.einsum("hkv,hk->hv", S, q[b, t] * scale)
        finals.append(S)
    o = torch.stack([torch.stack(row, 0) for row in outs], 0) if T > 0 else v.new_zeros(B, 0, HV, V)
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final
