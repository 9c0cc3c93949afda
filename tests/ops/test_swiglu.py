"""SwiGLU silu(gate) * up: Triton vs the float64 oracle, torch reference vs transformers' MLPs, routing.

Without CUDA the Triton kernels run under the interpreter in fp32 on tiny shapes. ``gpu`` tests need
CUDA: bf16 at Qwen3.5-35B-A3B sizes (moe intermediate 512, shared expert 512, 4096 tokens).
"""

from __future__ import annotations

import types

import pytest
import torch

from deltafuse.ops.swiglu import candidates as swiglu_backends  # noqa: E402
from deltafuse.backends.registry import CallInfo  # noqa: E402
from deltafuse.ops.swiglu import api  # noqa: E402
from deltafuse.ops.swiglu.naive import naive_swiglu  # noqa: E402
from deltafuse.ops.swiglu.reference import swiglu_torch  # noqa: E402
from tests.helpers import (  # noqa: E402
    DEVICE, INTERPRETED, assert_rel_close, assert_within_term_sizes, gpu, needs_cuda, npu_route, rel_rms,
    triton_kernel_module,
)



def _kernel():
    return triton_kernel_module("deltafuse.ops.swiglu.kernel", "_swiglu_fwd_kernel")


def _check(fn, gate, up, tol):
    g = gate.detach().requires_grad_()
    u = up.detach().requires_grad_()
    out = fn(g, u)
    dy = torch.randn_like(out)
    out.backward(dy)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = naive_swiglu(g64, u64)
    ref.backward(dy.double())
    assert out.dtype == gate.dtype and out.shape == gate.shape
    assert_rel_close(out, ref, tol, "out")
    assert_rel_close(u.grad, u64.grad, tol, "dup")
    # dgate = dy * up * (s + x s (1 - s)), s = sigmoid(x): the two terms cancel near silu's minimum (x = -1.278), where
    # an element's relative error is unbounded at the rounding of its terms (a lone gate of -1.284 was 8.5e-6 off, all
    # of it fp32 rounding). Each element is held to tol times the size of its terms, plus fp32's smallest normal
    # number at their scale for the sigmoid's underflow at x << 0.
    x = g64.detach()
    s = torch.sigmoid(x)
    scale = (dy.double() * u64.detach()).abs()
    size = scale * (s + x.abs() * s * (1 - s)) + scale * (1 + x.abs()) * torch.finfo(torch.float32).tiny / tol
    assert_within_term_sizes(g.grad, g64.grad, size, tol, "dgate")


@pytest.mark.parametrize("shape", [(1, 1), (1, 33), (3, 5, 33), (4, 1500), (2, 512)])
def test_triton_matches_float64(shape):
    k = _kernel()
    _check(k.swiglu_triton, 3 * torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE), 2e-6)


def test_triton_reads_fused_gate_up_halves_in_place():
    """The MoE experts split one projection with .chunk(2, -1): both halves are strided views."""
    k = _kernel()
    gu = torch.randn(9, 2 * 40, device=DEVICE, requires_grad=True)
    gate, up = gu.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    g2 = k._rows(gate, 40)
    assert g2.data_ptr() == gate.data_ptr() and g2.stride(0) == 80
    out = k.swiglu_triton(gate, up)
    dy = torch.randn_like(out)
    out.backward(dy)
    gu64 = gu.detach().double().requires_grad_()
    ref = naive_swiglu(*gu64.chunk(2, dim=-1))
    ref.backward(dy.double())
    assert_rel_close(out, ref, 2e-6, "out")
    assert_rel_close(gu.grad, gu64.grad, 2e-6, "dgate_up")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: exp(100) -> inf, as intended
def test_triton_extreme_values():
    """Saturated gates (exp overflows in fp32 for gate << 0), large up values, exact zeros."""
    k = _kernel()
    gate = torch.randn(6, 50) * 4
    gate[0] = 100.0
    gate[1] = -100.0
    gate[2] = 0.0
    gate[3, ::2] = 88.0
    up = torch.randn(6, 50)
    up[4] *= 1e15
    up[5] = 0.0
    _check(k.swiglu_triton, gate.to(DEVICE), up.to(DEVICE), 2e-6)


# --- torch reference vs transformers ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_transformers_mlps_bit_for_bit(dtype):
    pytest.importorskip("transformers")
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeMLP
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextMLP

    for cls, cfg in ((Qwen3_5MLP, Qwen3_5TextConfig(hidden_size=32)),
                     (Qwen3_5MoeMLP, Qwen3_5MoeTextConfig(hidden_size=32)),
                     (Qwen3NextMLP, Qwen3NextConfig(hidden_size=32))):
        mlp = cls(cfg, intermediate_size=24).to(dtype)
        x = torch.randn(2, 3, 32).to(dtype)
        assert mlp.act_fn(torch.tensor([1.0])).item() == torch.nn.functional.silu(torch.tensor([1.0])).item()
        ours = mlp.down_proj(swiglu_torch(mlp.gate_proj(x), mlp.up_proj(x)))
        assert torch.equal(ours, mlp(x)), cls.__name__


# --- public API ---------------------------------------------------------------------------------------
def test_public_op_default_and_forced():
    g, u = torch.randn(3, 20), torch.randn(3, 20)
    assert torch.equal(api.swiglu(g, u), swiglu_torch(g, u))
    if INTERPRETED:
        _kernel()
        assert_rel_close(api.swiglu(g, u, backend="triton"), naive_swiglu(g, u), 2e-6)


@pytest.mark.parametrize("call,match", [
    (lambda g, u: api.swiglu(g, u[:, :3]), r"up must have gate's shape \(3, 20\), got \(3, 3\)"),
    (lambda g, u: api.swiglu(g, u.double()), r"up has dtype torch.float64 but gate has torch.float32"),
    (lambda g, u: api.swiglu(g.int(), u), r"gate has dtype int32; allowed"),
    (lambda g, u: api.swiglu(g, None), r"up must be a torch.Tensor, got NoneType"),
    (lambda g, u: api.swiglu(g, u, dim=0), r"unexpected keyword.*'dim'"),
])
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(3, 20), torch.randn(3, 20))


# --- Ascend NPU route with a stand-in torch_npu --------------------------------------------------------
def test_npu_route_selection_and_argument_mapping(monkeypatch):
    calls = []
    fake = types.ModuleType("torch_npu")

    def npu_swiglu(x, dim=-1):
        calls.append((x, dim))
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    fake.npu_swiglu = npu_swiglu
    reg, impl = npu_route(monkeypatch, fake, swiglu_backends.register, api.SWIGLU)
    g = torch.randn(4, 6, requires_grad=True)
    u = torch.randn(4, 6, requires_grad=True)
    y = impl(g, u)
    x, dim = calls[-1]
    assert dim == -1 and torch.equal(x, torch.cat([g, u], -1).detach())  # gate first, then up
    # same maths, possibly another vectorised order: equal to rounding (a swapped gate/up is far off)
    torch.testing.assert_close(y, swiglu_torch(g, u), rtol=1e-6, atol=1e-6)
    y.sum().backward()
    assert g.grad is not None and u.grad is not None
    # a CPU call never picks the npu row
    assert reg.select(api.SWIGLU, CallInfo(torch.device("cpu"), torch.float32, True)) is swiglu_torch


# --- GPU: bf16 at Qwen3.5-35B-A3B sizes ---------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("rows,C,fused", [(4096, 512, False), (4096 * 8, 512, True), (3, 512, False),
                                          (4096, 5120, False)])
def test_gpu_bf16_vs_float64_and_stock(rows, C, fused):
    k = _kernel()
    if fused:
        gu = torch.randn(rows, 2 * C, device=DEVICE).mul(2).to(torch.bfloat16)
        gate, up = gu.chunk(2, -1)
    else:
        gate = torch.randn(rows, C, device=DEVICE).mul(2).to(torch.bfloat16)
        up = torch.randn(rows, C, device=DEVICE).to(torch.bfloat16)
    leaves = {}
    results = {}
    dy = torch.randn(rows, C, device=DEVICE).to(torch.bfloat16)
    for name, fn, dt in (("triton", k.swiglu_triton, torch.bfloat16), ("stock", swiglu_torch, torch.bfloat16),
                         ("f64", naive_swiglu, torch.float64)):
        g, u = gate.detach().to(dt).requires_grad_(), up.detach().to(dt).requires_grad_()
        out = fn(g, u)
        out.backward(dy.to(out.dtype))
        leaves[name] = (g, u)
        results[name] = (out, g.grad, u.grad)
    # forward: same rounding points as the stock activation-then-product: nearly every element identical
    same = (results["triton"][0] == results["stock"][0]).float().mean().item()
    assert same > 0.995, f"only {same:.4f} of the outputs equal the stock bf16 ones"
    for i, name in enumerate(("out", "dgate", "dup")):
        ours = rel_rms(results["triton"][i], results["f64"][i])
        theirs = rel_rms(results["stock"][i], results["f64"][i])
        assert ours <= 1.25 * theirs + 1e-3, f"{name}: triton {ours:.2e} vs stock {theirs:.2e}"
        assert_rel_close(results["triton"][i], results["f64"][i], 1.6e-2, name)
