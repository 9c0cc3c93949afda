"""`deltafuse bench e2e --peers`: real (very small) runs against stand-in fla / liger_kernel packages.

The stand-ins (tests/bench/peer_stubs) compute with transformers' torch code and log, per process, which
package was imported and how often it was called; the tests compare that log with what the benchmark reports.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import transformers

from deltafuse.backends.probes import version_tuple
from deltafuse.bench import peers
from deltafuse.bench.cli import main

STUBS = os.path.join(os.path.dirname(__file__), "peer_stubs")
FLA_STUB = os.path.join(STUBS, "fla_dist")
LIGER_STUB = os.path.join(STUBS, "liger_dist")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tf_picks_fla_on_cpu() -> bool:
    """5.15-5.24: transformers takes FLA whenever `import fla` works; before, only with CUDA (none here); 5.25+
    only for tensors on a device FLA serves, which the CPU is not."""
    from tests.test_verify import stock_runs_torch_off_its_devices

    return version_tuple(transformers.__version__) >= (5, 15) and not stock_runs_torch_off_its_devices()


TF_PICKS_FLA_ON_CPU = _tf_picks_fla_on_cpu()
TINY = ["--model", "tiny", "--seq-len", "128", "--num-examples", "20", "--no-progress"]


@pytest.fixture
def stub_env(monkeypatch, tmp_path):
    """PYTHONPATH with the chosen stand-ins; the stand-ins' call log; no stand-in switch from outside."""
    log = tmp_path / "peer_log.jsonl"
    monkeypatch.setenv("DELTAFUSE_TEST_PEER_LOG", str(log))
    for name in ("DELTAFUSE_TEST_FAKE_HOPPER", "DELTAFUSE_TEST_FAKE_LIGER_NO_CPU", "DELTAFUSE_PATCH"):
        monkeypatch.delenv(name, raising=False)

    def use(*dirs):
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, *dirs]))

    def entries():
        """{(package, run dir name): calls} from the stand-ins' log, one entry per process and package."""
        out = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            rec = json.loads(line)
            run = os.path.basename(rec["argv"][rec["argv"].index("--output-dir") + 1])
            assert (rec["package"], run) not in out
            out[rec["package"], run] = rec["calls"]
        return out

    return use, entries


def _gdn_layers() -> int:
    from deltafuse.models import build_config

    return sum(t == "linear_attention" for t in build_config("tiny").layer_types)


@pytest.mark.slow
def test_peers_table_rows_call_counts_and_fla_kept_out_of_off(stub_env, tmp_path, capsys):
    use, entries = stub_env
    use(FLA_STUB, LIGER_STUB)
    out = str(tmp_path / "bench")
    steps = 3
    rc = main(["e2e", *TINY, "--max-steps", str(steps), "--interval", "1", "--output-dir", out,
               "--peers", "fla,liger,fla+liger", "--repeats", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    md = open(os.path.join(out, "e2e.md")).read()
    res = json.load(open(os.path.join(out, "e2e.json")))
    log = entries()

    # the OFF run and the Liger-only run never imported FLA; FLA's runs did, and it counted what the bench counted
    assert ("fla", "off") not in log and ("fla", "liger") not in log
    assert not {("liger_kernel", "off"), ("liger_kernel", "fla"), ("liger_kernel", "on")} & set(log)
    off_report = json.load(open(os.path.join(out, "off", "peer_run.json")))
    assert off_report["fla_visible"] is False and off_report["calls"] == {} and off_report["status"] == "ran"
    assert res["peers"]["liger"]["report"]["fla_visible"] is False
    assert res["peers"]["fla"]["report"]["fla_visible"] is True
    gdn_calls = steps * _gdn_layers()
    for run in ("fla", "fla+liger"):
        counted = res["peers"][run]["report"]["calls"][peers.FLA_OP]
        assert counted == log["fla", peers.run_dir_name(run)]["chunk_gated_delta_rule"]
        assert counted == (gdn_calls if TF_PICKS_FLA_ON_CPU else 0)
    for run in ("liger", "fla+liger"):
        counted = res["peers"][run]["report"]["calls"][peers.LIGER_OP]
        assert counted == log["liger_kernel", peers.run_dir_name(run)]["liger_fused_linear_cross_entropy"] == steps
    if TF_PICKS_FLA_ON_CPU:
        assert log["fla", "on"]["chunk_gated_delta_rule"] == 0  # imported by transformers, routed around by deltafuse

    # one row per run, in order, each with its status
    head = "| run "
    table = md[md.index(head):].split("\n\n")[0].splitlines()[2:]
    labels = [row.split("|")[1].strip() for row in table]
    assert labels == ["OFF (stock)", "ON (deltafuse)", "FLA", "Liger", "FLA+Liger"]
    ran = ["liger"] + (["fla", "fla+liger"] if TF_PICKS_FLA_ON_CPU else [])
    for run in ("fla", "liger", "fla+liger"):
        row = table[labels.index(peers.LABELS[run])]
        info = res["peers"][run]
        if run in ran:
            assert info["status"] == "ran" and row.rstrip(" |").endswith(peers.ran_note(run, info["report"]))
            # CPU timings are noise: no speedup over a peer either
            assert info["speedup_of_deltafuse"] is None and row.split("|")[9].strip() == "(cpu: noise)"
            # the stand-ins compute the stock function: every step's loss is OFF's
            for a, b in zip(res["steps"]["off"][0], res["steps"][run][0], strict=True):
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        else:  # before 5.15 (no CUDA here) and from 5.25 (CPU tensors) stock never calls FLA: the run is stock
            assert info["status"] == "peer not used" and info["stats"] is None and run not in res["steps"]
            assert "peer not used: FLA's chunk_gated_delta_rule was called 0 times" in row
            assert row.count("| - ") == 8
    assert md in text
    assert all(res["commands"][r].startswith("DELTAFUSE_PATCH=0 python -m deltafuse.bench.peers --run " + r)
               for r in ("off", "fla", "liger", "fla+liger"))
    assert os.path.getsize(os.path.join(out, "e2e.png")) > 10_000


@pytest.mark.slow
def test_refused_and_missing_peers_are_rows_not_crashes(stub_env, tmp_path, capsys, monkeypatch):
    use, _ = stub_env
    use(FLA_STUB)  # no liger_kernel anywhere
    monkeypatch.setenv("DELTAFUSE_TEST_FAKE_HOPPER", "1")
    out = str(tmp_path / "bench")
    rc = main(["e2e", *TINY, "--max-steps", "2", "--interval", "1", "--output-dir", out, "--peers", "fla,liger",
               "--repeats", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    res = json.load(open(os.path.join(out, "e2e.json")))
    md = open(os.path.join(out, "e2e.md")).read()
    fla, liger = res["peers"]["fla"], res["peers"]["liger"]
    if TF_PICKS_FLA_ON_CPU:
        assert fla["status"] == "refused"
        assert fla["reason"] == ("refused: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for "
                                 "gated chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1 or install "
                                 "tilelang: `pip install tilelang`")
        assert fla["report"]["fla"]["hopper_guard_active"] is True
        assert fla["report"]["fla"]["hopper_guard_lifted"] is False
        assert fla["report"]["calls"][peers.FLA_OP] >= 1  # the forward ran; the backward refused
    else:
        assert fla["status"] == "peer not used"
    assert liger["status"] == "not installed"
    assert liger["reason"] == "not installed: ModuleNotFoundError: No module named 'liger_kernel'"
    for run in ("fla", "liger"):
        assert res["peers"][run]["stats"] is None and run not in res["steps"]
        row = next(r for r in md.splitlines() if r.startswith(f"| {peers.LABELS[run]} "))
        assert res["peers"][run]["reason"] in row
    # OFF and ON were measured as usual, in both rounds; a peer that cannot run is not tried again
    assert set(res["steps"]) == {"off", "on"} and len(res["steps"]["off"]) == len(res["steps"]["on"]) == 2
    assert res["order"] == ["off", "on", "fla", "liger", "off", "on"]


@pytest.mark.slow
def test_lifted_hopper_guard_is_said_next_to_the_numbers_and_cpu_only_peer_is_not_available(stub_env, tmp_path,
                                                                                          capfd, monkeypatch):
    use, entries = stub_env
    use(FLA_STUB, LIGER_STUB)
    monkeypatch.setenv("DELTAFUSE_TEST_FAKE_HOPPER", "1")
    monkeypatch.setenv("DELTAFUSE_TEST_FAKE_LIGER_NO_CPU", "1")
    out = str(tmp_path / "bench")
    steps = 2
    rc = main(["e2e", *TINY, "--max-steps", str(steps), "--interval", "1", "--output-dir", out,
               "--peers", "fla,liger", "--fla-lift-hopper-guard", "--repeats", "1"])
    captured = capfd.readouterr()
    assert rc == 0, captured.out + captured.err
    res = json.load(open(os.path.join(out, "e2e.json")))
    md = open(os.path.join(out, "e2e.md")).read()
    fla, liger = res["peers"]["fla"], res["peers"]["liger"]
    assert fla["report"]["fla"]["hopper_guard_active"] is True and fla["report"]["fla"]["hopper_guard_lifted"] is True
    assert "--fla-lift-hopper-guard" in res["commands"]["fla"]
    assert "--fla-lift-hopper-guard" not in res["commands"]["liger"]
    if TF_PICKS_FLA_ON_CPU:
        assert fla["status"] == "ran"
        assert fla["report"]["calls"][peers.FLA_OP] == steps * _gdn_layers() == \
            entries()["fla", "fla"]["chunk_gated_delta_rule"]
        row = next(r for r in md.splitlines() if r.startswith("| FLA "))
        assert fla["speedup_of_deltafuse"] is None and row.split("|")[9].strip() == "(cpu: noise)"
        assert row.rstrip(" |").endswith(
            "; FLA's Hopper guard lifted for timing; its backward is known to be wrong on this stack")
        assert ("- FLA: FLA's Hopper guard lifted for timing; its backward is known to be wrong on this stack "
                "(its numbers are timing only)") in md
    else:
        assert fla["status"] == "peer not used"
    assert liger["status"] == "not available" and liger["stats"] is None
    assert liger["reason"] == "not available on cpu: RuntimeError: 0 active drivers ([]). There should only be one."
    assert liger["reason"] in next(r for r in md.splitlines() if r.startswith("| Liger "))
    assert liger["reason"] in captured.err and "Traceback" in captured.err  # the child's own account
    assert liger["report"]["liger"]["families"] == [
        f for f in peers.LIGER_FAMILIES if os.path.isdir(os.path.join(os.path.dirname(transformers.__file__),
                                                                      "models", f))]


def test_peer_status_never_names_a_peer_that_was_not_called():
    ran = {"status": "ran", "reason": "", "calls": {peers.FLA_OP: 0, peers.LIGER_OP: 5},
           "liger": {"families": ["qwen3_5"]}}
    kind, reason = peers.peer_status("fla+liger", ran, 0, 3, 3)
    assert kind == "peer not used"
    assert reason.startswith("peer not used: FLA's chunk_gated_delta_rule was called 0 times") and "Liger" not in reason
    assert peers.peer_status("liger", ran, 0, 3, 3) == ("ran", "")
    kind, reason = peers.peer_status("liger", dict(ran, calls={}), 0, 3, 3)
    assert kind == "peer not used" and "(families patched: qwen3_5)" in reason
    assert peers.peer_status("liger", ran, 0, 2, 3) == ("failed", "failed: recorded 2 of 3 steps")
    assert peers.peer_status("liger", None, -9, 0, 3) == (
        "failed", "failed: exit code -9 and no report (the run's output is above)")
    refused = dict(ran, status="refused", reason="refused: no")
    assert peers.peer_status("fla", refused, 1, 0, 3) == ("refused", "refused: no")


def test_parse_peers():
    assert peers.parse_peers("none") == [] and peers.parse_peers("fla+liger, FLA") == ["fla+liger", "fla"]
    import argparse

    for bad, needle in (("flash", "allowed: none, or a comma-separated list of fla, liger, fla+liger"),
                        ("fla,fla", "names a peer twice"), (",", "allowed: none")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(needle)):
            peers.parse_peers(bad)


@pytest.mark.parametrize("argv, needle", [
    (["--peers", "flash"], "argument --peers: 'flash' is not allowed; allowed: none, or a comma-separated list"),
    (["--fla-lift-hopper-guard", "--peers", "liger"],
     "--fla-lift-hopper-guard applies to FLA runs; add fla or fla+liger to --peers (now: liger)"),
    (["--fla-lift-hopper-guard"], "(now: none)"),
])
def test_bench_e2e_bad_peer_flags(argv, needle, tmp_path, capsys):
    try:
        rc = main(["e2e", *argv, "--output-dir", str(tmp_path / "b")])
    except SystemExit as exc:  # argparse's own refusal of a bad value
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()
