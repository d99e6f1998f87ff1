"""Small pure renderables: sparklines and stacked bars.

They take numbers and return plain strings or Rich Text, so tests render them with no app.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from rich.style import Style
from rich.text import Text

TICKS = "▁▂▃▄▅▆▇█"


def sparkline(
    values: Sequence[float] | np.ndarray,
    width: int,
    lo: float | None = None,
    hi: float | None = None,
) -> str:
    """A one-line sparkline of the last ``width`` values (unknown values draw as spaces).

    Args:
        values: the series, oldest first.
        width: characters to fill; shorter series are right-aligned (newest on the right).
        lo: value drawn as the lowest tick (default: series minimum).
        hi: value drawn as the highest tick (default: series maximum).

    Returns:
        A string of exactly ``width`` characters.
    """
    if width <= 0:
        return ""
    arr = np.asarray(values, dtype=np.float64)[-width:]
    finite = arr[np.isfinite(arr)]
    if finite.size == 0:
        return " " * width
    lo = float(finite.min()) if lo is None else lo
    hi = float(finite.max()) if hi is None else hi
    span = hi - lo
    with np.errstate(invalid="ignore"):
        frac = (arr - lo) / span if span > 0 else np.zeros_like(arr)
        idx = np.floor(np.clip(frac, 0.0, 1.0) * (len(TICKS) - 1) + 0.5)
    chars = [TICKS[int(i)] if np.isfinite(i) else " " for i in idx]
    return " " * (width - len(chars)) + "".join(chars)


def stacked_bar(
    parts: Sequence[tuple[str, float]],
    colours: dict[str, str],
    width: int,
    full_scale: float,
) -> Text:
    """One horizontal bar split into coloured segments, proportional to ``full_scale``.

    Segment widths are rounded so they add up to the bar's total length (largest remainder
    first), and no positive part vanishes while it has at least half a cell.

    Args:
        parts: ``(name, value)`` in drawing order; negative and unknown values count as 0.
        colours: name -> colour of its segment.
        width: cells that ``full_scale`` fills.
        full_scale: the value that fills the whole width (e.g. the larger of two totals).

    Returns:
        Rich text exactly ``width`` cells wide (padded with spaces).
    """
    text = Text()
    if width <= 0:
        return text
    vals = np.array([v if np.isfinite(v) and v > 0 else 0.0 for _, v in parts], dtype=float)
    scale = full_scale if full_scale > 0 else max(float(vals.sum()), 1.0)
    exact = vals / scale * width
    total = min(width, round(float(exact.sum())))
    cells = np.floor(exact).astype(int)
    remainder = exact - cells
    # Parts that would vanish go first, then the largest remainders.
    vanishing = (cells == 0) & (exact >= 0.5)
    for i in np.lexsort((-remainder, ~vanishing)):
        if cells.sum() >= total:
            break
        if remainder[i] > 0:
            cells[i] += 1
    for (name, _), n in zip(parts, cells.tolist()):
        if n > 0:
            text.append("█" * n, style=Style(color=colours.get(name, "white")))
    text.append(" " * (width - text.cell_len))
    return text
