"""The experiment form: write the hypothesis, the one change, the predicted movement of one
metric and the rejection condition *before* the run; afterwards judge it against the run
on screen and show the verdict (supported / rejected / improved through another
mechanism) and whether the accounting closed; stage a supported one (``ctrl+t``: one node,
two nodes, the full job, with checks after each, `rankscope.tui.stage_screen`). Records
are the same JSON files as ``rankscope experiment`` writes, beside the recording."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Select, Static
from textual.widgets.option_list import Option

from rankscope.diagnosis.experiment import METRICS
from rankscope.launch.experiments import (
    ExperimentError,
    ExperimentRecord,
    evaluate_experiment,
    list_experiments,
    record_experiment,
)
from rankscope.sanitize import for_terminal, terminal_text
from rankscope.tui.rerun_context import (
    RerunContext,
    load_windows,
    parent_of,
    shown_hypotheses,
)


def result_lines(rec: ExperimentRecord) -> list[str]:
    """An evaluated record in a few lines (verdict, metric, step, accounting, notes).

    Args:
        rec: the record.

    Returns:
        Lines of text (one when not yet evaluated).
    """
    ev = rec.evaluation
    if ev is None:
        return [f"{rec.id}: recorded {rec.created}, not evaluated yet"]
    lines = [f"{rec.id}: {ev.get('verdict')}  ({rec.before_run} -> {rec.after_run})"]
    b, a, ch = ev.get("before"), ev.get("after"), ev.get("change")
    if isinstance(b, (int, float)) and isinstance(a, (int, float)):
        pct = f" ({ch:+.1%})" if isinstance(ch, (int, float)) else ""
        lines.append(f"  {rec.metric} predicted {rec.direction}: {b:.4g} -> {a:.4g}{pct}")
    sb, sa = ev.get("step_before") or {}, ev.get("step_after") or {}
    if sb.get("p50") is not None and sa.get("p50") is not None:
        lines.append(
            f"  step p50 {sb['p50'] / 1e6:.1f} -> {sa['p50'] / 1e6:.1f} ms, "
            f"p90 {sb['p90'] / 1e6:.1f} -> {sa['p90'] / 1e6:.1f} ms"
        )
    lines.append(f"  accounting closed: {'yes' if ev.get('accounting_closed') else 'no'}")
    if ev.get("recorded_before_after_run") is False:
        lines.append("  warning: the prediction was written after the after-run started")
    lines += [f"  {n}" for n in ev.get("notes") or ()]
    return lines


FIELD_LABELS = {
    "hypothesis": "hypothesis",
    "change": "the one change",
    "metric": "metric that should move",
    "direction": "direction",
    "rejection": "rejected if",
}
"""Border title of each field of the form."""


class ExperimentScreen(ModalScreen[None]):
    """Record a prediction; judge recorded ones against the run on screen."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Record", tooltip="Record the prediction (before the run)"),
        Binding(
            "ctrl+t",
            "stage",
            "Stage",
            tooltip="Stage the highlighted supported experiment: one node, two nodes, full",
        ),
        Binding("escape", "close", "Close", tooltip="Close the form"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | tab | Next field. |
    | ctrl+s | Record the prediction as written (before the run). |
    | enter on a record | Judge it: before = the run it was recorded from, after = the run on screen. |
    | ctrl+t | Stage the highlighted (or last judged) supported experiment: its plan, then `y`. |
    | escape | Close. |
    """

    DEFAULT_CSS = """
    ExperimentScreen { align: center middle; }
    ExperimentScreen > Vertical {
        width: 110; max-width: 98%; height: 90%;
        border: thick $primary; background: $surface; padding: 0 1;
    }
    ExperimentScreen .title { text-style: bold; height: 1; }
    ExperimentScreen Input { height: 3; }
    ExperimentScreen Horizontal { height: 3; }
    ExperimentScreen Select { width: 1fr; }
    ExperimentScreen #records { height: 1fr; }
    ExperimentScreen #result { height: auto; max-height: 12; }
    """

    class Suggested(Message):
        """The diagnosis' next experiment for the top hypothesis, to prefill the form."""

        def __init__(self, hypothesis: str, change: str, metric: str, direction: str, rejects: str):
            super().__init__()
            self.values = {
                "hypothesis": hypothesis,
                "change": change,
                "metric": metric,
                "direction": direction,
                "rejection": rejects,
            }

    class Evaluated(Message):
        """An evaluation came back from the worker."""

        def __init__(self, record: ExperimentRecord | None, error: str = "") -> None:
            super().__init__()
            self.record = record
            self.error = error

    def __init__(self, context: RerunContext) -> None:
        super().__init__()
        self.context = context
        self.evaluating = False
        self.suggested = False
        """The form was prefilled from the diagnosis."""
        self.suggestion_settled = False
        """The verdict on screen was read (it may have had nothing to suggest)."""
        self.last_result: ExperimentRecord | None = None

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Experiment: one change, one predicted movement", classes="title")
            # Focus keeps the cursor where it is: a prefilled text shows from its start.
            yield Input(
                placeholder="hypothesis (mechanism)", id="hypothesis", select_on_focus=False
            )
            yield Input(placeholder="the one change", id="change", select_on_focus=False)
            with Horizontal():
                yield Select(
                    [(m, m) for m in sorted(METRICS)],
                    value="step_time",
                    allow_blank=False,
                    id="metric",
                )
                yield Select(
                    [("goes down", "down"), ("goes up", "up")],
                    value="down",
                    allow_blank=False,
                    id="direction",
                )
            yield Input(placeholder="rejected if…", id="rejection", select_on_focus=False)
            yield Static(
                "Recorded · enter: judge against the run on screen · ctrl+t: stage",
                classes="title",
            )
            yield OptionList(id="records")
            yield Static(id="result")

    def on_mount(self) -> None:
        # Placeholders vanish once a field is filled: the border keeps naming it.
        for wid, label in FIELD_LABELS.items():
            field = self.query_one(f"#{wid}")
            if isinstance(field, Select):  # its border is drawn by the part showing the value
                field = field.query_one("SelectCurrent")
            field.border_title = label
        self._reload()
        if self.context.record is None:
            self._say(
                "no recording: experiments are kept beside one (start the view with "
                "--record DIR); the form can be read but not recorded",
                "yellow",
            )
        self.query_one("#change", Input).focus()
        run = parent_of(self.app)
        if self._suggest_from(shown_hypotheses(self.app, run) if run is not None else None):
            return
        if getattr(self.app, "diagnosing", False) and _on_screen(self.app) == run:
            return  # the pass under way is of this run: `show_analysis` takes it
        self._suggest_worker()

    def _suggest_from(self, hypotheses: tuple[Any, ...] | None) -> bool:
        """Prefill from the verdict's hypotheses; False when there are none to read."""
        if hypotheses is None:
            return False
        self.suggestion_settled = True
        suggestion = suggestion_of(hypotheses)
        if suggestion is not None:
            self.post_message(self.Suggested(*suggestion))
        return True

    def show_analysis(self, analysis: Any) -> None:
        """A diagnosis pass finished while the form is open (the app routes it here)."""
        if self.suggestion_settled:
            return
        run = parent_of(self.app)
        if run is None or not self._suggest_from(shown_hypotheses(self.app, run)):
            self._suggest_worker()

    @work(thread=True, group="experiment-suggest", exclusive=True, exit_on_error=False)
    def _suggest_worker(self) -> None:
        suggestion = suggest(self.app, self.context)
        if suggestion is not None:
            self.post_message(self.Suggested(*suggestion))

    def on_experiment_screen_suggested(self, message: Suggested) -> None:
        # Fill only what the user has not typed yet.
        for wid in ("hypothesis", "change", "rejection"):
            field = self.query_one(f"#{wid}", Input)
            if not field.value:
                field.value = message.values[wid]
                field.cursor_position = 0  # show the beginning of a long text
        if message.values["metric"] in METRICS:
            self.query_one("#metric", Select).value = message.values["metric"]
        if message.values["direction"] in ("down", "up"):
            self.query_one("#direction", Select).value = message.values["direction"]
        self.suggested = True

    def _reload(self) -> None:
        ol = self.query_one("#records", OptionList)
        ol.clear_options()
        if self.context.record is None:
            return
        records = list_experiments(self.context.record)
        for rec in records:
            label = f"{rec.id}  [{rec.status}]  {rec.hypothesis}: {rec.metric} {rec.direction}"
            ol.add_option(Option(Text(for_terminal(label)), id=rec.id))  # no markup
        if not records:
            ol.add_option(
                Option(
                    Text("none yet: ctrl+s records the prediction above", style="dim italic"),
                    disabled=True,
                )
            )

    def _say(self, text: str, style: str = "") -> None:
        # Results name runs and quote records read from the recording folder.
        self.query_one("#result", Static).update(Text(terminal_text(text), style=style))

    def action_save(self) -> None:
        """Record the prediction as written."""
        if self.context.record is None:
            self._say("no recording to store the experiment beside", "bold red")
            return

        def value(wid: str) -> str:
            return str(self.query_one(f"#{wid}", Input).value)

        try:
            rec = record_experiment(
                self.context.record,
                hypothesis=value("hypothesis"),
                change=value("change"),
                metric=str(self.query_one("#metric", Select).value),
                direction=str(self.query_one("#direction", Select).value),
                rejection=value("rejection"),
                parent_run=parent_of(self.app),
            )
        except ExperimentError as exc:
            self._say(str(exc), "bold red")
            return
        self._reload()
        self._say(f"recorded {rec.id} before the run: {rec.metric} should go {rec.direction}")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if self.evaluating or event.option.id is None:
            return
        model = getattr(self.app, "model", None)
        window = getattr(model, "window", None)
        after = window.run if window is not None else getattr(self.app, "run_id", None)
        self.evaluating = True
        self._say(f"judging {event.option.id} against {after}…", "italic")
        self._worker(str(event.option.id), after)

    @work(thread=True, group="experiment", exit_on_error=False)
    def _worker(self, exp_id: str, after: str | None) -> None:
        self.post_message(self.Evaluated(*judge(self.app, self.context, exp_id, after)))

    def on_experiment_screen_evaluated(self, message: Evaluated) -> None:
        self.evaluating = False
        if message.record is None:
            self._say(message.error, "bold red")
            return
        self.last_result = message.record
        self._reload()
        self._say("\n".join(result_lines(message.record)))

    def action_stage(self) -> None:
        """Open the staging of the highlighted record (else the one judged last)."""
        from rankscope.launch.experiments import load_experiment
        from rankscope.tui.stage_screen import StageScreen

        if self.context.record is None:
            self._say("no recording holds the experiment records", "bold red")
            return
        ol = self.query_one("#records", OptionList)
        exp_id = None
        if ol.highlighted is not None:
            exp_id = ol.get_option_at_index(ol.highlighted).id
        if exp_id is None and self.last_result is not None:
            exp_id = self.last_result.id
        if exp_id is None:
            self._say("highlight a supported record to stage (up/down in the list)", "yellow")
            return
        try:
            rec = load_experiment(self.context.record, exp_id)
        except ExperimentError as exc:
            self._say(str(exc), "bold red")
            return
        if rec.status != "supported":
            self._say(
                f"{rec.id} is {rec.status}: only a supported change is staged "
                "(enter judges it against the run on screen)",
                "yellow",
            )
            return
        self.app.push_screen(StageScreen(self.context, rec))

    def action_close(self) -> None:
        """Close the form."""
        self.dismiss(None)


def judge(
    app: Any, ctx: RerunContext, exp_id: str, after: str | None
) -> tuple[ExperimentRecord | None, str]:
    """Evaluate one record: before = the run it was recorded from, after = ``after``.

    Args:
        app: the app (its source).
        ctx: where to read runs and records.
        exp_id: the record id.
        after: the run with the change.

    Returns:
        ``(record, "")`` or ``(None, why)``.
    """
    from rankscope.launch.experiments import load_experiment

    if ctx.record is None:
        return None, "no recording holds the experiment records"
    try:
        rec = load_experiment(ctx.record, exp_id)
        before = rec.parent_run
        if before is None or after is None or before == after:
            return None, "show the run with the change first (e.g. follow a rerun), then judge"
        windows = load_windows(app, ctx, [before, after])
        if before not in windows or after not in windows:
            return None, f"no steps yet for {before if before not in windows else after}"
        return evaluate_experiment(ctx.record, exp_id, windows[before], windows[after]), ""
    except ExperimentError as exc:
        return None, str(exc)


def suggestion_of(hypotheses: tuple[Any, ...]) -> tuple[str, str, str, str, str] | None:
    """The next experiment of the most likely mechanism that is not ``healthy``.

    Args:
        hypotheses: ``rankscope.diagnosis.verdict.Hypothesis`` in the verdict's order.

    Returns:
        ``(hypothesis, change, metric, direction, rejects)``, or None for a healthy run.
    """
    top = next((h for h in hypotheses if h.mechanism != "healthy"), None)
    if top is None:
        return None
    nxt = top.next_experiment
    return top.mechanism, nxt.change, nxt.metric, nxt.direction, nxt.rejects


def _on_screen(app: Any) -> str | None:
    window = getattr(getattr(app, "model", None), "window", None)
    return window.run if window is not None else None


def suggest(app: Any, ctx: RerunContext) -> tuple[str, str, str, str, str] | None:
    """The diagnosis' next experiment for the top hypothesis of the run on screen: the
    verdict on screen when it is of that run, else a diagnosis of the run's window (the
    run on screen is a rerun and the experiment is about its parent).

    Args:
        app: the app.
        ctx: where to read the run.

    Returns:
        ``(hypothesis, change, metric, direction, rejects)``, or None for a healthy run or
        a run without steps.
    """
    from rankscope.diagnosis.engine import diagnose

    run = parent_of(app)
    if run is None:
        return None
    hypotheses = shown_hypotheses(app, run)
    if hypotheses is None:
        window = load_windows(app, ctx, [run]).get(run)
        if window is None:
            return None
        hypotheses = diagnose(window).verdict.hypotheses
    return suggestion_of(hypotheses)


def open_experiments(app: Any) -> None:
    """Open the experiment form, prefilled from the diagnosis' next experiment.

    Args:
        app: the running `RankscopeApp`.
    """
    app.push_screen(ExperimentScreen(RerunContext.from_app(app)))
