"""Candidates for the SDPA attention route (transformers' attention interface), in order of preference."""

from __future__ import annotations

import torch

from deltafuse.backends.common import NPU_UNVERIFIED, load_attr, npu_available, npu_supports, torch_supports
from deltafuse.backends.registry import REGISTRY, CallInfo, Candidate, Registry
from deltafuse.ops.attention.packed import flash_refusal, varlen_api

SDPA = "sdpa_attention"
PACKED_ATTENTION = "packed_causal_attention"


def _varlen_available() -> str | None:
    return None if varlen_api() is not None else "this torch has no torch.nn.attention.varlen.varlen_attn"


def _varlen_supports(call: CallInfo) -> str | None:
    if call.device.type == "cuda" and call.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {call.dtype} is not one of fp16, bf16 (flash attention)"
    return flash_refusal(call.device)


def register(registry: Registry) -> None:
    registry.register(SDPA, Candidate(
        "npu", load_attr("deltafuse.ops.attention.npu", "sdpa_npu"), npu_available("npu_fusion_attention"),
        npu_supports, verified=False,
        note="torch_npu.npu_fusion_attention, layout BNSD, native grouped-query heads, compressed causal mask "
             "(sparse_mode 2); " + NPU_UNVERIFIED))
    registry.register(SDPA, Candidate("transformers", load_attr("deltafuse.ops.attention.route", "stock_attention"),
                                      note="transformers' own sdpa_attention_forward, unchanged (any device)"))
    registry.register(PACKED_ATTENTION, Candidate(
        "varlen", load_attr("deltafuse.ops.attention.packed", "causal_attention_varlen"), _varlen_available,
        _varlen_supports,
        note="torch.nn.attention.varlen.varlen_attn: one flash-attention kernel over all sequences (CUDA, "
             "fp16/bf16; dropout and head sizes above 256 go to the per-sequence loop)"))
    registry.register(PACKED_ATTENTION, Candidate(
        "torch", load_attr("deltafuse.ops.attention.packed", "causal_attention_by_sequence"),
        supports=torch_supports,
        note="causal SDPA sequence by sequence for long packed rows (no [T, T] mask; any device)"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
