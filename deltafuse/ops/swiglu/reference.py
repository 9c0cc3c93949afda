"""Torch SwiGLU activation exactly as transformers' Qwen3.5 MLPs compute it: ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
