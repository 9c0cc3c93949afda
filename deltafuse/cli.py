"""The `deltafuse` command: info, verify, train, bench.

Every argument is checked before anything heavy is imported: an unknown subcommand or option or a bad argument
value prints one line on stderr and exits with status 2 without importing torch or transformers (the parser of
a command is built only when that command is chosen, from modules that import neither). A bad ``DELTAFUSE_*``
variable is the same one line and status 2, before a command builds anything.

Ctrl-C anywhere (while importing, building a model, training, benchmarking) prints one line, ``deltafuse
COMMAND: interrupted``, and exits with status 130; SIGTERM prints ``deltafuse COMMAND: terminated`` and exits
with 143. Neither shows a traceback. ``python -m deltafuse.train``, ``python -m deltafuse.bench`` and
``python -m deltafuse.verify`` are these same commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap

from deltafuse.exits import INTERRUPTED, TERMINATED, exit_codes, guarded

COMMANDS = ("info", "verify", "train", "bench")
SUBCOMMANDS = {"bench": ("e2e", "ops")}

DESCRIPTION = ("Fast, correct gated-delta-rule hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in transformers: "
               "which implementation serves each op (info), stock vs deltafuse on one model (verify), fine-tuning "
               "(train) and the ON/OFF and per-op benchmarks (bench).")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a text of several lines (an epilog listing exit codes) keeps its lines:
    each is wrapped on its own, an item's continuation lines under its text (``  130  interrupted``)."""

    def _fill_text(self, text, width, indent):
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        out = []
        for line in text.splitlines():
            item = re.match(r"( *\S+ +)(.*)$", line) if line.startswith(" ") else None
            lead = indent + (item.group(1) if item else "")
            body = item.group(2) if item else line
            out.append(textwrap.fill(body, width, initial_indent=lead, subsequent_indent=" " * len(lead))
                       if body else "")
        return "\n".join(out)


EPILOG = exit_codes(
    (0, "success"),
    (1, "a failure: verify found a tensor out of tolerance, or a training or benchmark run failed (its output "
        "or traceback says why)"),
    (2, "deltafuse cannot run as asked: one line on stderr naming the argument or DELTAFUSE_* variable, its "
        "value and what is allowed"),
    (3, "verify itself failed (its traceback is shown; not a verdict)"),
    INTERRUPTED, TERMINATED,
) + "\n`deltafuse COMMAND --help` describes each command and its exit codes."

INFO_DESCRIPTION = ("Which implementation serves each op deltafuse routes, on each visible device, for training "
                    "and for inference, and why every other candidate was rejected; with the versions of torch, "
                    "Triton, transformers and FLA and the DELTAFUSE_* settings in effect. Builds no model.")
INFO_EPILOG = exit_codes(
    (0, "the report was printed"),
    (1, "info itself failed (its traceback is shown)"),
    (2, "a bad argument or DELTAFUSE_* variable: one line naming it, its value and what is allowed"),
    INTERRUPTED, TERMINATED,
)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line: ``prog: error: message (see prog --help)``, exit 2.

    A subcommand's own mistakes are its own: ``deltafuse train --bogus`` says ``deltafuse train: error: ...
    (see deltafuse train --help)``. A subcommand's arguments can be added only once it is chosen (``lazy``), and
    options that need an expensive import to be known (transformers' TrainingArguments fields) only when the
    command line has an option that may be one of them (``add_late_arguments``).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsersAction)
        self._build = None
        self._late: list = []

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def lazy(self, build) -> None:
        """Call ``build(self)`` to add this (sub)parser's arguments when the command line chooses it."""
        self._build = build

    def built(self) -> OneLineParser:
        build, self._build = self._build, None
        if build is not None:
            build(self)
        return self

    def add_late_arguments(self, add, claims) -> None:
        """Call ``add(self)`` before parsing when a command-line option that this parser does not have satisfies
        ``claims(option)`` (without it, such options are unrecognized; the options ``add`` adds are parsed as if
        they had been there from the start)."""
        self._late.append((add, claims))

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if self._late:
            # the options not spelled exactly as one of this parser's (abbreviations too: ``claims`` decides)
            unknown = [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2
                       and a.split("=", 1)[0] not in self._option_string_actions]
            for add, claims in list(self._late):
                if any(claims(opt) for opt in unknown):
                    self._late.remove((add, claims))
                    add(self)
        return super().parse_known_args(args, namespace)


class _SubParsersAction(argparse._SubParsersAction):
    """The chosen subcommand's parser gets its arguments now (``OneLineParser.lazy``) and reports what it does
    not recognize itself (argparse leaves that to the top-level parser, whose ``--help`` does not describe it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, arg_strings = values[0], values[1:]
        chosen = self._name_parser_map[name]  # argparse has checked the name against the choices
        if isinstance(chosen, OneLineParser):
            chosen.built()
        if self.dest is not argparse.SUPPRESS:
            setattr(namespace, self.dest, name)
        sub, extras = chosen.parse_known_args(arg_strings, None)
        if extras:
            chosen.error(f"unrecognized arguments: {' '.join(extras)}")
        for key, value in vars(sub).items():
            setattr(namespace, key, value)


def check_environment(prog: str = "deltafuse") -> int:
    """Parse every ``DELTAFUSE_*`` variable now (``deltafuse.backends.settings.load_settings``); 0 when they are
    all valid, else 2 after one line on stderr naming the variable, the value and what is allowed. A ``DELTAFUSE_*`` name
    deltafuse does not know is warned about (one line): it has no effect."""
    from deltafuse.backends.settings import load_settings
    from deltafuse.config import SWITCHES, SettingsError

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


# command -> (module with add_arguments(parser) and run(args), light to import; the one-line help)
LAZY = {
    "verify": ("deltafuse.verify.args", "stock vs deltafuse: loss, logits and every gradient"),
    "train": ("deltafuse.train.cli", "LoRA or full fine-tuning with padding-free packing"),
    "bench": ("deltafuse.bench.cli", "the ON/OFF experiment (e2e) and per-op timings (ops)"),
}


def _module_arguments(module_name: str):
    def build(parser: argparse.ArgumentParser) -> None:
        import importlib

        module = importlib.import_module(module_name)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)

    return build


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser. A command's arguments are added when the command line chooses it (or now, for ``command``),
    from a module that imports neither torch nor transformers."""
    from deltafuse import __version__

    parser = OneLineParser(prog="deltafuse", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"deltafuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,verify,train,bench}", parser_class=OneLineParser)
    sub.required = True

    p = sub.add_parser("info", help="which implementation serves each op on each device, and why",
                       description=INFO_DESCRIPTION, epilog=INFO_EPILOG)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_info)

    for name, (module, help_text) in LAZY.items():
        p = sub.add_parser(name, help=help_text)
        p.lazy(_module_arguments(module))
        if name == command:
            p.built()
    return parser


def _command_of(argv: list[str]) -> str:
    """``deltafuse``, ``deltafuse train``, ``deltafuse bench e2e``: the command the line names, for the one line
    of an interruption (which can come before the arguments are parsed)."""
    words = ["deltafuse"]
    if argv and argv[0] in COMMANDS:
        words.append(argv[0])
        rest = [a for a in argv[1:] if not a.startswith("-")]
        if rest and rest[0] in SUBCOMMANDS.get(argv[0], ()):
            words.append(rest[0])
    return " ".join(words)


def _main(argv: list[str]) -> int:
    from deltafuse.config import SettingsError

    parser = build_parser()
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


def main(argv: list[str] | None = None) -> int:
    """`deltafuse ARGS`; returns the exit status (argparse's refusals exit with 2 through SystemExit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return guarded(_command_of(argv), _main, argv)


def command_main(command: str, argv: list[str] | None = None) -> int:
    """`python -m deltafuse.COMMAND ARGS`: the same as `deltafuse COMMAND ARGS`."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
