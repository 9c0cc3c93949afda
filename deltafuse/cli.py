"""The `deltafuse` command: info, verify, train, bench.

User errors (an unknown subcommand or option, a bad argument value, a bad ``DELTAFUSE_*`` variable) print one
line on stderr and exit with status 2, before anything heavy runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line: ``prog: error: message (see prog --help)``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_environment(prog: str = "deltafuse") -> int:
    """Parse every ``DELTAFUSE_*`` variable now (``deltafuse.config.load_settings``); 0 when they are all valid,
    else 2 after one line on stderr naming the variable, the value and what is allowed. A ``DELTAFUSE_*`` name
    deltafuse does not know is warned about (one line): it has no effect."""
    from deltafuse.config import SWITCHES, SettingsError, load_settings

    try:
        load_settings()
    except SettingsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    known = [sw.name for sw in SWITCHES] + ["DELTAFUSE_BACKEND"]
    for name in sorted(os.environ):
        if name.startswith("DELTAFUSE_") and name not in known:
            print(f"{prog}: warning: {name} is not a deltafuse variable and has no effect; known: "
                  f"{', '.join(known)}", file=sys.stderr)
    return 0


def _info(args) -> int:
    from deltafuse.info import format_info, info

    report = info()
    print(json.dumps(report, indent=2) if args.json else format_info(report))
    return 0


LAZY = {
    "verify": ("deltafuse.verify", "stock vs deltafuse: loss, logits and every gradient"),
    "train": ("deltafuse.train.cli", "LoRA or full fine-tuning with padding-free packing"),
    "bench": ("deltafuse.bench.cli", "the ON/OFF experiment (e2e) and per-op timings (ops)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the module of ``command`` is imported (so `deltafuse info` stays light)."""
    from deltafuse import __version__

    parser = OneLineParser(prog="deltafuse", description=(
        "Fast, correct gated-delta-rule hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in transformers."))
    parser.add_argument("--version", action="version", version=f"deltafuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,verify,train,bench}", parser_class=OneLineParser)
    sub.required = True

    p = sub.add_parser("info", help="which implementation serves each op on each device, and why")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_info)

    for name, (module, help_text) in LAZY.items():
        p = sub.add_parser(name, help=help_text)
        if name == command:
            _lazy_arguments(p, module)
    return parser


def _lazy_arguments(parser: argparse.ArgumentParser, module_name: str) -> None:
    import importlib

    module = importlib.import_module(module_name)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def main(argv: list[str] | None = None) -> int:
    from deltafuse.config import SettingsError

    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in LAZY else None)
    args = parser.parse_args(argv)
    # every DELTAFUSE_* variable is parsed before a subcommand builds anything
    status = check_environment(f"deltafuse {args.command}")
    if status:
        return status
    try:
        return int(args.func(args) or 0)
    except SettingsError as exc:
        print(f"deltafuse {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
