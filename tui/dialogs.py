"""Modal dialogs: choose the baseline run, filter ranks, and the key help."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from rankscope.sanitize import for_terminal
from rankscope.tui.sources import RunEntry

NO_BASELINE = ""
"""What `BaselinePicker` returns to clear the baseline (None means cancelled)."""

DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{
    width: 72; max-width: 95%; height: auto; max-height: 90%;
    border: thick $primary; background: $surface; padding: 0 1;
}}
{name} .title {{ text-style: bold; height: 1; }}
{name} .hint {{ color: $text-muted; height: auto; }}
"""


class BaselinePicker(ModalScreen[str | None]):
    """Pick the healthy run to compare against. Dismisses with the run id, `NO_BASELINE`
    to clear, or None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", tooltip="Close the dialog, changing nothing"),
        Binding("enter", "select", "Choose", show=False, tooltip="Choose the highlighted run"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | up, down | Move in the run list. |
    | enter | Use the highlighted run as the baseline. |
    | escape | Close without changing the baseline. |
    """

    DEFAULT_CSS = DIALOG_CSS.format(name="BaselinePicker")

    def __init__(self, runs: Sequence[RunEntry], current: str | None, baseline: str | None):
        super().__init__()
        self.runs = [r for r in runs if r.run != current]
        self.baseline = baseline

    def compose(self) -> ComposeResult:
        options = [Option(Text("(no baseline)", style="italic"), id="\0none")]
        for r in self.runs:
            label = Text()
            label.append(for_terminal(r.run), style="bold")
            label.append(f"  {r.job} · {r.scope} · {r.world_size} ranks · {r.steps} steps")
            if r.parent_run:
                label.append(f" · rerun of {for_terminal(r.parent_run)}", style="dim")
            if r.run == self.baseline:
                label.append("  (current baseline)", style="yellow")
            options.append(Option(label, id=r.run))
        with Vertical():
            yield Static("Baseline run", classes="title")
            yield OptionList(*options, id="runs")
            hint = "The healthy run the header, decomposition and manifest compare against."
            if not self.runs:
                hint += (
                    " No other run here yet: a run that reports to this hub (or is in this "
                    "recording) appears in this list."
                )
            yield Static(hint, classes="hint")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        ids = ["\0none", *[r.run for r in self.runs]]
        ol.highlighted = ids.index(self.baseline) if self.baseline in ids else 0
        ol.focus()

    def action_select(self) -> None:
        """Choose the highlighted run."""
        self.query_one(OptionList).action_select()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        option_id = event.option.id
        self.dismiss(NO_BASELINE if option_id in (None, "\0none") else option_id)

    def action_cancel(self) -> None:
        """Close without a change."""
        self.dismiss(None)


class FilterDialog(ModalScreen[str | None]):
    """Ask for a rank/host filter. Dismisses with the text (empty clears), or None when
    cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", tooltip="Close the dialog, changing nothing"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | enter | Apply the filter (empty shows every rank). |
    | escape | Close without changing the filter. |
    """

    DEFAULT_CSS = DIALOG_CSS.format(name="FilterDialog")

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Filter ranks / hosts", classes="title")
            yield Input(value=self.current, placeholder="12, 8-15, node0003", id="filter")
            yield Static(
                "Comma-separated: a rank (12 or r12), a range (8-15), or text matched "
                "against host and rack names. Pinned ranks always stay.",
                classes="hint",
            )

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        """Close without a change."""
        self.dismiss(None)


HELP_BINDING = Binding("question_mark", "app.help", "Help", tooltip="Every key of every screen")
"""``?`` on a screen of its own, first in its bindings, so the footer starts with it."""


KEY_NAMES = {
    "escape": "esc",
    "question_mark": "?",
    "slash": "/",
    "up": "↑",
    "down": "↓",
    "pageup": "pgup",
    "pagedown": "pgdn",
    "ctrl+s": "ctrl+s",
    "space": "space",
    "enter": "enter",
}
"""How keys are named in the help (anything else is shown as bound)."""


def key_rows(sections: Iterable[tuple[str, Sequence[BindingType]]]) -> list[tuple[str, str, str]]:
    """Flatten binding lists into ``(section, keys, description)`` rows.

    Args:
        sections: ``(title, BINDINGS)`` pairs.

    Returns:
        One row per binding; keys joined by ", ", the description is the binding's
        tooltip (or its short description).
    """
    rows = []
    for title, bindings in sections:
        for b in bindings:
            if not isinstance(b, Binding):
                b = Binding(*b)
            if b.action == HELP_BINDING.action:
                continue  # a screen's own `?`, listed once under "Everywhere"
            keys = ", ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in b.key.split(","))
            rows.append((title, keys, b.tooltip or b.description))
    return rows


KEY_WIDTH = 14
"""Cells of the help's key column."""


class HelpScreen(ModalScreen[None]):
    """Every key of every screen, generated from their bindings, in a list that scrolls
    with the keyboard."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,question_mark,q", "close", "Close", tooltip="Close the help"),
        Binding("down,j", "scroll(1)", "Down", show=False, tooltip="Scroll down a line"),
        Binding("up,k", "scroll(-1)", "Up", show=False, tooltip="Scroll up a line"),
        Binding("pagedown,space", "page(1)", "Page down", show=False, tooltip="Scroll a page"),
        Binding("pageup", "page(-1)", "Page up", show=False, tooltip="Scroll back a page"),
        Binding("home,g", "edge(0)", "Top", show=False, tooltip="The first key"),
        Binding("end,G", "edge(1)", "Bottom", show=False, tooltip="The last key"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | escape, ?, q | Close the help. |
    | down, j / up, k | Scroll a line. |
    | pagedown, space / pageup | Scroll a page. |
    | home, g / end, G | The first / the last key. |
    """

    DEFAULT_CSS = (
        DIALOG_CSS.format(name="HelpScreen")
        + """
        HelpScreen > Vertical { width: 84; height: 90%; max-height: 100%; }
        HelpScreen VerticalScroll { height: 1fr; scrollbar-size-vertical: 1; }
        HelpScreen .hint { height: 1; }
        """
    )

    def __init__(self, sections: Sequence[tuple[str, Sequence[BindingType]]]) -> None:
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        # One table per section, all with the same key column, so the descriptions line
        # up and wrap under themselves.
        parts: list[Text | Table] = []
        table: Table | None = None
        last = None
        for section, keys, desc in key_rows(self.sections):
            if section != last:
                if last is not None:
                    parts.append(Text(""))
                parts.append(Text(section, style="bold underline"))
                table = Table.grid(padding=(0, 1), expand=True)
                table.add_column(width=1)
                table.add_column(style="bold cyan", no_wrap=True, width=KEY_WIDTH)
                table.add_column(ratio=1)
                parts.append(table)
                last = section
            assert table is not None
            table.add_row("", keys, desc)
        with Vertical():
            yield Static("Keys", classes="title")
            yield Static(
                Text("↑↓ j k  pgup pgdn  home end: scroll · esc: close", style="dim"),
                classes="hint",
            )
            with VerticalScroll(id="keys-scroll"):
                yield Static(Group(*parts), id="keys")

    @property
    def scroller(self) -> VerticalScroll:
        """The scrolling list of keys."""
        return self.query_one("#keys-scroll", VerticalScroll)

    def on_mount(self) -> None:
        self.scroller.focus()

    def action_scroll(self, lines: int) -> None:
        """Scroll by ``lines``."""
        self.scroller.scroll_relative(y=lines, animate=False)

    def action_page(self, direction: int) -> None:
        """Scroll by a page."""
        page = max(self.scroller.scrollable_content_region.height - 1, 1)
        self.scroller.scroll_relative(y=direction * page, animate=False)

    def action_edge(self, end: int) -> None:
        """Scroll to the first or the last key."""
        if end:
            self.scroller.scroll_end(animate=False)
        else:
            self.scroller.scroll_home(animate=False)

    def action_close(self) -> None:
        """Close the help."""
        self.dismiss(None)
