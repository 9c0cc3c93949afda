"""The names ``--model`` accepts besides a local directory, as plain data.

The commands' argument checks and help texts use these, so that checking a command line imports neither torch
nor transformers; ``deltafuse.models`` holds what they are (its ``NAMED_MODELS`` and ``TINY_NAMES``, which a test
keeps equal to these).
"""

from __future__ import annotations

# the CPU-sized test model of every family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), in the order of the family maps
TINY_NAMES: tuple[str, ...] = ("tiny", "tiny-moe", "tiny-next")
# every named random-init configuration, in the order of deltafuse.models.NAMED_MODELS
NAMED_MODELS: tuple[str, ...] = TINY_NAMES + ("dense8", "moe8", "dense", "moe")
