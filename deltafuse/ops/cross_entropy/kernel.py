"""Triton softmax/gradient steps of the fused linear cross-entropy (token chunks, and vocabulary blocks).

For one chunk of logits [c, V] in the input dtype, one program per row makes two passes over the
vocabulary: the first keeps a running maximum and a running sum of exponentials (fp32) and reads the
target's logit, giving the row loss ``logsumexp - logit[target]``; the second writes
``(softmax - one_hot) * row_scale`` over the logits in place, rounded to the input dtype. The torch step
needs an fp32 copy of the chunk plus a separate gradient buffer; this one needs neither, so a chunk costs
only its [c, V] logits. The matmuls around it (head projection, gradient of hidden / weight) stay cuBLAS
calls in ``driver.fused_linear_cross_entropy_chunked``.

For vocabulary blocks (``driver.fused_linear_cross_entropy_blocked``) two more steps, one program per row of a
[c, w] block: the online step (the per-token log-probabilities' online kernel at temperature 1) updates the row's
running maximum, sum of exponentials and target logit and (frozen head) writes exp(x - new maximum) over the
block and rescales the row of the hidden-gradient accumulator when the maximum moved; the gradient step writes
(exp(x - lse) - one-hot) * row_scale over it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops.cross_entropy.driver import BlockSteps, fused_linear_cross_entropy_driver
from deltafuse.ops.cross_entropy.tokens import TokenSteps, token_logprobs_impl


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


@triton.jit
def _ce_block_grad_kernel(L, T, LSE, SCALE, W, stride_l, v0, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = L + row.to(tl.int64) * stride_l
    t = tl.load(T + row)
    local = tl.where((t != ignore_index) & (t >= v0), t - v0, -1)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    for c0 in range(0, W, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        cmask = cols < W
        x = tl.load(base + cols, mask=cmask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse)
        g = tl.where(cols == local, g - 1.0, g) * scale
        tl.store(base + cols, g.to(L.dtype.element_ty), mask=cmask)


@functools.lru_cache(maxsize=None)
def _block_v_cached(vocab: int, interpreted: bool) -> tuple[int, int]:
    block = min(1024 if interpreted else 4096, triton.next_power_of_2(max(vocab, 1)))
    return block, (8 if block >= 4096 else 4)


def _block_v(vocab: int, device: torch.device) -> tuple[int, int]:
    return _block_v_cached(vocab, device.type == "cpu" or triton_interpreting())


def chunk_softmax_grad_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                              row_scale: torch.Tensor | None):
    """Same contract as ``driver.chunk_softmax_grad_torch``; the gradient overwrites ``logits``."""
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


def _rows_contiguous(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 else logits.contiguous()


# The blocked loss launches these once per [chunk, block] tile (hundreds of times per call), so the wrappers
# keep host work to the launch: targets, statistics and scales arrive contiguous from the caller
# (driver._blocked_pass), and the accumulator is rescaled inside the kernel.
def online_block_step_triton(logits, targets, v0, ignore_index, m, l, xt, acc):
    """Same contract as ``driver.online_block_step_torch`` (fp32 running statistics, contiguous [c]
    tensors); the probabilities, when an accumulator is given, overwrite ``logits``. The per-token step's kernel
    without temperature (a factor of 1 is exact), entropy or top-1 statistics."""
    return token_online_step_triton(logits, targets, v0, ignore_index, 1.0, m, l, xt, None, None, acc)


def block_grad_step_triton(logits, targets, v0, ignore_index, lse, row_scale):
    """Same contract as ``driver.block_grad_step_torch`` (contiguous fp32 ``lse`` and ``row_scale``); the
    gradient overwrites ``logits``."""
    logits = _rows_contiguous(logits)
    c, w = logits.shape
    if c:
        block, warps = _block_v(w, logits.device)
        _ce_block_grad_kernel[(c,)](logits, targets, lse, row_scale, w, logits.stride(0), v0, ignore_index,
                                    BLOCK_V=block, num_warps=warps)
    return logits


TRITON_BLOCK_STEPS = BlockSteps(online_block_step_triton, block_grad_step_triton)


# --- per-token log-probabilities (``tokens.py``): one program per row of a [c, w] block ---------------------
@triton.jit
def _tok_online_kernel(L, T, M, S, XT, XS, MBT, ACC, W, H, stride_l, stride_acc, v0, ignore_index, inv_t,
                       HAS_ENTROPY: tl.constexpr, HAS_TOP1: tl.constexpr, WITH_ACC: tl.constexpr,
                       BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    base = L + row.to(tl.int64) * stride_l
    t = tl.load(T + row)
    local = t - v0
    hit = (t != ignore_index) & (local >= 0) & (local < W)
    z_t = tl.load(base + tl.where(hit, local, 0)).to(tl.float32) * inv_t  # before the block is overwritten
    m_old = tl.load(M + row)
    m_blk = float("-inf")
    before = float("-inf")
    for c0 in range(0, W, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < W, other=float("-inf")).to(tl.float32) * inv_t
        m_blk = tl.maximum(m_blk, tl.max(z, axis=0))
        if HAS_TOP1:
            before = tl.maximum(before, tl.max(tl.where(cols < local, z, float("-inf")), axis=0))
    m_new = tl.maximum(m_old, m_blk)
    alpha = tl.exp(m_old - m_new)
    s = 0.0
    xs = 0.0
    for c0 in range(0, W, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        cmask = cols < W
        z = tl.load(base + cols, mask=cmask, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(z - m_new)
        s += tl.sum(p, axis=0)
        if HAS_ENTROPY:
            xs += tl.sum(p * tl.where(cmask, z, 0.0), axis=0)  # p is 0 off the block
        if WITH_ACC:
            tl.store(base + cols, p.to(L.dtype.element_ty), mask=cmask)
    tl.store(S + row, tl.load(S + row) * alpha + s)
    if HAS_ENTROPY:
        tl.store(XS + row, tl.load(XS + row) * alpha + xs)
    if HAS_TOP1:
        tl.store(MBT + row, tl.maximum(tl.load(MBT + row), before))
    tl.store(M + row, m_new)
    tl.store(XT + row, tl.where(hit, z_t, tl.load(XT + row)))
    if WITH_ACC:
        if alpha != 1.0:  # the maximum moved: rescale the row's accumulator to it
            acc_row = ACC + row.to(tl.int64) * stride_acc
            for c0 in range(0, H, BLOCK_H):
                cols = c0 + tl.arange(0, BLOCK_H)
                cmask = cols < H
                tl.store(acc_row + cols, tl.load(acc_row + cols, mask=cmask, other=0.0) * alpha, mask=cmask)


@triton.jit
def _tok_grad_kernel(L, T, LSE, ENT, GLP, GENT, W, stride_l, v0, ignore_index, inv_t,
                     HAS_LOGPROB_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = L + row.to(tl.int64) * stride_l
    t = tl.load(T + row)
    local = tl.where((t != ignore_index) & (t >= v0), t - v0, -1)
    lse = tl.load(LSE + row)
    for c0 in range(0, W, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        cmask = cols < W
        z = tl.load(base + cols, mask=cmask, other=0.0).to(tl.float32) * inv_t
        log_p = z - lse
        p = tl.exp(log_p)
        g = tl.zeros((BLOCK_V,), tl.float32)
        if HAS_LOGPROB_GRAD:  # d log p_t / d z_j = 1[j = t] - p_j
            g += tl.load(GLP + row) * (tl.where(cols == local, 1.0, 0.0) - p)
        if HAS_ENTROPY_GRAD:  # d entropy / d z_j = -p_j (log p_j + entropy)
            g -= tl.load(GENT + row) * p * (log_p + tl.load(ENT + row))
        tl.store(base + cols, (g * inv_t).to(L.dtype.element_ty), mask=cmask)


def token_online_step_triton(logits, targets, v0, ignore_index, inv_t, m, l, xt, xs, mbt, acc):
    """Same contract as ``tokens.online_step_torch`` (contiguous fp32 statistics); the probabilities, when an
    accumulator is given, overwrite ``logits``."""
    logits = _rows_contiguous(logits)
    c, w = logits.shape
    if c:
        block, warps = _block_v(w, logits.device)
        with_acc = acc is not None
        hdim = acc.shape[1] if with_acc else 0
        _tok_online_kernel[(c,)](logits, targets, m, l, xt, xs if xs is not None else m,
                                 mbt if mbt is not None else m, acc if with_acc else m, w, hdim, logits.stride(0),
                                 acc.stride(0) if with_acc else 0, v0, ignore_index, float(inv_t),
                                 HAS_ENTROPY=xs is not None, HAS_TOP1=mbt is not None, WITH_ACC=with_acc,
                                 BLOCK_V=block, BLOCK_H=min(block, triton.next_power_of_2(max(hdim, 1))),
                                 num_warps=warps)
    return logits if acc is not None else None


def token_grad_step_triton(logits, targets, v0, ignore_index, inv_t, lse, ent, g_lp, g_ent):
    """Same contract as ``tokens.grad_step_torch`` (contiguous fp32 row tensors); the gradient overwrites
    ``logits``."""
    logits = _rows_contiguous(logits)
    c, w = logits.shape
    if c:
        block, warps = _block_v(w, logits.device)
        _tok_grad_kernel[(c,)](logits, targets, lse, ent if ent is not None else lse,
                               g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, w,
                               logits.stride(0), v0, ignore_index, float(inv_t),
                               HAS_LOGPROB_GRAD=g_lp is not None, HAS_ENTROPY_GRAD=g_ent is not None,
                               BLOCK_V=block, num_warps=warps)
    return logits


TRITON_TOKEN_STEPS = TokenSteps(token_online_step_triton, token_grad_step_triton)


def fused_linear_cross_entropy_triton(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                      chunk_size, return_logits, vocab_chunk_size=None, token_accuracy=False):
    return fused_linear_cross_entropy_driver(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch, chunk_size,
                     return_logits, vocab_chunk_size, chunk_softmax_grad_triton, TRITON_BLOCK_STEPS,
                     blocks_by_default=True, token_accuracy=token_accuracy)


def token_logprobs_triton(hidden, weight, bias, targets, ignore_index, temperature, want_entropy, want_top1,
                          chunk_size, vocab_chunk_size):
    return token_logprobs_impl(hidden, weight, bias, targets, ignore_index, temperature, want_entropy, want_top1,
                               chunk_size, vocab_chunk_size, TRITON_TOKEN_STEPS, blocks_by_default=True)


__all__ = ["block_grad_step_triton", "chunk_softmax_grad_triton", "fused_linear_cross_entropy_triton",
           "online_block_step_triton", "token_grad_step_triton", "token_logprobs_triton",
           "token_online_step_triton"]
