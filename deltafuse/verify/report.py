"""The result of ``deltafuse verify``: one comparison per tensor, and the text / JSON report.

A tensor passes on one of three criteria, and the report says which:

* ``rel``: ``max|a - b| / max|b| <= rtol`` (a = deltafuse, b = stock);
* ``floor`` (parameter gradients only): ``max|a - b| <= atol``, the absolute floor (a fixed fraction of the
  largest stock gradient value), while ``rel <= FLOOR_REL``. A gradient whose values are small against the
  model's largest one (the GDN decay parameters ``A_log`` and ``dt_bias``: sums over every token of terms that
  cancel) carries the rounding of the terms it sums, which is set by the model's scale, not by its own size.
  The ``rel <= FLOOR_REL`` bound keeps the floor from passing a result that does not resolve the reference at
  all: without it a gradient set to zero passed whenever stock's was below the floor (in 16-bit runs, whose
  floor is 1e-3 of the largest gradient, the ``A_log`` / ``dt_bias`` gradients of most GDN layers).
* ``float64`` (for a tensor that failed both): a float64 run of the stock model settles it. The tensor passes
  when deltafuse's result is no farther from the float64 one (the same ``rel`` metric) than stock's is (in 16
  bits 1.5x stock's: both carry their own roundings), or within ``rtol`` of it; or, for a parameter gradient that
  the run's precision does not resolve (stock's own result over FLOOR_REL of its size from float64, or the float64
  one under the floor), when deltafuse's is within the absolute floor of the float64 one and not a dropped
  gradient (``float64_verdict``). Where stock's gradients overflowed (an fp16 backward; the floor is then NaN), the
  floor comes from the float64 run's gradients and a gradient also passes within it of the float64 one while
  ``rel <= FLOOR_REL``. Stock's own result can be the
  inaccurate one: its torch GDN's gate gradients were 1.5x and 1.9x their own size from float64 on one fresh
  tiny-moe model in fp32 (deltafuse's 4e-6), up to 1.8x on fresh tiny models in bf16.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

# the absolute floor passes a tensor only while its error is at most this fraction of its largest stock value
# (rel <= FLOOR_REL): a zero (rel 1), sign-flipped (2) or doubled (1) result fails however small the reference
# is. Measured on the tensors that passed on the floor: rel up to 1.1e-2 (CPU fp32), 5.3e-2 (CPU fp16) and 0.107
# (H200 fp32, tiny packed: A_log / dt_bias of layer 0, whose stock values are 1.7x the floor itself)
FLOOR_REL = 0.5
CRITERIA = ("rel", "floor", "float64", "both None", "empty")
# a tensor that failed rel and the floor passes on a float64 run of stock when deltafuse's result is no farther
# from it than F64_SLACK times stock's. fp32: no farther at all. 16 bits: both runs carry their own roundings of
# about the same size, so the two errors of one tensor scatter around each other. On CPU (tiny, tiny-moe,
# tiny-next; bf16 and fp16; 37 fresh models) the ratio ours / stock of the gradients where either was over 5e-2
# from float64 ranged 0.01-1.19; 5 such gradients had failed, all GDN gate gradients that stock resolved no
# better (0.54-1.8 of their size from float64, ours 0.015-1.0). A zeroed gradient (1.0 from float64) still fails
# wherever stock's is within 0.67 of it; on 8 fresh tiny models stock's gate gradients were
# 0.1-9 % off in bf16
F64_SLACK = {torch.float32: 1.0, torch.bfloat16: 1.5, torch.float16: 1.5}


def float64_verdict(mine: float, mine_abs: float, theirs: float, slack: float, rtol: float, atol: float,
                    exact_max: float = math.inf, lost: bool = False, floor: bool = False) -> str:
    """How a tensor that failed rel and the floor fares against a float64 run: "closer" when deltafuse's distance
    from it (``mine``, the rel metric) is at most ``slack`` times stock's (``theirs``) or ``rtol``; "unresolved"
    (parameter gradients: ``atol > 0``) when the run's precision does not resolve the tensor, because stock's own
    result is over FLOOR_REL of the float64 one's size from it or the float64 one is itself under the floor
    (``exact_max <= atol``), and deltafuse's is within the floor of it (``mine_abs <= atol``: the floor's test,
    against the exact value instead of stock's); "" when it still fails, and always when deltafuse's is all zeros
    where the float64 one reaches the run's dtype's normal range (``lost``: a dropped gradient, not an underflow).
    With ``floor`` (stock's gradients overflowed, so the floor could not be applied against stock's result), a
    parameter gradient also passes on the floor against the float64 one: "floor" when ``mine_abs <= atol`` while
    ``mine <= FLOOR_REL``, the test a healthy run applies against stock.

    Measured: an H100's fp32 run of a fresh tiny-moe model left a layer's A_log / dt_bias gradients (1.5e-7 and
    2.6e-7 of the largest gradient) 2.1x and 2.3x their size from float64 in stock's run and 3.2x and 3.4x in
    deltafuse's. A fresh tiny model in bf16 (transformers 5.9) had one element of a layer's A_log gradient
    (1.9e-5 of the largest, under the floor of 1e-3) at +5.3e-7 in deltafuse's run and -1.5e-7 in stock's against
    -3.2e-7 in float64; with transformers 5.25 the same draw gave -7.1e-7 and -5.3e-8 against -6.4e-7. Single draws
    of such gradients swing several-fold either way, with no side the more accurate over many (tests/integrations/
    test_autocast.py: over 40 CPU draws the median ratio of deltafuse's error to stock's was 0.82-0.96)."""
    if lost:
        return ""
    # a non-finite stock result (an fp16 backward that overflowed) bounds nothing: deltafuse's is then judged by
    # rtol, or as unresolved
    if mine <= max(slack * theirs if math.isfinite(theirs) else 0.0, rtol):
        return "closer"
    if atol > 0 and (theirs > FLOOR_REL or exact_max <= atol) and mine_abs <= atol:
        return "unresolved"
    if floor and atol > 0 and mine_abs <= atol and mine <= FLOOR_REL:
        return "floor"
    return ""


@dataclass
class Comparison:
    name: str
    max_abs: float
    rel: float
    ok: bool
    shape: tuple = ()
    ref_max: float = math.nan  # max |stock|
    # the criterion it passed on: "rel", "floor" (the absolute floor), "both None" (no gradient on either side),
    # "empty"; "" when it failed
    passed_on: str = ""
    # against the float64 run (tensors that failed rel and floor): deltafuse's rel and stock's, deltafuse's max_abs,
    # and whether it passed as unresolved or on the floor against it (``float64_verdict``)
    f64_rel: float | None = None
    stock_f64_rel: float | None = None
    f64_abs: float | None = None
    unresolved: bool = False
    f64_floor: bool = False

    def __post_init__(self):
        if self.ok and not self.passed_on:
            self.passed_on = "rel"
        if self.passed_on and self.passed_on not in CRITERIA:
            raise ValueError(f"Comparison.passed_on={self.passed_on!r}; allowed: {', '.join(CRITERIA)} or ''")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class VerifyResult:
    model: str
    family: str | None
    packed: bool
    device: str
    dtype: str
    rtol: float
    atol: float
    transformers: str
    comparisons: list[Comparison] = field(default_factory=list)
    batch: dict = field(default_factory=dict)
    patch_rows: int = 0
    # MoE routers: name -> [tokens routed differently from stock, tokens]; pinned: whether those tokens were
    # routed as stock routed them for the comparison (16-bit runs)
    routing: dict = field(default_factory=dict)
    routing_pinned: bool = False
    # what the stock side ran: "stock" (transformers as installed) or "stock-torch" (transformers' own
    # pure-torch GDN functions, because stock's own fast path cannot run here: baseline_reason says why)
    baseline: str = "stock"
    baseline_swapped: list = field(default_factory=list)
    baseline_reason: str = ""
    # the absolute floor: atol = atol_scale * grad_scale (the largest |stock| over all parameter gradients),
    # applied to parameter gradients while rel <= floor_rel
    grad_scale: float = 0.0
    atol_scale: float = 0.0
    floor_rel: float = FLOOR_REL
    # the float64 run that settles tensors failing both criteria: "" (none needed), how many it judged and passed, or
    # why it could not run (the failures then stand)
    float64: str = ""
    # the absolute floor the float64 run judged gradients by: atol, or where stock's gradients overflowed (an fp16
    # backward: atol is then NaN) atol_scale times the float64 run's largest gradient value
    f64_atol: float | None = None

    @property
    def rerouted(self) -> int:
        return sum(d for d, _ in self.routing.values())

    @property
    def ok(self) -> bool:
        routing_ok = self.routing_pinned or self.rerouted == 0
        return bool(self.comparisons) and all(c.ok for c in self.comparisons) and routing_ok

    @property
    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.ok]

    def passed_on(self, criterion: str) -> list[Comparison]:
        """The comparisons that passed on ``criterion`` ("rel", "floor", "float64", "both None", "empty")."""
        return [c for c in self.comparisons if c.ok and c.passed_on == criterion]

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "comparisons"}
        out["ok"] = self.ok
        out["passed_on"] = {k: len(self.passed_on(k)) for k in CRITERIA}
        out["failed"] = len(self.failures)
        out["summary"] = self.verdict()
        out["comparisons"] = [c.to_dict() for c in self.comparisons]
        return out

    def baseline_line(self) -> str:
        if self.baseline == "stock":
            return "baseline: stock transformers as installed"
        places = ", ".join(dict.fromkeys(re.sub(r"layers\.\d+\.", "layers.*.", s.split(":")[0])
                                         for s in self.baseline_swapped))
        return (f"baseline: stock transformers with its own pure-torch GDN functions at {places} (stock's own "
                f"choice cannot run here: {self.baseline_reason})")

    def tolerance_lines(self) -> list[str]:
        lines = [f"tolerance: rel <= {self.rtol:g}, rel = max|a-b| / max|stock| per tensor (a = deltafuse)"]
        if self.atol > 0:
            scale = f"{self.atol_scale:g} x {self.grad_scale:.3g}, " if self.atol_scale and self.grad_scale else ""
            lines += [
                f"  or, for a parameter gradient, the absolute floor max|a-b| <= {self.atol:.3g} ({scale}the largest "
                f"stock gradient value) while rel <= {self.floor_rel:g}:",
                "  a gradient small against the largest one (vs largest; A_log, dt_bias: sums of terms that cancel) "
                "carries the rounding of what it sums; loss and logits have no floor"]
        if self.float64:
            slack = F64_SLACK.get(getattr(torch, self.dtype, None), 1.0)
            than = "stock's result is" if slack == 1.0 else f"{slack:g}x stock's {self.dtype} result"
            lines.append(f"  or, for a tensor that fails both: deltafuse no farther from a float64 run of stock than "
                         f"{than}, or within rel {self.rtol:g} of it, or, for a gradient the run's precision does not "
                         f"resolve (stock over {self.floor_rel:g} of its size from float64, or float64 under the "
                         f"floor), within the floor of float64 ({self.float64})")
            if not math.isfinite(self.atol) and self.f64_atol is not None:
                lines.append(f"  stock's gradients overflowed: the floor is {self.f64_atol:.3g} ({self.atol_scale:g} x "
                             f"the largest float64 gradient value), applied against the float64 run while rel <= "
                             f"{self.floor_rel:g}, and stock's non-finite results bound nothing")
        return lines

    def _relative_size(self, c: Comparison) -> str:
        # (no size where stock's gradients overflowed: the largest one is not finite)
        if not self.grad_scale or not math.isfinite(self.grad_scale) or not math.isfinite(c.ref_max):
            return ""
        return f"{c.ref_max / self.grad_scale:.1e}"

    def _verdict_cell(self, c: Comparison) -> str:
        if c.ok:
            if c.passed_on == "float64" and c.unresolved:
                return (f"float64, unresolved (stock {c.stock_f64_rel:.1e} of its size from it; deltafuse "
                        f"{c.f64_abs:.1e} from it, within the floor)")
            if c.passed_on == "float64" and c.f64_floor:
                return (f"float64, floor (deltafuse {c.f64_abs:.1e} from it, within the floor, rel {c.f64_rel:.1e}; "
                        f"stock {c.stock_f64_rel:.1e})")
            if c.passed_on == "float64":
                return f"float64 (deltafuse {c.f64_rel:.1e} from it, stock {c.stock_f64_rel:.1e})"
            return {"rel": "rel", "floor": "floor", "both None": "yes (no grad on either side)",
                    "empty": "yes (empty)"}[c.passed_on]
        if c.f64_rel is not None:
            return f"NO (float64: deltafuse {c.f64_rel:.1e} from it, stock {c.stock_f64_rel:.1e})"
        if math.isfinite(c.max_abs) and c.max_abs <= self.atol and c.name.startswith("grad "):
            return f"NO (within the floor, but rel > {self.floor_rel:g})"
        return "NO"

    def verdict(self) -> str:
        """The last line of the report: PASS or FAIL, and which criterion how many tensors passed on."""
        rel, floor = self.passed_on("rel"), self.passed_on("floor")
        parts = [f"{len(rel)} tensors within rel {self.rtol:g}"]
        if floor:
            rels = [c.rel for c in floor]
            sizes = [c.ref_max / self.grad_scale for c in floor if self.grad_scale and math.isfinite(c.ref_max)]
            span = f"rel {min(rels):.1e} to {max(rels):.1e}" if len(floor) > 1 else f"rel {rels[0]:.1e}"
            if sizes:
                span += (f"; their largest stock values are {min(sizes):.1e} to {max(sizes):.1e} of the largest "
                         f"gradient" if len(sizes) > 1 else
                         f"; its largest stock value is {sizes[0]:.1e} of the largest gradient")
            parts.append(f"{len(floor)} {'gradient' if len(floor) == 1 else 'gradients'} within the absolute floor "
                         f"{self.atol:.3g} only ({span})")
        exact = self.passed_on("float64")
        if exact:
            parts.append(f"{len(exact)} settled by a float64 run of stock (distance from it, deltafuse's vs stock's: "
                         + ", ".join(f"{c.name} {c.f64_rel:.1e} vs {c.stock_f64_rel:.1e}"
                                     + (" (unresolved, within the floor)" if c.unresolved else "")
                                     + (" (within the floor)" if c.f64_floor else "")
                                     for c in exact[:4])
                         + (f" and {len(exact) - 4} more" if len(exact) > 4 else "") + ")")
        others = len(self.passed_on("both None")) + len(self.passed_on("empty"))
        if others:
            parts.append(f"{others} with nothing to compare (no gradient on either side, or empty)")
        if self.ok:
            return "PASS: " + "; ".join(parts)
        failed = self.failures
        text = f"FAIL: {len(failed)} tensor(s) out of tolerance"
        if failed:
            text += ": " + ", ".join(c.name for c in failed[:10]) + (f" and {len(failed) - 10} more"
                                                                     if len(failed) > 10 else "")
        if self.rerouted and not self.routing_pinned:
            text += f"; {self.rerouted} token(s) routed to other experts than in stock"
        return text + ". Passed: " + "; ".join(parts)

    def format(self, limit: int | None = None) -> str:
        head = (f"deltafuse verify: {self.model} ({self.family}), {'packed' if self.packed else 'unpacked'} batch "
                f"{self.batch}, {self.device} {self.dtype}, transformers {self.transformers}")
        width = max([len(c.name) for c in self.comparisons] + [6])
        lines = [head, *self.tolerance_lines(), self.baseline_line(),
                 f"{'tensor':<{width}}  {'max_abs':>10}  {'rel':>10}  {'max|stock|':>10}  {'vs largest':>10}  passed on"]
        shown = self.comparisons if limit is None else self.comparisons[:limit]
        for c in shown:
            size = self._relative_size(c) if c.name.startswith("grad ") else ""
            lines.append(f"{c.name:<{width}}  {c.max_abs:10.3e}  {c.rel:10.3e}  {c.ref_max:10.3e}  {size:>10}  "
                         f"{self._verdict_cell(c)}")
        if limit is not None and len(self.comparisons) > limit:
            lines.append(f"... {len(self.comparisons) - limit} more")
        grads = [c for c in self.comparisons if c.name.startswith("grad ")]
        summary = f"{len(self.comparisons)} tensors compared ({len(grads)} parameter gradients)"
        finite = [c for c in grads if math.isfinite(c.rel)]
        worst = max(finite, key=lambda c: c.rel, default=None)
        if worst is not None:
            how = {"rel": "within rel", "floor": f"passed on the absolute floor: max_abs {worst.max_abs:.3g} <= "
                                                 f"{self.atol:.3g}"}.get(worst.passed_on, "out of tolerance")
            if worst.passed_on == "float64":
                how = f"passed against float64: {worst.f64_rel:.3g} from it, stock {worst.stock_f64_rel:.3g}"
            summary += f"; worst gradient by rel: {worst.name[5:]} {worst.rel:.3e} ({how})"
            on_rel = max((c for c in finite if c.passed_on == "rel"), key=lambda c: c.rel, default=None)
            if on_rel is not None and on_rel is not worst:
                summary += f"; worst within rel: {on_rel.name[5:]} {on_rel.rel:.3e}"
        lines.append(summary)
        if self.routing:
            moved = {n: v for n, v in self.routing.items() if v[0]}
            tokens = max(t for _, t in self.routing.values())
            if not moved:
                lines.append(f"routing: every token went to the same experts as in stock ({len(self.routing)} "
                             f"router(s), {tokens} tokens each)")
            else:
                what = ", ".join(f"{n} {d}/{t}" for n, (d, t) in moved.items())
                how = ("routed as stock routed them for the comparison (top-k ties within 16-bit rounding)"
                       if self.routing_pinned else "a failure in fp32")
                lines.append(f"routing: {self.rerouted} token(s) chose other experts than in stock ({what}); {how}")
        lines.append(self.verdict())
        return "\n".join(lines)


def compare(name: str, got: torch.Tensor | None, ref: torch.Tensor | None, rtol: float, atol: float,
            floor_rel: float = FLOOR_REL) -> Comparison:
    """Stock (``ref``) vs deltafuse (``got``): passes on ``rel <= rtol``, else on the absolute floor
    ``max_abs <= atol`` while ``rel <= floor_rel`` (``atol=0`` for no floor)."""
    if got is None or ref is None:
        ok = got is None and ref is None
        return Comparison(name, 0.0 if ok else math.inf, 0.0 if ok else math.inf, ok,
                          ref_max=math.nan if ref is None else ref.detach().abs().max().item() if ref.numel() else 0.0,
                          passed_on="both None" if ok else "")
    if got.shape != ref.shape:
        return Comparison(name, math.inf, math.inf, False, tuple(ref.shape))
    a, b = got.detach().double(), ref.detach().double()
    if a.numel() == 0:
        return Comparison(name, 0.0, 0.0, True, tuple(b.shape), 0.0, "empty")
    scale = b.abs().max().item()
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return Comparison(name, math.inf, math.inf, False, tuple(b.shape), scale)
    max_abs = (a - b).abs().max().item()
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if rel <= rtol:
        on = "rel"
    elif max_abs <= atol and rel <= floor_rel:
        on = "floor"
    else:
        on = ""
    return Comparison(name, max_abs, rel, bool(on), tuple(b.shape), scale, on)
