"""``rankscope demo``: a hub and a simulated training cluster in one process.

No GPU and no torch needed: the simulated ranks emit through the real collector path to a
real hub. Interactive, it opens the TUI on the hub's live store (or, with ``--view text`` or
without a terminal, prints a summary every second); ``--headless`` writes a recording and
exits. `start_demo` is the reusable part: a view only needs its handles.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from rankscope.hub.server import Hub
from rankscope.sim import RunInfo, Scenario, ScenarioError, ScopeSpec, list_scenarios, load_scenario
from rankscope.sim import run as run_sim
from rankscope.sim.emit import default_run_id
from rankscope.sim.spec import healthy_twin

HELP = "Hub + simulated cluster + live view in one process (no GPU or torch needed)"
DEFAULT_SCENARIO = "seed-example"
DEFAULT_RANKS = 64
HEADLESS_STEPS = 20
BASELINE_STEPS = 30
"""Healthy-twin steps recorded before an interactive demo: enough for stable medians."""
INGEST_WAIT_S = 30.0
"""Longest wait, after the simulated job ends, for the hub to take in what was sent."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default=DEFAULT_SCENARIO, help="scenario name or .toml path")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"world size of the full cluster (default {DEFAULT_RANKS}; 0 = as in the scenario)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps to run (default: until Ctrl-C; {HEADLESS_STEPS} with --headless)",
    )
    p.add_argument("--seed", type=int, default=None, help="scenario seed (draws its ranges)")
    p.add_argument(
        "--pace",
        choices=("realtime", "fast"),
        default=None,
        help="realtime (default when interactive) or as fast as possible",
    )
    p.add_argument(
        "--baseline-steps",
        type=int,
        default=None,
        metavar="N",
        help=(
            "first record N steps of the scenario's healthy twin (same seed, no fault) as "
            f"the baseline to compare with (default {BASELINE_STEPS} with a view, 0 headless)"
        ),
    )
    p.add_argument("--headless", action="store_true", help="no view: record and exit")
    p.add_argument("--record", metavar="DIR", default=None, help="write a recording to DIR")
    p.add_argument("--list", action="store_true", help="list scenarios, one line each")
    p.add_argument(
        "--scope",
        default="full",
        choices=("full", "two-node", "one-node", "one-rank"),
        help="run a reduced scope of the scenario's cluster",
    )
    p.add_argument("--hosts", default="", help="hosts of a reduced scope, e.g. node003,node004")
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="one-rank scope: the full-scope rank whose GPU is kept",
    )
    p.add_argument("--parent-run", default=None, help="run this one is a reduced rerun of")
    p.add_argument("--run-id", default=None, help="run id (default: scenario-seed-scope-xxxx)")
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="hub data address")
    p.add_argument("--json", action="store_true", help="headless: print the result as JSON")
    p.add_argument(
        "--view",
        choices=("tui", "text"),
        default=None,
        help="interactive view (default: tui on a terminal, text otherwise)",
    )
    p.add_argument("--config", default=None, help="TUI settings file (see config/default.toml)")


@dataclass
class DemoHandles:
    """A running demo: the hub, the simulated job's thread, and how to stop them."""

    hub: Hub
    scenario: Scenario
    run_id: str
    thread: threading.Thread
    stop_event: threading.Event
    result: list[RunInfo] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    baseline: RunInfo | None = None
    """The healthy twin recorded first, when one was asked for."""

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    @property
    def info(self) -> RunInfo | None:
        """What the simulated job sent, once it has finished."""
        return self.result[0] if self.result else None

    def wait(self, timeout: float | None = None) -> RunInfo | None:
        """Wait for the simulated job to finish; re-raise what it failed with."""
        self.thread.join(timeout)
        if self.errors:
            raise self.errors[0]
        return self.info

    def wait_ingested(self, timeout: float = INGEST_WAIT_S) -> bool:
        """Wait until the hub has taken in (accepted or rejected) every message sent."""
        info = self.info
        if info is None:
            return False
        expected = info.messages + (self.baseline.messages if self.baseline is not None else 0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.hub.health
            if h["messages"] + sum(h["rejects"].values()) >= expected:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """Stop the job after its current step, then the hub (which closes the recording)."""
        self.stop_event.set()
        self.thread.join(timeout=30)
        self.hub.stop()


def start_demo(
    scenario: Scenario,
    steps: int,
    *,
    pace: str | None = "realtime",
    record_dir: str | None = None,
    bind: str = "tcp://127.0.0.1:0",
    scope: ScopeSpec | None = None,
    run_id: str | None = None,
    parent_run: str | None = None,
    argv: list[str] | None = None,
    baseline_steps: int = 0,
) -> DemoHandles:
    """Start a hub and a simulated job in background threads.

    Args:
        scenario: the resolved scenario.
        steps: steps the job runs.
        pace: ``"realtime"`` or ``"fast"``/None.
        record_dir: recording directory of the hub (None: no recording).
        bind: the hub's data address.
        scope: which part of the cluster runs.
        run_id: the run's id (default: a fresh one).
        parent_run: the run this one is a reduced rerun of.
        argv: command line recorded in the manifest.
        baseline_steps: first run this many steps of the scenario's healthy twin (same
            seed and cluster, no fault) as fast as possible, as a separate run of the same
            job: the baseline the view compares the incident with. 0: none.

    Returns:
        Handles; call ``stop()`` when done.
    """
    spec = scope or ScopeSpec()
    hub = Hub(bind=bind, record_dir=record_dir).start()
    rid = run_id or default_run_id(scenario, spec.scope)
    stop = threading.Event()
    handles = DemoHandles(hub=hub, scenario=scenario, run_id=rid, thread=None, stop_event=stop)  # type: ignore[arg-type]
    twin = healthy_twin(scenario)
    if baseline_steps > 0 and twin is not scenario:
        try:
            handles.baseline = run_sim(
                twin,
                hub.endpoint,
                baseline_steps,
                pace="fast",
                scope=spec,
                run_id=f"{rid}-healthy",
                stop=stop,
                argv=argv,
            )
        except BaseException:
            hub.stop()
            raise

    def job() -> None:
        try:
            handles.result.append(
                run_sim(
                    scenario,
                    hub.endpoint,
                    steps,
                    pace=pace,
                    scope=spec,
                    parent_run=parent_run,
                    run_id=rid,
                    stop=stop,
                    argv=argv,
                )
            )
        except BaseException as exc:  # reported by wait(); the view must not hang on it
            handles.errors.append(exc)

    handles.thread = threading.Thread(target=job, name="rankscope-sim", daemon=True)
    handles.thread.start()
    return handles


def summary_line(handles: DemoHandles, last: int = 20) -> str:
    """One line about the live run: steps, step time p50/max, most frequent last arrivers.

    Args:
        handles: the running demo.
        last: steps of history to summarise.

    Returns:
        The line (or a waiting note before the first step arrives).
    """
    try:
        w = handles.hub.store.window(handles.run_id, last=last)
    except KeyError:
        return f"{handles.run_id}: waiting for the first step"
    if w.steps.shape[0] == 0:
        return f"{handles.run_id}: {w.world_size} ranks said hello, no step yet"
    step_ns = np.where(w.present, w.step_ns, np.nan)
    slowest = np.nanmax(step_ns, axis=0) / 1e6
    # Share of its own collectives in which each rank arrived last: a straggler is last in
    # most of the collectives it takes part in, whatever the size of its groups.
    times_last = np.nansum(w.coll["times_last"], axis=1)
    share = times_last / np.maximum(np.nansum(w.coll["n"], axis=1), 1.0)
    top = np.argsort(-share, kind="stable")[:3]
    lasts = ", ".join(
        f"r{r}@{w.ranks.hosts[w.ranks.host[r]]} {100 * share[r]:.0f}%"
        for r in top
        if times_last[r] > 0
    )
    return (
        f"{handles.run_id} step {int(w.steps[-1])}: step p50 {np.nanmedian(slowest):.0f} ms, "
        f"max {np.nanmax(slowest):.0f} ms over {w.steps.shape[0]} steps | "
        f"last to arrive (share of own collectives): {lasts or '-'}"
    )


def text_view(handles: DemoHandles, out: TextIO = sys.stdout, every_s: float = 1.0) -> None:
    """Print `summary_line` every ``every_s`` seconds until the job ends."""
    while handles.running:
        handles.thread.join(every_s)
        print(summary_line(handles), file=out, flush=True)


def make_demo_app(handles: DemoHandles, config: str | None = None, settings: Any = None) -> Any:
    """The TUI on the demo hub's live store, showing the simulated run.

    Args:
        handles: the running demo.
        config: settings file (``--config``); the usual discovery order otherwise.
        settings: ready settings instead (tests pass deterministic ones).

    Returns:
        The Textual app, not yet running.
    """
    from rankscope.tui.app import make_app
    from rankscope.tui.settings import load_settings
    from rankscope.tui.sources import LiveSource

    label = f"demo {handles.scenario.name} @ {handles.hub.endpoint}"
    settings = settings if settings is not None else load_settings(config)
    base = handles.baseline.run if handles.baseline is not None else None
    return make_app(settings, LiveSource(handles.hub, label), run=handles.run_id, baseline=base)


def _scenario_from_args(args: argparse.Namespace) -> Scenario:
    ranks = DEFAULT_RANKS if args.ranks is None else args.ranks
    return load_scenario(args.scenario, seed=args.seed, ranks=ranks or None)


def _scope_from_args(args: argparse.Namespace) -> ScopeSpec:
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
    ranks = (args.rank,) if args.rank is not None else ()
    return ScopeSpec(scope=args.scope, hosts=hosts, ranks=ranks)


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, desc in list_scenarios():
            print(f"{name:26s} {desc}")
        return 0
    try:
        scenario = _scenario_from_args(args)
    except ScenarioError as exc:
        print(f"rankscope demo: {exc}", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        print(f"rankscope demo: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    if args.baseline_steps is not None and args.baseline_steps < 0:
        print(
            f"rankscope demo: --baseline-steps must be >= 0, got {args.baseline_steps}",
            file=sys.stderr,
        )
        return 2
    headless = args.headless
    baseline_steps = args.baseline_steps
    if baseline_steps is None:
        baseline_steps = 0 if headless else BASELINE_STEPS
    steps = args.steps or (HEADLESS_STEPS if headless else 10**9)
    pace = args.pace or ("fast" if headless else "realtime")
    view = args.view or ("tui" if sys.stdout.isatty() else "text")
    argv = ["rankscope", "demo", *sys.argv[2:]] if sys.argv[1:2] == ["demo"] else None
    try:
        handles = start_demo(
            scenario,
            steps,
            pace=pace,
            record_dir=args.record,
            bind=args.bind,
            scope=_scope_from_args(args),
            run_id=args.run_id,
            parent_run=args.parent_run,
            argv=argv,
            baseline_steps=baseline_steps,
        )
    except ValueError as exc:
        print(f"rankscope demo: {exc}", file=sys.stderr)
        return 2
    try:
        if headless:
            handles.wait()
        elif view == "tui":
            make_demo_app(handles, args.config).run()
            handles.stop_event.set()
            handles.wait()
        else:
            print(
                f"rankscope demo: {scenario.name} ({scenario.description}); hub at "
                f"{handles.hub.endpoint}"
                + (f"; baseline {handles.baseline.run}" if handles.baseline is not None else "")
                + "; Ctrl-C to stop",
                flush=True,
            )
            text_view(handles)
            handles.wait()
        complete = handles.wait_ingested()
    except KeyboardInterrupt:
        handles.stop()
        return 130
    except ValueError as exc:
        handles.stop()
        print(f"rankscope demo: {exc}", file=sys.stderr)
        return 2
    health = handles.hub.health
    handles.stop()
    info = handles.info
    assert info is not None
    result: dict[str, Any] = {
        "run": info.run,
        "job": info.job,
        "scenario": scenario.name,
        "seed": scenario.seed,
        "scope": info.scope,
        "world_size": info.world_size,
        "steps": info.steps,
        "messages": info.messages,
        "baseline_run": handles.baseline.run if handles.baseline is not None else None,
        "bytes": info.bytes,
        "dropped": info.dropped,
        "hub_messages": health["messages"],
        "hub_rejects": health["rejects"],
        "complete": complete,
        "record": args.record,
        "wall_s": round(info.wall_s, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{info.run}: {info.steps} steps x {info.world_size} ranks, {info.messages} messages "
            f"({info.bytes / 1e6:.1f} MB) in {info.wall_s:.1f} s; hub accepted "
            f"{health['messages']}"
            + (
                f" (with baseline {handles.baseline.run}'s {handles.baseline.messages})"
                if handles.baseline is not None
                else ""
            )
            + f", rejected {sum(health['rejects'].values())}"
            + (f"; recording in {args.record}" if args.record else "")
        )
    ok = complete and info.dropped == 0 and not health["rejects"]
    return 0 if ok else 1
