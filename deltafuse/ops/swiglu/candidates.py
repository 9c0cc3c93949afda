"""Candidates for the SwiGLU activation op, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import (NPU_UNVERIFIED, load_attr, npu_available, npu_supports,
                                       torch_supports, triton_available, triton_supports,
                                       triton_forced_only)
from deltafuse.backends.registry import REGISTRY, Candidate, Registry

SWIGLU = "swiglu"
KERNEL = "deltafuse.ops.swiglu.kernel"


def register(registry: Registry) -> None:
    registry.register(SWIGLU, Candidate(
        "triton", load_attr(KERNEL, "swiglu_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_forced_only(
            "slower than transformers' torch formula on the H200 (fwd+bwd 0.28x at the shared expert and 0.44x "
            "at the routed experts' sizes, 4096 tokens; BENCHMARKS.md#block-ops)"),
         note="deltafuse's fused Triton silu(gate) * up (fwd+bwd)"))
    registry.register(SWIGLU, Candidate(
        "npu", load_attr("deltafuse.ops.swiglu.npu", "swiglu_npu"), npu_available("npu_swiglu"), npu_supports,
        verified=False, note="torch_npu.npu_swiglu on cat(gate, up); " + NPU_UNVERIFIED))
    registry.register(SWIGLU, Candidate(
        "torch", load_attr("deltafuse.ops.swiglu.reference", "swiglu_torch"), supports=torch_supports,
        note="transformers' formula in torch (any device)"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
