"""The staging screen: a supported experiment's change applied at one node, two nodes,
then the full job (`rankscope.tui.staging`). The plan — each stage's hosts, reference and
commands, and the same staging as a command line — is shown first; ``y`` runs it, each
stage's checks appear as they complete, and a failing check ends with the rollback line.
"""

from __future__ import annotations

import textwrap
from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from rankscope.launch.experiments import ExperimentRecord
from rankscope.sanitize import for_terminal
from rankscope.tui.rerun_context import RerunContext
from rankscope.tui.staging import StagingPlan, plan_staging


class StageScreen(ModalScreen[None]):
    """Plan, confirm and follow the staged scale-up of one supported experiment."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "launch", "Run stages", tooltip="Run the stages on screen, in order"),
        Binding("escape", "close", "Close", tooltip="Close (running stages keep running)"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | tab | The change field: how each stage applies it (enter: plan again). |
    | y | Run the stages; each stage's checks show as they complete. |
    | escape | Close; stages already running keep running. |
    """

    DEFAULT_CSS = """
    StageScreen { align: center middle; }
    StageScreen > Vertical {
        width: 110; max-width: 98%; height: 90%;
        border: thick $primary; background: $surface; padding: 0 1;
    }
    StageScreen #title { text-style: bold; height: 1; }
    StageScreen Input { height: 3; }
    StageScreen #plan { height: 1fr; scrollbar-gutter: stable; }
    StageScreen #status { height: auto; color: $text-muted; }
    """

    def __init__(self, context: RerunContext, record: ExperimentRecord) -> None:
        super().__init__()
        self.context = context
        self.record = record
        self.plan: StagingPlan | None = None
        self.planning = False
        self.running = False
        self.lines: list[str] = []
        """What the plan area shows: the plan, then each stage's results."""
        self.attempt: dict[str, Any] | None = None
        """The finished attempt (``run_stages``' plain data)."""

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(id="title")
            yield Input(
                placeholder="the change each stage applies: fault=healthy, section.key=value "
                "(simulated) or the script's arguments; empty reruns the parent unchanged",
                id="apply",
                select_on_focus=False,
            )
            with VerticalScroll(id="plan"):
                yield Static(id="body")
            yield Static(id="status")

    def on_mount(self) -> None:
        rec = self.record
        self.query_one("#title", Static).update(
            Text(for_terminal(f"Stage {rec.id}: {rec.change}"), no_wrap=True, overflow="ellipsis")
        )
        self.query_one("#apply", Input).border_title = "applied as"
        self.query_one("#plan", VerticalScroll).focus()
        self._plan()

    def _status(self, text: str, style: str = "") -> None:
        self.query_one("#status", Static).update(Text(for_terminal(text), style=style))

    def _show(self) -> None:
        body = self.query_one("#body", Static)
        width = body.content_size.width
        rows: list[Text] = []
        for line in map(for_terminal, self.lines):
            style = ""
            if "FAILED" in line or line.startswith(("rollback:", "staging failed")):
                style = "bold red"
            elif line.startswith("all stages passed"):
                style = "bold green"
            pieces = [line]
            if 0 < width < len(line):
                # Continuations hang under their line's text and keep its colour.
                indent = " " * (len(line) - len(line.lstrip()) + 4)
                pieces = textwrap.wrap(
                    line, width, subsequent_indent=indent, break_on_hyphens=False
                ) or [line]
            rows += [Text(piece, style=style) for piece in pieces]
        body.update(Text("\n").join(rows))

    def on_resize(self) -> None:
        # Once the new width is laid out: the text is wrapped to it.
        self.call_after_refresh(self._reflow)

    def _reflow(self) -> None:
        self._show()
        if self.running or self.attempt is not None:
            self._to_end()  # the latest results stay in view

    def _plan(self) -> None:
        if self.planning or self.running:
            return
        self.planning = True
        self._status("planning the stages…", "italic")
        self._plan_worker(self.query_one("#apply", Input).value)

    @work(thread=True, group="stage-plan", exit_on_error=False)
    def _plan_worker(self, change: str) -> None:
        try:
            got = plan_staging(self.app, self.context, self.record, change)
        except Exception as exc:  # the screen must outlive a bad run
            got = f"cannot plan: {type(exc).__name__}: {exc}"
        self.app.call_from_thread(self._planned, got)

    def _planned(self, got: StagingPlan | str) -> None:
        self.planning = False
        if isinstance(got, str):
            self.plan = None
            self.lines = [got]
            self._show()
            self._status(got, "bold red")
            return
        self.plan = got
        self.lines = list(got.lines)
        self._show()
        if got.error:
            self._status(got.error, "bold red")
        else:
            self._status(
                f"y: run {len(got.stages)} stage(s) · tab: the change · esc: close", "bold"
            )

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one("#plan", VerticalScroll).focus()
        self._plan()

    def action_launch(self) -> None:
        """Run the stages on screen."""
        plan = self.plan
        if self.running or self.planning:
            return
        if plan is None or plan.error or not plan.stages:
            self._status("nothing to run: the plan above cannot be launched", "yellow")
            return
        self.running = True
        self.lines += ["", f"staging {self.record.id}, stop at the first failing check:"]
        self._show()
        self._status("running the stages… (esc closes; they keep running)", "italic")
        self._run_worker(plan)

    @work(thread=True, group="stage-run", exit_on_error=False)
    def _run_worker(self, plan: StagingPlan) -> None:
        from rankscope.launch.stage import stage_result_lines
        from rankscope.tui.staging import run_staging

        def progress(line: str, entry: dict[str, Any] | None) -> None:
            lines = [line] if entry is None else stage_result_lines({"results": [entry]})
            self.app.call_from_thread(self._progress, lines)

        try:
            attempt = run_staging(self.app, self.context, plan, progress)
        except Exception as exc:  # the screen must outlive a bad stage
            self.app.call_from_thread(
                self._done, None, [f"staging failed: {type(exc).__name__}: {exc}"]
            )
            return
        shown = [r for r in attempt["results"] if "reference" in r]
        # A stage whose run failed to launch is reported only in the attempt.
        tail = stage_result_lines(
            {**attempt, "results": [r for r in attempt["results"] if r not in shown]}
        )
        self.app.call_from_thread(self._done, attempt, tail)

    def _to_end(self) -> None:
        # After the body's new height has been laid out.
        scroll = self.query_one("#plan", VerticalScroll)
        self.call_after_refresh(scroll.scroll_end, animate=False)

    def _progress(self, lines: list[str]) -> None:
        self.lines += lines
        if self.is_attached:
            self._show()
            self._to_end()

    def _done(self, attempt: dict[str, Any] | None, tail: list[str]) -> None:
        self.running = False
        self.attempt = attempt
        self.lines += tail
        head = tail[-1] if tail else "staging finished"
        self.app.notify(for_terminal(head), title="staging", markup=False)
        if not self.is_attached:
            return
        self._show()
        self._to_end()
        if attempt is None:
            self._status("staging failed · esc: close", "bold red")
        elif attempt.get("passed"):
            self._status("all stages passed · esc: close", "bold green")
        else:
            self._status(
                f"stopped at {attempt.get('stopped_at')}: the {attempt.get('failed_check')} "
                "check failed (rollback above) · esc: close",
                "bold red",
            )

    def action_close(self) -> None:
        """Close the screen."""
        self.dismiss(None)
