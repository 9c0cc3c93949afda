"""An embedded, deterministic generator of GSM8K-style arithmetic word problems with worked answers.

Every answer shows its steps with the ``<<expression=result>>`` annotations of GSM8K and ends with
``#### <result>``. The same ``(n, seed)`` always gives the same rows, on every machine: nothing is downloaded.
"""

from __future__ import annotations

import operator
import random

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Ema", "Finn", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Yuki", "Zoe")
ITEMS = ("pencils", "stickers", "marbles", "apples", "cards", "books", "shells", "stamps", "beads", "cookies")
THINGS = ("lamp", "chair", "kite", "backpack", "clock", "helmet", "jacket", "puzzle", "scarf", "teapot")
# the templates divide only where the division is exact
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def _people(rng: random.Random, k: int = 1):
    return rng.sample(NAMES, k)


def _step(x: int, op: str, y: int) -> tuple[int, str]:
    """``x op y`` and its worked form in GSM8K's notation: ``x op y = <<x op y=result>>result``."""
    result = _OPS[op](x, y)
    return result, f"{x} {op} {y} = <<{x}{op}{y}={result}>>{result}"


def _answer(result: int, *lines: str) -> str:
    """A worked answer: one line per step, then ``#### result``."""
    return "\n".join((*lines, f"#### {result}"))


def _packs(rng):
    name, item = _people(rng)[0], rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(3, 15)
    total, bought = _step(a, "*", b)
    c = rng.randint(1, total - 1)
    left, kept = _step(total, "-", c)
    q = (f"{name} buys {a} packs of {item}. Each pack has {b} {item}. {name} gives away {c} {item}. "
         f"How many {item} does {name} have left?")
    return q, _answer(left, f"{name} buys {bought} {item}.", f"After giving away {c}, {name} has {kept} {item} left.")


def _wages(rng):
    name = _people(rng)[0]
    a, b, c = rng.randint(8, 30), rng.randint(2, 9), rng.randint(2, 7)
    day, daily = _step(a, "*", b)
    total, overall = _step(day, "*", c)
    q = f"{name} earns ${a} an hour and works {b} hours a day for {c} days. How much does {name} earn in total?"
    return q, _answer(total, f"In one day {name} earns {daily} dollars.",
                      f"In {c} days {name} earns {overall} dollars.")


def _travel(rng):
    a, b, c, d = rng.randint(20, 90), rng.randint(1, 6), rng.randint(20, 90), rng.randint(1, 6)
    x, first = _step(a, "*", b)
    y, then = _step(c, "*", d)
    total, overall = _step(x, "+", y)
    q = (f"A train travels at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. "
         f"How many kilometers does it travel in total?")
    return q, _answer(total, f"First it travels {first} km.", f"Then it travels {then} km.",
                      f"In total it travels {overall} km.")


def _sharing(rng):
    name, item = _people(rng)[0], rng.choice(ITEMS)
    each, friends = rng.randint(3, 12), rng.randint(2, 8)
    total = each * friends
    c = rng.randint(1, each - 1)
    _, shared = _step(total, "/", friends)
    left, kept = _step(each, "-", c)
    q = (f"{name} has {total} {item} and shares them equally among {friends} friends. "
         f"Each friend then loses {c} of them. How many {item} does each friend have now?")
    return q, _answer(left, f"Each friend gets {shared} {item}.", f"After losing {c}, each friend has {kept} {item}.")


def _savings(rng):
    name, thing = _people(rng)[0], rng.choice(THINGS)
    a, b = rng.randint(5, 40), rng.randint(3, 12)
    saved, saving = _step(a, "*", b)
    c = rng.randint(1, saved - 1)
    left, kept = _step(saved, "-", c)
    q = (f"{name} saves ${a} every week for {b} weeks, then spends ${c} on a {thing}. "
         f"How much money does {name} have left?")
    return q, _answer(left, f"{name} saves {saving} dollars.",
                      f"After buying the {thing}, {name} has {kept} dollars.")


def _ages(rng):
    p1, p2 = _people(rng, 2)
    a, b, c = rng.randint(4, 40), rng.randint(1, 30), rng.randint(1, 20)
    now, age_now = _step(a, "+", b)
    later, age_later = _step(now, "+", c)
    q = f"{p1} is {a} years old. {p2} is {b} years older than {p1}. How old will {p2} be in {c} years?"
    return q, _answer(later, f"{p2} is {age_now} years old now.", f"In {c} years {p2} will be {age_later} years old.")


def _change(rng):
    name, thing = _people(rng)[0], rng.choice(THINGS)
    a, b = rng.randint(2, 25), rng.randint(2, 6)
    cost, costing = _step(a, "*", b)
    bill = next(v for v in (20, 50, 100, 200) if v > cost)
    change, giving = _step(bill, "-", cost)
    q = (f"A {thing} costs ${a}. {name} buys {b} of them and pays with a ${bill} bill. "
         f"How much change does {name} get?")
    return q, _answer(change, f"The {thing}s cost {costing} dollars.", f"The change is {giving} dollars.")


def _garden(rng):
    name = _people(rng)[0]
    rows, per, extra = rng.randint(2, 12), rng.randint(3, 12), rng.randint(1, 20)
    planted, planting = _step(rows, "*", per)
    total, adding = _step(planted, "+", extra)
    q = (f"{name} plants {rows} rows of {per} tulips and later adds {extra} more tulips. "
         f"How many tulips are in the garden?")
    return q, _answer(total, f"The rows hold {planting} tulips.", f"With the extra ones there are {adding} tulips.")


TEMPLATES = (_packs, _wages, _travel, _sharing, _savings, _ages, _change, _garden)
DEFAULT_SIZE = 4000


def generate(n: int = DEFAULT_SIZE, seed: int = 0) -> list[dict]:
    """``n`` rows ``{"prompt": question, "completion": worked answer}``, the same for the same (n, seed)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, answer = rng.choice(TEMPLATES)(rng)
        rows.append({"prompt": question, "completion": answer})
    return rows
