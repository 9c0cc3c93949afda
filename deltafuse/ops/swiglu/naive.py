"""Float64 oracle for SwiGLU, written from the formula."""

from __future__ import annotations

import torch


def naive_swiglu(gate, up, dtype=torch.float64):
    gate, up = gate.to(dtype), up.to(dtype)
    return gate / (1 + torch.exp(-gate)) * up
