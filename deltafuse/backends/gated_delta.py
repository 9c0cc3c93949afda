"""Candidates for the gated delta rule ops, in order of preference."""

from __future__ import annotations

import torch

from deltafuse.backends import probes
from deltafuse.backends.registry import CallInfo, Candidate, Registry

CHUNK = "chunk_gated_delta_rule"
RECURRENT = "fused_recurrent_gated_delta_rule"
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# --- our Triton kernels -------------------------------------------------------------------------------
def _triton_available(module: str):
    def check() -> str | None:
        if probes.triton_version() is None:
            return probes.import_error("triton") or "triton is not installed"
        return probes.import_error(module)

    return check


def _triton_supports(call: CallInfo) -> str | None:
    if call.device.type == "cuda":
        if torch.version.hip is not None:
            return "ROCm is not verified for deltafuse's Triton kernels"
        return None if call.dtype in FLOATS else f"dtype {call.dtype} is not one of fp16, bf16, fp32"
    if call.device.type == "cpu" and probes.triton_interpreting():
        return None if call.dtype == torch.float32 else "the Triton interpreter emulates fp32 only"
    return f"Triton kernels run on CUDA devices (or CPU under TRITON_INTERPRET=1), not {call.device.type}"


def _triton_auto_skip(call: CallInfo) -> str | None:
    if call.device.type == "cpu":
        return "interpreted Triton on CPU serves only when forced (backend='triton')"
    return None


def _load_triton_chunk():
    from deltafuse.ops.gated_delta.chunk import chunk_gated_delta_rule_triton

    return chunk_gated_delta_rule_triton


def _load_triton_recurrent():
    from deltafuse.ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule_triton

    return fused_recurrent_gated_delta_rule_triton


# --- flash-linear-attention --------------------------------------------------------------------------
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


def _fla_wrap(fn):
    def run(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  cu_seqlens=cu_seqlens)

    return run


def _load_fla_chunk():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return _fla_wrap(chunk_gated_delta_rule)


def _load_fla_recurrent():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return _fla_wrap(fused_recurrent_gated_delta_rule)


# --- deltafuse's torch reference ---------------------------------------------------------------------
def _torch_supports(call: CallInfo) -> str | None:
    ok = FLOATS + (torch.float64,)
    return None if call.dtype in ok else f"dtype {call.dtype} is not one of fp16, bf16, fp32, fp64"


def _load_torch_chunk():
    from deltafuse.ops.gated_delta.reference import chunk_gated_delta_rule_torch

    return chunk_gated_delta_rule_torch


def _load_torch_recurrent():
    from deltafuse.ops.gated_delta.reference import fused_recurrent_gated_delta_rule_torch

    return fused_recurrent_gated_delta_rule_torch


def register(registry: Registry) -> None:
    rows = {
        CHUNK: [
            Candidate("triton", _load_triton_chunk, _triton_available("deltafuse.ops.gated_delta.chunk"),
                      _triton_supports, auto_skip=_triton_auto_skip,
                      note="deltafuse's chunked Triton kernels (fwd+bwd)"),
            Candidate("fla", _load_fla_chunk, _fla_available, _fla_supports, fla_backward_known_bad,
                      note="flash-linear-attention"),
            Candidate("torch", _load_torch_chunk, supports=_torch_supports,
                      note="deltafuse's chunked torch reference (any device)"),
        ],
        RECURRENT: [
            Candidate("triton", _load_triton_recurrent, _triton_available("deltafuse.ops.gated_delta.recurrent"),
                      _triton_recurrent_supports, auto_skip=_triton_auto_skip,
                      note="deltafuse's recurrent Triton kernel (inference)"),
            Candidate("fla", _load_fla_recurrent, _fla_available, _fla_supports, note="flash-linear-attention"),
            Candidate("torch", _load_torch_recurrent, supports=_torch_supports,
                      note="deltafuse's step-by-step torch reference"),
        ],
    }
    for op, candidates in rows.items():
        for cand in candidates:
            registry.register(op, cand)


def _triton_recurrent_supports(call: CallInfo) -> str | None:
    if call.needs_grad:
        return "the recurrent Triton kernel has no backward (decoding only)"
    return _triton_supports(call)
