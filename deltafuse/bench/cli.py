"""Arguments of `deltafuse bench e2e|ops` and its entry point (`run(args) -> exit code`).

Only the chosen benchmark's arguments are built, and neither needs torch nor transformers to check its command
line: ``bench e2e``'s are the training flags, ``bench ops``'s (``ops_args``) name the ops it can time as data;
``deltafuse.bench.ops`` (torch, the backend registry) is imported only to run the benchmark.
"""

from __future__ import annotations

import argparse
import sys

from deltafuse.exits import INTERRUPTED, TERMINATED, exit_codes

BAD_INPUT = (2, "the benchmark cannot run as asked: one line on stderr naming the argument, file, directory or "
                "DELTAFUSE_* variable, its value and what is allowed, before anything runs")
E2E_EPILOG = exit_codes(
    (0, "both runs (and every --peers run, ran or not) are done: e2e.md, e2e.json and e2e.png are in "
        "--output-dir"),
    (1, "the OFF or the ON run failed or recorded fewer steps than asked (the line says which, its output is "
        "above), or the benchmark itself failed (its traceback is shown)"),
    BAD_INPUT,
    (INTERRUPTED[0], "interrupted (Ctrl-C): one line, no traceback; a previous benchmark in --output-dir is put "
                     "back"),
    TERMINATED,
)
OPS_EPILOG = exit_codes(
    (0, "the table was printed (an implementation that cannot run a case is a row with the reason)"),
    (1, "the benchmark itself failed (its traceback is shown)"),
    BAD_INPUT, INTERRUPTED, TERMINATED,
)
EPILOG = exit_codes(
    (0, "the benchmark finished"),
    (1, "a run or the benchmark failed"),
    BAD_INPUT, INTERRUPTED, TERMINATED,
) + "\n`deltafuse bench e2e --help` and `deltafuse bench ops --help` say more."


def _e2e_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.bench import e2e

    e2e.add_arguments(parser)
    parser.epilog = E2E_EPILOG
    parser.set_defaults(bench_func=e2e.run_e2e)


def _run_ops(args) -> list[dict]:
    from deltafuse.bench import ops

    return ops.run_ops(args)


def _ops_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.bench import ops_args

    ops_args.add_arguments(parser)
    parser.epilog = OPS_EPILOG
    parser.set_defaults(bench_func=_run_ops)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Benchmarks: the ON/OFF training experiment (e2e) and per-op timings (ops)."
    parser.epilog = EPILOG
    sub = parser.add_subparsers(dest="bench_command", metavar="{e2e,ops}")
    sub.required = True
    for name, help_text, build in (
            ("e2e", "the same training stock (OFF) then deltafuse (ON): table, JSON and PNG", _e2e_arguments),
            ("ops", "per-op forward and forward+backward time and memory, per implementation", _ops_arguments)):
        p = sub.add_parser(name, help=help_text)
        if hasattr(p, "lazy"):  # deltafuse's own parser: built when the command line chooses it
            p.lazy(build)
        else:
            build(p)


def run(args) -> int:
    """Run the chosen benchmark; bad input prints one line naming the argument and returns 2."""
    from deltafuse.bench.e2e_runs import BenchRunError
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
    """`python -m deltafuse.bench ARGS`: the same as `deltafuse bench ARGS`."""
    from deltafuse.cli import command_main

    return command_main("bench", argv)
