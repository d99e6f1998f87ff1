"""The verdict: ranked hypotheses, each with its evidence and next experiment.

Every mechanism is judged on two scale-free quantities:

- **impact**: the share of the step time the mechanism costs, estimated from the
  decomposition (e.g. the slow rank's extra compute over the step, the extra transfer of
  the slow rail's groups per step);
- **strength**: how specifically the data shows the mechanism's signature, from robust
  z-scores against the ranks' own spread (with a threshold that grows with the rank count,
  ``robust.expected_max_z``), effect sizes, and whether the slow rank is stable or moves.

``score = strength × logistic(impact; MIN_IMPACT)``. With a baseline, a finding the
baseline shows just as much is not the regression: impacts are taken net of the
baseline's. A conclusion that rests on arrival order when the skews are not larger than
the clock error says so in its caveats. ``healthy`` scores ``1 − max(other scores)``,
less where the step regressed against the baseline (`regressed`); there, a mechanism
far too small to account for the regression fades too (`MIN_COVER`).
Hypotheses are ranked by score, except that the mechanisms within `SCORE_TIE` of the best
lead in order of impact (`rank`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rankscope.collector.schema import MECHANISMS
from rankscope.diagnosis.candidate import Candidate, hosts_of, ms, pct
from rankscope.diagnosis.clockskew import ClockSkew, clock_skew
from rankscope.diagnosis.controlled import Busy, perturbation
from rankscope.diagnosis.coverage import Unreported, unreported
from rankscope.diagnosis.evidence import Evidence
from rankscope.diagnosis.judges import candidates
from rankscope.diagnosis.localise import (
    MATERIAL,
    Finding,
    Localisation,
    against_baseline,
    finding,
)
from rankscope.diagnosis.nextstep import NextExperiment, next_experiment
from rankscope.diagnosis.openworld import MECHANISM, Claim, unexplained
from rankscope.diagnosis.robust import logistic

__all__ = [
    "MECHANISMS",
    "MIN_COVER",
    "MIN_IMPACT",
    "REGRESSION_RATIO",
    "SCORE_TIE",
    "Evidence",
    "Hypothesis",
    "Verdict",
    "covers",
    "judge",
    "rank",
    "regressed",
    "regression_share",
]


MIN_IMPACT = MATERIAL
"""A mechanism costing less than about this share of the step (2 %) is not called a
regression: below it the cost is inside what healthy runs vary by from window to window.
It is the same threshold localisation calls a straggler material by, so a mechanism and
the open-world remainder are held to one standard."""


REGRESSION_RATIO = 1.5
"""A median step this many times the baseline's (per unit of useful work) is a regression
whatever explains it: ``healthy`` scores half as much there, and nothing at twice. Healthy
runs of one job differ by a few per cent; a fault the mechanisms judge only weakly (a
degraded link whose control rows moved a lot between the runs) can triple the step."""


MIN_COVER = 0.25
"""Where the step regressed (`REGRESSION_RATIO`), a mechanism that accounts for less than
about this share of the regression cannot be its cause: its score fades (a burst of
congestion costing 3 % of a step that tripled does not outrank the link that costs 80 %)."""


SCORE_TIE = 0.1
"""Mechanisms scoring within this of the best are ranked by impact. Scores saturate a few
percent of impact above `MIN_IMPACT`, so among well-supported mechanisms the score no
longer says which matters: one that costs 3 % of the step must not outrank one that costs
80 % because its signature is a little cleaner."""


def rank(hyps: list[Hypothesis]) -> tuple[Hypothesis, ...]:
    """Order hypotheses: by score, except that the mechanisms scoring within `SCORE_TIE`
    of the best one (and above ``healthy``) lead, ordered by impact.

    Args:
        hyps: every hypothesis, ``healthy`` included.

    Returns:
        The ranked hypotheses.
    """
    by_score = sorted(hyps, key=lambda h: (-h.score, -h.impact))
    healthy = max((h.score for h in hyps if h.mechanism == "healthy"), default=0.0)
    best = max((h.score for h in hyps if h.mechanism != "healthy"), default=0.0)
    floor = max(best - SCORE_TIE, healthy)

    def leads(h: Hypothesis) -> bool:
        return h.mechanism != "healthy" and h.score >= floor and h.score > healthy

    lead = sorted((h for h in by_score if leads(h)), key=lambda h: (-h.impact, -h.score))
    return (*lead, *(h for h in by_score if not leads(h)))


@dataclass(frozen=True)
class Hypothesis:
    """One ranked explanation."""

    mechanism: str
    score: float
    """0..1, higher is more likely; the verdict is ordered by it (see `rank`)."""
    impact: float
    """Estimated share of the step time the mechanism costs (net of the baseline's)."""
    strength: float
    """0..1, how specifically the data shows the mechanism's signature."""
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    rails: tuple[int, ...]
    groups: tuple[str, ...]
    evidence: tuple[str, ...]
    """Observations with their numbers."""
    caveats: tuple[str, ...]
    next_experiment: NextExperiment
    category: str | None = None
    """Where the implicated ranks' extra time goes (``unexplained_straggler``), if known."""


@dataclass(frozen=True)
class Verdict:
    """Hypotheses ranked by score, near-equal ones by impact (``healthy`` included)."""

    hypotheses: tuple[Hypothesis, ...]
    localisation: Localisation | None = None
    """The localisation the verdict read, net of chance and of the baseline."""
    finding: Finding | None = None
    """The material straggler it found, explained or not."""

    @property
    def top(self) -> Hypothesis:
        """The most likely explanation."""
        return self.hypotheses[0]

    def get(self, mechanism: str) -> Hypothesis:
        """The hypothesis of one mechanism."""
        for h in self.hypotheses:
            if h.mechanism == mechanism:
                return h
        raise KeyError(f"no hypothesis {mechanism!r}; vocabulary: {MECHANISMS}")


def _same(base: Candidate, cur: Candidate) -> bool:
    """Whether the baseline's candidate is the same loss as the run's: a mechanism named
    on ranks is the same only on a rank both name (a healthy run whose machine slowed
    rank 1 says nothing about a throttled rank 0); one named on none is the job's."""
    if base.ranks and cur.ranks:
        return bool(set(base.ranks) & set(cur.ranks))
    return True


def _step_ratio(baseline: Evidence | None, ev: Evidence) -> float:
    """The baseline's step time over the run's (1 where either is unknown)."""
    if baseline is None:
        return 1.0
    ratio = baseline.step_ns / ev.step_ns if ev.step_ns > 0 else float("nan")
    return float(ratio) if np.isfinite(ratio) and ratio > 0 else 1.0


def judge(ev: Evidence, baseline: Evidence | None = None) -> Verdict:
    """Rank the hypotheses for one window.

    Args:
        ev: evidence of the run under study.
        baseline: evidence of the healthy run; impacts are then net of the baseline's.

    Returns:
        The verdict, most likely first, ``healthy`` included.
    """
    cur = candidates(ev)
    base = candidates(baseline) if baseline is not None else {}
    shared: list[str] = []
    if baseline is not None and not ev.numerator.comparable:
        shared.append(
            f"useful work per step is {ev.numerator.useful_ratio:.2f}x the baseline's: not an "
            "equivalent job, so comparisons with it are indicative only"
        )
    if ev.window.world_size > 1 and not np.nansum(ev.window.coll["n"]) > 0:
        shared.append(
            "no collective was recorded (DDP bucket timing off, or collectives the collector "
            "does not see): arrival wait, transfer and the links were not judged, and "
            "collective time counts as other"
        )
    gone = ev.unreported if ev.unreported is not None else unreported(ev.window)
    skew = clock_skew(ev.window)
    doubts = ([_silence(gone)] if gone.ranks.shape[0] else []) + (
        [_skewed(skew)] if skew.ranks.shape[0] else []
    )
    shared += doubts
    # Ranks the window cannot vouch for: unreported, or on a clock of their own.
    doubted = np.concatenate([gone.ranks, np.setdiff1d(skew.ranks, gone.ranks)])
    slower, share = regressed(ev), regression_share(ev)
    busy = Busy.of(ev.window, ev.decomp)
    hyps = []
    for mech, c in cur.items():
        impact = c.impact
        caveats = list(c.caveats) + shared
        b = base.get(mech)
        if b is not None and mech != "numerator_change" and b.impact > 0 and _same(b, c):
            # Impacts are shares of each run's own step: net in time, not in shares (a
            # baseline losing 16 % of a 26 ms step lost 4 ms, not 16 % of a 75 ms one).
            held = b.impact * _step_ratio(baseline, ev)
            impact = max(0.0, c.impact - held)
            if held >= 0.5 * c.impact and c.impact > 0:
                caveats.append(f"the baseline shows {pct(held)} of the same")
        score = (
            c.strength
            * logistic(impact, MIN_IMPACT, MIN_IMPACT / 5)
            * covers(impact, slower, share)
        )
        hyps.append(
            Hypothesis(
                mechanism=mech,
                score=float(score),
                impact=float(impact),
                strength=float(c.strength),
                ranks=c.ranks,
                hosts=c.hosts,
                rails=c.rails,
                groups=c.groups,
                evidence=c.evidence,
                caveats=tuple(caveats),
                next_experiment=replace(
                    next_experiment(
                        mech, ranks=c.ranks, hosts=c.hosts, rails=c.rails, groups=c.groups
                    ),
                    perturbation=perturbation(mech, ev.window, busy, c.ranks, c.hosts, c.rails),
                ),
            )
        )
    loc = against_baseline(ev.loc, baseline.loc if baseline is not None else None)
    found = finding(loc, baseline.loc if baseline is not None else None)
    claims = [Claim(h.mechanism, h.score, h.impact, h.ranks) for h in hyps]
    open_world = unexplained(loc, found, claims)
    category = found.suspect.category if found.suspect is not None else None
    if doubted.shape[0]:
        # Ranks the window cannot vouch for are the first thing unexplained: named here,
        # with what the others show kept as evidence (their peers' collectives never
        # complete, or their arrivals are on another clock, so what localisation finds
        # near them may be that artefact).
        ranks = tuple(int(r) for r in doubted[:64])
        if open_world.strength >= 0.5:  # a material straggler among the others, after
            ranks += tuple(r for r in open_world.ranks if r not in ranks)
        open_world = replace(
            open_world,
            strength=1.0,
            ranks=ranks,
            evidence=(*doubts, *(f"among the others: {e}" for e in open_world.evidence)),
        )
        category = None
    open_score = (
        1.0 if doubted.shape[0] else open_world.strength * covers(open_world.impact, slower, share)
    )
    left = _regression_left(ev, hyps, slower, share, loc if not found.material else None)
    if not doubted.shape[0] and left.strength > open_score:
        # The step regressed and what explains it is neither a catalogued mechanism nor a
        # straggler: unexplained on the job, where the time grew, never the best of scores
        # near zero nor healthy.
        open_world = replace(
            left,
            ranks=open_world.ranks if open_world.strength >= 0.5 else (),
            evidence=(*left.evidence, *open_world.evidence),
        )
        open_score = left.strength
        category = ev.delta.first_appears if ev.delta is not None else None
    hyps.append(
        Hypothesis(
            mechanism=MECHANISM,
            # Its strength already says whether the unexplained part is material.
            score=float(open_score),
            impact=float(open_world.impact),
            strength=float(open_world.strength),
            ranks=open_world.ranks,
            hosts=hosts_of(ev, open_world.ranks),
            rails=(),
            groups=(),
            evidence=open_world.evidence,
            caveats=tuple(shared),
            next_experiment=replace(
                next_experiment(
                    MECHANISM,
                    ranks=open_world.ranks,
                    hosts=hosts_of(ev, open_world.ranks),
                    category=category,
                ),
                perturbation=perturbation(
                    MECHANISM,
                    ev.window,
                    busy,
                    open_world.ranks,
                    hosts_of(ev, open_world.ranks),
                ),
            ),
            category=category,
        )
    )
    best = max(hyps, key=lambda h: h.score, default=None)
    unjudged = tuple(u for c in cur.values() for u in c.unjudged)
    # A material straggler is not healthy, whichever mechanism explains it.
    straggler = logistic(found.gain, MATERIAL, MATERIAL / 5)
    if found.unjudged_moving >= MATERIAL:
        unjudged = (
            *unjudged,
            f"each step's slowest rank is an outlier among its peers in "
            f"{pct(loc.outlier_share)} of steps, costing {pct(found.unjudged_moving)} of the "
            "step: heavy-tailed per-rank noise or a straggler that moves between ranks; "
            "without a baseline run it is not judged",
        )
    if doubted.shape[0]:
        straggler = 1.0  # what no rank reported cannot be called healthy
    hyps.append(_healthy(ev, best, slower, (*shared, *unjudged), loc, straggler))
    return Verdict(hypotheses=rank(hyps), localisation=loc, finding=found)


REGRESSION_COVER = 0.5
"""A mechanism accounts for a regression against the baseline when its impact is at least
about this share of it (impacts are estimates; the rest may be knock-on time)."""


def _regression_left(
    ev: Evidence,
    hyps: list[Hypothesis],
    slower: float,
    share: float,
    loc: Localisation | None = None,
) -> Candidate:
    """How surely the step's regression against the baseline is left unexplained by the
    catalogued mechanisms (`Candidate.strength`; zero without a regression).

    As for a straggler (`openworld`): the best accounting mechanism, with score ``s``
    covering ``f`` of the regression (its impact over the regression's share of the step),
    is right with odds ``s``, and then what it does not cover is still unexplained if it
    is a large part (`REGRESSION_COVER`); or it is wrong and the whole regression is.
    Times `regressed`: how surely the step regressed at all. ``loc``: the localisation,
    where it found no material straggler (its best what-if is then evidence).
    """
    if not slower > 0.0 or not share > 0.0:
        return Candidate(0.0, 0.0)
    by, f = None, 0.0
    for h in hyps:
        cover = min(1.0, max(h.impact, 0.0) / share)
        if by is None or h.score * cover > by.score * f:
            by, f = h, cover
    s = min(max(by.score, 0.0), 1.0) if by is not None else 0.0
    rest = logistic(1.0 - f, REGRESSION_COVER, REGRESSION_COVER / 5) if f < 1.0 else 0.0
    strength = slower * (s * rest + (1.0 - s))
    cmp = ev.comparison
    evidence = [
        f"the median step is {cmp.p50_ratio:.2f}x the baseline's"
        + (
            f" ({_per_work_ratio(ev):.2f}x per unit of useful work)"
            if abs(_per_work_ratio(ev) - cmp.p50_ratio) > 0.01
            else ""
        )
        + f": {pct(share)} of the step is new"
    ]
    top = loc.top if loc is not None else None
    if top is not None:
        evidence.append(
            f"no rank, host or stage sets it: the best what-if, {top.label}, saves "
            f"{pct(top.gain)} of the step"
        )
    delta = ev.delta
    if delta is not None:
        grown = sorted((r for r in delta.rows if r.delta_ns > 0), key=lambda r: -r.delta_ns)
        if grown:
            evidence.append(
                "against the baseline the mean rank's step grew in "
                + ", ".join(f"{r.category} +{ms(r.delta_ns)}" for r in grown[:3])
            )
    if by is not None and by.score * f > 0.05:
        evidence.append(
            f"the best accounting mechanism, {by.mechanism} (score {by.score:.2f}), would "
            f"cost {pct(by.impact)} of the step: {pct(f)} of the regression"
        )
    else:
        evidence.append("no catalogued mechanism accounts for it")
    return Candidate(
        impact=float(share * (1.0 - s * f)),
        strength=float(strength),
        evidence=tuple(evidence),
    )


def _silence(gone: Unreported) -> str:
    """What the verdict says of ranks that said hello and stopped reporting."""

    def names(sel: np.ndarray) -> str:
        ranks = gone.ranks[sel]
        more = f" and {ranks.shape[0] - 16} more" if ranks.shape[0] > 16 else ""
        return ", ".join(str(int(r)) for r in ranks[:16]) + more

    parts = []
    if gone.never.any():
        parts.append(
            f"rank(s) {names(gone.never)} completed no step in this window (a dead or hung "
            "process, a collector that stopped sending, refused messages)"
        )
    if gone.no_calls.any():
        parts.append(
            f"rank(s) {names(gone.no_calls)} recorded no collective call while members of "
            "their groups did (their collectives are not timed: left out of the analyses)"
        )
    late = ~gone.never & ~gone.no_calls
    if late.any():
        parts.append(
            f"rank(s) {names(late)} stopped reporting (last step "
            f"{int(gone.last_step[late].max())}, {float(np.nanmin(gone.behind_s[late])):.1f} s "
            "or more before the others' latest, median)"
        )
    return (
        f"{' and '.join(parts)}: {gone.ranks.shape[0]} of the {gone.hello} that said hello, "
        f"while {gone.reporting} went on; they are not judged, and instances of their groups "
        "never complete, so their peers' time in them is exposed communication of unknown "
        "wait and transfer"
    )


def _skewed(skew: ClockSkew) -> str:
    """What the verdict says of ranks whose clock disagrees with their peers'."""
    ranks = ", ".join(str(int(r)) for r in skew.ranks[:16])
    more = f" and {skew.ranks.shape[0] - 16} more" if skew.ranks.shape[0] > 16 else ""
    lo, hi = float(skew.offset_ns.min()) / 1e6, float(skew.offset_ns.max()) / 1e6
    span = f"{lo:+.1f} ms" if abs(hi - lo) < 0.05 else f"{lo:+.1f} to {hi:+.1f} ms"
    return (
        f"rank(s) {ranks}{more} leave the collectives they share with other hosts {span} "
        f"from their peers (median over {skew.instances} instances, whose other members "
        f"leave within {skew.spread_ns / 1e3:.0f} µs of each other): their clock is off by "
        "about that, not aligned to the others', so arrival order, lateness and wait "
        "between them and the other hosts are not what happened"
    )


def _per_work_ratio(ev: Evidence) -> float:
    """Median step over the baseline's, per unit of useful work (NaN without a baseline)."""
    cmp, num = ev.comparison, ev.numerator
    if cmp.baseline is None or not np.isfinite(cmp.p50_ratio):
        return float("nan")
    ratio = cmp.p50_ratio
    if np.isfinite(num.useful_ratio) and num.useful_ratio > 0:
        ratio /= num.useful_ratio  # more work per step is not a slower step
    return float(ratio)


def regression_share(ev: Evidence) -> float:
    """Share of the current step that the regression against the baseline accounts for
    (``1 − 1/ratio`` per unit of work; 0 without a baseline or a regression)."""
    ratio = _per_work_ratio(ev)
    return float(1.0 - 1.0 / ratio) if np.isfinite(ratio) and ratio > 1.0 else 0.0


def covers(impact: float, slower: float, share: float) -> float:
    """Factor on a mechanism's score: 1, fading towards ``1 − slower`` as its ``impact``
    falls below `MIN_COVER` of the regression's ``share`` of the step.

    Args:
        impact: the mechanism's share of the step.
        slower: `regressed`.
        share: `regression_share`.
    """
    if slower == 0.0 or not share > 0.0:
        return 1.0
    return 1.0 - slower * (1.0 - logistic(impact / share, MIN_COVER, MIN_COVER / 5))


def regressed(ev: Evidence) -> float:
    """0..1: how surely the run is slower per unit of useful work than the baseline's
    (0 without a baseline)."""
    return logistic(_per_work_ratio(ev), REGRESSION_RATIO, REGRESSION_RATIO / 15)


def _healthy(
    ev: Evidence,
    best: Hypothesis | None,
    slower: float,
    unjudged: tuple[str, ...] = (),
    loc: Localisation | None = None,
    straggler: float = 0.0,
) -> Hypothesis:
    """``healthy`` scores ``1 − best score``, times the odds that the step did not regress
    against the baseline (a run twice as slow per unit of work is not healthy even when no
    mechanism is well supported; ``slower``: `regressed`), times the odds that no rank,
    host or stage carries a material what-if gain that no mechanism explains
    (``straggler``): a straggler outside the catalogue is never healthy."""
    cmp = ev.comparison
    evidence = [f"median step {ms(cmp.current.p50)}, p99 {ms(cmp.current.p99)}"]
    top = loc.top if loc is not None else None
    if top is not None:
        evidence.append(
            f"the best what-if, {top.label}, would save {pct(top.gain)} of the step "
            f"({pct(max(top.net_gain, 0.0))} beyond chance, the steps' noise and the baseline; "
            f"material from {pct(MATERIAL)})"
        )
    if cmp.baseline is not None:
        evidence.append(f"p50 {cmp.p50_ratio:.2f}x and p99 {cmp.p99_ratio:.2f}x the baseline's")
    if best is not None and best.impact >= MIN_IMPACT:
        but = "but scores only" if best.score < 0.5 else "and scores"
        evidence.append(
            f"the best supported mechanism, {best.mechanism}, would cost "
            f"{pct(best.impact)} of the step time {but} {best.score:.2f}"
        )
    else:
        evidence.append(f"no mechanism explains more than {pct(MIN_IMPACT)} of the step time")
    caveats = unjudged
    if slower > 0.5:
        caveats = (
            f"the median step is {cmp.p50_ratio:.2f}x the baseline's: a regression, even "
            "though no mechanism explains it with confidence",
            *unjudged,
        )
    score = (1.0 - (best.score if best is not None else 0.0)) * (1.0 - slower) * (1.0 - straggler)
    return Hypothesis(
        mechanism="healthy",
        score=float(max(score, 0.0)),
        impact=0.0,
        strength=1.0,
        ranks=(),
        hosts=(),
        rails=(),
        groups=(),
        evidence=tuple(evidence),
        caveats=caveats,
        next_experiment=next_experiment("healthy"),
    )
