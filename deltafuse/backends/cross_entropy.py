"""Candidates for the fused linear cross-entropy op, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import (load_attr, torch_supports, triton_available, triton_supports,
                                       triton_auto_skip)
from deltafuse.backends.registry import Candidate, Registry

FUSED_LINEAR_CROSS_ENTROPY = "fused_linear_cross_entropy"
KERNEL = "deltafuse.ops.cross_entropy.kernel"


def register(registry: Registry) -> None:
    registry.register(FUSED_LINEAR_CROSS_ENTROPY, Candidate(
        "triton", load_attr(KERNEL, "fused_linear_cross_entropy_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip,
        note="head projection (cuBLAS) in token chunks x vocabulary blocks + deltafuse's Triton online "
             "softmax/gradient written over each block in place; no [tokens, vocab] tensor"))
    registry.register(FUSED_LINEAR_CROSS_ENTROPY, Candidate(
        "torch", load_attr("deltafuse.ops.cross_entropy.reference", "fused_linear_cross_entropy_torch"),
        supports=torch_supports,
        note="head projection in token chunks x vocabulary blocks + fp32 online softmax in torch, gradients "
             "computed block by block in the forward (any device)"))
