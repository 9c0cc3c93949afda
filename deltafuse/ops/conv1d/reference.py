"""Pure-torch causal depthwise conv1d: the ``torch`` backend, usable on every device.

Layouts are the ones transformers passes (channels before time): x [B, C, T], weight [C, W], bias [C],
conv states [B, C, W-1] (``causal_conv1d_fn``) or [B, C, S >= W-1] (``causal_conv1d_update``).

out[b, c, t] = bias[c] + sum_j weight[c, j] * x[b, c, t - (W-1) + j], then the activation, where inputs
before the start of the row come from ``initial_states`` (zeros when not given) and inputs belonging to
another sequence than token t count as zero.

Numerics: the convolution runs in weight's dtype, like transformers' stock fallback and the causal-conv1d
package (x is cast to weight.dtype, the activation is applied in weight.dtype, the result is cast back to
x's dtype). Without sequence boundaries it is the very same ``F.conv1d`` call as transformers' stock
``causal_conv1d_fn``, so it matches that bit for bit. With boundaries the W taps are summed explicitly,
accumulating in float32 for 16-bit weights (float64 for float64 weights) and rounding once to weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out)
    raise ValueError(f"activation={activation!r} is not supported; allowed: None, 'silu', 'swish'")


def _sequence_ids(seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None, T: int, device) -> torch.Tensor:
    """Sequence id per token [B, T] (B = 1 for cu_seqlens)."""
    if seq_idx is not None:
        return seq_idx
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    positions = torch.arange(T, device=device)
    return torch.searchsorted(cu[1:], positions, right=True)[None]


def causal_conv1d_fn_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
):
    """Causal depthwise conv1d with resets at sequence boundaries.

    Args:
        x: [B, C, T].
        weight: [C, W], any W >= 1.
        bias: [C] or None.
        activation: None, "silu" or "swish" (the latter two are the same function).
        seq_idx: [B, T] integer sequence id per token (causal-conv1d's convention): token t uses the input
            at t - d only when both carry the same id.
        cu_seqlens: [N + 1] offsets of packed sequences along T (B = 1); equivalent to seq_idx = the index
            of the segment holding each token. At most one of seq_idx / cu_seqlens is expected.
        initial_states: [B, C, W-1], the last W-1 inputs of a previous segment of row b. They continue the
            sequence of the row's first token (seq_idx[b, 0], or the first cu_seqlens segment); every other
            sequence of the row starts from zeros.
        return_final_states: also return final_states [B, C, W-1]: the last W-1 inputs of the sequence of
            the row's last token, oldest first, with positions outside that sequence set to 0 (so zero-
            padded on the left when it is shorter than W-1); when that sequence is also the row's first one,
            the missing positions come from ``initial_states``. This is exactly the state to pass as
            ``initial_states`` to continue that sequence. Built from x without a round trip through
            weight's dtype, returned in x's dtype.
        final_states_out: optional [B, C, W-1] tensor that receives the final states (returned as such).

    Returns:
        out [B, C, T] in x's dtype, or (out, final_states) when ``return_final_states``.
    """
    B, C, T = x.shape
    W = weight.shape[1]
    dtype = weight.dtype
    boundaries = seq_idx is not None or cu_seqlens is not None

    if initial_states is None:
        history = x.new_zeros(B, C, W - 1)
    else:
        history = initial_states.to(x.dtype)
    extended = torch.cat([history, x], -1)  # [B, C, W-1+T], x's dtype

    sid = None
    if boundaries:
        sid = _sequence_ids(seq_idx, cu_seqlens, T, x.device).expand(B, T) if T > 0 else None

    if sid is None:
        # No boundaries (or nothing to convolve): the stock computation.
        if T == 0:  # F.conv1d refuses an empty time axis
            out = x[..., :0].to(dtype)  # empty, and still an output of x's graph
        elif initial_states is None:
            out = F.conv1d(x.to(dtype), weight.unsqueeze(1), bias, padding=W - 1, groups=C)[..., :T]
        else:
            out = F.conv1d(extended.to(dtype), weight.unsqueeze(1), bias, padding=0, groups=C)
    else:
        acc = torch.promote_types(dtype, torch.float32)
        xe = extended.to(acc)
        w = weight.to(acc)
        # sequence id of every extended position: history columns belong to the row's first sequence
        sid_ext = torch.cat([sid[:, :1].expand(B, W - 1), sid], -1)  # [B, W-1+T]
        out = None
        for j in range(W):
            same = (sid_ext[:, j : j + T] == sid).unsqueeze(1)  # [B, 1, T]
            term = torch.where(same, xe[..., j : j + T], 0.0) * w[:, j, None]
            out = term if out is None else out + term
        if bias is not None:
            out = out + bias.to(acc)[:, None]
        out = out.to(dtype)

    out = _activate(out, activation).to(x.dtype)
    if not return_final_states:
        return out

    final = extended[..., T:]  # the last W-1 extended positions
    if sid is not None:
        keep = (sid_ext[:, T:] == sid[:, -1:]).unsqueeze(1)
        final = torch.where(keep, final, torch.zeros_like(final))
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Decoding step(s), same semantics as transformers' stock ``causal_conv1d_update``.

    x [B, C, T_new]; conv_state [B, C, S] with S >= W-1 holds the last S inputs and is updated in place
    (shifted left by T_new, the new inputs appended; values pass through weight's dtype on the way, as in
    the stock function). Returns out [B, C, T_new] in x's dtype. The convolution runs over the whole
    [state, x] window exactly as the stock function does, so results are bit-identical to it (only the last
    W-1 state columns influence the output; S is W in transformers' cache, so the extra work is nil).
    """
    C, T_new = x.shape[1], x.shape[2]
    S = conv_state.shape[-1]
    combined = torch.cat([conv_state, x], -1).to(weight.dtype)  # [B, C, S + T_new]
    conv_state.copy_(combined[..., -S:])
    out = F.conv1d(combined, weight.unsqueeze(1), bias, padding=0, groups=C)[..., -T_new:]
    return _activate(out, activation).to(x.dtype)
