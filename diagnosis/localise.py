"""Localisation: who sets each step, where their extra time goes, and what fixing them gains.

This is the first stage of the verdict and needs no catalogue of causes (the seed:
"localize the missing wall time", "identify which ranks and operations determine the
changed critical path"). A mechanism the catalogue has never heard of still leaves a rank,
a host or a pipeline stage that the others wait for, and a wall-time category where that
entity's extra time goes.

**Who sets the step.** In a synchronous step every rank ends together; the ranks that
finish their own work early wait in the collectives for the one that finishes last. A
rank's *local* time is its step less exposed communication, arrival wait and pipeline
idle (compute, input, memory management, checkpoint, recovery, host gap and user phases),
plus what it spent in collectives after a peer had already left them (a transfer ends for
all members together, so a member held longer was held by something of its own: its
process not scheduled, a blocking call on the way out) and the time between its previous
step and this one (`local_ns`). Per step, the rank with the most local time sets it (the *setter*).
Communication is shared by the members of a collective (a slow rail delays all of them
alike), so it is localised by the links instead: a rail's or a host's extra transfer
over its peers' (`fabric`), which `link_suspects` turns into suspects of the same form.

**What-if** (the method of "Understanding Stragglers in Large Model Training Using What-if
Analysis", OSDI'25, on the step level): re-time each step with one entity's local time
replaced by the median local time of the ranks outside it (its peers': a median the
entity is part of is pulled toward it, and with two ranks would give back only half of
what a straggler costs). The step is paced by the largest local time; the ranks that
waited contribute nothing, so the re-timed step is ``max(largest local time outside the
entity, their median)`` and the gain is what the step loses from its
current maximum. It is exact when a step has one synchronisation point that every rank
joins (a data-parallel gradient all-reduce) and a lower bound when the step has several:
an entity that is late at an early collective and catches up later gains at least this.
Entities: each rank, each host (when hosts hold several ranks) and each pipeline stage
(the ``pp`` mesh coordinate). Gains are trimmed means over steps (the largest `TRIM` of
the steps left out, and at least two), so isolated spikes do not make a straggler while a pause that
recurs every few steps still does.

**Beyond chance.** Noise makes some rank the slowest in every step, so an entity's gain
is judged against its peers': the gain *beyond* the median gain of the other entities of
its kind (with a baseline run, also beyond the same entity's gain there). For this
judgement each step's setter is re-timed to the median of all ranks, itself included: with
few ranks that is the stricter bar (with two, half of a lead), where one of them is the
slowest by chance in every step and chance is largest; with many it is the same median.
The gain reported (`Suspect.gain`) is the what-if over the peers alone. A healthy run's
best rank gains about as much as the others; a straggler gains far more.

**The best of several.** The suspect is the entity with the largest gain, and the largest
of several draws stands above the median of the others even when none is slow: among four
ranks of one noisy machine (two cores shared by four ranks and their hub, each rank's
local time 12-47 ms a step), one set 6 of 20 steps and gained 2.1 % of the step beyond its
peers' median, as a material straggler would. So where an entity has `FEW_PEERS` peers or
more, its gain beyond them must also clear what the best entity gains beyond its peers by
chance: each step's setter drawn at random in proportion to the entities' ranks, its gain
drawn from the steps the others set (so that a straggler's own leads do not raise its
bar), `CHANCE_QUANTILE` of `CHANCE_DRAWS` draws. An entity short of that bar has it
taken off (`Suspect.noise`); one that clears it keeps its whole gain beyond its peers'
median. A test, not a lower bound as with few peers below: a straggler among many loses
nothing to it (a rank 20 % slower among 16 ranks each 10 % noisy, over 20 steps, is found
in 43 of 50 runs with or without it), while the chance leaders of a few noisy ranks are
held back (four ranks each 20 % noisy: 13 material suspects in 200 healthy runs, 61
without it; the same straggler found in 42 of 50, 47 without).

**Beyond noise.** With one or two peers, their median gain cannot stand for chance: over
few steps one of two ranks leads by chance (each 10 % noisy a step, the trimmed mean of
one is several per cent of the step above the other's in one run of ten). So where an
entity has fewer than `FEW_PEERS` peers, its net gain is also taken down by `NOISE_Z`
standard errors of the steps' noise (`Suspect.noise`): the robust spread of the per-step
differences between the entity's gain and its peers' median gain that step (with two
ranks, the other one's), over the square root of the steps. The spread is a median
deviation, so a pause that recurs in a quarter of the steps is signal, not noise; the trim
keeps two isolated spikes from counting. The net gain is then a one-sided 95 % lower
bound: material means the steps establish a material gain. With three or more peers the
best-of-several bar stands in for it: an entity's own spread would read a straggler that
sets only some of the steps as noise (a rank 20 % slower among 16 ranks each 10 % noisy was
found in 19 of 50 runs with the allowance, 43 without).

**Moving stragglers.** When the slow rank changes from step to step (data imbalance,
garbage-collection pauses on varying ranks), no fixed entity gains much; the *moving* gain
replaces each step's setter by the median rank, counting only the steps whose setter is an
outlier among the ranks of that step (its local time beyond what that many healthy ranks
reach by chance, `robust.expected_max_z`), which needs eight ranks or more to measure. A
moving straggler looks like the heavy-tailed per-rank noise every large job has, so on its
own it is judged only against a baseline run; without one it is reported, not called (a
catalogued mechanism with its own evidence, GC pauses or the data's work, still names it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankscope.diagnosis.decomposition import CATEGORIES, Decomposition
from rankscope.diagnosis.fabric import PAIRED_Z, FabricView, LinkFinding, is_pair
from rankscope.diagnosis.regime import MEDIAN_RANKS
from rankscope.diagnosis.robust import expected_max_z, nanmedian
from rankscope.diagnosis.window import Window

TRIM = 0.1
"""Share of the steps with the largest gain left out of an entity's mean gain."""
MATERIAL = 0.02
"""A what-if gain of about this share of the step, beyond what chance and the baseline
give, is material: a straggler worth naming (healthy runs stay well below it)."""
NOISE_Z = 1.645
"""Standard errors of its per-step variation taken off an entity's gain beyond its peers:
the net gain is what the steps establish, not what a few of them happened to show."""
FEW_PEERS = 3
"""Below this many peers their median gain cannot stand for chance, and the steps' noise
is taken off too (`NOISE_Z`)."""
CHANCE_DRAWS = 200
"""Random assignments of the steps' setters that make the best entity's chance gain."""
CHANCE_QUANTILE = 0.95
"""The quantile of those draws' best gain taken off (a one-sided 95 % bar, as
`NOISE_Z`)."""
OUTLIER_MARGIN = 3.0
"""A step's setter is an outlier when its robust z among the step's ranks exceeds the
largest z that many healthy ranks reach by chance by this margin."""
MIN_RANKS_MOVING = 8
"""Ranks needed to tell, within one step, an outlier from the slowest of a few."""
KINDS = ("rank", "host", "stage", "rail", "link")
SMALLER_SUFFICES = 1.5
"""A host or stage is named instead of its slowest rank only when it gains this many times
as much (several of its ranks are slow together); otherwise the rank is the suspect."""

_EXCESS_CATEGORIES = tuple(c for c in CATEGORIES if c not in ("arrival_wait", "pipeline_idle"))
LOCAL_CATEGORIES = tuple(c for c in _EXCESS_CATEGORIES if c != "exposed_comm")
"""The categories a rank's local time (`local_ns`), and so a rank's, host's or stage's
gain, is made of: its exposed communication is shared with its peers and is localised by
the links."""
LOCAL_KINDS = ("rank", "host", "stage")
"""Suspects whose gain is re-timed local time (the others, rails and links, are known by
their extra transfer)."""


@dataclass(frozen=True)
class Suspect:
    """One entity (rank, host or pipeline stage) and what it costs the job."""

    kind: str
    """One of `KINDS`."""
    key: str
    """The rank number, host name, ``pp=K``, rail number, or the host of an intra-host link."""
    ranks: tuple[int, ...]
    gain_ns: float
    """What-if: mean step time saved if it behaved like the median rank (trimmed)."""
    gain: float
    """``gain_ns`` over the job's median step."""
    net_gain: float
    """Beyond chance (its peers' median gain), the steps' noise (``noise``) and the
    baseline's same entity, with each step's setter re-timed to the median of all ranks,
    itself included (the module's "Beyond chance" and "Beyond noise")."""
    sets: float
    """Share of steps whose pace it set."""
    excess_ns: dict[str, float] = field(default_factory=dict)
    """Category -> mean ns its setting rank spent beyond the step's median rank, over the
    steps it set (arrival wait and pipeline idle left out: a setter does not wait)."""
    in_baseline: bool = False
    """The baseline run's same entity was a material straggler too: the loss is no
    regression against it, and still a loss (``net_gain`` is then beyond chance only)."""
    noise: float = 0.0
    """What the steps' noise could give the net gain (`NOISE_Z` standard errors with few
    peers; with more, what the best of them gains by chance, when its gain does not clear
    it), share of the step, already taken off ``net_gain``: ``net_gain + noise`` is the
    estimate."""

    @property
    def label(self) -> str:
        return f"{self.kind} {self.key}"

    @property
    def category(self) -> str | None:
        """The category most of its extra time goes to (None when nothing is extra)."""
        pos = {c: v for c, v in self.excess_ns.items() if np.isfinite(v) and v > 0}
        return max(pos, key=lambda c: pos[c]) if pos else None

    def what_if(self) -> str:
        """The headline: "step −12.3 ms (−18.0 %) if rank 7 behaved like the median rank"."""
        return (
            f"step −{self.gain_ns / 1e6:,.1f} ms (−{100 * self.gain:.1f} %) if {self.label} "
            "behaved like the median rank"
        )


@dataclass(frozen=True)
class Localisation:
    """Who sets the steps of one window and what fixing them would gain."""

    step_ns: float
    """The job's median step time."""
    setter: np.ndarray
    """int64 (S,) per step, the rank with the most local time (-1: no rank reported)."""
    stability: float
    """Share of steps set by the most frequent setter (near 1: it stays; low: it moves)."""
    suspects: tuple[Suspect, ...]
    """The best entities of each kind, highest net gain first."""
    moving_gain: float
    """Share of the step saved if each step's setter behaved like the median rank, over
    the steps whose setter is an outlier among that step's ranks (NaN below
    `MIN_RANKS_MOVING` ranks)."""
    outlier_share: float
    """Share of steps whose setter is such an outlier (NaN below `MIN_RANKS_MOVING`)."""
    imbalance: float
    """Share of the step saved if every rank behaved like the median rank (trimmed mean of
    largest minus median local time): the upper bound of what balancing can gain."""

    @property
    def top(self) -> Suspect | None:
        """The suspect: the smallest entity that accounts for the loss (`SMALLER_SUFFICES`)."""
        if not self.suspects:
            return None
        ranks = [s for s in self.suspects if s.kind == "rank"]
        best = max(self.suspects, key=lambda s: s.net_gain)
        if best.kind != "rank" and ranks:
            inside = [s for s in ranks if set(s.ranks) <= set(best.ranks)]
            if inside and best.gain < SMALLER_SUFFICES * max(s.gain for s in inside):
                return max(inside, key=lambda s: s.net_gain)
        return best

    @property
    def stays(self) -> bool:
        """The slow rank is the same in most steps (hardware-like)."""
        return bool(self.stability >= 0.5)

    def of(self, kind: str, key: str) -> Suspect | None:
        """The suspect of one kind and key, when it is among the best."""
        return next((s for s in self.suspects if s.kind == kind and s.key == key), None)


def _every(n_ranks: int) -> int:
    return max(1, n_ranks // MEDIAN_RANKS)


def sample(x: np.ndarray) -> np.ndarray:
    """Evenly spaced rows (ranks) of an (R, S) array, at most about `regime.MEDIAN_RANKS`
    (the median rank of a few hundred is that of thousands to well within the spread, and
    the pass stays flat in cost at 16k ranks; the job's step time is read the same way)."""
    return x[:: _every(x.shape[0])]


def _dropped(n_steps: int) -> int:
    """Steps with the largest gain left out of a trimmed mean over ``n_steps``."""
    # At least two steps are left out (one of two): a straggler recurs, and two isolated
    # spikes of a heavy-tailed run that happened to fall on one host are not one.
    return max(int(TRIM * n_steps), min(2, n_steps - 1)) if n_steps >= 2 else 0


def trimmed_mean(values: np.ndarray, n_steps: int) -> float:
    """Mean over ``n_steps`` of ``values`` (one entity's gains in the steps it has any;
    the other steps count as zero) after leaving out its largest `TRIM` share of the steps,
    and at least two (one of two)."""
    if n_steps <= 0:
        return float("nan")
    drop = _dropped(n_steps)
    kept = np.sort(values)[: max(values.size - drop, 0)] if drop else values
    return float(kept.sum() / max(n_steps - drop, 1))


def _trimmed_means(owner: np.ndarray, gain: np.ndarray, n_codes: int, n_steps: int) -> np.ndarray:
    """`trimmed_mean` of every entity's gains at once: float64 (n_codes,), 0 for an entity
    that sets no step."""
    if n_steps <= 0:
        return np.full(n_codes, np.nan)
    drop = _dropped(n_steps)
    valid = owner >= 0
    o, g = owner[valid], gain[valid]
    order = np.lexsort((g, o))
    counts = np.bincount(o, minlength=n_codes)[:n_codes]
    starts = np.cumsum(counts) - counts
    csum = np.r_[0.0, np.cumsum(g[order])]
    keep = np.maximum(counts - drop, 0)
    return (csum[starts + keep] - csum[starts]) / max(n_steps - drop, 1)


def _entity_max(busy: np.ndarray, codes: np.ndarray, n_codes: int) -> np.ndarray:
    """float64 (E, S) per entity and step, the largest local time of its ranks (-inf where
    none reported)."""
    filled = np.where(np.isfinite(busy), busy, -np.inf)
    member = np.flatnonzero(codes >= 0)
    order = member[np.argsort(codes[member], kind="stable")]
    sc = codes[order]
    starts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]])
    out = np.full((n_codes, busy.shape[1]), -np.inf)
    if order.size:
        out[sc[starts]] = np.maximum.reduceat(filled[order], starts, axis=0)
    return out


@dataclass(frozen=True)
class _Kind:
    kind: str
    codes: np.ndarray
    """int64 (R,) entity code of every rank (-1: unknown)."""
    keys: tuple[str, ...]


def _kinds(window: Window) -> list[_Kind]:
    n = window.world_size
    out = [_Kind("rank", np.arange(n, dtype=np.int64), tuple(str(r) for r in range(n)))]
    host = window.ranks.host.astype(np.int64)
    if n and (host >= 0).all():
        counts = np.bincount(host)
        if np.count_nonzero(counts) >= 2 and counts.max() >= 2:
            names = window.ranks.hosts
            keys = tuple(names[c] if c < len(names) else f"host{c}" for c in range(counts.size))
            out.append(_Kind("host", host, keys))
    pp = window.ranks.mesh.get("pp")
    if pp is not None and n and (pp >= 0).all() and np.unique(pp).size >= 2:
        codes = pp.astype(np.int64)
        out.append(_Kind("stage", codes, tuple(f"pp={k}" for k in range(int(codes.max()) + 1))))
    return out


def between_steps_ns(window: Window) -> np.ndarray:
    """Per rank and step the time the rank spent after its previous step ended and before
    this one began (0 for the first step of the window and where unknown).

    A rank whose host is busy between its steps (a synchronous log, a blocking call after
    the optimizer) starts late, and every peer waits for it inside the step: that time is
    the rank's host gap as much as a gap between its phases is.

    Args:
        window: the window.

    Returns:
        float64 (R, S) ns, never negative.
    """
    out = np.zeros(window.t_start.shape)
    if window.t_start.shape[1] > 1:
        gap = window.t_start[:, 1:] - window.t_end[:, :-1]
        both = window.present[:, 1:] & window.present[:, :-1]
        out[:, 1:] = np.where(both & np.isfinite(gap), np.maximum(gap, 0.0), 0.0)
    return out


def local_ns(decomp: Decomposition, window: Window | None = None) -> np.ndarray:
    """Per rank and step the time of the rank's own work: the step less its exposed
    communication, arrival wait and pipeline idle (compute, input, memory, checkpoint,
    recovery, host gap, other), plus, with ``window``, the time it spent in collectives
    after a peer had left them (``coll["overstay_ns"]``) and between its previous step and
    this one (`between_steps_ns`). The step is paced by the largest; communication is
    shared by the ranks of a collective and is localised by the links instead
    (`link_suspects`).

    Args:
        decomp: the decomposition.
        window: its window, to count the time between steps.

    Returns:
        float64 (R, S); NaN where absent.
    """
    local = (
        decomp.step_ns
        - decomp.category("exposed_comm")
        - decomp.category("arrival_wait")
        - decomp.category("pipeline_idle")
    )
    if window is None:
        return local
    # A collective's transfer ends for all its members together: what one member spent in
    # it after another had left was its own (``overstay_ns``).
    stayed = window.coll.get("overstay_ns")
    if stayed is not None:
        local = local + np.nan_to_num(np.maximum(stayed, 0.0), nan=0.0)
    return local + between_steps_ns(window)


def localise(window: Window, decomp: Decomposition, top: int = 3) -> Localisation:
    """Setters, suspects and what-if gains of one window (see the module docstring).

    Args:
        window: the window.
        decomp: its decomposition.
        top: suspects kept per kind.

    Returns:
        The localisation (no baseline netting: see `against_baseline`).
    """
    busy = local_ns(decomp, window)
    before = between_steps_ns(window)
    n_ranks = busy.shape[0]
    job = nanmedian(sample(decomp.step_ns), axis=0)
    step_ns = float(nanmedian(job)) if np.isfinite(job).any() else float("nan")
    med = nanmedian(sample(busy), axis=0)
    seen = int(np.count_nonzero(np.isfinite(med)))
    cat_med = nanmedian(decomp.ns[:, :: _every(n_ranks)], axis=1)  # (C, S)

    ranks = np.arange(n_ranks, dtype=np.int64)
    filled = np.where(np.isfinite(busy), busy, -np.inf)
    rank_owner, rank_gain, top1 = _step_gains(filled, busy, ranks)
    setter = rank_owner.astype(np.int64)
    counts = np.bincount(setter[setter >= 0], minlength=n_ranks)
    stability = float(counts.max() / seen) if seen and counts.size else float("nan")

    suspects: list[Suspect] = []
    if seen and np.isfinite(step_ns) and step_ns > 0:
        for kind in _kinds(window):
            suspects.extend(
                _suspects(kind, busy, med, setter, decomp, cat_med, before, seen, step_ns, top)
            )
    suspects.sort(key=lambda s: -s.net_gain)

    moving, outliers = float("nan"), float("nan")
    if n_ranks >= MIN_RANKS_MOVING and seen and step_ns > 0:
        spread = _spread(busy)
        with np.errstate(invalid="ignore", divide="ignore"):
            z = (top1 - med) / spread
        out = np.isfinite(z) & (z > expected_max_z(n_ranks) + OUTLIER_MARGIN)
        outliers = float(np.count_nonzero(out) / seen)
        moving = trimmed_mean(rank_gain[out], seen) / step_ns
    with np.errstate(invalid="ignore"):
        gap = np.where(np.isfinite(top1) & np.isfinite(med), top1 - med, 0.0)
    imbalance = trimmed_mean(gap[gap > 0], seen) / step_ns if seen and step_ns > 0 else 0.0
    return Localisation(
        step_ns=step_ns,
        setter=setter,
        stability=stability,
        suspects=tuple(suspects),
        moving_gain=moving,
        outlier_share=outliers,
        imbalance=float(imbalance),
    )


def _spread(busy: np.ndarray) -> np.ndarray:
    """Per step, the robust spread of the ranks' local times (1.4826 × MAD, floored at
    0.5 % of the median so a noise-free simulation does not make every rank an outlier)."""
    part = sample(busy)
    med = nanmedian(part, axis=0)
    mad = nanmedian(np.abs(part - med), axis=0) * 1.4826
    return np.maximum(mad, 0.005 * np.abs(med))


def _median_outside(busy: np.ndarray, codes: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Per step, the median local time of the ranks outside the entity that sets it (NaN
    where no entity does or none is outside), from one sort: the sorted positions of the
    setter's members are stepped over to reach the middle of what remains.

    What the setter would be re-timed to is its peers' typical time, not a median it is
    part of: with two ranks that median is their mean, and the what-if would give back
    only half of what a straggler costs. Read on `sample` rows, as the job's median is (a
    member outside the sample is no part of it anyway); a value that is not finite counts
    as not reported.

    Args:
        busy: float (R, S) local times.
        codes: int64 (R,) entity code of each rank (-1: unknown).
        owner: int64 (S,) the entity that sets each step (-1: none).
    """
    every = _every(busy.shape[0])
    rows = busy[::every]
    rows = np.where(np.isfinite(rows), rows, np.nan)
    codes = codes[::every]
    n_rows, n_steps = rows.shape
    order = np.argsort(rows, axis=0)  # NaN last
    ordered = np.take_along_axis(rows, order, axis=0)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(n_rows)[:, None].repeat(n_steps, axis=1), axis=0)
    finite = np.count_nonzero(np.isfinite(rows), axis=0)
    # Each entity's member rows, padded with -1.
    member = np.flatnonzero(codes >= 0)
    by = member[np.argsort(codes[member], kind="stable")]
    counts = np.bincount(codes[by], minlength=max(int(owner.max(initial=-1)) + 1, 1))
    members = np.full((counts.size, max(int(counts.max(initial=0)), 1)), -1, dtype=np.int64)
    if by.size:
        starts = np.cumsum(counts) - counts
        members[codes[by], np.arange(by.size) - np.repeat(starts, counts)] = by
    cols = np.flatnonzero(owner >= 0)
    mine = members[owner[cols]]  # (k, width)
    gone = np.where(mine >= 0, pos[np.maximum(mine, 0), cols[:, None]], n_rows).astype(float)
    gone[gone >= finite[cols][:, None]] = np.inf  # a NaN member is not among the finite
    gone.sort(axis=1)
    left = finite[cols] - np.count_nonzero(np.isfinite(gone), axis=1)
    picks = []
    for t in ((left - 1) // 2, left // 2):
        j = np.maximum(t, 0)
        for i in range(gone.shape[1]):
            j = j + (gone[:, i] <= j)
        picks.append(ordered[np.minimum(j, n_rows - 1), cols])
    out = np.full(n_steps, np.nan)
    out[cols] = np.where(left >= 1, 0.5 * (picks[0] + picks[1]), np.nan)
    return out


def _step_gains(
    ent_max: np.ndarray, busy: np.ndarray, codes: np.ndarray, med: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step the entity that sets it, the gain of replacing it by the median rank
    outside it (`_median_outside`; or by ``med``, a given per-step median), and the
    largest local time."""
    n_ent, n_steps = ent_max.shape
    if n_ent == 1:
        top1, top2 = ent_max[0], np.full(n_steps, -np.inf)
    else:
        part = np.partition(ent_max, n_ent - 2, axis=0)
        top1, top2 = part[n_ent - 1], part[n_ent - 2]
    owner = np.where(np.isfinite(top1), np.argmax(ent_max, axis=0), -1)
    if med is None:
        med = _median_outside(busy, codes, owner)
    ok = np.isfinite(top1) & np.isfinite(med)
    with np.errstate(invalid="ignore"):
        gain = np.where(ok, np.maximum(top1 - np.maximum(top2, med), 0.0), 0.0)
    owner = np.where(ok, owner, -1)
    return owner, gain, np.where(ok, top1, np.nan)


def _entity_gains(
    kind: _Kind, busy: np.ndarray, seen: int, med: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per step the entity of ``kind`` that sets it; per entity its trimmed mean gain (0
    for one that sets no step) and the steps it sets; per step the setter's gain. The
    setter is re-timed to the median of the ranks outside it, or, given ``med``, to that
    per-step median."""
    n_codes = len(kind.keys)
    ent_max = _entity_max(busy, kind.codes, n_codes)
    owner, gain, _ = _step_gains(ent_max, busy, kind.codes, med)
    sets = np.bincount(owner[owner >= 0], minlength=n_codes)[:n_codes]
    return owner, _trimmed_means(owner, gain, n_codes, seen), sets, gain


def _typical_peer(owner: np.ndarray, gain: np.ndarray, peers: np.ndarray) -> np.ndarray:
    """Per step, the median over one or two ``peers`` of their gains (0 for a peer that
    does not set the step): one entity sets each step, so it is the setter's gain with one
    peer and half of it with two. Whichever ids the ranks have, the same series."""
    return np.where(np.isin(owner, peers), gain / peers.size, 0.0)


def _noise(diff: np.ndarray, n_steps: int) -> float:
    """Standard error that the steps' noise gives an entity's trimmed mean gain beyond its
    peers', from the per-step differences of the gains (``diff``, `_typical_peer`): its robust
    spread (1.4826 × MAD, so that the pauses a straggler recurs with count as signal, not
    as noise) over the square root of the steps, scaled for the steps the trim leaves
    out. NaN below three steps."""
    if n_steps < 3 or diff.size < 3:
        return float("nan")
    spread = 1.4826 * float(np.median(np.abs(diff - np.median(diff))))
    return spread / ((1.0 - _dropped(n_steps) / n_steps) * np.sqrt(n_steps))


def _best_by_chance(
    owner: np.ndarray, gain: np.ndarray, members: np.ndarray, seen: int, entity: int
) -> float:
    """The gain beyond its peers' median that the best entity reaches by chance, for
    ``entity`` to be judged against: the window's steps each given a setter drawn at
    random (an entity's odds its share of the ranks) and a gain drawn from the steps the
    others set (module docstring, "The best of several"); `CHANCE_QUANTILE` over
    `CHANCE_DRAWS` draws, seeded so that one window always reads the same. The gains come
    from the others' steps so that a straggler's own leads, spread at random, do not raise
    the bar it is held to; a straggler that sets every step has none to draw, and no bar.

    Args:
        owner: int64 (S,) the entity that set each step (-1: none).
        gain: float (S,) that step's judged gain.
        members: int64 (E,) ranks of each entity (0: not in the window).
        seen: steps with a median, as `_trimmed_means` counts them.
        entity: the entity judged.
    """
    present = np.flatnonzero(members > 0)
    steps = np.flatnonzero(owner >= 0)
    pool = gain[steps[owner[steps] != entity]]
    if present.size <= FEW_PEERS or pool.size == 0:
        return 0.0
    rng = np.random.default_rng(0)
    odds = members[present] / members[present].sum()
    draws = rng.choice(present.size, size=(CHANCE_DRAWS, steps.size), p=odds)
    gains = rng.choice(pool, size=(CHANCE_DRAWS, steps.size))
    # Every draw at once: one group per (draw, entity drawn in it), its trimmed mean gain
    # as `_trimmed_means` makes it. Only the entities drawn for some step gain anything
    # (at most one a step, so the work stays as small as the window at any world size);
    # the rest gain zero, below every gain in each draw's sorted order.
    which = np.repeat(np.arange(CHANCE_DRAWS), steps.size)
    keys, group = np.unique(which * present.size + draws.ravel(), return_inverse=True)
    got = _trimmed_means(group, gains.ravel(), keys.size, seen)
    of = keys // present.size
    order = np.lexsort((got, of))
    got, of = got[order], of[order]
    counts = np.bincount(of, minlength=CHANCE_DRAWS)
    last = np.cumsum(counts) - 1
    zeros = present.size - counts
    n = counts - 1 + zeros  # the others of each draw's best

    def at(k: np.ndarray) -> np.ndarray:
        # The k-th smallest of the others: a zero, or a drawn entity's gain.
        pos = np.clip(last - counts + 1 + k - zeros, 0, got.size - 1)
        return np.where(k < zeros, 0.0, got[pos])

    best = got[last] - 0.5 * (at((n - 1) // 2) + at(n // 2))
    return float(np.quantile(best, CHANCE_QUANTILE))


def _suspects(
    kind: _Kind,
    busy: np.ndarray,
    med: np.ndarray,
    setter: np.ndarray,
    decomp: Decomposition,
    cat_med: np.ndarray,
    before: np.ndarray,
    seen: int,
    step_ns: float,
    top: int,
) -> list[Suspect]:
    n_codes = len(kind.keys)
    owner, gains, sets, _ = _entity_gains(kind, busy, seen)
    # Judged on the re-timing to the median of all ranks (the module's "Beyond chance").
    j_owner, judged, _, j_gain = _entity_gains(kind, busy, seen, med)
    has = np.flatnonzero(sets)
    members = np.bincount(kind.codes[kind.codes >= 0], minlength=n_codes)[:n_codes]
    present = members > 0
    several = np.count_nonzero(present) > FEW_PEERS
    before_med = np.median(sample(before), axis=0)
    order = has[np.argsort(-gains[has], kind="stable")][:top]
    out = []
    for e in order:
        peers = np.flatnonzero(present & (np.arange(n_codes) != e))
        chance = float(np.median(judged[peers])) if peers.size else 0.0
        # Beyond the noise too, with few peers: the steps' differences between the entity
        # and its peers must establish the gain, not a few of them.
        # Several peers: the best-of-several bar, taken off only when not cleared.
        bar = _best_by_chance(j_owner, j_gain, members, seen, e) if several else 0.0
        noise = bar / NOISE_Z if judged[e] - chance <= bar else 0.0
        if 0 < peers.size < FEW_PEERS:
            diff = np.where(j_owner == e, j_gain, 0.0) - _typical_peer(j_owner, j_gain, peers)
            noise = _noise(diff, seen)
            noise = noise if np.isfinite(noise) else 0.0
        steps = np.flatnonzero(owner == e)
        r = setter[steps]
        ok = r >= 0
        excess = {}
        for c in _EXCESS_CATEGORIES:
            i = CATEGORIES.index(c)
            vals = decomp.ns[i, r[ok], steps[ok]] - cat_med[i, steps[ok]]
            if c == "host_gap":
                vals = vals + before[r[ok], steps[ok]] - before_med[steps[ok]]
            excess[c] = float(np.nanmean(vals)) if vals.size else float("nan")
        out.append(
            Suspect(
                kind=kind.kind,
                key=kind.keys[e],
                ranks=tuple(int(x) for x in np.flatnonzero(kind.codes == e)),
                gain_ns=float(gains[e]),
                gain=float(gains[e] / step_ns),
                net_gain=float((judged[e] - chance - NOISE_Z * noise) / step_ns),
                sets=float(sets[e] / seen),
                excess_ns=excess,
                noise=float(NOISE_Z * noise / step_ns),
            )
        )
    return out


def what_if_gain(local: np.ndarray, ranks: tuple[int, ...] | list[int], step_ns: float) -> float:
    """The what-if of any set of ranks: the share of the step saved if every one of them
    behaved like the median rank (trimmed mean over steps, as for the suspects).

    Args:
        local: `local_ns` of the window.
        ranks: the ranks replaced.
        step_ns: the job's median step.

    Returns:
        The gain (0 when none, NaN without a step time).
    """
    if not step_ns > 0:
        return float("nan")
    n = local.shape[0]
    inside = np.zeros(n, dtype=bool)
    inside[[r for r in ranks if 0 <= r < n]] = True
    filled = np.where(np.isfinite(local), local, -np.inf)
    every = _every(n)
    peers = local[::every][~inside[::every]]
    med = nanmedian(peers, axis=0) if peers.shape[0] else np.full(local.shape[1], np.nan)
    top = filled.max(axis=0)
    outside = filled[~inside].max(axis=0) if (~inside).any() else np.full(top.shape, -np.inf)
    ok = np.isfinite(top) & np.isfinite(med)
    gain = np.where(ok, np.maximum(top - np.maximum(outside, med), 0.0), 0.0)
    return trimmed_mean(gain[gain > 0], int(ok.sum())) / step_ns


LINK_MARGIN = 3.0
"""A link is a suspect when its robust z among its peers (or its shift against the
baseline run) exceeds what that many healthy links reach by chance by this margin."""


def link_suspects(fabric: FabricView, step_ns: float) -> tuple[Suspect, ...]:
    """The worst rail (cross-host) and the worst host (intra-host) as suspects: their
    extra transfer over their peers' per step is what the step would save if they moved
    data like their peers (`fabric.LinkFinding.extra_ns_per_step`).

    Args:
        fabric: the link findings of the window.
        step_ns: the job's median step.

    Returns:
        Up to two suspects; a link within chance of its peers has no net gain.
    """
    out = []
    for kind, peers, vs_base in (
        ("rail", fabric.rails, fabric.rails_vs_baseline),
        ("link", fabric.hosts, fabric.hosts_vs_baseline),
    ):
        pair = is_pair(peers)
        found = peers if len(peers) >= 3 or pair else vs_base
        if not found or not step_ns > 0:
            continue
        worst: LinkFinding = max(found, key=lambda f: f.z if np.isfinite(f.z) else -np.inf)
        if not np.isfinite(worst.z):
            continue
        gain = max(float(worst.extra_ns_per_step), 0.0) / step_ns
        # Two links: the slower's paired t statistic over the steps, one-sided.
        beyond = worst.z > (PAIRED_Z if pair else expected_max_z(len(found)) + LINK_MARGIN)
        key = str(worst.code) if kind == "rail" or not worst.hosts else worst.hosts[0]
        out.append(
            Suspect(
                kind=kind,
                key=key,
                ranks=tuple(worst.ranks),
                gain_ns=gain * step_ns,
                gain=gain,
                net_gain=gain if beyond else 0.0,
                sets=float("nan"),
                excess_ns={"exposed_comm": float(worst.extra_ns_per_step)},
            )
        )
    return tuple(out)


def against_baseline(loc: Localisation, base: Localisation | None) -> Localisation:
    """The localisation with each suspect's net gain also beyond the baseline's same entity
    (its gain there, or, for an entity the baseline's best do not include, nothing more).

    An entity that straggled materially in the baseline too keeps its gain beyond chance
    and is marked `Suspect.in_baseline`: a straggler both runs have is no regression, but
    the job still waits for it, and a verdict of ``healthy`` would hide it.

    Args:
        loc: localisation of the run under study.
        base: localisation of the healthy run, or None.

    Returns:
        ``loc`` with netted suspects, highest net gain first.
    """
    if base is None:
        return loc
    out = []
    for s in loc.suspects:
        b = base.of(s.kind, s.key)
        both = b is not None and b.net_gain >= MATERIAL
        net = s.net_gain if b is None or both else min(s.net_gain, s.gain - b.gain)
        out.append(
            Suspect(
                s.kind,
                s.key,
                s.ranks,
                s.gain_ns,
                s.gain,
                float(net),
                s.sets,
                s.excess_ns,
                both,
                s.noise,
            )
        )
    out.sort(key=lambda s: -s.net_gain)
    moving = loc.moving_gain
    if np.isfinite(moving) and np.isfinite(base.moving_gain):
        moving = max(0.0, moving - base.moving_gain)
    return Localisation(
        step_ns=loc.step_ns,
        setter=loc.setter,
        stability=loc.stability,
        suspects=tuple(out),
        moving_gain=float(moving),
        outlier_share=loc.outlier_share,
        imbalance=loc.imbalance,
    )


@dataclass(frozen=True)
class Finding:
    """What localisation concludes, before any mechanism is asked."""

    suspect: Suspect | None
    """The fixed entity that sets the steps, when its net gain is material."""
    moving: bool
    """The straggler moves from step to step (no fixed suspect, a material moving gain)."""
    gain: float
    """Net gain of the finding, share of the step (0: nothing material)."""
    unjudged_moving: float = 0.0
    """Without a baseline: what each step's outlier setter costs (share of the step). A
    straggler that moves between ranks looks the same as heavy-tailed per-rank noise, which
    every large job has; only a healthy run of the same job can tell them apart."""

    @property
    def material(self) -> bool:
        return self.gain >= MATERIAL


def finding(loc: Localisation, base: Localisation | None = None) -> Finding:
    """The material straggler of a (netted) localisation, if any.

    Args:
        loc: `against_baseline` of the run's localisation.
        base: the baseline's localisation (None: a moving straggler is not judged).

    Returns:
        The finding: a fixed suspect, a moving straggler, or nothing material.
    """
    top = loc.top
    if top is not None and top.net_gain >= MATERIAL:
        return Finding(top, False, float(top.net_gain))
    # A moving straggler needs a healthy run to be told from heavy-tailed noise, and
    # enough ranks to see an outlier within a step (with a few ranks, the slowest one
    # changing hands is no structure at all).
    moving, unjudged = 0.0, 0.0
    if np.isfinite(loc.moving_gain):
        if base is None:
            unjudged = float(loc.moving_gain)
        else:
            moving = float(loc.moving_gain)  # already net of the baseline's
    if moving >= MATERIAL and (top is None or moving > top.net_gain):
        return Finding(None, True, float(moving))
    best = max(top.net_gain if top is not None else 0.0, moving)
    return Finding(None, False, float(max(best, 0.0)), unjudged_moving=unjudged)
