"""JSON object files that training reads (a run's saved settings, an FSDP config)."""

from __future__ import annotations

import json


def read_object(path: str) -> dict:
    """The JSON object in ``path``. Raises OSError when it cannot be read and ValueError (the reason) when it is
    not JSON text or its value is not an object; callers name the file and the argument."""
    with open(path, encoding="utf-8") as fh:
        value = json.load(fh)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
