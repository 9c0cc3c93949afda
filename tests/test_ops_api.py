"""Bad inputs to the public ops: each a clear error naming the argument, before any kernel runs."""

import pytest
import torch

from deltafuse import ops
from deltafuse.backends import REGISTRY, BackendError


def gdn_inputs(B=1, T=10, H=2, HV=4, K=8, V=8, dtype=torch.float32):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = -torch.rand(B, T, HV) - 0.01
    beta = torch.rand(B, T, HV) * 0.9 + 0.05
    return q, k, v, g, beta


@pytest.mark.parametrize("op", [ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule])
@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(q=a["q"][0]), r"q must have 4 dimensions, got shape \(10, 2, 8\)"),
    (lambda a: a.update(k=a["k"][:, :, :1]), r"k must have q's shape \(1, 10, 2, 8\)"),
    (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][:, :, :3], beta=a["beta"][:, :, :3]),
     r"HV=3 value heads, which is not a multiple of the H=2"),
    (lambda a: a.update(v=a["v"][:, :9]), r"v must be \[B, T, HV, V\] with B=1, T=10"),
    (lambda a: a.update(g=a["g"][:, :, :2]), r"g must be \[B, T, HV\] = \(1, 10, 4\), got \(1, 10, 2\)"),
    (lambda a: a.update(beta=a["beta"][..., None]), r"beta must have 3 dimensions"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), r"q has dtype int32; allowed: float16, bfloat16"),
    (lambda a: a.update(v=a["v"].double()), r"q, k, v must share a dtype"),
    (lambda a: a.update(q=a["q"].to("meta")), r"k is on cpu but q is on meta"),
    (lambda a: a.update(initial_state=torch.randn(2, 4, 8, 8)),
     r"initial_state must be \[N, HV, K, V\] = \(1, 4, 8, 8\) with N = B, got \(2, 4, 8, 8\)"),
    (lambda a: a.update(scale="big"), r"scale must be a float or None"),
    (lambda a: a.update(head_first=True), r"head_first=True is not supported"),
    (lambda a: a.update(frobnicate=1), r"unexpected keyword argument\(s\) \['frobnicate'\]"),
])
def test_gdn_bad_arguments(op, mutate, match):
    q, k, v, g, beta = gdn_inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        op(**args)


@pytest.mark.parametrize("cu,B,match", [
    (torch.tensor([0, 4, 10]), 2, r"cu_seqlens needs the batch dimension to be 1.*B=2"),
    (torch.tensor([1, 4, 10]), 1, r"cu_seqlens must start at 0, got 1"),
    (torch.tensor([0, 6, 4, 10]), 1, r"cu_seqlens must be strictly increasing"),
    (torch.tensor([0, 4, 4, 10]), 1, r"cu_seqlens must be strictly increasing"),
    (torch.tensor([0, 4, 9]), 1, r"cu_seqlens must end at T=10 \(the packed length\), got 9"),
    (torch.tensor([0.0, 10.0]), 1, r"cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([[0, 10]]), 1, r"cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([0]), 1, r"at least 2 offsets"),
])
def test_gdn_bad_cu_seqlens(cu, B, match):
    q, k, v, g, beta = gdn_inputs(B=B)
    with pytest.raises(ValueError, match=match):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)


def test_gdn_initial_state_count_follows_cu_seqlens():
    q, k, v, g, beta = gdn_inputs()
    cu = torch.tensor([0, 3, 10])
    with pytest.raises(ValueError, match=r"N = len\(cu_seqlens\) - 1, got \(1, 4, 8, 8\)"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=torch.randn(1, 4, 8, 8))


def test_forced_backend_that_cannot_serve_raises():
    q, k, v, g, beta = gdn_inputs()
    with pytest.raises(BackendError, match="backend 'fla' cannot serve chunk_gated_delta_rule"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, backend="fla")
    with pytest.raises(ValueError, match="backend='gpu'"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, backend="gpu")
    assert "fla" in [c.name for c in REGISTRY.candidates("chunk_gated_delta_rule")]


@pytest.mark.parametrize("kw,match", [
    (dict(x=torch.randn(2, 6)), r"x must have 3 dimensions"),
    (dict(weight=torch.randn(5, 4)), r"weight must be \[C, W\] with C=6 channels of x, got \(5, 4\)"),
    (dict(bias=torch.randn(5)), r"bias must be \[C\] = \(6,\), got \(5,\)"),
    (dict(activation="gelu"), r"activation='gelu' is not supported; allowed: None, 'silu', 'swish'"),
    (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int32)), r"seq_idx must be \[B, T\] = \(2, 10\)"),
    (dict(seq_idx=torch.zeros(2, 10)), r"seq_idx has dtype float32; allowed: int32, int64"),
    (dict(cu_seqlens=torch.tensor([0, 10])), r"cu_seqlens needs the batch dimension to be 1"),
    (dict(initial_states=torch.randn(2, 6, 4)), r"initial_states must be \[B, C, W-1\] = \(2, 6, 3\)"),
])
def test_conv_bad_arguments(kw, match):
    args = dict(x=torch.randn(2, 6, 10), weight=torch.randn(6, 4), bias=None)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ops.causal_conv1d_fn(**args)


def test_conv_update_bad_state():
    with pytest.raises(ValueError, match=r"conv_state must be \[B, C, S\] with B=2, C=6, S >= W-1 = 3"):
        ops.causal_conv1d_update(torch.randn(2, 6, 1), torch.randn(2, 6, 2), torch.randn(6, 4))
