"""Long sequences in parallel segments (benchmarks/gdn_segments.py, the exact state merge) against the float64
oracle.

The segmented path must give what one sequential pass gives: o, the final state and the gradients of every
input (the initial state included), for one long sequence, a batch of them, and packed rows that mix a long
sequence with short ones (only the long one is cut). Interpreted on CPU (fp32, segments of one or two chunks);
on a GPU in bf16 at a Qwen3.5 layer's heads, with the chunked op's own bounds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import gdn_segments as segments  # noqa: E402
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402
from tests.helpers import DEVICE, gpu, input_gen, needs_cuda, rel_rms  # noqa: E402


def _inputs(B, T, H, HV, K, V, N, dtype, seed, device):
    gen = input_gen(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    xs = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V),
              g=-torch.nn.functional.softplus(r(B, T, HV) * 1.5 - 2.0), beta=torch.sigmoid(r(B, T, HV)))
    xs = {n: x.to(device=device, dtype=dtype) for n, x in xs.items()}
    xs["h0"] = (r(N, HV, K, V) * 0.5).to(device)
    return xs


def _run_both(B, T, H, HV, K, V, cu, dtype, long, segment, seed, device):
    N = B if cu is None else len(cu) - 1
    xs = _inputs(B, T, H, HV, K, V, N, dtype, seed, device)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    gen = input_gen(seed + 1)
    do = torch.randn(B, T, HV, V, generator=gen).to(device)
    dh = torch.randn(N, HV, K, V, generator=gen).to(device)
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    plan = segments.segment_bounds(tuple(range(0, B * T + 1, T)) if cu is None else tuple(cu), long, segment)
    assert plan is not None and len(plan[0]) - 1 > N, "the case must cut at least one sequence"
    o, ht = segments.chunk_gated_delta_rule_segmented(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], K**-0.5, leaves["h0"], True, True, cu_t,
        long=long, segment=segment)
    ((o.float() * do).sum() + (ht * dh).sum()).backward()
    ref = {n: x.detach().double().requires_grad_() for n, x in xs.items()}
    ro, rht = naive_gated_delta_rule(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], K**-0.5, ref["h0"], True,
                                     True, None if cu is None else torch.tensor(cu))
    ((ro * do.double()).sum() + (rht * dh.double()).sum()).backward()
    errs = {"o": rel_rms(o, ro), "final": rel_rms(ht, rht)}
    errs.update({"d" + n: rel_rms(leaves[n].grad, ref[n].grad) for n in xs})
    assert o.shape == ro.shape and ht.shape == rht.shape
    assert all(torch.isfinite(t).all() for t in [o, ht] + [leaves[n].grad for n in xs])
    return errs


CASES = {
    "one_long": (1, 200, None),  # 4 segments of 64 tokens, the last 8
    "batch": (2, 130, None),  # each row its own sequence, 3 segments each
    "packed_mix": (1, 230, [0, 5, 197, 200, 230]),  # one 192-token sequence cut, short ones kept whole
}


@pytest.mark.parametrize("case", list(CASES))
def test_segments_match_the_oracle(case):
    if DEVICE == "cuda":
        pytest.skip("the fp32 interpreted case; the GPU runs test_segments_bf16_gpu")
    B, T, cu = CASES[case]
    errs = _run_both(B, T, 2, 4, 16, 8, cu, torch.float32, long=128, segment=64, seed=hash(case) % 1000,
                     device="cpu")
    assert all(e < 2e-5 for e in errs.values()), errs


def test_short_calls_are_not_cut():
    assert segments.segment_bounds((0, 100, 150), long=128, segment=64) is None
    cuts, first, count = segments.segment_bounds((0, 10, 200, 330), long=128, segment=64)
    assert cuts == [0, 10, 74, 138, 200, 264, 328, 330]
    assert first == [0, 1, 4] and count == [1, 3, 3]
    with pytest.raises(ValueError, match="segment must be a positive multiple of the chunk size 64, got 100"):
        segments.segment_bounds((0, 10), segment=100)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", ["one_long", "packed_mix"])
def test_segments_bf16_gpu(case):
    B, T, cu = {"one_long": (1, 9000, None), "packed_mix": (1, 9000, [0, 300, 8500, 8600, 9000])}[case]
    errs = _run_both(B, T, 16, 32, 128, 128, cu, torch.bfloat16, long=4096, segment=2048, seed=3, device="cuda")
    bounds = {"o": 3e-3, "final": 3e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 1e-2, "dbeta": 1e-2, "dh0": 5e-3}
    assert all(errs[n] <= t for n, t in bounds.items()), errs
