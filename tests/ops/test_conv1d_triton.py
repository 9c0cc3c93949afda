"""Triton causal conv1d (+SiLU, sequence resets, initial/final states) against the float64 loop oracle.

Without CUDA the kernels run under the Triton interpreter in fp32 on tiny shapes. ``gpu`` tests need CUDA
(bf16 at the Qwen3.5-35B-A3B conv width: C = 2*2048 + 4096 = 8192 channels, W = 4, 4096 tokens).
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from deltafuse.ops.conv1d import kernel as conv_kernel  # noqa: E402
from deltafuse.ops.conv1d.kernel import causal_conv1d_fn_triton  # noqa: E402
from deltafuse.ops.conv1d.naive import naive_causal_conv1d  # noqa: E402
from deltafuse.ops.conv1d.reference import causal_conv1d_fn_torch  # noqa: E402
from tests.helpers import DEVICE, assert_rel_close, gpu, needs_cuda, rel_rms  # noqa: E402

if DEVICE == "cpu" and not isinstance(conv_kernel._conv_fwd_kernel, triton.runtime.interpreter.InterpretedFunction):
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
    gen = torch.Generator().manual_seed(seed)
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
    gen = torch.Generator().manual_seed(3)
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
    gen = torch.Generator().manual_seed(0)
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
    reference raises there without initial states, see test_plain_rows for T = 0 against the oracle)."""
    import random

    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for _ in range(12):
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
        res = []
        for fn in (causal_conv1d_fn_triton, causal_conv1d_fn_torch):
            leaves = [t.to(DEVICE).detach().requires_grad_() if t is not None else None for t in (x, w, b, h0)]
            out, fin = fn(leaves[0], leaves[1], leaves[2], act, seq_idx=seq, cu_seqlens=cu,
                          initial_states=leaves[3], return_final_states=True)
            live = [t for t in leaves if t is not None]
            grads = torch.autograd.grad((out * dout).sum() + (fin * dfin).sum(), live, allow_unused=True)
            res.append([out, fin] + [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, live)])
        for name, a, r in zip(["out", "final", "dx", "dweight", "dbias/dinit", "dinit"], *res):
            if r.numel():
                assert_rel_close(a, r, 2e-6, f"{name} (B={B} C={C} T={T} W={W} {mode} act={act})")
