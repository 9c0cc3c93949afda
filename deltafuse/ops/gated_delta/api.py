"""Public gated delta rule ops with FLA's signatures; the registry picks the implementation per call."""

from __future__ import annotations

import torch

from deltafuse import backends
from deltafuse.ops.gated_delta.candidates import CHUNK, RECURRENT
from deltafuse.ops.gated_delta.gates import Gates, in_torch
from deltafuse.ops import _library
from deltafuse.ops import _checks as check

QKV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, kwargs):
    if kwargs.pop("head_first", False):
        check.fail("head_first=True is not supported; pass [B, T, H, D] tensors (head_first=False)")
    for name in ("chunk_size", "cu_seqlens_cpu", "chunk_indices", "seq_idx"):
        kwargs.pop(name, None)  # accepted for FLA/transformers compatibility; derived internally
    if kwargs:
        # transformers forwards its attention kwargs (cu_seq_lens_k, max_length_q, ...): ignore those,
        # but never a keyword that would change the maths.
        known_extra = {"cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "output_attentions",
                       "use_cache", "attention_mask"}
        unknown = sorted(set(kwargs) - known_extra)
        if unknown:
            check.fail(f"unexpected keyword argument(s) {unknown}; see deltafuse.ops.chunk_gated_delta_rule")
    check.tensor("q", q, 4, QKV_DTYPES)
    check.tensor("k", k, 4, QKV_DTYPES)
    check.tensor("v", v, 4, QKV_DTYPES)
    check.tensor("g", g, 3)
    check.tensor("beta", beta, 3)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        check.fail(f"k must have q's shape {check.shape(q)} [B, T, H, K], got {check.shape(k)}")
    if v.shape[:2] != (B, T):
        check.fail(f"v must be [B, T, HV, V] with B={B}, T={T} as q, got {check.shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        check.fail(f"v has HV={HV} value heads, which is not a multiple of the H={H} query/key heads")
    if q.dtype != k.dtype:
        check.fail(f"q and k must share a dtype, got {q.dtype} and {k.dtype} (v may differ: they are computed in "
                   "the wider of the two)")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            check.fail(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {check.shape(t)}")
    check.same_device("q", q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    n = B
    if cu_seqlens is not None:
        n = check.cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check.tensor("initial_state", initial_state, 4)
        if initial_state.shape != (n, HV, K, V):
            what = "len(cu_seqlens) - 1" if cu_seqlens is not None else "B"
            check.fail(f"initial_state must be [N, HV, K, V] = {(n, HV, K, V)} with N = {what}, "
                       f"got {check.shape(initial_state)}")
    if scale is None:
        scale = K**-0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        check.fail(f"scale must be a float or None (K**-0.5), got {scale!r}")
    return float(scale)


def _gates(g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel) -> Gates:
    """FLA's in-kernel gate and beta options, checked, with FLA's semantics (gates.py): ``use_gate_in_kernel=True``
    takes ``g`` as the raw gate and the log-space decay is ``-exp(A_log) * softplus(g + dt_bias)`` in fp32 (A_log
    and dt_bias: [HV], dt_bias optional), ``use_beta_sigmoid_in_kernel=True`` takes ``beta`` as logits (beta =
    sigmoid(beta), fp32). Both are differentiable (A_log and dt_bias get gradients). deltafuse's Triton kernels
    compute them inside; other backends are handed g and beta computed in torch."""
    HV = g.shape[-1]
    if use_gate_in_kernel:
        check.tensor("A_log", A_log, 1)
        if A_log.shape != (HV,):
            check.fail(f"A_log must be [HV] = ({HV},), got {check.shape(A_log)}")
        check.same_device("g", g, A_log=A_log, dt_bias=dt_bias)
        if dt_bias is not None:
            check.tensor("dt_bias", dt_bias, 1)
            if dt_bias.shape != (HV,):
                check.fail(f"dt_bias must be [HV] = ({HV},), got {check.shape(dt_bias)}")
    elif A_log is not None or dt_bias is not None:
        check.fail("A_log / dt_bias are read only with use_gate_in_kernel=True (g is then the raw gate); got "
                   f"use_gate_in_kernel={use_gate_in_kernel!r}")
    gate = bool(use_gate_in_kernel)
    return Gates(A_log if gate else None, dt_bias if gate else None, gate, bool(use_beta_sigmoid_in_kernel))


def _wider(q, k, v):
    """q, k and v in one dtype, the wider of q's and v's (FLA accepts e.g. fp32 q/k with fp16 v)."""
    dtype = torch.promote_types(q.dtype, v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _op_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, kwargs, backend, use_gate_in_kernel, A_log,
               dt_bias, use_beta_sigmoid_in_kernel):
    """A public call's arguments checked (``backend=`` too, for ``op``) and made what its op takes: (q, k, v in the
    wider dtype, the scale as a float, FLA's gate options as ``Gates``)."""
    scale = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, kwargs)
    if backend is not None:
        backends.call_backend(op, backend)
    gates = _gates(g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    q, k, v = _wider(q, k, v)
    return q, k, v, scale, gates


@check.public_op(CHUNK)
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                           *, backend: str | None = None, use_gate_in_kernel: bool = False,
                           A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           use_beta_sigmoid_in_kernel: bool = False,
                           **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a whole sequence (training and prefill), FLA's signature and layouts.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head hv reads q/k head
    hv // (HV // H)); g: [B, T, HV] log-space decay; beta: [B, T, HV]; initial_state: [N, HV, K, V] fp32;
    cu_seqlens: offsets of packed sequences (B must be 1). Returns (o [B, T, HV, V] in q's dtype,
    final state [N, HV, K, V] fp32 or None). ``backend=`` may force 'triton', 'fla' or 'torch'.
    ``use_gate_in_kernel`` (with ``A_log``, ``dt_bias``) and ``use_beta_sigmoid_in_kernel``: FLA's options, g and
    beta then raw (see ``_gates``; deltafuse's Triton kernels compute them inside). v may have another dtype than
    q/k (computed in the wider one).
    """
    out_dtype = q.dtype
    q, k, v, scale, gates = _op_inputs(CHUNK, q, k, v, g, beta, scale, initial_state, cu_seqlens, kwargs, backend,
                                       use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    o, final, _ = _chunk_op(q, k, v, g, beta, initial_state, gates.A_log, gates.dt_bias, cu_seqlens, scale,
                            bool(output_final_state), bool(use_qk_l2norm_in_kernel), gates.gate, gates.beta_sigmoid,
                            backend, _library.grad_mask(q, k, v, g, beta, initial_state, gates.A_log, gates.dt_bias),
                            torch.compiler.is_compiling())
    return o.to(out_dtype), (final if output_final_state else None)


@check.public_op(RECURRENT)
def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens: torch.Tensor | None = None,
                                     *, backend: str | None = None, inplace_final_state: bool = False,
                                     use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
                                     dt_bias: torch.Tensor | None = None, use_beta_sigmoid_in_kernel: bool = False,
                                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (decoding), same signature and layouts as chunk_gated_delta_rule.

    ``inplace_final_state=True`` (inference, with ``output_final_state`` and a contiguous fp32
    ``initial_state``): the final state is written over ``initial_state`` and that tensor is returned, as a
    decoding cache that replaces its state wants (the Triton kernel writes it in place; other backends copy)."""
    out_dtype = q.dtype
    q, k, v, scale, gates = _op_inputs(RECURRENT, q, k, v, g, beta, scale, initial_state, cu_seqlens, kwargs,
                                       backend, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    mask = _library.grad_mask(q, k, v, g, beta, initial_state, gates.A_log, gates.dt_bias)
    inplace = bool(inplace_final_state) and bool(output_final_state)
    if inplace:
        if initial_state is None:
            check.fail("inplace_final_state=True needs an initial_state to write the final state into; got None")
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            check.fail("inplace_final_state=True needs a contiguous fp32 initial_state; got "
                       f"{str(initial_state.dtype).replace('torch.', '')} with strides {tuple(initial_state.stride())}")
        if any(mask):
            check.fail("inplace_final_state=True is for inference, but autograd would differentiate this call "
                       "(an input requires grad); call it under torch.no_grad()")
    compiling = torch.compiler.is_compiling()
    # a compiled graph's custom op declares no mutation: there the public op copies instead (below)
    o, final, _ = _recurrent_op(q, k, v, g, beta, initial_state, gates.A_log, gates.dt_bias, cu_seqlens, scale,
                                bool(output_final_state), bool(use_qk_l2norm_in_kernel), gates.gate,
                                gates.beta_sigmoid, backend, mask, compiling, inplace and not compiling)
    if inplace and final is not initial_state:
        final = initial_state.copy_(final)
    return o.to(out_dtype), (final if output_final_state else None)


_GDN_TENSORS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _gdn_fake(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, output_final_state,
              use_qk_l2norm_in_kernel, gate, beta_sigmoid, backend, grad_mask, validate, inplace=False):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    final = None
    if output_final_state:
        n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
        final = q.new_empty(n, HV, K, V, dtype=torch.promote_types(q.dtype, torch.float32))
    return _library.fake_outputs(q.new_empty(B, T, HV, V), final, like=q)


def _gdn_run(op, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, output_final_state, l2, gate,
             beta_sigmoid, backend, grad_mask, validate, inplace=False):
    if validate and cu_seqlens is not None:
        _library.named_errors(op, check.cu_seqlens, cu_seqlens, q.shape[0], q.shape[1])
    impl = _library.select(op, backend, grad_mask, q, k, v, g, beta, initial_state)
    # an implementation that can write the final state over the initial one does (the caller copies otherwise)
    extra = {"inplace_final_state": True} if inplace and getattr(impl, "inplace_final_state", False) else {}
    # FLA's gate options: inside the kernels of an implementation that takes them, else computed here in torch
    # (recorded by autograd with the backend's own graph)
    fused = (gate or beta_sigmoid) and getattr(impl, "gates_in_kernel", False)

    def run(q_, k_, v_, g_, b_, h0, a_log, dtb):
        gates = Gates(a_log, dtb, gate, beta_sigmoid)
        if fused:
            o, final = impl(q_, k_, v_, g_, b_, scale, h0, output_final_state, l2, cu_seqlens, gates=gates, **extra)
        else:
            g_, b_ = in_torch(g_, b_, gates)
            o, final = impl(q_, k_, v_, g_, b_, scale, h0, output_final_state, l2, cu_seqlens, **extra)
        return o, (final if output_final_state else None)

    return _library.run_forward([q, k, v, g, beta, initial_state, A_log, dt_bias], grad_mask, run, q.device.type)


@_library.define(CHUNK, _GDN_TENSORS, _gdn_fake)
def _chunk_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None, scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
              gate: bool, beta_sigmoid: bool, backend: str | None, grad_mask: list[bool],
              validate: bool) -> list[torch.Tensor]:
    return _gdn_run(CHUNK, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, output_final_state,
                    use_qk_l2norm_in_kernel, gate, beta_sigmoid, backend, grad_mask, validate)


@_library.define(RECURRENT, _GDN_TENSORS, _gdn_fake)
def _recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, scale: float, output_final_state: bool,
                  use_qk_l2norm_in_kernel: bool, gate: bool, beta_sigmoid: bool, backend: str | None,
                  grad_mask: list[bool], validate: bool, inplace: bool) -> list[torch.Tensor]:
    """``inplace``: the final state may be written over ``initial_state`` (eager inference calls only)."""
    return _gdn_run(RECURRENT, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, output_final_state,
                    use_qk_l2norm_in_kernel, gate, beta_sigmoid, backend, grad_mask, validate, inplace)
