"""MoE experts of the Qwen3.5-MoE / Qwen3-Next family in torch: grouped matmuls with a lean autograd Function.

Math (transformers' experts module, 3-D parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I],
no bias, gate and up concatenated as [gate; up] along 2I): for token n and its j-th routed expert e,
``y = down[e] @ (silu(gate) * up)`` with ``[gate; up] = gate_up[e] @ x_n``, and the output is
``sum_j w[n, j] * y``.

Forward: the N*k (token, expert) slots are sorted by expert (stable), group offsets come from a
``searchsorted`` on the sorted ids (no host sync), the hidden rows are gathered, then one grouped matmul for
gate_up, SiLU * up (deltafuse's swiglu op: reads the two strided halves in place, and its backward serves
ours), one grouped matmul for down, and the weighted sum over each token's k slots reads the down output in
expert order through the inverse permutation (one ``embedding_bag`` with per-slot weights on CPU and CUDA:
fp32 accumulator, deterministic, no atomics, and no [S, H] copy of the output in token order).

Backward: only the gate_up output [S, 2I] is kept (plus the sort permutation and offsets; the hidden states
and weights are inputs). The hidden-state gradient is formed before the gate_up weight gradient, so no [S, H]
buffer of it coexists with that [E, 2I, H] gradient (the backward's peak). The gathered hidden rows and
SiLU * up are recomputed; the down projection output is never needed because the routing-weight gradient is
computed as <dout_n @ down[e], silu(gate) * up>, i.e. from the same [S, I] product that feeds the rest of
the backward (one batched row-dot product with an fp32 accumulator: no fp32 copies of the two [S, I]
operands); the hidden-state gradient is summed over each token's slots as the forward's output is. The stock grouped path keeps the gathered hidden rows, the down output, the activation and its
product (two [S, H] and two [S, I] tensors more).

Grouped matmuls use ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` when a one-time probe says
they work for the device and dtype and the call's strides are 16-byte aligned; otherwise a loop over
experts (one host sync to read the offsets). Weight gradients of experts that received no token are zeroed
explicitly on devices where the grouped kernel is known to leave them non-zero (Blackwell, ROCm).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from deltafuse.ops._amp import no_autocast_backward
from deltafuse.ops.swiglu.api import swiglu

_GROUPED = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_call(a, b, offs):
    if getattr(F, "grouped_mm", None) is not None:
        return F.grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a, b, offs=offs)


def _loop_mm(x, w, offs):
    """x [S, K] @ w[e] [K, M] for each group of rows -> [S, M]."""
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def _loop_wgrad(a, b, offs, n_groups):
    """sum over each group's rows of a[s]^T b[s]: a [S, P], b [S, Q] -> [E, P, Q]."""
    out = a.new_zeros((n_groups, a.shape[1], b.shape[1]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end].t(), b[start:end], out=out[e])
        start = end
    return out


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int] | None:
    """Compute capability of a CUDA device (the kernels this file calls depend on it), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _grouped_works(device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    """One-time probe: the grouped kernel runs for this device/dtype and matches the loop (empty group incl.)."""
    if _GROUPED is None:
        return False
    if device_type == "cuda":
        cap = _capability(index)
        if cap is None or cap < (8, 0) or torch.version.hip is not None:
            return False
    if device_type == "cpu" and torch.__version__ < (2, 9):
        return False
    try:
        dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(dev, dtype)
        w = torch.randn(3, 32, 16, generator=gen).to(dev, dtype)
        b = torch.randn(24, 8, generator=gen).to(dev, dtype)
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=dev)
        got = _grouped_call(x, w.transpose(1, 2), offs).float()
        ref = _loop_mm(x.float(), w.float().transpose(1, 2), offs)
        got_w = _grouped_call(x.t(), b, offs)[[0, 2]].float()
        ref_w = _loop_wgrad(x.float(), b.float(), offs, 3)[[0, 2]]
        tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        ok = (got - ref).abs().max() <= tol * ref.abs().max() and (got_w - ref_w).abs().max() <= tol * ref_w.abs().max()
        return bool(ok)
    except Exception:  # not implemented for this device/dtype: the loop serves
        return False


def _aligned(*tensors) -> bool:
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * es) % 16 for s in t.stride()[-2:]):
            return False
    return True


def _empty_groups_need_zeroing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    if torch.version.hip is not None:
        return True
    cap = _capability(device.index)
    return cap is not None and cap[0] >= 10


class _Plan:
    """Routing of one call: sorted slots, group offsets, the token of each sorted slot, the inverse order."""

    def __init__(self, top_k_index: torch.Tensor, n_experts: int):
        flat = top_k_index.reshape(-1)
        self.k = top_k_index.shape[1]
        # expert ids sorted as 16-bit keys where they fit: a radix sort makes one pass per key byte (torch.topk's
        # int64 indices took 8 passes per layer on the GPU, 2 do); a stable sort's order is the same either way
        if n_experts <= torch.iinfo(torch.int16).max and flat.dtype != torch.int16:
            flat = flat.to(torch.int16)
        sorted_ids, self.perm = torch.sort(flat, stable=True)
        bounds = torch.arange(1, n_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
        self.offs = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
        self.token = self.perm // self.k
        self.n_experts = n_experts
        self._inverse = None

    def inverse(self) -> torch.Tensor:
        """inv[slot] = the sorted row of token-order slot ``slot`` (computed once per call, forward and
        backward share it; a routing index, not derived from any trainable tensor)."""
        if self._inverse is None:
            inv = torch.empty_like(self.perm)
            inv[self.perm] = torch.arange(self.perm.numel(), device=self.perm.device)
            self._inverse = inv
        return self._inverse


class ExpertKernels:
    """The kernels of ``_MoeExperts``: grouped matmuls (``mm``, ``wgrad``), the per-token weighted sum over a
    token's slots (``gather_sum``) and the backward's activation step (``act_grads``)."""

    def __init__(self, grouped: bool, n_experts: int, zero_empty: bool):
        self.grouped, self.n_experts, self.zero_empty = grouped, n_experts, zero_empty

    def mm(self, x, w, offs):
        """x [S, K] @ w[e] ([K, M] view) per group."""
        if self.grouped and _aligned(x, w):
            return _grouped_call(x, w, offs)
        return _loop_mm(x, w, offs)

    def mm_rows(self, src, rows, w, offs):
        """src[rows] @ w[e] per group: the sorted slots' rows of ``src`` ([N, K] in token order) gathered first."""
        return self.mm(src[rows], w, offs)

    def wgrad(self, a, b, offs):
        if self.grouped and _aligned(a.t(), b):
            out = _grouped_call(a.t(), b, offs)
            if self.zero_empty:
                counts = torch.diff(offs, prepend=offs.new_zeros(1))
                out = torch.where((counts > 0).view(-1, 1, 1), out, torch.zeros((), dtype=out.dtype,
                                                                                device=out.device))
            return out
        return _loop_wgrad(a, b, offs, self.n_experts)

    @staticmethod
    def gather_sum(rows, index, weights):
        return gather_sum_torch(rows, index, weights)

    @staticmethod
    def act_grads(gu, g, w_sorted, w_dtype, need_w: bool, need_down: bool, need_dgu: bool):
        """What the backward needs of the activation ``act = silu(gate) * up`` (``gu`` = [gate; up], [S, 2I]),
        given ``g`` = dout_n @ down[e] ([S, I]) and the sorted slots' routing weights ``w_sorted`` ([S]):
        (<g, act> per slot in ``w_dtype``, act * w, d[gate; up] of act for the upstream g * w), each None
        where not needed."""
        return act_grads_torch(gu, g, w_sorted, w_dtype, need_w, need_down, need_dgu)


# Devices whose embedding_bag reads rows by index and sums them per bag with a floating-point accumulator of at
# least fp32 (one rounding to the output dtype), deterministically (no atomics): the per-token gather-sum below
# is one such call there, and a gather into a fresh [S, H] buffer plus a reduction elsewhere.
_BAG_DEVICES = ("cpu", "cuda")


def gather_sum_torch(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * rows[index[n, j]] (weights None: plain sum) with an fp32 (or wider)
    accumulator and one rounding to rows' dtype: rows [S, H], index [N, k] (each row read once) -> [N, H].

    One ``embedding_bag`` where the device's kernel is known to be deterministic and to accumulate in fp32
    (``_BAG_DEVICES``): the [S, H] rows are read in place, never copied into token order first. Elsewhere
    the rows are gathered into token order and reduced (a batched [1, k] x [k, H] product per token, or a
    sum in fp32)."""
    n, k = index.shape
    if rows.device.type in _BAG_DEVICES and rows.dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                              torch.float16):
        return F.embedding_bag(index, rows, mode="sum", per_sample_weights=weights)
    g = rows[index.reshape(-1)].view(n, k, rows.shape[1])
    if weights is None:
        return g.sum(1, dtype=torch.promote_types(rows.dtype, torch.float32)).to(rows.dtype)
    out = rows.new_empty(n, rows.shape[1])
    torch.bmm(weights.view(n, 1, k), g, out=out.view(n, 1, rows.shape[1]))
    return out


def _row_dots(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_i a[s, i] * b[s, i] per row with an fp32 (or wider) accumulator, rounded once to ``dtype``: one
    batched [1, I] x [I, 1] product (the exact products of two 16-bit values summed in the matmul's fp32
    accumulator), instead of upcasting both [S, I] operands, multiplying and reducing."""
    if a.dtype != dtype:  # the routing weights' dtype differs from the activations': keep fp32 partials
        return (a.to(torch.promote_types(a.dtype, torch.float32)) * b).sum(-1).to(dtype)
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu(gate, up)


def act_grads_torch(gu, g, w_sorted, w_dtype, need_w: bool, need_down: bool, need_dgu: bool):
    """``ExpertKernels.act_grads`` in torch: SiLU * up recomputed through the swiglu op (to reuse its
    backward), the row dots as one batched product with an fp32 accumulator."""
    inter = gu.shape[1] // 2
    with torch.enable_grad():
        gate = gu[:, :inter].detach().requires_grad_()
        up = gu[:, inter:].detach().requires_grad_()
        act = _swiglu(gate, up)
    dws = _row_dots(g, act.detach(), w_dtype) if need_w else None
    act_w = act.detach() * w_sorted[:, None] if need_down else None
    dgu = None
    if need_dgu:
        dgate, dup = torch.autograd.grad(act, (gate, up), g * w_sorted[:, None])
        dgu = torch.cat([dgate, dup], dim=-1)
    return dws, act_w, dgu


class _MoeExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_weights, gate_up, down, top_k_index, mats, needs):
        n, hdim = hidden.shape
        k = top_k_index.shape[1]
        inter = down.shape[2]
        plan = _Plan(top_k_index, gate_up.shape[0])
        gu = mats.mm_rows(hidden, plan.token, gate_up.transpose(1, 2), plan.offs)
        act = _swiglu(gu[:, :inter], gu[:, inter:])
        y = mats.mm(act, down.transpose(1, 2), plan.offs)
        del act
        # the weighted sum over each token's k slots reads the down output in expert order through the inverse
        # permutation (no [S, H] copy in token order); a fresh tensor, which callers may modify in place
        # (transformers 5.2 adds the shared expert with +=)
        out = mats.gather_sum(y, plan.inverse().view(n, k), top_k_weights.to(y.dtype))
        del y
        ctx.save_for_backward(hidden, top_k_weights, gate_up, down, gu)
        ctx.plan, ctx.mats, ctx.needs = plan, mats, needs
        return out

    @staticmethod
    @no_autocast_backward
    @once_differentiable
    def backward(ctx, dout):
        hidden, top_k_weights, gate_up, down, gu = ctx.saved_tensors
        plan, mats = ctx.plan, ctx.mats
        need_h, need_w, need_gu, need_down = ctx.needs
        n, hdim = hidden.shape
        dt = hidden.dtype
        dout = dout.to(dt).contiguous()
        w_sorted = top_k_weights.reshape(-1)[plan.perm].to(dt)
        # d(out) at each sorted slot's token, [S, H]: gathered once when the down weight gradient needs it too,
        # else only inside the matmul (mm_rows)
        do_g = dout[plan.token] if need_down else None
        # [S, I] = dout_n @ down[e]
        g = mats.mm_rows(dout, plan.token, down, plan.offs) if do_g is None else mats.mm(do_g, down, plan.offs)
        dws, act_w, dgu = mats.act_grads(gu, g, w_sorted, top_k_weights.dtype, need_w, need_down,
                                         need_h or need_gu)
        del g
        d_w = d_down = d_gu = d_hidden = None
        if need_w:  # back in token order by one gather through the inverse permutation
            d_w = dws[plan.inverse()].view(n, plan.k)
        if need_down:
            d_down = mats.wgrad(do_g, act_w, plan.offs)
            del act_w, do_g
        if dgu is not None:
            if need_h:
                # before the [E, 2I, H] weight gradient exists, so that the [S, H] data gradient is freed by
                # then; summed over each token's k slots straight from expert order (fp32 accumulator,
                # deterministic)
                dx = mats.mm(dgu, gate_up, plan.offs)
                d_hidden = mats.gather_sum(dx, plan.inverse().view(n, plan.k), None)
                del dx
            if need_gu:
                d_gu = mats.wgrad(dgu, hidden[plan.token], plan.offs)
        return d_hidden, d_w, d_gu, d_down, None, None, None


def run_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, make_mats):
    """The experts autograd Function with the kernels of ``make_mats()`` (an object with ``mm``, ``wgrad``,
    ``gather_sum`` and ``act_grads`` as ``ExpertKernels`` has); a call that routes no token returns zeros still
    tied to the inputs."""
    grad = torch.is_grad_enabled()
    needs = tuple(grad and t.requires_grad for t in (hidden, top_k_weights, gate_up_proj, down_proj))
    if top_k_index.numel() == 0:
        anchor = sum((t.sum() * 0) for t in (hidden, top_k_weights, gate_up_proj, down_proj))
        return torch.zeros_like(hidden) + anchor.to(hidden.dtype)
    return _MoeExperts.apply(hidden, top_k_weights, gate_up_proj, down_proj, top_k_index, make_mats(), needs)


def run_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, grouped: bool, kernels=None):
    """``run_experts`` with torch's grouped matmuls where they work (``grouped``) and the kernels class
    ``kernels`` (default ``ExpertKernels``; a subclass may replace ``gather_sum`` and ``act_grads``)."""
    dev = hidden.device
    cls = ExpertKernels if kernels is None else kernels

    def make_mats():
        use = grouped and _grouped_works(dev.type, dev.index, hidden.dtype)
        return cls(use, gate_up_proj.shape[0], _empty_groups_need_zeroing(dev))

    return run_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, make_mats)


def moe_experts_torch(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """Grouped matmuls where the device/dtype supports them, else a loop over experts."""
    return run_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, grouped=True)


def moe_experts_torch_loop(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """Always the loop over experts (what the grouped path falls back to); for tests and comparisons."""
    return run_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, grouped=False)
