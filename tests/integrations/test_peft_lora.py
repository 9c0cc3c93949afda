"""PEFT's LoRA Linear served by deltafuse's forward: bit-identical to PEFT's own forward (output, input gradient,
every adapter gradient) under autocast and without it, for power-of-two and other scalings, several adapters,
and the refused cases; the fp32 round trip of the input and the full-width scaling are gone (CPU profiler)."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from deltafuse.integrations.peft import lora_plan, wrap_lora_linear_forward  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402
from tests.helpers import Float64Everywhere, float64_copy, input_gen, input_seed, rel_rms  # noqa: E402

ORIGINAL = LoraLinear.forward
if hasattr(ORIGINAL, "__deltafuse_wraps__"):
    ORIGINAL = ORIGINAL.__deltafuse_wraps__
LEAN = wrap_lora_linear_forward(ORIGINAL)


def _layer(r=4, alpha=8, dropout=0.0, fin=24, fout=40, dtype=torch.bfloat16, adapters=("default",), seed=0):
    torch.manual_seed(input_seed(seed))
    base = torch.nn.Linear(fin, fout, bias=False).to(dtype)
    net = torch.nn.Sequential(base)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=["0"], init_lora_weights=False)
    model = peft.get_peft_model(net, cfg, adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, cfg)
    layer = model.base_model.model[0]
    if len(adapters) > 1:
        layer.set_adapter(list(adapters))
    return layer


def _run(forward, layer, x, amp_dtype):
    for p in layer.parameters():
        p.grad = None
    xl = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        out = forward(layer, xl)
    gen = input_gen(5)
    out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xl.grad, grads


def _assert_same(layer, x, amp_dtype):
    want = _run(ORIGINAL, layer, x, amp_dtype)
    got = _run(LEAN, layer, x, amp_dtype)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and len(got[2]) >= 2
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name


@pytest.mark.parametrize("alpha", [8, 4, 32, 2, 6])  # r=4: scaling 2, 1, 8 (folded), 0.5, 1.5 (stock order)
@pytest.mark.parametrize("amp", [torch.bfloat16, None])
def test_bit_identical_to_peft(alpha, amp):
    layer = _layer(alpha=alpha)
    x = torch.randn(3, 7, 24).to(torch.bfloat16) * 3
    assert lora_plan(layer, x, (), {}) is not None
    _assert_same(layer, x, amp)


def test_bit_identical_fp32_model_and_two_adapters():
    layer = _layer(dtype=torch.float32, adapters=("one", "two"))
    assert len(lora_plan(layer, torch.randn(2, 24), (), {})) == 2
    _assert_same(layer, torch.randn(5, 24), None)
    layer = _layer(adapters=("one", "two"), seed=1)
    _assert_same(layer, torch.randn(5, 24).to(torch.bfloat16), torch.bfloat16)


def test_refused_calls_run_peft():
    x = torch.randn(4, 24).to(torch.bfloat16)
    assert lora_plan(_layer(dropout=0.1), x, (), {}) is None
    layer = _layer()
    assert lora_plan(layer, x, (), {"adapter_names": ["default"] * 4}) is None
    layer.lora_A["default"].register_forward_hook(lambda *a: None)
    assert lora_plan(layer, x, (), {}) is None
    layer = _layer()
    layer.merge()
    assert lora_plan(layer, x, (), {}) is None


def _copies_and_wide_muls(forward, layer, x):
    from torch.profiler import ProfilerActivity, profile

    _run(forward, layer, x, torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _run(forward, layer, x, torch.bfloat16)
    T = x.shape[0]
    copies = [e for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
              and tuple(e.input_shapes[0]) == tuple(x.shape)]
    muls = [e for e in prof.events() if e.name == "aten::mul" and e.input_shapes
            and tuple(e.input_shapes[0]) == (T, layer.base_layer.out_features)]
    return len(copies), len(muls)


def test_no_input_round_trip_and_no_full_width_scaling():
    """PEFT under autocast: x copied to fp32 and back in the forward, both copies undone in the backward (4
    copies of the [T, in] input), and the [T, out] output and its gradient multiplied by the scaling; the lean
    forward: none of these (the scaling multiplies the [T, r] product)."""
    layer = _layer(alpha=8, fin=48, fout=80)
    x = torch.randn(16, 48).to(torch.bfloat16)
    assert _copies_and_wide_muls(ORIGINAL, layer, x) == (4, 2)
    assert _copies_and_wide_muls(LEAN, layer, x) == (0, 0)


def test_apply_routes_peft_linear_when_imported():
    import deltafuse

    deltafuse.apply()
    try:
        assert getattr(LoraLinear.forward, "__deltafuse_wraps__", None) is ORIGINAL
    finally:
        deltafuse.revert()
    assert LoraLinear.forward is ORIGINAL


# Draws of weights and tokens for the tiny-moe step. The per-gradient error ratios to stock's move together within a
# draw (one rounding path dominates the step), so a draw's median over its 26 gradients is one sample, not 26:
# measured over 80 fresh draws (transformers 5.9 and 5.25) it spans 0.30 - 1.80, log standard deviation 0.3, geometric
# mean 0.95, and 3 of the 80 exceed 1.5. The median over MOE_DRAWS draws is held to 1.5. Resampling the 80 draws, a
# healthy run fails it 6e-5 of the time, and a deltafuse whose gradients were all twice as far from float64 99 %.
MOE_DRAWS = 7
MOE_MEDIAN = 1.5


def test_tiny_moe_lora_step_under_autocast(monkeypatch):
    """tiny-moe, bf16 weights, LoRA as ``deltafuse train`` adds it (r=16, alpha=32), CPU autocast to bf16: with
    deltafuse applied, the loss and every LoRA gradient are bit-identical with and without the PEFT row, and
    about as close to a float64 run as stock transformers (the other rows' fused kernels round differently)."""
    medians = [_tiny_moe_lora_draw(monkeypatch, draw) for draw in range(MOE_DRAWS)]
    median = sorted(medians)[MOE_DRAWS // 2]
    assert median <= MOE_MEDIAN, (f"median over {MOE_DRAWS} draws of the median error ratio to stock's "
                                  f"{median:.2f} > {MOE_MEDIAN} (draws: {', '.join(f'{m:.2f}' for m in medians)})")


def _tiny_moe_lora_draw(monkeypatch, draw) -> float:
    """One draw of weights and tokens: asserts the bit-identity, the loss and every gradient's bound; returns the
    median over the LoRA gradients of deltafuse's error against float64 over stock's."""
    import deltafuse
    from deltafuse.models import build_model
    from deltafuse.train.setup import add_lora, lora_targets

    model = build_model("tiny-moe", dtype=torch.bfloat16, seed=input_seed("model", draw))
    model = add_lora(model, r=16, alpha=32, dropout=0.0, targets=lora_targets(model, None, False), experts=False)
    model.train()
    gen = input_gen("inputs", draw)
    with torch.no_grad():  # PEFT starts B at zero (A's gradients would be zero): random B, every gradient non-zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    oracle = float64_copy(model)

    def step(model=model, autocast=True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with Float64Everywhere():
        exact = step(oracle, autocast=False)
    stock = step()
    deltafuse.apply(model)
    try:
        assert getattr(LoraLinear.forward, "__deltafuse_wraps__", None) is ORIGINAL
        lean = step()
        monkeypatch.setattr(LoraLinear, "forward", ORIGINAL)
        peft_own = step()
    finally:
        monkeypatch.undo()
        deltafuse.revert()
    assert len(lean[1]) == len(stock[1]) > 0
    assert torch.equal(lean[0], peft_own[0])
    for name, g in peft_own[1].items():
        assert torch.equal(lean[1][name], g), name
    assert abs(float(lean[0]) - float(stock[0])) <= 2e-2 * abs(float(stock[0]))
    # against a float64 run of the same weights, as close as stock: the two runs' bf16 errors are heavy-tailed
    # per gradient (a fixed 5e-2 between them failed 2 draws of 10; over 80 draws the largest single ratio of
    # deltafuse's error to stock's was 2.7; with the GDN, fused or MoE rows off the spread was the same), so each
    # gradient is held to 5x stock's error plus three bf16 roundings
    eps = 2.0 ** -8
    bad, ratios = [], []
    for name, g in stock[1].items():
        assert g.float().norm() > 0, name
        mine, theirs = rel_rms(lean[1][name], exact[1][name]), rel_rms(g, exact[1][name])
        ratios.append(mine / theirs)
        if not mine <= 5 * theirs + 3 * eps:
            bad.append(f"{name}: {mine:.2e} from float64 (stock {theirs:.2e})")
    assert not bad, f"draw {draw}:\n" + "\n".join(bad)
    return sorted(ratios)[len(ratios) // 2]
