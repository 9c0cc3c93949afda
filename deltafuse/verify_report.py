"""The result of ``deltafuse verify``: one comparison per tensor, and the text / JSON report."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Comparison:
    name: str
    max_abs: float
    rel: float
    ok: bool
    shape: tuple = ()

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

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "comparisons"}
        out["ok"] = self.ok
        out["comparisons"] = [c.to_dict() for c in self.comparisons]
        return out

    def baseline_line(self) -> str:
        if self.baseline == "stock":
            return "baseline: stock transformers as installed"
        places = ", ".join(dict.fromkeys(re.sub(r"layers\.\d+\.", "layers.*.", s.split(":")[0])
                                         for s in self.baseline_swapped))
        return (f"baseline: stock transformers with its own pure-torch GDN functions at {places} (stock's own "
                f"choice cannot run here: {self.baseline_reason})")

    def format(self, limit: int | None = None) -> str:
        head = (f"deltafuse verify: {self.model} ({self.family}), {'packed' if self.packed else 'unpacked'} batch "
                f"{self.batch}, {self.device} {self.dtype}, transformers {self.transformers}\n"
                f"tolerance: rel <= {self.rtol:g} (or max_abs <= {self.atol:.3g}); rel = max|a-b| / max|stock|")
        width = max([len(c.name) for c in self.comparisons] + [4])
        lines = [head, self.baseline_line(), f"{'tensor':<{width}}  {'max_abs':>10}  {'rel':>10}  ok"]
        shown = self.comparisons if limit is None else self.comparisons[:limit]
        for c in shown:
            lines.append(f"{c.name:<{width}}  {c.max_abs:10.3e}  {c.rel:10.3e}  {'yes' if c.ok else 'NO'}")
        if limit is not None and len(self.comparisons) > limit:
            lines.append(f"... {len(self.comparisons) - limit} more")
        grads = [c for c in self.comparisons if c.name.startswith("grad ")]
        worst = max(grads, key=lambda c: c.rel, default=None)
        summary = f"{len(self.comparisons)} tensors compared ({len(grads)} parameter gradients)"
        if worst is not None:
            summary += f"; worst gradient {worst.name[5:]} rel {worst.rel:.3e}"
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
        if self.ok:
            lines.append("PASS")
        else:
            lines.append(f"FAIL: {len(self.failures)} tensor(s) out of tolerance"
                         + (": " + ", ".join(c.name for c in self.failures[:10]) if self.failures else "")
                         + ("" if self.routing_pinned or not self.rerouted else
                            f"; {self.rerouted} token(s) routed to other experts than in stock"))
        return "\n".join(lines)


def compare(name: str, got: torch.Tensor | None, ref: torch.Tensor | None, rtol: float, atol: float) -> Comparison:
    if got is None or ref is None:
        ok = got is None and ref is None
        return Comparison(name, 0.0 if ok else math.inf, 0.0 if ok else math.inf, ok)
    if got.shape != ref.shape:
        return Comparison(name, math.inf, math.inf, False, tuple(ref.shape))
    a, b = got.detach().double(), ref.detach().double()
    if a.numel() == 0:
        return Comparison(name, 0.0, 0.0, True, tuple(b.shape))
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return Comparison(name, math.inf, math.inf, False, tuple(b.shape))
    max_abs = (a - b).abs().max().item()
    scale = b.abs().max().item()
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return Comparison(name, max_abs, rel, rel <= rtol or max_abs <= atol, tuple(b.shape))
