"""Candidates for the causal depthwise conv1d ops of the GDN layer."""

from __future__ import annotations

from deltafuse.backends.common import (load_attr, torch_supports, triton_available, triton_supports,
                                       triton_auto_skip)
from deltafuse.backends.registry import REGISTRY, Candidate, Registry

CONV = "causal_conv1d_fn"
CONV_UPDATE = "causal_conv1d_update"
KERNEL = "deltafuse.ops.conv1d.kernel"
REFERENCE = "deltafuse.ops.conv1d.reference"


def register(registry: Registry) -> None:
    registry.register(CONV, Candidate(
        "triton", load_attr(KERNEL, "causal_conv1d_fn_triton"), triton_available(KERNEL), triton_supports,
        auto_skip=triton_auto_skip, note="deltafuse's Triton causal conv1d + SiLU with sequence resets (fwd+bwd)"))
    registry.register(CONV, Candidate("torch", load_attr(REFERENCE, "causal_conv1d_fn_torch"),
                                      supports=torch_supports,
                                      note="deltafuse's boundary-aware torch conv (any device)"))
    registry.register(CONV_UPDATE, Candidate("torch", load_attr(REFERENCE, "causal_conv1d_update_torch"),
                                             supports=torch_supports,
                                             note="deltafuse's torch single-step conv update"))


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
