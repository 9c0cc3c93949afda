from deltafuse.ops.swiglu.api import swiglu

__all__ = ["swiglu"]
