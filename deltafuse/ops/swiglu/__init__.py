from deltafuse.ops.swiglu import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.swiglu.api import swiglu

__all__ = ["swiglu"]
