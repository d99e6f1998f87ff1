"""The per-rank heatmap widget: rows of ranks or groups × recent steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.style import Style
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from rankscope.tui.heatgrid import GROUP, PIN, HeatGrid
from rankscope.tui.heatmap_render import PALETTES, HeatmapPainter, palette_for


@dataclass(frozen=True)
class RowRef:
    """What a heatmap row stands for."""

    kind: int
    """``PIN``, ``RANK`` or ``GROUP``."""
    rank: int
    """The rank (a group's worst rank)."""
    group: int
    """Group code along the grid's dimension."""
    label: str


class Heatmap(ScrollView, can_focus=True):
    """Ranks (or groups of ranks) × the most recent steps, coloured by one metric.

    Draws through ``render_line`` so only the visible lines are built, whatever the world
    size. When the rows do not fit, two rows share a line (half blocks).
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor(-1)", "Up", show=False),
        Binding("down,j", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "edge(0)", "First row", show=False),
        Binding("end", "edge(1)", "Last row", show=False),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | up, k | Select the row above. |
    | down, j | Select the row below. |
    | pageup, pagedown | Move the selection by a screen. |
    | home, end | Select the first or last row. |
    """

    DEFAULT_CSS = """
    Heatmap {
        height: 1fr;
        overflow-x: hidden;
        scrollbar-size-vertical: 1;
    }
    """

    cursor: reactive[int] = reactive(0, always_update=True)
    """Index of the selected row."""

    class CursorMoved(Message):
        """The selected row changed."""

        def __init__(self, heatmap: Heatmap, row: RowRef | None) -> None:
            super().__init__()
            self.heatmap = heatmap
            self.row = row

        @property
        def control(self) -> Heatmap:
            return self.heatmap

    def __init__(
        self,
        *,
        color_system: str = "truecolor",
        label_width: int = 20,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.grid: HeatGrid | None = None
        self._palette, self._missing = palette_for(color_system)
        self.label_width = label_width
        self._painter: HeatmapPainter | None = None
        self._lines_style: Style | None = None
        """The widget's style while one update renders its lines (`render_lines`)."""

    @property
    def palette(self) -> tuple[str, ...]:
        """Level colours in use."""
        return self._palette

    @property
    def missing_colour(self) -> str:
        """Colour of unknown cells."""
        return self._missing

    def set_color_system(self, color_system: str) -> None:
        """Switch palettes (e.g. for a 16-colour terminal)."""
        self._palette, self._missing = palette_for(color_system)
        self._repaint()

    @property
    def dense(self) -> bool:
        """Whether two rows share each line (rows do not fit the height)."""
        return self.grid is not None and len(self.grid) > max(self.size.height, 1)

    def selected(self) -> RowRef | None:
        """The selected row, or None when the grid is empty."""
        g = self.grid
        if g is None or not len(g):
            return None
        i = min(self.cursor, len(g) - 1)
        return RowRef(int(g.kinds[i]), int(g.rank[i]), int(g.group[i]), g.labels[i])

    def set_grid(self, grid: HeatGrid) -> None:
        """Show a new grid, keeping the selection on the same rank or group if present.

        Args:
            grid: the rows to draw.
        """
        old = self.selected()
        self.grid = grid
        cursor = 0
        if old is not None and len(grid):
            if old.kind == GROUP:
                hits = [i for i in range(len(grid)) if grid.group[i] == old.group]
            else:
                hits = [i for i in range(len(grid)) if grid.rank[i] == old.rank]
            if hits:
                kinds = [int(grid.kinds[i]) for i in hits]
                same = [h for h, k in zip(hits, kinds) if (k == PIN) == (old.kind == PIN)]
                cursor = (same or hits)[0]
            else:
                cursor = min(self.cursor, len(grid) - 1)
        self._repaint()
        self.cursor = cursor

    def _repaint(self) -> None:
        if self.grid is None:
            self._painter = None
            self.virtual_size = Size(0, 0)
        else:
            self._painter = HeatmapPainter(
                self.grid,
                self._palette,
                self._missing,
                dense=self.dense,
                label_width=self.label_width,
                cursor=self.cursor if len(self.grid) else None,
            )
            self.virtual_size = Size(self.size.width, self._painter.line_count)
        self.refresh()

    def on_resize(self) -> None:
        self._repaint()

    def watch_cursor(self, old: int, new: int) -> None:
        g = self.grid
        if g is None or not len(g):
            return
        clamped = max(0, min(new, len(g) - 1))
        if clamped != new:
            self.cursor = clamped
            return
        self._repaint()
        assert self._painter is not None
        line = self._painter.line_of_row(new)
        top = self.scroll_offset.y
        height = max(self.size.height, 1)
        if line < top:
            self.scroll_to(y=line, animate=False)
        elif line >= top + height:
            self.scroll_to(y=line - height + 1, animate=False)
        self.post_message(self.CursorMoved(self, self.selected()))

    def action_cursor(self, delta: int) -> None:
        """Move the selection by ``delta`` rows."""
        self.cursor = self.cursor + delta

    def action_page(self, direction: int) -> None:
        """Move the selection by one screen of rows."""
        per_line = 2 if self.dense else 1
        self.cursor = self.cursor + direction * max(self.size.height - 1, 1) * per_line

    def action_edge(self, end: int) -> None:
        """Select the first (0) or last (1) row."""
        n = len(self.grid) if self.grid is not None else 0
        self.cursor = max(n - 1, 0) if end else 0

    def render_lines(self, crop: Region) -> list[Strip]:
        # The widget's style is worked out once for the lines of one update (it walks the
        # CSS each time it is asked; every line asking cost a fifth of a frame).
        self._lines_style = self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._lines_style = None

    def render_line(self, y: int) -> Strip:
        style = self._lines_style or self.rich_style
        if self._painter is None:
            return Strip.blank(self.size.width, style)
        scroll_y = self.scroll_offset.y
        strip = self._painter.render_line(y + scroll_y, self.size.width)
        return strip.apply_style(style)


__all__ = ["PALETTES", "Heatmap", "RowRef"]
