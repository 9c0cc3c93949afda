"""Packed sequences: the patched model equals stock transformers run on every sequence alone.

Boundaries arrive as cu_seq_lens_q, seq_idx or only restarting position_ids; rows may hold several
sequences (B = 1 and B = 2), length-1 sequences included. Logits, loss and every parameter gradient are
compared with per-sequence stock runs (stock itself leaks state across packed sequences).
"""

from __future__ import annotations

import pytest
import torch

import deltafuse
from deltafuse import patching
from deltafuse.integrations.transformers import adapters
from deltafuse.models import build_model
from deltafuse.ops import causal_conv1d_fn, chunk_gated_delta_rule
from tests.integrations import (RTOL, assert_grads_close, grads, packed_inputs, per_sequence_stock, rel_max)



pytestmark = pytest.mark.usefixtures("clean_deltafuse")


def _rows(lengths_per_row, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
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
    model = build_model("tiny", seed=3).train()
    rows = _rows(lengths, model.config.vocab_size, seed=len(source) + sum(map(sum, lengths)))
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = per_sequence_stock(model, rows)
    ref_grads = grads(model)
    loss, logits, got = _run_packed(model, rows, source)
    assert rel_max(logits, ref_logits) < RTOL
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grads_close(got, ref_grads)


def test_stock_leaks_where_deltafuse_does_not():
    """The comparison above can fail: stock transformers on the same packed batch differs from its own
    per-sequence runs (state leaks through the GDN layers and the conv)."""
    model = build_model("tiny", seed=4).eval()
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
    model = build_model("tiny", seed=10, attn_implementation="eager").train()
    assert model.config._attn_implementation == "eager"
    rows = _rows([[8, 1, 13], [15, 7]], model.config.vocab_size, seed=11)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = per_sequence_stock(model, rows)
    ref_grads = grads(model)
    loss, logits, got = _run_packed(model, rows, "position_ids")
    assert rel_max(logits, ref_logits) < RTOL
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grads_close(got, ref_grads)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-next"])
def test_packed_other_families(name):
    model = build_model(name, seed=6).train()
    rows = _rows([[11, 1, 16], [20, 8]], model.config.vocab_size, seed=7)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = per_sequence_stock(model, rows)
    ref_grads = grads(model)
    loss, logits, got = _run_packed(model, rows, "position_ids")
    assert rel_max(logits, ref_logits) < RTOL
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grads_close(got, ref_grads)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_packed_with_gradient_checkpointing(monkeypatch, reentrant):
    """Boundaries travel in the layers' kwargs, so the recomputation in backward sees the same ones."""
    model = build_model("tiny", seed=8).train()
    rows = _rows([[14, 1, 9], [6, 18]], model.config.vocab_size, seed=9)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = per_sequence_stock(model, rows)
    ref_grads = grads(model)
    calls = []
    original = adapters.ops.chunk_gated_delta_rule

    def spy(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return original(*args, **kwargs)

    monkeypatch.setattr(adapters.ops, "chunk_gated_delta_rule", spy)
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
    assert rel_max(logits, ref_logits) < RTOL
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grads_close(got, ref_grads)


# --- packing helpers and op adapters ----------------------------------------------------------------
def test_packing_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    p = adapters.packing_from_position_ids(pos, 2, 6)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6, 12]
    assert p.seq_idx.tolist() == [[0, 0, 0, 1, 2, 2], [3, 3, 3, 3, 3, 3]]
    assert p.positions().tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]
    # the offsets' host copy travels with the tensor (the GDN kernels plan from it without a device read)
    from deltafuse.ops._checks import host_offsets

    assert host_offsets(p.cu_seqlens) == (0, 3, 4, 6, 12)
    p.cu_seqlens[1] = 2  # an in-place change invalidates the copy
    assert host_offsets(p.cu_seqlens) == (0, 2, 4, 6, 12)
    # one sequence per row (and [1, T] broadcast, [4, B, T] multimodal positions): nothing to separate
    assert adapters.packing_from_position_ids(torch.arange(6)[None], 2, 6) is None
    assert adapters.packing_from_position_ids(torch.arange(6).expand(4, 2, 6), 2, 6) is None
    # [4, B, T]: the first stream is the text position; [3, B, T] (multimodal rope only) is no sequence signal
    assert adapters.packing_from_position_ids(pos.expand(4, 2, 6), 2, 6).cu_seqlens.tolist() == [0, 3, 4, 6, 12]
    assert adapters.packing_from_position_ids(pos.expand(3, 2, 6), 2, 6) is None
    with pytest.raises(adapters.PackingError, match=r"position_ids of shape \(2, 5\)"):
        adapters.packing_from_position_ids(torch.zeros(2, 5, dtype=torch.long), 2, 6)


def test_packing_from_cu_seqlens_and_seq_idx_agree():
    cu = torch.tensor([0, 2, 3, 7, 8], dtype=torch.int32)
    a = adapters.packing_from_cu_seqlens(cu, 2, 4)
    b = adapters.packing_from_seq_idx(torch.tensor([[5, 5, 6, 7], [7, 7, 7, 9]]), 2, 4)
    # a sequence that spans the row end is cut there: rows never share a sequence
    assert a.cu_seqlens.tolist() == b.cu_seqlens.tolist() == [0, 2, 3, 4, 7, 8]
    with pytest.raises(adapters.PackingError, match="must run from 0 to B\\*T = 2\\*4 = 8"):
        adapters.packing_from_cu_seqlens(torch.tensor([0, 3, 6]), 2, 4)


def test_chunk_adapter_flattens_rows_and_maps_states():
    """B=2 rows with restarts, an initial state per row: equals the op on each sequence alone."""
    torch.manual_seed(0)
    B, T, H, HV, K, V = 2, 9, 2, 4, 8, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -torch.rand(B, T, HV)
    beta = torch.rand(B, T, HV)
    h0 = torch.randn(B, HV, K, V)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, [4, 5]] = True
    starts[1, 7] = True
    packing = adapters.packing_from_starts(starts)
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
    torch.manual_seed(1)
    B, C, T, W = 2, 6, 8, 4
    x = torch.randn(B, C, T)
    w = torch.randn(C, W)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, 3] = True
    packing = adapters.packing_from_starts(starts)
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

    model = build_model("tiny", seed=12).train()
    rows = _rows([[13, 1, 9, 20]], model.config.vocab_size, seed=13)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_seq_idx=seq_idx)
    batch = collator([{"input_ids": s.tolist()} for s in rows[0]])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs and ("seq_idx" in batch) == seq_idx
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = per_sequence_stock(model, rows)
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with patching.patched(model):
        out = model(**batch)
        out.loss.backward()
        logits = _logits(model, out, batch)
    assert rel_max(logits, ref_logits) < RTOL
    assert abs(out.loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grads_close(grads(model), ref_grads)
