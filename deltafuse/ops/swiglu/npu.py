"""Ascend NPU route for SwiGLU through ``torch_npu.npu_swiglu``.

``npu_swiglu(x, dim=-1)`` splits x in two halves along ``dim`` and returns silu(first) * second. The op's
signature here takes gate and up separately, so they are concatenated first (one extra copy of both; an
MLP-level route that projects gate and up with one matmul would avoid it). Not run on NPU hardware here.
"""

from __future__ import annotations

import torch


def swiglu_npu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
