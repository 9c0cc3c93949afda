"""An embedded, deterministic generator of GSM8K-style arithmetic word problems with worked answers.

Every answer shows its steps with the ``<<expression=result>>`` annotations of GSM8K and ends with
``#### <result>``. The same ``(n, seed)`` always gives the same rows, on every machine: nothing is downloaded.
"""

from __future__ import annotations

import random

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Ema", "Finn", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Yuki", "Zoe")
ITEMS = ("pencils", "stickers", "marbles", "apples", "cards", "books", "shells", "stamps", "beads", "cookies")
THINGS = ("lamp", "chair", "kite", "backpack", "clock", "helmet", "jacket", "puzzle", "scarf", "teapot")


def _people(rng: random.Random, k: int = 1):
    return rng.sample(NAMES, k)


def _packs(rng):
    name, item = _people(rng)[0], rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(3, 15)
    total = a * b
    c = rng.randint(1, total - 1)
    left = total - c
    q = (f"{name} buys {a} packs of {item}. Each pack has {b} {item}. {name} gives away {c} {item}. "
         f"How many {item} does {name} have left?")
    s = (f"{name} buys {a} * {b} = <<{a}*{b}={total}>>{total} {item}.\n"
         f"After giving away {c}, {name} has {total} - {c} = <<{total}-{c}={left}>>{left} {item} left.\n"
         f"#### {left}")
    return q, s


def _wages(rng):
    name = _people(rng)[0]
    a, b, c = rng.randint(8, 30), rng.randint(2, 9), rng.randint(2, 7)
    day = a * b
    total = day * c
    q = f"{name} earns ${a} an hour and works {b} hours a day for {c} days. How much does {name} earn in total?"
    s = (f"In one day {name} earns {a} * {b} = <<{a}*{b}={day}>>{day} dollars.\n"
         f"In {c} days {name} earns {day} * {c} = <<{day}*{c}={total}>>{total} dollars.\n"
         f"#### {total}")
    return q, s


def _travel(rng):
    a, b, c, d = rng.randint(20, 90), rng.randint(1, 6), rng.randint(20, 90), rng.randint(1, 6)
    x, y = a * b, c * d
    total = x + y
    q = (f"A train travels at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. "
         f"How many kilometers does it travel in total?")
    s = (f"First it travels {a} * {b} = <<{a}*{b}={x}>>{x} km.\n"
         f"Then it travels {c} * {d} = <<{c}*{d}={y}>>{y} km.\n"
         f"In total it travels {x} + {y} = <<{x}+{y}={total}>>{total} km.\n"
         f"#### {total}")
    return q, s


def _sharing(rng):
    name, item = _people(rng)[0], rng.choice(ITEMS)
    each, friends = rng.randint(3, 12), rng.randint(2, 8)
    total = each * friends
    c = rng.randint(1, each - 1)
    left = each - c
    q = (f"{name} has {total} {item} and shares them equally among {friends} friends. "
         f"Each friend then loses {c} of them. How many {item} does each friend have now?")
    s = (f"Each friend gets {total} / {friends} = <<{total}/{friends}={each}>>{each} {item}.\n"
         f"After losing {c}, each friend has {each} - {c} = <<{each}-{c}={left}>>{left} {item}.\n"
         f"#### {left}")
    return q, s


def _savings(rng):
    name, thing = _people(rng)[0], rng.choice(THINGS)
    a, b = rng.randint(5, 40), rng.randint(3, 12)
    saved = a * b
    c = rng.randint(1, saved - 1)
    left = saved - c
    q = (f"{name} saves ${a} every week for {b} weeks, then spends ${c} on a {thing}. "
         f"How much money does {name} have left?")
    s = (f"{name} saves {a} * {b} = <<{a}*{b}={saved}>>{saved} dollars.\n"
         f"After buying the {thing}, {name} has {saved} - {c} = <<{saved}-{c}={left}>>{left} dollars.\n"
         f"#### {left}")
    return q, s


def _ages(rng):
    p1, p2 = _people(rng, 2)
    a, b, c = rng.randint(4, 40), rng.randint(1, 30), rng.randint(1, 20)
    now = a + b
    later = now + c
    q = f"{p1} is {a} years old. {p2} is {b} years older than {p1}. How old will {p2} be in {c} years?"
    s = (f"{p2} is {a} + {b} = <<{a}+{b}={now}>>{now} years old now.\n"
         f"In {c} years {p2} will be {now} + {c} = <<{now}+{c}={later}>>{later} years old.\n"
         f"#### {later}")
    return q, s


def _change(rng):
    name, thing = _people(rng)[0], rng.choice(THINGS)
    a, b = rng.randint(2, 25), rng.randint(2, 6)
    cost = a * b
    bill = next(v for v in (20, 50, 100, 200) if v > cost)
    change = bill - cost
    q = (f"A {thing} costs ${a}. {name} buys {b} of them and pays with a ${bill} bill. "
         f"How much change does {name} get?")
    s = (f"The {thing}s cost {a} * {b} = <<{a}*{b}={cost}>>{cost} dollars.\n"
         f"The change is {bill} - {cost} = <<{bill}-{cost}={change}>>{change} dollars.\n"
         f"#### {change}")
    return q, s


def _garden(rng):
    name = _people(rng)[0]
    rows, per, extra = rng.randint(2, 12), rng.randint(3, 12), rng.randint(1, 20)
    planted = rows * per
    total = planted + extra
    q = (f"{name} plants {rows} rows of {per} tulips and later adds {extra} more tulips. "
         f"How many tulips are in the garden?")
    s = (f"The rows hold {rows} * {per} = <<{rows}*{per}={planted}>>{planted} tulips.\n"
         f"With the extra ones there are {planted} + {extra} = <<{planted}+{extra}={total}>>{total} tulips.\n"
         f"#### {total}")
    return q, s


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
