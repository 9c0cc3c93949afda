"""The error type of bad user input to `deltafuse train` / `deltafuse bench`: printed as one line, no traceback; and
the rule of which training set-ups CUDA graphs of the layers refuse (shared by train, bench and the Trainer
callback; no torch import, so the command lines are checked before torch loads)."""


class TrainInputError(ValueError):
    """An argument, file, row or directory that training cannot use; the message names it and what is allowed."""


def cuda_graphs_refusal(*, checkpointing: str | None = None, fsdp: str | None = None,
                        context_parallel: int = 1) -> str | None:
    """Why CUDA graphs of the decoder layers cannot go with this set-up, as one clause (what, and what is allowed),
    or None. ``checkpointing`` / ``fsdp``: how the caller's user spelled that setting when it is on (e.g.
    ``"--gradient-checkpointing"``), else None."""
    if checkpointing:
        return (f"{checkpointing} recomputes forwards during the backward, out of the order the graphs share memory "
                "in; allowed: one of the two")
    if context_parallel > 1:
        return f"--context-parallel {context_parallel}; allowed: 1 (the relay between ranks runs in the step)"
    if fsdp:
        return f"{fsdp}: FSDP gathers each layer's weights in hooks a replay would skip; allowed: no FSDP"
    return None
