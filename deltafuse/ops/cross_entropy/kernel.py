"""Triton softmax/gradient step of the chunked fused linear cross-entropy.

For one chunk of logits [c, V] in the input dtype, one program per row makes two passes over the
vocabulary: the first keeps a running maximum and a running sum of exponentials (fp32) and reads the
target's logit, giving the row loss ``logsumexp - logit[target]``; the second writes
``(softmax - one_hot) * row_scale`` over the logits in place, rounded to the input dtype. The torch step
needs an fp32 copy of the chunk plus a separate gradient buffer; this one needs neither, so a chunk costs
only its [c, V] logits. The matmuls around it (head projection, gradient of hidden / weight) stay cuBLAS
calls in ``reference.fused_linear_cross_entropy_chunked``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.backends import probes
from deltafuse.ops.cross_entropy.reference import fused_linear_cross_entropy_chunked


@triton.jit
def _ce_chunk_kernel(L, T, SCALE, LOSS, V, stride_l, ignore_index,
                     COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = L + row.to(tl.int64) * stride_l
    t = tl.load(T + row)
    valid = t != ignore_index
    t_safe = tl.where(valid, t, 0)
    x_t = tl.load(base + t_safe).to(tl.float32)
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    if COMPUTE_GRAD:
        scale = tl.load(SCALE + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cmask = cols < V
            x = tl.load(base + cols, mask=cmask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where((cols == t_safe) & valid, g - 1.0, g) * scale
            tl.store(base + cols, g.to(L.dtype.element_ty), mask=cmask)


def _block_v(vocab: int, device: torch.device) -> tuple[int, int]:
    cap = 1024 if device.type == "cpu" or probes.triton_interpreting() else 4096
    block = min(cap, triton.next_power_of_2(max(vocab, 1)))
    return block, (8 if block >= 4096 else 4)


def chunk_softmax_grad_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                              row_scale: torch.Tensor | None):
    """Same contract as ``reference.chunk_softmax_grad_torch``; the gradient overwrites ``logits``."""
    c, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows = torch.empty((c,), dtype=torch.float32, device=logits.device)
    if c == 0:
        return rows, (logits if row_scale is not None else None)
    block, warps = _block_v(vocab, logits.device)
    scale = row_scale.to(torch.float32).contiguous() if row_scale is not None else rows
    _ce_chunk_kernel[(c,)](logits, targets.contiguous(), scale, rows, vocab, logits.stride(0), int(ignore_index),
                           COMPUTE_GRAD=row_scale is not None, BLOCK_V=block, num_warps=warps)
    return rows, (logits if row_scale is not None else None)


def fused_linear_cross_entropy_triton(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                      chunk_size, return_logits):
    return fused_linear_cross_entropy_chunked(hidden, weight, bias, targets, ignore_index, reduction,
                                              num_items_in_batch, chunk_size, return_logits,
                                              chunk_softmax_grad_triton)


__all__ = ["chunk_softmax_grad_triton", "fused_linear_cross_entropy_triton"]
