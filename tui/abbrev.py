"""Fitting header and verdict lines to the terminal's width without cutting a word.

A line is made of fields in display order, each with a priority. When the line is too
wide, the least important fields go first (the sparkline before the baseline, the clock
before the world size); what must stay is shortened at a word boundary and marked with an
ellipsis, so ``run-0419`` never reads ``run-04``. Pure functions of rich ``Text``: tested
by rendering to strings, no app needed.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.text import Text

ELLIPSIS = "…"

_TRAILING = " ·│,;:→-"
"""Stripped before the ellipsis so a shortened text never ends in a dangling separator."""


@dataclass(frozen=True)
class Field:
    """One part of a line."""

    text: Text
    priority: int = 0
    """0 = always shown (shortened if need be); larger numbers are dropped first."""
    sep: str = " │ "
    """Put before the field when another one precedes it."""
    sep_style: str = "dim"


def _cut(text: Text, end: int) -> Text:
    out = text.copy()
    out.truncate(end)
    out.rstrip()
    plain = out.plain
    keep = len(plain.rstrip(_TRAILING))
    if keep < len(plain):
        out.truncate(keep)
    out.append(ELLIPSIS, style="dim")
    return out


def word_cuts(plain: str) -> list[int]:
    """Positions where ``plain`` may be cut: before each space that follows a word."""
    return [i for i in range(1, len(plain)) if plain[i] == " " and plain[i - 1] != " "]


def fit_words(text: Text, width: int, lines: int = 1) -> Text:
    """Shorten ``text`` at a word boundary, with an ellipsis, until it wraps to at most
    ``lines`` lines of ``width`` cells.

    Args:
        text: the text (styles are kept).
        width: cells per line (0 or less: no limit).
        lines: lines it may take when wrapped at word boundaries.

    Returns:
        ``text`` itself when it fits, else its longest word-boundary prefix that fits with
        the ellipsis; a single word wider than the room is cut inside as a last resort.
    """
    if width <= 0 or _line_count(text, width) <= lines:
        return text
    cuts = word_cuts(text.plain)
    lo, hi, best = 0, len(cuts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = _cut(text, cuts[mid])
        if _line_count(candidate, width) <= lines:
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    if best is not None:
        return best
    return _cut(text, max(width * lines - 1, 0))


_CONSOLE = Console(file=io.StringIO(), width=400, color_system=None, legacy_windows=False)


def _line_count(text: Text, width: int) -> int:
    if "\n" not in text.plain and text.cell_len <= width:
        return 1
    return len(text.wrap(_CONSOLE, width))


def fit_fields(fields: Sequence[Field], width: int) -> Text:
    """Join fields on one line of at most ``width`` cells.

    Fields of the largest priority are dropped first (the last of equals first); when only
    priority-0 fields remain and they are still too wide, the last of them is shortened at
    a word boundary (then the one before it, and so on).

    Args:
        fields: in display order.
        width: cells available (0 or less: no limit).

    Returns:
        One line of text.
    """
    kept = [f for f in fields if f.text.cell_len]
    if width > 0:
        while _width(kept) > width:
            droppable = [i for i, f in enumerate(kept) if f.priority > 0]
            if not droppable:
                break
            worst = max(droppable, key=lambda i: (kept[i].priority, i))
            del kept[worst]
    texts = [f.text for f in kept]
    if width > 0:
        for i in range(len(kept) - 1, -1, -1):
            total = _joined_len(kept, texts)
            if total <= width:
                break
            room = width - (total - texts[i].cell_len)
            # Too little room for a word and its ellipsis: leave the field out.
            texts[i] = fit_words(texts[i], room) if room >= 4 else Text("")
    line = Text()
    for f, t in zip(kept, texts):
        if not t.cell_len:
            continue
        if line.cell_len:
            line.append(f.sep, style=f.sep_style)
        line.append_text(t)
    return line


def _width(fields: Sequence[Field]) -> int:
    return _joined_len(fields, [f.text for f in fields])


def _joined_len(fields: Sequence[Field], texts: Sequence[Text]) -> int:
    # Separators go between the fields that are shown (an emptied one takes none).
    shown = [(f, t) for f, t in zip(fields, texts) if t.cell_len]
    return sum(t.cell_len + (len(f.sep) if i else 0) for i, (f, t) in enumerate(shown))
