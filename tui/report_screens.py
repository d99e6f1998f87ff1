"""Screens that show one part of the diagnosis in full: structure, message-size curves,
manifest diff and the stall view."""

from __future__ import annotations

import math
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from rankscope.sanitize import for_terminal
from rankscope.tui.analysis import AnalysisView
from rankscope.tui.dialogs import HELP_BINDING
from rankscope.tui.panels import fmt_ms, sync_table
from rankscope.tui.sources import beat_verdict

REPORT_CSS = """
{name} #title {{ height: auto; background: $panel; padding: 0 1; }}
{name} #note {{ height: auto; padding: 0 1; color: $text-muted; }}
{name} DataTable {{ height: 1fr; }}
"""


def fmt_duration(ms: float) -> str:
    """A wait in the unit that reads best: ms below a second, then s, then min and s."""
    if not math.isfinite(ms):
        return "–"
    if ms < 1000:
        return f"{fmt_ms(ms)} ms"
    seconds = ms / 1000
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


class ReportScreen(Screen):
    """A title, one keyed table and a note, redrawn on every diagnosis pass."""

    BINDINGS: ClassVar[list[BindingType]] = [
        HELP_BINDING,
        Binding("escape", "app.pop_screen", "Back", tooltip="Back to the main screen"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | ? | Every key of every screen. |
    | escape | Back to the main screen. |
    """

    TITLE_TEXT = ""
    COLUMNS: tuple[str, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(Text(self.TITLE_TEXT, style="bold"), id="title")
        table: DataTable = DataTable(id="table", cursor_type="row", zebra_stripes=True)
        for i, label in enumerate(self.COLUMNS):
            table.add_column(label, key=f"c{i}")
        yield table
        yield Static(id="note")
        yield Footer()

    def on_mount(self) -> None:
        self.show_analysis(getattr(self.app, "analysis", None))
        self.query_one(DataTable).focus()

    def show_analysis(self, analysis: AnalysisView | None) -> None:
        """Redraw from the latest diagnosis."""
        note = self.query_one("#note", Static)
        if analysis is None:
            note.update(Text("waiting for the first diagnosis", style="italic"))
            return
        rows, text = self.rows(analysis)
        sync_table(self.query_one(DataTable), rows)
        note.update(text)
        title = for_terminal(self.title_for(analysis))  # it names runs
        self.query_one("#title", Static).update(Text(title, style="bold"))

    def rows(self, analysis: AnalysisView) -> tuple[list, Text]:
        """``(key, cells)`` rows and the note for one analysis."""
        raise NotImplementedError

    def title_for(self, analysis: AnalysisView) -> str:
        """The title line for one analysis."""
        return self.TITLE_TEXT

    def baseline_hint(self) -> str:
        """How to get a baseline: choose one, or there is no other run to choose."""
        model = getattr(self.app, "model", None)
        runs = getattr(model, "runs", ()) or ()
        window = getattr(model, "window", None)
        current = window.run if window is not None else None
        if any(r.run != current for r in runs):
            return "press b to choose one"
        return "no other run here to compare with"


class StructureScreen(ReportScreen):
    """Every dimension's effect size on every per-rank metric (ε², strongest first)."""

    DEFAULT_CSS = REPORT_CSS.format(name="StructureScreen")
    TITLE_TEXT = "Structure: which placement dimension explains each per-rank metric"
    COLUMNS = ("metric", "dimension", "ε²", "stands out", "z")

    def rows(self, analysis: AnalysisView) -> tuple[list, Text]:
        rows = [
            (
                f"{r.metric}/{r.dimension}",
                (r.metric, r.dimension, f"{r.effect:.3f}", r.standout, f"{r.z:+.1f}"),
            )
            for r in analysis.structure
        ]
        note = Text(
            "ε²: share of the metric's variance across ranks that the dimension explains, "
            "corrected for the number of groups (≈0 for a random grouping). Metrics are "
            "relative to each step's median rank."
        )
        return rows, note


class CurvesScreen(ReportScreen):
    """Message-size curves: transfer time and bus bandwidth per group, op and size."""

    DEFAULT_CSS = REPORT_CSS.format(name="CurvesScreen")
    TITLE_TEXT = "Message-size curves (post-arrival transfer)"
    COLUMNS = ("group", "op", "size", "count", "time ms", "busbw GB/s", "baseline", "ratio")

    def rows(self, analysis: AnalysisView) -> tuple[list, Text]:
        rows = []
        for c in analysis.curves:
            base = c.baseline_busbw_gbps
            ratio = c.busbw_gbps / base if math.isfinite(base) and base > 0 else math.nan
            rows.append(
                (
                    f"{c.group}/{c.op}/{c.size}",
                    (
                        c.group,
                        c.op,
                        c.size,
                        str(c.count),
                        fmt_ms(c.time_ms),
                        f"{c.busbw_gbps:.2f}" if math.isfinite(c.busbw_gbps) else "–",
                        f"{base:.2f}" if math.isfinite(base) else "–",
                        f"×{ratio:.2f}" if math.isfinite(ratio) else "–",
                    ),
                )
            )
        note = Text(analysis.curves_convention or "")
        if not rows:
            note = Text("no complete collectives with sizes in the window", style="italic")
        elif analysis.baseline_run is None:
            note = Text(f"no baseline ({self.baseline_hint()}): nothing to compare with. ")
            note.append(analysis.curves_convention or "")
        return rows, note


class ManifestScreen(ReportScreen):
    """The manifest field by field against the baseline's."""

    DEFAULT_CSS = REPORT_CSS.format(name="ManifestScreen")
    TITLE_TEXT = "Manifest: what differs from the baseline"
    COLUMNS = ("field", "baseline", "current")

    def title_for(self, analysis: AnalysisView) -> str:
        if analysis.baseline_run is None:
            return f"Manifest of {analysis.run}, field by field (no baseline to diff against)"
        return f"Manifest: what differs between {analysis.baseline_run} and {analysis.run}"

    def rows(self, analysis: AnalysisView) -> tuple[list, Text]:
        if analysis.baseline_run is None:
            rows = [(f, (f, "", v)) for f, v in analysis.manifest_fields]
            hint = self.baseline_hint()
            return rows, Text(f"no baseline ({hint}): every field of this run is listed")
        rows = [(m.field, (m.field, m.baseline, m.current)) for m in analysis.manifest]
        if not rows:
            return rows, Text(f"identical to {for_terminal(analysis.baseline_run)}", style="green")
        return rows, Text(f"{len(rows)} fields differ from {for_terminal(analysis.baseline_run)}")


class StallScreen(ReportScreen):
    """No progress: which collectives are half-entered and which ranks they wait for."""

    DEFAULT_CSS = REPORT_CSS.format(name="StallScreen") + (
        "StallScreen #title { background: $error 40%; }"
    )
    TITLE_TEXT = "STALLED: no step is completing"
    COLUMNS = ("group", "op", "seq", "entered", "missing ranks", "waiting")

    def rows(self, analysis: AnalysisView) -> tuple[list, Text]:
        stall = analysis.stall
        if stall is None:
            return [], Text("no stall information", style="italic")
        rows = []
        for p in stall.pending:
            missing = ", ".join(f"r{r}" for r in p.missing[:12])
            if len(p.missing) > 12:
                missing += f" … (+{len(p.missing) - 12})"
            waited = stall.now_ns - p.waiting_since_ns
            rows.append(
                (
                    f"{p.group}/{p.seq}",
                    (
                        p.group_name,
                        p.op,
                        str(p.seq),
                        f"{p.entered}/{p.members}",
                        missing,
                        fmt_duration(waited / 1e6),
                    ),
                )
            )
        note = Text()
        hang = beat_verdict(getattr(self.app, "source", None), analysis.run)
        if hang is not None and hang.stalled:
            # The heartbeats name the culprit and the case: lead with them.
            for c in hang.culprits[:4]:
                note.append(f"r{c.rank}", style="bold red")
                note.append(f" on {for_terminal(c.host or '?')}: ", style="bold")
                note.append(f"{c.case.replace('_', ' ')}", style="bold red")
                where = f"{c.group_name}:{c.op}#{c.seq}" if c.group >= 0 else "no collective"
                note.append(f" ({for_terminal(where)}) — {for_terminal(c.detail)}\n")
            waits = [
                f"r{w.rank} {w.where}"
                for w in hang.waiting
                if w.rank not in {c.rank for c in hang.culprits}
            ][:6]
            if waits:
                note.append("waiting: " + for_terminal("; ".join(waits)) + "\n")
            note.append(
                f"no rank progressed for {hang.idle_s:.1f} s (threshold {hang.threshold_s:.1f} s)\n"
            )
        culprits = stall.culprits()
        if culprits and (hang is None or not hang.stalled):
            note.append("likely holding the job: ", style="bold")
            note.append(", ".join(f"r{r}" for r in culprits), style="bold red")
            note.append("  (missing from the most pending collectives: attach py-spy there)\n")
        if stall.silent_ranks:
            silent = ", ".join(f"r{r}" for r in stall.silent_ranks[:16])
            note.append(f"silent since the last step: {silent}\n")
        if not stall.pending and not stall.silent_ranks:
            note.append(
                "no collective is half-entered and every rank reported the last step: the "
                "job ended or stopped reporting, or every rank is outside collectives "
                "(input, checkpoint, evaluation)\n"
            )
        idle = stall.idle_steps
        note.append(
            f"last step ended {fmt_duration((stall.now_ns - stall.last_step_end_ns) / 1e6)} ago "
            f"({idle:.1f} median steps)"
            if math.isfinite(idle)
            else "no step has ended yet"
        )
        return rows, note
