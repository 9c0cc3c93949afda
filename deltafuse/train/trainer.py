"""`deltafuse train`: LoRA or full fine-tuning on transformers' Trainer with padding-free packing.

Why the plain ``transformers.Trainer`` and not TRL's ``SFTTrainer``: padding-free packing needs exactly two
things, bins of whole examples and a collator that flattens them with restarting ``position_ids``; transformers
ships the collator (``DataCollatorWithFlattening``) and the bins are a few lines (``packing.pack``). SFTTrainer
would add TRL and ``datasets`` as dependencies and its own packing/collation layer between us and the exact
inputs the model sees, which is what the stock-vs-deltafuse comparison must control (TRL is a test dependency
only: ``tests/integrations/test_trl.py``). Everything else (DDP via
accelerate/torchrun, gradient checkpointing, mixed precision, checkpoint/resume, PEFT, the progress bars and the
per-step logs) is the Trainer's; ``deltafuse.train.progress`` records and prints what it does not measure.

A run goes through ``_check`` (every argument, before anything heavy), ``_load_data``, ``_build_model``,
``_make_trainer``, ``_start_output`` (the first write), the Trainer's ``train()``, then ``_finish``.

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
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from deltafuse.train import ahead
from deltafuse.train import context_parallel as cp
from deltafuse.train import data as data_mod
from deltafuse.train import hfargs, packing, progress, setup, steps, trainargs
from deltafuse.train.errors import TrainInputError, cuda_graphs_refusal
from deltafuse.train.stopping import is_main_process, make_stopper, say_what_was_kept, signal_name, stopped_by_signal
from deltafuse.train.outdir import (OutputPlan, check_resume_compatible, checkpoints, plan_output_dir, read_metrics,
                                    replacing)
from deltafuse.train.progress import peak_memory

log = logging.getLogger(__name__)  # what a run reports; `deltafuse train` prints it on stdout
fmt_bytes = progress.fmt_bytes  # also imported from here (deltafuse.bench.e2e)


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
    from deltafuse.maps import PATCHER

    swapped = stack.enter_context(stock_torch_baseline(model, deltafuse_applied=PATCHER.has_records()))
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


def resolve_defaults(args) -> None:
    """Fill the defaults that depend on the model: --seq-len is 512 for the tiny models, 4096 otherwise."""
    if args.seq_len is None:
        args.seq_len = 512 if str(args.model).startswith("tiny") and not os.path.isdir(args.model) else 4096


# packed rows are cut into sequences by int32 offsets (``cu_seqlens``), as FLA's and torch's varlen kernels take them
MAX_SEQ_LEN = 2**31 - 1


def _check_seq_len(args) -> None:
    """--seq-len is a length a row can have. Rows are only as wide as the data needs (``packing.build_dataset``), so
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


@dataclass
class _Run:
    """One run's state, filled in stage by stage (the checks, the data, the model, the Trainer)."""

    args: Any
    stack: contextlib.ExitStack
    plan: OutputPlan | None = None
    enabled: bool = False  # deltafuse patches the model
    main: bool = True
    world: int = 1
    ahead: int = 0  # --compile-ahead threads (0: off)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    targs: Any = None  # transformers.TrainingArguments
    layout: Any = None  # cp.Layout with --context-parallel N > 1
    progress: bool = False
    stopper: Any = None
    tokenizer: Any = None
    stats: data_mod.DataStats = field(default_factory=data_mod.DataStats)
    examples: list = field(default_factory=list)
    eval_examples: list | None = None
    model: Any = None
    described: str = ""
    dataset: Any = None
    collator: Any = None
    eval_dataset: Any = None
    patch_info: dict = field(default_factory=dict)
    moe: bool = False
    full: bool = False
    targets: list | None = None
    trainable: int = 0
    total: int = 0
    graphs: Any = None  # graphed_layers.GraphedLayers with --cuda-graphs
    lr: float = 0.0
    trainer: Any = None
    logger: Any = None  # progress.StepLogger
    metrics_path: str = ""


def _train(args, stack: contextlib.ExitStack) -> dict:
    run = _Run(args, stack)
    _check(run)
    # from here on SIGTERM stops the run as Ctrl-C does (exit 143), and inside the training loop both save first
    run.stopper = make_stopper()(world=run.world, main=run.main, save_minutes=getattr(args, "save_minutes", 0.0))
    stack.enter_context(run.stopper.installed())
    _load_data(run)
    _build_model(run)
    _report_setup(run)
    _make_trainer(run)
    _start_output(run)
    t0 = time.perf_counter()
    result = run.trainer.train(resume_from_checkpoint=run.plan.resume_from)
    elapsed = time.perf_counter() - t0
    if run.stopper.stopped_at is not None:
        if run.trainer.state.global_step < args.max_steps:
            raise stopped_by_signal(args, run.stopper, run.plan, run.world)
        _say(f"{signal_name(run.stopper.signum)} came during the last step: the run is finishing")
    return _finish(run, result, elapsed)


def _check(run: _Run) -> None:
    """Every check first: nothing heavy is built and nothing is written or moved before they all pass."""
    from deltafuse.backends.settings import load_settings

    args = run.args
    resolve_defaults(args)
    run.main = is_main_process()
    env_patch = load_settings().patch
    if args.deltafuse and not env_patch:
        raise TrainInputError("--deltafuse contradicts DELTAFUSE_PATCH (or TWINKLE_NPU_PATCH) set to off in the "
                              "environment; unset it or pass --no-deltafuse")
    run.enabled = env_patch if args.deltafuse is None else args.deltafuse
    run.plan = plan_output_dir(args.output_dir, overwrite=args.overwrite, resume=args.resume, mode=args.mode,
                               main=run.main)
    setup.check_model_arg(args.model, patched=run.enabled)
    if run.plan.resume_from is not None:
        check_resume_compatible(args, run.plan)
    _check_seq_len(args)
    for path, flag in ((args.data, "--data"), (args.eval_data, "--eval-data")):
        if path is not None:  # the file's rows are streamed below, once the cheap checks have passed
            data_mod.check_file(path, flag)
    run.device = setup.training_device()
    run.dtype = setup.resolve_dtype(args.dtype, run.device)
    trainargs.check_fsdp(args, run.device)
    run.world = int(os.environ.get("WORLD_SIZE", "1"))
    cp.check_arguments(args, world=run.world, device=run.device, enabled=run.enabled,
                       overrides=hfargs.trainer_overrides(args))
    try:
        run.ahead = ahead.resolve(getattr(args, "compile_ahead", "auto"), enabled=run.enabled, device=run.device,
                                  world=run.world)
    except ValueError as exc:
        raise TrainInputError(str(exc)) from None
    run.targs = trainargs.training_arguments(args, run.device, run.dtype, evaluating=args.eval_data is not None,
                                             host_tokens=run.world == 1)
    if getattr(args, "context_parallel", 1) > 1:
        _ = run.targs.device  # torch.distributed is initialised here (accelerate), then the groups are made
        run.layout = cp.Layout(args.context_parallel)
    run.progress = trainargs.show_progress(args)
    _check_cuda_graphs(args, run)


def _check_cuda_graphs(args, run: _Run) -> None:
    """--cuda-graphs where the captured layers would be unsafe or serve nothing: refused now, in one line."""
    if not getattr(args, "cuda_graphs", False):
        return
    why = None
    if not run.device.startswith("cuda"):
        why = f"the device is {run.device}; allowed: a CUDA device"
    elif not run.enabled:
        why = ("deltafuse is off (--no-deltafuse or DELTAFUSE_PATCH=0); stock transformers' layers read values on "
               "the host (the experts' routing, packed boundaries), which a graph cannot; allowed: deltafuse on")
    else:
        why = cuda_graphs_refusal(checkpointing="--gradient-checkpointing" if args.gradient_checkpointing else None,
                                  fsdp=f"--fsdp {run.targs.fsdp!r}" if run.targs.fsdp else None,
                                  context_parallel=getattr(args, "context_parallel", 1))
    if why:
        raise TrainInputError(f"--cuda-graphs: {why}")


def _load_data(run: _Run) -> None:
    """The tokenizer and the encoded examples, streamed and truncated at tokenisation (a row costs what --seq-len
    keeps of it), before the model is built: a bad row is reported without waiting for the weights."""
    args = run.args
    run.tokenizer = setup.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    if args.data is None:
        from deltafuse.train import gsm

        rows = gsm.generate(args.num_examples, seed=0)
        run.stats.source = f"embedded GSM8K-style generator ({args.num_examples} rows)"
        run.stats.rows_read = len(rows)
    else:
        rows = data_mod.iter_jsonl(args.data, skip_bad_rows=args.skip_bad_rows, stats=run.stats,
                                   progress=run.progress and run.main)
    run.examples = data_mod.encode_rows(run.tokenizer, rows, args.seq_len, run.stats)
    del rows
    if args.eval_data is not None:
        eval_stats = data_mod.DataStats(source=args.eval_data)
        run.eval_examples = data_mod.encode_rows(
            run.tokenizer, data_mod.iter_jsonl(args.eval_data, skip_bad_rows=args.skip_bad_rows, stats=eval_stats,
                                               flag="--eval-data", progress=run.progress and run.main),
            args.seq_len, eval_stats)


def _build_model(run: _Run) -> None:
    """The model (patched by deltafuse or stock, with LoRA unless --full) and the batches it trains on."""
    from transformers import set_seed

    args = run.args
    set_seed(args.seed)
    model, run.tokenizer, run.described = setup.load_model_and_tokenizer(
        args.model, dtype=run.dtype, device=run.device, seed=args.seed, trust_remote_code=args.trust_remote_code,
        tokenizer=run.tokenizer)
    tokenizer = run.tokenizer
    vocab = model.get_input_embeddings().weight.shape[0]
    data_mod.check_vocabulary(run.examples, vocab)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    # one process: the batches carry their token counts (steps.py), so the Trainer never reads a count back
    run.dataset, run.collator = packing.build_dataset(run.examples, args.seq_len, args.packing, pad_id,
                                                      count_tokens=run.world == 1)
    if run.layout is not None:
        cp.check_model(model, args.context_parallel)
        run.collator = cp.ShardCollator(run.collator, args.context_parallel, run.layout.rank, pad_id,
                                        min_shard=cp.min_shard_tokens(model))
    if run.eval_examples is not None:
        data_mod.check_vocabulary(run.eval_examples, vocab)
        run.eval_dataset, _ = packing.build_dataset(run.eval_examples, args.seq_len, args.packing, pad_id)

    model.config.use_cache = False
    for key in ("eos_token_id", "pad_token_id"):  # the tokenizer decides; say it to the model's configs
        value = getattr(tokenizer, key, None)
        if value is not None:
            setattr(model.config, key, value)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, key, value)
    if run.targs.fsdp:  # FSDP wraps the decoder layers this model has (its _no_split_modules name absent ones too)
        run.targs = trainargs.training_arguments(args, run.device, run.dtype, evaluating=args.eval_data is not None,
                                                 fsdp_layers=trainargs.decoder_layer_classes(model),
                                                 host_tokens=run.world == 1)
    run.patch_info = apply_deltafuse(model, run.enabled, run.stack,
                                     context_parallel=run.layout.group if run.layout else None)
    run.moe = bool(setup.expert_parameters(model))  # before PEFT renames the expert parameters
    run.full = args.mode == "full"
    if not run.full:
        run.targets = setup.lora_targets(model, args.lora_targets, args.lora_mlp)
        set_seed(args.seed)
        model = setup.add_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                               targets=run.targets, experts=args.lora_experts)
    run.model = model
    if getattr(args, "cuda_graphs", False):
        from deltafuse.integrations.transformers.graphed_layers import GraphError, graph_layers

        most = packing.max_sequences_per_row(run.dataset, args.batch_size) if args.packing else None
        try:
            run.graphs = graph_layers(model, warmup=2, max_sequences=most)
        except GraphError as exc:
            raise TrainInputError(f"--cuda-graphs: {exc}") from None
        run.stack.callback(run.graphs.remove)
    run.trainable, run.total = setup.count_parameters(model)
    run.lr = args.lr if args.lr is not None else trainargs.default_lr(args.model, run.full)


def _report_setup(run: _Run) -> None:
    args = run.args
    _say(f"model: {run.described}; {run.dtype} on {run.device}; {'full fine-tuning' if run.full else 'LoRA'}: "
         f"{run.trainable:,} of {run.total:,} parameters trained")
    if not run.full:
        _say(f"lora: r={args.lora_r} alpha={args.lora_alpha} targets={','.join(run.targets)}"
             + (" + experts" if args.lora_experts else ""))
    if run.enabled:
        _say(run.patch_info.get("summary") or run.patch_info["text"].splitlines()[0])  # "deltafuse: applied ..."
    else:
        _say("deltafuse: OFF (stock transformers)")
    for line in run.stats.summary_lines(args.seq_len):
        _say(line)
    _say(f"batches: {'packed (padding-free)' if args.packing else 'padded'}, {len(run.dataset)} "
         f"{'bins of <= ' + str(args.seq_len) + ' tokens' if args.packing else 'examples'}, batch size "
         f"{args.batch_size}; {args.max_steps} steps, lr {run.lr:g}")
    if run.layout is not None:
        _say(f"context parallel: every row split over {args.context_parallel} processes; {run.layout.replicas} "
             f"data-parallel replica(s) of {args.batch_size} {'bin(s)' if args.packing else 'row(s)'} each")


def _make_trainer(run: _Run) -> None:
    """transformers' Trainer (context-parallel when asked) with the run's StepLogger, stopper and progress bars."""
    from transformers import Trainer

    args, targs = run.args, run.targs
    if run.layout is not None:
        Trainer = cp.trainer_class(Trainer, run.layout, seed=args.seed)
    Trainer = ahead.trainer_class(Trainer, run.ahead)
    Trainer = steps.trainer_class(Trainer, host_tokens=run.world == 1)
    if run.world == 1 and targs.n_gpu > 1:
        # one process that sees several GPUs: the Trainer would wrap the model in torch.nn.DataParallel (one
        # thread per GPU, deprecated by torch); train on the first GPU and say how to use them all
        _say(f"this process sees {targs.n_gpu} GPUs and trains on {run.device} only; to train on all of them "
             f"launch one process per GPU: torchrun --nproc_per_node {targs.n_gpu} -m deltafuse.train ...")
        targs._n_gpu = 1  # what transformers' Trainer itself sets for a model it must not replicate
    if run.world > 1 and not targs.fsdp and "ddp_find_unused_parameters" not in hfargs.trainer_overrides(args):
        targs.ddp_find_unused_parameters = run.moe and (run.full or args.lora_experts)
    run.metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    run.logger = progress.make_step_logger()(device=run.device, log_every=args.log_every,
                                             metrics_path=run.metrics_path, progress=run.progress,
                                             max_steps=args.max_steps, history=run.plan.history)
    try:
        run.trainer = Trainer(model=run.model, args=targs, train_dataset=run.dataset, eval_dataset=run.eval_dataset,
                              data_collator=run.collator, processing_class=run.tokenizer,
                              callbacks=[run.logger, run.stopper])
    except (ValueError, RuntimeError) as exc:  # a setting the Trainer cannot run here (e.g. --fsdp without a
        # launcher: a ValueError from transformers >= 5.10, accelerate's RuntimeError "no available devices" before)
        given = " ".join(" ".join(v) for v in hfargs.given(args))
        raise TrainInputError(f"transformers' Trainer refuses this setup{' (' + given + ')' if given else ''}: "
                              f"{' '.join(str(exc).split())}") from None
    progress.install(run.trainer)


def _start_output(run: _Run) -> None:
    """The first write: a previous run that --overwrite replaces is set aside now, deleted once this run has
    finished, and put back if it fails or is interrupted."""
    args, plan = run.args, run.plan
    os.makedirs(args.output_dir, exist_ok=True)
    run.stack.enter_context(say_what_was_kept(args.output_dir, bool(plan.replace), args.max_steps))
    run.stack.enter_context(replacing(args.output_dir, plan.replace))
    if plan.replace:
        _say(f"output: the previous run in {args.output_dir} ({len(plan.replace)} entries) is set aside until "
             "this one finishes")
    if run.targs.process_index == 0:
        with open(os.path.join(args.output_dir, "train_args.json"), "w") as fh:
            json.dump(vars(args), fh, indent=2, default=str)
    if plan.resume_from is not None:
        if plan.skipped:
            _say(f"resume: skipping {', '.join(plan.skipped)} "
                 "(no complete trainer_state.json: a save that was cut off)")
        _say(f"resuming from {plan.resume_from}" + ("" if plan.in_place else f" (history: {len(plan.history)} step "
                                                                               f"records of {plan.source_run})"))


def _finish(run: _Run, result, elapsed: float) -> dict:
    """The final evaluation, final/ and summary.json (a signal waits until they are written); the summary."""
    args, trainer, stopper, plan = run.args, run.trainer, run.stopper, run.plan
    final_eval = trainer.evaluate() if run.eval_dataset is not None else None
    with stopper.finishing():  # a signal now waits: final/ and summary.json are written whole
        final_dir = os.path.join(args.output_dir, "final")
        trainer.save_model(final_dir)
        if trainer.is_world_process_zero():
            run.tokenizer.save_pretrained(final_dir)
        records = read_metrics(run.metrics_path)
        mem, mem_kind = peak_memory(run.device)
        mem_per_rank = [mem]
        if run.world > 1 and torch.distributed.is_initialized():
            mem_per_rank = [None] * run.world
            torch.distributed.all_gather_object(mem_per_rank, mem)
        summary = {
            "model": args.model, "model_description": run.described, "mode": args.mode,
            "dtype": str(run.dtype).replace("torch.", ""),
            "deltafuse": run.patch_info, "packing": args.packing, "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "world_size": run.world, "distributed_type": str(trainer.accelerator.distributed_type),
            "wrapped_model": type(trainer.model_wrapped).__name__,
            "fsdp_config": dict(run.targs.fsdp_config) if run.targs.fsdp else None, "max_steps": args.max_steps,
            "lr": run.lr, "seed": args.seed,
            "gradient_checkpointing": args.gradient_checkpointing, "trainable_parameters": run.trainable,
            "total_parameters": run.total, "data": asdict(run.stats), "steps_run": len(records),
            "final_loss": records[-1]["loss"] if records else None, "train_runtime_s": elapsed,
            "train_loss": result.training_loss, "peak_mem_bytes": mem, "peak_mem_kind": mem_kind,
            "peak_mem_bytes_per_rank": mem_per_rank,
            "context_parallel": None if run.layout is None else {
                "size": args.context_parallel, "data_parallel_size": run.layout.replicas,
                "first_step_shards": getattr(trainer, "first_step_shards", None)},
            "resumed_from": plan.resume_from, "final_dir": final_dir,
            "trainer_overrides": hfargs.trainer_overrides(args),
            "eval": run.logger.evals, "final_eval": final_eval,
            "checkpoints": [p for _, p in checkpoints(args.output_dir)],
            "save_minutes": getattr(args, "save_minutes", 0.0), "timed_saves": stopper.timed_saves,
            "stack": stack_info(run.device), "metrics": run.metrics_path,
            "cuda_graphs": None if run.graphs is None else run.graphs.summary(),
        }
        if trainer.is_world_process_zero():
            with open(os.path.join(args.output_dir, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=2, default=str)
            for line in run.stats.summary_lines(args.seq_len)[1:]:
                _say(line)
            if run.graphs is not None:
                _say(run.graphs.summary())
            if plan.aside_left:  # the overwrite this run continued is complete now
                import shutil

                from deltafuse.train.outdir import ASIDE

                shutil.rmtree(os.path.join(args.output_dir, ASIDE))
                _say(f"output: the run that --overwrite replaced ({os.path.join(args.output_dir, ASIDE)}) is deleted "
                     "now that this one has finished")
            _say(f"done: {len(records)} steps in {elapsed:.1f} s; saved {'model' if run.full else 'adapter'} to "
                 f"{final_dir}; resumable checkpoint {summary['checkpoints'][-1] if summary['checkpoints'] else '-'}")
    if stopper.final and stopper.signum is not None:
        _say(f"{signal_name(stopper.signum)} while the final output was written: it is complete, the run has "
             "finished")
    return summary
