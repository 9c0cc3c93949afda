"""Loop-by-loop causal depthwise conv1d, written for clarity and float64 use in tests.

The oracle for every conv1d implementation: per row, per token, per tap (all channels at once), it adds
weight[:, j] * input[t - (W-1) + j] when that input belongs to the same sequence as token t (inputs before
the row start come from ``initial_states`` and belong to the row's first sequence). Slow and obviously right.
"""

from __future__ import annotations

import torch


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    dtype: torch.dtype = torch.float64,
):
    """Reference of ``causal_conv1d_fn_torch`` computed in ``dtype`` (float64 by default), differentiable.

    Returns out [B, C, T] (and final_states [B, C, W-1] when ``return_final_states``), both in ``dtype``.
    """
    B, C, T = x.shape
    W = weight.shape[1]
    x, weight = x.to(dtype), weight.to(dtype)
    if seq_idx is not None:
        sid = [[int(s) for s in row] for row in seq_idx.tolist()]
    elif cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        sid = [[n for n in range(len(bounds) - 1) for _ in range(bounds[n], bounds[n + 1])]]
    else:
        sid = [[0] * T for _ in range(B)]

    def value(b: int, p: int, seq: int) -> torch.Tensor:
        """Inputs [C] at position p (negative: from initial_states) as seen by a token of sequence ``seq``."""
        if p >= 0:
            return x[b, :, p] if sid[b][p] == seq else x.new_zeros(C)
        if initial_states is None or T == 0 or sid[b][0] != seq:
            return x.new_zeros(C)
        return initial_states[b, :, W - 1 + p].to(dtype)

    rows = []
    finals = []
    for b in range(B):
        outs = []
        for t in range(T):
            acc = bias.to(dtype) if bias is not None else x.new_zeros(C)
            for j in range(W):
                acc = acc + weight[:, j] * value(b, t - (W - 1) + j, sid[b][t])
            if activation in ("silu", "swish"):
                acc = acc * torch.sigmoid(acc)
            outs.append(acc)
        rows.append(torch.stack(outs, -1) if outs else x.new_zeros(C, 0))
        if return_final_states:
            if T == 0:
                finals.append(initial_states[b].to(dtype) if initial_states is not None else x.new_zeros(C, W - 1))
                continue
            last = sid[b][T - 1]
            cols = [value(b, p, last) for p in range(T - (W - 1), T)]
            finals.append(torch.stack(cols, -1) if cols else x.new_zeros(C, 0))
    out = torch.stack(rows)
    if return_final_states:
        return out, torch.stack(finals)
    return out
