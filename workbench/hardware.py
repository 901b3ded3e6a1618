"""Hardware fingerprint: what a run ran on, as a plain dict, plus a copy-bandwidth probe.

`fingerprint()` is cheap enough to call once per run. torch is imported only inside the
functions that need it, so importing this module costs nothing. The short `hardware_id`
("cpu:AMD-EPYC-9654:2c", "gpu:NVIDIA-H200", "gpu:2xNVIDIA-H200") is the key that runs,
parquet rows and dashboards group by; the rest of the dict is kept in the run manifest.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import time
from typing import Any

from workbench.errors import WorkbenchError

# Marketing noise dropped from CPU and GPU names before they become part of `hardware_id`.
_NAME_NOISE = re.compile(
    r"\((?:R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|\b\d+-Core\b|@\s*[\d.]+\s*GHz|\bwith\b.*$",
)


def fingerprint() -> dict[str, Any]:
    """Describe this machine: CPU, memory, OS, Python, torch and the first GPU (None if absent)."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": _physical_cores(),
        "cpu_cores_available": _available_cores(),
        "memory_bytes": _memory_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": None,
        "gpu_name": None,
        "gpu_count": 0,
        "gpu_driver": None,
        "gpu_runtime": None,
        "gpu_memory_bytes": None,
    }
    info.update(_torch_and_gpu())
    info["hardware_id"] = hardware_id(info)
    return info


def hardware_id(info: dict[str, Any]) -> str:
    """The short, stable key for a fingerprint: the GPU if there is one, else the CPU and its cores."""
    if info.get("gpu_name"):
        count = info.get("gpu_count") or 1
        prefix = f"{count}x" if count > 1 else ""
        return f"gpu:{prefix}{_slug(info['gpu_name'])}"
    cores = info.get("cpu_cores_available") or info.get("cpu_cores_logical") or 0
    return f"cpu:{_slug(info.get('cpu_model') or 'unknown')}:{cores}c"


def measure_copy_bandwidth(
    device: str = "cpu", nbytes: int = 256 * 2**20, repeats: int = 5
) -> float:
    """Best-of-`repeats` device-to-same-device copy bandwidth in bytes/s.

    Counts bytes moved as STREAM's Copy does: each copy reads `nbytes` and writes `nbytes`,
    so the result is 2 * nbytes / seconds. Allocates two `nbytes` buffers on `device`.
    """
    if nbytes <= 0:
        raise WorkbenchError(f"nbytes must be positive, got {nbytes}")
    if repeats < 1:
        raise WorkbenchError(f"repeats must be at least 1, got {repeats}")
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise WorkbenchError("measure_copy_bandwidth needs torch, which is not importable") from exc
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise WorkbenchError(f"unknown device {device!r}; use 'cpu' or 'cuda[:N]'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise WorkbenchError(f"device {device!r} requested but torch sees no CUDA device")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in both buffers
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def _torch_and_gpu() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {}
    out: dict[str, Any] = {"torch": torch.__version__}
    if torch.version.cuda:
        out["gpu_runtime"] = f"cuda {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        out["gpu_runtime"] = f"hip {torch.version.hip}"
    try:
        available = torch.cuda.is_available()
    except Exception:  # a broken driver install must not break a run's manifest
        available = False
    if not available:
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(
        gpu_name=props.name,
        gpu_count=torch.cuda.device_count(),
        gpu_memory_bytes=int(props.total_memory),
        gpu_driver=_gpu_driver(),
    )
    return out


def _gpu_driver() -> str | None:
    for cmd in (
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        ["rocm-smi", "--showdriverversion", "--csv"],
    ):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        if done.returncode == 0 and lines:
            return lines[-1].split(",")[-1].strip()
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _physical_cores() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.cpu_count(logical=False)


def _available_cores() -> int | None:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _memory_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().total)


def _slug(name: str) -> str:
    cleaned = _NAME_NOISE.sub(" ", name)
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", cleaned).strip("-")
    return slug or "unknown"
