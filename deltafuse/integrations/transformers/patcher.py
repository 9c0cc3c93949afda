"""The one patching mechanism: applies the rows of the family maps, records what it replaced, restores it.

The rows and maps are data (``rows.py``: ``Route``, ``FamilyMap`` and the row kinds); the ``Patcher`` here
applies them, module globals, class attributes, mapping keys and the instances of a model given to ``apply``
(attributes their ``__init__`` cached, forwards an accelerate hook captured), and writes one record per change
into its ``Ledger`` (``records.py``), so that ``revert`` restores the very objects it found; applying a row a
second time is recognised and changes nothing, also under a row of a higher layer that wraps its value. What a
call did comes back as ``ReportRow``s (``report.py``).
"""

from __future__ import annotations

import importlib
import sys
import types
import weakref

from deltafuse.integrations.transformers.records import Ledger, Record
from deltafuse.integrations.transformers.report import PatchReport, ReportRow, describe
from deltafuse.integrations.transformers.rows import MISSING, SWITCHES, FamilyMap, Route

# the names other modules import from here
__all__ = ["MISSING", "FamilyMap", "Ledger", "PatchReport", "Patcher", "ReportRow", "Route", "describe", "resolve"]


class Patcher:
    """Applies family maps; records what it replaced in ``ledger``, which ``revert`` restores. One instance per
    process (``deltafuse.maps.PATCHER``)."""

    def __init__(self, maps):
        self.maps = tuple(maps)
        self.ledger = Ledger()

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
        return self.ledger.has_records()

    # --- apply ----------------------------------------------------------------------------------------
    def apply(self, switches: dict[str, bool], model=None) -> tuple[dict, list[ReportRow], list[str]]:
        rows: list[ReportRow] = []
        notes: list[str] = []
        families: dict[str, str] = {}
        with self.ledger.lock:
            start_order = self.ledger.mark()
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
                        rows.extend(self._apply_instances(route, module, fmap.module, model,
                                                          _covering(fmap, route)))
                notes_of = {(route.switch, route.target_name(fmap.module)): route.note for route in fmap.routes
                            if route.note and (not route.note_if or self._stock_global(module, route.note_if)
                                               not in (None, MISSING))}
                for row in rows[start:]:
                    row.module = fmap.module
                    row.note = "; ".join(filter(None, (notes_of.get((row.switch, row.target), ""), row.note)))
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
        key = _key(route, target, attr)
        rec = self.ledger.get(key)
        if rec is not None and rec.target_ref() is target and self.ledger.beneath(key, target, current) is rec.new:
            return ReportRow(route.switch, label, describe(rec.old), describe(rec.new), "already applied")
        if current is MISSING:
            return ReportRow(route.switch, label, "<absent>", describe(route.replacement), "not found")
        if not route.wrap and current is route.replacement:
            return ReportRow(route.switch, label, describe(current), describe(current), "in place")
        new = self._new_value(route, current)
        setattr(target, attr, new)
        self.ledger.remember(key, Record(route, _strong(target), attr, current, had_own, new, label, module_name))
        return ReportRow(route.switch, label, describe(current), describe(new), "applied")

    def _apply_hooked_forward(self, route, cls, module_name, model) -> list[ReportRow]:
        """Instances whose forward an accelerate hook captured as ``_old_forward`` (a bound method)."""
        rec = self.ledger.get(_key(route, cls, route.attr))
        if rec is None:
            return []
        applied, already = 0, 0
        for inst in model.modules():
            if not isinstance(inst, cls):
                continue
            bound = vars(inst).get("_old_forward", None)
            if bound is None:
                continue
            key = _key(route, inst, "_old_forward")
            mine = self.ledger.get(key)
            if mine is not None and mine.target_ref() is inst and self.ledger.beneath(key, inst, bound) is mine.new:
                already += 1
                continue
            if getattr(bound, "__func__", None) is not rec.old or getattr(bound, "__self__", None) is not inst:
                continue
            new = types.MethodType(rec.new, inst)
            setattr(inst, "_old_forward", new)
            self.ledger.remember(key, Record(route, weakref.ref(inst), "_old_forward", bound, True, new,
                                             f"{module_name}.{route.owner}(hooked instance)._old_forward",
                                             module_name))
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
        rec = self.ledger.get((id(module), name))
        return rec.old if rec is not None else vars(module).get(name, MISSING)

    def _stock_init_value(self, module, route: Route):
        """What the stock ``__init__`` caches for an instance row: the first non-None original global."""
        for name in route.init_from:
            rec = self.ledger.get((id(module), name))
            value = rec.old if rec is not None else getattr(module, name, None)
            if value is not None and value is not MISSING:
                return value
        return None

    def _apply_instances(self, route: Route, module, module_name: str, model, covering: tuple = ()) -> list[ReportRow]:
        """Instance rows; ``covering``: what rows of higher layers put at the same attribute (an instance built
        while they were applied cached one of them: built while patched, as one holding ``route.replacement``)."""
        cls = getattr(module, route.owner, None)
        label = route.target_name(module_name)
        if not isinstance(cls, type):
            return [ReportRow(route.switch, label, "<absent>", "", "not found")]
        counts: dict[tuple, int] = {}
        for inst in model.modules():
            if not isinstance(inst, cls):
                continue
            attrs = vars(inst)
            key = _key(route, inst, route.attr)
            rec = self.ledger.get(key)
            current = attrs.get(route.attr, MISSING)
            if rec is not None and rec.target_ref() is inst and self.ledger.beneath(key, inst, current) is rec.new:
                status, old, new = "already applied", rec.old, rec.new
            elif current is MISSING:
                status, old, new = "not found", MISSING, route.replacement
            else:
                new = route.replacement
                if current is new or any(current is value for value in covering):
                    # built while deltafuse was applied: the stock value is what __init__ would have cached
                    old = self._stock_init_value(module, route)
                    status = "applied (built while patched)"
                else:
                    old = current
                    status = "applied"
                setattr(inst, route.attr, new)
                self.ledger.remember(key, Record(route, weakref.ref(inst), route.attr, old, True, new, label,
                                                 module_name))
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
        key = _key(route, table, ("key", route.attr))
        current = table.get(route.attr, MISSING)
        rec = self.ledger.get(key)
        if rec is not None and rec.target_ref() is table and self.ledger.beneath(key, table, current) is rec.new:
            shared = self.ledger.changed_since(start_order, key)
            return ReportRow(route.switch, label, describe(rec.old), describe(rec.new),
                             "applied (shared)" if shared else "already applied")
        if current is not MISSING and not route.wrap and current is route.replacement:
            return ReportRow(route.switch, label, describe(current), describe(current), "in place")
        new = route.replacement(current) if route.wrap else route.replacement
        table[route.attr] = new
        self.ledger.remember(key, Record(route, _strong(table), route.attr, current, current is not MISSING, new,
                                         label, module_name))
        return ReportRow(route.switch, label, describe(current), describe(new), "applied")

    # --- revert ---------------------------------------------------------------------------------------
    def mark(self) -> int:
        """A position in the history of changes; ``revert(since=mark)`` undoes only what came after it."""
        return self.ledger.mark()

    def revert(self, since: int = 0) -> list[ReportRow]:
        return self.ledger.restore(since)


def _strong(obj):
    return lambda: obj


def _key(route: Route, target, attr) -> tuple:
    """The ledger key of ``route``'s change of ``attr`` on ``target``: a row of a layer above 0 has its own."""
    return (id(target), attr) if not route.layer else (id(target), attr, route.layer)


def _covering(fmap: FamilyMap, route: Route) -> tuple:
    """What the instance rows of ``fmap`` in layers above ``route``'s put at the attribute ``route`` sets."""
    return tuple(r.replacement for r in fmap.routes if r.kind == "instance" and r.layer > route.layer
                 and (r.owner, r.attr) == (route.owner, route.attr))


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
