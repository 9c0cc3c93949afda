"""Pure-torch gated delta rule: the ``torch`` backend, usable on every device.

Two functions with FLA's signature and layouts:

* :func:`chunk_gated_delta_rule_torch` - chunked (64 tokens) WY/UT formulation for prefill and training.
* :func:`fused_recurrent_gated_delta_rule_torch` - token-by-token recurrence for decoding (small T).

Both compute in float32 (float64 when q, k or v is float64), are differentiable through plain autograd,
support grouped value heads (HV = G * H, value head ``hv`` reads query/key head ``hv // G``) without
repeating q/k, and honour ``cu_seqlens``: packed sequences never share state.

Layouts: q, k [B, T, H, K]; v [B, T, HV, V]; g (log-space decay), beta [B, T, HV];
initial/final state [N, HV, K, V] with N = B, or N = len(cu_seqlens) - 1 (and B = 1) for packed input.
Returns o [B, T, HV, V] in q's dtype and the final state in the compute dtype (float32, or float64 for
float64 input), or None when ``output_final_state`` is False.

How sequences are scheduled. Every sequence (a batch row, or a ``cu_seqlens`` segment) is cut into blocks
(64 tokens for the chunked form, 1 token for the recurrent one); its last block is padded with tokens whose
q = k = v = 0, g = 0 and beta = 0, which leave the state unchanged. Sequences are sorted by block count,
longest first, and the blocks are laid out step-major: step ``j`` holds block ``j`` of every sequence that
has more than ``j`` blocks, and those sequences are a prefix of the sorted order. The scan then runs
``max blocks`` steps, each on a prefix of the state tensor; a sequence's state is set aside when it has no
more blocks. No state ever flows from one sequence into another, and no memory is spent on padding
beyond the last block of each sequence.
"""

from __future__ import annotations

import torch

from deltafuse.ops.gated_delta.naive import l2norm

CHUNK_SIZE = 64


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _Schedule:
    """Block layout of a set of sequences over a flat token axis (see the module docstring).

    Attributes:
        token_index: [NB, block] long, flat token index of every block slot; padding slots point at
            ``num_tokens`` (one past the end, where callers append a zero row).
        slot_of_token: [num_tokens] long, flat slot (block * block_size + offset) holding each token.
        active: list of int, how many sequences take part in step j (non-increasing).
        offsets: list of int, first block of step j in the step-major layout.
        order: [N] long, sequence index at each sorted rank (longest first).
    """

    def __init__(self, token_index, slot_of_token, active, offsets, order):
        self.token_index = token_index
        self.slot_of_token = slot_of_token
        self.active = active
        self.offsets = offsets
        self.order = order
        self.num_sequences = order.numel()

    @classmethod
    def uniform(cls, B: int, T: int, block: int, device) -> "_Schedule":
        """B rows of T tokens each (no cu_seqlens): pure index arithmetic, no device synchronisation."""
        n_steps = -(-T // block)
        step = torch.arange(n_steps, device=device)[:, None, None]
        row = torch.arange(B, device=device)[None, :, None]
        pos = step * block + torch.arange(block, device=device)[None, None, :]  # position within the row
        token_index = torch.where(pos < T, row * T + pos, B * T).reshape(n_steps * B, block)
        t = torch.arange(T, device=device)
        slot_of_token = (((t // block)[None, :] * B + torch.arange(B, device=device)[:, None]) * block
                         + (t % block)[None, :]).reshape(B * T)
        order = torch.arange(B, device=device)
        return cls(token_index, slot_of_token, [B] * n_steps, [j * B for j in range(n_steps)], order)

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, block: int, device) -> "_Schedule":
        """Sequences given by cu_seqlens over T = cu_seqlens[-1] tokens (B = 1)."""
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        n = lengths.numel()
        blocks = (lengths + block - 1) // block  # blocks per sequence
        sorted_blocks, order = torch.sort(blocks, descending=True, stable=True)
        num_tokens, max_blocks, num_blocks = (
            int(x) for x in torch.stack([cu[-1], sorted_blocks[0], sorted_blocks.sum()]).tolist())
        # active[j] = number of sequences with more than j blocks; offsets = exclusive cumsum
        counts = torch.bincount(sorted_blocks, minlength=max_blocks + 1)
        active = n - torch.cumsum(counts, 0)[:max_blocks]
        offsets = torch.cumsum(active, 0) - active

        # enumerate (rank, step) pairs and place them step-major: flat block = offsets[step] + rank
        rank = torch.repeat_interleave(torch.arange(n, device=device), sorted_blocks)
        first = torch.cumsum(sorted_blocks, 0) - sorted_blocks
        step = torch.arange(num_blocks, device=device) - torch.repeat_interleave(first, sorted_blocks)
        flat = offsets[step] + rank
        seq = torch.empty(num_blocks, dtype=torch.long, device=device)
        seq[flat] = order[rank]
        blk = torch.empty(num_blocks, dtype=torch.long, device=device)
        blk[flat] = step

        within = torch.arange(block, device=device)
        begin = starts[seq] + blk * block  # [NB]
        remaining = lengths[seq] - blk * block
        valid = within[None, :] < remaining[:, None]  # [NB, block]
        token_index = torch.where(valid, begin[:, None] + within[None, :], num_tokens)
        slot_of_token = torch.empty(num_tokens, dtype=torch.long, device=device)
        slots = torch.arange(num_blocks * block, device=device).view(num_blocks, block)
        slot_of_token[token_index[valid]] = slots[valid]
        return cls(token_index, slot_of_token, active.tolist(), offsets.tolist(), order)


def _gather_blocks(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """x [NT, ...] -> [NB, block, ...], padding slots read an appended zero row."""
    padded = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], 0)
    return padded[token_index]


def _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, block):
    """Shared set-up: flatten tokens, cast, normalise, build the schedule and gather blocks."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    G = HV // H
    dtype = _compute_dtype(q, k, v)
    device = q.device
    NT = B * T
    q = q.reshape(NT, H, K).to(dtype)
    k = k.reshape(NT, H, K).to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    v = v.reshape(NT, H, G, V).to(dtype)
    g = g.reshape(NT, H, G).to(dtype)
    beta = beta.reshape(NT, H, G).to(dtype)

    if cu_seqlens is None:
        sched = _Schedule.uniform(B, T, block, device)
    else:
        sched = _Schedule.packed(cu_seqlens, block, device)
    blocks = [_gather_blocks(x, sched.token_index) for x in (q, k, v, g, beta)]

    N = sched.num_sequences
    if initial_state is None:
        state = torch.zeros(N, H, G, K, V, dtype=dtype, device=device)
    else:
        state = initial_state.to(dtype).reshape(N, H, G, K, V)[sched.order]
    return sched, blocks, state, dtype


def _scan(sched: _Schedule, state: torch.Tensor, step_fn):
    """Run ``step_fn(state_prefix, block_slice) -> (out, new_state)`` over the steps of the schedule.

    Returns (outputs concatenated in block order, final states in original sequence order).
    """
    outs = []
    finished = []  # states set aside, in descending rank ranges
    current = state.shape[0]
    for active, offset in zip(sched.active, sched.offsets):
        if active < current:
            finished.append(state[active:current])
            state = state[:active]
            current = active
        out, state = step_fn(state, slice(offset, offset + active))
        outs.append(out)
    finished.append(state[:current])
    final_sorted = torch.cat(finished[::-1], 0)
    inverse = torch.empty_like(sched.order)
    inverse[sched.order] = torch.arange(sched.order.numel(), device=sched.order.device)
    return outs, final_sorted[inverse]


def _finish(outs, final, sched, B, T, H, G, V, HV, K, out_dtype, output_final_state):
    """Scatter block outputs back to [B, T, HV, V] token order; final state to [N, HV, K, V]."""
    if outs:
        o_blocks = torch.cat(outs, 0)  # [NB, block, H, G, V]
        o = o_blocks.reshape(-1, H, G, V)[sched.slot_of_token]
    else:
        o = final.new_zeros(0, H, G, V)
    o = o.reshape(B, T, HV, V).to(out_dtype)
    if not output_final_state:
        return o, None
    return o, final.reshape(-1, HV, K, V)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (chunk 64) in float32/float64; see the module docstring for layouts.

    Within a chunk with entry state S0, cumulative log-decay c_t (from the chunk start, inclusive) and
    Gamma_t = exp(c_t), the per-token updates u_t = beta_t (v_t - Gamma_t S0^T k_t - sum_{s<t}
    exp(c_t - c_s) (k_t . k_s) u_s) form a unit lower-triangular system (I + A) U = beta V - diag(beta Gamma) K S0,
    solved once per chunk for both right-hand sides (UT transform): U = U_v - W S0. Then
    o_t = Gamma_t S0^T (scale q_t) + sum_{s<=t} exp(c_t - c_s) scale (q_t . k_s) u_s and
    S_end = Gamma_last S0 + sum_s exp(c_last - c_s) k_s u_s^T. Every decay is exp of a sum of g over a
    token range (never a ratio of decays), so g = -30 per token underflows to 0 without overflow or NaN,
    and dg keeps its relative accuracy there.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    G = HV // H
    C = CHUNK_SIZE
    sched, (qb, kb, vb, gb, bb), state, dtype = _prepare(
        q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, C
    )
    # blocks: qb, kb [NB, C, H, K]; vb [NB, C, H, G, V]; gb, bb [NB, C, H, G]
    qb = qb.permute(0, 2, 1, 3)  # [NB, H, C, K]
    kb = kb.permute(0, 2, 1, 3)
    vb = vb.permute(0, 2, 3, 1, 4)  # [NB, H, G, C, V]
    gb = gb.permute(0, 2, 3, 1)  # [NB, H, G, C]
    bb = bb.permute(0, 2, 3, 1)

    device = q.device
    eye = torch.eye(C, dtype=dtype, device=device)
    strict = torch.ones(C, C, dtype=torch.bool, device=device).tril(-1)
    cum = gb.cumsum(-1)  # c_t
    # segment sums seg[i, j] = sum_{j < r <= i} g_r = c_i - c_j for i >= j (0 on and above the diagonal),
    # summed directly rather than as a difference of prefix sums: a difference would route gradients
    # through cancelling O(1) terms and lose all relative accuracy of dg when exp(g) is tiny.
    seg = torch.where(strict, gb[..., :, None].expand(*gb.shape, C), 0.0).cumsum(-2)  # [NB, H, G, C, C]
    decay = torch.where(strict, seg.exp(), 0.0)  # strictly causal part; the diagonal decay is exactly 1

    kk = kb @ kb.transpose(-1, -2)  # [NB, H, C, C], shared by the G value heads
    qk = qb @ kb.transpose(-1, -2)
    system = kk[:, :, None] * decay * bb[..., :, None] + eye  # I + A, unit lower triangular
    attn = qk[:, :, None] * (decay + eye) * scale  # [NB, H, G, C, C], causal incl. diagonal

    gamma = cum.exp()  # [NB, H, G, C]
    rhs = torch.cat([vb * bb[..., None], kb[:, :, None] * (bb * gamma)[..., None]], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, w = solved[..., :V], solved[..., V:]  # [NB, H, G, C, V], [NB, H, G, C, K]
    k_end = kb[:, :, None] * seg[..., -1, :].exp()[..., None]  # k_s exp(c_last - c_s), [NB, H, G, C, K]
    gamma_end = gamma[..., -1]  # [NB, H, G]
    q_scaled = qb * scale

    def step(S, sl):
        # S [A, H, G, K, V]
        u = u_v[sl] - w[sl] @ S
        inter = torch.einsum("ahck,ahgkv->ahgcv", q_scaled[sl], S) * gamma[sl][..., None]
        o = inter + attn[sl] @ u  # [A, H, G, C, V]
        S = S * gamma_end[sl][..., None, None] + k_end[sl].transpose(-1, -2) @ u
        return o.permute(0, 3, 1, 2, 4), S  # [A, C, H, G, V]

    outs, final = _scan(sched, state, step)
    return _finish(outs, final, sched, B, T, H, G, V, HV, K, q.dtype, output_final_state)


def fused_recurrent_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (for decoding); same contract as :func:`chunk_gated_delta_rule_torch`.

    Per token: S = exp(g) S; S = S + k (beta (v - S^T k))^T; o = S^T (scale q). The loop runs
    max(sequence length) steps, each over the sequences still running.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    G = HV // H
    sched, (qb, kb, vb, gb, bb), state, dtype = _prepare(
        q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, 1
    )
    # blocks of one token: qb, kb [NT, 1, H, K]; vb [NT, 1, H, G, V]; gb, bb [NT, 1, H, G]
    qb, kb, vb, gb, bb = qb[:, 0] * scale, kb[:, 0], vb[:, 0], gb[:, 0], bb[:, 0]

    def step(S, sl):
        # S [A, H, G, K, V]
        kt = kb[sl]
        S = S * gb[sl].exp()[..., None, None]
        pred = torch.einsum("ahgkv,ahk->ahgv", S, kt)
        delta = bb[sl][..., None] * (vb[sl] - pred)
        S = S + kt[:, :, None, :, None] * delta[:, :, :, None, :]
        o = torch.einsum("ahgkv,ahk->ahgv", S, qb[sl])
        return o[:, None], S  # [A, 1, H, G, V]

    outs, final = _scan(sched, state, step)
    return _finish(outs, final, sched, B, T, H, G, V, HV, K, q.dtype, output_final_state)
