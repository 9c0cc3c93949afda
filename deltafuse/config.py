"""Settings from the environment: one frozen object, parsed strictly.

Switches accept 1/0, true/false, yes/no, on/off (any case). Anything else raises ``SettingsError`` naming
the variable, the value and what is allowed. The seed project's ``TWINKLE_NPU_*`` names are accepted as
aliases; when both spellings are set and disagree, the ``DELTAFUSE_*`` value wins and a warning says so.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Mapping

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
BACKENDS = ("auto", "triton", "fla", "torch")


class SettingsError(ValueError):
    """An environment variable or argument has a value deltafuse does not accept."""


@dataclass(frozen=True)
class Switch:
    field: str
    name: str
    alias: str
    default: bool
    doc: str


SWITCHES = (
    Switch("patch", "DELTAFUSE_PATCH", "TWINKLE_NPU_PATCH", True,
           "master switch: off means nothing is patched"),
    Switch("gdn", "DELTAFUSE_GDN", "TWINKLE_NPU_FLA", True,
           "gated delta rule and causal conv1d routes"),
    Switch("fused_ops", "DELTAFUSE_FUSED_OPS", "TWINKLE_NPU_FUSED_OPS", True,
           "norms, RoPE, SwiGLU, attention and loss routes"),
    Switch("moe", "DELTAFUSE_MOE", "TWINKLE_NPU_MOE_PATCH", True,
           "mixture-of-experts routes"),
)


@dataclass(frozen=True)
class Settings:
    patch: bool = True
    gdn: bool = True
    fused_ops: bool = True
    moe: bool = True
    backend: str = "auto"


def parse_bool(name: str, value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    allowed = "/".join(TRUE_WORDS + FALSE_WORDS)
    raise SettingsError(f"{name}={value!r} is not a switch value; allowed (any case): {allowed}")


def check_backend(name: str, value: str) -> str:
    word = value.strip().lower()
    if word not in BACKENDS:
        raise SettingsError(f"{name}={value!r} is not a backend; allowed: {', '.join(BACKENDS)}")
    return word


def _switch(env: Mapping[str, str], sw: Switch) -> bool:
    ours = env.get(sw.name)
    alias = env.get(sw.alias)
    ours_v = parse_bool(sw.name, ours) if ours is not None and ours.strip() != "" else None
    alias_v = parse_bool(sw.alias, alias) if alias is not None and alias.strip() != "" else None
    if ours_v is not None and alias_v is not None and ours_v != alias_v:
        warnings.warn(
            f"{sw.name}={ours!r} and its alias {sw.alias}={alias!r} disagree; using {sw.name}",
            stacklevel=3,
        )
    if ours_v is not None:
        return ours_v
    if alias_v is not None:
        return alias_v
    return sw.default


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read the switches from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    values = {sw.field: _switch(env, sw) for sw in SWITCHES}
    raw_backend = env.get("DELTAFUSE_BACKEND")
    backend = "auto" if raw_backend is None or raw_backend.strip() == "" else check_backend(
        "DELTAFUSE_BACKEND", raw_backend)
    return Settings(backend=backend, **values)


def resolve(settings: Settings, **overrides) -> Settings:
    """Settings with the non-None keyword arguments of ``apply`` taking precedence over the environment."""
    fields = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "backend":
            fields[key] = check_backend("backend", str(value)) if isinstance(value, str) else _bad_backend(value)
        elif key in ("patch", "gdn", "fused_ops", "moe"):
            if not isinstance(value, bool):
                raise SettingsError(f"{key}={value!r} must be True, False or None (take the environment)")
            fields[key] = value
        else:
            raise SettingsError(f"unknown setting {key!r}; known: patch, gdn, fused_ops, moe, backend")
    return Settings(**{**settings.__dict__, **fields})


def _bad_backend(value) -> str:
    raise SettingsError(f"backend={value!r} must be a string, one of: {', '.join(BACKENDS)}")
