"""Drawing a `HeatGrid`: lines of coloured cells and the colour-scale legend.

Pure renderables with no app state: they take a grid and a palette and return Strips or
Rich Text, so tests render them to strings with no app. Dense mode packs two rows into one
terminal line with the upper half block ``▀`` (foreground = upper row, background = lower
row), which doubles the ranks visible on a small terminal. Columns are the most recent
steps that fit, newest on the right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip

from rankscope.tui.heatgrid import GROUP, PIN, HeatGrid

PALETTES: dict[str, tuple[str, ...]] = {
    # Cool to hot; every step stays distinct after Rich maps it to the 256-colour cube.
    "truecolor": (
        "#1d3557",
        "#23598c",
        "#2a7fa8",
        "#3aa387",
        "#9cbf3b",
        "#e8c62e",
        "#f0882a",
        "#e63b2e",
    ),
    # Standard ANSI colours for 16-colour terminals, in the same cool-to-hot order; the
    # healthy end is dim so the hot cells stand out.
    "16": (
        "bright_black",
        "blue",
        "cyan",
        "green",
        "yellow",
        "bright_yellow",
        "red",
        "bright_red",
    ),
}
MISSING = "#3a3a3a"
MISSING_16 = "white"


def palette_for(color_system: str) -> tuple[tuple[str, ...], str]:
    """The heatmap palette and the "unknown" colour for a terminal colour system.

    Args:
        color_system: ``truecolor``, ``256``, ``standard``/``16`` or ``windows``.

    Returns:
        ``(levels, missing)`` colour names.
    """
    if color_system in ("standard", "16", "windows"):
        return PALETTES["16"], MISSING_16
    return PALETTES["truecolor"], MISSING


MAX_CELL_WIDTH = 3
"""Widest a step's column grows when the terminal has room for it."""


def _short(label: str) -> str:
    # The first word of a row label names it: "r12", "node003", "rail".
    head = label.split(" ", 1)[0]
    return label.split(" ", 2)[1] if head == "●" and " " in label else head


@dataclass(frozen=True)
class HeatmapPainter:
    """Draws a grid line by line; built once per data update, asked for visible lines.

    Pinned rows always get a line of their own. In dense mode the other rows share lines
    two by two (upper half block = first row, lower half = second), and a line's label
    names both (``▀node000 ▄node001``); the selected row's line shows its full label and
    its partner's name (``▸▀r12 node003 ▄r13``).
    Steps fill the width, each as wide as ``MAX_CELL_WIDTH`` cells when there is room; the
    newest steps are kept when there is not.
    """

    grid: HeatGrid
    palette: tuple[str, ...]
    missing: str = MISSING
    dense: bool = False
    """Two rows per line with half blocks."""
    label_width: int = 18
    cursor: int | None = None
    """Selected row (its line gets a marker and shows that row's label)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_levels", self.grid.levels(len(self.palette)))
        colours = [*self.palette, self.missing]
        # Level -1 (unknown) indexes the last colour.
        object.__setattr__(self, "_colours", colours)
        object.__setattr__(self, "_styles", {})
        n = len(self.grid)
        pins = int(np.sum(self.grid.kinds == PIN))
        if self.dense:
            rest = np.arange(pins, n)
            top = np.r_[np.arange(pins), rest[0::2]]
            bottom = np.r_[np.full(pins, -1), rest[1::2], np.full(rest.size % 2, -1)]
        else:
            top, bottom = np.arange(n), np.full(n, -1)
        line = np.empty(n, dtype=np.int64)
        line[top] = np.arange(top.size)
        line[bottom[bottom >= 0]] = np.flatnonzero(bottom >= 0)
        object.__setattr__(self, "_top", top.astype(np.int64))
        object.__setattr__(self, "_bottom", bottom.astype(np.int64))
        object.__setattr__(self, "_line", line)

    @property
    def line_count(self) -> int:
        """Lines needed to draw every row."""
        return int(self._top.size)  # type: ignore[attr-defined]

    def line_of_row(self, row: int) -> int:
        """The line that draws ``row``."""
        return int(self._line[row])  # type: ignore[attr-defined]

    def rows_of_line(self, y: int) -> tuple[int, int | None]:
        """The rows a line draws: ``(upper, lower)``; lower is None for a single row."""
        b = int(self._bottom[y])  # type: ignore[attr-defined]
        return int(self._top[y]), (b if b >= 0 else None)  # type: ignore[attr-defined]

    def _style(self, top: int, bottom: int | None) -> Style:
        key = (top, bottom)
        styles: dict = self._styles  # type: ignore[attr-defined]
        style = styles.get(key)
        if style is None:
            colours = self._colours  # type: ignore[attr-defined]
            if bottom is None:
                style = Style(bgcolor=colours[top])
            else:
                style = Style(color=colours[top], bgcolor=colours[bottom])
            styles[key] = style
        return style

    def _label(self, y: int) -> list[Segment]:
        top, bottom = self.rows_of_line(y)
        labels = self.grid.labels
        width = self.label_width - 2
        selected = self.cursor is not None and self.cursor in (top, bottom)
        partner = ""
        if selected:
            shown = int(self.cursor)  # type: ignore[arg-type]
            half = "" if bottom is None else ("▀" if shown == top else "▄")
            text = half + labels[shown]
            if bottom is not None:
                # The other row of the line stays named: which rank shares the colours
                # above (▀) or below (▄) the selected one.
                other = bottom if shown == top else top
                partner = f" {'▄' if shown == top else '▀'}{_short(labels[other])}"
        elif bottom is not None:
            shown = top
            text = f"▀{_short(labels[top])} ▄{_short(labels[bottom])}"
            # Two ranks of one group: name the group once; of two groups (a pin moved the
            # pairs across a host boundary): name both, the second by what differs.
            a, b = labels[top].split(" ", 1), labels[bottom].split(" ", 1)
            if len(a) == len(b) == 2 and a[0].startswith("r") and b[0].startswith("r"):
                if a[1] == b[1]:
                    text += f" {a[1]}"
                else:
                    common = next(
                        (i for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y),
                        min(len(a[1]), len(b[1])),
                    )
                    text += f" {a[1]}/{b[1][common:] or b[1]}"
        else:
            shown = top
            text = labels[top]
        room = width - len(partner)
        if len(text) > room:
            text = text[: max(room - 1, 0)] + "…"
        kind = int(self.grid.kinds[shown])
        style = Style(
            bold=kind == PIN or selected,
            color="yellow" if kind == PIN else None,
            italic=kind == GROUP,
            reverse=selected,
        )
        segments = [Segment(f"{'▸' if selected else ' '}{text}", style)]
        if partner:
            segments.append(Segment(partner, Style(dim=True)))
        pad = width - len(text) - len(partner)
        segments.append(Segment(" " * (pad + 1)))
        return segments

    def cell_width(self, width: int) -> int:
        """Cells per step for a line ``width`` cells wide (label included)."""
        n_cols = int(self._levels.shape[1])  # type: ignore[attr-defined]
        room = width - self.label_width
        if n_cols == 0 or room <= 0:
            return 1
        return int(max(1, min(MAX_CELL_WIDTH, room // n_cols)))

    def render_line(self, y: int, width: int) -> Strip:
        """One terminal line of the heatmap.

        Args:
            y: line index (0 = first line of rows).
            width: cells available, label included.

        Returns:
            A strip exactly ``width`` cells long (blank past the last row).
        """
        if y < 0 or y >= self.line_count or width <= 0:
            return Strip.blank(max(width, 0))
        label_cells = min(width, self.label_width)
        segments = list(Segment.adjust_line_length(self._label(y), label_cells))
        cells = width - label_cells
        levels: np.ndarray = self._levels  # type: ignore[attr-defined]
        n_cols = levels.shape[1]
        cw = self.cell_width(width)
        shown = min(cells // cw, n_cols)
        if shown > 0:
            cols = slice(n_cols - shown, n_cols)
            top_row, bottom_row = self.rows_of_line(y)
            top = levels[top_row, cols].astype(np.int16)
            bottom = levels[bottom_row, cols].astype(np.int16) if bottom_row is not None else None
            code = top * 16 + (bottom if bottom is not None else 0)
            # Runs of one colour pair (``np.r_`` here cost more than the rest of the line).
            cuts = [0, *(np.flatnonzero(code[1:] != code[:-1]) + 1).tolist()]
            for a, b in zip(cuts, [*cuts[1:], shown], strict=True):
                t = int(top[a])
                run = (b - a) * cw
                if bottom is not None:
                    segments.append(Segment("▀" * run, self._style(t, int(bottom[a]))))
                else:
                    segments.append(Segment(" " * run, self._style(t, None)))
        pad = cells - max(shown, 0) * cw
        if pad > 0:
            segments.append(Segment(" " * pad))
        return Strip(segments, width)


def legend(
    grid: HeatGrid,
    palette: tuple[str, ...],
    missing: str = MISSING,
    *,
    width: int = 80,
) -> Text:
    """The colour scale: metric, unit, value at each end, and the unknown colour.

    Args:
        grid: the grid whose scale is drawn.
        palette: level colours, healthy first.
        missing: colour of unknown cells.
        width: cells available.

    Returns:
        One line of Rich text.
    """
    spec = grid.spec
    good, bad = (grid.lo, grid.hi) if spec.higher_is_worse else (grid.hi, grid.lo)
    text = Text()
    text.append(f"{spec.label} ({spec.unit}) ", style="bold")
    text.append(f"{_fmt(good)} ")
    for colour in palette:
        text.append("██", style=Style(color=colour))
    text.append(f" {_fmt(bad)}")
    text.append("  ")
    text.append("██", style=Style(color=missing))
    text.append(" none")
    if grid.kinds.size and (grid.kinds == GROUP).any():
        if grid.rolled_up:
            text.append(
                f"  rows: worst rank of each {grid.rolled_up} (enter: its {grid.dimension}s)",
                style="dim",
            )
        else:
            text.append("  rows: worst rank of each " + grid.dimension, style="dim")
    text.truncate(width)
    return text


def _fmt(value: float) -> str:
    if not np.isfinite(value):
        return "–"
    mag = abs(value)
    if mag >= 1000:
        return f"{value:,.0f}"
    if mag >= 100:
        return f"{value:.0f}"
    if mag >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"
