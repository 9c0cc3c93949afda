"""Argument types shared by deltafuse's commands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse


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


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0; anything else is a one-line error naming the text given."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: a finite number > 0") from None
    if not 0 < value < float("inf"):  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a finite number > 0")
    return value
