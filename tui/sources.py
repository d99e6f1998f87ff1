"""Where the TUI's data comes from.

A `Source` hands out the run list, the latest `Window` of a run and the hub's health. The
app calls it from a worker thread on its sampling clock, never from the event loop, so a
source may block briefly (a store lock, a file read) but must be safe to call from a thread
other than the one that created it.

- `LiveSource` reads the store of a hub running in this process (``rankscope watch``).
- `RecordingSource` replays a recording into a private store and, with ``follow``, keeps
  reading it as it grows, in its own thread (``rankscope open``); any number of viewers can
  follow the same file without touching the hub that writes it.
- `StaticSource` serves fixed windows (tests, screenshots, a snapshot's saved window).

Every string in a window comes from telemetry. `sample` and `baseline_window` are where the
screens get their data, so they hand out only `rankscope.sanitize.clean_window` windows and
clean run entries: no host, job, phase or manifest string with a terminal escape reaches a
widget. Run ids stay as recorded (they are keys); widgets draw them through
``sanitize.for_terminal`` / ``for_markup``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from rankscope.diagnosis.window import Window
from rankscope.sanitize import clean_window, for_terminal


@dataclass(frozen=True)
class RunEntry:
    """One run as the run picker and the header show it."""

    job: str
    run: str
    scope: str = "full"
    parent_run: str | None = None
    world_size: int = 0
    """Ranks that said hello."""
    steps: int = 0
    """Steps received (the latest step id + 1 when the store does not count them)."""
    last_step: int = -1
    """Most recent step id (-1 before the first)."""


@dataclass(frozen=True)
class Sample:
    """What one tick of the sampling clock got from a source."""

    runs: tuple[RunEntry, ...]
    run: str | None
    """The run the window belongs to (the requested one, or the newest run)."""
    window: Window | None
    health: dict[str, Any] = field(default_factory=dict)
    """Hub counters: ``events_per_s``, ``dropped``, ``rejected``... (keys vary by source)."""
    error: str = ""
    """Why no window came back (an exception from the store, a missing run)."""


class Source(Protocol):
    """The data the TUI shows; see the module docstring."""

    label: str
    """Where the data comes from, for the header (``live tcp://*:5555``, a path...)."""
    live: bool
    """Whether new data keeps arriving (a live hub or a followed recording)."""

    def start(self) -> None:
        """Begin receiving or following (idempotent)."""

    def stop(self) -> None:
        """Stop threads this source started (idempotent)."""

    def runs(self) -> list[RunEntry]:
        """Known runs, oldest first."""

    def window(self, run: str, last: int) -> Window | None:
        """The last ``last`` steps of ``run`` (None when the run has no steps yet)."""

    def health(self) -> dict[str, Any]:
        """Hub and collector counters."""


MIN_STEPS = 16
"""Fewest steps a window is cut to by a cell bound."""


def steps_within(last: int, world_size: int, max_cells: int | None) -> int:
    """Steps to ask for so that ``world_size`` × steps stays within ``max_cells``.

    Args:
        last: steps wanted.
        world_size: ranks of the run (0 when unknown).
        max_cells: the bound (None: no bound).

    Returns:
        ``last``, or fewer (never below `MIN_STEPS`) for a large world.
    """
    if max_cells is None or world_size <= 0:
        return last
    return min(last, max(MIN_STEPS, max_cells // world_size))


def sample(source: Source, run: str | None, last: int, max_cells: int | None = None) -> Sample:
    """Take one sample: the run list, the window of ``run`` (default: the newest run that
    is not a rerun, else the newest) and the health counters.

    Errors raised by the source are caught and reported in ``Sample.error`` so a bad
    moment in the store never kills the sampling thread.

    Args:
        source: where to read.
        run: the run to show, or None to choose.
        last: steps of history.
        max_cells: bound on ranks × steps of the window (see `steps_within`).

    Returns:
        The sample.
    """
    try:
        runs = tuple(clean_entry(r) for r in source.runs())
        health = dict(source.health())
    except Exception as exc:  # a store mid-update must not kill the sampler
        return Sample((), run, None, {}, f"{type(exc).__name__}: {exc}")
    if run is None and runs:
        full = [r for r in runs if r.parent_run is None]
        run = (full or list(runs))[-1].run
    if run is None:
        return Sample(runs, None, None, health, "no runs yet")
    world = next((r.world_size for r in runs if r.run == run), 0)
    try:
        watch = getattr(source, "watch", None)
        if watch is not None:
            watch(run)  # the store keeps the shown run's history even once it finished
        window = clean_window(source.window(run, steps_within(last, world, max_cells)))
    except Exception as exc:
        return Sample(runs, run, None, health, f"{type(exc).__name__}: {exc}")
    return Sample(runs, run, window, health, "" if window is not None else "no steps yet")


def baseline_window(
    source: Source,
    run: str,
    runs: Sequence[RunEntry],
    last: int,
    max_cells: int | None,
    previous: Window | None = None,
) -> Window | None:
    """The baseline run's window, within its own cell bound (``view.baseline_max_cells``).

    A baseline is usually a finished run: ``previous`` (the window read last time) is
    returned as it is while the run list shows no newer step, so a finished baseline is
    read once, not on every tick.

    Args:
        source: where to read.
        run: the baseline run.
        runs: the run list of the latest sample.
        last: steps wanted.
        max_cells: bound on ranks × steps of the baseline window (see `steps_within`).
        previous: the baseline window read before, if any.

    Returns:
        The window (None when the run has no steps).
    """
    entry = next((r for r in runs if r.run == run), None)
    if (
        previous is not None
        and previous.run == run
        and entry is not None
        and entry.last_step >= 0
        and previous.steps.size > 0
        and int(previous.steps[-1]) == entry.last_step
    ):
        return previous
    world = entry.world_size if entry is not None else 0
    return clean_window(source.window(run, steps_within(last, world, max_cells)))


def clean_entry(entry: RunEntry) -> RunEntry:
    """A run entry whose job and scope are safe to draw (the run ids are keys: kept).

    Args:
        entry: as the source gave it.

    Returns:
        The entry, cleaned with `rankscope.sanitize.for_terminal`.
    """
    job, scope = for_terminal(entry.job), for_terminal(entry.scope)
    if job == entry.job and scope == entry.scope:
        return entry
    return replace(entry, job=job, scope=scope)


def run_entry(summary: Any) -> RunEntry:
    """Convert a store's run summary (any object or mapping with the usual names).

    Args:
        summary: an object with ``job``, ``run`` and optionally ``scope``, ``parent_run``,
            ``world_size``, ``steps_complete``/``steps``, ``last_step`` (None before the
            first step).

    Returns:
        The entry.
    """

    def get(name: str, default: Any = None) -> Any:
        if isinstance(summary, dict):
            return summary.get(name, default)
        return getattr(summary, name, default)

    last = get("last_step")
    last = int(last) if isinstance(last, int) else -1
    steps = get("steps_complete", get("steps"))
    if not isinstance(steps, int):
        steps = last + 1 if last >= 0 else 0
    return RunEntry(
        job=str(get("job", "")),
        run=str(get("run", "")),
        scope=str(get("scope", "full") or "full"),
        parent_run=get("parent_run"),
        world_size=int(get("world_size", 0) or 0),
        steps=int(steps),
        last_step=last,
    )


class StoreSource:
    """Reads a store object with ``runs()``, ``window(run, last=N)`` and ``health``."""

    live = True

    def __init__(self, store: Any, label: str) -> None:
        self.store = store
        self.label = label

    def start(self) -> None:
        """Nothing to start: the store is fed elsewhere."""

    def stop(self) -> None:
        """Nothing to stop."""

    def runs(self) -> list[RunEntry]:
        """Known runs."""
        return [run_entry(s) for s in self.store.runs()]

    def watch(self, run: str) -> None:
        """Tell the store the view shows ``run`` (a hub store plans its ring as active)."""
        keep = getattr(self.store, "watch", None)
        if keep is not None:
            keep(run)

    def window(self, run: str, last: int) -> Window | None:
        """The latest ``last`` steps of ``run``."""
        return self.store.window(run, last=last)

    def health(self) -> dict[str, Any]:
        """The store's health counters (a dict, or an object's public attributes)."""
        h = self.store.health
        h = h() if callable(h) else h
        if isinstance(h, dict):
            return dict(h)
        if hasattr(h, "__dataclass_fields__"):
            return {k: getattr(h, k) for k in h.__dataclass_fields__}
        return {k: v for k, v in vars(h).items() if not k.startswith("_")} if h else {}


class LiveSource(StoreSource):
    """The store of a hub running in this process; the hub's own threads feed it."""

    def __init__(self, hub: Any, label: str | None = None) -> None:
        super().__init__(hub.store, label or f"live {getattr(hub, 'bind', '')}".strip())
        self.hub = hub


WRITER_CHECK_S = 5.0
"""Seconds between two looks at a followed recording's ``meta.json``."""


class RecordingSource(StoreSource):
    """A recording replayed into a private store, optionally followed as it grows.

    Following reads the existing frames, then polls for new ones in a background thread
    (``rankscope.hub.replay.Follower``); it only reads the files, so the hub that writes
    them and other viewers are never disturbed.

    Args:
        path: the recording folder (or one segment file).
        follow: keep reading new frames in a background thread.
        follower: ``follower(path)`` -> an object with ``store``, ``start()`` and
            ``stop()`` (default ``rankscope.hub.replay.Follower``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        rankscope.hub.recording.RecordingError: ``path`` is not a recording.
    """

    def __init__(
        self,
        path: str | Path,
        follow: bool = True,
        follower: Callable[[Path], Any] | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"recording {self.path} does not exist")
        from rankscope.hub import replay

        self._follower: Any = None
        if follow:
            self._follower = (follower or replay.Follower)(self.path)
            store = self._follower.store
        else:
            store = replay.load(self.path)
        super().__init__(store, str(self.path))
        self._follow = follow
        self._writer_checked = -float("inf")
        self._writer = True
        self._started = False

    @property
    def live(self) -> bool:  # type: ignore[override]
        """Following, and the recording may still grow: no hub session yet (one may be
        starting), or a last session whose hub is still running (`session_liveness`: not
        stopped, its process alive, its heartbeat fresh). A finished recording — or one
        whose hub was killed — is not live, so the view does not call its end a stall."""
        if not self._follow:
            return False
        now = time.monotonic()
        if now - self._writer_checked >= WRITER_CHECK_S:
            self._writer_checked = now
            from rankscope.hub.recording import session_liveness

            self._writer = session_liveness(self.path).state in ("none", "live")
        return self._writer

    def start(self) -> None:
        """Start following the file (once)."""
        if self._follower is not None and not self._started:
            self._started = True
            self._follower.start()

    def stop(self) -> None:
        """Stop following (idempotent)."""
        if self._follower is not None and self._started:
            self._follower.stop()
            self._started = False


class StaticSource:
    """Fixed windows, one per run (tests, screenshots, saved windows).

    Args:
        windows: the windows, in run order (oldest first).
        health: counters shown in the header.
        label: where the data is said to come from.
    """

    live = False

    def __init__(
        self,
        windows: Sequence[Window],
        health: dict[str, Any] | None = None,
        label: str = "static",
    ) -> None:
        self._windows = {w.run: w for w in windows}
        self._health = dict(health or {})
        self.label = label

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Nothing to stop."""

    def runs(self) -> list[RunEntry]:
        """One entry per window."""
        return [
            RunEntry(
                job=w.job,
                run=w.run,
                scope=w.scope,
                parent_run=w.parent_run,
                world_size=w.world_size,
                steps=int(w.steps.size),
                last_step=int(w.steps[-1]) if w.steps.size else -1,
            )
            for w in self._windows.values()
        ]

    def window(self, run: str, last: int) -> Window | None:
        """The stored window of ``run`` (``last`` is ignored: it is already cut)."""
        return self._windows.get(run)

    def health(self) -> dict[str, Any]:
        """The fixed counters."""
        return dict(self._health)


def beat_verdict(source: Any, run: str) -> Any | None:
    """The heartbeat judge's verdict (`rankscope.hub.hang.judge_run`, the hub's own) on
    ``run`` from ``source``'s store, judged now for a live source and at the last beat for
    a recording; None where the store holds no beats of the run (a simulated job, an old
    recording) or cannot be judged."""
    store = getattr(source, "store", None)
    try:
        state = store.run_state(run) if store is not None else None
        if state is None or not state.beats.count:
            return None
        from rankscope.hub.hang import judge_run

        live = bool(getattr(source, "live", True))
        now = time.time_ns() if live else int(state.beats.heard_ns.max())
        return judge_run(store, run, now)
    except Exception:  # a view of the data must not fail on it
        return None
