"""Candidate checks shared by every op's rows: Triton kernels, Ascend NPU kernels, torch references."""

from __future__ import annotations

import importlib

import torch

from deltafuse.backends import probes
from deltafuse.backends.registry import CallInfo

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = FLOATS + (torch.float64,)
NPU_UNVERIFIED = "unverified on hardware: only the routing and argument mapping were tested, with a stand-in"


def load_attr(module: str, name: str):
    """load(): import ``module`` when first selected and return its ``name``."""

    def load():
        return getattr(importlib.import_module(module), name)

    return load


# --- deltafuse's Triton kernels ---------------------------------------------------------------------------
def triton_available(module: str):
    """available(): Triton and the kernel module ``module`` import."""

    def check() -> str | None:
        if probes.triton_version() is None:
            return probes.import_error("triton") or "triton is not installed"
        return probes.import_error(module)

    return check


def triton_supports(call: CallInfo) -> str | None:
    if call.device.type == "cuda":
        if torch.version.hip is not None:
            return "ROCm is not verified for deltafuse's Triton kernels"
        return None if call.dtype in FLOATS else f"dtype {call.dtype} is not one of fp16, bf16, fp32"
    if call.device.type == "cpu" and probes.triton_interpreting():
        return None if call.dtype == torch.float32 else "the Triton interpreter emulates fp32 only"
    return f"Triton kernels run on CUDA devices (or CPU under TRITON_INTERPRET=1), not {call.device.type}"


def triton_auto_skip(call: CallInfo) -> str | None:
    if call.device.type == "cpu":
        return "interpreted Triton on CPU serves only when forced (backend='triton')"
    return None


def triton_forced_only(reason: str):
    """auto_skip for a Triton kernel that is correct but not the best choice anywhere (``reason`` says why,
    with the measurement): it serves only when forced with backend='triton'."""

    def skip(call: CallInfo) -> str | None:
        return f"{reason}; serves only when forced with backend='triton'"

    return skip


# --- Ascend NPU (torch_npu) -------------------------------------------------------------------------------
def npu_available(*functions: str):
    """available(): torch_npu imports and has ``functions``. Not cached here: the registry caches it."""

    def check() -> str | None:
        try:
            mod = importlib.import_module("torch_npu")
        except Exception as exc:  # not installed, or a broken install: a reason, not a crash
            return f"torch_npu does not import ({type(exc).__name__}: {exc})"
        missing = [f for f in functions if not callable(getattr(mod, f, None))]
        if missing:
            return f"torch_npu has no {', '.join(missing)}"
        return None

    return check


def npu_supports(call: CallInfo) -> str | None:
    if call.device.type != "npu":
        return f"torch_npu kernels need an npu device; the tensors are on {call.device.type}"
    if call.dtype not in FLOATS:
        return f"dtype {call.dtype} is not one of fp16, bf16, fp32 (what torch_npu's kernels accept)"
    return None


# --- torch references -------------------------------------------------------------------------------------
def torch_supports(call: CallInfo) -> str | None:
    return None if call.dtype in TORCH_DTYPES else f"dtype {call.dtype} is not one of fp16, bf16, fp32, fp64"
