"""Candidates for the SDPA attention route (transformers' attention interface), in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import NPU_UNVERIFIED, load_attr, npu_available, npu_supports
from deltafuse.backends.registry import Candidate, Registry

SDPA = "sdpa_attention"


def register(registry: Registry) -> None:
    registry.register(SDPA, Candidate(
        "npu", load_attr("deltafuse.ops.attention.npu", "sdpa_npu"), npu_available("npu_fusion_attention"),
        npu_supports, verified=False,
        note="torch_npu.npu_fusion_attention, layout BNSD, native grouped-query heads, compressed causal mask "
             "(sparse_mode 2); " + NPU_UNVERIFIED))
    registry.register(SDPA, Candidate("transformers", load_attr("deltafuse.ops.attention", "stock_attention"),
                                      note="transformers' own sdpa_attention_forward, unchanged (any device)"))
