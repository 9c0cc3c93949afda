"""``DeltafuseCallback``: one switch for the Hugging Face Trainer (TRL trainers: tests/integrations/test_trl.py).

The callback run and a stock run start from the same weights and see the same batches; two plain-SGD steps
without clipping; compared: the logged loss of both steps and every trainable gradient of both steps (against a
float64 run of stock: as accurate as stock's fp32 ones). The patched ops are counted on ``deltafuse.ops`` (where
the patched modeling code looks them up), and after ``train()`` every object a patch row may touch is the one
found before.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from deltafuse import ops, patching
from deltafuse.maps import PATCHER
from deltafuse.integrations.trainer import DeltafuseCallback
from deltafuse.models import build_model
from tests.helpers import Float64Everywhere, float64_copy, fp32_gradient_errors, input_gen, input_seed
from tests.integrations import RTOL, assert_grads_close, assert_same_objects, snapshot

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

STEPS = 2
COUNTED = ("chunk_gated_delta_rule", "causal_conv1d_fn", "rms_norm_zero_centered", "fused_linear_cross_entropy",
           "moe_experts")


def training_args(output_dir, **overrides):
    """Arguments shared by the trainer tests: CPU, fp32, two plain-SGD steps, a log line per step."""
    fields = dict(output_dir=str(output_dir), max_steps=STEPS, logging_steps=1, optim="sgd", learning_rate=0.05,
                  lr_scheduler_type="constant", max_grad_norm=0.0, bf16=False, use_cpu=True, report_to="none",
                  save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=1234,
                  per_device_train_batch_size=2)
    return {**fields, **overrides}


def grad_recorder():
    """A callback keeping every trainable parameter's gradient at each optimizer step."""
    from transformers import TrainerCallback

    class GradRecorder(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append({n: None if p.grad is None else p.grad.detach().clone()
                               for n, p in model.named_parameters() if p.requires_grad})

    return GradRecorder()


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _assert_same_losses(got, ref, rtol):
    got_losses, ref_losses = logged_losses(got), logged_losses(ref)
    assert len(ref_losses) == STEPS and len(got_losses) == STEPS, (got_losses, ref_losses)
    for step, (g, r) in enumerate(zip(got_losses, ref_losses), 1):
        assert abs(g - r) <= rtol * abs(r), f"step {step}: loss {g!r} vs reference {r!r}"


def _assert_present(grads: dict) -> None:
    """The reference's gradients are present and non-zero (a comparison with them is not vacuous)."""
    present = [t for t in grads.values() if t is not None]
    assert len(present) >= 0.9 * len(grads) and all(t.abs().max() > 0 for t in present)


def assert_same_training(got, ref, got_grads, ref_grads, rtol=RTOL):
    """Same logged loss and the same gradients (rel ``rtol``, or fp32 rounding of the largest gradient) at
    every step."""
    _assert_same_losses(got, ref, rtol)
    assert len(got_grads) == len(ref_grads) == STEPS
    for g, r in zip(got_grads, ref_grads):
        _assert_present(r)
        assert_grads_close(g, r, rtol)


def assert_as_accurate(got, ref, got_grads, ref_grads, oracle_grads, rtol=RTOL):
    """Same logged loss (rel ``rtol``) at every step, and every gradient at every step as accurate as the fp32
    reference's: no farther from the float64 run's ``oracle_grads`` than tests/helpers.py ``fp32_gradient_errors``
    allows against the reference's error of it (twice it, plus 32 times its median over the step's gradients).
    For runs whose fp32 gradients can differ by more than ``rtol`` in some draws while both are as accurate."""
    _assert_same_losses(got, ref, rtol)
    assert len(got_grads) == len(ref_grads) == len(oracle_grads) == STEPS
    bad = []
    for step, (g, r, o) in enumerate(zip(got_grads, ref_grads, oracle_grads), 1):
        _assert_present(o)
        bad += [f"step {step} {n}: {mine:.2e} from float64, at most {bound:.2e}"
                for n, (mine, bound) in fp32_gradient_errors(g, o, r).items() if not mine <= bound]
    assert not bad, "gradients farther from the float64 run than the fp32 reference's allow:\n" + "\n".join(bad)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of deltafuse's public ops."""
    counter = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        fn = getattr(ops, name)

        def spy(*args, _name=name, _fn=fn, **kwargs):
            counter[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    return counter


class Rows(torch.utils.data.Dataset):
    """Random token rows of one length (no padding), labels = inputs."""

    def __init__(self, n, length, vocab, seed):
        gen = input_gen(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def lora(model, seed):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(input_seed("lora", seed))  # init_lora_weights=False: B is random too, so no LoRA gradient is 0
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                        "out_proj"])
    return get_peft_model(model, config)


def _hf_run(name, tmp_path, *, callback, peft: bool, oracle: bool = False):
    """``oracle``: the stock run in float64 (the same weights cast, eager MoE experts, under ``Float64Everywhere``)."""
    from transformers import Trainer, TrainingArguments

    model = build_model(name, seed=input_seed("model", 5)).train()
    if peft:
        model = lora(model, seed=6)
    if oracle:
        model = float64_copy(model)
    data = Rows(4, 24, model.config.vocab_size, seed=7)
    recorder = grad_recorder()
    callbacks = [recorder] + ([callback] if callback is not None else [])
    args = TrainingArguments(**training_args(tmp_path / ("on" if callback else "off64" if oracle else "off")))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    before = snapshot(model)
    assert not PATCHER.has_records()  # building the trainer patches nothing
    with Float64Everywhere() if oracle else contextlib.nullcontext():
        trainer.train()
    return trainer, recorder.steps, before, model


@pytest.mark.parametrize("name,peft", [("tiny-moe", False), ("tiny", True)])
def test_hf_trainer_callback_equals_stock_and_reverts(name, peft, tmp_path, op_calls):
    ref, ref_grads, _, _ = _hf_run(name, tmp_path, callback=None, peft=peft)
    assert sum(op_calls.values()) == 0
    callback = DeltafuseCallback()
    got, got_grads, before, model = _hf_run(name, tmp_path, callback=callback, peft=peft)
    # the patched ops served the training: GDN, norms and the causal-LM loss (the Trainer passes labels)
    for op in ("chunk_gated_delta_rule", "causal_conv1d_fn", "rms_norm_zero_centered", "fused_linear_cross_entropy"):
        assert op_calls[op] > 0, op_calls
    if name == "tiny-moe":
        assert op_calls["moe_experts"] > 0
    assert callback.report is not None and callback.report.applied
    # fp32: deltafuse's loss sums the cross-entropy in chunks, stock over the full logits (measured: <= 1.6e-4
    # on these two steps; a state leak across sequences shows as ~1e-3). The gradients against float64: with LoRA,
    # one draw of six had the GDN projections' adapters 5.7e-4 apart between deltafuse and stock
    oracle = _hf_run(name, tmp_path, callback=None, peft=peft, oracle=True)[1]
    assert_as_accurate(got, ref, got_grads, ref_grads, oracle, rtol=3 * RTOL)
    # reverted at the end of train(): every object is the one found before
    assert not callback.active and not PATCHER.has_records()
    assert_same_objects(before, snapshot(model))
    calls = dict(op_calls)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 200, (1, 9)))
    assert op_calls == calls  # stock again


def test_callback_leaves_an_earlier_apply_in_place(tmp_path, op_calls):
    """The callback reverts what it applied, not a ``deltafuse.apply`` made before the trainer."""
    from transformers import Trainer, TrainingArguments

    model = build_model("tiny", seed=input_seed("model", 1)).train()
    patching.apply(model)
    applied = snapshot(model)
    callback = DeltafuseCallback()
    trainer = Trainer(model=model, args=TrainingArguments(**training_args(tmp_path, max_steps=1)),
                      train_dataset=Rows(2, 12, model.config.vocab_size, seed=2), callbacks=[callback])
    trainer.train()
    assert not callback.active and PATCHER.has_records()
    assert_same_objects(applied, snapshot(model))
    assert op_calls["chunk_gated_delta_rule"] > 0


def test_revert_at_end_false_keeps_deltafuse_until_revert(tmp_path, capsys):
    from transformers import Trainer, TrainingArguments

    model = build_model("tiny", seed=input_seed("model", 1)).train()
    before = snapshot(model)
    callback = DeltafuseCallback(revert_at_end=False)
    trainer = Trainer(model=model, args=TrainingArguments(**training_args(tmp_path, max_steps=1)),
                      train_dataset=Rows(2, 12, model.config.vocab_size, seed=2), callbacks=[callback])
    capsys.readouterr()
    trainer.train()
    assert _deltafuse_lines(capsys.readouterr().out)[1:] == [
        "deltafuse: training ended; still applied (revert_at_end=False): call callback.revert() or "
        "deltafuse.revert() to restore stock transformers"]
    assert callback.active and PATCHER.has_records()
    assert callback.revert().startswith("deltafuse: reverted the ")
    assert not callback.active and not PATCHER.has_records()
    assert_same_objects(before, snapshot(model))
    assert callback.revert() is None  # a second revert does nothing


def _deltafuse_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("deltafuse:")]


def test_callback_says_once_per_train_what_it_routed_and_that_it_reverted(tmp_path, capsys):
    """The one line reaches the user (stdout of the main process: the Trainer's own logging is silent at INFO by
    default), once per ``train()``, and so does the revert."""
    from transformers import Trainer, TrainingArguments

    model = build_model("tiny", seed=input_seed("model", 1)).train()
    callback = DeltafuseCallback()
    trainer = Trainer(model=model, args=TrainingArguments(**training_args(tmp_path, max_steps=1)),
                      train_dataset=Rows(2, 12, model.config.vocab_size, seed=2), callbacks=[callback])
    capsys.readouterr()
    trainer.train()
    lines = _deltafuse_lines(capsys.readouterr().out)
    n = len(callback.report.applied)
    assert n > 0 and lines == [str(callback.report),
                               f"deltafuse: reverted the {n} routes applied for training: stock transformers restored"]
    assert "\n" not in lines[0] and "Qwen3.5 model: training calls on cpu float32 -> torch" in lines[0]
    trainer.train()  # a second train(): patched and reverted again, said again
    assert len(_deltafuse_lines(capsys.readouterr().out)) == 2


def test_callback_prints_on_the_main_process_only(capsys, caplog):
    import logging

    from transformers import TrainerState

    model = build_model("tiny")
    for state, quiet in ((TrainerState(is_world_process_zero=False), False), (TrainerState(), True)):
        callback = DeltafuseCallback(quiet=quiet)
        with caplog.at_level(logging.INFO, logger="deltafuse"):
            callback.on_train_begin(None, state, None, model=model)
            assert callback.active and PATCHER.has_records()
            callback.on_train_end(None, state, None)
        assert not callback.active and not PATCHER.has_records()
        assert capsys.readouterr().out == ""
        assert "deltafuse applied for training:" in caplog.text and "reverted the" in caplog.text  # the logger has both
        caplog.clear()


@pytest.mark.parametrize("kwargs,words", [
    (dict(gdn="yes"), ["gdn", "'yes'"]),
    (dict(backend="cuda"), ["backend", "'cuda'", "triton"]),
    (dict(revert_at_end=1), ["revert_at_end", "1", "True or False"]),
])
def test_callback_arguments_are_checked_when_built(kwargs, words):
    with pytest.raises(ValueError) as info:
        DeltafuseCallback(**kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_unsupported_model_fails_when_the_trainer_is_built(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from deltafuse.patching import UnsupportedModelError

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        Trainer(model=model, args=TrainingArguments(**training_args(tmp_path)),
                train_dataset=Rows(2, 8, 64, seed=0), callbacks=[DeltafuseCallback()])
    assert not PATCHER.has_records()


def test_one_process_seeing_several_gpus_trains_on_one_instead_of_data_parallel(tmp_path, caplog):
    """The Trainer decides DataParallel and the batch size from ``args.n_gpu`` when training starts; the
    callback, told at construction that the process sees 2 GPUs, brings it to 1 and says how to use both."""
    import logging

    from transformers import TrainingArguments

    args = TrainingArguments(**training_args(tmp_path))
    args._n_gpu = 2  # what transformers computes on a machine with two visible GPUs and no launcher
    callback = DeltafuseCallback()
    with caplog.at_level(logging.WARNING, logger="deltafuse"):
        callback.on_init_end(args, None, None, model=build_model("tiny"))
    assert args.n_gpu == 1 and args.train_batch_size == args.per_device_train_batch_size
    assert "this process sees 2 GPUs; training on the first only instead of torch.nn.DataParallel" in caplog.text
    assert "torchrun --nproc_per_node 2" in caplog.text
    args._n_gpu = 1
    caplog.clear()
    callback.on_init_end(args, None, None, model=build_model("tiny"))
    assert args.n_gpu == 1 and not caplog.text
