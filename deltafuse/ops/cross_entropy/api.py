"""Public fused linear cross-entropy (lm_head + shift + loss in chunks) and per-token log-probabilities; the
registry picks the implementation."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from deltafuse import backends
from deltafuse.ops.cross_entropy.candidates import FUSED_LINEAR_CROSS_ENTROPY, TOKEN_LOGPROBS
from deltafuse.ops import _amp, _library
from deltafuse.ops import _checks as check
from deltafuse.ops.cross_entropy.tokens import OUTPUTS as TOKEN_OUTPUTS

REDUCTIONS = ("mean", "sum")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """transformers' causal shift: position i predicts label i + 1; the last position of each row is ignored."""
    pad = torch.full(labels.shape[:-1] + (1,), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _check_num_items(num_items_in_batch, reduction):
    if num_items_in_batch is None:
        return
    if reduction != "mean":
        check.fail(f"num_items_in_batch={num_items_in_batch!r} replaces the mean's denominator; it needs "
                   f"reduction='mean', got reduction={reduction!r}")
    if torch.is_tensor(num_items_in_batch):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.dtype == torch.bool or \
                num_items_in_batch.is_complex():
            check.fail(f"num_items_in_batch must be a number or a one-element real tensor, got shape "
                       f"{check.shape(num_items_in_batch)} dtype {num_items_in_batch.dtype}")
        return
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)) or \
            num_items_in_batch < 0:
        check.fail(f"num_items_in_batch must be None, a number >= 0 or a one-element tensor, "
                   f"got {num_items_in_batch!r}")


def _head_inputs(hidden, weight, bias, targets, targets_name: str, kwargs: dict, op):
    """Checks shared by the linear-head ops: (hidden, weight, bias) after autocast's cast. ``kwargs``: the keywords
    the public function ``op`` did not take (an error naming them and the keywords it takes)."""
    if kwargs:
        import inspect

        taken = [p.name for p in inspect.signature(op).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY]
        check.fail(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed keywords: {', '.join(taken)}")
    check.tensor("hidden", hidden)
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        check.fail(f"hidden must be [..., H] with H > 0, got shape {check.shape(hidden)}")
    H = hidden.shape[-1]
    check.tensor("weight", weight, 2)
    if weight.shape[1] != H or weight.shape[0] == 0:
        check.fail(f"weight must be [V, H] = [V, {H}] with V > 0 for hidden of shape {check.shape(hidden)}, "
                   f"got {check.shape(weight)}")
    amp = _amp.autocast_dtype(hidden.device.type)
    hidden, weight, bias = _amp.cast_as_linear(amp, hidden, weight, bias)
    if weight.dtype != hidden.dtype:
        under = f" (after autocast's cast to {amp})" if amp is not None else ""
        check.fail(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}{under}; they must match "
                   f"(as for nn.Linear)")
    V = weight.shape[0]
    if bias is not None:
        check.tensor("bias", bias, 1)
        if bias.shape[0] != V or bias.dtype != hidden.dtype:
            check.fail(f"bias must be [V] = ({V},) of dtype {hidden.dtype}, got {check.shape(bias)} {bias.dtype}")
    check.tensor(targets_name, targets, dtypes=_INT_DTYPES)
    if targets.shape != hidden.shape[:-1]:
        check.fail(f"{targets_name} must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                   f"got {check.shape(targets)}")
    return hidden, weight, bias


@check.public_op(FUSED_LINEAR_CROSS_ENTROPY)
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                               num_items_in_batch=None, shift: bool = True, chunk_size: int | None = None,
                               vocab_chunk_size: int | None = None, return_logits: bool = False,
                               return_token_accuracy: bool = False, backend: str | None = None, **kwargs):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without [tokens, V] logits.

    hidden: [..., T, H] (any float dtype); weight: [V, H] of hidden's dtype (an ``lm_head`` weight, or a
    tied input embedding, trainable or frozen); bias: [V] or None; labels: integer, hidden.shape[:-1]
    (moved to hidden's device, as transformers does). ``shift=True`` applies transformers' causal shift
    (position t predicts labels[..., t + 1]); ``shift=False`` takes labels as already aligned (transformers'
    ``shift_labels``). Tokens whose label is ``ignore_index`` do not count.

    reduction 'mean' divides the summed token losses by the number of counted tokens (NaN when every token is
    ignored, as ``torch.nn.functional.cross_entropy`` gives), or by ``num_items_in_batch`` when it is given
    (transformers' gradient-accumulation normalisation); 'sum' returns the sum. The softmax is computed in
    fp32 (fp64 for fp64 inputs).

    Memory: ``chunk_size`` tokens are projected at a time, to ``vocab_chunk_size`` vocabulary columns at a time.
    Vocabulary blocks keep the temporaries to [chunk, block] (default 4,096 x 8,192); they cost nothing extra
    with a frozen head (LoRA) and one more projection per token with a trainable head or bias. Default: blocks
    for a frozen head with the Triton backend and a vocabulary above 8,192; otherwise whole-vocabulary chunks
    of a power of two near tokens * H / V tokens (at least 256, at least 1,024 with a trainable head). A
    ``vocab_chunk_size`` below V asks for blocks, one >= V for whole-vocabulary chunks. With
    ``return_logits=True`` returns ``(loss, logits)``; the logits ([..., T, V], hidden's dtype) are the same
    projection, carry no gradient, and are computed in whole-vocabulary chunks. ``return_token_accuracy=True``
    appends the token accuracy (``(loss, accuracy)`` or ``(loss, logits, accuracy)``): the fraction of counted
    tokens whose logits' argmax is their label (ties go to the lowest vocabulary index, as ``torch.argmax``;
    fp32 scalar, no gradient, NaN when every token is ignored; not scaled by ``num_items_in_batch``).
    ``backend=`` may force 'triton' or 'torch'.

    Mixed precision: under ``torch.autocast`` on hidden's device, hidden, weight and bias (fp32/fp16/bf16)
    are first cast to the autocast dtype, as autocast casts an ``nn.Linear`` (fp32 master weights then get
    fp32 gradients through the cast), and the loss is computed as for inputs of that dtype: logits in it,
    softmax in fp32, loss fp32.
    """
    hidden, weight, bias = _head_inputs(hidden, weight, bias, labels, "labels", kwargs, fused_linear_cross_entropy)
    H, V = hidden.shape[-1], weight.shape[0]
    if not isinstance(shift, bool):
        check.fail(f"shift must be True or False, got {shift!r}")
    if shift and labels.dim() < 1:
        check.fail(f"shift=True needs a sequence dimension: hidden must be [..., T, H], got {check.shape(hidden)}")
    if not _is_int(ignore_index):
        check.fail(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        check.fail(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    _check_num_items(num_items_in_batch, reduction)
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        check.fail(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if vocab_chunk_size is not None and (not _is_int(vocab_chunk_size) or vocab_chunk_size < 1):
        check.fail(f"vocab_chunk_size must be None or an int >= 1, got {vocab_chunk_size!r}")
    if not isinstance(return_logits, bool):
        check.fail(f"return_logits must be True or False, got {return_logits!r}")
    if not isinstance(return_token_accuracy, bool):
        check.fail(f"return_token_accuracy must be True or False, got {return_token_accuracy!r}")
    check.same_device("hidden", hidden, weight=weight, bias=bias)

    labels = labels.to(device=hidden.device)
    _check_targets(labels, ignore_index, V, "labels")
    targets = (_shift(labels, ignore_index) if shift else labels).reshape(-1).to(torch.int64)
    hidden2 = hidden.reshape(-1, H)
    if backend is not None:
        backends.call_backend(FUSED_LINEAR_CROSS_ENTROPY, backend)
    items = num_items_in_batch if torch.is_tensor(num_items_in_batch) else None
    number = None if items is not None or num_items_in_batch is None else float(num_items_in_batch)
    out = _fused_ce_op(hidden2, weight, bias, targets, items, number, ignore_index, reduction, chunk_size,
                       vocab_chunk_size, return_logits, return_token_accuracy, backend,
                       _library.grad_mask(hidden2, weight, bias), torch.compiler.is_compiling())
    result = (out[0],)
    if return_logits:
        result += (out[1].view(*hidden.shape[:-1], V),)
    if return_token_accuracy:
        result += (out[2],)
    return result if len(result) > 1 else result[0]


def _check_targets(targets, ignore_index, V, name):
    if check.values_checkable(targets) and targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            first = targets[bad].flatten()[0].item()
            check.fail(f"{name} must lie in [0, {V}) or equal ignore_index={ignore_index}, got {first}")


def _ce_fake(hidden, weight, bias, targets, num_items, num_items_number, ignore_index, reduction, chunk_size,
             vocab_chunk_size, return_logits, return_token_accuracy, backend, grad_mask, validate):
    ct = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0]) if return_logits else None
    accuracy = hidden.new_empty((), dtype=torch.float32) if return_token_accuracy else None
    return _library.fake_outputs(hidden.new_empty((), dtype=ct), logits, accuracy, like=hidden)


@_library.define(FUSED_LINEAR_CROSS_ENTROPY, ("hidden", "weight", "bias"), _ce_fake, no_grad_outputs=(1, 2))
def _fused_ce_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 num_items: torch.Tensor | None, num_items_number: float | None, ignore_index: int, reduction: str,
                 chunk_size: int | None, vocab_chunk_size: int | None, return_logits: bool,
                 return_token_accuracy: bool, backend: str | None, grad_mask: list[bool],
                 validate: bool) -> list[torch.Tensor]:
    if validate:
        _library.named_errors(FUSED_LINEAR_CROSS_ENTROPY, _check_targets, targets, ignore_index, weight.shape[0],
                              "labels")
    impl = _library.select(FUSED_LINEAR_CROSS_ENTROPY, backend, grad_mask, hidden, weight, bias)
    items = num_items if num_items is not None else num_items_number

    def run(h, w, b):
        out = impl(h, w, b, targets, ignore_index, reduction, items, chunk_size, return_logits, vocab_chunk_size,
                   token_accuracy=return_token_accuracy)
        return out[0], out[1], (out[2] if return_token_accuracy else None)

    return _library.run_forward([hidden, weight, bias], grad_mask, run, hidden.device.type)


class TokenLogProbs(NamedTuple):
    """Per-token outputs of ``token_logprobs``; a field not asked for is None."""
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None


def _check_outputs(outputs) -> tuple[bool, bool]:
    names = outputs if isinstance(outputs, (tuple, list)) else None
    if names is None or not all(isinstance(n, str) for n in names) or any(n not in TOKEN_OUTPUTS for n in names):
        check.fail(f"outputs must be a tuple of names among {', '.join(map(repr, TOKEN_OUTPUTS))}, got "
                   f"{check.short_repr(outputs)}")
    return "entropy" in names, "is_top1" in names


@check.public_op(TOKEN_LOGPROBS)
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   bias: torch.Tensor | None = None, temperature: float = 1.0, outputs=("log_probs",),
                   ignore_index: int = -100, chunk_size: int | None = None, vocab_chunk_size: int | None = None,
                   backend: str | None = None, **kwargs) -> TokenLogProbs:
    """Per-token log-probabilities of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    without [tokens, V] logits (TRL's ``ChunkedLogProbFunction`` semantics, without softcapping / logit scale).

    hidden: [..., H] (any float dtype); weight: [V, H] of hidden's dtype (trainable or frozen); bias: [V] or
    None; targets: integer, hidden.shape[:-1], already aligned (no shift), in [0, V) or ``ignore_index``.
    ``outputs`` names what to compute among 'log_probs' (always computed), 'entropy' and 'is_top1'. Returns a
    ``TokenLogProbs(log_probs, entropy, is_top1)`` of targets' shape, None for a field not named:

    * log_probs: fp32 (fp64 for fp64 inputs), differentiable w.r.t. hidden, weight and bias for any per-token
      upstream gradient;
    * entropy: of the temperature-scaled distribution, same dtype, differentiable as well (TRL's GRPO entropy
      bonus backpropagates through it);
    * is_top1: bool, no gradient: the target is the first index of the largest scaled logit (as
      ``torch.argmax``; a tie with an earlier index is not top-1).

    Rows whose target is ``ignore_index`` give 0, 0 and False and no gradient. ``temperature`` > 0 divides the
    logits. Memory: ``chunk_size`` tokens are projected ``vocab_chunk_size`` columns at a time (defaults:
    Triton 4,096 x 8,192; torch whole-vocabulary chunks). With a frozen head the hidden gradient is computed in
    the forward ([N, H] fp32 kept for the backward) and the backward is a row scaling; with a trainable head or
    bias, or a gradient reaching the entropy, the backward projects the blocks again. ``backend=`` may force
    'triton' or 'torch'. Autocast: as ``fused_linear_cross_entropy`` (inputs cast as for a linear layer, then
    computed in that dtype with fp32 statistics), which is also how TRL's function projects under autocast.
    """
    hidden, weight, bias = _head_inputs(hidden, weight, bias, targets, "targets", kwargs, token_logprobs)
    H, V = hidden.shape[-1], weight.shape[0]
    if not (math.isfinite(temperature) and temperature > 0):
        check.fail(f"temperature must be a finite number > 0, got {temperature!r}")
    want_entropy, want_top1 = _check_outputs(outputs)
    if not _is_int(ignore_index):
        check.fail(f"ignore_index must be an int, got {ignore_index!r}")
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        check.fail(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if vocab_chunk_size is not None and (not _is_int(vocab_chunk_size) or vocab_chunk_size < 1):
        check.fail(f"vocab_chunk_size must be None or an int >= 1, got {vocab_chunk_size!r}")
    check.same_device("hidden", hidden, weight=weight, bias=bias)
    targets = targets.to(device=hidden.device)
    _check_targets(targets, ignore_index, V, "targets")
    if backend is not None:
        backends.call_backend(TOKEN_LOGPROBS, backend)
    hidden2 = hidden.reshape(-1, H)
    out = _token_logprobs_op(hidden2, weight, bias, targets.reshape(-1).to(torch.int64), ignore_index,
                             float(temperature), want_entropy, want_top1, chunk_size, vocab_chunk_size, backend,
                             _library.grad_mask(hidden2, weight, bias), torch.compiler.is_compiling())
    shape = targets.shape
    wanted = (True, want_entropy, want_top1)
    return TokenLogProbs(*(t.view(shape) if w else None for t, w in zip(out[:3], wanted)))


def _tokens_fake(hidden, weight, bias, targets, ignore_index, temperature, want_entropy, want_top1, chunk_size,
                 vocab_chunk_size, backend, grad_mask, validate):
    ct = torch.promote_types(hidden.dtype, torch.float32)
    n = hidden.shape[0]
    return _library.fake_outputs(hidden.new_empty(n, dtype=ct), hidden.new_empty(n, dtype=ct) if want_entropy
                                 else None, hidden.new_empty(n, dtype=torch.bool) if want_top1 else None, like=hidden)


@_library.define(TOKEN_LOGPROBS, ("hidden", "weight", "bias"), _tokens_fake, no_grad_outputs=(2,))
def _token_logprobs_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                       ignore_index: int, temperature: float, want_entropy: bool, want_top1: bool,
                       chunk_size: int | None, vocab_chunk_size: int | None, backend: str | None,
                       grad_mask: list[bool], validate: bool) -> list[torch.Tensor]:
    if validate:
        _library.named_errors(TOKEN_LOGPROBS, _check_targets, targets, ignore_index, weight.shape[0], "targets")
    impl = _library.select(TOKEN_LOGPROBS, backend, grad_mask, hidden, weight, bias)
    return _library.run_forward(
        [hidden, weight, bias], grad_mask,
        lambda h, w, b: impl(h, w, b, targets, ignore_index, temperature, want_entropy, want_top1, chunk_size,
                             vocab_chunk_size), hidden.device.type)
