"""Calls with nothing to compute: an empty batch (B = 0) and empty sequences (T = 0), through every backend an
op has on this machine (the Triton kernels interpreted on CPU). Each returns outputs of the right shape and
dtype that stay in the autograd graph (a loss built on them backpropagates), and what is defined by the inputs
alone is exact: with T = 0 a GDN final state is the initial state (or zeros), and its gradient flows back to
the initial state unchanged."""

from __future__ import annotations

import pytest
import torch

from deltafuse import ops
from tests.helpers import input_gen

GDN = {"chunk": ops.chunk_gated_delta_rule, "recurrent": ops.fused_recurrent_gated_delta_rule}
H, G, K, V = 2, 2, 16, 8


def _gdn_inputs(B, T, grad):
    gen = input_gen(B * 7 + T)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H * G, V)
    g = (-torch.rand(B, T, H * G, generator=gen) - 0.1).requires_grad_(grad)
    beta = (torch.rand(B, T, H * G, generator=gen) * 0.9 + 0.05).requires_grad_(grad)
    h0 = rnd(B, H * G, K, V)
    return q, k, v, g, beta, h0


def _backends(op_name, training):
    """The backends that serve this op's call here: torch always; Triton forced (interpreted on CPU) where it
    has the direction needed (the recurrent kernel is inference only)."""
    names = ["torch", "triton"]
    if op_name == "recurrent" and training:
        names.remove("triton")
    return names


@pytest.mark.parametrize("B,T", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("name", list(GDN))
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_gdn_with_nothing_to_compute(name, B, T, with_initial, training):
    for backend in _backends(name, training):
        q, k, v, g, beta, h0 = _gdn_inputs(B, T, training)
        init = h0 if with_initial else None
        with torch.set_grad_enabled(training):
            o, final = GDN[name](q, k, v, g, beta, initial_state=init, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, backend=backend)
        assert o.shape == (B, T, H * G, V) and o.dtype == q.dtype, backend
        assert final.shape == (B, H * G, K, V) and final.dtype == torch.float32, backend
        expected = h0.detach() if with_initial else torch.zeros(B, H * G, K, V)
        assert torch.equal(final.detach(), expected), backend  # nothing happened to the state
        if training:
            assert o.requires_grad and (final.requires_grad or not with_initial), backend
            weight = torch.randn(final.shape)
            (o.sum() + (final * weight).sum()).backward()
            if with_initial and B:
                assert torch.equal(h0.grad, weight), backend  # d final / d h0 = identity
            for t in (q, k, v, g, beta):
                assert t.grad is None or (t.grad.shape == t.shape and t.grad.numel() == 0), backend


@pytest.mark.parametrize("shape", [(0, 8, 5), (2, 8, 0)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_conv1d_with_nothing_to_compute(shape, backend):
    x = torch.randn(*shape, requires_grad=True)
    w, b = torch.randn(8, 4, requires_grad=True), torch.randn(8, requires_grad=True)
    out, final = ops.causal_conv1d_fn(x, w, b, activation="silu", return_final_states=True, backend=backend)
    assert out.shape == shape and out.requires_grad
    assert final.shape == (shape[0], 8, 3)
    assert torch.equal(final, torch.zeros_like(final))  # no input: an all-zero history
    out.sum().backward()
    assert x.grad.shape == x.shape
    for t in (w, b):  # no input token: no gradient (None where the output does not depend on it at all)
        assert t.grad is None or torch.equal(t.grad, torch.zeros_like(t))


EMPTY = {
    "rms_norm_zero_centered": lambda be: ops.rms_norm_zero_centered(torch.randn(0, 5, 16, requires_grad=True),
                                                                    torch.randn(16), backend=be),
    "rms_norm_gated": lambda be: ops.rms_norm_gated(torch.randn(0, 5, 16, requires_grad=True), torch.randn(0, 5, 16),
                                                    torch.randn(16), backend=be),
    "apply_rotary_pos_emb": lambda be: ops.apply_rotary_pos_emb(torch.randn(0, 4, 5, 16, requires_grad=True),
                                                                torch.randn(0, 2, 5, 16), torch.randn(0, 5, 8),
                                                                torch.randn(0, 5, 8), backend=be)[0],
    "swiglu": lambda be: ops.swiglu(torch.randn(0, 5, 16, requires_grad=True), torch.randn(0, 5, 16), backend=be),
    "token_logprobs": lambda be: ops.token_logprobs(torch.randn(0, 16, requires_grad=True), torch.randn(32, 16),
                                                    torch.zeros(0, dtype=torch.long), backend=be).log_probs,
    "moe_experts": lambda be: ops.moe_experts(torch.randn(0, 16, requires_grad=True), torch.zeros(0, 2, dtype=torch.long),
                                              torch.rand(0, 2), torch.randn(4, 64, 16), torch.randn(4, 16, 32),
                                              backend=be),
}


@pytest.mark.parametrize("name", list(EMPTY))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_elementwise_ops_with_an_empty_batch(name, backend):
    out = EMPTY[name](backend)
    assert out.shape[0] == 0 and out.numel() == 0 and out.requires_grad
    out.sum().backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_loss_with_an_empty_batch(reduction, backend):
    """No target token: the sum is 0 and the mean is NaN (0 / 0), as torch's cross_entropy gives."""
    hidden, weight = torch.randn(0, 5, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    labels = torch.zeros(0, 5, dtype=torch.long)
    loss = ops.fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, backend=backend)
    want = torch.nn.functional.cross_entropy(torch.zeros(0, 32), torch.zeros(0, dtype=torch.long),
                                             reduction=reduction)
    assert loss.shape == () and torch.equal(loss.isnan(), want.isnan())
    if reduction == "sum":
        assert loss.item() == 0.0
        loss.backward()
        assert torch.equal(weight.grad, torch.zeros_like(weight))
