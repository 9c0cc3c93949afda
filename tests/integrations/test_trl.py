"""TRL recipes with deltafuse applied: SFT (packed, padding-free), DPO and GRPO on tiny models, CPU, fp32.

Every recipe runs two optimizer steps twice from the same weights on the same batches: once as the reference
(stock transformers), once with ``deltafuse.apply(model)`` before the trainer is built, or with
``callbacks=[DeltafuseCallback()]`` (the two recipes the README gives). Compared: the logged loss of both steps and every trainable parameter's gradient of both steps (taken
just before the optimizer step; plain SGD without clipping, so step 2 starts from the same weights).

TRL (1.16) scores tokens with its own fused LM head (``trl.trainer.utils.add_fused_lm_head``: it runs the
model's backbone, which deltafuse patches, then projects the hidden states in tiles), so deltafuse's fused
cross-entropy is not what computes these losses; the tests check that deltafuse's GDN ops did serve.

Packed SFT: stock transformers cannot be the reference there (without flash-linear-attention it refuses the
``cu_seq_lens_q`` / ``seq_idx`` TRL's padding-free collator passes, or, on older versions, mixes the packed
sequences' states), so the reference trainer scores every packed sequence alone with the stock model. That
per-sequence run adds the same terms as deltafuse's packed one in other orders, and in some draws the second
step's gradients of both lie 1e-4 to 1e-3 from float64. So the packed runs' gradients are judged against a
float64 oracle of that reference run: deltafuse's must be no farther from it than stock's fp32 ones (see
``_assert_as_accurate``).

Every run draws fresh texts, weights and LoRA adapters (tests/helpers.py ``input_gen`` / ``input_seed``).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl", reason="trl is in deltafuse's test extra (pip install -e '.[test]')")

from datasets import Dataset  # noqa: E402  (a dependency of trl)

from deltafuse import patching  # noqa: E402
from deltafuse.maps import PATCHER  # noqa: E402
from deltafuse.integrations.trainer import DeltafuseCallback  # noqa: E402
from deltafuse.models import build_model  # noqa: E402
from deltafuse.train.tokenizer import build_byte_tokenizer  # noqa: E402
from tests.helpers import Float64Everywhere, float64_copy, input_gen, input_seed  # noqa: E402
from tests.integrations import assert_same_objects, snapshot  # noqa: E402
from tests.integrations.test_trainer_switch import (STEPS, assert_as_accurate, assert_same_training,  # noqa: E402
                                                     grad_recorder, lora, op_calls,  # noqa: F401 (op_calls: a fixture)
                                                     training_args)

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

COMMON = {k: v for k, v in training_args("").items() if k not in ("output_dir", "per_device_train_batch_size")}


def _words(gen: torch.Generator, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz     .,"
    return "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (n,), generator=gen).tolist())


def _texts(seed: int, lengths) -> list[str]:
    gen = input_gen(seed)
    return [_words(gen, n) for n in lengths]


def _assert_same_training(got, ref):
    assert_same_training(got, ref, got.recorder.steps, ref.recorder.steps)


def _assert_as_accurate(got, ref, oracle):
    """``got`` (deltafuse) against ``ref`` (stock, fp32) and ``oracle`` (the same stock run in float64): the same
    logged loss as stock's (rel 1e-4) at both steps; at both steps every trainable gradient of deltafuse's as
    accurate as stock's (test_trainer_switch.py ``assert_as_accurate``: no farther from the oracle than twice
    stock's error of it plus 32 times stock's median error of the step, plus fp32 rounding).

    Measured on CPU with fresh weights and texts, transformers 5.25, 30 draws of each packed case: stock's errors up
    to 3e-4 at the second step, and up to 0.55 for tiny-moe's A_log (fp32 GDN gate gradients,
    tests/integrations/test_gradient_accuracy.py), where deltafuse's stay near 1e-6; one draw had deltafuse's
    second-step gradient of the first layer's qkv LoRA B at 1.4e-4 against stock's 1.3e-5 (the log ratio of the
    two errors over every parameter and draw: median -0.14 to +0.15 per case, 90th percentile +0.2 to +0.9).
    deltafuse's largest error at most 0.46 of the bound. g or beta scaled by 1 + 1e-3 inside the GDN gives errors of
    1e-3 - 6e-3 against medians of 3e-6, beta by 1 + 1e-4 6e-4."""
    assert_as_accurate(got, ref, got.recorder.steps, ref.recorder.steps, oracle.recorder.steps)


# --- SFT, packed and padding-free ----------------------------------------------------------------------------

def _per_sequence_sft_trainer_cls():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from trl import SFTTrainer

    class PerSequenceSFTTrainer(SFTTrainer):
        """The reference: every sequence of the packed row run alone through the stock backbone, its logits
        projected in full and scored by ``F.cross_entropy``; the loss normalised like ``SFTTrainer.compute_loss``
        (sum of token losses / tokens in the batch), plus, for MoE models, the router load-balancing loss over
        all tokens of the batch (TRL's ``aux_loss``)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            config = base.config.get_text_config()
            ids, labels, cu = inputs["input_ids"], inputs["labels"], inputs["cu_seq_lens_q"].tolist()
            assert ids.shape[0] == 1 and cu[-1] == ids.shape[1]
            total, count, routers = 0.0, 0, []
            for start, end in zip(cu[:-1], cu[1:]):
                out = base.base_model(input_ids=ids[:, start:end], use_cache=False,
                                      output_router_logits=self.aux_loss_enabled)
                logits = base.lm_head(out.last_hidden_state)[0, :-1]
                target = labels[0, start + 1:end]
                total = total + torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
                count += int((target != -100).sum())
                if self.aux_loss_enabled:
                    routers.append(out.router_logits)
            self.seen_sequences.append(len(cu) - 1)
            loss = total / (count if num_items_in_batch is None else num_items_in_batch)
            if self.aux_loss_enabled:
                per_layer = tuple(torch.cat(layer, 0) for layer in zip(*routers))
                aux = load_balancing_loss_func(per_layer, config.num_experts, config.num_experts_per_tok, None)
                loss = loss + self.router_aux_loss_coef * aux
            return loss

    return PerSequenceSFTTrainer


def _train(make_trainer, models, *, mode: str):
    """Build the trainer and train. ``mode``: "stock"; "apply" (``deltafuse.apply`` on every model before the
    trainer is built, ``revert`` after); "callback" (``make_trainer`` is given ``[DeltafuseCallback()]``)."""
    assert mode in ("stock", "apply", "callback"), mode
    if mode == "apply":
        for model in models:
            patching.apply(model)
    try:
        trainer = make_trainer([DeltafuseCallback()] if mode == "callback" else [])
        trainer.recorder = grad_recorder()
        trainer.add_callback(trainer.recorder)
        trainer.train()
    finally:
        if mode == "apply":
            patching.revert()
    return trainer


def _sft_run(name, tmp_path, *, mode: str, peft: bool, packed: bool, oracle: bool = False):
    """``oracle``: the stock run in float64 (the same weights cast, under ``Float64Everywhere``)."""
    from trl import SFTConfig, SFTTrainer

    assert mode == "stock" or not oracle
    model = build_model(name, seed=input_seed("model", 7)).train()
    if peft:
        model = lora(model, seed=8)
    if oracle:
        model = float64_copy(model)
    # 12 sequences of 1..14 tokens (bytes + EOS), a length-1 one (empty text) included: 3 packed rows of <= 32
    texts = _texts(9, [0, 13, 5, 9, 2, 11, 7, 4, 6, 10, 3, 8])
    dataset = Dataset.from_list([{"text": t} for t in texts])
    args = SFTConfig(output_dir=str(tmp_path / (mode + "64" * oracle)), per_device_train_batch_size=2, max_length=32,
                     packing=packed, padding_free=packed, gradient_checkpointing=mode != "stock",  # TRL's default: on
                     **COMMON)
    trainer_cls = _per_sequence_sft_trainer_cls() if mode == "stock" and packed else SFTTrainer

    def make(callbacks):
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=build_byte_tokenizer(),
                              callbacks=callbacks)
        # what train() starts from (TRL has set the model's instance ``forward`` to its fused LM head by now)
        trainer.seen_sequences, trainer.before = [], snapshot(model)
        return trainer

    if oracle:
        with Float64Everywhere():
            return _train(make, [model], mode=mode)
    return _train(make, [model], mode=mode)


@pytest.mark.parametrize("name,peft", [("tiny", True), ("tiny-moe", False), ("tiny-next", True)])
def test_sft_packed_padding_free_equals_per_sequence_stock(name, peft, tmp_path, op_calls):
    ref = _sft_run(name, tmp_path, mode="stock", peft=peft, packed=True)
    assert op_calls["chunk_gated_delta_rule"] == 0  # the reference is stock transformers
    assert len(ref.seen_sequences) == STEPS and min(ref.seen_sequences) >= 3, ref.seen_sequences  # really packed
    got = _sft_run(name, tmp_path, mode="apply", peft=peft, packed=True)
    batch = next(iter(got.get_train_dataloader()))
    assert {"cu_seq_lens_q", "seq_idx", "position_ids"} <= set(batch) and "attention_mask" not in batch
    assert op_calls["chunk_gated_delta_rule"] > 0 and op_calls["causal_conv1d_fn"] > 0
    assert op_calls["fused_linear_cross_entropy"] == 0  # TRL's fused head computes the SFT loss
    _assert_as_accurate(got, ref, _sft_run(name, tmp_path, mode="stock", peft=peft, packed=True, oracle=True))


def test_sft_packed_with_the_callback(tmp_path, op_calls):
    """``callbacks=[DeltafuseCallback()]``: patched from ``train()`` on (after TRL added its fused LM head, so
    TRL's captured forward is the stock one), same result as above, everything restored afterwards."""
    ref = _sft_run("tiny", tmp_path, mode="stock", peft=True, packed=True)
    got = _sft_run("tiny", tmp_path, mode="callback", peft=True, packed=True)
    assert op_calls["chunk_gated_delta_rule"] > 0 and op_calls["fused_linear_cross_entropy"] == 0
    _assert_as_accurate(got, ref, _sft_run("tiny", tmp_path, mode="stock", peft=True, packed=True, oracle=True))
    callback = next(c for c in got.callback_handler.callbacks if isinstance(c, DeltafuseCallback))
    assert callback.report.applied and not callback.active and not PATCHER.has_records()
    assert_same_objects(got.before, snapshot(got.model))  # every object a patch row may touch, as found
    calls = dict(op_calls)
    with torch.no_grad():
        got.model(input_ids=torch.randint(0, 200, (1, 9)), use_cache=False)
    assert op_calls == calls  # stock again after train()


def test_sft_padded_equals_stock(tmp_path, op_calls):
    """Without packing (right-padded rows with an attention mask) stock transformers is the reference itself."""
    ref = _sft_run("tiny", tmp_path, mode="stock", peft=False, packed=False)
    got = _sft_run("tiny", tmp_path, mode="apply", peft=False, packed=False)
    assert "attention_mask" in next(iter(got.get_train_dataloader()))
    assert op_calls["chunk_gated_delta_rule"] > 0
    _assert_same_training(got, ref)


# --- DPO -------------------------------------------------------------------------------------------------------

def _dpo_run(tmp_path, *, apply: bool):
    from trl import DPOConfig, DPOTrainer

    model = build_model("tiny-moe", seed=input_seed("model", 11)).train()
    ref_model = copy.deepcopy(model).eval()
    prompts, chosen, rejected = _texts(12, [6, 11, 3, 9]), _texts(13, [7, 2, 12, 5]), _texts(14, [4, 9, 6, 10])
    dataset = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r}
                                 for p, c, r in zip(prompts, chosen, rejected)])
    args = DPOConfig(output_dir=str(tmp_path / ("deltafuse" if apply else "ref")), per_device_train_batch_size=2,
                     max_length=32, beta=0.5, gradient_checkpointing=False, **COMMON)
    return _train(lambda callbacks: DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=dataset,
                                               processing_class=build_byte_tokenizer()),
                  [model, ref_model], mode="apply" if apply else "stock")


def test_dpo_equals_stock(tmp_path, op_calls):
    ref = _dpo_run(tmp_path, apply=False)
    assert op_calls["chunk_gated_delta_rule"] == 0
    got = _dpo_run(tmp_path, apply=True)
    assert op_calls["chunk_gated_delta_rule"] > 0
    _assert_same_training(got, ref)


# --- GRPO ------------------------------------------------------------------------------------------------------

def _reward_spread(completion_ids, **kwargs):
    """A non-constant reward of the sampled tokens (so the advantages, and the gradients, are not zero)."""
    return [float(sum(ids) % 17) / 17.0 + 0.01 * len(ids) for ids in completion_ids]


def _grpo_run(tmp_path, *, apply: bool):
    from trl import GRPOConfig, GRPOTrainer

    model = build_model("tiny", seed=input_seed("model", 21)).train()
    dataset = Dataset.from_list([{"prompt": p} for p in _texts(22, [5, 9, 3, 7])])
    args = GRPOConfig(output_dir=str(tmp_path / ("deltafuse" if apply else "ref")), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, use_vllm=False, beta=0.0,
                      gradient_checkpointing=False, **COMMON)
    return _train(lambda callbacks: GRPOTrainer(model=model, reward_funcs=_reward_spread, args=args,
                                                train_dataset=dataset, processing_class=build_byte_tokenizer()),
                  [model], mode="apply" if apply else "stock")


def test_grpo_equals_stock(tmp_path, op_calls):
    ref = _grpo_run(tmp_path, apply=False)
    assert op_calls["chunk_gated_delta_rule"] == 0
    got = _grpo_run(tmp_path, apply=True)
    assert op_calls["chunk_gated_delta_rule"] > 0
    rewards = [h["reward"] for h in got.state.log_history if "reward" in h]
    assert rewards == [h["reward"] for h in ref.state.log_history if "reward" in h]  # the same samples
    _assert_same_training(got, ref)
