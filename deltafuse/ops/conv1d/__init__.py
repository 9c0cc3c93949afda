from deltafuse.ops.conv1d import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.conv1d.api import causal_conv1d_fn, causal_conv1d_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
