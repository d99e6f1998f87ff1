"""What a judge returns about its mechanism, and the number formats evidence uses."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.evidence import Evidence


@dataclass(frozen=True)
class Candidate:
    """One mechanism's judgement before scoring."""

    impact: float
    strength: float
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    rails: tuple[int, ...] = ()
    groups: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()
    caveats: tuple[str, ...] = ()
    unjudged: tuple[str, ...] = ()
    """What the judge could not test on this window, and why (a healthy verdict says so
    rather than implying the mechanism was ruled out)."""


NONE = Candidate(0.0, 0.0)
"""A mechanism the window shows nothing of."""


def pct(x: float) -> str:
    return f"{100 * x:.1f}%" if np.isfinite(x) else "n/a"


def ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms" if np.isfinite(ns) else "n/a"


def hosts_of(ev: Evidence, ranks: Iterable[int]) -> tuple[str, ...]:
    """Sorted host names of some ranks."""
    names = ev.window.ranks.hosts
    codes = sorted({int(ev.window.ranks.host[r]) for r in ranks})
    return tuple(names[c] if 0 <= c < len(names) else f"host{c}" for c in codes)
