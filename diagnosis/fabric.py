"""Which links are slow: a host's local fabric, a network rail, misplaced groups, bursts.

Collective transfer (post-arrival service) is compared with **peers**: rows of the
per-(group, op, size bucket) table that do the same job — same kind of group (the mesh
dimensions its members differ in, or without mesh coordinates the name's leading letters:
``tp``, ``dp``...), op, size bucket, group size and host-crossing.
A ratio of 1 is "as fast as its peers"; the analyses never compare a 1 KiB all-reduce over
NVLink with a 256 MiB one over the network.

- **host**: intra-host groups grouped by their host — a slow local fabric (NVLink/PCIe)
  shows as one host whose intra-host collectives are slower than everyone else's.
- **rail**: cross-host groups whose members all sit on one rail, grouped by that rail — a
  degraded NIC or rail switch slows exactly the groups that cross it.
- **placement**: groups that cross hosts although most groups of their kind do not (a
  tensor-parallel group split over two hosts), against their kind's intra-host peers.
- **bursts**: per step, the geometric mean over cross-host instances of transfer relative
  to its row's quiet level (10th percentile) — a congestion burst lifts a whole step's
  transfers at once, and may hit more than half of the steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.grouprows import GroupSkew, group_rows, transfer_time
from rankscope.diagnosis.robust import nanmedian, robust_z
from rankscope.diagnosis.window import Window


@dataclass(frozen=True)
class LinkFinding:
    """A host, rail or set of groups whose collectives are slower than their peers'."""

    kind: str
    """``host``, ``rail`` or ``placement``."""
    code: int
    """Host code or rail (-1 for placement)."""
    label: str
    slowdown: float
    """Median transfer over the peers' median (1 = as fast as peers)."""
    z: float
    """Robust z of ``slowdown`` among the candidates of the same kind (hosts, rails); for a
    comparison with the baseline run, the shift in units of the control rows' spread."""
    extra_ns_per_step: float
    """Σ over its rows of (transfer − peer transfer) × instances, per step of the window."""
    groups: tuple[str, ...]
    hosts: tuple[str, ...]
    ranks: tuple[int, ...]
    control: int = 0
    """Against a baseline run: how many other rows the run-to-run spread comes from."""
    paired: int = 0
    """With exactly two candidates of its kind (two hosts, two rails): the steps the two
    were compared over, one against the other, and ``z`` is then the paired t statistic
    of the per-step difference in their transfer (`_paired`); 0 otherwise."""


@dataclass(frozen=True)
class FabricView:
    """Slow-link findings, worst first within each kind."""

    hosts: tuple[LinkFinding, ...]
    rails: tuple[LinkFinding, ...]
    placement: tuple[LinkFinding, ...]
    row_ratio: np.ndarray
    """float64 per `GroupSkew` row: median transfer over its peers' median."""
    inflation_cross: np.ndarray
    """float64 (S,) per step geometric-mean transfer of cross-host instances over their
    rows' quiet level (10th percentile)."""
    inflation_intra: np.ndarray
    """float64 (S,) the same for intra-host instances."""
    hosts_vs_baseline: tuple[LinkFinding, ...] = ()
    """Each host's intra-host transfer against the baseline run's same groups (worst first;
    empty without a baseline), see `fabric_baseline`."""
    rails_vs_baseline: tuple[LinkFinding, ...] = ()
    """Each rail's cross-host transfer against the baseline run's same groups."""


_KIND = re.compile(r"^[A-Za-z_]+")


def group_kind(name: str) -> str:
    """The kind of a group from its name.

    Args:
        name: group name (``tp0.3``, ``dp1.2``, ``world``).

    Returns:
        Its leading letters (``tp``, ``dp``, ``world``).
    """
    m = _KIND.match(name)
    return m.group(0).rstrip("_") if m else name


def _kind(window: Window, name: str, members: np.ndarray) -> str:
    """What job a group does: the mesh dimensions its members differ in (``tp``, ``dp``),
    when every member reports its mesh coordinates; else the name's leading letters. The
    group size is part of it, so unnamed groups of different sizes stay apart."""
    mesh = window.ranks.mesh
    if members.size >= 2:
        coords = {d: mesh[d][members] for d in sorted(mesh)}
        known = {d: c for d, c in coords.items() if (c >= 0).any()}
        if known and all((c >= 0).all() for c in known.values()):
            varied = [d for d, c in known.items() if np.unique(c).size > 1]
            if varied:
                return "+".join(varied) + f"/{members.size}"
    return f"{group_kind(name)}/{members.size}"


def row_links(window: Window, skew: GroupSkew) -> dict[str, np.ndarray]:
    """Where each row's group runs.

    Args:
        window: the window.
        skew: its per-(group, op, size bucket) rows.

    Returns:
        Columns per row: ``kind`` (object, the group's job, see `_kind`), ``crosses``
        (1 when the group spans hosts), ``members``, ``rail`` (the one rail all members
        sit on, else -1) and ``host`` (the one host, else -1).
    """
    n = len(skew)
    kind = np.empty(n, dtype=object)
    crosses = np.zeros(n, dtype=np.int64)
    members = np.zeros(n, dtype=np.int64)
    rail = np.full(n, -1, dtype=np.int64)
    host = np.full(n, -1, dtype=np.int64)
    cache: dict[int, tuple[str, int, int, int, int]] = {}
    r_rail = window.ranks.rail
    r_host = window.ranks.host
    for i, gid in enumerate(skew.group.tolist()):
        if gid not in cache:
            g = window.groups.get(gid)
            if g is None:
                cache[gid] = (f"group{gid}", 0, 0, -1, -1)
            else:
                m = np.asarray([r for r in g.ranks if 0 <= r < window.world_size], np.int64)
                rails = np.unique(r_rail[m]) if m.size else np.zeros(0)
                hosts = np.unique(r_host[m]) if m.size else np.zeros(0)
                cache[gid] = (
                    _kind(window, g.name, m),
                    int(g.crosses_hosts),
                    len(g.ranks),
                    int(rails[0]) if rails.size == 1 else -1,
                    int(hosts[0]) if hosts.size == 1 else -1,
                )
        kind[i], crosses[i], members[i], rail[i], host[i] = cache[gid]
    return {"kind": kind, "crosses": crosses, "members": members, "rail": rail, "host": host}


def _peer_ratio(t: np.ndarray, cls: list[tuple]) -> np.ndarray:
    """t over the median t of the rows sharing its class tuple."""
    out = np.full(t.shape[0], np.nan)
    index: dict[tuple, list[int]] = {}
    for i, c in enumerate(cls):
        index.setdefault(c, []).append(i)
    for rows in index.values():
        sel = np.asarray(rows)
        med = nanmedian(t[sel]) if np.isfinite(t[sel]).any() else np.nan
        if med > 0:
            out[sel] = t[sel] / med
    return out


def _extra(t: np.ndarray, ratio: np.ndarray, count: np.ndarray, sel: np.ndarray, steps: int):
    with np.errstate(invalid="ignore", divide="ignore"):
        peer = t[sel] / ratio[sel]
    extra = np.nansum((t[sel] - peer) * count[sel])
    return float(extra / max(steps, 1))


def _findings(
    kind: str,
    codes: np.ndarray,
    valid: np.ndarray,
    window: Window,
    skew: GroupSkew,
    ratio: np.ndarray,
    label,
) -> tuple[LinkFinding, ...]:
    sel_codes = np.unique(codes[valid & (codes >= 0) & np.isfinite(ratio)])
    if sel_codes.size == 0:
        return ()
    med = np.array([nanmedian(ratio[valid & (codes == c)]) for c in sel_codes])
    z = robust_z(np.log(med)) if sel_codes.size >= 3 else np.zeros(sel_codes.size)
    paired = 0
    if sel_codes.size == 2:
        t, paired = _paired(window, skew, codes, valid, ratio, sel_codes)
        z = np.array([t, -t]) if paired else z
    n_steps = int(window.steps.shape[0])
    out = []
    for c, m, zc in zip(sel_codes, med, z):
        sel = valid & (codes == c)
        gids = np.unique(skew.group[sel])
        names = tuple(window.groups[g].name if g in window.groups else f"group{g}" for g in gids)
        ranks = sorted({r for g in gids if g in window.groups for r in window.groups[g].ranks})
        host_codes = sorted(
            {int(window.ranks.host[r]) for r in ranks if 0 <= r < window.world_size}
        )
        out.append(
            LinkFinding(
                kind=kind,
                code=int(c),
                label=label(int(c)),
                slowdown=float(m),
                z=float(zc),
                extra_ns_per_step=_extra(
                    skew.transfer_p50, ratio, skew.count.astype(float), sel, n_steps
                ),
                groups=names,
                hosts=tuple(host_name(window, h) for h in host_codes),
                ranks=tuple(int(r) for r in ranks),
                paired=paired,
            )
        )
    out.sort(key=lambda f: -f.slowdown)
    return tuple(out)


PAIRED_STEPS = 8
"""Steps two links must be compared over before either is judged against the other."""
PAIRED_Z = 1.645 + 3.0
"""The paired t statistic at which the slower of two links is judged slow: one-sided at
95 %, with the margin of 3 a link among peers needs beyond the largest z of chance."""
PAIRED_FLOOR = 0.005
"""Floor on the spread of the per-step log transfer difference of two links (0.5 %), so
that a noise-free simulation does not read infinitely sure."""


def _paired(
    window: Window,
    skew: GroupSkew,
    codes: np.ndarray,
    valid: np.ndarray,
    ratio: np.ndarray,
    pair: np.ndarray,
) -> tuple[float, int]:
    """Two links compared step by step: per step, the mean over each one's (sampled)
    instances of log(transfer / its row's class median), the first's less the second's;
    the t statistic of that difference's mean over the steps, and the steps.

    Two hosts or two rails give no spread to judge either against, but each step is a
    comparison of the two under the same load: a link slower in step after step, by more
    than the steps' differences vary, is slower, where one slower in a few steps is noise.
    NaN (and 0 steps) below `PAIRED_STEPS` steps with both.
    """
    inst = window.instances
    n_steps = int(window.steps.shape[0])
    row = skew.row_of_instance
    if row.shape[0] != len(inst) or n_steps == 0:
        return float("nan"), 0
    idx = np.flatnonzero(skew.sampled & (row >= 0))
    r = row[idx]
    with np.errstate(invalid="ignore", divide="ignore"):
        keep = valid[r] & np.isin(codes[r], pair) & (ratio[r] > 0)
        idx, r = idx[keep], r[keep]
        lr = np.log(transfer_time(inst, idx) * ratio[r] / skew.transfer_p50[r])
    j = np.searchsorted(window.steps, inst.step[idx])
    jc = np.minimum(j, n_steps - 1)
    good = np.isfinite(lr) & (j < n_steps) & (window.steps[jc] == inst.step[idx])
    cell = jc + n_steps * (codes[r] == pair[1]).astype(np.int64)
    sums = np.bincount(cell[good], weights=lr[good], minlength=2 * n_steps)
    counts = np.bincount(cell[good], minlength=2 * n_steps)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    d = mean[:n_steps] - mean[n_steps:]
    d = d[np.isfinite(d)]
    if d.size < PAIRED_STEPS:
        return float("nan"), 0
    spread = max(float(np.std(d, ddof=1)), PAIRED_FLOOR)
    return float(np.mean(d) / (spread / np.sqrt(d.size))), int(d.size)


def is_pair(links: tuple[LinkFinding, ...]) -> bool:
    """Two links of one kind, compared one against the other step by step (`_paired`)."""
    return len(links) == 2 and min(f.paired for f in links) > 0


def host_name(window: Window, code: int) -> str:
    """A host's name from its code (``host<code>`` when the table does not name it).

    Args:
        window: the window.
        code: host code.

    Returns:
        The name.
    """
    hosts = window.ranks.hosts
    return hosts[code] if 0 <= code < len(hosts) else f"host{code}"


def _inflation(window: Window, skew: GroupSkew, side: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per step, exp(mean log(transfer / row quiet level)) over the (sampled) instances of
    cross-host rows (``side`` 1) and of intra-host rows (``side`` 0) in one pass; rows with
    ``side`` -1 are left out."""
    inst = window.instances
    n_steps = int(window.steps.shape[0])
    nan = np.full(n_steps, np.nan)
    row = skew.row_of_instance
    if row.shape[0] != len(inst) or n_steps == 0:
        return nan, nan.copy()
    idx = np.flatnonzero(skew.sampled & (row >= 0))
    r = row[idx]
    with np.errstate(invalid="ignore", divide="ignore"):
        # The sampled instances' transfer only (a tenth of the table at 10 M instances).
        lr = np.log(transfer_time(inst, idx) / skew.transfer_p10[r])
    j = np.searchsorted(window.steps, inst.step[idx])
    jc = np.minimum(j, n_steps - 1)
    good = np.isfinite(lr) & (j < n_steps) & (window.steps[jc] == inst.step[idx])
    good &= side[r] >= 0
    # One bincount over 2 x S cells: intra-host rows first, cross-host rows second.
    cell = jc + n_steps * np.maximum(side[r], 0).astype(np.int64)
    sums = np.bincount(cell[good], weights=lr[good], minlength=2 * n_steps)
    counts = np.bincount(cell[good], minlength=2 * n_steps)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(counts > 0, np.exp(sums / np.maximum(counts, 1)), np.nan)
    return out[n_steps:], out[:n_steps]


def fabric_view(
    window: Window,
    skew: GroupSkew,
    baseline: Window | None = None,
    baseline_skew: GroupSkew | None = None,
) -> FabricView:
    """Slow hosts, rails and misplaced groups, and per-step transfer inflation.

    Args:
        window: the window.
        skew: its `critical.group_skew` table.
        baseline: a healthy run of the same job, to compare each link with its own past.
        baseline_skew: the baseline's table (computed from it when not given).

    Returns:
        The findings (empty tuples where the window has no such groups).
    """
    n_steps = int(window.steps.shape[0])
    if len(skew) == 0:
        nan = np.full(n_steps, np.nan)
        return FabricView((), (), (), np.zeros(0), nan, nan.copy())
    a = row_links(window, skew)
    t = skew.transfer_p50
    op, bucket = skew.op.tolist(), skew.bucket.tolist()
    kinds, members, crosses = a["kind"].tolist(), a["members"].tolist(), a["crosses"].tolist()
    cls = [(k, o, b, m, c) for k, o, b, m, c in zip(kinds, op, bucket, members, crosses)]
    ratio = _peer_ratio(t, cls)

    intra = a["crosses"] == 0
    hosts = _findings("host", a["host"], intra, window, skew, ratio, lambda c: host_name(window, c))
    rails = _findings("rail", a["rail"], ~intra, window, skew, ratio, lambda c: f"rail {c}")

    # Kinds whose groups mostly stay inside a host; their crossing groups are misplaced.
    placement: list[LinkFinding] = []
    kind_arr = a["kind"]
    for k in sorted(set(kinds)):
        of_kind = kind_arr == k
        n_cross = int((of_kind & ~intra).sum())
        n_intra = int((of_kind & intra).sum())
        if n_cross == 0 or n_intra <= n_cross:
            continue
        # Compare the crossing rows with the same kind's intra-host rows (op, size, members).
        cls_k = [(o, b, m) for o, b, m in zip(op, bucket, members)]
        ref: dict[tuple, list[float]] = {}
        for i in np.flatnonzero(of_kind & intra):
            ref.setdefault(cls_k[i], []).append(t[i])
        sel = of_kind & ~intra
        r = np.full(len(skew), np.nan)
        for i in np.flatnonzero(sel):
            peers = ref.get(cls_k[i])
            if peers:
                r[i] = t[i] / float(np.median(peers))
        if not np.isfinite(r[sel]).any():
            continue
        gids = np.unique(skew.group[sel])
        names = tuple(window.groups[g].name for g in gids if g in window.groups)
        ranks = sorted({rk for g in gids if g in window.groups for rk in window.groups[g].ranks})
        hc = sorted({int(window.ranks.host[rk]) for rk in ranks if 0 <= rk < window.world_size})
        placement.append(
            LinkFinding(
                kind="placement",
                code=-1,
                label=f"{len(names)} {k.split('/')[0]} group(s) crossing hosts",
                slowdown=float(nanmedian(r[sel])),
                z=float("nan"),
                extra_ns_per_step=_extra(t, r, skew.count.astype(float), sel, n_steps),
                groups=names,
                hosts=tuple(host_name(window, h) for h in hc),
                ranks=tuple(int(x) for x in ranks),
            )
        )
    side = (a["crosses"] == 1).astype(np.int64)
    hosts_b: tuple[LinkFinding, ...] = ()
    rails_b: tuple[LinkFinding, ...] = ()
    if baseline is not None:
        # Imported here: fabric_baseline builds on this module's findings and row columns.
        from rankscope.diagnosis.fabric_baseline import PERSISTENT_Z, links_vs_baseline

        base_rows = baseline_skew if baseline_skew is not None else group_rows(baseline.instances)
        hosts_b, rails_b = links_vs_baseline(window, skew, baseline, base_rows)
        # A rail slower than in the baseline in every step, while other rails are not, is
        # not bursting, and the queue of a throttled link varies by itself: its rows leave
        # the burst measure. (All rails slower is the network as a whole: they stay.)
        slow = [f.code for f in rails_b if f.z > PERSISTENT_Z]
        if slow and len(slow) < len(rails_b):
            side[(side == 1) & np.isin(a["rail"], slow)] = -1
    infl_cross, infl_intra = _inflation(window, skew, side)
    return FabricView(
        hosts=hosts,
        rails=rails,
        placement=tuple(placement),
        row_ratio=ratio,
        inflation_cross=infl_cross,
        inflation_intra=infl_intra,
        hosts_vs_baseline=hosts_b,
        rails_vs_baseline=rails_b,
    )
