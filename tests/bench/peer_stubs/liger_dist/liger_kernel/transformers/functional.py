"""Liger's fused linear cross-entropy, computed with torch and counted."""

import os

import torch

import liger_kernel


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                     lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                     **kwargs):
    if input.device.type == "cpu" and os.environ.get("DELTAFUSE_TEST_FAKE_LIGER_NO_CPU") == "1":
        raise RuntimeError("0 active drivers ([]). There should only be one.")
    liger_kernel.CALLS["liger_fused_linear_cross_entropy"] += 1
    logits = (input @ weight.t()).float()
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
