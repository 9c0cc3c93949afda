"""Arguments of `deltafuse bench e2e|ops` and its entry point (`run(args) -> exit code`)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.bench import e2e, ops

    parser.description = "Benchmarks: the ON/OFF training experiment (e2e) and per-op timings (ops)."
    sub = parser.add_subparsers(dest="bench_command", metavar="{e2e,ops}")
    sub.required = True
    p = sub.add_parser("e2e", help="the same training stock (OFF) then deltafuse (ON): table, JSON and PNG")
    e2e.add_arguments(p)
    p.set_defaults(bench_func=e2e.run_e2e)
    p = sub.add_parser("ops", help="per-op forward and forward+backward time and memory, per implementation")
    ops.add_arguments(p)
    p.set_defaults(bench_func=ops.run_ops)


def run(args) -> int:
    """Run the chosen benchmark; bad input prints one line naming the argument and returns 2."""
    from deltafuse.bench.e2e import BenchRunError
    from deltafuse.config import SettingsError
    from deltafuse.train.errors import TrainInputError

    try:
        args.bench_func(args)
    except (TrainInputError, SettingsError) as exc:
        print(f"deltafuse bench {args.bench_command}: error: {exc}", file=sys.stderr)
        return 2
    except BenchRunError as exc:
        print(f"deltafuse bench {args.bench_command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltafuse.bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))
