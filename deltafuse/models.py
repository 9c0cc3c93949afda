"""Named model configurations built in code (random init, no downloads), and local model loading.

``tiny``, ``tiny-moe`` and ``tiny-next`` are CPU-sized versions of the three families; ``dense8`` and
``moe8`` are the Qwen3.5-9B / Qwen3.5-35B-A3B text configs cut to 8 layers (the benchmark shapes of
DESIGN.md); ``dense`` and ``moe`` are the same configs at full depth, for memory planning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

TINY_GDN = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096, vocab_size=512,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
TINY_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2)


@dataclass(frozen=True)
class NamedModel:
    family: str  # qwen3_5 | qwen3_5_moe | qwen3_next
    overrides: dict = field(default_factory=dict)
    doc: str = ""


NAMED_MODELS: dict[str, NamedModel] = {
    "tiny": NamedModel("qwen3_5", dict(TINY_GDN), "Qwen3.5 dense, 4 layers, hidden 64 (CPU)"),
    "tiny-moe": NamedModel("qwen3_5_moe", {k: v for k, v in {**TINY_GDN, **TINY_MOE}.items()
                                           if k != "intermediate_size"},
                           "Qwen3.5-MoE, 4 layers, 8 experts top-2 (CPU)"),
    "tiny-next": NamedModel("qwen3_next", {**TINY_GDN, **TINY_MOE, "norm_topk_prob": True},
                            "Qwen3-Next, 4 layers, 8 experts top-2 (CPU)"),
    "dense8": NamedModel("qwen3_5", dict(num_hidden_layers=8), "Qwen3.5-9B text config, 8 layers"),
    "moe8": NamedModel("qwen3_5_moe", dict(num_hidden_layers=8), "Qwen3.5-35B-A3B text config, 8 layers"),
    "dense": NamedModel("qwen3_5", {}, "Qwen3.5-9B text config, full depth"),
    "moe": NamedModel("qwen3_5_moe", {}, "Qwen3.5-35B-A3B text config, full depth"),
}

_FAMILY_CLASSES = {
    "qwen3_5": ("transformers.models.qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("transformers.models.qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


class UnknownModelError(ValueError):
    pass


def _classes(family: str):
    import importlib

    module_name, config_name, model_name = _FAMILY_CLASSES[family]
    try:
        module = importlib.import_module(module_name)
        return getattr(module, config_name), getattr(module, model_name)
    except (ImportError, AttributeError) as exc:
        import transformers

        raise UnknownModelError(
            f"transformers {transformers.__version__} has no {config_name}/{model_name} "
            f"(the {family} family needs transformers >= 5.2): {exc}") from exc


def build_config(name: str, **overrides):
    """The config of a named model; keyword arguments override its fields."""
    if name not in NAMED_MODELS:
        known = ", ".join(NAMED_MODELS)
        raise UnknownModelError(f"unknown model {name!r}; known names: {known}, or a local HF directory")
    spec = NAMED_MODELS[name]
    config_cls, _ = _classes(spec.family)
    fields = {**spec.overrides, **overrides}
    if spec.family == "qwen3_next" and "intermediate_size" not in overrides:
        fields.setdefault("intermediate_size", 128)
    return config_cls(**fields)


def build_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int = 0, **overrides):
    """A randomly initialised causal LM of a named configuration."""
    config = build_config(name, **overrides)
    _, model_cls = _classes(NAMED_MODELS[name].family)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: a full-depth model never exists in fp32
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype=dtype).eval()


def is_local_model(path: str) -> bool:
    return os.path.isdir(path)


class LocalModelError(ValueError):
    """A local model directory that cannot be used (unreadable config.json, no weights ...)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def check_local_model(path: str, *, trust_remote_code: bool = False):
    """The config of a local Hugging Face model directory, read without loading any weight.

    Raises FileNotFoundError (no directory, no config.json, no *.safetensors) or LocalModelError (a
    config.json that transformers cannot read), each naming the directory and what is wrong.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model directory {path!r} has no config.json")
    weights = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if not weights:
        raise FileNotFoundError(f"model directory {path!r} has no *.safetensors weights (only safetensors "
                                "are loaded)")
    import transformers
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a broken or foreign config.json: say which file and why, in one line
        raise LocalModelError(f"{os.path.join(path, 'config.json')} cannot be read by transformers "
                              f"{transformers.__version__}: {_first_line(exc)}") from None


def load_local_model(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     trust_remote_code: bool = False):
    """A causal LM from a local Hugging Face directory (config + safetensors); nothing is downloaded."""
    check_local_model(path, trust_remote_code=trust_remote_code)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device)


def config_family(config) -> str | None:
    """'qwen3_5', 'qwen3_5_moe' or 'qwen3_next' for the config of a supported model, else None."""
    return _family_of_module(type(config).__module__)


def _family_of_module(module: str) -> str | None:
    for family in ("qwen3_5_moe", "qwen3_5", "qwen3_next"):
        if f".{family}." in module or module.endswith(f".{family}"):
            return family
    return None


def model_family(model) -> str | None:
    """'qwen3_5', 'qwen3_5_moe' or 'qwen3_next' for a supported model object, else None."""
    return _family_of_module(type(model).__module__)
