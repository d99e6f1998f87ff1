"""Semantic validation of decoded messages against what the hub already knows.

``collector.schema.decode`` checks the shape of one message; this module checks it makes
sense for the run it claims: the rank said hello (for this incarnation), belongs to the
run's world, tables refer to known phase names and carry entry times, steps are not
repeated. Each failure is a `Reject` with a stable ``reason`` tag the hub counts:

``unknown_rank``        data from a rank (or incarnation) that has not said hello
``rank_out_of_range``   a rank or group member outside the run's world size
``world_size_mismatch`` a hello whose world size differs from the run's
``run_mismatch``        a hello reusing a run id under another job
``stale_incarnation``   data from an incarnation older than the rank's latest hello
``bad_phase``           a phase code outside built-in plus message phase names
``bad_time``            a collective without entry time, or a span ending before it starts
``bad_stats``           a stats message whose ``stats`` is not a map
``duplicate_step``      (counted per step, the message is kept without them) a step this
                        rank already reported, or one repeated inside the message
``bad_host_value``      (counted per value by the store when it writes the step, the
                        message is kept) a host or MoE column value that cannot be: see
                        ``hub.runstate.host_value_bounds``.
``bad_incarnation``     a hello whose incarnation exceeds the rank's latest (or, for a rank
                        new to a run, the run's latest) by more than
                        ``Limits.max_incarnation_step``
``identity_conflict``   a hello that changes a live rank's identity (host or pid) or raises
                        its incarnation while the rank was heard from within
                        ``Limits.identity_quiet_s`` (see below)
``world_too_large``     a hello claiming more ranks than ``Limits.max_world_size``, or than
                        the store's cell budget can give its 16-step floor
``too_many_runs``       a hello for a new run beyond ``Limits.max_runs`` runs in the store,
                        or ``Limits.max_runs_per_job`` runs of its job
``store_full``          a new run whose ring floor no longer fits the store's cell budget
                        beside every other run's floor, or a hello whose identity and
                        manifest no longer fit ``Limits.max_identity_bytes``
``too_large``           a message over ``Limits.max_message_bytes`` (also decode's cap),
                        one holding over ``Limits.max_header_bytes`` outside its tables
                        (measured before decoding), or a manifest over
                        ``Limits.max_manifest_bytes`` (packed)
``bad_time``            also: a time outside ``0..schema.MAX_TIME_NS`` or outside the
                        window of ``Limits.time_window_s`` around the hub's clock (the
                        receive time), a collective leaving before it entered, a device end
                        before its start, a step, span or collective longer than
                        ``Limits.max_duration_s``
``bad_op``              a collective ``op`` code outside ``schema.OPS`` (-1: unknown)
``bad_nbytes``          a collective byte count below -1 (-1: unknown)
``bad_step``            a negative step id, or a collective ``seq`` or ``step`` below -1
``bad_group``           a collective row whose group id is negative
``bad_groups``          a group that lists a rank twice, or no rank
``too_many_frames``     frames of one multipart message past ``server.MAX_BUNDLE_FRAMES``
                        (a relay's bundle holds fewer; counted by the receive loop)
``bad_reduced``         a relay's ``reduced`` message that does not add up: a cell of a rank
                        outside the world or of another incarnation than the rank's
                        latest, counts or sums that cannot be (``times_last`` above ``n``,
                        a negative or non-finite sum), an instance of a group the run does
                        not know or of another size, its last arriver outside the group,
                        calls in the cells that are not the instances' members, a
                        (rank, step) or instance twice
``duplicate_instance``  a ``reduced`` message repeating an instance the hub already folded
                        (one at or below the last ``seq`` folded for its group)

The values of the tables are checked without hub state (`check_values`); the live hub
checks a batch's values together first (`values_plausible`) and asks message by message
only when something is doubtful, so a reject always names its own message's column.

``decode`` (``collector.schema``) counts its own reasons: ``bad_msgpack``, ``bad_version``,
``bad_kind``, ``bad_header``, ``bad_type``, ``bad_table``, ``bad_size``, ``bad_hello``,
``bad_identity``, ``bad_groups``, ``bad_phase``, ``bad_time``, ``bad_beat`` (a heartbeat's
position, state or stacks), ``bad_fr`` (a heartbeat's Flight Recorder dump that is not a
string, is longer than ``schema.MAX_FR_CHARS`` or is not a JSON object), ``too_large``.
Every reject's detail names the field and the value.

Identity rule (no per-rank credentials yet; CURVE authentication is separate): a hello for
a rank the run knows may repeat its identity (collectors resend hello every 30 s and after
a reconnect) or update its other fields (mesh, rail, manifest). It may change the rank's
host or pid, or raise its incarnation, only once the rank has been silent (no message of
any kind) for ``identity_quiet_s`` on the hub's receive clock: a restarted process is
silent from its crash, a live one sends stats every 5 s. A restart faster than that is
heard at its next hello (at most 30 s later). Replays use the recorded receive times, so
they decide the same.

Out-of-order steps are fine: the store places each step in its slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from rankscope.collector import schema
from rankscope.hub.runstate import RunState
from rankscope.hub.store import Store

DEFAULT_TIME_WINDOW_S = 86_400.0
"""The window around its clock a hub should use where its senders are real collectors (one
day either side): a collector aligns its clock to the hub's, so a time further off is a
broken or hostile sender. Not the default (`Limits.time_window_s`): simulated, imported and
test streams carry times of their own (2001, 2023, 2027...) into live hubs."""


@dataclass(frozen=True)
class Limits:
    """What the hub accepts whatever a sender claims; every limit hit is a counted reject.

    The defaults bound a hub's memory to its store's cell budget plus a fixed overhead
    (``benchmarks/bench_hostile.py`` measures it under hostile senders).
    """

    max_message_bytes: int = schema.MAX_MESSAGE_BYTES
    """Largest message (``too_large``). ZeroMQ resets a connection that sends more than
    ``schema.MAX_MESSAGE_BYTES`` (a ``disconnects`` count); below that, this is counted."""
    max_header_bytes: int = schema.MAX_HEADER_BYTES
    """Most bytes of a message outside its tables, measured before decoding (``too_large``):
    what its Python objects can cost is bounded before they exist."""
    max_world_size: int = 131_072
    """Most ranks a run may claim (``world_too_large``): twice the 65,536-rank target."""
    max_runs: int = 256
    """Most runs the store holds (``too_many_runs``)."""
    max_runs_per_job: int = 64
    """Most runs of one job (``too_many_runs``): a job's full run and its reruns."""
    max_manifest_bytes: int = 256 * 1024
    """Largest manifest, msgpack-packed (``too_large``)."""
    max_identity_bytes: int = 64 * 1024 * 1024
    """Bound on the identities and manifests the store holds over all runs, packed
    (``store_full``); identical manifests of one run count once."""
    max_incarnation_step: int = 8
    """Most a hello may raise a rank's incarnation (``bad_incarnation``)."""
    identity_quiet_s: float = 15.0
    """Silence after which a hello may change a rank's identity (``identity_conflict``)."""
    time_window_s: float | None = None
    """Times must lie within this many seconds of the hub's clock (the receive time; the
    recorded one in a replay); None (the default): only ``0..schema.MAX_TIME_NS``, with
    ``max_duration_s``. A production hub sets `DEFAULT_TIME_WINDOW_S`."""
    max_duration_s: float = 7 * 86_400.0
    """Longest step, phase span or collective (``bad_time``)."""
    max_clock_frame_bytes: int = 256
    """Largest clock ping frame (``clock_bad`` in the transport counters)."""
    max_connections: int = 0
    """Most data connections open at once, past which a new one is refused at its
    handshake (``too_many_connections`` in the transport counters; `hub.gate`); 0: no cap.
    Each connection may hold up to ``max_message_bytes`` while a message arrives, so this
    times that bounds what ZeroMQ holds of messages still arriving (whole ones wait in
    each connection's queue, bounded in messages by the hub's ``rcvhwm``); direct
    collectors take one connection each, a relay one for its node."""
    max_queued_bytes: int = 64 * 1024 * 1024
    """Most bytes the hub's receive loop takes off ZeroMQ before processing them (with at
    most 512 messages). What ZeroMQ itself holds is bounded per connection in messages
    (``RCVHWM``) and by ``MAXMSGSIZE``: see the hub's socket options."""

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes",
            "max_header_bytes",
            "max_world_size",
            "max_runs",
            "max_runs_per_job",
            "max_manifest_bytes",
            "max_identity_bytes",
            "max_clock_frame_bytes",
            "max_queued_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.max_connections < 0:
            raise ValueError(f"Limits.max_connections must be ≥ 0, got {self.max_connections}")
        if self.max_incarnation_step < 0 or self.identity_quiet_s < 0:
            raise ValueError("Limits.max_incarnation_step and identity_quiet_s must be ≥ 0")
        if self.max_duration_s <= 0 or (self.time_window_s is not None and self.time_window_s <= 0):
            raise ValueError("Limits.max_duration_s and time_window_s must be > 0")

    def time_bounds(self, now_ns: int | None) -> tuple[int, int]:
        """``(lo, hi)``: the times a message may hold when the hub's clock reads ``now_ns``."""
        if self.time_window_s is None or now_ns is None:
            return 0, schema.MAX_TIME_NS
        w = int(self.time_window_s * 1e9)
        return max(0, now_ns - w), min(schema.MAX_TIME_NS, now_ns + w)


LIVE_LIMITS = Limits()
"""The limits of a `Hub` made without any."""
REPLAY_LIMITS = Limits()
"""The limits of a replay, and of an `Intake` made without any."""


class Reject(Exception):
    """A message the hub will not ingest, with a stable ``reason`` and a human detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Verdict:
    """What to ingest of an accepted message."""

    keep_steps: np.ndarray | None = None
    """For steps messages: mask of step rows to keep."""
    duplicate_steps: int = 0
    """Step rows dropped as duplicates."""
    empty: bool = False
    """Nothing is left to ingest (every step was a duplicate)."""
    rejects: tuple[tuple[str, str, int], ...] = ()
    """(reason, detail, count) of the parts of a ``reduced`` message left out (the rows of
    a rank the hub does not know in that incarnation), the rest being kept."""


_ACCEPT = Verdict()
"""The verdict of a message kept whole (shared: it is frozen)."""


def check(
    msg: schema.Message,
    store: Store,
    now_ns: int | None = None,
    limits: Limits = REPLAY_LIMITS,
    *,
    values: bool = True,
) -> Verdict:
    """Validate ``msg`` against the store's state and the hub's limits.

    Args:
        msg: a message decoded by ``schema.decode``.
        store: the live store (read only here).
        now_ns: the hub's clock at receipt (the recorded receive time in a replay): the
            reference of the time window and of the identity rule; None when unknown.
        limits: what the hub accepts.
        values: also run `check_values` (False when `values_plausible` already passed
            the message's batch).

    Returns:
        The `Verdict`.

    Raises:
        Reject: with the reason tag of the first problem found.
    """
    h = msg.header
    run = store.run_state(h["run"])
    rank, inc = h["rank"], h["inc"]
    if msg.nbytes > limits.max_message_bytes:
        raise Reject("too_large", f"{msg.kind} of {msg.nbytes} bytes > {limits.max_message_bytes}")
    if msg.kind == "hello":
        _check_hello(msg, store, run, now_ns, limits)
        return _ACCEPT
    if run is None:
        raise Reject(
            "unknown_rank",
            f"{msg.kind} from rank {rank} of run {h['run']!r}, which no rank has said hello to",
        )
    if rank >= run.world_size:
        raise Reject(
            "rank_out_of_range", f"rank {rank} in run {h['run']!r} of world size {run.world_size}"
        )
    known = int(run.incarnation[rank])
    if known < 0:
        raise Reject(
            "unknown_rank", f"{msg.kind} from rank {rank} of run {h['run']!r} before its hello"
        )
    if inc < known:
        raise Reject(
            "stale_incarnation", f"{msg.kind} from rank {rank} incarnation {inc}, latest is {known}"
        )
    if inc > known:
        raise Reject(
            "unknown_rank",
            f"{msg.kind} from rank {rank} incarnation {inc} before that incarnation's hello",
        )
    kind = msg.kind
    if kind == "steps":  # nearly every message
        return _check_steps(msg, run, values, now_ns, limits)
    if kind == "groups":
        for g in h["groups"]:
            ranks = g["ranks"]
            bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < run.world_size]
            if bad:
                raise Reject(
                    "rank_out_of_range",
                    f"group {g['id']} lists ranks {bad[:5]} outside world size {run.world_size}",
                )
            if len(set(ranks)) != len(ranks) or not ranks:
                raise Reject("bad_groups", f"group {g['id']} lists a rank twice, or none")
        return _ACCEPT
    if kind == "stats":
        if not isinstance(h.get("stats"), dict):
            raise Reject("bad_stats", "stats message without a stats map")
        return _ACCEPT
    if kind == "samples":
        if values:
            check_values(msg, now_ns, limits)
        return _ACCEPT
    if kind == "beat":  # field types and sizes were checked in decoding (bad_beat, bad_fr)
        return _ACCEPT
    if kind == "reduced":
        return check_reduced(msg, run, now_ns, limits)
    return _check_steps(msg, run, values, now_ns, limits)


def check_reduced(
    msg: schema.Message, run: RunState, now_ns: int | None, limits: Limits
) -> Verdict:
    """A relay's ``reduced`` message (`hub.reduce`): its ranks' own rows are checked as
    their own messages would be, and its sums add up and fit the run.

    The rows of a rank the hub does not know in the incarnation they name, and repeated
    steps, are left out and counted (the message's other ranks are kept, as their own
    messages would be); the tables of the message are filtered in place.

    The hub never sees the rows behind the sums, so what can be checked is checked: every
    cell is a current rank's, its sums are what sums of collective times can be (finite,
    not negative, ``times_last`` at most ``n``, each at most ``n`` times the longest
    collective), every instance is of a group the run knows and of its size, with its last
    arriver a member and its times in the window, the cells count exactly one call per
    member of each instance, and no (rank, step) or instance comes twice, in this message
    or after one the hub already folded.

    Returns:
        The `Verdict` (rows left out, with their reasons).

    Raises:
        Reject: a value no reader could use (as for a steps message), or ``bad_reduced``,
            ``bad_time``, ``bad_step``, ``bad_op``, ``bad_nbytes``, ``duplicate_instance``,
            naming the column and the value.
    """
    rejects = _check_rank_tables(msg, run, now_ns, limits)
    stats = msg.header.get("stats")
    if stats:
        kept = []
        for r, inc, _ in stats:
            if not 0 <= r < run.world_size:
                raise Reject("rank_out_of_range", f"stats of rank {r}, world size {run.world_size}")
            if inc == int(run.incarnation[r]):
                kept.append(True)
            else:
                kept.append(False)
                latest = int(run.incarnation[r])
                reason = "stale_incarnation" if 0 <= inc < latest else "unknown_rank"
                rejects.append((reason, f"stats of rank {r} incarnation {inc}, latest {latest}", 1))
        msg.header["stats"] = [e for e, k in zip(stats, kept, strict=True) if k]
    tables = msg.tables
    cells = tables["cells"]
    rank = cells["rank"]
    if rank.shape[0] and int(rank.min()) >= 0 and int(rank.max()) < run.world_size:
        off = cells["inc"] != run.incarnation[rank]
        if off.any():  # sums of an incarnation the hub does not hold: all of them go
            i = int(np.flatnonzero(off)[0])
            inc, latest = int(cells["inc"][i]), int(run.incarnation[rank[i]])
            reason = "stale_incarnation" if 0 <= inc < latest else "unknown_rank"
            detail = f"sums of rank {int(rank[i])} incarnation {inc}, its latest hello is {latest}"
            rejects.append((reason, detail, 1))
            for name in ("cells", "instances"):
                tables[name] = {k: v[:0] for k, v in tables[name].items()}
    _check_sums(msg, run, now_ns, limits)
    rejects += _check_parts(msg, run, now_ns, limits)
    empty = not any(next(iter(t.values())).shape[0] for t in tables.values()) and not (
        msg.header.get("stats")
    )
    dup = sum(n for reason, _, n in rejects if reason == "duplicate_step")
    other = tuple(r for r in rejects if r[0] != "duplicate_step")
    return Verdict(duplicate_steps=dup, empty=empty, rejects=other)


_RANK_TABLES = ("steps", "phases", "colls", "samples")


def _check_rank_tables(
    msg: schema.Message, run: RunState, now_ns: int | None, limits: Limits
) -> list[tuple[str, str, int]]:
    """The rank tables of a ``reduced`` message: values as `check_values` checks a steps
    or samples message's, ranks in the world; rows of a rank in another incarnation than
    the hub's latest, and steps a rank already reported (or repeats inside the message),
    are left out. Returns what was left out."""
    tables = msg.tables
    world = run.world_size
    out: list[tuple[str, str, int]] = []
    for name in _RANK_TABLES:
        t = tables.get(name)
        if t is None or not t["rank"].shape[0]:
            continue
        rank = t["rank"]
        if int(rank.min()) < 0 or int(rank.max()) >= world:
            bad = int(rank[(rank < 0) | (rank >= world)][0])
            raise Reject("rank_out_of_range", f"{name}.rank holds {bad}, world size {world}")
        known = run.incarnation[rank]
        off = t["inc"] != known
        if off.any():
            i = int(np.flatnonzero(off)[0])
            r, inc, latest = int(rank[i]), int(t["inc"][i]), int(known[i])
            reason = "stale_incarnation" if 0 <= inc < latest else "unknown_rank"
            detail = f"{name} rows of rank {r} incarnation {inc}, its latest hello is {latest}"
            out.append((reason, detail, 1))
            tables[name] = {k: v[~off] for k, v in t.items()}
    steps_msg = schema.Message(
        kind="steps",
        header={"phase_names": msg.header.get("phase_names") or []},
        tables={
            "steps": tables.get("steps") or _EMPTY_STEPS,
            **{n: tables[n] for n in ("phases", "colls") if n in tables},
        },
    )
    check_values(steps_msg, now_ns, limits)
    if "samples" in tables:
        samples = schema.Message(kind="samples", header={}, tables={"samples": tables["samples"]})
        check_values(samples, now_ns, limits)
    st = tables.get("steps")
    if st is None or not st["step"].shape[0]:
        return out
    rank, steps, inc = st["rank"].astype(np.int64), st["step"], st["inc"]
    slots = run.lookup(steps.astype(np.int64))
    ok = slots >= 0
    s = np.where(ok, slots, 0)
    seen = ok & run.present[rank, s] & (run.cell_inc[rank, s] >= inc)
    others = [n for n in ("phases", "colls") if n in tables]
    key, *keys = _pair_keys(st, *(tables[n] for n in others))
    order = np.argsort(key, kind="stable")
    again = np.zeros(key.shape[0], bool)
    again[order[1:]] = key[order][1:] == key[order][:-1]
    gone = seen | again
    if gone.any():
        n = int(gone.sum())
        out.append(("duplicate_step", f"{n} step(s) of the node's ranks sent again", n))
        # A step reported before loses its phase and collective rows too, as with a steps
        # message's (a repeat inside the message keeps its first row and so its rows).
        lost = key[seen]
        tables["steps"] = {k: v[~gone] for k, v in st.items()}
        for name, k in zip(others, keys, strict=True):
            if lost.shape[0]:
                tables[name] = {c: v[~np.isin(k, lost)] for c, v in tables[name].items()}
    return out


def _pair_keys(*tables: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Each table's (rank, step) pairs as int64 keys, equal exactly where both are: the
    step ids (any int64) renumbered densely over all the tables, so no sender's absurd step
    can alias another rank's."""
    steps = np.concatenate([t["step"] for t in tables])
    _, code = np.unique(steps, return_inverse=True)
    n = max(int(steps.shape[0]), 1)
    out, at = [], 0
    for t in tables:
        m = t["step"].shape[0]
        out.append(t["rank"].astype(np.int64) * n + code.reshape(-1)[at : at + m])
        at += m
    return out


_EMPTY_STEPS = schema.empty_table("steps", 0)


def _check_sums(msg: schema.Message, run: RunState, now_ns: int | None, limits: Limits) -> None:
    """The ``cells`` and ``instances`` of a ``reduced`` message (see `check_reduced`)."""
    cells, inst = msg.tables["cells"], msg.tables["instances"]

    lo, hi = limits.time_bounds(now_ns)
    span = float(limits.max_duration_s * 1e9)
    world = run.world_size
    rank, step, n = cells["rank"], cells["step"], cells["n"]
    if rank.shape[0]:
        if int(rank.min()) < 0 or int(rank.max()) >= world:
            bad = int(rank[(rank < 0) | (rank >= world)][0])
            raise Reject("bad_reduced", f"cells.rank holds {bad}, outside world size {world}")
        _check_step_ids("cells.step", step)
        if int(n.min()) < 1 or int(cells["times_last"].min()) < 0:
            raise Reject("bad_reduced", "a cell with no call, or a negative times_last")
        if (cells["times_last"] > n).any():
            raise Reject("bad_reduced", "a cell whose rank arrived last more often than it called")
        sums = np.stack([cells[name] for name in schema.CELL_SUMS])
        # NaN fails every comparison: one test each for finite, negative and too long.
        if not ((sums >= 0) & (sums <= n.astype(np.float64) * span)).all():
            culprits = [
                x for x in schema.CELL_SUMS if not ((cells[x] >= 0) & (cells[x] <= n * span)).all()
            ]
            raise Reject(
                "bad_reduced",
                f"cells.{culprits[0]} holds a value that is not finite, negative or over n x "
                f"Limits.max_duration_s",
            )
        (key,) = _pair_keys(cells)
        if np.unique(key).shape[0] != key.shape[0]:
            raise Reject("bad_reduced", "a (rank, step) cell twice in one message")
    k = inst["group"].shape[0]
    if k == 0:
        if rank.shape[0]:
            raise Reject("bad_reduced", "cells without instances")
        return
    group, seq = inst["group"], inst["seq"]
    _check_step_ids("instances.step", inst["step"])
    _check_step_ids("instances.seq", seq)
    if int(inst["inc"].min()) < 0:
        raise Reject("bad_reduced", f"instances.inc holds {int(inst['inc'].min())} < 0")
    op = inst["op"]
    if int(op.max()) >= _N_OPS or int(op.min()) < -1:
        raise Reject("bad_op", f"instances.op outside -1..{_N_OPS - 1}")
    if int(inst["nbytes"].min()) < -1:
        raise Reject("bad_nbytes", f"instances.nbytes holds {int(inst['nbytes'].min())} < -1")
    first, last = inst["first"], inst["last"]
    _in_bounds("instances.first/last", np.concatenate((first, last)), lo, hi, unknown=False)
    skew = last - first
    if int(skew.min()) < 0:
        raise Reject("bad_time", "an instance whose last entry is before its first")
    margin = inst["margin"]  # NaN: a group of one member
    known = ~np.isnan(margin)
    if not (
        np.isfinite(margin[known]).all()
        and (margin[known] >= 0).all()
        and (margin[known] <= skew[known]).all()
    ):
        raise Reject("bad_reduced", "instances.margin not within 0..last - first")
    for name in ("transfer", "device_transfer"):
        v = inst[name]
        if (np.abs(v[~np.isnan(v)]) > span).any() or np.isinf(v).any():
            raise Reject("bad_reduced", f"instances.{name} holds a value over the longest span")
    gids, sizes, member = run.group_index()
    g64 = group.astype(np.int64)
    pos = np.minimum(np.searchsorted(gids, g64), max(gids.shape[0] - 1, 0))
    if not gids.shape[0] or (gids[pos] != g64).any():
        bad = int(group[0] if not gids.shape[0] else group[gids[pos] != g64][0])
        raise Reject("bad_reduced", f"an instance of group {bad}, which the run does not know")
    size = sizes[pos]
    if (inst["n_members"] != size).any():
        gid = int(group[inst["n_members"] != size][0])
        raise Reject("bad_reduced", f"an instance of group {gid} not of its members' number")
    key = (g64 << 32) + inst["last_rank"]
    at = np.minimum(np.searchsorted(member, key), member.shape[0] - 1)
    if (member[at] != key).any():
        gid = int(group[member[at] != key][0])
        raise Reject("bad_reduced", f"an instance of group {gid} last reached by a non-member")
    members = int(size.sum())
    # Runs of one (group, incarnation), seq ascending: one per group the message covers.
    inc = inst["inc"]
    order = np.lexsort((seq, inc, group))
    g, e, s = group[order], inc[order], seq[order]
    same = (g[1:] == g[:-1]) & (e[1:] == e[:-1])
    if (same & (s[1:] == s[:-1])).any():
        raise Reject("bad_reduced", "an instance twice in one message")
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    folded_seq = run.reduced_seq
    for gid, epoch, low in zip(g[starts].tolist(), e[starts].tolist(), s[starts].tolist()):
        folded = folded_seq.get((gid, epoch))
        if folded is not None and low <= folded:
            raise Reject(
                "duplicate_instance",
                f"group {gid} seq {low} incarnation {epoch} after seq {folded} was folded",
            )
    unlisted = int((msg.header.get("unlisted") or (0, 0))[1])
    if int(n.sum()) != members + unlisted:
        raise Reject(
            "bad_reduced",
            f"cells count {int(n.sum())} calls, the instances' members make {members} and "
            f"the unlisted ones' {unlisted}",
        )


def _check_parts(
    msg: schema.Message, run: RunState, now_ns: int | None, limits: Limits
) -> list[tuple[str, str, int]]:
    """The ``parts`` and ``part_cells`` of a ``reduced`` message (`hub.partial`): each row
    of a group the run knows, ranks its members in their current incarnation, times in the
    window and in order, sums what ``n`` calls can hold. Parts of an incarnation the hub
    does not hold are left out (returned, as `check_reduced`'s rows are); whether the
    shares of an instance agree is `hub.partial.combine`'s to judge, when they are all in.
    """
    tables = msg.tables
    parts, cells = tables.get("parts"), tables.get("part_cells")
    if parts is None and cells is None:
        return []
    if parts is None or cells is None:
        raise Reject("bad_reduced", "parts without part_cells, or part_cells without parts")
    for name in ("parts", "part_cells", "part_rows"):
        t = tables.get(name)
        if t is not None and t["inc"].shape[0] and int(t["inc"].min()) < 0:
            raise Reject("bad_reduced", f"{name}.inc holds {int(t['inc'].min())} < 0")
    if not parts["group"].shape[0] and not cells["rank"].shape[0]:
        return []
    if not parts["group"].shape[0] or not cells["rank"].shape[0]:
        raise Reject("bad_reduced", "parts without part_cells, or part_cells without parts")
    lo, hi = limits.time_bounds(now_ns)
    span = float(limits.max_duration_s * 1e9)
    world = run.world_size
    rank = cells["rank"]
    if int(rank.min()) < 0 or int(rank.max()) >= world:
        bad = int(rank[(rank < 0) | (rank >= world)][0])
        raise Reject("bad_reduced", f"part_cells.rank holds {bad}, outside world size {world}")
    _check_step_ids("parts.step", parts["step"])
    _check_step_ids("parts.seq", parts["seq"])
    _check_step_ids("part_cells.step", cells["step"])
    n = cells["n"].astype(np.float64)
    if int(cells["n"].min()) < 1:
        raise Reject("bad_reduced", "a part cell with no call")
    _in_bounds("part_cells.origin", cells["origin"], lo, hi, unknown=False)
    enter, exit_ = cells["enter_ns"], cells["exit_ns"]
    begin, after = cells["start_ns"], cells["after_ns"]
    if not (
        (enter >= 0)
        & (exit_ >= enter)
        & (exit_ <= n * 2 * span)
        & (begin >= 0)
        & (begin <= n * 2 * span)
        & (after >= 0)
        & (after <= n * span)
    ).all():
        raise Reject(
            "bad_reduced",
            "part_cells sums not finite, negative, exits before entries, or over n x "
            "Limits.max_duration_s",
        )
    if not np.isin(cells["linear"], (0, 1)).all():
        raise Reject("bad_reduced", "part_cells.linear holds a value other than 0 or 1")
    rows = tables.get("part_rows")
    if rows is not None and rows["rank"].shape[0]:
        r = rows["rank"]
        if int(r.min()) < 0 or int(r.max()) >= world:
            bad = int(r[(r < 0) | (r >= world)][0])
            raise Reject("bad_reduced", f"part_rows.rank holds {bad}, outside world size {world}")
        _check_step_ids("part_rows.step", rows["step"])
        _check_step_ids("part_rows.seq", rows["seq"])
        both = np.concatenate((rows["start"], rows["exit"]))
        _in_bounds("part_rows.start/exit", both, lo, hi, unknown=False)
        _in_bounds("part_rows.cut", rows["cut"], lo, hi, unknown=True)
    op = parts["op"]
    if int(op.max()) >= _N_OPS or int(op.min()) < -1:
        raise Reject("bad_op", f"parts.op outside -1..{_N_OPS - 1}")
    if int(parts["nbytes"].min()) < -1:
        raise Reject("bad_nbytes", f"parts.nbytes holds {int(parts['nbytes'].min())} < -1")
    first, last = parts["first"], parts["last"]
    leave, gone = parts["first_exit"], parts["last_exit"]
    _in_bounds(
        "parts.first/last", np.concatenate((first, last, leave, gone)), lo, hi, unknown=False
    )
    runner = parts["runner_up"]
    known = runner != schema.NO_TIME
    if not (
        (last >= first).all()
        and (gone >= leave).all()
        and (leave >= first).all()
        and (last - first <= span).all()
        and (gone - first <= span).all()
        and (runner[known] >= first[known]).all()
        and (runner[known] <= last[known]).all()
    ):
        raise Reject("bad_time", "a part's entries or exits out of order or over the longest span")
    for name in ("exit_median", "end_median"):
        v = parts[name]
        ok = ~np.isnan(v) if name == "end_median" else np.ones(v.shape[0], bool)
        if not ((np.abs(v[ok]) <= span) & np.isfinite(v[ok])).all():
            raise Reject("bad_reduced", f"parts.{name} holds a value over the longest span")
    start = parts["start_max"]
    _in_bounds("parts.start_max", start, lo, hi, unknown=True)
    gids, sizes, member = run.group_index()
    # Part rows name members of the part cells' keys: `combine` refuses any that do not.
    for name, t, who in (("parts", parts, "last_rank"), ("part_cells", cells, "rank")):
        g64 = t["group"].astype(np.int64)
        pos = np.minimum(np.searchsorted(gids, g64), max(gids.shape[0] - 1, 0))
        if not gids.shape[0] or (gids[pos] != g64).any():
            bad = int(g64[0] if not gids.shape[0] else g64[gids[pos] != g64][0])
            raise Reject("bad_reduced", f"{name} of group {bad}, which the run does not know")
        key = (g64 << 32) + t[who]
        at = np.minimum(np.searchsorted(member, key), member.shape[0] - 1)
        if (member[at] != key).any():
            gid = int(g64[member[at] != key][0])
            raise Reject("bad_reduced", f"{name}.{who} not a member of group {gid}")
        if name == "parts":
            size = sizes[pos]
            m, d = t["n_members"], t["n_device"]
            if ((m < 1) | (m > size) | (d < 0) | (d > m)).any():
                raise Reject("bad_reduced", "parts.n_members/n_device outside 1..the group's size")
    off = cells["inc"] != run.incarnation[rank]
    if not off.any():
        return []
    # Shares of an incarnation the hub does not hold: those of their (group, step) go.
    i = int(np.flatnonzero(off)[0])
    inc, latest = int(cells["inc"][i]), int(run.incarnation[rank[i]])
    reason = "stale_incarnation" if 0 <= inc < latest else "unknown_rank"
    detail = f"parts of rank {int(rank[i])} incarnation {inc}, its latest hello is {latest}"
    named = [("parts", parts), ("part_cells", cells)]
    if rows is not None:
        named.append(("part_rows", rows))
    keys = [np.stack([t["group"].astype(np.int64), t["step"]], axis=1) for _, t in named]
    _, code = np.unique(np.concatenate(keys), axis=0, return_inverse=True)
    code = code.reshape(-1)
    bounds = np.cumsum([0] + [k.shape[0] for k in keys])
    bad = code[bounds[1] : bounds[2]][off]
    for (name, t), a, b in zip(named, bounds[:-1], bounds[1:], strict=True):
        tables[name] = {k: v[~np.isin(code[a:b], bad)] for k, v in t.items()}
    return [(reason, detail, 1)]


_WHO = ("host", "pid")
"""Identity fields that say which process a rank is (see the module's identity rule)."""


PACKED_MANIFEST = "_manifest_packed"
"""Header key where validation leaves a hello's packed manifest for the store (packed once
per hello: it is both what the limits measure and what the store holds)."""


def _packed(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except Exception as exc:  # a value msgpack made cannot fail, but a caller's may
        raise Reject("bad_hello", f"manifest cannot be packed: {exc!r}") from None


def _check_hello(
    msg: schema.Message,
    store: Store,
    run: RunState | None,
    now_ns: int | None,
    limits: Limits,
) -> None:
    h = msg.header
    rank, inc = h["rank"], h["inc"]
    ident = h["identity"]
    world = ident["world_size"]
    if world > limits.max_world_size:
        raise Reject(
            "world_too_large",
            f"identity.world_size = {world} > Limits.max_world_size {limits.max_world_size}",
        )
    manifest = h.get("manifest") or {}
    packed = _packed(manifest)
    size = len(packed)
    if size > limits.max_manifest_bytes:
        raise Reject(
            "too_large",
            f"manifest of rank {rank} is {size} bytes packed > {limits.max_manifest_bytes}",
        )
    started = h.get("t_start_ns")
    if started is not None and now_ns is not None:
        lo, hi = limits.time_bounds(now_ns)
        if not lo <= started <= hi:
            raise Reject("bad_time", f"t_start_ns = {started} outside {lo}..{hi}")
    if run is None:
        problem = store.admit(h["job"], world, limits.max_runs, limits.max_runs_per_job)
        if problem is not None:
            raise Reject(*problem)
    else:
        if run.job != h["job"]:
            raise Reject(
                "run_mismatch", f"run {h['run']!r} belongs to job {run.job!r}, not {h['job']!r}"
            )
        if run.world_size != world:
            raise Reject(
                "world_size_mismatch",
                f"rank {rank} says world size {world}, run {h['run']!r} has {run.world_size}",
            )
        latest = int(run.incarnation[rank])
        if inc < latest:
            raise Reject(
                "stale_incarnation",
                f"hello of rank {rank} incarnation {inc} after incarnation {latest}",
            )
        top = latest if latest >= 0 else int(run.incarnation.max())
        if top >= 0 and inc > top + limits.max_incarnation_step:
            raise Reject(
                "bad_incarnation",
                f"hello of rank {rank} incarnation {inc} > {top} + "
                f"Limits.max_incarnation_step {limits.max_incarnation_step}",
            )
        if latest >= 0:
            old = run.identities.get(rank, {})
            changed = [k for k in _WHO if old.get(k) != ident.get(k)]
            if changed or inc > latest:
                heard = run.heard_ns[rank]
                quiet = int(limits.identity_quiet_s * 1e9)
                if now_ns is not None and heard >= 0 and now_ns - heard < quiet:
                    what = ", ".join(f"{k} {old.get(k)!r} -> {ident.get(k)!r}" for k in changed)
                    raise Reject(
                        "identity_conflict",
                        f"hello of rank {rank} of run {h['run']!r} "
                        f"({what or f'incarnation {latest} -> {inc}'}) while the rank was "
                        f"heard {(now_ns - heard) / 1e9:.1f} s ago "
                        f"(< Limits.identity_quiet_s {limits.identity_quiet_s})",
                    )
    problem = store.admit_identity(h["run"], rank, ident, packed, limits.max_identity_bytes)
    if problem is not None:
        raise Reject(*problem)
    h[PACKED_MANIFEST] = packed


def _in_bounds(where: str, col: np.ndarray, lo: int, hi: int, *, unknown: bool) -> None:
    """Reject when a time column holds a value outside ``lo..hi`` (``NO_TIME`` allowed
    when ``unknown``)."""
    top = int(col.max())
    low = int(col.min())
    if top > hi or (low < lo and not (unknown and low == schema.NO_TIME)):
        if unknown:
            known = col[col != schema.NO_TIME]
            low = int(known.min()) if known.shape[0] else lo
            if low >= lo and top <= hi:
                return
        bad = low if low < lo else top
        raise Reject("bad_time", f"{where} holds {bad}, outside {lo}..{hi}")


def check_values(msg: schema.Message, now_ns: int | None, limits: Limits) -> None:
    """The values of a message's tables a reader could not use (state-free: the precise
    checks, one message at a time, naming the column and the value).

    Args:
        msg: a decoded ``steps`` or ``samples`` message (others have no tables).
        now_ns: the hub's clock, for the window (`Limits.time_bounds`).
        limits: the limits.

    Raises:
        Reject: the first problem found.
    """
    lo, hi = limits.time_bounds(now_ns)
    if msg.kind == "samples":
        t = msg.tables["samples"]["t"]
        if t.shape[0]:
            _in_bounds("samples.t", t, lo, hi, unknown=False)
        return
    if msg.kind != "steps":
        return
    span = int(limits.max_duration_s * 1e9)
    ph = msg.tables.get("phases")
    if ph is not None and ph["phase"].shape[0]:
        top = len(schema.PHASES) + len(msg.header.get("phase_names") or [])
        code = ph["phase"]
        if code.min() < 0 or code.max() >= top:
            raise Reject(
                "bad_phase",
                f"phase codes {int(code.min())}..{int(code.max())} outside 0..{top - 1}",
            )
        t0, t1 = ph["t0"], ph["t1"]
        _in_bounds("phases.t0/t1", np.concatenate((t0, t1)), lo, hi, unknown=True)
        d = t1 - t0
        if d.min() < 0 or d.max() > span:
            known = (t0 != schema.NO_TIME) & (t1 != schema.NO_TIME)
            if (d[known] < 0).any():
                raise Reject("bad_time", "a phase span ends before it starts")
            if (d[known] > span).any():
                raise Reject("bad_time", f"a phase span lasts {int(d[known].max())} ns > {span}")
        _check_step_ids("phases.step", ph["step"])
    co = msg.tables.get("colls")
    if co is not None and co["t_enter"].shape[0]:
        _check_colls(co, lo, hi, span)
    st = msg.tables["steps"]
    steps = st["step"]
    n = steps.shape[0]
    if n == 1:  # the usual message: one step, checked with Python scalars
        t_start, t_end, step = int(st["t_start"][0]), int(st["t_end"][0]), int(steps[0])
        for name, t in (("t_start", t_start), ("t_end", t_end)):
            if t != schema.NO_TIME and not lo <= t <= hi:
                raise Reject("bad_time", f"steps.{name} holds {t}, outside {lo}..{hi}")
        if t_end != schema.NO_TIME and t_start != schema.NO_TIME:
            if t_end < t_start:
                raise Reject("bad_time", "a step ends before it starts")
            if t_end - t_start > span:
                raise Reject("bad_time", f"step {step} lasts {t_end - t_start} ns > {span}")
        if step < 0:
            raise Reject("bad_step", f"steps.step holds {step} < 0")
    elif n:
        _check_step_ids("steps.step", steps)
        _in_bounds(
            "steps.t_start/t_end",
            np.concatenate((st["t_start"], st["t_end"])),
            lo,
            hi,
            unknown=True,
        )
        d = st["t_end"] - st["t_start"]
        if d.min() < 0 or d.max() > span:
            known = (st["t_end"] != schema.NO_TIME) & (st["t_start"] != schema.NO_TIME)
            if (d[known] < 0).any():
                raise Reject("bad_time", "a step ends before it starts")
            if (d[known] > span).any():
                raise Reject("bad_time", f"a step lasts {int(d[known].max())} ns > {span}")


def values_plausible(msgs: list[schema.Message], limits: Limits) -> bool:
    """Whether every value of these ``steps`` messages' tables passes `check_values`
    without a window around the hub's clock: one numpy call per question over the columns
    of all the messages together (a message's columns are short, and numpy's cost is per
    call), where `check_values` asks each message. True lets the caller skip
    `check_values`; False sends it to `check_values` message by message, which finds the
    culprit (or a legitimate unknown time behind a negative duration).

    Args:
        msgs: decoded ``steps`` messages.
        limits: the limits (a window, `Limits.time_window_s`, makes this False).

    Returns:
        True when nothing needs a closer look.
    """
    if limits.time_window_s is not None or not msgs:
        return False
    span = int(limits.max_duration_s * 1e9)
    s0: list[np.ndarray] = []
    s1: list[np.ndarray] = []
    ss: list[np.ndarray] = []
    c = ([], [], [], [], [], [], [], [], [])  # type: tuple[list[np.ndarray], ...]
    p = ([], [], [], [])  # type: tuple[list[np.ndarray], ...]
    tops: list[int] = []
    for m in msgs:
        tables = m.tables
        ph = tables.get("phases")
        if ph is not None:
            tops.append(len(schema.PHASES) + len(m.header.get("phase_names") or []))
            p[0].append(ph["phase"])
            p[1].append(ph["t0"])
            p[2].append(ph["t1"])
            p[3].append(ph["step"])
        st = tables["steps"]
        s0.append(st["t_start"])
        s1.append(st["t_end"])
        ss.append(st["step"])
        co = tables.get("colls")
        if co is not None:
            for out, name in zip(c, _BATCH_COLL_COLS, strict=True):
                out.append(co[name])
    t0, t1, step = np.concatenate(s0), np.concatenate(s1), np.concatenate(ss)
    d = t1 - t0  # an unknown end or start makes it fail: the precise checks decide
    T = schema.MAX_TIME_NS
    if t0.size and (
        d.min() < 0 or d.max() > span or t0.min() < 0 or t1.max() > T or step.min() < 0
    ):
        return False
    if p[0]:
        code, a0, a1, pstep = (np.concatenate(part) for part in p)
        top = np.repeat(np.array(tops, np.int64), [x.shape[0] for x in p[0]])
        pd = a1 - a0
        if code.size and (
            code.min() < 0
            or (code >= top).any()
            or pd.min() < 0
            or pd.max() > span
            or a0.min() < 0
            or a1.max() > T
            or pstep.min() < 0
        ):
            return False
    if not c[0]:
        return True
    te, tx, ds, de, nb, seq, cstep, group, op = (np.concatenate(part) for part in c)
    if not te.size:  # empty tables (a step with no collective yet): nothing to check
        return True
    dt = tx - te
    # Device times: all unknown (host-timed rows), or all known, in range and each end
    # after its start (device-timed rows); a mix is checked row by row.
    host_timed = ds.max() == schema.NO_TIME and de.max() == schema.NO_TIME
    return bool(
        te.min() >= 0
        and te.max() <= T
        and dt.min() >= 0
        and dt.max() <= span
        and (host_timed or (ds.min() >= 0 and de.max() <= T and (de - ds).min() >= 0))
        and op.min() >= -1
        and op.max() < _N_OPS
        and group.min() >= 0
        and nb.min() >= -1
        and seq.min() >= -1
        and cstep.min() >= -1
    )


_BATCH_COLL_COLS = (
    "t_enter",
    "t_exit",
    "t_start",
    "t_end",
    "nbytes",
    "seq",
    "step",
    "group",
    "op",
)


def _check_steps(
    msg: schema.Message, run: RunState, values: bool, now_ns: int | None, limits: Limits
) -> Verdict:
    h = msg.header
    if values:
        check_values(msg, now_ns, limits)
    st = msg.tables["steps"]
    steps = st["step"]
    n = steps.shape[0]
    if n == 1:  # the usual message: one step, no numpy
        if not run.has_step(h["rank"], h["inc"], int(steps[0])):
            return _ACCEPT
        return Verdict(keep_steps=np.zeros(1, bool), duplicate_steps=1, empty=True)
    keep = ~run.has_steps(h["rank"], h["inc"], steps)
    if n > 1:
        # Inside the message, the first row of a repeated step wins.
        order = np.argsort(steps, kind="stable")
        s = steps[order]
        repeat = np.zeros(n, bool)
        repeat[order[1:]] = s[1:] == s[:-1]
        keep &= ~repeat
    dup = int(n - keep.sum())
    return Verdict(
        keep_steps=keep if dup else None,
        duplicate_steps=dup,
        empty=dup > 0 and not keep.any(),
    )


def _check_step_ids(where: str, steps: np.ndarray) -> None:
    if steps.shape[0] and steps.min() < 0:
        raise Reject("bad_step", f"{where} holds {int(steps.min())} < 0")


_N_OPS = len(schema.OPS)


_UNKNOWN: dict[int, bytes] = {}
"""Rows -> the bytes of an all-``NO_TIME`` column (columns of at most 8,192 rows; at most
256 sizes)."""


def _unknown_times(col: np.ndarray) -> bool:
    """Whether every entry is ``NO_TIME``: one copy and one compare of bytes, cheaper than a
    numpy reduction on a message's column (as ``hub.pending`` does for its columns)."""
    n = col.shape[0]
    want = _UNKNOWN.get(n)
    if want is None:
        want = np.full(n, schema.NO_TIME, np.int64).tobytes()
        if n <= 8192:
            if len(_UNKNOWN) >= 256:
                _UNKNOWN.clear()
            _UNKNOWN[n] = want
    return col.tobytes() == want


STACKED_ROWS = 512
"""Tables up to this many rows have their columns' bounds checked in one stack (one
concatenation, one min and one max for all columns: numpy's cost is per call on short
columns); longer ones column by column."""

_COLL_LO = (0, 0, schema.NO_TIME, schema.NO_TIME, -1, -1, -1, 0, -1)
_COLL_COLS = ("t_enter", "t_start", "t_end", "nbytes", "seq", "step", "group", "op")


def _colls_plausible(co: Mapping[str, np.ndarray], lo: int, hi: int, span: int) -> bool:
    """Whether a short collective table passes `_check_colls` (every exit known; device
    times all unknown, or all known, inside the window and each end after its start): a
    stack of its columns, reduced once per bound. Never true where `_check_colls` would
    refuse; a table it is not sure of goes to the column-by-column checks."""
    t_enter, t_start, t_end = co["t_enter"], co["t_start"], co["t_end"]
    n = t_enter.shape[0]
    x = np.concatenate(
        (t_enter, co["t_exit"] - t_enter, *(co[c] for c in _COLL_COLS[1:])), dtype=np.int64
    ).reshape(9, n)
    low = x.min(axis=1).tolist()
    top = x.max(axis=1).tolist()
    host_timed = top[2] == schema.NO_TIME and top[3] == schema.NO_TIME
    return (
        all(a >= b for a, b in zip(low, _COLL_LO, strict=True))
        and lo <= low[0]
        and top[0] <= hi
        and top[1] <= span
        and top[7] <= schema.INT32_MAX
        and top[8] < _N_OPS
        and (
            host_timed
            or (  # device-timed: all known, in the window, each end after its start
                lo <= low[2] and top[2] <= hi and top[3] <= hi and int((t_end - t_start).min()) >= 0
            )
        )
    )


def _check_colls(co: Mapping[str, np.ndarray], lo: int, hi: int, span: int) -> None:
    """Values of a collective table a reader could not use: entry times unknown or out of
    the window, exits before entries, device ends before starts, unknown ops, negative
    byte counts, seqs or steps."""
    t_enter, t_exit = co["t_enter"], co["t_exit"]
    if t_enter.shape[0] <= STACKED_ROWS and _colls_plausible(co, lo, hi, span):
        return
    dev_s, dev_e = co["t_start"], co["t_end"]
    low, top = int(t_enter.min()), int(t_enter.max())
    if low < lo or top > hi:
        if (t_enter == schema.NO_TIME).any():
            n = int((t_enter == schema.NO_TIME).sum())
            raise Reject("bad_time", f"{n} collective rows without t_enter")
        bad = low if low < lo else top
        raise Reject("bad_time", f"colls.t_enter holds {bad}, outside {lo}..{hi}")
    # An exit is unknown (NO_TIME) only on a row whose completion was never seen.
    d = t_exit - t_enter
    if d.min() < 0 or d.max() > span:
        known = t_exit != schema.NO_TIME
        if (d[known] < 0).any():
            i = int(np.flatnonzero(known & (d < 0))[0])
            raise Reject(
                "bad_time",
                f"collective row {i} leaves at {int(t_exit[i])} before it enters at "
                f"{int(t_enter[i])}",
            )
        if (d[known] > span).any():
            raise Reject("bad_time", f"a collective lasts {int(d[known].max())} ns > {span}")
    if not (_unknown_times(dev_s) and _unknown_times(dev_e)):  # host-timed rows have none
        _in_bounds("colls.t_start", dev_s, lo, hi, unknown=True)
        _in_bounds("colls.t_end", dev_e, lo, hi, unknown=True)
        both = (dev_s != schema.NO_TIME) & (dev_e != schema.NO_TIME)
        if (dev_e[both] < dev_s[both]).any():
            raise Reject("bad_time", "a collective's device end is before its device start")
    op = co["op"]  # -1: not known (readers take it as "other", the last name)
    if int(op.max()) >= _N_OPS or int(op.min()) < -1:
        bad = int(op[(op >= _N_OPS) | (op < -1)][0])
        raise Reject("bad_op", f"colls.op holds {bad}, outside -1..{_N_OPS - 1}")
    if int(co["nbytes"].min()) < -1:  # -1: not known, as every int column
        raise Reject("bad_nbytes", f"colls.nbytes holds {int(co['nbytes'].min())} < -1")
    for name in ("seq", "step"):  # -1: not known
        if int(co[name].min()) < -1:
            raise Reject("bad_step", f"colls.{name} holds {int(co[name].min())} < -1")
    if int(co["group"].min()) < 0:
        raise Reject("bad_group", f"colls.group holds {int(co['group'].min())} < 0")
