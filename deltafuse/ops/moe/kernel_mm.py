"""The experts' grouped matmuls in Triton, with the routed rows gathered inside the kernel.

The experts' slots are sorted by expert; expert e owns the sorted rows ``[offs[e-1], offs[e])``. Each grouped
matmul computes ``out[r] = a[r] @ w[e]`` for every sorted row r of expert e, where ``a[r]`` is either row r of a
[S, K] tensor or, gathered, row ``rows[r]`` of a [N, K] tensor (the hidden states or the output gradient in
token order: the [S, K] copy in expert order is never written).

Tiles. Each expert's rows are cut into tiles of ``BM`` rows; a tile map computed on the device (no host sync)
gives every tile slot its expert and first row, and slots past the last tile have expert -1 and return at once.
The number of slots is bounded from the shapes alone: sum_e ceil(c_e / BM) <= (S + E (BM - 1)) / BM, so the
launch needs no value read back from the GPU and a CUDA graph can capture it. One program computes one
[BM, BN] output tile with an fp32 accumulator over the whole K and rounds it once to the output dtype, as
torch's grouped matmul does. Programs run tile-slot major, output-column block minor: the tiles of one expert
are neighbours in launch order, so that the second read of an expert's weight block (its next row tile) can come
from L2.

At Qwen3.5-35B-A3B sizes (4,096 tokens, top-8, 256 experts: about 128 rows per expert) each expert's weights are
read for few rows, and the bytes of the weights bound the time more than the arithmetic. On the H200 this kernel
took 0.77-0.86x the time of torch's grouped kernel at 4,096 tokens (0.65-0.78x, the gather included, for the two
matmuls that gather); at 16,384 tokens 0.96-1.10x for the two that do not and 0.70-0.99x for the two that do.
Where it serves is decided in ``kernel.py`` (BENCHMARKS.md#moe-grouped-mm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting

@dataclass(frozen=True)
class MMConfig:
    """Tile sizes of one grouped matmul launch: BM rows, BN output columns, BK of the reduction per step."""

    # on the H200 the fastest of ten tiles for every one of the four matmuls at 4,096 and 16,384 tokens in a first
    # sweep; in a second, with new ones, the same tile with 4 stages was 2.5 % faster summed over the cases (not yet
    # timed in a training step) (BENCHMARKS.md#moe-grouped-mm)
    bm: int = 128
    bn: int = 256
    bk: int = 64
    warps: int = 8
    stages: int = 3

    def __post_init__(self):
        for name in ("bm", "bn", "bk", "warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"MMConfig.{name}={v!r}; allowed: a power of two")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise ValueError(f"MMConfig.stages={self.stages!r}; allowed: an int >= 1")


# the interpreter's tiles: small, so that tests reach several row tiles, column blocks and reduction steps
INTERPRETED_CONFIG = MMConfig(bm=16, bn=16, bk=16, warps=1, stages=1)


def tile_slots(n_rows: int, n_experts: int, bm: int) -> int:
    """How many tile slots a launch has: the bound sum_e ceil(c_e / bm) <= (n_rows + E (bm - 1)) / bm."""
    return (n_rows + n_experts * (bm - 1)) // bm


@triton.jit
def _tile_map_kernel(OFFS, TILE_E, TILE_ROW, E, SLOTS, BM: tl.constexpr, EB: tl.constexpr, SB: tl.constexpr):
    # one program: every expert's tile count and running total, then each block of slots finds its expert as the
    # number of experts whose tiles end at or before it, and its first row through a one-hot select
    ei = tl.arange(0, EB)
    emask = ei < E
    ends = tl.load(OFFS + ei, mask=emask, other=0)
    starts = tl.load(OFFS + ei - 1, mask=emask & (ei > 0), other=0)
    tiles = tl.where(emask, (ends - starts + BM - 1) // BM, 0)
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    for s0 in range(0, SLOTS, SB):
        s = s0 + tl.arange(0, SB)
        e = tl.sum(((tile_end[None, :] <= s[:, None]) & emask[None, :]).to(tl.int32), axis=1)
        first = tl.sum(tl.where(ei[None, :] == e[:, None], starts[None, :] + (s[:, None] - tile_start[None, :]) * BM,
                                0), axis=1)
        valid = e < E
        smask = s < SLOTS
        tl.store(TILE_E + s, tl.where(valid, e, -1), mask=smask)
        tl.store(TILE_ROW + s, tl.where(valid, first, 0), mask=smask)


def tile_map(offs: torch.Tensor, n_rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first sorted row) of every tile slot, for experts whose sorted rows end at ``offs`` ([E],
    cumulative, int32) over ``n_rows`` rows: [slots] int32 each (``tile_slots``), expert -1 past the last tile.
    One Triton program on the device."""
    E = offs.numel()
    slots = tile_slots(n_rows, E, bm)
    expert = torch.empty(slots, device=offs.device, dtype=torch.int32)
    first = torch.empty_like(expert)
    if slots:
        eb = triton.next_power_of_2(max(E, 1))
        _tile_map_kernel[(1,)](offs.to(torch.int32).contiguous(), expert, first, E, slots, BM=bm, EB=eb,
                               SB=max(16, min(128, 8192 // eb)), num_warps=1 if triton_interpreting() else 4)
    return expert, first


@triton.jit
def _grouped_mm_kernel(A, ROWS, W, OUT, TILE_E, TILE_ROW, OFFS, N, K, stride_a, stride_we, stride_wk, stride_wn,
                       GATHER: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BN)
    slot = pid // n_blocks
    e = tl.load(TILE_E + slot)
    if e >= 0:
        first = tl.load(TILE_ROW + slot)
        end = tl.load(OFFS + e)
        r = first + tl.arange(0, BM)
        rmask = r < end
        r64 = r.to(tl.int64)
        if GATHER:
            src = tl.load(ROWS + r64, mask=rmask, other=0).to(tl.int64)
        else:
            src = r64
        cols = (pid % n_blocks) * BN + tl.arange(0, BN)
        cmask = cols < N
        ks = tl.arange(0, BK)
        at_a = A + src[:, None] * stride_a + ks[None, :]
        at_w = W + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a = tl.load(at_a, mask=rmask[:, None], other=0.0)
                w = tl.load(at_w, mask=cmask[None, :], other=0.0)
            else:
                kmask = (k0 + ks) < K
                a = tl.load(at_a, mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(at_w, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PREC)
            at_a += BK
            at_w += BK * stride_wk
        at_o = OUT + r64[:, None] * N + cols[None, :]
        tl.store(at_o, acc.to(OUT.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def grouped_mm_triton(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None,
                      tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                      config: MMConfig | None = None) -> torch.Tensor:
    """out[r] = a[rows[r]] @ w[e] (``rows`` None: a[r] @ w[e]) for the sorted rows r of each expert e, whose
    rows end at ``offs`` ([E] cumulative int32): a [N or S, K] (unit stride along K), w [E, K, M] (any strides),
    rows [S] int64 -> [S, M] in a's dtype, fp32 accumulator, one rounding. ``tiles``: ``tile_map(offs, S,
    config.bm)`` when the caller already has it (several matmuls of one routing share it)."""
    interp = triton_interpreting()
    config = config or (INTERPRETED_CONFIG if interp else MMConfig())
    S = a.shape[0] if rows is None else rows.shape[0]
    E, K, M = w.shape
    out = a.new_empty(S, M)
    if S == 0 or M == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    if tiles is None:
        tiles = tile_map(offs, S, config.bm)
    tile_e, tile_row = tiles
    grid = (tile_e.numel() * triton.cdiv(M, config.bn),)
    _grouped_mm_kernel[grid](
        a, a if rows is None else rows, w, out, tile_e, tile_row, offs, M, K, a.stride(0), w.stride(0),
        w.stride(1), w.stride(2), GATHER=rows is not None, EVEN_K=K % config.bk == 0,
        PREC="ieee" if a.dtype == torch.float32 else "tf32", BM=config.bm, BN=config.bn, BK=config.bk,
        num_warps=config.warps, num_stages=config.stages)
    return out
