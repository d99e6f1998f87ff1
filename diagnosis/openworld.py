"""The open world: a material straggler that no catalogued mechanism explains.

The catalogue is never the whole world. Localisation (`localise`) finds who sets the steps
and what fixing them would gain without asking why; the judges (`judges`) then try to
explain it. When the gain is material and the mechanisms that fit it — those naming the
same ranks, or, naming none, whose loss lands in the category the straggler's time goes
to — account for only part of it, the remainder is ``unexplained_straggler``: named by
rank (host, stage), the category, whether it stays or moves, and the smallest experiment
that makes the category visible. Never ``healthy``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.candidate import Candidate, ms, pct
from rankscope.diagnosis.judges import JUDGES
from rankscope.diagnosis.localise import (
    LOCAL_CATEGORIES,
    LOCAL_KINDS,
    MATERIAL,
    Finding,
    Localisation,
)
from rankscope.diagnosis.robust import logistic

MECHANISM = "unexplained_straggler"


@dataclass(frozen=True)
class Claim:
    """What a scored catalogued hypothesis says, as the open-world stage reads it."""

    mechanism: str
    score: float
    impact: float
    ranks: tuple[int, ...]


def fits(claim: Claim, found: Finding) -> bool:
    """Whether a mechanism's claim is about the straggler localisation found.

    A claim naming ranks fits a fixed suspect naming ranks when they share one; when
    either names none (a mechanism judged by group, a link known by its hosts), the claim
    fits when its mechanism's loss lands in the suspect's category; and when the straggler
    moves, when the mechanism is one that moves (`judges.Judge.moving`).
    """
    judge = JUDGES.get(claim.mechanism)
    if judge is None:
        return False
    s = found.suspect
    if s is not None:
        if claim.ranks and s.ranks:
            return bool(set(claim.ranks) & set(s.ranks))
        return s.category in judge.categories
    return judge.moving


def covered(claim: Claim, found: Finding) -> float:
    """The share of the finding's gain a claim would account for were it right: its impact
    over the gain, and at most the share of the suspect's extra time that lies in the
    categories where the mechanism's loss lands.

    The second bound keeps a mechanism from covering time it does not measure: a rank's
    compute phases read at a low CPU share (a thread kept off its core, or sharing it with
    its own communication thread) say nothing of the 25 ms it sleeps between them, however
    large the what-if of giving the phases' time back comes out. The extra time counted is
    what the gain is made of: for a rank, host or stage its local time, not the exposed
    communication it shares with its peers (a two-rank job's late rank has a little more
    of it, which no cause of its lateness needs to explain).
    """
    if found.gain <= 0:
        return 1.0
    f = min(1.0, max(claim.impact, 0.0) / found.gain)
    judge, s = JUDGES.get(claim.mechanism), found.suspect
    if judge is None or s is None:
        return f
    made_of = LOCAL_CATEGORIES if s.kind in LOCAL_KINDS else tuple(s.excess_ns)
    extra = {c: v for c, v in s.excess_ns.items() if c in made_of and np.isfinite(v) and v > 0}
    total = sum(extra.values())
    if total <= 0:
        return f
    return min(f, sum(v for c, v in extra.items() if c in judge.categories) / total)


def explained_share(claims: Iterable[Claim], found: Finding) -> tuple[float, Claim | None]:
    """The largest share of the finding's gain that one fitting claim accounts for
    (its score × what it covers, `covered`), and that claim."""
    best, which = 0.0, None
    if found.gain <= 0:
        return 1.0, None
    for c in claims:
        if fits(c, found):
            share = c.score * covered(c, found)
            if share > best:
                best, which = share, c
    return float(best), which


def unexplained(loc: Localisation, found: Finding, claims: list[Claim]) -> Candidate:
    """The ``unexplained_straggler`` candidate: the part of the finding no fitting claim
    explains.

    Args:
        loc: the (netted) localisation.
        found: its finding (`localise.finding`).
        claims: the scored catalogued hypotheses.

    Returns:
        The candidate (zero strength when nothing material is left to explain).
    """
    if not found.material:
        return Candidate(0.0, 0.0)
    share, by = explained_share(claims, found)
    residual = max(0.0, 1.0 - share)
    strength = _remainder_strength(found.gain, by, covered(by, found) if by else 0.0)
    evidence = []
    s = found.suspect
    if s is not None:
        cat = s.category or "no category"
        parts = sorted(
            ((c, v) for c, v in s.excess_ns.items() if v > 0.02 * s.gain_ns or v > 1e5),
            key=lambda cv: -cv[1],
        )[:3]
        where = ", ".join(f"{c} +{ms(v)}" for c, v in parts) or "nothing stands out"
        evidence += [
            s.what_if(),
            f"{s.label} set {pct(s.sets)} of the steps" if np.isfinite(s.sets) else s.label,
            f"its extra time over the median rank goes to {cat}: {where} a step",
        ]
        stays = "stays the same rank" if loc.stays else "moves between ranks"
        evidence.append(f"the rank that sets the step {stays} ({pct(loc.stability)} one rank)")
        if s.in_baseline:
            evidence.append(
                f"{s.label} set the steps of the baseline run too: no regression against "
                "it, but a loss in both"
            )
        ranks = s.ranks
    else:
        evidence += [
            f"each step's slowest rank is an outlier among that step's ranks in "
            f"{pct(loc.outlier_share)} of steps; re-timed with it behaving like the median "
            f"rank, the step is {pct(found.gain)} shorter",
            f"the slowest rank moves between steps ({pct(loc.stability)} one rank)",
        ]
        ranks = tuple(int(r) for r in _frequent(loc))
    if by is not None:
        evidence.append(
            f"the best fitting mechanism, {by.mechanism} (score {by.score:.2f}), accounts for "
            f"{pct(share)} of it"
        )
    else:
        evidence.append("no catalogued mechanism fits it")
    return Candidate(
        impact=float(found.gain * residual),
        strength=float(strength),
        ranks=tuple(ranks),
        evidence=tuple(evidence),
    )


def _remainder_strength(gain: float, by: Claim | None, f: float) -> float:
    """How surely a material part of the straggler's ``gain`` is left unexplained, given
    the best fitting claim ``by`` (score ``s``, covering ``f`` of the gain, `covered`).

    Either the claim is right (odds ``s``): what it does not cover, ``gain × (1 − f)``, is
    still unexplained, and is a finding if material on its own; or it is wrong (``1 − s``):
    the whole gain is. A mechanism at 0.6 covering all of the gain leaves a 0.4 chance
    however large the gain; a sure one covering a quarter of it leaves the other three
    quarters as sure as the straggler itself (a rank both kept off its cores and asleep
    between its phases: the CPU it lost is a tenth of the step, the sleep a third).
    """

    def material(x: float) -> float:
        return logistic(x, MATERIAL, MATERIAL / 4) if x > 0 else 0.0

    if by is None:
        return material(gain)
    s = min(max(by.score, 0.0), 1.0)
    return s * material(gain * (1.0 - f)) + (1.0 - s) * material(gain)


def _frequent(loc: Localisation, k: int = 8) -> list[int]:
    setter = loc.setter[loc.setter >= 0]
    if setter.size == 0:
        return []
    counts = np.bincount(setter)
    return [int(r) for r in np.argsort(-counts, kind="stable")[:k] if counts[r] > 0]
