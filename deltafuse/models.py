"""Named model configurations built in code (random init, no downloads), and local model loading.

The families, their classes and their CPU-sized test models (``tiny``, ``tiny-moe``, ``tiny-next``) come from
the family maps (``deltafuse.integrations.transformers``); ``dense8`` and ``moe8`` are the Qwen3.5-9B /
Qwen3.5-35B-A3B text configs cut to 8 layers (the end-to-end benchmark shapes of BENCHMARKS.md#lora-4096); ``dense``
and ``moe`` are the same configs at full depth, for memory planning.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import torch

from deltafuse.integrations.transformers.patcher import FamilyMap
from deltafuse.maps import FAMILY_MAPS

FAMILIES: dict[str, FamilyMap] = {m.family: m for m in FAMILY_MAPS}
# the CPU-sized test model of every family, in the order of the maps
TINY_NAMES: tuple[str, ...] = tuple(m.tiny_name for m in FAMILY_MAPS)


@dataclass(frozen=True)
class NamedModel:
    family: str  # a key of FAMILIES
    overrides: dict = field(default_factory=dict)
    doc: str = ""


NAMED_MODELS: dict[str, NamedModel] = {
    **{m.tiny_name: NamedModel(m.family, dict(m.tiny_config), m.doc) for m in FAMILY_MAPS},
    "dense8": NamedModel("qwen3_5", dict(num_hidden_layers=8), "Qwen3.5-9B text config, 8 layers"),
    "moe8": NamedModel("qwen3_5_moe", dict(num_hidden_layers=8), "Qwen3.5-35B-A3B text config, 8 layers"),
    "dense": NamedModel("qwen3_5", {}, "Qwen3.5-9B text config, full depth"),
    "moe": NamedModel("qwen3_5_moe", {}, "Qwen3.5-35B-A3B text config, full depth"),
}


class UnknownModelError(ValueError):
    pass


def _classes(family: str):
    """(config class, causal LM class) that the named models of ``family`` are built from."""
    fmap = FAMILIES[family]
    config_name, model_name = fmap.config_classes[0], fmap.model_classes[0]
    try:
        module = importlib.import_module(fmap.package)
        return getattr(module, config_name), getattr(module, model_name)
    except (ImportError, AttributeError) as exc:
        import transformers

        raise UnknownModelError(
            f"transformers {transformers.__version__} has no {config_name}/{model_name} "
            f"(the {fmap.title} family, {fmap.package}): {exc}") from exc


def supported_families() -> str:
    """The supported families and their config classes, for messages."""
    titles = [m.title for m in FAMILIES.values()]
    names = ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else titles[0]
    configs = ", ".join(c for m in FAMILIES.values() for c in m.config_classes)
    return f"{names} causal LMs (configs {configs})"


def build_config(name: str, **overrides):
    """The config of a named model; keyword arguments override its fields."""
    if name not in NAMED_MODELS:
        known = ", ".join(NAMED_MODELS)
        raise UnknownModelError(f"unknown model {name!r}; known names: {known}, or a local HF directory")
    spec = NAMED_MODELS[name]
    config_cls, _ = _classes(spec.family)
    return config_cls(**{**spec.overrides, **overrides})


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


def _family_of(cls: type, names: str) -> str | None:
    """The family one of whose ``names`` ("config_classes" or "model_classes") is ``cls`` or a base class of
    it, defined in that family's package; else None. Exact class names: no order between families matters."""
    for c in getattr(cls, "__mro__", ()):
        module = getattr(c, "__module__", "") or ""
        for fmap in FAMILIES.values():
            if c.__name__ in getattr(fmap, names) and module.startswith(fmap.package + "."):
                return fmap.family
    return None


def config_family(config) -> str | None:
    """The family (a key of FAMILIES) of the config of a supported model, else None."""
    return _family_of(type(config), "config_classes")


def model_family(model) -> str | None:
    """The family (a key of FAMILIES) of a supported model object, else None."""
    return _family_of(type(model), "model_classes")
