"""`deltafuse train`: LoRA or full fine-tuning on transformers' Trainer with padding-free packing.

Why the plain ``transformers.Trainer`` and not TRL's ``SFTTrainer``: padding-free packing needs exactly two
things, bins of whole examples and a collator that flattens them with restarting ``position_ids``; transformers
ships the collator (``DataCollatorWithFlattening``) and the bins are a few lines (``data.pack``). SFTTrainer
would add TRL and ``datasets`` as dependencies and its own packing/collation layer between us and the exact
inputs the model sees, which is what the stock-vs-deltafuse comparison must control (TRL is a test dependency
only: ``tests/integrations/test_trl.py``). Everything else (DDP via
accelerate/torchrun, gradient checkpointing, mixed precision, checkpoint/resume, PEFT) is the Trainer's.

--output-dir receives: checkpoint-N/ (resumable: weights or adapter, optimizer, scheduler, RNG, trainer state),
final/ (the adapter or the full model, with the tokenizer), metrics.jsonl (one record per step: loss, grad
norm, lr, tokens, step time, wall clock, peak memory), summary.json (settings, data counts, deltafuse's patch
report, the software stack) and train_args.json (the arguments, checked again on --resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict

import torch

from deltafuse.train import context_parallel as cp
from deltafuse.train import data as data_mod
from deltafuse.train import hfargs, setup
from deltafuse.train.errors import TrainInputError
from deltafuse.train.stopping import is_main_process, make_stopper, say_what_was_kept, signal_name, stopped_by_signal
from deltafuse.train.outdir import (ARTIFACTS, CHECKPOINT_RE, OutputPlan, checkpoints,  # noqa: F401 (re-exported)
                                    plan_output_dir, read_metrics, replacing)



log = logging.getLogger(__name__)  # what a run reports; `deltafuse train` prints it on stdout

# --- measurements ------------------------------------------------------------------------------------
def peak_memory(device: str) -> tuple[int, str]:
    """(bytes, what was measured): CUDA's peak allocated memory, or the process's peak RSS on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device))), "cuda max allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def stack_info(device: str) -> dict:
    import transformers

    import deltafuse

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "deltafuse": deltafuse.__version__,
            "device": device, "cpu_threads": torch.get_num_threads()}
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def _make_callback():
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        """Per-step record (loss, grad norm, tokens, step time, peak memory), progress bar, a line every N steps."""

        def __init__(self, *, device: str, log_every: int, metrics_path: str, progress: bool, max_steps: int,
                     history: list[dict] = ()):
            self.device, self.log_every, self.metrics_path = device, log_every, metrics_path
            self.history = list(history)  # the records of the resumed run up to its checkpoint
            self.progress, self.max_steps = progress, max_steps
            self.bar = None
            self.window: list[dict] = []
            self.records: list[dict] = []
            self.evals: list[dict] = []
            self._t_step = self._tokens0 = None
            self._pending: dict = {}

        def _sync(self):
            if self.device.startswith("cuda"):
                torch.cuda.synchronize(torch.device(self.device))

        def on_train_begin(self, args, state, control, **kw):
            if self.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(torch.device(self.device))
            self.t0 = time.perf_counter()
            if state.is_world_process_zero:  # here, once the checkpoint (if any) has loaded: start the file
                with open(self.metrics_path, "w") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in self.history)
            if self.progress and state.is_world_process_zero:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.max_steps, initial=state.global_step, desc="train", unit="step",
                                dynamic_ncols=True, file=sys.stderr)

        def on_step_begin(self, args, state, control, **kw):
            self._sync()
            self._t_step = time.perf_counter()
            self._tokens0 = state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kw):
            self._sync()
            now = time.perf_counter()
            mem, _ = peak_memory(self.device)
            self._pending = {"step": state.global_step, "step_time_s": now - self._t_step,
                             "wall_s": now - self.t0, "tokens": int(state.num_input_tokens_seen - self._tokens0),
                             "peak_mem_bytes": mem}

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs or self._pending.get("step") != state.global_step:
                return
            rec = dict(self._pending)
            rec["loss"] = float(logs["loss"])
            rec["grad_norm"] = float(logs["grad_norm"]) if logs.get("grad_norm") is not None else float("nan")
            rec["lr"] = float(logs.get("learning_rate", float("nan")))
            self._pending = {}
            if not state.is_world_process_zero:
                return
            self.records.append(rec)
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            self.window.append(rec)
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{rec['loss']:.4f}", refresh=False)
            if rec["step"] % self.log_every == 0 or rec["step"] == self.max_steps:
                self._print_window()

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            if not metrics or not state.is_world_process_zero:
                return
            rec = {"step": state.global_step, **{k: float(v) for k, v in metrics.items()
                                                  if isinstance(v, (int, float))}}
            self.evals.append(rec)
            line = f"eval at step {rec['step']} | loss {rec.get('eval_loss', float('nan')):.4f}"
            if self.bar is not None:
                self.bar.write(line, file=sys.stdout)
            else:
                log.info(line)

        def _print_window(self):
            w, self.window = self.window, []
            time_s = sum(r["step_time_s"] for r in w)
            tokens = sum(r["tokens"] for r in w)
            line = (f"step {w[-1]['step']:>{len(str(self.max_steps))}}/{self.max_steps}"
                    f" | loss {sum(r['loss'] for r in w) / len(w):.4f}"
                    f" | grad norm {sum(r['grad_norm'] for r in w) / len(w):.4f}"
                    f" | {tokens / time_s if time_s > 0 else float('nan'):,.0f} tok/s"
                    f" | step {time_s / len(w):.3f} s"
                    f" | peak mem {fmt_bytes(w[-1]['peak_mem_bytes'])}")
            if self.bar is not None:  # above the bar, which the CLI draws on stderr
                self.bar.write(line, file=sys.stdout)
            else:
                log.info(line)

        def on_train_end(self, args, state, control, **kw):
            if self.window and state.is_world_process_zero:
                self._print_window()
            if self.bar is not None:
                self.bar.close()

    return StepLogger


# --- the run -----------------------------------------------------------------------------------------
def _say(msg: str) -> None:
    if is_main_process():
        log.info(msg)


# `deltafuse bench e2e --peers` runs (``deltafuse.bench.peers``) turn this off: a peer run measures stock exactly
# as installed (e.g. FLA's route with its Hopper guard lifted for timing), never a substitute under its name.
STOCK_TORCH_FALLBACK = True


def _stock_that_runs(model, stack: contextlib.ExitStack) -> dict:
    """Stock transformers, with its own pure-torch GDN functions where its fast path (FLA, causal-conv1d,
    picked whenever they import) cannot run on this model's device: FLA installed on a CPU-only machine, or
    FLA's refused GDN backward on Hopper with Triton 3.4-3.7.0. Said in the log and the summary."""
    from deltafuse.integrations.transformers.stock import stock_fast_path_problems, stock_torch_baseline

    if not STOCK_TORCH_FALLBACK:
        return {"enabled": False, "stock": "as installed"}

    param = next(model.parameters())
    problems = stock_fast_path_problems(model, param.device, param.dtype, needs_grad=True)
    if not problems:
        return {"enabled": False, "stock": "stock"}
    swapped = stack.enter_context(stock_torch_baseline(model))
    reasons = sorted(set(problems.values()))
    _say(f"stock: its fast path cannot run here ({'; '.join(reasons)}); using transformers' own pure-torch "
         f"functions instead ({len(swapped)} place(s))")
    return {"enabled": False, "stock": "stock-torch", "stock_reason": reasons, "stock_swapped": swapped}


def apply_deltafuse(model, enabled: bool, stack: contextlib.ExitStack, context_parallel=None) -> dict:
    """Patch transformers for this model until ``stack`` closes (or leave it stock); the PatchReport as a dict.
    ``context_parallel``: the process group the model's rows are split over (``deltafuse.apply``'s argument)."""
    if not enabled:
        return _stock_that_runs(model, stack)
    import deltafuse
    from deltafuse.patching import UnsupportedModelError

    try:
        report = stack.enter_context(deltafuse.patched(model, context_parallel=context_parallel))
    except UnsupportedModelError as exc:
        raise TrainInputError(f"deltafuse cannot patch this model ({type(model).__name__}): it is not of a "
                              "supported family; pass --no-deltafuse to train it with stock transformers") from exc
    out = report.to_dict() if hasattr(report, "to_dict") else {"enabled": True}
    out["text"] = report.details() if hasattr(report, "details") else str(report)  # every row (str: one line)
    out["applied_rows"] = len(getattr(report, "applied", [])) + len(getattr(report, "already_applied", []))
    return out


def default_lr(model: str, full: bool) -> float:
    if setup.is_named(model) and model.startswith("tiny"):
        return 5e-3  # random-init CPU models: a visible loss drop in a few dozen steps
    return 2e-5 if full else 2e-4


def resolve_defaults(args) -> None:
    """Fill the defaults that depend on the model: --seq-len is 512 for the tiny models, 4096 otherwise."""
    if args.seq_len is None:
        args.seq_len = 512 if str(args.model).startswith("tiny") and not os.path.isdir(args.model) else 4096


# packed rows are cut into sequences by int32 offsets (``cu_seqlens``), as FLA's and torch's varlen kernels take them
MAX_SEQ_LEN = 2**31 - 1


def _check_seq_len(args) -> None:
    """--seq-len is a length a row can have. Rows are only as wide as the data needs (``data.build_dataset``), so
    any larger value is allowed and simply truncates nothing."""
    if args.seq_len > MAX_SEQ_LEN:
        raise TrainInputError(f"--seq-len {args.seq_len} is more than a row can hold; allowed: 2 to {MAX_SEQ_LEN:,} "
                              "tokens (sequences are indexed with int32 offsets); rows are only as long as the "
                              "longest packed row of the data, so a large value costs nothing")


def train(args) -> dict:
    """Run one training as described by the parsed ``deltafuse train`` arguments; returns the summary.

    What deltafuse patched for the run is reverted when it ends, so a caller's process is left as it was.
    SIGINT/SIGTERM while it trains: the current step finishes, a resumable checkpoint-N is saved, and
    ``Interrupted`` says where and how to continue (see ``deltafuse.train.stopping``).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        # transformers' own Trainer/PEFT path still calls the v6-deprecated name; nothing for a user to change
        warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return _train(args, stack)


def _train(args, stack: contextlib.ExitStack) -> dict:
    from deltafuse.config import load_settings

    # every check first: nothing heavy is built and nothing is written or moved before they all pass
    resolve_defaults(args)
    main = is_main_process()
    env_patch = load_settings().patch
    if args.deltafuse and not env_patch:
        raise TrainInputError("--deltafuse contradicts DELTAFUSE_PATCH (or TWINKLE_NPU_PATCH) set to off in the "
                              "environment; unset it or pass --no-deltafuse")
    enabled = env_patch if args.deltafuse is None else args.deltafuse
    plan = plan_output_dir(args.output_dir, overwrite=args.overwrite, resume=args.resume, mode=args.mode, main=main)
    setup.check_model_arg(args.model, patched=enabled)
    if plan.resume_from is not None:
        _check_resume_compatible(args, plan)
    _check_seq_len(args)
    for path, flag in ((args.data, "--data"), (args.eval_data, "--eval-data")):
        if path is not None:  # the file's rows are streamed below, once the cheap checks have passed
            data_mod.check_file(path, flag)
    device = setup.training_device()
    dtype = setup.resolve_dtype(args.dtype, device)
    cp_size = getattr(args, "context_parallel", 1)
    _check_fsdp(args, device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp.check_arguments(args, world=world, device=device, enabled=enabled, overrides=hfargs.trainer_overrides(args))
    evaluating = args.eval_data is not None
    targs = _training_arguments(args, device, dtype, evaluating=evaluating)
    layout = None
    if cp_size > 1:
        _ = targs.device  # torch.distributed is initialised here (accelerate), then the groups are made
        layout = cp.Layout(cp_size)

    # the data, streamed row by row and truncated at tokenisation (a row costs what --seq-len keeps of it),
    # before the model is built: a bad row is reported without waiting for the weights
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    # from here on SIGTERM stops the run as Ctrl-C does (exit 143), and inside the training loop both save first
    stopper = make_stopper()(world=world, main=main, save_minutes=getattr(args, "save_minutes", 0.0))
    stack.enter_context(stopper.installed())
    tokenizer = setup.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    stats = data_mod.DataStats()
    if args.data is None:
        from deltafuse.train import gsm

        rows = gsm.generate(args.num_examples, seed=0)
        stats.source = f"embedded GSM8K-style generator ({args.num_examples} rows)"
        stats.rows_read = len(rows)
    else:
        rows = data_mod.iter_jsonl(args.data, skip_bad_rows=args.skip_bad_rows, stats=stats,
                                   progress=progress and main)
    examples = data_mod.encode_rows(tokenizer, rows, args.seq_len, stats)
    del rows
    eval_examples = None
    if evaluating:
        eval_stats = data_mod.DataStats(source=args.eval_data)
        eval_examples = data_mod.encode_rows(
            tokenizer, data_mod.iter_jsonl(args.eval_data, skip_bad_rows=args.skip_bad_rows, stats=eval_stats,
                                           flag="--eval-data", progress=progress and main),
            args.seq_len, eval_stats)

    from transformers import set_seed

    set_seed(args.seed)
    model, tokenizer, described = setup.load_model_and_tokenizer(
        args.model, dtype=dtype, device=device, seed=args.seed, trust_remote_code=args.trust_remote_code,
        tokenizer=tokenizer)
    vocab = model.get_input_embeddings().weight.shape[0]
    data_mod.check_vocabulary(examples, vocab)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    dataset, collator = data_mod.build_dataset(examples, args.seq_len, args.packing, pad_id)
    if layout is not None:
        cp.check_model(model, cp_size)
        collator = cp.ShardCollator(collator, cp_size, layout.rank, pad_id, min_shard=cp.min_shard_tokens(model))
    eval_dataset = None
    if eval_examples is not None:
        data_mod.check_vocabulary(eval_examples, vocab)
        eval_dataset, _ = data_mod.build_dataset(eval_examples, args.seq_len, args.packing, pad_id)

    model.config.use_cache = False
    for key in ("eos_token_id", "pad_token_id"):  # the tokenizer decides; say it to the model's configs
        value = getattr(tokenizer, key, None)
        if value is not None:
            setattr(model.config, key, value)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, key, value)
    if targs.fsdp:  # FSDP wraps the decoder layers this model has (its _no_split_modules name absent ones too)
        targs = _training_arguments(args, device, dtype, evaluating=evaluating,
                                    fsdp_layers=decoder_layer_classes(model))
    patch_info = apply_deltafuse(model, enabled, stack, context_parallel=layout.group if layout else None)
    moe = bool(setup.expert_parameters(model))  # before PEFT renames the expert parameters
    full = args.mode == "full"
    targets = None
    if not full:
        targets = setup.lora_targets(model, args.lora_targets, args.lora_mlp)
        set_seed(args.seed)
        model = setup.add_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                               targets=targets, experts=args.lora_experts)
    trainable, total = setup.count_parameters(model)
    lr = args.lr if args.lr is not None else default_lr(args.model, full)

    _say(f"model: {described}; {dtype} on {device}; {'full fine-tuning' if full else 'LoRA'}: "
         f"{trainable:,} of {total:,} parameters trained")
    if not full:
        _say(f"lora: r={args.lora_r} alpha={args.lora_alpha} targets={','.join(targets)}"
             + (" + experts" if args.lora_experts else ""))
    if enabled:
        _say(patch_info.get("summary") or patch_info["text"].splitlines()[0])  # "deltafuse: applied N routes ..."
    else:
        _say("deltafuse: OFF (stock transformers)")
    for line in stats.summary_lines(args.seq_len):
        _say(line)
    _say(f"batches: {'packed (padding-free)' if args.packing else 'padded'}, {len(dataset)} "
         f"{'bins of <= ' + str(args.seq_len) + ' tokens' if args.packing else 'examples'}, batch size "
         f"{args.batch_size}; {args.max_steps} steps, lr {lr:g}")

    if layout is not None:
        _say(f"context parallel: every row split over {cp_size} processes; {layout.replicas} data-parallel "
             f"replica(s) of {args.batch_size} {'bin(s)' if args.packing else 'row(s)'} each")

    from transformers import PrinterCallback, ProgressCallback, Trainer

    if layout is not None:
        Trainer = cp.trainer_class(Trainer, layout, seed=args.seed)
    if world == 1 and targs.n_gpu > 1:
        # one process that sees several GPUs: the Trainer would wrap the model in torch.nn.DataParallel (one
        # thread per GPU, deprecated by torch); train on the first GPU and say how to use them all
        _say(f"this process sees {targs.n_gpu} GPUs and trains on {device} only; to train on all of them launch "
             f"one process per GPU: torchrun --nproc_per_node {targs.n_gpu} -m deltafuse.train ...")
        targs._n_gpu = 1  # what transformers' Trainer itself sets for a model it must not replicate
    if world > 1 and not targs.fsdp and "ddp_find_unused_parameters" not in hfargs.trainer_overrides(args):
        targs.ddp_find_unused_parameters = moe and (full or args.lora_experts)
    Logger = _make_callback()
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    logger = Logger(device=device, log_every=args.log_every, metrics_path=metrics_path, progress=progress,
                    max_steps=args.max_steps, history=plan.history)
    try:
        trainer = Trainer(model=model, args=targs, train_dataset=dataset, eval_dataset=eval_dataset,
                          data_collator=collator, processing_class=tokenizer, callbacks=[logger, stopper])
    except (ValueError, RuntimeError) as exc:  # a setting the Trainer cannot run here (e.g. --fsdp without a
        # launcher: a ValueError from transformers >= 5.10, accelerate's RuntimeError "no available devices" before)
        given = " ".join(" ".join(v) for v in hfargs.given(args))
        raise TrainInputError(f"transformers' Trainer refuses this setup{' (' + given + ')' if given else ''}: "
                              f"{' '.join(str(exc).split())}") from None
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    # the first write: a previous run that --overwrite replaces is set aside now, deleted once this run has
    # finished, and put back if it fails or is interrupted
    os.makedirs(args.output_dir, exist_ok=True)
    resume_from = plan.resume_from
    stack.enter_context(say_what_was_kept(args.output_dir, bool(plan.replace), args.max_steps))
    stack.enter_context(replacing(args.output_dir, plan.replace))
    if plan.replace:
        _say(f"output: the previous run in {args.output_dir} ({len(plan.replace)} entries) is set aside until "
             "this one finishes")
    if targs.process_index == 0:
        with open(os.path.join(args.output_dir, "train_args.json"), "w") as fh:
            json.dump(vars(args), fh, indent=2, default=str)
    if resume_from is not None:
        if plan.skipped:
            _say(f"resume: skipping {', '.join(plan.skipped)} (no trainer_state.json: a save that was cut off)")
        _say(f"resuming from {resume_from}" + ("" if plan.in_place else f" (history: {len(plan.history)} step "
                                                                          f"records of {plan.source_run})"))
    t0 = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume_from)
    elapsed = time.perf_counter() - t0
    if stopper.stopped_at is not None:
        if trainer.state.global_step < args.max_steps:
            raise stopped_by_signal(args, stopper, plan, world)
        _say(f"{signal_name(stopper.signum)} came during the last step: the run is finishing")

    final_eval = trainer.evaluate() if eval_dataset is not None else None
    with stopper.finishing():  # a signal now waits: final/ and summary.json are written whole
        final_dir = os.path.join(args.output_dir, "final")
        trainer.save_model(final_dir)
        if trainer.is_world_process_zero():
            tokenizer.save_pretrained(final_dir)
        records = read_metrics(metrics_path)
        mem, mem_kind = peak_memory(device)
        mem_per_rank = [mem]
        if world > 1 and torch.distributed.is_initialized():
            mem_per_rank = [None] * world
            torch.distributed.all_gather_object(mem_per_rank, mem)
        summary = {
            "model": args.model, "model_description": described, "mode": args.mode,
            "dtype": str(dtype).replace("torch.", ""),
            "deltafuse": patch_info, "packing": args.packing, "seq_len": args.seq_len, "batch_size": args.batch_size,
            "world_size": world, "distributed_type": str(trainer.accelerator.distributed_type),
            "wrapped_model": type(trainer.model_wrapped).__name__,
            "fsdp_config": dict(targs.fsdp_config) if targs.fsdp else None, "max_steps": args.max_steps, "lr": lr,
            "seed": args.seed,
            "gradient_checkpointing": args.gradient_checkpointing, "trainable_parameters": trainable,
            "total_parameters": total, "data": asdict(stats), "steps_run": len(records),
            "final_loss": records[-1]["loss"] if records else None, "train_runtime_s": elapsed,
            "train_loss": result.training_loss, "peak_mem_bytes": mem, "peak_mem_kind": mem_kind,
            "peak_mem_bytes_per_rank": mem_per_rank,
            "context_parallel": None if layout is None else {
                "size": cp_size, "data_parallel_size": layout.replicas,
                "first_step_shards": getattr(trainer, "first_step_shards", None)},
            "resumed_from": resume_from, "final_dir": final_dir, "trainer_overrides": hfargs.trainer_overrides(args),
            "eval": logger.evals, "final_eval": final_eval,
            "checkpoints": [p for _, p in checkpoints(args.output_dir)],
            "save_minutes": getattr(args, "save_minutes", 0.0), "timed_saves": stopper.timed_saves,
            "stack": stack_info(device), "metrics": metrics_path,
        }
        if trainer.is_world_process_zero():
            with open(os.path.join(args.output_dir, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=2, default=str)
            for line in stats.summary_lines(args.seq_len)[1:]:
                _say(line)
            if plan.aside_left:  # the overwrite this run continued is complete now
                import shutil

                from deltafuse.train.outdir import ASIDE

                shutil.rmtree(os.path.join(args.output_dir, ASIDE))
                _say(f"output: the run that --overwrite replaced ({os.path.join(args.output_dir, ASIDE)}) is deleted "
                     "now that this one has finished")
            _say(f"done: {len(records)} steps in {elapsed:.1f} s; saved {'model' if full else 'adapter'} to "
                 f"{final_dir}; resumable checkpoint {summary['checkpoints'][-1] if summary['checkpoints'] else '-'}")
    if stopper.final and stopper.signum is not None:
        _say(f"{signal_name(stopper.signum)} while the final output was written: it is complete, the run has "
             "finished")
    return summary


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
            with open(given, encoding="utf-8") as fh:
                cfg = json.load(fh)
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise TrainInputError(f"--fsdp_config {given!r}: cannot be read as a JSON object ({exc})") from None
    named = cfg.get("transformer_layer_cls_to_wrap", cfg.get("fsdp_transformer_layer_cls_to_wrap"))
    if layers and not named and cfg.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") == "TRANSFORMER_BASED_WRAP":
        cfg["transformer_layer_cls_to_wrap"] = layers
    return cfg


def _training_arguments(args, device: str, dtype: torch.dtype, *, evaluating: bool,
                        fsdp_layers: list[str] | None = None):
    """deltafuse's TrainingArguments, then the transformers fields given on the command line (checked here,
    before anything heavy: a bad value or combination is a TrainInputError). ``fsdp_layers``: the decoder layer
    classes FSDP wraps, once the model is built."""
    from transformers import TrainingArguments

    overrides = hfargs.trainer_overrides(args)
    eval_on = overrides.get("eval_strategy", "no") not in ("no", None) or overrides.get("eval_on_start")
    if eval_on and not evaluating:
        shown = (f"--eval_strategy {overrides['eval_strategy']}" if "eval_strategy" in overrides
                 else "--eval_on_start")
        raise TrainInputError(f"{shown} needs held-out rows: pass --eval-data JSONL")
    fsdp = _fsdp_requested(overrides)
    kwargs = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr if args.lr is not None else default_lr(args.model, args.mode == "full"),
        lr_scheduler_type=args.lr_scheduler, warmup_steps=args.warmup_steps, weight_decay=0.0,
        max_grad_norm=args.max_grad_norm, seed=args.seed, data_seed=args.seed,
        logging_strategy="steps", logging_steps=1, save_strategy="steps",
        save_steps=args.save_every or args.max_steps, save_total_limit=args.save_total_limit,
        report_to="none", disable_tqdm=True, log_level="warning", dataloader_num_workers=0,
        remove_unused_columns=False, include_num_input_tokens_seen="non_padding", prediction_loss_only=True,
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


def _fsdp_requested(overrides: dict) -> bool:
    """--fsdp given with a value that turns FSDP on (transformers' options such as ``full_shard``)."""
    value = overrides.get("fsdp")
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    return bool(value) and str(value).strip().lower() not in ("", "false", "no", "0", "off")


def _check_fsdp(args, device: str) -> None:
    """FSDP runs where accelerate runs it: several processes on accelerators. Elsewhere the Trainer would train
    without sharding (DDP on CPU, one plain process on one GPU) under a flag that says FSDP: refused."""
    overrides = hfargs.trainer_overrides(args)
    if not _fsdp_requested(overrides):
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


def _check_resume_compatible(args, plan: OutputPlan) -> None:
    """The checkpoint is below --max-steps and its run was trained with the settings this run asks for."""
    step, checkpoint = plan.resume_step, plan.resume_from
    if step >= args.max_steps:
        raise TrainInputError(f"--resume: {checkpoint!r} is at step {step}, which is not below --max-steps "
                              f"{args.max_steps}; raise --max-steps to train further")
    saved_path = os.path.join(plan.source_run, "train_args.json")
    if not os.path.isfile(saved_path):
        return
    try:
        with open(saved_path, encoding="utf-8") as fh:
            saved = json.load(fh)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise TrainInputError(f"--resume {checkpoint!r}: {saved_path} (the settings of its run) cannot be read "
                              f"({exc}); the run directory is damaged") from None
    for key in ("model", "mode", "lora_r", "lora_targets", "lora_mlp", "lora_experts"):
        if key in saved and str(saved[key]) != str(getattr(args, key, None)):
            flag = "--" + key.replace("_", "-")
            raise TrainInputError(f"--resume: the checkpoint was trained with {flag} {saved[key]!r}, this run asks "
                                  f"for {getattr(args, key, None)!r}; resume with the same setting")
