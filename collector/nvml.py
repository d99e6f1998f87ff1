"""NVML access for device identity, manifest facts and samples — optional by design.

``pynvml`` (from ``nvidia-ml-py``) is imported only when a GPU is looked at. Without the
package, without a driver or on any NVML failure the functions here return None or NaN:
a CPU-only job and a GPU job with a broken NVML both train normally.
"""

from __future__ import annotations

import math
import threading
from typing import Any

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "nvml": None}


def nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None when NVML is not usable here."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import pynvml

                pynvml.nvmlInit()
                _state["nvml"] = pynvml
            except Exception:
                _state["nvml"] = None
        return _state["nvml"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def device_count() -> int:
    """GPUs NVML sees (0 without NVML)."""
    nv = nvml()
    if nv is None:
        return 0
    try:
        return int(nv.nvmlDeviceGetCount())
    except Exception:
        return 0


def handle(index: int) -> Any | None:
    """NVML handle of the GPU with this physical index, or None."""
    nv = nvml()
    if nv is None:
        return None
    try:
        return nv.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None


def index_of_uuid(uuid: str) -> int | None:
    """Physical index of the GPU with this UUID (``CUDA_VISIBLE_DEVICES`` may list UUIDs)."""
    for i in range(device_count()):
        h = handle(i)
        try:
            if h is not None and _text(nvml().nvmlDeviceGetUUID(h)).startswith(uuid):  # type: ignore[union-attr]
                return i
        except Exception:
            continue
    return None


def _numa_node(pci_bus: str) -> int | None:
    # NVML reports an 8-digit PCI domain; sysfs names devices with 4 ("0000:3b:00.0").
    domain, _, rest = pci_bus.lower().partition(":")
    path = f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node"
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def device_info(index: int) -> dict[str, Any]:
    """Identity and manifest facts of one GPU; keys are left out when NVML cannot say.

    Args:
        index: physical GPU index.

    Returns:
        ``gpu_uuid``, ``pci_bus``, ``numa_node`` (identity) and ``gpu_model``, ``driver``,
        ``sm_clock_max_mhz``, ``mem_clock_max_mhz``, ``sm_clock_app_mhz``, ``power_limit_w``,
        ``cuda_driver`` (manifest).
    """
    nv, h = nvml(), handle(index)
    if nv is None or h is None:
        return {}
    calls = {
        "gpu_uuid": lambda: _text(nv.nvmlDeviceGetUUID(h)),
        "pci_bus": lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId),
        "gpu_model": lambda: _text(nv.nvmlDeviceGetName(h)),
        "driver": lambda: _text(nv.nvmlSystemGetDriverVersion()),
        "cuda_driver": lambda: int(nv.nvmlSystemGetCudaDriverVersion()),
        "sm_clock_max_mhz": lambda: int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
        "mem_clock_max_mhz": lambda: int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)),
        "sm_clock_app_mhz": lambda: int(nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_SM)),
        "power_limit_w": lambda: nv.nvmlDeviceGetPowerManagementLimit(h) / 1000.0,
    }
    out: dict[str, Any] = {}
    for key, call in calls.items():
        try:
            out[key] = call()
        except Exception:
            continue
    if "pci_bus" in out:
        numa = _numa_node(out["pci_bus"])
        if numa is not None:
            out["numa_node"] = numa
    return out


NAN = math.nan


def sample(h: Any) -> tuple[float, float, float, float, int, float]:
    """One device sample: SM clock, memory clock (MHz), power (W), temperature (°C),
    throttle-reason bits and GPU utilisation (%). Unknown values are NaN (throttle -1).

    Args:
        h: an NVML handle (None gives all-unknown).
    """
    if h is None:  # no GPU for this rank: do not even import pynvml
        return (NAN, NAN, NAN, NAN, -1, NAN)
    nv = nvml()
    if nv is None:
        return (NAN, NAN, NAN, NAN, -1, NAN)

    def get(call: Any, default: Any) -> Any:
        try:
            return call()
        except Exception:
            return default

    sm = get(lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)), NAN)
    mem = get(lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)), NAN)
    power = get(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, NAN)
    temp = get(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)), NAN)
    # Newer NVML renamed throttle reasons to "clocks event reasons"; same bits.
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    throttle = get(lambda: int(reasons(h)), -1) if reasons else -1
    util = get(lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu), NAN)
    return (sm, mem, power, temp, throttle, util)
