"""MoE experts: torch (grouped matmuls and the expert loop) vs the float64 oracle, parity with transformers'
experts modules (eager and grouped_mm) through an experts-interface adapter, router gradients through the
sparse MoE block, PEFT LoRA on the expert parameters, experts without tokens, no cross-call caching, the
saved-for-backward footprint, and argument checks. ``gpu`` tests need CUDA (bf16, Qwen3.5-35B-A3B sizes).
"""

from __future__ import annotations


import pytest
import torch

from deltafuse.ops.moe import candidates as moe_backends
from deltafuse.backends.registry import CallInfo, Registry
from deltafuse.ops.moe import reference
from deltafuse.ops.moe.naive import naive_moe_experts
from tests.helpers import (
    DEVICE, INTERPRETED, assert_rel_close, assert_within_term_sizes, gpu, input_gen, input_seed, needs_cuda, rel_rms,
    triton_kernel_module,
)

OP = moe_backends.MOE_EXPERTS


def _api():
    from deltafuse.ops.moe import moe_experts

    return moe_experts


def _inputs(N, H, I, E, k, *, dtype=torch.float32, device=DEVICE, seed=0, used=None):
    """Random routing over the first ``used`` experts (default all): experts >= used receive no token."""
    gen = input_gen(seed)
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
        if name == "weights":
            _assert_weight_grads_close(a, b, ins[0].detach(), idx, ins[2].detach(), ins[3].detach(), dy, tol)
        else:
            assert_rel_close(a, b, tol, f"d{name}")
    return got


def _assert_weight_grads_close(got, want, x, idx, gu, dn, dy, tol):
    """dweights[n, j] = dy[n] . y, y the output of expert idx[n, j] for token n: a dot product whose terms can cancel
    (one token with one expert gave a lone dweight 6.1e-5 off in relative terms, at fp32 rounding of its H terms), so
    each element is held to tol times the size of its terms, sum |dy[n] * y| (float64)."""
    inter = dn.shape[2]
    size = torch.zeros(idx.shape, dtype=torch.float64)
    for n in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            h = gu[int(idx[n, j])] @ x[n]
            y = dn[int(idx[n, j])] @ (torch.nn.functional.silu(h[:inter]) * h[inter:])
            size[n, j] = (dy[n].double().cpu() * y.cpu()).abs().sum()
    assert_within_term_sizes(got, want, size, tol, "dweights")


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


@pytest.mark.parametrize("E,k,n", [(256, 8, 300), (512, 10, 77), (3, 2, 1), (40000, 4, 50)])
def test_routing_plan_orders_slots_by_expert_stably(E, k, n):
    """The routing plan (expert ids sorted as 16-bit keys where they fit, as int64 past 32,767 experts) against
    one built in int64 by hand: slots grouped by expert in token order, each group's end offset, each slot's
    token; the inverse order undoes the sort."""
    gen = input_gen()
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(n)]).to(DEVICE)
    plan = reference._Plan(idx, E)
    flat = idx.reshape(-1).cpu()
    want = sorted(range(flat.numel()), key=lambda s: (int(flat[s]), s))
    assert plan.perm.cpu().tolist() == want
    assert plan.offs.dtype == torch.int32
    assert plan.offs.cpu().tolist() == torch.cumsum(torch.bincount(flat, minlength=E), 0).tolist()
    assert torch.equal(plan.token.cpu(), torch.tensor(want) // k)
    assert torch.equal(plan.inverse().cpu()[torch.tensor(want)], torch.arange(flat.numel()))


def test_no_caching_across_calls_and_per_call_weights_get_gradients():
    """A LoRA-style weight built per call (W0 + B @ A) gets its gradient, and changing the parameters between
    calls changes the result (nothing derived from them is kept)."""
    x, idx, w, gu, dn = _inputs(8, 16, 8, 4, 2, seed=6)
    gen = input_gen(7)
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
    # the inputs are saved as they are or as views of them (the op records the backend on detached views);
    # the one-element int64 handle is the op's reference to that record
    inputs = {p.untyped_storage().data_ptr() for p in (x, w, gu, dn)}
    new = [t for t in saved if t.untyped_storage().data_ptr() not in inputs
           and not (t.dtype == torch.int64 and t.numel() == 1)]
    assert sum(t.numel() for t in new) <= S * 2 * I, [tuple(t.shape) for t in new]
    assert not any(t.shape == (S, H) for t in saved)
    out.sum().backward()


def _aten_ops(fn):
    """(name, input shapes) of the aten ops ``fn`` issues (CPU profiler): the ones no other aten op issued,
    plus every dtype copy (``aten::_to_copy``, wherever it comes from). ``fn`` runs once before, so one-time
    probes are not counted."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    ops = []
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if e.name == "aten::_to_copy" or (e.name.startswith("aten::") and e.name != "aten::to" and parent is None):
            ops.append((e.name, [tuple(s) for s in e.input_shapes]))
    return ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_token_order_copies_or_fp32_upcasts_of_slot_tensors(dtype):
    """Forward + backward of one call: the [S, H] down output and hidden-state gradient are never gathered into
    token order (the per-token sums read them in expert order), and no [S, I] / [S, H] tensor is copied to
    another dtype (the routing-weight gradient's row dots accumulate in fp32 without upcast copies). What is
    left per call: the two gathers from token order ([N, H] inputs, needed by the grouped matmuls) and the
    gate_up rows' re-gather for its weight gradient."""
    N, H, I, E, k = 24, 32, 8, 6, 4
    S = N * k
    x, idx, w, gu, dn = _inputs(N, H, I, E, k, dtype=dtype, device="cpu", seed=11)

    def step():
        out = _api()(x, idx, w, gu, dn)
        out.backward(torch.randn_like(out))

    ops = _aten_ops(step)
    big = [(n, sh) for n, sh in ops if sh and sh[0] and len(sh[0]) == 2 and sh[0][0] == S and sh[0][1] in (H, I)]
    assert not [o for o in big if o[0] == "aten::index"], big  # no [S, H] gather into token order
    # (the routing plan's [S] expert ids cast to 16-bit sort keys are not slot tensors: S * min(H, I) elements)
    copies = [(n, sh) for n, sh in ops if n in ("aten::_to_copy", "aten::copy_")
              and sh and sh[0] and int(torch.tensor(sh[0]).prod()) >= S * min(H, I)]
    assert not copies, copies
    gathers = [sh for n, sh in ops if n == "aten::index"]
    assert sorted(tuple(sh[0]) for sh in gathers if sh[0] and sh[0][-1] == H) == [(N, H)] * 3, gathers


def test_bf16_matches_float64_on_cpu():
    """bf16 on the CPU (fp32 accumulators in the per-token sums and the routing-weight row dots): every output
    and gradient within bf16 tolerance of the float64 oracle."""
    _check(reference.moe_experts_torch, *_inputs(19, 32, 16, 6, 4, dtype=torch.bfloat16, device="cpu", seed=12),
           tol=2e-2)


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


def _run_experts(mod, impl, x, idx, w, grad_of):
    """Output and gradients (dx, dw, d gate_up_proj, d down_proj) of an experts module run under ``impl``, its
    output gradient ``grad_of(out)``."""
    mod.config._experts_implementation = impl
    mod.zero_grad(set_to_none=True)
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = mod(xl, idx, wl)
    out.backward(grad_of(out))
    return out.detach(), xl.grad, wl.grad, mod.gate_up_proj.grad, mod.down_proj.grad


@pytest.mark.parametrize("stock", ["eager", "grouped_mm"])
def test_sparse_moe_block_equals_transformers(registered, stock):
    """Whole sparse MoE block (router softmax/top-k/renormalise, experts, shared expert): output, input gradient
    and every parameter gradient (router included) equal the stock experts implementations in fp32."""
    for cfg, block_cls in _families():
        torch.manual_seed(input_seed(9))
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
    results = {impl: _run_experts(mod, impl, x, idx, w, lambda out: torch.cos(out.detach()))
               for impl in ("eager", registered)}
    for a, b, name in zip(results[registered], results["eager"], ("out", "dx", "dw", "dgate_up", "ddown")):
        assert_rel_close(a, b, 2e-6, name)
    # eager leaves unused experts without gradient contributions: zero rows there
    assert torch.equal(results[registered][3][5:], torch.zeros_like(results[registered][3][5:]))


def test_peft_lora_on_expert_parameters(registered):
    """PEFT LoRA with target_parameters on gate_up_proj and down_proj: same output and LoRA gradients as stock."""
    peft = pytest.importorskip("peft")
    cfg, block_cls = _families()[0]
    torch.manual_seed(input_seed(11))
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


# --- the Triton per-token sums -----------------------------------------------------------------------------
def _kernel():
    return triton_kernel_module("deltafuse.ops.moe.kernel", "_gather_sum_kernel")


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("N,k,H", [(1, 1, 8), (5, 3, 40), (9, 8, 96), (4, 10, 33)])
def test_gather_sum_triton_matches_float64(weighted, N, k, H):
    """out[n] = sum_j w[n, j] rows[index[n, j]] against float64, every element; rows read out of order (a
    random permutation, as the inverse of the sort by expert is), H across several column blocks and not a
    multiple of one."""
    kernel = _kernel()
    gen = input_gen(N * 100 + k * 10 + H + weighted)
    S = N * k
    rows = torch.randn(S, H, generator=gen)
    index = torch.randperm(S, generator=gen).view(N, k)
    w = torch.rand(N, k, generator=gen) + 0.1 if weighted else None
    got = kernel.gather_sum_triton(rows.to(DEVICE), index.to(DEVICE), None if w is None else w.to(DEVICE))
    ref = rows.double()[index]
    ref = (ref * (w.double()[..., None] if weighted else 1.0)).sum(1)
    assert got.shape == (N, H) and got.dtype == rows.dtype
    assert_rel_close(got, ref, 1e-6, "gather_sum")


def test_gather_sum_triton_no_tokens():
    kernel = _kernel()
    out = kernel.gather_sum_triton(torch.randn(0, 8, device=DEVICE), torch.zeros(0, 2, dtype=torch.int64,
                                                                                 device=DEVICE), None)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, True, False),
                                  (False, False, True)])
@pytest.mark.parametrize("S,I", [(1, 4), (7, 40), (13, 16)])
def test_act_grads_triton_matches_float64(need, S, I):
    """The backward's activation step against float64: <g, silu(gate) up> per slot, silu(gate) up w, and
    d[gate; up] of silu(gate) up for the upstream g w; every element, each output only where asked for; I
    across several column blocks and S not a multiple of the rows per program."""
    kernel = _kernel()
    gen = input_gen(S * 7 + I + sum(need))
    gu = torch.randn(S, 2 * I, generator=gen) * 2
    g = torch.randn(S, I, generator=gen)
    w = torch.rand(S, generator=gen) + 0.05
    got = kernel.act_grads_triton(gu.to(DEVICE), g.to(DEVICE), w.to(DEVICE), torch.float32, *need)
    gate, up = (t.double().requires_grad_() for t in (gu[:, :I], gu[:, I:]))
    act = torch.nn.functional.silu(gate) * up
    want = [(g.double() * act).sum(1).detach(), (act * w.double()[:, None]).detach(),
            torch.cat(torch.autograd.grad(act, (gate, up), g.double() * w.double()[:, None]), 1)]
    for name, flag, a, b in zip(("dws", "act_w", "dgu"), need, got, want):
        if not flag:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == torch.float32, name
        if name == "dws":
            # a sum of I products per slot, which may cancel: within float32's summation bound of each slot,
            # (I + 4) eps of the sum of the terms' magnitudes (the + 4: rounding of each product in the kernel)
            bound = (I + 4) * torch.finfo(torch.float32).eps * (g.double().abs() * act.detach().abs()).sum(1)
            assert torch.isfinite(a).all() and ((a.double().cpu() - b).abs() <= bound).all(), (name, a, b, bound)
        else:
            assert_rel_close(a, b, 1e-6, name)


@pytest.mark.parametrize("shape", [(1, 8, 4, 3, 1), (13, 40, 8, 8, 4), (6, 24, 12, 5, 5), (9, 16, 40, 4, 3),
                                   (30, 24, 20, 3, 2)])
def test_triton_experts_match_float64(shape):
    """The experts with the Triton per-token sums (and, interpreted or on the devices that take them, the Triton
    grouped matmuls: the last shape gives each expert two row tiles and reductions of 20 and 40 that are no
    multiple of the tile): output and every gradient against float64."""
    kernel = _kernel()
    N, H, I, E, k = shape
    _check(kernel.moe_experts_triton, *_inputs(N, H, I, E, k, seed=sum(shape) + 1), 5e-6)


def test_triton_experts_without_tokens_on_some_experts_and_forced_through_the_op():
    """Forced with backend='triton' through the public op: equal to float64, and experts that got no token
    have exact zero weight gradients."""
    _kernel()
    x, idx, w, gu, dn = _inputs(9, 16, 8, 7, 2, seed=40, used=3)
    got = _check(lambda *a: _api()(*a, backend="triton"), x, idx, w, gu, dn, 5e-6)
    assert torch.equal(got[2][3:], torch.zeros_like(got[2][3:]))
    assert torch.equal(got[3][3:], torch.zeros_like(got[3][3:]))


# --- the Triton grouped matmuls -----------------------------------------------------------------------------
def _mm_kernel():
    return triton_kernel_module("deltafuse.ops.moe.kernel_mm", "_grouped_mm_kernel")


def _sorted_routing(counts, gen):
    """offs [E] int32 (cumulative ends) for experts with ``counts`` sorted rows, and a random token of each
    sorted row among N = sum(counts) // 2 + 1 tokens (rows gathered out of order, some tokens twice)."""
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    S = int(offs[-1]) if counts else 0
    n = S // 2 + 1
    return offs, torch.randint(0, n, (S,), generator=gen), n


def _tile_map_by_loop(counts, bm):
    """The tile map built expert by expert in Python: (expert, first row) per tile, then (-1, 0) up to the bound."""
    expert, first, start = [], [], 0
    for e, c in enumerate(counts):
        for r in range(start, start + c, bm):
            expert.append(e)
            first.append(r)
        start += c
    pad = (start + len(counts) * (bm - 1)) // bm - len(expert)
    return torch.tensor(expert + [-1] * pad, dtype=torch.int32), torch.tensor(first + [0] * pad, dtype=torch.int32)


@pytest.mark.parametrize("bm", [1, 4, 16])
def test_tile_map_cuts_every_experts_rows_into_tiles_once(bm):
    """Every sorted row is in exactly one tile, of its own expert, each tile's first row is a multiple of ``bm``
    rows into its expert, and the slots past the last tile (expert -1, first row 0) fill the shape-only bound;
    the map equals one built expert by expert in Python."""
    kernel_mm = _mm_kernel()
    gen = input_gen(bm)
    drawn = [torch.randint(0, 3 * bm + 2, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
             for _ in range(4)]
    for counts in ([0, 5, 0, 17, 1, 0], [33], [0, 0, 3], [bm] * 4, [0, 0], *drawn):
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        S, E = int(offs[-1]), len(counts)
        expert, first = (t.cpu() for t in kernel_mm.tile_map(offs.to(DEVICE), S, bm))
        want_expert, want_first = _tile_map_by_loop(counts, bm)
        assert torch.equal(expert, want_expert) and torch.equal(first, want_first), counts
        assert expert.dtype == first.dtype == torch.int32
        assert expert.numel() == first.numel() == (S + E * (bm - 1)) // bm
        owner = torch.full((S,), -1)
        starts = [0] + offs[:-1].tolist()
        for e, r in zip(expert.tolist(), first.tolist()):
            if e < 0:
                continue
            end = int(offs[e])
            assert starts[e] <= r < end and (r - starts[e]) % bm == 0, (counts, e, r)
            rows = torch.arange(r, min(r + bm, end))
            assert (owner[rows] == -1).all(), (counts, e, r)
            owner[rows] = e
        want = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
        assert torch.equal(owner, want), counts
        real = (expert >= 0).nonzero().flatten()
        assert real.numel() == 0 or bool((expert[real.max() + 1:] == -1).all())
        assert not first[expert < 0].any()


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("counts,K,M", [([5, 0, 40, 1], 24, 40), ([16, 16], 32, 16), ([0, 33, 0], 20, 7),
                                          ([3], 1, 5)])
def test_grouped_mm_triton_matches_float64(gather, layout, counts, K, M):
    """out[r] = a[rows[r]] @ w[e] (or a[r] @ w[e]) for each expert's sorted rows against a float64 product,
    every element: experts without rows, with one and with several row tiles, reductions and widths that are no
    multiple of the tiles, the weights in both layouts (K or M contiguous, as the forward's transposed views and
    the data gradients' plain weights are)."""
    kernel_mm = _mm_kernel()
    gen = input_gen(sum(counts) * 31 + K + M + gather)
    offs, rows, n = _sorted_routing(counts, gen)
    S, E = int(offs[-1]), len(counts)
    src = torch.randn(n if gather else S, K, generator=gen)
    w = torch.randn(E, K, M, generator=gen) if layout == "kn" else torch.randn(E, M, K, generator=gen).transpose(1, 2)
    got = kernel_mm.grouped_mm_triton(src.to(DEVICE), w.to(DEVICE), offs.to(DEVICE),
                                      rows.to(DEVICE) if gather else None)
    a = src.double()[rows] if gather else src.double()
    want = torch.cat([a[int(lo):int(hi)] @ w[e].double()
                      for e, (lo, hi) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
    assert got.shape == (S, M) and got.dtype == src.dtype
    assert_rel_close(got, want, 1e-6, "grouped_mm")
    assert (got.cpu().double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_grouped_mm_triton_without_rows():
    kernel_mm = _mm_kernel()
    out = kernel_mm.grouped_mm_triton(torch.randn(4, 8, device=DEVICE), torch.randn(3, 8, 5, device=DEVICE),
                                      torch.zeros(3, dtype=torch.int32, device=DEVICE),
                                      torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0, 5)


@pytest.mark.parametrize("frozen", [True, False])
def test_triton_experts_run_their_matmuls_in_triton_with_the_rows_gathered_inside(monkeypatch, frozen):
    """Where the Triton matmuls serve (interpreted, or a measured GPU), all four matmuls of a call are Triton's and
    no [S, H] gather into expert order is made for them: the hidden states' rows (forward) and the output
    gradient's rows (backward, unless the down weight gradient needs them) are read by the kernel; one tile map
    serves the call."""
    kernel = _kernel()
    if not kernel._triton_mm_device(torch.empty(1, device=DEVICE)):
        pytest.skip("the Triton grouped matmuls do not serve this device")
    from deltafuse.ops.moe import kernel_mm

    calls, maps = [], []
    real_mm, real_map = kernel_mm.grouped_mm_triton, kernel_mm.tile_map
    monkeypatch.setattr(kernel_mm, "grouped_mm_triton",
                        lambda a, w, offs, rows=None, *rest: calls.append(rows is not None) or real_mm(a, w, offs, rows,
                                                                                                     *rest))
    monkeypatch.setattr(kernel_mm, "tile_map", lambda *a: maps.append(1) or real_map(*a))
    x, idx, w, gu, dn = _inputs(11, 16, 8, 4, 2, seed=5)
    gu.requires_grad_(not frozen)
    dn.requires_grad_(not frozen)
    out = kernel.moe_experts_triton(x, idx, w, gu, dn)
    out.backward(torch.randn_like(out))
    assert calls == [True, False, frozen, False] and maps == [1]


# --- selection and argument checks -------------------------------------------------------------------------
def test_candidate_rules():
    reg = Registry()
    moe_backends.register(reg)
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        rows = {d.candidate: d for d in reg.explain(OP, CallInfo(torch.device("cpu"), dt, True))}
        assert rows["torch"].chosen and not rows["triton"].chosen and rows["triton"].reason


def _ids_out_of_range(idx):
    """The routing with one id below the range and one above it (the drawn ids alone need not reach 0 or E - 1)."""
    idx = idx.clone()
    idx[0, 0], idx[1, 1] = -1, 6
    return idx


@pytest.mark.parametrize("call,match", [
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu, dn, act="gelu"), r"act must be one of 'silu'.*got 'gelu'"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu[:, :7], dn), r"gate_up_proj must be \[E, 2I, H\].*got \(4, 7, 8\)"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu, dn[:, :, :3]),
     r"down_proj must be \[E, H, I\] = \(4, 8, 4\).*\(4, 8, 3\)"),
    (lambda x, i, w, gu, dn: _api()(x, i, w, gu.double(), dn), r"gate_up_proj has dtype torch.float64 but hidden"),
    (lambda x, i, w, gu, dn: _api()(x, i.float(), w, gu, dn), r"top_k_index has dtype float32; allowed: int64"),
    (lambda x, i, w, gu, dn: _api()(x, i[:2], w, gu, dn), r"top_k_index must be \[N, k\] = \[5, k\].*got \(2, 2\)"),
    (lambda x, i, w, gu, dn: _api()(x, i, w[:, :1], gu, dn), r"top_k_weights must have top_k_index's shape \(5, 2\)"),
    (lambda x, i, w, gu, dn: _api()(x, _ids_out_of_range(i), w, gu, dn),
     r"expert ids in \[0, 4\), got values in \[-1, 6\]"),
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
    res = {impl: _run_experts(mod, impl, x, idx, w, torch.ones_like) for impl in ("grouped_mm", registered)}
    for a, b, name in zip(res[registered], res["grouped_mm"], ("out", "dx", "dw", "dgate_up", "ddown")):
        assert rel_rms(a, b) < 2e-2, f"{name}: {rel_rms(a, b):.2e}"
    assert torch.equal(res[registered][3][200:], torch.zeros_like(res[registered][3][200:]))


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_float64(dtype, impl):
    tol = 1e-3 if dtype == torch.float32 else 2e-2  # fp32 on GPU may use TF32 in grouped kernels
    fn = reference.moe_experts_torch if impl == "torch" else _kernel().moe_experts_triton
    _check(fn, *_inputs(64, 64, 32, 16, 4, dtype=dtype, device="cuda", seed=13, used=12), tol)


@gpu
@needs_cuda
def test_gpu_triton_sums_equal_the_reference_at_qwen35_sizes():
    """bf16 at Qwen3.5-35B-A3B sizes (4,096 tokens, 256 experts, top-8): the Triton per-token sums give the
    reference's output and gradients (both fp32 accumulators rounded once; only the summation order can
    differ), and the automatic choice on CUDA is the Triton one."""
    from deltafuse import backends

    x, idx, w, gu, dn = _inputs(4096, 2048, 512, 256, 8, dtype=torch.bfloat16, device="cuda", seed=21)
    dy = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    res = {}
    for name, fn in (("torch", reference.moe_experts_torch), ("triton", _kernel().moe_experts_triton)):
        out = fn(x, idx, w, gu, dn)
        res[name] = (out, *torch.autograd.grad(out, (x, w, gu, dn), dy))
    for a, b, name in zip(res["triton"], res["torch"], ("out", "dx", "dw", "dgate_up", "ddown")):
        assert rel_rms(a, b) < 1e-3, f"{name}: {rel_rms(a, b):.2e}"
    rows = {d.candidate: d for d in backends.REGISTRY.explain(OP, backends.call_info(x, w, gu, dn))}
    assert rows["triton"].chosen, rows


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


# --- Ascend NPU route with a stand-in torch_npu (npu_grouped_matmul) ---------------------------------------
import types  # noqa: E402

from tests.helpers import npu_device, npu_registry  # noqa: E402


def _fake_torch_npu(calls, with_gmm=True):
    """torch_npu stand-in: npu_grouped_matmul with the documented semantics for one x, one weight and one
    output, as plain torch loops over the groups; every call is recorded. What the hardware writes for an
    empty group under group_type=2 is not documented: the stand-in writes NaN there, so the route must zero
    those experts itself."""
    mod = types.ModuleType("torch_npu")

    def npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=-1,
                           group_list_type=0, **extra):
        calls.append(dict(x=list(x), weight=list(weight), bias=bias, group_list=group_list, split_item=split_item,
                          group_type=group_type, group_list_type=group_list_type, extra=extra))
        if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or bias is not None or extra:
            raise NotImplementedError("stand-in: one x, one weight, one output, no bias or quantisation")
        if group_list_type != 0 or not isinstance(group_list, torch.Tensor) or group_list.dim() != 1:
            raise NotImplementedError("stand-in: group_list is a 1-D tensor of cumulative group ends")
        ends = group_list.tolist()
        assert all(b >= a for a, b in zip([0] + ends, ends)), "group_list must be non-decreasing"
        a, w = x[0], weight[0]
        if group_type == 0:  # split the M axis: rows of a by group, each times w[e]
            assert a.dim() == 2 and w.dim() == 3 and w.shape[0] == len(ends) and w.shape[1] == a.shape[1]
            assert ends[-1] == a.shape[0]
            out = a.new_empty(a.shape[0], w.shape[2])
            start = 0
            for e, end in enumerate(ends):
                out[start:end] = a[start:end] @ w[e]
                start = end
            return [out]
        if group_type == 2:  # split the K axis: columns of a and rows of w by group, one [M, N] per group
            assert a.dim() == 2 and w.dim() == 2 and ends[-1] == a.shape[1] == w.shape[0]
            out = torch.full((len(ends), a.shape[0], w.shape[1]), float("nan"), dtype=a.dtype)
            start = 0
            for e, end in enumerate(ends):
                if end > start:
                    out[e] = a[:, start:end] @ w[start:end]
                start = end
            return [out]
        raise NotImplementedError(f"stand-in: group_type {group_type}")

    if with_gmm:
        mod.npu_grouped_matmul = npu_grouped_matmul
    return mod


def _npu_impl(monkeypatch, calls):
    reg = npu_registry(monkeypatch, _fake_torch_npu(calls), moe_backends.register)
    return reg.select(OP, CallInfo(npu_device(), torch.bfloat16, True))


def test_npu_route_selection(monkeypatch):
    from deltafuse import backends

    assert [c.name for c in backends.REGISTRY.candidates(OP)] == ["triton", "npu", "torch"]
    reg = npu_registry(monkeypatch, _fake_torch_npu([]), moe_backends.register)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        rows = {d.candidate: d for d in reg.explain(OP, CallInfo(npu_device(), dt, True))}
        assert rows["npu"].chosen and rows["npu"].verified is False and not rows["torch"].chosen
        assert "CUDA" in rows["triton"].reason
    # torch_npu's kernels take fp16/bf16/fp32 only; fp64 on npu falls back to torch
    rows = {d.candidate: d for d in reg.explain(OP, CallInfo(npu_device(), torch.float64, True))}
    assert rows["torch"].chosen and "fp16, bf16, fp32" in rows["npu"].reason
    # never on other devices
    rows = {d.candidate: d for d in reg.explain(OP, CallInfo(torch.device("cpu"), torch.float32, True))}
    assert rows["torch"].chosen and "npu device" in rows["npu"].reason
    assert "npu_grouped_matmul" in next(c for c in reg.candidates(OP) if c.name == "npu").note


def test_npu_route_unavailable_without_torch_npu_or_grouped_matmul(monkeypatch):
    npu = CallInfo(npu_device(), torch.bfloat16, True)
    reg = npu_registry(monkeypatch, None, moe_backends.register)  # import torch_npu raises ImportError
    rows = {d.candidate: d for d in reg.explain(OP, npu)}
    assert rows["torch"].chosen and "torch_npu does not import" in rows["npu"].reason
    reg = npu_registry(monkeypatch, _fake_torch_npu([], with_gmm=False), moe_backends.register)
    rows = {d.candidate: d for d in reg.explain(OP, npu)}
    assert rows["torch"].chosen and "torch_npu has no npu_grouped_matmul" in rows["npu"].reason


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 5e-6)])
@pytest.mark.parametrize("shape", [(9, 16, 8, 7, 2, 4), (13, 24, 12, 8, 4, 6), (5, 8, 4, 3, 1, 2)])
def test_npu_route_matches_torch_and_float64_with_stand_in(monkeypatch, dtype, tol, shape):
    """The npu route (stand-in kernel, CPU tensors): output and the gradients of hidden, routing weights,
    gate_up_proj and down_proj equal the torch route and the float64 oracle; experts >= used get no token and
    exact zero weight gradients (the stand-in writes NaN there)."""
    N, H, I, E, k, used = shape
    impl = _npu_impl(monkeypatch, calls := [])
    assert impl.__name__ == "moe_experts_npu"
    x, idx, w, gu, dn = _inputs(N, H, I, E, k, dtype=dtype, device="cpu", seed=sum(shape) + 20, used=used)
    assert torch.bincount(idx.flatten(), minlength=E)[used:].sum() == 0
    got = _check(impl, x, idx, w, gu, dn, tol)
    assert calls, "the stand-in npu_grouped_matmul was not called"
    for g in got[2:]:
        assert torch.equal(g[used:], torch.zeros_like(g[used:])) and g[:used].abs().max() > 0
    # the torch route on the same inputs and the same output gradient
    out_n = impl(x, idx, w, gu, dn)
    out_t = reference.moe_experts_torch(x, idx, w, gu, dn)
    dy = torch.randn_like(out_t)
    grads_n = torch.autograd.grad(out_n, (x, w, gu, dn), dy)
    grads_t = torch.autograd.grad(out_t, (x, w, gu, dn), dy)
    assert_rel_close(out_n, out_t, tol, "out vs torch")
    for name, a, b in zip(("hidden", "weights", "gate_up", "down"), grads_n, grads_t):
        assert_rel_close(a, b, tol, f"d{name} vs torch")


def test_npu_route_argument_mapping(monkeypatch):
    """Forward and data-gradient matmuls: group_type=0 with the 3-D weight (the parameter itself or a
    transposed view of it, no copy); weight gradients: group_type=2 with x = [a^T]; always split_item=3,
    group_list_type=0 and an int64 group_list of cumulative group ends."""
    impl = _npu_impl(monkeypatch, calls := [])
    N, H, I, E, k = 10, 16, 8, 6, 2
    x, idx, w, gu, dn = _inputs(N, H, I, E, k, device="cpu", seed=30, used=4)
    ends = torch.cumsum(torch.bincount(idx.flatten(), minlength=E), 0)
    with torch.no_grad():
        impl(x, idx, w, gu, dn)
    assert [c["group_type"] for c in calls] == [0, 0]  # inference: gate_up and down, nothing else
    calls.clear()
    out = impl(x, idx, w, gu, dn)
    fwd = list(calls)
    out.backward(torch.randn_like(out))
    bwd = calls[len(fwd):]
    assert [c["group_type"] for c in fwd] == [0, 0]
    assert sorted(c["group_type"] for c in bwd) == [0, 0, 2, 2]
    S = N * k
    for c in calls:
        assert c["split_item"] == 3 and c["group_list_type"] == 0 and c["bias"] is None and not c["extra"]
        assert c["group_list"].dtype == torch.int64 and torch.equal(c["group_list"], ends)
        assert len(c["x"]) == 1 and len(c["weight"]) == 1
    # forward: x [S, H] @ gate_up^T view, then [S, I] @ down^T view; both views of the parameters
    (x0,), (w0,) = fwd[0]["x"], fwd[0]["weight"]
    assert x0.shape == (S, H) and w0.shape == (E, H, 2 * I) and w0.data_ptr() == gu.data_ptr()
    (x1,), (w1,) = fwd[1]["x"], fwd[1]["weight"]
    assert x1.shape == (S, I) and w1.shape == (E, I, H) and w1.data_ptr() == dn.data_ptr()
    # backward data gradients: dout rows @ down [E, H, I], dgate_up @ gate_up [E, 2I, H]
    mm_shapes = sorted((tuple(c["x"][0].shape), tuple(c["weight"][0].shape)) for c in bwd if c["group_type"] == 0)
    assert mm_shapes == sorted([((S, H), (E, H, I)), ((S, 2 * I), (E, 2 * I, H))])
    # weight gradients: x = [a^T] with a [S, P] (split along its columns), weight = [b [S, Q]] -> [E, P, Q]
    wg_shapes = sorted((tuple(c["x"][0].shape), tuple(c["weight"][0].shape)) for c in bwd if c["group_type"] == 2)
    assert wg_shapes == sorted([((H, S), (S, I)), ((2 * I, S), (S, H))])
    # no tokens: zeros, no kernel call
    calls.clear()
    x0, idx0, w0_, gu0, dn0 = _inputs(0, H, I, E, k, device="cpu")
    out0 = impl(x0, idx0, w0_, gu0, dn0)
    assert out0.shape == (0, H) and not calls


@gpu
@needs_cuda
@pytest.mark.parametrize("gather", [True, False])
def test_gpu_grouped_mm_at_qwen35_sizes_is_as_close_to_float64_as_torchs(gather):
    """bf16 at Qwen3.5-35B-A3B sizes (4,096 tokens, 256 experts, top-8; skewed: some experts with several row
    tiles, some with none): each of the experts' four matmul shapes; every element against torch's grouped kernel
    (the same fp32 sums rounded once: equal in the benchmark, here within one bf16 rounding), and three experts'
    rows (the two largest and the smallest) against float64, no farther than torch's (relative RMS about 1.7e-3
    each, within 2.5e-3, and ours at most 1.1x torch's)."""
    kernel_mm = _mm_kernel()
    gen = input_gen(17 + gather)
    E, n, k, H, I = 256, 4096, 8, 2048, 512
    pop = (1.0 / (torch.arange(E, dtype=torch.float64) + 8.0))[torch.randperm(E, generator=gen)]
    pop[5] = 0.0  # expert 5 gets no row
    # Gumbel top-k: k distinct experts per token, drawn with probability ~ popularity
    idx = (pop.log() - torch.log(-torch.log(torch.rand(n, E, generator=gen, dtype=torch.float64)))).topk(k).indices
    plan = reference._Plan(idx.cuda(), E)
    counts = torch.diff(plan.offs, prepend=plan.offs.new_zeros(1)).cpu()
    assert counts[5] == 0 and counts.max() > 2 * 128
    ends = plan.offs.tolist()
    # the forward's transposed weight views (K contiguous), then the data gradients' plain weights (M contiguous)
    for K, M, k_contiguous in ((H, 2 * I, True), (I, H, True), (H, I, False), (2 * I, H, False)):
        src = torch.randn(n if gather else plan.token.numel(), K, generator=gen).cuda().bfloat16()
        w = torch.randn(E, M, K, generator=gen).transpose(1, 2) if k_contiguous else torch.randn(E, K, M, generator=gen)
        w = (w / K ** 0.5).cuda().bfloat16()
        rows = plan.token if gather else None
        got = kernel_mm.grouped_mm_triton(src, w, plan.offs, rows)
        a = src[rows] if gather else src
        theirs = reference._grouped_call(a, w, plan.offs)
        assert rel_rms(got, theirs) < 1e-3, (K, M)
        # one bf16 rounding apart, with room for fp32 sums taken in another order where they cancel
        bound = 2 ** -7 * theirs.float().abs() + 1e-4 * theirs.float().abs().max()
        assert ((got.float() - theirs.float()).abs() <= bound).all(), (K, M)
        for e in [int(c) for c in counts.topk(2).indices] + [int(counts[counts > 0].argmin())]:
            lo, hi = (ends[e - 1] if e else 0), ends[e]
            want = a[lo:hi].double() @ w[e].double()
            ours, torch_err = rel_rms(got[lo:hi], want), rel_rms(theirs[lo:hi], want)
            assert ours < 2.5e-3 and ours <= 1.1 * torch_err, (K, M, e, ours, torch_err)
            assert (got[lo:hi].double() - want).abs().max() <= 2 ** -7 * want.abs().max(), (K, M, e)
