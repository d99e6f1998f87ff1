"""Run a simulated job against a hub: every rank's hello, the group table, then its steps,
samples and health messages, built with the wire schema's own builders and sent through the
collector's `Sender`, exactly as a real rank would.

All ranks share a few PUSH sockets (rank ``r`` always uses socket ``r % senders``, so each
rank's messages stay in order). Unlike a training rank, the simulator prefers waiting to
dropping: when the hub's queue is full it retries until ``send_timeout_s``, so a recording
made as fast as possible is complete. For the same reason the sockets live in a context of
their own, terminated before `run` returns: what `run` reports as sent has left the process
(ZeroMQ sends from a background thread; with the process-wide context, a run could return,
and the hub stop, while its last messages were still queued).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from rankscope.collector import schema
from rankscope.collector.security import ClientCurve
from rankscope.collector.sender import Sender
from rankscope.sim.engine import Cluster
from rankscope.sim.spec import Scenario
from rankscope.sim.tables import StepTables, merge_rows, merge_steps
from rankscope.sim.topology import ScopeSpec

PACES = ("realtime", "fast")
STATS_EVERY = 10
"""Steps between two collector-health (``stats``) messages of a rank."""
SAMPLE_PERIOD_S = 1.0
"""Simulated seconds between two samples messages of a rank (one sample row per step)."""


@dataclass(frozen=True)
class RunInfo:
    """What a simulated run sent."""

    job: str
    run: str
    scope: str
    parent_run: str | None
    world_size: int
    steps: int
    """Steps completed."""
    messages: int
    bytes: int
    dropped: int
    """Messages given up after ``send_timeout_s`` of a full queue."""
    retries: int
    """Sends that found a full queue and waited for room."""
    wall_s: float
    truth: dict[str, Any] = field(default_factory=dict)


def default_run_id(scenario: Scenario, scope: str) -> str:
    """A fresh run id naming the scenario, seed and scope."""
    return f"{scenario.name}-s{scenario.seed}-{scope}-{uuid.uuid4().hex[:6]}"


class Emitter:
    """Sends each rank's messages through the shared sockets, waiting for room rather than
    dropping (up to ``timeout_s`` per message), and counts what happened."""

    def __init__(
        self,
        senders: list[Any],
        timeout_s: float,
        stop: threading.Event | None,
        route: np.ndarray | None = None,
    ):
        """Args:
        senders: objects with ``send(data, timeout_ms, *, cancel) -> bool`` (collector
            `Sender`s: False when the message was dropped).
        timeout_s: longest wait for room before a message is dropped.
        stop: when set, waiting ends at once.
        route: int (R,) the sender of each rank (its node's relay); by default
            ``rank % len(senders)``.
        """
        self.senders = senders
        self.timeout_ms = timeout_s * 1000.0
        self.stop = stop
        self.route = route
        self.messages = self.bytes = self.dropped = 0

    @property
    def retries(self) -> int:
        """Sends that found their socket's queue full and waited for room."""
        return sum(getattr(s, "waited", 0) for s in self.senders)

    def send(self, rank: int, data: bytes) -> None:
        """Send one message of ``rank`` on its socket (its route, else
        ``rank % len(senders)``)."""
        route = self.route
        sender = self.senders[int(route[rank]) if route is not None else rank % len(self.senders)]
        if sender.send(data, timeout_ms=self.timeout_ms, cancel=self.stop):
            self.messages += 1
            self.bytes += len(data)
        else:
            self.dropped += 1


class Kept(Emitter):
    """An `Emitter` that keeps every ``(rank, message)`` in sending order instead of
    sending (to feed a hub, a relay or a recording in process)."""

    def __init__(self) -> None:
        super().__init__([], 0.0, None)
        self.out: list[tuple[int, bytes]] = []

    def send(self, rank: int, data: bytes) -> None:
        self.out.append((rank, data))
        self.messages += 1
        self.bytes += len(data)


class RankStreams:
    """What every simulated rank sends, in order: its hello, then (rank 0) the group table
    (with ``node_groups``, each node's first rank also the groups with a member on its
    node, as a node's collectors tell its relay),
    then steps messages (``steps_per_message`` steps each), samples messages (at most one
    per ``sample_period_s`` of simulated time, like a collector's sampler thread) and, every
    `STATS_EVERY` steps and at the end, its health counters."""

    def __init__(
        self,
        cluster: Cluster,
        emit: Emitter,
        *,
        run_id: str,
        scope: str,
        parent_run: str | None = None,
        steps_per_message: int = 1,
        sample_period_s: float = SAMPLE_PERIOD_S,
        node_groups: bool = False,
    ) -> None:
        self.cluster = cluster
        self.node_groups = node_groups
        self.emit = emit
        self.scope = scope
        self.parent_run = parent_run
        self.steps_per_message = steps_per_message
        self.sample_period_ns = int(sample_period_s * 1e9)
        self.headers = [
            {"job": cluster.scenario.job, "run": run_id, "rank": r, "inc": 0, "batch": 0}
            for r in range(cluster.layout.world_size)
        ]
        self._steps: list[StepTables] = []
        self._samples: list[StepTables] = []
        self._last_samples_ns = cluster.t0_ns
        self.steps_done = 0

    def _header(self, rank: int) -> dict[str, Any]:
        h = self.headers[rank]
        h["batch"] += 1
        return h

    def start(self) -> None:
        """Send every rank's hello, then the group table."""
        c = self.cluster
        for r, ident in enumerate(c.identities):
            self.emit.send(
                r,
                schema.hello_message(
                    self._header(r),
                    ident,
                    scope=self.scope,
                    parent_run=self.parent_run,
                    manifest=c.manifest,
                    t_start_ns=c.t0_ns,
                ),
            )
        # One table for the whole job, from rank 0 (the world group alone lists every rank).
        self.emit.send(0, schema.groups_message(self._header(0), c.groups))
        if self.node_groups:
            # And each node's groups from the node's first rank, as each node's collectors
            # report the groups they belong to: a relay learns the groups it can reduce
            # (those of other nodes too: of a group spanning nodes, its share).
            host = np.asarray(c.layout.host)
            by_host: dict[int, list[dict[str, Any]]] = {}
            for g in c.groups:
                for h in np.unique(host[np.asarray(g["ranks"], np.int64)]).tolist():
                    by_host.setdefault(int(h), []).append(g)
            ids, firsts = np.unique(host, return_index=True)
            first_of = dict(zip(ids.tolist(), firsts.tolist(), strict=True))
            for h, mine in by_host.items():
                first = first_of[h]
                self.emit.send(first, schema.groups_message(self._header(first), mine))

    def add(self, tables: StepTables) -> None:
        """Take one simulated step; send whatever is due."""
        self._steps.append(tables)
        self._samples.append(tables)
        self.steps_done += 1
        if len(self._steps) >= self.steps_per_message:
            self._send_steps()
        if int(tables.steps["t_end"].max()) - self._last_samples_ns >= self.sample_period_ns:
            self._send_samples()
        if self.steps_done % STATS_EVERY == 0:
            self._send_stats()

    def finish(self) -> None:
        """Send what is still pending, then every rank's final health counters."""
        self._send_steps()
        self._send_samples()
        self._send_stats()

    def _send_steps(self) -> None:
        if not self._steps:
            return
        merged = merge_steps(self._steps)
        self._steps = []
        for r in range(len(self.headers)):
            t = merged.rank_tables(r, ("steps", "phases", "colls"))
            msg = schema.steps_message(self._header(r), t["steps"], t["phases"], t["colls"])
            self.emit.send(r, msg)

    def _send_samples(self) -> None:
        if not self._samples:
            return
        cols, off = merge_rows(self._samples, "samples")
        self._last_samples_ns = int(self._samples[-1].steps["t_end"].max())
        self._samples = []
        for r in range(len(self.headers)):
            a, b = int(off[r]), int(off[r + 1])
            rows = {k: v[a:b] for k, v in cols.items()}
            self.emit.send(r, schema.samples_message(self._header(r), rows))

    def _send_stats(self) -> None:
        c = self.cluster
        err = int(c.clock_error_ns)
        for r in range(len(self.headers)):
            stats = {
                "dropped_batches": 0,
                "dropped_events": 0,
                "errors": {},
                "clock_offset_ns": int(c.clock_offset[r]),
                "clock_error_ns": err,
            }
            self.emit.send(r, schema.stats_message(self._header(r), stats))


def _parse_pace(pace: str | float | None) -> float | None:
    """None: as fast as possible; 0.0: real time; > 0: wall seconds per step."""
    if pace is None or pace == "fast":
        return None
    if pace == "realtime":
        return 0.0
    if isinstance(pace, int | float) and not isinstance(pace, bool) and pace > 0:
        return float(pace)
    raise ValueError(f"pace must be 'realtime', 'fast', None or seconds per step > 0, got {pace!r}")


def run(
    scenario: Scenario,
    endpoint: str,
    steps: int,
    pace: str | float | None = None,
    scope: ScopeSpec | str | None = None,
    parent_run: str | None = None,
    run_id: str | None = None,
    *,
    t0_ns: int | None = None,
    senders: int = 1,
    steps_per_message: int = 1,
    hwm: int = 2000,
    send_timeout_s: float = 10.0,
    stop: threading.Event | None = None,
    on_step: Callable[[StepTables], None] | None = None,
    argv: list[str] | None = None,
    stop_linger_s: float = 0.0,
    curve: ClientCurve | None = None,
    relays: Sequence[str] | None = None,
    delivered: Callable[[int], bool] | None = None,
    deliver_wait_s: float = 30.0,
) -> RunInfo:
    """Simulate a job and stream it to a hub through the real collector path.

    Args:
        scenario: the resolved scenario (`load_scenario`).
        endpoint: the hub's data address, e.g. ``tcp://127.0.0.1:5555``.
        steps: steps to run.
        pace: ``None``/``"fast"`` (as fast as possible), ``"realtime"`` (simulated time
            follows the wall clock) or seconds of wall time per step.
        scope: which part of the cluster runs (`ScopeSpec` or scope name; default full).
        parent_run: the run this one is a reduced-scope rerun of.
        run_id: the run's id (default: a fresh one naming scenario, seed and scope).
        t0_ns: hub-clock time of simulated time 0 (default: now). Same scenario, scope and
            ``t0_ns`` give byte-identical tables.
        senders: PUSH sockets shared by all ranks.
        steps_per_message: steps each rank batches into one message (as a collector may
            do); fewer, larger messages cost the hub less, at the price of latency.
        hwm: high-water mark of each socket, in messages.
        send_timeout_s: how long one message may wait for room before it is dropped.
        stop: set it to end the run after the current step.
        on_step: called with each step's tables once they are handed to the senders.
        argv: command line recorded in the manifest.
        stop_linger_s: once ``stop`` is set, how long what is still queued may take to
            leave (0: given up at once; the demo's quit key waits a little so what the
            run counts as sent reaches its hub).
        curve: CURVE keys for a hub that requires them
            (`rankscope.collector.security.client_curve_from_env`), or None for plain
            ZeroMQ.
        relays: data addresses of node relays (`rankscope.hub.relay`): each rank sends to
            the relay of its host (host index modulo their number), as a collector started
            by ``rankscope run --relay`` does, and ``endpoint`` and ``senders`` are not
            used. The relays' keys, not ``curve``, reach the hub.
        delivered: given the number of messages sent, whether the receiving end has taken
            them all in (a demo's own hub). The senders are closed only once it says so,
            or after ``deliver_wait_s``: ZeroMQ may lose what is still in flight to a
            receiver that is behind (a relay reducing more ranks than its cores keep up
            with) when the sending socket closes, whatever its linger.
        deliver_wait_s: longest wait for ``delivered``.

    Returns:
        What was sent.

    Raises:
        ValueError: bad steps, pace, scope or endpoint.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    if not isinstance(senders, int) or senders < 1:
        raise ValueError(f"senders must be a positive int, got {senders!r}")
    if not isinstance(steps_per_message, int) or steps_per_message < 1:
        raise ValueError(f"steps_per_message must be a positive int, got {steps_per_message!r}")
    per_step = _parse_pace(pace)
    t0 = time.time_ns() if t0_ns is None else int(t0_ns)
    cluster = Cluster(scenario, scope, t0_ns=t0, argv=argv)
    spec = ScopeSpec.coerce(scope)
    run_name = run_id or default_run_id(scenario, spec.scope)
    job = scenario.job
    ctx = zmq.Context()
    socks: list[Sender] = []
    wall0 = time.monotonic()
    try:
        route = None
        if relays:
            # A node's ranks talk to their node's relay, on the node: no keys.
            for address in relays:
                socks.append(Sender(address, hwm, context=ctx))
            host = np.asarray(cluster.layout.host)
            route = np.unique(host, return_inverse=True)[1].reshape(-1) % len(relays)
        else:
            for _ in range(senders):
                # One at a time: a sender built before a later one fails is still closed.
                socks.append(Sender(endpoint, hwm, context=ctx, curve=curve))
        emit = Emitter(socks, send_timeout_s, stop, route)
        streams = RankStreams(
            cluster,
            emit,
            run_id=run_name,
            scope=spec.scope,
            parent_run=parent_run,
            steps_per_message=steps_per_message,
            # Each node's relay learns the node's groups, as real collectors tell it.
            node_groups=bool(relays),
        )
        streams.start()
        for k in range(steps):
            if stop is not None and stop.is_set():
                break
            tables = cluster.step(k)
            if per_step is not None:
                if per_step == 0.0:
                    due = (int(tables.steps["t_end"].max()) - t0) / 1e9
                else:
                    due = (k + 1) * per_step
                _sleep_until(wall0 + due, stop)
            streams.add(tables)
            if on_step is not None:
                on_step(tables)
        streams.finish()
        if delivered is not None:
            deadline = time.monotonic() + deliver_wait_s
            while not delivered(emit.messages) and time.monotonic() < deadline:
                if stop is not None and stop.is_set():
                    break
                time.sleep(0.02)
    finally:
        # A stopped run waits at most stop_linger_s for what is still queued; otherwise wait
        # (bounded) until every message is handed to the network.
        stopped = stop is not None and stop.is_set()
        linger_ms = int((stop_linger_s if stopped else send_timeout_s) * 1000)
        for s in socks:
            s.close(linger_ms=linger_ms)
        # destroy, not term: term waits for every socket of the context to be closed, so
        # one left open would hold the run for ever; the senders closed above keep their
        # bounded linger.
        ctx.destroy(linger=0)
    return RunInfo(
        job=job,
        run=run_name,
        scope=spec.scope,
        parent_run=parent_run,
        world_size=cluster.layout.world_size,
        steps=streams.steps_done,
        messages=emit.messages,
        bytes=emit.bytes,
        dropped=emit.dropped,
        retries=emit.retries,
        wall_s=time.monotonic() - wall0,
        truth=cluster.truth,
    )


def _sleep_until(deadline: float, stop: threading.Event | None) -> None:
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (stop is not None and stop.is_set()):
            return
        if stop is not None:
            stop.wait(min(left, 0.25))
        else:
            time.sleep(min(left, 0.25))


def iter_messages(
    scenario: Scenario,
    steps: int,
    scope: ScopeSpec | str | None = None,
    *,
    run_id: str = "sim",
    t0_ns: int = 0,
    steps_per_message: int = 1,
) -> list[bytes]:
    """Every message a run would send, without a socket (tests, determinism checks).

    Args:
        scenario: the resolved scenario.
        steps: steps to simulate.
        scope: which part of the cluster runs.
        run_id: the run id in each header.
        t0_ns: hub-clock time of simulated time 0.
        steps_per_message: steps each rank batches into one message.

    Returns:
        The encoded messages in sending order.
    """
    out: list[bytes] = []

    class _Collect:
        def send(
            self, data: bytes, timeout_ms: float = 0, *, cancel: threading.Event | None = None
        ) -> bool:
            out.append(data)
            return True

    cluster = Cluster(scenario, scope, t0_ns=t0_ns)
    spec = ScopeSpec.coerce(scope)
    streams = RankStreams(
        cluster,
        Emitter([_Collect()], 0.0, None),
        run_id=run_id,
        scope=spec.scope,
        steps_per_message=steps_per_message,
    )
    streams.start()
    for k in range(steps):
        streams.add(cluster.step(k))
    streams.finish()
    return out
