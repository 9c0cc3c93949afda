"""Triton causal conv1d (+SiLU, sequence resets, initial/final states) against the float64 loop oracle.

Without CUDA the kernels run under the Triton interpreter in fp32 on tiny shapes. ``gpu`` tests need CUDA
(bf16 at the Qwen3.5-35B-A3B conv width: C = 2*2048 + 4096 = 8192 channels, W = 4, 4096 tokens).
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from deltafuse.ops.conv1d import kernel_fwd_bwd  # noqa: E402
from deltafuse.ops.conv1d.kernel import ConvOptions, causal_conv1d_fn_triton, configured  # noqa: E402
from deltafuse.ops.conv1d.kernel_update import causal_conv1d_update_triton  # noqa: E402
from deltafuse.ops.conv1d.naive import naive_causal_conv1d  # noqa: E402
from deltafuse.ops.conv1d.reference import causal_conv1d_fn_torch, causal_conv1d_update_torch  # noqa: E402
from tests.helpers import DEVICE, assert_rel_close, gpu, input_gen, input_seed, needs_cuda, rel_rms  # noqa: E402

if DEVICE == "cpu" and not isinstance(kernel_fwd_bwd.conv_fwd_kernel, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip("no CUDA and the kernels were compiled for a GPU (set TRITON_INTERPRET=1 before import)",
                allow_module_level=True)


def _inputs(B, C, T, W, *, bias, init, layout_btc, gen, dtype=torch.float32):
    x = torch.randn(B, T, C, generator=gen).transpose(1, 2) if layout_btc else torch.randn(B, C, T, generator=gen)
    w = torch.randn(C, W, generator=gen) * 0.5
    b = torch.randn(C, generator=gen) if bias else None
    h0 = torch.randn(B, C, W - 1, generator=gen) if init else None
    return [t.to(DEVICE, dtype) if t is not None else None for t in (x, w, b, h0)]


def _run(fn, inputs, cast, kwargs, final, dout, dfin):
    leaves = [t.detach().to(cast).requires_grad_() if t is not None else None for t in inputs]
    res = fn(leaves[0], leaves[1], leaves[2], initial_states=leaves[3], return_final_states=final, **kwargs)
    out, fin = res if final else (res, None)
    loss = (out.double() * dout).sum() + ((fin.double() * dfin).sum() if final else 0)
    live = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, live, allow_unused=True)  # W = 1: initial_states [B, C, 0] is unused
    return out, fin, [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, live)], live


def check(B, C, T, W, *, bias=True, init=True, final=True, act="silu", seq_idx=None, cu=None, layout_btc=True,
          seed=0, tol=2e-6):
    gen = input_gen(seed)
    inputs = _inputs(B, C, T, W, bias=bias, init=init, layout_btc=layout_btc, gen=gen)
    dout = torch.randn(B, C, T, generator=gen, dtype=torch.float64).to(DEVICE)
    dfin = torch.randn(B, C, W - 1, generator=gen, dtype=torch.float64).to(DEVICE)
    kwargs = dict(activation=act, seq_idx=seq_idx, cu_seqlens=cu)
    out, fin, grads, leaves = _run(causal_conv1d_fn_triton, inputs, torch.float32, kwargs, final, dout, dfin)
    o64, f64, g64, _ = _run(naive_causal_conv1d, [t.cpu() if t is not None else None for t in inputs],
                            torch.float64, {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()},
                            final, dout.cpu(), dfin.cpu())
    assert out.stride() == inputs[0].stride()  # output keeps x's memory layout
    assert_rel_close(out.cpu(), o64, tol, "out")
    if final:
        assert_rel_close(fin.cpu(), f64, tol, "final_states")
    for name, g, r in zip(["dx", "dweight", "dbias", "dinitial"][: len(grads)] if bias else
                          ["dx", "dweight", "dinitial"][: len(grads)], grads, g64):
        assert_rel_close(g.cpu(), r, tol, name)


@pytest.mark.parametrize("B,C,T,W", [(2, 5, 7, 4), (1, 70, 33, 4), (1, 3, 1, 4), (2, 4, 2, 3), (1, 6, 5, 1),
                                     (2, 3, 0, 4), (1, 8, 40, 2)])
def test_plain_rows(B, C, T, W):
    check(B, C, T, W)


@pytest.mark.parametrize("opts", [dict(bias=False), dict(init=False), dict(final=False), dict(act=None),
                                  dict(layout_btc=False), dict(bias=False, init=False, act=None)])
def test_options(opts):
    check(2, 6, 9, 4, **opts)


def test_cu_seqlens_with_length_one_sequences():
    lengths = [1, 3, 1, 6, 2, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    check(1, 5, sum(lengths), 4, cu=cu)


def test_seq_idx_per_row():
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 6, 6, 6, 6, 6, 6, 7, 7]], dtype=torch.int32,
                           device=DEVICE)
    check(2, 4, 9, 4, seq_idx=seq_idx)
    check(2, 4, 9, 4, seq_idx=seq_idx, act=None, init=False)


def test_matches_torch_reference_through_the_same_contract():
    gen = input_gen(3)
    x, w, b, h0 = _inputs(1, 7, 12, 4, bias=True, init=True, layout_btc=True, gen=gen)
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32, device=DEVICE)
    out_buf = torch.empty(1, 7, 3, device=DEVICE)
    got = causal_conv1d_fn_triton(x, w, b, "silu", cu_seqlens=cu, initial_states=h0, return_final_states=True,
                                  final_states_out=out_buf)
    ref = causal_conv1d_fn_torch(x, w, b, "silu", cu_seqlens=cu, initial_states=h0, return_final_states=True)
    assert got[1] is out_buf
    assert rel_rms(got[0], ref[0]) < 2e-6 and torch.equal(got[1], ref[1])


@gpu
@needs_cuda
@pytest.mark.parametrize("T,packed", [(4096, False), (4096, True), (1, False)])
def test_gpu_bf16_qwen35_moe_width(T, packed):
    C, W = 8192, 4
    gen = input_gen(0)
    x = torch.randn(1, T, C, generator=gen).transpose(1, 2).to(DEVICE, torch.bfloat16)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(DEVICE, torch.bfloat16)
    cu = None
    if packed:
        cu = torch.tensor([0, 1, 700, 701, 2500, T], dtype=torch.int32, device=DEVICE)
    dout = torch.randn(1, C, T, generator=gen).to(DEVICE, torch.bfloat16)
    if packed:  # the GDN layer transposes the conv output back, so its incoming gradient is a transposed view
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    res = {}
    for name, fn in (("triton", causal_conv1d_fn_triton), ("torch", causal_conv1d_fn_torch)):
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = fn(xl, wl, None, "silu", cu_seqlens=cu)
        out.backward(dout)
        res[name] = (out, xl.grad, wl.grad)
    xl, wl = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    # float64 oracle: the torch reference in float64 (the loop oracle is too slow at this size)
    out = causal_conv1d_fn_torch(xl, wl, None, "silu", cu_seqlens=cu)
    out.backward(dout.double())
    ref = (out, xl.grad, wl.grad)
    for i, name in enumerate(("out", "dx", "dweight")):
        ours, theirs = rel_rms(res["triton"][i], ref[i]), rel_rms(res["torch"][i], ref[i])
        assert ours <= 1.25 * theirs + 1e-3, f"{name}: triton {ours:.2e} vs torch bf16 {theirs:.2e}"
        assert_rel_close(res["triton"][i], ref[i], 1.6e-2, name)


def test_random_configurations_match_torch_reference():
    """Random B, C, T (incl. 1), W in 1..4, layouts, bias, states, activation, boundaries (T = 0: the torch
    reference raises there without initial states, see test_plain_rows for T = 0 against the oracle), against the
    torch reference in float64. A fresh seed every run (named in a failure's message; ``--test-seed`` repeats it):
    eight configurations a run, others the next."""
    import random

    seed = input_seed("configurations")
    rng = random.Random(seed)
    gen = input_gen(seed)
    for _ in range(8):
        B, C, T, W = rng.randint(1, 3), rng.randint(1, 70), rng.choice([1, rng.randint(2, 40)]), rng.randint(1, 4)
        mode = rng.choice(["none", "seq", "cu"])
        if mode == "cu":
            B = 1
        x = (torch.randn(B, T, C, generator=gen).transpose(1, 2) if rng.random() < 0.5
             else torch.randn(B, C, T, generator=gen))
        w = torch.randn(C, W, generator=gen)
        b = torch.randn(C, generator=gen) if rng.random() < 0.5 else None
        h0 = torch.randn(B, C, W - 1, generator=gen) if rng.random() < 0.5 else None
        act = rng.choice([None, "silu"])
        seq = cu = None
        if mode == "seq" and T > 0:
            seq = torch.sort(torch.randint(0, 4, (B, T), generator=gen), dim=1).values.int().to(DEVICE)
        if mode == "cu" and T > 0:
            cuts = sorted(rng.sample(range(1, T), min(T - 1, rng.randint(0, 4)))) if T > 1 else []
            cu = torch.tensor([0] + cuts + [T], dtype=torch.int32, device=DEVICE)
        dout = torch.randn(B, C, T, generator=gen).to(DEVICE)
        dfin = torch.randn(B, C, W - 1, generator=gen).to(DEVICE)

        def run(fn, inputs, activation, dtype, grads_in=(dout, dfin)):
            leaves = [t.to(DEVICE, dtype).detach().requires_grad_() if t is not None else None for t in inputs]
            out, fin = fn(leaves[0], leaves[1], leaves[2], activation, seq_idx=seq, cu_seqlens=cu,
                          initial_states=leaves[3], return_final_states=True)
            live = [t for t in leaves if t is not None]
            dy, df = (g.to(dtype) for g in grads_in)
            grads = torch.autograd.grad((out * dy).sum() + (fin * df).sum(), live, allow_unused=True)
            return [out, fin] + [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, live)]

        got = run(causal_conv1d_fn_triton, (x, w, b, h0), act, torch.float32)
        want = run(causal_conv1d_fn_torch, (x, w, b, h0), act, torch.float64)
        # every output and gradient element is a sum of at most B*T + W products: the sums of their magnitudes are
        # the same run on |inputs| without the activation (SiLU's slope is at most 1.1)
        mag = run(causal_conv1d_fn_torch, [None if t is None else t.abs() for t in (x, w, b, h0)], None,
                  torch.float64, (dout.abs(), dfin.abs()))
        where = f"seed {seed}: B={B} C={C} T={T} W={W} {mode} act={act}"
        for name, a, r, m in zip(["out", "final", "dx", "dweight", "dbias/dinit", "dinit"], got, want, mag):
            if r.numel():
                _assert_fp32_sum(a, r, 1.1 * m, B * T + W, f"{name} ({where})")


def _assert_fp32_sum(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, terms: int, name: str) -> None:
    """fp32 ``got`` against the float64 ``want``, element by element within the bound of fp32 summation of at
    most ``terms`` products, (terms + 4) eps times the sum of their magnitudes ``mag``. A relative bound on the
    result cannot hold for a sum that cancels (dbias of one channel, 6 tokens: 5.1e-6 of itself off float64)."""
    assert got.shape == want.shape and torch.isfinite(got).all(), name
    bound = (terms + 4) * torch.finfo(torch.float32).eps * mag
    over = (got.double() - want).abs() / bound.clamp_min(1e-300)
    assert (over <= 1).all(), f"{name}: {over.max().item():.2f}x the fp32 summation bound"


# --- options: every field of ConvOptions changes what the kernels run and the results stay exact ------------
OPTION_SETS = [
    # one token per block (every step is a block edge), no prefetch, Triton pipelining on
    ConvOptions(fwd_block_c=4, fwd_block_t=1, fwd_warps=2, fwd_stages=2, fwd_prefetch=0,
                bwd_block_c=4, bwd_block_t=1, bwd_warps=2, bwd_stages=2, bwd_prefetch=0),
    # blocks of 3 and 5 tokens (not powers of two), prefetch 1 and 4
    ConvOptions(fwd_block_c=16, fwd_block_t=3, fwd_prefetch=1, bwd_block_c=2, bwd_block_t=5, bwd_prefetch=4),
    # blocks longer than the row, prefetch 2 and 3
    ConvOptions(fwd_block_c=32, fwd_block_t=64, fwd_prefetch=4, bwd_block_c=32, bwd_block_t=64, bwd_prefetch=2,
                fwd_warps=4, bwd_warps=4),
    ConvOptions(fwd_block_c=8, fwd_block_t=2, fwd_prefetch=3, bwd_block_c=8, bwd_block_t=2, bwd_prefetch=1),
]


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: f"c{o.fwd_block_c}t{o.fwd_block_t}p{o.fwd_prefetch}-"
                                                        f"c{o.bwd_block_c}t{o.bwd_block_t}p{o.bwd_prefetch}")
def test_every_option_with_resets_across_block_edges(opts):
    """Sequences of 1, 2, 3 and 5 tokens put resets at every offset inside and at the edges of the blocks."""
    lengths = [2, 1, 5, 3, 1, 2]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    with configured(opts):
        check(1, 9, sum(lengths), 4, cu=cu, seed=11)
        check(2, 5, 7, 3, layout_btc=False, seed=12, act=None)
        seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2, 3], [4, 4, 4, 4, 5, 5, 5]], dtype=torch.int32, device=DEVICE)
        check(2, 6, 7, 4, seq_idx=seq_idx, seed=13)


def test_options_are_recorded_by_the_forward_for_its_backward():
    """A backward run outside the ``configured`` block still uses the forward's options (and is exact)."""
    gen = input_gen(5)
    x, w, b, h0 = _inputs(1, 6, 9, 4, bias=True, init=True, layout_btc=True, gen=gen)
    dout = torch.randn(1, 6, 9, generator=gen).to(DEVICE)
    grads = []
    for opts in (OPTION_SETS[0], None):
        leaves = [t.detach().requires_grad_() for t in (x, w, b, h0)]
        with configured(opts):
            out = causal_conv1d_fn_triton(leaves[0], leaves[1], leaves[2], "silu", initial_states=leaves[3])
        out.backward(dout)
        grads.append([t.grad for t in leaves])
    for a, r in zip(*grads):
        assert_rel_close(a, r, 2e-6)


def test_backward_runs_with_the_forward_options():
    """Options are read once, when the forward runs: a backward inside a ``configured`` block of other options
    runs with the forward's (gradients bit-equal to a run entirely under them, while a run entirely under the
    other options sums dw over other blocks and differs in the last bits), whether the forward took them from a
    ``configured`` block or as an argument."""
    gen = input_gen(6)
    x, w, b, h0 = _inputs(1, 6, 40, 4, bias=True, init=True, layout_btc=True, gen=gen)
    dout = torch.randn(1, 6, 40, generator=gen).to(DEVICE)
    mine, other = OPTION_SETS[0], OPTION_SETS[2]

    def grads(fwd, bwd, **kwargs):
        leaves = [t.detach().requires_grad_() for t in (x, w, b, h0)]
        with configured(fwd):
            out = causal_conv1d_fn_triton(leaves[0], leaves[1], leaves[2], "silu", initial_states=leaves[3],
                                          **kwargs)
        with configured(bwd):
            out.backward(dout)
        return [t.grad for t in leaves]

    want = grads(mine, mine)
    assert not torch.equal(grads(other, other)[1], want[1])  # the two option sets give different dw bits
    for got in (grads(mine, other), grads(other, other, options=mine)):
        for name, g, r in zip(("dx", "dweight", "dbias", "dinitial"), got, want):
            assert torch.equal(g, r), name
    with pytest.raises(TypeError, match="options must be a ConvOptions or None, got dict"):
        causal_conv1d_fn_triton(x, w, b, "silu", options={"fwd_block_c": 8})


@pytest.mark.parametrize("bad,match", [
    (dict(fwd_block_c=6), "fwd_block_c=6; allowed: a power of two"),
    (dict(bwd_warps=3), "bwd_warps=3; allowed: a power of two"),
    (dict(bwd_block_t=0), "bwd_block_t=0; allowed: an int >= 1"),
    (dict(fwd_prefetch=5), "fwd_prefetch=5; allowed: 0 to 4"),
    (dict(bwd_prefetch=-1), "bwd_prefetch=-1; allowed: an int >= 0"),
    (dict(fwd_stages=True), "fwd_stages=True; allowed: an int >= 1"),
    (dict(update_block_c=2.0), "update_block_c=2.0; allowed: an int >= 1"),
])
def test_options_refuse_bad_values_by_name(bad, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        ConvOptions(**bad)
    with pytest.raises(TypeError, match="options must be a ConvOptions"):
        with configured({"fwd_block_c": 8}):
            pass


def test_incoming_gradient_in_another_layout():
    """dy laid out [B, C, T] against x in the [B, T, C] layout (and the reverse): the same gradients."""
    gen = input_gen(8)
    for layout_btc in (True, False):
        x, w, b, h0 = _inputs(2, 7, 10, 4, bias=True, init=True, layout_btc=layout_btc, gen=gen)
        dy = torch.randn(2, 10, 7, generator=gen).transpose(1, 2).to(DEVICE)
        if layout_btc:
            dy = dy.contiguous()
        res = []
        for fn, cast in ((causal_conv1d_fn_triton, torch.float32), (naive_causal_conv1d, torch.float64)):
            leaves = [t.detach().to(cast).requires_grad_() for t in (x, w, b, h0)]
            fn(leaves[0], leaves[1], leaves[2], "silu", initial_states=leaves[3]).backward(dy.to(cast))
            res.append([t.grad for t in leaves])
        for name, a, r in zip(("dx", "dweight", "dbias", "dinitial"), *res):
            assert_rel_close(a, r, 2e-6, name)


def test_width_over_four_is_refused_by_name_and_routed_to_torch():
    from deltafuse.backends import REGISTRY, call_info
    from deltafuse.ops.conv1d.candidates import CONV

    x, w = torch.randn(1, 3, 6, device=DEVICE), torch.randn(3, 5, device=DEVICE)
    with pytest.raises(ValueError, match="W from 1 to 4, got W=5"):
        causal_conv1d_fn_triton(x, w)
    rows = {d.candidate: d for d in REGISTRY.explain(CONV, call_info(x, w), backend="triton")}
    assert "kernel width W=5 is over 4" in rows["triton"].reason
    rows = {d.candidate: d for d in REGISTRY.explain(CONV, call_info(x, w[:, :4]), backend="triton")}
    assert rows["triton"].chosen


# --- the decoding update ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,C,W,S,T_new", [(1, 5, 4, 4, 1), (3, 19, 4, 3, 1), (2, 9, 4, 4, 3), (2, 6, 3, 6, 2),
                                           (1, 4, 1, 2, 1), (2, 7, 5, 4, 2), (2, 4, 2, 1, 4)])
@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, None)])
def test_update_matches_torch_reference_over_steps(B, C, W, S, T_new, bias, act):
    """Several steps in a row: outputs close to the torch function's, conv_state equal to its after every step
    (state updated in place, x given in the transposed [B, T, C] layout too, B > 1)."""
    gen = input_gen(B * 100 + C + W * S + T_new)
    w = torch.randn(C, W, generator=gen).to(DEVICE)
    bvec = torch.randn(C, generator=gen).to(DEVICE) if bias else None
    state = torch.randn(B, C, S, generator=gen).to(DEVICE)
    ref_state = state.clone()
    for step in range(3):
        x = torch.randn(B, T_new, C, generator=gen).transpose(1, 2).to(DEVICE)
        if step == 1:
            x = x.contiguous()
        ptr = state.data_ptr()
        out = causal_conv1d_update_triton(x, state, w, bvec, act)
        ref = causal_conv1d_update_torch(x, ref_state, w, bvec, act)
        assert state.data_ptr() == ptr
        assert out.shape == (B, C, T_new) and out.dtype == x.dtype
        assert_rel_close(out, ref, 2e-6, f"out at step {step}")
        assert torch.equal(state, ref_state), f"conv_state at step {step}"


def test_update_takes_two_dimensional_x_and_a_strided_state():
    gen = input_gen(21)
    B, C, W = 3, 10, 4
    w, bvec = torch.randn(C, W, generator=gen).to(DEVICE), torch.randn(C, generator=gen).to(DEVICE)
    big = torch.randn(B, C, 2 * W, generator=gen).to(DEVICE)
    state = big[..., ::2]  # a strided view [B, C, W]: written in place through its strides
    ref_state = state.clone()
    untouched = big[..., 1::2].clone()
    x = torch.randn(B, C, generator=gen).to(DEVICE)
    out = causal_conv1d_update_triton(x, state, w, bvec, "silu")
    ref = causal_conv1d_update_torch(x[..., None], ref_state, w, bvec, "silu")
    assert out.shape == (B, C)
    assert_rel_close(out, ref[..., 0], 2e-6, "out")
    assert torch.equal(big[..., ::2], ref_state) and torch.equal(big[..., 1::2], untouched)


def test_update_refuses_bad_arguments_by_name():
    x, state, w = torch.randn(2, 4, 1), torch.randn(2, 4, 2), torch.randn(4, 4)
    with pytest.raises(ValueError, match="S >= W-1 = 3"):
        causal_conv1d_update_triton(x, state, w)
    with pytest.raises(ValueError, match="activation='relu'"):
        causal_conv1d_update_triton(x, torch.randn(2, 4, 4), w, activation="relu")
    with pytest.raises(ValueError, match="got conv_state of dtype torch.float64"):
        causal_conv1d_update_triton(x, torch.randn(2, 4, 4, dtype=torch.float64), w)


def test_update_candidates_prefer_triton_and_never_for_a_differentiable_step():
    from deltafuse.backends import REGISTRY, CallInfo
    from deltafuse.ops.conv1d.candidates import CONV_UPDATE

    assert [c.name for c in REGISTRY.candidates(CONV_UPDATE)] == ["triton", "torch"]
    shapes = ((1, 8, 1), (8, 4), None)
    cuda = CallInfo(torch.device("cuda", 0), torch.bfloat16, False, (), shapes)
    assert [d.candidate for d in REGISTRY.explain(CONV_UPDATE, cuda) if d.chosen] == ["triton"]
    grad = CallInfo(torch.device("cuda", 0), torch.bfloat16, True, (), shapes)
    rows = {d.candidate: d for d in REGISTRY.explain(CONV_UPDATE, grad)}
    assert rows["torch"].chosen and "no backward" in rows["triton"].reason


@gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 32])
def test_gpu_update_bf16_qwen35_moe_width(B):
    C, W = 8192, 4
    gen = input_gen(B)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(DEVICE, torch.bfloat16)
    bvec = torch.randn(C, generator=gen).to(DEVICE, torch.bfloat16)
    state = torch.randn(B, C, W, generator=gen).to(DEVICE, torch.bfloat16)
    ref_state = state.clone()
    for step in range(3):
        x = torch.randn(B, 1, C, generator=gen).transpose(1, 2).to(DEVICE, torch.bfloat16)
        state64 = ref_state.double()  # a copy from before the step
        out = causal_conv1d_update_triton(x, state, w, bvec, "silu")
        ref = causal_conv1d_update_torch(x, ref_state, w, bvec, "silu")
        ref64 = causal_conv1d_update_torch(x.double(), state64, w.double(), bvec.double(), "silu")
        assert torch.equal(state, ref_state), f"conv_state at step {step}"
        assert_rel_close(out, ref64, 1e-2, "out")
        assert rel_rms(out, ref64) <= 1.25 * rel_rms(ref, ref64) + 1e-3


@pytest.mark.parametrize("opts", [ConvOptions(update_block_c=2, update_warps=2), ConvOptions(update_block_c=64)])
def test_update_options(opts):
    gen = input_gen(31)
    B, C, W = 2, 11, 4
    w, bvec = torch.randn(C, W, generator=gen).to(DEVICE), torch.randn(C, generator=gen).to(DEVICE)
    state = torch.randn(B, C, W, generator=gen).to(DEVICE)
    ref_state = state.clone()
    x = torch.randn(B, C, 2, generator=gen).to(DEVICE)
    with configured(opts):
        out = causal_conv1d_update_triton(x, state, w, bvec, "silu")
    ref = causal_conv1d_update_torch(x, ref_state, w, bvec, "silu")
    assert_rel_close(out, ref, 2e-6, "out")
    assert torch.equal(state, ref_state)
