"""Candidates for the MoE experts op, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import (NPU_UNVERIFIED, load_attr, npu_available, npu_supports, torch_supports,
                                       triton_auto_skip, triton_available, triton_supports)
from deltafuse.backends.registry import REGISTRY, Candidate, Registry

MOE_EXPERTS = "moe_experts"
KERNEL = "deltafuse.ops.moe.kernel"


def register(registry: Registry) -> None:
    registry.register(MOE_EXPERTS, Candidate(
        "triton", load_attr(KERNEL, "moe_experts_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip,
        note="the torch reference's routing with the two per-token sums over each token's slots (the weighted "
             "output, the hidden-state gradient) in one Triton pass each (fp32 accumulator, deterministic); on "
             "the H200 (compute capability 9.0) also the forward and data-gradient grouped matmuls, the routed rows "
             "gathered inside the kernel; elsewhere torch's grouped matmuls"))
    registry.register(MOE_EXPERTS, Candidate(
        "npu", load_attr("deltafuse.ops.moe.npu", "moe_experts_npu"), npu_available("npu_grouped_matmul"),
        npu_supports, verified=False,
        note="the torch reference's autograd Function with its grouped matmuls on torch_npu.npu_grouped_matmul "
             "(split_item=3; group_type=0 for the forward and data gradients, 2 for the weight gradients; "
             "empty experts' weight gradients zeroed explicitly); " + NPU_UNVERIFIED))
    registry.register(MOE_EXPERTS, Candidate(
        "torch", load_attr("deltafuse.ops.moe.reference", "moe_experts_torch"), supports=torch_supports,
        note="sort by expert, grouped matmuls (torch grouped_mm where it works for the device/dtype, else a "
             "loop over experts), fused SiLU*up, deterministic weighted un-permute; a lean autograd Function "
             "that keeps only the gate_up output for the backward (any device)"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
