"""`benchmarks/gdn_memory_plan.py`: the GDN op's allocation plan, counted with its kernels replaced by no-ops, against
the buffers the launcher's design keeps alive at its peak (chunk_launch.backward), counted by hand."""

from __future__ import annotations

import importlib.util
import os

import pytest

from deltafuse.ops.gated_delta import chunk_launch
from deltafuse.ops.gated_delta.chunk_options import ChunkOptions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("gdn_memory_plan", os.path.join(ROOT, "benchmarks", "gdn_memory_plan.py"))
memory_plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_plan)


@pytest.mark.parametrize("T", [4096, 65536])
def test_peak_is_the_reverse_pass_buffers_and_the_options_drop_a_token_buffer(T):
    """bf16, H=16, HV=32, D=128 (Qwen3.5's GDN). Default: at the reverse pass o, w, T (fp32, 64 per token and value
    head), the chunk states and their gradients, v' and dv_local are alive. sbwd_from_t drops w there. wy_recompute_t
    drops T and, with the dq partials over v''s bytes, saves T's bytes exactly, alone or with bwd_group_loop (no dq
    partials); the group loop alone leaves T alive.
    The small per-token vectors (gates, norms) stay under 1 % of the peak."""
    H, HV, D = 16, 32, 128
    token = T * HV * D * 2  # one [tokens, HV, D] bf16 buffer
    states = (T // 64) * HV * D * D * 2  # the chunk states, or their gradients
    tinv = T * HV * 64 * 4
    reverse_pass = 4 * token + tinv + 2 * states  # o, w, v', dv_local; T; states and their gradients
    kernels = {n: getattr(chunk_launch, n) for n in ("_intra_fwd", "_state_bwd", "_bwd_out")}
    _, peak = memory_plan.plan((1, T, H, HV, D), ChunkOptions())
    assert reverse_pass <= peak <= 1.01 * reverse_pass
    for lean_options in (dict(wy_recompute_t=True, bwd_group_loop=True), dict(wy_recompute_t=True)):
        _, lean = memory_plan.plan((1, T, H, HV, D), ChunkOptions(**lean_options))
        assert reverse_pass - tinv <= lean <= 1.01 * (reverse_pass - tinv), lean_options
    # sbwd_from_t: w is freed before the reverse pass, and the dk and dq partials take the bytes of T and v' (a token
    # and value head of each hold 256 bytes here), so no later stage holds more
    _, from_t = memory_plan.plan((1, T, H, HV, D), ChunkOptions(sbwd_from_t=True))
    assert reverse_pass - token <= from_t <= 1.01 * (reverse_pass - token)
    # the group loop alone leaves the peak where it was (T stays alive through the reverse pass)
    assert memory_plan.plan((1, T, H, HV, D), ChunkOptions(bwd_group_loop=True))[1] >= reverse_pass
    # keep_states: the backward's peak is the recompute's (the same buffers, kept instead of rebuilt); the output
    # kernel runs with o, w, u (fp32), its 16-bit copy of v', T and the chunk states alive, and u goes after it
    stages, keep = memory_plan.plan((1, T, H, HV, D), ChunkOptions(keep_states=True))
    assert reverse_pass <= keep <= 1.01 * reverse_pass
    held = dict(stages)["f:out"]
    assert 5 * token + tinv + states <= held <= 1.01 * (5 * token + tinv + states)
    assert all(getattr(chunk_launch, n) is k for n, k in kernels.items())  # the kernels are restored
