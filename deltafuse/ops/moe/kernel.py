"""MoE experts with the per-token sums and the backward's activation step in Triton; the grouped matmuls, the
forward's SwiGLU and the routing plan are the torch reference's.

The torch reference (``reference.py``) sorts the N*k (token, expert) slots by expert and runs torch's grouped
matmuls in that order. Twice per call it sums each token's k rows out of expert order: the forward's weighted
output ``out[n] = sum_j w[n, j] * y[inv[n, j]]`` and the backward's hidden-state gradient
``dx[n] = sum_j dxs[inv[n, j]]``. There it is one ``embedding_bag``. ``gather_sum_triton`` does the same
sum in one pass: each program reads one token's k rows (one column block, the k loads unrolled and in flight
together), accumulates in fp32 in slot order and rounds once to the rows' dtype, as the reference does. It is
deterministic (no atomics).

The backward's activation step, given g = dout_n @ down[e] and the slots' routing weights w, needs <g, act>
per slot (the routing-weight gradient), act * w (the down weight gradient's operand) and d[gate; up] for the
upstream g * w. The reference recomputes act through the swiglu op and runs about eight kernels (the
activation, two products with w, the row dots, the activation's backward, a concatenation).
``act_grads_triton`` reads gate, up and g once and writes the three results, rounding where the torch
reference rounds (silu(gate) and act to the inputs' dtype, g * w and g * w * up before the SiLU derivative).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops.moe import kernel_mm
from deltafuse.ops.moe.reference import ExpertKernels, run_grouped

# widest column block of one program; a token's k rows of it are loaded together
MAX_BLOCK = 1024


@triton.jit
def _gather_sum_kernel(R, IDX, W, OUT, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(IDX + n * K + j).to(tl.int64)
        x = tl.load(R + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            x = x * tl.load(W + n * K + j).to(tl.float32)
        acc += x
    tl.store(OUT + n * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def gather_sum_triton(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * rows[index[n, j]] (weights None: the plain sum): rows [S, H], index and
    weights [N, k] -> [N, H] in rows' dtype, with an fp32 accumulator and one rounding."""
    n, k = index.shape
    H = rows.shape[1]
    rows = rows.contiguous()
    index = index.contiguous()
    out = rows.new_empty(n, H)
    if n == 0 or H == 0:
        return out
    interp = triton_interpreting()
    # small blocks when interpreted, so that the tests reach several column blocks
    block = min(32 if interp else MAX_BLOCK, triton.next_power_of_2(H))
    w = index if weights is None else weights.contiguous()
    _gather_sum_kernel[(n, triton.cdiv(H, block))](rows, index, w, out, H, K=k, HAS_W=weights is not None,
                                                   BLOCK=block, num_warps=1 if interp else 4)
    return out


@triton.jit
def _act_grads_kernel(GU, G, WS, DWS, ACTW, DGU, S, I, stride_gu, DT: tl.constexpr, NEED_W: tl.constexpr,
                      NEED_DOWN: tl.constexpr, NEED_DGU: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < S
    r64 = rows.to(tl.int64)
    w = tl.load(WS + r64, mask=rmask, other=0.0).to(tl.float32)
    dws = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, I, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < I)[None, :]
        at_gu = GU + r64[:, None] * stride_gu + cols[None, :]
        at_i = r64[:, None] * I + cols[None, :]
        gate = tl.load(at_gu, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(at_gu + I, mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(G + at_i, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = (gate * sig).to(DT).to(tl.float32)
        act = (silu * up).to(DT).to(tl.float32)
        if NEED_W:
            dws += tl.sum(gv * act, axis=1)
        if NEED_DOWN:
            tl.store(ACTW + at_i, (act * w[:, None]).to(DT), mask=mask)
        if NEED_DGU:
            gw = (gv * w[:, None]).to(DT).to(tl.float32)
            dup = gw * silu
            dgate = (gw * up).to(DT).to(tl.float32) * (sig * (1.0 + gate * (1.0 - sig)))
            at_d = DGU + r64[:, None] * (2 * I) + cols[None, :]
            tl.store(at_d, dgate.to(DT), mask=mask)
            tl.store(at_d + I, dup.to(DT), mask=mask)
    if NEED_W:
        tl.store(DWS + r64, dws, mask=rmask)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def act_grads_triton(gu, g, w_sorted, w_dtype, need_w: bool, need_down: bool, need_dgu: bool):
    """``reference.ExpertKernels.act_grads`` in one Triton pass: gu [S, 2I] ([gate; up]), g [S, I] and
    w_sorted [S] in the activations' dtype -> (<g, act> [S] in ``w_dtype``, act * w [S, I], d[gate; up]
    [S, 2I]), None where not needed."""
    S, I2 = gu.shape
    inter = I2 // 2
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    g = g.contiguous()
    w_sorted = w_sorted.contiguous()
    dev, dt = gu.device, gu.dtype
    dws = torch.empty(S, device=dev, dtype=torch.float32) if need_w else None
    act_w = torch.empty(S, inter, device=dev, dtype=dt) if need_down else None
    dgu = torch.empty(S, I2, device=dev, dtype=dt) if need_dgu else None
    if S and inter and (need_w or need_down or need_dgu):
        interp = triton_interpreting()
        rows, block = (4, 16) if interp else (4, min(256, triton.next_power_of_2(inter)))
        dummy = g
        _act_grads_kernel[(triton.cdiv(S, rows),)](
            gu, g, w_sorted, dws if need_w else dummy, act_w if need_down else dummy,
            dgu if need_dgu else dummy, S, inter, gu.stride(0), DT=_TL[dt], NEED_W=need_w, NEED_DOWN=need_down,
            NEED_DGU=need_dgu, ROWS=rows, BLOCK=block, num_warps=1 if interp else 4)
    elif need_w:
        dws.zero_()
    return (None if dws is None else dws.to(w_dtype)), act_w, dgu


# CUDA compute capabilities where the experts op ran faster with the Triton grouped matmuls than with torch's, alone
# and in the training step (the H200: BENCHMARKS.md#moe-grouped-mm); elsewhere torch's grouped kernel serves (its
# loop where it has none)
TRITON_MM_CAPABILITIES = ((9, 0),)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _triton_mm_device(t: torch.Tensor) -> bool:
    if triton_interpreting():
        return t.device.type == "cpu" and t.dtype == torch.float32
    if t.device.type != "cuda" or t.dtype not in (torch.float16, torch.bfloat16) or torch.version.hip is not None:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability(index) in TRITON_MM_CAPABILITIES


class _TritonSums(ExpertKernels):
    """The reference's routing with the per-token sums, the backward's activation step and, on the devices of
    ``TRITON_MM_CAPABILITIES``, the forward and data-gradient grouped matmuls (``kernel_mm``) in Triton."""

    def __init__(self, grouped: bool, n_experts: int, zero_empty: bool):
        super().__init__(grouped, n_experts, zero_empty)
        self._tiles = {}

    def _triton_mm(self, a, rows, w, offs):
        config = kernel_mm.INTERPRETED_CONFIG if triton_interpreting() else kernel_mm.MMConfig()
        S = a.shape[0] if rows is None else rows.shape[0]
        key = (config.bm, S)
        if key not in self._tiles:  # the four matmuls of one call share the routing, hence the tile map
            self._tiles[key] = kernel_mm.tile_map(offs, S, config.bm)
        return kernel_mm.grouped_mm_triton(a, w, offs, rows, self._tiles[key], config)

    def mm(self, x, w, offs):
        if _triton_mm_device(x):
            return self._triton_mm(x, None, w, offs)
        return super().mm(x, w, offs)

    def mm_rows(self, src, rows, w, offs):
        if _triton_mm_device(src):
            return self._triton_mm(src, rows, w, offs)
        return super().mm_rows(src, rows, w, offs)

    @staticmethod
    def gather_sum(rows, index, weights):
        return gather_sum_triton(rows, index, weights)

    @staticmethod
    def act_grads(gu, g, w_sorted, w_dtype, need_w: bool, need_down: bool, need_dgu: bool):
        return act_grads_triton(gu, g, w_sorted, w_dtype, need_w, need_down, need_dgu)


def moe_experts_triton(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """The torch reference's experts (grouped matmuls where they work) with its two per-token sums and its
    backward's activation step in Triton."""
    return run_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, grouped=True,
                       kernels=_TritonSums)
