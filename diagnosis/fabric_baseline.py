"""Which links slowed down since the baseline run: each link against its own past.

`fabric` compares a link with its peers in the same window, which needs enough peers for
a spread (three rails or hosts at least). A small job — two hosts, one or two rails — has
too few, but with a healthy baseline run of the same job every link has a reference of
its own: the same process group (matched by name and member ranks), op and message-size
bucket in the baseline.

For each matched row the change is ``log(transfer / baseline transfer)`` (post-arrival
transfer, median over the row's instances: the same message size class, so per instance
is per byte up to the bucket's factor of two). A link's shift is the median change of its
rows **relative to the median change of every other matched row** — a machine that is
slower as a whole between the two runs moves the control rows too, and that is not a
link. The shift is judged against the run-to-run movement of the control rows (their
robust spread from three or more, else the largest of their moves), with a floor; with no
control row at all a wider floor stands in for the unseen machine drift.
"""

from __future__ import annotations

import numpy as np

from rankscope.diagnosis.fabric import LinkFinding, host_name, row_links
from rankscope.diagnosis.grouprows import GroupSkew
from rankscope.diagnosis.robust import nanmedian
from rankscope.diagnosis.window import Window

SHIFT_FLOOR = float(np.log(1.5))
"""Smallest run-to-run spread (log units) trusted for one row's median transfer when other
rows show how the machine moved: between two healthy runs on a shared machine their
transfers spread by ~1.5x, so a link must shift several times that to stand out."""
BLIND_FLOOR = float(np.log(2.0))
"""The spread assumed when no other row was matched: a single sub-millisecond group on two
loaded cores was seen to move by up to ~4x between healthy runs (two spreads at this floor),
while a degraded link moves by tens of times."""
MAD_SIGMA = 1.4826
MIN_CONTROL = 3
"""Control rows needed before their robust spread replaces the largest control move."""
PERSISTENT_Z = 4.5
"""A link shifted by more than this many spreads is persistently degraded (the verdict's
threshold for two links, ``expected_max_z(2) + Z_MARGIN``)."""


def _row_keys(window: Window, skew: GroupSkew) -> list[tuple | None]:
    """(group name, member ranks, op, size bucket) per row; None for an unknown group."""
    out: list[tuple | None] = []
    for gid, op, bucket in zip(skew.group.tolist(), skew.op.tolist(), skew.bucket.tolist()):
        g = window.groups.get(gid)
        out.append(None if g is None else (g.name, tuple(g.ranks), op, bucket))
    return out


def matched_change(
    window: Window, skew: GroupSkew, baseline: Window, baseline_skew: GroupSkew
) -> np.ndarray:
    """Per row of ``skew``, log of its median transfer over the baseline's same row.

    Args:
        window: the window under study.
        skew: its per-(group, op, size bucket) rows.
        baseline: the healthy run's window.
        baseline_skew: its rows.

    Returns:
        float64 per row; NaN where the baseline has no such row or a transfer is unknown.
    """
    ref: dict[tuple, float] = {}
    for key, t in zip(_row_keys(baseline, baseline_skew), baseline_skew.transfer_p50.tolist()):
        if key is not None:
            ref[key] = t
    out = np.full(len(skew), np.nan)
    for i, (key, t) in enumerate(zip(_row_keys(window, skew), skew.transfer_p50.tolist())):
        b = ref.get(key) if key is not None else None
        if b is not None and np.isfinite(b) and np.isfinite(t) and b > 0 and t > 0:
            out[i] = np.log(t / b)
    return out


def _shifts(
    kind: str,
    codes: np.ndarray,
    on_kind: np.ndarray,
    change: np.ndarray,
    window: Window,
    skew: GroupSkew,
    label,
) -> tuple[LinkFinding, ...]:
    known = np.isfinite(change)
    sel_codes = np.unique(codes[on_kind & known & (codes >= 0)])
    n_steps = max(int(window.steps.shape[0]), 1)
    t = skew.transfer_p50
    out = []
    for c in sel_codes.tolist():
        mine = on_kind & known & (codes == c)
        control = known & ~mine
        ctrl = change[control]
        level = float(np.median(ctrl)) if ctrl.size else 0.0
        if ctrl.size >= MIN_CONTROL:
            spread = max(SHIFT_FLOOR, MAD_SIGMA * float(np.median(np.abs(ctrl - level))))
        elif ctrl.size:
            spread = max(SHIFT_FLOOR, float(np.max(np.abs(ctrl - level))))
        else:
            spread = BLIND_FLOOR
        shift = float(nanmedian(change[mine])) - level
        # What the link's rows would have taken had they moved like the control rows.
        expected = t[mine] / np.exp(change[mine] - level)
        extra = float(np.nansum((t[mine] - expected) * skew.count[mine])) / n_steps
        gids = np.unique(skew.group[mine])
        names = tuple(window.groups[g].name for g in gids.tolist() if g in window.groups)
        ranks = sorted(
            {r for g in gids.tolist() if g in window.groups for r in window.groups[g].ranks}
        )
        hcodes = sorted({int(window.ranks.host[r]) for r in ranks if 0 <= r < window.world_size})
        out.append(
            LinkFinding(
                kind=kind,
                code=int(c),
                label=label(int(c)),
                slowdown=float(np.exp(shift)),
                z=shift / spread,
                extra_ns_per_step=extra,
                groups=names,
                hosts=tuple(host_name(window, h) for h in hcodes),
                ranks=tuple(int(r) for r in ranks),
                control=int(ctrl.size),
            )
        )
    out.sort(key=lambda f: -f.z)
    return tuple(out)


def links_vs_baseline(
    window: Window, skew: GroupSkew, baseline: Window, baseline_skew: GroupSkew
) -> tuple[tuple[LinkFinding, ...], tuple[LinkFinding, ...]]:
    """Each host's intra-host transfer and each rail's cross-host transfer against the
    baseline run's same rows, relative to how every other row moved.

    Args:
        window: the window under study.
        skew: its per-(group, op, size bucket) rows.
        baseline: the healthy run's window.
        baseline_skew: its rows.

    Returns:
        ``(hosts, rails)``: findings worst first; ``slowdown`` is the link's transfer
        change over the control rows' (1 = moved like everything else), ``z`` that shift
        in units of the control rows' run-to-run spread, ``control`` how many rows that
        spread comes from.
    """
    if len(skew) == 0 or len(baseline_skew) == 0:
        return (), ()
    change = matched_change(window, skew, baseline, baseline_skew)
    if not np.isfinite(change).any():
        return (), ()
    a = row_links(window, skew)
    intra = a["crosses"] == 0
    hosts = _shifts("host", a["host"], intra, change, window, skew, lambda c: host_name(window, c))
    rails = _shifts("rail", a["rail"], ~intra, change, window, skew, lambda c: f"rail {c}")
    return hosts, rails
