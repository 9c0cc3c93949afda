"""Tunables of the chunked gated delta rule kernels (``ChunkOptions``) and the default a ``configured`` block sets.

A call of the chunked op takes its options and stage hook as arguments (``kernel.chunk_gated_delta_rule_triton``);
one that passes none reads, once at its start, what the innermost ``configured`` block set (else
``DEFAULT_OPTIONS`` and no hook), and its backward runs with what its forward read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from deltafuse.ops._scoped import ScopedDefault

# product modes (kernel_fwd._dot_m): "tf32" one fp32 product, "16" the fp32 operand rounded to 16 bits, "x2" split
PROD_MODES = {"tf32": 0, "16": 1, "x2": 2}
# in-chunk inverse of the diagonal 16x16 blocks (kernel_fwd._unit_lower_inverse's INV)
INV_MODES = {"subst": 0, "double": 1, "recursive": 2}

StageHook = Callable[[str], None]


@dataclass(frozen=True)
class ChunkOptions:
    """Tunables of the chunked kernels on a GPU (the interpreter uses its own small fixed tiles).

    ``*_store``: dtype of the stored per-token / per-chunk intermediates (w, u, v', chunk states and their
    gradients): "input" (the inputs' 16-bit dtype) or "fp32". ``*_x2``: products of an fp32 operand with a
    16-bit one split the fp32 operand into two 16-bit parts (about 16 mantissa bits) instead of rounding it
    to 16 bits or using tf32 (``fwd_x2``: in the intra kernel, both where the forward runs it and where the
    backward reruns it to recompute w, u and T; the forward's later kernels take ``fwd_prod_*`` below.
    ``bwd_x2``: in ``_dv_local``; the reverse pass takes ``sbwd_prod_*``). fp32 inputs always use fp32 storage and three-pass tf32 products.
    ``bv_<kernel>`` / ``warps_<kernel>``: value-tile width and warps per kernel; ``stages``: pipeline stages.

    Forward kernels (the forward's sequential pass ``hfwd``, which the backward recomputes with the same settings,
    and its output kernel ``out``): ``fwd_prod_<p>``: how a product of
    a 16-bit operand with an fp32 one is computed: "x2" (the fp32 operand split into two 16-bit parts), "16"
    (rounded to 16 bits, one product) or "tf32" (one tf32 product); p is ``wh`` (w times the state, for v'),
    ``kv`` (k^T times the decayed v', the state update), ``qh`` (q times the stored state, when states are
    stored in fp32: 16-bit states make it exact) and ``sv`` (the in-chunk scores times v'). With fp32 inputs
    (or an fp32-stored operand) every product is an fp32 one. ``bk_out``: K block of the output kernel;
    ``stages_<kernel>``: its pipeline stages. The two sequential passes (``stages_hfwd``, ``stages_sbwd``) take
    at most that many: fewer where that many chunks' loads would not fit the device's shared memory
    (``chunk_launch.fit_stages``; one at fp32 storage in the reverse pass on an H200). In the interpreter warps
    and stages are 1 and tile widths are capped at the head size. One stage with a value tile under 64 and 4 or more
    warps is refused for ``_intra_fwd`` (``stages``, ``bv_intra``, ``warps_intra``) and ``_dv_local`` (``stages_dvl``,
    ``bv_dvl``, ``warps_dvl``): it faulted or gave NaN gradients on an H100 with Triton 3.6.
    """

    fwd_store: str = "input"
    bwd_store: str = "input"
    # fwd_store_v: dtype of the forward's u / v' buffer [tokens, HV, V] alone, and of the u buffer of the
    # backward's recompute ("input" or "fp32"; fwd_store="fp32" or fp32 inputs make it fp32 too). Rounding u and v'
    # to 16 bits is the largest error of the forward's output after the output's own rounding: in an fp64 model of
    # the kernels' roundings (bf16, 2,048 tokens, D = 128) it takes o from 1.7e-3 to 2.4e-3 relative RMS with gates
    # that forget within a chunk, and from 2.6e-3 to 3.3e-3 with gates that barely decay (over the 3e-3 bound).
    # fp32 by default: on an H100, with heads that keep a long memory, it takes o from 3.2e-3 to 2.6e-3 at 1x4,096
    # tokens for 3 % more forward+backward time at 16 K-64 K tokens and the same peak (BENCHMARKS.md#gdn-store-v-s25).
    fwd_store_v: str = "fp32"
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
    # 4 stages of loads in flight in the forward's sequential pass, 3 in the reverse pass: on the H200 they take the
    # pass from 2.15 to 1.47 ms and the reverse pass from 3.35 to 2.83 ms at 1x65,536 tokens, bf16, HV=32, D=128
    # (BENCHMARKS.md#gdn-stages-s22); fewer where the device's shared memory does not hold them (fit_stages)
    stages_hfwd: int = 4
    bv_out: int = 64
    bk_out: int = 128
    warps_out: int = 4
    stages_out: int = 2
    # backward kernels
    # bwd_partials: dtype of the per-value-head dq / dk partials that _bwd_out writes and _bwd_reduce sums when
    # several value heads share a q/k head: "fp32" or "input" (the inputs' 16-bit dtype: half the bytes).
    # prod_wy / prod_bo: products of a computed fp32 tile with a 16-bit one in _bwd_wy / _bwd_out (16-bit
    # inputs only): "x2" (two 16-bit parts), "16" (one 16-bit product), "tf32" (one fp32 product). The reverse
    # pass's products take the same modes: sbwd_prod_kd (k times the state gradient, for dv'), sbwd_prod_qd (q^T
    # times the decayed do) and sbwd_prod_wd (w^T dv'); _dv_local follows bwd_x2. _state_bwd has its own tiles
    # (bv_sbwd, warps_sbwd, stages_sbwd);
    # _bwd_reduce takes bt_red tokens per program. bo_two_pass: _bwd_out makes two passes over the value blocks
    # (dq, then dk): one [64, K] fp32 accumulator live instead of two, for one more read of v' and h.
    # wy_recompute_t: _bwd_wy computes T = (I + A)^-1 itself instead of reading the one the backward's in-chunk
    # kernel stored: one fp32 [tokens, HV, 64] buffer less through the reverse pass and _bwd_wy (0.5 GiB at
    # 65,536 tokens x 32 value heads), for one more in-chunk inverse per chunk and value head.
    # bwd_group_loop: with several value heads per q/k head, _bwd_wy and _bwd_out run one program per chunk and q/k
    # head that takes its value heads in turn: _bwd_out finishes dq and dk, with no dq partials (one [tokens, HV, K]
    # buffer), dk partials per q/k head instead of per value head, and no _bwd_reduce; G times fewer programs.
    # Both are off: on the H200 together they lower the backward's peak at 1x65,536 from 4.53 to 4.03 GiB above
    # the inputs but take its forward+backward from 21.4 to 31.8 ms (BENCHMARKS.md, session 20). Since the dq
    # partials take v''s bytes (session 26), wy_recompute_t alone gives that peak too, for 12 % more time (17.6 ->
    # 19.8 ms on an H200, BENCHMARKS.md#gdn-from-t-s26).
    bwd_partials: str = "input"
    prod_wy: str = "16"
    prod_bo: str = "16"
    bo_two_pass: bool = False
    wy_recompute_t: bool = False
    bwd_group_loop: bool = False
    # the reverse pass's three products in 16 bits (one product each): on the H200 they take that pass from 2.71 to
    # 1.75 ms at 1x65,536 tokens (bf16, HV=32, D=128) with every gradient of the hardest GPU cases still within
    # its bound (BENCHMARKS.md#gdn-sbwd-16-s23)
    sbwd_prod_kd: str = "16"
    sbwd_prod_qd: str = "16"
    sbwd_prod_wd: str = "16"
    # sbwd_from_t: the reverse pass forms w^T dv' as khat^T diag(beta exp(gc)) (T^T dv') from the T that the
    # backward's in-chunk kernel stores, instead of reading w: w is freed after the backward's recompute of the
    # states, one [tokens, HV, K] buffer less at the reverse pass, for one more [64, 64] x [64, bv_sbwd] product per
    # chunk there (with wy_recompute_t no T is stored and w is read). sbwd_prod_td: the mode of that product of two
    # fp32 tiles: "tf32" (one product at the inputs' precision), "x2" (both split into two 16-bit parts, three
    # 16-bit products) or "16" (both rounded to 16 bits, one product). Off: on an H100 it takes the backward's
    # peak at 1x65,536 (bf16, HV=32, D=128) from 4.52 to 4.03 GiB above the inputs, under FlashQLA's 4.05, but the
    # product sits on the pass's chain of dependent products, which takes the pass from 1.75 to 3.36 ms and the
    # forward+backward from 18.1 to 19.7 ms (+9 %; BENCHMARKS.md#gdn-from-t-s26).
    sbwd_from_t: bool = False
    sbwd_prod_td: str = "tf32"
    bv_sbwd: int = 32
    warps_sbwd: int = 4
    stages_sbwd: int = 3
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
    # fwd_x2 says, in both passes: split T into two 16-bit parts, or one tf32 product) or "16" (T rounded to 16 bits,
    # one product; 16-bit inputs only, fp32 inputs always take fp32 products).
    intra_inv: str = "recursive"
    intra_prod: str = "x2"
    # keep_states: whether the forward keeps what the backward otherwise recomputes from the inputs (the l2norm
    # factors, gc, w, v', T and the chunk-start states), so that the backward skips its rerun of the in-chunk kernel
    # and of the forward's sequential pass, with gradients bit for bit those of the recompute. Off: a forward keeps
    # only its inputs. On: a forward that autograd records keeps them too, about 2.5 GiB at 65,536 tokens x 32
    # value heads of 128 x 128 at bf16 (the inputs are 0.9 GiB), from the forward to the backward; on an H100 that
    # takes the forward+backward at 1x65,536 from 18.0 to 14.7 ms (BENCHMARKS.md#gdn-keep-s27). Off by default: a
    # model's layers would hold it all at once between their forwards and backwards. Never under
    # torch.utils.checkpoint's non-reentrant hooks (kernel.keep_states says why); needs fwd_store == bwd_store.
    keep_states: bool = False

    def __post_init__(self):
        for name, allowed in _CHOICES:
            self._check_choice(name, allowed)
        if self.fwd_prod_qh == "16":
            # q times an fp32 state rounded to 16 bits in registers gave NaN outputs on an H200 with Triton 3.6
            raise ValueError("ChunkOptions.fwd_prod_qh='16' is refused (NaN outputs on the H200 with Triton 3.6, "
                             "BENCHMARKS.md#gdn-v2-combined); allowed: 'x2', 'tf32'")
        for name in _PRODUCTS:
            self._check_choice(name, PROD_MODES)
        if self.keep_states is True and self.fwd_store != self.bwd_store:
            raise ValueError(f"ChunkOptions.keep_states=True with fwd_store={self.fwd_store!r} and bwd_store="
                             f"{self.bwd_store!r}: the kept states are in the forward's dtype; allowed: equal stores, "
                             "or keep_states=False")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"ChunkOptions.{f.name}={value!r}; allowed: True, False")
            if f.type != "int":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ChunkOptions.{f.name}={value!r}; allowed: an int >= 1")
            if not f.name.startswith("stages") and value & (value - 1):
                raise ValueError(f"ChunkOptions.{f.name}={value!r}; allowed: a power of two (a tile width or a "
                                 "warp count)")
        for stages, bv, warps in _ONE_STAGE_FAULTS:
            if getattr(self, stages) == 1 and getattr(self, bv) < 64 and getattr(self, warps) >= 4:
                raise ValueError(f"ChunkOptions.{stages}=1 with {bv}={getattr(self, bv)} and {warps}="
                                 f"{getattr(self, warps)} is refused (illegal memory accesses or NaN gradients on an "
                                 f"H100 with Triton 3.6, BENCHMARKS.md#gdn-tile-fault-s29); allowed: {stages} >= 2, "
                                 f"{bv} >= 64, or {warps} <= 2")

    def _check_choice(self, name: str, allowed) -> None:
        if getattr(self, name) not in allowed:
            raise ValueError(f"ChunkOptions.{name}={getattr(self, name)!r}; allowed: "
                             + ", ".join(repr(m) for m in allowed))


# the string fields and the values each takes, in the order they are checked; then the product modes
_CHOICES = (("fwd_store", ("input", "fp32")), ("bwd_store", ("input", "fp32")), ("fwd_store_v", ("input", "fp32")),
            ("intra_inv", INV_MODES),
            ("intra_prod", ("x2", "16")), ("bwd_partials", ("input", "fp32")))
# (stages, value tile, warps) of the kernels whose single-stage build with value tiles under 64 columns and 4 or more
# warps faulted or gave NaN gradients on an H100 with Triton 3.6 (BENCHMARKS.md#gdn-tile-fault-s29): the two that loop
# over value tiles after a product held from before the loop, _intra_fwd and _dv_local. At 2 warps both are correct
# (_dv_local in session 29; _intra_fwd at 32 columns in session 31, BENCHMARKS.md#gdn-timer-s31, 18 % slower)
_ONE_STAGE_FAULTS = (("stages", "bv_intra", "warps_intra"), ("stages_dvl", "bv_dvl", "warps_dvl"))
_PRODUCTS = ("fwd_prod_wh", "fwd_prod_kv", "fwd_prod_qh", "fwd_prod_sv", "prod_wy", "prod_bo", "sbwd_prod_kd",
             "sbwd_prod_qd", "sbwd_prod_wd", "sbwd_prod_td")
DEFAULT_OPTIONS = ChunkOptions()
# (options, stage hook) of calls that pass none: the defaults and no hook, except where a ``configured`` block reaches
_DEFAULTS: ScopedDefault[tuple[ChunkOptions, StageHook | None]] = ScopedDefault("deltafuse_chunk_options",
                                                                                (DEFAULT_OPTIONS, None))


def options_in_effect() -> ChunkOptions:
    """The options a call that passes none runs with now (the defaults outside a ``configured`` block)."""
    return _DEFAULTS.get()[0]


def _check(options) -> None:
    if options is not None and not isinstance(options, ChunkOptions):
        raise TypeError(f"options must be a ChunkOptions or None, got {type(options).__name__}")


def configured(options: ChunkOptions | None = None, stage_hook: StageHook | None = None):
    """Calls of the chunked op inside the block that pass no ``options`` run with these, and call
    ``stage_hook(stage_name)`` after each kernel launch of their forward and backward (a benchmark's per-stage
    timing); what was in effect before is restored on exit. A call reads them once, at its start: its backward
    uses its forward's, wherever it runs. A checkpoint's recompute in the backward is a new call, on a GPU on
    autograd's own thread: calls during a backward that no block of their own reaches take the innermost block open
    in the process (``deltafuse.ops._scoped``), so a block around the forward and the backward gives the recompute
    the first run's options; a backward after the block has closed recomputes with the defaults. Normal use never
    needs it: the defaults are the tuned values (BENCHMARKS.md#gdn-v2-combined, #gdn-16bit-w-state)."""
    _check(options)
    return _DEFAULTS.block((DEFAULT_OPTIONS if options is None else options, stage_hook))


def resolve(options: ChunkOptions | None, stage_hook: StageHook | None) -> tuple[ChunkOptions, StageHook | None]:
    """The options and stage hook of one call: those given, else those in effect (``configured``)."""
    _check(options)
    default_options, default_hook = _DEFAULTS.get()
    return (default_options if options is None else options,
            default_hook if stage_hook is None else stage_hook)
