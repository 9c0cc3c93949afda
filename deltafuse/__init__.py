"""deltafuse: fast, correct gated-delta-rule hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in transformers.

    import deltafuse
    report = deltafuse.apply(model)   # route every hot op to the best correct implementation
    deltafuse.revert()                # put transformers back as it was
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["apply", "revert", "patched", "info", "PatchReport", "__version__"]


def __getattr__(name):
    # Lazy: `import deltafuse` never imports transformers (nor any op) until patching is asked for.
    if name in ("apply", "revert", "patched", "PatchReport"):
        from deltafuse import patching

        return getattr(patching, name)
    if name == "info":
        from deltafuse.info import info

        return info
    raise AttributeError(f"module 'deltafuse' has no attribute {name!r}")
