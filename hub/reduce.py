"""Reduction on the node: a relay matches its node's groups and sends one message per flush.

The hub's cost is per message and per collective row. A relay with ``--reduce``
(`hub.relay`) cuts both for its node:

- **Matching on the node.** A tensor-parallel group lives on one node, and most of a
  hybrid-parallel job's collective calls are its. A relay that carries every member of a
  group matches the group's instances itself (blocking and asynchronous), with the hub's own block
  arithmetic (`diagnosis.blocks.match_block` and `block_sums`), and sends their sums in
  place of their rows: *cells*, per (rank, incarnation, step) the sums the hub's matching
  folds into its ring (``diagnosis.window.COLL_AGGREGATES``: calls, time inside, wait,
  transfer, lateness, times last, exposed wait and transfer, overstay), and *instances*,
  each with its first and last entry and exit (int64 ns on the rows' clock), last arriver,
  margin and median transfers, as the hub's instance table holds them.
- **One message per node and flush.** Every steps and samples message of the node's ranks
  that the hub would take joins the node's next ``reduced`` message
  (``collector.schema.REDUCED_TABLES``): its rows with their rank and incarnation, phase
  codes mapped to the message's names, beside the sums. A relay one level up with
  ``--reduce`` gathers its nodes' messages the same way (one per rack and flush), and
  matches the rows of groups whose members all said hello through it (a group spread over
  hosts of its rack), its cells summed into its nodes' cells of the same rank-step. The
  message says how many of the collectors' messages it stands for.

Exact, not approximate: every value is a sum, min, max or median of integer-ns times of one
node's rows, and the hub computes the same from the same rows (its origin differs, which
moves no integer below 2**53). ``tests/test_relay_reduce.py`` holds a direct and a reduced
run of the same seeded simulations to identical aggregates, instances and diagnoses.

Groups with members beyond the relay (data-parallel buckets, a group spread over racks)
are reduced to *parts* where the relay carries two or more of their members
(`hub.partial`): per instance what its members show (first and last entry, exits), per
member its sums, and the calls whose exposed time hangs on the instance's last entry; the
hub combines the parts of an instance once they cover its group. Asynchronous calls carry
their cut (`diagnosis.arrivals.async_cut`, computed here as the hub computes it from the
same message), so a node's asynchronous groups are matched here too.

What is neither matched nor parted goes on as rows: point-to-point calls (the exposed-time
union keeps them apart), calls that never finished (a hang's evidence), members that
disagree on what they called, and rows still held when their group cannot complete (a
member stopped sending: after `STALE_STEPS` steps, or `HOLD_S` seconds, or when
`MAX_HELD_ROWS` are held). A message the hub would refuse (its values, a repeated step, an
incarnation the relay did not see say hello) goes on alone, for the hub to refuse and
count.

At scale the relay lists only its ranks' share of the hub's instance table
(`INSTANCE_STEPS`); the cells sum every instance, and the message says how many it left
out.

The relay learns groups from the ``groups`` messages it carries (each node's collectors
send theirs) and its ranks from their hellos; what it never saw it never reduces. The raw
rows of matched groups do not reach the hub, so the hub keeps their exposed sums apart
(``diagnosis.window.Window.reduced``), for its exposed-time union to stay exact; a
recording holds the sums, not those rows.
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
from rankscope.hub.partial import make_part, with_cut
from rankscope.hub.runstate import MAX_INSTANCE_ROWS
from rankscope.hub.validate import REPLAY_LIMITS, Limits, Reject, check_values

STALE_STEPS = 4
"""Held rows of a step this many steps behind the run's newest go on unreduced."""

HOLD_S = 30.0
"""Held rows older than this go on unreduced (a member that stopped sending)."""

MAX_HELD_ROWS = 1_000_000
"""Most rows held for members still to report; the oldest go on unreduced beyond."""

MAX_RUNS = 64
"""Runs a relay gathers and reduces at once; a new one retires the run heard from longest
ago (what it holds goes on first)."""

MAX_RANKS = 65_536
"""Ranks of one run a relay gathers (a node holds a few, a rack's relay a few hundred);
beyond, their messages go on as they came."""

MAX_STATS_BYTES = 64 * 1024
"""A ``stats`` message larger than this goes on alone (node messages stay far below the
hub's header bound, whatever a rank's counters hold)."""

MAX_NODE_ROWS = 100_000
"""Rows gathered for a node message that make it leave at once (a few MB)."""

INSTANCE_STEPS = 16
"""Steps of instances the hub's table is to hold: a relay lists at most its ranks' share of
the hub's ``MAX_INSTANCE_ROWS`` over this many steps (the sums cover all of them). A
65,536-rank job's tensor-parallel groups close 1.5 M instances a step, and the hub keeps
1 M: listed whole, they would fill its table every step and cost most of its time."""

_P2P = np.zeros(len(schema.OPS) + 1, bool)
_P2P[P2P_OPS + 1] = True
"""``op + 1`` -> whether the call is point-to-point (-1, unknown, at 0)."""

_DONE_STEPS = 64
"""Steps a rank reported that are remembered (to hold rows only for steps not yet ended)."""


@dataclass
class ReduceCounters:
    """What a reducing relay did, for its status line."""

    reduced_rows: int = 0
    """Rows matched on the node and sent as sums."""
    instances: int = 0
    """Instances sent in ``reduced`` messages."""
    parts: int = 0
    """Parts sent (instances of groups with members beyond the relay: `hub.partial`)."""
    messages: int = 0
    """``reduced`` messages sent."""
    passed_rows: int = 0
    """Rows of reducible groups sent on unreduced (incomplete, irregular, refused)."""
    merged: int = 0
    """Node messages of lower relays gathered into this relay's."""
    groups_deduplicated: int = 0
    """Group tables sent on without the groups it had sent already."""


@dataclass
class _Held:
    since: float
    rows: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    """rank -> its row tables (of one group and step)."""
    incs: dict[int, int] = field(default_factory=dict)
    """rank -> the incarnation that sent them."""
    n: int = 0


@dataclass
class _Run:
    job: str
    header: dict[int, dict[str, Any]] = field(default_factory=dict)
    """rank -> the header of its latest message (for the rows sent on in its name)."""
    inc: dict[int, int] = field(default_factory=dict)
    groups: dict[int, np.ndarray] = field(default_factory=dict)
    """Group -> its members, ascending (`_members`: one array per membership)."""
    _local: frozenset[int] = frozenset()
    _here: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _reducible: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _stale: bool = False
    """A hello or a group table came since ``local``, ``here`` were worked out (they are
    worked out when next read: a rack's relay hears hundreds of hellos, and a data-parallel
    group has thousands of members)."""
    partials: bool = True
    """Whether groups with members beyond this relay are reduced to parts."""
    parted: set[int] = field(default_factory=set)
    """Groups this relay sent parts of: parts they stay, when their last members' hellos
    come (the hub combines a step's parts; a match of the members whose rows are still
    held could not join them)."""
    world: int = 0
    """The run's world size (its hellos say it; 0 before one came)."""
    unlisted: list[int] = field(default_factory=lambda: [0, 0])
    """Instances matched and summed but left out of the next node message, and their
    members' calls (the message's header says both)."""
    done: dict[int, set[int]] = field(default_factory=dict)
    """rank -> steps whose step row it sent (the last `_DONE_STEPS`)."""
    sent_groups: dict[int, np.ndarray] = field(default_factory=dict)
    """Group -> the membership this relay last sent the hub."""
    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    by_step: dict[int, set[int]] = field(default_factory=dict)
    """step -> the groups ``held`` holds rows of for it."""
    newest: int = -1
    heard: float = 0.0
    """When a message of the run last came (monotonic s)."""
    cells: list[dict[str, np.ndarray]] = field(default_factory=list)
    instances: list[dict[str, np.ndarray]] = field(default_factory=list)
    parts: list[dict[str, np.ndarray]] = field(default_factory=list)
    part_cells: list[dict[str, np.ndarray]] = field(default_factory=list)
    part_rows: list[dict[str, np.ndarray]] = field(default_factory=list)
    tables: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    """Rank tables gathered for the next node message (``rank`` and ``inc`` added)."""
    pending: int = 0
    """Rows in ``tables``."""
    carried: int = 0
    """Collector messages gathered into ``tables`` (the node message says it)."""
    stats: list[list[Any]] = field(default_factory=list)
    """The ranks' ``stats`` maps gathered, ``[rank, inc, map]``."""
    phase_names: list[str] = field(default_factory=list)
    """The user phase names the run's node messages index (every rank's, in order seen)."""
    _codes: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict)

    def unhold(self, key: tuple[int, int]) -> _Held:
        """Take the held rows of ``key`` (group, step) out."""
        gids = self.by_step[key[1]]
        gids.discard(key[0])
        if not gids:
            del self.by_step[key[1]]
        return self.held.pop(key)

    def phase_codes(self, names: tuple[str, ...]) -> np.ndarray | None:
        """Phase code of a message naming ``names`` -> code in the node messages, or None
        when the run's names would pass what a message may carry."""
        lut = self._codes.get(names)
        if lut is None:
            new = [n for n in names if n not in self.phase_names]
            if len(self.phase_names) + len(set(new)) > schema.MAX_PHASE_NAMES:
                return None
            for n in new:
                if n not in self.phase_names:
                    self.phase_names.append(n)
            base = len(schema.PHASES)
            lut = np.array(
                [*range(base), *(base + self.phase_names.index(n) for n in names)], np.int64
            )
            self._codes[names] = lut
        return lut

    def relocal(self) -> None:
        """Work out ``local`` and ``here`` again when next read."""
        self._stale = True

    def _refresh(self) -> None:
        if not self._stale:
            return
        self._stale = False
        known = np.array(sorted(self.inc), np.int64)
        local, here = set(), {}
        for gid, ranks in self.groups.items():
            at = np.minimum(np.searchsorted(known, ranks), max(known.shape[0] - 1, 0))
            mine = ranks[known[at] == ranks] if known.shape[0] else ranks[:0]
            if mine.shape[0] == ranks.shape[0] and gid not in self.parted:
                local.add(gid)
                here[gid] = tuple(mine.tolist())
            elif (mine.shape[0] >= 2 or gid in self.parted) and self.partials:
                here[gid] = tuple(mine.tolist())
        self._local = frozenset(local)
        self._here = here
        self._reducible = np.array(sorted(here), np.int64)

    @property
    def local(self) -> frozenset[int]:
        """Groups every member of which said hello through this relay."""
        self._refresh()
        return self._local

    @property
    def here(self) -> dict[int, tuple[int, ...]]:
        """Groups this relay reduces -> their members that said hello through it: all of
        them for ``local`` groups, two or more for the others (their instances leave as
        parts: `hub.partial`)."""
        self._refresh()
        return self._here

    @property
    def reducible_arr(self) -> np.ndarray:
        """The groups of ``here``, ascending."""
        self._refresh()
        return self._reducible

    def reducible_rows(self, co: Mapping[str, np.ndarray]) -> np.ndarray:
        """Which rows of a ``colls`` table this relay reduces: of the groups it reduces,
        not point-to-point (the exposed-time union keeps those apart)."""
        return _member(self.reducible_arr, co["group"]) & ~_P2P[co["op"] + 1]  # op -1 at 0


_MEMBERS: dict[bytes, np.ndarray] = {}
"""Memberships seen, by their bytes: every relay of a process (a benchmark's thousands)
holds one array per membership, not one each (a world group of 65,536 ranks is 512 KB)."""


def _members(ranks: list[Any]) -> np.ndarray | None:
    """A group's members as an ascending array, shared with the relays that saw the same
    list; None unless they are ranks (integers, not negative, at least one)."""
    try:
        arr = np.array(ranks)
    except (ValueError, OverflowError):
        return None
    if arr.ndim != 1 or not arr.shape[0] or arr.dtype.kind not in "iu" or arr.min() < 0:
        return None
    key = arr.astype(np.int64, copy=False).tobytes()
    got = _MEMBERS.get(key)
    if got is None:
        if len(_MEMBERS) >= 4096:
            _MEMBERS.clear()
        got = _MEMBERS[key] = np.unique(arr.astype(np.int64))
        got.flags.writeable = False
    return got


def _member(arr: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Which entries of ``group`` are in the ascending ``arr``."""
    if not arr.shape[0]:
        return np.zeros(group.shape[0], bool)
    at = np.minimum(np.searchsorted(arr, group), arr.shape[0] - 1)
    return arr[at] == group


class NodeReducer:
    """The relay's reduction (see the module): `take` each message as it comes, `due`
    before each bundle leaves.

    Args:
        limits: the value checks a steps message must pass to have its rows reduced (the
            hub's; a message that fails goes on whole, for the hub to refuse and count).
        stale_steps, hold_s, max_held_rows: when held rows give up waiting.
        partials: reduce groups with members beyond the relay to parts (`hub.partial`),
            where it carries two or more of their members; False sends their rows on.
        instance_steps: list the instances of the groups it matches up to its ranks' share
            of the hub's instance table over this many steps (`INSTANCE_STEPS`), each group
            the same number a step, rotating over the calls of a step from one step to the
            next; the cells sum them all. None lists every one.
    """

    def __init__(
        self,
        limits: Limits = REPLAY_LIMITS,
        stale_steps: int = STALE_STEPS,
        hold_s: float = HOLD_S,
        max_held_rows: int = MAX_HELD_ROWS,
        partials: bool = True,
        instance_steps: int | None = INSTANCE_STEPS,
    ) -> None:
        self.limits = limits
        self.partials = partials
        self.instance_steps = instance_steps
        self.stale_steps = stale_steps
        self.hold_s = hold_s
        self.max_held_rows = max_held_rows
        self.counters = ReduceCounters()
        self._runs: dict[str, _Run] = {}
        self._held_rows = 0
        self._out: list[bytes] = []

    def take(self, frame: bytes, now: float | None = None) -> list[bytes]:
        """What to forward at once for one message from a collector: nothing when its
        rows join the node's next message (`due`), else the message itself (after the
        node's message so far, where order matters)."""
        try:
            msg = schema.decode(frame, self.limits.max_header_bytes)
        except schema.SchemaError:
            return [frame]  # the hub refuses it and counts why
        h = msg.header
        kind = msg.kind
        if kind == "hello":
            run = self._runs.get(h["run"])
            # Rows of an incarnation the hello ends leave before it.
            first = self._node(h["run"], run) if run is not None and run.pending else []
            self._hello(h, time.monotonic() if now is None else now)
            retired, self._out = self._out, []  # what a run it retired held, first
            return [*first, *retired, frame]
        run = self._runs.get(h["run"])
        if run is None or run.job != h["job"] or run.inc.get(h["rank"]) != h["inc"]:
            return [frame]
        run.heard = time.monotonic() if now is None else now
        if kind == "groups":
            new = []
            for g in h["groups"]:
                members = _members(g["ranks"])
                if members is None:
                    new.append(g)  # the hub refuses it and says why
                    continue
                gid = int(g["id"])
                run.groups[gid] = members
                sent = run.sent_groups.get(gid)
                if sent is None or not (sent is members or np.array_equal(sent, members)):
                    run.sent_groups[gid] = members
                    new.append(g)
            run.relocal()
            if len(new) == len(h["groups"]):
                return [frame]
            # Every rank reports the groups it belongs to: a node's eight ranks the same
            # world group, a rack's 256 the same data-parallel groups. What this relay
            # already sent goes on once (the message itself goes on, maybe empty: the
            # hub counts what reached it).
            self.counters.groups_deduplicated += 1
            header = {k: h[k] for k in ("job", "run", "rank", "inc")}
            return [schema.groups_message(header, new)]
        if kind == "samples":
            if not self._checked(msg):
                return [frame]
            self._add(run, "samples", msg.tables["samples"], h["rank"], h["inc"])
            run.carried += 1
        elif kind == "steps":
            if not self._steps(run, msg, time.monotonic() if now is None else now):
                return [frame]
            run.carried += 1
        elif kind == "reduced":
            if not self._merge(run, msg, time.monotonic() if now is None else now):
                return [frame]
            run.carried += int(h.get("messages") or 0)
        elif kind == "stats" and isinstance(h.get("stats"), dict) and msg.nbytes <= MAX_STATS_BYTES:
            run.stats.append([int(h["rank"]), int(h["inc"]), h["stats"]])
            run.carried += 1
        else:
            return [frame]
        return self._node(h["run"], run) if run.pending >= MAX_NODE_ROWS else []

    def due(self, now: float | None = None) -> list[bytes]:
        """The messages ready to leave: one ``reduced`` message per run with what its
        ranks sent since the last call and the instances completed meanwhile, and held
        rows that gave up waiting (sent on as rows)."""
        now = time.monotonic() if now is None else now
        for run_id, run in self._runs.items():
            self._expire(run, now)
            self._out += self._node(run_id, run)
        out, self._out = self._out, []
        return out

    def _retire(self, run_id: str) -> None:
        run = self._runs[run_id]
        for key in list(run.held):
            self._pass_on(run, key)
        self._out += self._node(run_id, run)
        del self._runs[run_id]

    def flush_all(self) -> list[bytes]:
        """Stopping: everything held goes on as rows, after what is complete."""
        for run in self._runs.values():
            for key in list(run.held):
                self._pass_on(run, key)
        return self.due()

    # -- messages ---------------------------------------------------------------------

    def _hello(self, h: Mapping[str, Any], now: float) -> None:
        run = self._runs.get(h["run"])
        if run is None:
            if len(self._runs) >= MAX_RUNS:  # the run heard from longest ago leaves
                self._retire(min(self._runs, key=lambda k: self._runs[k].heard))
            run = self._runs[h["run"]] = _Run(job=h["job"], partials=self.partials)
        elif run.job != h["job"]:
            return
        run.heard = now
        rank, inc = int(h["rank"]), int(h["inc"])
        if rank not in run.inc and len(run.inc) >= MAX_RANKS:
            return
        if inc < run.inc.get(rank, -1):
            return
        new = rank not in run.inc
        run.inc[rank] = inc
        ident = h.get("identity")
        if isinstance(ident, Mapping) and isinstance(ident.get("world_size"), int):
            run.world = max(run.world, int(ident["world_size"]))
        run.header[rank] = {k: h[k] for k in ("job", "run", "rank", "inc")}
        if new:
            run.relocal()

    def _checked(self, msg: schema.Message) -> bool:
        """Whether the hub would take the values of ``msg`` (those it would refuse go on
        alone, for the hub to name the column)."""
        try:
            check_values(msg, None, self.limits)
        except Reject:
            return False
        return True

    def _steps(self, run: _Run, msg: schema.Message, now: float) -> bool:
        """Take a steps message into the node's next one; False to send it on alone."""
        h = msg.header
        rank, inc = int(h["rank"]), int(h["inc"])
        st = msg.tables["steps"]
        steps = st["step"]
        done = run.done.setdefault(rank, set())
        if any(s in done for s in steps.tolist()) or not self._checked(msg):
            return False  # a repeat (the hub drops it and counts) or refused values
        ph = msg.tables.get("phases")
        if ph is not None and ph["step"].shape[0]:
            codes = run.phase_codes(tuple(h.get("phase_names") or ()))
            if codes is None:
                return False  # more user phase names than a message may carry
            ph = dict(ph, phase=codes[ph["phase"]].astype(np.int16))
        co = msg.tables.get("colls")
        if co is not None and co["step"].shape[0]:
            # Blocking collectives of the node's groups; point-to-point and async calls go
            # on as rows (the exposed-time union needs them: `diagnosis.exposure`).
            mine = run.reducible_rows(co)
            if mine.any():
                rows = with_cut(co, rank)
                self._hold(run, rank, inc, {k: v[mine] for k, v in rows.items()}, now)
                co = {k: v[~mine] for k, v in co.items()}
            if co["step"].shape[0]:
                self._add(run, "colls", co, rank, inc)
        self._add(run, "steps", st, rank, inc)
        if ph is not None and ph["step"].shape[0]:
            self._add(run, "phases", ph, rank, inc)
        self._note_steps(run, rank, steps)
        return True

    def _merge(self, run: _Run, msg: schema.Message, now: float) -> bool:
        """Take a lower relay's node message into this one's (a rack's relay gathers its
        nodes'); False to send it on alone (a rank or incarnation this relay did not see
        say hello, or more phase names than a message may carry)."""
        tables = dict(msg.tables)
        for t in tables.values():
            if "rank" not in t or not t["rank"].shape[0]:
                continue
            ranks, inv = np.unique(t["rank"], return_inverse=True)
            want = np.array([run.inc.get(r, -1) for r in ranks.tolist()], np.int64)
            if (t["inc"] != want[inv]).any():
                return False
        ph = tables.get("phases")
        if ph is not None and ph["step"].shape[0]:
            codes = run.phase_codes(tuple(msg.header.get("phase_names") or ()))
            if codes is None or int(ph["phase"].max()) >= codes.shape[0]:
                return False
            tables["phases"] = dict(ph, phase=codes[ph["phase"]].astype(np.int16))
        stats = msg.header.get("stats") or []
        if any(run.inc.get(r) != inc for r, inc, _ in stats):
            return False
        run.stats += stats
        unlisted = msg.header.get("unlisted") or (0, 0)
        run.unlisted = [run.unlisted[0] + unlisted[0], run.unlisted[1] + unlisted[1]]
        co = tables.get("colls")
        touched: set[tuple[int, int]] = set()
        if co is not None and co["rank"].shape[0]:
            # Rows of groups whose members all said hello through this relay (a rack's
            # relay holds every member of a group that spans its nodes): matched here as
            # a node relay matches its node's, once each member's step row has come.
            mine = run.reducible_rows(co)
            if mine.any():
                owner = co["rank"].astype(np.int64) * (1 << 32) + co["inc"]
                rows = with_cut(co, owner)
                held = {k: v[mine] for k, v in rows.items()}
                who = held["rank"].astype(np.int64)
                order = np.argsort(who, kind="stable")
                cuts = np.flatnonzero(np.diff(who[order])) + 1
                for at in np.split(order, cuts):
                    rank, inc = int(who[at[0]]), int(held["inc"][at[0]])
                    rows = {k: v[at] for k, v in held.items() if k not in ("rank", "inc")}
                    touched |= self._hold(run, rank, inc, rows, now)
                tables["colls"] = {k: v[~mine] for k, v in co.items()}
        for name in ("steps", "phases", "colls", "samples"):
            t = tables.get(name)
            if t is not None and t["rank"].shape[0]:
                run.tables.setdefault(name, []).append(t)
                run.pending += t["rank"].shape[0]
        if tables["cells"]["rank"].shape[0]:
            run.cells.append(tables["cells"])
            run.instances.append(tables["instances"])
        pc = tables.get("part_cells")
        if pc is not None and pc["rank"].shape[0] and "parts" in tables:
            run.parts.append(tables["parts"])  # a lower relay's parts go on as they came
            run.part_cells.append(pc)
            if "part_rows" in tables:
                run.part_rows.append(tables["part_rows"])
        st = tables.get("steps")
        if st is not None and st["rank"].shape[0]:
            who = st["rank"].astype(np.int64)
            order = np.argsort(who, kind="stable")
            cuts = np.flatnonzero(np.diff(who[order])) + 1
            for at in np.split(order, cuts):
                self._note_steps(run, int(who[at[0]]), st["step"][at])
        # Rows that came after every member's step row (a lower relay let them go late).
        for key in touched:
            if key in run.held and all(key[1] in run.done.get(r, ()) for r in run.here[key[0]]):
                self._complete(run, key)
        self.counters.merged += 1
        return True

    def _add(
        self, run: _Run, table: str, cols: Mapping[str, np.ndarray], rank: int, inc: int
    ) -> None:
        n = next(iter(cols.values())).shape[0]
        if not n:
            return
        run.tables.setdefault(table, []).append(
            {**cols, "rank": np.full(n, rank, np.int32), "inc": np.full(n, inc, np.int32)}
        )
        run.pending += n

    def _node(self, run_id: str, run: _Run) -> list[bytes]:
        """The run's node message of what is gathered, if anything is."""
        if not run.pending and not run.cells and not run.stats and not run.parts:
            return []
        tables = {name: _concat(parts) for name, parts in run.tables.items()}
        if run.cells:
            tables["cells"] = _sum_cells(_concat(run.cells))
            tables["instances"] = _concat(run.instances)
        if run.parts:
            tables["parts"] = _concat(run.parts)
            tables["part_cells"] = _concat(run.part_cells)
            if run.part_rows:
                tables["part_rows"] = _concat(run.part_rows)
        carried, stats, unlisted = run.carried, run.stats, run.unlisted
        run.tables, run.cells, run.instances, run.pending, run.carried = {}, [], [], 0, 0
        run.unlisted = [0, 0]
        run.parts, run.part_cells, run.part_rows = [], [], []
        run.stats = []
        # The header names a rank the message covers, as every message names its sender,
        # and how many of the collectors' messages it stands for.
        ranks = [int(t["rank"].min()) for t in tables.values() if "rank" in t and len(t["rank"])]
        rank = min(ranks + [r for r, _, _ in stats])
        self.counters.messages += 1
        header = {**run.header[rank], "messages": carried}
        if stats:
            header["stats"] = stats
        if unlisted[0]:
            header["unlisted"] = unlisted
        return [schema.reduced_message(header, tables, run.phase_names)]

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
        for step in ids:
            for gid in list(run.by_step.get(step, ())):
                key = (gid, step)
                # A member whose rows came reduced (a lower relay's part) completes too.
                here = run.here.get(gid, ())
                if rank in here and all(step in run.done.get(r, ()) for r in here):
                    self._complete(run, key)

    def _hold(
        self, run: _Run, rank: int, inc: int, co: dict[str, np.ndarray], now: float
    ) -> set[tuple[int, int]]:
        """Hold one rank's rows by (group, step); returns the keys they joined."""
        keys: set[tuple[int, int]] = set()
        order = np.lexsort((co["step"], co["group"]))
        g, s = co["group"][order], co["step"][order]
        cut = np.flatnonzero((np.diff(g) != 0) | (np.diff(s) != 0)) + 1
        for at in np.split(order, cut):
            key = (int(co["group"][at[0]]), int(co["step"][at[0]]))
            held = run.held.get(key)
            if held is None:
                held = run.held[key] = _Held(since=now)
                run.by_step.setdefault(key[1], set()).add(key[0])
            held.rows.setdefault(rank, []).append({k: v[at] for k, v in co.items()})
            held.incs[rank] = inc
            held.n += at.shape[0]
            self._held_rows += at.shape[0]
            keys.add(key)
        return keys

    # -- reduction --------------------------------------------------------------------

    def _complete(self, run: _Run, key: tuple[int, int]) -> None:
        held = run.unhold(key)
        self._held_rows -= held.n
        gid, step = key
        if gid not in run.local:
            return self._part(run, held, gid, step)
        members = run.here[gid]
        parts = []
        for r in members:
            tabs = held.rows.get(r)
            if not tabs:
                return self._rows_on(run, held)
            parts.append(_by_seq(_concat(tabs)))
        if not _agree(parts):
            return self._rows_on(run, held)
        first = parts[0]
        seq = first["seq"]
        enter_i = np.stack([t["t_enter"] for t in parts])
        exit_i = np.stack([t["t_exit"] for t in parts])
        flags = np.stack([t["flags"] for t in parts])
        if (exit_i == schema.NO_TIME).any():
            return self._rows_on(run, held)
        is_async: np.ndarray | None = (flags & ASYNC_FLAGS) != 0
        assert is_async is not None
        cut = None
        if is_async.any():
            if any("cut" not in t for t in parts):
                return self._rows_on(run, held)
            cut = _relative(np.stack([t["cut"] for t in parts]), int(enter_i.min()))
        else:
            is_async = None
        incs = {held.incs[r] for r in members}
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
        sums = block_sums(enter, exit_, m, np.zeros(1, np.int64), is_async, cut)
        c, k = enter.shape
        cells = {
            "rank": ranks.astype(np.int32),
            "inc": np.full(c, inc, np.int32),
            "step": np.full(c, step, np.int64),
            "n": np.full(c, k, np.int32),
            "times_last": sums["times_last"][:, 0].astype(np.int32),
        }
        for name in schema.CELL_SUMS:
            cells[name] = sums[name][:, 0]
        run.cells.append(cells)
        listed = self._listed(run, k, step)
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
                "first_exit": exit_i.min(axis=0),
                "last_exit": exit_i.max(axis=0),
            }
            if listed is None
            else {
                "group": np.full(listed.shape[0], gid, np.int32),
                "seq": seq[listed],
                "step": first["step"][listed],
                "inc": np.full(listed.shape[0], inc, np.int32),
                "op": first["op"][listed],
                "nbytes": first["nbytes"][listed],
                "n_members": np.full(listed.shape[0], c, np.int32),
                "first": m.first[listed].astype(np.int64) + origin,
                "last": m.last[listed].astype(np.int64) + origin,
                "last_rank": m.last_rank[listed].astype(np.int32),
                "margin": m.margin[listed],
                "transfer": m.transfer[listed],
                "device_transfer": m.device_transfer[listed],
                "first_exit": exit_i.min(axis=0)[listed],
                "last_exit": exit_i.max(axis=0)[listed],
            }
        )
        if listed is not None:
            run.unlisted[0] += k - listed.shape[0]
            run.unlisted[1] += c * (k - listed.shape[0])
        self.counters.reduced_rows += c * k
        self.counters.instances += k if listed is None else listed.shape[0]
        return None

    def _listed(self, run: _Run, k: int, step: int) -> np.ndarray | None:
        """Which of a group's ``k`` instances of ``step`` to list (None: all): at most the
        relay's share of the hub's instance table (`INSTANCE_STEPS`) spread over the groups
        it matches, every ``stride``-th call from an offset that moves with the step."""
        if self.instance_steps is None or run.world <= 0:
            return None
        share = MAX_INSTANCE_ROWS * len(run.inc) / run.world / self.instance_steps
        most = max(1, int(share / max(1, len(run.local))))
        if k <= most:
            return None
        stride = -(-k // most)
        return np.arange(step % stride, k, stride)

    def _part(self, run: _Run, held: _Held, gid: int, step: int) -> None:
        """The part of each instance of ``gid`` in ``step`` for the members whose rows this
        relay holds (`hub.partial.make_part`); rows on where they disagree on what they
        called, hold asynchronous rows or an unknown exit, or span incarnations."""
        members = sorted(held.rows)
        tabs = [_by_seq(_concat(held.rows[r])) for r in members]
        if not _agree(tabs):
            return self._rows_on(run, held)
        first = tabs[0]
        seq = first["seq"]
        stack = {name: np.stack([t[name] for t in tabs]) for name in _PART_ROWS}
        if (stack["t_exit"] == schema.NO_TIME).any():
            return self._rows_on(run, held)
        incs = {held.incs[r] for r in members}
        if len(incs) != 1:
            return self._rows_on(run, held)
        made = make_part(
            gid,
            step,
            incs.pop(),
            np.array(members, np.int64),
            seq,
            first["op"],
            first["nbytes"],
            stack["t_enter"],
            stack["t_exit"],
            stack["cut"],
            stack["flags"],
            stack["t_start"],
            stack["t_end"],
        )
        if made is None:
            return self._rows_on(run, held)
        if gid not in run.parted:
            run.parted.add(gid)
            run.relocal()
        run.parts.append(made[0])
        run.part_cells.append(made[1])
        if made[2]["rank"].shape[0]:
            run.part_rows.append(made[2])
        self.counters.reduced_rows += len(members) * seq.shape[0]
        self.counters.parts += seq.shape[0]
        return None

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
        held = run.unhold(key)
        self._held_rows -= held.n
        self._rows_on(run, held)

    def _rows_on(self, run: _Run, held: _Held) -> None:
        """Send held rows on as their ranks' rows, for the hub to match."""
        for rank, tabs in held.rows.items():
            co = {k: v for k, v in _concat(tabs).items() if k in schema.COLL_COLUMNS}
            self.counters.passed_rows += co["step"].shape[0]
            self._add(run, "colls", co, rank, held.incs[rank])


_PART_ROWS = ("t_enter", "t_exit", "cut", "flags", "t_start", "t_end")
"""The row columns a part is made of."""


def _agree(tabs: list[dict[str, np.ndarray]]) -> bool:
    """Whether members' rows of one group and step (in call order) name the same calls:
    the same ``seq``, ``op`` and ``nbytes``, each call once, none of an unknown ``seq``."""
    first = tabs[0]
    seq = first["seq"]
    if (seq < 0).any() or (seq.shape[0] > 1 and (np.diff(seq) == 0).any()):
        return False
    return all(
        np.array_equal(t["seq"], seq)
        and np.array_equal(t["nbytes"], first["nbytes"])
        and np.array_equal(t["op"], first["op"])
        for t in tabs
    )


def _by_seq(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A rank's rows of one group and step in call order."""
    if t["seq"].shape[0] > 1 and (np.diff(t["seq"]) <= 0).any():
        order = np.argsort(t["seq"], kind="stable")
        return {k: v[order] for k, v in t.items()}
    return t


def _relative(t: np.ndarray, origin: int) -> np.ndarray:
    out = (t - origin).astype(np.float64)
    out[t == schema.NO_TIME] = np.nan
    return out


def _sum_cells(cells: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One cell per (rank, incarnation, step): a rack's relay sums the cells of what it
    matched itself into its nodes' cells of the same rank-step (a message names each once)."""
    key = np.stack([cells["rank"].astype(np.int64), cells["inc"].astype(np.int64), cells["step"]])
    order = np.lexsort(key[::-1])
    k = key[:, order]
    new = np.ones(order.shape[0], bool)
    new[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)
    if new.all():
        return cells
    starts = np.flatnonzero(new)
    out = {name: cells[name][order][starts] for name in ("rank", "inc", "step")}
    for name in ("n", "times_last", *schema.CELL_SUMS):
        out[name] = np.add.reduceat(cells[name][order], starts).astype(cells[name].dtype)
    return out


def _concat(parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    parts = list(parts)
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def unpack_node(msg: schema.Message) -> list[schema.Message]:
    """The ``steps`` and ``samples`` messages of each rank a ``reduced`` message gathers
    (its sums aside), for readers that walk a recording message by message.

    Args:
        msg: a decoded ``reduced`` message.

    Returns:
        One ``steps`` message per (rank, incarnation) with rows, then one ``samples``
        message per one with samples; headers ``job``, ``run``, ``rank``, ``inc`` and the
        node message's ``phase_names``.
    """
    h = msg.header
    names = list(h.get("phase_names") or [])
    out: list[schema.Message] = []
    per: dict[tuple[int, int], dict[str, dict[str, np.ndarray]]] = {}
    for name in ("steps", "phases", "colls", "samples"):
        t = msg.tables.get(name)
        if t is None or not t["rank"].shape[0]:
            continue
        who = t["rank"].astype(np.int64) * (1 << 32) + t["inc"]
        order = np.argsort(who, kind="stable")
        cuts = np.flatnonzero(np.diff(who[order])) + 1
        for at in np.split(order, cuts):
            key = (int(t["rank"][at[0]]), int(t["inc"][at[0]]))
            cols = {k: v[at] for k, v in t.items() if k not in ("rank", "inc")}
            per.setdefault(key, {})[name] = cols
    samples = []
    for (rank, inc), tables in sorted(per.items()):
        header = {"job": h["job"], "run": h["run"], "rank": rank, "inc": inc}
        rows = {k: v for k, v in tables.items() if k != "samples"}
        if rows:
            rows.setdefault("steps", schema.empty_table("steps", 0))
            out.append(
                schema.Message(kind="steps", header={**header, "phase_names": names}, tables=rows)
            )
        if "samples" in tables:
            samples.append(
                schema.Message(kind="samples", header=header, tables={"samples": tables["samples"]})
            )
    return out + samples
