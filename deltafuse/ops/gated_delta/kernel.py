"""Chunked gated delta rule in portable Triton: the op's Triton entry (host side, autograd wrapper).

Per value head the recurrence is (state S of shape [K, V], decay ``g`` in log space)

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

It is evaluated over chunks of ``BT = 64`` tokens (the WY / UT-transform form). Inside a chunk, with
``gc`` the chunk-local cumulative sum of ``g`` and ``D_ij = exp(gc_i - gc_j)``:

    A  = strictly_lower(beta_i (k_i . k_j) D_ij)          T = (I + A)^-1
    w  = T (beta k exp(gc))                               u = T (beta v)
    v' = u - w h                                          (h: state at the chunk start)
    o  = scale ((q exp(gc)) h + lower_incl(q k^T o D) v')
    h_next = exp(gc_last) h + (k exp(gc_last - gc))^T v'

Kernels (grid axes in brackets; the first three in ``kernel_fwd.py``, ``_out_fwd`` in ``kernel_out.py``, the
others in ``kernel_bwd.py``):

* ``_l2norm_rstd`` [token block, q/k head]: the l2norm factors rsqrt(|x|^2 + eps) of q and k rows. The
  other kernels read q and k as given and apply these factors to their products, so normalised rows are
  never rounded to 16 bits or stored.
* ``_intra_fwd``   [chunk, value head]: gc, A, T, w, u (and T itself for the backward).
* ``_state_fwd``   [V block x sequence x value head, one axis]: the sequential pass over chunks with the state in
  fp32 registers; stores the chunk-start states (``hs``) and v' (the forward writes v' over u), and the final
  state. The forward and the backward's recompute both run it.
* ``_out_fwd``     [V block x value head x chunk, one axis]: the output, every chunk at once from the stored
  ``hs`` and v': o = scale ((q exp(gc)) h + lower_incl(q k^T o D) v'). The forward frees ``hs`` and v'
  once o is written; nothing but the inputs is kept for the backward.
* ``_dv_local``    [chunk, value head]: the intra-chunk part of dv', scale lower_incl(q k^T o D)^T do.
* ``_state_bwd``   [V block x sequence x value head, one axis]: the reverse pass; stores the gradient of the
  state at every chunk end (``dhs``), the full gradient of v' (``dvn``) and the initial-state gradient.
* ``_bwd_wy``      [chunk x value head, one axis]: back through w, u and T (dv, dbeta, the WY part of dg);
  writes the WY part of dk as the start of the value head's dk partial.
* ``_bwd_out``     [chunk x value head, one axis]: the output and state parts of dq, dk and all of dg for one
  value head; writes its dq partial and adds its dk terms to the dk partial (per-value-head buffers
  [tokens, HV, K], fp32 or 16-bit: ``ChunkOptions.bwd_partials``). With one value head per q/k head it
  finishes dq and dk itself. No repeated q/k is ever materialised.
* ``_bwd_reduce``  [token block, q/k head]: sums the partials of the value heads that share a q/k head, goes
  back through the l2norm and casts.

No kernel uses a transposed computed tile as a dot operand (a Triton-on-Hopper miscompile hazard): transposed
inputs are loaded with swapped strides, and a product with a transposed computed tile is formed as the
transpose of the product of the transposed loaded operand with that tile.

Products of a 16-bit operand (inputs, stored intermediates) with an fp32 one split the fp32 operand into
two 16-bit parts, so 16-bit tensor cores give close to fp32 accuracy without fp32 copies of the large
tiles.

The backward recomputes w, u, the chunk states and v' from the inputs instead of keeping them from the
forward pass, so only the inputs are saved between forward and backward.

All sequences, batched or packed (``cu_seqlens``), go through one flattened token axis: a batch of B
sequences of length T is the packed batch with boundaries 0, T, 2T, ...; a chunk never crosses a
sequence boundary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Callable

import torch
import triton
import triton.language as tl

from deltafuse.config import triton_interpreting
from deltafuse.ops._checks import host_offsets
from deltafuse.ops.gated_delta.kernel_bwd import _bwd_out, _bwd_reduce, _bwd_wy, _dv_local, _state_bwd
from deltafuse.ops.gated_delta.kernel_fwd import _intra_fwd, _l2norm_rstd, _state_fwd
from deltafuse.ops.gated_delta.kernel_out import _out_fwd

BT = 64  # chunk length; the in-chunk inverse (kernel_fwd._unit_lower_inverse) is written for 4 blocks of 16

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreting() -> bool:
    return triton_interpreting()

# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------


class _Plan:
    """Sequence and chunk bookkeeping for one call (int32 tables on the inputs' device).

    Built with tensor operations on the host (no per-sequence or per-chunk Python loop: a packed row of
    thousands of short sequences gets a new plan every step) and copied to the device in one transfer.
    """

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
        table = torch.cat([b, offsets, rows.reshape(-1)]).to(torch.int32).to(device, non_blocking=True)
        n1 = len(bounds)
        self.cu = table[:n1]
        self.coff = table[n1:2 * n1]
        self.chunks = table[2 * n1:]


_PLANS: dict = {}


def _plan(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> _Plan:
    """Chunk tables, cached by sequence layout (they depend on lengths only, never on values)."""
    bounds = tuple(n * T for n in range(B + 1)) if cu_seqlens is None else host_offsets(cu_seqlens)
    key = (bounds, str(device))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 64:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = _Plan(list(bounds), device)
    return plan


# product modes (kernel_fwd._dot_m): "tf32" one fp32 product, "16" the fp32 operand rounded to 16 bits, "x2" split
_PROD_MODES = {"tf32": 0, "16": 1, "x2": 2}
# in-chunk inverse of the diagonal 16x16 blocks (kernel_fwd._unit_lower_inverse's INV)
_INV_MODES = {"subst": 0, "double": 1, "recursive": 2}


@dataclass(frozen=True)
class ChunkOptions:
    """Tunables of the chunked kernels on a GPU (the interpreter uses its own small fixed tiles).

    ``*_store``: dtype of the stored per-token / per-chunk intermediates (w, u, v', chunk states and their
    gradients): "input" (the inputs' 16-bit dtype) or "fp32". ``*_x2``: products of an fp32 operand with a
    16-bit one split the fp32 operand into two 16-bit parts (about 16 mantissa bits) instead of rounding it
    to 16 bits or using tf32 (``fwd_x2``: in the forward's intra kernel; its later kernels take
    ``fwd_prod_*`` below). fp32 inputs always use fp32 storage and three-pass tf32 products.
    ``bv_<kernel>`` / ``warps_<kernel>``: value-tile width and warps per kernel; ``stages``: pipeline stages.

    Forward kernels (the forward's sequential pass ``hfwd``, which the backward recomputes with the same settings,
    and its output kernel ``out``): ``fwd_prod_<p>``: how a product of
    a 16-bit operand with an fp32 one is computed: "x2" (the fp32 operand split into two 16-bit parts), "16"
    (rounded to 16 bits, one product) or "tf32" (one tf32 product); p is ``wh`` (w times the state, for v'),
    ``kv`` (k^T times the decayed v', the state update), ``qh`` (q times the stored state, when states are
    stored in fp32: 16-bit states make it exact) and ``sv`` (the in-chunk scores times v'). With fp32 inputs
    (or an fp32-stored operand) every product is an fp32 one. ``bk_out``: K block of the output kernel;
    ``stages_<kernel>``: its pipeline stages. In the interpreter warps and stages are 1 and tile widths are
    capped at the head size.
    """

    fwd_store: str = "input"
    bwd_store: str = "input"
    fwd_x2: bool = True
    bwd_x2: bool = True
    bv_intra: int = 128
    warps_intra: int = 4
    bv_dvl: int = 128
    warps_dvl: int = 4
    bv_wy: int = 32
    warps_wy: int = 4
    bv_bo: int = 32
    warps_bo: int = 8
    stages: int = 2
    # forward kernels
    # w times the state in 16 bits (one product), the state update split: on the H200 the 16-bit state update
    # put the hardest oracle case (decay near zero) over the bf16 bound (o 3.03e-3 > 3e-3), the 16-bit w-state
    # product did not (2.84e-3) and is 2 % (16 K-64 K tokens) to 10 % (4 K) faster (BENCHMARKS.md#gdn-16bit-w-state)
    fwd_prod_wh: str = "16"
    fwd_prod_kv: str = "x2"
    fwd_prod_qh: str = "x2"
    fwd_prod_sv: str = "x2"
    bv_hfwd: int = 32
    warps_hfwd: int = 4
    stages_hfwd: int = 2
    bv_out: int = 64
    bk_out: int = 128
    warps_out: int = 4
    stages_out: int = 2
    # backward kernels
    # bwd_partials: dtype of the per-value-head dq / dk partials that _bwd_out writes and _bwd_reduce sums when
    # several value heads share a q/k head: "fp32" or "input" (the inputs' 16-bit dtype: half the bytes).
    # prod_wy / prod_bo: products of a computed fp32 tile with a 16-bit one in _bwd_wy / _bwd_out (16-bit
    # inputs only): "x2" (two 16-bit parts), "16" (one 16-bit product), "tf32" (one fp32 product); the
    # other backward kernels follow bwd_x2. _state_bwd has its own tiles (bv_sbwd, warps_sbwd, stages_sbwd);
    # _bwd_reduce takes bt_red tokens per program. bo_two_pass: _bwd_out makes two passes over the value blocks
    # (dq, then dk): one [64, K] fp32 accumulator live instead of two, for one more read of v' and h.
    bwd_partials: str = "input"
    prod_wy: str = "16"
    prod_bo: str = "16"
    bo_two_pass: bool = False
    bv_sbwd: int = 32
    warps_sbwd: int = 4
    stages_sbwd: int = 2
    stages_dvl: int = 2
    stages_wy: int = 2
    stages_bo: int = 3
    bt_red: int = 32
    warps_red: int = 4
    # in-chunk kernel (_intra_fwd, run by the forward and again by the backward)
    # intra_inv: how the four diagonal 16x16 blocks of T = (I + A)^-1 are inverted: "subst" (forward
    # substitution, 16 dependent steps of masked reductions), "double" (repeated squaring, (I - A)(I + A^2)
    # (I + A^4)(I + A^8): six batched fp32 [4, 16, 16] products; loses digits when A's entries approach 1), or
    # "recursive" (the inverted block size doubled 1 -> 2 -> 4 -> 8 -> 16: six batched fp32 products, as
    # accurate as the substitution). intra_prod: products of T with the 16-bit k and v for w and u: "x2" (as
    # fwd_x2 / bwd_x2 say: split T into two 16-bit parts, or one tf32 product) or "16" (T rounded to 16 bits,
    # one product; 16-bit inputs only, fp32 inputs always take fp32 products).
    intra_inv: str = "recursive"
    intra_prod: str = "x2"

    def __post_init__(self):
        for name in ("fwd_store", "bwd_store"):
            if getattr(self, name) not in ("input", "fp32"):
                raise ValueError(f"ChunkOptions.{name}={getattr(self, name)!r}; allowed: 'input', 'fp32'")
        if self.intra_inv not in _INV_MODES:
            raise ValueError(f"ChunkOptions.intra_inv={self.intra_inv!r}; allowed: "
                             + ", ".join(repr(m) for m in _INV_MODES))
        if self.intra_prod not in ("x2", "16"):
            raise ValueError(f"ChunkOptions.intra_prod={self.intra_prod!r}; allowed: 'x2', '16'")
        if self.bwd_partials not in ("input", "fp32"):
            raise ValueError(f"ChunkOptions.bwd_partials={self.bwd_partials!r}; allowed: 'input', 'fp32'")
        if self.fwd_prod_qh == "16":
            # q times an fp32 state rounded to 16 bits in registers gave NaN outputs on an H200 with Triton 3.6
            raise ValueError("ChunkOptions.fwd_prod_qh='16' is refused (NaN outputs on the H200 with Triton 3.6, "
                             "BENCHMARKS.md#gdn-v2-combined); allowed: 'x2', 'tf32'")
        for name in ("fwd_prod_wh", "fwd_prod_kv", "fwd_prod_qh", "fwd_prod_sv", "prod_wy", "prod_bo"):
            if getattr(self, name) not in _PROD_MODES:
                raise ValueError(f"ChunkOptions.{name}={getattr(self, name)!r}; allowed: "
                                 + ", ".join(repr(m) for m in _PROD_MODES))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type != "int":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ChunkOptions.{f.name}={value!r}; allowed: an int >= 1")
            if not f.name.startswith("stages") and value & (value - 1):
                raise ValueError(f"ChunkOptions.{f.name}={value!r}; allowed: a power of two (a tile width or a "
                                 "warp count)")


DEFAULT_OPTIONS = ChunkOptions()
# (options, stage hook) in effect: the defaults and no hook, except inside a ``configured`` block
_in_effect: list = [DEFAULT_OPTIONS, None]


def options_in_effect() -> ChunkOptions:
    """The options the chunked kernels run with now (the defaults outside a ``configured`` block)."""
    return _in_effect[0]


@contextlib.contextmanager
def configured(options: ChunkOptions | None = None, stage_hook: Callable[[str], None] | None = None):
    """Run the chunked kernels with ``options`` inside the block, calling ``stage_hook(stage_name)`` after each
    kernel launch (a benchmark's per-stage timing); what was in effect before is restored on exit. Normal use
    never needs it: the defaults are the tuned values (BENCHMARKS.md#gdn-v2-combined, #gdn-16bit-w-state)."""
    if options is not None and not isinstance(options, ChunkOptions):
        raise TypeError(f"options must be a ChunkOptions or None, got {type(options).__name__}")
    saved = list(_in_effect)
    _in_effect[:] = [DEFAULT_OPTIONS if options is None else options, stage_hook]
    try:
        yield
    finally:
        _in_effect[:] = saved


class _Cfg:
    """Compile-time choices for one pass ("fwd" or "bwd") of one dtype / head-size family."""

    def __init__(self, dtype: torch.dtype, K: int, V: int, which: str):
        interp = _interpreting()
        opts = _in_effect[0]
        self.BK = max(16, triton.next_power_of_2(K))
        self.DT = _TL_DTYPE[dtype]
        full = dtype == torch.float32
        # precision of fp32-operand products: exact in the interpreter, three-pass tf32 for fp32 inputs
        self.PREC = "ieee" if interp else ("tf32x3" if full else "tf32")
        self.X2 = (not full) and bool(getattr(opts, which + "_x2"))
        # the in-chunk kernel: inverse of the diagonal blocks, product mode of T with k and v (kernel_fwd._dot_ma)
        self.INV = _INV_MODES[opts.intra_inv]
        self.intra_mode = _PROD_MODES["16"] if (not full and opts.intra_prod == "16") else (
            _PROD_MODES["x2"] if self.X2 else _PROD_MODES["tf32"])
        if not (full or interp) and getattr(opts, which + "_store") == "fp32":
            # the sequential pass with fp32-stored states and 16-bit inputs gave NaN outputs and then an illegal
            # memory access on the H200 with Triton 3.6 (BENCHMARKS.md#gdn-v2-combined); the interpreter tests keep it
            raise ValueError(f"ChunkOptions.{which}_store='fp32' with {str(dtype).replace('torch.', '')} inputs is "
                             "refused on a GPU (NaN outputs and an illegal memory access on the H200 with Triton "
                             "3.6); allowed: 'input' (fp32 inputs always store fp32)")
        self.store = torch.float32 if (full or getattr(opts, which + "_store") == "fp32") else dtype
        vmax = max(16, triton.next_power_of_2(V))
        names = ("intra", "dvl", "wy", "bo")
        self.bv = {n: min(vmax, 16 if interp else getattr(opts, "bv_" + n)) for n in names}
        # Head sizes under 64 (tiles of 16 or 32 columns) gave wrong outputs with 8 warps and illegal memory
        # accesses with 4 on the H200 (Triton 3.6); 2 warps are correct there (BENCHMARKS.md#gdn-small-heads).
        small = min(self.BK, vmax) < 64
        warps = {n: getattr(opts, "warps_" + n) for n in names}
        self.nw = {n: 1 if interp else (min(2, warps[n]) if small else warps[n]) for n in names}
        self.stages = 1 if interp else opts.stages


def _mark(name: str) -> None:
    hook = _in_effect[1]
    if hook is not None:
        hook(name)


def _rstd(q, k, L2):
    """rsqrt(|x|^2 + eps) per row of q and k, or (None, None) when the l2norm is off."""
    if not L2:
        return None, None
    TT, H, K = q.shape
    rq = torch.empty(TT, H, device=q.device, dtype=torch.float32)
    rk = torch.empty(TT, H, device=q.device, dtype=torch.float32)
    if TT:
        _l2norm_rstd[(triton.cdiv(TT, 64), H)](q, k, rq, rk, TT, H=H, K=K, BK=max(16, triton.next_power_of_2(K)),
                                               num_warps=1 if _interpreting() else 4)
    _mark("l2norm")
    return rq, rk


def _prepare(k, rk, v, g, beta, plan, cfg, L2, store_t):
    TT, H, K = k.shape
    HV, V = v.shape[-2:]
    dev = k.device
    gc = torch.empty(TT, HV, device=dev, dtype=torch.float32)
    w = torch.empty(TT, HV, K, device=dev, dtype=cfg.store)
    u = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    tinv = torch.empty(TT, HV, BT, device=dev, dtype=torch.float32) if store_t else None
    if plan.NC:
        _intra_fwd[(plan.NC, HV)](k, rk if L2 else gc, v, g, beta, gc, w, u, tinv if store_t else gc, plan.chunks,
                                  H=H, HV=HV, K=K, V=V, BK=cfg.BK, BV=cfg.bv["intra"], L2=L2, STORE_T=store_t,
                                  MODE=cfg.intra_mode, INV=cfg.INV, PREC=cfg.PREC, DT=cfg.DT,
                                  num_warps=cfg.nw["intra"], num_stages=cfg.stages)
    _mark("intra")
    return gc, w, u, tinv


class _FwdCfg:
    """Tiles, warps, stages and product modes of the forward's sequential pass and output kernel."""

    def __init__(self, cfg: _Cfg, full: bool, K: int, V: int):
        interp = _interpreting()
        opts = _in_effect[0]
        vmax = max(16, triton.next_power_of_2(V))
        # the interpreter honours the tile widths (capped at the head size) so that tests reach every tiling
        self.bv_state = min(vmax, opts.bv_hfwd)
        self.bv_out = min(vmax, opts.bv_out)
        self.bk_out = min(cfg.BK, opts.bk_out)
        # head sizes under 64: 2 warps at most (see _Cfg)
        small = min(cfg.BK, vmax) < 64
        self.nw_state = 1 if interp else (min(2, opts.warps_hfwd) if small else opts.warps_hfwd)
        self.nw_out = 1 if interp else (min(2, opts.warps_out) if small else opts.warps_out)
        self.stages_state = 1 if interp else opts.stages_hfwd
        self.stages_out = 1 if interp else opts.stages_out
        mode = {n: 0 if full else _PROD_MODES[getattr(opts, "fwd_prod_" + n)] for n in ("wh", "kv", "qh", "sv")}
        self.WH, self.KV, self.QH, self.SV = mode["wh"], mode["kv"], mode["qh"], mode["sv"]


def _state_pass(k, rk, w, u, gc, h0, hs, vn, ht, plan, cfg, fc, L2):
    """The forward's sequential pass: chunk-start states into ``hs``, v' into ``vn``, the final state into ``ht``
    (when not None)."""
    TT, H, K = k.shape
    HV, V = u.shape[-2:]
    _state_fwd[(triton.cdiv(V, fc.bv_state) * plan.N * HV,)](
        k, rk if L2 else gc, w, u, gc, h0 if h0 is not None else gc, hs, vn, ht if ht is not None else gc, plan.cu,
        plan.coff, H=H, HV=HV, K=K, V=V, BK=cfg.BK, BV=fc.bv_state, L2=L2, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, WH=fc.WH, KV=fc.KV, PREC=cfg.PREC, DT=cfg.DT, num_warps=fc.nw_state,
        num_stages=fc.stages_state)
    _mark("state")


def _output(q, k, rq, rk, gc, hs, vn, o, plan, scale, cfg, fc, L2):
    """o = scale ((q rq exp(gc)) h + lower_incl(q k^T rq rk D) v') for every chunk, written into ``o``."""
    TT, H, K = q.shape
    HV, V = vn.shape[-2:]
    if plan.NC:
        _out_fwd[(plan.NC * HV * triton.cdiv(V, fc.bv_out),)](
            q, k, rq if L2 else gc, rk if L2 else gc, gc, hs, vn, o, plan.chunks, scale, H=H, HV=HV, K=K, V=V,
            BK=fc.bk_out, BV=fc.bv_out, L2=L2, QH=fc.QH, SV=fc.SV, PREC=cfg.PREC, DT=cfg.DT,
            num_warps=fc.nw_out, num_stages=fc.stages_out)
    _mark("out")
    return o


def _forward(q, k, v, g, beta, scale, h0, want_ht, L2, plan):
    TT, H, K = q.shape
    HV, V = v.shape[-2:]
    cfg = _Cfg(q.dtype, K, V, "fwd")
    fc = _FwdCfg(cfg, q.dtype == torch.float32, K, V)
    rq, rk = _rstd(q, k, L2)
    gc, w, u, _ = _prepare(k, rk, v, g, beta, plan, cfg, L2, False)
    hs = torch.empty(max(plan.NC, 1), HV, K, V, device=q.device, dtype=cfg.store)
    ht = torch.empty(plan.N, HV, K, V, device=q.device, dtype=torch.float32) if want_ht else None
    # v' is written over u (same dtype and layout; each program reads its u tile before writing it)
    _state_pass(k, rk, w, u, gc, h0, hs, u, ht, plan, cfg, fc, L2)
    del w
    o = _output(q, k, rq, rk, gc, hs, u, torch.empty(TT, HV, V, device=q.device, dtype=q.dtype), plan, scale,
                cfg, fc, L2)
    del hs, u  # the chunk states and v' go as soon as o is written; the backward recomputes them
    return o, ht


def _backward(q, k, v, g, beta, scale, h0, do, dht, L2, plan, need_dh0):
    TT, H, K = q.shape
    HV, V = v.shape[-2:]
    G = HV // H
    dev = q.device
    cfg = _Cfg(q.dtype, K, V, "bwd")
    opts = _in_effect[0]
    interp = _interpreting()
    full = q.dtype == torch.float32
    # the small-head rule of _Cfg (2 warps at most under 64 columns) for the backward's own tunables
    small = min(cfg.BK, max(16, triton.next_power_of_2(V))) < 64

    def warps(n):
        return 1 if interp else (min(2, n) if small else n)

    def stages(n):
        return 1 if interp else n

    def mode(name):
        return 0 if full else _PROD_MODES[getattr(opts, name)]

    common = dict(H=H, HV=HV, K=K, V=V, BK=cfg.BK, L2=L2, PREC=cfg.PREC, DT=cfg.DT)
    rq, rk = _rstd(q, k, L2)
    gc, w, u, tinv = _prepare(k, rk, v, g, beta, plan, cfg, L2, True)
    rq, rk = (rq, rk) if L2 else (gc, gc)
    hs = torch.empty(max(plan.NC, 1), HV, K, V, device=dev, dtype=cfg.store)
    vn = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    # the forward's sequential pass again, with the forward's tiles and products: the backward differentiates
    # exactly what the forward computed
    _state_pass(k, rk, w, u, gc, h0, hs, vn, None, plan, cfg, _FwdCfg(cfg, full, K, V), L2)
    del u
    dvl = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    if plan.NC:
        _dv_local[(plan.NC, HV)](q, k, rq, rk, gc, do, dvl, plan.chunks, scale, BV=cfg.bv["dvl"], X2=cfg.X2,
                                 **common, num_warps=cfg.nw["dvl"], num_stages=stages(opts.stages_dvl))
    _mark("dv_local")
    dhs = torch.empty(max(plan.NC, 1), HV, K, V, device=dev, dtype=cfg.store)
    dvn = torch.empty(TT, HV, V, device=dev, dtype=cfg.store)
    dh0 = torch.empty(plan.N, HV, K, V, device=dev, dtype=torch.float32) if need_dh0 else None
    bv_sbwd = min(max(16, triton.next_power_of_2(V)), 16 if interp else opts.bv_sbwd)
    # fp32 states in the reverse pass need the shared memory that load pipelining would take
    stages_sbwd = 1 if (interp or cfg.store == torch.float32) else opts.stages_sbwd
    _state_bwd[(triton.cdiv(V, bv_sbwd) * plan.N * HV,)](
        q, k, rq, rk, w, gc, do, dvl, dht if dht is not None else gc, dhs, dvn, dh0 if need_dh0 else gc, plan.cu,
        plan.coff, scale, BV=bv_sbwd, HAS_DHT=dht is not None, STORE_DH0=need_dh0, X2=cfg.X2, **common,
        num_warps=warps(opts.warps_sbwd), num_stages=stages_sbwd)
    _mark("state_bwd")
    del w, dvl
    dv = torch.empty_like(v)
    dg = torch.empty(g.shape, device=dev, dtype=g.dtype)
    db = torch.empty(beta.shape, device=dev, dtype=beta.dtype)
    if not plan.NC:
        dq, dk = torch.zeros_like(q), torch.zeros_like(k)
        for t in (dv, dg, db):
            t.zero_()
        return dq, dk, dv, dg, db, dh0
    # Per-value-head partials of dkhat (and of dqhat when G > 1), [TT, HV, K]: _bwd_wy writes the WY part of
    # dkhat, _bwd_out adds its terms (or, with G = 1, finishes dq and dk itself), _bwd_reduce sums the groups.
    part_dtype = torch.float32 if (full or opts.bwd_partials == "fp32") else q.dtype
    dgc = torch.empty(TT, HV, device=dev, dtype=torch.float32)
    dkp = torch.empty(TT, HV, K, device=dev, dtype=part_dtype)
    _bwd_wy[(plan.NC * HV,)](k, rk, v, beta, gc, tinv, hs, dvn, dv, db, dgc, dkp, plan.chunks, BV=cfg.bv["wy"],
                             MODE=mode("prod_wy"), **common, num_warps=cfg.nw["wy"],
                             num_stages=stages(opts.stages_wy))
    _mark("bwd_wy")
    del dvn, tinv
    if G == 1:
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dqp = dkp
    else:
        dq = dk = gc  # written by _bwd_reduce
        dqp = torch.empty(TT, HV, K, device=dev, dtype=part_dtype)
    _bwd_out[(plan.NC * HV,)](q, k, rq, rk, gc, hs, dhs, vn, do, dgc, dkp, dqp, dq, dk, dg, plan.chunks, scale,
                              BV=cfg.bv["bo"], MODE=mode("prod_bo"), TWO_PASS=opts.bo_two_pass, **common,
                              num_warps=cfg.nw["bo"], num_stages=stages(opts.stages_bo))
    _mark("bwd_out")
    if G > 1:
        del hs, dhs, vn
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        bt = 32 if interp else opts.bt_red
        _bwd_reduce[(triton.cdiv(TT, bt), H)](q, k, rq, rk, dqp, dkp, dq, dk, TT, H=H, HV=HV, K=K, BK=cfg.BK,
                                              BT=bt, L2=L2, num_warps=warps(opts.warps_red))
        _mark("bwd_reduce")
    return dq, dk, dv, dg, db, dh0


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens):
        B, T, H, K = q.shape
        HV, V = v.shape[-2:]
        plan = _plan(B, T, cu_seqlens, q.device)
        qf = q.reshape(B * T, H, K).contiguous()
        kf = k.reshape(B * T, H, K).contiguous()
        vf = v.reshape(B * T, HV, V).contiguous()
        gf = g.reshape(B * T, HV).contiguous()
        bf = beta.reshape(B * T, HV).contiguous()
        h0 = initial_state.contiguous() if initial_state is not None else None
        o, ht = _forward(qf, kf, vf, gf, bf, scale, h0, output_final_state, l2, plan)
        ctx.save_for_backward(qf, kf, vf, gf, bf, h0)
        ctx.meta = (B, T, scale, l2, plan, initial_state is not None)
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        qf, kf, vf, gf, bf, h0 = ctx.saved_tensors
        B, T, scale, l2, plan, has_h0 = ctx.meta
        H, K = qf.shape[-2:]
        HV, V = vf.shape[-2:]
        if do is None:
            do = torch.zeros(B * T, HV, V, device=qf.device, dtype=qf.dtype)
        do = do.reshape(B * T, HV, V).contiguous()
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dg, db, dh0 = _backward(qf, kf, vf, gf, bf, scale, h0, do, dht, l2, plan,
                                            need_dh0=has_h0 and ctx.needs_input_grad[6])
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
                db.view(B, T, HV), None, dh0, None, None, None)


def chunk_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None = None,
                                  output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                  cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (forward and backward) in Triton.

    q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head hv reads q/k head
    hv // (HV // H)); g [B, T, HV] log-space decay; beta [B, T, HV]; initial_state [N, HV, K, V] fp32
    with N = B, or N = len(cu_seqlens) - 1 and B = 1 for packed sequences. Returns (o [B, T, HV, V] in
    q's dtype, final state [N, HV, K, V] fp32 or None). Differentiable in q, k, v, g, beta and
    initial_state, and through the final state when it is returned. Inputs are assumed validated.
    """
    K = q.shape[-1]
    if K > 256:
        raise ValueError(f"chunk_gated_delta_rule_triton: q/k head dim K={K} is not supported; allowed: K <= 256")
    if q.dtype not in _TL_DTYPE:
        raise ValueError(f"chunk_gated_delta_rule_triton: q.dtype={q.dtype} is not supported; "
                         f"allowed: {sorted(str(d) for d in _TL_DTYPE)}")
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, float(scale), initial_state, bool(output_final_state),
                                      bool(use_qk_l2norm_in_kernel), cu_seqlens)
