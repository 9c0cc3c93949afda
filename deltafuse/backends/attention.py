"""Candidates for the SDPA attention route (transformers' attention interface), in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import NPU_UNVERIFIED, load_attr, npu_available, npu_supports, torch_supports
from deltafuse.backends.registry import Candidate, Registry

SDPA = "sdpa_attention"
PACKED_ATTENTION = "packed_causal_attention"


def register(registry: Registry) -> None:
    registry.register(SDPA, Candidate(
        "npu", load_attr("deltafuse.ops.attention.npu", "sdpa_npu"), npu_available("npu_fusion_attention"),
        npu_supports, verified=False,
        note="torch_npu.npu_fusion_attention, layout BNSD, native grouped-query heads, compressed causal mask "
             "(sparse_mode 2); " + NPU_UNVERIFIED))
    registry.register(SDPA, Candidate("transformers", load_attr("deltafuse.ops.attention", "stock_attention"),
                                      note="transformers' own sdpa_attention_forward, unchanged (any device)"))
    registry.register(PACKED_ATTENTION, Candidate(
        "torch", load_attr("deltafuse.ops.attention.packed", "causal_attention_by_sequence"),
        supports=torch_supports,
        note="causal SDPA sequence by sequence for long packed rows (no [T, T] mask; any device)"))
