"""Argument types shared by deltafuse's commands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``; anything else is a one-line error saying what is allowed."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: an integer >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small; allowed: an integer >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def checked_float(text: str, ok: Callable[[float], bool], allowed: str) -> float:
    """``text`` as a float for which ``ok`` holds; else a one-line argparse error naming the text given and
    ``allowed`` (what is allowed, in words)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: {allowed}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0; anything else is a one-line error naming the text given."""
    return checked_float(text, lambda v: 0 < v < math.inf, "a finite number > 0")  # NaN fails both comparisons
