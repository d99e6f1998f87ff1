"""What the rerun, ladder and experiment screens need from the running app: where the rerun
reports (hub endpoint), where its log and records go (the recording), which launcher, the
windows to plan from — and the reruns launched from this session.

Kept apart from the screens so that the screens stay drawing and keys, and the app needs
one line per key to open them (`open_rerun_menu`, `open_ladder`, `open_experiments`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.diagnosis.window import Window
from rankscope.launch.runner import RunningRerun

DEFAULT_LAST = 64
"""Steps of a run the plan and the ladder read, at most."""


@dataclass
class RerunSession:
    """Reruns launched from this TUI session (they outlive the menu that started them)."""

    running: dict[str, RunningRerun] = field(default_factory=dict)

    def active(self) -> list[RunningRerun]:
        """Reruns still running."""
        return [r for r in self.running.values() if r.poll() is None]

    def cancel_all(self) -> None:
        """Cancel every rerun still running (the app is closing)."""
        for r in self.active():
            r.cancel(grace_s=2.0)


@dataclass(frozen=True)
class RerunContext:
    """Where a rerun started from the TUI reports, writes and launches."""

    hub: str | None
    """Endpoint of the hub the rerun reports to; None when no hub is reachable."""
    record: Path | None
    """The recording: logs go to ``reruns/``, experiment records to ``experiments/``."""
    launcher: str
    launcher_dirs: tuple[str, ...] = ()
    last: int = DEFAULT_LAST
    """Steps of a run to read from the app's own source when there is no recording to
    replay: the store's raw-row span when it is shorter, so that the decomposition counts
    overlapping asynchronous collectives once."""

    @classmethod
    def from_app(cls, app: Any) -> RerunContext:
        """Read the app's source: a live hub in this process, or a recording (whose hub,
        if one is writing it now, is named in its ``meta.json``).

        Args:
            app: the running `RankscopeApp` (anything with ``source`` and ``settings``).

        Returns:
            The context.
        """
        from rankscope.commands.rerun import live_hub

        source = app.source
        hub_obj = getattr(source, "hub", None)
        hub: str | None = None
        record: Path | None = None
        if hub_obj is not None:
            hub = getattr(hub_obj, "endpoint", None)
            rec = getattr(hub_obj, "record_dir", None)
            record = Path(rec) if rec else None
        elif getattr(source, "path", None) is not None:
            record = Path(source.path)
            hub = live_hub(record)
        last = DEFAULT_LAST
        raw = getattr(getattr(source, "store", None), "raw_steps", None)
        if isinstance(raw, int) and raw > 0:
            last = min(last, raw)
        return cls(hub=hub, record=record, launcher="", last=last)

    def with_launcher_for(self, window: Window | None) -> RerunContext:
        """The same context with the default launcher for a run: ``simulated`` for a run of
        the simulated cluster, else ``torchrun``."""
        if self.launcher:
            return self
        sim = isinstance((window.manifest if window is not None else {}).get("sim"), dict)
        return RerunContext(
            self.hub,
            self.record,
            "simulated" if sim else "torchrun",
            self.launcher_dirs,
            self.last,
        )


def load_windows(app: Any, ctx: RerunContext, runs: list[str]) -> dict[str, Window]:
    """Windows of ``runs`` for planning and the ladder (call from a worker thread).

    With a recording, it is replayed keeping every analysed step's raw rows (as the CLI
    does); otherwise the app's source is read for ``ctx.last`` steps.

    Args:
        app: the app.
        ctx: the context.
        runs: run ids.

    Returns:
        run -> window, for the runs that have one.
    """
    out: dict[str, Window] = {}
    if ctx.record is not None and (ctx.record / "meta.json").exists():
        from rankscope.commands.rerun import load_store

        store = load_store(ctx.record, DEFAULT_LAST)
        known = {r.run for r in store.runs()}
        for run in runs:
            if run in known:
                out[run] = store.window(run, last=DEFAULT_LAST)
        if len(out) == len(runs):
            return out
    for run in runs:
        if run not in out:
            w = app.source.window(run, ctx.last)
            if w is not None:
                out[run] = w
    return out


def shown_hypotheses(app: Any, run: str) -> tuple[Any, ...] | None:
    """The ranked hypotheses of the diagnosis on screen, when it is of ``run``.

    The app's diagnosis clock has already judged the run on screen (against the baseline
    when one is chosen); the rerun menu and the experiment form start from that verdict
    instead of diagnosing again, so they propose what the verdict line says.

    Args:
        app: the app (its ``analysis``, a `rankscope.tui.analysis.AnalysisView`).
        run: the run to plan or experiment on.

    Returns:
        ``rankscope.diagnosis.verdict.Hypothesis`` in the verdict's order, or None when the
        analysis on screen is of another run, failed, or has not arrived yet.
    """
    analysis = getattr(app, "analysis", None)
    if analysis is None or analysis.run != run or not analysis.ranked:
        return None
    return tuple(analysis.ranked)


def session_of(app: Any) -> RerunSession:
    """The app's rerun session, created on first use."""
    session = getattr(app, "_rerun_session", None)
    if session is None:
        session = RerunSession()
        app._rerun_session = session
    return session


def parent_of(app: Any) -> str | None:
    """The run a ladder or rerun starts from: the run on screen, or its parent when the
    run on screen is itself a rerun (known from the run list, or — before the rerun's first
    message — from the launch that started it)."""
    model = getattr(app, "model", None)
    window = getattr(model, "window", None)
    run = getattr(app, "run_id", None) or (window.run if window is not None else None)
    if run is None:
        return None
    launched = session_of(app).running.get(run)
    if launched is not None:
        return launched.launch.plan.parent_run
    for entry in getattr(model, "runs", ()) or ():
        if entry.run == run:
            return entry.parent_run or run
    if window is not None and window.run == run:
        return window.parent_run or run
    return run
