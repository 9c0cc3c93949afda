"""Fused linear cross-entropy: torch and Triton vs the float64 oracle, parity with transformers' ForCausalLMLoss,
the memory property (nothing of size tokens x vocab kept for the backward), edge cases and argument checks.

Without CUDA the Triton softmax step runs under the interpreter in fp32 on tiny shapes. ``gpu`` tests need
CUDA: bf16 at Qwen3.5's vocabulary.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from deltafuse.ops.cross_entropy import candidates as ce_backends
from deltafuse.backends.registry import CallInfo, Registry
from deltafuse.models import TINY_NAMES
from deltafuse.ops.cross_entropy import driver
from deltafuse.ops.cross_entropy.naive import naive_linear_cross_entropy
from tests.helpers import (  # noqa: E402
    DEVICE, INTERPRETED, assert_rel_close, assert_within_term_sizes, gpu, input_gen, input_seed, needs_cuda, rel_rms,
    triton_kernel_module,
)

OP = ce_backends.FUSED_LINEAR_CROSS_ENTROPY


def _api():
    from deltafuse.ops.cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy


def _kernel():
    return triton_kernel_module("deltafuse.ops.cross_entropy.kernel", "_ce_chunk_kernel")


def _inputs(B, T, H, V, *, bias=False, dtype=torch.float32, device=DEVICE, seed=0, scale=1.0):
    gen = input_gen(seed)
    hidden = (torch.randn(B, T, H, generator=gen) * scale).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / math.sqrt(H)).to(device, dtype).requires_grad_()
    b = (0.5 * torch.randn(V, generator=gen)).to(device, dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=gen).to(device)
    return hidden, weight, b, labels


def _grads(loss, tensors):
    tensors = [t for t in tensors if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def _compare(hidden, weight, bias, labels, tol, backend, **kw):
    """The op (given backend) vs the float64 oracle: loss and the gradient of hidden, weight and bias."""
    fl = _api()
    loss = fl(hidden, weight, labels, bias=bias, backend=backend, **kw)
    leaves = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None
              for t in (hidden, weight, bias)]
    kw_ref = {k: v for k, v in kw.items() if k not in ("chunk_size", "vocab_chunk_size")}
    ref = naive_linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], **kw_ref)
    assert loss.dtype == torch.promote_types(hidden.dtype, torch.float32)
    if torch.isnan(ref):
        assert torch.isnan(loss), f"expected NaN (every token ignored), got {loss}"
    else:
        assert_rel_close(loss.reshape(1), ref.reshape(1), tol, "loss")
    got = _grads(loss, (hidden, weight, bias))
    want_leaves = [t for t in leaves if t is not None and t.requires_grad]
    if ref.requires_grad and not torch.isnan(ref):
        want = torch.autograd.grad(ref, want_leaves, allow_unused=True)
    else:  # every token ignored: the stock loss gives zero gradients
        want = [torch.zeros_like(t) for t in want_leaves]
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        assert a is not None, f"d{name} missing"
        if b.abs().max() == 0:
            assert float(a.abs().max()) == 0.0, f"d{name} must be exactly zero"
        else:
            assert_rel_close(a, b, tol, f"d{name}")


def _labels_case(labels, case, V, ignore=-100):
    labels = labels.clone()
    if case == "ignored":
        labels[:, ::3] = ignore
    elif case == "single_valid":
        labels.fill_(ignore)
        labels[0, 2] = V - 1  # after the shift, position 1 predicts it: one counted token
    elif case == "all_ignored":
        labels.fill_(ignore)
    return labels


CASES = ["plain", "ignored", "single_valid", "all_ignored"]
KWARGS = [dict(), dict(reduction="sum"), dict(num_items_in_batch=11), dict(num_items_in_batch=torch.tensor(5)),
          dict(shift=False)]
# None: the small test vocabularies are projected whole (token chunks); 6: vocabulary blocks of 6 columns
# (V is not a multiple of it)
VOCAB_CHUNKS = pytest.mark.parametrize("vc", [None, 6], ids=["whole_vocab", "vocab_blocks"])


# --- torch reference vs float64 ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kw", KWARGS, ids=["mean", "sum", "num_items_int", "num_items_tensor", "noshift"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
@VOCAB_CHUNKS
def test_torch_matches_float64(case, kw, frozen, vc):
    B, T, H, V = 2, 7, 16, 37  # V and the 14 tokens are not multiples of the chunk (5)
    hidden, weight, bias, labels = _inputs(B, T, H, V, bias=not frozen)
    weight.requires_grad_(not frozen)
    _compare(hidden, weight, bias, _labels_case(labels, case, V), 2e-6, "torch", chunk_size=5,
             vocab_chunk_size=vc, **kw)


@pytest.mark.parametrize("chunk", [None, 1, 3, 14, 1000])
def test_chunk_size_does_not_change_the_result(chunk):
    hidden, weight, _, labels = _inputs(2, 7, 8, 29, seed=1)
    labels[1, 3] = -100
    _compare(hidden, weight, None, labels, 2e-6, "torch", chunk_size=chunk)


@VOCAB_CHUNKS
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
def test_float64_inputs_are_computed_in_float64(vc, frozen):
    hidden, weight, bias, labels = _inputs(1, 9, 8, 21, bias=True, dtype=torch.float64, device="cpu")
    weight.requires_grad_(not frozen)
    bias.requires_grad_(not frozen)
    _compare(hidden, weight, bias, labels, 1e-12, "torch", chunk_size=4, vocab_chunk_size=vc)


@VOCAB_CHUNKS
def test_custom_ignore_index_and_frozen_weight(vc):
    hidden, weight, _, labels = _inputs(2, 6, 8, 19, seed=3)
    weight.requires_grad_(False)
    labels[0, 1] = labels[1, 4] = 7  # 7 lies inside the vocabulary (and inside the second block of 6)
    fl = _api()
    loss = fl(hidden, weight, labels, ignore_index=7, chunk_size=4, vocab_chunk_size=vc)
    h64 = hidden.detach().double().requires_grad_()
    ref = naive_linear_cross_entropy(h64, weight.double(), labels, ignore_index=7)
    assert_rel_close(loss.reshape(1), ref.reshape(1), 2e-6, "loss")
    (dh,) = torch.autograd.grad(loss, hidden)
    assert_rel_close(dh, torch.autograd.grad(ref, h64)[0], 2e-6, "dhidden")
    assert weight.grad is None


@VOCAB_CHUNKS
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
def test_all_ignored_matches_stock_nan_and_zero_gradients(vc, frozen):
    hidden, weight, bias, labels = _inputs(1, 5, 8, 13, bias=True)
    weight.requires_grad_(not frozen)
    bias.requires_grad_(not frozen)
    labels.fill_(-100)
    fl = functools.partial(_api(), vocab_chunk_size=vc)
    loss = fl(hidden, weight, labels, bias=bias)
    assert torch.isnan(loss)
    for g in _grads(loss, (hidden, weight, bias)):
        assert torch.equal(g, torch.zeros_like(g))
    assert float(fl(hidden, weight, labels, num_items_in_batch=4).detach()) == 0.0
    assert float(fl(hidden, weight, labels, reduction="sum").detach()) == 0.0


@VOCAB_CHUNKS
def test_gradient_is_scaled_by_the_incoming_gradient(vc):
    hidden, weight, bias, labels = _inputs(2, 5, 8, 17, bias=True, seed=4)
    fl = functools.partial(_api(), vocab_chunk_size=vc, chunk_size=3)
    g1 = _grads(fl(hidden, weight, labels, bias=bias), (hidden, weight, bias))
    g3 = _grads(-2.5 * fl(hidden, weight, labels, bias=bias), (hidden, weight, bias))
    for a, b in zip(g1, g3):
        assert_rel_close(b, -2.5 * a, 1e-6)


@VOCAB_CHUNKS
def test_backward_twice_with_retained_graph_accumulates_correctly(vc):
    """The precomputed gradients are handed over unscaled for an incoming 1: a second backward must still add
    the same amount (nothing saved was modified in place)."""
    hidden, weight, bias, labels = _inputs(2, 5, 8, 17, bias=True, seed=15)
    loss = _api()(hidden, weight, labels, bias=bias, chunk_size=4, vocab_chunk_size=vc)
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (hidden, weight, bias)]
    loss.backward()
    for t, g in zip((hidden, weight, bias), first):
        assert_rel_close(t.grad, 2 * g, 1e-6)


def test_no_grad_computes_only_the_loss():
    hidden, weight, _, labels = _inputs(2, 5, 8, 17, seed=5)
    calls = []

    def spy(logits, targets, ignore_index, row_scale):
        calls.append(row_scale)
        return driver.chunk_softmax_grad_torch(logits, targets, ignore_index, row_scale)

    with torch.no_grad():
        loss, _ = driver.fused_linear_cross_entropy_chunked(hidden.reshape(-1, 8), weight, None,
                                                               labels.reshape(-1), -100, "mean", None, 4, False,
                                                               spy)
    assert calls and all(c is None for c in calls)
    assert not loss.requires_grad


# --- memory property -----------------------------------------------------------------------------------
def test_nothing_of_size_tokens_by_vocab_is_saved_or_built():
    """N x V = 64 x 1024 fp32 would be 256 KiB; nothing that large is saved for the backward, and no chunk's
    logits exceed chunk x V."""
    N, H, V, chunk = 64, 8, 1024, 16
    hidden, weight, bias, labels = _inputs(1, N, H, V, bias=True, seed=6)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    shapes = []

    def spy(logits, targets, ignore_index, row_scale):
        shapes.append(tuple(logits.shape))
        return driver.chunk_softmax_grad_torch(logits, targets, ignore_index, row_scale)

    targets = torch.cat([labels[0, 1:], labels.new_full((1,), -100)])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, logits = driver.fused_linear_cross_entropy_chunked(hidden.reshape(N, H), weight, bias, targets,
                                                                    -100, "mean", None, chunk, False, spy)
    assert logits is None
    assert saved, "the backward must keep the precomputed gradients"
    assert max(saved) < N * V, f"a saved tensor has {max(saved)} elements >= N*V = {N * V}"
    assert max(saved) <= max(V * H, N * H, V)
    assert shapes and all(s[0] <= chunk and s[1] == V for s in shapes)
    loss.backward()
    ref = naive_linear_cross_entropy(hidden.detach().double(), weight.detach().double(), labels,
                                     bias=bias.detach().double())
    assert_rel_close(loss.reshape(1), ref.reshape(1), 2e-6)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
def test_vocabulary_blocks_build_nothing_wider_than_a_block(frozen):
    """With vocabulary blocks no logits tile is wider than the block or taller than the chunk, nothing of
    size tokens x vocab is saved, and a frozen head projects every block once, a trainable one twice."""
    N, H, V, chunk, block = 64, 8, 1024, 16, 100
    hidden, weight, bias, labels = _inputs(1, N, H, V, bias=True, seed=6)
    weight.requires_grad_(not frozen)
    bias.requires_grad_(not frozen)
    shapes = {"online": [], "grad": []}

    def online(logits, *args):
        shapes["online"].append(tuple(logits.shape))
        return driver.online_block_step_torch(logits, *args)

    def grad(logits, *args):
        shapes["grad"].append(tuple(logits.shape))
        return driver.block_grad_step_torch(logits, *args)

    saved = []
    targets = torch.cat([labels[0, 1:], labels.new_full((1,), -100)])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
        loss = driver.fused_linear_cross_entropy_blocked(hidden.reshape(N, H), weight, bias, targets, -100,
                                                            "mean", None, chunk, block,
                                                            driver.BlockSteps(online, grad))
    blocks = -(-V // block) * (N // chunk)
    assert len(shapes["online"]) == blocks and len(shapes["grad"]) == (0 if frozen else blocks)
    assert all(c <= chunk and w <= block for c, w in shapes["online"] + shapes["grad"])
    assert saved and max(saved) < N * V
    ref = naive_linear_cross_entropy(hidden.detach().double().requires_grad_(), weight.detach().double(), labels,
                                     bias=bias.detach().double())
    assert_rel_close(loss.reshape(1), ref.reshape(1), 2e-6)


def test_vocabulary_block_rule():
    """By default only a frozen head with the Triton steps and a vocabulary above 8,192 gets 8,192-column
    blocks; logits always use whole-vocabulary chunks; an explicit size below V splits, one at or above V
    projects the whole vocabulary."""
    def rule(vocab, size=None, logits=False, trainable=False, triton=True):
        return driver.blocked_vocab_chunk(vocab, size, logits, trainable, triton)

    assert rule(248320) == 8192 and rule(8193) == 8192 and rule(8192) is None and rule(97) is None
    assert rule(248320, trainable=True) is None and rule(248320, triton=False) is None
    assert rule(248320, logits=True) is None and rule(248320, 4096, logits=True) is None
    assert rule(248320, 4096, trainable=True, triton=False) == 4096
    assert rule(97, 96) == 96 and rule(97, 97) is None and rule(97, 1000) is None


@pytest.mark.parametrize("backend,trainable,blocked", [("triton", False, True), ("triton", True, False),
                                                       ("torch", False, False)])
def test_default_way_per_backend_and_head(backend, trainable, blocked, monkeypatch):
    """The public op's default follows the rule: vocabulary blocks for a frozen head on the Triton steps."""
    if backend == "triton":
        _kernel()
    monkeypatch.setattr(driver, "VOCAB_CHUNK", 8)  # the test vocabulary (37) counts as large
    hidden, weight, _, labels = _inputs(1, 6, 8, 37, seed=22)
    weight.requires_grad_(trainable)
    ways = []
    monkeypatch.setattr(driver, "_blocked_pass", _spy(driver._blocked_pass, ways, "blocked"))
    monkeypatch.setattr(driver, "_chunked_pass", _spy(driver._chunked_pass, ways, "chunked"))
    loss = _api()(hidden, weight, labels, backend=backend)
    assert ways == ["blocked" if blocked else "chunked"]
    ref = naive_linear_cross_entropy(hidden.detach().double(), weight.detach().double(), labels)
    assert_rel_close(loss.reshape(1), ref.reshape(1), 2e-6)


def _spy(fn, log, name):
    def run(*args, **kwargs):
        log.append(name)
        return fn(*args, **kwargs)
    return run


def test_public_op_through_a_model_graph_saves_no_logits():
    """The same property through the public op inside a larger graph (a linear layer before the head)."""
    N, H, V = 48, 8, 2048
    hidden, weight, _, labels = _inputs(1, N, H, V, seed=7)
    pre = torch.nn.Linear(H, H).to(DEVICE)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
        loss = _api()(pre(hidden), weight, labels, chunk_size=8)
    assert max(saved) < N * V
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None and pre.weight.grad is not None


# --- tied embeddings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("trainable", [False, True])
@VOCAB_CHUNKS
def test_tied_embedding(trainable, vc):
    """weight is the input embedding: frozen -> only hidden (and what made it) gets a gradient; trainable ->
    the weight's gradient sums the embedding and head paths."""
    gen = input_gen(8)
    V, H, T = 23, 8, 9
    emb = (torch.randn(V, H, generator=gen) / 3).to(DEVICE).requires_grad_(trainable)
    mix = torch.randn(H, H, generator=gen).to(DEVICE).requires_grad_()
    ids = torch.randint(0, V, (2, T), generator=gen).to(DEVICE)
    labels = ids.clone()
    labels[0, :2] = -100

    def run(e, m, fn):
        hidden = torch.tanh(F.embedding(ids, e) @ m)
        return fn(hidden, e)

    loss = run(emb, mix, lambda h, e: _api()(h, e, labels, chunk_size=4, vocab_chunk_size=vc))
    emb64 = emb.detach().double().requires_grad_(trainable)
    mix64 = mix.detach().double().requires_grad_()
    ref = run(emb64, mix64, lambda h, e: naive_linear_cross_entropy(h, e, labels))
    assert_rel_close(loss.reshape(1), ref.reshape(1), 2e-6, "loss")
    targets = [mix] + ([emb] if trainable else [])
    got = torch.autograd.grad(loss, targets)
    want = torch.autograd.grad(ref, [mix64] + ([emb64] if trainable else []))
    for a, b in zip(got, want):
        assert_rel_close(a, b, 2e-6)
    assert emb.grad is None


def test_return_logits_equals_the_projection_without_gradient():
    hidden, weight, bias, labels = _inputs(2, 5, 8, 19, bias=True, seed=9)
    loss, logits = _api()(hidden, weight, labels, bias=bias, chunk_size=3, return_logits=True)
    assert logits.shape == (2, 5, 19) and not logits.requires_grad
    assert torch.allclose(logits, F.linear(hidden, weight, bias).detach(), atol=1e-6, rtol=1e-6)
    assert torch.equal(loss, _api()(hidden, weight, labels, bias=bias, chunk_size=3))


# --- Triton softmax step (interpreted on CPU) ----------------------------------------------------------
@pytest.mark.parametrize("V", [1, 37, 1500])
def test_triton_chunk_step_matches_torch(V):
    k = _kernel()
    gen = input_gen(V)
    x = (3 * torch.randn(6, V, generator=gen)).to(DEVICE)
    x[2, :] += 80.0  # large logits: the running max must keep exp finite
    t = torch.randint(0, V, (6,), generator=gen).to(DEVICE)
    t[1] = -100
    scale = torch.tensor([0.5, 0.0, 0.25, 1.0, 2.0, 0.5], device=DEVICE)
    r_ref, g_ref = driver.chunk_softmax_grad_torch(x.double(), t, -100, scale.double())  # the float64 step
    buf = x.clone()
    r, g = k.chunk_softmax_grad_triton(buf, t, -100, scale)
    assert g.data_ptr() == buf.data_ptr(), "the gradient is written over the logits in place"
    # Each element against the float64 step, within a few fp32 roundings of its terms: x - lse is rounded at the
    # size of |x| + |lse| (lse itself from a sum of V exponentials), so p = exp(x - lse) carries that absolute error
    # as a relative one (the old fp32-vs-fp32 peak check failed on a probability of 0.6 off by 1.2e-6 relative).
    # The torch fp32 step and the kernel stay within 0.9 roundings of these sizes over 300 draws of the three V.
    xd, valid = x.double(), t != -100
    lse = torch.logsumexp(xd, dim=-1, keepdim=True)
    terms = xd.abs() + 2 * lse.abs() + math.log2(V) + 4
    onehot = torch.zeros_like(xd)
    onehot[valid, t[valid]] = 1.0
    g_size = scale.double().abs()[:, None] * ((xd - lse).exp() * terms + onehot)
    x_t = xd.gather(1, torch.where(valid, t, 0)[:, None])
    r_size = valid.double() * (lse.abs() + x_t.abs() + math.log2(V) + 4)[:, 0]
    fp32_rounding = 2.0 ** -24
    assert_within_term_sizes(r, r_ref, r_size, 4 * fp32_rounding, "row losses")
    assert_within_term_sizes(g, g_ref, g_size, 4 * fp32_rounding, "dlogits")
    assert torch.all(r[~valid] == 0) and torch.all(g[~valid] == 0)
    r2, none = k.chunk_softmax_grad_triton(x.clone(), t, -100, None)
    assert none is None and torch.equal(r2, r)


@pytest.mark.parametrize("w,v0", [(1, 0), (37, 30), (1500, 700)])
@pytest.mark.parametrize("hdim", [None, 5, 1100], ids=["no_acc", "acc5", "acc1100"])
def test_triton_block_steps_match_torch(w, v0, hdim):
    """The online step (running max / sum / target logit; with an accumulator: its rescaling and the
    probabilities in place) and the gradient step, for a block of w columns starting at v0, against the torch
    steps; targets inside and outside the block, an ignored row, and a row whose logits jump by 80 (the
    running maximum must move)."""
    k = _kernel()
    gen = input_gen(w + v0)
    x = (3 * torch.randn(6, w, generator=gen)).to(DEVICE)
    x[2, :] += 80.0
    t = (v0 + torch.randint(0, w, (6,), generator=gen)).to(DEVICE)
    t[1] = -100
    t[4] = v0 + w + 3  # outside the block
    t[5] = max(v0 - 1, 0) if v0 else v0 + w  # just before (or after) the block
    stats = [torch.randn(6, generator=gen).to(DEVICE), (1 + torch.rand(6, generator=gen)).to(DEVICE),
             torch.randn(6, generator=gen).to(DEVICE)]
    stats[0][3] = float("-inf")  # a row seeing its first block
    stats[0][0] = x[0].max() + 1.0  # a row whose maximum does not move (its accumulator stays as it is)
    acc = torch.randn(6, hdim, generator=gen).to(DEVICE) if hdim else None
    ref_stats = [s.clone() for s in stats]
    ref_acc = acc.clone() if hdim else None
    p_ref = driver.online_block_step_torch(x.clone(), t, v0, -100, *ref_stats, ref_acc)
    buf = x.clone()
    p = k.online_block_step_triton(buf, t, v0, -100, *stats, acc)
    for name, got, want in zip(("max", "sum", "target logit"), stats, ref_stats):
        assert_rel_close(got, want, 1e-6, name)
    if hdim:
        assert p.data_ptr() == buf.data_ptr(), "the probabilities are written over the logits in place"
        assert_rel_close(p, p_ref, 1e-6, "probabilities")
        assert_rel_close(acc, ref_acc, 1e-6, "rescaled accumulator")
    else:
        assert p is None and p_ref is None and torch.equal(buf, x)
    lse = torch.logsumexp(x, 1) + torch.rand(6, generator=gen).to(DEVICE)
    scale = torch.tensor([0.5, 0.0, 0.25, 1.0, 2.0, 0.5], device=DEVICE)
    g_ref = driver.block_grad_step_torch(x.clone(), t, v0, -100, lse, scale)
    buf = x.clone()
    g = k.block_grad_step_triton(buf, t, v0, -100, lse, scale)
    assert g.data_ptr() == buf.data_ptr()
    assert_rel_close(g, g_ref, 1e-6, "block gradient")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kw", KWARGS[:3], ids=["mean", "sum", "num_items"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
@VOCAB_CHUNKS
def test_triton_backend_matches_float64(case, kw, frozen, vc):
    _kernel()
    B, T, H, V = 2, 6, 16, 45
    hidden, weight, bias, labels = _inputs(B, T, H, V, bias=not frozen, seed=10)
    weight.requires_grad_(not frozen)
    _compare(hidden, weight, bias, _labels_case(labels, case, V), 2e-6, "triton", chunk_size=5,
             vocab_chunk_size=vc, **kw)


# --- parity with transformers ---------------------------------------------------------------------------
def _hf_loss():
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(num_items_in_batch=torch.tensor(9)), dict(num_items_in_batch=4)],
                         ids=["mean", "num_items_tensor", "num_items_int"])
@pytest.mark.parametrize("case", ["ignored", "single_valid", "all_ignored"])
def test_equals_transformers_for_causal_lm_loss(dtype, kw, case):
    hf_loss = _hf_loss()
    B, T, H, V = 2, 9, 16, 53
    hidden, weight, _, labels = _inputs(B, T, H, V, dtype=dtype, device="cpu", seed=11, scale=2.0)
    labels = _labels_case(labels, case, V)
    stock = hf_loss(F.linear(hidden, weight), labels, V, **kw)
    ours = _api()(hidden, weight, labels, chunk_size=4, **kw)
    g_stock = torch.autograd.grad(stock, (hidden, weight))
    g_ours = torch.autograd.grad(ours, (hidden, weight))
    assert ours.dtype == stock.dtype == torch.float32
    if torch.isnan(stock):
        assert torch.isnan(ours)
    else:
        assert abs(float(ours.detach()) - float(stock.detach())) <= 1e-6 * max(1.0, abs(float(stock.detach())))
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: weight gradient is summed over chunks in bf16-rounded parts
    for a, b, name in zip(g_ours, g_stock, ("hidden", "weight")):
        assert a.dtype == b.dtype == dtype
        if b.abs().max() == 0:
            assert torch.equal(a, b), name
        else:
            assert rel_rms(a, b) <= tol, f"d{name}: {rel_rms(a, b):.2e}"


def test_equals_transformers_with_shift_labels():
    """transformers' shift_labels (already aligned labels) is shift=False."""
    hf_loss = _hf_loss()
    hidden, weight, _, labels = _inputs(1, 8, 8, 31, device="cpu", seed=12)
    shifted = torch.cat([labels[:, 1:], labels.new_full((1, 1), -100)], dim=1)
    stock = hf_loss(F.linear(hidden, weight), None, 31, shift_labels=shifted)
    ours = _api()(hidden, weight, shifted, shift=False, chunk_size=3)
    assert abs(float(ours.detach()) - float(stock.detach())) <= 1e-6 * abs(float(stock.detach()))


# --- selection and argument checks -----------------------------------------------------------------------
def test_candidate_rules():
    reg = Registry()
    ce_backends.register(reg)
    rows = {d.candidate: d for d in reg.explain(OP, CallInfo(torch.device("cpu"), torch.float32, True))}
    assert rows["torch"].chosen
    if INTERPRETED:
        assert "only when forced" in rows["triton"].reason
    rows = {d.candidate: d for d in reg.explain(OP, CallInfo(torch.device("cpu"), torch.bfloat16, True), "triton")}
    assert not rows["triton"].chosen and rows["triton"].reason
    rows = {d.candidate: d for d in reg.explain(OP, CallInfo(torch.device("cpu"), torch.float64, True))}
    assert rows["torch"].chosen


@pytest.mark.parametrize("call,match", [
    (lambda h, w, l: _api()(h, w[:, :3], l), r"weight must be \[V, H\] = \[V, 8\].*got \(13, 3\)"),
    (lambda h, w, l: _api()(h, w.double(), l), r"weight has dtype torch.float64 but hidden has torch.float32"),
    (lambda h, w, l: _api()(h, w, l.float()), r"labels has dtype float32; allowed: int64"),
    (lambda h, w, l: _api()(h, w, l[:, :2]), r"labels must have shape hidden.shape\[:-1\] = \(2, 5\), got \(2, 2\)"),
    (lambda h, w, l: _api()(h, w, l, reduction="none"), r"reduction must be one of 'mean', 'sum', got 'none'"),
    (lambda h, w, l: _api()(h, w, l, reduction="sum", num_items_in_batch=3),
     r"num_items_in_batch=3 .* needs reduction='mean', got reduction='sum'"),
    (lambda h, w, l: _api()(h, w, l, num_items_in_batch=-1), r"num_items_in_batch must be .* got -1"),
    (lambda h, w, l: _api()(h, w, l, num_items_in_batch=torch.ones(2)), r"num_items_in_batch must be .*shape \(2,\)"),
    (lambda h, w, l: _api()(h, w, l, chunk_size=0), r"chunk_size must be None or an int >= 1, got 0"),
    (lambda h, w, l: _api()(h, w, l, vocab_chunk_size=2.0),
     r"vocab_chunk_size must be None or an int >= 1, got 2.0"),
    (lambda h, w, l: _api()(h, w, l, ignore_index=1.5), r"ignore_index must be an int, got 1.5"),
    (lambda h, w, l: _api()(h, w, l, bias=torch.zeros(4)), r"bias must be \[V\] = \(13,\).*got \(4,\)"),
    (lambda h, w, l: _api()(h, w, l + 13),
     r"labels must lie in \[0, 13\) or equal ignore_index=-100, got (1[3-9]|2[0-5])$"),
    (lambda h, w, l: _api()(h, w, l, shift=1), r"shift must be True or False, got 1"),
    (lambda h, w, l: _api()(h, w, l, bogus=1), r"unexpected keyword.*'bogus'"),
])
def test_argument_errors_name_argument_value_and_allowed(call, match):
    h, w, _, l = _inputs(2, 5, 8, 13, device="cpu")
    with pytest.raises(ValueError, match=match):
        call(h, w, l)


# --- GPU: bf16 at Qwen3.5's vocabulary ---------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
@pytest.mark.parametrize("vc", [None, 4096, 248320], ids=["default", "vocab_blocks", "whole_vocab"])
def test_gpu_bf16_matches_transformers_at_full_vocab(backend, frozen, vc):
    hf_loss = _hf_loss()
    N, H, V = 2048, 2048, 248320
    hidden, weight, _, labels = _inputs(1, N, H, V, dtype=torch.bfloat16, device="cuda", seed=13)
    weight.requires_grad_(not frozen)
    labels[0, ::7] = -100
    leaves = (hidden,) if frozen else (hidden, weight)
    stock = hf_loss(F.linear(hidden, weight), labels, V)
    g_stock = torch.autograd.grad(stock, leaves)
    ours = _api()(hidden, weight, labels, backend=backend, vocab_chunk_size=vc)
    g_ours = torch.autograd.grad(ours, leaves)
    assert abs(float(ours.detach()) - float(stock.detach())) <= 2e-3 * abs(float(stock.detach()))
    for a, b in zip(g_ours, g_stock):
        assert rel_rms(a, b) < 2e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
@pytest.mark.parametrize("vc", [1000, 5003], ids=["vocab_blocks", "whole_vocab"])
def test_gpu_fp32_triton_matches_float64(frozen, vc):
    hidden, weight, bias, labels = _inputs(2, 300, 64, 5003, bias=not frozen, device="cuda", seed=14)
    weight.requires_grad_(not frozen)
    labels[:, ::5] = -100
    _compare(hidden, weight, bias, labels, 1e-4, "triton", chunk_size=128, vocab_chunk_size=vc)


@gpu
@needs_cuda
def test_gpu_mixed_precision_accumulation_is_exact_in_fp32():
    """The fp32 accumulator path (16-bit matmul inputs, fp32 sum): against the same sum in float64."""
    gen = input_gen(21)
    a = torch.randn(300, 512, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(512, 700, generator=gen).to("cuda", torch.bfloat16)
    acc = torch.randn(300, 700, generator=gen).to("cuda")
    want = acc.double() + a.double() @ b.double()
    driver._add_mm(acc, a, b)
    assert rel_rms(acc, want) < 1e-6


# --- model level: the loss-path adapter of the transformers patch layer ---------------------------------------
def _fused_causal_lm_forward(original):
    from deltafuse.integrations.transformers.adapters_loss import wrap_causal_lm_forward

    return wrap_causal_lm_forward(original)


@pytest.mark.parametrize("name", list(TINY_NAMES))
def test_patched_tiny_models_equal_stock_loss_and_every_gradient(name, monkeypatch):
    pytest.importorskip("transformers")
    from deltafuse.models import build_model
    from tests.ops.test_moe import _adapter

    model = build_model(name, seed=input_seed("model", 16), vocab_size=97, num_hidden_layers=2,
                        layer_types=["linear_attention", "full_attention"]).train()
    ids = torch.randint(0, 97, (2, 11), generator=input_gen(17))
    labels = ids.clone()
    labels[0, :3] = -100
    kwargs = dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(15))
    moe = hasattr(model.config, "num_experts")
    if moe:
        kwargs["output_router_logits"] = True  # the router aux loss joins the loss as in stock

    def run():
        model.zero_grad(set_to_none=True)
        out = model(**kwargs)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    stock_out, stock_grads = run()
    assert stock_out.logits is not None
    # the float64 oracle: stock transformers on a float64 copy (eager experts: grouped_mm takes no float64)
    oracle = copy.deepcopy(model).double()
    if moe:
        oracle.set_experts_implementation("eager")
    oracle.zero_grad(set_to_none=True)
    oracle(**kwargs).loss.backward()
    exact = {n: p.grad.detach() for n, p in oracle.named_parameters() if p.grad is not None}
    monkeypatch.setattr(type(model), "forward", _fused_causal_lm_forward(type(model).forward))
    if moe:
        from transformers.integrations.moe import ExpertsInterface

        adapter = _adapter()
        monkeypatch.setitem(ExpertsInterface._global_mapping, "deltafuse", adapter)
        previous = model.config._experts_implementation  # transformers 5.9 has no get_experts_implementation
        model.set_experts_implementation("deltafuse")
    try:
        ours_out, ours_grads = run()
    finally:
        if moe:
            model.set_experts_implementation(previous)
    if moe:
        assert adapter.calls and set(adapter.calls) == {"deltafuse"}
    assert ours_out.logits is None
    assert abs(float(ours_out.loss.detach()) - float(stock_out.loss.detach())) <= 2e-6 * float(stock_out.loss.detach())
    assert set(ours_grads) == set(stock_grads) == set(exact)
    scale = max(g.abs().max().item() for g in exact.values())
    for n in stock_grads:
        # as close to float64 as stock fp32 is, or within 2e-5 of it, or within fp32 rounding of the largest
        # gradient (assert_grads_close's floor): the decay parameters (A_log, dt_bias) sum cancelling terms over
        # every token, so both sides' error swings with the draw (30 draws: stock 1e-7 - 2e-3, deltafuse alike)
        stock_err = float((stock_grads[n].double() - exact[n]).norm() / exact[n].norm())
        if (ours_grads[n].double() - exact[n]).abs().max().item() > 1e-6 * scale:
            assert_rel_close(ours_grads[n], exact[n], max(2e-5, 1.5 * stock_err), n)
    with torch.no_grad():  # evaluation: stock path, logits returned
        assert model(**kwargs).logits is not None


def test_default_chunk_size_rule():
    """chunk * V ~ tokens * H (power of two), at least 256 tokens, at least 1,024 with a trainable head."""
    d = driver.default_chunk_size
    assert d(4096, 248320, 2048) == 256 and d(16384, 248320, 2048) == 256 and d(65536, 248320, 2048) == 1024
    assert d(65536, 248320, 4096) == 2048
    assert d(4096, 248320, 2048, trainable_head=True) == 1024
    assert d(14, 37, 16) == 14 and d(1, 37, 16) == 1 and d(0, 37, 16) == 1


def test_benchmark_script_imports_and_parses_on_cpu(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loss_moe.py"
    spec = importlib.util.spec_from_file_location("bench_loss_moe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(tmp_path / "x.json"), "--dry-run", "--tokens", "4096", "--chunk-sizes", "256",
                       "--blocks", "512x4096"]) == 0
    out = capsys.readouterr().out
    assert "tokens=4096" in out and "E=256 top-8 I=512 H=2048" in out and "[256]" in out and "512x4096" in out
    for bad in (["--top-k", "300"], ["--blocks", "512"], ["--blocks", "0x4096"], ["--blocks", "ax4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_adapter_with_peft_lora_on_the_head(dropout, monkeypatch):
    """LoRA on lm_head: served with the effective weight (same loss and LoRA gradients as stock); with LoRA
    dropout (not expressible as a weight) the stock path serves."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from deltafuse.models import build_model

    model = build_model("tiny", seed=input_seed("model", 18), vocab_size=97, num_hidden_layers=2,
                        layer_types=["linear_attention", "full_attention"]).train()
    model = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, target_modules=["lm_head", "out_proj"], lora_dropout=dropout, init_lora_weights=False),
        model)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert any("lm_head" in n for n in lora)
    ids = torch.randint(0, 97, (1, 9), generator=input_gen(19))

    def run():
        torch.manual_seed(input_seed(20))  # same dropout masks in both runs
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in lora.items()}

    stock, stock_grads = run()
    monkeypatch.setattr(type(model), "forward", _fused_causal_lm_forward(type(model).forward))
    ours, ours_grads = run()
    if dropout:
        assert ours.logits is not None, "LoRA dropout on the head must take the stock path"
        assert float(ours.loss.detach()) == float(stock.loss.detach())
        return
    assert ours.logits is None, "a LoRA head without dropout is served by the fused loss"
    assert abs(float(ours.loss.detach()) - float(stock.loss.detach())) <= 2e-6 * float(stock.loss.detach())
    for n in stock_grads:
        assert_rel_close(ours_grads[n], stock_grads[n], 2e-5, n)


# --- token accuracy ------------------------------------------------------------------------------------
def _accuracy_reference(hidden, weight, bias, targets, ignore_index=-100):
    """Fraction of counted targets equal to the argmax of the full float64 logits (first maximum on ties)."""
    logits = hidden.detach().double().reshape(-1, hidden.shape[-1]) @ weight.detach().double().t()
    if bias is not None:
        logits = logits + bias.detach().double()
    valid = targets != ignore_index
    return ((logits.argmax(-1) == targets) & valid).sum().item() / valid.sum().item()


def _half_predicted(hidden, weight, bias, labels, seed):
    """labels with one ignored label per row (column 2) whose shifted targets are the float64 argmax on half of
    the scored positions (rounded down, drawn at random) and another class on the rest: the same accuracy whatever
    the draw."""
    logits = hidden.detach().double() @ weight.detach().double().t() + bias.detach().double()
    pred = logits.argmax(-1).cpu()
    B, T = labels.shape
    gen = input_gen(seed)
    shifted_pred = torch.nn.functional.pad(pred, (1, 0))[..., :-1]  # label t + 1 is predicted at position t
    missed = (shifted_pred + torch.randint(1, weight.shape[0], (B, T), generator=gen)) % weight.shape[0]
    scored = torch.ones(B, T, dtype=torch.bool)
    scored[:, [0, 2]] = False  # the first label is no target; column 2 is ignored
    where = scored.reshape(-1).nonzero().squeeze(1)
    take = torch.zeros(B * T, dtype=torch.bool)
    take[where[torch.randperm(len(where), generator=gen)[: len(where) // 2]]] = True
    out = torch.where(take.view(B, T), shifted_pred, missed).to(labels.device)
    out[..., 2] = -100
    return out


@pytest.mark.parametrize("backend,vocab_chunk_size", [("torch", None), ("torch", 8), ("triton", None),
                                                      ("triton", 8)])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen_head", "trainable_head"])
def test_token_accuracy_matches_argmax_of_full_logits(backend, vocab_chunk_size, trainable):
    """Whole-vocabulary chunks and vocabulary blocks count the same hits as the argmax of the full logits;
    the loss and gradients are those of the call without accuracy; logits and accuracy come together."""
    if backend == "triton":
        _kernel()
    hidden, weight, bias, labels = _inputs(2, 9, 8, 37, bias=True, seed=31)
    weight.requires_grad_(trainable)
    labels = _half_predicted(hidden, weight, bias, labels, 32)
    fl = _api()
    loss, acc = fl(hidden, weight, labels, bias=bias, backend=backend, chunk_size=4,
                   vocab_chunk_size=vocab_chunk_size, return_token_accuracy=True)
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    logits = hidden.detach().double().reshape(-1, 8) @ weight.detach().double().t() + bias.detach().double()
    want = _accuracy_reference(hidden, weight, bias, targets)
    assert want == 0.5  # 7 of the 14 scored targets (2 rows of 9 labels: no target for the first, column 2 ignored)
    assert acc.dtype == torch.float32 and not acc.requires_grad and acc.item() == pytest.approx(want, abs=1e-7)
    plain = fl(hidden, weight, labels, bias=bias, backend=backend, chunk_size=4, vocab_chunk_size=vocab_chunk_size)
    assert loss.item() == plain.item()
    got = _grads(loss, (hidden, weight, bias))
    ref = _grads(plain, (hidden, weight, bias))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    loss2, logits2, acc2 = fl(hidden, weight, labels, bias=bias, backend=backend, return_logits=True,
                              return_token_accuracy=True)
    assert acc2.item() == pytest.approx(want, abs=1e-7)
    assert_rel_close(logits2.reshape(-1, 37), logits.float(), 1e-6, "logits")


@pytest.mark.parametrize("vocab_chunk_size", [None, 4], ids=["chunks", "blocks"])
def test_token_accuracy_ties_go_to_the_first_index_and_all_ignored_is_nan(vocab_chunk_size):
    """Duplicate head rows give exactly tied logits: the lower index is the prediction (torch.argmax's rule),
    also when the tie spans two vocabulary blocks."""
    hidden, weight, _, _ = _inputs(1, 6, 8, 12, seed=33)
    w = weight.detach().clone()
    # rows 2 and 9 tie everywhere (blocks of 4: columns 2 and 9 sit in different blocks), twice as long as any
    # other row, so that hidden states along them give every row's largest logits to the tied pair
    w[2] *= 2 * w.norm(dim=1).max() / w[2].norm()
    w[9] = w[2]
    h = w[2] * 4.0 + 0.1 * hidden.detach()
    logits = h.reshape(-1, 8).double() @ w.double().t()
    assert (logits[:, 2] == logits[:, 9]).all() and (logits.argmax(-1) == 2).all()
    fl = _api()
    first = torch.full((1, 6), 2)
    second = torch.full((1, 6), 9)
    _, acc = fl(h, w, first, backend="torch", vocab_chunk_size=vocab_chunk_size, return_token_accuracy=True)
    assert acc.item() == 1.0
    _, acc = fl(h, w, second, backend="torch", vocab_chunk_size=vocab_chunk_size, return_token_accuracy=True)
    assert acc.item() == 0.0
    _, acc = fl(h, w, torch.full((1, 6), -100), backend="torch", vocab_chunk_size=vocab_chunk_size,
                return_token_accuracy=True)
    assert math.isnan(acc.item())
    with pytest.raises(ValueError, match=r"return_token_accuracy must be True or False, got 1"):
        fl(h, w, first, return_token_accuracy=1)
