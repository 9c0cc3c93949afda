"""The torch causal depthwise conv1d against the float64 loop oracle and transformers' stock functions."""

from __future__ import annotations

import pytest
import torch

from deltafuse.ops.conv1d.naive import naive_causal_conv1d
from deltafuse.ops.conv1d.reference import causal_conv1d_fn_torch, causal_conv1d_update_torch
from tests.helpers import assert_rel_close, input_gen

# observed worst errors: fp32 ~3e-7, fp64 ~1e-15
TOL = {torch.float32: 2e-6, torch.float64: 1e-13}


def rnd(*shape, dtype=torch.float64, gen):
    """Random values bounded away from zero (|x| in [0.1, 1.1])."""
    mag = torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.1
    sign = torch.randint(0, 2, shape, generator=gen).to(torch.float64) * 2 - 1
    return (mag * sign).to(dtype)


def cu_from_lengths(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def seq_idx_from_lengths(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]


def check_against_oracle(B, C, T, W, dtype, *, bias, activation, init, final, seq_idx=None, cu=None, seed=0):
    gen = input_gen(seed)
    x = rnd(B, C, T, dtype=dtype, gen=gen)
    weight = rnd(C, W, dtype=dtype, gen=gen)
    b = rnd(C, dtype=dtype, gen=gen) if bias else None
    h0 = rnd(B, C, W - 1, dtype=dtype, gen=gen) if init else None
    dout = rnd(B, C, T, gen=gen)
    dfinal = rnd(B, C, W - 1, gen=gen)
    kwargs = dict(activation=activation, seq_idx=seq_idx, cu_seqlens=cu, return_final_states=final)

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) if t is not None else None for t in (x, weight, b, h0)]
        res = fn(leaves[0], leaves[1], leaves[2], initial_states=leaves[3], **kwargs)
        out, fin = res if final else (res, None)
        loss = (out.double() * dout).sum() + ((fin.double() * dfinal).sum() if final else 0)
        live = [t for t in leaves if t is not None]
        return out, fin, torch.autograd.grad(loss, live)

    out, fin, grads = run(causal_conv1d_fn_torch, dtype)
    out_ref, fin_ref, grads_ref = run(naive_causal_conv1d, torch.float64)
    tol = TOL[dtype]
    assert out.dtype == dtype
    assert_rel_close(out, out_ref, tol, "out")
    if final:
        assert fin.shape == (B, C, W - 1) and fin.dtype == dtype
        assert_rel_close(fin, fin_ref, tol, "final_states")
    names = [n for n, t in zip(("dx", "dweight", "dbias", "dinitial_states"), (x, weight, b, h0)) if t is not None]
    for name, a, r in zip(names, grads, grads_ref):
        assert_rel_close(a, r, tol, name)


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 130])
@pytest.mark.parametrize("W,bias,activation,init,dtype", [
    (4, True, "silu", True, torch.float32),
    (4, False, None, False, torch.float64),
    (3, True, "swish", False, torch.float32),
    (2, False, "silu", True, torch.float64),
    (1, True, None, False, torch.float32),
])
def test_matches_oracle_without_boundaries(T, W, bias, activation, init, dtype):
    check_against_oracle(2, 6, T, W, dtype, bias=bias, activation=activation, init=init, final=True, seed=T * W)


VARLEN = [[1, 5, 1, 1, 40, 2, 1], [63, 1, 66], [2], [1, 1, 1]]


@pytest.mark.parametrize("lengths", VARLEN)
@pytest.mark.parametrize("how", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("W,init,dtype", [(4, True, torch.float32), (4, False, torch.float64),
                                          (3, True, torch.float64), (1, False, torch.float32)])
def test_matches_oracle_with_boundaries(lengths, how, W, init, dtype):
    boundaries = {"cu": cu_from_lengths(lengths)} if how == "cu_seqlens" else {"seq_idx": seq_idx_from_lengths(lengths)}
    check_against_oracle(1, 5, sum(lengths), W, dtype, bias=True, activation="silu", init=init, final=True,
                         seed=len(lengths) + W, **boundaries)


def test_seq_idx_rows_have_their_own_boundaries():
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 6, 6, 6, 6, 6, 6, 7, 7]], dtype=torch.int32)
    for dtype in (torch.float32, torch.float64):
        check_against_oracle(2, 4, 9, 4, dtype, bias=True, activation=None, init=True, final=True, seq_idx=seq_idx)


def test_no_boundary_path_is_transformers_stock():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn as stock

    stock = getattr(stock, "__wrapped__", stock)
    gen = input_gen(4)
    for x_dtype, w_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]:
        x = rnd(2, 8, 37, dtype=x_dtype, gen=gen)
        weight = rnd(8, 4, dtype=w_dtype, gen=gen)
        bias = rnd(8, dtype=w_dtype, gen=gen)
        for act in (None, "silu"):
            ours = causal_conv1d_fn_torch(x, weight, bias, activation=act)
            theirs = stock(x, weight, bias, activation=act)
            assert ours.dtype == theirs.dtype == x_dtype
            assert torch.equal(ours, theirs), (x_dtype, w_dtype, act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_equals_separate_runs(dtype):
    lengths = [1, 4, 1, 20, 2, 1, 9]
    cu = cu_from_lengths(lengths)
    gen = input_gen(6)
    x = rnd(1, 6, sum(lengths), dtype=dtype, gen=gen)
    weight = rnd(6, 4, dtype=dtype, gen=gen)
    bias = rnd(6, dtype=dtype, gen=gen)
    h0 = rnd(1, 6, 3, dtype=dtype, gen=gen)
    tol = TOL[dtype]
    packed = {
        "cu_seqlens": causal_conv1d_fn_torch(x, weight, bias, "silu", cu_seqlens=cu, initial_states=h0,
                                             return_final_states=True),
        "seq_idx": causal_conv1d_fn_torch(x, weight, bias, "silu", seq_idx=seq_idx_from_lengths(lengths),
                                          initial_states=h0, return_final_states=True),
    }
    for how, (out, final) in packed.items():
        for n in range(len(lengths)):
            s, e = int(cu[n]), int(cu[n + 1])
            # initial_states continue the first sequence only; the last sequence's state is returned
            alone, alone_final = causal_conv1d_fn_torch(x[..., s:e], weight, bias, "silu",
                                                        initial_states=h0 if n == 0 else None,
                                                        return_final_states=True)
            assert_rel_close(out[..., s:e], alone, tol, f"{how}: out of sequence {n}")
        assert_rel_close(final, alone_final, tol, f"{how}: final_states")
    # the check above must be able to fail: without boundaries inputs leak into the next sequence
    leaky = causal_conv1d_fn_torch(x, weight, bias, "silu", initial_states=h0)
    assert not torch.allclose(leaky[..., 1:2], packed["cu_seqlens"][0][..., 1:2], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("T", [1, 2, 3, 10])
def test_final_states_continue_the_sequence(T):
    """conv(x1) then conv(x2, initial_states=final(x1)) equals conv(x1 ++ x2); T < W-1 exercises padding."""
    gen = input_gen(T)
    x = rnd(2, 5, T + 7, gen=gen)
    weight, bias = rnd(5, 4, gen=gen), rnd(5, gen=gen)
    full = causal_conv1d_fn_torch(x, weight, bias, "silu")
    out1, state = causal_conv1d_fn_torch(x[..., :T], weight, bias, "silu", return_final_states=True)
    assert state.shape == (2, 5, 3)
    if T < 3:
        assert torch.equal(state[..., : 3 - T], torch.zeros(2, 5, 3 - T, dtype=x.dtype))
    assert torch.equal(state[..., 3 - min(T, 3) :], x[..., max(T - 3, 0) : T])
    out2 = causal_conv1d_fn_torch(x[..., T:], weight, bias, "silu", initial_states=state)
    assert_rel_close(torch.cat([out1, out2], -1), full, 1e-14, "out")


def test_final_states_out_is_written_and_returned():
    gen = input_gen(2)
    x = rnd(1, 3, 6, dtype=torch.float32, gen=gen)
    weight = rnd(3, 4, dtype=torch.float32, gen=gen)
    buf = torch.full((1, 3, 3), float("nan"))
    out, final = causal_conv1d_fn_torch(x, weight, cu_seqlens=torch.tensor([0, 4, 6]), return_final_states=True,
                                        final_states_out=buf)
    assert final is buf
    expected = torch.cat([torch.zeros(1, 3, 1), x[..., 4:]], -1)  # last sequence has 2 tokens
    assert torch.equal(buf, expected)


def test_unknown_activation_is_named():
    x, weight = torch.ones(1, 2, 3), torch.ones(2, 4)
    with pytest.raises(ValueError, match="activation='relu'"):
        causal_conv1d_fn_torch(x, weight, activation="relu")


@pytest.mark.parametrize("S,T_new", [(3, 1), (3, 2), (5, 1), (6, 4)])
@pytest.mark.parametrize("x_dtype,w_dtype,s_dtype", [(torch.float32, torch.float32, torch.float32),
                                                     (torch.bfloat16, torch.float32, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16, torch.float32)])
def test_update_matches_transformers_stock(S, T_new, x_dtype, w_dtype, s_dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as stock

    stock = getattr(stock, "__wrapped__", stock)
    gen = input_gen(S * 10 + T_new)
    C, W = 6, 4
    weight, bias = rnd(C, W, dtype=w_dtype, gen=gen), rnd(C, dtype=w_dtype, gen=gen)
    state_ours = rnd(2, C, S, dtype=s_dtype, gen=gen)
    state_stock = state_ours.clone()
    for step in range(3):
        x = rnd(2, C, T_new, dtype=x_dtype, gen=gen)
        ours = causal_conv1d_update_torch(x, state_ours, weight, bias, "silu")
        theirs = stock(x, state_stock, weight, bias, "silu")
        assert ours.dtype == theirs.dtype == x_dtype and ours.shape == (2, C, T_new)
        assert torch.equal(ours, theirs), f"out at step {step}"
        assert torch.equal(state_ours, state_stock), f"conv_state at step {step}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("W,S", [(4, 3), (4, 7), (2, 1), (1, 2)])
def test_update_steps_equal_full_conv(dtype, W, S):
    """Decoding token by token (and in blocks of 2) equals one conv over the whole input."""
    gen = input_gen(W * S)
    B, C, T = 2, 5, 9
    x = rnd(B, C, T, dtype=dtype, gen=gen)
    weight, bias = rnd(C, W, dtype=dtype, gen=gen), rnd(C, dtype=dtype, gen=gen)
    full = naive_causal_conv1d(x, weight, bias, "silu")
    for block in (1, 2):
        state = torch.zeros(B, C, S, dtype=dtype)
        outs = [causal_conv1d_update_torch(x[..., t : t + block], state, weight, bias, "silu")
                for t in range(0, T, block)]
        assert_rel_close(torch.cat(outs, -1), full, TOL[dtype], f"out (blocks of {block})")
        expected_state = torch.cat([torch.zeros(B, C, max(S - T, 0), dtype=dtype), x[..., max(T - S, 0) :]], -1)
        assert torch.equal(state, expected_state)


@pytest.mark.parametrize("with_init", [False, True])
def test_empty_time_axis(with_init):
    """T = 0: an empty output, and the final state is the initial state (or zeros), as the oracle says."""
    x = torch.randn(2, 6, 0)
    weight = torch.randn(6, 4)
    init = torch.randn(2, 6, 3) if with_init else None
    out, final = causal_conv1d_fn_torch(x, weight, None, "silu", initial_states=init, return_final_states=True)
    ref_out, ref_final = naive_causal_conv1d(x, weight, None, "silu", initial_states=init, return_final_states=True)
    assert out.shape == ref_out.shape == (2, 6, 0)
    assert torch.equal(final.double(), ref_final) and final.shape == (2, 6, 3)
