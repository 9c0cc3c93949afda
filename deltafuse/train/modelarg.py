"""``--model``: a named configuration or a local Hugging Face model directory, checked before anything heavy.

A name is checked without importing torch or transformers (``deltafuse train --model nope`` answers at once); a
directory's files and config are read from disk; only ``patched=True`` with a directory asks transformers which
model types deltafuse patches.
"""

from __future__ import annotations

import json
import os

from deltafuse.model_names import NAMED_MODELS
from deltafuse.train.errors import TrainInputError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def supported_model_types() -> list[str]:
    """The config ``model_type`` values of the causal LMs deltafuse patches, in the installed transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    from deltafuse.maps import PATCHER

    packages = {m.module.rsplit(".", 1)[0].rsplit(".", 1)[-1] for m in PATCHER.maps}
    return sorted(t for t in CONFIG_MAPPING_NAMES
                  if model_type_to_module_name(t) in packages and not t.endswith("_vision"))


def check_model_arg(model: str, *, patched: bool = False) -> None:
    """Fail early, before anything heavy, on an unknown name or an incomplete local directory.

    With ``patched`` (deltafuse will patch the model) a local directory must also be of a supported family.
    """
    if model in NAMED_MODELS and not os.path.isdir(model):
        return
    if not os.path.exists(model):
        known = ", ".join(NAMED_MODELS)
        looks_like_path = os.sep in model or model.startswith(".") or model.startswith("~")
        what = "is not a directory that exists" if looks_like_path else "is neither a known model name nor a directory"
        raise TrainInputError(f"--model {model!r} {what}; known names: {known}; or pass a local Hugging Face "
                              "model directory (config.json, *.safetensors, tokenizer files)")
    if not os.path.isdir(model):
        raise TrainInputError(f"--model {model!r} is a file; pass a model directory or a known name")
    files = set(os.listdir(model))
    if "config.json" not in files:
        raise TrainInputError(f"--model {model!r} has no config.json; a model directory needs config.json, "
                              "*.safetensors weights and tokenizer files")
    if not any(f.endswith(".safetensors") for f in files):
        bins = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        extra = f" (found {', '.join(sorted(bins))}; only safetensors are loaded)" if bins else ""
        raise TrainInputError(f"--model {model!r} has no *.safetensors weights{extra}")
    if not any(f in files for f in TOKENIZER_FILES):
        raise TrainInputError(f"--model {model!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                              "save the tokenizer next to the weights")
    config_path = os.path.join(model, "config.json")
    try:
        with open(config_path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainInputError(f"--model {model!r}: {config_path} cannot be read as JSON ({exc})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise TrainInputError(f"--model {model!r}: {config_path} has no model_type; save the model with "
                              "transformers' save_pretrained")
    from deltafuse.train.outdir import weights_problem

    weights = sorted(f for f in files if f.endswith(".safetensors") or f == "model.safetensors.index.json")
    problem = weights_problem(model, weights)
    if problem:
        raise TrainInputError(f"--model {model!r}: {problem}")
    if patched:
        supported = supported_model_types()
        if model_type not in supported:
            raise TrainInputError(f"--model {model!r} is a {model_type!r} model, a family deltafuse does not patch; "
                                  f"supported model types: {', '.join(supported)}; pass --no-deltafuse to train "
                                  "it with stock transformers")
