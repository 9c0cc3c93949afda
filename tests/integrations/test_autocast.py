"""Mixed precision: fp32 master weights under ``torch.autocast`` (what HF Trainer ``bf16=True``, accelerate's
``mixed_precision="bf16"`` and TRL do on an fp32 model).

Whole tiny models of the three families, patched vs stock under the same CPU autocast, are compared against
an fp32 run without autocast: the patched model's loss and every gradient must be as close to it as stock's
are (plus an absolute margin of bf16 rounding), and close to stock's. The ops are compared under autocast
with float64 oracles, with the same op on the inputs autocast would give, and with a backward called
inside the autocast region.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltafuse import ops, patching
from deltafuse.models import build_config, build_model
from deltafuse.ops.cross_entropy.naive import naive_linear_cross_entropy
from deltafuse.ops.moe.naive import naive_moe_experts
from deltafuse.ops.norm.naive import naive_rms_norm_gated, naive_rms_norm_zero_centered
from tests.helpers import INTERPRETED, gpu, input_gen, input_seed, needs_cuda
from tests.integrations import assert_grads_close, count_op_calls, grads

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

SMALL = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=97)
OPS = ("rms_norm_zero_centered", "rms_norm_gated", "apply_rotary_pos_emb", "swiglu", "fused_linear_cross_entropy",
       "moe_experts", "chunk_gated_delta_rule", "causal_conv1d_fn")


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (b is the reference)."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def _every_expert(name: str) -> dict:
    """Config overrides that send every token to every expert of a MoE family. The comparison below is one of
    continuous functions, and top-k routing is not continuous. The routers of these random tiny models are
    nearly uniform: the k-th and (k+1)-th probabilities of some token are 1e-5 to 1e-3 apart, while bf16
    rounding moves them by about 2.5e-4 (CPU, tiny-next). One token sent to another expert then changes that
    layer's expert gradients by ~20 %, for any implementation. With k equal to the number of experts, the
    routing weights stay a smooth function of the logits, and the experts still run through the dispatch."""
    config = build_config(name, **SMALL)
    experts = getattr(config, "num_experts", None)
    return {} if experts is None else {"num_experts_per_tok": experts}


def _step(model, kwargs, dtype):
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
        out = model(**kwargs)
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.fixture
def spy(monkeypatch):
    return count_op_calls(monkeypatch, OPS)


@pytest.mark.parametrize("name,dtype", [("tiny", torch.bfloat16), ("tiny-moe", torch.bfloat16),
                                        ("tiny-next", torch.bfloat16), ("tiny-moe", torch.float16)])
def test_fp32_weights_under_autocast_train_like_stock(name, dtype, spy):
    _autocast_vs_stock(name, dtype, spy, "cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("name,dtype", [("tiny", torch.bfloat16), ("tiny-moe", torch.bfloat16),
                                        ("tiny-next", torch.bfloat16), ("tiny", torch.float16)])
def test_gpu_fp32_weights_under_cuda_autocast_train_like_stock(name, dtype, spy):
    """The same on CUDA, where the Triton kernels serve (stock: transformers' torch code, no FLA). Stock's
    torch GDN upcasts its bf16 inputs to fp32; ours, like FLA, computes in the inputs' dtype with fp32
    accumulation, so the decay parameters' gradients (A_log, dt_bias) may differ from fp32 by up to the bf16
    tolerance `deltafuse verify` uses on CUDA (5e-2), not only by stock's own error."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("FLA is importable: stock transformers would route its GDN layers to FLA instead of its torch "
                    "code (and FLA 0.6 refuses its backward on Hopper with Triton < 3.7.1)")
    _autocast_vs_stock(name, dtype, spy, "cuda")


# Draws per case, each with fresh weights and tokens. The GDN gate's parameters (A_log, dt_bias and the
# projection a comes from) get gradients that sum cancelling terms over every token, so under 16-bit autocast their
# error against fp32 is heavy-tailed on both sides and swings with the draw. Measured on CPU over 40 draws per case
# (where both sides compute the GDN in fp32 from the same 16-bit projections): the ratio of deltafuse's error to
# stock's has a median of 0.82 - 0.96 per parameter and case, a log standard deviation of 0.9 (A_log, dt_bias) and
# 0.2 - 0.4 (in_proj_a), and reaches 18 in single draws, either side the larger. So these parameters are judged by
# the median ratio over the draws (at most GATE_MEDIAN; its standard error over DRAWS draws is about a quarter of
# log 2.5, so a typical run sits four of them below it), every other gradient in every draw. A GDN whose dg is
# 1 % (fp16) or 3 % (bf16) too large fails it.
DRAWS = 24
GATE = ("A_log", "dt_bias", "in_proj_a.weight")
GATE_MEDIAN = 2.5


def _autocast_vs_stock(name, dtype, spy, device):
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    floor = 5e-2 if device == "cuda" else 0.0  # the 16-bit GDN kernel's tolerance (see the CUDA test)
    gate: dict[str, list[float]] = {}
    for draw in range(DRAWS):
        for n, ratio in _one_draw(name, dtype, spy, device, draw, eps, floor).items():
            gate.setdefault(n, []).append(ratio)
    assert any(n.endswith("A_log") for n in gate) and all(len(r) == DRAWS for r in gate.values())
    medians = {n: sorted(r)[DRAWS // 2] for n, r in gate.items()}
    bad = {n: m for n, m in medians.items() if not m <= GATE_MEDIAN}
    assert not bad, (f"GDN gate gradients under autocast, median over {DRAWS} draws of deltafuse's error / "
                     f"max(stock's, {floor / GATE_MEDIAN}) over {GATE_MEDIAN}: "
                     + ", ".join(f"{n} {m:.2f}" for n, m in bad.items()))


def _one_draw(name, dtype, spy, device, draw, eps, floor) -> dict[str, float]:
    """One draw of weights and tokens: the loss and every gradient but the GDN gate's against fp32 and stock;
    returns, for the gate's parameters, deltafuse's error against fp32 over max(stock's, ``floor`` / GATE_MEDIAN):
    a median of these ratios at most GATE_MEDIAN is a median error at most max(GATE_MEDIAN x stock's, ``floor``)."""
    model = build_model(name, seed=input_seed("model", draw), device=device, **SMALL, **_every_expert(name)).train()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = torch.randint(0, 97, (2, 13), generator=input_gen("ids", draw)).to(device)
    labels = ids.clone()
    labels[0, :3] = -100
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    if hasattr(model.config, "num_experts"):
        kwargs["output_router_logits"] = True
    spy.update(dict.fromkeys(spy, 0))
    ref_loss, ref = _step(model, kwargs, None)  # fp32, no autocast
    stock_loss, stock = _step(model, kwargs, dtype)
    with patching.patched(model):
        loss, got = _step(model, kwargs, dtype)
        fp32_loss, fp32 = _step(model, kwargs, None)
    fired = {k: v for k, v in spy.items() if v}
    assert fired.get("fused_linear_cross_entropy") == 2 and fired.get("rms_norm_zero_centered")
    assert fired.get("swiglu") and fired.get("rms_norm_gated") and fired.get("apply_rotary_pos_emb")
    assert bool(fired.get("moe_experts")) == hasattr(model.config, "num_experts")
    # fp32 without autocast: deltafuse equals stock to fp32 rounding
    assert abs(fp32_loss.item() - ref_loss.item()) <= 2e-6 * abs(ref_loss.item())
    assert_grads_close(fp32, ref)
    # under autocast: as close to fp32 as stock is (plus a tenth of the 16-bit rounding, relative) and within a fifth
    # of it of stock's (CPU, 300 draws per case: deltafuse's loss error beyond stock's at most 0.013 eps, apart from
    # stock's at most 0.022 eps; one draw of another 960: 0.024 eps beyond stock's)
    ref_loss, stock_loss, loss = ref_loss.item(), stock_loss.item(), loss.item()
    assert abs(loss - ref_loss) <= abs(stock_loss - ref_loss) + 0.1 * eps * abs(ref_loss)
    assert abs(loss - stock_loss) <= 0.2 * eps * abs(stock_loss)
    assert got.keys() == ref.keys()
    bad, gate, names = [], {}, []
    for n, r in ref.items():
        assert (got[n] is None) == (r is None) == (stock[n] is None), n
        if r is None:
            continue
        assert got[n].dtype == torch.float32, n  # master weights get fp32 gradients
        mine = _norm_rel(got[n], r)  # asserts deltafuse's gradient is finite
        # stock overflowed (fp16 on transformers 5.9) where we did not: 8 roundings stand in for stock's error
        theirs = _norm_rel(stock[n], r) if torch.isfinite(stock[n]).all() else None
        if n.endswith(GATE):
            gate[n] = mine / max(8 * eps if theirs is None else theirs, floor / GATE_MEDIAN)
            continue
        if theirs is None:
            if not mine <= 8 * eps:
                bad.append(f"{n}: vs fp32 {mine:.2e} (stock not finite)")
            continue
        names.append(n)
        between = _norm_rel(got[n], stock[n])
        # as close to fp32 as stock (plus three 16-bit roundings), and no further from stock than stock's own
        # error allows (5.9's experts compute in bf16 under autocast: 0.18 from fp32)
        if not (mine <= max(1.5 * theirs + 3 * eps, floor) and between <= max(8 * eps, 1.5 * theirs, floor)):
            bad.append(f"{n}: vs fp32 {mine:.2e} (stock {theirs:.2e}), vs stock {between:.2e}")
    assert not bad, f"gradients under autocast (draw {draw}):\n" + "\n".join(bad)
    flat = {k: torch.cat([d[n].flatten() for n in names]) for k, d in (("got", got), ("stock", stock), ("ref", ref))}
    mine, theirs = _norm_rel(flat["got"], flat["ref"]), _norm_rel(flat["stock"], flat["ref"])
    assert mine <= max(1.5 * theirs + 3 * eps, floor), f"all other gradients: vs fp32 {mine:.2e} (stock {theirs:.2e})"
    return gate


# --- ops under autocast ------------------------------------------------------------------------------
def _rand(*shape, seed, scale=1.0):
    gen = input_gen(seed)
    return (torch.randn(*shape, generator=gen) * scale).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_loss_under_autocast_is_the_loss_of_the_autocast_inputs(dtype):
    """fp32 hidden / weight / bias under autocast: exactly the op on the inputs cast to the autocast dtype
    (what nn.Linear gets), fp32 loss and fp32 gradients; within the dtype's rounding of the float64 oracle.
    (CPU autocast: the Triton interpreter emulates fp32 only, so the torch backend.)"""
    backend = "torch"
    hidden, weight, bias = _rand(2, 7, 16, seed=1), _rand(37, 16, seed=2, scale=0.25), _rand(37, seed=3)
    labels = torch.randint(0, 37, (2, 7), generator=input_gen(4))
    labels[1, 3] = -100
    with torch.autocast("cpu", dtype=dtype):
        loss = ops.fused_linear_cross_entropy(hidden, weight, labels, bias=bias, backend=backend, chunk_size=4)
    assert loss.dtype == torch.float32
    loss.backward()
    leaves = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    want = ops.fused_linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], backend=backend,
                                          chunk_size=4)
    want.backward()
    assert loss.item() == want.item()
    for t, w in zip((hidden, weight, bias), leaves):
        assert t.grad.dtype == torch.float32 and torch.equal(t.grad, w.grad.float())
    oracle = naive_linear_cross_entropy(hidden.detach().double(), weight.detach().double(), labels,
                                        bias=bias.detach().double())
    assert abs(loss.item() - oracle.item()) <= 1e-2 * oracle.item()


def test_fused_loss_refuses_mixed_dtypes_without_autocast_and_keeps_float64_under_it():
    hidden, weight = _rand(1, 5, 8, seed=5), _rand(11, 8, seed=6)
    labels = torch.randint(0, 11, (1, 5), generator=input_gen(7))
    with pytest.raises(ValueError, match=r"fused_linear_cross_entropy: weight has dtype torch.bfloat16 but "
                                         r"hidden has torch.float32; they must match"):
        ops.fused_linear_cross_entropy(hidden, weight.detach().bfloat16(), labels)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(ValueError, match=r"weight has dtype torch.bfloat16 but hidden has torch.float64 "
                                            r"\(after autocast's cast to torch.bfloat16\)"):
        ops.fused_linear_cross_entropy(hidden.detach().double(), weight, labels)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves float64 alone, as for nn.Linear
        loss = ops.fused_linear_cross_entropy(h64, w64, labels)
    oracle = naive_linear_cross_entropy(h64.detach(), w64, labels)
    assert loss.dtype == torch.float64 and abs(loss.item() - oracle.item()) <= 1e-12 * oracle.item()


def _same_under_autocast(fn, inputs, oracle=None, tol=None, backward_inside=True):
    """fn(*inputs) under bf16 autocast, with backward outside (and inside) the region, equals fn without
    autocast (output and every input gradient, bit for bit); against the float64 oracle within tol."""
    def run(amp, inside):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = fn(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            gen = input_gen(99)
            cot = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
            if inside:
                torch.autograd.backward(outs, cot)
        if not inside:
            torch.autograd.backward(outs, cot)
        return [o.detach() for o in outs], [t.grad for t in leaves if t.requires_grad]

    ref_out, ref_grads = run(False, False)
    for inside in (False, True) if backward_inside else (False,):
        out, got = run(True, inside)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(out, ref_out))
        assert all(torch.equal(a, b) for a, b in zip(got, ref_grads))
    if oracle is not None:
        want = oracle(*[t.detach().double() for t in inputs])
        want = want if isinstance(want, tuple) else (want,)
        for o, w in zip(ref_out, want):
            assert _norm_rel(o, w) <= tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_elementwise_ops_ignore_autocast(backend):
    """Norms, RoPE, SwiGLU: stock computes them the same with or without autocast, so do the ops, on
    autocast's mixed inputs (bf16 activations, fp32 weights / cos / sin; fp32 activations for the Triton
    interpreter, which emulates fp32 only)."""
    act = torch.bfloat16
    if backend == "triton":
        pytest.importorskip("triton")
        act = torch.float32 if INTERPRETED else act
    x = _rand(3, 16, seed=10).detach().to(act).requires_grad_()
    w = _rand(16, seed=11, scale=0.1)
    _same_under_autocast(lambda a, b: ops.rms_norm_zero_centered(a, b, 1e-6, backend=backend), (x, w),
                         lambda a, b: naive_rms_norm_zero_centered(a, b, 1e-6), 1e-2)
    gate = _rand(3, 16, seed=12).detach().to(act).requires_grad_()
    _same_under_autocast(lambda a, g, b: ops.rms_norm_gated(a, g, b, 1e-6, backend=backend), (x, gate, w + 1),
                         lambda a, g, b: naive_rms_norm_gated(a, g, b, 1e-6), 1e-2)
    up = _rand(3, 16, seed=13).detach().to(act).requires_grad_()
    _same_under_autocast(lambda g, u: ops.swiglu(g, u, backend=backend), (gate, up),
                         lambda g, u: torch.nn.functional.silu(g) * u, 1e-2)
    q = _rand(1, 2, 5, 8, seed=14).detach().to(act).requires_grad_()
    k = _rand(1, 2, 5, 8, seed=15).detach().to(act).requires_grad_()
    ang = torch.rand(1, 5, 2, generator=input_gen(16)) * 3
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    _same_under_autocast(lambda a, b: ops.apply_rotary_pos_emb(a, b, cos, sin, backend=backend), (q, k))


def test_conv1d_and_experts_ignore_autocast():
    """The short convolution computes in its weight's dtype (as causal-conv1d does) and the experts in their
    inputs' dtype (as transformers' grouped_mm path does), autocast or not."""
    x = _rand(1, 8, 9, seed=20).detach().bfloat16().requires_grad_()
    w, b = _rand(8, 4, seed=21, scale=0.5), _rand(8, seed=22, scale=0.1)
    _same_under_autocast(lambda a, c, d: ops.causal_conv1d_fn(a, c, d, activation="silu", backend="torch"),
                         (x, w, b))
    n, h, inter, e, k = 6, 8, 4, 3, 2
    hidden = _rand(n, h, seed=23)
    index = torch.randint(0, e, (n, k), generator=input_gen(24))
    weights = _rand(n, k, seed=25).detach().softmax(-1).requires_grad_()
    gate_up, down = _rand(e, 2 * inter, h, seed=26, scale=0.3), _rand(e, h, inter, seed=27, scale=0.3)
    _same_under_autocast(lambda a, wt, g, d: ops.moe_experts(a, index, wt, g, d), (hidden, weights, gate_up, down),
                         lambda a, wt, g, d: naive_moe_experts(a, index, wt, g, d), 1e-6)


def test_gated_delta_rule_ignores_autocast():
    """The GDN layer's op under autocast computes what it computes without (the torch path's matmuls stay in
    fp32, as FLA's and deltafuse's kernels, which autocast cannot reach). Backward outside the region only:
    the torch path's backward is autograd's replay of its ops, which autocast reaches (as in stock)."""
    B, T, H, D = 1, 6, 2, 8
    q = _rand(B, T, H, D, seed=30).detach().bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(_rand(B, T, H, D, seed=31).detach(), dim=-1).bfloat16().requires_grad_()
    v = _rand(B, T, H, D, seed=32).detach().bfloat16().requires_grad_()
    g = (-torch.rand(B, T, H, generator=input_gen(33))).requires_grad_()
    beta = torch.rand(B, T, H, generator=input_gen(34)).bfloat16().requires_grad_()
    _same_under_autocast(lambda *a: ops.chunk_gated_delta_rule(*a, backend="torch")[0], (q, k, v, g, beta),
                         backward_inside=False)


def test_autocast_helpers():
    from deltafuse.ops import _amp

    assert _amp.autocast_dtype("cpu") is None and _amp.autocast_dtype("meta") is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert _amp.autocast_dtype("cpu") == torch.float16
        a, b, c, d = _amp.cast_as_linear(torch.float16, torch.ones(1), torch.ones(1, dtype=torch.float64), None,
                                         torch.ones(1, dtype=torch.int64))
        assert (a.dtype, b.dtype, c, d.dtype) == (torch.float16, torch.float64, None, torch.int64)
        with _amp.disabled("cpu"):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
