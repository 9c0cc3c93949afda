"""The Trainer of `deltafuse train` (``steps.py``): the NaN / inf filter on the device logs what transformers' own
filter logs and trains the same weights; the collator's token counts add up to the data's tokens."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from deltafuse.train import packing, steps
from deltafuse.train.cli import main
from tests.helpers import input_gen, input_seed


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int):
        g = input_gen(1)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


class _Regression(torch.nn.Module):
    """A linear model whose loss is NaN or inf for the rows named in ``bad`` (the value only: the gradient is
    the finite loss's, so the weights stay comparable)."""

    def __init__(self, width: int, bad: dict[int, float]):
        super().__init__()
        torch.manual_seed(input_seed(0))
        self.lin = torch.nn.Linear(width, 1)
        self.bad = bad

    def forward(self, x, y, index, **kwargs):
        assert packing.TOKENS_KEY not in kwargs
        loss = ((self.lin(x).squeeze(-1) - y) ** 2).mean()
        poison = sum(self.bad.get(int(i), 0.0) for i in index)
        return {"loss": loss + torch.tensor(poison).detach()}


def _train(tmp_path, name: str, trainer_cls, bad, *, accumulate: int, nan_filter: bool, tokens: bool = False,
           log_every: int = 1):
    from transformers import TrainingArguments

    model = _Regression(5, bad)
    seen: list[bool] = []

    class Probe(trainer_cls):
        def prediction_step(self, *a, **kw):  # inside the evaluation loop
            seen.append(self.args.logging_nan_inf_filter)
            return super().prediction_step(*a, **kw)

    def collate(rows):
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        if tokens:
            batch[packing.TOKENS_KEY] = 3 * len(rows)
        return batch

    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=6, per_device_train_batch_size=1,
                             gradient_accumulation_steps=accumulate, learning_rate=0.05, logging_steps=log_every,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                             logging_nan_inf_filter=nan_filter, remove_unused_columns=False, seed=0,
                             dataloader_num_workers=0, eval_strategy="no",
                             include_num_input_tokens_seen="no")
    trainer = Probe(model=model, args=args, train_dataset=_Rows(12, 5), eval_dataset=_Rows(2, 5),
                    data_collator=collate)
    trainer.train()
    trainer.evaluate()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, model.lin.weight.detach().clone(), seen, trainer


def _same(a: list[float], b: list[float]) -> bool:
    # the same additions in the same order on both sides: equal to the bit (NaN equal to NaN)
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


@pytest.mark.parametrize("accumulate,log_every", [(1, 1), (2, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("nan_filter", [True, False])
def test_device_nan_filter_logs_what_the_trainer_logs(tmp_path, accumulate, log_every, nan_filter):
    """Rows 2, 6, 9 (NaN) and 5 (inf) poison their micro-batches' losses. The logged losses and the trained weights
    equal the stock Trainer's, with its filter on (a non-finite loss replaced by the sum of the losses since the last
    log over the steps since then, counting this one: 0 right after a log) and off (NaN from then on, as
    transformers logs). Logging every step (as `deltafuse train` does) and every 2 or 3 steps."""
    from transformers import Trainer

    bad = {2: float("nan"), 5: float("inf"), 6: float("nan"), 9: float("nan")}
    kw = dict(accumulate=accumulate, nan_filter=nan_filter, log_every=log_every)
    stock, w_stock, _, _ = _train(tmp_path, "stock", Trainer, bad, **kw)
    ours, w_ours, seen, trainer = _train(tmp_path, "ours", steps.trainer_class(Trainer, host_tokens=False), bad, **kw)
    assert len(stock) == 6 // log_every and _same(stock, ours), (stock, ours)
    assert any(math.isnan(x) or math.isinf(x) for x in stock) is not nan_filter  # the case does exercise the filter
    torch.testing.assert_close(w_ours, w_stock, rtol=0, atol=0)
    # evaluation reads the user's setting, and the Trainer's own training-loop test stays off
    assert seen == [nan_filter] and trainer.args.logging_nan_inf_filter is False


def test_host_token_counts_leave_the_batch(tmp_path):
    from transformers import Trainer

    _, _, _, trainer = _train(tmp_path, "tok", steps.trainer_class(Trainer, host_tokens=True), {}, accumulate=2,
                              nan_filter=True, tokens=True)
    assert trainer.state.num_input_tokens_seen == 6 * 2 * 3  # 6 steps of 2 micro-batches of 3 counted tokens


def test_packed_collator_counts_the_real_tokens():
    bins = [[{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}],
            [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}]]
    batch = packing.PackedCollator(pad_token_id=0, row_tokens=6, count_tokens=True)(bins)
    assert batch["input_ids"].shape == (1, 12) and batch[packing.TOKENS_KEY] == 9  # 3 filler tokens not counted
    padded = packing.PaddedCollator(0, count_tokens=True)([b[0] for b in bins])
    assert padded[packing.TOKENS_KEY] == int(padded["attention_mask"].sum()) == 7
    assert packing.TOKENS_KEY not in packing.PackedCollator()(bins)


def test_deltafuse_train_counts_every_token_of_an_epoch(tmp_path):
    """One epoch (22 bins, two per step): the steps' token counts add up to the data's tokens."""
    out = str(tmp_path / "run")
    assert main(["--model", "tiny", "--max-steps", "11", "--batch-size", "2", "--seq-len", "512", "--num-examples",
                 "40", "--output-dir", out, "--no-progress"]) == 0
    with open(os.path.join(out, "summary.json")) as fh:
        data = json.load(fh)["data"]
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    assert len(recs) == 11 and all(r["tokens"] > 0 for r in recs)
    assert sum(r["tokens"] for r in recs) == data["tokens"]
