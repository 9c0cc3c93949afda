"""The Ascend NPU route for transformers' SDPA attention, with a stand-in ``torch_npu``.

No NPU here: the stand-in implements ``npu_fusion_attention`` as Ascend documents it (BNSD layout, grouped
query heads, ``atten_mask`` True = masked, ``sparse_mode`` 2 = causal from a compressed 2048 x 2048 mask), and
the route is compared with transformers' own ``sdpa_attention_forward`` on CPU tensors in float64.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from deltafuse.ops.attention.candidates import SDPA
from deltafuse.ops.attention import candidates as attention_backends
from deltafuse.backends.registry import CallInfo, Registry
from deltafuse.integrations.transformers import adapters_fused
from deltafuse.ops.attention import npu as attention_npu
from deltafuse.ops.attention import stock_attention
from tests.helpers import input_gen, npu_device


def _fake_torch_npu(calls):
    def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
        calls.append(dict(head_num=head_num, layout=input_layout, mask=atten_mask, scale=scale,
                          keep_prob=keep_prob, sparse_mode=sparse_mode, shapes=(query.shape, key.shape)))
        assert input_layout == "BNSD" and head_num == query.shape[1] and query.shape[1] % key.shape[1] == 0
        rep = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        s1, s2 = query.shape[2], key.shape[2]
        scores = (query @ k.transpose(-1, -2)) * scale
        if sparse_mode == 2:
            assert atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
            assert torch.equal(atten_mask, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
            masked = torch.triu(torch.ones(s1, s2, dtype=torch.bool), 1)  # upper-left aligned causal
        else:
            assert sparse_mode == 0
            masked = atten_mask if atten_mask is not None else torch.zeros(s1, s2, dtype=torch.bool)
            assert masked.dtype == torch.bool
        out = scores.masked_fill(masked, float("-inf")).softmax(-1) @ v
        return out, None, None, None, 0, 0, 0

    return types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention)


def _qkv(B, Hq, Hk, T, S, D=8, seed=0):
    g = input_gen(seed)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    return q, k, v


def _padding_mask(B, T, S, float_mask):
    keep = torch.tril(torch.ones(T, S, dtype=torch.bool), diagonal=S - T).expand(B, 1, T, S).clone()
    keep[0, :, :, 0] = False  # a left-padded first row (never a fully masked row: the diagonal stays)
    keep[0, :, 0, 0] = True
    if not float_mask:
        return keep
    return torch.zeros(B, 1, T, S, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)


CASES = {
    "causal_gqa_prefill": dict(B=2, Hq=4, Hk=2, T=7, S=7, mask=None),
    "bool_mask": dict(B=2, Hq=4, Hk=1, T=5, S=5, mask="bool"),
    "float_mask": dict(B=2, Hq=2, Hk=2, T=5, S=5, mask="float"),
    "decode_one_token": dict(B=2, Hq=4, Hk=2, T=1, S=6, mask=None),
    "prefill_keys_longer": dict(B=1, Hq=4, Hk=2, T=4, S=9, mask=None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_route_equals_transformers_sdpa(monkeypatch, case):
    c = CASES[case]
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    q, k, v = _qkv(c["B"], c["Hq"], c["Hk"], c["T"], c["S"])
    mask = None if c["mask"] is None else _padding_mask(c["B"], c["T"], c["S"], c["mask"] == "float")
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=c["Hq"] // c["Hk"])
    want, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.3)
    got = attention_npu.sdpa_npu(q, k, v, mask, 0.0, 0.3, True)
    assert got.shape == want.shape == (c["B"], c["T"], c["Hq"], 8) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    call = calls[-1]
    assert call["head_num"] == c["Hq"] and call["scale"] == 0.3 and call["keep_prob"] == 1.0
    assert call["shapes"][1][1] == c["Hk"]  # grouped heads passed as they are, not repeated
    causal_no_mask = c["mask"] is None and c["T"] > 1
    assert call["sparse_mode"] == (2 if causal_no_mask else 0)
    if c["mask"] is None and c["T"] == 1:
        assert call["mask"] is None  # one query token attends to every key


def test_default_scale_is_head_dim_to_minus_half(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    q, k, v = _qkv(1, 2, 2, 3, 3)
    attention_npu.sdpa_npu(q, k, v, None, 0.0, None, True)
    assert calls[-1]["scale"] == 8 ** -0.5


def test_selection_npu_only_and_unverified(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu([]))
    reg = Registry()
    attention_backends.register(reg)
    rows = {d.candidate: d for d in reg.explain(SDPA, CallInfo(npu_device(), torch.bfloat16, True))}
    assert rows["npu"].chosen and rows["npu"].verified is False
    assert reg.select(SDPA, CallInfo(npu_device(), torch.bfloat16, True)) is attention_npu.sdpa_npu
    cpu = {d.candidate: d for d in reg.explain(SDPA, CallInfo(torch.device("cpu"), torch.float32, True))}
    assert cpu["transformers"].chosen and "npu device" in cpu["npu"].reason
    assert reg.select(SDPA, CallInfo(torch.device("cpu"), torch.float32, True)) is stock_attention
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    reg.clear_cache()
    rows = {d.candidate: d for d in reg.explain(SDPA, CallInfo(npu_device(), torch.bfloat16, True))}
    assert rows["transformers"].chosen and "torch_npu does not import" in rows["npu"].reason


def test_wrapper_leaves_other_devices_and_special_calls_to_transformers():
    seen = []

    def original(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        seen.append((module, query, key, value, attention_mask, dropout, scaling, is_causal, kw))
        return "stock", None

    wrapped = adapters_fused.wrap_sdpa_attention(original)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)
    q, k, v = _qkv(1, 4, 2, 3, 3)
    assert wrapped(module, q, k, v, None, dropout=0.1, scaling=0.5, position_ids=None)[0] == "stock"
    assert seen[-1][1] is q and seen[-1][5:8] == (0.1, 0.5, None) and seen[-1][8] == {"position_ids": None}
    # what the route would take on an npu: causal self-attention without maths-changing extras
    assert adapters_fused._routable_attention(module, None, {})
    assert not adapters_fused._routable_attention(module, False, {})
    assert not adapters_fused._routable_attention(types.SimpleNamespace(), None, {})  # encoders, vision blocks
    for extra in ("position_bias", "softcap", "s_aux", "sliding_window"):
        assert not adapters_fused._routable_attention(module, None, {extra: 1})
    assert not adapters_fused._routable_attention(module, None, {"output_attentions": True})
