"""Chunked fused linear cross-entropy in torch (any device): the portable implementation.

The head projection, the softmax and the loss are computed for ``chunk_size`` tokens at a time, so the
largest temporaries are [chunk, V] instead of [tokens, V]. Because the loss is a scalar, its gradient with
respect to the chunk's logits is known during the forward (softmax - one-hot, times the reduction's scale);
the forward therefore also computes the gradients of hidden, weight and bias chunk by chunk and keeps only
those ([N, H], [V, H], [V]) for the backward, which multiplies them by the incoming scalar gradient.
Nothing of size [tokens, V] is saved for the backward.

Rounding points follow transformers' stock path (``lm_head`` in the input dtype, then ``logits.float()``
and an fp32 softmax; the logits gradient is rounded to the input dtype before the two matmuls of the linear
backward), so a low-precision run matches the stock loss up to summation order. A float64 input is
computed in float64 throughout.

The weight gradient is accumulated across chunks in the weight's dtype when that is fp32/fp64, and in fp32
otherwise when ``V * H`` is small; for large bf16/fp16 heads it is accumulated in the weight dtype (a
[V, H] fp32 buffer would cost 2 GiB at Qwen3.5's 248,320 x 2,048 head). LoRA training freezes the head, so
that case computes no weight gradient at all.

``chunk_fn(logits, targets, ignore_index, row_scale) -> (row_losses, dlogits)`` is the per-chunk softmax
step; the Triton backend passes a fused kernel that writes the gradient over the logits in place.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Default chunk: about as many logits as the hidden states hold (chunk * V ~ N * H, rounded up to a power of two),
# so a chunk's logits cost about what the hidden-state gradient costs. The floor keeps the matmuls efficient
# (H200, H=2,048, V=248,320, 4,096 tokens, frozen head: 64-token chunks took 41 ms against stock's 23 ms,
# 128 took 23 ms, 512 took 16 ms; BENCHMARKS.md);
# with a trainable head every chunk also reads and writes the whole [V, H] weight-gradient accumulator, so
# chunks are kept large there (few passes over it, and few roundings when it is accumulated in bf16).
MIN_CHUNK = 256
MIN_CHUNK_TRAINABLE_HEAD = 1024
# A [V, H] fp32 weight-gradient accumulator is used for low-precision heads up to this many elements.
FP32_ACCUMULATE_MAX = 1 << 24


def default_chunk_size(n_tokens: int, vocab: int, hidden: int, trainable_head: bool = False) -> int:
    n_tokens = max(n_tokens, 1)
    rows = -(-n_tokens * hidden // max(vocab, 1))
    rows = 1 << max(rows - 1, 0).bit_length()
    return min(n_tokens, max(rows, MIN_CHUNK_TRAINABLE_HEAD if trainable_head else MIN_CHUNK))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def chunk_softmax_grad_torch(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                             row_scale: torch.Tensor | None):
    """Row losses (fp32; 0 on ignored rows) and, when row_scale is given, d(loss)/d(logits) in logits' dtype.

    logits: [c, V] (input dtype); targets: [c] int64; row_scale: [c] fp32 (the reduction's scale, 0 on
    ignored rows).
    """
    x = logits.to(_compute_dtype(logits.dtype))
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    lse = torch.logsumexp(x, dim=-1)
    rows = torch.where(valid, lse - x.gather(1, safe).squeeze(1), torch.zeros_like(lse))
    if row_scale is None:
        return rows, None
    if x.data_ptr() == logits.data_ptr():  # fp32/fp64 input: do not overwrite the caller's logits
        x = x.clone()
    x.sub_(lse.unsqueeze(1)).exp_()
    x.scatter_add_(1, safe, -valid.to(x.dtype).unsqueeze(1))
    x.mul_(row_scale.to(x.dtype).unsqueeze(1))
    return rows, x.to(logits.dtype)


def _denominator(targets, ignore_index, reduction, num_items_in_batch, device):
    """The divisor of the summed loss as an fp32 (fp64) tensor, or None for reduction='sum'."""
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            return num_items_in_batch.to(device=device, dtype=torch.float32)
        return torch.tensor(float(num_items_in_batch), dtype=torch.float32, device=device)
    if reduction == "sum":
        return None
    return (targets != ignore_index).sum().to(torch.float32)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch, chunk_size,
                logits_out, chunk_fn, needs):
        need_dh, need_dw, need_db = needs
        n, _ = hidden.shape
        vocab = weight.shape[0]
        device = hidden.device
        ct = _compute_dtype(hidden.dtype)
        denom = _denominator(targets, ignore_index, reduction, num_items_in_batch, device)
        any_grad = need_dh or need_dw or need_db
        row_scale = None
        if any_grad:
            valid = targets != ignore_index
            if denom is None:
                row_scale = valid.to(ct)
            else:  # where(): an all-ignored batch (denominator 0) gives zero gradients, as the stock loss does
                row_scale = torch.where(valid, 1.0 / denom.to(ct), torch.zeros((), dtype=ct, device=device))
        dh = torch.empty_like(hidden) if need_dh else None
        dw = None
        if need_dw:
            acc = weight.dtype if weight.dtype in (torch.float32, torch.float64) or \
                weight.numel() > FP32_ACCUMULATE_MAX else torch.float32
            dw = torch.zeros(weight.shape, dtype=acc, device=device)
        db = torch.zeros((vocab,), dtype=_compute_dtype(bias.dtype), device=device) if need_db else None
        total = torch.zeros((), dtype=ct, device=device)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            h = hidden[s:e]
            logits = F.linear(h, weight, bias)
            if logits_out is not None:
                logits_out[s:e].copy_(logits)
            rows, dlogits = chunk_fn(logits, targets[s:e], ignore_index,
                                     row_scale[s:e] if row_scale is not None else None)
            del logits
            total += rows.sum(dtype=ct)
            if dlogits is None:
                continue
            if need_dh:
                torch.mm(dlogits, weight, out=dh[s:e])
            if need_dw:
                if dw.dtype == dlogits.dtype:
                    dw.addmm_(dlogits.t(), h)
                else:
                    dw += torch.mm(dlogits.t(), h).to(dw.dtype)
            if need_db:
                db += dlogits.sum(0, dtype=db.dtype)
            del dlogits
        loss = total if denom is None else total / denom.to(ct)
        if dw is not None:
            dw = dw.to(weight.dtype)
        if db is not None:
            db = db.to(bias.dtype)
        ctx.save_for_backward(dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw, db = ctx.saved_tensors
        # The usual incoming gradient is exactly 1 (loss.backward()): hand the precomputed gradients over
        # as they are instead of allocating scaled copies (one [V, H] copy for a trainable head). This reads
        # one scalar back from the device.
        one = bool(grad_loss == 1)

        def scaled(t):
            if t is None or one:
                return t
            return t * grad_loss.to(t.dtype)

        return scaled(dh), scaled(dw), scaled(db), None, None, None, None, None, None, None, None


def fused_linear_cross_entropy_chunked(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                       chunk_size, return_logits, chunk_fn: Callable = chunk_softmax_grad_torch):
    """hidden [N, H], weight [V, H], bias [V] or None, targets [N] int64 (already shifted).

    Returns (loss, logits [N, V] or None). The logits, when asked for, are filled chunk by chunk from the same
    projection the loss uses and carry no gradient.
    """
    grad = torch.is_grad_enabled()
    needs = (grad and hidden.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    n, vocab = hidden.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n, vocab, hidden.shape[1], needs[1])
    logits_out = None
    if return_logits:
        logits_out = torch.empty((n, vocab), dtype=torch.promote_types(hidden.dtype, weight.dtype),
                                 device=hidden.device)
    loss = _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, reduction,
                                          num_items_in_batch, chunk_size, logits_out, chunk_fn, needs)
    return loss, logits_out


def fused_linear_cross_entropy_torch(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                     chunk_size, return_logits):
    return fused_linear_cross_entropy_chunked(hidden, weight, bias, targets, ignore_index, reduction,
                                              num_items_in_batch, chunk_size, return_logits,
                                              chunk_softmax_grad_torch)
