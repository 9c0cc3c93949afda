"""Attention routes for transformers' attention interface.

Not public ops: transformers' own attention functions serve every call that has no route here. The routes:
Ascend's fused attention kernel (``npu.sdpa_npu``) for npu tensors, and sequence-by-sequence causal attention
(``packed.causal_attention_by_sequence``) for long packed rows whose mask is block-causal.
"""

from __future__ import annotations

from deltafuse.ops.attention import candidates  # noqa: F401  (registers the candidates first)
from deltafuse.ops.attention.route import packed_attention, sdpa_route, stock_attention

__all__ = ["packed_attention", "sdpa_route", "stock_attention"]
