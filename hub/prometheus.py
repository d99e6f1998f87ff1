"""A Prometheus endpoint over the hub's store (``rankscope hub --prometheus PORT``).

Nothing is updated per event: a custom collector builds every metric at scrape time from the
latest window of each run, so ingestion pays nothing for the endpoint and a scrape costs one
window read. Values summarize the window (the last N steps, N in
``rankscope_window_steps``): step time and lateness as medians over its steps, because
synchronous training follows per-rank maxima and a single last step is noisy between
scrapes.

Metrics (labels ``job``, ``run``, ``scope`` on all; per rank ``rank``, ``host``; per group
``group``, ``group_name``, ``op``):

=========================================  ===============================================
``rankscope_rank_step_seconds``            median step wall time of the rank
``rankscope_rank_last_step_seconds``       wall time of the rank's most recent step
``rankscope_rank_lateness_seconds``        median per-step sum of lateness (entry − first)
``rankscope_rank_wait_seconds``            median per-step arrival wait
``rankscope_rank_times_last``              instances the rank entered last, in the window
``rankscope_group_transfer_seconds``       median post-arrival transfer of the group's op
``rankscope_group_busbw_bytes_per_second`` median bus bandwidth (nccl-tests convention)
``rankscope_group_skew_seconds``           median arrival skew
``rankscope_group_instances``              complete instances in the window
``rankscope_run_last_step``                highest step id in the window
``rankscope_run_world_size``               ranks in the run
``rankscope_window_steps``                 steps the window covers
``rankscope_exporter_errors_total``        scrapes that failed to read a window
=========================================  ===============================================
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankscope.collector.schema import OPS
from rankscope.diagnosis.curves import algbw_bytes, bus_factor, transfer_time
from rankscope.diagnosis.window import Window

log = logging.getLogger(__name__)

RUN_LABELS = ("job", "run", "scope")
RANK_LABELS = (*RUN_LABELS, "rank", "host")
GROUP_LABELS = (*RUN_LABELS, "group", "group_name", "op")

WindowSource = Callable[[], Iterable[Window]]
HangSource = Callable[[], Iterable[tuple[tuple[str, str, str], Any]]]
"""Returns ``((job, run, scope), diagnosis.stall.Hang)`` of every run with heartbeats."""
CULPRIT_LABELS = (*RUN_LABELS, "rank", "host", "case", "group", "op", "seq")
"""Returns the latest window of every run to expose; called once per scrape."""


def _median_rows(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows give NaN, as wanted
        return np.nanmedian(x, axis=1) if x.shape[1] else np.full(x.shape[0], np.nan)


def _last_known(x: np.ndarray) -> np.ndarray:
    """Per row, the right-most finite value (NaN when none)."""
    ok = np.isfinite(x)
    idx = x.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1) if x.shape[1] else np.zeros(0, int)
    out = np.full(x.shape[0], np.nan)
    has = ok.any(axis=1) if x.shape[1] else np.zeros(x.shape[0], bool)
    out[has] = x[np.nonzero(has)[0], idx[has]]
    return out


def rank_metrics(window: Window) -> dict[str, np.ndarray]:
    """Per-rank values of the rank metrics, in seconds.

    Args:
        window: a run's window.

    Returns:
        Metric suffix -> float64 (R,) (NaN where the rank reported nothing).
    """
    step_s = np.where(window.present, window.step_ns, np.nan) / 1e9
    coll = window.coll
    present = window.present
    return {
        "step_seconds": _median_rows(step_s),
        "last_step_seconds": _last_known(step_s),
        "lateness_seconds": _median_rows(np.where(present, coll["late_ns"], np.nan)) / 1e9,
        "wait_seconds": _median_rows(np.where(present, coll["wait_ns"], np.nan)) / 1e9,
        "times_last": np.where(present.any(axis=1), np.nansum(coll["times_last"], axis=1), np.nan),
    }


def group_metrics(window: Window) -> list[tuple[int, int, dict[str, float]]]:
    """Per (group, op) medians over the window's complete collective instances.

    Args:
        window: a run's window.

    Returns:
        ``[(group id, op index, {"transfer_seconds", "busbw_bytes_per_second",
        "skew_seconds", "instances"})]`` sorted by group and op.
    """
    inst = window.instances
    done = np.nonzero(inst.n_arrived >= inst.n_members)[0]
    if done.shape[0] == 0:
        return []
    t = transfer_time(inst)[done]
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = algbw_bytes(inst.op[done], inst.nbytes[done], inst.n_members[done]) / t
    bus = np.where(
        np.isfinite(t) & (t > 0), alg * bus_factor(inst.op[done], inst.n_members[done]), np.nan
    )
    key = inst.group[done].astype(np.int64) * (len(OPS) + 1) + inst.op[done].astype(np.int64)
    keys, inv = np.unique(key, return_inverse=True)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for k in range(keys.shape[0]):
            sel = inv == k
            out.append(
                (
                    int(keys[k] // (len(OPS) + 1)),
                    int(keys[k] % (len(OPS) + 1)),
                    {
                        "transfer_seconds": float(np.nanmedian(inst.transfer[done][sel])) / 1e9,
                        # bytes/ns is GB/s; x1e9 gives the base unit, bytes per second.
                        "busbw_bytes_per_second": float(np.nanmedian(bus[sel])) * 1e9,
                        "skew_seconds": float(np.nanmedian(inst.skew[done][sel])) / 1e9,
                        "instances": float(sel.sum()),
                    },
                )
            )
    return out


_RANK_HELP = {
    "step_seconds": "Median step wall time of the rank over the window.",
    "last_step_seconds": "Wall time of the rank's most recent step.",
    "lateness_seconds": "Median per-step sum of the rank's lateness (entry minus first entry).",
    "wait_seconds": "Median per-step arrival wait of the rank (waiting for later ranks).",
    "times_last": "Collective instances the rank entered last, over the window.",
}
_GROUP_HELP = {
    "transfer_seconds": "Median post-arrival transfer time of the group's collectives.",
    "busbw_bytes_per_second": "Median bus bandwidth (nccl-tests convention) in bytes/s.",
    "skew_seconds": "Median arrival skew (last entry minus first entry).",
    "instances": "Complete collective instances of the group and op in the window.",
}


class WindowCollector(Collector):
    """A prometheus_client collector that reads the latest windows at scrape time.

    Args:
        source: returns the windows to expose (one per run); called once per scrape.
    """

    def __init__(self, source: WindowSource, hangs: HangSource | None = None) -> None:
        self._source = source
        self._hangs = hangs
        self._errors = 0
        self._lock = threading.Lock()
        self._logged = False

    @property
    def errors(self) -> int:
        """Scrapes whose window read failed."""
        return self._errors

    def _windows(self) -> list[Window]:
        try:
            return list(self._source())
        except Exception as exc:  # a failing read must not turn every scrape into a 500
            with self._lock:
                self._errors += 1
                if not self._logged:
                    self._logged = True
                    log.warning("prometheus: reading the store failed: %r", exc)
            return []

    def collect(self) -> Iterator[Metric]:
        """Build every metric family from the latest windows."""
        windows = self._windows()
        rank_fam = {
            k: GaugeMetricFamily(f"rankscope_rank_{k}", h, labels=RANK_LABELS)
            for k, h in _RANK_HELP.items()
        }
        group_fam = {
            k: GaugeMetricFamily(f"rankscope_group_{k}", h, labels=GROUP_LABELS)
            for k, h in _GROUP_HELP.items()
        }
        last_step = GaugeMetricFamily(
            "rankscope_run_last_step", "Highest step id in the window.", labels=RUN_LABELS
        )
        world = GaugeMetricFamily(
            "rankscope_run_world_size", "Ranks in the run.", labels=RUN_LABELS
        )
        steps = GaugeMetricFamily(
            "rankscope_window_steps", "Steps the window covers.", labels=RUN_LABELS
        )
        for w in windows:
            run = (w.job, w.run, w.scope)
            world.add_metric(run, float(w.world_size))
            steps.add_metric(run, float(w.steps.shape[0]))
            if w.steps.shape[0]:
                last_step.add_metric(run, float(w.steps[-1]))
            hosts = list(w.ranks.hosts)
            host_of = w.ranks.host.tolist()
            per_rank = {k: v.tolist() for k, v in rank_metrics(w).items()}
            reported = w.present.any(axis=1).tolist()
            for r in range(w.world_size):
                if not reported[r]:
                    continue
                h = host_of[r]
                rank_labels = [*run, str(r), hosts[h] if 0 <= h < len(hosts) else ""]
                for k, fam in rank_fam.items():
                    v = per_rank[k][r]
                    if v == v:  # NaN never reaches the exposition: absent means unknown
                        fam.add_metric(rank_labels, v)
            for gid, op, values in group_metrics(w):
                g = w.groups.get(gid)
                group_labels = [
                    *run,
                    str(gid),
                    g.name if g else f"g{gid}",
                    OPS[op] if op < len(OPS) else "other",
                ]
                for k, fam in group_fam.items():
                    v = values[k]
                    if v == v:
                        fam.add_metric(group_labels, v)
        yield from rank_fam.values()
        yield from group_fam.values()
        yield last_step
        yield world
        yield steps
        yield from self._stall_metrics()
        errors = CounterMetricFamily(
            "rankscope_exporter_errors", "Scrapes that failed to read a window."
        )
        errors.add_metric((), float(self._errors))
        yield errors

    def _stall_metrics(self) -> Iterator[Metric]:
        if self._hangs is None:
            return
        stalled = GaugeMetricFamily(
            "rankscope_stalled",
            "1 while no rank of the run progresses (a hang).",
            labels=RUN_LABELS,
        )
        idle = GaugeMetricFamily(
            "rankscope_stall_idle_seconds", "Seconds since any rank progressed.", labels=RUN_LABELS
        )
        culprit = GaugeMetricFamily(
            "rankscope_stall_culprit",
            "1 for each rank named as holding a stalled run.",
            labels=CULPRIT_LABELS,
        )
        try:
            hangs = list(self._hangs())
        except Exception as exc:
            with self._lock:
                self._errors += 1
            log.warning("prometheus: judging stalls failed: %r", exc)
            hangs = []
        for run, hang in hangs:
            stalled.add_metric(run, 1.0 if hang.stalled else 0.0)
            if hang.idle_s == hang.idle_s:
                idle.add_metric(run, float(hang.idle_s))
            for c in hang.culprits:
                labels = [*run, str(c.rank), c.host, c.case, str(c.group), c.op, str(c.seq)]
                culprit.add_metric(labels, 1.0)
        yield stalled
        yield idle
        yield culprit


def make_registry(
    source: WindowSource, hangs: HangSource | None = None
) -> tuple[CollectorRegistry, WindowCollector]:
    """A registry holding only the rankscope collector (no process or GC metrics).

    Args:
        source: returns the windows to expose.

    Returns:
        The registry and its collector.
    """
    registry = CollectorRegistry(auto_describe=False)
    collector = WindowCollector(source, hangs)
    registry.register(collector)
    return registry, collector


def store_source(store: Any, last: int = 100) -> WindowSource:
    """A window source over the hub's live store: the latest window of every run.

    Args:
        store: the hub's ``Store``: ``runs()`` (run summaries with a ``run`` id, or ids)
            and ``window(run_id, last=N)``.
        last: steps per window.

    Returns:
        The source.
    """

    def windows() -> Iterator[Window]:
        for summary in store.runs():
            w = store.window(getattr(summary, "run", summary), last=last)
            if w is not None:
                yield w

    return windows


def store_hangs(store: Any, watch: Any = None) -> HangSource:
    """A hang source over the hub's live store: the latest judgement of each run that
    has heartbeats (the `hub.hang.HangWatch`'s when given, else judged at the scrape)."""

    def hangs() -> Iterator[tuple[tuple[str, str, str], Any]]:
        import time

        from rankscope.hub.hang import judge_run

        for run_id in list(store.run_ids()):
            run = store.run_state(run_id)
            if run is None or not run.beats.count:
                continue
            rec = watch.records.get(run_id) if watch is not None else None
            hang = rec.hang if rec is not None else judge_run(store, run_id, time.time_ns())
            yield (run.job, run_id, run.scope), hang

    return hangs


def parse_listen(spec: str | int) -> tuple[str, int]:
    """Parse ``PORT`` or ``ADDR:PORT`` for the endpoint.

    A bare port listens on loopback only, so metrics of a job are not published to the
    network by accident; ``0.0.0.0:PORT`` (or an interface's address) serves a scraper on
    another host.

    Args:
        spec: ``9100``, ``"9100"``, ``"127.0.0.1:9100"`` or ``"[::1]:9100"``.

    Returns:
        ``(addr, port)``.

    Raises:
        ValueError: naming the spec when it is not a valid port or address.
    """
    text = str(spec).strip()
    addr, _, port_text = text.rpartition(":")
    addr = addr.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--prometheus {spec!r}: expected PORT or ADDR:PORT") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--prometheus {spec!r}: port {port} outside 0..65535")
    return addr, port


class PrometheusEndpoint:
    """An HTTP ``/metrics`` endpoint in a daemon thread, fed by a window source.

    Args:
        source: returns the windows to expose (see `store_source`).
        port: TCP port; 0 picks a free one (see ``port`` after `start`).
        addr: interface to bind.
    """

    def __init__(
        self,
        source: WindowSource,
        port: int,
        addr: str = "127.0.0.1",
        hangs: HangSource | None = None,
    ) -> None:
        self.registry, self.collector = make_registry(source, hangs)
        self.addr = addr
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Start serving.

        Returns:
            The bound port.

        Raises:
            OSError: when the address cannot be bound (port in use, bad interface).
        """
        self._server, self._thread = start_http_server(self.port, self.addr, self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> PrometheusEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
