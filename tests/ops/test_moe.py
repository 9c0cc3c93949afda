"""MoE experts: torch (grouped matmuls and the expert loop) vs the float64 oracle, parity with transformers'
experts modules (eager and grouped_mm) through an experts-interface adapter, router gradients through the
sparse MoE block, PEFT LoRA on the expert parameters, experts without tokens, no cross-call caching, the
saved-for-backward footprint, and argument checks. ``gpu`` tests need CUDA (bf16, Qwen3.5-35B-A3B sizes).
"""

from __future__ import annotations


import pytest
import torch

from deltafuse.backends import moe as moe_backends
from deltafuse.backends.registry import CallInfo, Registry
from deltafuse.ops.moe import reference
from deltafuse.ops.moe.naive import naive_moe_experts
from tests.helpers import DEVICE, INTERPRETED, assert_rel_close, gpu, needs_cuda, rel_rms  # noqa: E402

OP = moe_backends.MOE_EXPERTS


def _api():
    from deltafuse.ops.moe import moe_experts

    return moe_experts


def _inputs(N, H, I, E, k, *, dtype=torch.float32, device=DEVICE, seed=0, used=None):
    """Random routing over the first ``used`` experts (default all): experts >= used receive no token."""
    gen = torch.Generator().manual_seed(seed)
    used = E if used is None else used
    idx = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(N)]) if N else \
        torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(N, k, generator=gen).softmax(-1)
    x = torch.randn(N, H, generator=gen)
    gu = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    dn = torch.randn(E, H, I, generator=gen) / I ** 0.5
    leaves = [t.to(device, dtype).requires_grad_() for t in (x, w, gu, dn)]
    return leaves[0], idx.to(device), leaves[1], leaves[2], leaves[3]


def _check(fn, x, idx, w, gu, dn, tol, names=("hidden", "weights", "gate_up", "down")):
    out = fn(x, idx, w, gu, dn)
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, gu, dn), dy)
    ins = [t.detach().double().requires_grad_() for t in (x, w, gu, dn)]
    ref = naive_moe_experts(ins[0], idx, ins[1], ins[2], ins[3])
    want = torch.autograd.grad(ref, ins, dy.double())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_rel_close(out, ref, tol, "out")
    for name, a, b in zip(names, got, want):
        assert_rel_close(a, b, tol, f"d{name}")
    return got


# --- vs float64 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("shape", [(1, 8, 4, 3, 1), (7, 16, 8, 6, 2), (13, 16, 8, 8, 4), (5, 24, 12, 4, 4)])
def test_torch_matches_float64(impl, shape):
    N, H, I, E, k = shape
    fn = reference.moe_experts_torch if impl == "grouped" else reference.moe_experts_torch_loop
    _check(fn, *_inputs(N, H, I, E, k, seed=sum(shape)), 5e-6)


def test_float64_loop_is_exact():
    _check(reference.moe_experts_torch, *_inputs(6, 8, 4, 5, 2, dtype=torch.float64, device="cpu", seed=3), 1e-13)


def test_grouped_path_is_used_for_fp32_on_cpu_when_torch_has_it():
    if reference._GROUPED is None:
        pytest.skip("this torch has no grouped_mm")
    assert reference._grouped_works("cpu", None, torch.float32)
    assert not reference._grouped_works("cpu", None, torch.float64)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_experts_without_tokens_get_exact_zero_gradients(impl):
    fn = reference.moe_experts_torch if impl == "grouped" else reference.moe_experts_torch_loop
    x, idx, w, gu, dn = _inputs(9, 16, 8, 7, 2, seed=4, used=3)  # experts 3..6 receive nothing
    got = _check(fn, x, idx, w, gu, dn, 5e-6)
    assert torch.equal(got[2][3:], torch.zeros_like(got[2][3:]))
    assert torch.equal(got[3][3:], torch.zeros_like(got[3][3:]))
    assert got[2][:3].abs().max() > 0 and got[3][:3].abs().max() > 0


def test_single_expert_holds_every_slot_and_zero_weights():
    x, idx, w, gu, dn = _inputs(6, 8, 4, 5, 1, seed=5)
    idx = torch.full_like(idx, 2)
    with torch.no_grad():
        w[::2] = 0.0  # zero routing weight: output 0 for those tokens, but the router still gets a gradient
    _check(_api(), x, idx, w, gu, dn, 5e-6)


def test_no_tokens():
    x, idx, w, gu, dn = _inputs(0, 8, 4, 3, 2)
    out = _api()(x, idx, w, gu, dn)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.equal(gu.grad, torch.zeros_like(gu)) and torch.equal(dn.grad, torch.zeros_like(dn))


def test_no_caching_across_calls_and_per_call_weights_get_gradients():
    """A LoRA-style weight built per call (W0 + B @ A) gets its gradient, and changing the parameters between
    calls changes the result (nothing derived from them is kept)."""
    x, idx, w, gu, dn = _inputs(8, 16, 8, 4, 2, seed=6)
    gen = torch.Generator().manual_seed(7)
    A = (0.1 * torch.randn(4, 2, 16, generator=gen)).to(DEVICE).requires_grad_()
    B = (0.1 * torch.randn(4, 16, 2, generator=gen)).to(DEVICE).requires_grad_()
    base = gu.detach()

    def run(fn, base, A, B, x, w, dn):
        return fn(x, idx, w, base + B @ A, dn)

    out1 = run(_api(), base, A, B, x, w, dn)
    dy = torch.randn_like(out1)
    gA, gB = torch.autograd.grad(out1, (A, B), dy)
    ins = [t.detach().double().requires_grad_() for t in (A, B)]
    ref = run(naive_moe_experts, base.double(), ins[0], ins[1], x.detach().double(), w.detach().double(),
              dn.detach().double())
    rA, rB = torch.autograd.grad(ref, ins, dy.double())
    assert_rel_close(gA, rA, 5e-6, "dA")
    assert_rel_close(gB, rB, 5e-6, "dB")
    with torch.no_grad():
        dn.mul_(2.0)
    out2 = run(_api(), base, A, B, x, w, dn)
    assert_rel_close(out2, 2 * out1.detach(), 1e-6, "out after doubling down_proj")


def test_saved_tensors_exclude_hidden_sized_intermediates():
    """Saved for the backward: the inputs and the [S, 2I] gate_up output; no gathered [S, H] rows, no down
    output, no separate activation."""
    N, H, I, E, k = 16, 32, 4, 4, 4
    x, idx, w, gu, dn = _inputs(N, H, I, E, k, seed=8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = _api()(x, idx, w, gu, dn)
    S = N * k
    new = [t for t in saved if not any(t is p for p in (x, w, gu, dn))]
    assert sum(t.numel() for t in new) <= S * 2 * I, [tuple(t.shape) for t in new]
    assert not any(t.shape == (S, H) for t in saved)
    out.sum().backward()


# --- parity with transformers ----------------------------------------------------------------------------
def _adapter():
    """The experts-interface function the transformers patch layer registers, recording for every call whether
    deltafuse's op served it ("deltafuse") or transformers' grouped_mm ("fallback")."""
    from deltafuse.integrations.transformers.adapters_fused import experts_forward, experts_plain

    def recording_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        recording_experts_forward.calls.append("deltafuse" if experts_plain(self) else "fallback")
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    recording_experts_forward.calls = []
    return recording_experts_forward


@pytest.fixture
def registered():
    pytest.importorskip("transformers")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    assert "deltafuse" not in ALL_EXPERTS_FUNCTIONS
    fn = _adapter()
    ExpertsInterface.register("deltafuse", fn)
    yield "deltafuse"
    del ExpertsInterface._global_mapping["deltafuse"]
    assert fn.calls and set(fn.calls) == {"deltafuse"}, f"the adapter must serve through deltafuse: {fn.calls}"


def _families():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35m
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as qn
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    small = dict(hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=3,
                 shared_expert_intermediate_size=8)
    return [(Qwen3_5MoeTextConfig(**small), q35m.Qwen3_5MoeSparseMoeBlock),
            (Qwen3NextConfig(**small), qn.Qwen3NextSparseMoeBlock)]


def _run_block(block, impl, x):
    block.experts.config._experts_implementation = impl
    block.zero_grad(set_to_none=True)
    xl = x.detach().clone().requires_grad_()
    out = block(xl)
    out.backward(torch.ones_like(out) * 0.1 + torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), xl.grad.detach(), grads


@pytest.mark.parametrize("stock", ["eager", "grouped_mm"])
def test_sparse_moe_block_equals_transformers(registered, stock):
    """Whole sparse MoE block (router softmax/top-k/renormalise, experts, shared expert): output, input gradient
    and every parameter gradient (router included) equal the stock experts implementations in fp32."""
    for cfg, block_cls in _families():
        torch.manual_seed(9)
        block = block_cls(cfg)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(2, 7, 16)
        ref = _run_block(block, stock, x)
        ours = _run_block(block, registered, x)
        assert_rel_close(ours[0], ref[0], 2e-6, f"{block_cls.__name__} out")
        assert_rel_close(ours[1], ref[1], 2e-6, f"{block_cls.__name__} dx")
        assert set(ours[2]) == set(ref[2]) and "gate.weight" in ref[2]
        for name in ref[2]:
            assert_rel_close(ours[2][name], ref[2][name], 2e-6, f"{block_cls.__name__} d{name}")


def test_experts_module_equals_transformers_with_unused_experts(registered):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    cfg, _ = _families()[0]
    mod = Qwen3_5MoeExperts(cfg)
    x, idx, w, gu, dn = _inputs(11, 16, 8, 8, 3, device="cpu", seed=10, used=5)
    with torch.no_grad():
        mod.gate_up_proj.copy_(gu)
        mod.down_proj.copy_(dn)
    results = {}
    for impl in ("eager", registered):
        mod.config._experts_implementation = impl
        mod.zero_grad(set_to_none=True)
        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = mod(xl, idx, wl)
        out.backward(torch.cos(out.detach()))
        results[impl] = (out.detach(), xl.grad, wl.grad, mod.gate_up_proj.grad, mod.down_proj.grad)
    for a, b, name in zip(results[registered], results["eager"], ("out", "dx", "dw", "dgate_up", "ddown")):
        assert_rel_close(a, b, 2e-6, name)
    # eager leaves unused experts without gradient contributions: zero rows there
    assert torch.equal(results[registered][3][5:], torch.zeros_like(results[registered][3][5:]))


def test_peft_lora_on_expert_parameters(registered):
    """PEFT LoRA with target_parameters on gate_up_proj and down_proj: same output and LoRA gradients as stock."""
    peft = pytest.importorskip("peft")
    cfg, block_cls = _families()[0]
    torch.manual_seed(11)
    block = block_cls(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                        init_lora_weights=False), block)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 4 and all(p.requires_grad for p in lora.values())
    x = torch.randn(1, 9, 16)
    experts = model.experts.get_base_layer() if hasattr(model.experts, "get_base_layer") else model.experts
    runs = {}
    for impl in ("eager", registered):
        experts.config._experts_implementation = impl
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.pow(2).sum().backward()
        runs[impl] = (out.detach(), {n: p.grad.clone() for n, p in lora.items()})
    assert_rel_close(runs[registered][0], runs["eager"][0], 2e-6, "out")
    for n in lora:
        assert_rel_close(runs[registered][1][n], runs["eager"][1][n], 2e-6, f"d{n}")


# --- selection and argument checks -------------------------------------------------------------------------
def test_candidate_rules():
    reg = Registry()
    moe_backends.register(reg)
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        rows = {d.candidate: d for d in reg.explain(OP, CallInfo(torch.device("cpu"), dt, True))}
        assert rows["torch"].chosen


@pytest.mark.parametrize("call,match", [
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu, dn, act="gelu"), r"act must be one of 'silu'.*got 'gelu'"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu[:, :7], dn), r"gate_up_proj must be \[E, 2I, H\].*got \(4, 7, 8\)"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu, dn[:, :, :3]),
     r"down_proj must be \[E, H, I\] = \(4, 8, 4\).*\(4, 8, 3\)"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu.double(), dn), r"gate_up_proj has dtype torch.float64 but hidden"),
    (lambda x, i, w, gu, dn: _api()(x, i.float(), w, gu, dn), r"top_k_index has dtype float32; allowed: int64"),
    (lambda x, i, w, gu, dn: _api()(x, i[:2], w, gu, dn), r"top_k_index must be \[N, k\] = \[5, k\].*got \(2, 2\)"),
    (lambda x, i, w, gu, dn: _api()(x, i, w[:, :1], gu, dn), r"top_k_weights must have top_k_index's shape \(5, 2\)"),
    (lambda x, i, w, gu, dn: _api()(x, i + 3, w, gu, dn), r"expert ids in \[0, 4\), got values in \[3, [4-6]\]"),
    (lambda x, i, w, gu, dn: _api()(x[None], i, w, gu, dn), r"hidden must have 2 dimensions"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu, dn, bogus=1), r"unexpected keyword.*'bogus'"),
])
def test_argument_errors_name_argument_value_and_allowed(call, match):
    x, i, w, gu, dn = _inputs(5, 8, 4, 4, 2, device="cpu")
    with pytest.raises(ValueError, match=match):
        call(x, i, w, gu, dn)


# --- GPU: bf16 at Qwen3.5-35B-A3B sizes ---------------------------------------------------------------------
@gpu
@needs_cuda
def test_gpu_bf16_matches_transformers_grouped_mm(registered):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    cfg = Qwen3_5MoeTextConfig(hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8)
    mod = Qwen3_5MoeExperts(cfg).to("cuda", torch.bfloat16)
    x, idx, w, gu, dn = _inputs(2048, 2048, 512, 256, 8, dtype=torch.bfloat16, device="cuda", seed=12, used=200)
    with torch.no_grad():
        mod.gate_up_proj.copy_(gu)
        mod.down_proj.copy_(dn)
    res = {}
    for impl in ("grouped_mm", registered):
        mod.config._experts_implementation = impl
        mod.zero_grad(set_to_none=True)
        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = mod(xl, idx, wl)
        out.backward(torch.ones_like(out))
        res[impl] = (out.detach(), xl.grad, wl.grad, mod.gate_up_proj.grad, mod.down_proj.grad)
    for a, b, name in zip(res[registered], res["grouped_mm"], ("out", "dx", "dw", "dgate_up", "ddown")):
        assert rel_rms(a, b) < 2e-2, f"{name}: {rel_rms(a, b):.2e}"
    assert torch.equal(res[registered][3][200:], torch.zeros_like(res[registered][3][200:]))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_float64(dtype):
    tol = 1e-3 if dtype == torch.float32 else 2e-2  # fp32 on GPU may use TF32 in grouped kernels
    _check(reference.moe_experts_torch, *_inputs(64, 64, 32, 16, 4, dtype=dtype, device="cuda", seed=13, used=12),
           tol)


def test_swiglu_inside_uses_the_triton_kernel_when_forced():
    """SiLU * up (forward and backward) goes through deltafuse's swiglu op: with Triton forced (interpreted on
    CPU) the experts still match float64."""
    pytest.importorskip("triton")
    from deltafuse import backends
    from deltafuse.ops.swiglu import kernel as swiglu_kernel

    if DEVICE == "cpu" and not INTERPRETED:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    calls = []
    real = swiglu_kernel._SwiGLU.apply

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    backends.set_backend_override("triton")
    try:
        swiglu_kernel._SwiGLU.apply = spy
        backends.REGISTRY.clear_cache()
        _check(reference.moe_experts_torch, *_inputs(6, 16, 8, 4, 2, seed=14), 5e-6)
    finally:
        swiglu_kernel._SwiGLU.apply = real
        backends.set_backend_override(None)
        backends.REGISTRY.clear_cache()
    assert len(calls) == 2  # forward and the backward's recompute
