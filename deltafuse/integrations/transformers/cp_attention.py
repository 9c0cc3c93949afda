"""Context parallelism's full attention: each rank's queries against the keys of the whole row.

K and V of the whole row are all-gathered (``torch.distributed.nn.functional.all_gather``, whose backward is a
reduce-scatter). A local sequence's queries are the last lq of its keys (from its start, possibly on an earlier
rank, to this shard's end): causal attention aligned at the lower right, computed without a mask tensor
(``causal_attention_lower_right``). ``context_parallel.py`` describes the kernels it reaches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltafuse.integrations.transformers.boundaries import Packing
from deltafuse.integrations.transformers.cp_exchange import refuse

if TYPE_CHECKING:
    from deltafuse.integrations.transformers.context_parallel import Shard


def attention_segments(packing: Packing, shard: Shard) -> list[tuple[int, int, int, int, int]]:
    """(row b, first local query i0, query count lq, first key k0, key count lk) of every local sequence: its
    queries are the columns [i0, i0 + lq) of the shard, its keys the global columns [k0, k0 + lk) of the row,
    from its start to the shard's last query of it. The queries are the last lq of the keys: causal attention
    aligned at the lower right (query i sees keys up to k0 + lk - lq + i). Within a row the key ranges of its
    local sequences are consecutive: together [first_start[b], shard end)."""
    L = packing.length
    out = []
    for s, e in zip(packing.offsets[:-1], packing.offsets[1:]):
        b = s // L
        i0, lq = s - b * L, e - s
        g0 = shard.start + i0
        k0 = shard.first_start[b] if i0 == 0 else g0
        out.append((b, i0, lq, k0, g0 + lq - k0))
    return out


def _flash_takes_gqa(query, key, value) -> bool:
    """Whether torch's flash kernel serves this call with fewer key/value heads as they are (CUDA, 16-bit, head
    size <= 256): ``causal_lower_right`` then reaches it without a mask and without repeating K/V."""
    if query.device.type != "cuda":
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, True)))
    except (ImportError, TypeError, RuntimeError):
        return False


def _repeat_heads(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """Each key/value head ``group`` times in a row (repeat_interleave's order) through one expand + reshape."""
    if group == 1:
        return x
    shape = list(x.shape)
    expanded = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], group, *shape[dim + 1:])
    shape[dim] *= group
    return expanded.reshape(shape)


def _by_sequence(query, key, value, segments, scaling):
    """One ``scaled_dot_product_attention`` per local sequence with torch's lower-right causal bias (no mask
    tensor on CUDA: the flash kernel (16-bit, head size <= 256, grouped K/V as they are) or the memory-efficient
    one (K/V heads repeated); CPU builds the [lq, lk] mask itself and computes in the given dtype)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    B, Hq, L, D = query.shape
    group = Hq // key.shape[1]
    native = group == 1 or query.device.type != "cuda" or _flash_takes_gqa(query[:1, :, :1], key[:1, :, :1],
                                                                            value[:1, :, :1])
    rows = [[] for _ in range(B)]
    for b, i0, lq, k0, lk in segments:
        q = query[b:b + 1, :, i0:i0 + lq]
        k, v = key[b:b + 1, :, k0:k0 + lk], value[b:b + 1, :, k0:k0 + lk]
        if not native:
            k, v = _repeat_heads(k, group, 1), _repeat_heads(v, group, 1)
        rows[b].append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), scale=scaling,
                                                      enable_gqa=native and group > 1))
    out = torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)
    return out.transpose(1, 2).contiguous()


def _varlen(query, key, value, segments, scaling, cu_q):
    """All local sequences in one ``varlen_attn`` call (flash attention, CUDA, 16-bit): queries flattened on the
    B*L axis, keys the concatenated key ranges of the rows, causal (flash aligns it at the lower right when a
    sequence has more keys than queries). None when this torch or this call cannot use it."""
    from deltafuse.ops.attention.packed import VARLEN_MAX_HEAD_DIM, varlen_api, varlen_causal_call

    api = varlen_api()
    B, Hq, L, D = query.shape
    if (api is None or query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16)
            or D > VARLEN_MAX_HEAD_DIM or key.dtype != query.dtype or value.shape[-1] != D):
        return None
    if not api[2] and not (scaling is None or scaling == D ** -0.5):  # a torch without scale=
        return None
    q = query.transpose(1, 2).reshape(B * L, Hq, D)
    spans = []  # per row, its consecutive key range
    for b in range(B):
        mine = [s for s in segments if s[0] == b]
        spans.append((b, mine[0][3], mine[-1][3] + mine[-1][4]))
    k = torch.cat([key[b, :, lo:hi].transpose(0, 1) for b, lo, hi in spans])
    v = torch.cat([value[b, :, lo:hi].transpose(0, 1) for b, lo, hi in spans])
    lengths_k = [s[4] for s in segments]
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int64).cumsum(0).to(device=query.device, dtype=torch.int32)
    kwargs, k, v = varlen_causal_call(api, scaling, Hq, k, v)
    out = api[0](q, k, v, cu_q.to(device=query.device, dtype=torch.int32), cu_k,
                 max(s[2] for s in segments), max(lengths_k), **kwargs)
    return out.view(B, L, Hq, D)


def causal_attention_lower_right(query, key, value, segments, scaling=None, cu_seqlens_q=None):
    """Local queries [B, Hq, L, D] against the gathered keys/values [B, Hk, T, D] of their rows, sequence by
    sequence as ``segments`` (``attention_segments``) says; returns [B, L, Hq, D] (contiguous). No [lq, lk] mask
    and no repeated K/V on CUDA: ``varlen_attn`` (one call, 16-bit) when ``cu_seqlens_q`` (the local offsets) are
    given and it serves the call, else the per-sequence loop (``_by_sequence``)."""
    B, Hq, L, D = query.shape
    if Hq % key.shape[1]:
        raise ValueError(f"query has {Hq} heads and key {key.shape[1]}; the query heads must be a multiple of the "
                         "key heads")
    if cu_seqlens_q is not None:
        out = _varlen(query, key, value, segments, scaling, cu_seqlens_q)
        if out is not None:
            return out
    return _by_sequence(query, key, value, segments, scaling)


def attention(module, query, key, value, dropout, scaling, packing: Packing):
    """Causal attention of the local queries [B, Hq, L, D] against every rank's keys of their own sequence.
    Returns [B, L, Hq, D] (contiguous), what transformers' attention functions return.

    K and V of the whole row are all-gathered (the ranks after this one included, although only the keys up to
    this shard's end are used: W*L*Hk*D values each, 64 MiB per tensor at 65,536 tokens with 2 K/V heads of 256
    in bf16); under gradient checkpointing the recomputation gathers them again (a collective every rank runs in
    the same order)."""
    shard = packing.context
    if dropout:
        raise refuse(f"attention dropout {dropout}", "0.0 (config.attention_dropout=0 or model.eval())")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}; the query heads must be a "
                         "multiple of the key heads")
    if shard.world > 1:
        from torch.distributed.nn.functional import all_gather

        Hk = key.shape[1]
        both = torch.cat([key, value], dim=1) if key.shape[-1] == value.shape[-1] else None
        if both is not None:
            full = torch.cat(all_gather(both, group=shard.group), dim=2)
            key, value = full[:, :Hk], full[:, Hk:]
        else:
            key = torch.cat(all_gather(key, group=shard.group), dim=2)
            value = torch.cat(all_gather(value, group=shard.group), dim=2)
    shard.attention_calls += 1
    return causal_attention_lower_right(query, key, value, attention_segments(packing, shard), scaling,
                                        packing.cu_seqlens)

