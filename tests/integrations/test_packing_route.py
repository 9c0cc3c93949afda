"""How packed-sequence boundaries reach the GDN ops when transformers does not pass them along.

transformers 5.2-5.8 call ``linear_attn(hidden_states, cache_params, ..., attention_mask)`` without the
decoder layer's ``**kwargs``, and their GDN forward takes no ``**kwargs`` and calls its ops without
boundaries. Stand-in layers with exactly that shape exercise the route on every installed transformers: the
boundaries arrive, nothing is left behind (also on exceptions), and a layer that does not apply them is an
error, never a silent fall-through. The real models run the same route in test_packed.py on 5.2 / 5.5 (CI).
"""

from __future__ import annotations

import pytest
import torch

from deltafuse import ops
from deltafuse.integrations.transformers import adapters
from deltafuse.integrations.transformers import boundaries as bd
from deltafuse.integrations.transformers import packing as pk
from tests.helpers import input_gen
from tests.integrations import record_op_kwarg, rel_max

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

B, T, H, K, W = 2, 11, 2, 4, 4
C = H * K


class OldGDN(torch.nn.Module):
    """A GDN layer shaped like transformers 5.2's: no **kwargs, ops called without boundaries."""

    def __init__(self, call_conv=True):
        super().__init__()
        gen = input_gen(0)
        self.conv_w = torch.nn.Parameter(torch.randn(3 * C, W, generator=gen) / W)
        self.g_w = torch.nn.Parameter(torch.randn(C, H, generator=gen) / C)
        self.call_conv = call_conv
        self.layer_idx = 0

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        x = hidden_states.transpose(1, 2)
        if self.call_conv:
            x = adapters.causal_conv1d_fn(x=x, weight=self.conv_w, bias=None, activation="silu", seq_idx=None)
        q, k, v = x.transpose(1, 2).split(C, -1)
        g = torch.nn.functional.logsigmoid(hidden_states[..., :C] @ self.g_w)
        beta = torch.sigmoid(hidden_states[..., C:2 * C] @ self.g_w)
        shape = (hidden_states.shape[0], hidden_states.shape[1], H, K)
        o, _ = adapters.chunk_gated_delta_rule(q.reshape(shape), k.reshape(shape), v.reshape(shape), g=g, beta=beta,
                                               initial_state=None, output_final_state=False,
                                               use_qk_l2norm_in_kernel=True)
        return o.reshape(hidden_states.shape[0], hidden_states.shape[1], C)


class OldDecoderLayer(torch.nn.Module):
    """A decoder layer shaped like transformers 5.2's: its **kwargs do not reach linear_attn."""

    def __init__(self, gdn):
        super().__init__()
        self.linear_attn = gdn

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return self.linear_attn(hidden_states=hidden_states, cache_params=None, attention_mask=attention_mask)


@pytest.fixture
def wrapped(monkeypatch):
    monkeypatch.setattr(OldGDN, "forward", pk.wrap_gdn_forward(OldGDN.forward))
    monkeypatch.setattr(OldDecoderLayer, "forward", pk.wrap_decoder_layer_forward(OldDecoderLayer.forward))


def _packing():
    pos = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    return bd.packing_from_position_ids(pos, B, T), [[(0, 4), (4, 5), (5, 11)], [(0, 7), (7, 11)]]


def _hidden(seed):
    return torch.randn(B, T, 3 * C, generator=input_gen(seed), requires_grad=True)


def _no_state_left():
    return (pk._LAYER_PACKING.get(), pk._OP_PACKING.get(), pk._MODEL_PACKING.get()) == (None,) * 3


def test_boundaries_reach_the_ops_of_an_old_design_layer(wrapped):
    """Through the decoder-layer keywords only, the output and the input gradient equal each sequence alone
    (and differ from the unpacked call, so the comparison can fail)."""
    packing, bounds = _packing()
    layer = OldDecoderLayer(OldGDN())
    x = _hidden(1)
    out = layer(x, **{pk.PACKING_KWARG: packing})
    assert _no_state_left()
    upstream = torch.randn(out.shape, generator=input_gen(2))
    (dx,) = torch.autograd.grad(out, x, upstream)
    ref = torch.zeros_like(out)
    ref_dx = torch.zeros_like(x)
    for b, seqs in enumerate(bounds):
        for s, e in seqs:
            xs = x[b:b + 1, s:e].detach().requires_grad_()
            o = layer(xs)  # one sequence: no boundaries needed
            ref[b:b + 1, s:e] = o.detach()
            ref_dx[b:b + 1, s:e] = torch.autograd.grad(o, xs, upstream[b:b + 1, s:e])[0]
    assert rel_max(out, ref) < 1e-5 and rel_max(dx, ref_dx) < 1e-5
    with torch.no_grad():
        assert rel_max(layer(x), ref) > 1e-3  # without the boundaries the sequences mix


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputation_gets_the_boundaries_again(wrapped, monkeypatch, reentrant):
    from torch.utils.checkpoint import checkpoint

    packing, _ = _packing()
    layer = OldDecoderLayer(OldGDN())
    x = _hidden(3)
    seen = record_op_kwarg(monkeypatch, "chunk_gated_delta_rule", "cu_seqlens")
    kw = {pk.PACKING_KWARG: packing}
    ref = layer(x, **kw)
    ref.square().sum().backward()
    ref_dx, x.grad = x.grad, None
    seen.clear()
    out = checkpoint(lambda h: layer(h, **kw), x, use_reentrant=reentrant)
    assert _no_state_left()
    out.square().sum().backward()  # reentrant checkpointing allows no autograd.grad
    dx = x.grad
    assert len(seen) == 2 and all(c is not None and c.tolist() == packing.cu_seqlens.tolist() for c in seen)
    assert rel_max(out, ref) < 1e-6 and rel_max(dx, ref_dx) < 1e-6
    assert _no_state_left()


def test_nothing_is_left_behind_on_an_exception(wrapped, monkeypatch):
    packing, _ = _packing()
    layer = OldDecoderLayer(OldGDN())

    def fail(*args, **kwargs):
        raise RuntimeError("op failed")

    monkeypatch.setattr(adapters.ops, "chunk_gated_delta_rule", fail)
    with pytest.raises(RuntimeError, match="op failed"):
        layer(_hidden(4), **{pk.PACKING_KWARG: packing})
    assert _no_state_left()


def test_a_layer_that_skips_an_op_is_refused(wrapped):
    """Its conv never saw the boundaries: an error naming the op and the transformers version."""
    packing, _ = _packing()
    layer = OldDecoderLayer(OldGDN(call_conv=False))
    with pytest.raises(bd.PackingError, match=r"without calling deltafuse's conv op.*not supported"):
        layer(_hidden(5), **{pk.PACKING_KWARG: packing})
    assert _no_state_left()


def test_a_gdn_layer_inside_a_packed_call_without_boundaries_is_refused(wrapped):
    """No route brought the boundaries (a decoder layer that is not deltafuse's): refused, not mixed."""
    packing, _ = _packing()
    gdn = OldGDN()
    token = pk._MODEL_PACKING.set(packing)
    try:
        with pytest.raises(bd.PackingError, match=r"received no sequence boundaries.*transformers \d"):
            gdn(_hidden(6))
    finally:
        pk._MODEL_PACKING.reset(token)
    # another layer's boundaries are not taken either
    token = pk._LAYER_PACKING.set((OldGDN(), packing))
    try:
        with torch.no_grad():
            alone = gdn(_hidden(6))  # no packed model call in progress: an ordinary batch
    finally:
        pk._LAYER_PACKING.reset(token)
    with torch.no_grad():
        assert rel_max(alone, gdn(_hidden(6))) == 0.0


def test_op_and_layer_batch_must_agree(wrapped):
    packing, _ = _packing()
    token = pk._OP_PACKING.set(pk._HeldPacking(packing))
    try:
        q = torch.randn(1, T, H, K)
        with pytest.raises(bd.PackingError, match=r"\[1, 11\] batch .* describe \[2, 11\]"):
            adapters.chunk_gated_delta_rule(q, q, q, g=-torch.rand(1, T, H), beta=torch.rand(1, T, H))
    finally:
        pk._OP_PACKING.reset(token)


def test_checkpointing_forward_of_newer_transformers_is_not_wrapped():
    """Newer transformers check ``type(self).forward is forward_with_checkpointing``: a wrapper would silently
    turn gradient checkpointing off, so the decoder-layer row refuses such a forward."""

    def forward_with_checkpointing(self, *args, **kwargs):
        return None

    with pytest.raises(RuntimeError, match="checkpointing forward, which must stay the class attribute"):
        pk.wrap_decoder_layer_forward(forward_with_checkpointing)
    # that every patched decoder layer is still recomputed in backward, on each transformers, is asserted by
    # test_packed.py::test_packed_with_gradient_checkpointing (the GDN ops run again with the same boundaries)


# --- MoE experts output ------------------------------------------------------------------------------------
def test_moe_experts_output_may_be_modified_in_place():
    """transformers 5.2's sparse MoE block does ``expert_output += shared_expert_output``: the experts output
    must not be a view of an intermediate of the autograd Function. Values and gradients after the in-place
    add equal the float64 oracle."""
    from deltafuse.ops.moe import reference
    from deltafuse.ops.moe.naive import naive_moe_experts

    gen = input_gen(7)
    N, Hd, I, E, k = 9, 8, 6, 4, 2
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    leaves = [t.requires_grad_() for t in (torch.randn(N, Hd, generator=gen), torch.rand(N, k, generator=gen),
                                           torch.randn(E, 2 * I, Hd, generator=gen) / Hd ** 0.5,
                                           torch.randn(E, Hd, I, generator=gen) / I ** 0.5)]
    x, w, gu, dn = leaves
    shared = torch.randn(N, Hd, generator=gen)
    upstream = torch.randn(N, Hd, generator=gen)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = naive_moe_experts(ref_leaves[0], idx, *ref_leaves[1:]) + shared.double()
    want = torch.autograd.grad(ref, ref_leaves, upstream.double())
    # the public op (grouped matmuls) and the per-expert loop share the autograd Function
    for impl in (lambda *a: ops.moe_experts(*a, backend="torch"), reference.moe_experts_torch_loop):
        out = impl(x, idx, w, gu, dn)
        assert out._base is None
        out += shared
        got = torch.autograd.grad(out, leaves, upstream)
        assert rel_max(out, ref) < 1e-5
        for g, r in zip(got, want):
            assert rel_max(g, r) < 1e-5
