"""Packed sequences: the patched model equals stock transformers run on every sequence alone.

Boundaries arrive as cu_seq_lens_q, seq_idx or only restarting position_ids; rows may hold several
sequences (B = 1 and B = 2), length-1 sequences included. Logits, loss and every parameter gradient are
compared with per-sequence stock runs (stock itself leaks state across packed sequences).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import deltafuse
from deltafuse import patching
from deltafuse.integrations.transformers import adapters
from deltafuse.integrations.transformers import boundaries as bd
from deltafuse.models import TINY_NAMES, build_model
from deltafuse.ops import causal_conv1d_fn, chunk_gated_delta_rule
from tests.helpers import input_gen, input_seed
from tests.integrations import (RTOL, assert_grads_close, grads, packed_inputs, per_sequence_stock, rel_max,
                                record_op_kwarg)



pytestmark = pytest.mark.usefixtures("clean_deltafuse")


def _rows(lengths_per_row, vocab, seed):
    gen = input_gen(seed)
    return [[torch.randint(0, vocab, (n,), generator=gen) for n in row] for row in lengths_per_row]


def _run_packed(model, rows, source):
    ids, pos, labels, cu, seq_idx = packed_inputs(rows)
    kwargs = dict(input_ids=ids, labels=labels)
    if source in ("position_ids", "cu_seq_lens_q+position_ids", "seq_idx+position_ids"):
        kwargs["position_ids"] = pos
    if source.startswith("cu_seq_lens_q"):
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int((cu[1:] - cu[:-1]).max()),
                      max_length_k=int((cu[1:] - cu[:-1]).max()))
    if source.startswith("seq_idx"):
        kwargs["seq_idx"] = seq_idx.to(torch.int32)
    model.zero_grad(set_to_none=True)
    with patching.patched(model) as report:
        assert report.applied, str(report)
        out = model(**kwargs)
        out.loss.backward()
        logits = _logits(model, out, kwargs)
    return out.loss.detach(), logits.detach(), grads(model)


class _Reference(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict


def _stock_reference(model, rows) -> _Reference:
    """Loss, logits and gradients of the stock model on each sequence alone (``per_sequence_stock``)."""
    model.zero_grad(set_to_none=True)
    loss, logits = per_sequence_stock(model, rows)
    return _Reference(loss, logits, grads(model))


def _assert_matches(loss, logits, got_grads, reference):
    """Logits, loss and every gradient equal the per-sequence stock ones (``_stock_reference``) within RTOL."""
    assert rel_max(logits, reference.logits) < RTOL
    assert abs(loss.item() - reference.loss.item()) <= RTOL * abs(reference.loss.item())
    assert_grads_close(got_grads, reference.grads)


def _logits(model, out, kwargs):
    """The logits of a call; with the fused loss (no logits when training) those of an evaluation call."""
    if out.logits is not None:
        return out.logits
    with torch.no_grad():
        return model(**kwargs).logits


CASES = [
    # (source, rows of sequence lengths)
    ("position_ids", [[23, 1, 66, 6]]),                      # B=1, a length-1 sequence, one crosses 64
    ("position_ids", [[9, 1, 20], [1, 29]]),                   # B=2 with restarts inside rows
    ("position_ids", [[30], [1, 1, 28]]),                      # a row of one sequence next to a packed one
    ("cu_seq_lens_q+position_ids", [[17, 1, 12]]),            # what DataCollatorWithFlattening gives (B=1)
    ("cu_seq_lens_q", [[17, 1, 12]]),                          # offsets only: positions derived from them
    ("seq_idx+position_ids", [[10, 14], [3, 1, 20]]),
    ("seq_idx", [[12, 1, 7]]),
]


@pytest.mark.parametrize("source,lengths", CASES, ids=[f"{s}-{'x'.join(map(str, map(len, r)))}B{len(r)}"
                                                        for s, r in CASES])
def test_packed_equals_per_sequence_stock(source, lengths):
    model = build_model("tiny", seed=input_seed("model", 3)).train()
    rows = _rows(lengths, model.config.vocab_size, seed=len(source) + sum(map(sum, lengths)))
    reference = _stock_reference(model, rows)
    loss, logits, got = _run_packed(model, rows, source)
    _assert_matches(loss, logits, got, reference)


def test_stock_leaks_where_deltafuse_does_not():
    """The comparison above can fail: stock transformers on the same packed batch differs from its own
    per-sequence runs (state leaks through the GDN layers and the conv)."""
    model = build_model("tiny", seed=input_seed("model", 4)).eval()
    rows = _rows([[12, 20]], model.config.vocab_size, seed=5)
    ids, pos, _, _, _ = packed_inputs(rows)
    with torch.no_grad():
        ref_logits = torch.cat([model(input_ids=s[None], use_cache=False).logits for s in rows[0]], 1)
        stock = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with patching.patched(model):
            ours = model(input_ids=ids, position_ids=pos).logits
    assert rel_max(stock[:, 12:], ref_logits[:, 12:]) > 1e-3  # stock leaks into the second sequence
    assert rel_max(ours, ref_logits) < RTOL


def test_packed_with_eager_attention():
    """transformers builds the packed full-attention mask from position_ids for eager as for sdpa."""
    model = build_model("tiny", seed=input_seed("model", 10), attn_implementation="eager").train()
    assert model.config._attn_implementation == "eager"
    rows = _rows([[8, 1, 13], [15, 7]], model.config.vocab_size, seed=11)
    reference = _stock_reference(model, rows)
    loss, logits, got = _run_packed(model, rows, "position_ids")
    _assert_matches(loss, logits, got, reference)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-next"])
def test_packed_other_families(name):
    model = build_model(name, seed=input_seed("model", 6)).train()
    rows = _rows([[11, 1, 16], [20, 8]], model.config.vocab_size, seed=7)
    reference = _stock_reference(model, rows)
    loss, logits, got = _run_packed(model, rows, "position_ids")
    _assert_matches(loss, logits, got, reference)


# --- which position_ids and masks mark boundaries ----------------------------------------------------------
MRope = ("tiny", "tiny-moe")  # the Qwen3.5 families read [3|4, B, T] position_ids; Qwen3-Next reads [B, T]
LAYOUTS = [(m, "all-ones-mask") for m in TINY_NAMES] + \
    [(m, layout) for m in MRope for layout in ("rows3", "rows4", "rows3+all-ones-mask")]


def _layout_kwargs(layout, ids, pos):
    kwargs = {"input_ids": ids}
    if layout.startswith("rows3"):
        kwargs["position_ids"] = pos[None].expand(3, -1, -1)
    elif layout == "rows4":
        # text positions first; the RoPE rows of a text batch equal them
        kwargs["position_ids"] = pos[None].expand(4, -1, -1)
    else:
        kwargs["position_ids"] = pos
    if layout.endswith("all-ones-mask"):
        kwargs["attention_mask"] = torch.ones_like(ids)
    return kwargs


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{m}-{lay}" for m, lay in LAYOUTS])
def test_restarting_positions_mark_boundaries(name, layout):
    """Restarting position_ids separate sequences with an all-ones 2-D mask too, and as [3, B, T] (equal rows)
    or [4, B, T] (text row first): logits, loss and every gradient equal the per-sequence stock runs, in the
    GDN/conv layers and the full-attention layers alike, while stock on the same batch mixes the sequences."""
    model = build_model(name, seed=input_seed("model", 21)).train()
    rows = _rows([[10, 1, 15], [19, 7]], model.config.vocab_size, seed=22)
    ids, pos, labels, _, _ = packed_inputs(rows)
    kwargs = _layout_kwargs(layout, ids, pos)
    reference = _stock_reference(model, rows)
    with torch.no_grad():
        stock = model(**kwargs, use_cache=False).logits
    assert rel_max(stock, reference.logits) > 1e-3, "stock mixes these sequences: the comparison below can fail"
    model.zero_grad(set_to_none=True)
    with patching.patched(model):
        out = model(**kwargs, labels=labels)
        out.loss.backward()
        logits = _logits(model, out, kwargs)
    _assert_matches(out.loss, logits, grads(model), reference)


def test_full_attention_alone_is_block_causal():
    """A model of full-attention layers only (no GDN layer to separate anything): with the all-ones mask
    dropped and equal [3, B, T] rows passed as one row, transformers builds its block-causal mask, so the
    logits are the per-sequence ones."""
    model = build_model("tiny", seed=input_seed("model", 23), num_hidden_layers=2,
                        layer_types=["full_attention"] * 2).eval()
    rows = _rows([[9, 14, 1]], model.config.vocab_size, seed=24)
    ids, pos, _, _, _ = packed_inputs(rows)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s[None], use_cache=False).logits for s in rows[0]], 1)
        # stock mixes with the mask in every version; [3, B, T] rows mix from 5.5 on (5.2 reads the first row
        # as text positions itself)
        for kwargs, stock_mixes in ((dict(position_ids=pos, attention_mask=torch.ones_like(ids)), True),
                                    (dict(position_ids=pos[None].expand(3, -1, -1)), None)):
            stock = model(input_ids=ids, use_cache=False, **kwargs).logits
            if stock_mixes:
                assert rel_max(stock, ref) > 1e-3
            with patching.patched(model):
                got = model(input_ids=ids, **kwargs).logits
            assert rel_max(got, ref) < RTOL


def test_padding_mask_keeps_position_ids_as_positions():
    """A mask with zeros is kept: position_ids are then positions only (as in stock; a left-padded generate
    batch restarts its positions after the padding), each row one sequence, padded tokens masked as in stock;
    a multimodal [3, B, T] whose rows differ is no boundary signal either."""
    model = build_model("tiny", seed=input_seed("model", 25)).eval()
    gen = input_gen(26)
    ids = torch.randint(0, model.config.vocab_size, (2, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    mm = torch.arange(14).expand(3, 2, 14).clone()
    mm[1:, :, 3:7] = torch.tensor([3, 3, 4, 4])  # image tokens: equal temporal, varying height / width
    for kwargs in (dict(attention_mask=mask, position_ids=pos), dict(position_ids=mm)):
        with torch.no_grad():
            stock = model(input_ids=ids, use_cache=False, **kwargs).logits
            with patching.patched(model):
                got = model(input_ids=ids, use_cache=False, **kwargs).logits
        assert rel_max(got, stock) < RTOL
    # a padded row equals that row alone without its padding
    with torch.no_grad():
        alone = model(input_ids=ids[1:, 4:], use_cache=False).logits
        with patching.patched(model):
            got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert rel_max(got[1:, 4:], alone) < RTOL


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_packed_with_gradient_checkpointing(monkeypatch, reentrant):
    """Boundaries travel in the layers' kwargs, so the recomputation in backward sees the same ones."""
    model = build_model("tiny", seed=input_seed("model", 8)).train()
    rows = _rows([[14, 1, 9], [6, 18]], model.config.vocab_size, seed=9)
    reference = _stock_reference(model, rows)
    calls = record_op_kwarg(monkeypatch, "chunk_gated_delta_rule", "cu_seqlens")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    try:
        loss, logits, got = _run_packed(model, rows, "position_ids")
    finally:
        model.gradient_checkpointing_disable()
    n_gdn = sum(t == "linear_attention" for t in model.config.layer_types)
    # forward, the recomputation in backward (checkpointed), and the evaluation call that returns the logits
    assert len(calls) == 3 * n_gdn, "every GDN layer runs again in backward (checkpointed)"
    assert all(c is not None and c.tolist() == [0, 14, 15, 24, 30, 48] for c in calls), \
        "the recomputation got the same packed boundaries"
    _assert_matches(loss, logits, got, reference)


# --- packing helpers and op adapters ----------------------------------------------------------------
def test_packing_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    p = bd.packing_from_position_ids(pos, 2, 6)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6, 12]
    assert p.seq_idx.tolist() == [[0, 0, 0, 1, 2, 2], [3, 3, 3, 3, 3, 3]]
    assert p.positions().tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]
    # the offsets' host copy travels with the tensor (the GDN kernels plan from it without a device read)
    from deltafuse.ops._checks import host_offsets

    assert host_offsets(p.cu_seqlens) == (0, 3, 4, 6, 12)
    p.cu_seqlens[1] = 2  # an in-place change invalidates the copy
    assert host_offsets(p.cu_seqlens) == (0, 2, 4, 6, 12)
    # one sequence per row (and [1, T] broadcast, [4, B, T] multimodal positions): nothing to separate
    assert bd.packing_from_position_ids(torch.arange(6)[None], 2, 6) is None
    assert bd.packing_from_position_ids(torch.arange(6).expand(4, 2, 6), 2, 6) is None
    # [4, B, T]: the first row is the text position (the three RoPE rows after it do not count)
    four = torch.stack([pos, torch.zeros_like(pos), pos, pos])
    assert bd.packing_from_position_ids(four, 2, 6).cu_seqlens.tolist() == [0, 3, 4, 6, 12]
    # [3, B, T] with equal rows is text; rows that differ (multimodal RoPE) carry no sequence signal
    assert bd.packing_from_position_ids(pos.expand(3, 2, 6), 2, 6).cu_seqlens.tolist() == [0, 3, 4, 6, 12]
    mm = pos.expand(3, 2, 6).clone()
    mm[1, 0, 3] = 7
    assert bd.packing_from_position_ids(mm, 2, 6) is None
    with pytest.raises(bd.PackingError, match=r"position_ids of shape \(2, 5\)"):
        bd.packing_from_position_ids(torch.zeros(2, 5, dtype=torch.long), 2, 6)
    with pytest.raises(bd.PackingError, match=r"position_ids of shape \(2, 2, 6\).*\[3\|4, B, T\]"):
        bd.packing_from_position_ids(torch.zeros(2, 2, 6, dtype=torch.long), 2, 6)


def test_packing_from_cu_seqlens_and_seq_idx_agree():
    cu = torch.tensor([0, 2, 3, 7, 8], dtype=torch.int32)
    a = bd.packing_from_cu_seqlens(cu, 2, 4)
    b = bd.packing_from_seq_idx(torch.tensor([[5, 5, 6, 7], [7, 7, 7, 9]]), 2, 4)
    # a sequence that spans the row end is cut there: rows never share a sequence
    assert a.cu_seqlens.tolist() == b.cu_seqlens.tolist() == [0, 2, 3, 4, 7, 8]
    with pytest.raises(bd.PackingError, match="must run from 0 to B\\*T = 2\\*4 = 8"):
        bd.packing_from_cu_seqlens(torch.tensor([0, 3, 6]), 2, 4)
    for bad in ([0, 5, -2, 8], [0, 6, 3, 8]):  # a negative or decreasing offset is refused, never wrapped around
        with pytest.raises(bd.PackingError, match=r"cu_seq_lens_q must not decrease .*got \[" + str(bad[0])):
            bd.packing_from_cu_seqlens(torch.tensor(bad), 2, 4)


def test_chunk_adapter_flattens_rows_and_maps_states():
    """B=2 rows with restarts, an initial state per row: equals the op on each sequence alone."""
    torch.manual_seed(input_seed(0))
    B, T, H, HV, K, V = 2, 9, 2, 4, 8, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -torch.rand(B, T, HV)
    beta = torch.rand(B, T, HV)
    h0 = torch.randn(B, HV, K, V)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, [4, 5]] = True
    starts[1, 7] = True
    packing = bd.packing_from_starts(starts)
    o, final = adapters.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, cu_seq_lens_q=packing.cu_seqlens,
                                               use_cache=True)  # an unrelated layer kwarg is ignored
    for b, bounds in ((0, [(0, 4), (4, 5), (5, 9)]), (1, [(0, 7), (7, 9)])):
        for i, (s, e) in enumerate(bounds):
            state = h0[b:b + 1] if i == 0 else None
            ref_o, ref_final = chunk_gated_delta_rule(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e],
                                                      g[b:b + 1, s:e], beta[b:b + 1, s:e], initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert rel_max(o[b:b + 1, s:e], ref_o) < 1e-5
        assert rel_max(final[b:b + 1], ref_final) < 1e-5  # the row's last sequence


def test_conv_adapter_boundaries_and_cached_prefix():
    torch.manual_seed(input_seed(1))
    B, C, T, W = 2, 6, 8, 4
    x = torch.randn(B, C, T)
    w = torch.randn(C, W)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 3] = True
    packing = bd.packing_from_starts(starts)
    out = adapters.causal_conv1d_fn(x, w, None, activation="silu", cu_seq_lens_q=packing.cu_seqlens)
    ref0 = torch.cat([causal_conv1d_fn(x[:1, :, :3], w, activation="silu"),
                      causal_conv1d_fn(x[:1, :, 3:], w, activation="silu")], -1)
    assert rel_max(out[:1], ref0) < 1e-6
    assert rel_max(out[1:], causal_conv1d_fn(x[1:], w, activation="silu")) < 1e-6
    # the layer may prepend W-1 cached inputs: they continue each row's first sequence
    prefix = torch.randn(B, C, W - 1)
    out2 = adapters.causal_conv1d_fn(torch.cat([prefix, x], -1), w, None, activation="silu",
                                     seq_idx=packing.seq_idx)[..., W - 1:]
    ref_first = causal_conv1d_fn(x[:1, :, :3], w, activation="silu", initial_states=prefix[:1])
    assert rel_max(out2[:1, :, :3], ref_first) < 1e-6
    assert rel_max(out2[:1, :, 3:], ref0[..., 3:]) < 1e-6


def test_public_api_reexported():
    assert deltafuse.apply is patching.apply and deltafuse.revert is patching.revert


@pytest.mark.parametrize("flash_kwargs,seq_idx", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["position_ids", "flash_kwargs", "seq_idx", "all"])
def test_transformers_padding_free_collator(flash_kwargs, seq_idx):
    """Batches exactly as transformers' DataCollatorWithFlattening builds them."""
    from transformers import DataCollatorWithFlattening

    model = build_model("tiny", seed=input_seed("model", 12)).train()
    rows = _rows([[13, 1, 9, 20]], model.config.vocab_size, seed=13)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_seq_idx=seq_idx)
    batch = collator([{"input_ids": s.tolist()} for s in rows[0]])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs and ("seq_idx" in batch) == seq_idx
    reference = _stock_reference(model, rows)
    model.zero_grad(set_to_none=True)
    with patching.patched(model):
        out = model(**batch)
        out.loss.backward()
        logits = _logits(model, out, batch)
    _assert_matches(out.loss, logits, grads(model), reference)
