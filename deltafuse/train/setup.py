"""Model, tokenizer and adapter setup for training: named configs or a local HF directory; LoRA or full."""

from __future__ import annotations

import os

import torch

from deltafuse.train.errors import TrainInputError
from deltafuse.train.modelarg import check_model_arg

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj",  # full attention
                        "in_proj_qkv", "in_proj_z", "out_proj",  # Qwen3.5 GDN
                        "in_proj_qkvz")  # Qwen3-Next GDN (in_proj_qkv/in_proj_z fused)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


def training_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def is_named(model: str) -> bool:
    from deltafuse.models import NAMED_MODELS

    return model in NAMED_MODELS


def load_tokenizer(model: str, *, trust_remote_code: bool = False):
    """The tokenizer of a named config (byte-level) or a local directory; light, so data is encoded (and its
    errors reported) before the model is built."""
    check_model_arg(model)
    if is_named(model) and not os.path.isdir(model):
        from deltafuse.train.tokenizer import build_byte_tokenizer

        return build_byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a broken or foreign tokenizer file: say which directory and why
        raise TrainInputError(f"--model {model!r}: the tokenizer cannot be loaded: "
                              f"{type(exc).__name__}: {exc}") from None


def load_model_and_tokenizer(model: str, *, dtype: torch.dtype, device: str, seed: int,
                             trust_remote_code: bool = False, tokenizer=None):
    """(model, tokenizer, description) for a named config (byte-level tokenizer) or a local directory;
    ``tokenizer``: one already loaded by ``load_tokenizer``."""
    from deltafuse import models

    if tokenizer is None:
        tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code)
    else:
        check_model_arg(model)
    if is_named(model) and not os.path.isdir(model):
        try:
            net = models.build_model(model, dtype=dtype, device=device, seed=seed)
        except models.UnknownModelError as exc:
            raise TrainInputError(f"--model {model!r}: {exc}") from None
        return net, tokenizer, f"{model} (random init: {models.NAMED_MODELS[model].doc})"
    try:
        net = models.load_local_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise TrainInputError(f"--model {model!r}: the model cannot be loaded: {exc}") from None
    return net, tokenizer, f"{model} (local)"


def linear_leaf_names(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def expert_parameters(model) -> list[str]:
    return sorted({n for n, p in model.named_parameters() if p.dim() == 3 and n.endswith(EXPERT_PARAMETERS)})


def lora_targets(model, requested: list[str] | None, include_mlp: bool) -> list[str]:
    """The LoRA target module names: the defaults present in the model, or exactly the requested ones."""
    present = linear_leaf_names(model)
    if requested:
        missing = [t for t in requested if t not in present]
        if missing:
            raise TrainInputError(f"--lora-targets {','.join(requested)}: {', '.join(missing)} match no linear "
                                  f"layer of this model; its linear layers are: {', '.join(sorted(present))}")
        return list(requested)
    wanted = DEFAULT_LORA_TARGETS + (MLP_TARGETS if include_mlp else ())
    targets = [t for t in wanted if t in present]
    if not targets:
        raise TrainInputError(f"none of the default LoRA targets ({', '.join(wanted)}) is a linear layer of this "
                              f"model; pass --lora-targets from: {', '.join(sorted(present))}")
    return targets


def add_lora(model, *, r: int, alpha: int, dropout: float, targets: list[str], experts: bool):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TrainInputError("LoRA needs the peft package (pip install 'deltafuse[train]'); or pass --full") from None

    target_parameters = None
    if experts:
        names = expert_parameters(model)
        if not names:
            raise TrainInputError("--lora-experts: this model has no 3-D expert parameters "
                                  "(experts.gate_up_proj / experts.down_proj); it is not a mixture-of-experts model")
        target_parameters = [s for s in EXPERT_PARAMETERS if any(n.endswith(s) for n in names)]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        target_parameters=target_parameters, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total
