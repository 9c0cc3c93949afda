"""Candidates for the gated delta rule ops, in order of preference, and the shape facts they judge."""

from __future__ import annotations

import importlib
import importlib.metadata

from deltafuse.backends import probes
from deltafuse.backends.common import (FLOATS, NPU_UNVERIFIED, load_attr, npu_supports, torch_supports,
                                       triton_auto_skip, triton_available, triton_supports)
from deltafuse.backends.registry import REGISTRY, CallInfo, Candidate, Registry

CHUNK = "chunk_gated_delta_rule"
RECURRENT = "fused_recurrent_gated_delta_rule"
CHUNK_KERNEL = "deltafuse.ops.gated_delta.kernel"
RECURRENT_KERNEL = "deltafuse.ops.gated_delta.kernel_recurrent"
REFERENCE = "deltafuse.ops.gated_delta.reference"

# The q/k head size deltafuse's Triton kernels take: the state tile [K, V] lives in registers, with K padded to
# a power of two of at most 256 (both kernels raise above it).
TRITON_MAX_K = 256


def head_sizes(shapes: tuple) -> tuple:
    """The shape facts of a GDN call: q/k head size K and value head size V. ``shapes`` are those of the
    tensors the public ops pass to ``call_info``: (q, k, v, g, beta, initial_state)."""
    q, _k, v = shapes[:3]
    return (("K", int(q[-1])), ("V", int(v[-1])))


def _triton_head_size(call: CallInfo) -> str | None:
    K = call.fact("K")
    if K is not None and K > TRITON_MAX_K:
        return f"q/k head size K={K} is over {TRITON_MAX_K}, the largest deltafuse's Triton kernels take"
    return None


def _triton_chunk_supports(call: CallInfo) -> str | None:
    return triton_supports(call) or _triton_head_size(call)


def _triton_recurrent_supports(call: CallInfo) -> str | None:
    if call.needs_grad:
        return "the recurrent Triton kernel has no backward (decoding only)"
    return triton_supports(call) or _triton_head_size(call)


# --- flash-linear-attention ------------------------------------------------------------------------------
def _fla_available() -> str | None:
    return probes.import_error("fla.ops.gated_delta_rule")


def _fla_supports(call: CallInfo) -> str | None:
    if call.device.type != "cuda":
        return f"FLA's kernels need a CUDA device; the tensors are on {call.device.type}"
    return None if call.dtype in FLOATS else f"dtype {call.dtype} is not one of fp16, bf16, fp32"


def fla_backward_known_bad(call: CallInfo) -> str | None:
    """FLA 0.6 computes wrong gated-delta gradients on Hopper with Triton >= 3.4 and < 3.7.1 (and raises)."""
    if not call.needs_grad or not probes.is_hopper(call.device):
        return None
    tv = probes.triton_version()
    if tv is not None and (3, 4) <= tv[:2] and tv < (3, 7, 1):
        return (f"FLA's gated delta rule backward is wrong on Hopper ({probes.cuda_name(call.device.index)}) "
                f"with Triton {'.'.join(map(str, tv))} (>= 3.4, < 3.7.1); FLA 0.6 refuses it")
    return None


# --- FLA on Ascend NPUs -------------------------------------------------------
def _triton_ascend_version() -> str | None:
    """Version of the installed triton-ascend distribution (the Triton build for Ascend NPUs), or None."""
    try:
        return importlib.metadata.version("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None


def _fla_ascend_available() -> str | None:
    why = probes.import_error("torch_npu")
    if why is not None:
        return why
    if _triton_ascend_version() is None:
        return ("FLA runs on Ascend NPUs only through triton-ascend (the Triton build for NPUs), which is not "
                "installed")
    return _fla_available()


def _load_fla(name: str):
    def load():
        fn = getattr(importlib.import_module("fla.ops.gated_delta_rule"), name)

        def run(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None):
            return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_seqlens)

        return run

    return load


def register(registry: Registry) -> None:
    rows = {
        CHUNK: [
            Candidate("triton", load_attr(CHUNK_KERNEL, "chunk_gated_delta_rule_triton"),
                      triton_available(CHUNK_KERNEL), _triton_chunk_supports, auto_skip=triton_auto_skip,
                      note="deltafuse's chunked Triton kernels (fwd+bwd)"),
            Candidate("fla", _load_fla("chunk_gated_delta_rule"), _fla_available, _fla_supports,
                      fla_backward_known_bad, note="flash-linear-attention"),
            Candidate("npu", _load_fla("chunk_gated_delta_rule"), _fla_ascend_available, npu_supports,
                      verified=False, note="flash-linear-attention's kernels on an Ascend NPU through triton-ascend "
                                           "(fwd+bwd); " + NPU_UNVERIFIED),
            Candidate("torch", load_attr(REFERENCE, "chunk_gated_delta_rule_torch"), supports=torch_supports,
                      note="deltafuse's chunked torch reference (any device)"),
        ],
        RECURRENT: [
            Candidate("triton", load_attr(RECURRENT_KERNEL, "fused_recurrent_gated_delta_rule_triton"),
                      triton_available(RECURRENT_KERNEL), _triton_recurrent_supports, auto_skip=triton_auto_skip,
                      note="deltafuse's recurrent Triton kernel (inference)"),
            Candidate("fla", _load_fla("fused_recurrent_gated_delta_rule"), _fla_available, _fla_supports,
                      note="flash-linear-attention"),
            Candidate("npu", _load_fla("fused_recurrent_gated_delta_rule"), _fla_ascend_available, npu_supports,
                      verified=False, note="flash-linear-attention's recurrent kernel on an Ascend NPU through "
                                           "triton-ascend; " + NPU_UNVERIFIED),
            Candidate("torch", load_attr(REFERENCE, "fused_recurrent_gated_delta_rule_torch"),
                      supports=torch_supports, note="deltafuse's step-by-step torch reference"),
        ],
    }
    for op, candidates in rows.items():
        for cand in candidates:
            registry.register(op, cand)
        registry.set_facts(op, head_sizes)


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
