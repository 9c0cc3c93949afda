"""Candidates for the gated delta rule ops, in order of preference, and the shape facts they judge."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import time

import torch

from deltafuse.backends import probes
from deltafuse.backends.common import (FLOATS, NPU_UNVERIFIED, load_attr, npu_supports, torch_supports,
                                       triton_auto_skip, triton_available, triton_supports)
from deltafuse.backends.registry import REGISTRY, BackendError, CallInfo, Candidate, Registry

CHUNK = "chunk_gated_delta_rule"
RECURRENT = "fused_recurrent_gated_delta_rule"
CHUNK_KERNEL = "deltafuse.ops.gated_delta.kernel"
RECURRENT_KERNEL = "deltafuse.ops.gated_delta.kernel_recurrent"
REFERENCE = "deltafuse.ops.gated_delta.reference"

log = logging.getLogger(__name__)

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
    # a call that needs gradients runs the chunked kernels (kernel_recurrent.recurrent_or_chunked): same rules
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


# --- FlashQLA (TileLang kernels for Hopper and Blackwell) ---------------------------------------------------
# Measured on one H200 (BENCHMARKS.md#long-context-gdn): 3.1x faster than deltafuse's kernels at 1x65,536 tokens
# forward+backward, 1.5x at 1x16,384 and 2.1x at 8x2,048, 2.3x slower at 1x4,096; and less accurate. Against the
# float64 oracle at 1x1,024 its bf16 o is off by 3.7e-3 relative RMS. That is over the 3e-3 bound every automatic
# GDN backend meets (deltafuse's kernels 2.4e-3, transformers' torch fallback 1.7e-3). So it serves only when
# forced.
FLASH_QLA_HEAD = 128
FLASH_QLA_FORCED_ONLY = ("FlashQLA's bf16 output is measured 3.7e-3 from float64 (relative RMS), over the 3e-3 "
                         "bound of the automatic GDN backends (BENCHMARKS.md#long-context-gdn)")
# TileLang compiles FlashQLA's kernels on their first use for a shape, on the host, inside the call: on an H200 3.5
# minutes for the four benchmark shapes' forward and backward, 5.5 minutes for the first step of moe8 LoRA on one
# 65,536-token sequence (BENCHMARKS.md#moe8-64k-s16). A first forward of a shape taking longer than this is reported.
FLASH_QLA_COMPILE_NOTE_S = 2.0


def _flash_qla_available() -> str | None:
    return probes.import_error("flash_qla")


def _flash_qla_supports(call: CallInfo) -> str | None:
    if call.device.type != "cuda":
        return f"FlashQLA's kernels need a CUDA device; the tensors are on {call.device.type}"
    cap = probes.cuda_capability(call.device.index)
    if cap is None or cap not in ((9, 0), (10, 0), (10, 3), (12, 0), (12, 1)):
        return f"FlashQLA runs on compute capability 9.0, 10.0, 10.3 and 12.x only; this GPU has {cap}"
    if cap[0] == 12 and call.needs_grad:
        return "FlashQLA on compute capability 12.x has a forward only, and this call needs a backward"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashQLA takes fp16 and bf16 only, got {str(call.dtype).replace('torch.', '')}"
    K, V = call.fact("K"), call.fact("V")
    if (K, V) != (FLASH_QLA_HEAD, FLASH_QLA_HEAD):
        return f"FlashQLA takes head sizes K = V = {FLASH_QLA_HEAD} only, got K={K}, V={V}"
    return None


def _flash_qla_forced_only(call: CallInfo) -> str | None:
    return f"{FLASH_QLA_FORCED_ONLY}; serves only when forced with backend='flash_qla'"


def _load_flash_qla():
    fn = importlib.import_module("flash_qla").chunk_gated_delta_rule
    seen = set()  # (shape of q, shape of v, dtype, packed or not) of the calls made so far

    def run(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
            cu_seqlens=None):
        if v.dtype != q.dtype:
            raise BackendError(f"FlashQLA needs v in q's dtype {q.dtype}, got v.dtype={v.dtype}; allowed: one dtype "
                               "for q, k and v (or another backend)")
        key = (tuple(q.shape), tuple(v.shape), q.dtype, cu_seqlens is None)
        t0 = time.perf_counter() if key not in seen else None
        # its backward asserts an fp32 g (the models compute the gate in fp32); states are fp32 by the op's contract
        o, final = fn(q, k, v, g.float(), beta, scale=scale,
                      initial_state=None if initial_state is None else initial_state.float(),
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
        if t0 is not None:
            seen.add(key)
            took = time.perf_counter() - t0
            if took >= FLASH_QLA_COMPILE_NOTE_S:
                log.warning("deltafuse: FlashQLA's first call for q %s, v %s (%s%s) took %.1f s: TileLang compiles "
                            "its kernels on first use of a shape (its backward's on the first backward, minutes "
                            "more); they are cached on disk for later processes", list(q.shape), list(v.shape),
                            str(q.dtype).replace("torch.", ""), ", packed" if cu_seqlens is not None else "", took)
        return o, (None if final is None else final.float())

    return run


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
            Candidate("flash_qla", _load_flash_qla, _flash_qla_available, _flash_qla_supports,
                      auto_skip=_flash_qla_forced_only,
                      note="FlashQLA's TileLang kernels (fwd+bwd; forced only; compiled on the first use of a shape, "
                           "minutes on an H200)"),
            Candidate("torch", load_attr(REFERENCE, "chunk_gated_delta_rule_torch"), supports=torch_supports,
                      note="deltafuse's chunked torch reference (any device)"),
        ],
        RECURRENT: [
            Candidate("triton", load_attr(RECURRENT_KERNEL, "recurrent_or_chunked"),
                      triton_available(RECURRENT_KERNEL), _triton_recurrent_supports, auto_skip=triton_auto_skip,
                      note="deltafuse's recurrent Triton kernel; a call that needs gradients runs the chunked "
                           "kernels (fwd+bwd)"),
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
