"""transformers' ``TrainingArguments`` on the `deltafuse train` command line, spelled as transformers does.

Every ``TrainingArguments`` field is accepted as ``--field_name VALUE`` (gradient accumulation, weight decay,
evaluation, report_to, fsdp, optimizer, ...), parsed and checked by transformers' own ``HfArgumentParser``.
The fields that `deltafuse train` sets from its own flags, or must fix for its packed batches and per-step
records, are refused in their transformers spelling with a one-line error naming the flag to use, so no
setting can be given twice with two values.
"""

from __future__ import annotations

import argparse
import functools
import os

from deltafuse.train.errors import TrainInputError

PREFIX = "hf:"  # argparse dest prefix of a passed-through option (the value: its raw strings)

# fields set from deltafuse's own flags -> the flag to use
OWNED = {
    "output_dir": "--output-dir", "max_steps": "--max-steps", "num_train_epochs": "--max-steps",
    "per_device_train_batch_size": "--batch-size", "learning_rate": "--lr", "lr_scheduler_type": "--lr-scheduler",
    "warmup_steps": "--warmup-steps", "max_grad_norm": "--max-grad-norm", "seed": "--seed", "data_seed": "--seed",
    "save_steps": "--save-every", "save_strategy": "--save-every", "save_total_limit": "--save-total-limit",
    "gradient_checkpointing": "--gradient-checkpointing", "activation_checkpointing": "--gradient-checkpointing",
    "gradient_checkpointing_kwargs": "--gradient-checkpointing",
    "activation_checkpointing_kwargs": "--gradient-checkpointing",
    "bf16": "--dtype", "fp16": "--dtype", "use_cpu": "--dtype (the device is the one torch sees)",
    "resume_from_checkpoint": "--resume", "disable_tqdm": "--progress / --no-progress",
}
# fields fixed by deltafuse train -> why
FIXED = {
    "logging_steps": "one metrics record per step (--log-every sets the printed lines)",
    "logging_strategy": "one metrics record per step (--log-every sets the printed lines)",
    "remove_unused_columns": "the packed batches carry their own columns",
    "include_num_input_tokens_seen": "the per-step token counts come from the batches with one process, from it with several",
}


class _Parser:
    """``HfArgumentParser(TrainingArguments)`` whose errors raise TrainInputError (one line, no exit)."""

    _instance = None

    @classmethod
    def get(cls):
        if cls._instance is None:
            from transformers import HfArgumentParser, TrainingArguments

            class Quiet(HfArgumentParser):
                def error(self, message):
                    raise TrainInputError(message)

            cls._instance = Quiet(TrainingArguments)
        return cls._instance


def passthrough_options() -> dict[str, str]:
    """transformers' option strings (underscore spelling, ``--no_x`` forms included) -> TrainingArguments field."""
    parser = _Parser.get()
    out = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        for opt in action.option_strings:
            if opt.startswith("--") and "-" not in opt[2:]:
                out[opt] = action.dest
    return out


class _Raw(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [option_string, *values])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The TrainingArguments options, in their own help group (the options themselves are not listed).

    Knowing their names imports transformers: on a parser that can add options late (``deltafuse.cli``'s
    ``OneLineParser.add_late_arguments``) they are added only when the command line has an option the parser
    does not have that may be one (``may_be_passthrough``: the field names read from transformers' source), so
    a command line without one, a mistyped deltafuse flag included, is checked without importing transformers;
    on any other parser they are added now.
    """
    group = parser.add_argument_group(
        "transformers TrainingArguments",
        "any TrainingArguments field as --field_name VALUE (e.g. --gradient_accumulation_steps 4, --weight_decay "
        "0.1, --eval_strategy steps --eval_steps 20 with --eval-data, --report_to tensorboard, --fsdp full_shard, "
        "--optim adamw_torch_fused); the fields deltafuse's own flags set are refused in this spelling")

    def add_options(parser: argparse.ArgumentParser) -> None:
        for opt in passthrough_options():
            if opt in parser._option_string_actions:  # --seed: deltafuse's own flag, the same meaning
                continue
            group.add_argument(opt, dest=PREFIX + opt, nargs="*", action=_Raw, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)

    late = getattr(parser, "add_late_arguments", None)
    if late is None:
        add_options(parser)
    else:
        late(add_options, claims=may_be_passthrough)


def may_be_passthrough(option: str) -> bool:
    """Whether ``option`` (``--name``) may be a TrainingArguments option, answered without importing transformers:
    ``--field`` or ``--no_field`` for a field of its source, or, when the source cannot be read that way, any
    ``--name`` without a hyphen (then transformers' parser decides)."""
    name = option[2:] if option.startswith("--") else None
    if not name or "-" in name:
        return False
    fields = _source_fields()
    if fields is None:
        return True
    return name in fields or (name.startswith("no_") and name[3:] in fields)


@functools.lru_cache(maxsize=1)
def _source_fields() -> frozenset[str] | None:
    """The fields of ``transformers.TrainingArguments`` read from its source file (``ast``; transformers itself
    is not imported), or None when they cannot be read there with certainty (not found, not a plain dataclass
    without base classes)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("transformers")
        if spec is None or not spec.origin:
            return None
        with open(os.path.join(os.path.dirname(spec.origin), "training_args.py"), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError, ImportError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments":
            if node.bases or node.keywords:
                return None
            fields = frozenset(n.target.id for n in node.body
                               if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
            return fields or None
    return None


def given(args) -> list[list[str]]:
    """The passed-through options in ``args``: [option, raw values...] each."""
    return [v for k, v in sorted(vars(args).items()) if k.startswith(PREFIX)]


def trainer_overrides(args) -> dict:
    """The TrainingArguments fields given on the command line, typed and checked by transformers."""
    options = passthrough_options()
    tokens, fields = [], []
    for opt, *values in given(args):
        field = options[opt]
        if field in OWNED:
            raise TrainInputError(f"{opt} is set by `deltafuse train` itself: pass {OWNED[field]} instead")
        if field in FIXED:
            raise TrainInputError(f"{opt} is fixed by `deltafuse train` ({FIXED[field]}); leave it out")
        tokens += [opt, *values]
        fields.append(field)
    if not fields:
        return {}
    namespace, rest = _Parser.get().parse_known_args(tokens + ["--output_dir", "unused"])
    if rest:
        raise TrainInputError(f"unrecognized arguments: {' '.join(rest)}")
    return {f: getattr(namespace, f) for f in fields}
