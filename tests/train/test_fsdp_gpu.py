"""`deltafuse train --fsdp full_shard` on two GPUs (torchrun): FSDP2 really shards, and the run equals one GPU
training the same global batch (fp32, so equality is tight): LoRA and full fine-tuning, a dense and an MoE
model, FSDP's activation checkpointing, and a resumed run equal to an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]
BASE = ["--seq-len", "256", "--num-examples", "80", "--dtype", "fp32", "--no-progress"]


def train(out: str, *argv: str, gpus: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if gpus > 1 else []
    proc = subprocess.run([sys.executable, *launch, "-m", "deltafuse.train", "--output-dir", out, *BASE, *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def assert_same_run(got: list[dict], ref: list[dict], rtol: float = 1e-4):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= rtol * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 10 * rtol * abs(b["grad_norm"]) + 1e-6, (a, b)


@pytest.mark.parametrize("model, mode", [("tiny", "--lora"), ("tiny", "--full"), ("tiny-moe", "--full")])
def test_fsdp2_on_two_gpus_equals_one_gpu_with_the_same_global_batch(tmp_path, model, mode):
    args = ["--model", model, mode, "--max-steps", "4"]
    one = train(str(tmp_path / "one"), *args, "--batch-size", "2", gpus=1)
    out = str(tmp_path / "fsdp")
    two = train(out, *args, "--batch-size", "1", "--fsdp", "full_shard", gpus=2)
    s = summary(out)
    assert s["world_size"] == 2 and s["distributed_type"] == "DistributedType.FSDP", s
    assert s["wrapped_model"] == "FSDPModule" or s["wrapped_model"].startswith("FSDP"), s["wrapped_model"]
    assert s["fsdp_config"]["version"] == 2
    assert_same_run(two, one)
    assert os.path.isdir(os.path.join(out, "final"))


def test_fsdp2_activation_checkpointing_and_resume(tmp_path):
    args = ["--model", "tiny", "--max-steps", "6", "--save-every", "3", "--batch-size", "1", "--fsdp", "full_shard"]
    out = str(tmp_path / "plain")
    straight = train(out, *args, gpus=2)
    checkpointed = train(str(tmp_path / "ckpt"), *args, "--gradient-checkpointing", gpus=2)
    assert summary(str(tmp_path / "ckpt"))["fsdp_config"]["activation_checkpointing"] is True
    assert_same_run(checkpointed, straight)
    shutil.rmtree(os.path.join(out, "checkpoint-6"))
    shutil.rmtree(os.path.join(out, "final"))
    resumed = train(out, *args, "--resume", gpus=2)
    assert summary(out)["resumed_from"].endswith("checkpoint-3")
    assert_same_run(resumed[3:], straight[3:])


def test_one_process_that_sees_two_gpus_trains_on_one_and_says_so(tmp_path):
    """Without a launcher the Trainer would replicate the model with torch.nn.DataParallel."""
    out = str(tmp_path / "one")
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="0,1")
    proc = subprocess.run([sys.executable, "-m", "deltafuse.train", "--output-dir", out, "--model", "tiny",
                           "--max-steps", "2", *BASE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("this process sees 2 GPUs and trains on cuda:0 only; to train on all of them launch one process per GPU: "
            "torchrun --nproc_per_node 2 -m deltafuse.train ...") in proc.stdout
    assert summary(out)["wrapped_model"] == "PeftModelForCausalLM"
