"""`deltafuse train` end to end on the tiny CPU model: loss falls, outputs, resume, full FT, local dirs, DDP
(torchrun and accelerate launch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from deltafuse.train.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"^step +(\d+)/(\d+) \| loss [\d.]+ \| grad norm [\d.]+ \| [\d,]+ tok/s \| step [\d.]+ s \| "
                  r"peak mem [\d.]+ (MiB|GiB)$", re.M)


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def summary(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as fh:
        return json.load(fh)


def stock_gdn_function():
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    return m.torch_chunk_gated_delta_rule


def test_lora_training_on_tiny_loss_falls_logs_and_saves(tmp_path, capsys):
    out = str(tmp_path / "run")
    before = stock_gdn_function()
    rc = main(["--model", "tiny", "--max-steps", "30", "--seq-len", "512", "--num-examples", "200",
               "--output-dir", out, "--log-every", "10", "--no-progress", "--deltafuse"])
    assert rc == 0
    assert stock_gdn_function() is before  # what deltafuse patched for the run is reverted afterwards
    text = capsys.readouterr().out
    assert [m.group(1) for m in LINE.finditer(text)] == ["10", "20", "30"], text
    recs = records(out)
    assert [r["step"] for r in recs] == list(range(1, 31))
    losses = [r["loss"] for r in recs]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first - last > 0.2, f"loss did not fall: first 5 steps {first:.4f}, last 5 {last:.4f}"
    assert all(r["tokens"] > 0 and r["step_time_s"] > 0 and r["grad_norm"] > 0 for r in recs)
    assert os.path.isfile(os.path.join(out, "final", "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(out, "final", "tokenizer.json"))
    assert os.path.isfile(os.path.join(out, "checkpoint-30", "optimizer.pt"))
    s = summary(out)
    assert s["deltafuse"]["enabled"] is True and s["deltafuse"]["applied_rows"] > 0
    assert s["mode"] == "lora" and s["dtype"] == "float32" and s["packing"] is True
    assert 0 < s["trainable_parameters"] < s["total_parameters"]


def test_resume_continues_the_same_run(tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["--model", "tiny", "--max-steps", "6", "--save-every", "3", "--seq-len", "256", "--num-examples",
            "60", "--output-dir", out, "--no-progress", "--no-deltafuse"]
    assert main(args) == 0
    straight = records(out)
    shutil.rmtree(os.path.join(out, "checkpoint-6"))
    shutil.rmtree(os.path.join(out, "final"))
    assert main(args + ["--resume"]) == 0
    assert "resuming from " + os.path.join(out, "checkpoint-3") in capsys.readouterr().out
    resumed = records(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight[3:], resumed[3:]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, (a, b)
    assert summary(out)["resumed_from"].endswith("checkpoint-3")
    # nothing to do: the latest checkpoint is already at --max-steps
    assert main(args + ["--resume"]) == 2
    assert "is at step 6, which is not below --max-steps 6" in capsys.readouterr().err


def test_full_finetuning_saves_a_model_that_trains_again_from_its_directory(tmp_path):
    out = str(tmp_path / "full")
    assert main(["--model", "tiny", "--full", "--max-steps", "12", "--seq-len", "256", "--num-examples", "60",
                 "--output-dir", out, "--no-progress", "--lr", "3e-3", "--gradient-checkpointing"]) == 0
    losses = [r["loss"] for r in records(out)]
    assert losses[-1] < losses[0] - 0.3
    final = os.path.join(out, "final")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(final))
    s = summary(out)
    assert s["trainable_parameters"] == s["total_parameters"] and s["gradient_checkpointing"] is True
    out2 = str(tmp_path / "again")
    assert main(["--model", final, "--max-steps", "2", "--seq-len", "256", "--num-examples", "20",
                 "--output-dir", out2, "--no-progress"]) == 0
    assert summary(out2)["model_description"].endswith("(local)")


def test_tiny_moe_with_expert_lora_and_no_packing(tmp_path):
    out = str(tmp_path / "moe")
    assert main(["--model", "tiny-moe", "--lora-experts", "--no-packing", "--batch-size", "2", "--max-steps", "2",
                 "--seq-len", "256", "--num-examples", "20", "--output-dir", out, "--no-progress"]) == 0
    with open(os.path.join(out, "final", "adapter_config.json")) as fh:
        cfg = json.load(fh)
    assert sorted(cfg["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert summary(out)["packing"] is False


def _assert_two_process_ddp_run(launcher: list[str], out: str) -> None:
    """``python -m <launcher> -m deltafuse.train`` for 2 steps: both processes train one model that the Trainer
    wraps in DistributedDataParallel."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", *launcher, "-m", "deltafuse.train", "--max-steps", "2", "--seq-len",
                           "256", "--num-examples", "20", "--output-dir", out, "--no-progress"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = summary(out)
    assert s["world_size"] == 2 and s["wrapped_model"] == "DistributedDataParallel"
    assert len(records(out)) == 2


def test_ddp_with_two_cpu_processes(tmp_path):
    """torchrun with 2 gloo processes: the Trainer wraps the model in DistributedDataParallel."""
    _assert_two_process_ddp_run(["torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                                str(tmp_path / "ddp"))


def test_accelerate_launch_with_two_cpu_processes(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU machine (gloo): the same DDP run."""
    pytest.importorskip("accelerate")
    with socket.socket() as sock:  # a free port: another run of the suite may be launching at the same time
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _assert_two_process_ddp_run(["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                                 "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
                                 "--dynamo_backend", "no"], str(tmp_path / "acc"))


def test_library_call_reports_through_logging_not_stdout(tmp_path, capsys, caplog):
    import argparse
    import logging

    from deltafuse.train.cli import add_arguments
    from deltafuse.train.trainer import train

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-steps", "2", "--log-every", "1", "--seq-len", "128", "--num-examples", "10",
                              "--output-dir", str(tmp_path / "lib"), "--no-progress", "--no-deltafuse"])
    with caplog.at_level(logging.INFO, logger="deltafuse.train"):
        s = train(args)
    assert capsys.readouterr().out == ""
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("deltafuse.train."))
    assert [m.group(1) for m in LINE.finditer(text)] == ["1", "2"], text
    assert "deltafuse: OFF (stock transformers)" in text and "done: 2 steps" in text
    assert s["steps_run"] == 2


def test_stock_run_with_fla_installed_on_a_cpu_box_uses_transformers_torch_functions(tmp_path):
    """--no-deltafuse: stock picks FLA / causal-conv1d whenever they import, and their kernels cannot run on a
    CPU-only machine; the run trains with transformers' pure-torch functions and says so."""
    from tests.test_verify import _new_design, stock_runs_torch_off_its_devices, write_standins

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAFUSE_", "TWINKLE_NPU_"))}
    env["PYTHONPATH"] = os.pathsep.join([root, write_standins(tmp_path / "site")])
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "deltafuse", "train", "--model", "tiny", "--no-deltafuse",
                           "--max-steps", "2", "--num-examples", "16", "--seq-len", "128", "--no-progress",
                           "--output-dir", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = summary(out)
    assert done["steps_run"] == 2
    if _new_design("qwen3_5") and stock_runs_torch_off_its_devices():  # 5.25+: stock runs torch on the CPU itself
        assert done["deltafuse"]["stock"] == "stock"
    elif _new_design("qwen3_5"):  # 5.15+ pick FLA at import; 5.2-5.14 only with CUDA available
        assert done["deltafuse"]["stock"] == "stock-torch"
        assert "FLA's kernels need a CUDA device" in " ".join(done["deltafuse"]["stock_reason"])
        assert "using transformers' own pure-torch functions" in proc.stdout
    else:
        assert done["deltafuse"]["stock"] == "stock"
