"""Partial RoPE for q and k: Triton vs the float64 oracle, torch reference vs transformers, routing.

Without CUDA the Triton kernels run under the interpreter in fp32 on tiny shapes. ``gpu`` tests need
CUDA: bf16 at Qwen3.5-35B-A3B sizes (16 q heads, 2 kv heads, head_dim 256, rotary_dim 64, 4096 tokens).
"""

from __future__ import annotations

import types

import pytest
import torch

from deltafuse.ops.rope import candidates as rope_backends  # noqa: E402
from deltafuse.backends.registry import CallInfo  # noqa: E402
from deltafuse.ops.rope import api  # noqa: E402
from deltafuse.ops.rope.naive import naive_rotary  # noqa: E402
from deltafuse.ops.rope.reference import apply_rotary_pos_emb_torch  # noqa: E402
from tests.helpers import (  # noqa: E402
    DEVICE, INTERPRETED, assert_rel_close, gpu, needs_cuda, npu_route, rel_rms, triton_kernel_module,
)



def _kernel():
    return triton_kernel_module("deltafuse.ops.rope.kernel", "_rope_kernel")


def cos_sin(B, T, rd, start=0, base=10000.0, dtype=torch.float32, device=DEVICE, batch_cos=True):
    """cos/sin the way transformers' text rotary embedding builds them (fp32 angles, rotate-half layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    pos = (torch.arange(T) + start)[None].expand(B if batch_cos else 1, T).float()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def qk(B, HQ, HK, T, D, layout, dtype=torch.float32, device=DEVICE):
    """q, k as transformers passes them: contiguous [B, T, H, D] transposed to [B, H, T, D] (layout 1)."""
    q = torch.randn(B, T, HQ, D, device=device).to(dtype)
    k = torch.randn(B, T, HK, D, device=device).to(dtype)
    if layout == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q, k


def _check(fn, q, k, cos, sin, ud, tol, cs_grad=False):
    leaves = [t.detach().requires_grad_(t is q or t is k or cs_grad) for t in (q, k, cos, sin)]
    qo, ko = fn(*leaves, ud)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo * dq).sum() + (ko * dk).sum()).backward()
    r = [t.detach().double().requires_grad_(i < 2 or cs_grad) for i, t in enumerate((q, k, cos, sin))]
    rq, rk = naive_rotary(r[0], r[2], r[3], ud), naive_rotary(r[1], r[2], r[3], ud)
    ((rq * dq.double()).sum() + (rk * dk.double()).sum()).backward()
    assert qo.shape == q.shape and ko.shape == k.shape
    assert_rel_close(qo, rq, tol, "q_embed")
    assert_rel_close(ko, rk, tol, "k_embed")
    names = ["dq", "dk"] + (["dcos", "dsin"] if cs_grad else [])
    for name, a, b in zip(names, leaves, r):
        assert_rel_close(a.grad, b.grad, tol, name)
    return qo, ko


CASES = [  # B, HQ, HK, T, D, rd, layout (unsqueeze_dim), cos batch
    (2, 3, 1, 5, 24, 8, 1, True),      # partial, GQA, transformers' transposed layout
    (1, 4, 2, 1, 32, 8, 1, False),     # T = 1, cos broadcast over the batch
    (2, 2, 2, 7, 16, 16, 2, True),     # full rotary, [B, T, H, D]
    (1, 18, 2, 3, 300, 20, 1, True),   # more heads than one head block, pass-through wider than one block
    (1, 2, 1, 4, 20, 6, 2, False),     # rotary half (3) not a power of two
]


@pytest.mark.parametrize("B,HQ,HK,T,D,rd,ud,bc", CASES)
def test_triton_matches_float64(B, HQ, HK, T, D, rd, ud, bc):
    k_ = _kernel()
    q, k = qk(B, HQ, HK, T, D, ud)
    cos, sin = cos_sin(B, T, rd, start=3, batch_cos=bc)
    qo, ko = _check(k_.apply_rotary_pos_emb_triton, q, k, cos, sin, ud, 2e-6)
    # fp32 forward has the stock rounding points: identical to the stock formula
    rq, rk = apply_rotary_pos_emb_torch(q, k, cos, sin, ud)
    assert torch.equal(qo, rq) and torch.equal(ko, rk)
    # the pass-through channels are copied exactly
    assert torch.equal(qo[..., rd:], q[..., rd:]) and torch.equal(ko[..., rd:], k[..., rd:])
    # outputs keep the input's memory layout (no hidden transpose-copy for attention to undo)
    assert qo.stride() == q.stride()


def test_triton_cos_sin_gradients():
    k_ = _kernel()
    q, k = qk(2, 3, 1, 4, 16, 1)
    cos, sin = cos_sin(1, 4, 8, batch_cos=False)
    _check(k_.apply_rotary_pos_emb_triton, q, k, cos, sin, 1, 2e-6, cs_grad=True)


def test_triton_general_cos_sin_halves():
    """cos/sin whose two halves differ (not what transformers builds, but the formula allows it)."""
    k_ = _kernel()
    q, k = qk(1, 2, 1, 3, 12, 2)
    cos, sin = torch.randn(1, 3, 8, device=DEVICE), torch.randn(1, 3, 8, device=DEVICE)
    _check(k_.apply_rotary_pos_emb_triton, q, k, cos, sin, 2, 2e-6, cs_grad=True)


def test_positions_near_one_million_are_finite_and_exact():
    """fp32 angles at positions up to ~1M: no NaN/inf anywhere, every element right, forward and backward."""
    k_ = _kernel()
    T = 6
    for start in (1_000_000 - T, 2**20 - T):
        q, k = qk(1, 2, 1, T, 32, 1)
        cos, sin = cos_sin(1, T, 8, start=start)
        assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
        assert (cos.pow(2) + sin.pow(2) - 1).abs().max() < 1e-5
        qo, ko = _check(k_.apply_rotary_pos_emb_triton, q, k, cos, sin, 1, 2e-6)
        # rotation preserves each pair's norm: nothing blew up or vanished
        n_in = q[..., :4].pow(2) + q[..., 4:8].pow(2)
        n_out = qo[..., :4].pow(2) + qo[..., 4:8].pow(2)
        assert_rel_close(n_out, n_in, 1e-5, "pair norms")


def test_packed_batch_equals_per_sequence_runs():
    """Positions restarting inside a packed row (padding-free batches): RoPE is per token, so the packed
    call equals each sequence rotated on its own, bit for bit."""
    k_ = _kernel()
    lengths = [1, 4, 1, 3]
    T = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])
    q, k = qk(1, 3, 1, T, 16, 1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    f = pos[None, :, None].float() * inv_freq
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    qo, ko = k_.apply_rotary_pos_emb_triton(q, k, cos, sin, 1)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        c, s = cos_sin(1, n, 8)
        sq, sk = k_.apply_rotary_pos_emb_triton(q[:, :, sl], k[:, :, sl], c, s, 1)
        assert torch.equal(qo[:, :, sl], sq) and torch.equal(ko[:, :, sl], sk)
        start += n


# --- torch reference vs transformers ------------------------------------------------------------------
def _hf_modules():
    pytest.importorskip("transformers")
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35m
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return [(q35, q35.Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**kw))),
            (q35m, q35m.Qwen3_5MoeTextRotaryEmbedding(Qwen3_5MoeTextConfig(**kw))),
            (qn, qn.Qwen3NextRotaryEmbedding(Qwen3NextConfig(**kw)))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 999_990])
def test_reference_equals_transformers_bit_for_bit(dtype, start):
    for mod, rotary in _hf_modules():
        B, T = 2, 5
        x = torch.randn(B, T, 64).to(dtype)
        pos = (torch.arange(T) + start)[None].expand(B, T)
        if "qwen3_5" in mod.__name__:  # mrope models take text positions as three equal streams (3, B, T)
            pos = pos[None].expand(3, B, T)
        cos, sin = rotary(x, pos)
        assert cos.shape == (B, T, 8)  # head_dim 32 * partial_rotary_factor 0.25
        assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
        q, k = qk(B, 4, 2, T, 32, 1, dtype, "cpu")
        hq, hk = mod.apply_rotary_pos_emb(q, k, cos, sin)
        rq, rk = apply_rotary_pos_emb_torch(q, k, cos, sin, 1)
        assert torch.equal(rq, hq) and torch.equal(rk, hk), mod.__name__
        # and the text cos/sin are the rotate-half layout our kernels assume: two equal halves
        assert torch.equal(cos[..., :4], cos[..., 4:]) and torch.equal(sin[..., :4], sin[..., 4:])


def test_mrope_text_positions_fold_to_plain_rope():
    """Qwen3.5's interleaved mrope with three equal position streams (text) gives plain RoPE cos/sin."""
    for mod, rotary in _hf_modules()[:2]:
        # (3, B, T) as the text models pass them on every supported transformers version
        cos, sin = rotary(torch.randn(1, 7, 64), torch.arange(7)[None, None].expand(3, 1, 7))
        ref_cos, ref_sin = cos_sin(1, 7, 8, device="cpu", base=rotary.config.rope_parameters["rope_theta"])
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), mod.__name__


# --- public API ---------------------------------------------------------------------------------------
def test_public_op_default_and_forced():
    q, k = qk(1, 2, 1, 3, 16, 1, device="cpu")
    cos, sin = cos_sin(1, 3, 8, device="cpu")
    rq, rk = api.apply_rotary_pos_emb(q, k, cos, sin)
    eq, ek = apply_rotary_pos_emb_torch(q, k, cos, sin, 1)
    assert torch.equal(rq, eq) and torch.equal(rk, ek)
    q2, k2 = q.transpose(1, 2), k.transpose(1, 2)
    rq2, _ = api.apply_rotary_pos_emb(q2, k2, cos, sin, unsqueeze_dim=2)
    assert torch.equal(rq2, rq.transpose(1, 2))
    if INTERPRETED:
        _kernel()
        tq, tk = api.apply_rotary_pos_emb(q, k, cos, sin, backend="triton")
        assert torch.equal(tq, eq) and torch.equal(tk, ek)


@pytest.mark.parametrize("call,match", [
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=0), r"unsqueeze_dim=0 is not supported"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k, c[..., :5], s[..., :5]), r"rotary_dim\) must be even.*got 5"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k, c, s[..., :4]), r"sin must have cos's shape \(1, 3, 8\)"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k[:, :, :2], c, s), r"k must be \[B, H, T, D\] with B=1, T=3"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k.double(), c, s), r"k has dtype torch.float64 but q"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k, c[:, :2], s[:, :2]), r"cos must be \[B or 1, T, rotary_dim\]"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q[0], k, c, s), r"q must have 4 dimensions, got shape \(2, 3, 16\)"),
    (lambda q, k, c, s: api.apply_rotary_pos_emb(q, k, torch.randn(1, 3, 20), torch.randn(1, 3, 20)),
     r"in \[2, D=16\], got 20"),
])
def test_argument_errors(call, match):
    q, k = qk(1, 2, 1, 3, 16, 1, device="cpu")
    cos, sin = cos_sin(1, 3, 8, device="cpu")
    with pytest.raises(ValueError, match=match):
        call(q, k, cos, sin)


# --- Ascend NPU route with a stand-in torch_npu --------------------------------------------------------
def test_npu_route_selection_and_argument_mapping(monkeypatch):
    calls = []
    fake = types.ModuleType("torch_npu")

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        calls.append((x, r1, r2))
        assert x.dim() == 4 and r1.dim() == 4 and x.is_contiguous()
        x1, x2 = torch.chunk(x, 2, -1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    fake.npu_rotary_mul = npu_rotary_mul
    reg, impl = npu_route(monkeypatch, fake, rope_backends.register, api.ROPE)
    q, k = qk(2, 4, 2, 5, 32, 1, device="cpu")
    cos, sin = cos_sin(2, 5, 8, device="cpu")
    q.requires_grad_()
    qo, ko = impl(q, k, cos, sin, 1)
    x, r1, r2 = calls[-2]
    assert x.shape == (2, 4, 5, 8) and r1.shape == (2, 1, 5, 8)  # only the rotated slice, cos unsqueezed
    eq, ek = apply_rotary_pos_emb_torch(q.detach(), k, cos, sin, 1)
    assert torch.equal(qo, eq) and torch.equal(ko, ek)
    qo.sum().backward()
    assert q.grad is not None
    assert reg.select(api.ROPE, CallInfo(torch.device("cpu"), torch.float32, True)) is apply_rotary_pos_emb_torch


# --- GPU: bf16 at Qwen3.5-35B-A3B sizes ---------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("B,T,start", [(1, 4096, 0), (2, 1024, 0), (1, 512, 1_000_000 - 512), (1, 1, 5)])
def test_gpu_bf16_vs_stock_and_float64(B, T, start):
    k_ = _kernel()
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeTextRotaryEmbedding,
                                                                      apply_rotary_pos_emb)

    cfg = Qwen3_5MoeTextConfig(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256)
    rotary = Qwen3_5MoeTextRotaryEmbedding(cfg).to(DEVICE)
    q, k = qk(B, 16, 2, T, 256, 1, torch.bfloat16)
    pos = (torch.arange(T, device=DEVICE) + start)[None].expand(3, B, T)  # text positions, as the model passes them
    cos, sin = rotary(q, pos)
    assert cos.shape[-1] == 64 and torch.isfinite(cos).all() and torch.isfinite(sin).all()
    res = {}
    # one upstream gradient for all (randn_like would follow each output's memory layout)
    dq = torch.randn(B, 16, T, 256, device=DEVICE)
    dk = torch.randn(B, 2, T, 256, device=DEVICE)
    for name, fn, dt in (("triton", k_.apply_rotary_pos_emb_triton, torch.bfloat16),
                         ("stock", apply_rotary_pos_emb, torch.bfloat16),
                         ("f64", lambda q, k, c, s, ud=1: (naive_rotary(q, c, s), naive_rotary(k, c, s)),
                          torch.float64)):
        ql, kl = q.detach().to(dt).requires_grad_(), k.detach().to(dt).requires_grad_()
        qo, ko = fn(ql, kl, cos, sin)
        ((qo * dq.to(dt)).sum() + (ko * dk.to(dt)).sum()).backward()
        res[name] = (qo, ko, ql.grad, kl.grad)
    # same rounding points as the stock formula: the bf16 forward is identical to it
    assert torch.equal(res["triton"][0], res["stock"][0]) and torch.equal(res["triton"][1], res["stock"][1])
    for i, name in enumerate(("q_embed", "k_embed", "dq", "dk")):
        ours, theirs = rel_rms(res["triton"][i], res["f64"][i]), rel_rms(res["stock"][i], res["f64"][i])
        assert ours <= 1.25 * theirs + 1e-3, f"{name}: triton {ours:.2e} vs stock {theirs:.2e}"
        assert_rel_close(res["triton"][i], res["f64"][i], 1.6e-2, name)
