"""TRL recipes with deltafuse applied: SFT (packed, padding-free), DPO and GRPO on tiny models, CPU, fp32.

Every recipe runs two optimizer steps twice from the same weights on the same batches: once as the reference
(stock transformers), once with ``deltafuse.apply(model)`` before the trainer is built (the recipe the README
gives). Compared: the logged loss of both steps and every trainable parameter's gradient of both steps (taken
just before the optimizer step; plain SGD without clipping, so step 2 starts from the same weights).

TRL (1.16) scores tokens with its own fused LM head (``trl.trainer.utils.add_fused_lm_head``: it runs the
model's backbone, which deltafuse patches, then projects the hidden states in tiles), so deltafuse's fused
cross-entropy is not what computes these losses; the tests check that deltafuse's GDN ops did serve.

Packed SFT: stock transformers cannot be the reference there (without flash-linear-attention it refuses the
``cu_seq_lens_q`` / ``seq_idx`` TRL's padding-free collator passes, or, on older versions, mixes the packed
sequences' states), so the reference trainer scores every packed sequence alone with the stock model.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is in deltafuse's test extra (pip install -e '.[test]')")

from datasets import Dataset  # noqa: E402  (a dependency of trl)

from deltafuse import ops, patching  # noqa: E402
from deltafuse.models import build_model  # noqa: E402
from deltafuse.train.tokenizer import build_byte_tokenizer  # noqa: E402
from tests.integrations import RTOL, assert_grads_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

LR = 0.05
STEPS = 2
COMMON = dict(max_steps=STEPS, logging_steps=1, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
              max_grad_norm=0.0,
              bf16=False, use_cpu=True, report_to="none", save_strategy="no", dataloader_num_workers=0,
              disable_tqdm=True, seed=1234)


def _words(gen: torch.Generator, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz     .,"
    return "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (n,), generator=gen).tolist())


def _texts(seed: int, lengths) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    return [_words(gen, n) for n in lengths]


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _grad_recorder():
    from transformers import TrainerCallback

    class GradRecorder(TrainerCallback):
        """Every trainable parameter's gradient at each optimizer step."""

        def __init__(self):
            self.steps: list[dict] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append({n: None if p.grad is None else p.grad.detach().clone()
                               for n, p in model.named_parameters() if p.requires_grad})

    return GradRecorder()


def _assert_same_training(got, ref):
    """Same logged loss and same gradients (rel RTOL, or fp32 rounding of the largest gradient) at every step."""
    got_losses, ref_losses = _losses(got), _losses(ref)
    assert len(ref_losses) == STEPS and len(got_losses) == STEPS, (got_losses, ref_losses)
    for step, (g, r) in enumerate(zip(got_losses, ref_losses), 1):
        assert abs(g - r) <= RTOL * abs(r), f"step {step}: loss {g!r} vs reference {r!r}"
    got_grads, ref_grads = got.recorder.steps, ref.recorder.steps
    assert len(got_grads) == len(ref_grads) == STEPS
    for g, r in zip(got_grads, ref_grads):
        present = [t for t in r.values() if t is not None]
        assert len(present) >= 0.9 * len(r) and all(t.abs().max() > 0 for t in present)  # not vacuous
        assert_grads_close(g, r)


@pytest.fixture
def gdn_calls(monkeypatch):
    """Counts the calls of deltafuse's GDN ops (the patched modeling code looks them up on ``deltafuse.ops``)."""
    counter = {"chunk_gated_delta_rule": 0, "causal_conv1d_fn": 0, "fused_linear_cross_entropy": 0}
    for name in counter:
        fn = getattr(ops, name)

        def spy(*args, _name=name, _fn=fn, **kwargs):
            counter[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    return counter


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


def _lora(model, seed):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # init_lora_weights=False: B is random too, so every LoRA gradient is non-zero
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                        "out_proj"])
    return get_peft_model(model, config)


def _train(make_trainer, models, *, apply: bool):
    """Build the trainer (after ``deltafuse.apply`` on every model when ``apply``), train, revert."""
    if apply:
        for model in models:
            patching.apply(model)
    try:
        trainer = make_trainer()
        trainer.recorder = _grad_recorder()
        trainer.add_callback(trainer.recorder)
        trainer.train()
    finally:
        if apply:
            patching.revert()
    return trainer


def _sft_run(name, tmp_path, *, reference: bool, lora: bool, packed: bool):
    from trl import SFTConfig, SFTTrainer

    model = build_model(name, seed=7).train()
    if lora:
        model = _lora(model, seed=8)
    # 12 sequences of 1..14 tokens (bytes + EOS), a length-1 one (empty text) included: 3 packed rows of <= 32
    texts = _texts(9, [0, 13, 5, 9, 2, 11, 7, 4, 6, 10, 3, 8])
    dataset = Dataset.from_list([{"text": t} for t in texts])
    args = SFTConfig(output_dir=str(tmp_path / ("ref" if reference else "deltafuse")), per_device_train_batch_size=2,
                     max_length=32, packing=packed, padding_free=packed,
                     gradient_checkpointing=not reference, **COMMON)  # TRL's default (on) for the deltafuse run
    trainer_cls = _per_sequence_sft_trainer_cls() if reference and packed else SFTTrainer

    def make():
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=build_byte_tokenizer())
        trainer.seen_sequences = []
        return trainer

    return _train(make, [model], apply=not reference)


@pytest.mark.parametrize("name,lora", [("tiny", True), ("tiny-moe", False), ("tiny-next", True)])
def test_sft_packed_padding_free_equals_per_sequence_stock(name, lora, tmp_path, gdn_calls):
    ref = _sft_run(name, tmp_path, reference=True, lora=lora, packed=True)
    assert gdn_calls["chunk_gated_delta_rule"] == 0  # the reference is stock transformers
    assert len(ref.seen_sequences) == STEPS and min(ref.seen_sequences) >= 3, ref.seen_sequences  # really packed
    got = _sft_run(name, tmp_path, reference=False, lora=lora, packed=True)
    batch = next(iter(got.get_train_dataloader()))
    assert {"cu_seq_lens_q", "seq_idx", "position_ids"} <= set(batch) and "attention_mask" not in batch
    assert gdn_calls["chunk_gated_delta_rule"] > 0 and gdn_calls["causal_conv1d_fn"] > 0
    assert gdn_calls["fused_linear_cross_entropy"] == 0  # TRL's fused head computes the SFT loss
    _assert_same_training(got, ref)


def test_sft_padded_equals_stock(tmp_path, gdn_calls):
    """Without packing (right-padded rows with an attention mask) stock transformers is the reference itself."""
    ref = _sft_run("tiny", tmp_path, reference=True, lora=False, packed=False)
    got = _sft_run("tiny", tmp_path, reference=False, lora=False, packed=False)
    assert "attention_mask" in next(iter(got.get_train_dataloader()))
    assert gdn_calls["chunk_gated_delta_rule"] > 0
    _assert_same_training(got, ref)


# --- DPO -------------------------------------------------------------------------------------------------------

def _dpo_run(tmp_path, *, apply: bool):
    from trl import DPOConfig, DPOTrainer

    model = build_model("tiny-moe", seed=11).train()
    ref_model = copy.deepcopy(model).eval()
    prompts, chosen, rejected = _texts(12, [6, 11, 3, 9]), _texts(13, [7, 2, 12, 5]), _texts(14, [4, 9, 6, 10])
    dataset = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r}
                                 for p, c, r in zip(prompts, chosen, rejected)])
    args = DPOConfig(output_dir=str(tmp_path / ("deltafuse" if apply else "ref")), per_device_train_batch_size=2,
                     max_length=32, beta=0.5, gradient_checkpointing=False, **COMMON)
    return _train(lambda: DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=dataset,
                                     processing_class=build_byte_tokenizer()), [model, ref_model], apply=apply)


def test_dpo_equals_stock(tmp_path, gdn_calls):
    ref = _dpo_run(tmp_path, apply=False)
    assert gdn_calls["chunk_gated_delta_rule"] == 0
    got = _dpo_run(tmp_path, apply=True)
    assert gdn_calls["chunk_gated_delta_rule"] > 0
    _assert_same_training(got, ref)


# --- GRPO ------------------------------------------------------------------------------------------------------

def _reward_spread(completion_ids, **kwargs):
    """A non-constant reward of the sampled tokens (so the advantages, and the gradients, are not zero)."""
    return [float(sum(ids) % 17) / 17.0 + 0.01 * len(ids) for ids in completion_ids]


def _grpo_run(tmp_path, *, apply: bool):
    from trl import GRPOConfig, GRPOTrainer

    model = build_model("tiny", seed=21).train()
    dataset = Dataset.from_list([{"prompt": p} for p in _texts(22, [5, 9, 3, 7])])
    args = GRPOConfig(output_dir=str(tmp_path / ("deltafuse" if apply else "ref")), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, use_vllm=False, beta=0.0,
                      gradient_checkpointing=False, **COMMON)
    return _train(lambda: GRPOTrainer(model=model, reward_funcs=_reward_spread, args=args, train_dataset=dataset,
                                      processing_class=build_byte_tokenizer()), [model], apply=apply)


def test_grpo_equals_stock(tmp_path, gdn_calls):
    ref = _grpo_run(tmp_path, apply=False)
    assert gdn_calls["chunk_gated_delta_rule"] == 0
    got = _grpo_run(tmp_path, apply=True)
    assert gdn_calls["chunk_gated_delta_rule"] > 0
    rewards = [h["reward"] for h in got.state.log_history if "reward" in h]
    assert rewards == [h["reward"] for h in ref.state.log_history if "reward" in h]  # the same samples
    _assert_same_training(got, ref)
