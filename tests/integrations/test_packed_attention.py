"""Sequence-by-sequence causal attention for long packed rows: equal to transformers' dense block-causal
attention, and used only when transformers' mask is exactly block-causal."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from deltafuse.verify import core as verify
from deltafuse.integrations.transformers import adapters, adapters_fused
from deltafuse.integrations.transformers import packing as pk
from deltafuse.models import TINY_NAMES
from deltafuse.ops.attention import packed as packed_ops
from tests.helpers import gpu, input_gen, needs_cuda

pytestmark = pytest.mark.usefixtures("clean_deltafuse")


def _dense_block_causal(q, k, v, offsets, scaling):
    """Reference: one SDPA over each whole row with the [T, T] block-causal mask (float64 in the tests)."""
    B, Hq, T, _ = q.shape
    seq = torch.zeros(B * T, dtype=torch.long)
    for i, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        seq[s:e] = i
    seq = seq.view(B, T).to(q.device)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device))
    mask = (seq[:, :, None] == seq[:, None, :]) & causal  # [B, T, T]
    group = Hq // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=mask[:, None], scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("Hq,Hk", [(4, 4), (4, 2), (6, 1)])
def test_by_sequence_equals_dense_block_causal(Hq, Hk):
    g = input_gen(Hq * 10 + Hk)
    B, T, D = 2, 37, 8
    offsets = (0, 5, 6, 20, 37, 38, 60, 74)  # row 0: 5, 1, 14, 17; row 1: 1, 22, 14 (length-1 sequences)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    got = packed_ops.causal_attention_by_sequence(q, k, v, offsets, scaling=0.4)
    assert got.shape == (B, T, Hq, D) and got.is_contiguous()
    grads = torch.autograd.grad((got * dy).sum(), (q, k, v))
    want = _dense_block_causal(q, k, v, offsets, 0.4)
    want_grads = torch.autograd.grad((want * dy).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_rows_must_start_sequences():
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="crosses the end of row 0"):
        packed_ops.causal_attention_by_sequence(q, q, q, (0, 6, 8))


def test_block_causal_only_without_mask_and_explicit_boundaries():
    """The text-model wrapper marks the packing block-causal only when transformers' mask comes from the
    restarting position_ids alone."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    seen = []

    def original(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, **kwargs):
        seen.append(kwargs.get(pk.PACKING_KWARG))
        return None

    wrapped = pk.wrap_text_model_forward(original)
    ids = torch.zeros(1, 6, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    wrapped(m, input_ids=ids, position_ids=pos)
    assert seen[-1].block_causal
    wrapped(m, input_ids=ids, cu_seq_lens_q=torch.tensor([0, 3, 6]))  # positions set from the boundaries
    assert seen[-1].block_causal
    wrapped(m, input_ids=ids, position_ids=torch.arange(6)[None], cu_seq_lens_q=torch.tensor([0, 3, 6]))
    assert not seen[-1].block_causal  # the user's positions do not restart: transformers builds plain causal


@pytest.mark.parametrize("model", list(TINY_NAMES))
def test_packed_model_with_the_route_equals_per_sequence_stock(monkeypatch, model):
    calls = []
    real = packed_ops.causal_attention_by_sequence

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(adapters_fused, "PACKED_ATTENTION_MIN_TOKENS", 1)
    monkeypatch.setattr(packed_ops, "causal_attention_by_sequence", counting)
    from deltafuse import backends

    backends.REGISTRY.clear_cache()
    try:
        result = verify.verify_model(model, packed=True)
    finally:
        backends.REGISTRY.clear_cache()
    assert result.ok, result.format()
    assert calls, "the sequence-by-sequence route was not used"
    rows = verify.PACKED_ROWS
    want = [0]
    for row in rows:
        for n in row:
            want.append(want[-1] + n)
    assert all(tuple(c) == tuple(want) for c in calls)


# --- torch's varlen_attn route ------------------------------------------------------------------------------
def _fake_varlen(style, calls):
    """A stand-in for torch.nn.attention.varlen.varlen_attn with the documented semantics (flat [N, H, D]
    tensors, int32 cumulative offsets, causal within each sequence), computed per sequence in the input dtype."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False, **causal):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
        assert causal == ({"window_size": (-1, 0)} if style == "window" else {"is_causal": True})
        assert q.dim() == 3 and k.shape[0] == q.shape[0]
        calls.append(dict(heads=(q.shape[1], k.shape[1]), scale=scale, gqa=enable_gqa, max=max_q))
        offs = cu_q.tolist()
        assert max_q == max(e - s for s, e in zip(offs[:-1], offs[1:]))
        outs = []
        for s, e in zip(offs[:-1], offs[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            if enable_gqa:
                ks = ks.repeat_interleave(q.shape[1] // k.shape[1], 0)
                vs = vs.repeat_interleave(q.shape[1] // k.shape[1], 0)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(outs)

    return varlen_attn


@pytest.mark.parametrize("style,takes_scale,takes_gqa", [("window", True, True), ("window", True, False),
                                                         ("is_causal", False, False)])
@pytest.mark.parametrize("Hq,Hk,scaling", [(4, 2, None), (4, 4, 0.4), (6, 1, 8 ** -0.5)])
def test_varlen_route_equals_dense_block_causal(monkeypatch, style, takes_scale, takes_gqa, Hq, Hk, scaling):
    """The argument mapping onto varlen_attn (flat layout, int32 offsets, causal keyword of either torch
    version, scale and grouped-query heads when it takes them), against the dense float64 reference with every
    gradient; a non-default scale on a varlen_attn without scale= goes to the per-sequence loop."""
    calls = []
    monkeypatch.setattr(packed_ops, "varlen_api",
                        lambda: (_fake_varlen(style, calls), ("window_size", (-1, 0)) if style == "window"
                                 else ("is_causal", True), takes_scale, takes_gqa))
    g = input_gen(Hq + Hk)
    B, T, D = 2, 37, 8
    offsets = (0, 5, 6, 20, 37, 38, 60, 74)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    got = packed_ops.causal_attention_varlen(q, k, v, offsets, scaling=scaling,
                                             cu_seqlens=torch.tensor(offsets, dtype=torch.int64))
    want = _dense_block_causal(q, k, v, offsets, scaling)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((got * dy).sum(), (q, k, v)),
                    torch.autograd.grad((want * dy).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    non_default = scaling is not None and scaling != D ** -0.5
    if non_default and not takes_scale:
        assert calls == [], "a scale varlen_attn cannot take must go to the loop"
        return
    assert len(calls) == 1 and calls[0]["max"] == 22
    assert calls[0]["scale"] == (scaling if non_default else None)
    assert calls[0]["heads"] == ((Hq, Hk) if takes_gqa else (Hq, Hq)) and calls[0]["gqa"] == (takes_gqa and Hq != Hk)


def test_varlen_route_hands_unsupported_calls_to_the_loop(monkeypatch):
    calls, loops = [], []
    monkeypatch.setattr(packed_ops, "varlen_api", lambda: (_fake_varlen("window", calls), ("window_size", (-1, 0)),
                                                           True, True))
    real = packed_ops.causal_attention_by_sequence
    monkeypatch.setattr(packed_ops, "causal_attention_by_sequence",
                        lambda *a, **kw: (loops.append(1), real(*a, **kw))[1])
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    packed_ops.causal_attention_varlen(q, q, q, (0, 3, 6), dropout=0.1)
    big = torch.randn(1, 1, 4, packed_ops.VARLEN_MAX_HEAD_DIM + 8, dtype=torch.float64)
    packed_ops.causal_attention_varlen(big, big, big, (0, 4))
    assert len(loops) == 2 and calls == []
    monkeypatch.setattr(packed_ops, "varlen_api", lambda: None)
    packed_ops.causal_attention_varlen(q, q, q, (0, 3, 6))
    assert len(loops) == 3
    monkeypatch.setattr(packed_ops, "varlen_api", lambda: (_fake_varlen("window", calls), ("window_size", (-1, 0)),
                                                           True, True))
    with pytest.raises(ValueError, match=r"row starts \[4\] are not sequence starts"):
        packed_ops.causal_attention_varlen(torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8),
                                           torch.randn(2, 2, 4, 8), (0, 6, 8))


def test_loop_keeps_cudnn_attention_out():
    """cuDNN builds an execution plan per new sequence length; the loop runs with it disabled (and restores
    the global setting afterwards)."""
    seen = []
    real = F.scaled_dot_product_attention
    before = torch.backends.cuda.cudnn_sdp_enabled()

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    q = torch.randn(1, 2, 6, 8)
    try:
        F.scaled_dot_product_attention = spy
        packed_ops.causal_attention_by_sequence(q, q, q, (0, 2, 6))
    finally:
        F.scaled_dot_product_attention = real
    assert seen == [False, False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_route_selection(monkeypatch):
    from deltafuse.backends import probes
    from deltafuse.ops.attention import candidates as rows
    from deltafuse.backends.registry import CallInfo, Registry

    reg = Registry()
    rows.register(reg)
    cpu = {d.candidate: d for d in reg.explain(rows.PACKED_ATTENTION, CallInfo(torch.device("cpu"),
                                                                                 torch.bfloat16, True))}
    assert cpu["torch"].chosen and "CUDA" in cpu["varlen"].reason
    cuda = {d.candidate: d for d in reg.explain(rows.PACKED_ATTENTION, CallInfo(torch.device("cuda", 0),
                                                                                  torch.float32, True))}
    assert cuda["torch"].chosen and cuda["varlen"].reason
    if packed_ops.varlen_api() is not None:
        for cap, chosen in (((9, 0), "varlen"), ((8, 0), "varlen"), ((7, 5), "torch"), ((7, 0), "torch")):
            monkeypatch.setattr(probes, "cuda_capability", lambda index, cap=cap: cap)
            cuda = {d.candidate: d for d in reg.explain(rows.PACKED_ATTENTION, CallInfo(torch.device("cuda", 0),
                                                                                          torch.bfloat16, True))}
            assert cuda[chosen].chosen, (cap, cuda)
            if chosen == "torch":  # GPUs before Ampere have no flash attention: the per-sequence loop
                assert f"compute capability 8.0 or newer; this GPU has {cap[0]}.{cap[1]}" in cuda["varlen"].reason


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["varlen", "loop", "varlen-padded"])
def test_gpu_bf16_routes_equal_float64_dense(impl):
    """Qwen3.5-35B-A3B's attention heads (16 query, 2 key/value, size 256), 4,096 tokens in sequences of
    1 to 700 tokens, bf16, forward and backward against the dense block-causal reference in float64;
    ``varlen-padded``: the offsets only on the device, 7 empty sequences after the real ones and the row's length
    as the longest (a captured CUDA graph's form)."""
    g = input_gen(31)
    lengths = [1, 700, 64, 333, 2, 1000, 129, 517, 1350]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    T = offsets[-1]
    leaves = [torch.randn(1, h, T, 256, generator=g).cuda() for h in (16, 2, 2)]
    dy = torch.randn(1, T, 16, 256, generator=g).cuda()
    fn = packed_ops.causal_attention_by_sequence if impl == "loop" else packed_ops.causal_attention_varlen
    if impl != "loop" and packed_ops.varlen_api() is None:
        pytest.skip("this torch has no varlen_attn")
    low = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
    if impl == "varlen-padded":
        cu = torch.tensor(offsets + [T] * 7, device="cuda", dtype=torch.int32)
        out = fn(*low, None, cu_seqlens=cu, longest=T)
    else:
        out = fn(*low, offsets, cu_seqlens=torch.tensor(offsets, device="cuda", dtype=torch.int32))
    got = [out] + list(torch.autograd.grad((out.float() * dy).sum(), low))
    ref_leaves = [t.double().requires_grad_() for t in leaves]
    want = _dense_block_causal(*ref_leaves, offsets, None)
    want = [want] + list(torch.autograd.grad((want * dy.double()).sum(), ref_leaves))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())
        assert err < 1e-2, f"{impl} {name}: relative RMS error {err:.2e}"



def test_padded_offsets_go_to_varlen_alone():
    """Offsets known only on the device (a captured graph's padded form): the per-sequence loop cannot serve them
    and says so in one line, as does varlen_attn for an fp32 query (flash attention)."""
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"needs the sequence offsets on the host \(got offsets=None"):
        packed_ops.causal_attention_by_sequence(q, q, q, None, cu_seqlens=torch.tensor([0, 3, 6, 6]), longest=6)
    if packed_ops.varlen_api() is not None:
        with pytest.raises(ValueError, match=r"a padded offsets tensor needs fp16/bf16 queries"):
            packed_ops.causal_attention_varlen(q, q, q, None, cu_seqlens=torch.tensor([0, 3, 6, 6]), longest=6)


def test_padded_packing_form():
    from deltafuse.integrations.transformers.boundaries import PackingError, packing_from_position_ids

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    packing = packing_from_position_ids(pos, 1, 9)
    padded = packing.padded_to(5)
    assert padded.padded and padded.offsets is None and padded.num_sequences == 5
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 9, 9, 9] and padded.cu_seqlens.dtype == torch.int32
    assert padded.seq_idx is packing.seq_idx and not padded.rows_are_sequences
    assert packing.padded_to(3).cu_seqlens.tolist() == [0, 3, 5, 9]
    with pytest.raises(PackingError, match=r"padded_to\(capacity=2\): the batch holds 3 sequences; allowed: an int "
                                           r">= 3"):
        packing.padded_to(2)
    with pytest.raises(PackingError, match="not padded already"):
        padded.padded_to(8)


def test_attention_of_padded_rows_without_mask_is_refused():
    """A padded packed batch whose mask was left out (varlen_attn was to serve it) reaching transformers' function
    raises instead of attending across the sequences of the row."""
    from deltafuse.integrations.transformers.adapters_fused import wrap_sdpa_attention
    from deltafuse.integrations.transformers.boundaries import PackingError, packing_from_position_ids
    from deltafuse.integrations.transformers.packing import PACKING_KWARG

    stock = []
    wrapped = wrap_sdpa_attention(lambda *a, **kw: (stock.append(1), (a[1], None))[1])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    padded = dataclasses.replace(packing_from_position_ids(pos, 1, 6), block_causal=True).padded_to(4)
    q = torch.randn(1, 2, 6, 8)
    module = types.SimpleNamespace(is_causal=True)
    with pytest.raises(PackingError, match=r"attention of a padded packed batch \[1, 6\] got no mask"):
        wrapped(module, q, q, q, None, **{PACKING_KWARG: padded})
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    wrapped(module, q, q, q, mask, **{PACKING_KWARG: padded})  # with the mask: transformers' function, correct
    assert stock == [1]
