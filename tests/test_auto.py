"""`import deltafuse.auto` applies according to the environment; run in fresh processes so nothing leaks."""

import json
import os
import subprocess
import sys

SCRIPT = """
import json
import deltafuse.auto
from transformers.models.qwen3_5 import modeling_qwen3_5 as m
from deltafuse.integrations.transformers.adapters import chunk_gated_delta_rule
name = "torch_chunk_gated_delta_rule" if not hasattr(m, "is_fast_path_available") else "chunk_gated_delta_rule"
r = deltafuse.auto.REPORT.to_dict()
print(json.dumps({"routed": getattr(m, name) is chunk_gated_delta_rule, "enabled": r["enabled"],
                  "applied": sum(row["status"] == "applied" for row in r["rows"]), "notes": r["notes"]}))
"""


def _run(**env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAFUSE_", "TWINKLE_NPU_"))}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env={**base, **env}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_applies_by_default():
    out = _run()
    assert out["enabled"] and out["routed"] and out["applied"] > 0


def test_auto_respects_master_switch_and_its_alias():
    for env in ({"DELTAFUSE_PATCH": "off"}, {"TWINKLE_NPU_PATCH": "0"}):
        out = _run(**env)
        assert not out["enabled"] and not out["routed"] and out["applied"] == 0
        assert any("DELTAFUSE_PATCH is off" in note for note in out["notes"])


def test_auto_gdn_switch_off():
    out = _run(DELTAFUSE_GDN="no")
    assert out["enabled"] and not out["routed"]
    assert any("gdn is off" in note for note in out["notes"])
