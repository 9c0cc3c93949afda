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
  accelerate wrappers; the report is kept in ``callback.report``. The main process (rank 0 of the job)
  prints its one line (``str(report)``: what was routed, where the model's training calls go) once per
  ``train()``; the full report (``report.details()``) goes to the ``deltafuse`` logger at INFO.
* end of training (``on_train_end``): what this callback applied is reverted (a ``deltafuse.apply`` made
  before stays), unless ``revert_at_end=False``, and the main process prints one line saying which;
  ``callback.revert()`` does it by hand, e.g. after an exception ended training (the Trainer calls no
  callback then). ``DeltafuseCallback(quiet=True)`` prints nothing (the logger still gets both).

``DeltafuseCallback(cuda_graphs=True)``: every decoder layer's forward and backward replay from CUDA graphs, captured
after two eager training steps (``deltafuse.integrations.transformers.graphed_layers``; a packed row of more
sequences than the capture allows, or any other call a graph cannot take, runs eagerly); set-ups where that is
unsafe (gradient checkpointing, FSDP, a model not on CUDA, router logits for an auxiliary loss) are refused in one
line when the trainer is built or, for what only the model shows, when training begins.

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

from deltafuse.backends.settings import load_settings, resolve
from deltafuse.maps import PATCHER
from deltafuse.patching import PatchReport, find_model, patched

__all__ = ["DeltafuseCallback"]

logger = logging.getLogger("deltafuse")


class DeltafuseCallback(TrainerCallback):
    """Applies deltafuse to the trainer's model when training begins and reverts it when training ends.

    ``gdn``, ``fused_ops``, ``moe`` and ``backend`` are those of ``deltafuse.apply`` (None / "auto": the
    environment decides). ``revert_at_end=False`` leaves deltafuse applied after ``train()`` (call
    ``revert()`` yourself). ``quiet=True``: the main process prints nothing when training begins and ends.
    ``cuda_graphs=True``: the decoder layers replay from CUDA graphs (module docstring); ``max_sequences``: the
    most sequences of a packed row that replays (default: from the warm-up batches); ``callback.graphs`` is their
    controller while applied.
    """

    def __init__(self, *, gdn: bool | None = None, fused_ops: bool | None = None, moe: bool | None = None,
                 backend: str = "auto", revert_at_end: bool = True, quiet: bool = False, cuda_graphs: bool = False,
                 max_sequences: int | None = None):
        for name, value in (("revert_at_end", revert_at_end), ("quiet", quiet), ("cuda_graphs", cuda_graphs)):
            if not isinstance(value, bool):
                raise ValueError(f"DeltafuseCallback({name}={value!r}); allowed: True or False")
        self.quiet = quiet
        # the same checks apply() makes, so a wrong switch fails when the callback is built, not in train()
        resolve(load_settings(), gdn=gdn, fused_ops=fused_ops, moe=moe,
                backend=None if backend == "auto" else backend)
        self._kwargs = dict(gdn=gdn, fused_ops=fused_ops, moe=moe, backend=backend)
        self.revert_at_end = revert_at_end
        if max_sequences is not None and (isinstance(max_sequences, bool) or not isinstance(max_sequences, int)
                                          or max_sequences < 1 or not cuda_graphs):
            raise ValueError(f"DeltafuseCallback(max_sequences={max_sequences!r}); allowed: None, or an int >= 1 "
                             "with cuda_graphs=True")
        self.cuda_graphs = cuda_graphs
        self.max_sequences = max_sequences
        self.graphs = None  # graphed_layers.GraphedLayers while applied with cuda_graphs=True
        self.report: PatchReport | None = None
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        """True while what this callback applied is in place."""
        return self._stack is not None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            find_model(model)  # UnsupportedModelError names every wrapper walked
        if self.cuda_graphs:
            _check_graph_args(args)
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
        if self.cuda_graphs and self.graphs is None:
            from deltafuse.integrations.transformers.graphed_layers import check_model, decoder_layers, graph_layers

            _check_graph_args(args)
            check_model(model, decoder_layers(model))  # refused before anything is patched
        self.report = stack.enter_context(patched(model, **self._kwargs))
        self._stack = stack
        if self.cuda_graphs and self.graphs is None:
            try:
                self.graphs = graph_layers(model, warmup=2, max_sequences=self.max_sequences)
            except BaseException:
                self.revert()
                raise
            stack.callback(self._drop_graphs)
        logger.info("deltafuse applied for training:\n%s", self.report.details())
        self._say(state, str(self.report))
        waits = step_waits(args) if self.cuda_graphs else None
        if waits:
            self._say(state, waits)

    def _drop_graphs(self) -> None:
        graphs, self.graphs = self.graphs, None
        if graphs is not None:
            logger.info("deltafuse: %s", graphs.summary())
            graphs.remove()

    def on_train_end(self, args, state, control, **kwargs):
        if self.graphs is not None:
            self._say(state, f"deltafuse: {self.graphs.summary()}")
        if not self.revert_at_end:
            if self.active:
                self._say(state, "deltafuse: training ended; still applied (revert_at_end=False): call "
                                 "callback.revert() or deltafuse.revert() to restore stock transformers")
            return
        line = self.revert()
        if line:
            self._say(state, line)

    def revert(self) -> str | None:
        """Undo what this callback applied (nothing else); does nothing when it applied nothing. Returns the
        line saying what was reverted (None when nothing was)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return None
        changed = len(self.report.applied) if self.report is not None else 0
        stack.close()
        line = f"deltafuse: reverted the {changed} route{'' if changed == 1 else 's'} applied for training"
        if PATCHER.has_records():
            line += "; routes applied before train() (deltafuse.apply) stay"
        else:
            line += ": stock transformers restored"
        logger.info(line)
        return line

    def _say(self, state, line: str) -> None:
        """Print ``line`` on the job's main process (every process logs it at INFO)."""
        if not self.quiet and getattr(state, "is_world_process_zero", True):
            print(line, flush=True)


def step_waits(args) -> str | None:
    """One line naming the TrainingArguments that make every Trainer step wait for the GPU in its middle (each reads
    a value back after every micro-batch's backward), else None. With the layers replayed from graphs the host
    keeps pace with the GPU, so these waits show in the step time; `deltafuse train` does both without a read."""
    on = []
    if getattr(args, "logging_nan_inf_filter", False):
        on.append("logging_nan_inf_filter=True (tests the loss)")
    tokens = getattr(args, "include_num_input_tokens_seen", "no")
    if tokens not in (False, None, "no"):
        on.append(f"include_num_input_tokens_seen={tokens!r} (sums the tokens)")
    if not on:
        return None
    return ("deltafuse: cuda_graphs: " + " and ".join(on) + " read the GPU back after every micro-batch, so the "
            "optimizer step is queued only once the backward has finished (full-depth Qwen3.5-35B-A3B on an H200: "
            "271 ms a step with both, 237 ms without); to let the host run ahead, set the token count off and "
            "build the trainer from deltafuse.train.steps.trainer_class(YourTrainer, host_tokens=False), which "
            "filters NaN / inf losses on the device with the Trainer's semantics, or set the filter off too")


def _check_graph_args(args) -> None:
    """TrainingArguments under which graphed layers are unsafe: refused in one line (``GraphError``)."""
    from deltafuse.integrations.transformers.graphed_layers import GraphError
    from deltafuse.train.errors import cuda_graphs_refusal

    checkpointing = getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)
    why = cuda_graphs_refusal(checkpointing="gradient checkpointing (on in the training arguments)" if checkpointing
                              else None, fsdp=f"fsdp={args.fsdp!r}" if getattr(args, "fsdp", None) else None)
    if why:
        raise GraphError(f"DeltafuseCallback(cuda_graphs=True): {why}")
