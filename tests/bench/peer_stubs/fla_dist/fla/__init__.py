"""Stand-in for flash-linear-attention (see tests/bench/peer_stubs/README.md)."""

import _peer_stub_log

__version__ = "0.6.0+stub"
CALLS = {"chunk_gated_delta_rule": 0}
_peer_stub_log.register("fla", CALLS)
