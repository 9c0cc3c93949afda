"""Triton SwiGLU ``silu(gate) * up``, forward and backward, with a torch autograd Function.

Inputs are viewed as rows of C elements with a row stride, so the two halves of a fused gate/up projection
(``linear(x, gate_up).chunk(2, -1)``) are read in place without a copy. The forward rounds silu(gate) to
the input dtype before the product, as the stock ``act_fn(gate) * up`` does, so low-precision outputs
match the stock MLP. Only gate and up are kept for the backward (the stock path also keeps silu(gate)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafuse.ops._amp import no_autocast_backward

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _tile(n_rows, C, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """(r64, cols, mask) of this program's [ROWS, BLOCK_C] tile of the [n_rows, C] rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows.to(tl.int64), cols, (rows < n_rows)[:, None] & (cols < C)[None, :]


@triton.jit
def _at(P, r64, stride, cols):
    return P + r64[:, None] * stride + cols[None, :]


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n_rows, C, stride_g, stride_u, stride_y,
                       X_DT: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r64, cols, mask = _tile(n_rows, C, ROWS, BLOCK_C)
    g = tl.load(_at(G, r64, stride_g, cols), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(_at(U, r64, stride_u, cols), mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(X_DT).to(tl.float32)
    tl.store(_at(Y, r64, stride_y, cols), (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, n_rows, C, stride_g, stride_u, stride_dy, stride_dg, stride_du,
                       ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    r64, cols, mask = _tile(n_rows, C, ROWS, BLOCK_C)
    g = tl.load(_at(G, r64, stride_g, cols), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(_at(U, r64, stride_u, cols), mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(_at(DY, r64, stride_dy, cols), mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    du = dy * (g * sig)
    dg = dy * u * (sig * (1.0 + g * (1.0 - sig)))
    tl.store(_at(DG, r64, stride_dg, cols), dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(_at(DU, r64, stride_du, cols), du.to(DU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, C: int) -> torch.Tensor:
    t2 = t.reshape(-1, C)
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < C):
        t2 = t2.contiguous()
    return t2


def _config(C: int):
    block_c = min(1024, triton.next_power_of_2(C))
    rows = max(1, 1024 // block_c)
    return block_c, rows, 4


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        C = gate.shape[-1]
        g2, u2 = _rows(gate, C), _rows(up, C)
        n_rows = g2.shape[0]
        y = torch.empty((n_rows, C), dtype=gate.dtype, device=gate.device)
        block_c, rows, warps = _config(C)
        if y.numel():
            _swiglu_fwd_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(C, block_c))](
                g2, u2, y, n_rows, C, g2.stride(0), u2.stride(0), y.stride(0), X_DT=_TL[gate.dtype],
                ROWS=rows, BLOCK_C=block_c, num_warps=warps)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return y.view(gate.shape)

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        n_rows, C = g2.shape
        dy2 = _rows(dy, C)
        dg = torch.empty((n_rows, C), dtype=g2.dtype, device=g2.device)
        du = torch.empty((n_rows, C), dtype=u2.dtype, device=u2.device)
        block_c, rows, warps = _config(C)
        if dg.numel():
            _swiglu_bwd_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(C, block_c))](
                g2, u2, dy2, dg, du, n_rows, C, g2.stride(0), u2.stride(0), dy2.stride(0), dg.stride(0),
                du.stride(0), ROWS=rows, BLOCK_C=block_c, num_warps=warps)
        return dg.view(ctx.shape), du.view(ctx.shape)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.dtype not in _TL:
        raise ValueError(f"the Triton SwiGLU supports fp16, bf16 and fp32, got {gate.dtype}")
    return _SwiGLU.apply(gate, up)
