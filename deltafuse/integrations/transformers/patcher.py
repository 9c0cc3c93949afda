"""The one patching mechanism: applies the rows of the family maps, records what it replaced, restores it.

A family map (``qwen3_5.py`` ...) is data: the modeling module it patches and a tuple of ``Route`` rows.
A row names a target and what to put there:

* ``global``   - a module global (``owner`` empty), looked up by name by transformers at call or init time;
* ``class``    - a class attribute of class ``owner`` (a method: ``wrap=True`` builds the new method from the
  original one);
* ``instance`` - an attribute every instance of ``owner`` cached in its ``__init__`` (old design); applied to
  the instances of a model passed to ``apply``.
* ``mapping``  - key ``attr`` of the dict at the dotted import path ``mapping`` (a registry of named
  implementations that ``owner``, a class of the family module, looks names up in); the key is added or its
  value replaced, and removed or restored on revert.

``design`` restricts a row to the old ("old": the module defines ``design_marker``) or new ("new") design
of transformers' GDN integration. The patcher records (target, attribute, previous value, whether the
target owned the attribute) for everything it changes, so ``revert`` restores the very objects it found;
applying a row a second time is recognised and changes nothing.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

MISSING = object()
KINDS = ("global", "class", "instance", "mapping")
DESIGNS = ("any", "old", "new")
SWITCHES = ("gdn", "fused_ops", "moe")


@dataclass(frozen=True)
class Route:
    switch: str
    kind: str
    owner: str
    attr: str
    replacement: Any
    design: str = "any"
    wrap: bool = False
    init_from: tuple[str, ...] = ()
    note: str = ""
    mapping: str = ""
    # the note holds only where the family module's global of this name is, as transformers set it, not None
    # (e.g. "FusedRMSNormGated": FLA's norm, old design with FLA importable); "" = always
    note_if: str = ""

    def __post_init__(self):
        if self.switch not in SWITCHES:
            raise ValueError(f"Route.switch={self.switch!r}; allowed: {', '.join(SWITCHES)}")
        if self.kind not in KINDS:
            raise ValueError(f"Route.kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.design not in DESIGNS:
            raise ValueError(f"Route.design={self.design!r}; allowed: {', '.join(DESIGNS)}")
        if self.kind != "global" and not self.owner:
            raise ValueError(f"Route {self.attr!r}: kind={self.kind!r} needs the owning class name")
        if (self.kind == "mapping") != bool(self.mapping):
            raise ValueError(f"Route {self.attr!r}: mapping={self.mapping!r} with kind={self.kind!r}; a dotted import "
                             "path of a dict is required for kind 'mapping' and allowed for no other kind")

    def target_name(self, module: str) -> str:
        if self.kind == "global":
            return f"{module}.{self.attr}"
        if self.kind == "class":
            return f"{module}.{self.owner}.{self.attr}"
        if self.kind == "mapping":
            return f"{self.mapping}[{self.attr!r}]"
        return f"{module}.{self.owner}(instance).{self.attr}"


@dataclass(frozen=True)
class FamilyMap:
    """Everything deltafuse knows about one model family (or, with ``models=False``, one library).

    family: the family's name (``config_family`` / ``model_family`` return it); module: the modeling module
    the rows patch; routes: the rows. title: how messages name the family. config_classes: the config classes
    of its models (the first is the one named models are built from); model_classes: the model classes
    deltafuse supports (the first is the causal LM named models build); both are looked up in the package
    of ``module``. tiny_name / tiny_config: the CPU-sized test model of the family (keyword arguments of the
    first config class).
    """

    family: str
    module: str
    routes: tuple[Route, ...]
    design_marker: str = "is_fast_path_available"
    doc: str = ""
    # False for a library's map (TRL): it defines no model classes, so ``owns`` and model search ignore it
    models: bool = True
    # a top-level package that must already be imported for the map to apply (``apply`` does not import it)
    when_imported: str = ""
    title: str = ""
    config_classes: tuple[str, ...] = ()
    model_classes: tuple[str, ...] = ()
    tiny_name: str = ""
    tiny_config: dict = field(default_factory=dict, hash=False)

    @property
    def package(self) -> str:
        """The transformers package of the family (``transformers.models.qwen3_5``)."""
        return self.module.rsplit(".", 1)[0]


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
        for prefix in ("deltafuse.integrations.transformers.adapters.",
                       "deltafuse.integrations.transformers.adapters_fused.",
                       "deltafuse.integrations.transformers.packing."):
            text = text.replace(prefix, "deltafuse.")
        return text

    def to_dict(self) -> dict:
        return dict(self.__dict__)


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
        again = {r.target for r in self.already_applied}  # a key several families share counts once
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
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    return f"{module}.{name}"


@dataclass
class _Record:
    route: Route
    target_ref: Callable[[], Any]  # returns the target or None once an instance is gone
    attr: str
    old: Any
    had_own: bool
    new: Any
    label: str
    module: str


class Patcher:
    """Applies family maps; keeps the records that ``revert`` needs. One instance per process."""

    def __init__(self, maps):
        self.maps = tuple(maps)
        self._records: dict[tuple, _Record] = {}
        self._order: list[tuple] = []
        self._lock = threading.RLock()

    # --- discovery ----------------------------------------------------------------------------------
    def modules(self) -> dict[str, object]:
        """Family -> imported modeling module, or the reason it is unavailable (a str)."""
        found = {}
        for fmap in self.maps:
            if fmap.when_imported and fmap.when_imported not in sys.modules:
                found[fmap.family] = (f"not imported ({fmap.when_imported} is routed only when imported before "
                                      f"deltafuse.apply)")
                continue
            try:
                found[fmap.family] = importlib.import_module(fmap.module)
            except Exception as exc:  # an absent family is a report line, not a crash
                found[fmap.family] = f"not available ({type(exc).__name__}: {exc})"
        return found

    @staticmethod
    def design(fmap: FamilyMap, module) -> str:
        return "old" if hasattr(module, fmap.design_marker) else "new"

    def family_module_names(self) -> set[str]:
        return {fmap.module for fmap in self.maps if fmap.models}

    def owns(self, cls: type) -> bool:
        """True when ``cls`` (or a base class) is defined in one of the mapped modeling modules."""
        names = self.family_module_names()
        return any(getattr(c, "__module__", None) in names for c in getattr(cls, "__mro__", ()))

    def has_records(self) -> bool:
        return bool(self._records)

    # --- apply ----------------------------------------------------------------------------------------
    def apply(self, switches: dict[str, bool], model=None) -> tuple[dict, list[ReportRow], list[str]]:
        rows: list[ReportRow] = []
        notes: list[str] = []
        families: dict[str, str] = {}
        with self._lock:
            start_order = len(self._order)
            modules = self.modules()
            for fmap in self.maps:
                module = modules[fmap.family]
                if isinstance(module, str):
                    families[fmap.family] = module
                    continue
                design = self.design(fmap, module) if fmap.models else "any"
                families[fmap.family] = f"{design} design ({fmap.module})" if fmap.models else fmap.module
                start = len(rows)
                for route in fmap.routes:
                    if route.design not in ("any", design) or not switches.get(route.switch, False):
                        continue
                    if route.kind == "global":
                        rows.append(self._apply_attr(route, module, fmap.module))
                    elif route.kind == "class":
                        cls = getattr(module, route.owner, None)
                        if not isinstance(cls, type):
                            rows.append(ReportRow(route.switch, route.target_name(fmap.module), "<absent>", "",
                                                  "not found"))
                            continue
                        rows.append(self._apply_attr(route, cls, fmap.module))
                        if model is not None and route.attr == "forward":
                            rows.extend(self._apply_hooked_forward(route, cls, fmap.module, model))
                    elif route.kind == "mapping":
                        rows.append(self._apply_key(route, module, fmap.module, start_order))
                    elif model is not None:
                        rows.extend(self._apply_instances(route, module, fmap.module, model))
                notes_of = {route.target_name(fmap.module): route.note for route in fmap.routes
                            if route.note and (not route.note_if or self._stock_global(module, route.note_if)
                                               not in (None, MISSING))}
                for row in rows[start:]:
                    row.module = fmap.module
                    row.note = "; ".join(filter(None, (notes_of.get(row.target, ""), row.note)))
            for switch in SWITCHES:
                if not any(r.switch == switch for fmap in self.maps for r in fmap.routes):
                    state = "on" if switches.get(switch) else "off"
                    notes.append(f"{switch} ({state}): no routes exist yet for "
                                 f"{', '.join(f.family for f in self.maps)}; nothing is patched for it")
        return families, rows, notes

    def _new_value(self, route: Route, current):
        if route.wrap:
            if current is MISSING or current is None:
                raise RuntimeError(f"cannot wrap {route.owner}.{route.attr}: it does not exist")
            return route.replacement(current)
        return route.replacement

    def _apply_attr(self, route: Route, target, module_name: str) -> ReportRow:
        label = route.target_name(module_name)
        attr = route.attr
        had_own = attr in vars(target)
        current = vars(target).get(attr, MISSING) if had_own else getattr(target, attr, MISSING)
        key = (id(target), attr)
        rec = self._records.get(key)
        if rec is not None and rec.target_ref() is target and current is rec.new:
            return ReportRow(route.switch, label, describe(rec.old), describe(rec.new), "already applied")
        if current is MISSING:
            return ReportRow(route.switch, label, "<absent>", describe(route.replacement), "not found")
        if not route.wrap and current is route.replacement:
            return ReportRow(route.switch, label, describe(current), describe(current), "in place")
        new = self._new_value(route, current)
        setattr(target, attr, new)
        self._remember(key, _Record(route, _strong(target), attr, current, had_own, new, label, module_name))
        return ReportRow(route.switch, label, describe(current), describe(new), "applied")

    def _apply_hooked_forward(self, route, cls, module_name, model) -> list[ReportRow]:
        """Instances whose forward an accelerate hook captured as ``_old_forward`` (a bound method)."""
        rec = self._records.get((id(cls), route.attr))
        if rec is None:
            return []
        applied, already = 0, 0
        for inst in model.modules():
            if not isinstance(inst, cls):
                continue
            bound = vars(inst).get("_old_forward", None)
            if bound is None:
                continue
            key = (id(inst), "_old_forward")
            mine = self._records.get(key)
            if mine is not None and mine.target_ref() is inst and bound is mine.new:
                already += 1
                continue
            if getattr(bound, "__func__", None) is not rec.old or getattr(bound, "__self__", None) is not inst:
                continue
            new = types.MethodType(rec.new, inst)
            setattr(inst, "_old_forward", new)
            self._remember(key, _Record(route, weakref.ref(inst), "_old_forward", bound, True, new,
                                        f"{module_name}.{route.owner}(hooked instance)._old_forward", module_name))
            applied += 1
        label = f"{module_name}.{route.owner}(hooked instance)._old_forward"
        out = []
        if applied:
            out.append(ReportRow(route.switch, label, describe(rec.old), describe(rec.new), "applied", applied))
        if already:
            out.append(ReportRow(route.switch, label, describe(rec.old), describe(rec.new), "already applied",
                                 already))
        return out

    def _stock_global(self, module, name: str):
        """Module global ``name`` as transformers set it (the value deltafuse replaced, if it did)."""
        rec = self._records.get((id(module), name))
        return rec.old if rec is not None else vars(module).get(name, MISSING)

    def _stock_init_value(self, module, route: Route):
        """What the stock ``__init__`` caches for an instance row: the first non-None original global."""
        for name in route.init_from:
            rec = self._records.get((id(module), name))
            value = rec.old if rec is not None else getattr(module, name, None)
            if value is not None and value is not MISSING:
                return value
        return None

    def _apply_instances(self, route: Route, module, module_name: str, model) -> list[ReportRow]:
        cls = getattr(module, route.owner, None)
        label = route.target_name(module_name)
        if not isinstance(cls, type):
            return [ReportRow(route.switch, label, "<absent>", "", "not found")]
        counts: dict[tuple, int] = {}
        for inst in model.modules():
            if not isinstance(inst, cls):
                continue
            attrs = vars(inst)
            key = (id(inst), route.attr)
            rec = self._records.get(key)
            current = attrs.get(route.attr, MISSING)
            if rec is not None and rec.target_ref() is inst and current is rec.new:
                status, old, new = "already applied", rec.old, rec.new
            elif current is MISSING:
                status, old, new = "not found", MISSING, route.replacement
            else:
                new = route.replacement
                if current is new:
                    # built while deltafuse was applied: the stock value is what __init__ would have cached
                    old = self._stock_init_value(module, route)
                    status = "applied (built while patched)"
                else:
                    old = current
                    status = "applied"
                setattr(inst, route.attr, new)
                self._remember(key, _Record(route, weakref.ref(inst), route.attr, old, True, new, label, module_name))
            row_key = (status, describe(old), describe(new))
            counts[row_key] = counts.get(row_key, 0) + 1
        return [ReportRow(route.switch, label, old, new, status, n) for (status, old, new), n in counts.items()]

    def _apply_key(self, route: Route, module, module_name: str, start_order: int) -> ReportRow:
        """A ``mapping`` row: set key ``route.attr`` of the dict at ``route.mapping``. Several families may
        name the same key: the first applies it, the others report "applied (shared)" in the same call."""
        label = route.target_name(module_name)
        if not isinstance(getattr(module, route.owner, None), type):
            return ReportRow(route.switch, label, "<absent>", describe(route.replacement), "not found",
                             note=f"{module_name} has no class {route.owner}")
        table = resolve(route.mapping)
        if not isinstance(table, dict):
            return ReportRow(route.switch, label, "<absent>", describe(route.replacement), "not found",
                             note=f"{route.mapping} is not an importable dict in this transformers")
        key = (id(table), ("key", route.attr))
        current = table.get(route.attr, MISSING)
        rec = self._records.get(key)
        if rec is not None and rec.target_ref() is table and current is rec.new:
            shared = key in self._order[start_order:]
            return ReportRow(route.switch, label, describe(rec.old), describe(rec.new),
                             "applied (shared)" if shared else "already applied")
        if current is not MISSING and not route.wrap and current is route.replacement:
            return ReportRow(route.switch, label, describe(current), describe(current), "in place")
        new = route.replacement(current) if route.wrap else route.replacement
        table[route.attr] = new
        self._remember(key, _Record(route, _strong(table), route.attr, current, current is not MISSING, new, label,
                                    module_name))
        return ReportRow(route.switch, label, describe(current), describe(new), "applied")

    def _remember(self, key, record: _Record) -> None:
        if key in self._records:
            # re-applied over a value someone else put there: keep the value deltafuse first found
            first = self._records[key]
            record = _Record(record.route, record.target_ref, record.attr, first.old, first.had_own, record.new,
                             record.label, record.module)
        else:
            self._order.append(key)
        self._records[key] = record

    # --- revert ---------------------------------------------------------------------------------------
    def mark(self) -> int:
        """A position in the history of changes; ``revert(since=mark)`` undoes only what came after it."""
        return len(self._order)

    def revert(self, since: int = 0) -> list[ReportRow]:
        rows = []
        with self._lock:
            for key in reversed(self._order[since:]):
                rec = self._records[key]
                target = rec.target_ref()
                if target is None:
                    rows.append(ReportRow(rec.route.switch, rec.label, describe(rec.new), describe(rec.old), "gone",
                                          module=rec.module))
                    continue
                if rec.route.kind == "mapping":
                    if rec.had_own:
                        target[rec.attr] = rec.old
                    else:
                        target.pop(rec.attr, None)
                elif rec.had_own:
                    setattr(target, rec.attr, rec.old)
                else:
                    try:
                        delattr(target, rec.attr)
                    except AttributeError:
                        pass
                rows.append(ReportRow(rec.route.switch, rec.label, describe(rec.new), describe(rec.old), "reverted",
                                      module=rec.module))
            for key in self._order[since:]:
                del self._records[key]
            del self._order[since:]
        merged: dict[tuple, ReportRow] = {}
        for r in rows:
            k = (r.switch, r.target, r.old, r.new, r.status)
            if k in merged:
                merged[k].count += 1
            else:
                merged[k] = r
        return list(merged.values())


def _strong(obj):
    return lambda: obj


def _follow(obj, path: str):
    """The object at dotted attribute ``path`` of ``obj`` (``obj`` itself for ""), or MISSING."""
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name, MISSING)
        if obj is MISSING or obj is None:
            return MISSING
    return obj


def resolve(dotted: str):
    """The object at a dotted import path (``package.module.Object.attr``), or MISSING when it does not exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return _follow(obj, ".".join(parts[cut:]))
    return MISSING
