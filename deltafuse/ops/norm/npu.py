"""Ascend NPU route for the zero-centred RMSNorm through ``torch_npu.npu_rms_norm``.

``npu_rms_norm(x, gamma, epsilon)`` returns (x * rstd * gamma, rstd) with gamma of x's dtype: a plain
RMSNorm. Qwen3.5 multiplies by (1 + weight) in fp32, so the call passes gamma = 1 + weight, built from the
parameter on every call (autograd sees it; nothing derived from the weight is kept), and runs in fp32:
rounding 1 + weight to bf16 would quantise the learned offsets to steps of 2**-7 near 1, which the stock
module does not do. The fp32 copy of x costs memory for bf16 inputs. Not run on NPU hardware here.
"""

from __future__ import annotations

import torch


def rms_norm_zero_centered_npu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import torch_npu

    ct = torch.promote_types(x.dtype, torch.float32)
    gamma = 1.0 + weight.to(ct)
    y, _rstd = torch_npu.npu_rms_norm(x.to(ct), gamma, epsilon=eps)
    return y.to(x.dtype)
