"""Step-by-step gated delta rule, written for clarity and float64 use in tests.

This is the oracle every fast implementation is compared with. It follows the recurrence literally,
one token at a time, one sequence at a time, so it is slow and obviously right:

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T (scale * q_t)

with S of shape [K, V] per value head; value head ``hv`` reads query/key head ``hv // (HV // H)``.

With gradients, autograd would keep every token's [HV, K, V] state (about 40 GiB in float64 for 4,097 tokens at
32 value heads and 128 x 128 states, which ran GPU test workers out of memory): sequences longer than
``checkpoint_tokens`` are therefore run in segments of that many tokens under ``torch.utils.checkpoint``, which keeps
only each segment's starting state and recomputes the segment's steps, the same operations in the same order, for
the backward. The values and gradients are those of the plain loop.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


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
    checkpoint_tokens: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference gated delta rule computed in ``dtype`` (float64 by default).

    Layouts follow FLA: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; states [N, HV, K, V].
    Returns (o [B, T, HV, V] in ``dtype``, final state [N, HV, K, V] in ``dtype`` or None). Differentiable; with
    gradients enabled, sequences longer than ``checkpoint_tokens`` (0: never) are checkpointed in segments of that
    many tokens (module docstring).
    """
    if not isinstance(checkpoint_tokens, int) or isinstance(checkpoint_tokens, bool) or checkpoint_tokens < 0:
        raise ValueError(f"checkpoint_tokens={checkpoint_tokens!r}; allowed: an int >= 0 (0: no checkpointing)")
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
    inputs = (q, k, v, g, beta, initial_state)
    tracked = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    rows = [[] for _ in range(B)]  # per row: its outputs [tokens, HV, V], span by span
    finals = []
    for n, (b, start, end) in enumerate(spans):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = torch.zeros(HV, K, V, dtype=dtype, device=q.device)
        length = end - start
        step = checkpoint_tokens if tracked and 0 < checkpoint_tokens < length else max(length, 1)
        for s0 in range(start, end, step):
            part = slice(s0, min(s0 + step, end))
            args = (S, q[b, part], k[b, part], v[b, part], g[b, part], beta[b, part], scale)
            if step < length:
                out, S = checkpoint(_steps, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                out, S = _steps(*args)
            rows[b].append(out)
        finals.append(S)
    o = torch.stack([torch.cat(r, 0) for r in rows], 0) if T > 0 else v.new_zeros(B, 0, HV, V)
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final


def _steps(S, q, k, v, g, beta, scale):
    """The recurrence over consecutive tokens of one sequence from state S: (outputs [tokens, HV, V], final S)."""
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - pred)
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t] * scale))
    return torch.stack(outs, 0), S
