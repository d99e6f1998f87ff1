"""The rankscope TUI: composition, bindings and routing.

`make_app(settings, source)` is the one way to build it, for the CLI and for every test.
Two clocks drive it (``clocks``): the sampling clock (``refresh.sample_hz``) asks the
source for the latest window in a worker thread and builds the main-screen model there;
the diagnosis clock (``refresh.diagnosis_s``) runs the analysis in another worker. Both
finish by posting a message that this module routes to the screens; only the event loop
touches widgets. View changes (metric, grouping, pins, filter, zoom) rebuild the model
from the last sample without waiting for the next one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.screen import ModalScreen

from rankscope.diagnosis.window import Window
from rankscope.sanitize import for_terminal
from rankscope.tui.analysis import AnalysisView
from rankscope.tui.clocks import Clocks
from rankscope.tui.detail_screen import RankDetailScreen
from rankscope.tui.detailmodel import RankDetail
from rankscope.tui.dialogs import NO_BASELINE, BaselinePicker, FilterDialog, HelpScreen
from rankscope.tui.heatmap import Heatmap
from rankscope.tui.main_screen import MainScreen
from rankscope.tui.mainmodel import MainModel, ViewState
from rankscope.tui.messages import AnalysisReady, ModelReady
from rankscope.tui.metrics import busy_excess, filter_mask, next_dimension, slowest_ranks
from rankscope.tui.report_screens import (
    CurvesScreen,
    ManifestScreen,
    StallScreen,
    StructureScreen,
)
from rankscope.tui.settings import METRICS, Settings, ViewSettings
from rankscope.tui.sources import Sample, Source, beat_verdict
from rankscope.tui.viewstate import SavedView, load_view, save_view

REPORTS = {"structure": StructureScreen, "curves": CurvesScreen, "manifest": ManifestScreen}


class RankscopeApp(Clocks, App[int]):
    """Live view of a distributed training job; see the module docstring."""

    TITLE = "rankscope"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("question_mark", "help", "Help", tooltip="This list of keys (every screen's)"),
        Binding(
            "r",
            "rerun",
            "Rerun",
            tooltip="Plan and launch a rerun, or the swap/sweep the verdict proposes",
        ),
        Binding("q", "quit", "Quit", tooltip="Quit (the hub and recording are not affected)"),
        Binding(
            "p", "pause", "Pause", show=False, tooltip="Freeze the view (data keeps being recorded)"
        ),
        Binding("b", "baseline", "Baseline", show=False, tooltip="Choose the baseline run"),
        Binding(
            "L",
            "ladder",
            "Ladder",
            show=False,
            tooltip="Each scope's rerun next to the full run; the run's sweeps",
        ),
        Binding(
            "e",
            "experiment",
            "Experiment",
            show=False,
            tooltip="Record, judge or stage an experiment",
        ),
        Binding(
            "ctrl+s",
            "snapshot",
            "Snapshot",
            tooltip="Write a snapshot bundle for a ticket",
            show=False,
        ),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | q | Quit (the hub and the recording are not affected). |
    | ? | The list of keys. |
    | p | Pause or resume the view; data keeps being received and recorded. |
    | b | Choose the baseline run. |
    | r | Rerun menu: `1` one-rank, `n` one-node, `2` two-node, `f` full; `s` the swap or sweep the verdict proposes. |
    | L | The ladder: each scope's rerun next to the full run, and the first scope that regresses. |
    | e | Experiments: record hypothesis, change, prediction and rejection condition; judge them; stage a supported one (`ctrl+t`). |
    | ctrl+s | Write a snapshot bundle (Markdown, JSON, screen, raw window) in the current folder. |
    """

    metric: reactive[str] = reactive(ViewSettings.metric)
    """Heatmap metric (``settings.METRICS``)."""
    group_by: reactive[str] = reactive("host")
    """Row grouping dimension (``settings.GROUP_BY``)."""
    paused: reactive[bool] = reactive(False)
    """The view is frozen; the source keeps receiving."""
    pins: reactive[tuple[int, ...]] = reactive(())
    """Pinned ranks, shown first in the heatmap."""
    filter_text: reactive[str] = reactive("")
    """Rank/host filter (see ``metrics.filter_mask``)."""
    zoom: reactive[int | None] = reactive(None)
    """Group code zoomed into (ranks of that group, one row each)."""
    zoom_up: reactive[int | None] = reactive(None)
    """Rolled-up group (a rack) zoomed into: its hosts shown as rows."""
    baseline_run: reactive[str | None] = reactive(None)
    """Run the header, decomposition and manifest compare against."""

    def __init__(
        self,
        settings: Settings,
        source: Source,
        *,
        clock: Callable[[], float] = time.monotonic,
        run: str | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.source = source
        self.clock = clock
        self.run_id = run
        self.model: MainModel | None = None
        self.analysis: AnalysisView | None = None
        self.detail: RankDetail | None = None
        self.diagnosing = False
        self._sample: Sample | None = None
        self._baseline: Window | None = None
        self._baseline_for: str | None = None
        self._baseline_read: Window | None = None
        self._baseline_lock = threading.Lock()
        self._generation = 0
        self._sampling = False
        self._analysed: tuple | None = None
        self._restored_job: str | None = None
        self._last_step: int | None = None
        self._last_progress = clock()
        self._stall_dismissed = False
        self._fixed_view = False
        self._shown_run: str | None = None
        self.default_baseline: str | None = None
        """The baseline the view starts with (``make_app(baseline=...)``); ``R`` returns
        to it."""
        self._restored: SavedView | None = None
        self._held_pins: tuple[tuple[int, ...], str | None] | None = None
        self._pins_run: str | None = None
        self._restoring = False
        self.set_reactive(RankscopeApp.metric, settings.view.metric)
        self.set_reactive(RankscopeApp.group_by, settings.view.group_by)
        if not settings.display.animation:
            self.animation_level = "none"

    def initial_view(
        self,
        *,
        metric: str | None = None,
        group_by: str | None = None,
        pins: tuple[int, ...] = (),
        baseline_run: str | None = None,
        filter_text: str = "",
        zoom: int | None = None,
    ) -> None:
        """Open on this view (a snapshot's) instead of the job's saved one. Nothing is saved
        to the job's state while it is shown, so a snapshot never overwrites it.

        Call before the app runs.
        """
        if metric is not None:
            self.set_reactive(RankscopeApp.metric, metric)
        if group_by is not None:
            self.set_reactive(RankscopeApp.group_by, group_by)
        self.set_reactive(RankscopeApp.pins, tuple(pins))
        self.set_reactive(RankscopeApp.baseline_run, baseline_run)
        self.set_reactive(RankscopeApp.filter_text, filter_text)
        self.set_reactive(RankscopeApp.zoom, zoom)
        self._fixed_view = True

    # ----------------------------------------------------------------- lifecycle

    @property
    def color_system(self) -> str:
        """The palette family to draw with (settings, else what the terminal reports)."""
        chosen = self.settings.display.color
        if chosen != "auto":
            return chosen
        return self.console.color_system or "truecolor"

    def on_mount(self) -> None:
        self.theme = self.settings.display.theme
        self.source.start()
        self.push_screen(MainScreen())
        self.set_interval(1.0 / self.settings.refresh.sample_hz, self.sample_tick)
        self.set_interval(self.settings.refresh.diagnosis_s, self.diagnosis_tick)
        self.sample_tick()

    def on_unmount(self) -> None:
        self.source.stop()

    def header_extra(self) -> str:
        """Clock and machine name for the header, as the settings allow."""
        parts = [self.source.label]
        if self.settings.display.show_machine:
            parts.append(socket.gethostname())
        if self.settings.display.show_clock:
            parts.append(time.strftime("%H:%M:%S"))
        return " · ".join(p for p in parts if p)

    @property
    def view(self) -> ViewState:
        """The current view choices."""
        return ViewState(
            metric=self.metric,
            group_by=self.group_by,
            pins=self.pins,
            filter=self.filter_text,
            zoom=self.zoom,
            zoom_up=self.zoom_up,
            rank_rows_max=self.settings.view.rank_rows_max,
            group_rows_max=self.settings.view.group_rows_max,
            last_arrivals=self.settings.view.last_arrivals,
        )

    def _detail_rank(self) -> int | None:
        for screen in reversed(self.screen_stack):
            if isinstance(screen, RankDetailScreen):
                return screen.rank
        return None

    def _top(self):
        # Messages and timers can still arrive while the app shuts down and the screen
        # stack is already empty.
        return self.screen_stack[-1] if self.screen_stack else None

    def _blocked(self) -> bool:
        top = self._top()
        return top is None or self.paused or isinstance(top, ModalScreen)

    # ----------------------------------------------------------------- routing

    def on_model_ready(self, message: ModelReady) -> None:
        if message.generation < self._generation:
            return
        self._sample = message.sample
        self._baseline = message.baseline
        self._baseline_for = message.baseline_run
        self.model = message.model
        shown = message.model.window.run if message.model.window is not None else None
        if shown is not None and self._shown_run not in (None, shown) and self.run_id is None:
            # Without --run the view follows the newest full run (reruns name their parent
            # and never take its place): a recording being read, or a job restarted.
            self.notify(f"showing {for_terminal(shown)}, the newest run", timeout=4, markup=False)
        self._shown_run = shown or self._shown_run
        if message.detail is not None:
            self.detail = message.detail
        self._restore_view(message.model)
        self._check_stall(message.model)
        self._show_model()
        if self._analysed is None:
            # The first window (or a new baseline) should not wait a full diagnosis period.
            self.diagnosis_tick()

    def _show_model(self) -> None:
        screen = self._top()
        # A screen being composed or torn down has no widgets yet (or any more); it draws
        # the latest model itself when it mounts or resumes.
        try:
            if isinstance(screen, MainScreen) and self.model is not None:
                screen.show_model(self.model)
            elif isinstance(screen, RankDetailScreen) and self.detail is not None:
                screen.show_detail(self.detail)
        except NoMatches:
            pass

    def on_analysis_ready(self, message: AnalysisReady) -> None:
        self.diagnosing = False
        self.analysis = message.analysis
        show = getattr(self._top(), "show_analysis", None)
        if show is not None:
            try:
                show(message.analysis)
            except NoMatches:
                pass  # see _show_model

    # ----------------------------------------------------------------- stall view

    def _check_stall(self, model: MainModel) -> None:
        if model.header is None:
            return
        if not self.source.live:
            self._recorded_stall(model.header.run)
            return
        now = self.clock()
        if model.header.step != self._last_step:
            self._last_step = model.header.step
            self._last_progress = now
            self._stall_dismissed = False
            if isinstance(self._top(), StallScreen):
                self.pop_screen()
            return
        idle = now - self._last_progress
        if (
            idle >= self.settings.refresh.stall_s
            and not self._stall_dismissed
            and isinstance(self._top(), MainScreen)
            and not self._beats_say_no_stall(model.header.run)
        ):
            self._stall_dismissed = True
            self.push_screen(StallScreen())
            self.diagnosis_tick(force=True)

    def _recorded_stall(self, run: str) -> None:
        """A recording (a hang bundle's window among them) makes no progress by nature:
        it opens on the stall view once, when the heartbeat judge finds its run stalled
        at the last beat. Without beats nothing is said (no beat, no verdict). A live
        source whose stall view was shown and dismissed is not shown it again when its
        hub stops."""
        if self._stall_dismissed or not isinstance(self._top(), MainScreen):
            return
        hang = beat_verdict(self.source, run)
        if hang is None:
            return
        self._stall_dismissed = True
        if hang.stalled:
            self.push_screen(StallScreen())
            self.diagnosis_tick(force=True)

    def _beats_say_no_stall(self, run: str) -> bool:
        """Whether the heartbeat judge finds ``run`` not stalled: every rank exited
        cleanly, or all are busy outside collectives in a long step, or the idle time is
        within what its recent steps make plausible. False where the source holds no beats:
        there, no progress for ``stall_s`` is all the view knows."""
        hang = beat_verdict(self.source, run)
        return hang is not None and not hang.stalled

    # ----------------------------------------------------------------- view state

    def _restore_view(self, model: MainModel) -> None:
        if model.header is None or self._restored_job == model.header.job:
            return
        self._restored_job = model.header.job
        if not self.settings.state.persist or self._fixed_view:
            return
        saved = load_view(self.settings.state_dir(), model.header.job)
        if saved is None:
            return
        run, world = model.header.run, model.header.world_size
        pins = tuple(p for p in saved.pins if p < world)
        if saved.pins_run not in (None, run):
            # Pins name ranks of the run they were made on; on another launch the same
            # numbers may be other hosts, so they are kept in the file but not shown.
            self._held_pins = (saved.pins, saved.pins_run)
            pins = ()
        known = {r.run for r in model.runs}
        baseline = self.baseline_run
        if saved.baseline_run in known and saved.baseline_run != run:
            baseline = saved.baseline_run
        self._restoring = True
        try:
            self.metric = saved.metric
            self.group_by = saved.group_by
            self.pins = pins
            self._pins_run = saved.pins_run if pins else None
            self.baseline_run = baseline
        finally:
            self._restoring = False
        self._restored = SavedView(
            saved.metric, saved.group_by, pins, baseline, saved.pins_run if pins else None
        )
        note = self.saved_view_note()
        if note is not None:
            self.notify(for_terminal(note), title="saved view", timeout=8, markup=False)

    def saved_view_note(self) -> str | None:
        """What of the job's saved view is still in effect, or None when nothing is (no
        saved view, or it differs from the defaults in nothing still shown).

        Returns:
            e.g. ``view: saved for job llm (pins 3, metric step) · R resets``.
        """
        saved = self._restored
        if saved is None or self._restored_job is None:
            return None
        parts = []
        if saved.pins and self.pins == saved.pins:
            where = "" if saved.pins_run else ", run unknown"
            parts.append(f"pins {len(saved.pins)}{where}")
        if saved.metric != self.settings.view.metric and self.metric == saved.metric:
            parts.append(f"metric {saved.metric}")
        if saved.group_by != self.settings.view.group_by and self.group_by == saved.group_by:
            parts.append(f"by {saved.group_by}")
        if saved.baseline_run not in (None, self.default_baseline) and (
            self.baseline_run == saved.baseline_run
        ):
            parts.append(f"baseline {saved.baseline_run}")
        held = ""
        if self._held_pins is not None:
            pins, run = self._held_pins
            held = f"{len(pins)} pin{'s' if len(pins) != 1 else ''} of {run} not applied"
        if not parts and not held:
            return None
        text = f"view: saved for job {self._restored_job}"
        if parts:
            text += f" ({', '.join(parts)})"
        if held:
            text += f"; {held}" if parts else f": {held}"
        return text + " · R resets"

    def reset_view(self) -> None:
        """Back to the default view: the settings' metric and grouping, no pins, no
        filter or zoom, the baseline given on the command line (or none). Pins saved for
        another run are forgotten too. The defaults are then the job's saved view."""
        self._held_pins = None
        self._restored = None
        self._restoring = True
        try:
            self.metric = self.settings.view.metric
            self.group_by = self.settings.view.group_by
            self.pins = ()
            self._pins_run = None
            self.filter_text = ""
            self.zoom = None
            self.zoom_up = None
            self.baseline_run = self.default_baseline
        finally:
            self._restoring = False
        self._persist()
        self.rebuild()
        self.notify("view reset to the defaults", timeout=3)

    def _persist(self) -> None:
        job = self._restored_job
        if job is None or not self.settings.state.persist or self._fixed_view or self._restoring:
            return
        pins, pins_run = self.pins, self._pins_run
        if not pins and self._held_pins is not None:
            # Nothing pinned on this run yet: keep the other run's pins for it.
            pins, pins_run = self._held_pins
        view = SavedView(self.metric, self.group_by, pins, self.baseline_run, pins_run)
        try:
            save_view(self.settings.state_dir(), job, view)
        except OSError as exc:
            self.notify(
                for_terminal(f"cannot save the view: {exc}"), severity="warning", markup=False
            )

    def _view_changed(self) -> None:
        self.rebuild()

    def watch_metric(self) -> None:
        self._persist()
        self._view_changed()

    def watch_group_by(self) -> None:
        self.zoom = None
        self.zoom_up = None
        self._persist()
        self._view_changed()

    def watch_pins(self, pins: tuple[int, ...]) -> None:
        if pins and not self._restoring:
            # Pinned on this run: these are its pins now, not the other run's.
            self._held_pins = None
            if self._pins_run is None or self._pins_run != self._shown_run:
                self._pins_run = self._shown_run
        self._persist()
        self._view_changed()

    def watch_filter_text(self) -> None:
        self._view_changed()

    def watch_zoom(self) -> None:
        self._view_changed()

    def watch_zoom_up(self) -> None:
        self.zoom = None
        self._view_changed()

    def watch_baseline_run(self) -> None:
        self._persist()
        self._analysed = None
        self._view_changed()

    def watch_paused(self, paused: bool) -> None:
        if self.model is not None:
            self._show_model()
        if not paused:
            self.sample_tick()

    # ----------------------------------------------------------------- commands

    def toggle_pin(self, rank: int) -> None:
        """Pin ``rank``, or unpin it when pinned."""
        if rank in self.pins:
            self.pins = tuple(p for p in self.pins if p != rank)
            self.notify(f"unpinned r{rank}", timeout=2)
        else:
            self.pins = (*self.pins, rank)
            self.notify(f"pinned r{rank}", timeout=2)

    def pin_slowest(self) -> None:
        """Pin the slowest ranks among those the filter keeps."""
        w = self.model.window if self.model is not None else None
        if w is None:
            return
        k = self.settings.view.pin_slowest
        slow = slowest_ranks(w, k, filter_mask(w, self.filter_text))
        new = [r for r in slow if r not in self.pins]
        if new:
            self.pins = (*self.pins, *new)
        if not slow:
            self.notify("no steps yet")
            return
        # How much slower each is says whether it stands out or only ranks k-th.
        parts = [f"r{r} {100 * x:+.1f}%" for r, x in zip(slow, busy_excess(w, slow))]
        self.notify("pinned " + ", ".join(parts) + " (busy time vs the median rank)")

    def cycle_metric(self) -> None:
        """Next heatmap metric."""
        self.metric = METRICS[(METRICS.index(self.metric) + 1) % len(METRICS)]

    def cycle_group_by(self) -> None:
        """Next grouping dimension that the run reports (every one before the first
        window)."""
        w = self.model.window if self.model is not None else None
        self.group_by = next_dimension(w, self.group_by)

    def ask_filter(self) -> None:
        """Open the filter dialog."""

        def done(text: str | None) -> None:
            if text is not None:
                self.filter_text = text

        self.push_screen(FilterDialog(self.filter_text), done)

    def open_detail(self, rank: int) -> None:
        """Open the rank-detail screen."""
        self.detail = None
        self.push_screen(RankDetailScreen(rank))
        self.rebuild()

    def open_report(self, name: str) -> None:
        """Open the structure, curves or manifest screen."""
        self.push_screen(REPORTS[name]())

    def action_pause(self) -> None:
        """Pause or resume the view."""
        self.paused = not self.paused

    def action_baseline(self) -> None:
        """Choose the baseline run."""
        runs = self.model.runs if self.model is not None else ()
        current = self.model.window.run if self.model and self.model.window else None

        def done(choice: str | None) -> None:
            if choice is None:
                return
            self.baseline_run = None if choice == NO_BASELINE else choice

        self.push_screen(BaselinePicker(runs, current, self.baseline_run), done)

    def action_rerun(self) -> None:
        """Open the reduced-scope rerun menu."""
        from rankscope.tui.rerun_screen import open_rerun_menu

        open_rerun_menu(self)

    def action_ladder(self) -> None:
        """Open the ladder of this run and its reruns."""
        from rankscope.tui.ladder_screen import open_ladder

        open_ladder(self)

    def action_experiment(self) -> None:
        """Open the experiment form."""
        from rankscope.tui.experiment_screen import open_experiments

        open_experiments(self)

    def action_snapshot(self) -> None:
        """Write a snapshot bundle of what is on screen (``rankscope.snapshot``)."""
        from rankscope.tui.snapshot_key import write_snapshot

        write_snapshot(self)

    def help_sections(self) -> list[tuple[str, list[BindingType]]]:
        """Every screen's bindings, for the help screen (keys that are not bindings,
        like a form's tab, as ``(key, "", description)``)."""
        return [
            ("Everywhere", list(self.BINDINGS)),
            ("Main screen", list(MainScreen.BINDINGS)),
            ("Heatmap (main screen)", list(Heatmap.BINDINGS)),
            ("Rank detail", list(RankDetailScreen.BINDINGS)),
            ("Structure, curves, manifest, stall", list(StructureScreen.BINDINGS)),
            (
                "Baseline picker",
                [("up,down", "", "Move in the run list"), *BaselinePicker.BINDINGS],
            ),
            ("Filter", [("enter", "", "Apply (empty shows every rank)"), *FilterDialog.BINDINGS]),
            *self._rerun_sections(),
            (
                "Snapshot",
                [
                    ("ctrl+s", "", "Write a bundle for a ticket into the current folder"),
                    ("", "", "rankscope open BUNDLE shows it again, pins and metric included"),
                ],
            ),
            ("This help", list(HelpScreen.BINDINGS)),
        ]

    @staticmethod
    def _rerun_sections() -> list[tuple[str, list[BindingType]]]:
        from rankscope.tui.experiment_screen import ExperimentScreen
        from rankscope.tui.ladder_screen import LadderScreen
        from rankscope.tui.rerun_screen import RerunScreen
        from rankscope.tui.stage_screen import StageScreen

        return [
            ("Rerun menu (r)", list(RerunScreen.BINDINGS)),
            (
                "Ladder (L)",
                [
                    ("up,down", "", "Scroll the ladder and its sweeps a line"),
                    ("pageup,pagedown", "", "Scroll a page"),
                    *LadderScreen.BINDINGS,
                ],
            ),
            (
                "Experiments (e)",
                [
                    ("tab", "", "Next field"),
                    ("enter", "", "On a record: judge it against the run on screen"),
                    *ExperimentScreen.BINDINGS,
                ],
            ),
            (
                "Staging (ctrl+t on a supported experiment)",
                [
                    ("tab", "", "The change each stage applies (enter: plan again)"),
                    ("up,down", "", "Scroll the plan and the results a line"),
                    ("pageup,pagedown", "", "Scroll a page"),
                    *StageScreen.BINDINGS,
                ],
            ),
        ]

    def action_help(self) -> None:
        """Show every key."""
        if not isinstance(self._top(), HelpScreen):
            self.push_screen(HelpScreen(self.help_sections()))


def make_app(
    settings: Settings,
    source: Source,
    *,
    clock: Callable[[], float] = time.monotonic,
    run: str | None = None,
    baseline: str | None = None,
) -> RankscopeApp:
    """Build the TUI. The CLI and every test call this.

    Args:
        settings: typed settings (``settings.load_settings`` or ``deterministic_settings``).
        source: where the data comes from (``LiveSource``, ``RecordingSource``,
            ``StaticSource``).
        clock: monotonic seconds, for stall detection (tests pass a fake one).
        run: the run to show (default: the newest run that is not a rerun).
        baseline: the healthy run to compare with from the start (``b`` changes it); a
            baseline saved in the job's view state takes precedence.

    Returns:
        The app, not yet running.
    """
    app = RankscopeApp(settings, source, clock=clock, run=run)
    if baseline is not None:
        app.set_reactive(RankscopeApp.baseline_run, baseline)
        app.default_baseline = baseline
    return app
