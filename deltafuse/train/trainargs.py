"""deltafuse's ``TrainingArguments`` for a `deltafuse train` run: its own flags, then the transformers fields given
on the command line (``hfargs``), checked before anything heavy is built; FSDP's configuration and where it can run.
"""

from __future__ import annotations

import os
import sys

import torch

from deltafuse.train import hfargs, jsonfile, setup
from deltafuse.train.errors import TrainInputError


def show_progress(args) -> bool:
    """--progress / --no-progress, or by default whether stderr is a terminal."""
    return sys.stderr.isatty() if args.progress is None else bool(args.progress)


def default_lr(model: str, full: bool) -> float:
    if setup.is_named(model) and model.startswith("tiny"):
        return 5e-3  # random-init CPU models: a visible loss drop in a few dozen steps
    return 2e-5 if full else 2e-4


def decoder_layer_classes(model) -> list[str]:
    """The class names of the model's ``_no_split_modules`` that it really contains (a text-only Qwen3.5 model
    names its vision block too, which accelerate's FSDP wrapping refuses to look for in vain)."""
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in wanted})


def _fsdp_config(overrides: dict, args, layers: list[str] | None) -> dict | None:
    """The fsdp_config for the Trainer: the user's (a JSON file, as transformers reads it) or deltafuse's
    default, with the decoder layers to wrap filled in when it names none."""
    given = overrides.get("fsdp_config")
    if given is None:
        # FSDP2 (fully_shard per decoder layer, then the model) on every transformers version (5.2-5.19 default
        # to FSDP1); --gradient-checkpointing as FSDP's own activation checkpointing of those layers (the
        # Trainer's would all-gather each layer's parameters again in backward)
        cfg = {"version": 2, "activation_checkpointing": bool(args.gradient_checkpointing)}
    else:
        if args.gradient_checkpointing:
            raise TrainInputError("--gradient-checkpointing with --fsdp_config: set \"activation_checkpointing\": "
                                  "true in the FSDP config instead (FSDP checkpoints the layers it wraps)")
        if layers is None or not isinstance(given, str):
            return None  # transformers reads and checks it
        try:
            cfg = jsonfile.read_object(given)
        except (OSError, ValueError) as exc:
            raise TrainInputError(f"--fsdp_config {given!r}: cannot be read as a JSON object ({exc})") from None
    named = cfg.get("transformer_layer_cls_to_wrap", cfg.get("fsdp_transformer_layer_cls_to_wrap"))
    if layers and not named and cfg.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") == "TRANSFORMER_BASED_WRAP":
        cfg["transformer_layer_cls_to_wrap"] = layers
    return cfg


def training_arguments(args, device: str, dtype: torch.dtype, *, evaluating: bool,
                       fsdp_layers: list[str] | None = None, host_tokens: bool = False):
    """deltafuse's TrainingArguments, then the transformers fields given on the command line (checked here,
    before anything heavy: a bad value or combination is a TrainInputError). ``fsdp_layers``: the decoder layer
    classes FSDP wraps, once the model is built.

    The Trainer logs every step (``StepLogger`` records each) and draws its own progress bars unless
    --no-progress; ``report_to`` and ``log_level`` are transformers' defaults (no integration; its verbosity as
    the process set it), given as --report_to / --log_level like any other field. ``host_tokens``: the batches
    carry their token counts and the Trainer of ``steps.py`` adds them up, so the Trainer's own count (a read
    from the GPU after every micro-batch) is off."""
    from transformers import TrainingArguments

    overrides = hfargs.trainer_overrides(args)
    eval_on = overrides.get("eval_strategy", "no") not in ("no", None) or overrides.get("eval_on_start")
    if eval_on and not evaluating:
        shown = (f"--eval_strategy {overrides['eval_strategy']}" if "eval_strategy" in overrides
                 else "--eval_on_start")
        raise TrainInputError(f"{shown} needs held-out rows: pass --eval-data JSONL")
    fsdp = fsdp_requested(overrides)
    kwargs = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr if args.lr is not None else default_lr(args.model, args.mode == "full"),
        lr_scheduler_type=args.lr_scheduler, warmup_steps=args.warmup_steps, weight_decay=0.0,
        max_grad_norm=args.max_grad_norm, seed=args.seed, data_seed=args.seed,
        logging_strategy="steps", logging_steps=1, save_strategy="steps",
        save_steps=args.save_every or args.max_steps, save_total_limit=args.save_total_limit,
        disable_tqdm=not show_progress(args), dataloader_num_workers=0,
        remove_unused_columns=False, include_num_input_tokens_seen="no" if host_tokens else "non_padding", prediction_loss_only=True,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu=not device.startswith("cuda"),
        **_checkpointing_args(TrainingArguments, args.gradient_checkpointing and not fsdp),
    )
    kwargs.update(overrides)
    if fsdp:
        cfg = _fsdp_config(overrides, args, fsdp_layers)
        if cfg is not None:
            kwargs["fsdp_config"] = cfg
    try:
        return TrainingArguments(**kwargs)
    except (ValueError, TypeError, ImportError) as exc:
        given = " ".join(" ".join(v) for v in hfargs.given(args))
        raise TrainInputError(f"transformers refuses these training arguments ({given or 'defaults'}): "
                              f"{' '.join(str(exc).split())}") from None


def fsdp_requested(overrides: dict) -> bool:
    """--fsdp given with a value that turns FSDP on (transformers' options such as ``full_shard``)."""
    value = overrides.get("fsdp")
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    return bool(value) and str(value).strip().lower() not in ("", "false", "no", "0", "off")


def check_fsdp(args, device: str) -> None:
    """FSDP runs where accelerate runs it: several processes on accelerators. Elsewhere the Trainer would train
    without sharding (DDP on CPU, one plain process on one GPU) under a flag that says FSDP: refused."""
    overrides = hfargs.trainer_overrides(args)
    if not fsdp_requested(overrides):
        return
    shown = f"--fsdp {overrides['fsdp']}"
    if not device.startswith("cuda"):
        raise TrainInputError(f"{shown}: FSDP needs GPUs (accelerate shards on accelerators only; on {device} "
                              "this launch would train unsharded with DDP); leave --fsdp out on CPU")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise TrainInputError(f"{shown}: FSDP shards across several processes, this is one (WORLD_SIZE={world}); "
                              "launch with torchrun --nproc_per_node N -m deltafuse.train ... or accelerate launch")


def _checkpointing_args(targs_cls, enabled: bool) -> dict:
    """Activation checkpointing arguments under the name this transformers version uses."""
    import dataclasses

    kwargs = {"use_reentrant": False} if enabled else None
    names = {f.name for f in dataclasses.fields(targs_cls)}
    if "activation_checkpointing" in names:  # transformers >= 5.2x; gradient_checkpointing is a deprecated alias
        return {"activation_checkpointing": enabled, "activation_checkpointing_kwargs": kwargs}
    return {"gradient_checkpointing": enabled, "gradient_checkpointing_kwargs": kwargs}

