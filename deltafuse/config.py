"""Settings from the environment: one frozen object, parsed strictly.

Switches accept 1/0, true/false, yes/no, on/off (any case). Anything else raises ``SettingsError`` naming
the variable, the value and what is allowed. The seed project's ``TWINKLE_NPU_*`` names are accepted as
aliases; when both spellings are set and disagree, the ``DELTAFUSE_*`` value wins and a warning says so.

Every environment variable deltafuse reads is parsed here and nowhere else: ``load_settings`` for the
whole ``DELTAFUSE_*`` set, ``env_switch`` / ``env_backend`` for code that reads one of them per call (the
ops, the registry), ``triton_interpreting`` for ``TRITON_INTERPRET`` (read as Triton itself reads it).

The backend names that may be forced are the ones registered, plus ``auto``. This module imports no other
deltafuse module: the package root connects the backend registry (``use_registry``), so importing any part
of deltafuse leaves it connected.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Mapping, Protocol

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


class BackendNames(Protocol):
    """What settings need from the backend registry: its names, and a number that changes with them."""

    version: int

    def backend_names(self) -> tuple[str, ...]: ...


_registry: list[BackendNames | None] = [None]


def use_registry(registry: BackendNames) -> None:
    """Take the names that may be forced from ``registry`` (the package root passes deltafuse's registry)."""
    _registry[0] = registry


def forceable_backends() -> tuple[str, ...]:
    """'auto' and every backend name some op has registered (in registration order)."""
    registry = _registry[0]
    if registry is None:  # only while the package root itself is being imported
        raise RuntimeError("deltafuse.config has no backend registry yet (the deltafuse package connects it)")
    return ("auto",) + registry.backend_names()


def parse_backend(name: str, value) -> str:
    """The backend named by ``value`` (env variable or argument ``name``), lower-cased; '' means 'auto'.

    Allowed: 'auto' and every registered backend name. An op that has no backend of that name keeps its own
    automatic choice (a per-call ``backend=`` the op lacks is refused by ``deltafuse.backends.select``)."""
    allowed = forceable_backends()
    if not isinstance(value, str):
        raise SettingsError(f"{name}={value!r} is not a backend name (a str, got {type(value).__name__}); "
                            f"allowed: {', '.join(allowed)}")
    word = value.strip().lower() or "auto"
    if word not in allowed:
        raise SettingsError(f"{name}={value!r} is not a backend; allowed: {', '.join(allowed)}")
    return word


@functools.lru_cache(maxsize=16)
def _env_backend(raw: str | None, _names_version: int) -> str:
    return "auto" if raw is None else parse_backend("DELTAFUSE_BACKEND", raw)


def env_backend() -> str:
    """DELTAFUSE_BACKEND read from ``os.environ`` now: 'auto' when unset (cheap per call: parsed once per
    distinct value and set of registered names); raises ``SettingsError`` for a name nothing registered."""
    registry = _registry[0]
    return _env_backend(os.environ.get("DELTAFUSE_BACKEND"), -1 if registry is None else registry.version)


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
    return _switch({} if raw is None else {name: raw}, sw)


def env_switch(name: str) -> bool:
    """One switch read from ``os.environ`` now (cheap per call: parsed once per distinct value); raises
    ``SettingsError`` for a value that is not a switch word. Aliases are not consulted here."""
    return _env_switch(name, os.environ.get(name))


def _switch(env: Mapping[str, str], sw: Switch) -> bool:
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


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read the switches from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    values = {sw.field: _switch(env, sw) for sw in SWITCHES}
    raw_backend = env.get("DELTAFUSE_BACKEND")
    backend = "auto" if raw_backend is None else parse_backend("DELTAFUSE_BACKEND", raw_backend)
    return Settings(backend=backend, **values)


def resolve(settings: Settings, **overrides) -> Settings:
    """Settings with the non-None keyword arguments of ``apply`` taking precedence over the environment."""
    fields = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "backend":
            fields[key] = parse_backend("backend", value)
        elif key in ("patch", "gdn", "fused_ops", "moe"):
            if not isinstance(value, bool):
                raise SettingsError(f"{key}={value!r} must be True, False or None (take the environment)")
            fields[key] = value
        else:
            raise SettingsError(f"unknown setting {key!r}; known: patch, gdn, fused_ops, moe, backend")
    return Settings(**{**settings.__dict__, **fields})
