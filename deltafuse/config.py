"""Settings from the environment: one frozen object, parsed strictly.

Switches accept 1/0, true/false, yes/no, on/off (any case). Anything else raises ``SettingsError`` naming
the variable, the value and what is allowed. The seed project's ``TWINKLE_NPU_*`` names are accepted as
aliases; when both spellings are set and disagree, the ``DELTAFUSE_*`` value wins and a warning says so.

The switches are parsed here (``switch_value``; ``env_switch`` for code that reads one of them per call, the
ops), and ``TRITON_INTERPRET`` as Triton itself reads it (``triton_interpreting``). ``DELTAFUSE_BACKEND``,
whose allowed values are the backend names the registry holds, is parsed next to the registry, in
``deltafuse.backends.settings``, which also reads the whole set (``load_settings``). This module imports no
other deltafuse module.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Mapping

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """An environment variable or argument has a value deltafuse does not accept."""


@dataclass(frozen=True)
class Switch:
    field: str
    name: str
    alias: str | None
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
    Switch("validate", "DELTAFUSE_VALIDATE", None, False,
           "also check tensor values (cu_seqlens, expert ids) on accelerators, which synchronises the device"),
)


@dataclass(frozen=True)
class Settings:
    patch: bool = True
    gdn: bool = True
    fused_ops: bool = True
    moe: bool = True
    backend: str = "auto"
    validate: bool = False


def parse_bool(name: str, value: str) -> bool:
    if not isinstance(value, str):
        raise SettingsError(f"{name}={value!r} is not a switch value (a str, got {type(value).__name__}); "
                            f"allowed (any case): {'/'.join(TRUE_WORDS + FALSE_WORDS)}")
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    allowed = "/".join(TRUE_WORDS + FALSE_WORDS)
    raise SettingsError(f"{name}={value!r} is not a switch value; allowed (any case): {allowed}")


@functools.lru_cache(maxsize=None)
def _triton_module():
    try:
        return importlib.import_module("triton")
    except Exception:  # not installed, or a broken install: nothing is interpreted
        return None


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (on CPU tensors): Triton's own reading of
    TRITON_INTERPRET (``triton.knobs.runtime.interpret``), so deltafuse and Triton never disagree; Triton
    versions without knobs read only "1". The one place deltafuse reads it; False without Triton."""
    triton = _triton_module()
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=64)
def _env_switch(name: str, raw: str | None) -> bool:
    sw = next(s for s in SWITCHES if s.name == name)
    return switch_value({} if raw is None else {name: raw}, sw)


def env_switch(name: str) -> bool:
    """One switch read from ``os.environ`` now (cheap per call: parsed once per distinct value); raises
    ``SettingsError`` for a value that is not a switch word. Aliases are not consulted here."""
    return _env_switch(name, os.environ.get(name))


def switch_value(env: Mapping[str, str], sw: Switch) -> bool:
    """The value of switch ``sw`` in ``env``: its DELTAFUSE_* name, else its alias (a warning when both are set
    and disagree), else its default."""
    ours = env.get(sw.name)
    alias = env.get(sw.alias) if sw.alias is not None else None
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
