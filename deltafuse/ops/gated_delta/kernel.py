"""Chunked gated delta rule in portable Triton: the op's Triton entry (host side, autograd wrapper).

Per value head the recurrence is (state S of shape [K, V], decay ``g`` in log space)

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

It is evaluated over chunks of ``BT = 64`` tokens (the WY / UT-transform form). Inside a chunk, with
``gc`` the chunk-local cumulative sum of ``g`` and ``D_ij = exp(gc_i - gc_j)``:

    A  = strictly_lower(beta_i (k_i . k_j) D_ij)          T = (I + A)^-1
    w  = T (beta k exp(gc))                               u = T (beta v)
    v' = u - w h                                          (h: state at the chunk start)
    o  = scale ((q exp(gc)) h + lower_incl(q k^T o D) v')
    h_next = exp(gc_last) h + (k exp(gc_last - gc))^T v'

Kernels (grid axes in brackets; the first three in ``kernel_fwd.py``, ``_out_fwd`` in ``kernel_out.py``, the
others in ``kernel_bwd.py``; their launches in ``chunk_launch.py``, their tunables in ``chunk_options.py``):

* ``_l2norm_rstd`` [token block, q/k head]: the l2norm factors rsqrt(|x|^2 + eps) of q and k rows. The
  other kernels read q and k as given and apply these factors to their products, so normalised rows are
  never rounded to 16 bits or stored.
* ``_intra_fwd``   [chunk, value head]: gc, A, T, w, u (and T itself for the backward's ``_bwd_wy``, unless
  ``ChunkOptions.wy_recompute_t`` has that kernel invert it again).
* ``_state_fwd``   [V block x sequence x value head, one axis]: the sequential pass over chunks with the state in
  fp32 registers; stores the chunk-start states (``hs``) and v' (the forward writes v' over u), and the final
  state. The forward and the backward's recompute both run it.
* ``_out_fwd``     [V block x value head x chunk, one axis]: the output, every chunk at once from the stored
  ``hs`` and v': o = scale ((q exp(gc)) h + lower_incl(q k^T o D) v'). The forward frees ``hs`` and v'
  once o is written; unless ``ChunkOptions.keep_states``, nothing but the inputs is kept for the backward.
* ``_dv_local``    [chunk, value head]: the intra-chunk part of dv', scale lower_incl(q k^T o D)^T do.
* ``_state_bwd``   [V block x sequence x value head, one axis]: the reverse pass; stores the gradient of the
  state at every chunk end (``dhs``), the full gradient of v' (``dvn``) and the initial-state gradient. With
  ``ChunkOptions.sbwd_from_t`` it forms w^T dv' from the stored T instead of reading w, which the backward then
  frees after its recompute of the states.
* ``_bwd_wy``      [chunk x value head, one axis]: back through w, u and T (dv, dbeta, the WY part of dg);
  writes the WY part of dk as the start of the value head's dk partial, over T's bytes where a token and value
  head of both hold the same bytes (K = 128 at 16-bit partials).
* ``_bwd_out``     [chunk x value head, one axis]: the output and state parts of dq, dk and all of dg for one
  value head; writes its dq partial (over v''s bytes where they match theirs) and adds its dk terms to the dk
  partial (per-value-head buffers [tokens, HV, K], fp32 or 16-bit: ``ChunkOptions.bwd_partials``). With one
  value head per q/k head it finishes dq and dk itself. No repeated q/k is ever materialised.
* ``_bwd_reduce``  [token block, q/k head]: sums the partials of the value heads that share a q/k head, goes
  back through the l2norm and casts.

With ``ChunkOptions.bwd_group_loop``, ``_bwd_wy`` and ``_bwd_out`` run one program per chunk and q/k head that
takes the value heads sharing it in turn [chunk x q/k head]: ``_bwd_wy`` writes the group's WY part of dk,
``_bwd_out`` finishes dq and dk, and there are neither dq partials nor ``_bwd_reduce``.

No kernel uses a transposed computed tile as a dot operand (a Triton-on-Hopper miscompile hazard): transposed
inputs are loaded with swapped strides, and a product with a transposed computed tile is formed as the
transpose of the product of the transposed loaded operand with that tile.

Products of a 16-bit operand (inputs, stored intermediates) with an fp32 one either split the fp32 operand into
two 16-bit parts, so 16-bit tensor cores give close to fp32 accuracy without fp32 copies of the large tiles, or
round it to 16 bits (one product), product by product (``ChunkOptions``' product modes): rounded where the bf16
results of the hardest oracle cases stayed within their bounds (the forward's w h, the reverse pass's three
products, the backward's per-chunk kernels), split elsewhere.

The backward recomputes w, u, the chunk states and v' from the inputs instead of keeping them from the
forward pass, so only the inputs are saved between forward and backward. With ``ChunkOptions.keep_states`` the
forward keeps them (T too, and a 16-bit copy of v' that ``_out_fwd`` writes) and the backward skips its recompute
(``keep_states`` below says where they are kept).

FLA's in-kernel gate options (``gates=``, gates.py) are computed where g and beta are read: ``_intra_fwd`` turns
the raw gate a into g = -exp(A_log) softplus(a + dt_bias) and logits into beta = sigmoid(beta); ``_bwd_wy`` and
``_bwd_out`` write the gradients of the raw inputs, and ``_bwd_out`` each chunk's part of dA_log and d dt_bias.

All sequences, batched or packed (``cu_seqlens``), go through one flattened token axis: a batch of B
sequences of length T is the packed batch with boundaries 0, T, 2T, ...; a chunk never crosses a
sequence boundary.

q, k and v are read with their own token strides (``sq``, ``sk``, ``sv``): the views the GDN layer passes (slices of
its fused projection, each token's heads contiguous) are read in place, without copies. Every buffer the kernels
write, the gradients of q, k and v included, is contiguous.

The tunables (``ChunkOptions``) and the stage hook are arguments of a call, read once at its start (those of a
``configured`` block when it passes none); the autograd context keeps them, so the backward runs with the
forward's.
"""

from __future__ import annotations

import torch

from deltafuse.ops.gated_delta import chunk_launch as launch
from deltafuse.ops.gated_delta.chunk_options import (DEFAULT_OPTIONS, ChunkOptions, StageHook, configured,
                                                     options_in_effect, resolve)
from deltafuse.ops.gated_delta.gates import NONE, Gates

# the tunables' names, for callers that reach them through the op's entry (benchmarks, tests)
__all__ = ["ChunkOptions", "DEFAULT_OPTIONS", "chunk_gated_delta_rule_triton", "configured", "options_in_effect"]


def _qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    """q, k, v [B, T, heads, D] as [tokens, heads, D] for the kernels, which read any token stride as long as each
    token's heads x D values are contiguous. Views of one tensor (the GDN layer's fused projection, q, k and v side
    by side) are read in place, without copies: saving them for the backward holds no more than copies would. A view
    of a tensor that q and k do not share (transformers <= 5.22 repeats q and k to the value heads, so only v is a
    view) is copied, as anything else that is not contiguous: saving it would keep the whole tensor alive."""
    rows = [x.reshape(tokens, *x.shape[-2:]) for x in (q, k, v)]
    shared = len({r.untyped_storage().data_ptr() for r in rows}) == 1

    def in_place(r: torch.Tensor) -> bool:
        return r.is_contiguous() or (shared and r.stride(2) == 1 and (r.stride(1) == r.shape[2] or r.shape[1] == 1))

    return [r if in_place(r) else r.contiguous() for r in rows]


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens, options,
                stage_hook, A_log, dt_bias, gate, beta_sigmoid, keep):
        B, T, H, K = q.shape
        HV, V = v.shape[-2:]
        plan = launch.plan_for(B, T, cu_seqlens, q.device)
        qf, kf, vf = _qkv_rows(q, k, v, B * T)
        gf = g.reshape(B * T, HV).contiguous()
        bf = beta.reshape(B * T, HV).contiguous()
        h0 = initial_state.contiguous() if initial_state is not None else None
        gates = Gates(A_log.contiguous() if gate else None, dt_bias.contiguous() if gate and dt_bias is not None
                      else None, gate, beta_sigmoid)
        o, ht, kept = launch.forward(qf, kf, vf, gf, bf, scale, h0, output_final_state, l2, plan, options,
                                     stage_hook, gates, keep=keep is not None)
        # kept states go through save_for_backward under saved-tensor hooks (the hooks decide where they live), else
        # on the context, where the backward takes them (freeing each when done with it, and recomputing in a
        # second backward of a retained graph)
        # (the backward writes its own buffers over kept ones only where nothing else holds them: on the context, not
        # where hooks may hand them out again)
        ctx.kept_hooked = keep == "hooks"
        ctx.save_for_backward(qf, kf, vf, gf, bf, h0, gates.A_log, gates.dt_bias, *(kept if ctx.kept_hooked else ()))
        ctx.kept = None if ctx.kept_hooked else kept
        ctx.meta = (B, T, scale, l2, plan, initial_state is not None, gate, beta_sigmoid)
        ctx.options, ctx.stage_hook = options, stage_hook  # the backward runs with the forward's
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        saved = list(ctx.saved_tensors)  # read once (checkpointing's hooks hand each tensor over once)
        qf, kf, vf, gf, bf, h0, A_log, dt_bias = saved[:8]
        kept = saved[8:] if ctx.kept_hooked else ctx.kept
        ctx.kept = None
        del saved
        B, T, scale, l2, plan, has_h0, gate, beta_sigmoid = ctx.meta
        H, K = qf.shape[-2:]
        HV, V = vf.shape[-2:]
        if do is None:
            do = torch.zeros(B * T, HV, V, device=qf.device, dtype=qf.dtype)
        do = do.reshape(B * T, HV, V).contiguous()
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dg, db, dh0, dA, ddt = launch.backward(
            qf, kf, vf, gf, bf, scale, h0, do, dht, l2, plan, has_h0 and ctx.needs_input_grad[6], ctx.options,
            ctx.stage_hook, Gates(A_log, dt_bias, gate, beta_sigmoid), kept=kept, own_kept=not ctx.kept_hooked)
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
                db.view(B, T, HV), None, dh0, None, None, None, None, None,
                None if dA is None else dA.to(A_log.dtype), None if ddt is None else ddt.to(dt_bias.dtype),
                None, None, None)


def chunk_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None = None,
                                  output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                  cu_seqlens: torch.Tensor | None = None, *, options: ChunkOptions | None = None,
                                  stage_hook: StageHook | None = None,
                                  gates: Gates | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (forward and backward) in Triton.

    q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head hv reads q/k head
    hv // (HV // H)); g [B, T, HV] log-space decay; beta [B, T, HV]; initial_state [N, HV, K, V] fp32
    with N = B, or N = len(cu_seqlens) - 1 and B = 1 for packed sequences. Returns (o [B, T, HV, V] in
    q's dtype, final state [N, HV, K, V] fp32 or None). Differentiable in q, k, v, g, beta and
    initial_state, and through the final state when it is returned. Inputs are assumed validated.

    ``options``: the kernels' tunables (default: those of the innermost ``configured`` block, else
    ``DEFAULT_OPTIONS``); ``stage_hook``: called with each stage's name after its kernel launch, forward and
    backward (default: the ``configured`` block's, else none). Both are read once, here: the backward of this
    call runs with them whatever is in effect when it runs.

    ``gates``: FLA's in-kernel gate options (gates.py), computed inside the kernels: g then holds the raw gate a
    (its dtype kept) and beta logits; A_log and dt_bias get gradients.
    """
    K = q.shape[-1]
    if K > 256:
        raise ValueError(f"chunk_gated_delta_rule_triton: q/k head dim K={K} is not supported; allowed: K <= 256")
    if q.dtype not in launch.TL_DTYPES:
        raise ValueError(f"chunk_gated_delta_rule_triton: q.dtype={q.dtype} is not supported; "
                         f"allowed: {sorted(str(d) for d in launch.TL_DTYPES)}")
    options, stage_hook = resolve(options, stage_hook)
    gates = NONE if gates is None else gates
    keep = keep_states(options, (q, k, v, g, beta, initial_state, gates.A_log, gates.dt_bias))
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, float(scale), initial_state, bool(output_final_state),
                                      bool(use_qk_l2norm_in_kernel), cu_seqlens, options, stage_hook, gates.A_log,
                                      gates.dt_bias, bool(gates.gate), bool(gates.beta_sigmoid), keep)


def _checkpoint_pack(pack) -> bool:
    """Whether ``pack`` is one of torch.utils.checkpoint's own pack hooks (non-reentrant checkpointing)."""
    name = getattr(pack, "__qualname__", "")
    return name.startswith(("_checkpoint_hook.", "_recomputation_hook."))


def keep_states(options: ChunkOptions, tensors) -> str | None:
    """How a call keeps its states for its backward (``ChunkOptions.keep_states``): None (it does not: the options
    say not to, no backward can run, or non-reentrant checkpointing records it), "context" (on the autograd
    context) or "hooks" (through the saved-tensor hooks in effect).

    Never under torch.utils.checkpoint's non-reentrant hooks: checkpointing requires its recompute to save what
    the first forward saved, and the recompute runs on autograd's thread, which a ``configured`` block reaches only
    while it is open (``deltafuse.ops._scoped``), so the two could disagree. (A reentrant checkpoint's recompute,
    with no hooks, keeps on the context: that changes nothing checkpointing compares.)"""
    if not options.keep_states or not torch.is_grad_enabled():
        return None
    if not any(t is not None and t.requires_grad for t in tensors):
        return None
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is None:
        return "context"
    return None if _checkpoint_pack(hooks[0]) else "hooks"


chunk_gated_delta_rule_triton.gates_in_kernel = True  # takes ``gates=`` (gates.py)
