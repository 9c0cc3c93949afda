"""Per-token log-probabilities (``ops.token_logprobs``): torch and Triton vs a float64 oracle from the full logits
and vs TRL's own ``ChunkedLogProbFunction`` (skipped without TRL): log_probs, entropy, is_top1 and every gradient
with random per-token upstream gradients, ignored rows, N=1, vocabularies not a multiple of the block,
temperature, ties, autocast, argument checks.

Without CUDA the Triton steps run under the interpreter in fp32 on tiny shapes. ``gpu`` tests need CUDA: bf16 at
Qwen3.5's head (hidden 2,048, vocabulary 248,320) against TRL's function.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltafuse.ops.cross_entropy.naive import naive_token_logprobs
from tests.helpers import DEVICE, assert_rel_close, gpu, input_gen, needs_cuda, rel_rms, triton_kernel_module

ALL = ("log_probs", "entropy", "is_top1")


def _op():
    from deltafuse.ops import token_logprobs

    return token_logprobs


def _backend(name):
    if name == "triton":
        triton_kernel_module("deltafuse.ops.cross_entropy.kernel", "_tok_online_kernel")
    return name


def _inputs(N, H, V, *, bias=False, trainable=True, dtype=torch.float32, device=DEVICE, seed=0, ignored=()):
    gen = input_gen(seed)
    hidden = torch.randn(N, H, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 1.5 / math.sqrt(H)).to(device, dtype).requires_grad_(trainable)
    b = (0.5 * torch.randn(V, generator=gen)).to(device, dtype).requires_grad_(trainable) if bias else None
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    for i in ignored:
        targets[i] = -100
    return hidden, weight, b, targets


def _upstream(n, seed, device=DEVICE):
    gen = input_gen(seed)
    return (torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device))


def _leaves(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]


def _oracle(hidden, weight, bias, targets, temperature, g_lp, g_ent):
    """float64 log_probs, entropy, is_top1 and the gradients of sum(g_lp * log_probs + g_ent * entropy)."""
    leaves64 = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None
                for t in (hidden, weight, bias)]
    lp, ent, top1 = naive_token_logprobs(*leaves64[:2], targets, bias=leaves64[2], temperature=temperature)
    objective = (lp * g_lp.double()).sum() + ((ent * g_ent.double()).sum() if g_ent is not None else 0)
    grads = torch.autograd.grad(objective, [t for t in leaves64 if t is not None and t.requires_grad])
    return lp, ent, top1, grads


def _check(hidden, weight, bias, targets, *, backend, temperature=1.0, outputs=ALL, tol=1e-5, seed=1, **kw):
    out = _op()(hidden, weight, targets, bias=bias, temperature=temperature, outputs=outputs, backend=backend, **kw)
    g_lp, g_ent = _upstream(targets.numel(), seed)
    if "entropy" not in outputs:
        g_ent = None
    lp, ent, top1, want = _oracle(hidden, weight, bias, targets, temperature, g_lp, g_ent)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == targets.shape
    assert_rel_close(out.log_probs, lp, tol, "log_probs")
    if "entropy" in outputs:
        assert_rel_close(out.entropy, ent, tol, "entropy")
    else:
        assert out.entropy is None
    if "is_top1" in outputs:
        assert out.is_top1.dtype == torch.bool and torch.equal(out.is_top1, top1)
        assert not out.is_top1.requires_grad
    else:
        assert out.is_top1 is None
    objective = (out.log_probs * g_lp).sum() + ((out.entropy * g_ent).sum() if g_ent is not None else 0)
    got = torch.autograd.grad(objective, _leaves(hidden, weight, bias))
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        assert_rel_close(a, b, tol, f"d/d{name}")
    return out


# --- float64 oracle ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen_head", "trainable_head"])
@pytest.mark.parametrize("outputs", [("log_probs",), ALL, ("log_probs", "is_top1")], ids=["lp", "all", "lp_top1"])
def test_matches_float64_oracle(backend, trainable, outputs):
    """Vocabulary 37 in blocks of 16 (not a multiple), chunks of 3 tokens, a bias, ignored rows."""
    hidden, weight, bias, targets = _inputs(8, 16, 37, bias=True, trainable=trainable, seed=3, ignored=(2, 5))
    out = _check(hidden, weight, bias, targets, backend=_backend(backend), outputs=outputs, vocab_chunk_size=16,
                 chunk_size=3)
    for field in (out.log_probs, out.entropy, out.is_top1):
        if field is not None:
            assert not bool(field[[2, 5]].any())  # ignored rows: 0, 0, False


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen_head", "trainable_head"])
def test_default_tiling_and_temperature(backend, trainable):
    hidden, weight, bias, targets = _inputs(11, 8, 53, trainable=trainable, seed=4, ignored=(0,))
    _check(hidden, weight, bias, targets, backend=_backend(backend), temperature=0.7)
    _check(hidden, weight, bias, targets, backend=_backend(backend), temperature=1.9, vocab_chunk_size=20, seed=2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_token(backend):
    hidden, weight, bias, targets = _inputs(1, 8, 29, bias=True, seed=5)
    _check(hidden, weight, bias, targets, backend=_backend(backend), vocab_chunk_size=8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_row_ignored_gives_zeros_and_zero_gradients(backend):
    hidden, weight, _, targets = _inputs(4, 8, 19, seed=6, ignored=range(4))
    out = _op()(hidden, weight, targets, outputs=ALL, backend=_backend(backend), vocab_chunk_size=8)
    assert not out.log_probs.any() and not out.entropy.any() and not out.is_top1.any()
    g = torch.autograd.grad((out.log_probs * 3).sum() + out.entropy.sum(), (hidden, weight))
    assert all(not t.any() for t in g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_shape_is_kept(backend):
    hidden, weight, _, targets = _inputs(6, 8, 23, seed=7)
    out = _op()(hidden.view(2, 3, 8), weight, targets.view(2, 3), outputs=ALL, backend=_backend(backend))
    flat = _op()(hidden, weight, targets, outputs=ALL, backend="torch")
    assert out.log_probs.shape == (2, 3) and out.is_top1.shape == (2, 3)
    assert_rel_close(out.log_probs.reshape(-1), flat.log_probs, 1e-6, "log_probs")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ties_go_to_the_first_index(backend):
    """Duplicated head rows make exact ties: the target is top-1 only when it is the first maximal index,
    also when the tie spans two vocabulary blocks."""
    gen = input_gen(8)
    H, V = 8, 24
    weight = torch.randn(V, H, generator=gen)
    # rows 3 and 5 twice as long as any other: along either, its own product is the largest (Cauchy-Schwarz)
    longest = weight.norm(dim=1).max()
    for r in (3, 5):
        weight[r] *= 2 * longest / weight[r].norm()
    weight = weight.to(DEVICE)
    weight[13] = weight[3]   # tie inside block 0 (columns 0-7) against block 1 (8-15)
    weight[20] = weight[13]  # and block 2 (16-23)
    weight[6] = weight[5]    # a tie inside one block
    hidden = torch.zeros(8, H, device=DEVICE)
    hidden[:4] = weight[3] * 4  # rows whose maximum is at 3, 13 and 20
    hidden[4:] = weight[5] * 4
    targets = torch.tensor([3, 13, 20, 0, 5, 6, 1, 5], device=DEVICE)
    logits = hidden @ weight.t()
    assert logits[0, 3] == logits[0, 13] == logits[0, 20] == logits[0].max()
    assert logits[4, 5] == logits[4, 6] == logits[4].max()
    want = logits.argmax(dim=1) == targets
    assert want.tolist() == [True, False, False, False, True, False, False, True]
    out = _op()(hidden, weight, targets, outputs=ALL, backend=_backend(backend), vocab_chunk_size=8)
    assert torch.equal(out.is_top1, want)
    trl = _trl_function()
    if trl is not None:
        got = trl.apply(hidden, weight, None, targets, 1.0, 8, None, 1.0, ALL)
        assert torch.equal(got[4], want)


def test_frozen_head_backward_needs_no_projection(monkeypatch):
    """Frozen head: the hidden gradient is computed in the forward; the backward projects nothing."""
    from deltafuse.ops.cross_entropy import tokens

    hidden, weight, _, targets = _inputs(6, 8, 31, trainable=False, seed=9)
    out = _op()(hidden, weight, targets, backend="torch")
    g_lp, _ = _upstream(6, 10)
    calls = []
    monkeypatch.setattr(tokens, "_project", lambda *a: calls.append(1) or pytest.fail("projected in backward"))
    (dh,) = torch.autograd.grad((out.log_probs * g_lp).sum(), hidden)
    monkeypatch.undo()
    _, _, _, want = _oracle(hidden, weight, None, targets, 1.0, g_lp, None)
    assert not calls
    assert_rel_close(dh, want[0], 1e-5, "d/dhidden")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_frozen_head_with_entropy_gradient(backend):
    """A gradient reaching the entropy (TRL's GRPO entropy bonus) with a frozen head: backward recomputes."""
    hidden, weight, _, targets = _inputs(7, 8, 30, trainable=False, seed=11, ignored=(3,))
    _check(hidden, weight, None, targets, backend=_backend(backend), vocab_chunk_size=12, temperature=0.8)


def test_no_gradient_mode_and_gradient_of_entropy_only():
    hidden, weight, _, targets = _inputs(5, 8, 17, seed=12)
    with torch.no_grad():
        out = _op()(hidden, weight, targets, outputs=ALL)
    assert not out.log_probs.requires_grad
    out = _op()(hidden, weight, targets, outputs=ALL, backend="torch")
    _, g_ent = _upstream(5, 13)
    got = torch.autograd.grad((out.entropy * g_ent).sum(), (hidden, weight))
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    _, ent, _ = naive_token_logprobs(*leaves, targets)
    want = torch.autograd.grad((ent * g_ent.double()).sum(), leaves)
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-5)


def test_fp64_is_computed_in_fp64():
    hidden, weight, bias, targets = _inputs(5, 8, 17, bias=True, dtype=torch.float64, seed=14)
    out = _op()(hidden, weight, targets, bias=bias, outputs=ALL, backend="torch")
    lp, ent, _ = naive_token_logprobs(hidden, weight, targets, bias=bias)
    assert out.log_probs.dtype == torch.float64
    assert rel_rms(out.log_probs, lp) < 1e-13 and rel_rms(out.entropy, ent) < 1e-13


def test_autocast_projects_in_the_autocast_dtype_like_trl():
    """Under autocast fp32 inputs are cast to bf16 first (as TRL's compute_dtype and nn.Linear): the same
    values as calling with bf16 copies, gradients back in fp32."""
    hidden, weight, _, targets = _inputs(6, 16, 40, seed=15, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _op()(hidden, weight, targets, outputs=ALL, backend="torch")
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    ref = _op()(h16, w16, targets, outputs=ALL, backend="torch")
    assert torch.equal(out.log_probs, ref.log_probs) and torch.equal(out.entropy, ref.entropy)
    g = torch.autograd.grad(out.log_probs.sum(), (hidden, weight))
    assert g[0].dtype == torch.float32 and g[1].dtype == torch.float32
    trl = _trl_function()
    if trl is not None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = trl.apply(hidden, weight, None, targets, 1.0, 16, None, 1.0, ALL)
        assert_rel_close(out.log_probs, theirs[0], 1e-3, "log_probs vs TRL")
        assert torch.equal(out.is_top1, theirs[4])


@pytest.mark.parametrize("kwargs,match", [
    (dict(outputs=("log_probs", "mean_logits")), r"outputs must be a tuple of names among 'log_probs', "
                                                  r"'entropy', 'is_top1', got \('log_probs', 'mean_logits'\)"),
    (dict(outputs="entropy"), r"outputs must be a tuple of names .* got 'entropy'"),
    (dict(temperature=0.0), r"temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=float("inf")), r"temperature must be a finite number > 0, got inf"),
    (dict(targets=torch.tensor([0, 1, 17])), r"targets must lie in \[0, 17\) or equal ignore_index=-100, got 17"),
    (dict(targets=torch.tensor([0, 1])), r"targets must have shape hidden.shape\[:-1\] = \(3,\), got \(2,\)"),
    (dict(weight=torch.randn(17, 8, dtype=torch.float64)), r"weight has dtype torch.float64 but hidden has "
                                                           r"torch.float32"),
    (dict(chunk_size=0), r"chunk_size must be None or an int >= 1, got 0"),
    (dict(frob=1), r"unexpected keyword argument\(s\) \['frob'\]"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(hidden=torch.randn(3, 8), weight=torch.randn(17, 8), targets=torch.tensor([0, 1, 2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match="^token_logprobs: " + match):
        _op()(**args)


# --- against TRL's own function ----------------------------------------------------------------------------
def _trl_function():
    try:
        from trl.kernels import ChunkedLogProbFunction
    except Exception:  # TRL absent (or not importable with this transformers)
        return None
    return ChunkedLogProbFunction


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen_head", "trainable_head"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_trl_chunked_logprob_function(backend, trainable, temperature):
    trl = _trl_function()
    if trl is None:
        pytest.skip("trl is not installed")
    hidden, weight, bias, targets = _inputs(9, 16, 45, bias=True, trainable=trainable, seed=16)
    g_lp, g_ent = _upstream(9, 17)
    theirs = trl.apply(hidden, weight, bias, targets, temperature, 16, None, 1.0, ALL)
    want = torch.autograd.grad((theirs[0] * g_lp).sum() + (theirs[1] * g_ent).sum(), _leaves(hidden, weight, bias))
    ours = _op()(hidden, weight, targets, bias=bias, temperature=temperature, outputs=ALL,
                 backend=_backend(backend), vocab_chunk_size=16, chunk_size=4)
    got = torch.autograd.grad((ours.log_probs * g_lp).sum() + (ours.entropy * g_ent).sum(),
                              _leaves(hidden, weight, bias))
    assert_rel_close(ours.log_probs, theirs[0], 1e-5, "log_probs")
    assert_rel_close(ours.entropy, theirs[1], 1e-5, "entropy")
    assert torch.equal(ours.is_top1, theirs[4])
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-5, "gradient")


# --- GPU: bf16 at Qwen3.5's head against TRL's function ----------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen_head", "trainable_head"])
def test_gpu_bf16_matches_trl_at_full_vocab(backend, trainable):
    trl = _trl_function()
    if trl is None:
        pytest.skip("trl is not installed")
    N, H, V = 2048, 2048, 248320
    hidden, weight, _, targets = _inputs(N, H, V, trainable=trainable, dtype=torch.bfloat16, device="cuda", seed=18)
    g_lp, g_ent = _upstream(N, 19, device="cuda")
    leaves = _leaves(hidden, weight, None)
    theirs = trl.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ALL)
    want = torch.autograd.grad((theirs[0] * g_lp).sum() + (theirs[1] * g_ent).sum(), leaves)
    ours = _op()(hidden, weight, targets, outputs=ALL, backend=backend)
    got = torch.autograd.grad((ours.log_probs * g_lp).sum() + (ours.entropy * g_ent).sum(), leaves)
    assert rel_rms(ours.log_probs, theirs[0]) < 1e-3 and rel_rms(ours.entropy, theirs[1]) < 1e-3
    # top-1 may differ only where bf16 logits tie or nearly tie; require agreement on almost every token
    assert (ours.is_top1 == theirs[4]).float().mean() > 0.999
    for a, b in zip(got, want):
        assert rel_rms(a, b) < 2e-2
