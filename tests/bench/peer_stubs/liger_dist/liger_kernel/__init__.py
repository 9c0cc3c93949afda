"""Stand-in for Liger-Kernel (see tests/bench/peer_stubs/README.md)."""

import _peer_stub_log

__version__ = "0.8.5+stub"
CALLS = {"liger_fused_linear_cross_entropy": 0}
_peer_stub_log.register("liger_kernel", CALLS)
