"""Rebuild a store from a recording, once (`load`) or following it as it grows (`Follower`).

Frames go through the same `Intake` as live messages, so a simulated or real rank, live or
replayed, is indistinguishable to everything downstream.

A recording may hold records the current hub would refuse: written by an older hub, or by
one with a validation gap. Every record goes through the hub's decode and validation and,
a hello first through `reader_check` (what the readers cannot represent: identity integers
outside 32 bits, a mesh coordinate that is not an integer, a world too large to allocate). A
record refused by either is skipped and reported — a ``bad_record`` `Skip` in the read
report (segment, offset, reason and detail), one warning line each for the first
``WARN_BAD_RECORDS`` — and the replay goes on with the next: one bad record never costs
the rest of the recording, nor a traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from rankscope.collector import schema
from rankscope.hub.intake import Intake
from rankscope.hub.recording import (
    Frame,
    ReadReport,
    RecordingError,
    follow,
    read_frames,
    read_meta,
)
from rankscope.hub.store import Store, merge_counts

log = logging.getLogger("rankscope.hub")

WARN_BAD_RECORDS = 20
"""Bad records a replay warns about one line each; the rest are summed up in one line
(``rankscope inspect --json`` lists them)."""

MAX_WORLD_SIZE = 1 << 20
"""Largest world size a reader accepts in a hello: the store allocates rank x step grids
for a run, and a corrupt world size must not ask for terabytes."""

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_IDENTITY_INTS = {
    k: (_INT64 if k == "pid" else _INT32)
    for k, t in {**schema.HELLO_REQUIRED, **schema.HELLO_OPTIONAL}.items()
    if t is int
}
"""Identity integers and the range the readers hold them in (the rank table is int32)."""


def _int_problem(where: str, value: Any, bounds: tuple[int, int]) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{where} must be an integer, got {type(value).__name__}"
    if not bounds[0] <= value <= bounds[1]:
        bits = 32 if bounds == _INT32 else 64
        return f"{where} {value} is outside {bits} bits"
    return None


def reader_check(msg: schema.Message) -> tuple[str, str] | None:
    """What a reader cannot represent in a decoded message, beyond ``schema.decode`` and
    ``hub.validate``: the hub's ingest should refuse the same (issue 17), a reader checks
    anyway, for recordings written before it did.

    Args:
        msg: a message ``schema.decode`` accepted.

    Returns:
        ``(reason, detail)`` of the first problem, or None when the readers can hold it.
    """
    h = msg.header
    if msg.kind != "hello":
        return None  # data of an incarnation no accepted hello announced is refused anyway
    problem = _int_problem("inc", h.get("inc"), _INT32)
    if problem is not None:
        return "bad_hello", problem
    ident = h["identity"]
    for key, bounds in _IDENTITY_INTS.items():
        if ident.get(key) is not None:
            problem = _int_problem(f"identity.{key}", ident[key], bounds)
            if problem is not None:
                return "bad_hello", problem
    world = ident["world_size"]
    if world > MAX_WORLD_SIZE:
        return "bad_hello", f"identity.world_size {world} is over {MAX_WORLD_SIZE}"
    mesh = ident.get("mesh")
    if mesh is not None:
        if not isinstance(mesh, dict):
            return "bad_hello", f"identity.mesh must be a map, got {type(mesh).__name__}"
        for dim in schema.MESH_DIMS:
            if mesh.get(dim) is not None:
                problem = _int_problem(f"identity.mesh.{dim}", mesh[dim], _INT32)
                if problem is not None:
                    return "bad_hello", problem
    started = h.get("t_start_ns")
    if started is not None and not isinstance(started, bool) and isinstance(started, int):
        problem = _int_problem("t_start_ns", started, _INT64)
        if problem is not None:
            return "bad_hello", problem
    return None


class _RecordIntake:
    """The hub's `Intake`, record by record: a refused record becomes a ``bad_record``
    skip of the report (and a warning line) instead of the hub's reject log."""

    def __init__(self, store: Store, report: ReadReport, path: str | os.PathLike[str]) -> None:
        self.store = store
        self.report = report
        self.path = path
        self._last: tuple[str, str] | None = None
        self.intake = Intake(store, reject_log=self._rejected)

    def _rejected(self, reason: str, detail: str) -> None:
        self._last = (reason, detail)

    def feed(self, frame: Frame) -> bool:
        """Replay one frame; never raises. Returns whether (some of) it was kept."""
        self._last = None
        try:
            problem = None
            # Only a hello can carry what `reader_check` refuses (data of an incarnation
            # no accepted hello announced is the validation's): decode the rare hello
            # twice rather than every record.
            if b"hello" in frame.payload:
                try:
                    msg = schema.decode(frame.payload)
                except schema.SchemaError:
                    pass  # the intake decodes it again and says why
                else:
                    problem = reader_check(msg)
            if problem is not None:
                self.store.count_reject(problem[0])
                ok = False
                self._last = problem
            else:
                ok = self.intake.feed(frame.payload, frame.t_recv_ns)
        except Exception as exc:  # a reader bug must not end the replay
            ok = False
            self._last = ("internal_error", repr(exc))
        if not ok:
            reason, detail = self._last or ("rejected", "no reason given")
            self.report.bad_record(frame, reason, detail)
            n = self.report.bad_records
            if n <= WARN_BAD_RECORDS:
                log.warning(
                    "%s: skipped the record at %s offset %d: %s: %s",
                    self.path,
                    frame.segment,
                    frame.offset,
                    reason,
                    detail,
                )
        return ok

    def finish(self) -> None:
        """Warn once about the bad records past ``WARN_BAD_RECORDS``."""
        more = self.report.bad_records - WARN_BAD_RECORDS
        if more > 0:
            log.warning(
                "%s: skipped %d more bad records (rankscope inspect --json %s lists them)",
                self.path,
                more,
                self.path,
            )


def recorded_counters(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The live hubs' counters stored in ``meta.json``, summed over sessions.

    Returns:
        ``sessions``, ``rejects`` (reason -> count), ``transport`` (name -> count).
    """
    sessions = read_meta(path).get("sessions", [])
    rejects: dict[str, int] = {}
    transport: dict[str, int] = {}

    def counts(x: Any) -> dict[str, int]:  # what an older or damaged meta holds may be odd
        if not isinstance(x, dict):
            return {}
        return {str(k): v for k, v in x.items() if isinstance(v, int) and not isinstance(v, bool)}

    for s in sessions:
        counters = s.get("counters")
        counters = counters if isinstance(counters, dict) else {}
        merge_counts(rejects, counts(counters.get("rejects")))
        merge_counts(transport, counts(counters.get("transport")))
    return {"sessions": len(sessions), "rejects": rejects, "transport": transport}


def _report_health(report: ReadReport) -> dict[str, Any]:
    return {
        "frames": report.frames,
        "bytes": report.bytes,
        "skipped": [dataclasses.asdict(s) for s in report.skipped],
        "skipped_bytes": report.skipped_bytes,
        "bad_records": report.bad_records,
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
    intake = _RecordIntake(store, report, path)
    for frame in read_frames(path, report):
        intake.feed(frame)
    intake.finish()
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
        intake = _RecordIntake(self.store, self.report, self.path)
        try:
            for frame in follow(self.path, poll_s=self.poll_s, stop=self._stop, report=self.report):
                intake.feed(frame)
                self.store.extra_health["recording"] = _report_health(self.report)
        except RecordingError as exc:  # a newer format: what it is, not where it was seen
            log.error("following %s stopped: %s", self.path, exc)
        except Exception as exc:
            log.exception("following %s failed: %r", self.path, exc)
        intake.finish()

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
