"""Candidates for the fused linear cross-entropy and per-token log-probability ops, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import (load_attr, torch_supports, triton_available, triton_supports,
                                       triton_auto_skip)
from deltafuse.backends.registry import REGISTRY, Candidate, Registry

FUSED_LINEAR_CROSS_ENTROPY = "fused_linear_cross_entropy"
TOKEN_LOGPROBS = "token_logprobs"
KERNEL = "deltafuse.ops.cross_entropy.kernel"


def register(registry: Registry) -> None:
    registry.register(FUSED_LINEAR_CROSS_ENTROPY, Candidate(
        "triton", load_attr(KERNEL, "fused_linear_cross_entropy_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip,
        note="head projection (cuBLAS) in token chunks x vocabulary blocks + deltafuse's Triton online "
             "softmax/gradient written over each block in place; no [tokens, vocab] tensor"))
    registry.register(FUSED_LINEAR_CROSS_ENTROPY, Candidate(
        "torch", load_attr("deltafuse.ops.cross_entropy.driver", "fused_linear_cross_entropy_torch"),
        supports=torch_supports,
        note="head projection in token chunks x vocabulary blocks + fp32 online softmax in torch, gradients "
             "computed block by block in the forward (any device)"))
    registry.register(TOKEN_LOGPROBS, Candidate(
        "triton", load_attr(KERNEL, "token_logprobs_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip,
        note="head projection (cuBLAS) in token chunks x vocabulary blocks folded into online statistics by "
             "deltafuse's Triton kernels; frozen head: hidden gradient accumulated in the forward"))
    registry.register(TOKEN_LOGPROBS, Candidate(
        "torch", load_attr("deltafuse.ops.cross_entropy.tokens", "token_logprobs_torch"), supports=torch_supports,
        note="head projection in whole-vocabulary token chunks + fp32 online statistics in torch (any device)"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
