"""One switch for the Hugging Face ``Trainer`` and the TRL trainers built on it.

    from deltafuse.integrations.trainer import DeltafuseCallback
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, callbacks=[DeltafuseCallback()])
    trainer.train()   # deltafuse applied to the trainer's model for the run, reverted at its end

When things happen:

* constructing the trainer (``on_init_end``): the arguments were already checked when the callback was built;
  here the model is checked to hold a supported family (``UnsupportedModelError`` now, not after data
  loading), and a process that sees several GPUs without a launcher trains on the first one (with a warning
  saying how to launch one process per GPU) instead of the Trainer's ``torch.nn.DataParallel``. Nothing is patched yet: TRL trainers add their fused LM head *after* ``Trainer.__init__`` by
  capturing ``model.forward``, and a forward captured while patched would keep calling deltafuse's causal-LM
  forward after ``revert``.
* ``trainer.train()`` (``on_train_begin``, after the optimizer and the accelerate/DDP wrapping exist):
  ``deltafuse.patched(model)`` is entered. deltafuse replaces functions and methods, never parameters or
  modules, so the optimizer built before is unaffected; the model is found behind PEFT, DDP, FSDP and
  accelerate wrappers; the report is kept in ``callback.report`` and logged.
* end of training (``on_train_end``): what this callback applied is reverted (a ``deltafuse.apply`` made
  before stays), unless ``revert_at_end=False``; ``callback.revert()`` does it by hand, e.g. after an
  exception ended training (the Trainer calls no callback then).

Evaluation and generation inside ``train()`` (eval steps, GRPO's sampling) run patched; a
``trainer.evaluate()`` outside ``train()`` runs stock transformers.

Why not transformers' hub kernels (``from_pretrained(..., use_kernels=True, kernel_config=KernelConfig(...))``)?
They cannot carry deltafuse faithfully: they are applied only while loading or by ``set_use_kernels`` and have
no undo ("Disabling kernels at runtime is a no-op as there is no 'unkernelize' routine"); ``KernelConfig``
accepts no ``cpu`` device, so a kernel is bound per device when kernelizing, not per call; the GDN layer's
function-level hooks see no packing boundaries when only ``position_ids`` restart (deltafuse derives them above
the layer); transformers before 5.15 (5.9 included) has no hooks on these functions at all; the fused loss and
the MoE experts are not hub layers of these models; and they need the ``kernels`` package in a narrow version
range, from a Hub repository or a local directory in its build layout, never from an installed package.
"""

from __future__ import annotations

import contextlib
import logging

from transformers import TrainerCallback

from deltafuse.config import load_settings, resolve
from deltafuse.patching import PatchReport, find_model, patched

__all__ = ["DeltafuseCallback"]

logger = logging.getLogger("deltafuse")


class DeltafuseCallback(TrainerCallback):
    """Applies deltafuse to the trainer's model when training begins and reverts it when training ends.

    ``gdn``, ``fused_ops``, ``moe`` and ``backend`` are those of ``deltafuse.apply`` (None / "auto": the
    environment decides). ``revert_at_end=False`` leaves deltafuse applied after ``train()`` (call
    ``revert()`` yourself).
    """

    def __init__(self, *, gdn: bool | None = None, fused_ops: bool | None = None, moe: bool | None = None,
                 backend: str = "auto", revert_at_end: bool = True):
        if not isinstance(revert_at_end, bool):
            raise ValueError(f"DeltafuseCallback(revert_at_end={revert_at_end!r}); allowed: True or False")
        # the same checks apply() makes, so a wrong switch fails when the callback is built, not in train()
        resolve(load_settings(), gdn=gdn, fused_ops=fused_ops, moe=moe,
                backend=None if backend == "auto" else backend)
        self._kwargs = dict(gdn=gdn, fused_ops=fused_ops, moe=moe, backend=backend)
        self.revert_at_end = revert_at_end
        self.report: PatchReport | None = None
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        """True while what this callback applied is in place."""
        return self._stack is not None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            find_model(model)  # UnsupportedModelError names every wrapper walked
        gpus = getattr(args, "n_gpu", 0)
        if gpus > 1:
            # one process that sees several GPUs: the Trainer would replicate the model with
            # torch.nn.DataParallel (deprecated by torch; deltafuse's fused loss does not run in its replicas)
            logger.warning("deltafuse: this process sees %d GPUs; training on the first only instead of "
                           "torch.nn.DataParallel. To train on all of them launch one process per GPU: "
                           "torchrun --nproc_per_node %d your_script.py (or accelerate launch)", gpus, gpus)
            args._n_gpu = 1  # what transformers' Trainer itself sets for a model it must not replicate

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("DeltafuseCallback.on_train_begin got model=None; the callback needs the trainer's "
                             "model (pass it to the Trainer via callbacks=[...], not to a bare CallbackHandler)")
        stack = self._stack if self._stack is not None else contextlib.ExitStack()
        self.report = stack.enter_context(patched(model, **self._kwargs))
        self._stack = stack
        logger.info("deltafuse applied for training:\n%s", self.report)

    def on_train_end(self, args, state, control, **kwargs):
        if self.revert_at_end:
            self.revert()

    def revert(self) -> None:
        """Undo what this callback applied (nothing else); does nothing when it applied nothing."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
