"""Messages that carry data from worker threads into the UI.

Workers never touch widgets: they finish by posting one of these to the app. High-rate
messages define ``can_replace`` so that a burst (a slow frame while samples keep coming)
collapses to the latest one.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from rankscope.diagnosis.window import Window
from rankscope.tui.analysis import AnalysisView
from rankscope.tui.detailmodel import RankDetail
from rankscope.tui.mainmodel import MainModel
from rankscope.tui.sources import Sample


@dataclass
class ModelReady(Message):
    """A new main-screen model, from a fresh sample or a changed view."""

    model: MainModel
    generation: int
    """The view generation it was built for; the app drops older generations."""
    sample: Sample
    """The sample it was built from (kept for rebuilding on view changes)."""
    baseline_run: str | None
    """The baseline run asked for."""
    baseline: Window | None
    """Its window (None when none is chosen, or it has no steps or cannot be read)."""
    detail: RankDetail | None
    """The detail of the rank whose screen is open."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ModelReady)


@dataclass
class AnalysisReady(Message):
    """A finished diagnosis pass."""

    analysis: AnalysisView

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, AnalysisReady)
