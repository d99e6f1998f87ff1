"""The main screen's panels: header, verdict line, last arrivers, structure, decomposition.

Each widget formats a model it is handed; none of them reads a source or runs analysis.
Tables are keyed (by rank, by metric and dimension) and updated cell by cell.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

from rich.console import Group
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.render import measure
from textual.widgets import DataTable, Static
from textual.widgets._data_table import default_cell_formatter

from rankscope.sanitize import for_markup, for_terminal
from rankscope.tui.abbrev import Field, fit_fields, fit_words
from rankscope.tui.analysis import AnalysisView
from rankscope.tui.charts import sparkline, stacked_bar
from rankscope.tui.mainmodel import Arrival, HeaderModel, LastRank

CATEGORY_COLOURS = {
    "compute": "#4e79a7",
    "exposed_comm": "#b07aa1",
    "arrival_wait": "#e15759",
    "pipeline_idle": "#f28e2b",
    "input": "#edc948",
    "memory": "#76b7b2",
    "checkpoint": "#59a14f",
    "recovery": "#ff9da7",
    "host_gap": "#d37295",
    "other": "#9c9c9c",
}
"""Colour of each decomposition category in the stacked bars."""


def fmt_ms(value: float | None) -> str:
    """Milliseconds with precision that suits their size ("–" when unknown)."""
    if value is None or not math.isfinite(value):
        return "–"
    mag = abs(value)
    if mag >= 1000:
        return f"{value:,.0f}"
    if mag >= 100:
        return f"{value:.0f}"
    if mag >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_rate(value: float | None) -> str:
    """A per-second rate with a k/M/G suffix ("–" when unknown)."""
    if value is None or not math.isfinite(value):
        return "–"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.1f}{suffix}"
    return f"{value:.0f}"


def _count(value: Any) -> int | None:
    # Counters come as a number or as a map of reasons (or kinds) to numbers.
    if isinstance(value, dict):
        if "events" in value:
            return _count(value["events"])
        return sum(v for v in value.values() if isinstance(v, int))
    return int(value) if isinstance(value, (int, float)) else None


def hub_health(health: dict[str, Any]) -> list[str]:
    """The hub's health in a few words: ingest rate, dropped events, rejected messages.

    Args:
        health: the store's counters (``events_per_s``, ``drops``, ``rejects``).

    Returns:
        Phrases, in that order, for the counters present.
    """
    out = []
    rate = health.get("events_per_s")
    if isinstance(rate, (int, float)):
        out.append(f"{fmt_rate(float(rate))} ev/s")
    drops = _count(health.get("drops"))
    if drops is not None:
        out.append(f"drops {drops:,}")
    rejects = _count(health.get("rejects"))
    if rejects:
        out.append(f"rejects {rejects:,}")
    return out


def _plain(cells: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(c) for c in cells)


def sync_table(
    table: DataTable,
    rows: Sequence[tuple[Hashable, Sequence[Any]]],
) -> None:
    """Make a keyed table show ``rows`` in order without rebuilding it.

    New keys are added, changed cells updated in place, vanished keys removed; the rows
    are then sorted into the given order.

    Args:
        table: a table whose columns were added with keys ``c0``, ``c1``...
        rows: ``(key, cells)`` in display order.
    """
    # A str cell is read as console markup by DataTable: cells hold host names from
    # telemetry, so every str is escaped (a "[link=...]" host stays its name).
    wanted = {
        str(k): tuple(for_markup(c) if isinstance(c, str) else c for c in cells)
        for k, cells in rows
    }
    changed = False
    for row_key in list(table.rows):
        if row_key.value not in wanted:
            table.remove_row(row_key)
            changed = True
    existing = {k.value for k in table.rows}
    for key, cells in wanted.items():
        if key in existing:
            for i, cell in enumerate(cells):
                if table.get_cell(key, f"c{i}") != cell:
                    table.update_cell(key, f"c{i}", cell)
                    changed = True
        else:
            table.add_row(*cells, key=key)
            changed = True
    if changed:
        _fit_columns(table)
    if [r.key.value for r in table.ordered_rows] != list(wanted) and len(wanted) > 1:
        # The sort key sees cell values, not row keys; each row's cells are distinct
        # because its key is derived from them.
        # Rich texts are not hashable: rows are told apart by their plain text.
        position = {_plain(cells): i for i, cells in enumerate(wanted.values())}
        table.sort(key=lambda values: position.get(_plain(values), len(position)))


def _fit_columns(table: DataTable) -> None:
    """Size every auto-width column to the cells it holds now.

    DataTable widens a column when a row is added but never narrows it when a cell is
    updated or a row removed, so without this a column's width depends on which values it
    happened to hold on earlier ticks: the same data would draw differently depending on
    how it arrived.
    """
    console = table.app.console
    for column in table.ordered_columns:
        if not column.auto_width:
            continue
        width = measure(console, column.label, 1)
        for value in table.get_column(column.key):
            width = max(width, measure(console, default_cell_formatter(value), 1))
        if width != column.content_width:
            column.content_width = width
            # The table's virtual size follows its column widths; DataTable recomputes
            # it on its next idle when this flag is set (Textual is pinned exactly).
            table._require_update_dimensions = True
            table.refresh()


class HeaderBar(Static):
    """Two lines: who and where (job, run, scope, size, step, live/paused), then how fast
    (step time against the baseline, valid tokens/s, hub health)."""

    DEFAULT_CSS = """
    HeaderBar {
        height: 2;
        background: $panel;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    _shown: tuple | None = None

    def show(
        self,
        header: HeaderModel | None,
        *,
        paused: bool,
        source: str,
        live: bool,
        extra: str = "",
        message: str = "",
        other_runs: bool = True,
    ) -> None:
        """Format the header.

        Args:
            header: the numbers (None while waiting for data).
            paused: the view is frozen.
            source: where the data comes from.
            live: the source keeps receiving.
            extra: right-hand text (clock, machine), already formatted.
            message: shown instead of numbers while ``header`` is None.
            other_runs: the source holds a run that could be chosen as the baseline.
        """
        self._shown = (header, paused, source, live, extra, message, other_runs)
        width = self.content_size.width
        live_text = Text()
        if paused:
            live_text.append("‖ PAUSED", style="bold black on yellow")
        elif live:
            live_text.append("● LIVE", style="bold green")
        else:
            live_text.append("○ STATIC", style="bold cyan")
        if header is None:
            top = fit_fields([Field(live_text, sep=""), Field(Text(source, style="dim"))], width)
            bottom = fit_words(Text(message or "waiting for data", style="italic"), width)
            self.update(Text("\n").join([top, bottom]))
            return
        # What goes first when the line is too narrow: the largest priority (abbrev.py).
        plural = "s" if header.world_size != 1 else ""
        hosts = f"{header.hosts} host{'s' if header.hosts != 1 else ''}"
        top = fit_fields(
            [
                Field(live_text, sep=""),
                Field(Text(f"step {header.step:,}", style="bold")),
                Field(Text(header.job), priority=2),
                Field(Text(f"{for_terminal(header.run)} · {header.scope}")),
                Field(Text(f"{header.world_size} rank{plural} on {hosts}"), priority=1),
                Field(Text(extra, style="dim"), priority=3),
            ],
            width,
        )
        s = header.stats
        fields = []
        if s is None:
            fields.append(Field(Text("step –"), sep=""))
        else:
            stats = Text("step ", style="bold")
            stats.append(f"p50 {fmt_ms(s.p50)} p90 {fmt_ms(s.p90)} max {fmt_ms(s.max)} ms")
            fields.append(Field(stats, sep=""))
            fields.append(Field(Text(sparkline(s.series, 12), style="cyan"), priority=4, sep=" "))
        b = header.baseline
        if b is not None and s is not None:
            change = (s.p50 / b.p50 - 1) * 100 if b.p50 > 0 else math.nan
            worse = math.isfinite(change) and change > 2
            base = Text(f"base p50 {fmt_ms(b.p50)}")
            if math.isfinite(change):
                base.append(" ")
                base.append(f"{change:+.0f}%", style="bold red" if worse else "green")
            fields.append(Field(base, priority=1))
            # The change matters more than the name (long for a simulated or dated run).
            name = Text(f"({for_terminal(header.baseline_run)})", style="dim")
            fields.append(Field(name, priority=3, sep=" "))
        elif s is not None:
            hint = "no baseline (b)" if other_runs else "no other run to compare"
            fields.append(Field(Text(hint, style="dim"), priority=1))
        fields.append(Field(Text(f"{fmt_rate(header.tokens_per_s)} tok/s"), priority=3))
        hub = hub_health(header.health)
        # Lost data is worth more room than the ingest rate of a healthy hub.
        losing = any(h.startswith(("drops", "rejects")) and not h.endswith(" 0") for h in hub)
        if header.clock_error_ms is not None:
            hub.append(f"clock ±{fmt_ms(header.clock_error_ms)} ms")
        if hub:
            fields.append(Field(Text("hub " + " · ".join(hub)), priority=2 if losing else 5))
        bottom = fit_fields(fields, width)
        # One text, so the CSS keeps each line to one row instead of wrapping it.
        self.update(Text("\n").join([top, bottom]))

    def on_resize(self) -> None:
        if self._shown is not None:
            header, paused, source, live, extra, message, other_runs = self._shown
            self.show(
                header,
                paused=paused,
                source=source,
                live=live,
                extra=extra,
                message=message,
                other_runs=other_runs,
            )


class VerdictLine(Static):
    """The top hypothesis, its evidence in a phrase and the next experiment."""

    DEFAULT_CSS = """
    VerdictLine {
        height: auto;
        max-height: 2;
        padding: 0 1;
        background: $boost;
    }
    """

    _shown: tuple | None = None

    def show(self, analysis: AnalysisView | None, busy: bool = False) -> None:
        """Format the verdict: on one line when it fits, else the hypothesis and its
        evidence on the first and the next experiment on the second, each shortened at a
        word boundary.

        Args:
            analysis: the latest diagnosis (None before the first pass).
            busy: a pass is running.
        """
        self._shown = (analysis, busy)
        text = Text()
        if analysis is None:
            text.append("verdict: ", style="bold")
            text.append("diagnosing…" if busy else "waiting for data", style="italic")
            self.update(text)
            return
        if not analysis.hypotheses:
            text.append("verdict: ", style="bold")
            text.append(analysis.note or "no hypothesis yet", style="italic")
            self.update(text)
            return
        top = analysis.hypotheses[0]
        healthy = top.mechanism == "healthy"
        text.append("▶ ", style="bold green" if healthy else "bold red")
        text.append(top.mechanism, style="bold green" if healthy else "bold red")
        text.append(f" ({top.score:.2f}) ", style="dim")
        regime = getattr(analysis.diagnosis, "regime", None)
        if regime is not None:
            # The verdict reads only the steps since the shift: say so first.
            text.append(
                f"since step {regime.start_step} ({regime.change:+.0%} step time): ",
                style="bold",
            )
        # The what-if is the headline when it is about this hypothesis: what fixing the
        # suspect would save says more than the judge's first observation.
        text.append(analysis.headline or top.evidence)
        width = self.content_size.width
        if not top.next_experiment:
            self.update(fit_words(text, width, lines=2))
            return
        advice = Text()
        advice.append("→ next: ", style="bold")
        advice.append(top.next_experiment)
        if width <= 0 or text.cell_len + 2 + advice.cell_len <= width:
            self.update(Text("  ").join([text, advice]))
            return
        # Too long for one line: what it is on the first, what to do next on the second,
        # each shortened at a word boundary (the next experiment is never pushed off).
        self.update(Text("\n").join([fit_words(text, width), fit_words(advice, width)]))

    def on_resize(self) -> None:
        if self._shown is not None:
            self.show(*self._shown)


class LastArrivalsPanel(Vertical):
    """Per process group the latest collective with who arrived last and by how much, and
    the ranks that arrived last most often."""

    DEFAULT_CSS = """
    LastArrivalsPanel {
        height: auto;
        border: round $primary 50%;
        border-title-color: $text;
    }
    LastArrivalsPanel > Static { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
    LastArrivalsPanel > DataTable {
        height: auto; max-height: 7; scrollbar-size-horizontal: 0; scrollbar-size-vertical: 0;
    }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="instances")
        table: DataTable = DataTable(id="ranking", cursor_type="none", zebra_stripes=False)
        for i, label in enumerate(("rank", "host", "×last", "late ms")):
            table.add_column(label, key=f"c{i}")
        yield table

    def on_mount(self) -> None:
        self.border_title = "last to arrive"

    def show(
        self,
        arrivals: Sequence[Arrival],
        ranking: Sequence[LastRank],
        since_step: int | None = None,
    ) -> None:
        """Format the latest instances and update the ranking table (counted over the
        steps since ``since_step`` when the step time shifted there)."""
        self.border_title = (
            "last to arrive" if since_step is None else f"last to arrive · since step {since_step}"
        )
        text = Text()
        if not arrivals:
            text.append("no complete collectives in the window", style="dim italic")
        for a in arrivals:
            if text:
                text.append("\n")
            # Who and by how much first: the group and op are context.
            line = Text()
            line.append(f"r{a.last_rank}", style="bold yellow")
            line.append(f" +{fmt_ms(a.margin_ms)} ms", style="bold")
            line.append(f" of {fmt_ms(a.skew_ms)} skew", style="dim")
            line.append(f"  {a.group} {a.op} #{a.seq}")
            text.append_text(fit_words(line, self.query_one("#instances").content_size.width))
        self.query_one("#instances", Static).update(text)
        sync_table(
            self.query_one("#ranking", DataTable),
            [
                (r.rank, (f"r{r.rank}", r.host, str(r.times_last), fmt_ms(r.late_ms)))
                for r in ranking
            ],
        )


STRUCTURE_FLOOR = 0.25
"""An effect size below this (a dimension explaining under a quarter of a metric's spread
across ranks) is shown dimmed: placement does not explain that metric."""


SHORT_DIMENSIONS = {"time_since_start": "time", "gpu_index": "gpu"}
"""Shorter names for the panel's narrow "by" column (the structure screen keeps the full
ones)."""


def standout_label(dimension: str, standout: str) -> str:
    """The standout group without the dimension's name the next column already gives
    (``rail=3`` under ``rail`` reads ``3``)."""
    prefix = f"{dimension}="
    return standout[len(prefix) :] if standout.startswith(prefix) else standout


class StructurePanel(Vertical):
    """Which placement dimension explains a per-rank metric, and the group that stands
    out (effect size ε²)."""

    DEFAULT_CSS = """
    StructurePanel {
        height: auto;
        border: round $primary 50%;
    }
    StructurePanel > DataTable { height: auto; max-height: 9; scrollbar-size-horizontal: 0; }
    StructurePanel > Static { height: auto; padding: 0 1; color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        table: DataTable = DataTable(id="structure", cursor_type="none")
        for i, label in enumerate(("metric", "by", "ε²", "stands out")):
            table.add_column(label, key=f"c{i}")
        yield table
        yield Static(id="structure-note")

    def on_mount(self) -> None:
        self.border_title = "structure"

    def show(self, analysis: AnalysisView | None, limit: int = 6) -> None:
        """Update the correlation table from the latest diagnosis."""
        rows = analysis.structure[:limit] if analysis is not None else ()
        cells = []
        for r in rows:
            style = "" if r.effect >= STRUCTURE_FLOOR else "dim"
            values = (
                r.metric,
                SHORT_DIMENSIONS.get(r.dimension, r.dimension),
                f"{r.effect:.2f}",
                f"{standout_label(r.dimension, r.standout)} z{r.z:+.1f}",
            )
            cells.append((f"{r.metric}/{r.dimension}", tuple(Text(v, style=style) for v in values)))
        sync_table(self.query_one(DataTable), cells)
        note = self.query_one("#structure-note", Static)
        weak = analysis is not None and rows and rows[0].effect < STRUCTURE_FLOOR
        note.display = bool(weak)
        if weak:
            note.update(
                Text(
                    f"no dimension explains {STRUCTURE_FLOOR:.0%} of a metric's spread "
                    "across ranks: not a placement effect",
                    style="italic",
                )
            )


def _flow(items: Sequence[Text], width: int, gap: int = 2) -> list[Text]:
    """Lay ``items`` out left to right on lines of at most ``width`` cells."""
    lines: list[Text] = []
    line = Text()
    for item in items:
        if line.cell_len and line.cell_len + gap + item.cell_len > width:
            lines.append(line)
            line = Text()
        if line.cell_len:
            line.append(" " * gap)
        line.append_text(item)
    if line.cell_len or not lines:
        lines.append(line)
    return lines


class DecompositionPanel(Static):
    """Stacked wall-time categories of the window against the baseline, and where the
    missing time first appears."""

    DEFAULT_CSS = """
    DecompositionPanel {
        height: auto;
        border: round $primary 50%;
        padding: 0 1;
    }
    """

    _analysis: AnalysisView | None = None
    _other_runs: bool = True

    def on_mount(self) -> None:
        self.border_title = "decomposition (ms per rank-step)"

    def on_resize(self) -> None:
        self.show(self._analysis)

    def set_other_runs(self, present: bool) -> None:
        """Say whether the source holds another run to choose as the baseline (the hint
        under the bars depends on it)."""
        if present != self._other_runs:
            self._other_runs = present
            self.show(self._analysis)

    def show(self, analysis: AnalysisView | None, width: int | None = None) -> None:
        """Draw the bars for the latest diagnosis."""
        self._analysis = analysis
        if analysis is None or not analysis.decomposition:
            # A diagnosis that came back without one says why (no complete step, a failure).
            why = analysis.note if analysis is not None and analysis.note else ""
            self.update(Text(why or "waiting for the first diagnosis", style="dim italic"))
            return
        rows = analysis.decomposition
        bar_width = max((width or self.size.width or 40) - 16, 10)
        cur = [(r.category, r.current_ms) for r in rows]
        base = [(r.category, r.baseline_ms) for r in rows]
        has_base = any(math.isfinite(v) for _, v in base)
        total_cur = sum(v for _, v in cur if math.isfinite(v))
        total_base = sum(v for _, v in base if math.isfinite(v)) if has_base else 0.0
        full = max(total_cur, total_base)
        lines = []
        now = Text("now  ", style="bold")
        now.append_text(stacked_bar(cur, CATEGORY_COLOURS, bar_width, full))
        now.append(f" {fmt_ms(total_cur)}")
        lines.append(now)
        if has_base:
            b = Text("base ", style="bold")
            b.append_text(stacked_bar(base, CATEGORY_COLOURS, bar_width, full))
            b.append(f" {fmt_ms(total_base)}")
            lines.append(b)
        # Categories under 1% of the step, then and now, would only add noise.
        floor = 0.01 * max(full, 1e-9)
        shown = [
            r
            for r in rows
            if (math.isfinite(r.current_ms) and r.current_ms >= floor)
            or (math.isfinite(r.baseline_ms) and r.baseline_ms >= floor)
        ]
        items = []
        for r in sorted(shown, key=lambda r: -r.current_ms):
            item = Text()
            item.append("■", style=Style(color=CATEGORY_COLOURS.get(r.category, "white")))
            delta = f" {r.delta_ms:+.0f}" if has_base and math.isfinite(r.delta_ms) else ""
            item.append(f"{r.category} {fmt_ms(r.current_ms)}{delta}")
            items.append(item)
        # Wrapped between items, never inside one (a number apart from its category
        # reads as another category's).
        lines += _flow(items, max((width or self.size.width or 40) - 4, 20))
        verdict = Text()
        if not has_base and self._other_runs:
            verdict.append("no baseline: press b to choose one", style="dim italic")
        elif not has_base:
            verdict.append("no baseline: no other run here to compare with", style="dim italic")
        elif analysis.first_appears is None:
            verdict.append("no category grew against the baseline", style="green")
        else:
            row = next(r for r in rows if r.category == analysis.first_appears)
            verdict.append("missing time appears in ", style="bold")
            verdict.append(analysis.first_appears, style="bold red")
            verdict.append(f" +{fmt_ms(row.delta_ms)} ms")
        lines.append(verdict)
        self.update(Group(*lines))
