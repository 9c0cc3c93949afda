"""FSDP2 with deltafuse applied, two gloo processes on CPU: the loss and every gradient equal stock
transformers' run on one process over the same sequences, one at a time (so no state can cross a packed
boundary in the reference), and the fused loss runs (no logits) however lm_head is sharded."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deltafuse.models import build_model
from tests.helpers import run_two_ranks
from tests.integrations import assert_grads_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENGTHS = [[30, 18], [20, 28]]  # rank 0's row, rank 1's row: the same count of trained targets (46) each
sys.path.insert(0, os.path.join(ROOT, "tests", "integrations"))
from fsdp_worker import build  # noqa: E402  (the model the ranks build, LoRA included)


def stock_per_sequence(family: str, seed: int, rows: list[torch.Tensor], lora: str | None = None):
    """Stock model, one sequence per call: the mean loss over every trained target and its gradients."""
    model = build(family, seed, lora)
    total, count = 0.0, 0
    for ids, lengths in zip(rows, LENGTHS):
        start = 0
        for n in lengths:
            seq = ids[start:start + n][None]
            start += n
            total = total + model(input_ids=seq, labels=seq).loss * (n - 1)
            count += n - 1
    loss = total / count
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def run_ranks(tmp_path, family: str, seed: int, wraps: dict | None = None, device: str = "cpu") -> tuple[list, dict]:
    vocab = build_model(family).config.vocab_size
    rows = [torch.randint(0, vocab, (sum(lengths),)) for lengths in LENGTHS]
    out = str(tmp_path / "fsdp.pt")
    torch.save({"rows": rows, "lengths": LENGTHS, **({"wraps": wraps} if wraps else {})}, out + ".data")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", FSDP_WORKER_DEVICE=device)
    run_two_ranks([os.path.join(ROOT, "tests", "integrations", "fsdp_worker.py"), family, str(seed), out],
                  log_dir=str(tmp_path / "logs"), env=env, cwd=ROOT)
    return rows, torch.load(out)


def assert_equal_stock(got: dict, ref_loss: float, ref_grads: dict, name: str, head_rtol: float | None = None) -> None:
    """Loss within 1e-5, every gradient within the stock-vs-deltafuse fp32 bound (RTOL: the GDN kernels sum in
    another order), and with ``head_rtol`` those of lm_head and the final norm (next to the loss; trained unless
    LoRA leaves lm_head out) within it."""
    assert got["param_types"] == ["DTensor"], (name, got["param_types"])  # really sharded
    assert got["logits"] is None, name  # the fused loss ran: stock's path returns the logits
    assert abs(got["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (name, got["loss"], ref_loss)
    assert sorted(got["grads"]) == sorted(ref_grads), name
    assert_grads_close(got["grads"], ref_grads)
    near = [n for n in ref_grads if "lm_head" in n or n.endswith("model.norm.weight")]  # none: LoRA off the head
    if head_rtol is not None and near:
        assert_grads_close({n: got["grads"][n] for n in near}, {n: ref_grads[n] for n in near}, rtol=head_rtol)


@pytest.mark.slow  # two processes each; the full run only
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("family", ["tiny", "tiny-moe"])
def test_fsdp2_two_processes_equal_stock_on_one(tmp_path, family):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    rows, results = run_ranks(tmp_path, family, seed)
    ref_loss, ref_grads = stock_per_sequence(family, seed, rows)
    for order, got in results.items():
        assert_equal_stock(got, ref_loss, ref_grads, order)


# lm_head's own FSDP2 module (resharded after forward: gathered for the forward and again for the backward),
# accelerate's [final norm, lm_head] group (not resharded after forward: gathered once), lm_head in the model's
# group; full fine-tuning (lm_head's gradient through the reduce-scatter) and LoRA (on lm_head too).
WRAPS = {
    "tiny": {"head": {"wrap": "head"}, "tail": {"wrap": "tail"}, "root": {"wrap": "root"},
             "tail, LoRA on lm_head": {"wrap": "tail", "lora": "head"}},
    "tiny-moe": {"head, LoRA": {"wrap": "head", "lora": "layers"},
                 "head, LoRA on lm_head": {"wrap": "head", "lora": "head"}},
}
GATHERS = {"head": 2, "tail": 1, "root": None}  # stock's all-gathers of lm_head's group per step


@pytest.mark.slow  # two processes each; the full run only
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("family", list(WRAPS))
def test_fused_loss_runs_on_an_fsdp2_lm_head_and_equals_stock_on_one(tmp_path, family):
    """The fused loss runs inside lm_head's own FSDP2 call: no logits, lm_head's group gathered as often as for
    stock's call (no extra all-gather), loss and every gradient equal to stock on one process."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    rows, results = run_ranks(tmp_path, family, seed, WRAPS[family])
    refs = {}
    for name, case in WRAPS[family].items():
        got = results[name]
        if case.get("lora") not in refs:
            refs[case.get("lora")] = stock_per_sequence(family, seed, rows, case.get("lora"))
        ref_loss, ref_grads = refs[case.get("lora")]
        assert got["head_type"].startswith("FSDP") == (case["wrap"] != "root"), (name, got["head_type"])
        assert got["head_gathers"] == GATHERS[case["wrap"]], (name, got["head_gathers"])
        if case.get("lora") == "head":
            assert any("lm_head.lora_A" in n for n in ref_grads), name
        assert_equal_stock(got, ref_loss, ref_grads, name, head_rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fused_loss_runs_on_an_fsdp2_lm_head_on_two_gpus(tmp_path):
    """The same on two GPUs (NCCL, the GPU machine's torch): the fused loss runs on lm_head's own FSDP2 module and
    in accelerate's [final norm, lm_head] group, also under accelerate's bf16 policy (every FSDP module's output
    cast to bf16: the loss comes out in bf16, as stock's does from the model's output). fp32 against stock on the
    CPU within the GPU's fp32 rounding (TF32 products in the Triton kernels); bf16 within bf16 rounding."""
    family, seed = "tiny-moe", int(torch.randint(0, 2**31 - 1, ()).item())
    wraps = {"head": {"wrap": "head"}, "tail": {"wrap": "tail"},
             "tail, LoRA on lm_head": {"wrap": "tail", "lora": "head"},
             "tail, bf16 policy": {"wrap": "tail", "mixed": True}}
    rows, results = run_ranks(tmp_path, family, seed, wraps, device="cuda")
    refs = {lora: stock_per_sequence(family, seed, rows, lora) for lora in (None, "head")}
    for name, case in wraps.items():
        got = results[name]
        ref_loss, ref_grads = refs[case.get("lora")]
        assert got["head_type"].startswith("FSDP") and got["logits"] is None, (name, got["head_type"])
        assert got["head_gathers"] == GATHERS[case["wrap"]], (name, got["head_gathers"])
        mixed = case.get("mixed", False)
        assert got["loss_dtype"] == ("torch.bfloat16" if mixed else "torch.float32"), (name, got["loss_dtype"])
        assert abs(got["loss"] - ref_loss) <= (2e-2 if mixed else 2e-3) * abs(ref_loss), (name, got["loss"], ref_loss)
        assert_grads_close(got["grads"], ref_grads, rtol=1e-1 if mixed else 1e-2)
