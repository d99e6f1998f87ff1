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
    # Standard ANSI colours for 16-colour terminals, in the same cool-to-hot order.
    "16": ("blue", "cyan", "green", "bright_green", "yellow", "bright_yellow", "red", "bright_red"),
}
MISSING = "#3a3a3a"
MISSING_16 = "bright_black"


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


@dataclass(frozen=True)
class HeatmapPainter:
    """Draws a grid line by line; built once per data update, asked for visible lines."""

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

    @property
    def line_count(self) -> int:
        """Lines needed to draw every row."""
        n = len(self.grid)
        return (n + 1) // 2 if self.dense else n

    def line_of_row(self, row: int) -> int:
        """The line that draws ``row``."""
        return row // 2 if self.dense else row

    def _style(self, top: int, bottom: int | None) -> Style:
        key = (top, bottom)
        styles: dict = self._styles  # type: ignore[attr-defined]
        style = styles.get(key)
        if style is None:
            colours = self._colours  # type: ignore[attr-defined]
            if bottom is None:
                style = Style(bgcolor=colours[top])
            elif bottom == -2:
                style = Style(color=colours[top])
            else:
                style = Style(color=colours[top], bgcolor=colours[bottom])
            styles[key] = style
        return style

    def _label(self, y: int) -> tuple[str, Style]:
        rows = (2 * y, 2 * y + 1) if self.dense else (y,)
        shown = self.cursor if self.cursor in rows else rows[0]
        assert shown is not None
        marker = "▸" if self.cursor in rows else " "
        text = self.grid.labels[shown]
        width = self.label_width - 2
        if len(text) > width:
            text = text[: width - 1] + "…"
        kind = int(self.grid.kinds[shown])
        style = Style(
            bold=kind == PIN or marker == "▸",
            color="yellow" if kind == PIN else None,
            italic=kind == GROUP,
            reverse=marker == "▸",
        )
        return f"{marker}{text:<{width}} ", style

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
        label, label_style = self._label(y)
        label = label[:width]
        segments = [Segment(label, label_style)]
        cells = width - len(label)
        levels: np.ndarray = self._levels  # type: ignore[attr-defined]
        n_cols = levels.shape[1]
        shown = min(cells, n_cols)
        if shown > 0:
            cols = slice(n_cols - shown, n_cols)
            if self.dense:
                top = levels[2 * y, cols].astype(np.int16)
                has_bottom = 2 * y + 1 < levels.shape[0]
                bottom = levels[2 * y + 1, cols].astype(np.int16) if has_bottom else None
            else:
                top = levels[y, cols].astype(np.int16)
                bottom = None
            code = top * 16 + (bottom if bottom is not None else 0)
            cuts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
            ends = np.r_[cuts[1:], shown]
            for a, b in zip(cuts.tolist(), ends.tolist()):
                t = int(top[a])
                if self.dense and bottom is not None:
                    segments.append(Segment("▀" * (b - a), self._style(t, int(bottom[a]))))
                elif self.dense:
                    segments.append(Segment("▀" * (b - a), self._style(t, -2)))
                else:
                    segments.append(Segment(" " * (b - a), self._style(t, None)))
        pad = cells - max(shown, 0)
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
