"""``Monitor``: the in-rank API that marks steps, phases, work and collectives.

The hot path (the torch wrappers, ``collective`` and ``phase`` spans, step ends) stamps
``time.monotonic_ns()`` and stores one row, a small tuple, in a slot of a preallocated ring
— no lock, no system call beyond the clock reads. Phase spans and steps also read the
training thread's CPU clock (``time.thread_time_ns()``) at both ends, for their ``cpu_ns``;
steps take their GC pauses from the process's `gc_pauses.CLOCK`. A background ``Pump``
drains the rings into columnar messages. Every method swallows its own failures: an error is counted by
reason, logged once, and reported in the ``stats`` messages; it never reaches the training
loop.

Step attribution: a collective or phase belongs to the step that is open when it starts;
between ``end_step`` and the next ``begin_step`` it belongs to the next step.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from rankscope.collector import schema
from rankscope.collector.gc_pauses import CLOCK as GC_CLOCK
from rankscope.collector.identity import Identity
from rankscope.collector.pump import FLAG_PENDING, Pump
from rankscope.collector.ring import Ring
from rankscope.collector.runqueue import wait_ns as _runq
from rankscope.collector.sampling import Sampler
from rankscope.collector.security import ClientCurve
from rankscope.collector.spans import CollectiveSpan, PhaseSpan, StepSpan

log = logging.getLogger("rankscope")

NO_TIME = schema.NO_TIME
_NEVER = -(1 << 62)
MAX_USER_PHASES = 1024
MAX_GROUP_ID = (1 << 31) - 1

DDP_BUCKET_MODES = ("auto", "every", "sampled", "tail", "off")
"""How DDP's gradient all-reduce is timed (``rankscope.start(ddp_buckets=...)``; the
mechanisms and their costs are in ``torch_ddp``):

- ``auto`` (default): ``tail`` for a model on the CPU, ``every`` on a GPU.
- ``every``: a comm hook times every bucket of every step.
- ``sampled``: the same hook, recording the buckets of one step in ``ddp_sample_every``.
- ``tail``: no hook; one row per backward, for the wait at its end (CPU only; a GPU model
  gets ``every``).
- ``off``: no hook, and nothing of DDP's all-reduce is recorded.
"""

DDP_SAMPLE_EVERY = 10
"""Default ``ddp_sample_every``: with ``ddp_buckets="sampled"``, buckets of one step in ten."""

_OP_INDEX = schema.OP_INDEX
_OTHER = schema.OP_INDEX["other"]
_NO_WORK = (-1, -1, -1, math.nan, math.nan, -1)
"""A step's work before the program reports any (``work`` copies it on first use): the
``WORK`` columns of ``schema.STEP_COLUMNS`` in order, ``expert_tokens`` last."""
_INT_WORK = (0, 1, 2, 5)
"""Indices of the counted work columns (tokens, valid_tokens, samples, expert_tokens)."""
_cpu = time.thread_time_ns
_thread = threading.get_ident
_NO_MEM = (-1, -1, -1, -1)


_INT64_END = 1 << 63
_QUEUE_FRESH_NS = 1_000_000
"""A step that begins within this of the previous step's end, on its thread, starts from
the run-queue delay read there: one read a step."""


def _is_step(step: object) -> bool:
    """Whether a program's step id is usable: an int64 >= 0 (a bool is not)."""
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step < _INT64_END


def op_index(op: str | int) -> int:
    """Index of an op name in ``schema.OPS`` (unknown names map to ``other``)."""
    if isinstance(op, int) and 0 <= op < len(schema.OPS):
        return op
    return _OP_INDEX.get(op, _OTHER) if isinstance(op, str) else _OTHER


class Monitor:
    """One rank's collector. Create it with ``rankscope.start``.

    Attributes:
        job, run, scope, parent_run: which run this rank belongs to.
        identity: this rank's identity (``hello`` fields).
        enabled: False when the monitor could not start; every method is then a no-op.
    """

    def __init__(
        self,
        *,
        job: str,
        run: str,
        identity: Identity,
        hub: str,
        scope: str = "full",
        parent_run: str | None = None,
        job_config: Mapping[str, Any] | None = None,
        capacity: int = 1 << 16,
        hwm: int = 1000,
        flush_interval_s: float = 0.5,
        sample_interval_s: float = 1.0,
        clock_sync: bool = True,
        enabled: bool = True,
        ddp_buckets: str = "auto",
        ddp_sample_every: int = DDP_SAMPLE_EVERY,
        curve: ClientCurve | None = None,
    ) -> None:
        """Build a monitor; ``start()`` launches its threads (``rankscope.start`` does both).

        Args:
            job, run, scope, parent_run: run identity (validated by ``rankscope.start``).
            identity: this rank's identity.
            hub: hub data address.
            job_config: the user's configuration, sent in the manifest.
            capacity: rows per ring (collectives; steps and phases get a fraction).
            hwm: send high-water mark in messages.
            flush_interval_s: shortest time between two shipments: a step end ships once
                this long has passed since the last one; without step ends, rows ship
                every four intervals.
            sample_interval_s: device/host sampling period (0 turns sampling off).
            clock_sync: ping the hub's clock service (else wall-clock fallback only).
            enabled: False builds an inert monitor.
            ddp_buckets: how DDP gradient buckets are timed, one of ``DDP_BUCKET_MODES``.
            ddp_sample_every: with ``ddp_buckets="sampled"``, record the buckets of the
                steps whose number is a multiple of this.
            curve: CURVE keys for the connection to the hub, or None for plain ZeroMQ.

        Raises:
            ValueError: on a ``ddp_buckets`` or ``ddp_sample_every`` it cannot use.
        """
        if ddp_buckets not in DDP_BUCKET_MODES:
            raise ValueError(
                f"ddp_buckets {ddp_buckets!r} is not one of {', '.join(DDP_BUCKET_MODES)}"
            )
        if (
            not isinstance(ddp_sample_every, int)
            or isinstance(ddp_sample_every, bool)
            or ddp_sample_every < 1
        ):
            raise ValueError(f"ddp_sample_every must be an int >= 1, got {ddp_sample_every!r}")
        self.ddp_buckets = ddp_buckets
        """How DDP gradient buckets are timed (read when a model's hook is registered)."""
        self.ddp_sample_every = ddp_sample_every
        self.job = job
        self.run = run
        self.scope = scope
        self.parent_run = parent_run
        self.identity = identity
        self.hub = hub
        self.enabled = enabled
        self.job_config = dict(job_config or {})
        self.t_start_local = time.monotonic_ns()
        self._colls = Ring(schema.COLL_COLUMNS, capacity)
        self._phases = Ring(schema.PHASE_COLUMNS, max(1024, capacity // 4))
        self._steps = Ring(schema.STEP_COLUMNS, max(256, capacity // 64))
        self._seq: dict[int, int] = {}
        self._open = False
        self._auto = False
        self._step = 0
        self._next_step = 0
        self._t_step = 0
        self._c_step = 0
        """Training-thread CPU clock at the open step's start."""
        self._q_step = -1
        """Its run-queue delay then (`runqueue.wait_ns`; -1 unknown)."""
        self._q_last = (-1, 0, 0)
        """The last step end's (run-queue delay, local time, thread): a step that begins
        on the same thread within `_QUEUE_FRESH_NS` of it starts from it."""
        self._step_thread = 0
        """Thread that opened the step (its CPU clock means nothing on another)."""
        self._gc_ns0 = 0
        self._gc_n0 = 0
        self._gc = False
        """The GC callback is registered for this monitor (else gc columns are unknown)."""
        self._last_ended = _NEVER
        self._work: tuple[float, ...] | list[float] = _NO_WORK
        self._mem = _NO_MEM
        self._heads_at_begin = (0, 0, 0)
        self.memory_probe: Callable[[], tuple[int, int, int, int]] | None = None
        """Returns (allocated, reserved, peak, allocator retries) at each step end."""
        self._user_phases: dict[str, int] = {}
        self.user_backward = False
        """The program marks ``backward`` itself: the torch hooks then leave it alone."""
        self._phase_ids = dict(schema.PHASE_INDEX)
        self._groups: dict[int, dict[str, Any]] = {}
        self._groups_version = 0
        self._lock = threading.Lock()
        self._errors: dict[str, int] = {}
        self._closed = False
        self._sampler: Sampler | None = None
        self._sample_interval_s = sample_interval_s
        self.inspector: Any = None
        """The NCCL Inspector tail when the plugin is on (`collector.inspector_tail`)."""
        self.pump = Pump(
            self,
            hub,
            hwm=hwm,
            flush_interval_s=flush_interval_s,
            clock_sync=clock_sync,
            curve=curve,
        )
        if enabled:
            self.register_group(
                0, "world", range(identity.world_size), backend="", desc="default group"
            )

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Monitor:
        """Start the background threads (sender, sampler). Returns self."""
        if not self.enabled or self.pump.running:
            return self
        if not self._gc:
            self._gc = GC_CLOCK.acquire()
        if self._sample_interval_s > 0:
            # Sampled on the pump's thread, on its wake-ups: no thread of its own to wake.
            self._sampler = Sampler(
                self.identity.gpu_index, interval_s=self._sample_interval_s, on_error=self._error
            )
        self.pump.start()
        return self

    def close(self, timeout_s: float = 3.0) -> None:
        """End an open step that saw activity, ship everything, close the sockets.

        Safe to call twice; called at interpreter exit for the active monitor.

        Args:
            timeout_s: bound on the final flush.
        """
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        hooks = sys.modules.get("rankscope.collector.torch_hooks")
        if hooks is not None and hooks._state.mon is self:
            hooks.uninstall()
        try:
            if self._open:
                if self._activity_since_begin():
                    self.end_step()
                self._open = False
        except Exception as exc:
            self._error("close", exc)
        if self._gc:
            self._gc = False
            GC_CLOCK.release()
        self.pump.stop(timeout_s)
        self.enabled = False

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _after_fork_in_child(self) -> None:
        # The child of a fork (a DataLoader worker) has none of our threads, and the
        # sockets belong to the parent: go inert without touching them.
        self.enabled = False
        self._closed = True
        self.pump.abandon()
        self._sampler = None
        if self._gc:
            self._gc = False
            GC_CLOCK.release()

    # -- steps -----------------------------------------------------------------------
    def begin_step(self, step: int | None = None) -> None:
        """Mark the start of a training step (ends the previous one if still open).

        Args:
            step: step id; by default one more than the previous.
        """
        if not self.enabled:
            return
        t = time.monotonic_ns()
        c = _cpu()
        if self._auto and self._open and self._last_ended == _NEVER:
            self._adopt_setup(step)
        self._auto = False
        self._begin(step, t, c)

    def _adopt_setup(self, step: int | None) -> None:
        """The program marks its first step while a step the collector opened by itself is
        open: that step was setup (a parameter broadcast, a first barrier), not one of the
        program's. It gets no row of its own (its id would repeat the program's first,
        and the hub would keep one of the two), and the rows it holds count in the
        program's first step."""
        setup = self._step
        self._open = False
        self._next_step = setup  # numbering continues from where the setup step began
        if not _is_step(step) or step == setup:
            return
        since_colls, since_phases, _ = self._heads_at_begin
        for ring, since in ((self._colls, since_colls), (self._phases, since_phases)):
            for i in range(max(since, ring.tail), ring.head):
                if ring.get_field(i, "step") == setup:
                    ring.set_field(i, "step", step)

    def _begin(self, step: int | None, t: int, c: int = -1) -> None:
        """Open a step at local time ``t``; ``c``: the thread CPU clock then (-1: read it)."""
        if c < 0:
            c = _cpu()
        if self._open:
            self._end(t, c)
        if step is None:
            step = self._next_step
        elif not _is_step(step):
            self._error("bad_step", ValueError(f"step must be an int64 >= 0, got {step!r}"))
            step = self._next_step
        self._step = step
        self._next_step = step + 1
        self._t_step = t
        self._c_step = c
        thread = _thread()
        q, t_q, q_thread = self._q_last
        self._q_step = q if q_thread == thread and t - t_q <= _QUEUE_FRESH_NS else _runq()
        self._step_thread = thread
        gcc = GC_CLOCK
        self._gc_ns0 = gcc.ns
        self._gc_n0 = gcc.count
        self._open = True
        # Shared constants, not fresh objects: a step the program reports no work or
        # memory for allocates nothing.
        self._work = _NO_WORK
        self._mem = _NO_MEM
        colls = self._colls
        self._heads_at_begin = (colls.head, self._phases.head, colls.dropped)

    def _activity_since_begin(self) -> bool:
        w = self._work
        return (
            (self._colls.head, self._phases.head, self._colls.dropped) != self._heads_at_begin
            or w[0] >= 0
            or w[1] >= 0
            or w[2] >= 0
            or not math.isnan(w[3])
            or w[5] >= 0
        )

    def end_step(self) -> None:
        """Mark the end of the open step; its row is shipped at the next flush."""
        if not self.enabled:
            return
        if not self._open:
            self._error("end_without_begin", RuntimeError("end_step() without begin_step()"))
            return
        self._end(time.monotonic_ns())

    def _end(self, t: int, c: int = -1) -> None:
        """Close the open step at local time ``t``; ``c``: the thread CPU clock then (-1:
        read it)."""
        cpu, runq = -1, -1
        if _thread() == self._step_thread:
            cpu = (c if c >= 0 else _cpu()) - self._c_step
            q = _runq()
            if q >= 0 and self._q_step >= 0:
                # Read after ``t``: a preemption in between is the next interval's wait,
                # and no step waits longer than it lasted.
                runq = max(0, min(q - self._q_step, t - self._t_step))
            self._q_last = (q, t, self._step_thread)
        mem = self._mem
        probe = self.memory_probe
        if probe is not None:
            try:
                mem = probe()
            except Exception as exc:
                self._error("memory_probe", exc)
        w = self._work
        step = self._step
        if self._gc:
            gcc = GC_CLOCK
            gc_ns, gc_n = gcc.ns - self._gc_ns0, gcc.count - self._gc_n0
        else:
            gc_ns = gc_n = -1
        ring = self._steps
        h = ring.head
        if h - ring.tail > ring.mask:
            ring.dropped += 1
        else:
            ring.slots[h & ring.mask] = (step, self._t_step, t, *w, *mem, gc_ns, gc_n, cpu, runq)
            ring.head = h + 1
        if step > self._last_ended:
            self._last_ended = step
        self._open = False
        self._step = self._next_step
        pump = self.pump
        if t >= pump.wake_after_ns:
            pump.step_ended(t)

    def step(self, step: int | None = None) -> StepSpan:
        """Context manager around one step: ``with mon.step(): ...``."""
        return StepSpan(self, step)

    def _optimizer_end(self, idx: int, t0: int, t: int, c0: int = -1, c: int = -1) -> None:
        """Optimizer post-step hook: the optimizer phase ``[t0, t]`` (thread CPU clock
        ``c0`` to ``c``, -1 unknown) and, under automatic steps, the step boundary at ``t``
        (the next step opens at once)."""
        self._rec_phase(idx, t0, t, c - c0 if c0 >= 0 and c >= 0 else -1)
        if self._auto and self.enabled:
            if self._open:
                self._end(t, c)
            self._begin(None, t, c)

    def _auto_touch(self) -> None:
        """First activity under auto-instrumentation opens the first step."""
        if self._auto and not self._open and self.enabled:
            self._begin(None, time.monotonic_ns())

    # -- work and memory ---------------------------------------------------------------
    def work(
        self,
        tokens: int | None = None,
        valid_tokens: int | None = None,
        samples: int | None = None,
        attn_cost: float | None = None,
        flops: float | None = None,
        expert_tokens: int | None = None,
    ) -> None:
        """Add work done in the current step (sums over calls, e.g. micro-batches).

        Args:
            tokens: tokens processed, padding included.
            valid_tokens: tokens that count for the loss.
            samples: sequences or examples.
            attn_cost: Σ seq² of the local packed sequences.
            flops: executed floating-point operations, if known.
            expert_tokens: MoE: tokens routed to this rank's local experts (what its
                all-to-all brings in and its experts compute).
        """
        if not self.enabled:
            return
        w = self._work
        if not isinstance(w, list):
            w = self._work = list(_NO_WORK)
        try:
            for i, v in zip(_INT_WORK, (tokens, valid_tokens, samples, expert_tokens)):
                if v is not None:
                    iv = int(v)
                    if iv < 0:
                        raise ValueError(f"work counts must be >= 0, got {v!r}")
                    total = iv if w[i] < 0 else w[i] + iv
                    if total >= _INT64_END:
                        raise ValueError(f"work count {total} does not fit int64")
                    w[i] = total
            for i, f in ((3, attn_cost), (4, flops)):
                if f is not None:
                    fv = float(f)
                    w[i] = fv if math.isnan(w[i]) else w[i] + fv
        except (TypeError, ValueError, OverflowError) as exc:
            self._error("bad_work", exc)

    def memory(
        self,
        allocated: int = -1,
        reserved: int = -1,
        peak: int = -1,
        alloc_retries: int = -1,
    ) -> None:
        """Set the memory figures of the current step (bytes; -1 unknown)."""
        if not self.enabled:
            return
        try:
            mem = (int(allocated), int(reserved), int(peak), int(alloc_retries))
            if any(not -_INT64_END <= v < _INT64_END for v in mem):
                raise ValueError(f"memory figures {mem} do not fit int64")
            self._mem = mem
        except (TypeError, ValueError) as exc:
            self._error("bad_memory", exc)

    # -- phases ----------------------------------------------------------------------
    def _phase_id(self, name: str) -> int:
        if name == "backward":
            self.user_backward = True
        idx = self._phase_ids.get(name)
        if idx is None:
            if not isinstance(name, str) or not name or len(self._user_phases) >= MAX_USER_PHASES:
                self._error("bad_phase", ValueError(f"phase name {name!r} refused"))
                return -1
            with self._lock:
                idx = len(schema.PHASES) + len(self._user_phases)
                self._user_phases[name] = idx
                self._phase_ids[name] = idx
        return idx

    def phase(self, name: str) -> PhaseSpan:
        """Context manager timing one phase of the current step: ``with mon.phase("forward")``.

        Args:
            name: a built-in phase (``schema.PHASES``) or any user name.
        """
        return PhaseSpan(self, self._phase_id(name))

    def record_phase(self, name: str, t0: int, t1: int, cpu_ns: int = -1) -> None:
        """Record a phase span measured elsewhere (``time.monotonic_ns()`` times).

        Args:
            name: phase name.
            t0, t1: the span.
            cpu_ns: CPU time of the training thread inside it (``time.thread_time_ns()``
                difference), -1 unknown.
        """
        try:
            cpu = int(cpu_ns)
            if cpu < -1 or cpu >= _INT64_END:
                raise ValueError(f"cpu_ns must be an int64 >= 0 or -1, got {cpu_ns!r}")
        except (TypeError, ValueError) as exc:
            self._error("bad_phase", exc)
            cpu = -1
        self._rec_phase(self._phase_id(name), int(t0), int(t1), cpu)

    def _rec_phase(self, idx: int, t0: int, t1: int, cpu: int = -1) -> None:
        if idx < 0 or not self.enabled:
            return
        if self._auto and not self._open:
            self._begin(None, t0)
        ring = self._phases
        h = ring.head
        if h - ring.tail > ring.mask:
            ring.dropped += 1
            return
        ring.slots[h & ring.mask] = (self._step, idx, t0, t1, cpu)
        ring.head = h + 1

    def _user_phase_names(self) -> list[str]:
        with self._lock:
            return list(self._user_phases)

    # -- collectives -----------------------------------------------------------------
    def register_group(
        self,
        group_id: int,
        name: str,
        ranks: Iterable[int],
        backend: str = "",
        desc: str = "",
    ) -> None:
        """Declare a process group; collectives refer to it by ``group_id``.

        The id must be the same on every member rank (derive it from something all ranks
        agree on, such as the order groups are created in).

        Args:
            group_id: int in [0, 2**31).
            name: display name (e.g. ``tp``, ``dp``).
            ranks: global ranks in group-rank order.
            backend: ``nccl``, ``gloo``...
            desc: free text.
        """
        if not self.enabled:
            return
        try:
            gid = int(group_id)
            if not 0 <= gid <= MAX_GROUP_ID:
                raise ValueError(f"group id {group_id!r} outside [0, 2**31)")
            members = [int(r) for r in ranks]
            world = self.identity.world_size
            if any(not 0 <= r < world for r in members):
                raise ValueError(f"group {gid} ranks {members[:8]} outside world size {world}")
        except (TypeError, ValueError) as exc:
            self._error("bad_group", exc)
            return
        entry = {
            "id": gid,
            "name": str(name),
            "ranks": members,
            "backend": str(backend),
            "desc": str(desc),
        }
        with self._lock:
            if self._groups.get(gid) != entry:
                self._groups[gid] = entry
                self._groups_version += 1

    def _groups_snapshot(self) -> tuple[int, list[dict[str, Any]]]:
        with self._lock:
            return self._groups_version, [dict(g) for g in self._groups.values()]

    def next_seq(self, group_id: int) -> int:
        """Take the next sequence number of a group (issue order)."""
        s = self._seq.get(group_id, 0)
        self._seq[group_id] = s + 1
        return s

    def collective(self, op: str, group: int = 0, nbytes: int = 0) -> CollectiveSpan:
        """Context manager timing a collective this code issues itself.

        Args:
            op: name in ``schema.OPS``.
            group: registered group id.
            nbytes: this rank's input size in bytes.
        """
        return CollectiveSpan(self, op_index(op), int(group), int(nbytes))

    def record_collective(
        self,
        op: str | int,
        group_id: int,
        seq: int | None = None,
        nbytes: int = 0,
        t_enter: int = NO_TIME,
        t_exit: int = NO_TIME,
        *,
        t_start: int = NO_TIME,
        t_end: int = NO_TIME,
        flags: int = 0,
        step: int | None = None,
    ) -> None:
        """Record a collective measured elsewhere. Times are ``time.monotonic_ns()``.

        Args:
            op: op name or index in ``schema.OPS``.
            group_id: registered group id.
            seq: instance number in the group (next in issue order by default).
            nbytes: this rank's input size.
            t_enter: host issue time; t_exit: host completion time.
            t_start, t_end: device times, when known.
            flags: ``schema.FLAG_*`` bits (``FLAG_MANUAL`` is added).
            step: step id (the current step by default).
        """
        if not self.enabled:
            return
        try:
            gid = int(group_id)
            s = self.next_seq(gid) if seq is None else int(seq)
            if self._auto and not self._open:
                self._begin(None, int(t_enter))
            self._colls.push(
                self._step if step is None else int(step),
                op_index(op),
                gid,
                s,
                int(nbytes),
                int(t_enter),
                int(t_start),
                int(t_end),
                int(t_exit),
                (int(flags) | schema.FLAG_MANUAL) & ~FLAG_PENDING,
            )
        except Exception as exc:
            self._error("bad_collective", exc)

    def _rec_coll(self, op: int, gid: int, nbytes: int, t0: int, t1: int, flags: int) -> int:
        """Hot path: one collective row. Returns the row index (-1 when dropped)."""
        seqs = self._seq
        s = seqs.get(gid, 0)
        seqs[gid] = s + 1
        if not self._open:
            if not self.enabled:
                return -1
            if self._auto:
                self._begin(None, t0)
        ring = self._colls
        h = ring.head
        if h - ring.tail > ring.mask:
            ring.dropped += 1
            return -1
        ring.slots[h & ring.mask] = (
            self._step,
            op,
            gid,
            s,
            nbytes,
            t0,
            NO_TIME,
            NO_TIME,
            t1,
            flags,
        )
        ring.head = h + 1
        return h

    # -- health ----------------------------------------------------------------------
    def _error(self, reason: str, exc: BaseException) -> None:
        n = self._errors.get(reason, 0)
        self._errors[reason] = n + 1
        if n == 0:
            log.warning(
                "rankscope collector: %s: %s: %s (reported once)", reason, type(exc).__name__, exc
            )

    def stats(self) -> dict[str, Any]:
        """The collector's own counters (what ``stats`` messages carry).

        Returns:
            ``dropped_batches`` (messages the sender dropped), ``dropped_events`` (ring
            rows refused when full), ``incomplete_colls``, ``errors`` (reason -> count),
            ``clock_offset_ns``, ``clock_error_ns``, ``clock_synced``, ``sent_batches``,
            ``sent_rows``, ``sampler_dropped``, ``pump_cpu_s`` (CPU seconds of the
            background thread), ``sampler_cpu_s`` (the part of it spent sampling),
            ``pump_wakes``, ``reconnects`` (times the hub came back after the connection
            was lost).
        """
        sender = self.pump.sender
        if self._gc and not GC_CLOCK.registered:
            # The program emptied gc.callbacks: its pauses go unseen from now on, and the
            # steps say so (unknown) rather than report none.
            self._gc = False
            GC_CLOCK.release()
            self._error("gc_callback_removed", RuntimeError("gc.callbacks lost rankscope's clock"))
        errors = dict(self._errors)
        if GC_CLOCK.errors:
            errors["gc_callback"] = GC_CLOCK.errors
        return {
            "dropped_batches": sender.dropped if sender else 0,
            "dropped_events": self._colls.dropped + self._phases.dropped + self._steps.dropped,
            "incomplete_colls": self.pump.incomplete,
            "errors": errors,
            "clock_offset_ns": int(self.pump.clock.offset_ns),
            "clock_error_ns": int(self.pump.clock.error_ns),
            "clock_synced": bool(self.pump.clock.synced),
            "sent_batches": sender.sent if sender else 0,
            "sent_rows": self.pump.sent_rows,
            "sampler_dropped": self._sampler.dropped if self._sampler else 0,
            "pump_cpu_s": round(self.pump.cpu_s, 4),
            "sampler_cpu_s": round(self._sampler.cpu_s, 4) if self._sampler else 0.0,
            "pump_wakes": self.pump.wakes,
            "reconnects": sender.reconnects if sender else 0,
            **({"nccl_inspector": self.inspector.counters()} if self.inspector else {}),
        }

    # -- identity and manifest (called on the pump thread) -----------------------------
    def update_identity(self, **fields: Any) -> None:
        """Change identity fields (e.g. mesh coordinates learnt late); a hello follows."""
        try:
            self.identity = replace(self.identity, **fields)
        except TypeError as exc:
            self._error("bad_identity", exc)
            return
        self.pump._resend_hello = True

    def update_job_config(self, job_config: Mapping[str, Any]) -> None:
        """Merge more job configuration into the manifest; a hello follows."""
        self.job_config.update(job_config)
        self.pump.manifest = None
        self.pump._resend_hello = True
