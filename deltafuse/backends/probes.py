"""Facts about this process and its devices, each computed once."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util

import torch

from deltafuse.config import triton_interpreting  # noqa: F401  (the one reading of TRITON_INTERPRET)


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if digits == "":
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def import_error(module: str) -> str | None:
    """None when ``module`` imports, else a one-line reason."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install must not take the process down
        return f"import {module} failed: {type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple[int, ...] | None:
    if import_error("triton") is not None:
        return None
    import triton

    return version_tuple(triton.__version__)


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int | None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def cuda_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())


def is_hopper(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    cap = cuda_capability(device.index)
    return cap is not None and cap[0] == 9


def visible_devices() -> list[torch.device]:
    """CPU plus every visible accelerator."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "is_available") and npu.is_available():
        devices += [torch.device("npu", i) for i in range(npu.device_count())]
    return devices
