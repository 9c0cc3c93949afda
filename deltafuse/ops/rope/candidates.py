"""Candidates for the partial RoPE op, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import (NPU_UNVERIFIED, load_attr, npu_available, npu_supports,
                                       torch_supports, triton_auto_skip, triton_available, triton_supports)
from deltafuse.backends.registry import REGISTRY, Candidate, Registry

ROPE = "apply_rotary_pos_emb"
KERNEL = "deltafuse.ops.rope.kernel"


def register(registry: Registry) -> None:
    registry.register(ROPE, Candidate(
        "triton", load_attr(KERNEL, "apply_rotary_pos_emb_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip,
        note="deltafuse's Triton partial RoPE for q and k in one pass (fwd+bwd); its bf16 forward is bit-equal "
             "to transformers' (compiled without floating-point contraction)"))
    registry.register(ROPE, Candidate(
        "npu", load_attr("deltafuse.ops.rope.npu", "apply_rotary_pos_emb_npu"), npu_available("npu_rotary_mul"),
        npu_supports, verified=False,
        note="torch_npu.npu_rotary_mul on the rotated slice, rest concatenated; " + NPU_UNVERIFIED))
    registry.register(ROPE, Candidate(
        "torch", load_attr("deltafuse.ops.rope.reference", "apply_rotary_pos_emb_torch"), supports=torch_supports,
        note="transformers' formula in torch (any device)"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
