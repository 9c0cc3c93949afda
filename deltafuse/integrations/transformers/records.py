"""What the patcher replaced, and how to put it back: one ``Record`` per changed attribute or key, in a ``Ledger``.

A record holds (target, attribute, previous value, whether the target owned the attribute), so that restoring
puts back the very objects found; the ledger keeps the records in the order they were made, restores them in
reverse, and can restore only what came after a ``mark()``. A row of layer 0 is keyed (id of the target, attribute
or mapping key); a row of a higher layer over the same target adds its layer to that key, so each layer has its
own record (``beneath`` looks through the layers above one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from deltafuse.integrations.transformers.report import ReportRow, describe
from deltafuse.integrations.transformers.rows import LAYERS, Route


@dataclass
class Record:
    route: Route
    target_ref: Callable[[], Any]  # returns the target or None once an instance is gone
    attr: str
    old: Any
    had_own: bool
    new: Any
    label: str
    module: str


class Ledger:
    """The records of every change not yet restored, keyed by (id of the target, attribute or mapping key).

    ``lock`` (reentrant) is held by whoever changes or restores through this ledger."""

    def __init__(self):
        self._records: dict[tuple, Record] = {}
        self._order: list[tuple] = []
        self.lock = threading.RLock()

    def has_records(self) -> bool:
        return bool(self._records)

    def get(self, key) -> Record | None:
        return self._records.get(key)

    def beneath(self, key: tuple, target, value):
        """``value`` (found at ``target``) with what the rows of the layers above ``key``'s put over it peeled off,
        the highest layer first: what the change recorded under ``key`` left there, if nothing else changed it."""
        base, own = key[:2], (key[2] if len(key) > 2 else 0)
        for layer in range(max(LAYERS), own, -1):
            rec = self._records.get(base + (layer,))
            if rec is not None and rec.new is value and rec.target_ref() is target:
                value = rec.old
        return value

    def remember(self, key, record: Record) -> None:
        if key in self._records:
            # re-applied over a value someone else put there: keep the value deltafuse first found
            first = self._records[key]
            record = Record(record.route, record.target_ref, record.attr, first.old, first.had_own, record.new,
                            record.label, record.module)
        else:
            self._order.append(key)
        self._records[key] = record

    def mark(self) -> int:
        """A position in the history of changes; ``restore(since=mark)`` undoes only what came after it."""
        return len(self._order)

    def changed_since(self, mark: int, key) -> bool:
        """Whether the record of ``key`` was made after ``mark``."""
        return key in self._order[mark:]

    def restore(self, since: int = 0) -> list[ReportRow]:
        """Put back everything recorded after ``since`` (newest first) and forget it; one row per distinct
        change ("reverted", or "gone" for an instance no longer alive), counted."""
        rows = []
        with self.lock:
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
