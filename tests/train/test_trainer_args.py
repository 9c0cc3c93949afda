"""transformers' TrainingArguments pass through `deltafuse train` (--field_name VALUE); deltafuse's own settings
cannot be given twice; bad values and combinations are one line, exit 2, before the model is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deltafuse.train import setup
from deltafuse.train.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--seq-len", "128", "--num-examples", "12", "--no-progress", "--no-deltafuse"]


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("argv, needle", [
    (["--learning_rate", "1e-3"], "--learning_rate is set by `deltafuse train` itself: pass --lr instead"),
    (["--max_steps", "3"], "--max_steps is set by `deltafuse train` itself: pass --max-steps instead"),
    (["--per_device_train_batch_size", "2"], "pass --batch-size instead"),
    (["--output_dir", "x"], "pass --output-dir instead"),
    (["--bf16"], "--bf16 is set by `deltafuse train` itself: pass --dtype instead"),
    (["--logging_steps", "5"], "--logging_steps is fixed by `deltafuse train` (one metrics record per step"),
    (["--weight_decay", "abc"], "argument --weight_decay/--weight-decay: invalid float value: 'abc'"),
    (["--eval_strategy", "sometimes"], "invalid choice: 'sometimes'"),
    (["--eval_strategy", "steps", "--eval_steps", "1"], "--eval_strategy steps needs held-out rows: pass "
                                                        "--eval-data JSONL"),
    (["--gradient_accumulation_steps", "2", "--eval_data", "x"], "unrecognized arguments: --eval_data x"),
])
def test_refused_trainer_arguments_are_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(setup, "load_model_and_tokenizer",
                        lambda *a, **k: pytest.fail("the model was built before the input was refused"))
    out = tmp_path / "out"
    try:
        rc = main(["--output-dir", str(out), "--max-steps", "2", *TINY, *argv])
    except SystemExit as exc:  # argparse's own refusal (an unknown option): its usage line and exit 2
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert needle in err.strip().splitlines()[-1], err
    assert not out.exists()


def test_trainer_refusing_a_setup_is_one_line(tmp_path, monkeypatch, capsys):
    """A setting that transformers' Trainer itself refuses when it is built is one line naming the flags given."""
    import transformers

    def refuse(self, *args, **kwargs):
        raise ValueError("Using fsdp only works in distributed training.\n(second line)")

    monkeypatch.setattr(transformers.Trainer, "__init__", refuse)
    out = tmp_path / "out"
    rc = main(["--output-dir", str(out), "--max-steps", "2", *TINY, "--weight_decay", "0.1"])
    last = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(last) == 1, last
    assert last[0] == ("deltafuse train: error: transformers' Trainer refuses this setup (--weight_decay 0.1): "
                       "Using fsdp only works in distributed training. (second line)")
    assert not out.exists()


def test_fsdp_on_cpu_is_refused_before_anything_is_built(tmp_path):
    """accelerate shards on accelerators only: on CPU the launch would train unsharded (DDP) under --fsdp."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "deltafuse.train", "--output-dir", str(out), "--max-steps", "2",
                           *TINY, "--fsdp", "full_shard"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "deltafuse train: error: --fsdp full_shard: FSDP needs GPUs (accelerate shards on accelerators only; on "
        "cpu this launch would train unsharded with DDP); leave --fsdp out on CPU")
    assert not out.exists()


def test_fsdp_in_one_process_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(setup, "training_device", lambda: "cuda")
    monkeypatch.setattr(setup, "load_model_and_tokenizer",
                        lambda *a, **k: pytest.fail("the model was built before the input was refused"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "out"
    assert main(["--output-dir", str(out), "--max-steps", "2", *TINY, "--fsdp", "full_shard"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "deltafuse train: error: --fsdp full_shard: FSDP shards across several processes, this is one "
        "(WORLD_SIZE=1); launch with torchrun --nproc_per_node N -m deltafuse.train ... or accelerate launch")
    assert not out.exists()


def _parsed(argv):
    import argparse

    from deltafuse.train.cli import add_arguments
    from deltafuse.train.trainer import resolve_defaults

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    resolve_defaults(args)
    return args


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_defaults_to_fsdp2_with_its_own_activation_checkpointing(tmp_path, checkpointing):
    """Without --fsdp_config: FSDP2 on every transformers version (5.2-5.19 default to FSDP1), and
    --gradient-checkpointing as FSDP's activation checkpointing instead of the Trainer's."""
    from deltafuse.train.trainargs import training_arguments

    argv = ["--output-dir", str(tmp_path / "o"), "--fsdp", "full_shard"]
    args = _parsed(argv + (["--gradient-checkpointing"] if checkpointing else []))
    targs = training_arguments(args, "cpu", torch.float32, evaluating=False)
    assert targs.fsdp_config["version"] == 2
    assert bool(targs.fsdp_config["activation_checkpointing"]) is checkpointing
    trainer_own = getattr(targs, "activation_checkpointing", None) or targs.gradient_checkpointing
    assert not trainer_own


def test_fsdp_with_its_own_config_and_gradient_checkpointing_is_refused(tmp_path):
    from deltafuse.train.errors import TrainInputError
    from deltafuse.train.trainargs import training_arguments

    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"version": 2}))
    args = _parsed(["--output-dir", str(tmp_path / "o"), "--fsdp", "full_shard", "--fsdp_config", str(cfg),
                    "--gradient-checkpointing"])
    with pytest.raises(TrainInputError, match=r'^--gradient-checkpointing with --fsdp_config: set '
                                              r'"activation_checkpointing": true in the FSDP config instead'):
        training_arguments(args, "cpu", torch.float32, evaluating=False)


def test_trainer_arguments_reach_the_trainer(tmp_path, capsys):
    """Gradient accumulation (a step sees the tokens of two micro-batches: the reference run's two steps),
    weight decay, optimizer options and evaluation during training, all from transformers' own flags."""
    rows = [json.dumps({"prompt": f"{i} + {i + 1} = ", "completion": f"{2 * i + 1}"}) for i in range(8)]
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("\n".join(rows) + "\n")
    ref = str(tmp_path / "ref")
    assert main(["--output-dir", ref, "--max-steps", "4", *TINY]) == 0
    out = str(tmp_path / "ga")
    assert main(["--output-dir", out, "--max-steps", "2", *TINY, "--gradient_accumulation_steps", "2",
                 "--weight_decay", "0.1", "--adam_beta2", "0.95", "--report_to", "none",
                 "--no_dataloader_pin_memory", "--eval-data", str(eval_path), "--eval_strategy", "steps",
                 "--eval_steps", "1", "--per_device_eval_batch_size", "2"]) == 0
    text = capsys.readouterr().out
    targs = torch.load(os.path.join(out, "checkpoint-2", "training_args.bin"), weights_only=False)
    assert (targs.gradient_accumulation_steps, targs.weight_decay, targs.adam_beta2) == (2, 0.1, 0.95)
    assert targs.dataloader_pin_memory is False and targs.per_device_eval_batch_size == 2
    assert targs.learning_rate == 5e-3 and targs.logging_steps == 1  # deltafuse's own settings are kept
    ga, one = records(out), records(ref)
    assert [r["step"] for r in ga] == [1, 2]
    assert [r["tokens"] for r in ga] == [one[0]["tokens"] + one[1]["tokens"], one[2]["tokens"] + one[3]["tokens"]]
    with open(os.path.join(out, "summary.json")) as fh:
        s = json.load(fh)
    assert s["trainer_overrides"] == {"gradient_accumulation_steps": 2, "weight_decay": 0.1, "adam_beta2": 0.95,
                                      "report_to": "none", "dataloader_pin_memory": False,
                                      "eval_strategy": "steps", "eval_steps": 1.0, "per_device_eval_batch_size": 2}
    assert [e["step"] for e in s["eval"]] == [1, 2, 2]  # two during training, then the final evaluation
    assert all(0 < e["eval_loss"] < 20 for e in s["eval"])
    assert s["final_eval"]["eval_loss"] == s["eval"][-1]["eval_loss"]
    assert "eval at step 1 | loss " in text and "eval at step 2 | loss " in text


def test_bench_e2e_forwards_trainer_arguments():
    from deltafuse.bench import e2e_runs

    args = e2e_runs.train_parser().parse_args(["--max-steps", "3", "--gradient_accumulation_steps", "4",
                                               "--report_to", "tensorboard", "wandb"])
    fwd = e2e_runs.forward_train_args(args)
    assert fwd[-5:] == ["--gradient_accumulation_steps", "4", "--report_to", "tensorboard", "wandb"] or (
        fwd[-5:] == ["--report_to", "tensorboard", "wandb", "--gradient_accumulation_steps", "4"])
    again = e2e_runs.train_parser().parse_args(fwd)
    assert vars(again) == vars(args)


@pytest.mark.parametrize("family, layer", [("tiny", "Qwen3_5DecoderLayer"), ("tiny-moe", "Qwen3_5MoeDecoderLayer"),
                                           ("tiny-next", "Qwen3NextDecoderLayer")])
def test_fsdp_wraps_the_decoder_layers_the_model_has(tmp_path, family, layer):
    """A text-only model's _no_split_modules also names its vision block; accelerate refuses a name it cannot
    find in the model, so FSDP is told the layers that are there (in deltafuse's config or the user's)."""
    from deltafuse.models import build_model
    from deltafuse.train.trainargs import decoder_layer_classes, training_arguments

    model = build_model(family)
    layers = decoder_layer_classes(model)
    assert layers == [layer] and layer in model._no_split_modules
    args = _parsed(["--output-dir", str(tmp_path / "o"), "--fsdp", "full_shard"])
    targs = training_arguments(args, "cpu", torch.float32, evaluating=False, fsdp_layers=layers)
    assert targs.fsdp_config["transformer_layer_cls_to_wrap"] == [layer] and targs.fsdp_config["version"] == 2
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"version": 2, "reshard_after_forward": False}))
    args = _parsed(["--output-dir", str(tmp_path / "o"), "--fsdp", "full_shard", "--fsdp_config", str(own)])
    targs = training_arguments(args, "cpu", torch.float32, evaluating=False, fsdp_layers=layers)
    assert targs.fsdp_config["transformer_layer_cls_to_wrap"] == [layer]
    assert targs.fsdp_config["reshard_after_forward"] is False
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"version": 2, "transformer_layer_cls_to_wrap": ["Something"]}))
    args = _parsed(["--output-dir", str(tmp_path / "o"), "--fsdp", "full_shard", "--fsdp_config", str(named)])
    targs = training_arguments(args, "cpu", torch.float32, evaluating=False, fsdp_layers=layers)
    assert targs.fsdp_config["transformer_layer_cls_to_wrap"] == ["Something"]  # the user's choice stands


@pytest.mark.parametrize("text, reason", [("[1, 2]", "not a JSON object"), ("{", "Expecting property name")])
def test_an_fsdp_config_that_is_no_json_object_is_one_line(tmp_path, text, reason):
    from deltafuse.train.errors import TrainInputError
    from deltafuse.train.trainargs import training_arguments

    cfg = tmp_path / "fsdp.json"
    cfg.write_text(text)
    args = _parsed(["--output-dir", str(tmp_path / "o"), "--fsdp", "full_shard", "--fsdp_config", str(cfg)])
    with pytest.raises(TrainInputError, match=rf"^--fsdp_config '.*fsdp.json': cannot be read as a JSON object "
                                              rf"\({reason}"):
        training_arguments(args, "cpu", torch.float32, evaluating=False, fsdp_layers=["Qwen3_5DecoderLayer"])
