"""The collector's background thread: drain the rings, encode, send, keep the clock.

Everything that costs more than a few hundred nanoseconds happens here, off the training
thread: turning ring rows into columnar ``steps`` messages, converting local monotonic
times to the hub clock, clock pings, hello/groups/stats messages and host/device samples.
It never waits on the hub: sends are non-blocking and a full queue drops and counts.

Each wake-up has a fixed cost that dwarfs the work per row (on a busy host the thread
wakes with cold caches and competes for the GIL), so the thread wakes rarely and ships
many steps at once: when a step ends and at least ``flush_interval_s`` has passed since
the last shipment (the training thread signals it through a pipe, at most once per
shipment), and otherwise every ``IDLE_FLUSHES`` intervals (rows of a long step, samples).
Clock answers and connection changes wake it too; nothing else does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from rankscope.collector import nvml, schema
from rankscope.collector.clock import ClockSync, clock_endpoint
from rankscope.collector.heartbeat import Heartbeat
from rankscope.collector.manifest import build_manifest
from rankscope.collector.security import ClientCurve
from rankscope.collector.sender import Sender

if TYPE_CHECKING:
    from rankscope.collector.monitor import Monitor

FLAG_PENDING = 1 << 30
"""Internal flag on a ring row still waiting for a completion or device time; never sent."""

HOLD_NS = 1_000_000_000
"""Rows of a step that has not ended wait this long for it before being shipped anyway."""

INCOMPLETE_NS = 30_000_000_000
"""A collective still pending after this long is shipped without an exit time."""

MAX_BATCH_ROWS = 100_000
"""Rows of one table in one message (well under ``schema.MAX_ROWS``)."""

HELLO_EVERY_S = 30.0
"""Hello and groups are sent again this often, besides at once after a reconnect: a
restarted hub learns them within this long even if the reconnect went unseen."""

STATS_EVERY_S = 5.0

IDLE_FLUSHES = 4
"""Without step ends, rows are shipped every ``IDLE_FLUSHES * flush_interval_s``."""

_NEVER = 1 << 62

_COLL_TIMES = ("t_enter", "t_start", "t_end", "t_exit")


def to_hub_clock(col: np.ndarray, offset_ns: int) -> np.ndarray:
    """Shift local monotonic times to the hub clock, keeping ``NO_TIME`` as it is."""
    out = col.astype(np.int64, copy=True)
    known = out != schema.NO_TIME
    out[known] += offset_ns
    return out


def shippable(
    step: np.ndarray,
    t_ref: np.ndarray,
    pending: np.ndarray | None,
    last_ended: int,
    now_ns: int,
    final: bool,
) -> int:
    """How many leading rows may be shipped now.

    A row waits while it is pending (no exit or device time yet) or belongs to a step that
    has not ended — but only for a while: a step with no end mark or a collective that
    never completes must not hold the ring forever.

    Args:
        step: step column of the unread rows, in write order.
        t_ref: local time of each row (entry or phase end).
        pending: bool mask of rows still waiting for data, or None.
        last_ended: highest step id that has ended (-2**62 when none).
        now_ns: current local time.
        final: ship everything (the monitor is closing).

    Returns:
        The length of the shippable prefix.
    """
    n = int(step.shape[0])
    if final or n == 0:
        return n
    waiting = (step > last_ended) & (t_ref > now_ns - HOLD_NS)
    if pending is not None:
        waiting |= pending & (t_ref > now_ns - INCOMPLETE_NS)
    if not waiting.any():
        return n
    return int(np.argmax(waiting))


class Pump:
    """Owns the sockets and the background thread of one ``Monitor``."""

    def __init__(
        self,
        monitor: Monitor,
        endpoint: str,
        *,
        hwm: int,
        flush_interval_s: float,
        clock_sync: bool,
        now: Callable[[], int] = time.monotonic_ns,
        curve: ClientCurve | None = None,
    ) -> None:
        self.mon = monitor
        self.endpoint = endpoint
        self.curve = curve
        self.hwm = hwm
        self.flush_ns = max(1, int(flush_interval_s * 1e9))
        self.idle_ns = IDLE_FLUSHES * self.flush_ns
        self._now = now
        self._clock_ep = clock_endpoint(endpoint) if clock_sync else None
        self.clock = ClockSync(None, now=now)
        self.sender: Sender | None = None
        self.batch = 0
        self.incomplete = 0
        self._malformed = 0
        """Ring rows read with a value shipped as unknown, already counted as errors."""
        self.sent_rows = 0
        self.wakes = 0
        """Times the thread woke up (its cost is mostly per wake)."""
        self.cpu_s = 0.0
        """CPU seconds this thread has used (the collector's own cost, off the hot path)."""
        self.tasks: list[Callable[[], None]] = []
        """Extra work run on every wake (e.g. resolving CUDA events)."""
        self.hold: Callable[[Any, int], int] | None = None
        """Rows a device-time source still waits for: given the unread collective rows and
        the local time, how many leading ones may ship (`collector.inspector_tail`)."""
        self.extra_manifest: dict[str, Any] = {}
        """Manifest fields added to the built manifest (the device-time source)."""
        self.wake_after_ns = _NEVER
        """A step ending at or after this local time wakes the thread to ship it (read on
        the training thread; the pump moves it on after each shipment)."""
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._wake_now = False
        self._resend_hello = False
        self._linger_ms = 1000
        self._identity_enriched = False
        self.manifest: dict[str, Any] | None = None
        """Built once on this thread (it may run ``git``); reset when the job config changes."""
        self._thread: threading.Thread | None = None
        self._groups_sent = -1
        self._ctx: zmq.Context | None = None
        self.heartbeat = Heartbeat(monitor, self)
        """Beats on this thread, whatever the training loop does (`collector.heartbeat`)."""

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon thread; sockets are created on it."""
        try:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        except OSError as exc:  # no pipe: the thread still ships on its timer
            self.mon._error("wake_pipe", exc)
            self._wake_r = self._wake_w = None
        self._thread = threading.Thread(target=self._run, name="rankscope-pump", daemon=True)
        self._thread.start()

    def step_ended(self, t: int) -> None:
        """Training thread, at each step end: wake the pump when a shipment is due.

        Costs one comparison, plus a one-byte pipe write at most once per shipment.

        Args:
            t: the step's end time (local monotonic ns).
        """
        if t >= self.wake_after_ns:
            # Once per shipment: the pump sets the next due time when it has shipped.
            self.wake_after_ns = _NEVER
            self.wake()

    def wake(self) -> None:
        """Wake the thread now and ship at this pass."""
        self._wake_now = True
        fd = self._wake_w
        if fd is not None:
            try:
                os.write(fd, b"\x01")
            except OSError:  # full (a wake is already pending) or closed
                pass

    def stop(self, timeout_s: float = 3.0) -> None:
        """Final flush, stats, close the sockets; waits at most ``timeout_s``."""
        # Half the budget may go to flushing what ZeroMQ still holds for an absent hub.
        self._linger_ms = int(min(1.0, max(0.0, timeout_s) / 2) * 1000)
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            self.wake()
            t.join(timeout_s)
        elif t is None:
            self._closed.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abandon(self) -> None:
        """Forget the sockets without touching them (after ``fork``: they belong to the parent)."""
        self.sender = None
        self.clock.socket = None
        self._thread = None
        self._stop.set()
        self._close_pipe()

    def _close_pipe(self) -> None:
        fds = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = None
        for fd in fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _drain_pipe(self) -> None:
        fd = self._wake_r
        if fd is not None:
            try:
                os.read(fd, 4096)
            except OSError:  # nothing there (a spurious wake)
                pass

    # -- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        mon = self.mon
        try:
            # A private context: a job that forks or terminates the shared one cannot stall us.
            self._ctx = zmq.Context()
            self.sender = Sender(
                self.endpoint,
                self.hwm,
                context=self._ctx,
                linger_ms=1000,
                curve=self.curve,
                watch=True,
            )
            if self._clock_ep is not None:
                self.clock = ClockSync(
                    self._clock_ep, context=self._ctx, now=self._now, curve=self.curve
                )
        except Exception as exc:
            mon._error("sockets", exc)
            self._closed.set()
            return
        sender = self.sender
        clock = self.clock
        poller = zmq.Poller()
        if clock.socket is not None:
            poller.register(clock.socket, zmq.POLLIN)
        link = sender.watch()
        if link is not None:
            poller.register(link, zmq.POLLIN)
        pipe = self._wake_r
        if pipe is not None:
            poller.register(pipe, zmq.POLLIN)
        sampler = mon._sampler
        sample_ns = int(sampler.interval_s * 1e9) if sampler is not None else 0
        now = self._now()
        next_flush = now
        next_hello = now
        next_stats = now + int(STATS_EVERY_S * 1e9)
        next_sample = now + sample_ns if sampler is not None else _NEVER
        ready: dict[Any, int] = {}
        while True:
            stopping = self._stop.is_set()
            self.wakes += 1
            try:
                now = self._now()
                if pipe is not None and pipe in ready:
                    self._drain_pipe()
                if link is not None and link in ready and sender.read_events():
                    # The hub came back, maybe as a fresh process that knows nothing of
                    # this rank: identity and groups first, then the rows held meanwhile.
                    self._resend_hello = True
                    self._wake_now = True
                    clock.restart()
                # While the hub is away, rows wait in the rings (bounded; full rings drop
                # and count) instead of queueing behind a hello the next hub never saw.
                held = sender.connected is False and not stopping
                if not held and (now >= next_hello or self._resend_hello):
                    self._resend_hello = False
                    self._enrich_identity()
                    self._send_hello()
                    self._groups_sent = -1
                    next_hello = now + int(HELLO_EVERY_S * 1e9)
                if not held and self._groups_sent != mon._groups_version:
                    self._send_groups()
                if clock.socket is not None and (
                    clock.socket in ready or now >= clock.next_due_ns()
                ):
                    clock.tick()
                for task in self.tasks:
                    task()
                beat = self.heartbeat
                if not held and (stopping or now >= beat.next_ns):
                    beat.beat(now, final=stopping)
                if sampler is not None and (stopping or now >= next_sample):
                    self._sample(sampler)
                    next_sample = now + sample_ns
                if not held and (stopping or now >= next_flush or self._wake_now):
                    self._wake_now = False
                    self._flush(final=stopping)
                    next_flush = now + self.idle_ns
                    self.wake_after_ns = now + self.flush_ns
                self.cpu_s = time.thread_time()
                if not held and (stopping or now >= next_stats):
                    self._send_stats()
                    next_stats = now + int(STATS_EVERY_S * 1e9)
            except Exception as exc:  # keep pumping: a bad batch must not stop the stream
                mon._error("pump", exc)
            if stopping:
                break
            # Samples and stats ride on wake-ups that happen anyway; they get one of their
            # own only when a whole extra interval late (no step has ended meanwhile).
            due = min(
                next_flush,
                next_hello,
                next_stats + self.idle_ns,
                next_sample + sample_ns,
                clock.next_due_ns(),
                self.heartbeat.next_ns,
            )
            wait_ms = max(1, min(self.idle_ns, due - self._now()) // 1_000_000)
            if poller.sockets:
                ready = dict(poller.poll(wait_ms))
            else:
                self._stop.wait(wait_ms / 1000)
        self._shutdown()

    def _sample(self, sampler: Any) -> None:
        c0 = time.thread_time()
        try:
            sampler.sample_once()
        except Exception as exc:  # a sampler failure must not end sampling or shipping
            self.mon._error("sampler", exc)
        sampler.cpu_s += time.thread_time() - c0

    def _shutdown(self) -> None:
        try:
            self.clock.close()
            if self.sender is not None:
                self.sender.close(linger_ms=self._linger_ms)
        except Exception as exc:
            self.mon._error("close", exc)
        try:
            if self._ctx is not None:
                # destroy, not term: term waits for every socket of the context to be
                # closed, so one left open by a failed close above would hold the exit for
                # ever. destroy closes any such socket without linger, then terminates;
                # the sockets closed above keep their own bounded linger.
                self._ctx.destroy(linger=0)
        except Exception as exc:
            self.mon._error("close", exc)
        self._close_pipe()
        self._closed.set()

    # -- messages --------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        self.batch += 1
        mon = self.mon
        return {
            "job": mon.job,
            "run": mon.run,
            "rank": mon.identity.rank,
            "inc": mon.identity.incarnation,
            "batch": self.batch,
        }

    def _enrich_identity(self) -> None:
        # NVML initialisation can take a noticeable time; it runs here, not in start().
        if self._identity_enriched:
            return
        self._identity_enriched = True
        mon = self.mon
        ident = mon.identity
        if ident.gpu_index is not None and ident.gpu_uuid is None:
            info = nvml.device_info(ident.gpu_index)
            mon.identity = replace(
                ident,
                gpu_uuid=info.get("gpu_uuid"),
                pci_bus=info.get("pci_bus"),
                numa_node=info.get("numa_node"),
            )

    def _manifest(self) -> dict[str, Any]:
        if self.manifest is None:
            self.manifest = build_manifest(self.mon.job_config, self.mon.identity.gpu_index)
            self.manifest.update(self.extra_manifest)
        return self.manifest

    def _send(self, data: bytes) -> None:
        if self.sender is not None:
            self.sender.send(data)

    def _send_hello(self) -> None:
        mon = self.mon
        self._send(
            schema.hello_message(
                self._header(),
                mon.identity.hello_fields(),
                scope=mon.scope,
                parent_run=mon.parent_run,
                manifest=self._manifest(),
                t_start_ns=self.clock.to_hub(mon.t_start_local),
            )
        )

    def _send_groups(self) -> None:
        version, groups = self.mon._groups_snapshot()
        self._send(schema.groups_message(self._header(), groups))
        self._groups_sent = version

    def _send_stats(self) -> None:
        stats = self.mon.stats()
        self._send(schema.stats_message(self._header(), stats))

    def _flush(self, final: bool) -> None:
        mon = self.mon
        sampler = mon._sampler
        if not (len(mon._colls) or len(mon._phases) or len(mon._steps)) and (
            sampler is None or not sampler.pending
        ):
            return  # nothing to ship: skip the column work
        now = self._now()
        offset = self.clock.offset_ns
        while True:
            last_ended = mon._last_ended
            steps = mon._steps.unread(MAX_BATCH_ROWS)
            colls = mon._colls.unread(MAX_BATCH_ROWS)
            phases = mon._phases.unread(MAX_BATCH_ROWS)
            malformed = mon._colls.malformed + mon._phases.malformed + mon._steps.malformed
            while self._malformed < malformed:
                self._malformed += 1
                mon._error("malformed_row", ValueError("a value did not fit its column"))
            pending = (colls["t_exit"] == schema.NO_TIME) | ((colls["flags"] & FLAG_PENDING) != 0)
            nc = shippable(colls["step"], colls["t_enter"], pending, last_ended, now, final)
            if self.hold is not None and not final and nc:
                nc = min(nc, self.hold(colls[:nc], now))
            np_ = shippable(phases["step"], phases["t1"], None, last_ended, now, final)
            ns = len(steps)
            if ns == 0 and nc == 0 and np_ == 0:
                break
            c = colls[:nc]
            self.incomplete += int(pending[:nc].sum())
            coll_cols = {name: c[name] for name in schema.COLL_COLUMNS}
            for name in _COLL_TIMES:
                coll_cols[name] = to_hub_clock(c[name], offset)
            coll_cols["flags"] = c["flags"] & ~FLAG_PENDING
            s = steps[:ns]
            step_cols = {name: s[name] for name in schema.STEP_COLUMNS}
            step_cols["t_start"] = to_hub_clock(s["t_start"], offset)
            step_cols["t_end"] = to_hub_clock(s["t_end"], offset)
            p = phases[:np_]
            phase_cols = {name: p[name] for name in schema.PHASE_COLUMNS}
            phase_cols["t0"] = to_hub_clock(p["t0"], offset)
            phase_cols["t1"] = to_hub_clock(p["t1"], offset)
            data = schema.steps_message(
                self._header(),
                step_cols,
                phases=phase_cols,
                colls=coll_cols,
                phase_names=mon._user_phase_names(),
            )
            self._send(data)
            self.heartbeat.note_shipped(s["t_end"], c["t_exit"])
            self.sent_rows += ns + nc + np_
            mon._steps.consume(ns)
            mon._colls.consume(nc)
            mon._phases.consume(np_)
            if ns < MAX_BATCH_ROWS and nc < MAX_BATCH_ROWS and np_ < MAX_BATCH_ROWS:
                break
        samples = mon._sampler.drain() if mon._sampler is not None else None
        if samples is not None:
            samples["t"] = to_hub_clock(samples["t"], offset)
            self._send(schema.samples_message(self._header(), samples))
