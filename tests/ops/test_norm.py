"""Zero-centred and gated RMSNorm: Triton vs the float64 oracle, torch reference vs transformers, routing.

Without CUDA the Triton kernels run under the interpreter in fp32 on tiny shapes (the environment
variable is set before Triton is imported). ``gpu`` tests need CUDA: bf16 at Qwen3.5-35B-A3B sizes.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deltafuse.backends import REGISTRY  # noqa: E402
from deltafuse.ops.norm import candidates as norm_backends  # noqa: E402
from deltafuse.backends.registry import CallInfo, Registry  # noqa: E402
from deltafuse.ops.norm import api  # noqa: E402
from deltafuse.ops.norm.naive import naive_rms_norm_gated, naive_rms_norm_zero_centered  # noqa: E402
from deltafuse.ops.norm.reference import rms_norm_gated_torch, rms_norm_zero_centered_torch  # noqa: E402
from tests.helpers import (  # noqa: E402
    DEVICE, INTERPRETED, assert_rel_close, gpu, needs_cuda, npu_device, npu_registry, rel_rms,
    triton_kernel_module,
)



def _kernel():
    return triton_kernel_module("deltafuse.ops.norm.kernel", "_rms_fwd_kernel")


def _leaf(t, device=DEVICE, dtype=torch.float32):
    return t.to(device=device, dtype=dtype).detach().requires_grad_()


def _check(fn, oracle, inputs, tol, names):
    """fn(*inputs) vs oracle(*inputs in float64): output and the gradient of every input, every element."""
    leaves = [_leaf(t, t.device, t.dtype) for t in inputs]
    out = fn(*leaves)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in inputs]
    ref = oracle(*ref_leaves)
    ref.backward(dy.double())
    assert out.dtype == inputs[0].dtype
    assert_rel_close(out, ref, tol, "out")
    for name, a, b in zip(names, leaves, ref_leaves):
        assert_rel_close(a.grad, b.grad, tol, f"d{name}")


# --- Triton vs float64 (fp32 interpreted on CPU, fp32 on GPU) ------------------------------------------
SHAPES = [(1, 37), (3, 5, 37), (2, 3, 64), (4, 2048), (33, 16)]


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_zero_centered_matches_float64(shape):
    k = _kernel()
    D = shape[-1]
    x, w = torch.randn(shape), 0.3 * torch.randn(D)
    _check(lambda x, w: k.rms_norm_zero_centered_triton(x, w, 1e-6),
           lambda x, w: naive_rms_norm_zero_centered(x, w, 1e-6), [x.to(DEVICE), w.to(DEVICE)], 2e-6, "xw")


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_gated_matches_float64(shape):
    k = _kernel()
    D = shape[-1]
    x, g, w = torch.randn(shape), 2 * torch.randn(shape), 1 + 0.3 * torch.randn(D)
    _check(lambda x, g, w: k.rms_norm_gated_triton(x, g, w, 1e-6),
           lambda x, g, w: naive_rms_norm_gated(x, g, w, 1e-6), [t.to(DEVICE) for t in (x, g, w)], 2e-6, "xgw")


@pytest.mark.parametrize("gated", [False, True])
def test_triton_frozen_weight_gets_no_gradient_and_inputs_still_match_float64(gated):
    """A norm weight that needs no gradient (LoRA freezes it): no weight gradient, and the input (and gate)
    gradients still equal the float64 oracle, every element; the kernel writes no weight partials then."""
    k = _kernel()
    shape, D = (5, 3, 40), 40
    x, g, w = torch.randn(shape), 2 * torch.randn(shape), 1 + 0.3 * torch.randn(D)
    leaves = [_leaf(t) for t in ((x, g) if gated else (x,))]
    wt = w.to(DEVICE)  # frozen
    out = k.rms_norm_gated_triton(*leaves, wt, 1e-6) if gated else k.rms_norm_zero_centered_triton(*leaves, wt, 1e-6)
    dy = torch.randn_like(out)
    out.backward(dy)
    refs = [t.double().requires_grad_() for t in ((x, g) if gated else (x,))]
    ref = naive_rms_norm_gated(*refs, w.double(), 1e-6) if gated else naive_rms_norm_zero_centered(*refs, w.double(),
                                                                                                  1e-6)
    ref.backward(dy.double())
    assert wt.grad is None
    assert_rel_close(out, ref, 2e-6, "out")
    for name, a, b in zip("xg", leaves, refs):
        assert_rel_close(a.grad, b.grad, 2e-6, f"d{name}")
    # the backward itself, asked for no weight gradient, returns none
    _, x2s, g2s, rstd = k._forward(leaves[0].detach(), leaves[1].detach() if gated else None, wt, 1e-6)
    dx, dg, dw = k._backward(dy.reshape(-1, D), x2s, g2s, wt, rstd, False)
    assert dw is None and dx.shape == (15, D) and (dg is not None) == gated


def test_triton_reads_strided_rows_in_place():
    """q_norm's input is a strided view (one half of q_proj's output per head): read without a copy."""
    k = _kernel()
    B, T, H, D = 2, 3, 4, 16
    full = torch.randn(B, T, H, 2 * D, device=DEVICE)
    x = full[..., :D]  # strides (T*H*2D, H*2D, 2D, 1)
    assert not x.is_contiguous()
    w = 0.2 * torch.randn(D, device=DEVICE)
    x2 = k._rows(x, D)
    assert x2.data_ptr() == x.data_ptr() and x2.stride(0) == 2 * D
    _check(lambda x, w: k.rms_norm_zero_centered_triton(x, w, 1e-6),
           lambda x, w: naive_rms_norm_zero_centered(x, w, 1e-6), [x, w], 2e-6, "xw")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: exp(100) -> inf, as intended
def test_triton_extreme_rows():
    """Huge activations, eps-dominated rows, an all-zero row, saturated gates: finite, every element right."""
    k = _kernel()
    D = 40
    x = torch.randn(6, D)
    x[0] *= 1e15  # x^2 ~ 1e30, still finite in fp32
    x[1] *= 1e-6  # mean x^2 ~ 1e-12 << eps: the output is x / sqrt(eps)
    x[2] = 0.0
    x[3, 7] = 3e4  # one outlier dominates the row
    g = torch.randn(6, D) * 3
    g[4] = 100.0
    g[5] = -100.0  # silu saturates: exp(100) overflows fp32 in 1 + exp(-g)
    w = 0.5 * torch.randn(D)
    for eps in (1e-6, 1e-2):
        _check(lambda x, w: k.rms_norm_zero_centered_triton(x, w, eps),
               lambda x, w: naive_rms_norm_zero_centered(x, w, eps), [x.to(DEVICE), w.to(DEVICE)], 2e-6, "xw")
        _check(lambda x, g, w: k.rms_norm_gated_triton(x, g, w, eps),
               lambda x, g, w: naive_rms_norm_gated(x, g, w, eps), [t.to(DEVICE) for t in (x, g, w)], 2e-6,
               "xgw")


def test_triton_rows_are_independent():
    """Each row is normalised on its own: changing one row leaves every other output row bit-identical."""
    k = _kernel()
    x, w = torch.randn(9, 24, device=DEVICE), torch.randn(24, device=DEVICE)
    y0 = k.rms_norm_zero_centered_triton(x, w, 1e-6)
    x2 = x.clone()
    x2[4] = torch.randn(24, device=DEVICE) * 7
    y1 = k.rms_norm_zero_centered_triton(x2, w, 1e-6)
    keep = [i for i in range(9) if i != 4]
    assert torch.equal(y0[keep], y1[keep])
    assert_rel_close(y1[4], naive_rms_norm_zero_centered(x2[4], w, 1e-6), 2e-6, "row 4")


# --- torch reference vs transformers ------------------------------------------------------------------
def _hf_norm_classes():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35m
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    return [
        (q35.Qwen3_5RMSNorm, q35.Qwen3_5RMSNormGated),
        (q35m.Qwen3_5MoeRMSNorm, q35m.Qwen3_5MoeRMSNormGated),
        (qn.Qwen3NextRMSNorm, qn.Qwen3NextRMSNormGated),
    ]


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_reference_equals_transformers_bit_for_bit(dtype, wdtype):
    for plain_cls, gated_cls in _hf_norm_classes():
        D = 48
        plain, gated = plain_cls(D, eps=1e-6).to(wdtype), gated_cls(D, eps=1e-6).to(wdtype)
        with torch.no_grad():
            plain.weight.normal_(0, 0.2)
            gated.weight.normal_(1, 0.2)
        x = _leaf(torch.randn(2, 5, D) * 3, "cpu", dtype)
        g = _leaf(torch.randn(2, 5, D) * 3, "cpu", dtype)
        dy = torch.randn(2, 5, D).to(dtype)

        hf = plain(x)
        hf.backward(dy)
        hf_grads = (x.grad.clone(), plain.weight.grad.clone())
        x.grad = None
        w = plain.weight.detach().clone().requires_grad_()
        ours = rms_norm_zero_centered_torch(x, w, 1e-6)
        ours.backward(dy)
        assert torch.equal(ours, hf), plain_cls.__name__
        assert torch.equal(x.grad, hf_grads[0]) and torch.equal(w.grad, hf_grads[1])

        x.grad = None
        hf = gated(x, g)
        hf.backward(dy)
        hf_grads = (x.grad.clone(), g.grad.clone(), gated.weight.grad.clone())
        x.grad = g.grad = None
        w = gated.weight.detach().clone().requires_grad_()
        ours = rms_norm_gated_torch(x, g, w, 1e-6)
        ours.backward(dy)
        assert ours.dtype == hf.dtype == dtype
        assert torch.equal(ours, hf), gated_cls.__name__
        assert torch.equal(x.grad, hf_grads[0]) and torch.equal(g.grad, hf_grads[1])
        assert torch.equal(w.grad, hf_grads[2])


def test_reference_float64_is_computed_in_float64():
    x, w = torch.randn(3, 20, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    assert rel_rms(rms_norm_zero_centered_torch(x, w, 1e-6), naive_rms_norm_zero_centered(x, w, 1e-6)) < 1e-14
    g = torch.randn(3, 20, dtype=torch.float64)
    assert rel_rms(rms_norm_gated_torch(x, g, w, 1e-6), naive_rms_norm_gated(x, g, w, 1e-6)) < 1e-14


# --- public API: checks and selection -----------------------------------------------------------------
def test_public_ops_default_to_torch_on_cpu_and_force_triton():
    x, g, w = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24)
    assert torch.equal(api.rms_norm_zero_centered(x, w, 1e-6), rms_norm_zero_centered_torch(x, w, 1e-6))
    assert torch.equal(api.rms_norm_gated(x, g, w, 1e-6), rms_norm_gated_torch(x, g, w, 1e-6))
    if INTERPRETED:
        _kernel()
        got = api.rms_norm_zero_centered(x, w, 1e-6, backend="triton")
        assert_rel_close(got, naive_rms_norm_zero_centered(x, w, 1e-6), 2e-6)
        got = api.rms_norm_gated(x, g, w, 1e-6, backend="triton")
        assert_rel_close(got, naive_rms_norm_gated(x, g, w, 1e-6), 2e-6)


@pytest.mark.parametrize("call,match", [
    (lambda x, g, w: api.rms_norm_zero_centered(x, w[:5]), r"weight must be \[D\] = \(24,\).*got \(5,\)"),
    (lambda x, g, w: api.rms_norm_zero_centered(x, w, eps=-1.0), r"eps must be a finite float >= 0, got -1.0"),
    (lambda x, g, w: api.rms_norm_zero_centered(x, w, eps=float("nan")), r"eps must be .* got nan"),
    (lambda x, g, w: api.rms_norm_zero_centered(x.long(), w), r"x has dtype int64; allowed: float16"),
    (lambda x, g, w: api.rms_norm_zero_centered(x, w, bogus=1), r"unexpected keyword.*'bogus'"),
    (lambda x, g, w: api.rms_norm_gated(x, g[:, :3], w), r"gate must have x's shape \(4, 24\), got \(4, 3\)"),
    (lambda x, g, w: api.rms_norm_gated(x, "g", w), r"gate must be a torch.Tensor, got str"),
    (lambda x, g, w: api.rms_norm_gated(x, g, w.view(4, 6)), r"weight must have 1 dimensions, got shape \(4, 6\)"),
])
def test_argument_errors_name_argument_value_and_allowed(call, match):
    x, g, w = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24)
    with pytest.raises(ValueError, match=match):
        call(x, g, w)


def test_triton_candidate_rules():
    reg = Registry()
    norm_backends.register(reg)
    cpu = CallInfo(torch.device("cpu"), torch.float32, True)
    rows = {d.candidate: d for d in reg.explain(api.RMS_NORM, cpu)}
    assert rows["torch"].chosen
    if INTERPRETED:
        assert "only when forced" in rows["triton"].reason
    bf16_cpu = CallInfo(torch.device("cpu"), torch.bfloat16, True)
    rows = {d.candidate: d for d in reg.explain(api.RMS_NORM_GATED, bf16_cpu, "triton")}
    assert not rows["triton"].chosen and rows["triton"].reason


# --- Ascend NPU route with a stand-in torch_npu --------------------------------------------------------
def _fake_torch_npu(calls):
    mod = types.ModuleType("torch_npu")

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls.append({"x": x, "gamma": gamma, "epsilon": epsilon})
        assert gamma.dtype == x.dtype, "torch_npu requires gamma in x's dtype"
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        return x * rstd * gamma, rstd

    mod.npu_rms_norm = npu_rms_norm
    return mod


def test_npu_route_selection_and_argument_mapping(monkeypatch):
    calls = []
    reg = npu_registry(monkeypatch, _fake_torch_npu(calls), norm_backends.register)
    npu = CallInfo(npu_device(), torch.bfloat16, True)
    rows = {d.candidate: d for d in reg.explain(api.RMS_NORM, npu)}
    assert rows["npu"].chosen and rows["npu"].verified is False
    assert "need" in rows["triton"].reason or "CUDA" in rows["triton"].reason
    # the gated norm has no torch_npu kernel: the torch formula serves it on npu
    assert [d.candidate for d in reg.explain(api.RMS_NORM_GATED, npu) if d.chosen] == ["torch"]
    # never on other devices, and fp64 is not accepted by torch_npu
    assert [d.candidate for d in reg.explain(api.RMS_NORM, CallInfo(torch.device("cpu"), torch.float32, True))
            if d.chosen] == ["torch"]
    assert "fp16, bf16, fp32" in reg.explain(api.RMS_NORM, CallInfo(npu_device(), torch.float64,
                                                                   True))[1].reason

    impl = reg.select(api.RMS_NORM, npu)
    x = _leaf(torch.randn(3, 16), "cpu", torch.bfloat16)
    w = _leaf(0.01 * torch.randn(16), "cpu", torch.bfloat16)
    y = impl(x, w, 1e-5)
    c = calls[-1]
    # (1 + w) is passed as gamma in fp32 (bf16 would quantise 1 + w to steps of 2**-7), x upcast to fp32
    assert c["x"].dtype == torch.float32 and c["gamma"].dtype == torch.float32 and c["epsilon"] == 1e-5
    assert torch.equal(c["gamma"], 1.0 + w.detach().float())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, rms_norm_zero_centered_torch(x.detach(), w.detach(), 1e-5))
    y.float().sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()  # the parameter is in the graph
    # gamma is rebuilt from the parameter on every call: an updated weight changes the next result
    with torch.no_grad():
        w.add_(0.5)
    impl(x, w, 1e-5)
    assert torch.equal(calls[-1]["gamma"], 1.0 + w.detach().float())


def test_npu_route_unavailable_without_torch_npu(monkeypatch):
    reg = npu_registry(monkeypatch, None, norm_backends.register)  # import torch_npu raises ImportError
    rows = {d.candidate: d for d in reg.explain(api.RMS_NORM, CallInfo(npu_device(), torch.bfloat16,
                                                                      True))}
    assert rows["torch"].chosen and "torch_npu does not import" in rows["npu"].reason


# --- GPU: bf16 at Qwen3.5-35B-A3B sizes ---------------------------------------------------------------
def _bf16_vs_oracle_and_stock(fn, stock, oracle, inputs, names):
    """Triton (bf16) error vs float64 must be no worse than the stock bf16 module's own error (+ margin)."""
    leaves = [_leaf(t, DEVICE, t.dtype) for t in inputs]
    out = fn(*leaves)
    dy = torch.randn_like(out)
    out.backward(dy)
    s_leaves = [_leaf(t, DEVICE, t.dtype) for t in inputs]
    s_out = stock(*s_leaves)
    s_out.backward(dy)
    r_leaves = [t.detach().double().requires_grad_() for t in inputs]
    ref = oracle(*r_leaves)
    ref.backward(dy.double())
    assert torch.isfinite(out).all()
    assert rel_rms(out, s_out) < 1e-2
    for name, a, s, r in [("out", out, s_out, ref)] + [
            (n, a.grad, s.grad, r.grad) for n, a, s, r in zip(names, leaves, s_leaves, r_leaves)]:
        ours, theirs = rel_rms(a, r), rel_rms(s, r)
        assert ours <= 1.25 * theirs + 1e-3, f"{name}: triton {ours:.2e} vs stock {theirs:.2e}"
        assert_rel_close(a, r, 1.6e-2, name)


@gpu
@needs_cuda
@pytest.mark.parametrize("shape,wdtype", [((4096, 2048), torch.bfloat16), ((1, 4096, 16, 256), torch.bfloat16),
                                          ((4096, 2048), torch.float32), ((3, 1, 2048), torch.bfloat16)])
def test_gpu_bf16_zero_centered(shape, wdtype):
    k = _kernel()
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    D = shape[-1]
    mod = Qwen3_5RMSNorm(D, eps=1e-6).to(DEVICE, wdtype)
    with torch.no_grad():
        mod.weight.normal_(0, 0.1)
    x = (torch.randn(shape) * 4).to(torch.bfloat16).to(DEVICE)
    # the torch reference is the stock module's formula (bit-identical: see the parity test); also check it
    assert torch.equal(mod(x), rms_norm_zero_centered_torch(x, mod.weight, 1e-6))
    _bf16_vs_oracle_and_stock(lambda x, w: k.rms_norm_zero_centered_triton(x, w, 1e-6),
                              lambda x, w: rms_norm_zero_centered_torch(x, w, 1e-6),
                              lambda x, w: naive_rms_norm_zero_centered(x, w, 1e-6),
                              [x, mod.weight.detach()], "xw")


@gpu
@needs_cuda
@pytest.mark.parametrize("rows,D", [(4096 * 32, 128), (7, 128), (4096, 2048)])
def test_gpu_bf16_gated(rows, D):
    k = _kernel()
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    mod = Qwen3_5RMSNormGated(D, eps=1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        mod.weight.normal_(1, 0.1)
    x = torch.randn(rows, D).to(torch.bfloat16).to(DEVICE)
    g = (torch.randn(rows, D) * 3).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(mod(x, g), rms_norm_gated_torch(x, g, mod.weight, 1e-6))
    _bf16_vs_oracle_and_stock(lambda x, g, w: k.rms_norm_gated_triton(x, g, w, 1e-6),
                              lambda x, g, w: rms_norm_gated_torch(x, g, w, 1e-6),
                              lambda x, g, w: naive_rms_norm_gated(x, g, w, 1e-6),
                              [x, g, mod.weight.detach()], "xgw")


def test_info_marks_npu_routes_unverified_on_hardware(monkeypatch):
    """`deltafuse info` on an npu device (stand-in torch_npu): the npu rows are chosen and flagged."""
    from deltafuse.info import format_info, info

    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu([]))
    REGISTRY.clear_cache()  # availability is cached per process; the stand-in must be seen
    try:
        report = info(devices=[npu_device()])
        rows = {op: r for op, r in report["ops"].items() if op == api.RMS_NORM}
        assert all(r["chosen"] == "npu" and r["unverified_on_hardware"] for r in rows[api.RMS_NORM])
        assert "-> npu (unverified on hardware)" in format_info(report)
    finally:
        monkeypatch.delitem(sys.modules, "torch_npu")
        REGISTRY.clear_cache()
