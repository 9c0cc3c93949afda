"""`deltafuse train --context-parallel N`: refusals before the model loads, the sampler and collator that give
every rank of a group the same rows and its own shard of them, and two gloo processes against one process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deltafuse.train import context_parallel as cp
from deltafuse.train.cli import main
from deltafuse.train.data import IGNORE_INDEX
from tests.helpers import run_two_ranks
from tests.train.test_bad_input import fails

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- refusals: one line, exit 2, nothing built ------------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: every refusal here must come before it."""
    from deltafuse.train import setup

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr(setup, "load_model_and_tokenizer", load)


def cp_fails(monkeypatch, capsys, tmp_path, world, argv, *needles):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = str(tmp_path / "out")
    fails(["--num-examples", "8", "--seq-len", "64", "--output-dir", out, "--no-progress", *argv], capsys, *needles)
    assert not os.path.exists(out)


def test_process_count_not_a_multiple(no_model, monkeypatch, capsys, tmp_path):
    cp_fails(monkeypatch, capsys, tmp_path, 1, ["--context-parallel", "2"],
             "--context-parallel 2: the launch has 1 process(es) (WORLD_SIZE), not a multiple of 2",
             "torchrun --nproc_per_node 2")
    cp_fails(monkeypatch, capsys, tmp_path, 3, ["--context-parallel", "2"], "has 3 process(es)")
    cp_fails(monkeypatch, capsys, tmp_path, 4, ["--context-parallel", "3"], "has 4 process(es)", "multiple of 3")


def test_combinations_not_served(no_model, monkeypatch, capsys, tmp_path):
    cp_fails(monkeypatch, capsys, tmp_path, 2, ["--context-parallel", "2", "--no-deltafuse"],
             "--context-parallel 2 with --no-deltafuse", "allowed: deltafuse on")
    monkeypatch.setenv("DELTAFUSE_PATCH", "0")
    cp_fails(monkeypatch, capsys, tmp_path, 2, ["--context-parallel", "2"], "DELTAFUSE_PATCH off")
    monkeypatch.delenv("DELTAFUSE_PATCH")
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    cp_fails(monkeypatch, capsys, tmp_path, 2, ["--context-parallel", "2", "--eval-data", str(held_out)],
             "--context-parallel 2 with --eval-data")
    cp_fails(monkeypatch, capsys, tmp_path, 2, ["--context-parallel", "2", "--torch_compile", "true"],
             "--context-parallel 2 with --torch_compile")
    # with FSDP2 the fused loss runs inside lm_head's call (tests/integrations/test_context_parallel.py): the
    # combination is served where FSDP is (GPUs); on CPU FSDP alone is refused
    cp_fails(monkeypatch, capsys, tmp_path, 2, ["--context-parallel", "2", "--fsdp", "full_shard"],
             "--fsdp full_shard: FSDP needs GPUs")
    # several groups on CPU: gloo serves one only
    cp_fails(monkeypatch, capsys, tmp_path, 4, ["--context-parallel", "2"],
             "--context-parallel 2 with 4 processes on cpu", "allowed here: 2 processes")


def test_model_settings_not_served():
    from deltafuse.models import build_model
    from deltafuse.train.errors import TrainInputError

    model = build_model("tiny")
    cp.check_model(model, 2)
    model.config._attn_implementation = "eager"
    with pytest.raises(TrainInputError, match=r"--context-parallel 2: .*attention implementation is 'eager'.*"
                                              r"allowed: 'sdpa'"):
        cp.check_model(model, 2)
    moe = build_model("tiny-moe")
    moe.config.output_router_logits = True
    with pytest.raises(TrainInputError, match="output_router_logits is True"):
        cp.check_model(moe, 2)


# --- the sampler under accelerate's batch sharding ---------------------------------------------------------
@pytest.mark.parametrize("length,batch,size,replicas", [(11, 2, 2, 1), (11, 2, 2, 2), (7, 3, 3, 2), (5, 1, 2, 3),
                                                       (2, 4, 2, 2)])
def test_groups_get_the_batches_of_a_data_parallel_run(length, batch, size, replicas):
    """Through accelerate's BatchSamplerShard over all size * replicas processes, the ranks of a group get the same
    batches, and replica d those that rank d of a `replicas`-process run (accelerate's seeded sampler) gets."""
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler

    seed = int(torch.randint(0, 2**20, ()).item())
    world = size * replicas
    for epoch in range(2):
        got, want = [], []
        for r in range(world):  # each process has its own sampler
            sampler = cp.Sampler(length, batch, size, replicas, seed)
            sampler.set_epoch(epoch)
            got.append(list(BatchSamplerShard(BatchSampler(sampler, batch, False), num_processes=world,
                                              process_index=r)))
        for d in range(replicas):
            reference = SeedableRandomSampler(data_source=range(length), data_seed=seed)
            reference.set_epoch(epoch)
            want.append(list(BatchSamplerShard(BatchSampler(reference, batch, False), num_processes=replicas,
                                               process_index=d)))
        for r in range(world):
            assert got[r] == want[r // size], (epoch, r)
        assert all(len(b) == batch for b in got[0]) and len(got[0]) == len(want[0])
        assert len(sampler) == sum(len(b) for b in got[0]) * world
        seen = sorted({i for d in range(replicas) for b in want[d] for i in b})
        assert seen == list(range(length))  # every row in every epoch


# --- the collator ------------------------------------------------------------------------------------------
def _check_shards(rows_in, shards, size, width):
    whole = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("input_ids", "labels", "position_ids")}
    B, T = rows_in["input_ids"].shape
    assert whole["input_ids"].shape == (B, width)
    for r, s in enumerate(shards):
        meta = s[cp.META].tolist()
        assert meta[cp.WIDTH] == width and meta[cp.START] == r * width // size and meta[cp.LENGTH] == width // size
        assert meta[cp.DIGEST] == shards[0][cp.META][cp.DIGEST].item()
        assert meta[cp.TARGETS] == int((whole["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert torch.equal(whole["input_ids"][:, :T], rows_in["input_ids"])
    fill = whole["position_ids"][:, T:]
    assert torch.equal(fill, torch.arange(width - T).expand(B, width - T))  # a sequence of its own, from 0
    assert bool((whole["labels"][:, T:] == IGNORE_INDEX).all()) and bool((whole["input_ids"][:, T:] == 0).all())
    return whole


@pytest.mark.parametrize("size", [2, 3])
def test_packed_rows_are_filled_and_cut(size):
    from deltafuse.train.packing import PackedCollator

    lengths = [int(n) for n in torch.randint(1, 9, (5,))]
    examples = [{"input_ids": torch.randint(5, 50, (n,)).tolist(), "labels": torch.randint(5, 50, (n,)).tolist()}
                for n in lengths]
    base = PackedCollator()
    rows = base([examples])
    T = sum(lengths)
    width = -(-T // size) * size
    shards = [cp.ShardCollator(base, size, r, pad_token_id=0)([examples]) for r in range(size)]
    whole = _check_shards(rows, shards, size, width)
    assert torch.equal(whole["position_ids"][:, :T], rows["position_ids"])
    assert torch.equal(whole["labels"][:, :T], rows["labels"])
    # at least kernel - 1 tokens per rank: a longer fill
    shards = [cp.ShardCollator(base, size, r, pad_token_id=0, min_shard=T)([examples]) for r in range(size)]
    _check_shards(rows, shards, size, T * size)


def test_right_padding_becomes_a_pad_sequence():
    from deltafuse.train.packing import PaddedCollator

    lengths = [7, 3, 5]
    examples = [{"input_ids": torch.randint(5, 50, (n,)).tolist(), "labels": torch.randint(5, 50, (n,)).tolist()}
                for n in lengths]
    base = PaddedCollator(pad_token_id=0)
    rows = base(examples)
    shards = [cp.ShardCollator(base, 2, r, pad_token_id=0)(examples) for r in range(2)]
    whole = _check_shards(rows, shards, 2, 8)
    for b, n in enumerate(lengths):
        positions = whole["position_ids"][b]
        assert positions[:n].tolist() == list(range(n))  # the example
        assert positions[n:7].tolist() == list(range(7 - n))  # its padding: another sequence, from 0
        assert whole["labels"][b, :n].tolist() == examples[b]["labels"]
        assert bool((whole["labels"][b, n:] == IGNORE_INDEX).all())
    left = {"input_ids": rows["input_ids"], "labels": rows["labels"], "attention_mask": rows["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="not right padding"):
        cp.whole_rows(left, 2, 0)


# --- two gloo processes against one process ----------------------------------------------------------------
def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.slow  # two processes; the context-parallel model runs on the newest transformers (the full run)
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("flags,width", [
    (["--seq-len", "129", "--batch-size", "1"], 130),  # one packed bin of 129 tokens: a pad token fills the row
    (["--no-packing", "--batch-size", "2", "--seq-len", "161", "--gradient_accumulation_steps", "2"], None),
])
def test_two_ranks_train_as_one_process(tmp_path, flags, width):
    """The first two steps' loss and gradient norm (the second step's loss follows from the first step's
    gradients) equal one process on the same rows; the rows were split between the two ranks."""
    seed = str(int(torch.randint(0, 2**20, ()).item()))
    common = ["--model", "tiny", "--max-steps", "2", "--num-examples", "24", "--seed", seed, "--log-every", "1",
              "--no-progress", "--deltafuse", *flags]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = str(tmp_path / "cp")
    stdout = run_two_ranks(["-m", "deltafuse.train", *common, "--context-parallel", "2", "--output-dir", out],
                  log_dir=str(tmp_path / "logs"), env=env, cwd=ROOT, timeout=300)
    one = str(tmp_path / "one")
    assert main([*common, "--output-dir", one]) == 0
    got, want = _records(out), _records(one)
    assert [r["step"] for r in got] == [1, 2]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (key, g, w)
        assert g["tokens"] == w["tokens"]  # the shards' tokens, summed over the ranks
    with open(os.path.join(out, "summary.json")) as fh:
        s = json.load(fh)
    shards = s["context_parallel"]["first_step_shards"]
    assert s["context_parallel"]["size"] == 2 and s["context_parallel"]["data_parallel_size"] == 1
    row = shards[0]["row_tokens"]
    if width is not None:
        assert row == width
    assert [(x["rank"], x["start"], x["tokens"]) for x in shards] == [(0, 0, row // 2), (1, row // 2, row // 2)]
    assert len(s["peak_mem_bytes_per_rank"]) == 2 and s["wrapped_model"] == "DistributedDataParallel"
    assert "context parallel: 2 ranks x 1 data-parallel replica(s)" in stdout[0]
