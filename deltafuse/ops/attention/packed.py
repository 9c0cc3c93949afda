"""Causal self-attention of a packed batch computed sequence by sequence.

For packed rows (several sequences per row, no padding) transformers' ``sdpa`` path builds a dense
[B, 1, T, T] block-causal mask and evaluates all T x T query/key pairs, most of them masked out. The same
result is causal attention within each sequence, sum of L_i^2 pairs instead of T^2. Two implementations:

* ``causal_attention_varlen``: torch's ``varlen_attn`` (one flash-attention kernel over all sequences, CUDA,
  16-bit). H200, 16,384 tokens of ~270-token sequences, Qwen3.5-35B-A3B's heads, fwd+bwd: 2.8 ms, against
  71 ms for the dense mask and ~30 ms for the loop below (BENCHMARKS.md#packed-attention).
* ``causal_attention_by_sequence``: one ``scaled_dot_product_attention(is_causal=True)`` per sequence (any
  device). cuDNN's attention is left out of the backends it may use: it builds an execution plan for every
  new sequence length, and packed batches bring new lengths at every step (the same H200 case took 3.7 s
  per call with fresh lengths under torch's default choice, 29-38 ms with each single backend once warm).

Key/value heads are repeated for grouped-query attention.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


def causal_attention_by_sequence(query, key, value, offsets, scaling=None, dropout=0.0, cu_seqlens=None,
                                 longest=None):
    """query [B, Hq, T, D], key/value [B, Hk, T, D]; ``offsets``: the sequence starts on the flat B*T axis as
    Python ints (0, ..., B*T; every row start is a sequence start); ``cu_seqlens`` (the same on the device) and
    ``longest`` are not needed here. Returns [B, T, Hq, D] (contiguous), what transformers' attention functions
    return."""
    if offsets is None:
        raise ValueError("causal_attention_by_sequence needs the sequence offsets on the host (got offsets=None: a "
                         "padded offsets tensor, which only varlen_attn serves)")
    B, Hq, T, _ = query.shape
    Hk = key.shape[1]
    if Hq % Hk:
        raise ValueError(f"query has {Hq} heads and key {Hk}; the query heads must be a multiple of the key heads")
    group = Hq // Hk
    rows = [[] for _ in range(B)]
    with _without_cudnn():
        _loop(query, key, value, offsets, scaling, dropout, rows, T, group)
    out = torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)
    return out.transpose(1, 2).contiguous()


def _without_cudnn():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _loop(query, key, value, offsets, scaling, dropout, rows, T, group):
    for s, e in zip(offsets[:-1], offsets[1:]):
        if e <= s:
            continue
        b = s // T
        ls, le = s - b * T, e - b * T
        if le > T:
            raise ValueError(f"sequence [{s}, {e}) crosses the end of row {b} (T={T}): rows must start sequences")
        k = key[b:b + 1, :, ls:le]
        v = value[b:b + 1, :, ls:le]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows[b].append(F.scaled_dot_product_attention(query[b:b + 1, :, ls:le], k, v, dropout_p=dropout,
                                                      is_causal=True, scale=scaling))


@functools.lru_cache(maxsize=None)
def varlen_api():
    """(varlen_attn, its keyword for causality, whether it takes scale=, whether it takes enable_gqa=), or
    None when this torch has no ``torch.nn.attention.varlen``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch > 2.10: causal is the window (-1, 0)
        causal = ("window_size", (-1, 0))
    elif "is_causal" in params:  # torch 2.10
        causal = ("is_causal", True)
    else:
        return None
    return varlen_attn, causal, "scale" in params, "enable_gqa" in params


def flash_refusal(device: torch.device) -> str | None:
    """Why ``varlen_attn``'s flash attention cannot run on ``device`` (None: it can): a CUDA GPU of compute
    capability 8.0 or newer."""
    if device.type != "cuda":
        return f"varlen_attn runs flash attention on CUDA devices, not {device.type}"
    from deltafuse.backends import probes

    cap = probes.cuda_capability(device.index)
    if cap is not None and tuple(cap) < (8, 0):
        return f"varlen_attn's flash attention needs compute capability 8.0 or newer; this GPU has {cap[0]}.{cap[1]}"
    return None


def varlen_runs_on(device: torch.device) -> bool:
    """Whether ``varlen_attn`` runs on ``device``: this torch has it and ``flash_refusal`` has no objection."""
    return varlen_api() is not None and flash_refusal(device) is None


# flash attention's limit on the head size
VARLEN_MAX_HEAD_DIM = 256


def varlen_causal_call(api, scaling, query_heads: int, k: torch.Tensor, v: torch.Tensor):
    """(keywords, k, v) of a causal ``varlen_attn`` call with ``api = varlen_api()`` on [tokens, heads, D] K/V:
    causality in this torch's spelling, a non-default ``scaling`` as ``scale=``, and grouped K/V passed as they are
    (``enable_gqa=True``) or, on a torch without it, their heads repeated to the query heads."""
    _, (causal_kw, causal_value), takes_scale, takes_gqa = api
    kwargs = {causal_kw: causal_value}
    if takes_scale and not (scaling is None or scaling == k.shape[-1] ** -0.5):
        kwargs["scale"] = scaling
    group = query_heads // k.shape[1]
    if group > 1:
        if takes_gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return kwargs, k, v


def causal_attention_varlen(query, key, value, offsets, scaling=None, dropout=0.0, cu_seqlens=None, longest=None):
    """Same contract as ``causal_attention_by_sequence``, through torch's ``varlen_attn``. ``cu_seqlens``:
    the offsets as a device tensor (else built from ``offsets``). Calls it cannot serve (dropout, a head size
    above 256, a non-default scale on a torch without ``scale=``) go to the per-sequence loop.

    ``offsets`` None: the offsets are known only on the device (``cu_seqlens``, possibly ending in empty sequences:
    a captured CUDA graph's fixed-size tensor, whose sequences start every row) and ``longest`` bounds the
    sequence length; nothing is read on the host, and a call this function cannot serve raises."""
    api = varlen_api()
    B, Hq, T, D = query.shape
    Hk = key.shape[1]
    default_scale = scaling is None or scaling == D ** -0.5
    if api is None or dropout or D > VARLEN_MAX_HEAD_DIM or (not api[2] and not default_scale) or Hq % Hk:
        return causal_attention_by_sequence(query, key, value, offsets, scaling, dropout)
    if offsets is None:
        if cu_seqlens is None or longest is None:
            raise ValueError("causal_attention_varlen(offsets=None) needs cu_seqlens and longest")
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"causal_attention_varlen: a padded offsets tensor needs fp16/bf16 queries (flash "
                             f"attention), got {query.dtype}")
    else:
        starts = set(offsets)
        missing = [b * T for b in range(1, B) if b * T not in starts]
        if missing:
            raise ValueError(f"row starts {missing[:4]} are not sequence starts (T={T}): rows must start sequences")
        if cu_seqlens is None:
            cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=query.device)
        longest = max((e - s for s, e in zip(offsets[:-1], offsets[1:])), default=0)
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    q = query.transpose(1, 2).reshape(B * T, Hq, D)
    k = key.transpose(1, 2).reshape(B * T, Hk, D)
    v = value.transpose(1, 2).reshape(B * T, Hk, D)
    kwargs, k, v = varlen_causal_call(api, scaling, Hq, k, v)
    out = api[0](q, k, v, cu, cu, longest, longest, **kwargs)
    return out.view(B, T, Hq, D)
