"""Liger's model patches for the three GDN families: the causal-LM forward computes the loss through
liger_fused_linear_cross_entropy (looked up at call time, as Liger's loss_utils does)."""

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from liger_kernel.transformers import functional


def _lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    num_items = kwargs.pop("num_items_in_batch", None)
    out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = out.last_hidden_state
    if not (self.training and labels is not None):
        raise NotImplementedError("the stand-in serves training calls with labels only")
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(hidden.device)
    loss = functional.liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                                       shift, reduction="sum" if num_items is not None else "mean")
    if num_items is not None:
        loss = loss / num_items
    return CausalLMOutputWithPast(loss=loss, logits=None)


def _patcher(module_name, class_name):
    def apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
              model=None):
        import importlib

        module = importlib.import_module(module_name)
        if fused_linear_cross_entropy:
            getattr(module, class_name).forward = _lce_forward

    return apply


apply_liger_kernel_to_qwen3_5 = _patcher("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM")
apply_liger_kernel_to_qwen3_5_moe = _patcher("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                                             "Qwen3_5MoeForCausalLM")
apply_liger_kernel_to_qwen3_next = _patcher("transformers.models.qwen3_next.modeling_qwen3_next",
                                            "Qwen3NextForCausalLM")
