"""One sanitiser for every string that comes from telemetry.

Everything a collector sends is untrusted: job and run ids, host, rack and NIC names,
process-group names, user phase names, the manifest (``argv``, env, job config, git). A
hostile or broken rank can put terminal escapes in a host name (OSC 2 retitles the
terminal, OSC 52 writes the clipboard), HTML and image links in a manifest field, a
formula in a CSV cell, ``../`` or ``%`` in a run id that becomes a folder name, or control
characters that make an SVG ill-formed. This module is the one place that knows how to
make such a string safe for each place it is written to:

==========================  ===================================================================
`for_terminal`              a terminal, the TUI, any printed line: control characters
                            (C0, C1, DEL, ESC and so every CSI/OSC/DCS sequence), bidi
                            overrides and other invisible format characters are written as
                            visible ``\\x1b`` / ``\\u202e`` escapes; the rest is kept
`terminal_text`             a whole block of text a command prints: `for_terminal`,
                            keeping newlines and tabs
`for_markup`                a Rich/Textual markup string (``notify``, ``DataTable`` str
                            cells, border titles): `for_terminal`, then ``rich.markup.escape``
`for_markdown`              Markdown text and table cells: `for_terminal`, HTML-escaped,
                            Markdown punctuation (links, images, emphasis, code, pipes)
                            backslash-escaped
`for_markdown_code`         inside a Markdown code span or block: `for_terminal`, backticks
                            replaced, so the span cannot be closed early
`for_xml` / `xml_chars`     XML 1.0 text or attribute (SVG): invalid characters removed,
                            then escaped; `xml_chars` only removes, for a whole document
                            whose markup is already escaped
`for_csv_cell`              a CSV cell: a leading ``= + - @``, tab or CR gets a ``'``
                            (OWASP CSV injection), so a spreadsheet shows text, not a formula
`for_filename`              one path component: only ``[A-Za-z0-9._-]``, no leading dot or
                            dash, never ``..``, bounded length, never empty
==========================  ===================================================================

Where it is applied (the design: clean once where the readers share the data, and encode
at each output, rather than a call at every format string):

- Readers: `clean_window` returns a `Window` whose display strings (job, scope, host, rack,
  NIC and group names, phase names, the manifest) are `for_terminal`-clean; the TUI's
  sampler (`rankscope.tui.sources.sample`) hands only such windows to the screens. Run ids
  are keys — they name runs in the store, in reruns and in ladders — so they stay as
  recorded and are cleaned where they are shown.
- Outputs: every command prints through `terminal_text` (``inspect``, ``diagnose``,
  ``ladder``, ``snapshot``, ``export``, ``rerun``); ``report`` draws `clean_data` of the
  snapshot with every value as plain ``Text``, never markup; ``snapshot.md`` escapes each
  value with `for_markdown` / `for_markdown_code`; ``screen.svg`` is written through
  `xml_chars` (Rich's and Textual's SVG export already escape ``&<>``); CSV cells go
  through `for_csv_cell`; a snapshot's folder and ``manifests/<run>.json`` names through
  `for_filename`; in the TUI, ``DataTable`` str cells through `for_markup`, run ids and
  notifications through `for_terminal` (``notify(..., markup=False)``). JSON output needs nothing: ``json.dumps``
  escapes every control and non-ASCII character.

Cleaning is idempotent and never raises: anything that is not a string is ``str()``-ed.
The module needs only the standard library (Rich is imported by `for_markup` alone, when
called), so every layer, the hub's exporters included, may use it.
"""

from __future__ import annotations

import dataclasses
import html
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

__all__ = [
    "clean_data",
    "clean_window",
    "for_csv_cell",
    "for_filename",
    "for_markdown",
    "for_markdown_code",
    "for_markup",
    "for_terminal",
    "for_xml",
    "terminal_text",
    "xml_chars",
]

_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Bidirectional controls (Trojan Source): they reorder what the reader sees."""
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Control, format (zero-width, bidi, BOM...), surrogate, line and paragraph separators."""


def _visible(ch: str) -> str:
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _unsafe(ch: str) -> bool:
    o = ord(ch)
    if 0x20 <= o < 0x7F:
        return False
    if o < 0x20 or 0x7F <= o <= 0x9F or ch in _BIDI:
        return True
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def _escape_unsafe(s: str, keep: str = "") -> str:
    if s.isascii() and s.isprintable():  # the common case: nothing to do
        return s
    return "".join(_visible(c) if c not in keep and _unsafe(c) else c for c in s)


def for_terminal(s: Any) -> str:
    """A telemetry string that is safe to show on a terminal (one line).

    Control characters (C0 including ESC, newline and tab; DEL; C1 including the 8-bit
    CSI/OSC introducers), bidi overrides and other format characters become visible
    escapes such as ``\\x1b`` or ``\\u202e``: an escape sequence is shown, not obeyed, and
    the operator sees that the name is odd. Printable text, non-ASCII letters included,
    is kept.

    Args:
        s: the value (not a string: ``str()`` of it).

    Returns:
        Printable text on one line.
    """
    return _escape_unsafe(s if isinstance(s, str) else str(s))


def terminal_text(s: Any) -> str:
    """A block of text a command prints, safe for the terminal: `for_terminal` on every
    character except newlines and tabs, which keep the layout.

    Args:
        s: the text.

    Returns:
        The text, with every other control character shown as an escape.
    """
    return _escape_unsafe(s if isinstance(s, str) else str(s), keep="\n\t")


def for_markup(s: Any) -> str:
    """A telemetry string to put inside Rich/Textual console markup.

    Args:
        s: the value.

    Returns:
        `for_terminal` text with ``[`` escaped so it opens no markup tag.
    """
    from rich.markup import escape  # lazily: the core packages never import rich

    return escape(for_terminal(s))


_MD_PUNCT = re.compile(r"([\\`*\[\]|])")
"""What forms links, images, code spans, emphasis and table cells. ``_`` is left alone:
intraword it never emphasises, and names are full of it."""


def for_markdown(s: Any) -> str:
    """A telemetry string to put in Markdown text or a table cell.

    HTML is escaped (``<img>``, ``<script>``, ``<http://...>`` autolinks stay text), and
    the punctuation that forms links, images, code spans, emphasis or table cells
    (``\\ ` * [ ] |``) is backslash-escaped, so ``![x](http://...)`` renders as those
    characters.
    Newlines and every other control character become visible escapes (one line).

    Args:
        s: the value.

    Returns:
        Markdown that renders as the literal text.
    """
    text = html.escape(for_terminal(s), quote=False)  # no attribute is ever written
    return _MD_PUNCT.sub(r"\\\1", text)


def for_markdown_code(s: Any) -> str:
    """A telemetry string to put inside a Markdown code span or fenced block, where
    neither HTML nor backslash escapes are read: backticks become ``'`` so the span or
    fence cannot be closed, and control characters become visible escapes.

    Args:
        s: the value.

    Returns:
        The text for inside the code.
    """
    return for_terminal(s).replace("`", "'")


_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_chars(s: str) -> str:
    """Remove every character XML 1.0 does not allow anywhere in a document (C0 controls
    other than tab, newline and CR; surrogates; U+FFFE and U+FFFF). Markup is left as it
    is: use on a whole document whose text is already escaped.

    Args:
        s: the text.

    Returns:
        The text without invalid characters.
    """
    return _XML_INVALID.sub("", s)


def for_xml(s: Any) -> str:
    """A telemetry string to put in XML 1.0 text or a quoted attribute (SVG).

    Args:
        s: the value.

    Returns:
        Text without invalid characters, with ``& < > " '`` escaped.
    """
    return html.escape(xml_chars(s if isinstance(s, str) else str(s)), quote=True)


_CSV_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def for_csv_cell(s: Any) -> str:
    """A telemetry string to put in a CSV cell that a spreadsheet may open.

    A cell starting with ``=``, ``+``, ``-``, ``@``, tab or carriage return is read as a
    formula by Excel, LibreOffice and Google Sheets; it gets a leading ``'`` (OWASP CSV
    injection), which they show as text. Quoting is left to the CSV writer.

    Args:
        s: the value (a name: numbers are written by the exporter as numbers).

    Returns:
        The cell text.
    """
    text = s if isinstance(s, str) else str(s)
    return "'" + text if text.startswith(_CSV_FORMULA) else text


_NAME_BAD = re.compile(r"[^A-Za-z0-9._-]+")
FILENAME_MAX = 80
"""Longest file-name component `for_filename` returns."""


def for_filename(s: Any, *, default: str = "run", max_len: int = FILENAME_MAX) -> str:
    """A telemetry string as one file or folder name, inside the folder it is joined to.

    Only ``A-Z a-z 0-9 . _ -`` are kept (each run of anything else is ``_``: no ``/``,
    ``\\``, ``%`` or control character survives); runs of dots become ``_`` (never
    ``..``); a leading dot or dash becomes ``_`` (no hidden file, no option-like name);
    the result is cut to ``max_len`` and is never empty.

    Args:
        s: the value (a run id, a job name).
        default: the name when nothing is left.
        max_len: longest result.

    Returns:
        A safe name component.
    """
    text = _NAME_BAD.sub("_", s if isinstance(s, str) else str(s))
    text = re.sub(r"\.{2,}", "_", text)
    text = re.sub(r"^[.-]", "_", text)[: max(int(max_len), 1)]
    return text if text.strip("_") else default


def clean_data(value: Any) -> Any:
    """`for_terminal` on every string (keys included) of nested plain data (a manifest).

    Args:
        value: mappings, lists, tuples and scalars.

    Returns:
        The same shape with clean strings; other scalars unchanged.
    """
    if isinstance(value, str):
        return for_terminal(value)
    if isinstance(value, Mapping):
        return {
            for_terminal(k) if isinstance(k, str) else k: clean_data(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [clean_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clean_data(v) for v in value)
    return value


def _names(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(for_terminal(n) for n in names)


def _keys(columns: Mapping[str, Any]) -> dict[str, Any]:
    return {for_terminal(k): v for k, v in columns.items()}


def clean_window(window: Any) -> Any:
    """A `Window` whose display strings are `for_terminal`-clean: what the readers show.

    Cleaned: ``job``, ``scope``, host / rack / NIC names, group names, phase names and
    the manifest. Kept: ``run`` and ``parent_run`` (keys into the store, shown through
    `for_terminal` where they are drawn) and every array. A window with nothing to clean
    is returned as it is, so the common case copies nothing.

    Args:
        window: a `rankscope.diagnosis.window.Window` (None passes through).

    Returns:
        The clean window.
    """
    if window is None:
        return None
    ranks = window.ranks
    strings = [window.job, window.scope, *ranks.hosts, *ranks.racks, *ranks.nics]
    strings += [g.name for g in window.groups.values()]
    strings += list(window.phase_ns) + list(window.phase_cpu_ns)
    manifest = clean_data(window.manifest)
    if all(for_terminal(s) == s for s in strings) and manifest == window.manifest:
        return window
    clean_ranks = dataclasses.replace(
        ranks, hosts=_names(ranks.hosts), racks=_names(ranks.racks), nics=_names(ranks.nics)
    )
    groups = {
        gid: dataclasses.replace(g, name=for_terminal(g.name)) for gid, g in window.groups.items()
    }
    return dataclasses.replace(
        window,
        job=for_terminal(window.job),
        scope=for_terminal(window.scope),
        manifest=manifest,
        ranks=clean_ranks,
        groups=groups,
        phase_ns=_keys(window.phase_ns),
        phase_cpu_ns=_keys(window.phase_cpu_ns),
    )
