"""What would serve each op on each visible device, and why every other candidate was rejected."""

from __future__ import annotations

import platform

import torch

from deltafuse import backends
from deltafuse.backends import probes
from deltafuse.backends.registry import CallInfo
from deltafuse.backends.settings import load_settings


def _dtype_for(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def info(devices: list[torch.device] | None = None) -> dict:
    """A JSON-ready description: versions, settings, and per op / device / mode the chosen candidate."""
    settings = load_settings()
    forced = backends.current_backend()
    devices = probes.visible_devices() if devices is None else devices
    report = {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": probes.package_version("triton"),
            "transformers": probes.package_version("transformers"),
            "fla": probes.package_version("fla-core") or probes.package_version("flash-linear-attention"),
            "flash_qla": probes.package_version("flash-qla"),
        },
        "settings": {**settings.__dict__, "backend_in_effect": forced},
        "devices": [],
        "ops": {},
    }
    for dev in devices:
        entry = {"device": str(dev)}
        if dev.type == "cuda":
            entry["name"] = probes.cuda_name(dev.index)
            entry["capability"] = ".".join(map(str, probes.cuda_capability(dev.index)))
        report["devices"].append(entry)
    for op in sorted(backends.REGISTRY.ops):
        rows = []
        for dev in devices:
            for needs_grad in (True, False):
                call = CallInfo(dev, _dtype_for(dev), needs_grad)
                decisions = backends.REGISTRY.explain(op, call, forced)
                chosen = next((d.candidate for d in decisions if d.chosen), None)
                rows.append({
                    "device": str(dev),
                    "dtype": str(call.dtype).replace("torch.", ""),
                    "mode": "train" if needs_grad else "inference",
                    "chosen": chosen,
                    "unverified_on_hardware": bool(chosen) and not next(
                        d.verified for d in decisions if d.chosen),
                    "rejected": {d.candidate: d.reason for d in decisions if not d.chosen},
                })
        report["ops"][op] = rows
    return report


def format_info(report: dict) -> str:
    v = report["versions"]
    lines = [
        "deltafuse info",
        "  versions: " + ", ".join(f"{k} {v[k] or '-'}" for k in v),
        "  settings: " + ", ".join(f"{k}={val}" for k, val in report["settings"].items()),
        "  devices:  " + ", ".join(
            d["device"] + (f" ({d['name']}, sm {d['capability']})" if "name" in d else "")
            for d in report["devices"]),
    ]
    for op, rows in report["ops"].items():
        lines.append(f"\n{op}")
        for row in rows:
            chosen = row["chosen"] or "NONE"
            if row["unverified_on_hardware"]:
                chosen += " (unverified on hardware)"
            lines.append(f"  {row['device']:<8} {row['dtype']:<9} {row['mode']:<9} -> {chosen}")
            for name, reason in row["rejected"].items():
                lines.append(f"      {name}: {reason}")
    return "\n".join(lines)
