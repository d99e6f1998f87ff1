"""The live store: what the hub knows about every run, as numpy columns.

Per run the store keeps

- identities, manifests, process groups and the user phase names;
- a dense ring of the last ``history_steps`` steps of every rank: step times, work,
  memory, phase totals and the collective aggregates of ``window.COLL_AGGREGATES``. A step
  older than the ring when it arrives is dropped (counted as ``late_steps``); an evicted step
  keeps living in the lifetime totals (step time, per-rank arrivals);
- collective rows awaiting the rest of their instance (``pending``). They are matched in a
  periodic vectorized pass (:meth:`Store.settle`, `hub.matching`) so ingest only keeps
  references to the message columns; instances whose every member arrived are folded into the
  aggregates and the instance table. An instance still incomplete ``stale_steps`` steps
  after its step is closed as incomplete (a rank died or never sends that group);
- raw collective rows of the last ``raw_steps`` steps, and device/host samples back to the
  oldest step of the ring.

Memory is bounded across runs, not per run: the rings of all runs share one budget of
``max_cells`` rank × step cells (93 bytes each, plus 8 per work, memory or host column and
per phase that some rank reports, 8 more per phase whose CPU time some rank reports, and
24 in a run that relays reduced: `runstate.REDUCED`),
planned by `hub.ringbudget`:

- a new run's ring is sized when it says hello, from what the budget leaves it;
- every run keeps a floor of ``max(16, floor_cells // world)`` steps (a baseline window),
  and the budget covers every floor: a new run is admitted (`Store.admit`) only while the
  floors of all runs, its own included, fit ``max_cells``;
- runs with a recent step share the rest, each up to what it would keep alone
  (``min(history_steps, max_cells // world)``); runs idle for ``idle_s`` of the steps' own
  clock (finished, stalled) keep what is still left, down to the floor;
- a run a viewer is showing (`Store.watch`, within the last ``WATCH_S``) counts as active;
- when the plan asks less of a ring, it is re-allocated smaller keeping its newest steps
  (the others leave as when a full ring evicts: counted in the lifetime totals); when it
  offers an active run a quarter more than it holds, the ring grows. The plan is revisited
  when a run says hello and on every `Store.settle`.

Closed collective instances share one budget too, ``max_instance_rows`` over all runs, in
proportion to the rings' cells (at least `MIN_INSTANCE_ROWS` a run, or an eighth of a
smaller budget): a finished baseline
at its floor gives up its instances to the run under study, and its table the memory.

Beyond the rings: the pending rows of at most ``stale_steps`` steps (more while a rank
that still sends steps lags, `LAG_HOLD_S`, and never older than the ring) and the raw rows
of ``raw_steps`` steps per run; identities and manifests, packed, within the identity budget
(`Store.admit_identity`). The recording is separate and keeps everything.

All methods are thread-safe: the hub's receive thread ingests while viewers read windows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis import arrivals
from rankscope.diagnosis.arrivals import match
from rankscope.diagnosis.assemble import coll_rows, device_means
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    DEVICE_COLUMNS,
    HOST_COLUMNS,
    MEMORY_COLUMNS,
    REDUCED_AGGREGATES,
    WORK_COLUMNS,
    InstanceTable,
    Window,
)
from rankscope.hub.matching import settle
from rankscope.hub.ringbudget import RingClaim, plan
from rankscope.hub.runstate import MAX_INSTANCE_ROWS, REDUCED, RunState, RunSummary

MIN_RING_STEPS = 16
"""Fewest steps a ring holds, whatever the world size and the budget."""
MIN_INSTANCE_ROWS = 65_536
"""Closed instances a run keeps whatever the others hold (a few steps of a large job, all
of a small one's window); the budget's shares start from it."""
WATCH_S = 30.0
"""How long a `Store.watch` keeps a run planned as active after the viewer's last read."""
LAG_HOLD_S = 60.0
"""A rank whose steps lag the run's newest by more than ``stale_steps`` holds its
instances open while it was heard from within this many seconds (on the hub's receive
clock): a sender flushing a backlog then completes them, where closing them at
``stale_steps`` would count complete steps as incomplete twice (the others' rows, then
its own). A rank that sends no steps (silent, or hung and sending only stats) holds nothing: its
instances close as before."""

_INSTANCE_FIELDS = tuple(InstanceTable.__dataclass_fields__)


@dataclass(frozen=True)
class RunTotals:
    """Lifetime figures of a run, beyond the bounded history."""

    steps: np.ndarray
    """int64 step ids seen (ascending)."""
    step_ns: np.ndarray
    """float64 per step: the slowest rank's ``t_end - t_start`` (synchronous progress
    follows the maximum)."""
    ranks_reporting: np.ndarray
    """int32 per step: ranks that reported it."""
    coll_rows: np.ndarray
    """int64 (R,): collective rows received per rank."""
    done_rows: np.ndarray
    """int64 (R,): rows in complete instances per rank."""
    times_last: np.ndarray
    """int64 (R,): complete instances where the rank arrived last."""
    late_ns: np.ndarray
    """float64 (R,): Σ lateness ``t_enter - first`` over complete instances."""
    instances_complete: int
    instances_incomplete: int
    """Instances closed without every member (rank died, or a group never completes)."""


class Store:
    """Live per-run numpy store; the hub's `Intake` feeds it, viewers read `window`."""

    def __init__(
        self,
        *,
        history_steps: int = 512,
        raw_steps: int = 8,
        stale_steps: int = 32,
        settle_rows: int = 250_000,
        max_cells: int = 4_000_000,
        floor_cells: int = 262_144,
        idle_s: float = 120.0,
        max_instance_rows: int = MAX_INSTANCE_ROWS,
    ) -> None:
        """Create an empty store.

        Args:
            history_steps: steps per rank kept densely (the longest window).
            raw_steps: most recent steps whose raw collective rows are kept.
            stale_steps: an instance still incomplete this many steps after its own is
                closed as incomplete.
            settle_rows: rows arrived since the last matching pass that trigger one during
                ingest (the hub also settles on a timer); passes of a few hundred thousand
                rows keep their temporaries in cache.
            max_cells: bound on Σ ranks × ring steps over all runs (see the module
                docstring); a large world keeps fewer steps, at least 16.
            floor_cells: cells a run keeps whatever the others need (at least 16 steps):
                the default holds a 16-step baseline window at 16,384 ranks.
            idle_s: seconds without a new step (on the steps' hub-aligned clock, behind
                the newest step of any run) after which a run gives up ring space first.
            max_instance_rows: closed collective instances the store keeps over all runs
                (~105 bytes each), shared as the ring cells are (`_bound_instances`), the
                newest of each run; their sums stay in the rings whatever is dropped.

        Raises:
            ValueError: a bound out of range.
        """
        if history_steps < 1 or raw_steps < 0 or stale_steps < 1:
            raise ValueError("history_steps and stale_steps must be ≥ 1, raw_steps ≥ 0")
        if max_instance_rows < 1:
            raise ValueError(f"max_instance_rows must be ≥ 1, got {max_instance_rows}")
        if max_cells < 1 or floor_cells < 1 or idle_s < 0:
            raise ValueError(
                f"max_cells ({max_cells}) and floor_cells ({floor_cells}) must be ≥ 1, "
                f"idle_s ({idle_s}) ≥ 0"
            )
        self.history_steps = int(history_steps)
        self.raw_steps = int(raw_steps)
        self.stale_steps = int(stale_steps)
        self.settle_rows = int(settle_rows)
        self.max_cells = int(max_cells)
        self.floor_cells = int(floor_cells)
        self.idle_ns = int(idle_s * 1e9)
        self.max_instance_rows = int(max_instance_rows)
        self._lock = threading.RLock()
        self._runs: dict[str, RunState] = {}
        self._watched: dict[str, float] = {}
        """Run -> monotonic time a viewer last asked to keep it (`watch`)."""
        self._counters: dict[str, Any] = {
            "messages": 0,
            "bytes": 0,
            "events": 0,
            "rejects": {},
            "late_steps": 0,
        }
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self.extra_health: dict[str, Any] = {}
        """Counters from outside the store (recording skips, transport, a recorded hub's
        rejects), merged into `health`."""

    @property
    def message_count(self) -> int:
        """Messages accepted so far (cheap: no lock, no summary)."""
        return int(self._counters["messages"])

    # -- ingest -------------------------------------------------------------------------

    def run_state(self, run: str) -> RunState | None:
        """The state of one run (for validation), or None."""
        return self._runs.get(run)

    def floor_cells_of(self, world: int) -> int:
        """Cells a run of ``world`` ranks keeps whatever the others need (its floor)."""
        want = min(self.history_steps, max(MIN_RING_STEPS, self.max_cells // world))
        return world * min(want, max(MIN_RING_STEPS, self.floor_cells // world))

    def admit(
        self, job: str, world: int, max_runs: int, max_runs_per_job: int
    ) -> tuple[str, str] | None:
        """Whether a new run may be created: None, or ``(reason, detail)`` of a reject.

        The budget covers every run's floor: a run is admitted only while the floors of all
        runs, its own included, fit ``max_cells``.
        """
        with self._lock:
            floor = self.floor_cells_of(world)
            if world * MIN_RING_STEPS > self.max_cells:
                return (
                    "world_too_large",
                    f"identity.world_size = {world}: {MIN_RING_STEPS} steps need "
                    f"{world * MIN_RING_STEPS} cells > the store's max_cells {self.max_cells}",
                )
            if len(self._runs) >= max_runs:
                return ("too_many_runs", f"the store holds {len(self._runs)} runs (max {max_runs})")
            of_job = sum(1 for r in self._runs.values() if r.job == job)
            if of_job >= max_runs_per_job:
                return (
                    "too_many_runs",
                    f"job {job!r} has {of_job} runs (max {max_runs_per_job} per job)",
                )
            held = sum(self.floor_cells_of(r.world_size) for r in self._runs.values())
            if held + floor > self.max_cells:
                return (
                    "store_full",
                    f"a run of {world} ranks needs {floor} floor cells; the other runs' "
                    f"floors hold {held} of max_cells {self.max_cells}",
                )
            return None

    def admit_identity(
        self,
        run: str,
        rank: int,
        identity: Mapping[str, Any],
        packed: bytes,
        max_bytes: int,
    ) -> tuple[str, str] | None:
        """Whether a hello's identity and manifest (``packed``) fit the store's identity
        budget (``max_bytes`` packed, over all runs): None, or ``(reason, detail)``."""
        with self._lock:
            r = self._runs.get(run)
            if r is not None:
                cost = r.identity_cost(rank, identity, packed)
            else:
                cost = len(msgpack.packb(dict(identity), use_bin_type=True)) + len(packed)
            held = self.identity_bytes()
            if cost > 0 and held + cost > max_bytes:
                return (
                    "store_full",
                    f"identity and manifest of rank {rank} ({cost} bytes) beyond the "
                    f"identity budget: {held} of {max_bytes} bytes held",
                )
            return None

    def identity_bytes(self) -> int:
        """Packed bytes of every run's identities and distinct manifests."""
        with self._lock:
            return sum(r.identity_bytes for r in self._runs.values())

    def count_reject(self, reason: str, n: int = 1) -> None:
        with self._lock:
            rejects = self._counters["rejects"]
            rejects[reason] = rejects.get(reason, 0) + n

    def ingest(
        self,
        msg: schema.Message,
        keep_steps: np.ndarray | None = None,
        t_recv_ns: int | None = None,
    ) -> None:
        """Apply one validated message.

        Args:
            msg: decoded message that passed `hub.validate.check`.
            keep_steps: for ``steps`` messages, the mask of step rows to keep (duplicates
                removed); rows of the other steps in the phase and collective tables go too.
            t_recv_ns: the hub's receive time (now when None): when the rank was last
                heard from (the identity rule, the lag hold).
        """
        with self._lock:
            h = msg.header
            heard = time.time_ns() if t_recv_ns is None else int(t_recv_ns)
            self._counters["messages"] += 1
            self._counters["bytes"] += msg.nbytes
            if msg.kind == "hello":
                run = self._runs.get(h["run"])
                if run is None:
                    world = int(h["identity"]["world_size"])
                    started = h.get("t_start_ns")
                    started = started if isinstance(started, int) else schema.NO_TIME
                    history = self._plan((world, started))
                    run = RunState(
                        h["job"], h["run"], world, history, self.raw_steps, self.max_instance_rows
                    )
                    self._runs[h["run"]] = run
                    self._bound_instances()
                run.hello(h)
                run.heard_ns[h["rank"]] = heard
                return
            run = self._runs[h["run"]]
            run.heard_ns[h["rank"]] = heard
            if msg.kind == "steps":  # nearly every message
                run.stepped_ns[h["rank"]] = heard
                self._took_rows(run, *run.add_steps(h, msg.tables, keep_steps))
            elif msg.kind == "reduced":
                # What the relays gathered into it: the collectors' messages it stands for.
                c = self._counters
                c["node_messages"] = c.get("node_messages", 0) + 1
                c["gathered"] = c.get("gathered", 0) + int(h.get("messages") or 0)
                for name in ("steps", "phases", "colls", "samples"):
                    t = msg.tables.get(name)
                    if t is not None:
                        for r in np.unique(t["rank"]).tolist():
                            run.heard_ns[r] = heard
                            if name == "steps":
                                run.stepped_ns[r] = heard
                for r, _, stats in h.get("stats") or ():
                    run.stats[r] = dict(stats)
                    run.heard_ns[r] = heard
                self._took_rows(run, *run.add_node(h, msg.tables))
                if run.part_rejects:  # shares that disagreed when combined
                    for reason, n in run.part_rejects.items():
                        rejects = self._counters["rejects"]
                        rejects[reason] = rejects.get(reason, 0) + n
                    run.part_rejects = {}
            elif msg.kind == "groups":
                run.set_groups(h["groups"])
            elif msg.kind == "samples":
                run.add_samples(h["rank"], msg.tables["samples"])
            elif msg.kind == "stats":
                run.stats[h["rank"]] = dict(h.get("stats") or {})
            now = time.monotonic()
            if not self._rate or now - self._rate[-1][0] >= 0.25:
                self._rate.append((now, self._counters["events"]))

    def _took_rows(self, run: RunState, late: int, events: int) -> None:
        """Count what a message of rows brought, and match once enough is pending."""
        self._counters["late_steps"] += late
        self._counters["events"] += events
        if run.pending.new_rows >= self.settle_rows:
            self._settle_run(run)

    # -- matching -------------------------------------------------------------------------

    def settle(self) -> None:
        """Match pending collective rows of every run, fold completed instances, and
        re-plan the rings under the cell budget."""
        with self._lock:
            for run in self._runs.values():
                self._settle_run(run)
            self._plan(None)

    # -- the cell budget ------------------------------------------------------------------

    def watch(self, run: str) -> None:
        """A viewer is showing ``run``: plan its ring as an active run's for the next
        ``WATCH_S`` seconds, even if it has finished, so that opening an older run does
        not leave it at its floor while a newer one streams. Call it on every read.

        Args:
            run: the run id (unknown ids are remembered and harmless).
        """
        with self._lock:
            fresh = run not in self._watched
            self._watched[run] = time.monotonic()
            if fresh and run in self._runs:
                self._plan(None)

    def _claim(
        self, world: int, steps: int, last_ns: int, now: int, watched: bool = False
    ) -> RingClaim:
        want = min(self.history_steps, max(MIN_RING_STEPS, self.max_cells // world))
        floor = min(want, max(MIN_RING_STEPS, self.floor_cells // world))
        # A run with no step yet has just started.
        active = watched or last_ns == schema.NO_TIME or now - last_ns <= self.idle_ns
        return RingClaim(world, steps, want, floor, active, last_ns)

    def _plan(self, new: tuple[int, int] | None) -> int:
        """Apply the budget's plan to the rings (see the module docstring).

        Args:
            new: ``(world size, hub-clock start or NO_TIME)`` of a run about to be
                created, or None.

        Returns:
            The new run's ring steps (0 when ``new`` is None).
        """
        runs = list(self._runs.values())
        now = max((r.last_ns for r in runs), default=schema.NO_TIME)
        if new is not None:  # a run whose processes just started is active from then
            now = max(now, new[1])
        seen = time.monotonic() - WATCH_S
        self._watched = {rid: t for rid, t in self._watched.items() if t >= seen}
        claims = [
            self._claim(r.world_size, r.H, r.last_ns, now, rid in self._watched)
            for rid, r in self._runs.items()
        ]
        if new is not None:
            claims.append(self._claim(new[0], 0, new[1], now))
        target = plan(claims, self.max_cells)
        # An active run grows once the plan offers it a quarter more (or all it wants):
        # smaller gains are not worth copying its ring.
        grow = [
            c.active and t > c.steps and (t >= c.steps + max(1, c.steps // 4) or t == c.want)
            for c, t in zip(claims[: len(runs)], target, strict=False)
        ]
        held = sum(
            c.world * (t if i >= len(runs) or grow[i] else c.steps)
            for i, (c, t) in enumerate(zip(claims, target, strict=True))
        )
        # Shrink only while over budget: idle runs first (the longest idle first), then
        # active ones, so a small new run does not make a large one copy its ring.
        order = sorted(range(len(runs)), key=lambda i: (claims[i].active, claims[i].last_ns))
        for i in order:
            if held <= self.max_cells:
                break
            if target[i] < runs[i].H:
                held -= claims[i].world * (runs[i].H - target[i])
                runs[i].resize(target[i])
        if held <= self.max_cells:
            for i in order:
                if grow[i]:
                    runs[i].resize(target[i])
        self._bound_instances()
        return target[-1] if new is not None else 0

    def _bound_instances(self) -> None:
        """Share ``max_instance_rows`` among the runs as their rings share the cells: a
        run keeps instances in proportion to its ring's cells (a finished baseline at its
        floor keeps few, the run under study most), and every run at least
        `MIN_INSTANCE_ROWS` (an eighth of the budget, when that is smaller)."""
        runs = list(self._runs.values())
        cells = [r.world_size * r.H for r in runs]
        total = sum(cells)
        least = min(MIN_INSTANCE_ROWS, max(1, self.max_instance_rows // 8))
        for r, c in zip(runs, cells, strict=True):
            share = self.max_instance_rows * c // total if total else self.max_instance_rows
            r.bound_instances(max(least, share))

    def ring_cells(self) -> dict[str, int]:
        """Rank × step cells of every run's ring (run -> cells); their sum stays within
        ``max_cells`` unless the runs' floors alone exceed it."""
        with self._lock:
            return {rid: r.world_size * r.H for rid, r in self._runs.items()}

    def ring_nbytes(self) -> dict[str, int]:
        """Bytes of every run's ring grids (run -> bytes)."""
        with self._lock:
            return {rid: r.ring_nbytes() for rid, r in self._runs.items()}

    def _settle_run(self, run: RunState) -> None:
        settle(run, self._stale_steps(run))

    def _stale_steps(self, run: RunState) -> int:
        """``stale_steps``, widened while a rank that is still heard from lags behind (see
        `LAG_HOLD_S`): instances stay open above the newest step of such a rank."""
        if run.max_step is None:
            return self.stale_steps
        newest = np.array(run.newest_step, np.int64)
        lagging = (newest >= 0) & (newest < run.max_step - self.stale_steps)
        if not lagging.any():
            return self.stale_steps
        now = max(run.heard_ns)
        alive = lagging & (np.array(run.stepped_ns, np.int64) >= now - int(LAG_HOLD_S * 1e9))
        if not alive.any():
            return self.stale_steps
        return max(self.stale_steps, run.max_step - int(newest[alive].min()))

    # -- reading --------------------------------------------------------------------------

    def runs(self) -> list[RunSummary]:
        """Every run, in the order the store first heard of it."""
        with self._lock:
            return [run.summary() for run in self._runs.values()]

    def run_ids(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def totals(self, run: str) -> RunTotals:
        """Lifetime figures of ``run`` (settles first).

        Raises:
            KeyError: unknown run.
        """
        with self._lock:
            r = self._get(run)
            self._settle_run(r)
            steps, step_ns, nrep = r.step_totals()
            return RunTotals(
                steps=steps,
                step_ns=step_ns,
                ranks_reporting=nrep,
                coll_rows=r.life_rows.copy(),
                done_rows=r.life_done.copy(),
                times_last=r.life_last.copy(),
                late_ns=r.life_late.copy(),
                instances_complete=r.life_complete,
                instances_incomplete=r.life_incomplete,
            )

    def run_health(self, run: str) -> dict[str, Any]:
        """Collector-reported figures of one run: ``drops``, ``collector_errors``,
        ``clock_error_ns`` (rank -> ns).

        Raises:
            KeyError: unknown run.
        """
        with self._lock:
            return self._get(run).health()

    def _get(self, run: str) -> RunState:
        r = self._runs.get(run)
        if r is None:
            known = ", ".join(self._runs) or "none"
            raise KeyError(f"unknown run {run!r} (known: {known})")
        return r

    def window(self, run: str | None = None, last: int | None = None) -> Window:
        """The last ``last`` steps of ``run`` as a `Window` (settles first).

        Args:
            run: run id; None means the run heard of most recently.
            last: number of most recent steps (all kept steps when None).

        Returns:
            The window; instances include those still incomplete.

        Raises:
            KeyError: unknown run, or no run at all.
        """
        with self._lock:
            if run is None:
                if not self._runs:
                    raise KeyError("the store holds no run yet")
                run = next(reversed(self._runs))
            r = self._get(run)
            self._settle_run(r)
            return self._window(r, last)

    def _window(self, r: RunState, last: int | None) -> Window:
        steps, slots = r.window_slots(last)
        R = r.world_size
        present = r.present[:, slots]
        ts = r.t_start[:, slots]
        known = present & (ts != schema.NO_TIME)
        if not known.any():  # no start known (a sender may send none): the earliest end
            ts = r.t_end[:, slots]
            known = present & (ts != schema.NO_TIME)
        t0 = int(ts[known].min()) if known.any() else 0
        shift = float(r.t0 - t0)

        absent = ~present
        gaps = bool(absent.any())

        def grid(a: np.ndarray) -> np.ndarray:
            g = a[:, slots].astype(np.float64, copy=False)
            if gaps:
                g[absent] = np.nan
            return g

        def rel(a: np.ndarray) -> np.ndarray:
            g = arrivals.relative_ns(a[:, slots], t0)
            if gaps:
                g[absent] = np.nan
            return g

        # What no rank ever reported is one read-only array shared by every such column
        # (most of a window's columns on a job without devices or phases: a third of its
        # memory at 65,536 ranks).
        unknown = np.broadcast_to(np.float64(np.nan), present.shape)

        def nan_or(a: np.ndarray | None) -> np.ndarray:
            return grid(a) if a is not None else unknown

        # A phase never reported is zero wherever the rank reported the step.
        never = np.where(present, 0.0, np.nan) if gaps else np.zeros(present.shape)
        never.flags.writeable = False
        phase_ns = {
            name: grid(r.phases[name]) if name in r.phases else never
            for name in (*schema.PHASES, *r.phase_names)
        }
        instances = self._window_instances(r, steps, shift)
        raw = r.pending.raw(r.raw_cutoff())
        rows = None
        if raw is not None:
            sel = np.isin(raw["step"], steps)
            rows = coll_rows(raw, t0, sel) if sel.any() else None
        samples = r.samples.view()
        if len(r.samples):
            rr, jj = np.nonzero(present)
            step_rows = {
                "rank": rr,
                "step": steps[jj],
                "t_start": r.t_start[:, slots][rr, jj],
                "t_end": r.t_end[:, slots][rr, jj],
            }
            device = device_means(samples, step_rows, R, steps)
        else:
            device = dict.fromkeys(DEVICE_COLUMNS, unknown)
        ranks, groups = r.info()
        clock = np.full(R, np.nan)
        for rank, st in r.stats.items():
            err = st.get("clock_error_ns")
            if isinstance(err, (int, float)) and 0 <= rank < R:
                clock[rank] = float(err)
        return Window(
            job=r.job,
            run=r.run,
            scope=r.scope,
            parent_run=r.parent_run,
            manifest=dict(r.manifest()),
            ranks=ranks,
            groups=groups,
            t0_ns=t0,
            steps=steps,
            present=present.copy(),
            t_start=rel(r.t_start),
            t_end=rel(r.t_end),
            phase_ns=phase_ns,
            work={name: nan_or(r.work.get(name)) for name in WORK_COLUMNS},
            memory={name: nan_or(r.memory.get(name)) for name in MEMORY_COLUMNS},
            device=device,
            coll={name: grid(r.coll[name]) for name in COLL_AGGREGATES},
            instances=instances,
            rows=rows,
            clock_error_ns=clock,
            health=r.health(),
            host={name: nan_or(r.host.get(name)) for name in HOST_COLUMNS},
            phase_cpu_ns={name: grid(a) for name, a in r.phase_cpu.items()},
            reduced={
                name: grid(r.coll[REDUCED + name])
                for name in REDUCED_AGGREGATES
                if REDUCED + name in r.coll
            },
        )

    def _window_instances(self, r: RunState, steps: np.ndarray, shift: float) -> InstanceTable:
        parts: list[dict[str, np.ndarray]] = []
        done = r.instances.view()
        keep = np.isin(done["step"], steps)
        parts.append({k: v[keep] for k, v in done.items()})
        P = r.pending.open_rows()
        if P is not None:
            sizes = {gid: len(g["ranks"]) for gid, g in r.groups.items()}
            m = match(P, sizes, t0_ns=r.t0, epoch=P["epoch"])
            ep = np.empty(len(m.instances), np.int64)
            ep[m.row_instance] = P["epoch"]
            open_ = {k: getattr(m.instances, k) for k in _INSTANCE_FIELDS}
            open_["epoch"] = ep
            keep = np.isin(open_["step"], steps)
            parts.append({k: v[keep] for k, v in open_.items()})
        cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        order = np.lexsort((cols["seq"], cols["group"], cols["epoch"]))
        out = {}
        for k in _INSTANCE_FIELDS:
            v = cols[k][order]
            if k in ("first", "last"):
                v = v + shift
            out[k] = v
        return InstanceTable(**out)

    @property
    def health(self) -> dict[str, Any]:
        """Counters: ``messages``, ``bytes``, ``events`` (collective rows), ``events_per_s``
        (over the last few seconds), ``rejects`` (reason -> count), ``late_steps``; once a
        relay's node message came, ``node_messages`` and ``gathered`` (the collectors'
        messages they stood for); ``drops`` (``batches``/``events`` reported by
        collectors), ``collector_errors``
        (reason -> count), ``clock_error_ns`` (run -> {rank: ns}), plus `extra_health`."""
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._counters.items()}
            rate = 0.0
            if len(self._rate) >= 2:
                now = time.monotonic()
                recent = [p for p in self._rate if now - p[0] <= 5.0] or [self._rate[-1]]
                t_a, e_a = recent[0]
                t_b, e_b = self._rate[-1]
                if now - t_b > 2.0:
                    rate = 0.0  # nothing arrived lately
                elif t_b > t_a:
                    rate = (e_b - e_a) / (t_b - t_a)
            out["events_per_s"] = rate
            drops = {"batches": 0, "events": 0}
            errors: dict[str, int] = {}
            clocks: dict[str, dict[int, float]] = {}
            for rid, run in self._runs.items():
                h = run.health()
                drops["batches"] += h["drops"]["batches"]
                drops["events"] += h["drops"]["events"]
                for k, v in h["collector_errors"].items():
                    errors[k] = errors.get(k, 0) + v
                if h["clock_error_ns"]:
                    clocks[rid] = h["clock_error_ns"]
            bad = sum(run.bad_host_values for run in self._runs.values())
            if bad:  # counted where the ring is written (`runstate.host_value_bounds`)
                rejects = out["rejects"]
                rejects["bad_host_value"] = rejects.get("bad_host_value", 0) + bad
            out["drops"] = drops
            out["collector_errors"] = errors
            out["clock_error_ns"] = clocks
            for k, v in self.extra_health.items():
                out[k] = v
            return out


def merge_counts(into: dict[str, int], more: Mapping[str, int]) -> dict[str, int]:
    """Add per-reason counts (used to merge a recorded hub's rejects)."""
    for k, v in more.items():
        into[k] = into.get(k, 0) + int(v)
    return into
