"""What ``apply`` or ``revert`` did, as the patcher reports it: one ``ReportRow`` per route and target, gathered
in a ``PatchReport`` (its one line, ``details()`` and ``to_dict()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltafuse.integrations.transformers.rows import MISSING, SWITCHES
from deltafuse.integrations.transformers.stock import held_function


@dataclass
class ReportRow:
    switch: str
    target: str
    old: str
    new: str
    status: str  # applied | applied (shared) | already applied | in place | not found | reverted | gone
    count: int = 1
    module: str = ""  # the modeling module of the row's family
    note: str = ""

    def short(self, text: str) -> str:
        if self.module:
            text = text.replace(self.module + ".", "")
        for prefix, short in _SHORT_PREFIXES:
            text = text.replace(prefix, short)
        return text

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# how rows name the objects of deltafuse's adapter modules
_SHORT_PREFIXES = (("deltafuse.integrations.transformers.adapters.", "deltafuse."),
                   ("deltafuse.integrations.transformers.adapters_fused.", "deltafuse."),
                   ("deltafuse.integrations.transformers.packing.", "deltafuse."),
                   ("deltafuse.integrations.transformers.cp_adapters.", "deltafuse.context_parallel."))

# statuses of a row that changed something in this call ("applied (shared)": the same key, applied by another
# family's row of the same call)
CHANGED = ("applied", "applied (built while patched)", "reverted")
PROBLEMS = ("not found", "gone")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _is_design(what) -> bool:
    """Whether a ``PatchReport.families`` value is a patched model family's design ("new design (module)")."""
    return str(what).startswith(("old design", "new design"))


@dataclass
class PatchReport:
    """What ``apply`` (or ``revert``) did: one row per route and target, plus notes.

    ``str(report)`` is one line: what was routed, to which implementations the model's training calls go on its
    device, what was left out and where the rest is; ``report.details()`` is every row, setting and note.
    """

    enabled: bool
    settings: dict
    transformers: str | None
    families: dict = field(default_factory=dict)  # family -> design, or why it was skipped
    rows: list[ReportRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model: str | None = None
    action: str = "apply"
    titles: dict = field(default_factory=dict)  # family -> how messages name it ("Qwen3.5")
    model_family: str | None = None  # the family of the model given to apply
    # which implementation each routed op picks for a training call (backward needed) on ``serving_on``
    # ("cpu float32"): switch -> {op: backend}; empty when unknown
    serving_on: str | None = None
    serving: dict = field(default_factory=dict)

    @property
    def applied(self) -> list[ReportRow]:
        return [r for r in self.rows if r.status in ("applied", "reverted")]

    @property
    def already_applied(self) -> list[ReportRow]:
        return [r for r in self.rows if r.status == "already applied"]

    def to_dict(self) -> dict:
        return {"action": self.action, "enabled": self.enabled, "settings": dict(self.settings),
                "transformers": self.transformers, "model": self.model, "model_family": self.model_family,
                "families": dict(self.families), "serving_on": self.serving_on,
                "serving": {k: dict(v) for k, v in self.serving.items()}, "summary": self.summary(),
                "rows": [r.to_dict() for r in self.rows], "notes": list(self.notes)}

    # --- the one line ------------------------------------------------------------------------------------
    def _title(self, family: str) -> str:
        return self.titles.get(family, family)

    def _counts(self, statuses) -> str:
        counts = {k: sum(r.switch == k and r.status in statuses for r in self.rows) for k in SWITCHES}
        return ", ".join(f"{k} {n}" for k, n in counts.items() if n)

    def _designs(self) -> str:
        patched = {f: str(d).split(" (", 1)[0] for f, d in self.families.items() if _is_design(d)}
        designs = set(patched.values())
        version = f"transformers {self.transformers}" if self.transformers else "transformers"
        if len(designs) == 1:
            return f"{version}, {designs.pop()}"
        return version + "".join(f", {self._title(f)} {d}" for f, d in patched.items())

    def _serving_text(self) -> str:
        if not self.serving_on or not self.serving:
            return ""
        chosen = {op: b for ops in self.serving.values() for op, b in ops.items()}
        if len(set(chosen.values())) == 1:
            return f"training calls on {self.serving_on} -> {next(iter(chosen.values()))}"
        parts = []
        for switch, ops in self.serving.items():
            names = list(ops.values())
            main = max(dict.fromkeys(names), key=names.count)
            odd = [f"{op} {b}" for op, b in ops.items() if b != main]
            parts.append(f"{switch} {main}" + (f" ({', '.join(odd)})" if odd else ""))
        return f"training calls on {self.serving_on} -> " + ", ".join(parts)

    def summary(self) -> str:
        """One line: what this call changed, where the model's training calls go, what was left out."""
        if not self.enabled:
            return "deltafuse: patching is off (DELTAFUSE_PATCH), nothing was changed"
        if self.action == "revert":
            if not self.rows:
                return "deltafuse: revert: nothing was patched"
            done = [r for r in self.rows if r.status == "reverted"]
            text = (f"deltafuse: reverted {_n(len(done), 'route')} ({self._counts(('reverted',))}): the objects "
                    f"found before apply are back")
            gone = [r for r in self.rows if r.status == "gone"]
            if gone:
                text += f"; {len(gone)} target(s) no longer exist"
            return text + "; details: report.details()"
        changed = [r for r in self.rows if r.status in CHANGED]
        models = [f for f, d in self.families.items() if _is_design(d)]
        head = f"deltafuse: applied {_n(len(changed), 'route')}"
        if changed:
            head += f" ({self._counts(CHANGED)})"
        if models:
            head += " to " + ", ".join(self._title(f) for f in models) + f" ({self._designs()})"
        parts = [head]
        again = {(r.switch, r.target) for r in self.already_applied}  # a key several families share counts once
        if again:
            parts.append(f"{_n(len(again), 'route')} already applied")
        serving = self._serving_text()
        if serving and self.model_family:
            parts.append(f"{self._title(self.model_family)} model: {serving}")
        elif serving:
            parts.append(serving + " (each call picks on its tensors' device)")
        elif self.model_family:
            parts.append(f"{self._title(self.model_family)} model")
        off = [k for k in ("gdn", "fused_ops", "moe") if self.settings.get(k) is False]
        if off:
            parts.append(", ".join(off) + " off")
        skipped = [f for f, d in self.families.items() if str(d).startswith("not ")]
        by_reason: dict[str, list[str]] = {}
        for f in skipped:  # "not imported (trl is routed only when ...)", "not available (ImportError: ...)"
            by_reason.setdefault(str(self.families[f]).split(" (", 1)[0], []).append(self._title(f))
        parts += [f"{', '.join(names)} {why}" for why, names in by_reason.items()]
        problems = [r for r in self.rows if r.status in PROBLEMS]
        if problems:
            parts.append(f"{_n(len(problems), 'route')} not found")
        tail = "details: report.details()"
        if self.notes:
            tail = f"{_n(len(self.notes), 'note')}: report.details()"
        return "; ".join(parts) + "; " + tail

    def __str__(self) -> str:
        return self.summary()

    # --- everything ----------------------------------------------------------------------------------------
    def details(self) -> str:
        """Every setting, family, row (target, old -> new, status, note) and note, one per line."""
        head = f"deltafuse {self.action}: "
        if not self.enabled:
            head += "patching is off (DELTAFUSE_PATCH), nothing was changed"
        else:
            done = len(self.applied)
            head += f"{done} row(s) {'reverted' if self.action == 'revert' else 'applied'}"
            if self.action == "apply":
                head += f", {len(self.already_applied)} already applied"
        lines = [head]
        if self.settings:
            lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()))
        if self.transformers:
            lines.append(f"transformers {self.transformers}")
        if self.model:
            lines.append(f"model: {self.model}" + (f" ({self._title(self.model_family)})" if self.model_family else ""))
        for fam, what in self.families.items():
            lines.append(f"family {fam}: {what}")
        if self.serving_on and self.serving:
            lines.append(f"training calls on {self.serving_on}: " + "; ".join(
                f"{switch}: " + ", ".join(f"{op} -> {b}" for op, b in ops.items())
                for switch, ops in self.serving.items()) + " (deltafuse info: every op and device, with reasons)")
        if self.rows:
            width = max(len(r.short(r.target)) for r in self.rows)
            module = None
            for r in self.rows:
                if r.module != module:
                    module = r.module
                    lines.append(f"{module or '(other)'}:")
                count = f" x{r.count}" if r.count != 1 else ""
                lines.append(f"  [{r.switch}] {r.short(r.target):<{width}}  {r.short(r.old)} -> {r.short(r.new)}  "
                             f"({r.status}{count})" + (f"  # {r.note}" if r.note else ""))
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def describe(value) -> str:
    """A readable name of a patched object (function, class, method or None)."""
    if value is MISSING:
        return "<absent>"
    if value is None:
        return "None"
    inner = getattr(value, "__deltafuse_wraps__", None)
    if inner is not None:
        return f"{getattr(value, '__deltafuse_factory__', 'deltafuse wrapper')}({describe(inner)})"
    func = getattr(value, "__func__", value)
    module = getattr(func, "__module__", None) or type(func).__module__
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if name is None:
        held = held_function(func)  # transformers 5.25+ with `kernels`: a Func module around the function
        if held is not None:
            return describe(held)
    return f"{module}.{name or type(func).__name__}"
