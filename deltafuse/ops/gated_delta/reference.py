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

How sequences are scheduled. Every sequence (a batch row, or a ``cu_seqlens`` segment) of length L is cut
into L // block full blocks (64 tokens for the chunked form, 1 token for the recurrent one) and, when
L mod block > 0, a tail of the remaining tokens. Sequences are sorted by full-block count, most first, and
the full blocks are laid out step-major: step ``j`` holds block ``j`` of every sequence that has more than
``j`` full blocks, and those sequences are a prefix of the sorted order. The scan runs ``max full blocks``
steps, each on a prefix of the state tensor; a sequence's state is set aside when it has no more full
blocks. Then the tails are grouped by the smallest power of two that holds them (1, 2, 4, ..., 64 tokens)
and every group runs as one step from its sequences' states; a tail is padded at its end with tokens whose
q = k = v = 0, g = 0 and beta = 0, which leave the state unchanged. No state ever flows from one sequence
into another, padding is at most the tail's own length, and a packed batch of many short sequences costs
about what the same number of tokens in one sequence costs (2,000 sequences of one token are 2,000 one-token
blocks in one step, not 2,000 chunks of 64).
"""

from __future__ import annotations

import functools

import torch

from deltafuse.ops._checks import host_offsets
from deltafuse.ops.gated_delta.naive import l2norm

CHUNK_SIZE = 64


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _take(rows: torch.Tensor, n: int, device) -> torch.Tensor | None:
    """rows as an index tensor on ``device``, or None when it is 0, 1, ..., n-1 (take everything as is)."""
    if rows.numel() == n and torch.equal(rows, torch.arange(n)):
        return None
    return rows.to(device)


class _Schedule:
    """Block layout of a set of sequences over a flat token axis (see the module docstring).

    Built on the host from the sequence lengths (cu_seqlens is read once, or not at all when it carries
    its host copy); the index tensors are then copied to the inputs' device. State rows are addressed in
    "pools": the scan's states (sorted by rank) followed by the initial states (in sequence order), and
    for the final states the scan's states, then each tail group's, then the initial states.

    Attributes:
        token_index: [NB, block] long, flat token index of every slot of the full blocks (all valid).
        active: list of int, how many sequences take part in scan step j (non-increasing).
        offsets: list of int, first block of step j in the step-major layout.
        scan_order: index of the sequences with full blocks, most blocks first (their initial states), or
            None for all sequences in order.
        tails: list of (token_index [n, size], entry): the sequences whose length is not a multiple of
            ``block``, grouped by the power of two ``size`` that holds their last L mod block tokens;
            padding slots point at ``num_tokens`` (one past the end, where callers append a zero row).
            ``entry`` = (source, rows): their entry states are rows of the scan's states ("scan"), of the
            initial states ("initial") or of both concatenated ("both").
        final: (sources, rows): the final states are rows (None: all, in order) of the concatenation of
            the named sources ("scan", "tail" for every tail group's states, "initial").
        slot_of_token: [num_tokens] long, or None for the identity: the slot holding each token in the
            concatenation of the full blocks' outputs and then each tail group's, one slot per row.
    """

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, num_tokens: int, block: int, device):
        n = lengths.numel()
        self.num_sequences = n
        full = lengths // block
        tail = lengths - full * block
        # full blocks, step-major: step j holds block j of every sequence with more than j full blocks
        sorted_full, order = torch.sort(full, descending=True, stable=True)
        n_scan = int((full > 0).sum())
        sorted_full, order = sorted_full[:n_scan], order[:n_scan]
        max_blocks = int(sorted_full[0]) if n_scan else 0
        counts = torch.bincount(sorted_full, minlength=max_blocks + 1)
        active = n_scan - torch.cumsum(counts, 0)[:max_blocks]
        offsets = torch.cumsum(active, 0) - active
        num_blocks = int(sorted_full.sum())
        rank = torch.repeat_interleave(torch.arange(n_scan), sorted_full)
        first = torch.cumsum(sorted_full, 0) - sorted_full
        step = torch.arange(num_blocks) - torch.repeat_interleave(first, sorted_full)
        flat = offsets[step] + rank
        seq = torch.empty(num_blocks, dtype=torch.long)
        seq[flat] = order[rank]
        blk = torch.empty(num_blocks, dtype=torch.long)
        blk[flat] = step
        within = torch.arange(block)
        token_index = (starts[seq] + blk * block)[:, None] + within[None, :]
        slot_of_token = torch.empty(num_tokens, dtype=torch.long)
        slot_of_token[token_index.reshape(-1)] = torch.arange(num_blocks * block)
        slot = num_blocks * block
        scan_rank = torch.full((n,), -1, dtype=torch.long)
        scan_rank[order] = torch.arange(n_scan)

        # tails: one group per power-of-two size, each processed in one batched step after the scan
        sizes = [1 << i for i in range(block.bit_length()) if (1 << i) <= block]
        if sizes[-1] != block:
            sizes.append(block)
        group = torch.searchsorted(torch.tensor(sizes), tail)  # smallest size >= tail
        tails, tail_ids = [], []
        for gi, size in enumerate(sizes):
            ids = torch.nonzero((tail > 0) & (group == gi)).flatten()
            if ids.numel() == 0:
                continue
            pos = torch.arange(size)[None, :]
            tok = (starts[ids] + full[ids] * block)[:, None] + pos
            valid = pos < tail[ids][:, None]
            slot_of_token[tok[valid]] = (slot + torch.arange(ids.numel() * size).view(-1, size))[valid]
            slot += ids.numel() * size
            in_scan = scan_rank[ids] >= 0
            if bool(in_scan.all()):
                entry = ("scan", scan_rank[ids])
            elif not bool(in_scan.any()):
                entry = ("initial", ids)
            else:
                entry = ("both", torch.where(in_scan, scan_rank[ids], n_scan + ids))
            tails.append((torch.where(valid, tok, num_tokens).to(device),
                          (entry[0], _take(entry[1], n_scan if entry[0] == "scan" else n, device))))
            tail_ids.append(ids)

        # final states: the last source that touched each sequence
        has_tail = tail > 0
        final_pos = torch.empty(n, dtype=torch.long)
        sources, base = [], 0
        if bool(((full > 0) & ~has_tail).any()):
            sources.append("scan")
            final_pos[order] = torch.arange(n_scan)
            base = n_scan
        if tail_ids:
            sources.append("tail")
            ids = torch.cat(tail_ids)
            final_pos[ids] = base + torch.arange(ids.numel())
            base += ids.numel()
        if n == 0 or bool((lengths == 0).any()):  # no sequence at all (B = 0), or empty ones
            sources.append("initial")
            untouched = torch.nonzero(lengths == 0).flatten()
            final_pos[untouched] = base + untouched
            base += n
        self.final = (sources, _take(final_pos, base, device))

        self.token_index = token_index.to(device)
        self.active = active.tolist()
        self.offsets = offsets.tolist()
        self.scan_order = _take(order, n, device)
        self.tails = tails
        self.slot_of_token = _take(slot_of_token, slot, device)

    @classmethod
    def uniform(cls, B: int, T: int, block: int, device) -> "_Schedule":
        """B rows of T tokens each (no cu_seqlens)."""
        return _schedule(tuple(range(0, B * T + 1, T)) if T else (0,) * (B + 1), block, str(device))

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, block: int, device) -> "_Schedule":
        """Sequences given by cu_seqlens over T = cu_seqlens[-1] tokens (B = 1)."""
        return _schedule(tuple(host_offsets(cu_seqlens)), block, str(device))


@functools.lru_cache(maxsize=32)
def _schedule(bounds: tuple[int, ...], block: int, device: str) -> _Schedule:
    """The schedule of the sequences between consecutive ``bounds``, kept for the next call with the same
    layout: it depends on the lengths only (never on values), is read-only once built, and costs ~0.4 ms of host
    time to build (every GDN layer of a step, and every decoding step, asks for the same one)."""
    cu = torch.tensor(bounds, dtype=torch.long)
    return _Schedule(cu[:-1], cu[1:] - cu[:-1], bounds[-1], block, torch.device(device))


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]


def _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, block):
    """Shared set-up: flatten tokens (plus one zero row that padding slots read), cast, normalise, build
    the schedule; initial states [N, H, G, K, V] in sequence order, or None for zeros."""
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
    flat = [torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], 0) for x in (q, k, v, g, beta)]

    if cu_seqlens is None:
        sched = _Schedule.uniform(B, T, block, device)
    else:
        sched = _Schedule.packed(cu_seqlens, block, device)

    state = None
    if initial_state is not None:
        state = initial_state.to(dtype).reshape(sched.num_sequences, H, G, K, V)
    return sched, flat, state, dtype


def _run(sched: _Schedule, flat, initial: torch.Tensor | None, make_step, need_final: bool):
    """Run the schedule: ``make_step(blocks)`` turns gathered blocks (q, k, v, g, beta, each
    [n_blocks, block, ...]) into ``step(states, block_slice, want_state) -> (out, new_states)``, where
    states None stands for zero states and new_states is None unless wanted.

    The full blocks are scanned step-major, each step on a prefix of the (sorted) states; a sequence's
    state is set aside when it has no more full blocks. Then each tail group takes its sequences' states
    and runs one step. ``initial`` [N, ...] or None (zeros). Returns (outputs in slot order, final states
    in sequence order or None when not ``need_final``).
    """
    state_shape = (flat[0].shape[1], flat[2].shape[2], flat[0].shape[2], flat[2].shape[3])  # H, G, K, V

    def initial_rows(rows, n):
        if initial is not None:
            return _rows(initial, rows)
        return None if n is None else flat[0].new_zeros((n,) + state_shape)

    outs = []
    scan = None
    if sched.active:
        step_fn = make_step([x[sched.token_index] for x in flat])
        state = initial_rows(sched.scan_order, sched.active[0])
        finished = []  # states set aside, in descending rank ranges
        current = state.shape[0]
        for active, offset in zip(sched.active, sched.offsets):
            if active < current:
                finished.append(state[active:current])
                state = state[:active]
                current = active
            out, state = step_fn(state, slice(offset, offset + active))
            outs.append(out)
        finished.append(state)
        scan = torch.cat(finished[::-1], 0) if len(finished) > 1 else state  # sorted by rank
    tails = []
    for index, (source, rows) in sched.tails:
        if source == "scan":
            entry = _rows(scan, rows)
        elif source == "initial":
            entry = initial_rows(rows, None)  # None: zero states, never materialised
        else:
            entry = _rows(torch.cat([scan, initial_rows(None, sched.num_sequences)], 0), rows)
        out, S = make_step([x[index] for x in flat])(entry, slice(None), need_final)
        outs.append(out)
        tails.append(S)
    if not need_final:
        return outs, None
    sources, rows = sched.final
    pieces = []
    for source in sources:
        pieces.extend({"scan": [scan], "tail": tails, "initial": [initial_rows(None, sched.num_sequences)]}[source])
    final = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
    return outs, _rows(final, rows)


def _finish(outs, final, sched, flat, B, T, H, G, V, HV, K, out_dtype):
    """Scatter block outputs back to [B, T, HV, V] token order; final state to [N, HV, K, V]."""
    if outs:
        slots = torch.cat([o.reshape(-1, H, G, V) for o in outs], 0) if len(outs) > 1 else outs[0]
        o = _rows(slots.reshape(-1, H, G, V), sched.slot_of_token)
    else:
        o = flat[2][:0]  # no token: empty, and still an output of v's graph
    o = o.reshape(B, T, HV, V).to(out_dtype)
    return o, None if final is None else final.reshape(-1, HV, K, V)


def _gated_delta(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 block, make_step):
    """Both public functions: the schedule of ``block``-token blocks run with ``make_step`` (see :func:`_run`),
    outputs and final states back in the public layouts."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    sched, flat, state, _ = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, block)
    outs, final = _run(sched, flat, state, make_step, output_final_state)
    return _finish(outs, final, sched, flat, B, T, H, HV // H, V, HV, K, q.dtype)


def _chunk_step(qb, kb, vb, gb, bb, scale):
    """Intra-block precomputation for blocks of C tokens (the chunk formulation in the docstring of
    :func:`chunk_gated_delta_rule_torch`); returns the scan step over a slice of blocks.

    qb, kb [NB, C, H, K]; vb [NB, C, H, G, V]; gb, bb [NB, C, H, G].
    """
    C = qb.shape[1]
    V = vb.shape[-1]
    dtype, device = qb.dtype, qb.device
    qb = qb.permute(0, 2, 1, 3)  # [NB, H, C, K]
    kb = kb.permute(0, 2, 1, 3)
    vb = vb.permute(0, 2, 3, 1, 4)  # [NB, H, G, C, V]
    gb = gb.permute(0, 2, 3, 1)  # [NB, H, G, C]
    bb = bb.permute(0, 2, 3, 1)

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
    attn = qk[:, :, None] * (decay + eye) * scale  # [NB, H, G, C, C], causal incl. diagonal

    gamma = cum.exp()  # [NB, H, G, C]
    rhs = torch.cat([vb * bb[..., None], kb[:, :, None] * (bb * gamma)[..., None]], -1)
    if C == 1:
        solved = rhs  # I + A is the 1x1 identity
    else:
        system = kk[:, :, None] * decay * bb[..., :, None] + eye  # I + A, unit lower triangular
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, w = solved[..., :V], solved[..., V:]  # [NB, H, G, C, V], [NB, H, G, C, K]
    k_end = kb[:, :, None] * seg[..., -1, :].exp()[..., None]  # k_s exp(c_last - c_s), [NB, H, G, C, K]
    gamma_end = gamma[..., -1]  # [NB, H, G]
    k_end_t = k_end.transpose(-1, -2).contiguous()  # [NB, H, G, K, C]
    # what reads the entry state: Gamma_t scale q_t (output) stacked with w (updates), one product per step
    reads = torch.cat([(qb * scale)[:, :, None] * gamma[..., None], w], -2)  # [NB, H, G, 2C, K]

    def step(S, sl, want_state=True):
        # S [A, H, G, K, V], or None for zero entry states
        if S is None:
            u = u_v[sl]
            o = attn[sl] @ u
        else:
            both = reads[sl] @ S  # [A, H, G, 2C, V]
            u = u_v[sl] - both[..., C:, :]
            o = both[..., :C, :] + attn[sl] @ u  # [A, H, G, C, V]
        S_new = None
        if want_state:
            kt = k_end_t[sl]
            if S is None:
                S_new = kt @ u
            else:
                # accumulate into the fresh decayed tensor: one state-sized allocation per step (autograd
                # keeps S and gamma_end for the product, never its result)
                S_new = (S * gamma_end[sl][..., None, None]).contiguous()
                S_new.view(-1, *S.shape[-2:]).baddbmm_(kt.flatten(0, 2), u.flatten(0, 2))
        return o.permute(0, 3, 1, 2, 4), S_new  # [A, C, H, G, V]

    return step


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
    and dg keeps its relative accuracy there. A sequence's last L mod 64 tokens form a shorter chunk
    (the next power of two), so short sequences cost about what their tokens cost.
    """
    return _gated_delta(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                        CHUNK_SIZE, lambda blocks: _chunk_step(*blocks, scale))


def _recurrent_step(qb, kb, vb, gb, bb, scale):
    """Blocks of one token: qb, kb [NT, 1, H, K]; vb [NT, 1, H, G, V]; gb, bb [NT, 1, H, G]."""
    qb, kb, vb, gb, bb = qb[:, 0] * scale, kb[:, 0], vb[:, 0], gb[:, 0], bb[:, 0]

    def step(S, sl, want_state=True):
        # S [A, H, G, K, V]; the scan always passes states (blocks of one token leave no tails)
        kt = kb[sl]
        S = S * gb[sl].exp()[..., None, None]
        pred = torch.einsum("ahgkv,ahk->ahgv", S, kt)
        delta = bb[sl][..., None] * (vb[sl] - pred)
        S = S + kt[:, :, None, :, None] * delta[:, :, :, None, :]
        o = torch.einsum("ahgkv,ahk->ahgv", S, qb[sl])
        return o[:, None], S  # [A, 1, H, G, V]

    return step


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
    return _gated_delta(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                        1, lambda blocks: _recurrent_step(*blocks, scale))
