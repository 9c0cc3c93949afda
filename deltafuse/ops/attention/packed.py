"""Causal self-attention of a packed batch computed sequence by sequence.

For packed rows (several sequences per row, no padding) transformers' ``sdpa`` path builds a dense
[B, 1, T, T] block-causal mask and evaluates all T x T query/key pairs, most of them masked out. The same
result is causal attention within each sequence: one ``scaled_dot_product_attention(is_causal=True)`` per
sequence (flash-eligible on CUDA, no mask), sum of L_i^2 pairs instead of T^2. Key/value heads are repeated
per sequence for grouped-query attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention_by_sequence(query, key, value, offsets, scaling=None, dropout=0.0):
    """query [B, Hq, T, D], key/value [B, Hk, T, D]; ``offsets``: the sequence starts on the flat B*T axis as
    Python ints (0, ..., B*T; every row start is a sequence start). Returns [B, T, Hq, D] (contiguous), what
    transformers' attention functions return."""
    B, Hq, T, _ = query.shape
    Hk = key.shape[1]
    if Hq % Hk:
        raise ValueError(f"query has {Hq} heads and key {Hk}; the query heads must be a multiple of the key heads")
    group = Hq // Hk
    rows = [[] for _ in range(B)]
    for s, e in zip(offsets[:-1], offsets[1:]):
        if e <= s:
            continue
        b = s // T
        ls, le = s - b * T, e - b * T
        if le > T:
            raise ValueError(f"sequence [{s}, {e}) crosses the end of row {b} (T={T}): rows must start sequences")
        k = key[b:b + 1, :, ls:le]
        v = value[b:b + 1, :, ls:le]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows[b].append(F.scaled_dot_product_attention(query[b:b + 1, :, ls:le], k, v, dropout_p=dropout,
                                                      is_causal=True, scale=scaling))
    out = torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)
    return out.transpose(1, 2).contiguous()
