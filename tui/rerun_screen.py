"""The rerun menu: pick a scope, read the full plan, confirm, launch, follow the new run —
or run the controlled experiment the verdict on screen proposes (``s``: a shard swap, a
placement swap or a pairwise sweep, `rankscope.tui.controlled`), whose evaluation the menu
shows once it has finished.

Planning (diagnosis, plan, launcher template) and launching run in worker threads and
come back as messages; the screen only draws and takes keys. Nothing is launched without
the plan on screen and an explicit ``y``. The plan says which parts of the program come
from telemetry (script, arguments, hosts: the parent's manifest and its ranks' host names),
and ``y`` runs a script telemetry chose only when ``[rerun] allow`` of the settings lists it
(`rankscope.launch.runner.program_check`). Every line drawn is
`rankscope.sanitize.for_terminal`-clean: the plan quotes host names and run ids.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Static

from rankscope.launch.runner import Launch
from rankscope.sanitize import for_terminal
from rankscope.tui.abbrev import Field, fit_fields
from rankscope.tui.controlled import ControlledPlan, offers, plan_controlled
from rankscope.tui.rerun_context import (
    RerunContext,
    load_windows,
    parent_of,
    session_of,
    shown_hypotheses,
)

SCOPE_KEYS = {"one-rank": "1", "one-node": "n", "two-node": "2", "full": "f"}


@dataclass(frozen=True)
class PlanResult:
    """A plan prepared in a worker: the launch, or why there is none."""

    scope: str
    launch: Launch | None
    lines: tuple[str, ...]
    error: str = ""
    launcher: str = ""
    """The launcher template used (the default one for the run when none was chosen)."""
    controlled: ControlledPlan | None = None
    """The controlled experiment planned (``s``), instead of a scope rerun."""


class RerunScreen(ModalScreen[str | None]):
    """Propose a reduced-scope rerun of the run on screen. Dismisses with the new run's id
    once launched (the app then follows it), or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "scope('one-rank')", "One rank", tooltip="Plan a rerun on the slowest rank"),
        Binding("n", "scope('one-node')", "One node", tooltip="Plan a rerun on the suspect node"),
        Binding("2", "scope('two-node')", "Two nodes", tooltip="Suspect node with a peer"),
        Binding("f", "scope('full')", "Full", tooltip="Plan a full-scale rerun"),
        Binding(
            "s",
            "controlled",
            "Swap/sweep",
            tooltip="Plan the controlled experiment the verdict proposes (swap shards, swap "
            "placement, pairwise sweep); again: the next hypothesis' one",
        ),
        Binding("l", "launcher", "Launcher", tooltip="Next launcher template"),
        Binding("y", "launch", "Launch", tooltip="Launch the plan on screen"),
        Binding("x", "cancel_rerun", "Cancel rerun", tooltip="Stop the rerun started last"),
        Binding("escape", "close", "Close", tooltip="Close the menu (reruns keep running)"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | 1 | Plan a one-rank rerun (the slowest rank's device). |
    | n | Plan a one-node rerun (the suspect node). |
    | 2 | Plan a two-node rerun (the suspect with a healthy peer, or across the rail). |
    | f | Plan a full-scale rerun. |
    | s | Plan the verdict's controlled experiment: swap shards, swap placement or a pairwise sweep; `y` runs it and the menu shows its evaluation. |
    | l | Next launcher template (torchrun, slurm, simulated, yours). |
    | y | Launch the plan on screen; the view then follows the new run. |
    | x | Cancel the rerun started last from this session. |
    | escape | Close the menu; running reruns keep running. |
    """

    DEFAULT_CSS = """
    RerunScreen { align: center middle; }
    RerunScreen > Vertical {
        width: 110; max-width: 98%; height: 90%;
        border: thick $primary; background: $surface; padding: 0 1;
    }
    RerunScreen #title { text-style: bold; height: 1; }
    RerunScreen #plan { height: 1fr; scrollbar-gutter: stable; }
    RerunScreen #status { height: auto; color: $text-muted; }
    """

    class Planned(Message):
        """A plan came back from the worker."""

        def __init__(self, result: PlanResult) -> None:
            super().__init__()
            self.result = result

    def __init__(self, context: RerunContext) -> None:
        super().__init__()
        self.context = context
        self.result: PlanResult | None = None
        self.planning = False
        self.offer_index = -1
        """Which of the verdict's controlled experiments ``s`` planned last."""
        self.experimenting = False
        """A controlled experiment launched from this menu is running or being judged."""
        self.outcome: tuple[str, ...] | None = None
        """The evaluation of the controlled experiment, once it has finished."""
        self.intro: list[str] = []
        """What the menu offers, shown until a plan replaces it."""

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(id="title")
            with VerticalScroll(id="plan"):
                yield Static(id="body")
            yield Static(id="status")

    def on_mount(self) -> None:
        self._title()
        run = parent_of(self.app)
        offered = offers(shown_hypotheses(self.app, run) if run is not None else None)
        swap = f"s {offered[0].label}" if offered else "s swap/sweep"
        self.intro = [
            f"Reruns of {run or 'the run on screen'}: the plan is shown first, y launches it.",
            "  1 one-rank · n one-node · 2 two-node · f full",
            "",
        ]
        if offered:
            self.intro.append(
                "Controlled experiments the verdict proposes, by hypothesis "
                "(s plans the first, s again the next):"
            )
            width = max(len(o.label) for o in offered)
            self.intro += [f"  {o.label:<{width}}  {o.mechanism}" for o in offered]
        else:
            self.intro.append(
                "s: the controlled experiment (swap shards, swap placement, pairwise sweep) "
                "the verdict proposes, once it has one"
            )
        self._show_body()
        self._status(
            f"1 one-rank · n one-node · 2 two-node · f full · {swap} · l launcher · y launch "
            "· esc close"
        )

    def _title(self) -> None:
        ctx = self.context
        hub = ctx.hub or "no hub: plans only"
        launcher = ctx.launcher or "default for the run"
        widget = self.query_one("#title", Static)
        # At 80 columns the hub, then the launcher, give way to the run's name.
        fields = [
            Field(Text(f"Rerun {for_terminal(parent_of(self.app) or '?')}"), sep=""),
            Field(Text(f"launcher {launcher}"), priority=1, sep=" · "),
            Field(Text(f"hub {hub}"), priority=2, sep=" · "),
        ]
        widget.update(fit_fields(fields, widget.content_size.width))

    def on_resize(self) -> None:
        self._title()
        self._show_body()

    def _show_body(self) -> None:
        body = self.query_one("#body", Static)
        width = body.content_size.width
        lines: list[str] = []
        shown = list(self.result.lines) if self.result is not None else self.intro
        if self.outcome is not None:
            shown = ["result:", *(f"  {line}" for line in self.outcome), "", *shown]
        for line in map(for_terminal, shown):
            if width <= 0 or len(line) <= width:
                lines.append(line)
                continue
            # Continuations hang under their own line's text, so the plan's structure
            # (hosts, keeps, changes, each command) still reads at 80 columns.
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            lines += textwrap.wrap(
                line, width, subsequent_indent=indent, break_on_hyphens=False
            ) or [line]
        body.update(Text("\n".join(lines)))

    def _status(self, text: str, style: str = "") -> None:
        self.query_one("#status", Static).update(Text(for_terminal(text), style=style))

    def action_scope(self, scope: str) -> None:
        """Plan a rerun at ``scope`` (in a worker)."""
        if self.planning or self.experimenting:
            return
        self.planning = True
        self._status(f"planning a {scope} rerun…", "italic")
        self._plan_worker(scope, self.context)

    @work(thread=True, group="rerun-plan", exit_on_error=False)
    def _plan_worker(self, scope: str, ctx: RerunContext) -> None:
        self.post_message(self.Planned(plan_rerun(self.app, ctx, scope)))

    def action_controlled(self, again: bool = True) -> None:
        """Plan the verdict's controlled experiment (in a worker); pressed again, the next
        hypothesis' one."""
        if self.planning or self.experimenting:
            return
        self.planning = True
        if again or self.offer_index < 0:
            self.offer_index += 1
        self._status("planning the controlled experiment…", "italic")
        self._controlled_worker(self.offer_index, self.context)

    @work(thread=True, group="rerun-plan", exit_on_error=False)
    def _controlled_worker(self, index: int, ctx: RerunContext) -> None:
        try:
            got = plan_controlled(self.app, ctx, index)
        except Exception as exc:  # the menu must outlive a bad run
            got = f"cannot plan: {type(exc).__name__}: {exc}"
        if isinstance(got, str):
            result = PlanResult("controlled", None, (), got)
        else:
            result = PlanResult(
                got.offer.label, got.launch, got.lines, got.error, got.launcher, got
            )
        self.post_message(self.Planned(result))

    def on_rerun_screen_planned(self, message: Planned) -> None:
        self.planning = False
        self.result = message.result
        if message.result.launcher and message.result.launcher != self.context.launcher:
            c = self.context
            self.context = RerunContext(
                c.hub, c.record, message.result.launcher, c.launcher_dirs, c.last
            )
            self._title()
        self.outcome = None
        self._show_body()
        if message.result.error:
            self._status(message.result.error, "bold red")
        elif message.result.controlled is not None:
            what = message.result.scope
            self._status(f"y: run this {what}; its evaluation shows here · esc: close", "bold")
        else:
            self._status(f"y: launch this {message.result.scope} rerun · esc: close", "bold")

    def action_launcher(self) -> None:
        """Use the next launcher template and re-plan the scope on screen."""
        from rankscope.launch.templates import list_launchers

        names = list(list_launchers(self.context.launcher_dirs))
        if not names:
            return
        i = names.index(self.context.launcher) if self.context.launcher in names else -1
        c = self.context
        nxt = names[(i + 1) % len(names)]
        self.context = RerunContext(c.hub, c.record, nxt, c.launcher_dirs, c.last)
        self._title()
        if self.result is not None and self.result.controlled is not None:
            self.action_controlled(again=False)
        elif self.result is not None and self.result.scope in SCOPE_KEYS:
            self.action_scope(self.result.scope)

    def action_launch(self) -> None:
        """Launch the plan on screen, then close and follow the new run."""
        from rankscope.launch.runner import program_check, start

        res = self.result
        if self.experimenting:
            self._status("the controlled experiment is still running", "yellow")
            return
        if res is not None and res.controlled is not None and res.controlled.sweep_argv:
            self._start_sweep(res.controlled)
            return
        if res is None or res.launch is None:
            self._status("nothing to launch: plan a scope first (1, n, 2, f, s)", "yellow")
            return
        settings = getattr(self.app, "settings", None)
        allow = settings.rerun.allow if settings is not None else ()
        refused = program_check(res.launch, allow, cli=False)
        if refused is not None:
            self._status(refused, "bold red")
            return
        try:
            running = start(res.launch)
        except (OSError, RuntimeError) as exc:
            self._status(f"launch failed: {exc}", "bold red")
            return
        session_of(self.app).running[running.run] = running
        note = for_terminal(f"launched {running.run}; log {res.launch.log}")
        self.app.notify(note, timeout=5, markup=False)
        if res.controlled is not None:
            # The menu stays on the plan until the swap has been judged.
            self.experimenting = True
            self._status(
                f"running {running.run}; the swap is judged once its steps have arrived "
                "(x cancels, esc closes: the verdict then comes as a notification)",
                "italic",
            )
            self._evaluate_worker(res.controlled, running)
            return
        self.dismiss(running.run)

    def _start_sweep(self, plan: ControlledPlan) -> None:
        self.experimenting = True
        self._status(f"running the sweep {plan.sweep_run}…", "italic")
        self._sweep_worker(plan)

    @work(thread=True, group="controlled", exit_on_error=False)
    def _sweep_worker(self, plan: ControlledPlan) -> None:
        from rankscope.tui.controlled import run_sweep

        record = self.context.record
        try:
            lines = run_sweep(plan, record) if record is not None else ["no recording"]
        except Exception as exc:  # the menu must outlive a bad sweep
            lines = [f"sweep failed: {type(exc).__name__}: {exc}"]
        self._finish_from_thread(lines)

    @work(thread=True, group="controlled", exit_on_error=False)
    def _evaluate_worker(self, plan: ControlledPlan, running: Any) -> None:
        from rankscope.tui.controlled import evaluate_rerun

        try:
            lines = evaluate_rerun(self.app, self.context, plan, running)
        except Exception as exc:  # the menu must outlive a bad rerun
            lines = [f"cannot judge the swap: {type(exc).__name__}: {exc}"]
        self._finish_from_thread(lines)

    def _finish_from_thread(self, lines: list[str]) -> None:
        try:
            self.app.call_from_thread(self._finished, tuple(lines))
        except RuntimeError:
            pass  # the app has closed

    def _finished(self, lines: tuple[str, ...]) -> None:
        """The controlled experiment's evaluation came back (on the event loop)."""
        self.experimenting = False
        self.outcome = lines
        head = lines[0] if lines else "finished"
        self.app.notify(for_terminal(head), title="controlled experiment", markup=False)
        if not self.is_attached:
            return  # the menu was closed meanwhile: the notification carries it
        self._show_body()
        self.query_one("#plan", VerticalScroll).scroll_home(animate=False)
        self._status(f"{head} · esc: close", "bold")

    def action_cancel_rerun(self) -> None:
        """Cancel the rerun started last from this session."""
        active = session_of(self.app).active()
        if not active:
            self._status("no rerun is running", "yellow")
            return
        r = active[-1]
        r.cancel(grace_s=2.0)
        self._status(f"cancelled {r.run}", "bold")

    def action_close(self) -> None:
        """Close without launching."""
        self.dismiss(None)


def plan_rerun(app: Any, ctx: RerunContext, scope: str) -> PlanResult:
    """Propose a rerun of the run on screen at ``scope`` from its verdict (the one on
    screen, else a fresh diagnosis) and render its command.

    Args:
        app: the app (its source and the run on screen).
        ctx: hub, recording, launcher.
        scope: one of the ladder scopes.

    Returns:
        The plan, its launch and its text; ``error`` says what failed.
    """
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.plan import propose
    from rankscope.launch.report import launch_text, plan_text
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.safety import UnsafeValueError
    from rankscope.launch.templates import TemplateError, find_launcher

    parent = parent_of(app)
    if parent is None:
        return PlanResult(scope, None, (), "no run on screen yet")
    try:
        window = load_windows(app, ctx, [parent]).get(parent)
        if window is None:
            return PlanResult(scope, None, (), f"run {parent} has no steps yet")
        ctx = ctx.with_launcher_for(window)
        # The verdict on screen when it is of this run, so the plan acts on what it says.
        hypotheses = shown_hypotheses(app, parent)
        if hypotheses is None:
            hypotheses = diagnose(window).verdict.hypotheses
        plan = propose(window, hypotheses, scope)
        if ctx.hub is None or ctx.record is None:
            why = (
                "no hub to report to"
                if ctx.hub is None
                else "no recording to log beside (start the view with --record DIR to launch)"
            )
            text = (*plan_text(plan), *_origins(plan, ctx, window.manifest))
            return PlanResult(scope, None, text, f"{why}: shown, not launchable", ctx.launcher)
        launch = prepare(
            plan,
            find_launcher(ctx.launcher, ctx.launcher_dirs),
            LaunchSettings(hub=ctx.hub),
            record=ctx.record,
            manifest=window.manifest,
        )
    except (UnsafeValueError, TemplateError, ValueError, KeyError) as exc:
        return PlanResult(scope, None, (), f"cannot plan: {exc}", ctx.launcher)
    return PlanResult(scope, launch, tuple(launch_text(launch)), "", ctx.launcher)


def _origins(plan: Any, ctx: RerunContext, manifest: dict[str, Any]) -> list[str]:
    """Where the program of a plan that cannot be launched would come from."""
    from rankscope.launch.report import origin_lines
    from rankscope.launch.runner import LaunchSettings, launch_sources, script_from_manifest
    from rankscope.launch.templates import find_launcher

    script, args = script_from_manifest(manifest)
    template = find_launcher(ctx.launcher, ctx.launcher_dirs)
    shown = {"script": script, "args": " ".join(args), "hosts": ", ".join(plan.hosts)}
    return origin_lines(launch_sources(template, LaunchSettings(hub=""), manifest), shown)


def open_rerun_menu(app: Any) -> None:
    """Open the rerun menu on the run on screen; a launched rerun becomes the run shown.

    Args:
        app: the running `RankscopeApp`.
    """
    ctx = RerunContext.from_app(app)

    def done(run: str | None) -> None:
        if run:
            app.run_id = run
            app.notify(for_terminal(f"following {run}"), timeout=3, markup=False)

    app.push_screen(RerunScreen(ctx), done)
