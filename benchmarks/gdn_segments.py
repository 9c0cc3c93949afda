"""An experiment: long sequences of the chunked gated delta rule in parallel segments, with an exact state
merge.

The chunked kernels walk a sequence's chunks one after another: a single 65,536-token sequence is 1,024 steps
of one program per value head and value block. The idea tried here: the state update is affine in the state,
so a sequence cut into segments can run them all at once. For a segment s,

    S_end = M_s S_start + N_s,   M_s = prod_t exp(g_t) (I - beta_t k_t k_t^T)  (K x K per value head),

with N_s the segment's end state from a zero start. Both come from the chunked op itself, run on every segment
in one call (the segments as sequences of ``cu_seqlens``): N_s with no initial state, M_s with v = 0 and the
identity as the initial state (then S_end = M_s I). The segments' true start states follow from a short scan,
H_{s+1} = M_s H_s + N_s (batched K x K products, one step per segment of the longest sequence), and the
outputs from one more call with those start states. The merge is exact algebra, not an approximation; every
piece is differentiable through the chunked op's own backward, so the backward runs over all segments at once
too. The same merge is what a sequence split over several GPUs needs.

Measured, and why it stays a benchmark (BENCHMARKS.md#long-context-gdn, H200, bf16, H=16, HV=32, D=128): at
1x65,536 forward+backward takes 58-69 ms against 19.3 ms for one sequential pass. The premise failed: the
sequential state pass is not latency-bound at these heads. Value heads times value blocks already fill the
GPU's 132 SMs, so cutting the sequence buys no parallelism, and the three calls cost three times the per-token
work. The merge stays here, tested against the float64 oracle, for context parallelism across GPUs. There the
segments are on different devices and the sequential relay is the cost.
"""

from __future__ import annotations

import torch

from deltafuse.ops import _checks
from deltafuse.ops.gated_delta.chunk_launch import BT
from deltafuse.ops.gated_delta.kernel import chunk_gated_delta_rule_triton

# A sequence is cut when it is at least LONG tokens, into pieces of SEGMENT tokens (a multiple of the chunk).
LONG = 16384
SEGMENT = 4096

def _offsets_tensor(bounds: list[int], device) -> torch.Tensor:
    cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
    _checks.remember_host_offsets(cu, bounds)  # the ops take the values from here, never from the device
    return cu


def segment_bounds(bounds: tuple[int, ...], long: int = LONG, segment: int = SEGMENT):
    """The segments of sequences given by their offsets ``bounds``, or None when no sequence is ``long``.

    Returns (segment offsets, for each sequence the index of its first segment, segments per sequence)."""
    if segment % BT or segment <= 0:
        raise ValueError(f"segment must be a positive multiple of the chunk size {BT}, got {segment}")
    if max((b - a for a, b in zip(bounds, bounds[1:])), default=0) < long:
        return None
    cuts, first, count = [0], [], []
    for a, b in zip(bounds, bounds[1:]):
        first.append(len(cuts) - 1)
        n = 1 if b - a < long else -(-(b - a) // segment)
        cuts.extend(min(a + (i + 1) * segment, b) for i in range(n - 1))
        cuts.append(b)
        count.append(n)
    return cuts, first, count


def chunk_gated_delta_rule_segmented(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, long: int = LONG,
                                     segment: int = SEGMENT):
    """``chunk_gated_delta_rule_triton`` with sequences of at least ``long`` tokens cut into parallel segments
    (exact); the same arguments and results. Calls with no such sequence go to the chunked op unchanged."""
    B, T = q.shape[:2]
    bounds = tuple(n * T for n in range(B + 1)) if cu_seqlens is None else _checks.host_offsets(cu_seqlens)
    plan = segment_bounds(bounds, long, segment)
    if plan is None:
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, cu_seqlens)
    cuts, first, count = plan
    HV, V = v.shape[-2:]
    K = q.shape[-1]
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    qf, kf, vf, gf, bf = flat
    cu = _offsets_tensor(cuts, q.device)
    nseg = len(cuts) - 1
    run = chunk_gated_delta_rule_triton
    # N: each segment's end state from a zero start; M: its transition (v = 0, identity start)
    _, local = run(qf, kf, vf, gf, bf, scale, None, True, use_qk_l2norm_in_kernel, cu)
    eye = torch.eye(K, device=q.device, dtype=torch.float32).expand(nseg, HV, K, K)
    _, trans = run(qf, kf, vf.new_zeros(1, B * T, HV, K), gf, bf, scale, eye, True, use_qk_l2norm_in_kernel, cu)
    # the scan over the segments of each sequence, all sequences at once per step
    starts = [None] * nseg
    for i, (f, n) in enumerate(zip(first, count)):
        starts[f] = (initial_state[i].float() if initial_state is not None
                     else local.new_zeros(HV, K, V))
    for j in range(1, max(count)):
        seqs = [i for i, n in enumerate(count) if n > j]
        prev = torch.tensor([first[i] + j - 1 for i in seqs])
        h = torch.stack([starts[first[i] + j - 1] for i in seqs])
        nxt = torch.matmul(trans[prev.to(trans.device)], h) + local[prev.to(local.device)]
        for row, i in enumerate(seqs):
            starts[first[i] + j] = nxt[row]
    h0 = torch.stack(starts)
    o, final = run(qf, kf, vf, gf, bf, scale, h0, output_final_state, use_qk_l2norm_in_kernel, cu)
    if final is not None:
        final = final[torch.tensor([f + n - 1 for f, n in zip(first, count)], device=final.device)]
    return o.reshape(B, T, HV, V), final
