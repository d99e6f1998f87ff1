"""Host sampling from /proc, NVML present / absent / failing, and CUDA-event resolution.

This machine has no GPU: NVML and CUDA events are replaced by small fakes that behave
like the real APIs (the only mocks in the collector tests)."""

from __future__ import annotations

import math
import socket
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rankscope.collector import nvml, schema
from rankscope.collector.cuda_events import DeviceTimer
from rankscope.collector.identity import Identity
from rankscope.collector.monitor import Monitor
from rankscope.collector.pump import FLAG_PENDING
from rankscope.collector.sampling import Sampler, read_cpu_times, read_load1, read_rss_bytes


def test_proc_readers_on_this_host() -> None:
    busy, total = read_cpu_times()  # type: ignore[misc]
    assert 0 <= busy <= total and total > 0
    assert read_load1() >= 0
    assert read_rss_bytes() > 1 << 20


def test_proc_readers_on_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_text("not a proc file\n")
    assert read_cpu_times(str(bad)) is None
    assert read_cpu_times(str(tmp_path / "missing")) is None
    assert math.isnan(read_load1(str(bad)))
    assert read_rss_bytes(str(bad)) == -1


@pytest.fixture
def fresh_nvml() -> Iterator[None]:
    saved = dict(nvml._state)
    saved_mod = sys.modules.get("pynvml")
    nvml._state.update(tried=False, nvml=None)
    yield
    nvml._state.clear()
    nvml._state.update(saved)
    if saved_mod is None:
        sys.modules.pop("pynvml", None)
    else:
        sys.modules["pynvml"] = saved_mod


def _fake_pynvml(fail_init: bool = False, broken: tuple[str, ...] = ()) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0

    def call(name: str, value: object):
        def f(*args: object) -> object:
            if name in broken:
                raise RuntimeError(f"{name} not supported")
            return value

        return f

    def init() -> None:
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    m.nvmlInit = init
    m.nvmlDeviceGetCount = call("count", 2)
    m.nvmlDeviceGetHandleByIndex = call("handle", object())
    m.nvmlDeviceGetUUID = call("uuid", b"GPU-1234-abcd")
    m.nvmlDeviceGetPciInfo = call("pci", types.SimpleNamespace(busId=b"00000000:3B:00.0"))
    m.nvmlDeviceGetName = call("name", "NVIDIA H100 80GB HBM3")
    m.nvmlSystemGetDriverVersion = call("driver", "550.54.15")
    m.nvmlSystemGetCudaDriverVersion = call("cuda", 12040)
    m.nvmlDeviceGetMaxClockInfo = call("maxclock", 1980)
    m.nvmlDeviceGetApplicationsClock = call("appclock", 1755)
    m.nvmlDeviceGetPowerManagementLimit = call("plimit", 700_000)
    m.nvmlDeviceGetClockInfo = call("clock", 1410)
    m.nvmlDeviceGetPowerUsage = call("power", 512_000)
    m.nvmlDeviceGetTemperature = call("temp", 71)
    m.nvmlDeviceGetCurrentClocksEventReasons = call("reasons", 0x20)
    m.nvmlDeviceGetUtilizationRates = call("util", types.SimpleNamespace(gpu=97))
    return m


def test_nvml_present(fresh_nvml: None) -> None:
    sys.modules["pynvml"] = _fake_pynvml()
    info = nvml.device_info(0)
    assert info["gpu_uuid"] == "GPU-1234-abcd" and info["pci_bus"] == "00000000:3B:00.0"
    assert info["gpu_model"].startswith("NVIDIA") and info["power_limit_w"] == 700.0
    assert info["sm_clock_max_mhz"] == 1980 and info["driver"] == "550.54.15"
    assert nvml.sample(nvml.handle(0)) == (1410.0, 1410.0, 512.0, 71.0, 0x20, 97.0)
    assert nvml.index_of_uuid("GPU-1234") == 0


def test_nvml_absent_or_failing_is_silent(fresh_nvml: None) -> None:
    sys.modules["pynvml"] = _fake_pynvml(fail_init=True)
    assert nvml.nvml() is None and nvml.device_info(0) == {} and nvml.device_count() == 0
    sm, mem, power, temp, throttle, util = nvml.sample(nvml.handle(0))
    assert all(math.isnan(v) for v in (sm, mem, power, temp, util)) and throttle == -1


def test_nvml_partial_support(fresh_nvml: None) -> None:
    sys.modules["pynvml"] = _fake_pynvml(broken=("power", "reasons", "plimit"))
    sample = nvml.sample(nvml.handle(0))
    assert sample[0] == 1410.0 and math.isnan(sample[2]) and sample[4] == -1
    assert "power_limit_w" not in nvml.device_info(0)


def test_sampler_columns_without_and_with_nvml(fresh_nvml: None) -> None:
    sys.modules["pynvml"] = _fake_pynvml(fail_init=True)
    s = Sampler(gpu_index=0)
    s.sample_once()
    s.sample_once()
    cols = s.drain()
    assert cols is not None and list(cols) == list(schema.SAMPLE_COLUMNS)
    assert np.isnan(cols["sm_clock_mhz"]).all() and (cols["throttle"] == -1).all()
    assert (cols["rss_bytes"] > 0).all() and np.isfinite(cols["load1"]).all()
    assert s.drain() is None
    nvml._state.update(tried=False, nvml=None)
    sys.modules["pynvml"] = _fake_pynvml()
    s = Sampler(gpu_index=0)
    s.sample_once()
    cols = s.drain()
    assert cols is not None and cols["sm_clock_mhz"][0] == 1410.0 and cols["throttle"][0] == 0x20


# -- CUDA events --------------------------------------------------------------------------
class FakeClock:
    """The device's timeline, in ms, advanced by the test."""

    now_ms = 0.0


class FakeEvent:
    def __init__(self, enable_timing: bool = True) -> None:
        self.t: float | None = None
        self.done = False

    def record(self) -> None:
        self.t = FakeClock.now_ms
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "elapsed_time needs both events completed"
        return end.t - self.t  # type: ignore[operator]


class FakeCuda:
    Event = FakeEvent

    def __init__(self) -> None:
        self.recorded: list[FakeEvent] = []

    def Stream(self) -> object:
        return object()

    def stream(self, _s: object) -> object:
        import contextlib

        return contextlib.nullcontext()


def _monitor() -> Monitor:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Monitor(
        job="j",
        run="r",
        identity=Identity(rank=0, world_size=1, local_rank=0, host="h", node_rank=0, pid=1),
        hub=f"tcp://127.0.0.1:{port}",
        flush_interval_s=3600,
        sample_interval_s=0,
        clock_sync=False,
    )


def test_device_times_resolve_lazily_from_events() -> None:
    mon = _monitor()
    timer = DeviceTimer(mon, types.SimpleNamespace(cuda=FakeCuda()))
    mon.begin_step(0)
    FakeClock.now_ms = 1000.0
    timer._maybe_anchor()
    anchor_ev, anchor_host = timer._anchor_next  # type: ignore[misc]
    FakeClock.now_ms = 1002.5
    start = timer.event()
    FakeClock.now_ms = 1004.0
    end = timer.event()
    row = mon._rec_coll(0, 0, 64, 10, 20, FLAG_PENDING)
    timer.track(row, start, end)
    timer.resolve()  # nothing has completed on the device: the row stays pending
    r = mon._colls.unread()[0]
    assert r["flags"] & FLAG_PENDING and r["t_start"] == schema.NO_TIME
    anchor_ev.done = start.done = True
    timer.resolve()  # the end event is still running
    assert mon._colls.unread()[0]["flags"] & FLAG_PENDING
    end.done = True
    timer.resolve()
    r = mon._colls.unread()[0]
    assert r["t_start"] == anchor_host + 2_500_000
    assert r["t_end"] == anchor_host + 4_000_000
    assert r["flags"] == schema.FLAG_DEVICE_TIMED
    assert timer.resolved == 1 and len(timer._pool) == 2  # events go back to the pool
    mon.close(timeout_s=0.1)


def test_device_timer_gives_up_on_consumed_rows() -> None:
    mon = _monitor()
    timer = DeviceTimer(mon, types.SimpleNamespace(cuda=FakeCuda()))
    mon.begin_step(0)
    timer._maybe_anchor()
    timer._anchor_next[0].done = True  # type: ignore[index]
    start, end = timer.event(), timer.event()
    row = mon._rec_coll(0, 0, 64, 10, 20, FLAG_PENDING)
    timer.track(row, start, end)
    mon._colls.consume(1)  # shipped without device times (e.g. it waited too long)
    start.done = end.done = True
    timer.resolve()
    assert timer.abandoned == 1 and timer.resolved == 0
    mon.close(timeout_s=0.1)
