"""The arguments of `deltafuse verify` (``add_arguments``) and its entry (``run``), light to import.

Checking a verify command line imports neither torch nor transformers: the names, limits and help texts are
plain data here; ``run`` imports ``deltafuse.verify.core``, which does the work (see its docstring).
"""

from __future__ import annotations

import argparse
import os
import sys

from deltafuse.argtypes import positive_float
from deltafuse.exits import INTERRUPTED, TERMINATED, exit_codes
from deltafuse.model_names import NAMED_MODELS, TINY_NAMES

# --dtype spellings (deltafuse.verify.core.DTYPES maps each to its torch dtype)
DTYPE_NAMES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")
SEED_LIMIT = 2**63 - 1  # the batch generator is seeded with seed + 1

DESCRIPTION = ("Stock transformers vs deltafuse on one model and one random batch: forward and backward once "
               "stock, once with deltafuse applied, then the loss, the logits and the gradient of every trainable "
               "parameter compared (relative error against a tolerance). --packed gives deltafuse a padding-free "
               "packed batch and compares it with stock runs of each sequence alone.")
EPILOG = exit_codes(
    (0, "every tensor is within tolerance"),
    (1, "at least one tensor is out of tolerance (the report names each one); 1 means nothing else"),
    (2, "verify cannot run as asked (a bad argument or DELTAFUSE_* variable, a forced backend that cannot serve "
        "the device, a --model that is no supported model): one line on stderr naming it, its value and what is "
        "allowed, before a model is built"),
    (3, "verify itself failed (its traceback is shown; not a verdict)"),
    INTERRUPTED, TERMINATED,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.add_argument("--model", default="tiny", metavar="NAME|PATH",
                        help=f"{', '.join(TINY_NAMES)} (CPU sizes), "
                             f"{', '.join(n for n in NAMED_MODELS if n not in TINY_NAMES)}, or a local HF model "
                             "directory (default: tiny)")
    parser.add_argument("--packed", action="store_true",
                        help="a packed batch (position_ids restarting) vs stock runs of each sequence alone")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default: cpu")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="default: float32")
    parser.add_argument("--seed", type=_seed, default=0, help="weights and batch seed (default: 0)")
    parser.add_argument("--rtol", type=positive_float, default=None,
                        help="relative tolerance, a finite number > 0 (default: 1e-4 fp32 CPU, 2e-3 fp32 CUDA, "
                             "5e-2 bf16, 1e-2 fp16)")


def run(args) -> int:
    """`deltafuse verify`: a --model that is neither a name nor a directory is refused here, before torch is
    imported; then ``deltafuse.verify.core.run`` (exit codes: see EPILOG)."""
    problem = model_problem(args.model)
    if problem:
        print(f"deltafuse verify: error: {problem}", file=sys.stderr)
        return 2
    from deltafuse.verify.core import run as verify_run

    return verify_run(args)


def model_problem(name_or_path: str) -> str | None:
    """Why ``--model name_or_path`` cannot be verified when it is neither a named model nor a directory (one
    line), else None (a directory's config is checked by ``deltafuse.verify.core.check_model_arg``)."""
    if name_or_path in NAMED_MODELS or os.path.isdir(name_or_path):
        return None
    return f"--model {name_or_path!r} is neither a known name ({', '.join(NAMED_MODELS)}) nor a local directory"


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: 0 <= seed < 2**63 - 1") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: 0 <= seed < 2**63 - 1")
    return value
