"""Ascend NPU route for transformers' SDPA attention through ``torch_npu.npu_fusion_attention``.

NOT RUN ON NPU HARDWARE. The argument mapping follows Ascend's torch_npu documentation of
``npu_fusion_attention`` and was verified only against a stand-in (tests/integrations/test_attention_npu.py)
that implements the documented semantics in torch:

- layout "BNSD": query [B, N1, S1, D], key/value [B, N2, S2, D] as transformers passes them; N1 a multiple of
  N2 (grouped-query attention is native, no repeated k/v); ``head_num`` = N1; the output [B, N1, S1, D] is
  returned as transformers' [B, S1, N1, D].
- ``atten_mask`` marks positions that do NOT take part (True / 1 = masked): transformers' boolean masks
  (True = attend) are inverted, float masks are masked where negative.
- causal attention without a mask uses ``sparse_mode=2`` (upper-left aligned causal) with the documented
  compressed 2048 x 2048 upper-triangular mask, so no [S1, S2] mask is built; as in transformers' SDPA
  function, a prefill whose keys are longer than its queries keeps only the first S1 keys.
- ``scale`` = the layer's scaling (default D^-0.5), ``keep_prob`` = 1 - dropout.
"""

from __future__ import annotations

import torch

_CAUSAL_MASKS: dict = {}


def _compressed_causal_mask(device) -> torch.Tensor:
    key = str(device)
    mask = _CAUSAL_MASKS.get(key)
    if mask is None:
        mask = _CAUSAL_MASKS[key] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return mask


def sdpa_npu(query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=True):
    """transformers' ``sdpa_attention_forward`` contract (without position bias or softcap): returns the
    attention output [B, S1, N1, D] (contiguous)."""
    import torch_npu

    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal) and q_len > 1 and attention_mask is None
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if attention_mask is not None:
        masked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
        mask, sparse_mode = masked.to(query.device), 0
    elif causal:
        mask, sparse_mode = _compressed_causal_mask(query.device), 2
    else:
        mask, sparse_mode = None, 0
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch_npu.npu_fusion_attention(query, key, value, query.shape[1], "BNSD", atten_mask=mask,
                                         scale=scale, keep_prob=1.0 - float(dropout), sparse_mode=sparse_mode)[0]
    return out.transpose(1, 2).contiguous()
