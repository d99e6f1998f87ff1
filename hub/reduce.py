"""Matching on the node: a relay reduces the collectives of groups whose members it carries.

A tensor-parallel group lives on one node, and most of a hybrid-parallel job's collective
calls are its. A relay (`hub.relay`, ``--reduce``) that carries every member of such a
group matches the group's instances itself, with the hub's own block arithmetic
(`diagnosis.blocks.match_block` and `block_sums`), and sends the hub, in place of the rows,
one ``reduced`` message (``collector.schema.REDUCED_TABLES``) per run and flush:

- *cells*: per (rank, incarnation, step) the sums the hub's matching folds into its ring
  (``diagnosis.window.COLL_AGGREGATES``): calls, time inside, wait, transfer, lateness,
  times last, exposed wait and transfer, overstay;
- *instances*: per instance its first and last entry (int64 ns, the rows' own clock), last
  arriver, margin and median transfers, as the hub's instance table holds them.

Exact, not approximate: every value is a sum, min, max or median of integer-ns times of one
node's rows, and the hub computes the same from the same rows (its origin differs, which
moves no integer below 2**53). ``tests/test_relay_reduce.py`` holds a direct and a reduced
run of the same seeded simulation to identical aggregates, instances and verdicts.

What is not reduced goes on as it came: rows of groups with a member on another node, of
async calls, of calls that never finished (a hang's evidence), of members that disagree on
what they called, of a rank whose steps message the hub would refuse, and rows still held
when their group cannot complete (a member stopped sending: after `STALE_STEPS` steps, or
`HOLD_S` seconds, or when `MAX_HELD_ROWS` are held) are forwarded as that rank's rows, for
the hub's own matching to settle or close as incomplete.

The relay learns groups from the ``groups`` messages it carries (each node's collectors
send theirs) and its ranks from their hellos; what it never saw it never reduces. The raw
rows of reduced groups do not reach the hub: its exposed-time union (`diagnosis.exposure`)
then stands down for those cells (the per-row sums it refines are exact for blocking
calls), and a recording holds the reduced sums, not the rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import ASYNC_FLAGS
from rankscope.diagnosis.blocks import block_sums, match_block
from rankscope.diagnosis.exposure import P2P_OPS
from rankscope.hub.validate import REPLAY_LIMITS, Limits, Reject, check_values

STALE_STEPS = 4
"""Held rows of a step this many steps behind the run's newest go on unreduced."""

HOLD_S = 30.0
"""Held rows older than this go on unreduced (a member that stopped sending)."""

MAX_HELD_ROWS = 1_000_000
"""Most rows held for members still to report; the oldest go on unreduced beyond."""

_DONE_STEPS = 64
"""Steps a rank reported that are remembered (to hold rows only for steps not yet ended)."""

_CELL_SUMS = (
    "coll_ns",
    "wait_ns",
    "transfer_ns",
    "late_ns",
    "exposed_wait_ns",
    "exposed_transfer_ns",
    "overstay_ns",
)


@dataclass
class ReduceCounters:
    """What a reducing relay did, for its status line."""

    reduced_rows: int = 0
    """Rows matched on the node and sent as sums."""
    instances: int = 0
    """Instances sent in ``reduced`` messages."""
    messages: int = 0
    """``reduced`` messages sent."""
    passed_rows: int = 0
    """Rows of reducible groups sent on unreduced (incomplete, irregular, refused)."""

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Held:
    since: float
    rows: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    """rank -> its row tables (of one group and step)."""
    n: int = 0


@dataclass
class _Run:
    job: str
    header: dict[int, dict[str, Any]] = field(default_factory=dict)
    """rank -> the header of its latest message (for the rows sent on in its name)."""
    inc: dict[int, int] = field(default_factory=dict)
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    local: frozenset[int] = frozenset()
    """Groups every member of which said hello through this relay."""
    local_arr: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    done: dict[int, set[int]] = field(default_factory=dict)
    """rank -> steps whose step row it sent (the last `_DONE_STEPS`)."""
    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    newest: int = -1
    cells: list[dict[str, np.ndarray]] = field(default_factory=list)
    instances: list[dict[str, np.ndarray]] = field(default_factory=list)

    def relocal(self) -> None:
        known = self.inc.keys()
        self.local = frozenset(
            gid for gid, ranks in self.groups.items() if all(r in known for r in ranks)
        )
        self.local_arr = np.array(sorted(self.local), np.int64)


class NodeReducer:
    """The relay's reduction (see the module): `take` each message as it comes, `due`
    before each bundle leaves.

    Args:
        limits: the value checks a steps message must pass to have its rows reduced (the
            hub's; a message that fails goes on whole, for the hub to refuse and count).
        stale_steps, hold_s, max_held_rows: when held rows give up waiting.
    """

    def __init__(
        self,
        limits: Limits = REPLAY_LIMITS,
        stale_steps: int = STALE_STEPS,
        hold_s: float = HOLD_S,
        max_held_rows: int = MAX_HELD_ROWS,
    ) -> None:
        self.limits = limits
        self.stale_steps = stale_steps
        self.hold_s = hold_s
        self.max_held_rows = max_held_rows
        self.counters = ReduceCounters()
        self._runs: dict[str, _Run] = {}
        self._held_rows = 0
        self._out: list[bytes] = []

    @property
    def held_rows(self) -> int:
        return self._held_rows

    def take(self, frame: bytes, now: float | None = None) -> list[bytes]:
        """What to forward for one message from a collector: the message itself, or its
        steps message without the rows this relay keeps to reduce."""
        try:
            msg = schema.decode(frame, self.limits.max_header_bytes)
        except schema.SchemaError:
            return [frame]  # the hub refuses it and counts why
        h = msg.header
        kind = msg.kind
        if kind == "hello":
            self._hello(h)
            return [frame]
        run = self._runs.get(h["run"])
        if run is None or run.job != h["job"]:
            return [frame]
        if kind == "groups":
            for g in h["groups"]:
                ranks = g["ranks"]
                if all(isinstance(r, int) and r >= 0 for r in ranks) and ranks:
                    run.groups[int(g["id"])] = tuple(sorted(ranks))
            run.relocal()
            return [frame]
        if kind != "steps" or not run.local:
            return [frame]
        return self._steps(run, msg, frame, time.monotonic() if now is None else now)

    def due(self, now: float | None = None) -> list[bytes]:
        """The messages ready to leave: ``reduced`` messages of the instances completed
        since the last call, and held rows that gave up waiting (sent on as rows)."""
        now = time.monotonic() if now is None else now
        for run_id, run in self._runs.items():
            self._expire(run, now)
            if run.cells:
                self._out.append(self._reduced(run_id, run))
        out, self._out = self._out, []
        return out

    def flush_all(self) -> list[bytes]:
        """Stopping: everything held goes on as rows, after what is complete."""
        for run in self._runs.values():
            for key in list(run.held):
                self._pass_on(run, key)
        return self.due()

    # -- messages ---------------------------------------------------------------------

    def _hello(self, h: Mapping[str, Any]) -> None:
        run = self._runs.get(h["run"])
        if run is None:
            run = self._runs[h["run"]] = _Run(job=h["job"])
        elif run.job != h["job"]:
            return
        rank, inc = int(h["rank"]), int(h["inc"])
        if inc < run.inc.get(rank, -1):
            return
        new = rank not in run.inc
        run.inc[rank] = inc
        run.header[rank] = {k: h[k] for k in ("job", "run", "rank", "inc")}
        if new:
            run.relocal()

    def _steps(self, run: _Run, msg: schema.Message, frame: bytes, now: float) -> list[bytes]:
        h = msg.header
        rank, inc = int(h["rank"]), int(h["inc"])
        co = msg.tables.get("colls")
        st = msg.tables["steps"]
        steps = st["step"]
        done = run.done.setdefault(rank, set())
        if (
            co is None
            or not co["step"].shape[0]
            or run.inc.get(rank) != inc
            or any(s in done for s in steps.tolist())
        ):
            self._note_steps(run, rank, steps)
            return [frame]
        # Blocking collectives of the node's groups; point-to-point and async calls go on
        # as rows (the exposed-time union needs them: `diagnosis.exposure`).
        mine = (
            np.isin(co["group"], run.local_arr)
            & ((co["flags"] & ASYNC_FLAGS) == 0)
            & ~np.isin(co["op"], P2P_OPS)
        )
        if not mine.any():
            self._note_steps(run, rank, steps)
            return [frame]
        try:
            check_values(msg, None, self.limits)
        except Reject:
            return [frame]  # the hub refuses it, naming the column
        rest = {k: v[~mine] for k, v in co.items()}
        kept = {k: v[mine] for k, v in co.items()}
        self._hold(run, rank, kept, now)
        tables: dict[str, Any] = {"steps": schema.encode_table("steps", dict(st))}
        ph = msg.tables.get("phases")
        if ph is not None:
            tables["phases"] = schema.encode_table("phases", dict(ph))
        tables["colls"] = schema.encode_table("colls", rest)
        out = dict(h)
        out["tables"] = tables
        self._note_steps(run, rank, steps)
        return [schema.encode(out)]

    def _note_steps(self, run: _Run, rank: int, steps: np.ndarray) -> None:
        """A rank's step rows came: its held rows of those steps are all here."""
        if not steps.shape[0]:
            return
        ids = steps.tolist()
        done = run.done.setdefault(rank, set())
        done.update(ids)
        top = max(ids)
        run.newest = max(run.newest, top)
        if len(done) > 2 * _DONE_STEPS:
            floor = top - _DONE_STEPS
            done.difference_update([s for s in done if s < floor])
        for key in [k for k in run.held if k[1] in ids and rank in run.held[k].rows]:
            members = run.groups[key[0]]
            if all(key[1] in run.done.get(r, ()) for r in members):
                self._complete(run, key)

    def _hold(self, run: _Run, rank: int, co: dict[str, np.ndarray], now: float) -> None:
        order = np.lexsort((co["step"], co["group"]))
        g, s = co["group"][order], co["step"][order]
        cut = np.flatnonzero((np.diff(g) != 0) | (np.diff(s) != 0)) + 1
        for at in np.split(order, cut):
            key = (int(co["group"][at[0]]), int(co["step"][at[0]]))
            held = run.held.get(key)
            if held is None:
                held = run.held[key] = _Held(since=now)
            held.rows.setdefault(rank, []).append({k: v[at] for k, v in co.items()})
            held.n += at.shape[0]
            self._held_rows += at.shape[0]

    # -- reduction --------------------------------------------------------------------

    def _complete(self, run: _Run, key: tuple[int, int]) -> None:
        held = run.held.pop(key)
        self._held_rows -= held.n
        gid, step = key
        members = run.groups[gid]
        parts = []
        for r in members:
            tabs = held.rows.get(r)
            if not tabs:
                return self._rows_on(run, held)
            t = (
                tabs[0]
                if len(tabs) == 1
                else {k: np.concatenate([x[k] for x in tabs]) for k in tabs[0]}
            )
            if t["seq"].shape[0] > 1 and (np.diff(t["seq"]) <= 0).any():
                order = np.argsort(t["seq"], kind="stable")
                t = {k: v[order] for k, v in t.items()}
            parts.append(t)
        first = parts[0]
        seq = first["seq"]
        for t in parts:
            if not (
                np.array_equal(t["seq"], seq)
                and np.array_equal(t["nbytes"], first["nbytes"])
                and np.array_equal(t["op"], first["op"])
            ):
                return self._rows_on(run, held)
        if (seq < 0).any() or (seq.shape[0] > 1 and (np.diff(seq) == 0).any()):
            return self._rows_on(run, held)
        enter_i = np.stack([t["t_enter"] for t in parts])
        exit_i = np.stack([t["t_exit"] for t in parts])
        flags = np.stack([t["flags"] for t in parts])
        if (flags & ASYNC_FLAGS).any() or (exit_i == schema.NO_TIME).any():
            return self._rows_on(run, held)
        incs = {run.inc.get(r, -1) for r in members}
        if len(incs) != 1:
            return self._rows_on(run, held)
        inc = incs.pop()
        origin = int(enter_i.min())
        enter = (enter_i - origin).astype(np.float64)
        exit_ = (exit_i - origin).astype(np.float64)
        device: dict[str, np.ndarray] = {}
        if (flags & schema.FLAG_DEVICE_TIMED).any():
            t_start = np.stack([t["t_start"] for t in parts])
            t_end = np.stack([t["t_end"] for t in parts])
            device = {
                "flags": flags,
                "t_start": _relative(t_start, origin),
                "t_end": _relative(t_end, origin),
            }
        ranks = np.array(members, np.int64)
        m = match_block(enter, exit_, ranks[:, None], **device)
        sums = block_sums(enter, exit_, m, np.zeros(1, np.int64))
        c, k = enter.shape
        cells = {
            "rank": ranks.astype(np.int32),
            "inc": np.full(c, inc, np.int32),
            "step": np.full(c, step, np.int64),
            "n": np.full(c, k, np.int32),
            "times_last": sums["times_last"][:, 0].astype(np.int32),
        }
        for name in _CELL_SUMS:
            cells[name] = sums[name][:, 0]
        run.cells.append(cells)
        run.instances.append(
            {
                "group": np.full(k, gid, np.int32),
                "seq": seq,
                "step": first["step"],
                "inc": np.full(k, inc, np.int32),
                "op": first["op"],
                "nbytes": first["nbytes"],
                "n_members": np.full(k, c, np.int32),
                "first": m.first.astype(np.int64) + origin,
                "last": m.last.astype(np.int64) + origin,
                "last_rank": m.last_rank.astype(np.int32),
                "margin": m.margin,
                "transfer": m.transfer,
                "device_transfer": m.device_transfer,
            }
        )
        self.counters.reduced_rows += c * k
        self.counters.instances += k
        return None

    def _reduced(self, run_id: str, run: _Run) -> bytes:
        cells = _concat(run.cells)
        inst = _concat(run.instances)
        run.cells, run.instances = [], []
        # The header names a rank the message covers, as every message names its sender.
        rank = int(cells["rank"].min())
        header = dict(run.header[rank])
        self.counters.messages += 1
        return schema.reduced_message(header, cells, inst)

    def _expire(self, run: _Run, now: float) -> None:
        stale = run.newest - self.stale_steps
        for key, held in list(run.held.items()):
            if key[1] <= stale or now - held.since > self.hold_s:
                self._pass_on(run, key)
        if self._held_rows > self.max_held_rows:
            for key in sorted(run.held, key=lambda k: run.held[k].since):
                self._pass_on(run, key)
                if self._held_rows <= self.max_held_rows:
                    break

    def _pass_on(self, run: _Run, key: tuple[int, int]) -> None:
        held = run.held.pop(key)
        self._held_rows -= held.n
        self._rows_on(run, held)

    def _rows_on(self, run: _Run, held: _Held) -> None:
        """Send held rows on as their ranks' rows (a steps message without step rows)."""
        for rank, tabs in held.rows.items():
            co = _concat(tabs)
            self.counters.passed_rows += co["step"].shape[0]
            self._out.append(
                schema.steps_message(run.header[rank], schema.empty_table("steps", 0), None, co)
            )


def _relative(t: np.ndarray, origin: int) -> np.ndarray:
    out = (t - origin).astype(np.float64)
    out[t == schema.NO_TIME] = np.nan
    return out


def _concat(parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    parts = list(parts)
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
