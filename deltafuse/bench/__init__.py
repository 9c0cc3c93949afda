"""`deltafuse bench`: the ON/OFF training experiment (e2e) and per-op timings (ops)."""
