"""`benchmarks/gdn_registers.py`: the GDN op's launches as the launcher makes them, and its sequential passes compiled
ahead of time for sm_90 on this machine (no GPU), checked against the launcher's own shared-memory fit.

The tool compiles for a GPU, so it runs in a process of its own without TRITON_INTERPRET (which the test session
sets: the interpreter's tiles are not the GPU's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from deltafuse.ops.gated_delta.chunk_options import DEFAULT_OPTIONS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "benchmarks", "gdn_registers.py")
H200_SHARED = 232448


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here and now, not read from a cache
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)


def _report(tmp_path, shared: int) -> dict:
    out = tmp_path / f"regs-{shared}.json"
    proc = _run(tmp_path, "--shape", "1,192,2,4,128", "--kernels", "_state_fwd,_state_bwd", "--shared-memory",
                str(shared), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_sequential_passes_compiled_fit_the_shared_memory_they_were_fitted_to(tmp_path):
    """One forward+backward at Qwen3.5's heads (two value heads per q/k head, D = 128, 3 chunks): the forward's four
    kernels, the backward's recompute of the first three and its own five, each with the launcher's grid. Compiled
    for sm_90 by Triton's own compiler: on the H200's shared memory the sequential passes keep the stages asked for
    (4 and 3) and fit it; on a GPU with 100 KiB per program (sm_86 / sm_89: 101,376 bytes) the launcher gives them
    fewer stages, and the kernels Triton builds with those stages fit there too. Registers within sm_90's 255."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no NVIDIA tools (cuobjdump) to read a compiled kernel with")
    for shared, stages in ((H200_SHARED, {"_state_fwd": DEFAULT_OPTIONS.stages_hfwd,
                                          "_state_bwd": DEFAULT_OPTIONS.stages_sbwd}), (101376, None)):
        got = _report(tmp_path, shared)
        names = [name for name, _ in got["sequence"]]
        assert names == ["_l2norm_rstd", "_intra_fwd", "_state_fwd", "_out_fwd", "_l2norm_rstd", "_intra_fwd",
                         "_state_fwd", "_dv_local", "_state_bwd", "_bwd_wy", "_bwd_out", "_bwd_reduce"]
        grids = dict(got["sequence"])
        assert grids["_intra_fwd"] == [3, 4]  # chunks x value heads
        assert grids["_state_fwd"] == [4 * 128 // DEFAULT_OPTIONS.bv_hfwd]  # value heads x V blocks
        rows = got["rows"]
        # the forward's pass twice: in the forward (final state stored) and in the backward's recompute (not)
        assert sorted((r["kernel"], r["passes"]) for r in rows) == [("_state_bwd", "bwd"), ("_state_fwd", "bwd"),
                                                                     ("_state_fwd", "fwd")]
        for r in rows:
            assert 0 < r["shared"] <= shared and 0 < r["registers"] <= 255, (shared, r)
            if stages is None:
                asked = DEFAULT_OPTIONS.stages_hfwd if r["kernel"] == "_state_fwd" else DEFAULT_OPTIONS.stages_sbwd
                assert 1 <= r["stages"] < asked, (shared, r)
            else:
                assert r["stages"] == stages[r["kernel"]], r


def test_bad_arguments_are_one_line_errors(tmp_path):
    """Bad arguments are refused before anything is compiled, naming the argument, the value and what is allowed."""
    for args, message in [(("--shape", "1,64,2"), "--shape '1,64,2'; allowed: five positive ints"),
                          (("--kernels", "_nope"), "--kernels: ['_nope'] not among the op's kernels; allowed: "),
                          (("--options", "stages_hfwd=x"), "--options: stages_hfwd='x'; allowed: an int"),
                          (("--shared-memory", "0"), "--shared-memory 0; allowed: a positive number of bytes"),
                          (("--json", str(tmp_path / "no" / "r.json")), "allowed: a file path in an existing, "),
                          (("--json", str(tmp_path)), "allowed: a file path in an existing, ")]:
        proc = _run(tmp_path, *args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-500:])
