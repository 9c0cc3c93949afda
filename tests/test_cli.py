import json
import os
import subprocess
import sys

from deltafuse.cli import main

OPS = {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"}


def test_info_json_lists_every_op_per_device_and_mode(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert OPS <= set(report["ops"])
    for op in OPS:
        rows = report["ops"][op]
        assert {(r["device"], r["mode"]) for r in rows} >= {("cpu", "train"), ("cpu", "inference")}
        for row in rows:
            if row["device"] == "cpu":
                assert row["chosen"] == "torch"
            # every candidate that was not chosen says why
            assert all(isinstance(reason, str) and reason for reason in row["rejected"].values())
    assert report["versions"]["torch"]


def test_info_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for op in OPS:
        assert op in out
    assert "fla:" in out  # the reason FLA is not used on CPU is shown


def test_bad_environment_value_is_a_clear_error():
    env = {**os.environ, "DELTAFUSE_BACKEND": "cuda"}
    proc = subprocess.run([sys.executable, "-m", "deltafuse", "info"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "DELTAFUSE_BACKEND='cuda'" in proc.stderr and "auto, triton, fla, npu, flash_qla, torch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_forced_backend_shows_in_info(monkeypatch, capsys):
    monkeypatch.setenv("DELTAFUSE_BACKEND", "torch")
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["backend_in_effect"] == "torch"
    row = report["ops"]["chunk_gated_delta_rule"][0]
    assert row["chosen"] == "torch"
