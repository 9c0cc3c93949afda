"""Chunked gated delta rule in Triton: the host side of the kernels (chunk tables, launch configuration, the
launches of the forward and of the backward).

Every launch takes its tunables from the ``ChunkOptions`` it is handed (``PassConfig``) and reports to the stage
hook it is handed; nothing here reads a default. The recurrence, the chunk algebra and the grid of every kernel
are described in ``kernel.py`` (the op's Triton entry and autograd Function).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops._checks import host_offsets, known_host_offsets
from deltafuse.ops.gated_delta.chunk_options import INV_MODES, PROD_MODES, ChunkOptions, StageHook
from deltafuse.ops.gated_delta.gates import NONE, Gates
from deltafuse.ops.gated_delta.kernel_bwd import _bwd_out, _bwd_reduce, _bwd_wy, _dv_local, _state_bwd
from deltafuse.ops.gated_delta.kernel_fwd import _intra_fwd, _l2norm_rstd, _state_fwd
from deltafuse.ops.gated_delta.kernel_out import _out_fwd

BT = 64  # chunk length; the in-chunk inverse (kernel_fwd._unit_lower_inverse) is written for 4 blocks of 16

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreting() -> bool:
    return triton_interpreting()


_ALIGN = 4  # int32 elements in 16 bytes


class Plan:
    """Sequence and chunk bookkeeping for one call (int32 tables on the inputs' device).

    Built with tensor operations on the host (no per-sequence or per-chunk Python loop: a packed row of
    thousands of short sequences gets a new plan every step) and copied to the device in one transfer.
    """

    padded = False  # every chunk row is a real chunk (DevicePlan: rows past them are empty)

    def __init__(self, bounds: list[int], device: torch.device):
        b = torch.tensor(bounds, dtype=torch.int64)
        starts, ends = b[:-1], b[1:]
        counts = (ends - starts + BT - 1) // BT  # chunks per sequence
        offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        self.N = counts.numel()
        self.NC = int(offsets[-1])
        seq = torch.repeat_interleave(torch.arange(self.N), counts)  # sequence of every chunk
        within = torch.arange(self.NC) - offsets[:-1][seq]  # chunk index inside its sequence
        rows = torch.stack([seq, starts[seq] + within * BT, ends[seq]], 1)  # (sequence, start, end)
        if not self.NC:
            rows = rows.new_zeros(1, 3)
        self.cu, self.coff, self.chunks = _tables(b, offsets, rows, device)


def _tables(cu: torch.Tensor, coff: torch.Tensor, rows: torch.Tensor, device) -> tuple:
    """(offsets, first chunk of every sequence, chunk rows) as int32 views of one tensor on ``device``, each table
    starting on a 16-byte boundary: Triton specialises pointer arguments on that, and tables at offsets of n+1 and
    2(n+1) entries for n sequences compiled every chunk kernel a second time whenever a new n moved them on or off
    such a boundary (13.6 s at step 2 of a moe8 run on the H200)."""
    n1 = cu.numel()
    pad = cu.new_zeros(-n1 % _ALIGN)
    table = torch.cat([cu, pad, coff, pad, rows.reshape(-1)]).to(torch.int32).to(device, non_blocking=True)
    step = n1 + pad.numel()
    return table[:n1], table[step:step + n1], table[2 * step:]


def plan_for(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device):
    """Chunk tables, kept per sequence layout (they depend on lengths only, never on values); for packed
    sequences whose offsets the host does not hold, or while a CUDA graph is being captured, built on the device
    (``DevicePlan``: no read of the offsets, and nothing of this call's layout baked into a captured graph)."""
    if cu_seqlens is not None and _plan_on_device(cu_seqlens):
        return DevicePlan(cu_seqlens, B * T)
    bounds = tuple(range(0, B * T + 1, T)) if T else (0,) * (B + 1)
    return _plan(bounds if cu_seqlens is None else tuple(host_offsets(cu_seqlens)), str(device))


def _plan_on_device(cu_seqlens: torch.Tensor) -> bool:
    """Whether the chunk tables of these offsets are built on their device: always on an accelerator while a CUDA
    graph is captured there (the host's tables would hold this call's layout in every replay), else when they are
    on an accelerator and the host holds no copy of them (``remember_host_offsets``: reading them would wait for
    the device). On the CPU reading them costs nothing."""
    if cu_seqlens.device.type == "cpu":
        return False
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    return known_host_offsets(cu_seqlens) is None


@functools.lru_cache(maxsize=64)
def _plan(bounds: tuple[int, ...], device: str) -> Plan:
    return Plan(list(bounds), torch.device(device))


class DevicePlan:
    """``Plan``'s tables built on the offsets' device with tensor operations of fixed sizes, from nothing but the
    offsets tensor and the token count: no value is read on the host, so a captured CUDA graph recomputes them
    from the offsets it is replayed with.

    The number of chunks depends on the lengths, so the chunk table has room for the most chunks N sequences of
    TT tokens can have, (TT + 63 N) // 64, and its rows past the real chunks are empty (start = end = TT): every
    chunk kernel returns at once for such a row, and the chunk-indexed buffers (chunk-start states) get rows
    nothing reads. Empty sequences (equal offsets: the padding of a fixed-size offsets tensor) have no chunk;
    their final state is their initial state."""

    padded = True

    def __init__(self, cu_seqlens: torch.Tensor, TT: int):
        dev = cu_seqlens.device
        cu = cu_seqlens.to(torch.int64)
        self.N = N = cu.numel() - 1
        self.NC = NC = (TT + (BT - 1) * N) // BT
        counts = (cu[1:] - cu[:-1] + BT - 1) // BT
        coff = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        chunk = torch.arange(NC, device=dev)
        seq = torch.searchsorted(coff[1:], chunk, right=True)  # the sequence of every chunk; N past the last one
        real = seq < N
        seq = seq.clamp_max(N - 1)
        start = torch.where(real, cu[seq] + (chunk - coff[seq]) * BT, TT)
        end = torch.where(real, cu[seq + 1], TT)
        rows = torch.stack([seq, start, end], 1) if NC else cu.new_full((1, 3), TT)
        self.cu, self.coff, self.chunks = _tables(cu, coff, rows, dev)


class PassConfig:
    """Compile-time choices for one pass ("fwd" or "bwd") of one dtype / head-size family under ``options``;
    ``stage_hook(stage_name)`` is called after each kernel launch of the pass (``mark``)."""

    def __init__(self, dtype: torch.dtype, K: int, V: int, which: str, options: ChunkOptions,
                 stage_hook: StageHook | None = None):
        interp = _interpreting()
        opts = self.options = options
        self.stage_hook = stage_hook
        self.BK = max(16, triton.next_power_of_2(K))
        self.DT = TL_DTYPES[dtype]
        full = dtype == torch.float32
        # precision of fp32-operand products: exact in the interpreter, three-pass tf32 for fp32 inputs
        self.PREC = "ieee" if interp else ("tf32x3" if full else "tf32")
        self.X2 = (not full) and bool(getattr(opts, which + "_x2"))
        # the in-chunk kernel: inverse of the diagonal blocks, product mode of T with k and v (kernel_fwd._dot_ma).
        # The backward reruns it to recompute w, u and T, so both passes take the forward's fwd_x2: the backward
        # then differentiates exactly what the forward computed, whatever bwd_x2 says.
        self.INV = INV_MODES[opts.intra_inv]
        self.intra_mode = PROD_MODES["16"] if (not full and opts.intra_prod == "16") else (
            PROD_MODES["x2"] if (not full and opts.fwd_x2) else PROD_MODES["tf32"])
        if not (full or interp) and getattr(opts, which + "_store") == "fp32":
            # the sequential pass with fp32-stored states and 16-bit inputs gave NaN outputs and then an illegal
            # memory access on the H200 with Triton 3.6 (BENCHMARKS.md#gdn-v2-combined); the interpreter tests keep it
            raise ValueError(f"ChunkOptions.{which}_store='fp32' with {str(dtype).replace('torch.', '')} inputs is "
                             "refused on a GPU (NaN outputs and an illegal memory access on the H200 with Triton "
                             "3.6); allowed: 'input' (fp32 inputs always store fp32)")
        self.store = torch.float32 if (full or getattr(opts, which + "_store") == "fp32") else dtype
        # the u buffer of the in-chunk kernel (the forward writes v' over it): fp32 under fwd_store_v in both passes,
        # so that the backward's recompute of the states is the forward's; the backward's own v' buffer, read by
        # _bwd_out, stays in self.store
        self.store_v = torch.float32 if opts.fwd_store_v == "fp32" else self.store
        vmax = max(16, triton.next_power_of_2(V))
        names = ("intra", "dvl", "wy", "bo")
        self.bv = {n: min(vmax, 16 if interp else getattr(opts, "bv_" + n)) for n in names}
        # Head sizes under 64 (tiles of 16 or 32 columns) gave wrong outputs with 8 warps and illegal memory
        # accesses with 4 on the H200 (Triton 3.6); 2 warps are correct there (BENCHMARKS.md#gdn-small-heads).
        small = min(self.BK, vmax) < 64
        warps = {n: getattr(opts, "warps_" + n) for n in names}
        self.nw = {n: 1 if interp else (min(2, warps[n]) if small else warps[n]) for n in names}
        self.stages = 1 if interp else opts.stages

    def mark(self, name: str) -> None:
        """A kernel launch of stage ``name`` is done: tell the stage hook, if any."""
        if self.stage_hook is not None:
            self.stage_hook(name)


def _rstd(q, k, L2, cfg):
    """rsqrt(|x|^2 + eps) per row of q and k, or (None, None) when the l2norm is off."""
    if not L2:
        return None, None
    TT, H, K = q.shape
    rq = torch.empty(TT, H, device=q.device, dtype=torch.float32)
    rk = torch.empty(TT, H, device=q.device, dtype=torch.float32)
    if TT:
        _l2norm_rstd[(triton.cdiv(TT, 64), H)](q, k, rq, rk, TT, q.stride(0), k.stride(0), H=H, K=K,
                                               BK=max(16, triton.next_power_of_2(K)),
                                               num_warps=1 if _interpreting() else 4)
    cfg.mark("l2norm")
    return rq, rk


def _dense(x: torch.Tensor, make=torch.empty) -> torch.Tensor:
    """A contiguous tensor of ``x``'s shape, dtype and device: q, k and v may be row views of a wider tensor, their
    gradients never are."""
    return make(x.shape, device=x.device, dtype=x.dtype)


def _alias(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf``'s bytes as a contiguous tensor of ``dtype`` and ``shape`` (the caller checks that the byte layouts
    of one token and head agree)."""
    return buf.view(torch.uint8).view(dtype).view(shape)


def _gate_args(gates: Gates, dummy: torch.Tensor) -> dict:
    """The kernels' gate arguments: the A_log and dt_bias pointers (``dummy`` where unused) and the switches."""
    return dict(alog_ptr=gates.A_log if gates.gate else dummy,
                dtb_ptr=gates.dt_bias if gates.gate and gates.dt_bias is not None else dummy,
                GATE=gates.gate, HAS_DT=gates.gate and gates.dt_bias is not None)


def _gate_grads(gates: Gates, pa: torch.Tensor, pd: torch.Tensor) -> tuple:
    """(dA_log, d dt_bias) from the chunks' parts [NC, HV] that ``_bwd_out`` wrote (None where there is none)."""
    if not gates.gate:
        return None, None
    return pa.sum(0), (pd.sum(0) if gates.dt_bias is not None else None)


def prepare(k, rk, v, g, beta, plan, cfg, L2, store_t, gates: Gates = NONE):
    """gc (the in-chunk cumulative gate, fp32), w, u and T (when ``store_t``) of every chunk; with ``gates``, g
    and beta are raw (see gates.py) and the kernel computes the gate and beta from them."""
    TT, H, K = k.shape
    HV, V = v.shape[-2:]
    dev = k.device
    gc = torch.empty(TT, HV, device=dev, dtype=torch.float32)
    w = torch.empty(TT, HV, K, device=dev, dtype=cfg.store)
    u = torch.empty(TT, HV, V, device=dev, dtype=cfg.store_v)
    tinv = torch.empty(TT, HV, BT, device=dev, dtype=torch.float32) if store_t else None
    if plan.NC:
        _intra_fwd[(plan.NC, HV)](k, rk if L2 else gc, v, g, beta, gc, w, u, tinv if store_t else gc, plan.chunks,
                                  sk=k.stride(0), sv=v.stride(0), H=H, HV=HV, K=K, V=V, BK=cfg.BK,
                                  BV=cfg.bv["intra"], L2=L2, STORE_T=store_t, MODE=cfg.intra_mode, INV=cfg.INV,
                                  PREC=cfg.PREC, DT=cfg.DT, BSIG=gates.beta_sigmoid, **_gate_args(gates, gc),
                                  num_warps=cfg.nw["intra"], num_stages=cfg.stages)
    cfg.mark("intra")
    return gc, w, u, tinv


# Shared memory a sequential pass takes besides its pipelined loads (layout conversions, dot operands): about 11 KB
# for _state_bwd at bf16, K = V = 128 on the H200 (Triton's report for 4 stages: 240,652 bytes, 4 x 57,344 of loads)
_SMEM_OTHER = 16 * 1024


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int | None) -> int | None:
    """The most shared memory one program may take on device ``index`` of the active Triton driver (Triton's own
    figure, the one it checks a compiled kernel against), or None where the driver cannot tell."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index or 0)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver without the query: the requested stages stand
        return None


def fit_stages(requested: int, per_stage: int, limit: int | None) -> int:
    """Pipeline stages of a sequential pass: ``requested``, or as many as fit (at least 1) when ``requested``
    copies of one chunk's loads (``per_stage`` bytes) and the pass's other shared memory would exceed ``limit``
    bytes (None: no limit known). Triton refuses a kernel that needs more than the device has ("out of resource:
    shared memory"), so a ``stages_*`` option is an upper bound: 4 stages of the forward's pass fit an H200 at
    bf16 and K = V = 128, 2 at fp32, and a GPU with less shared memory per program gets fewer."""
    if limit is None:
        return requested
    return max(1, min(requested, (limit - _SMEM_OTHER) // per_stage))


def _row_bytes(BK: int, BV: int, k_size: int, w_size: int, v_sizes: tuple[int, ...], k_tiles: int) -> int:
    """Bytes one pipeline stage of a sequential pass loads per chunk: ``k_tiles`` [64, BK] tiles of the inputs
    (k, and q in the reverse pass), w [64, BK] as stored, one [64, BV] tile per entry of ``v_sizes`` (element
    sizes) and three fp32 rows (gates, l2norm factors)."""
    return 64 * (BK * (k_tiles * k_size + w_size) + BV * sum(v_sizes) + 3 * 4)


@functools.lru_cache(maxsize=256)
def pass_stages(requested: int, BK: int, BV: int, k_size: int, w_size: int, v_sizes: tuple[int, ...], k_tiles: int,
                index: int | None) -> int:
    """The stages a sequential pass runs with on device ``index``: ``fit_stages`` of its loads per chunk
    (``_row_bytes``), worked out once per configuration (it sits on every GDN call's path)."""
    if requested <= 1:
        return requested
    return fit_stages(requested, _row_bytes(BK, BV, k_size, w_size, v_sizes, k_tiles), _shared_memory(index))


class ForwardConfig:
    """Tiles, warps, stages and product modes of the forward's sequential pass and output kernel (under the
    options of ``cfg``)."""

    def __init__(self, cfg: PassConfig, full: bool, K: int, V: int):
        interp = _interpreting()
        opts = cfg.options
        vmax = max(16, triton.next_power_of_2(V))
        # the interpreter honours the tile widths (capped at the head size) so that tests reach every tiling
        self.bv_state = min(vmax, opts.bv_hfwd)
        self.bv_out = min(vmax, opts.bv_out)
        self.bk_out = min(cfg.BK, opts.bk_out)
        # head sizes under 64: 2 warps at most (see PassConfig)
        small = min(cfg.BK, vmax) < 64
        self.nw_state = 1 if interp else (min(2, opts.warps_hfwd) if small else opts.warps_hfwd)
        self.nw_out = 1 if interp else (min(2, opts.warps_out) if small else opts.warps_out)
        # the most stages asked for; state_pass fits them to the device (fit_stages)
        self.stages_state = 1 if interp else opts.stages_hfwd
        self.stages_out = 1 if interp else opts.stages_out
        mode = {n: 0 if full else PROD_MODES[getattr(opts, "fwd_prod_" + n)] for n in ("wh", "kv", "qh", "sv")}
        self.WH, self.KV, self.QH, self.SV = mode["wh"], mode["kv"], mode["qh"], mode["sv"]


def _build_configs(dtype: torch.dtype, K: int, V: int, which: str, options: ChunkOptions,
                   stage_hook: StageHook | None) -> tuple[PassConfig, ForwardConfig]:
    cfg = PassConfig(dtype, K, V, which, options, stage_hook)
    return cfg, ForwardConfig(cfg, dtype == torch.float32, K, V)


@functools.lru_cache(maxsize=64)
def _shared_configs(dtype: torch.dtype, K: int, V: int, which: str, options: ChunkOptions,
                    interpreting: bool) -> tuple[PassConfig, ForwardConfig]:
    return _build_configs(dtype, K, V, which, options, None)


def configs(dtype: torch.dtype, K: int, V: int, which: str, options: ChunkOptions,
            stage_hook: StageHook | None = None) -> tuple[PassConfig, ForwardConfig]:
    """The pass's ``PassConfig`` and the forward pass's ``ForwardConfig``. Without a stage hook both are built once
    per (dtype, head sizes, pass, options, interpreter or not) and shared: they are never changed after they are
    built, and building them cost ~40 us of host time per GDN call."""
    if stage_hook is None:
        return _shared_configs(dtype, K, V, which, options, _interpreting())
    return _build_configs(dtype, K, V, which, options, stage_hook)


def state_pass(k, rk, w, u, gc, h0, hs, vn, ht, plan, cfg, fc, L2):
    """The forward's sequential pass: chunk-start states into ``hs``, v' into ``vn``, the final state into ``ht``
    (when not None)."""
    TT, H, K = k.shape
    HV, V = u.shape[-2:]
    stages = pass_stages(fc.stages_state, cfg.BK, fc.bv_state, k.element_size(), w.element_size(),
                         (u.element_size(),), 1, k.device.index)
    _state_fwd[(triton.cdiv(V, fc.bv_state) * plan.N * HV,)](
        k, rk if L2 else gc, w, u, gc, h0 if h0 is not None else gc, hs, vn, ht if ht is not None else gc, plan.cu,
        plan.coff, sk=k.stride(0), H=H, HV=HV, K=K, V=V, BK=cfg.BK, BV=fc.bv_state, L2=L2, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, WH=fc.WH, KV=fc.KV, PREC=cfg.PREC, DT=cfg.DT, num_warps=fc.nw_state,
        num_stages=stages)
    cfg.mark("state")


def output(q, k, rq, rk, gc, hs, vn, o, plan, scale, cfg, fc, L2, vk=None):
    """o = scale ((q rq exp(gc)) h + lower_incl(q k^T rq rk D) v') for every chunk, written into ``o``; v' also
    into ``vk`` (in its dtype) when given."""
    TT, H, K = q.shape
    HV, V = vn.shape[-2:]
    if plan.NC:
        _out_fwd[(plan.NC * HV * triton.cdiv(V, fc.bv_out),)](
            q, k, rq if L2 else gc, rk if L2 else gc, gc, hs, vn, o, vn if vk is None else vk, plan.chunks, scale,
            sq=q.stride(0), sk=k.stride(0), H=H, HV=HV, K=K, V=V,
            BK=fc.bk_out, BV=fc.bv_out, L2=L2, QH=fc.QH, SV=fc.SV, PREC=cfg.PREC, DT=cfg.DT, KEEP_V=vk is not None,
            num_warps=fc.nw_out, num_stages=fc.stages_out)
    cfg.mark("out")
    return o


def forward(q, k, v, g, beta, scale, h0, want_ht, L2, plan, options: ChunkOptions,
            stage_hook: StageHook | None = None, gates: Gates = NONE, keep: bool = False):
    """(o, the final state when ``want_ht`` else None, the kept states when ``keep`` else None) of the flattened
    inputs, with ``options``; with ``gates`` g and beta are raw (gates.py). The kept states are the list
    ``backward`` takes as ``kept`` (rq, rk, gc, w, v', T, chunk states): what its recompute would give, bit for
    bit."""
    TT, H, K = q.shape
    HV, V = v.shape[-2:]
    cfg, fc = configs(q.dtype, K, V, "fwd", options, stage_hook)
    rq, rk = _rstd(q, k, L2, cfg)
    gc, w, u, tinv = prepare(k, rk, v, g, beta, plan, cfg, L2, keep and not options.wy_recompute_t, gates)
    hs = torch.empty(max(plan.NC, 1), HV, K, V, device=q.device, dtype=cfg.store)
    ht = torch.empty(plan.N, HV, K, V, device=q.device, dtype=torch.float32) if want_ht else None
    # v' is written over u (same dtype and layout; each program reads its u tile before writing it)
    state_pass(k, rk, w, u, gc, h0, hs, u, ht, plan, cfg, fc, L2)
    # v' as the backward's recompute stores it (in the states' dtype): u's buffer where that is its dtype, else a
    # copy the output kernel writes as it reads v' (u is fp32 under fwd_store_v)
    vk = (u if u.dtype == cfg.store else torch.empty(u.shape, device=u.device, dtype=cfg.store)) if keep else None
    kept = [rq, rk, gc, w, vk, tinv, hs] if keep else None
    del w  # (before o exists, unless kept)
    o = output(q, k, rq, rk, gc, hs, u, torch.empty(TT, HV, V, device=q.device, dtype=q.dtype), plan, scale,
               cfg, fc, L2, None if vk is u else vk)
    del hs, u, vk  # unless kept, the chunk states and v' go as soon as o is written; the backward recomputes them
    return o, ht, kept


def backward(q, k, v, g, beta, scale, h0, do, dht, L2, plan, need_dh0, options: ChunkOptions,
             stage_hook: StageHook | None = None, gates: Gates = NONE, kept: list | None = None,
             own_kept: bool = True):
    """(dq, dk, dv, dg, dbeta, dh0, dA_log, d dt_bias) of the flattened inputs, with ``options`` (those of the
    forward: its sequential pass is recomputed with the forward's tiles and products). With ``gates`` (those of the
    forward) dg and dbeta are those of the raw inputs, and dA_log / d dt_bias fp32 [HV] where the gate applies
    (else None).

    ``kept``: the forward's kept states (``forward(keep=True)``), used instead of the recompute; the list is
    emptied here, so that each buffer goes when this function is done with it. ``own_kept``: nothing else holds
    them, so the backward's buffers may take their bytes."""
    TT, H, K = q.shape
    HV, V = v.shape[-2:]
    G = HV // H
    dev = q.device
    cfg, fc = configs(q.dtype, K, V, "bwd", options, stage_hook)
    opts = options
    interp = _interpreting()
    full = q.dtype == torch.float32
    # the small-head rule of PassConfig (2 warps at most under 64 columns) for the backward's own tunables
    small = min(cfg.BK, max(16, triton.next_power_of_2(V))) < 64

    def warps(n):
        return 1 if interp else (min(2, n) if small else n)

    def stages(n):
        return 1 if interp else n

    def mode(name):
        return 0 if full else PROD_MODES[getattr(opts, name)]

    common = dict(H=H, HV=HV, K=K, V=V, BK=cfg.BK, L2=L2, PREC=cfg.PREC, DT=cfg.DT)
    strides = dict(sq=q.stride(0), sk=k.stride(0))  # q, k and v may be row views of a wider tensor (kernel.py)
    if kept:
        rq, rk, gc, w, vn, tinv, hs = kept
        kept.clear()
    else:
        rq, rk = _rstd(q, k, L2, cfg)
        gc, w, u, tinv = prepare(k, rk, v, g, beta, plan, cfg, L2, not opts.wy_recompute_t, gates)
        hs = torch.empty(max(plan.NC, 1), HV, K, V, device=dev, dtype=cfg.store)
        vn = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
        # the forward's sequential pass again, with the forward's tiles and products: the backward differentiates
        # exactly what the forward computed
        state_pass(k, rk, w, u, gc, h0, hs, vn, None, plan, cfg, fc, L2)
        del u
        own_kept = True
    rq, rk = (rq, rk) if L2 else (gc, gc)
    # with sbwd_from_t the reverse pass forms w^T dv' from the stored T: w goes here, before the reverse pass's
    # buffers exist (one [tokens, HV, K] buffer less at the backward's peak)
    from_t = opts.sbwd_from_t and tinv is not None
    if from_t:
        w = gc  # w's last reference goes; a placeholder argument the kernel does not read
    dvl = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    if plan.NC:
        _dv_local[(plan.NC, HV)](q, k, rq, rk, gc, do, dvl, plan.chunks, scale, BV=cfg.bv["dvl"], X2=cfg.X2,
                                 **strides, **common, num_warps=cfg.nw["dvl"], num_stages=stages(opts.stages_dvl))
    cfg.mark("dv_local")
    dhs = torch.empty(max(plan.NC, 1), HV, K, V, device=dev, dtype=cfg.store)
    # the full dv' is written over its in-chunk part (same dtype and layout; each program of the reverse pass
    # reads its dv_local tile before writing the same elements): one [tokens, HV, V] buffer less at the peak
    dvn = dvl
    dh0 = torch.empty(plan.N, HV, K, V, device=dev, dtype=torch.float32) if need_dh0 else None
    bv_sbwd = min(max(16, triton.next_power_of_2(V)), 16 if interp else opts.bv_sbwd)
    # as many stages as fit the device (fit_stages): one at fp32 storage on an H200
    # a chunk's loads per stage: its w tile [64, BK], or its T tile (fp32 [64, 64], as many bytes as BK * 256 / BK)
    w_row = 256 // cfg.BK if from_t else w.element_size()
    stages_sbwd = 1 if interp else pass_stages(opts.stages_sbwd, cfg.BK, bv_sbwd, q.element_size(), w_row,
                                               (dvl.element_size(), do.element_size()), 2, dev.index)
    _state_bwd[(triton.cdiv(V, bv_sbwd) * plan.N * HV,)](
        q, k, rq, rk, w, tinv if from_t else gc, beta, gc, do, dvl, dht if dht is not None else gc, dhs, dvn,
        dh0 if need_dh0 else gc, plan.cu, plan.coff, scale, SQ=strides["sq"], SK=strides["sk"], BV=bv_sbwd,
        HAS_DHT=dht is not None, STORE_DH0=need_dh0, KD=mode("sbwd_prod_kd"), QD=mode("sbwd_prod_qd"),
        WD=mode("sbwd_prod_wd"), FROM_T=from_t, TD=mode("sbwd_prod_td"), BSIG=gates.beta_sigmoid, **common,
        num_warps=warps(opts.warps_sbwd), num_stages=stages_sbwd)
    cfg.mark("state_bwd")
    del w, dvl  # (dvl is dvn now)
    # dv is written over dv' where their dtypes agree (each _bwd_wy program reads a dv' tile before writing the
    # same elements of dv; nothing reads dv' after it): one [tokens, HV, V] buffer less at that kernel
    dv = dvn if dvn.dtype == v.dtype else torch.empty(v.shape, device=dev, dtype=v.dtype)
    dg = torch.empty(g.shape, device=dev, dtype=g.dtype)
    db = torch.empty(beta.shape, device=dev, dtype=beta.dtype)
    # this chunk's parts of dA_log and d dt_bias ([NC, HV], written by _bwd_out when the gate is in the kernel)
    # (zeroed for a device-built plan: its empty chunk rows write no part)
    parts = torch.zeros if plan.padded else torch.empty
    pa = parts(max(plan.NC, 1), HV, device=dev, dtype=torch.float32) if gates.gate else gc
    pd = parts(max(plan.NC, 1), HV, device=dev, dtype=torch.float32) if gates.gate else gc
    if not plan.NC:
        dq, dk = _dense(q, torch.zeros), _dense(k, torch.zeros)
        for t in (dv, dg, db):
            t.zero_()
        if gates.gate:  # no chunk: no part of dA_log or d dt_bias
            pa.zero_()
            pd.zero_()
        return dq, dk, dv, dg, db, dh0, *_gate_grads(gates, pa, pd)
    # Per-value-head partials of dkhat (and of dqhat when G > 1), [TT, HV, K]: _bwd_wy writes the WY part of
    # dkhat, _bwd_out adds its terms (or, with G = 1, finishes dq and dk itself), _bwd_reduce sums the groups.
    # With bwd_group_loop (several value heads per q/k head), one program per chunk and q/k head runs its value
    # heads in turn in _bwd_wy and in _bwd_out: dkp is [TT, H, K], _bwd_out finishes dq and dk (dk over dkp where
    # their dtypes agree) and neither the dq partials nor _bwd_reduce are needed.
    gloop = opts.bwd_group_loop and G > 1
    part_dtype = torch.float32 if (full or opts.bwd_partials == "fp32") else q.dtype
    dgc = torch.empty(TT, HV, device=dev, dtype=torch.float32)
    # The per-value-head dk partials take T's bytes where a token and value head of each hold the same bytes (K = 128
    # at 16-bit partials): each _bwd_wy program loads its chunk's T tile before it writes the same bytes of dkp, and
    # nothing else reads them. T is otherwise dead after _bwd_wy: one [tokens, HV, K] buffer less from here on.
    dkp = (_alias(tinv, part_dtype, (TT, HV, K)) if own_kept and not gloop and tinv is not None
           and K * part_dtype.itemsize == 256 else None)
    if dkp is None:
        dkp = torch.empty(TT, H if gloop else HV, K, device=dev, dtype=part_dtype)
    programs = plan.NC * (H if gloop else HV)
    _bwd_wy[(programs,)](k, rk, v, beta, gc, gc if tinv is None else tinv, hs, dvn, dv, db, dgc, dkp, plan.chunks,
                         sk=k.stride(0), sv=v.stride(0), BV=cfg.bv["wy"], MODE=mode("prod_wy"),
                         BSIG=gates.beta_sigmoid, RECOMP_T=opts.wy_recompute_t, INV=cfg.INV, GLOOP=gloop, **common,
                         num_warps=cfg.nw["wy"], num_stages=stages(opts.stages_wy))
    cfg.mark("bwd_wy")
    del dvn, tinv
    if G == 1 or gloop:
        dq = _dense(q)
        dk = dkp if gloop and dkp.dtype == k.dtype else _dense(k)
        dqp = dkp
    else:
        dq = dk = gc  # written by _bwd_reduce
        # the dq partials over v' where a token and value head of each hold the same bytes (K = V at 16-bit
        # partials and storage): each _bwd_out program reads all of its chunk's v' tiles before it writes the same
        # bytes of dqp (not with bo_two_pass, whose second pass reads v' again), and nothing else reads them
        dqp = (_alias(vn, part_dtype, (TT, HV, K)) if own_kept and not opts.bo_two_pass
               and K * part_dtype.itemsize == V * vn.element_size() else None)
        if dqp is None:
            dqp = torch.empty(TT, HV, K, device=dev, dtype=part_dtype)
    _bwd_out[(programs,)](q, k, rq, rk, gc, hs, dhs, vn, do, dgc, dkp, dqp, dq, dk, dg, plan.chunks, scale, g,
                          pa_ptr=pa, pd_ptr=pd, **_gate_args(gates, gc), BV=cfg.bv["bo"], MODE=mode("prod_bo"),
                          TWO_PASS=opts.bo_two_pass, GLOOP=gloop, **strides, **common, num_warps=cfg.nw["bo"],
                          num_stages=stages(opts.stages_bo))
    cfg.mark("bwd_out")
    if G > 1 and not gloop:
        del hs, dhs, vn
        dq, dk = _dense(q), _dense(k)
        bt = 32 if interp else opts.bt_red
        _bwd_reduce[(triton.cdiv(TT, bt), H)](q, k, rq, rk, dqp, dkp, dq, dk, TT, **strides, H=H, HV=HV, K=K, BK=cfg.BK,
                                              BT=bt, L2=L2, num_warps=warps(opts.warps_red))
        cfg.mark("bwd_reduce")
    return dq, dk, dv, dg, db, dh0, *_gate_grads(gates, pa, pd)
