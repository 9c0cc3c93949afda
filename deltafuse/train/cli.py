"""Arguments of `deltafuse train` and its entry point (`run(args) -> exit code`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys

from deltafuse.argtypes import int_at_least as _int_at_least
from deltafuse.train.ahead import workers_arg as _ahead_workers
from deltafuse.argtypes import checked_float, positive_float
from deltafuse.exits import INTERRUPTED, TERMINATED, exit_codes
from deltafuse.train.errors import TrainInputError

EPILOG = exit_codes(
    (0, "the run finished: the adapter or model, metrics.jsonl and summary.json are in --output-dir"),
    (1, "training failed (its traceback is shown)"),
    (2, "training cannot run as asked: one line on stderr naming the argument, file, row, directory or "
        "DELTAFUSE_* variable, its value and what is allowed"),
    (INTERRUPTED[0], "interrupted (Ctrl-C): one line, no traceback; once the run has started it says what "
                     "--output-dir holds (checkpoints kept, or a previous run put back)"),
    TERMINATED,
)


def _fraction(text: str) -> float:
    return checked_float(text, lambda v: 0 <= v < 1, "0 <= p < 1")


def _minutes(text: str) -> float:
    return checked_float(text, lambda v: 0 <= v < math.inf, "a finite number of minutes >= 0 (0: off)")


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no module; allowed: comma-separated module names")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `deltafuse train` flags (also used by `deltafuse bench e2e`, which forwards them)."""
    from deltafuse.model_names import NAMED_MODELS  # the names as plain data: no torch, no transformers

    parser.description = ("LoRA or full fine-tuning of a gated-delta-rule hybrid model on transformers' Trainer, "
                          "with padding-free packing, stock (--no-deltafuse) or patched (--deltafuse).")
    parser.epilog = EPILOG
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", default="tiny", metavar="NAME|DIR",
                   help=f"a named random-init config ({', '.join(NAMED_MODELS)}) or a local Hugging Face model "
                        "directory (config.json, *.safetensors, tokenizer); default: tiny")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom code in a local model directory")
    g.add_argument("--data", default=None, metavar="JSONL",
                   help='JSONL rows {"prompt","completion"} or {"messages":[...]}; default: the embedded '
                        "GSM8K-style generator")
    g.add_argument("--num-examples", metavar="N", type=_int_at_least(1), default=4000,
                   help="rows of the embedded generator when --data is not given (default: 4000)")
    g.add_argument("--eval-data", default=None, metavar="JSONL",
                   help="held-out rows (same format as --data) for evaluation: the eval loss at the end, and "
                        "during training with --eval_strategy steps --eval_steps N")
    g.add_argument("--skip-bad-rows", action="store_true",
                   help="skip malformed JSONL rows (counted at the end) instead of stopping at the first one")
    g.add_argument("--seq-len", metavar="N", type=_int_at_least(2), default=None,
                   help="tokens per packed bin / per example; longer rows are truncated (default: 512 for the "
                        "tiny models, 4096 otherwise)")
    g.add_argument("--packing", dest="packing", action="store_true", default=True,
                   help="padding-free packing with per-sequence boundaries (default)")
    g.add_argument("--no-packing", dest="packing", action="store_false", help="one example per row, right-padded")

    g = parser.add_argument_group("training")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="mode", action="store_const", const="lora", default="lora",
                      help="train LoRA adapters (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="full fine-tuning")
    g.add_argument("--max-steps", metavar="N", type=_int_at_least(1), default=60, help="optimizer steps (default: 60)")
    g.add_argument("--batch-size", metavar="N", type=_int_at_least(1), default=1,
                   help="per-device batch: packed bins, or examples with --no-packing (default: 1)")
    g.add_argument("--lr", type=positive_float, default=None,
                   help="learning rate (default: 5e-3 for the tiny models, else 2e-4 LoRA / 2e-5 full)")
    g.add_argument("--lr-scheduler", default="constant",
                   choices=("constant", "linear", "cosine", "constant_with_warmup"),
                   help="learning-rate schedule (default: constant)")
    g.add_argument("--warmup-steps", metavar="N", type=_int_at_least(0), default=0, help="learning-rate warm-up steps")
    g.add_argument("--max-grad-norm", metavar="X", type=positive_float, default=1.0,
                   help="gradient clipping (default: 1.0)")
    g.add_argument("--seed", metavar="N", type=_int_at_least(0), default=0,
                   help="seed of init, LoRA init and data order")
    g.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights and autocast dtype (default auto: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="replay every decoder layer's forward and backward from CUDA graphs, captured after 2 "
                        "eager steps (CUDA, deltafuse on; not with --gradient-checkpointing, --context-parallel or "
                        "FSDP); a call of another shape runs eagerly")
    g.add_argument("--compile-ahead", metavar="auto|off|N", type=_ahead_workers, default="auto",
                   help="before the first step, compile its Triton kernels in N threads instead of one by one as it "
                        "runs (default auto: one per CPU with deltafuse on a CUDA device in one process, else off)")
    g.add_argument("--context-parallel", metavar="N", type=_int_at_least(1), default=1,
                   help="split every row along the sequence over N processes (launch N, or a multiple of N, with "
                        "torchrun or accelerate: the data-parallel size is processes / N); exact, needs deltafuse "
                        "(default: 1, off)")
    sw = g.add_mutually_exclusive_group()
    sw.add_argument("--deltafuse", dest="deltafuse", action="store_true", default=None,
                    help="patch the model with deltafuse (default: on unless DELTAFUSE_PATCH=0)")
    sw.add_argument("--no-deltafuse", dest="deltafuse", action="store_false", help="stock transformers")

    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora-r", metavar="N", type=_int_at_least(1), default=16, help="rank (default: 16)")
    g.add_argument("--lora-alpha", metavar="N", type=_int_at_least(1), default=32, help="alpha (default: 32)")
    g.add_argument("--lora-dropout", metavar="P", type=_fraction, default=0.0, help="dropout (default: 0)")
    g.add_argument("--lora-targets", type=_names, default=None, metavar="A,B,...",
                   help="module names to adapt (default: q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,"
                        "out_proj, and in_proj_qkvz on Qwen3-Next; those present in the model)")
    g.add_argument("--lora-mlp", action="store_true", help="also adapt gate_proj,up_proj,down_proj")
    g.add_argument("--lora-experts", action="store_true",
                   help="also adapt the MoE expert weights (PEFT target_parameters on experts.gate_up_proj/down_proj)")

    g = parser.add_argument_group("output")
    g.add_argument("--output-dir", metavar="DIR", default="runs/train",
                   help="where checkpoints, the adapter/model and metrics go (default: runs/train)")
    g.add_argument("--overwrite", action="store_true", help="replace a previous run in --output-dir")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the latest checkpoint in --output-dir, or from the given checkpoint dir")
    g.add_argument("--save-every", metavar="N", type=_int_at_least(1), default=None,
                   help="save a resumable checkpoint every N steps (default: at the end, and by --save-minutes)")
    g.add_argument("--save-minutes", metavar="M", type=_minutes, default=30.0,
                   help="also save a resumable checkpoint after a step once M minutes of training have passed since "
                        "the last save, so a killed run loses at most M minutes (default: 30; 0: off). Ctrl-C and "
                        "SIGTERM always save the step they interrupt")
    g.add_argument("--save-total-limit", metavar="N", type=_int_at_least(1), default=2,
                   help="checkpoints kept (default: 2)")
    g.add_argument("--log-every", metavar="N", type=_int_at_least(1), default=10,
                   help="a log line every N steps (default: 10)")
    prog = g.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="show a progress bar (default: when stderr is a terminal)")
    prog.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    from deltafuse.train import hfargs

    hfargs.add_arguments(parser)


class _StdoutHandler(logging.StreamHandler):
    """Plain lines on whatever ``sys.stdout`` is at the time (a test's capture included), flushed."""

    def __init__(self):
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


@contextlib.contextmanager
def _report_on_stdout():
    """The run's report (logger ``deltafuse.train``) as plain stdout lines while the command runs."""
    logger = logging.getLogger("deltafuse.train")
    handler = _StdoutHandler()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _ignore_signals_while_exiting() -> None:
    """The run has stopped and said so: a further Ctrl-C or SIGTERM must not turn the exit into a traceback."""
    import signal

    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to change
        pass


def run(args) -> int:
    """Train; bad input prints one line naming the argument/file and what is allowed, and returns 2.

    Ctrl-C prints one line saying what was kept (see ``stopping.Interrupted``) and returns 130 (143 for SIGTERM).
    """
    from deltafuse.config import SettingsError

    try:
        from deltafuse.train.modelarg import check_model_arg

        check_model_arg(args.model)  # a name is checked before torch and transformers are imported
        from deltafuse.train.trainer import train

        with _report_on_stdout():
            train(args)
        _close_process_group()
    except (TrainInputError, SettingsError) as exc:
        print(f"deltafuse train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        _ignore_signals_while_exiting()
        code = getattr(exc, "exit_code", 130)  # 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM
        what = "terminated" if code == 143 else "interrupted"  # the words of deltafuse.exits' own one line
        print(f"deltafuse train: {what}{'; ' + str(exc) if str(exc) else ''}", file=sys.stderr)
        return code
    return 0


def _close_process_group() -> None:
    """After a finished multi-process run (torchrun, accelerate): wait for every rank, then close the process group
    the Trainer opened. A process that exits with it open can abort while gloo's threads are torn down
    ("terminate called without an active exception", exit status != 0 after a complete run)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """`python -m deltafuse.train ARGS`: the same as `deltafuse train ARGS`."""
    from deltafuse.cli import command_main

    return command_main("train", argv)
