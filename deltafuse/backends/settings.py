"""The settings whose allowed values are the registry's backend names: ``DELTAFUSE_BACKEND`` and the
``backend=`` of ``apply``, with the ``DELTAFUSE_*`` switches read through ``deltafuse.config``.

``deltafuse.config`` parses every switch and knows no backend name. Which names may be forced ('auto' and every
candidate some op registered) is the registry's answer, so their parsing sits here, next to it. The registry
fills itself from the op packages the first time it is asked.
"""

from __future__ import annotations

import functools
import os

from deltafuse.backends.registry import REGISTRY
from deltafuse.config import SWITCHES, Settings, SettingsError, switch_value


def forceable_backends() -> tuple[str, ...]:
    """'auto' and every backend name some op has registered (in registration order)."""
    return ("auto",) + REGISTRY.backend_names()


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
    raw = os.environ.get("DELTAFUSE_BACKEND")
    return "auto" if raw is None else _env_backend(raw, REGISTRY.version)


def load_settings(env=None) -> Settings:
    """Read the switches and DELTAFUSE_BACKEND from ``env`` (default: ``os.environ``); a bad value raises
    ``SettingsError`` naming the variable, the value and what is allowed."""
    env = os.environ if env is None else env
    values = {sw.field: switch_value(env, sw) for sw in SWITCHES}
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


__all__ = ["env_backend", "forceable_backends", "load_settings", "parse_backend", "resolve"]
