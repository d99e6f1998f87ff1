"""The main screen: header, verdict, per-rank heatmap and the diagnosis panels."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Static

from rankscope.tui.abbrev import fit_words
from rankscope.tui.analysis import AnalysisView
from rankscope.tui.dialogs import HELP_BINDING
from rankscope.tui.heatgrid import GROUP
from rankscope.tui.heatmap import Heatmap
from rankscope.tui.heatmap_render import legend
from rankscope.tui.mainmodel import MainModel
from rankscope.tui.panels import (
    DecompositionPanel,
    HeaderBar,
    LastArrivalsPanel,
    StructurePanel,
    VerdictLine,
)

if TYPE_CHECKING:
    from rankscope.tui.app import RankscopeApp


class MainScreen(Screen):
    """Everything an engineer needs in the first ten seconds of an incident."""

    BINDINGS: ClassVar[list[BindingType]] = [
        # First, so the footer shows it however narrow the terminal (k9s, htop): the
        # footer carries the few keys used most, the help every key.
        HELP_BINDING,
        Binding("space", "pin", "Pin", tooltip="Pin or unpin the selected rank"),
        Binding("P", "pin_slowest", "Pin slowest", show=False, tooltip="Pin the slowest ranks"),
        Binding("slash", "filter", "Filter", tooltip="Filter ranks and hosts"),
        Binding("m", "metric", "Metric", tooltip="Next heatmap metric"),
        Binding("g", "group_by", "Group", tooltip="Next grouping dimension"),
        Binding("enter", "open", "Detail", tooltip="Zoom into a group, or a rank's detail"),
        Binding("escape", "back", "Back", show=False, tooltip="Leave the zoom, then the filter"),
        Binding(
            "R",
            "reset_view",
            "Reset view",
            show=False,
            tooltip="Back to the default view: metric, grouping, no pins, no filter",
        ),
        Binding("s", "structure", "Structure", show=False, tooltip="Every dimension's effect"),
        Binding("c", "curves", "Curves", show=False, tooltip="Message-size curves"),
        Binding("d", "manifest", "Manifest", show=False, tooltip="Manifest diff vs baseline"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | ? | Every key of every screen. |
    | space | Pin or unpin the selected rank (a group row pins its worst rank). |
    | P | Pin the slowest ranks (``view.pin_slowest`` of them). |
    | / | Filter ranks and hosts (``12``, ``8-15``, ``node0003``; comma-separated). |
    | m | Next heatmap metric. |
    | g | Next grouping dimension. |
    | enter | Zoom into the selected group, or open the selected rank's detail. |
    | escape | Leave the zoom, then clear the filter. |
    | R | Reset the view to the defaults (metric, grouping, pins, filter, baseline). |
    | s | Structure: every dimension's effect on every metric. |
    | c | Message-size curves. |
    | d | Manifest diff against the baseline. |
    """

    DEFAULT_CSS = """
    MainScreen { layout: vertical; }
    MainScreen #body { height: 1fr; }
    MainScreen #left { width: 1fr; }
    MainScreen #legend { height: 1; padding: 0 1; }
    MainScreen #viewnote {
        height: 1; padding: 0 1; color: $text-warning; background: $warning-muted;
        display: none;
    }
    MainScreen #side { width: 50; height: 1fr; }
    MainScreen.-narrow #body { layout: vertical; }
    MainScreen.-narrow #side { width: 1fr; height: auto; max-height: 9; layout: horizontal; }
    MainScreen.-narrow LastArrivalsPanel > DataTable { max-height: 4; }
    MainScreen.-narrow LastArrivalsPanel > Static { max-height: 2; }
    MainScreen.-narrow #side > * { width: 1fr; }
    MainScreen.-narrow StructurePanel { display: none; }
    """

    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]  # noqa: RUF012

    @property
    def rs_app(self) -> RankscopeApp:
        """The app, typed."""
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        yield VerdictLine(id="verdict")
        yield Static(id="viewnote")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield Static(id="legend")
                yield Heatmap(id="heatmap", color_system=self.rs_app.color_system)
            with Vertical(id="side"):
                yield LastArrivalsPanel(id="arrivals")
                yield StructurePanel(id="structure")
                yield DecompositionPanel(id="decomposition")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Heatmap).focus()
        app = self.rs_app
        if app.model is not None:
            self.show_model(app.model)
        self.show_analysis(app.analysis)

    def on_screen_resume(self) -> None:
        # Models that arrived while another screen was on top were not drawn here.
        app = self.rs_app
        if app.model is not None:
            self.show_model(app.model)
        self.show_analysis(app.analysis)

    @property
    def heatmap(self) -> Heatmap:
        """The heatmap widget."""
        return self.query_one(Heatmap)

    def show_model(self, model: MainModel) -> None:
        """Draw a new model (called by the app on every sample or view change)."""
        app = self.rs_app
        current = model.header.run if model.header is not None else None
        other_runs = any(r.run != current for r in model.runs)
        self.query_one(HeaderBar).show(
            model.header,
            paused=app.paused,
            source=app.source.label,
            live=app.source.live,
            extra=app.header_extra(),
            message=model.message,
            other_runs=other_runs,
        )
        self.query_one(DecompositionPanel).set_other_runs(other_runs)
        self.show_view_note()
        legend_widget = self.query_one("#legend", Static)
        if model.grid is None:
            legend_widget.update(Text(model.message, style="italic"))
            return
        grid = model.grid
        text = legend(grid, self.heatmap.palette, self.heatmap.missing_colour, width=400)
        extra = []
        if grid.zoom_up is not None:
            extra.append(f"zoom: {grid.zoom_up_name} (esc)")
        if grid.zoom is not None:
            extra.append(f"zoom: {grid.zoom_name} (esc)")
        if model.view.filter:
            extra.append(f"filter: {model.view.filter} ({grid.hidden} hidden)")
        if extra:
            prefix = Text()
            prefix.append(" · ".join(extra) + "  ", style="bold yellow")
            prefix.append_text(text)
            text = prefix
        legend_widget.update(text)
        self.heatmap.set_grid(grid)
        self.query_one(LastArrivalsPanel).show(model.arrivals, model.ranking, model.regime_step)

    def show_view_note(self) -> None:
        """Say which parts of the job's saved view are in effect (hidden when none)."""
        note = self.rs_app.saved_view_note()
        widget = self.query_one("#viewnote", Static)
        widget.display = note is not None
        if note is not None:
            width = widget.content_size.width or self.size.width - 2
            widget.update(fit_words(Text(note), width))

    def show_analysis(self, analysis: AnalysisView | None) -> None:
        """Draw a new diagnosis."""
        self.query_one(VerdictLine).show(analysis, busy=self.rs_app.diagnosing)
        self.query_one(StructurePanel).show(analysis)
        self.query_one(DecompositionPanel).show(analysis)

    def action_pin(self) -> None:
        """Pin or unpin the selected rank."""
        row = self.heatmap.selected()
        if row is not None:
            self.rs_app.toggle_pin(row.rank)

    def action_pin_slowest(self) -> None:
        """Pin the slowest ranks."""
        self.rs_app.pin_slowest()

    def action_filter(self) -> None:
        """Ask for a rank/host filter."""
        self.rs_app.ask_filter()

    def action_metric(self) -> None:
        """Next heatmap metric."""
        self.rs_app.cycle_metric()

    def action_group_by(self) -> None:
        """Next grouping dimension."""
        self.rs_app.cycle_group_by()

    def action_open(self) -> None:
        """Zoom into a group row, or open a rank's detail."""
        row = self.heatmap.selected()
        if row is None:
            return
        grid = self.heatmap.grid
        if row.kind == GROUP and grid is not None and grid.rolled_up:
            self.rs_app.zoom_up = row.group
        elif row.kind == GROUP:
            self.rs_app.zoom = row.group
        else:
            self.rs_app.open_detail(row.rank)

    def action_back(self) -> None:
        """Leave the zoom, else clear the filter."""
        app = self.rs_app
        if app.zoom is not None:
            app.zoom = None
        elif app.zoom_up is not None:
            app.zoom_up = None
        elif app.filter_text:
            app.filter_text = ""

    def action_reset_view(self) -> None:
        """Back to the default view."""
        self.rs_app.reset_view()

    def action_structure(self) -> None:
        """Open the structure screen."""
        self.rs_app.open_report("structure")

    def action_curves(self) -> None:
        """Open the message-size curves."""
        self.rs_app.open_report("curves")

    def action_manifest(self) -> None:
        """Open the manifest diff."""
        self.rs_app.open_report("manifest")
