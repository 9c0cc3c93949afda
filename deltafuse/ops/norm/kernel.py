"""Triton RMSNorms (zero-centred and gated), forward and backward, with a torch autograd Function.

Layout: any [..., D] input is viewed as rows of D elements (a row stride is passed, so the strided q/k
slices of the attention layer are read in place); the last dimension must have stride 1.

Forward: one program per tile of ROWS rows, the whole row in registers (BLOCK_D = next power of two of
D). The per-row reciprocal RMS is kept in fp32 for the backward. The rounding points of the stock
transformers modules are reproduced (the gated norm rounds norm(x) to x's dtype and w * norm(x) to the
promoted dtype of w and x before the fp32 gate multiply), so low-precision outputs match the stock
modules up to the summation order of the mean.

Backward: a persistent grid; each program walks tiles, writes dx (and dgate), and accumulates its partial
weight gradient in fp32; the partials are summed on the host side with one torch reduction. A weight that
needs no gradient (a frozen norm under LoRA) gets no partials: no accumulator, no buffer, no reduction.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deltafuse.ops._amp import no_autocast_backward

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MAX_D = 65536


@triton.jit
def _rms_fwd_kernel(X, G, W, Y, RSTD, n_rows, D, stride_x, stride_g, stride_y, eps,
                    GATED: tl.constexpr, X_DT: tl.constexpr, P_DT: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D
    rstd = tl.math.rsqrt(ms + eps)
    n = x * rstd[:, None]
    if GATED:
        g = tl.load(G + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        nq = n.to(X_DT).to(tl.float32)
        p = (w[None, :] * nq).to(P_DT).to(tl.float32)
        y = p * (g / (1.0 + tl.exp(-g)))
    else:
        y = n * (1.0 + w[None, :])
    tl.store(Y + r64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rms_bwd_kernel(X, G, W, DY, DX, DG, DW_PART, RSTD, n_rows, D, stride_x, stride_g, stride_dy,
                    stride_dx, stride_dg, n_tiles,
                    GATED: tl.constexpr, X_DT: tl.constexpr, P_DT: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, WANT_DW: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        rows = tile * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)
        x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        n = x * rstd[:, None]
        if GATED:
            nq = n.to(X_DT).to(tl.float32)
            p = (w[None, :] * nq).to(P_DT).to(tl.float32)
            g = tl.load(G + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-g))
            dp = dy * (g * sig)
            dg = dy * p * (sig * (1.0 + g * (1.0 - sig)))
            tl.store(DG + r64[:, None] * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
            if WANT_DW:
                acc += dp * nq
            dn = dp * w[None, :]
        else:
            if WANT_DW:
                acc += dy * n
            dn = dy * (1.0 + w[None, :])
        dot = tl.sum(dn * n, axis=1) / D
        dx = rstd[:, None] * (dn - n * dot[:, None])
        tl.store(DX + r64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(DW_PART + pid * D + cols, tl.sum(acc, axis=0), mask=cmask)


@functools.lru_cache(maxsize=64)
def _config(D: int):
    block_d = triton.next_power_of_2(D)
    if block_d > MAX_D:
        raise ValueError(f"the Triton RMSNorm handles a last dimension of at most {MAX_D}, got D={D}")
    rows = max(1, min(64, 2048 // block_d))
    warps = 4 if block_d * rows <= 2048 else (8 if block_d <= 8192 else 16)
    return block_d, rows, warps


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t2 = t.reshape(-1, D)
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < D):
        t2 = t2.contiguous()
    return t2


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _n_programs(n_tiles: int, device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n_tiles, _sm_count(index) * 4))
    return max(1, min(n_tiles, 4))


def _tl_dtype(dt: torch.dtype):
    if dt not in _TL:
        raise ValueError(f"the Triton RMSNorm supports fp16, bf16 and fp32, got {dt}")
    return _TL[dt]


def _forward(x, gate, weight, eps):
    D = x.shape[-1]
    weight = weight.contiguous()
    x2 = _rows(x, D)
    g2 = _rows(gate, D) if gate is not None else None
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, D), dtype=x.dtype, device=x.device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    block_d, rows, warps = _config(D)
    pdt = torch.promote_types(weight.dtype, x.dtype)
    if n_rows:
        _rms_fwd_kernel[(triton.cdiv(n_rows, rows),)](
            x2, g2 if g2 is not None else x2, weight, y, rstd, n_rows, D, x2.stride(0),
            g2.stride(0) if g2 is not None else 0, y.stride(0), float(eps),
            GATED=gate is not None, X_DT=_tl_dtype(x.dtype), P_DT=_tl_dtype(pdt),
            ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return y.view(x.shape), x2, g2, rstd


def _backward(dy, x2, g2, weight, rstd, want_dw):
    n_rows, D = x2.shape
    weight = weight.contiguous()
    dy2 = _rows(dy, D)
    dx = torch.empty((n_rows, D), dtype=x2.dtype, device=x2.device)
    dg = torch.empty((n_rows, D), dtype=g2.dtype, device=x2.device) if g2 is not None else None
    block_d, rows, warps = _config(D)
    n_tiles = triton.cdiv(n_rows, rows)
    nprog = _n_programs(n_tiles, x2.device)
    # every program writes its row of partials; none are made when the weight needs no gradient (a frozen norm)
    dw_part = torch.empty((nprog, D), dtype=torch.float32, device=x2.device) if want_dw else None
    pdt = torch.promote_types(weight.dtype, x2.dtype)
    if n_rows:
        _rms_bwd_kernel[(nprog,)](
            x2, g2 if g2 is not None else x2, weight, dy2, dx, dg if dg is not None else dx,
            dw_part if want_dw else dx, rstd,
            n_rows, D, x2.stride(0), g2.stride(0) if g2 is not None else 0, dy2.stride(0), dx.stride(0),
            dg.stride(0) if dg is not None else 0, n_tiles,
            GATED=g2 is not None, X_DT=_tl_dtype(x2.dtype), P_DT=_tl_dtype(pdt),
            ROWS=rows, BLOCK_D=block_d, WANT_DW=bool(want_dw), num_warps=warps)
    if not want_dw:
        return dx, dg, None
    dw = dw_part.sum(0).to(weight.dtype) if n_rows else torch.zeros_like(weight)
    return dx, dg, dw


class _RMSNormZeroCentered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, _, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, _, dw = _backward(dy, x2, None, weight, rstd, ctx.needs_input_grad[1])
        return dx.view(ctx.x_shape), dw, None


class _RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        y, x2, g2, rstd = _forward(x, gate, weight, eps)
        ctx.save_for_backward(x2, g2, weight, rstd)
        ctx.shapes = (x.shape, gate.shape)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        x2, g2, weight, rstd = ctx.saved_tensors
        dx, dg, dw = _backward(dy, x2, g2, weight, rstd, ctx.needs_input_grad[2])
        return dx.view(ctx.shapes[0]), dg.view(ctx.shapes[1]), dw, None


def rms_norm_zero_centered_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNormZeroCentered.apply(x, weight, eps)


def rms_norm_gated_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNormGated.apply(x, gate, weight, eps)


__all__ = ["rms_norm_zero_centered_triton", "rms_norm_gated_triton"]
