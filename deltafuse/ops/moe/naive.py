"""Float64 oracle for the MoE experts, one (token, expert) slot at a time (no shared code with the ops)."""

from __future__ import annotations

import torch


def naive_moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, dtype=torch.float64):
    """out[n] = sum_j w[n, j] * down[e] @ (silu(gate) * up), [gate; up] = gate_up[e] @ hidden[n], e = idx[n, j]."""
    x, w = hidden.to(dtype), top_k_weights.to(dtype)
    gu_all, dn_all = gate_up_proj.to(dtype), down_proj.to(dtype)
    inter = dn_all.shape[2]
    rows = []
    for n in range(x.shape[0]):
        acc = x.new_zeros(x.shape[1])
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[n, j])
            gu = gu_all[e] @ x[n]
            gate, up = gu[:inter], gu[inter:]
            acc = acc + w[n, j] * (dn_all[e] @ (gate / (1 + torch.exp(-gate)) * up))
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
