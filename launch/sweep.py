"""Sweeps: the application's own collectives repeated outside the application.

The method's primitive-path test ("Repeat one message size outside the application to
test the primitive path"; "Validate pairwise and collective paths independently at
representative message sizes"): take the groups, ops and message sizes a recorded run
issued, add a power-of-two ladder around them, and time each (group, op, size) alone, the
way nccl-tests does, on the intended process groups — one rank pair at a time
(``pairwise``), on one node, on two nodes or on the full group.

This module is the pure part: `plan_sweep` chooses what to sweep from a `Window`;
`sweep_points` and `pair_points` turn the measured times into nccl-tests bandwidths
(`rankscope.diagnosis.curves`); `compare` sets the sweep's curve beside the application's
and the baseline's and says whether the primitive alone reproduces the slow curve;
`pairwise_finding` names the slow pair, rail, host or the placement. The processes that
do the timing are `rankscope.launch.sweep_worker` (torch.distributed) and the simulated
launcher (`rankscope.sim.sweep`); both write the same result file (`RESULT_KEYS`).

What a recorded run does not say: the dtype of each collective (the wire carries bytes);
the sweep uses ``float32`` unless told otherwise, which changes nothing for the bandwidth
of a sum but is stated in the plan.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector.schema import OP_INDEX, OPS
from rankscope.diagnosis.curves import (
    CONVENTION,
    algbw_bytes,
    bucket_label,
    bus_factor,
    message_curves,
    size_bucket,
)
from rankscope.diagnosis.window import Window

__all__ = [
    "SCOPES",
    "SWEEP_OPS",
    "PairPoint",
    "PairwiseFinding",
    "SweepComparison",
    "SweepPlan",
    "SweepPoint",
    "SweepTarget",
    "compare",
    "load_result",
    "pair_points",
    "pairwise_finding",
    "plan_sweep",
    "size_ladder",
    "sweep_points",
]

SCOPES = ("pairwise", "one-node", "two-node", "full")
"""Where a sweep runs: each link of a suspect group in turn, one node, two nodes, all."""
SWEEP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
"""Collectives a sweep can repeat (point-to-point traffic is what ``pairwise`` tests)."""
MIN_SIZE = 1 << 10
MAX_SIZE = 1 << 28
MAX_PAIRS = 64
"""Pairwise tests at most this many links; larger groups test their ring's links."""
REPRODUCES = 1.5
"""The primitive reproduces the application's curve when its busbw is at most this many
times the application's at the same size (not much faster alone than inside the job)."""
SLOW = 0.5
"""A link or rail is slow below this share of the best of its kind."""
BELOW = 0.8
"""An application curve is slow below this share of the baseline's busbw (median over its
sizes)."""


@dataclass(frozen=True)
class SweepTarget:
    """One collective to sweep: a group of the parent run, one op, a ladder of sizes."""

    group: str
    """The group's name in the parent run."""
    ranks: tuple[int, ...]
    """Its members, parent-run ranks."""
    op: str
    sizes: tuple[int, ...]
    """Bytes per rank (``nbytes`` as the collector records it), ascending."""
    app_sizes: tuple[int, ...] = ()
    """The sizes the application issued (bucket means), which the ladder surrounds."""


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep runs, where, and how it maps onto the launched processes."""

    job: str
    parent_run: str
    run: str
    scope: str
    """One of `SCOPES`."""
    hosts: tuple[str, ...]
    """In node-rank order."""
    ranks: tuple[int, ...]
    """Parent rank of each sweep rank (sweep rank i = ``ranks[i]``): hosts in order, local
    ranks in order on each, as torchrun numbers them."""
    nproc_per_node: int
    targets: tuple[SweepTarget, ...]
    pairs: tuple[tuple[int, int], ...] = ()
    """Pairwise: parent-rank pairs tested in turn."""
    pair_op: str = "all_reduce"
    pair_sizes: tuple[int, ...] = ()
    dtype: str = "float32"
    warmup: int = 2
    iters: int = 5
    repeats: int = 1
    """Timed loops per row; a row's time is the median of their means (robust to a busy
    machine)."""
    nics: tuple[str, ...] = ()
    """NIC of each sweep rank as the parent reported it ('' unknown), so a gloo sweep binds
    the same interface the application did."""
    reason: str = ""
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the plan file the sweep processes read)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepPlan:
        """Read a plan file's data back.

        Raises:
            ValueError: a field is missing or of the wrong shape.
        """
        try:
            targets = tuple(
                SweepTarget(
                    group=str(t["group"]),
                    ranks=tuple(int(r) for r in t["ranks"]),
                    op=str(t["op"]),
                    sizes=tuple(int(s) for s in t["sizes"]),
                    app_sizes=tuple(int(s) for s in t.get("app_sizes", ())),
                )
                for t in data["targets"]
            )
            return cls(
                job=str(data["job"]),
                parent_run=str(data["parent_run"]),
                run=str(data["run"]),
                scope=str(data["scope"]),
                hosts=tuple(str(h) for h in data["hosts"]),
                ranks=tuple(int(r) for r in data["ranks"]),
                nproc_per_node=int(data["nproc_per_node"]),
                targets=targets,
                pairs=tuple((int(a), int(b)) for a, b in data.get("pairs", ())),
                pair_op=str(data.get("pair_op", "all_reduce")),
                pair_sizes=tuple(int(s) for s in data.get("pair_sizes", ())),
                dtype=str(data.get("dtype", "float32")),
                warmup=int(data.get("warmup", 2)),
                iters=int(data.get("iters", 5)),
                repeats=int(data.get("repeats", 1)),
                nics=tuple(str(n) for n in data.get("nics", ())),
                reason=str(data.get("reason", "")),
                notes=tuple(str(n) for n in data.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a sweep plan: {exc!r}") from None


def size_ladder(app_sizes: Sequence[float], *, span: int = 2, step: int = 1) -> tuple[int, ...]:
    """Powers of two from ``4**-span`` below the smallest application size to ``4**span``
    above the largest (every ``2**step``), plus the application's sizes themselves.

    Args:
        app_sizes: bytes per rank the application issued.
        span: factors of four to extend on each side.
        step: log2 spacing of the ladder.

    Returns:
        Ascending sizes in ``[MIN_SIZE, MAX_SIZE]``, multiples of 8 bytes.
    """
    sizes = [int(s) for s in app_sizes if s and s > 0]
    if not sizes:
        return ()
    lo = max(int(np.floor(np.log2(min(sizes)))) - 2 * span, 10)
    hi = min(int(np.ceil(np.log2(max(sizes)))) + 2 * span, 28)
    ladder = {1 << e for e in range(lo, hi + 1, max(step, 1))}
    ladder |= {_wire_size(s) for s in sizes}
    return tuple(sorted(ladder))


def _wire_size(nbytes: float) -> int:
    """A recorded size as the sweep issues it: whole 8-byte elements in the ladder's range."""
    return min(max(int(nbytes) // 8 * 8, MIN_SIZE), MAX_SIZE)


def _parse_sizes(sizes: Sequence[int | str]) -> tuple[int, ...]:
    out = []
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    for s in sizes:
        text = str(s).strip().lower().removesuffix("ib").removesuffix("b")
        mult = units.get(text[-1:], 1) if text else 1
        num = text[:-1] if mult > 1 else text
        try:
            value = int(float(num) * mult)
        except ValueError:
            raise ValueError(
                f"message size {s!r}: expected bytes such as 65536, 64K or 4M"
            ) from None
        if not MIN_SIZE // 8 <= value <= MAX_SIZE:
            raise ValueError(f"message size {s!r} is outside {MIN_SIZE // 8}..{MAX_SIZE} bytes")
        out.append(value // 8 * 8 or 8)
    return tuple(sorted(set(out)))


def _hosts_order(window: Window, host_idx: Sequence[int]) -> tuple[tuple[str, ...], np.ndarray]:
    """Hosts in the given order and the parent ranks on them, local rank order per host."""
    info = window.ranks
    ranks: list[int] = []
    for h in host_idx:
        on = np.flatnonzero(info.host == h)
        on = on[np.argsort(info.local_rank[on], kind="stable")]
        ranks.extend(int(r) for r in on)
    return tuple(info.hosts[h] for h in host_idx), np.array(ranks, dtype=np.int64)


def _app_ops(window: Window) -> dict[tuple[int, str], list[float]]:
    """(group id, op) -> message sizes the application issued (bucket means)."""
    curves = message_curves(window.instances)
    out: dict[tuple[int, str], list[float]] = {}
    for g, o, nb in zip(curves.group, curves.op, curves.nbytes):
        op = OPS[int(o)]
        if op in SWEEP_OPS:
            out.setdefault((int(g), op), []).append(float(nb))
    return out


def _suspect_host(window: Window, hyp: Any) -> int | None:
    hosts = getattr(hyp, "hosts", ()) if hyp is not None else ()
    for name in hosts or ():
        if name in window.ranks.hosts:
            return window.ranks.hosts.index(name)
    ranks = getattr(hyp, "ranks", ()) if hyp is not None else ()
    for r in ranks or ():
        if 0 <= int(r) < window.world_size and window.ranks.host[int(r)] >= 0:
            return int(window.ranks.host[int(r)])
    return None


def _ring_pairs(members: np.ndarray, window: Window) -> list[tuple[int, int]]:
    """Links a large group's ring and a rail-optimised fabric use: same-rail peers on
    consecutive hosts, and neighbouring local ranks inside each host (first hosts)."""
    info = window.ranks
    hosts = list(dict.fromkeys(int(info.host[r]) for r in members))
    pairs: list[tuple[int, int]] = []
    for h1, h2 in zip(hosts, hosts[1:] + hosts[:1]):
        if h1 == h2:
            continue
        a = members[info.host[members] == h1]
        b = members[info.host[members] == h2]
        for r in a:
            peer = b[info.rail[b] == info.rail[r]]
            if peer.size:
                pairs.append((int(r), int(peer[0])))
    for h in hosts:
        on = members[info.host[members] == h]
        on = on[np.argsort(info.local_rank[on], kind="stable")]
        pairs.extend((int(x), int(y)) for x, y in itertools.pairwise(on))
    seen: set[tuple[int, int]] = set()
    out = []
    for a, b in pairs:
        key = (min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out[:MAX_PAIRS]


def _group_named(window: Window, name: str) -> int:
    for gid, g in window.groups.items():
        if g.name == name:
            return gid
    known = ", ".join(sorted(g.name for g in window.groups.values())) or "none"
    raise ValueError(f"run {window.run!r} has no group {name!r} (groups: {known})")


def _pairwise_members(window: Window, group: str | None, top: Any) -> tuple[np.ndarray, str]:
    """The ranks whose links a pairwise sweep tests, and why those."""
    info = window.ranks
    if group is not None:
        g = window.groups[_group_named(window, group)]
        return np.array(g.ranks, dtype=np.int64), f"the links of group {g.name} (--group)"
    mech = getattr(top, "mechanism", "") if top is not None else ""
    if mech in ("network_rail", "local_fabric", "intermittent_congestion"):
        # A fabric fault is judged against its peers: every rail and every local link of
        # two hosts, those the hypothesis names first, so the slow one has healthy ones of
        # its kind beside it (a host's own links are all slow alike when its fabric is).
        want = 2
        named = [info.hosts.index(h) for h in getattr(top, "hosts", ()) if h in info.hosts]
        hosts = list(dict.fromkeys(named))[:want]
        for h in range(len(info.hosts)):
            if len(hosts) >= want:
                break
            if h not in hosts and (info.host == h).any():
                hosts.append(h)
        members = np.flatnonzero(np.isin(info.host, hosts))
        names = ", ".join(info.hosts[h] for h in hosts)
        return members, f"every link between the ranks of {names} ({mech} names them)"
    suspects = [
        int(r) for r in (getattr(top, "ranks", ()) or ()) if 0 <= int(r) < window.world_size
    ]
    candidates = [g for g in window.groups.values() if 2 <= len(g.ranks) < window.world_size]
    for r in suspects:
        for g in sorted(candidates, key=lambda g: (not g.crosses_hosts, len(g.ranks))):
            if r not in g.ranks:
                continue
            if len(g.ranks) > 2:
                return (
                    np.array(g.ranks, dtype=np.int64),
                    f"the links of {g.name}, the group of rank {r} that {mech or 'the verdict'} "
                    "names",
                )
            # One link alone has nothing to be slow against: every link of its hosts.
            hosts = sorted({int(info.host[m]) for m in g.ranks})
            names = ", ".join(info.hosts[h] for h in hosts)
            return (
                np.flatnonzero(np.isin(info.host, hosts)),
                f"every link between the ranks of {names}, the hosts of {g.name} (rank {r}'s "
                f"group that {mech or 'the verdict'} names)",
            )
    return np.arange(window.world_size), "every rank of the run (no suspect group)"


def plan_sweep(
    window: Window,
    scope: str,
    *,
    hypotheses: Sequence[Any] = (),
    group: str | None = None,
    sizes: Sequence[int | str] | None = None,
    run: str | None = None,
    iters: int = 5,
    warmup: int = 2,
    repeats: int = 1,
    dtype: str = "float32",
) -> SweepPlan:
    """Choose what a sweep of ``window``'s run repeats, and where.

    Args:
        window: the recorded run.
        scope: one of `SCOPES`.
        hypotheses: the verdict's hypotheses, best first (the suspect host, pair or group).
        group: sweep only this group (its name in the run).
        sizes: explicit sizes (bytes, or ``64K``/``4M``) instead of the ladder.
        run: id of the sweep run (default ``<parent>-sweep-<scope>``).
        iters, warmup: timed and untimed repetitions per size.
        repeats: timed loops per size (the median of their means is kept).
        dtype: element type of the buffers.

    Returns:
        The plan.

    Raises:
        ValueError: an unknown scope or group, bad sizes, a run with no host identity or
            no collective to sweep.
    """
    if scope not in SCOPES:
        raise ValueError(f"unknown sweep scope {scope!r}; expected one of {', '.join(SCOPES)}")
    if iters < 1 or warmup < 0:
        raise ValueError("iters must be >= 1 and warmup >= 0")
    info = window.ranks
    if (info.host < 0).all():
        raise ValueError(f"run {window.run!r}: no rank reported its host")
    explicit = _parse_sizes(sizes) if sizes else ()
    top = next((h for h in hypotheses if getattr(h, "mechanism", "healthy") != "healthy"), None)
    present = [h for h in range(len(info.hosts)) if (info.host == h).any()]
    notes: list[str] = []
    pairs: list[tuple[int, int]] = []
    if scope == "pairwise":
        members, reason = _pairwise_members(window, group, top)
        if members.shape[0] < 2:
            raise ValueError("pairwise needs a group of at least two ranks")
        if members.shape[0] * (members.shape[0] - 1) // 2 <= MAX_PAIRS:
            pairs = [(int(a), int(b)) for a, b in itertools.combinations(sorted(members), 2)]
        else:
            pairs = _ring_pairs(members, window)
            notes.append(f"{len(members)} ranks: testing {len(pairs)} ring and rail links")
        host_idx = list(dict.fromkeys(int(info.host[r]) for r in sorted(members)))
    elif scope == "one-node":
        h = _suspect_host(window, top)
        host_idx = [h if h is not None else present[0]]
        reason = f"the suspect node {info.hosts[host_idx[0]]}"
    elif scope == "two-node":
        if len(present) < 2:
            raise ValueError(f"run {window.run!r} has one host; a two-node sweep needs two")
        h = _suspect_host(window, top)
        first = h if h is not None else present[0]
        peer = next(p for p in present if p != first)
        host_idx = [first, peer]
        reason = f"{info.hosts[first]} and {info.hosts[peer]}"
    else:
        host_idx = present
        reason = "every host of the run"
    hosts, ranks = _hosts_order(window, host_idx)
    kept = set(int(r) for r in ranks)
    per_host = [int((info.host == h).sum()) for h in host_idx]
    targets: list[SweepTarget] = []
    app = _app_ops(window)
    for (gid, op), app_sizes in sorted(app.items()):
        g = window.groups.get(gid)
        if g is None or len(g.ranks) < 2:
            continue
        if group is not None and g.name != group:
            continue
        if scope != "pairwise" and not set(g.ranks) <= kept:
            continue
        ladder = explicit or size_ladder(app_sizes)
        targets.append(
            SweepTarget(
                group=g.name,
                ranks=tuple(int(r) for r in g.ranks),
                op=op,
                sizes=ladder,
                app_sizes=tuple(sorted({_wire_size(s) for s in app_sizes})),
            )
        )
    if group is not None and not targets and scope != "pairwise":
        _group_named(window, group)  # raises for an unknown name
        raise ValueError(f"group {group!r} issues no sweepable collective within this scope")
    if not targets and scope != "pairwise":
        notes.append("no recorded group lies within this scope: sweeping all its ranks")
        fallback = (
            explicit
            or size_ladder([float(s) for v in app.values() for s in v])
            or (
                1 << 16,
                1 << 20,
            )
        )
        targets.append(SweepTarget("scope", tuple(int(r) for r in ranks), "all_reduce", fallback))
    pair_sizes: tuple[int, ...] = ()
    if scope == "pairwise":
        recorded = [s for t in targets for s in t.app_sizes]
        pair_sizes = explicit or _pair_ladder(recorded)
        targets = []  # a pairwise sweep times links, one pair at a time
    nics = tuple(info.nics[int(info.nic[r])] if int(info.nic[r]) >= 0 else "" for r in ranks)
    return SweepPlan(
        job=window.job,
        parent_run=window.run,
        run=run or f"{window.run}-sweep-{scope}",
        scope=scope,
        hosts=hosts,
        ranks=tuple(int(r) for r in ranks),
        nproc_per_node=max(per_host) if per_host else 1,
        targets=tuple(targets),
        pairs=tuple(pairs),
        pair_sizes=pair_sizes,
        dtype=dtype,
        warmup=warmup,
        iters=iters,
        repeats=max(int(repeats), 1),
        nics=nics,
        reason=reason,
        notes=tuple(notes),
    )


def _pair_ladder(recorded: Sequence[int]) -> tuple[int, ...]:
    # Pairwise times many links: a short ladder, the largest recorded size and two below.
    if not recorded:
        return (1 << 16, 1 << 18, 1 << 20)
    top = min(max(int(max(recorded)) // 8 * 8, MIN_SIZE), 1 << 22)
    return tuple(sorted({max(top // 16, MIN_SIZE), max(top // 4, MIN_SIZE), top}))


# -- results -------------------------------------------------------------------------------

RESULT_KEYS = ("plan", "backend", "points", "pairs")
"""A result file: the plan it ran, the backend, and raw timings — ``points`` rows
``{"group", "op", "nbytes", "n", "time_ns"}`` and ``pairs`` rows
``{"pair", "op", "nbytes", "time_ns"}`` (parent ranks; ``time_ns`` per operation: the
slowest member's mean over the timed iterations)."""


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a sweep result file.

    Raises:
        ValueError: unreadable, or not a sweep result.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not set(RESULT_KEYS) <= set(data):
        raise ValueError(f"{path}: not a sweep result (needs {', '.join(RESULT_KEYS)})")
    return data


@dataclass(frozen=True)
class SweepPoint:
    """One (group, op, size) of a sweep, with nccl-tests bandwidths."""

    group: str
    op: str
    nbytes: int
    n: int
    time_ns: float
    algbw_gbps: float
    busbw_gbps: float
    bucket: int


@dataclass(frozen=True)
class PairPoint:
    """One link of a pairwise sweep at one size."""

    pair: tuple[int, int]
    """Parent ranks."""
    hosts: tuple[str, str]
    rails: tuple[int, int]
    crosses_hosts: bool
    op: str
    nbytes: int
    time_ns: float
    busbw_gbps: float


def _bandwidths(
    op: str, nbytes: np.ndarray, n: np.ndarray, t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    o = np.full(nbytes.shape, OP_INDEX[op], dtype=np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = algbw_bytes(o, nbytes, n) / t
    return alg, alg * bus_factor(o, n)


def sweep_points(result: Mapping[str, Any]) -> tuple[SweepPoint, ...]:
    """The collective rows of a result with their algbw and busbw (``CONVENTION``).

    Args:
        result: a result file's data (`load_result`).

    Returns:
        Points by group, op, size.
    """
    out = []
    for row in result.get("points", ()):
        nb = np.array([float(row["nbytes"])])
        n = np.array([float(row["n"])])
        t = np.array([float(row["time_ns"])])
        alg, bus = _bandwidths(str(row["op"]), nb, n, t)
        out.append(
            SweepPoint(
                group=str(row["group"]),
                op=str(row["op"]),
                nbytes=int(row["nbytes"]),
                n=int(row["n"]),
                time_ns=float(t[0]),
                algbw_gbps=float(alg[0]),
                busbw_gbps=float(bus[0]),
                bucket=int(size_bucket(nb)[0]),
            )
        )
    out.sort(key=lambda p: (p.group, p.op, p.nbytes))
    return tuple(out)


def pair_points(result: Mapping[str, Any], window: Window | None = None) -> tuple[PairPoint, ...]:
    """The pairwise rows of a result, with the hosts and rails of each pair.

    Args:
        result: a result file's data.
        window: the parent run (hosts and rails); default: those the result carries.

    Returns:
        One point per (pair, size).
    """
    ident = result.get("identity", {})
    out = []
    for row in result.get("pairs", ()):
        a, b = (int(x) for x in row["pair"])

        def who(r: int) -> tuple[str, int]:
            if window is not None and 0 <= r < window.world_size:
                h = int(window.ranks.host[r])
                host = window.ranks.hosts[h] if h >= 0 else "?"
                return host, int(window.ranks.rail[r])
            rec = ident.get(str(r), {})
            return str(rec.get("host", "?")), int(rec.get("rail", -1))

        (ha, ra), (hb, rb) = who(a), who(b)
        nb = np.array([float(row["nbytes"])])
        t = np.array([float(row["time_ns"])])
        _, bus = _bandwidths(str(row.get("op", "all_reduce")), nb, np.array([2.0]), t)
        out.append(
            PairPoint(
                pair=(a, b),
                hosts=(ha, hb),
                rails=(ra, rb),
                crosses_hosts=ha != hb,
                op=str(row.get("op", "all_reduce")),
                nbytes=int(row["nbytes"]),
                time_ns=float(t[0]),
                busbw_gbps=float(bus[0]),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class PairwiseFinding:
    """What the pairwise links say."""

    finding: str
    """``network_rail``, ``nic``, ``local_fabric``, ``placement`` or ``healthy``."""
    slowest_pair: tuple[int, int] | None
    slow_pairs: tuple[tuple[int, int], ...]
    slow_rail: int | None
    slow_host: str | None
    slow_rank: int | None
    pair_busbw_gbps: dict[str, float]
    """``"a-b"`` -> busbw at the largest size tested."""
    rail_busbw_gbps: dict[str, float]
    """Rail -> median busbw of its same-rail cross-host links."""
    why: str


def _key(pair: tuple[int, int]) -> str:
    return f"{pair[0]}-{pair[1]}"


def pairwise_finding(points: Sequence[PairPoint], *, slow: float = SLOW) -> PairwiseFinding:
    """Name the slow link of a pairwise sweep, and what it is.

    Each link is judged at the largest size tested (bandwidth-bound) against the best link
    of its kind — cross-host links against cross-host ones, links inside a host against
    those: a link is slow below ``slow`` of that best. Then, in this order:

    - ``network_rail``: the same-rail cross-host links of one rail are slow while another
      rail's are not (a rail-optimised fabric: the rail, not the hosts);
    - ``nic``: every cross-host link of one rank is slow, and no rail as a whole is;
    - ``local_fabric``: links inside one host are slow, the other hosts' are not;
    - ``placement``: the group spans hosts, its cross-host links are far slower than its
      links inside a host, and no rail, NIC or host stands out — the fabric is healthy and
      the group is slow because of where its ranks are;
    - ``healthy``: none of these.

    Args:
        points: `pair_points` of one sweep.
        slow: the share of the best below which a link is slow.

    Returns:
        The finding.
    """
    if not points:
        return PairwiseFinding("healthy", None, (), None, None, None, {}, {}, "no link tested")
    top = max(p.nbytes for p in points)
    at = {p.pair: p for p in points if p.nbytes == top}
    links = list(at.values())
    bw = {p.pair: p.busbw_gbps for p in links}
    cross = [p for p in links if p.crosses_hosts]
    intra = [p for p in links if not p.crosses_hosts]
    slow_pairs: list[tuple[int, int]] = []
    for kind in (cross, intra):
        if len(kind) >= 2:
            best = max(p.busbw_gbps for p in kind)
            slow_pairs += [p.pair for p in kind if p.busbw_gbps < slow * best]
    slowest = min(links, key=lambda p: p.busbw_gbps).pair
    rails: dict[int, list[float]] = {}
    for p in cross:
        if p.rails[0] == p.rails[1] and p.rails[0] >= 0:
            rails.setdefault(p.rails[0], []).append(p.busbw_gbps)
    rail_bw = {r: float(np.median(v)) for r, v in sorted(rails.items())}
    base: dict[str, Any] = dict(
        slowest_pair=slowest,
        slow_pairs=tuple(sorted(slow_pairs, key=lambda q: bw[q])),
        pair_busbw_gbps={_key(p.pair): p.busbw_gbps for p in links},
        rail_busbw_gbps={str(r): v for r, v in rail_bw.items()},
    )
    if len(rail_bw) >= 2:
        best = max(rail_bw.values())
        bad = [r for r, v in rail_bw.items() if v < slow * best]
        if len(bad) == 1:
            r = bad[0]
            return PairwiseFinding(
                "network_rail",
                slow_rail=r,
                slow_host=None,
                slow_rank=None,
                why=(
                    f"rail {r}'s cross-host links run at {rail_bw[r]:.3g} GB/s busbw, the best "
                    f"rail at {best:.3g}: the rail, not the hosts"
                ),
                **base,
            )
    if len(cross) >= 2 and slow_pairs:
        ranks = {r for p in cross for r in p.pair}
        for r in sorted(ranks):
            mine = [p for p in cross if r in p.pair]
            others = [p for p in cross if r not in p.pair]
            if (
                len(mine) >= 2
                and others
                and all(p.pair in slow_pairs for p in mine)
                and not any(p.pair in slow_pairs for p in others)
            ):
                host = mine[0].hosts[mine[0].pair.index(r)]
                return PairwiseFinding(
                    "nic",
                    slow_rail=None,
                    slow_host=host,
                    slow_rank=r,
                    why=f"every cross-host link of rank {r} ({host}) is slow, no other is",
                    **base,
                )
    if len(intra) >= 2:
        slow_intra = [p for p in intra if p.pair in slow_pairs]
        hosts_bad = {p.hosts[0] for p in slow_intra}
        hosts_all = {p.hosts[0] for p in intra}
        if len(hosts_bad) == 1 and len(hosts_all) >= 2:
            host = next(iter(hosts_bad))
            return PairwiseFinding(
                "local_fabric",
                slow_rail=None,
                slow_host=host,
                slow_rank=None,
                why=f"links inside {host} are slow, those inside the other hosts are not",
                **base,
            )
    if cross and intra:
        c = float(np.median([p.busbw_gbps for p in cross]))
        i = float(np.median([p.busbw_gbps for p in intra]))
        uniform = not [q for q in slow_pairs if at[q].crosses_hosts]
        if c < slow * i and uniform:
            return PairwiseFinding(
                "placement",
                slow_rail=None,
                slow_host=None,
                slow_rank=None,
                why=(
                    f"the group spans hosts: its cross-host links run at {c:.3g} GB/s, its "
                    f"links inside a host at {i:.3g}, and every cross-host link alike — a "
                    "healthy fabric under a group placed across hosts"
                ),
                **base,
            )
    return PairwiseFinding(
        "healthy",
        slow_rail=None,
        slow_host=None,
        slow_rank=None,
        why="no link, rail, NIC or host stands out from its peers",
        **base,
    )


@dataclass(frozen=True)
class CurveRow:
    """One size of one (group, op): the sweep beside the application and the baseline."""

    group: str
    op: str
    bucket: int
    size: str
    sweep_busbw_gbps: float
    app_busbw_gbps: float
    baseline_busbw_gbps: float
    """NaN where the baseline has no point there."""


@dataclass(frozen=True)
class SweepComparison:
    """The sweep's curve against the application's (and the baseline's)."""

    rows: tuple[CurveRow, ...]
    reproduces: bool | None
    """The primitive alone is as slow as inside the application (None: no size in
    common)."""
    ratio: float
    """Median over matched sizes of sweep busbw / application busbw."""
    app_slow: bool | None
    """The application's curve is below the baseline's (None: no baseline)."""
    conclusion: str
    slow_groups: tuple[str, ...] = ()
    """Groups whose application curve is below `BELOW` of the baseline's, slowest first."""
    convention: str = CONVENTION
    notes: tuple[str, ...] = field(default_factory=tuple)


def _app_rows(window: Window) -> dict[tuple[str, str, int], float]:
    c = message_curves(window.instances)
    names = {gid: g.name for gid, g in window.groups.items()}
    return {
        (names.get(int(g), f"g{int(g)}"), OPS[int(o)], int(b)): float(bw)
        for g, o, b, bw in zip(c.group, c.op, c.bucket, c.busbw_gbps)
    }


def compare(
    result: Mapping[str, Any], window: Window, baseline: Window | None = None
) -> SweepComparison:
    """Set a sweep's curve beside the application's and the baseline's.

    Sizes are matched by power-of-two bucket, groups by name. The primitive path alone
    *reproduces* the application's curve when its busbw is at most `REPRODUCES` times the
    application's (median over matched sizes): then the slowness is in the fabric or the
    library. When the primitive alone is much faster, the application's own schedule or
    arrival (overlap, contention with its compute, late ranks) makes its curve slow.

    With a baseline, each (group, op) whose application curve is below `BELOW` of the
    baseline's is slow, and the primitive is judged on those groups only (a fault slows
    the groups that cross it); with none slow there is no slow curve to explain.

    Args:
        result: the sweep's result file data.
        window: the recorded run the sweep repeats.
        baseline: a healthy run of the same job, if any.

    Returns:
        The comparison.
    """
    app = _app_rows(window)
    base = _app_rows(baseline) if baseline is not None else {}
    rows = []
    ratios: dict[tuple[str, str], list[float]] = {}
    shares: dict[tuple[str, str], list[float]] = {}
    for p in sweep_points(result):
        key = (p.group, p.op, p.bucket)
        a = app.get(key, float("nan"))
        b = base.get(key, float("nan"))
        rows.append(CurveRow(p.group, p.op, p.bucket, bucket_label(p.bucket), p.busbw_gbps, a, b))
        if np.isfinite(a) and a > 0:
            ratios.setdefault((p.group, p.op), []).append(p.busbw_gbps / a)
            if np.isfinite(b) and b > 0:
                shares.setdefault((p.group, p.op), []).append(a / b)
    if not ratios:
        return SweepComparison(
            tuple(rows),
            None,
            float("nan"),
            None,
            "no swept size matches a size the application issued: nothing to compare",
        )
    # A fault slows the groups that cross it, not all of them: each (group, op) is judged
    # against the baseline alone, and the primitive is compared where the job is slow.
    slow = sorted(
        (float(np.median(v)), g, o) for (g, o), v in shares.items() if np.median(v) < BELOW
    )
    app_slow = bool(slow) if shares else None
    judged = [(g, o) for _, g, o in slow] if slow else list(ratios)
    ratio = float(np.median([r for k in judged for r in ratios.get(k, [])]))
    reproduces = ratio <= REPRODUCES
    slow_groups = tuple(dict.fromkeys(g for _, g, _ in slow))
    where = f" on {', '.join(slow_groups)}" if slow_groups else ""
    if app_slow is False:
        text = (
            "the application's curve is not below the baseline's, and the primitive path "
            f"alone runs at x{ratio:.2f} of it: no slow curve for the fabric to explain"
        )
    elif reproduces:
        text = (
            f"the primitive path alone reproduces the application's slow curve{where} (busbw "
            f"x{ratio:.2f} of the application's): the fabric or the collective library"
        )
    else:
        text = (
            f"the primitive path alone is x{ratio:.2f} faster than inside the application"
            f"{where}: not the fabric — the application's schedule or arrival (overlap, "
            "contention, late ranks)"
        )
    if app_slow is None:
        text += " (no baseline says whether the application's curve is slow)"
    return SweepComparison(tuple(rows), reproduces, ratio, app_slow, text, slow_groups=slow_groups)
