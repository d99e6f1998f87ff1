"""The ladder screen: the run on screen and its reduced-scope reruns side by side — each
scope's step distribution, decomposition and verdict — and the first scope where the
regression appears, with what that eliminates (`rankscope.launch.ladder`) — and beside
the rungs the run's sweeps (``PATH/sweeps/<run>.json``, `rankscope.launch.ladder.read_sweeps`):
what each swept, what it found and its conclusion.

The ladder is computed in a worker thread (a diagnosis per rung) and redrawn when it
comes back; ``r`` recomputes it, e.g. once a rerun has finished.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from rankscope.launch.ladder import Ladder, SweepEntry
from rankscope.sanitize import for_terminal
from rankscope.tui.dialogs import HELP_BINDING
from rankscope.tui.rerun_context import RerunContext, load_windows, parent_of, session_of


class LadderScreen(Screen):
    """Rungs by scope and the first scope where the regression appears."""

    BINDINGS: ClassVar[list[BindingType]] = [
        HELP_BINDING,
        Binding("escape", "app.pop_screen", "Back", tooltip="Back to the main screen"),
        Binding("r", "refresh", "Refresh", tooltip="Recompute the ladder"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | ? | Every key of every screen. |
    | r | Recompute the ladder (after a rerun has finished). |
    | up, down, pageup, pagedown | Scroll a ladder taller than the screen. |
    | escape | Back to the main screen. |
    """

    DEFAULT_CSS = """
    LadderScreen #title { height: auto; background: $panel; padding: 0 1; text-style: bold; }
    LadderScreen #body { height: 1fr; padding: 0 1; scrollbar-gutter: stable; }
    LadderScreen #status { height: auto; padding: 0 1; color: $text-muted; }
    LadderScreen #sweeps { height: auto; margin-top: 1; }
    """

    class Built(Message):
        """A ladder (or the reason there is none) came back from the worker."""

        def __init__(
            self, ladder: Ladder | None, error: str = "", sweeps: tuple[SweepEntry, ...] = ()
        ) -> None:
            super().__init__()
            self.ladder = ladder
            self.error = error
            self.sweeps = ladder.sweeps if ladder is not None else sweeps

    def __init__(self, context: RerunContext) -> None:
        super().__init__()
        self.context = context
        self.ladder: Ladder | None = None
        self.sweeps: tuple[SweepEntry, ...] = ()
        """The parent's sweeps, shown beside the rungs (also without a rung to show)."""
        self.building = False

    def compose(self) -> ComposeResult:
        yield Static(Text("Ladder"), id="title")
        with VerticalScroll(id="body"):
            yield Static(id="table")
            yield Static(id="sweeps")
        yield Static(id="status")
        yield Footer()

    def on_mount(self) -> None:
        # Focused, so the arrows and page keys scroll a ladder taller than the screen.
        self.query_one("#body", VerticalScroll).focus()
        self.action_refresh()

    def action_refresh(self) -> None:
        """Recompute the ladder in a worker."""
        if self.building:
            return
        self.building = True
        running = session_of(self.app).active()
        note = f" · {len(running)} rerun(s) still running" if running else ""
        self.query_one("#status", Static).update(Text(f"computing the ladder…{note}"))
        self._worker(self.context)

    @work(thread=True, group="ladder", exit_on_error=False)
    def _worker(self, ctx: RerunContext) -> None:
        sweeps: tuple[SweepEntry, ...] = ()
        try:
            parent = parent_of(self.app)
            if ctx.record is not None and parent is not None:
                from rankscope.launch.ladder import read_sweeps

                sweeps = read_sweeps(ctx.record, parent)
            ladder, error = build_for_app(self.app, ctx, sweeps)
        except Exception as exc:  # the screen must outlive a bad run
            ladder, error = None, f"{type(exc).__name__}: {exc}"
        self.post_message(self.Built(ladder, error, sweeps))

    def on_ladder_screen_built(self, message: Built) -> None:
        self.building = False
        self.ladder = message.ladder
        self.sweeps = message.sweeps
        self.query_one("#sweeps", Static).update(sweeps_table(self.sweeps))
        status = self.query_one("#status", Static)
        if message.ladder is None:
            self.query_one("#table", Static).update(
                Text(for_terminal(message.error or "no ladder"), style="yellow")
            )
            status.update(Text("r: refresh · esc: back"))
            return
        lad = message.ladder
        self.query_one("#title", Static).update(Text(f"Ladder of {for_terminal(lad.parent_run)}"))
        self.show_ladder()
        running = session_of(self.app).active()
        note = f"{len(running)} rerun(s) still running · " if running else ""
        status.update(Text(f"{note}r: refresh · esc: back"))

    def show_ladder(self) -> None:
        """Draw the ladder's text to the width of the screen (no line wraps)."""
        from rankscope.launch.report import LADDER_WIDTH, ladder_text

        if self.ladder is None:
            return
        table = self.query_one("#table", Static)
        width = table.content_size.width or LADDER_WIDTH
        rows = []
        for line in map(for_terminal, ladder_text(self.ladder, width=width)):
            style = "bold" if line.startswith("first scope") else ""
            if " YES:" in line or line.endswith(" YES"):
                style = "red"
            rows.append(Text(line, style=style))
        text = Text("\n").join(rows)
        table.update(text)

    def on_resize(self) -> None:
        self.call_after_refresh(self.show_ladder)


def sweeps_table(entries: tuple[SweepEntry, ...]) -> Table | Text:
    """The sweeps beside the rungs: run, scope, what it found, its conclusion.

    Args:
        entries: the parent's sweeps (`rankscope.launch.ladder.read_sweeps`).

    Returns:
        A table that wraps its conclusions to the screen, or a line saying how to run one.
    """
    if not entries:
        return Text(
            "sweeps: none (s in the rerun menu runs the pairwise sweep a rail verdict "
            "proposes; rankscope sweep PATH --scope ... runs any)",
            style="dim",
        )
    table = Table(title="sweeps", title_justify="left", expand=True, box=None, padding=(0, 1))
    findings = [len(e.finding or "?") for e in entries]
    table.add_column("run", style="bold", overflow="fold")
    table.add_column("scope", no_wrap=True)
    # A finding is one long word (network_rail): its column never cuts it.
    table.add_column("found", ratio=2, min_width=max(findings), overflow="fold")
    table.add_column("conclusion", ratio=3)
    for e in entries:
        named = [
            f"{k} {v}" for k, v in e.found.items() if v not in (None, [], "") and k != "slow_pairs"
        ]
        found = (e.finding or "?") + (f" ({', '.join(named)})" if named else "")
        style = "" if e.finding in (None, "healthy") else "red"
        table.add_row(
            for_terminal(e.run),
            Text(for_terminal(e.scope)).append(f"\n{for_terminal(e.backend or '?')}", "dim"),
            Text(for_terminal(found), style=style),
            for_terminal(e.conclusion),
        )
    return table


def build_for_app(
    app: Any, ctx: RerunContext, sweeps: tuple[SweepEntry, ...] = ()
) -> tuple[Ladder | None, str]:
    """The ladder of the run on screen (or of its parent) and its reruns.

    Args:
        app: the app (its source and run list).
        ctx: where to read the runs.
        sweeps: the parent's sweeps, carried in the ladder beside its rungs.

    Returns:
        ``(ladder, "")`` or ``(None, why)``.
    """
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.ladder import build_ladder

    parent = parent_of(app)
    if parent is None:
        return None, "no run on screen yet"
    runs = app.source.runs()
    children = [r.run for r in runs if r.parent_run == parent]
    if not children:
        # A ladder of one rung would name the full scale as the first that regresses,
        # which says nothing about the mechanism before a smaller scope has been tried.
        return None, (
            f"no reduced-scope rerun of {parent} yet: press r on the main screen to plan one "
            "(one-rank, one-node, two-node); the ladder then puts each next to this run and "
            "names the first scope where the regression appears"
        )
    windows = load_windows(app, ctx, [parent, *children])
    if parent not in windows:
        return None, f"run {parent} has no steps yet"
    baseline_run = getattr(app, "baseline_run", None)
    baseline = None
    if baseline_run and baseline_run not in windows:
        baseline = load_windows(app, ctx, [baseline_run]).get(baseline_run)
    verdicts = {run: diagnose(w, baseline).verdict for run, w in windows.items()}
    kids = [windows[c] for c in children if c in windows]
    ladder = build_ladder(
        windows[parent], kids, baseline=baseline, verdicts=verdicts, sweeps=sweeps
    )
    return ladder, ""


def open_ladder(app: Any) -> None:
    """Open the ladder of the run on screen.

    Args:
        app: the running `RankscopeApp`.
    """
    app.push_screen(LadderScreen(RerunContext.from_app(app)))
