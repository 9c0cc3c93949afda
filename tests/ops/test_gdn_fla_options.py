"""FLA's extra GDN options, with FLA's semantics, against the float64 step-by-step oracle: the gate computed from
raw inputs (``use_gate_in_kernel=True`` with ``A_log`` / ``dt_bias``: g = -exp(A_log) * softplus(g + dt_bias)),
beta from logits (``use_beta_sigmoid_in_kernel=True``), and v in another dtype than q/k. Outputs, final states and
the gradients of every input (A_log and dt_bias included), on every backend that serves the call here."""

from __future__ import annotations

import pytest
import torch

from deltafuse import ops
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule
from tests.helpers import assert_rel_close, gpu, input_gen, needs_cuda

B, T, H, G, K, V = 2, 37, 2, 2, 16, 8
HV = H * G
OPS = {"chunk": ops.chunk_gated_delta_rule, "recurrent": ops.fused_recurrent_gated_delta_rule}


def _inputs(seed):
    gen = input_gen(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V), a=rnd(B, T, HV), b=rnd(B, T, HV),
                A_log=torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) * 15 + 0.5),
                dt_bias=rnd(HV), h0=rnd(B, HV, K, V, scale=0.3))


def _oracle(x, with_bias):
    """float64: the gate and beta computed by their formulas, then the step-by-step recurrence."""
    a = x["a"] + (x["dt_bias"] if with_bias else 0)
    g = -x["A_log"].exp() * torch.nn.functional.softplus(a)
    beta = x["b"].sigmoid()
    return naive_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, initial_state=x["h0"], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)


def _grads(out, final, leaves, do, dh):
    (out.double() * do).sum().backward(retain_graph=False) if final is None else \
        ((out.double() * do).sum() + (final.double() * dh).sum()).backward()
    return {n: t.grad for n, t in leaves.items()}


CASES = [("chunk", "torch"), ("chunk", "triton"), ("recurrent", "torch"), ("recurrent", "triton")]


@pytest.mark.parametrize("with_bias", [True, False], ids=["dt_bias", "no_dt_bias"])
@pytest.mark.parametrize("name,backend", CASES)
def test_gate_and_beta_in_kernel_match_the_oracle(name, backend, with_bias):
    x = _inputs(seed=hash((name, backend, with_bias)) % 1000)
    do, dh = torch.randn(B, T, HV, V, dtype=torch.float64), torch.randn(B, HV, K, V, dtype=torch.float64)
    ref_leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rf = _oracle(ref_leaves, with_bias)
    ref = _grads(ro, rf, ref_leaves, do, dh)
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    o, final = OPS[name](leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                         initial_state=leaves["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=leaves["A_log"],
                         dt_bias=leaves["dt_bias"] if with_bias else None, use_beta_sigmoid_in_kernel=True,
                         backend=backend)
    got = _grads(o, final, leaves, do, dh)
    assert_rel_close(o, ro, 2e-5, "o")
    assert_rel_close(final, rf, 2e-5, "final state")
    for n in ("q", "k", "v", "b", "h0"):
        assert_rel_close(got[n], ref[n], 5e-5, f"d{n}")
    # da = dg * dg/da, with dg/da = -exp(A_log) sigmoid(a + dt_bias) known exactly. The Triton kernels' dg is accurate
    # against the whole tensor's scale, and the factor reweights its elements: their
    # da is checked as dg = da / (dg/da), every element, against the oracle's dg (measured on 280 draws: dg <= 2.7e-5,
    # da itself up to 7e-5, and 1.4e-4 once in CI); the torch reference's da directly
    dgda = -x["A_log"].exp() * torch.sigmoid(x["a"] + (x["dt_bias"] if with_bias else 0))
    if backend == "torch":
        assert_rel_close(got["a"], ref["a"], 5e-5, "da")
    else:
        assert_rel_close(got["a"].double() / dgda, ref["a"] / dgda, 5e-5, "dg (da over dg/da)")
    # dA_log and d dt_bias are sums over every token of terms that cancel (dg * g, and dg * sigmoid): their error
    # is bounded against the size of those terms, what an fp32 sum of them can resolve; per head for the torch
    # reference, against the largest head for the Triton kernels, whose dg is accurate against the whole tensor's
    # scale (rel_rms over all heads, as their own tests bound it), not each head's
    gate = -ref_leaves["A_log"].detach().exp() * torch.nn.functional.softplus(
        x["a"] + (x["dt_bias"] if with_bias else 0))
    dg = ref["a"] / (-ref_leaves["A_log"].detach().exp() * torch.sigmoid(x["a"] + (x["dt_bias"] if with_bias else 0)))
    terms = {"A_log": (dg * gate).abs().sum((0, 1)), "dt_bias": ref["a"].abs().sum((0, 1))}
    for n in ("A_log",) + (("dt_bias",) if with_bias else ()):
        err = (got[n].double() - ref[n]).abs()
        # measured: torch <= 3e-7 of each head's terms; Triton (interpreted fp32, decays down to -15 per token)
        # up to 2e-4 of the largest head's
        scale = 5e-5 * terms[n] if backend == "torch" else 1e-3 * terms[n].max()
        assert bool((err <= scale).all()), (n, err.tolist(), terms[n].tolist())
    if not with_bias:
        assert got["dt_bias"] is None


@pytest.mark.parametrize("gate,beta_sigmoid", [(True, False), (False, True), (True, True)],
                         ids=["gate", "beta_sigmoid", "both"])
@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("backward", ["per_value_head", "group_loop", "from_t"])
def test_triton_chunk_computes_the_options_in_its_kernels(monkeypatch, gate, beta_sigmoid, packed, backward):
    """The Triton chunk kernels take FLA's options themselves (the op hands them the raw inputs: the torch formulas
    never run) over several chunks per sequence, packed sequences (one of a single token) and an initial state,
    with raw gates from -30 to 30 (softplus past its x > 20 branch and deep in its tail): o, the final state and
    every gradient against the float64 oracle; with the backward's programs per value head (the default), per
    q/k head (ChunkOptions.bwd_group_loop, with wy_recompute_t), and with the reverse pass reading T and beta
    instead of w (ChunkOptions.sbwd_from_t)."""
    from deltafuse.ops.gated_delta import api
    from deltafuse.ops.gated_delta import kernel as chunk_mod

    def no_torch_gates(*args):
        raise AssertionError("the gate options were computed in torch, not in the Triton kernels")

    monkeypatch.setattr(api, "in_torch", no_torch_gates)
    gen = input_gen()
    Bx, Tx = (1, 200) if packed else (2, 150)
    cu = torch.tensor([0, 70, 71, 200]) if packed else None
    N = 3 if packed else Bx
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen, dtype=torch.float64) * scale  # noqa: E731
    x = dict(q=rnd(Bx, Tx, H, K), k=rnd(Bx, Tx, H, K), v=rnd(Bx, Tx, HV, V), h0=rnd(N, HV, K, V, scale=0.3),
             A_log=torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) + 0.05), dt_bias=rnd(HV))
    x["a"] = rnd(Bx, Tx, HV, scale=3.0) if gate else -torch.rand(Bx, Tx, HV, generator=gen, dtype=torch.float64)
    if gate:  # every 17th token's raw gates spread over [-30, 30]
        x["a"][0, ::17] = torch.linspace(-30, 30, x["a"][0, ::17].numel(), dtype=torch.float64).view(-1, HV)
    x["b"] = rnd(Bx, Tx, HV, scale=2.0) if beta_sigmoid else torch.rand(Bx, Tx, HV, generator=gen,
                                                                        dtype=torch.float64) + 0.01
    do, dh = rnd(Bx, Tx, HV, V), rnd(N, HV, K, V)
    ref_leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    g = ref_leaves["a"]
    if gate:
        g = -ref_leaves["A_log"].exp() * torch.nn.functional.softplus(g + ref_leaves["dt_bias"])
    beta = ref_leaves["b"].sigmoid() if beta_sigmoid else ref_leaves["b"]
    ro, rf = naive_gated_delta_rule(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], g, beta,
                                    initial_state=ref_leaves["h0"], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ref = _grads(ro, rf, ref_leaves, do, dh)
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    extra = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"]) if gate else {}
    options = {"per_value_head": None, "group_loop": chunk_mod.ChunkOptions(bwd_group_loop=True, wy_recompute_t=True),
               "from_t": chunk_mod.ChunkOptions(sbwd_from_t=True)}[backward]
    with chunk_mod.configured(options):
        o, final = ops.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                                              initial_state=leaves["h0"], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, cu_seqlens=cu, use_gate_in_kernel=gate,
                                              use_beta_sigmoid_in_kernel=beta_sigmoid, backend="triton", **extra)
        got = _grads(o, final, leaves, do, dh)
    assert_rel_close(o, ro, 2e-5, "o")
    assert_rel_close(final, rf, 2e-5, "final state")
    for n in ("q", "k", "v", "a", "b", "h0"):
        assert_rel_close(got[n], ref[n], 5e-5, f"d{n}")
    if gate:
        for n in ("A_log", "dt_bias"):
            assert_rel_close(got[n], ref[n], 1e-4, f"d{n}")
    else:
        assert got["A_log"] is None and got["dt_bias"] is None


@pytest.mark.parametrize("with_bias", [True, False], ids=["dt_bias", "no_dt_bias"])
def test_triton_recurrent_computes_the_options_in_its_kernel(monkeypatch, with_bias):
    """Decoding (no gradients): the public recurrent op hands the Triton kernel the raw gate and beta logits (the
    torch formulas never run); o and the final state against the float64 oracle."""
    from deltafuse.ops.gated_delta import api

    def no_torch_gates(*args):
        raise AssertionError("the gate options were computed in torch, not in the Triton kernel")

    monkeypatch.setattr(api, "in_torch", no_torch_gates)
    x = _inputs(seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    ro, rf = _oracle(x, with_bias)
    f = {n: t.float() for n, t in x.items()}
    with torch.no_grad():
        o, final = ops.fused_recurrent_gated_delta_rule(
            f["q"], f["k"], f["v"], f["a"], f["b"], initial_state=f["h0"], output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=f["A_log"],
            dt_bias=f["dt_bias"] if with_bias else None, use_beta_sigmoid_in_kernel=True, backend="triton")
    assert_rel_close(o, ro, 2e-5, "o")
    assert_rel_close(final, rf, 2e-5, "final state")


@pytest.mark.parametrize("name,backend", [("chunk", "torch"), ("chunk", "triton"), ("recurrent", "torch")])
def test_v_in_another_dtype_than_q_and_k(name, backend):
    """fp32 q/k with fp16 v (FLA accepts it): computed in fp32, o in q's dtype, equal to the all-fp32 call on the
    same (fp16-representable) values."""
    x = _inputs(seed=7)
    v16 = x["v"].half()
    g = -x["A_log"].exp() * torch.nn.functional.softplus(x["a"])
    args = (x["q"].float(), x["k"].float())
    o, final = OPS[name](*args, v16, g.float(), x["b"].sigmoid().float(), initial_state=x["h0"].float(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
    want, want_final = naive_gated_delta_rule(x["q"], x["k"], v16.double(), g, x["b"].sigmoid(),
                                              initial_state=x["h0"], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.float32
    assert_rel_close(o, want, 2e-5, "o")
    assert_rel_close(final, want_final, 2e-5, "final state")


@pytest.mark.parametrize("op", list(OPS.values()))
@pytest.mark.parametrize("kwargs,match", [
    (dict(use_gate_in_kernel=True), r"A_log"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), r"A_log must be \[HV\] = \(4,\), got \(3,\)"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4, 1)), r"dt_bias must have 1 dim"),
    (dict(A_log=torch.zeros(4)), r"A_log / dt_bias are read only with use_gate_in_kernel=True"),
    (dict(dt_bias=torch.zeros(4)), r"A_log / dt_bias are read only with use_gate_in_kernel=True"),
])
def test_gate_options_refuse_what_they_cannot_read(op, kwargs, match):
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        op(q, q, torch.randn(1, 5, 4, 8), torch.randn(1, 5, 4), torch.rand(1, 5, 4), **kwargs)


def test_q_and_k_must_share_a_dtype():
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"q and k must share a dtype, got torch.float32 and torch.float64"):
        ops.chunk_gated_delta_rule(q, q.double(), torch.randn(1, 5, 4, 8), torch.randn(1, 5, 4), torch.rand(1, 5, 4))


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["chunk", "recurrent", "recurrent_train"])
def test_gate_and_beta_in_kernel_bf16_gpu(name):
    """bf16 at a Qwen3.5 layer's heads on the GPU, against the float64 oracle, with the 16-bit GDN bounds; the
    recurrent op for decoding (no gradients) and for training (its Triton candidate then runs the chunked
    kernels)."""
    Bg, Tg, Hg, HVg, D = 2, 300, 4, 8, 128
    gen = input_gen(11)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=gen, dtype=torch.float64) * scale  # noqa: E731
    x = dict(q=rnd(Bg, Tg, Hg, D), k=rnd(Bg, Tg, Hg, D), v=rnd(Bg, Tg, HVg, D), a=rnd(Bg, Tg, HVg), b=rnd(Bg, Tg, HVg),
             A_log=torch.log(torch.rand(HVg, generator=gen, dtype=torch.float64) * 15 + 0.5), dt_bias=rnd(HVg),
             h0=rnd(Bg, HVg, D, D, scale=0.3))
    low = ("q", "k", "v", "a", "b")
    for n in low:  # the oracle sees the bf16 values the op gets: the bound is on the op, not on input rounding
        x[n] = x[n].to(torch.bfloat16).double()
    do, dh = rnd(Bg, Tg, HVg, D), rnd(Bg, HVg, D, D)
    ref_leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rf = _oracle(ref_leaves, True)
    ref = _grads(ro, rf, ref_leaves, do, dh)
    leaves = {n: (t.to("cuda", torch.bfloat16) if n in low else t.float().cuda()).requires_grad_() for n, t in x.items()}
    with torch.set_grad_enabled(name != "recurrent"):
        o, final = OPS[name.replace("_train", "")](leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                             initial_state=leaves["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                             use_beta_sigmoid_in_kernel=True)
    assert_rel_close(o.cpu(), ro, 3e-3, "o")
    assert_rel_close(final.cpu(), rf, 3e-3, "final state")
    if name == "recurrent":
        return  # decoding: the recurrent op is run without gradients here
    got = _grads(o, final, leaves, do.cuda(), dh.cuda())
    # gates up to -15 * softplus per token make the key gradients heavy-tailed (a few elements far above their
    # rms): the element bound is 100x the rms bound here (measured: dk's largest error 1.2e-2 at rms 5.2e-2),
    # still far below what an unwritten or wrong element gives
    for n in ("q", "k", "v", "a", "b", "h0"):
        assert_rel_close(got[n].cpu(), ref[n], 5e-3, f"d{n}", peak=100.0)
    for n in ("A_log", "dt_bias"):
        assert_rel_close(got[n].cpu(), ref[n], 1e-2, f"d{n}")
