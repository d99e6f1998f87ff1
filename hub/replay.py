"""Rebuild a store from a recording, once (`load`) or following it as it grows (`Follower`).

Frames go through the same `Intake` as live messages, so a simulated or real rank, live or
replayed, is indistinguishable to everything downstream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from rankscope.hub.intake import Intake, RejectLog
from rankscope.hub.recording import ReadReport, follow, read_frames, read_meta
from rankscope.hub.store import Store, merge_counts

log = logging.getLogger("rankscope.hub")


def recorded_counters(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The live hubs' counters stored in ``meta.json``, summed over sessions.

    Returns:
        ``sessions``, ``rejects`` (reason -> count), ``transport`` (name -> count).
    """
    meta = read_meta(path)
    rejects: dict[str, int] = {}
    transport: dict[str, int] = {}
    sessions = meta.get("sessions", []) if isinstance(meta.get("sessions"), list) else []
    for s in sessions:
        counters = s.get("counters") or {}
        merge_counts(rejects, counters.get("rejects") or {})
        merge_counts(transport, counters.get("transport") or {})
    return {"sessions": len(sessions), "rejects": rejects, "transport": transport}


def _report_health(report: ReadReport) -> dict[str, Any]:
    return {
        "frames": report.frames,
        "bytes": report.bytes,
        "skipped": [dataclasses.asdict(s) for s in report.skipped],
        "skipped_bytes": report.skipped_bytes,
    }


def load(
    path: str | os.PathLike[str],
    *,
    store: Store | None = None,
    report: ReadReport | None = None,
    **store_args: Any,
) -> Store:
    """Replay a recording into a store.

    Args:
        path: recording directory (or one segment file).
        store: store to fill; a new ``Store(**store_args)`` by default.
        report: filled with frames read and regions skipped.
        store_args: passed to `Store` (``history_steps``...).

    Returns:
        The settled store. ``health["recording"]`` says what was read and skipped;
        ``health["recorded"]`` holds the live hub's counters (its rejects never reached the
        recording).

    Raises:
        RecordingError: no recording at ``path``, or a newer format.
    """
    store = store if store is not None else Store(**store_args)
    report = report if report is not None else ReadReport()
    intake = Intake(store, reject_log=RejectLog(every_s=60.0))
    for frame in read_frames(path, report):
        intake.feed(frame.payload, frame.t_recv_ns)
    store.settle()
    store.extra_health["recording"] = _report_health(report)
    store.extra_health["recorded"] = recorded_counters(path)
    return store


class Follower:
    """Feeds a store from a growing recording in a background thread (for viewers that
    attach to a running hub's record directory)."""

    def __init__(
        self, path: str | os.PathLike[str], store: Store | None = None, poll_s: float = 0.2
    ) -> None:
        self.path = path
        self.store = store if store is not None else Store()
        self.poll_s = poll_s
        self.report = ReadReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Follower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankscope-follow", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        intake = Intake(self.store, reject_log=RejectLog(every_s=60.0))
        try:
            for frame in follow(self.path, poll_s=self.poll_s, stop=self._stop, report=self.report):
                intake.feed(frame.payload, frame.t_recv_ns)
                self.store.extra_health["recording"] = _report_health(self.report)
        except Exception as exc:
            log.exception("following %s failed: %r", self.path, exc)

    def stop(self) -> None:
        """Stop following (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.store.extra_health["recording"] = _report_health(self.report)
        self.store.extra_health["recorded"] = recorded_counters(self.path)


def load_run(path: str | os.PathLike[str], run: str | None, steps: int) -> tuple[Store, Any]:
    """Replay a recording and take the window of one run, keeping the raw collective rows of
    every step in it (what ``diagnose``, ``export`` and the ladder need).

    Args:
        path: recording directory.
        run: run id, or None for the most recent run.
        steps: steps in the window (at least 1).

    Returns:
        ``(store, window)``.

    Raises:
        ValueError: naming what is wrong (no recording, unreadable recording, no run,
            unknown run, bad step count).
    """
    from pathlib import Path

    from rankscope.hub.recording import RecordingError

    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    if not Path(path).exists():
        raise ValueError(f"no recording at {str(path)!r}")
    try:
        store = load(path, history_steps=steps, raw_steps=steps)
    except RecordingError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not store.run_ids():
        raise ValueError(f"{path}: the recording holds no run")
    try:
        window = store.window(run, last=steps)
    except KeyError as exc:
        known = ", ".join(store.run_ids())
        raise ValueError(f"{path}: {exc.args[0]} (runs: {known})") from None
    return store, window
