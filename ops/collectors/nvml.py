"""GPU readings through NVML: one wrapper for every call, degrading to "no GPU" without a driver.

Every NVML call goes through `nvml_query`, which returns a sentinel (`NA`) when pynvml, the
driver or the function is missing, and logs each missing function once: a host without a GPU
or with an older driver degrades, never raises.
`read_raw()` returns one JSON-able dict per GPU, keyed as in `FIELDS`; the pure
`ops.parsers.nvml.parse_device` turns such a dict into a `GpuReading`. The capture script dumps
the same dicts (`ops.collectors.nvml.main`), so the parser is tested on real readings.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ops.parsers.nvml import GpuReading, parse_device

log = logging.getLogger(__name__)


class _NotAvailable:
    """The sentinel of a reading NVML could not give (no driver, no function, not supported)."""

    _instance: _NotAvailable | None = None

    def __new__(cls) -> _NotAvailable:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "N/A"


NA: Any = _NotAvailable()

_lock = threading.Lock()
_logged: set[str] = set()
_init: dict[str, Any] = {"done": False, "ok": False, "module": None}


def _log_once(key: str, message: str) -> None:
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.info(message)


def _library() -> Any:
    """The initialized pynvml module, or None when pynvml or the driver is missing."""
    with _lock:
        if _init["done"]:
            return _init["module"] if _init["ok"] else None
        _init["done"] = True
        try:
            import pynvml
        except ImportError:
            _init["ok"] = False
            reason = "pynvml is not installed"
        else:
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                _init["ok"] = False
                reason = f"NVML init failed: {exc}"
            else:
                _init["ok"] = True
                _init["module"] = pynvml
                return pynvml
    _log_once("init", f"no GPU readings: {reason}")
    return None


def _call(fn_name: str, *args: Any) -> tuple[Any, str | None]:
    """Call one NVML function; return (value, None) or (NA, why it failed)."""
    lib = _library()
    if lib is None:
        return NA, "NVML not available"
    fn: Callable[..., Any] | None = getattr(lib, fn_name, None)
    if fn is None:
        _log_once(fn_name, f"NVML function {fn_name} is missing from this pynvml; reading skipped")
        return NA, "function missing from pynvml"
    try:
        value = fn(*args)
    except lib.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code in (lib.NVML_ERROR_FUNCTION_NOT_FOUND, lib.NVML_ERROR_NOT_SUPPORTED):
            _log_once(fn_name, f"NVML function {fn_name} not supported here: {exc}")
        return NA, str(exc)
    return value, None


def nvml_query(fn_name: str, *args: Any, default: Any = NA) -> Any:
    """Call `pynvml.<fn_name>(*args)`; `default` when the driver or function is missing or fails.

    Units are NVML's: bytes for memory, KB/s for PCIe throughput, a count for replays.
    Byte strings (older pynvml) are decoded to str.
    """
    value, error = _call(fn_name, *args)
    if error is not None:
        return default
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _jsonable(value: Any) -> Any:
    """NVML structs as dicts, bytes as str, so a reading can be dumped to JSON and parsed back."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    fields = getattr(value, "_fields_", None)
    if fields is not None:
        out = {}
        for field in fields:
            name = field[0]
            if name == "version" or name.startswith("reserved_"):
                continue
            item = getattr(value, name, None)
            converted = _jsonable(item)
            if isinstance(converted, (str, int, float, bool, dict)):
                out[name] = converted
        return out
    return str(value)


def _memory_args(lib: Any, handle: Any) -> tuple[Any, ...]:
    """Arguments for nvmlDeviceGetMemoryInfo: the v2 struct (with `reserved`) when pynvml has it."""
    version = getattr(lib, "nvmlMemory_v2", None)
    return (handle,) if version is None else (handle, version)


# key in the raw dict -> (NVML function, extra args after the handle, unit)
FIELDS: dict[str, tuple[str, tuple[Any, ...], str]] = {
    "name": ("nvmlDeviceGetName", (), "text"),
    "uuid": ("nvmlDeviceGetUUID", (), "text"),
    "pci": ("nvmlDeviceGetPciInfo", (), "struct (busId)"),
    "memory": ("nvmlDeviceGetMemoryInfo", (), "bytes (total, used, free, reserved)"),
    "pcie_tx": ("nvmlDeviceGetPcieThroughput", (0,), "KB/s over the last 20 ms (TX)"),
    "pcie_rx": ("nvmlDeviceGetPcieThroughput", (1,), "KB/s over the last 20 ms (RX)"),
    "link_gen": ("nvmlDeviceGetCurrPcieLinkGeneration", (), "PCIe generation"),
    "link_gen_max": ("nvmlDeviceGetMaxPcieLinkGeneration", (), "generation, GPU and slot"),
    "link_gen_gpu_max": ("nvmlDeviceGetGpuMaxPcieLinkGeneration", (), "generation, GPU alone"),
    "link_width": ("nvmlDeviceGetCurrPcieLinkWidth", (), "lanes"),
    "link_width_max": ("nvmlDeviceGetMaxPcieLinkWidth", (), "lanes"),
    "replay_counter": ("nvmlDeviceGetPcieReplayCounter", (), "count since driver load"),
    "utilization": ("nvmlDeviceGetUtilizationRates", (), "percent (gpu, memory)"),
}


def device_count() -> int:
    """Number of GPUs NVML sees; 0 without a driver."""
    count = nvml_query("nvmlDeviceGetCount", default=0)
    return int(count) if isinstance(count, int) else 0


def read_raw(*, timings: bool = False) -> list[dict[str, Any]]:
    """One dict per GPU: FIELDS keys -> JSON-able values (None where NVML gave nothing).

    With `timings`, each dict also holds `_errors` (why a field is None) and `_call_us`
    (microseconds per call), which the capture script records.
    """
    lib = _library()
    if lib is None:
        return []
    devices: list[dict[str, Any]] = []
    for index in range(device_count()):
        handle, error = _call("nvmlDeviceGetHandleByIndex", index)
        raw: dict[str, Any] = {"index": index}
        errors: dict[str, str] = {}
        call_us: dict[str, float] = {}
        if error is not None:
            raw["_errors"] = {"handle": error}
            devices.append(raw)
            continue
        for key, (fn_name, extra, _unit) in FIELDS.items():
            args = _memory_args(lib, handle) if key == "memory" else (handle, *extra)
            start = time.perf_counter()
            value, error = _call(fn_name, *args)
            if error is not None and key == "memory" and len(args) == 2:
                value, error = _call(fn_name, handle)  # a driver without the v2 struct
            call_us[key] = round((time.perf_counter() - start) * 1e6, 1)
            raw[key] = None if error is not None else _jsonable(value)
            if error is not None:
                errors[key] = error
        if timings:
            raw["_errors"] = errors
            raw["_call_us"] = call_us
        devices.append(raw)
    return devices


def read() -> list[GpuReading]:
    """Parsed readings of every GPU; an empty list without a driver or GPU."""
    return [parse_device(raw) for raw in read_raw()]


def dump() -> dict[str, Any]:
    """Everything NVML says about this host, as the JSON the fixtures hold."""
    return {
        "driver_version": nvml_query("nvmlSystemGetDriverVersion", default=None),
        "nvml_version": nvml_query("nvmlSystemGetNVMLVersion", default=None),
        "cuda_driver_version": nvml_query("nvmlSystemGetCudaDriverVersion", default=None),
        "devices": read_raw(timings=True),
    }


def main() -> None:
    """Print `dump()` as JSON (the capture script's nvml.json)."""
    json.dump(dump(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
