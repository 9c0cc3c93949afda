"""Candidates for the RMSNorm ops, in order of preference."""

from __future__ import annotations

from deltafuse.backends.common import (NPU_UNVERIFIED, load_attr, npu_available, npu_supports,
                                       torch_supports, triton_available, triton_supports,
                                       triton_auto_skip)
from deltafuse.backends.registry import REGISTRY, Candidate, Registry

RMS_NORM = "rms_norm_zero_centered"
RMS_NORM_GATED = "rms_norm_gated"


KERNEL = "deltafuse.ops.norm.kernel"


def register(registry: Registry) -> None:
    registry.register(RMS_NORM, Candidate(
        "triton", load_attr(KERNEL, "rms_norm_zero_centered_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip, note="deltafuse's fused Triton RMSNorm (fwd+bwd)"))
    registry.register(RMS_NORM, Candidate(
        "npu", load_attr("deltafuse.ops.norm.npu", "rms_norm_zero_centered_npu"), npu_available("npu_rms_norm"),
        npu_supports, verified=False,
        note="torch_npu.npu_rms_norm in fp32 with gamma = 1 + weight built per call; " + NPU_UNVERIFIED))
    registry.register(RMS_NORM, Candidate(
        "torch", load_attr("deltafuse.ops.norm.reference", "rms_norm_zero_centered_torch"), supports=torch_supports,
        note="transformers' formula in torch (any device)"))
    registry.register(RMS_NORM_GATED, Candidate(
        "triton", load_attr(KERNEL, "rms_norm_gated_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip, note="deltafuse's fused Triton gated RMSNorm (fwd+bwd)"))
    registry.register(RMS_NORM_GATED, Candidate(
        "torch", load_attr("deltafuse.ops.norm.reference", "rms_norm_gated_torch"), supports=torch_supports,
        note="transformers' formula in torch (any device; torch_npu has no fused gated norm)"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
