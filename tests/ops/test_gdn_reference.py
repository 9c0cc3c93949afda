"""The torch gated delta rule (chunked and recurrent) against the float64 step-by-step oracle."""

from __future__ import annotations

import pytest
import torch

from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule
from deltafuse.ops.gated_delta.reference import (
    chunk_gated_delta_rule_torch,
    fused_recurrent_gated_delta_rule_torch,
)
from tests.helpers import assert_rel_close, input_gen

FUNCS = {"chunk": chunk_gated_delta_rule_torch, "recurrent": fused_recurrent_gated_delta_rule_torch}
# observed worst errors: fp32 ~8e-7 (outputs and gradients), fp64 ~1e-14, bf16 ~2e-3
TOL = {torch.float32: (1e-5, 2e-5), torch.float64: (1e-12, 1e-11), torch.bfloat16: (2e-2, None)}


def make_inputs(B, T, H, G, K, V, dtype, *, n_states=None, g_mode="rand", beta_mode="rand", seed=0):
    """Fresh random inputs without zeros. Keys are scaled to |k| ~ 1 so the recurrence stays stable
    without the in-kernel l2norm."""
    gen = input_gen(seed)
    HV = H * G

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = rnd(B, T, H, K) / K**0.5
    v = rnd(B, T, HV, V)
    if g_mode == "rand":
        g = -torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.7 - 0.01
    elif g_mode == "tiny":
        g = torch.full((B, T, HV), -1e-4, dtype=torch.float64)
    else:  # "strong"
        g = torch.full((B, T, HV), -30.0, dtype=torch.float64)
    if beta_mode == "rand":
        beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    else:
        beta = torch.full((B, T, HV), float(beta_mode), dtype=torch.float64)
    h0 = rnd(n_states if n_states is not None else B, HV, K, V)
    # bf16 runs keep the decay and the state in fp32, as the GDN layer passes them
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    return q.to(dtype), k.to(dtype), v.to(dtype), g.to(wide), beta.to(dtype), h0.to(wide)


def run_with_grads(fn, inputs, scale, use_init, l2, cu, do, dh):
    """Run fn on leaf copies of inputs; loss = <o, do> + <final, dh>; returns (o, final, grads)."""
    q, k, v, g, beta, h0 = (t.detach().clone().requires_grad_(True) for t in inputs)
    leaves = [q, k, v, g, beta] + ([h0] if use_init else [])
    o, final = fn(q, k, v, g, beta, scale, h0 if use_init else None, True, l2, cu)
    loss = (o.to(torch.float64) * do).sum() + (final.to(torch.float64) * dh).sum()
    grads = torch.autograd.grad(loss, leaves)
    return o, final, grads


def check_against_oracle(fn, inputs, *, use_init, l2, cu=None, dtype, grads=True):
    q, v = inputs[0], inputs[2]
    K = q.shape[-1]
    scale = K**-0.5
    gen = input_gen(1)
    n = inputs[5].shape[0]
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(n, *v.shape[2:3], K, v.shape[-1], generator=gen, dtype=torch.float64)
    out_tol, grad_tol = TOL[dtype]
    if not grads:
        o, final = fn(*inputs[:5], scale, inputs[5] if use_init else None, True, l2, cu)
        o_ref, final_ref = naive_gated_delta_rule(
            *(t.double() for t in inputs[:5]), scale, inputs[5].double() if use_init else None, True, l2, cu)
        assert o.dtype == q.dtype and final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert_rel_close(o, o_ref, out_tol, "o")
        assert_rel_close(final, final_ref, out_tol, "final_state")
        return
    o, final, g_impl = run_with_grads(fn, inputs, scale, use_init, l2, cu, do, dh)
    o_ref, final_ref, g_ref = run_with_grads(
        naive_gated_delta_rule, [t.double() for t in inputs], scale, use_init, l2, cu, do, dh)
    assert o.shape == o_ref.shape and o.dtype == q.dtype
    assert final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel_close(o, o_ref, out_tol, "o")
    assert_rel_close(final, final_ref, out_tol, "final_state")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], g_impl, g_ref):
        assert_rel_close(a, b, grad_tol, name)


# (B, T, H, G, use_init, l2norm, dtype): every T edge with both head layouts, both dtypes, init on/off
CASES = [
    (2, 1, 2, 1, True, True, torch.float32),
    (2, 1, 1, 4, False, False, torch.float64),
    (1, 63, 2, 1, False, True, torch.float32),
    (2, 63, 1, 4, True, False, torch.float64),
    (2, 64, 1, 4, True, True, torch.float32),
    (1, 64, 2, 1, False, False, torch.float64),
    (1, 65, 1, 4, False, True, torch.float32),
    (2, 65, 2, 1, True, True, torch.float64),
    (1, 130, 2, 1, True, False, torch.float32),
    (1, 130, 1, 4, True, True, torch.float64),
]


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("B,T,H,G,use_init,l2,dtype", CASES)
def test_matches_oracle(name, B, T, H, G, use_init, l2, dtype):
    if name == "recurrent" and T > 65:
        T = 65  # the recurrence has no chunk boundaries; keep its share of the run time small
    inputs = make_inputs(B, T, H, G, 16, 32 if G == 1 else 16, dtype, seed=T + G)
    check_against_oracle(FUNCS[name], inputs, use_init=use_init, l2=l2, dtype=dtype)


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("g_mode,beta_mode", [("tiny", "rand"), ("strong", "rand"), ("rand", 0.0),
                                               ("rand", 1.0), ("strong", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_decay_and_beta(name, g_mode, beta_mode, dtype):
    # l2-normalised keys with beta = 1 make each update overwrite the state along k, the hardest case
    inputs = make_inputs(1, 70, 1, 2, 16, 16, dtype, g_mode=g_mode, beta_mode=beta_mode, seed=3)
    check_against_oracle(FUNCS[name], inputs, use_init=True, l2=True, dtype=dtype)


VARLEN = [
    [1, 70, 1, 1, 64, 3, 1],  # length-1 sequences at the start, middle and end, one exactly 64
    [130, 1, 63, 65],
    [1],
]


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("lengths", VARLEN)
@pytest.mark.parametrize("dtype,use_init", [(torch.float32, True), (torch.float64, False), (torch.float64, True)])
def test_varlen_matches_oracle(name, lengths, dtype, use_init):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    inputs = make_inputs(1, T, 1, 4, 16, 16, dtype, n_states=len(lengths), seed=len(lengths))
    check_against_oracle(FUNCS[name], inputs, use_init=use_init, l2=True, cu=cu, dtype=dtype)


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_equals_separate_runs(name, dtype):
    fn = FUNCS[name]
    lengths = [5, 1, 66, 1, 64, 2]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    q, k, v, g, beta, h0 = make_inputs(1, int(cu[-1]), 2, 2, 16, 16, dtype, n_states=len(lengths), seed=11)
    o, final = fn(q, k, v, g, beta, 0.25, h0, True, True, cu)
    tol = TOL[dtype][0]
    for n in range(len(lengths)):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, final_n = fn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], 0.25, h0[n : n + 1], True, True)
        assert_rel_close(o[:, s:e], o_n, tol, f"o of sequence {n}")
        assert_rel_close(final[n : n + 1], final_n, tol, f"final state of sequence {n}")
    # the check above must be able to fail: without cu_seqlens the state leaks into later sequences
    o_leak, _ = fn(q, k, v, g, beta, 0.25, h0[:1], True, True)
    assert not torch.allclose(o_leak[:, int(cu[1]) :], o[:, int(cu[1]) :], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", list(FUNCS))
def test_grouped_heads_equal_repeated_qk(name):
    fn = FUNCS[name]
    q, k, v, g, beta, h0 = make_inputs(2, 67, 2, 4, 16, 16, torch.float64, seed=5)
    o, final = fn(q, k, v, g, beta, 0.3, h0, True, True)
    o_rep, final_rep = fn(q.repeat_interleave(4, 2), k.repeat_interleave(4, 2), v, g, beta, 0.3, h0, True, True)
    assert_rel_close(o, o_rep, 1e-13, "o")
    assert_rel_close(final, final_rep, 1e-13, "final_state")


@pytest.mark.parametrize("name", list(FUNCS))
def test_chunked_and_split_runs_agree(name):
    """Running T tokens at once equals running a prefix then the rest from the prefix's final state."""
    fn = FUNCS[name]
    q, k, v, g, beta, h0 = make_inputs(2, 100, 1, 2, 16, 16, torch.float64, seed=8)
    o, final = fn(q, k, v, g, beta, 0.3, h0, True, True)
    cut = 37
    o1, s1 = fn(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], 0.3, h0, True, True)
    o2, s2 = fn(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], 0.3, s1, True, True)
    assert_rel_close(torch.cat([o1, o2], 1), o, 1e-13, "o")
    assert_rel_close(s2, final, 1e-13, "final_state")


@pytest.mark.parametrize("name", list(FUNCS))
def test_bf16_inputs(name):
    inputs = make_inputs(1, 65, 1, 2, 16, 16, torch.bfloat16, seed=9)
    check_against_oracle(FUNCS[name], inputs, use_init=True, l2=True, dtype=torch.bfloat16, grads=False)


@pytest.mark.parametrize("name", list(FUNCS))
def test_no_final_state_unless_asked(name):
    q, k, v, g, beta, h0 = make_inputs(1, 3, 1, 1, 16, 16, torch.float32)
    o, final = FUNCS[name](q, k, v, g, beta, 0.25, h0, False, False)
    assert final is None and o.shape == v.shape


# --- many short packed sequences -------------------------------------------------------------------------
# Every sequence is cut into full chunks plus a tail held by the next power of two (1, 2, ..., 64 tokens);
# these lengths give every tail size, sequences with only a tail, only full chunks, and both.
EVERY_TAIL = [1, 2, 3, 7, 12, 17, 33, 63, 64, 65, 130, 1]


def per_sequence_oracle(inputs, cu, scale, l2, do, dh):
    """float64 oracle run sequence by sequence on leaf copies (each from its own initial state); returns
    (o, final, grads of q, k, v, g, beta, h0) with the same loss as run_with_grads."""
    q, k, v, g, beta, h0 = (t.detach().double().requires_grad_(True) for t in inputs)
    outs, finals = [], []
    for n in range(cu.numel() - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, f_n = naive_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale,
                                          h0[n : n + 1], True, l2)
        outs.append(o_n)
        finals.append(f_n)
    o, final = torch.cat(outs, 1), torch.cat(finals, 0)
    loss = (o * do).sum() + (final * dh).sum()
    return o, final, torch.autograd.grad(loss, [q, k, v, g, beta, h0])


def check_per_sequence(fn, lengths, H, G, dtype, *, g_mode="rand", beta_mode="rand", seed=0, l2=True):
    """fn on the packed batch against the per-sequence float64 oracle: outputs, final states and every
    gradient, asserted sequence by sequence (so one wrong short sequence cannot hide in an average)."""
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T, N, K, V = int(cu[-1]), len(lengths), 16, 16
    inputs = make_inputs(1, T, H, G, K, V, dtype, n_states=N, g_mode=g_mode, beta_mode=beta_mode, seed=seed)
    gen = input_gen(seed + 100)
    do = torch.randn(1, T, H * G, V, generator=gen, dtype=torch.float64)
    dh = torch.randn(N, H * G, K, V, generator=gen, dtype=torch.float64)
    o, final, grads = run_with_grads(fn, inputs, K**-0.5, True, l2, cu, do, dh)
    o_ref, final_ref, grads_ref = per_sequence_oracle(inputs, cu, K**-0.5, l2, do, dh)
    out_tol, grad_tol = TOL[dtype]
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        where = f"sequence {n} (length {e - s})"
        assert_rel_close(o[:, s:e], o_ref[:, s:e], out_tol, f"o of {where}")
        assert_rel_close(final[n], final_ref[n], out_tol, f"final state of {where}")
        for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, grads_ref):
            assert_rel_close(a[:, s:e], b[:, s:e], grad_tol, f"{name} of {where}")
        assert_rel_close(grads[5][n], grads_ref[5][n], grad_tol, f"dh0 of {where}")


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("H,G", [(2, 1), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_many_short_sequences_match_per_sequence_oracle(name, H, G, dtype):
    lengths = EVERY_TAIL if name == "chunk" else [1, 3, 1, 17, 2, 1, 33, 1]
    check_per_sequence(FUNCS[name], lengths, H, G, dtype, seed=H + G)


@pytest.mark.parametrize("g_mode,beta_mode", [("tiny", "rand"), ("strong", "rand"), ("rand", 0.0), ("rand", 1.0),
                                               ("strong", 1.0)])
@pytest.mark.parametrize("H,G", [(2, 1), (1, 4)])
def test_many_short_sequences_extreme_decay_and_beta(g_mode, beta_mode, H, G):
    check_per_sequence(chunk_gated_delta_rule_torch, EVERY_TAIL, H, G, torch.float64, g_mode=g_mode,
                       beta_mode=beta_mode, seed=7)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_short_lengths_match_per_sequence_oracle(seed):
    """Lengths uniform in 1..16 between two longer sequences, fresh lengths per seed."""
    gen = input_gen(seed)
    lengths = torch.randint(1, 17, (30,), generator=gen).tolist()
    lengths[4], lengths[20] = 97, 64 + int(torch.randint(1, 64, (1,), generator=gen))
    check_per_sequence(chunk_gated_delta_rule_torch, lengths, 1, 2, torch.float32, seed=seed)


@pytest.mark.parametrize("name", list(FUNCS))
def test_short_sequences_without_states(name):
    """No initial state and no final state asked (the training call): zero entry states are never
    materialised for sequences shorter than a chunk; outputs and gradients still match the oracle."""
    lengths = [1, 5, 1, 70, 2, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v, g, beta, _ = make_inputs(1, int(cu[-1]), 1, 2, 16, 16, torch.float64, n_states=len(lengths), seed=4)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, final = FUNCS[name](*leaves, 0.25, None, False, True, cu)
    assert final is None
    o_ref, _ = naive_gated_delta_rule(*ref_leaves, 0.25, None, False, True, cu)
    assert_rel_close(o, o_ref, 1e-12, "o")
    do = torch.randn_like(o_ref)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * do).sum(), ref_leaves)
    for gname, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, grads_ref):
        assert_rel_close(a, b, 1e-11, gname)


def test_non_contiguous_initial_state():
    lengths = [3, 1, 66]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v, g, beta, h0 = make_inputs(1, int(cu[-1]), 1, 2, 16, 16, torch.float64, n_states=3, seed=6)
    h0_t = h0.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, K and V strides swapped
    assert not h0_t.is_contiguous()
    o, final = chunk_gated_delta_rule_torch(q, k, v, g, beta, 0.25, h0_t, True, True, cu)
    o_ref, final_ref = naive_gated_delta_rule(q, k, v, g, beta, 0.25, h0, True, True, cu)
    assert_rel_close(o, o_ref, 1e-12, "o")
    assert_rel_close(final, final_ref, 1e-12, "final_state")


@pytest.mark.parametrize("lengths", [[1] * 500, [16, 1, 9, 2, 15] * 40, [1000, 1, 3, 64, 65, 200, 33]])
def test_schedule_padding_is_bounded_by_the_tails(lengths):
    """Work follows the tokens, not the number of sequences: every slot of the chunked schedule holds a
    token except tail padding, and a tail of r tokens is padded to at most 2r - 1 (so at most 2x the
    tokens); each token has exactly one slot."""
    from deltafuse.ops.gated_delta.reference import _Schedule

    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(cu[-1])
    sched = _Schedule.packed(cu, 64, "cpu")
    index = torch.cat([sched.token_index.reshape(-1)] + [t.reshape(-1) for t, _ in sched.tails])
    real = index[index < T]
    assert torch.equal(real.sort().values, torch.arange(T)), "every token exactly once"
    tails = [L % 64 for L in lengths if L % 64]
    allowed = sum(2 * r - 1 for r in tails)
    assert index.numel() - T <= allowed and index.numel() <= 2 * T
    assert len(sched.active) == max(lengths) // 64  # the scan runs over full chunks only
    slots = sched.slot_of_token if sched.slot_of_token is not None else torch.arange(index.numel())
    assert torch.equal(index[slots], torch.arange(T)), "slot_of_token inverts the layout"


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_schedule_is_built_once_per_layout(name):
    """A second call with the same sequence layout reuses the first one's schedule (nothing is built again) and
    is as exact; another layout gets its own. Fresh inputs each call, against the float64 oracle."""
    from deltafuse.ops.gated_delta import reference

    cu = torch.tensor([0, 3, 40, 41, 97])
    layouts = [cu, cu.clone(), torch.tensor([0, 50, 97])]
    built = []
    for i, offsets in enumerate(layouts):
        q, k, v, g, beta, h0 = make_inputs(1, 97, 2, 2, 8, 8, torch.float64, n_states=offsets.numel() - 1,
                                           seed=int(torch.randint(0, 2**31 - 1, ()).item()))
        before = reference._schedule.cache_info().misses
        o, ht = FUNCS[name](q, k, v, g, beta, 0.4, h0, True, True, offsets)
        built.append(reference._schedule.cache_info().misses - before)
        want, want_ht = naive_gated_delta_rule(q, k, v, g, beta, 0.4, h0, True, True, offsets)
        assert_rel_close(o, want, 1e-12, f"o, layout {i}")
        assert_rel_close(ht, want_ht, 1e-12, f"final state, layout {i}")
    # the first layout may already be cached by an earlier test of this process; its copy never builds again
    assert built[1] == 0 and built[2] <= 1


@pytest.mark.parametrize("B,T,cu,use_init", [(2, 150, None, True), (1, 300, [0, 1, 64, 65, 65, 200, 300], True),
                                             (1, 130, [0, 130], False)])
def test_oracle_checkpointed_segments_equal_the_plain_loop(B, T, cu, use_init):
    """The oracle's checkpointed segments (``checkpoint_tokens``) give the plain step-by-step loop's values and
    gradients bit for bit, with sequences longer and shorter than a segment, an empty one and grouped heads; and its
    graph keeps a fraction of the plain loop's saved tensors (the reason it exists: the 4,097-token GPU cases held
    about 40 GiB without it)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    inputs = make_inputs(B, T, 1, 2, 8, 16, torch.float64, n_states=None if cu is None else len(cu) - 1, seed=seed)
    gen = input_gen(seed + 1)
    do = torch.randn(B, T, 2, 16, generator=gen, dtype=torch.float64)
    dh = torch.randn(*inputs[5].shape, generator=gen, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    runs, saved = [], []
    for tokens in (0, 64, 5):
        fn = lambda *a, n=tokens: naive_gated_delta_rule(*a, checkpoint_tokens=n)  # noqa: E731
        count = [0]

        def pack(t, count=count):
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            runs.append(run_with_grads(fn, inputs, 0.3, use_init, True, cu_t, do, dh))
        saved.append(count[0])
    plain = runs[0]
    for got in runs[1:]:
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
        assert all(torch.equal(a, b) for a, b in zip(got[2], plain[2]))
    assert saved[1] * 2 < saved[0] and saved[2] * 2 < saved[0], saved


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_oracle_refuses_a_bad_checkpoint_length(bad):
    x = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"checkpoint_tokens={bad!r}; allowed: an int >= 0"):
        naive_gated_delta_rule(x, x, x, -torch.rand(1, 3, 1, dtype=torch.float64), torch.rand(1, 3, 1,
                               dtype=torch.float64), checkpoint_tokens=bad)
