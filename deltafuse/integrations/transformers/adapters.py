"""Thin functions that present deltafuse's ops with the call signatures transformers uses.

The op adapters (``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
``causal_conv1d_update``) accept every way the GDN layers of transformers 5.x call these ops (old design:
instance attributes called with FLA / causal-conv1d keywords; new design: module functions called with the
layer's whole ``**kwargs``) and call ``deltafuse.ops``, which picks the implementation per call through the
backend registry. Packed sequences reach them as the ``Packing`` the GDN-layer wrapper holds
(``packing.py``); called directly with ``cu_seqlens`` / ``cu_seq_lens_q`` / ``seq_idx``, they derive one from
those. When rows hold several sequences, the GDN op runs once on the flattened [1, B*T] axis with the
combined offsets, and the result is reshaped back; recurrent states map between rows and sequences (a row's
initial state continues its first sequence, its final state is that of its last sequence). A shard of a
context-parallel row is not served here: the context-parallel rows put their own op adapters
(``cp_adapters.py``, built on ``gdn_packing`` / ``gdn_call`` and ``conv_packing`` / ``conv1d_call``) over these.
"""

from __future__ import annotations

import torch

from deltafuse import ops
from deltafuse.ops import _library
from deltafuse.integrations.transformers.boundaries import (
    Packing, PackingError, packing_from_cu_seqlens, packing_from_seq_idx,
)
from deltafuse.integrations.transformers.packing import held_packing


def _given_packing(cu_seqlens, seq_idx, batch: int, length: int) -> Packing | None:
    """The Packing of boundaries passed to an op adapter directly (offsets on the flat B*T axis, or a
    [B, T] sequence id per token), or None (none given, or one sequence per row)."""
    if cu_seqlens is not None:
        return packing_from_cu_seqlens(cu_seqlens, batch, length)
    if seq_idx is not None:
        return packing_from_seq_idx(seq_idx, batch, length)
    return None


def gdn_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
             packing: Packing | None):
    """The GDN op ``op`` (``ops.chunk_gated_delta_rule`` or ``ops.fused_recurrent_gated_delta_rule``) on a [B, T]
    batch whose sequences ``packing`` gives (None: each row one sequence); returns (o, final state or None)."""
    B, T = q.shape[:2]
    if packing is not None and packing.cu_seqlens is None:  # derived inside a compiled graph
        o, final, _ = _packed_gdn_op(q, k, v, g, beta, initial_state, packing.seq_idx, scale,
                                     bool(output_final_state), bool(use_qk_l2norm_in_kernel),
                                     op is ops.fused_recurrent_gated_delta_rule,
                                     _library.grad_mask(q, k, v, g, beta, initial_state))
        return o, (final if output_final_state else None)
    if packing is None or packing.rows_are_sequences:
        extra = {}
        if op is ops.fused_recurrent_gated_delta_rule and _state_replaced_in_place(initial_state, output_final_state,
                                                                                 q, k, v, g, beta):
            extra["inplace_final_state"] = True
        return op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra)
    cu_seqlens = packing.cu_seqlens
    if cu_seqlens.device != q.device:
        cu_seqlens = cu_seqlens.to(q.device)
    N = packing.num_sequences
    first = last = None
    state = initial_state
    if initial_state is not None or output_final_state:
        first, last = packing.row_sequences(q.device)
    if initial_state is not None:
        if initial_state.shape[0] != B:
            raise PackingError(f"initial_state has {initial_state.shape[0]} rows but the batch has B={B}")
        state = initial_state.new_zeros((N,) + tuple(initial_state.shape[1:]))
        state[first] = initial_state
    flat = [t.reshape((1, B * T) + tuple(t.shape[2:])) for t in (q, k, v, g, beta)]
    o, final = op(*flat, scale=scale, initial_state=state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    o = o.reshape((B, T) + tuple(o.shape[2:]))
    if final is not None:
        final = final[last]
    return o, final


def _state_replaced_in_place(initial_state, output_final_state, *tensors) -> bool:
    """Whether a decoding step may write its final state over ``initial_state``: every GDN layer of
    transformers replaces its cache's state with the step's final state right after the call (5.15+ copies it
    onto the cached tensor, older releases assign it), so writing it there saves an allocation and, with the
    copy onto itself that follows, a read and a write of the whole state. Only eagerly, for inference, on a
    contiguous fp32 state (what the cache holds)."""
    return (bool(output_final_state) and initial_state is not None and initial_state.dtype == torch.float32
            and initial_state.is_contiguous() and not torch.compiler.is_compiling()
            and not any(_library.grad_mask(initial_state, *tensors)))


def _packed_gdn_fake(q, k, v, g, beta, initial_state, seq_idx, scale, output_final_state,
                     use_qk_l2norm_in_kernel, recurrent, grad_mask):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    final = None
    if output_final_state:
        final = q.new_empty(B, HV, K, V, dtype=torch.promote_types(q.dtype, torch.float32))
    return _library.fake_outputs(q.new_empty(B, T, HV, V), final, like=q)


@_library.define("packed_gated_delta_rule", ("q", "k", "v", "g", "beta", "initial_state"), _packed_gdn_fake)
def _packed_gdn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None, seq_idx: torch.Tensor, scale: float | None,
                   output_final_state: bool, use_qk_l2norm_in_kernel: bool, recurrent: bool,
                   grad_mask: list[bool]) -> list[torch.Tensor]:
    """The GDN op on a [B, T] batch whose sequences ``seq_idx`` [B, T] (a Packing's) gives: what a compiled
    graph calls, as the number of sequences is known only when it runs. Derives the Packing here (one read of
    the boundaries per call) and runs the same path as an eager call, the public op's own autograd included
    (recorded and replayed by ``deltafuse::backward``); initial and final states are per row."""
    B, T = seq_idx.shape
    packing = packing_from_seq_idx(seq_idx, B, T)
    op = ops.fused_recurrent_gated_delta_rule if recurrent else ops.chunk_gated_delta_rule

    def run(q_, k_, v_, g_, b_, h0):
        return gdn_call(op, q_, k_, v_, g_, b_, scale, h0, output_final_state, use_qk_l2norm_in_kernel, packing)

    return _library.run_forward([q, k, v, g, beta, initial_state], grad_mask, run, q.device.type)


def gdn_packing(q, cu_seqlens, kwargs) -> Packing | None:
    """The boundaries of a GDN op call: given ones (``cu_seqlens`` / ``cu_seq_lens_q`` / ``seq_idx``), else
    those of the GDN forward in progress; every other keyword transformers forwards is dropped."""
    if cu_seqlens is None:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
    seq_idx = kwargs.get("seq_idx")
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is None and seq_idx is None:
        return held_packing("gdn", B, T)
    return _given_packing(cu_seqlens, seq_idx, B, T)


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """``chunk_gated_delta_rule`` as every transformers design calls it (FLA's signature plus the layer's
    keywords); q/k may have H heads (5.23+) or HV heads (repeated, up to 5.22)."""
    return gdn_call(ops.chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, gdn_packing(q, cu_seqlens, kwargs))


def recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                               **kwargs):
    """The decoding GDN op (``fused_recurrent_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``)."""
    return gdn_call(ops.fused_recurrent_gated_delta_rule, q, k, v, g, beta, scale, initial_state,
                    output_final_state, use_qk_l2norm_in_kernel, gdn_packing(q, cu_seqlens, kwargs))


def _conv_seq_idx(x: torch.Tensor, packing: Packing | None) -> torch.Tensor | None:
    """seq_idx [B, x.shape[-1]] for the conv, or None when every row is one sequence.

    The boundaries describe the T new tokens; when the layer prepended cached inputs (a cache continuing a
    prefix), the extra leading columns belong to each row's first sequence.
    """
    if packing is None:
        return None
    B, _, L = x.shape
    seq_idx = packing.seq_idx.to(device=x.device, dtype=torch.int64)
    if seq_idx.shape[1] > L:
        raise PackingError(f"seq_idx of shape {tuple(seq_idx.shape)} does not fit the conv input [B, C, T] = "
                           f"{tuple(x.shape)}")
    extra = L - seq_idx.shape[1]
    if extra:
        seq_idx = torch.cat([seq_idx[:, :1].expand(B, extra), seq_idx], 1)
    return seq_idx.contiguous()


def conv_seq_idx(x: torch.Tensor, packing: Packing | None) -> torch.Tensor | None:
    """seq_idx [B, x.shape[-1]] of ``packing``'s sequences for the conv input ``x`` [B, C, T] (what the plain
    conv passes its op), or None when every row is one sequence."""
    return _conv_seq_idx(x, packing)


def conv_packing(x: torch.Tensor, seq_idx, cu_seqlens, kwargs: dict) -> Packing | None:
    """The boundaries of a conv call on ``x`` [B, C, T]: given ones (``seq_idx`` / ``cu_seqlens``, else the
    layer's ``seq_idx`` / ``cu_seq_lens_q`` in ``kwargs``), else those of the GDN forward in progress."""
    if cu_seqlens is None:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
    if seq_idx is None:
        seq_idx = kwargs.get("seq_idx")
    B, _, L = x.shape
    if seq_idx is None and cu_seqlens is None:
        return held_packing("conv", B, None)
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() != 2 or seq_idx.shape[0] != B \
                or seq_idx.shape[1] > L:
            got = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
            raise PackingError(f"seq_idx of shape {got} does not fit the conv input [B, C, T] = {tuple(x.shape)}")
        return packing_from_seq_idx(seq_idx, B, seq_idx.shape[1])
    total = int(cu_seqlens[-1])
    if total % B != 0:
        raise PackingError(f"cu_seqlens end at {total}, which is not B*T for a batch of B={B} rows")
    return packing_from_cu_seqlens(cu_seqlens, B, total // B)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, cu_seqlens=None, **kwargs):
    """Causal depthwise conv as both designs call it: causal-conv1d's keywords (old), or the layer's kwargs
    with ``cu_seq_lens_q`` / ``seq_idx`` (new). x [B, C, T], weight [C, W]."""
    return conv1d_call(x, weight, bias, conv_packing(x, seq_idx, cu_seqlens, kwargs), initial_states,
                       return_final_states, final_states_out, activation)


def conv1d_call(x, weight, bias, packing: Packing | None, initial_states=None, return_final_states=False,
                final_states_out=None, activation=None):
    """The causal conv on ``x`` [B, C, T] whose sequences ``packing`` gives (None: each row one sequence)."""
    sid = _conv_seq_idx(x, packing)
    return ops.causal_conv1d_fn(x, weight, bias, seq_idx=sid, initial_states=initial_states,
                                return_final_states=return_final_states, final_states_out=final_states_out,
                                activation=activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **kwargs):
    """One decoding step of the conv; conv_state [B, C, S >= W-1] is updated in place."""
    return ops.causal_conv1d_update(x, conv_state, weight, bias, activation)
