"""Candidates for the MoE experts op, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import load_attr, torch_supports
from deltafuse.backends.registry import Candidate, Registry

MOE_EXPERTS = "moe_experts"


def register(registry: Registry) -> None:
    registry.register(MOE_EXPERTS, Candidate(
        "torch", load_attr("deltafuse.ops.moe.reference", "moe_experts_torch"), supports=torch_supports,
        note="sort by expert, grouped matmuls (torch grouped_mm where it works for the device/dtype, else a "
             "loop over experts), fused SiLU*up, deterministic weighted un-permute; a lean autograd Function "
             "that keeps only the gate_up output for the backward (any device)"))
