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


def test_trainer_refusing_a_setup_is_one_line(tmp_path):
    """A process of its own: transformers' logger keeps the stderr of the test that first imported it."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "deltafuse.train", "--output-dir", str(out), "--max-steps", "2",
                           *TINY, "--fsdp", "full_shard"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    # transformers' own words differ by version ("Using fsdp only works in distributed training." from 5.10 on,
    # accelerate's "There are currently no available devices found ..." before)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("deltafuse train: error: transformers' Trainer refuses this setup (--fsdp full_shard): ")
    assert "distributed training" in last or "no available devices" in last, last
    assert not out.exists()


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
    from deltafuse.bench import e2e

    args = e2e.train_parser().parse_args(["--max-steps", "3", "--gradient_accumulation_steps", "4",
                                          "--report_to", "tensorboard", "wandb"])
    fwd = e2e.forward_train_args(args)
    assert fwd[-5:] == ["--gradient_accumulation_steps", "4", "--report_to", "tensorboard", "wandb"] or (
        fwd[-5:] == ["--report_to", "tensorboard", "wandb", "--gradient_accumulation_steps", "4"])
    again = e2e.train_parser().parse_args(fwd)
    assert vars(again) == vars(args)
