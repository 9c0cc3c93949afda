"""The Trainer of `deltafuse train`, without its two waits for the GPU in the middle of every step.

transformers' Trainer reads two values back from the GPU after every micro-batch's backward:

* ``logging_nan_inf_filter`` (on by default) tests the step's loss for NaN / inf with a Python ``or`` of two
  device tensors;
* ``include_num_input_tokens_seen`` sums the batch's tokens on the device and reads the sum back.

Each read waits for the whole forward and backward to finish; only then does the host queue the optimizer step and
the step's bookkeeping, while the GPU idles. Once the decoder layers replay from CUDA graphs (``--cuda-graphs``) the
host keeps pace with the GPU, and those waits were what kept the Trainer's step above a plain loop's (BENCHMARKS.md).

Here both are done without a read:

* the NaN / inf filter runs on the device, with the Trainer's semantics: a micro-batch loss that is not finite is
  replaced by what the Trainer would add in its place, ``tr_loss / (1 + global_step - last_logged)``, where
  ``tr_loss`` is the sum of the (kept) losses since the last log, kept here on the device as well (with the
  per-step logging of `deltafuse train` the denominator is 1). ``--logging_nan_inf_filter false`` turns it off, as
  in the Trainer;
* the tokens are the collator's host count (``packing.TOKENS_KEY``, the real tokens of the batch: the Trainer's
  ``non_padding`` count without the filler sequence), for one process; several processes keep the Trainer's own
  count, which gathers the ranks' counts.

The gradients, the optimizer step and the logged values are those of the Trainer's own code.
"""

from __future__ import annotations

import contextlib

import torch

from deltafuse.train.packing import TOKENS_KEY


def trainer_class(base, *, host_tokens: bool):
    """``base`` (a transformers Trainer class) with the NaN / inf filter on the device and, with ``host_tokens``,
    the collator's token counts (its TrainingArguments must then have ``include_num_input_tokens_seen="no"``)."""

    class StepTrainer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the training loop's filter moves here (the Trainer's own test reads the loss back after every
            # micro-batch); the setting itself stays the user's wherever else it is read (evaluation, saved args)
            self._deltafuse_nan_filter = bool(self.args.logging_nan_inf_filter)
            self.args.logging_nan_inf_filter = False
            self._deltafuse_since_log = None  # (last logged step, device sum of the kept losses since then)

        @contextlib.contextmanager
        def _users_nan_filter(self):
            self.args.logging_nan_inf_filter = self._deltafuse_nan_filter
            try:
                yield
            finally:
                self.args.logging_nan_inf_filter = False

        def train(self, *args, **kwargs):
            self._deltafuse_since_log = None  # the Trainer starts its own sum at 0 in every train()
            return super().train(*args, **kwargs)

        def evaluation_loop(self, *args, **kwargs):
            with self._users_nan_filter():
                return super().evaluation_loop(*args, **kwargs)

        def _save(self, *args, **kwargs):
            with self._users_nan_filter():
                return super()._save(*args, **kwargs)

        def training_step(self, model, inputs, *args, **kwargs):
            tokens = inputs.pop(TOKENS_KEY, None)
            if host_tokens and tokens is not None:
                self.state.num_input_tokens_seen += int(tokens)
            loss = super().training_step(model, inputs, *args, **kwargs)
            if not self._deltafuse_nan_filter or not isinstance(loss, torch.Tensor):
                return loss
            # the Trainer's own record of its last log (set by its training loop; a transformers without it is
            # taken to log every step, as `deltafuse train` does); its sum restarts at 0 with every log
            last = getattr(self, "_globalstep_last_logged", self.state.global_step)
            if self._deltafuse_since_log is None or self._deltafuse_since_log[0] != last:
                self._deltafuse_since_log = (last, torch.zeros_like(loss))
            since = self._deltafuse_since_log[1]
            kept = torch.where(torch.isfinite(loss), loss, since / (1 + self.state.global_step - last))
            self._deltafuse_since_log = (last, since + kept)
            return kept

        def prediction_step(self, model, inputs, *args, **kwargs):
            inputs.pop(TOKENS_KEY, None)
            return super().prediction_step(model, inputs, *args, **kwargs)

    StepTrainer.__qualname__ = StepTrainer.__name__ = f"Step{base.__name__}"
    return StepTrainer
