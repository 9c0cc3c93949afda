"""MoE experts with the per-token sums over a token's k slots in Triton; everything else is the torch reference's.

The torch reference (``reference.py``) sorts the N*k (token, expert) slots by expert and runs torch's grouped
matmuls in that order. Twice per call it sums each token's k rows out of expert order: the forward's weighted
output ``out[n] = sum_j w[n, j] * y[inv[n, j]]`` and the backward's hidden-state gradient
``dx[n] = sum_j dxs[inv[n, j]]``. There it is one ``embedding_bag``. ``gather_sum_triton`` does the same
sum in one pass: each program reads one token's k rows (one column block, the k loads unrolled and in flight
together), accumulates in fp32 in slot order and rounds once to the rows' dtype, as the reference does. It is
deterministic (no atomics). The grouped matmuls, the SwiGLU and the routing plan are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops.moe.reference import ExpertKernels, run_grouped

# widest column block of one program; a token's k rows of it are loaded together
MAX_BLOCK = 1024


@triton.jit
def _gather_sum_kernel(R, IDX, W, OUT, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(IDX + n * K + j).to(tl.int64)
        x = tl.load(R + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            x = x * tl.load(W + n * K + j).to(tl.float32)
        acc += x
    tl.store(OUT + n * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def gather_sum_triton(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * rows[index[n, j]] (weights None: the plain sum): rows [S, H], index and
    weights [N, k] -> [N, H] in rows' dtype, with an fp32 accumulator and one rounding."""
    n, k = index.shape
    S, H = rows.shape
    rows = rows.contiguous()
    index = index.contiguous()
    out = rows.new_empty(n, H)
    if n == 0 or H == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(H))
    if triton_interpreting():
        block = min(block, 32)  # small blocks so that the interpreted tests reach several column blocks
    w = index if weights is None else weights.contiguous()
    _gather_sum_kernel[(n, triton.cdiv(H, block))](rows, index, w, out, H, K=k, HAS_W=weights is not None,
                                                   BLOCK=block, num_warps=1 if triton_interpreting() else 4)
    return out


class _TritonSums(ExpertKernels):
    """The reference's grouped matmuls with the per-token sums in Triton."""

    @staticmethod
    def gather_sum(rows, index, weights):
        return gather_sum_triton(rows, index, weights)


def moe_experts_triton(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """The torch reference's experts (grouped matmuls where they work) with its two per-token sums in Triton."""
    return run_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, grouped=True,
                       kernels=_TritonSums)
