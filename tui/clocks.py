"""The app's two clocks: sampling and diagnosis, each finishing in a worker thread.

The sampling clock asks the source for the latest window and builds the main-screen model
off the event loop; the diagnosis clock runs the analysis at a lower rate. Both post a
message (``ModelReady``, ``AnalysisReady``) that the app routes to the screens. Neither
runs while the view is paused or a dialog is open. `RankscopeApp` mixes this in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import work

from rankscope.diagnosis.window import Window
from rankscope.tui.analysis import AnalysisView, analyse
from rankscope.tui.detailmodel import rank_detail
from rankscope.tui.mainmodel import ViewState, build_main_model
from rankscope.tui.messages import AnalysisReady, ModelReady
from rankscope.tui.report_screens import StallScreen
from rankscope.tui.settings import Settings
from rankscope.tui.sources import Sample, Source, baseline_window, sample

if TYPE_CHECKING:
    from textual.app import App

    _Base = App
else:
    _Base = object


class Clocks(_Base):
    """Sampling and diagnosis clocks (see the module docstring)."""

    settings: Settings
    source: Source
    clock: Callable[[], float]
    run_id: str | None
    diagnosing: bool
    _sample: Sample | None
    _baseline: Window | None
    _baseline_for: str | None
    _baseline_read: Window | None
    _baseline_lock: threading.Lock
    _generation: int
    _sampling: bool
    _analysed: tuple | None
    _last_progress: float

    # Provided by the app.
    view: ViewState
    baseline_run: str | None

    def _blocked(self) -> bool:
        raise NotImplementedError

    def _detail_rank(self) -> int | None:
        raise NotImplementedError

    def _top(self):
        raise NotImplementedError

    # ----------------------------------------------------------------- sampling clock

    def sample_tick(self) -> None:
        """Ask the source for the latest window, unless paused, under a dialog, or a
        previous sample is still being built."""
        if self._blocked() or self._sampling:
            return
        self._sampling = True
        self._sample_worker(self.view, self._generation, self._detail_rank(), self.baseline_run)

    @work(thread=True, group="sample", exit_on_error=False)
    def _sample_worker(
        self, view: ViewState, generation: int, detail_rank: int | None, baseline: str | None
    ) -> None:
        try:
            v = self.settings.view
            smp = sample(self.source, self.run_id, v.window_steps, v.max_cells)
            self._build(smp, view, generation, detail_rank, baseline, fetch_baseline=True)
        finally:
            self._sampling = False

    @work(thread=True, group="rebuild", exclusive=True, exit_on_error=False)
    def _rebuild_worker(
        self,
        smp: Sample,
        view: ViewState,
        generation: int,
        detail_rank: int | None,
        baseline: str | None,
    ) -> None:
        self._build(smp, view, generation, detail_rank, baseline, fetch_baseline=False)

    def _build(
        self,
        smp: Sample,
        view: ViewState,
        generation: int,
        detail_rank: int | None,
        baseline_run: str | None,
        *,
        fetch_baseline: bool,
    ) -> None:
        baseline = None
        if baseline_run is not None:
            baseline = self._baseline_window(smp, baseline_run, fetch_baseline)
        model = build_main_model(smp, view, baseline)
        detail = None
        w = smp.window
        if detail_rank is not None and w is not None and 0 <= detail_rank < w.world_size:
            detail = rank_detail(w, detail_rank)
        self.post_message(ModelReady(model, generation, smp, baseline_run, baseline, detail))

    def _baseline_window(self, smp: Sample, run: str, fetch: bool) -> Window | None:
        # The window last read, not the last one the UI has handled: a sample that starts
        # before the previous model reached the UI must not read a finished baseline again.
        with self._baseline_lock:
            previous = self._baseline_read
            if not fetch and previous is not None and previous.run == run:
                return previous
            try:
                v = self.settings.view
                baseline = baseline_window(
                    self.source, run, smp.runs, v.window_steps, v.baseline_max_cells, previous
                )
            except Exception:  # a baseline that cannot be read is shown as none
                baseline = None
            self._baseline_read = baseline
            return baseline

    def rebuild(self) -> None:
        """Rebuild the model from the last sample with the current view."""
        self._generation += 1
        if self._sample is not None:
            self._rebuild_worker(
                self._sample, self.view, self._generation, self._detail_rank(), self.baseline_run
            )

    # ----------------------------------------------------------------- diagnosis clock

    def diagnosis_tick(self, force: bool = False) -> None:
        """Run a diagnosis pass on the latest window when it changed."""
        smp = self._sample
        if smp is None or smp.window is None or self.diagnosing:
            return
        if self._blocked() and not force:
            return
        w = smp.window
        if self._baseline_for != self.baseline_run:
            return  # the new baseline's window is still being fetched
        baseline = self._baseline if self.baseline_run is not None else None
        stalled = isinstance(self._top(), StallScreen)
        key = (w.run, int(w.steps[-1]) if w.steps.size else -1, w.steps.size, self.baseline_run)
        if key == self._analysed and not stalled and not force:
            return
        self._analysed = key
        now_ns = None
        if stalled:
            from rankscope.diagnosis.stall import latest_time

            now_ns = latest_time(w) + (self.clock() - self._last_progress) * 1e9
        self.diagnosing = True
        self._diagnosis_worker(w, baseline, now_ns)

    @work(thread=True, group="diagnosis", exit_on_error=False)
    def _diagnosis_worker(self, window: Window, baseline: Window | None, now_ns: float | None):
        try:
            result = analyse(window, baseline, now_ns)
        except Exception as exc:  # the view must outlive a bug in one analysis
            result = AnalysisView(
                run=window.run,
                baseline_run=baseline.run if baseline is not None else None,
                note=f"diagnosis failed: {type(exc).__name__}: {exc}",
            )
        self.post_message(AnalysisReady(result))
