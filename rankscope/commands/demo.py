"""``rankscope demo``: a hub and a simulated training cluster in one process.

No GPU and no torch needed: the simulated ranks emit through the real collector path to a
real hub. Interactive, it opens the TUI on the hub's live store (or, with ``--view text`` or
without a terminal, prints a summary every second); ``--headless`` runs its steps and exits.
The hub records by default (``--record DIR``, else a fresh temporary folder named on exit;
``--no-record`` for none), so reruns, the ladder, experiments and snapshots work from the
first try. ``--hub ENDPOINT`` sends the simulated cluster to a hub already running
(``rankscope hub`` or ``rankscope watch``) instead of starting one.

Quitting (``q`` in the TUI, Ctrl-C in the text view) stops the simulated job after its
current step; what it already sent gets `QUIT_WAIT_S` to reach the hub, and the summary
line says how many messages were sent, reached the hub, and were lost or dropped.

`start_demo` is the reusable part: a view only needs its handles.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import zmq

from rankscope.collector.security import client_curve_from_env
from rankscope.hub.recording import RecordingError
from rankscope.hub.server import Hub
from rankscope.sim import RunInfo, Scenario, ScenarioError, ScopeSpec, list_scenarios, load_scenario
from rankscope.sim import run as run_sim
from rankscope.sim.emit import default_run_id
from rankscope.sim.spec import healthy_twin

HELP = "Hub + simulated cluster + live view in one process (no GPU or torch needed)"
DEFAULT_SCENARIO = "seed-example"
DEFAULT_BIND = "tcp://127.0.0.1:0"
HEADLESS_STEPS = 20
BASELINE_STEPS = 30
"""Healthy-twin steps recorded before an interactive demo: enough for stable medians."""
JOIN_SLICE_S = 0.2
"""Longest a wait for the simulated job blocks before it looks for a pending Ctrl-C."""
INGEST_WAIT_S = 30.0
"""Longest wait, after the simulated job has run all its steps, for the hub to take in
what was sent (it returns as soon as everything is in)."""
QUIT_WAIT_S = 1.0
"""After the user quits: how long the simulated job's queued messages may take to leave,
and then again how long the hub may take to read them in. Each wait ends as soon as it is
done; what is still missing then is counted as lost in the summary."""
MAX_RELAYS = 64
"""Relay processes a demo starts at most (each is a Python process on this machine)."""
RECORD_PREFIX = "rankscope-demo-"
"""Name prefix of the temporary recording folder (under the system's temporary folder)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default=DEFAULT_SCENARIO, help="scenario name or .toml path")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="world size of the full cluster (default, or 0: as the scenario says)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps to run (default: until quit; {HEADLESS_STEPS} with --headless)",
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
            f"the baseline to compare with (default {BASELINE_STEPS}; 0 with --headless)"
        ),
    )
    p.add_argument("--headless", action="store_true", help="no view: run the steps and exit")
    rec = p.add_mutually_exclusive_group()
    rec.add_argument(
        "--record",
        metavar="DIR",
        default=None,
        help=f"write the recording to DIR (default: a new {tempfile.gettempdir()}/"
        f"{RECORD_PREFIX}* folder, named on exit)",
    )
    rec.add_argument("--no-record", action="store_true", help="write no recording")
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
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--bind",
        default=None,
        help=f"data address of the demo's own hub (default {DEFAULT_BIND}: a free port)",
    )
    where.add_argument(
        "--hub",
        metavar="ENDPOINT",
        default=None,
        help="send the simulated cluster to this running hub (rankscope hub, rankscope "
        "watch) instead of starting one; it records and shows it",
    )
    p.add_argument(
        "--relays",
        type=int,
        default=0,
        metavar="N",
        help="send through N relay processes (`rankscope relay`; each host's ranks to one, "
        "as `rankscope run --relay` does on a node) instead of straight to the hub "
        "[default: %(default)s]",
    )
    p.add_argument(
        "--reduce",
        action="store_true",
        help="with --relays: each relay matches its hosts' own groups and gathers their "
        "messages (`rankscope relay --reduce`)",
    )
    p.add_argument("--json", action="store_true", help="print the result on exit as JSON")
    p.add_argument(
        "--view",
        choices=("tui", "text"),
        default=None,
        help="interactive view (default: tui on a terminal, text otherwise)",
    )
    p.add_argument("--config", default=None, help="TUI settings file (see config/default.toml)")


@dataclass
class DemoHandles:
    """A running demo: its hub (None when sending to a hub elsewhere), the simulated job's
    thread, and how to stop them."""

    hub: Hub | None
    endpoint: str
    """Where the simulated ranks send: the demo's own hub, or the one given."""
    scenario: Scenario
    run_id: str
    thread: threading.Thread
    stop_event: threading.Event
    result: list[RunInfo] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    baseline: RunInfo | None = None
    """The healthy twin recorded first, when one was asked for."""
    last_step: int | None = None
    """The last step handed to the senders."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the job's thread has finished. Waits go through it, not ``Thread.join``:
    a join that Ctrl-C interrupts leaves the thread looking finished on Python 3.11."""
    relays: list[DemoRelay] = field(default_factory=list)
    """The relay processes the simulated ranks send through (``--relays``)."""

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    @property
    def info(self) -> RunInfo | None:
        """What the simulated job sent, once it has finished."""
        return self.result[0] if self.result else None

    @property
    def record_dir(self) -> str | None:
        """The own hub's recording folder (None: no recording, or not our hub)."""
        rec = self.hub.record_dir if self.hub is not None else None
        return None if rec is None else str(rec)

    def wait(self, timeout: float | None = None) -> RunInfo | None:
        """Wait for the simulated job to finish; re-raise what it failed with."""
        self.join(timeout)
        if self.errors:
            raise self.errors[0]
        return self.info

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the job's thread to finish (at most ``timeout``); True when it has.

        The wait wakes every few tenths of a second: a Ctrl-C that the kernel delivers to
        another thread of the process only sets Python's flag, and the main thread runs
        the handler (raising KeyboardInterrupt) only once it wakes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = (
                JOIN_SLICE_S if deadline is None else min(JOIN_SLICE_S, deadline - time.monotonic())
            )
            if self.done.wait(max(left, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def sent(self) -> int | None:
        """Messages handed to ZeroMQ by the run and its baseline (None: still running)."""
        info = self.info
        if info is None:
            return None
        return info.messages + (self.baseline.messages if self.baseline is not None else 0)

    def reached(self) -> int | None:
        """Messages the own hub has taken in, accepted or rejected, those its relays
        gathered into node messages counted as they were sent (None: no own hub)."""
        if self.hub is None:
            return None
        h = self.hub.health
        gathered = h.get("gathered", 0) - h.get("node_messages", 0)
        return int(h["messages"] + sum(h["rejects"].values()) + gathered)

    def wait_ingested(self, timeout: float = INGEST_WAIT_S) -> bool:
        """Wait until the own hub has taken in (accepted or rejected) every message sent;
        False when time ran out first, the job has not finished, or the hub is not ours."""
        expected = self.sent()
        if expected is None or self.hub is None:
            return False
        deadline = time.monotonic() + timeout
        while True:
            reached = self.reached()
            if reached is not None and reached >= expected:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the job after its current step (waiting at most ``timeout`` for it), its
        relays (each forwards what it holds first), then the own hub (which closes the
        recording)."""
        self.stop_event.set()
        self.join(timeout)
        self.stop_relays()
        if self.hub is not None:
            self.hub.stop()

    def stop_relays(self) -> None:
        """Stop the relay processes; each forwards what it still holds (at most a second)."""
        for r in self.relays:
            r.stop()


@dataclass
class DemoRelay:
    """One ``rankscope relay`` process of a demo."""

    endpoint: str
    proc: subprocess.Popen[str]
    summary: str = ""
    """Its last status line, once stopped."""

    @classmethod
    def spawn(cls, endpoint: str, upstream: str, insecure: bool, reduce: bool = False) -> DemoRelay:
        argv = [sys.executable, "-m", "rankscope", "relay", "--listen", endpoint]
        argv += ["--upstream", upstream, "--status-every", "0"]
        if insecure:
            argv.append("--insecure")
        if reduce:
            argv.append("--reduce")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return cls(endpoint, proc)

    def ready(self, timeout: float = 30.0) -> None:
        """Wait until it listens (its socket file is there). Raises ValueError when it
        exited or did not start in time."""
        path = self.endpoint[len("ipc://") :]
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                self.stop()
                raise ValueError(f"relay {self.endpoint} did not start: {self.summary}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            out, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        lines = (out or "").strip().splitlines() or (err or "").strip().splitlines()
        self.summary = lines[-1] if lines else self.summary


def start_demo(
    scenario: Scenario,
    steps: int,
    *,
    pace: str | None = "realtime",
    record_dir: str | None = None,
    bind: str = DEFAULT_BIND,
    hub: str | None = None,
    scope: ScopeSpec | None = None,
    run_id: str | None = None,
    parent_run: str | None = None,
    argv: list[str] | None = None,
    baseline_steps: int = 0,
    stop_linger_s: float = QUIT_WAIT_S,
    relays: int = 0,
    reduce: bool = False,
) -> DemoHandles:
    """Start a hub and a simulated job in background threads.

    Args:
        scenario: the resolved scenario.
        steps: steps the job runs.
        pace: ``"realtime"`` or ``"fast"``/None.
        record_dir: recording directory of the hub (None: no recording).
        bind: the own hub's data address.
        hub: send to this running hub instead of starting one (``bind`` and
            ``record_dir`` are then not used: that hub records).
        scope: which part of the cluster runs.
        run_id: the run's id (default: a fresh one).
        parent_run: the run this one is a reduced rerun of.
        argv: command line recorded in the manifest.
        baseline_steps: first run this many steps of the scenario's healthy twin (same
            seed and cluster, no fault) as fast as possible, as a separate run of the same
            job: the baseline the view compares the incident with. 0: none.
        stop_linger_s: once stopped, how long the job's queued messages may take to leave.
        relays: send through this many relay processes (`rankscope.hub.relay`), each
            host's ranks to one, instead of straight to the hub.
        reduce: the relays reduce (`rankscope.hub.reduce`).

    Returns:
        Handles; call ``stop()`` when done.

    Raises:
        ValueError: a bad endpoint or argument.
        zmq.ZMQError: the own hub cannot bind ``bind``.
        RecordingError: ``record_dir`` is held by another hub or is not a recording.
    """
    spec = scope or ScopeSpec()
    own = Hub(bind=bind, record_dir=record_dir).start() if hub is None else None
    endpoint = own.endpoint if own is not None else hub
    assert endpoint is not None
    rid = run_id or default_run_id(scenario, spec.scope)
    stop = threading.Event()
    handles = DemoHandles(
        hub=own,
        endpoint=endpoint,
        scenario=scenario,
        run_id=rid,
        thread=None,  # type: ignore[arg-type]
        stop_event=stop,
    )
    # A hub of one's own speaks plain ZeroMQ on loopback; another hub may require the
    # client keys this process finds (`rankscope keys`), as a collector would use them.
    curve = client_curve_from_env() if hub is not None else None
    via: list[str] | None = None
    if relays > 0:
        folder = tempfile.mkdtemp(prefix="rankscope-demo-relays-")
        try:
            for k in range(relays):
                handles.relays.append(
                    DemoRelay.spawn(
                        f"ipc://{folder}/relay{k}", endpoint, insecure=hub is None, reduce=reduce
                    )
                )
            for r in handles.relays:
                r.ready()
        except BaseException:
            handles.stop_relays()
            if own is not None:
                own.stop()
            raise
        via = [r.endpoint for r in handles.relays]

    def taken_in(before: int) -> Any:
        """Whether the own hub has taken in ``before`` earlier messages and the ``n`` of
        this run (None: not our hub, nothing to wait for)."""
        if handles.hub is None:
            return None
        return lambda n: (handles.reached() or 0) >= before + n

    twin = healthy_twin(scenario)
    if baseline_steps > 0 and twin is not scenario:
        try:
            handles.baseline = run_sim(
                twin,
                endpoint,
                baseline_steps,
                pace="fast",
                scope=spec,
                run_id=f"{rid}-healthy",
                stop=stop,
                argv=argv,
                stop_linger_s=stop_linger_s,
                curve=curve,
                relays=via,
                delivered=taken_in(0),
            )
        except BaseException:
            handles.stop_relays()
            if own is not None:
                own.stop()
            raise

    def on_step(tables: Any) -> None:
        handles.last_step = int(tables.steps["step"].max())

    def job() -> None:
        try:
            handles.result.append(
                run_sim(
                    scenario,
                    endpoint,
                    steps,
                    pace=pace,
                    scope=spec,
                    parent_run=parent_run,
                    run_id=rid,
                    stop=stop,
                    on_step=on_step,
                    argv=argv,
                    stop_linger_s=stop_linger_s,
                    curve=curve,
                    relays=via,
                    delivered=taken_in(
                        handles.baseline.messages if handles.baseline is not None else 0
                    ),
                )
            )
        except BaseException as exc:  # reported by wait(); the view must not hang on it
            handles.errors.append(exc)
        finally:
            handles.done.set()

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
    if handles.hub is None:
        step = "-" if handles.last_step is None else str(handles.last_step)
        return f"{handles.run_id}: step {step} sent to {handles.endpoint}"
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
        handles.join(every_s)
        print(summary_line(handles), file=out, flush=True)


def make_demo_app(handles: DemoHandles, config: str | None = None, settings: Any = None) -> Any:
    """The TUI on the demo hub's live store, showing the simulated run.

    Args:
        handles: the running demo (with its own hub).
        config: settings file (``--config``); the usual discovery order otherwise.
        settings: ready settings instead (tests pass deterministic ones).

    Returns:
        The Textual app, not yet running.

    Raises:
        ValueError: the demo sends to a hub elsewhere (view that hub instead).
    """
    from rankscope.tui.app import make_app
    from rankscope.tui.settings import load_settings
    from rankscope.tui.sources import LiveSource

    if handles.hub is None:
        raise ValueError(f"the demo has no hub of its own (it sends to {handles.endpoint})")
    label = f"demo {handles.scenario.name} @ {handles.hub.endpoint}"
    settings = settings if settings is not None else load_settings(config)
    base = handles.baseline.run if handles.baseline is not None else None
    return make_app(settings, LiveSource(handles.hub, label), run=handles.run_id, baseline=base)


def run_app(app: Any, **kwargs: Any) -> None:
    """Run the TUI until the user quits; quitting does not wait for a diagnosis or ladder
    still being computed (`rankscope.tui.runner`). ``kwargs`` go to ``App.run`` (tests
    drive the app headless with an ``auto_pilot``)."""
    from rankscope.tui.runner import run_app as run_leaving_workers

    run_leaving_workers(app, **kwargs)


def _scenario_from_args(args: argparse.Namespace) -> Scenario:
    return load_scenario(args.scenario, seed=args.seed, ranks=args.ranks or None)


def _scope_from_args(args: argparse.Namespace) -> ScopeSpec:
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
    ranks = (args.rank,) if args.rank is not None else ()
    return ScopeSpec(scope=args.scope, hosts=hosts, ranks=ranks)


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, if anything."""
    if args.steps is not None and args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if args.baseline_steps is not None and args.baseline_steps < 0:
        return f"--baseline-steps must be >= 0, got {args.baseline_steps}"
    if args.ranks is not None and args.ranks < 0:
        return f"--ranks must be >= 0, got {args.ranks}"
    if not 0 <= args.relays <= MAX_RELAYS:
        return f"--relays must be 0..{MAX_RELAYS}, got {args.relays}"
    if args.reduce and not args.relays:
        return "--reduce is what relays do: give --relays N too"
    if args.hub is not None:
        if args.record is not None:
            return "--record belongs to the hub given by --hub: start it with --record DIR"
        if args.view is not None:
            return (
                "--view needs the demo's own hub; with --hub, view the hub's recording "
                "(rankscope open DIR) or run the hub as rankscope watch"
            )
    return None


def _record_dir(args: argparse.Namespace) -> str | None:
    """Where the own hub records: ``--record DIR``, none with ``--no-record`` or ``--hub``,
    else a new temporary folder."""
    if args.hub is not None or args.no_record:
        return None
    if args.record is not None:
        return str(args.record)
    return tempfile.mkdtemp(prefix=RECORD_PREFIX)


def _quit(handles: DemoHandles, wait_s: float = QUIT_WAIT_S) -> None:
    """Stop the simulated job after the user quit, and give what it sent a short time to
    reach the hub (each wait ends as soon as it is done)."""
    handles.stop_event.set()
    print(
        f"rankscope demo: stopping; the last messages go to the hub (at most {2 * wait_s:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    # The job's queued messages may linger up to wait_s; a little more covers its last step.
    handles.join(wait_s + 0.5)
    if handles.hub is not None and handles.info is not None:
        handles.wait_ingested(wait_s)


def _summary(handles: DemoHandles, stopped: bool, record: str | None) -> dict[str, Any]:
    """What was sent, what reached the hub, what was lost; read after the hub stopped."""
    info = handles.info
    base = handles.baseline
    sent = handles.sent()
    reached = handles.reached()
    health = handles.hub.health if handles.hub is not None else None
    return {
        "run": handles.run_id,
        "job": handles.scenario.job,
        "scenario": handles.scenario.name,
        "seed": handles.scenario.seed,
        "scope": info.scope if info is not None else None,
        "world_size": info.world_size if info is not None else None,
        "steps": info.steps if info is not None else None,
        "messages": info.messages if info is not None else None,
        "baseline_run": base.run if base is not None else None,
        "baseline_messages": base.messages if base is not None else 0,
        "bytes": info.bytes if info is not None else None,
        "dropped": (info.dropped if info is not None else 0) + (base.dropped if base else 0),
        "sent": sent,
        "reached_hub": reached,
        "lost": None if sent is None or reached is None else max(0, sent - reached),
        "hub_messages": health["messages"] if health is not None else None,
        "hub_rejects": health["rejects"] if health is not None else None,
        "complete": (
            None if sent is None or reached is None or handles.hub is None else reached >= sent
        ),
        "hub": handles.endpoint,
        "stopped": stopped,
        "record": record,
        "wall_s": round(info.wall_s, 3) if info is not None else None,
        "relays": [{"endpoint": r.endpoint, "summary": r.summary} for r in handles.relays],
        "bundles": health["transport"]["bundles"] if health is not None else None,
    }


def _summary_text(r: dict[str, Any]) -> str:
    """The summary as the lines a person reads on exit (short enough for 80 columns with
    the usual run ids and temporary folders); message counts include the baseline's."""
    if r["steps"] is None:
        lines = [f"{r['run']}: still sending when the demo ended"]
    else:
        lines = [
            f"{r['run']}: {r['steps']} steps x {r['world_size']} ranks in {r['wall_s']:.1f} s"
            + (", stopped" if r["stopped"] else "")
        ]
    counts = []
    if r["sent"] is not None:
        counts.append(f"{r['sent']} sent")
    if r["reached_hub"] is not None:
        extra = r["reached_hub"] - (r["sent"] or 0)
        # More than was sent: reruns launched from the view report to the same hub.
        counts.append(
            f"{r['reached_hub']} reached the hub"
            + (f" ({extra} of them from reruns)" if extra > 0 else "")
        )
        if r["lost"] is not None:
            counts.append(f"{r['lost']} lost")
        rejected = sum(r["hub_rejects"].values())
        if rejected:
            counts.append(f"{rejected} rejected")
    counts.append(f"{r['dropped']} dropped")
    lines.append("messages: " + ", ".join(counts))
    for k, relay in enumerate(r["relays"]):
        lines.append(f"relay {k}: {relay['summary'] or 'no summary'}")
    if r["reached_hub"] is None:
        lines.append(f"sent to {r['hub']}: its own status line counts what it took in")
    if r["record"]:
        lines += [f"recording: {r['record']}", f"view it again: rankscope open {r['record']}"]
    return "\n".join(lines)


def _start_error(exc: BaseException, bind: str) -> str | None:
    """The one line for a demo that could not start (None: a bug, keep the traceback)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted before the view opened"
    if isinstance(exc, zmq.ZMQError):
        if exc.errno == zmq.EADDRINUSE:
            return f"{bind} is in use (a hub already there? send the demo to it with --hub {bind})"
        return f"cannot start the hub on {bind}: {exc}"
    if isinstance(exc, ValueError | RecordingError):
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, desc in list_scenarios():
            print(f"{name:26s} {desc}")
        return 0
    problem = _check_args(args)
    if problem is not None:
        print(f"rankscope demo: {problem}", file=sys.stderr)
        return 2
    try:
        scenario = _scenario_from_args(args)
    except ScenarioError as exc:
        print(f"rankscope demo: {exc}", file=sys.stderr)
        return 2
    headless = args.headless
    baseline_steps = args.baseline_steps
    if baseline_steps is None:
        baseline_steps = 0 if headless else BASELINE_STEPS
    steps = args.steps or (HEADLESS_STEPS if headless else 10**9)
    pace = args.pace or ("fast" if headless else "realtime")
    view = "none" if headless or args.hub is not None else args.view
    if view is None:
        view = "tui" if sys.stdout.isatty() else "text"
    argv = ["rankscope", "demo", *sys.argv[2:]] if sys.argv[1:2] == ["demo"] else None
    record = _record_dir(args)
    made = record is not None and args.record is None
    if baseline_steps > 0 and not args.json:
        print(
            f"rankscope demo: recording the baseline ({baseline_steps} steps of "
            f"{scenario.name}'s healthy twin)",
            file=sys.stderr,
            flush=True,
        )
    try:
        handles = start_demo(
            scenario,
            steps,
            pace=pace,
            record_dir=record,
            bind=args.bind or DEFAULT_BIND,
            hub=args.hub,
            scope=_scope_from_args(args),
            run_id=args.run_id,
            parent_run=args.parent_run,
            argv=argv,
            baseline_steps=baseline_steps,
            relays=args.relays,
            reduce=args.reduce,
        )
    except BaseException as exc:
        if made and record is not None and not any(Path(record).iterdir()):
            Path(record).rmdir()  # the temporary folder made for a demo that did not start
        problem = _start_error(exc, args.bind or DEFAULT_BIND)
        if problem is None:
            raise
        print(f"rankscope demo: {problem}", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 2
    stopped = False
    interrupted = False
    try:
        if view == "tui":
            run_app(make_demo_app(handles, args.config))
            stopped = handles.running
        elif view == "text":
            print(
                f"rankscope demo: {scenario.name} ({scenario.description}); hub at "
                f"{handles.endpoint}"
                + (f"; baseline {handles.baseline.run}" if handles.baseline is not None else "")
                + "; Ctrl-C to stop",
                flush=True,
            )
            try:
                text_view(handles)
            except KeyboardInterrupt:
                stopped = True
        else:
            if args.hub is not None and not args.json:
                print(
                    f"rankscope demo: sending {scenario.name} ({scenario.world_size} ranks) "
                    f"to {args.hub}" + ("" if headless else "; Ctrl-C to stop"),
                    file=sys.stderr,
                    flush=True,
                )
            try:
                handles.wait()
            except KeyboardInterrupt:
                stopped = interrupted = True
        if stopped:
            _quit(handles)
        else:
            handles.wait()
            handles.wait_ingested()
    except KeyboardInterrupt:  # a second Ctrl-C while stopping: give up at once
        return 130
    finally:
        handles.stop_event.set()
        handles.stop_relays()  # each forwards what it holds first
        if handles.hub is not None:
            handles.hub.stop()  # drains what is still arriving and closes the recording
    if handles.errors:
        raise handles.errors[0]  # the simulated job failed: a bug, with its traceback
    result = _summary(handles, stopped, record)
    if args.json:
        print(json.dumps(result))
    else:
        print(_summary_text(result), flush=True)
    if result["hub_rejects"]:
        return 1  # the hub refused messages: a bug, whoever stopped the run
    if interrupted and headless:
        return 130
    if stopped:
        return 0  # the user quit: what did not arrive in time is stated, not an error
    return 0 if result["dropped"] == 0 and result["complete"] is not False else 1
