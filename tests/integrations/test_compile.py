"""torch.compile of a patched tiny model of every family, packed (position_ids restarting inside a row) and
not: no graph break comes from deltafuse's code, there are no more breaks than stock transformers has on the
same inputs, and the compiled loss and every gradient equal eager deltafuse's (fp32).

Also: the custom ops the packing route adds pass ``torch.library.opcheck``, and the compiled packed call
equals each sequence run alone (so the compiled path really separates the sequences)."""

from __future__ import annotations

import os

import pytest
import torch

import deltafuse
from deltafuse.integrations.transformers import adapters
from deltafuse.integrations.transformers import boundaries as bd
from deltafuse.integrations.transformers import packing as pk
from deltafuse.models import TINY_NAMES, build_model
from tests.helpers import input_gen, input_seed

OURS = os.path.dirname(deltafuse.__file__) + os.sep
T = 12


def _inputs(model, packed, seed):
    g = input_gen(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
    if not packed:
        return ids, None
    cut = int(torch.randint(3, T - 3, (1,), generator=g))
    return ids, torch.cat([torch.arange(cut), torch.arange(T - cut)])[None]


def _breaks(model, ids, pos):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, position_ids=pos)
    ours = [(r.reason.splitlines()[0], f"{f.filename}:{f.lineno}") for r in explained.break_reasons
            for f in r.user_stack if f.filename.startswith(OURS)]
    return explained.graph_break_count, ours


def _step(fn, model, ids, pos):
    model.zero_grad(set_to_none=True)
    loss = fn(input_ids=ids, labels=ids, position_ids=pos).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(got, want):
    loss, grads = got
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-6)
    assert grads.keys() == want[1].keys()
    for name in grads:
        assert grads[name].abs().max() > 0, name
        torch.testing.assert_close(grads[name], want[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
# the first family in every run; the others in the full run only (`-m "not slow"` skips them)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
                                  for i, n in enumerate(TINY_NAMES)])
def test_compiled_patched_model_breaks_no_graph_and_equals_eager(name, packed):
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(input_seed(seed))
    model = build_model(name, seed=seed)
    ids, pos = _inputs(model, packed, seed)
    stock_breaks, _ = _breaks(model, ids, pos)
    deltafuse.apply(model)
    try:
        breaks, ours = _breaks(model, ids, pos)
        assert not ours, ours
        assert breaks <= stock_breaks, (breaks, stock_breaks)
        torch._dynamo.reset()
        eager = _step(model, model, ids, pos)
        # inductor (its buffer reuse and generated code) for the first family; AOTAutograd without code
        # generation for the others, which checks the same traced graphs, fakes and custom-op autograd faster
        backend = "inductor" if name == TINY_NAMES[0] else "aot_eager"
        _assert_equal(_step(torch.compile(model, backend=backend), model, ids, pos), eager)
    finally:
        deltafuse.revert()
        torch._dynamo.reset()


def test_compiled_packed_gdn_layer_equals_each_sequence_alone():
    """The compiled route (Packing without host offsets, ``deltafuse::packed_gated_delta_rule``) separates the
    sequences: a packed [2, T] batch equals every sequence run alone, output and input gradient."""
    model = build_model(TINY_NAMES[0])
    deltafuse.apply(model)
    try:
        layer = next(m for m in model.modules() if hasattr(m, "in_proj_qkv"))
        pos = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
        bounds = [[(0, 4), (4, 5), (5, 11)], [(0, 7), (7, 11)]]
        x = torch.randn(2, pos.shape[1], model.config.hidden_size, requires_grad=True)

        def packed(x, pos):
            packing = bd.packing_from_position_ids(pos, *pos.shape)
            assert packing.cu_seqlens is None and packing.offsets is None  # the compiled route
            return layer(x, **{pk.PACKING_KWARG: packing})

        torch._dynamo.reset()
        out = torch.compile(packed, fullgraph=True)(x, pos)
        upstream = torch.randn_like(out)
        (dx,) = torch.autograd.grad(out, x, upstream)
        for b, seqs in enumerate(bounds):
            for s, e in seqs:
                xs = x[b:b + 1, s:e].detach().requires_grad_()
                o = layer(xs)
                torch.testing.assert_close(out[b:b + 1, s:e], o, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(dx[b:b + 1, s:e], torch.autograd.grad(o, xs, upstream[b:b + 1, s:e])[0],
                                           rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            assert (layer(x) - out).abs().max() > 1e-3  # without the boundaries the sequences mix
    finally:
        deltafuse.revert()
        torch._dynamo.reset()


def _gdn_args(grad, final, state):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    B, L, H, HV, K, V = 2, 6, 2, 4, 8, 8
    r = lambda *s: torch.randn(*s).requires_grad_(grad)  # noqa: E731
    q, k, v = r(B, L, H, K), r(B, L, H, K), r(B, L, HV, V)
    g = (-torch.rand(B, L, HV)).requires_grad_(grad)
    beta = torch.rand(B, L, HV).requires_grad_(grad)
    h0 = r(B, HV, K, V) if state else None
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 4, 4]])
    return (q, k, v, g, beta, h0, seq_idx, 0.3, final, True, False, [grad] * 5 + [grad and state])


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("state", [False, True], ids=["stateless", "states"])
def test_packing_ops_pass_opcheck(grad, state):
    torch.library.opcheck(adapters._packed_gdn_op.op, _gdn_args(grad, state, state))
    if not grad and not state:
        cu = torch.tensor([0, 4, 5, 11, 18, 22], dtype=torch.int32)
        torch.library.opcheck(bd.packing_starts, (cu, 2, 11))


def test_packed_gdn_op_equals_the_eager_route_with_states():
    """Initial states continue each row's first sequence and final states are each row's last, as eagerly."""
    q, k, v, g, beta, h0, seq_idx, scale, *_ = _gdn_args(False, True, True)
    o, final, _ = adapters._packed_gdn_op.op(q, k, v, g, beta, h0, seq_idx, scale, True, True, False, [False] * 6)
    packing = bd.packing_from_seq_idx(seq_idx, *seq_idx.shape)
    assert packing.offsets == (0, 2, 5, 6, 10, 12)
    want_o, want_final = adapters.gdn_call(deltafuse.ops.chunk_gated_delta_rule, q, k, v, g, beta, scale, h0,
                                           True, True, packing)
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)


def test_packing_starts_checks_the_offsets_when_it_runs():
    starts = bd.packing_starts(torch.tensor([0, 4, 5, 11, 18, 22]), 2, 11)
    want = torch.zeros(2, 11, dtype=torch.bool)
    want[0, [0, 4, 5]] = True
    want[1, [0, 7]] = True
    assert torch.equal(starts, want)
    with pytest.raises(bd.PackingError, match=r"run from 0 to B\*T = 2\*11 = 22 .* got 0 \.\.\. 21"):
        bd.packing_starts(torch.tensor([0, 4, 21]), 2, 11)
    with pytest.raises(bd.PackingError, match=r"must not decrease .*got \[0, -3, 22\]"):
        bd.packing_starts(torch.tensor([0, -3, 22]), 2, 11)


def test_compiled_boundaries_equal_eager():
    """Traced with no break, the boundaries (seq_idx, and the positions derived from given cu_seq_lens_q) are
    eager's, and malformed offsets are refused when the graph runs."""
    cu = torch.tensor([0, 4, 5, 11, 18, 22], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])

    def boundaries(cu, pos):
        given = bd.packing_from_cu_seqlens(cu, 2, 11)
        derived = bd.packing_from_position_ids(pos, 2, 11)
        return given.seq_idx, given.positions(), derived.seq_idx

    torch._dynamo.reset()
    compiled = torch.compile(boundaries, fullgraph=True)
    for got, want in zip(compiled(cu, pos), boundaries(cu, pos)):
        assert torch.equal(got, want)
    assert torch.equal(compiled(cu, pos)[1], pos)
    with pytest.raises(bd.PackingError, match=r"run from 0 to B\*T"):
        compiled(torch.tensor([0, 4, 5, 11, 18, 21], dtype=torch.int32), pos)
    torch._dynamo.reset()


def _export_as_stock_does(model, kwargs):
    """torch.export of the patched ``model``; a skip when stock transformers cannot export it either."""
    try:
        return torch.export.export(model, (), kwargs).module()
    except Exception:
        deltafuse.revert()
        try:
            torch.export.export(model, (), kwargs)
        except Exception as exc:
            import transformers

            pytest.skip(f"stock transformers {transformers.__version__} does not export this model either: "
                        f"{type(exc).__name__}")
        raise


def _mask_inputs(model, seed, mrope):
    g = input_gen(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :int(torch.randint(1, T // 2, (1,), generator=g))] = 0  # a left-padded row
    pos = torch.arange(T)[None].expand(2, T)
    if mrope:
        pos = pos[None].expand(3, 2, T)
    return dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


@pytest.mark.parametrize("mrope", [False, True], ids=["positions", "3xpositions"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
                                  for i, n in enumerate(TINY_NAMES)])
def test_export_and_fullgraph_compile_with_a_mask_and_position_ids(name, mrope):
    """What the vision-language classes always pass (they compute position_ids) and transformers' own
    export tests pass: torch.export and torch.compile(fullgraph=True) trace the patched model, and the traced
    graph equals stock for every value its inputs take (a padding mask; an all-ones mask with restarting
    positions, read as stock reads it while tracing)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    model = build_model(name, seed=seed)
    if mrope and not pk._is_mrope(model.model):
        pytest.skip(f"{name} has no multimodal RoPE")
    padded = _mask_inputs(model, seed, mrope)
    restarting = dict(padded, attention_mask=torch.ones(2, T, dtype=torch.long))
    cut = T // 2
    restarting["position_ids"] = torch.cat([torch.arange(cut), torch.arange(T - cut)]).expand_as(padded["position_ids"])
    with torch.no_grad():
        want = [model(**kw).logits for kw in (padded, restarting)]
    deltafuse.apply(model)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            exported = _export_as_stock_does(model, padded)
            for kw, ref in zip((padded, restarting), want):
                torch.testing.assert_close(exported(**kw).logits, ref, rtol=1e-5, atol=1e-5)
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            for kw, ref in zip((padded, restarting), want):
                torch.testing.assert_close(compiled(**kw).logits, ref, rtol=1e-5, atol=1e-5)
    finally:
        deltafuse.revert()
        torch._dynamo.reset()


def test_export_vision_language_class_text_call():
    """Qwen3_5ForConditionalGeneration computes [3, B, T] position_ids itself on every call: a text call with a
    padding mask exports with deltafuse applied and equals stock."""
    transformers = pytest.importorskip("transformers")
    from deltafuse.integrations.transformers.tiny import TINY_GDN

    config = transformers.Qwen3_5Config(
        text_config=dict(TINY_GDN),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    kwargs = _mask_inputs(model.model.language_model, 0, mrope=False)
    del kwargs["position_ids"]
    with torch.no_grad():
        want = model(**kwargs).logits
    deltafuse.apply(model)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            torch.testing.assert_close(_export_as_stock_does(model, kwargs)(**kwargs).logits, want,
                                       rtol=1e-5, atol=1e-5)
    finally:
        deltafuse.revert()
        torch._dynamo.reset()
