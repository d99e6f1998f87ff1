"""Judges of the parallel layout: a heavier pipeline stage, and experts that get more tokens.

- **pipeline_imbalance**: one pipeline stage (the ``pp`` mesh coordinate) does more work
  per step than the others (an uneven layer split, the embedding or the loss head on one
  stage); the other stages idle in pipeline bubbles (``pp_wait``) waiting for it. Its
  signature is a band along ``pp``: the stage's *median* rank works longer, so one slow
  device inside a stage (which moves the stage's maximum, not its median) is not it.
- **expert_imbalance**: mixture-of-experts routing sends more tokens to the experts of some
  ranks; they compute longer and the others wait at the all-to-all. Its signature is local
  time following ``expert_tokens`` (tokens routed to the rank's local experts) within each
  step, with the token spread to explain the lead.
"""

from __future__ import annotations

import numpy as np

from rankscope.collector.schema import OP_INDEX
from rankscope.diagnosis.candidate import NONE, Candidate, hosts_of, ms, pct
from rankscope.diagnosis.evidence import Evidence
from rankscope.diagnosis.robust import logistic, nanmedian, spearman

MIN_STAGE_RATIO = 1.1
"""A stage whose median rank works this many times the median stage's is heavier than its
peers by more than the run-to-run wobble of a balanced pipeline."""
MIN_EXPERT_RATIO = 1.2
"""The busiest experts' tokens over the median rank's, below which routing is balanced."""


def judge_pipeline_imbalance(ev: Evidence) -> Candidate:
    pp = ev.window.ranks.mesh.get("pp")
    if pp is None or not (pp >= 0).all() or np.unique(pp).size < 2:
        return NONE
    local = ev.local
    idle = ev.decomp.category("pipeline_idle")
    stages = np.unique(pp)
    work = np.stack([nanmedian(local[pp == s], axis=0) for s in stages])  # (P, S)
    wait = np.stack([nanmedian(idle[pp == s], axis=0) for s in stages])
    per_stage = nanmedian(work, axis=1)
    if not np.isfinite(per_stage).any():
        return NONE
    heavy = int(np.nanargmax(per_stage))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = float(nanmedian(work[heavy] / nanmedian(work, axis=0)))
    if not np.isfinite(ratio) or ratio <= 1.0:
        return NONE
    others = np.arange(stages.size) != heavy
    idle_heavy = float(nanmedian(wait[heavy]))
    idle_others = float(nanmedian(nanmedian(wait[others], axis=0)))
    bubbles = np.isfinite(idle_others) and idle_others > max(idle_heavy, 0.0)
    key = f"pp={int(stages[heavy])}"
    stage = ev.loc.of("stage", key)
    if stage is not None:
        impact = stage.gain
    else:
        impact = float(nanmedian(work[heavy] - nanmedian(work, axis=0))) / ev.step_ns
    strength = logistic(ratio, MIN_STAGE_RATIO, 0.02) * (1.0 if bubbles else 0.6)
    ranks = tuple(int(r) for r in np.flatnonzero(pp == stages[heavy]))
    evidence = [
        f"pipeline stage {key} works {ratio:.2f}x the median stage's local time per step "
        f"({ms(float(per_stage[heavy]))} vs {ms(float(nanmedian(per_stage)))})",
        f"the other stages idle {ms(idle_others)} a step in pipeline bubbles, stage {key} "
        f"{ms(idle_heavy)}",
    ]
    if stage is not None:
        evidence.append(f"what-if: {stage.what_if()}")
    return Candidate(
        float(max(impact, 0.0)),
        float(strength),
        ranks,
        hosts_of(ev, ranks),
        evidence=tuple(evidence),
    )


def judge_expert_imbalance(ev: Evidence) -> Candidate:
    et = ev.window.work.get("expert_tokens")
    if et is None:
        return NONE
    et = np.where(ev.window.present & (et >= 0), et, np.nan)
    if np.count_nonzero(np.isfinite(et).any(axis=1)) < 2:
        return NONE
    med = nanmedian(et, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = np.max(np.where(np.isfinite(et), et, -np.inf), axis=0)
        ratio = float(nanmedian(np.where(med > 0, top / med, np.nan)))
    if not np.isfinite(ratio) or ratio < 1.0:
        return NONE
    local = ev.local
    lc = local - nanmedian(local, axis=0)
    ec = et - med
    rho = spearman(lc.ravel(), ec.ravel())
    ok = np.isfinite(lc) & np.isfinite(ec)
    if ok.sum() < 4 or not np.isfinite(rho):
        return NONE
    # Local time each extra token costs (least squares through the step medians), and the
    # lead over the median rank that the token spread predicts for the busiest rank.
    var = float((ec[ok] ** 2).sum())
    beta = float((lc[ok] * ec[ok]).sum() / var) if var > 0 else 0.0
    lead = float(nanmedian(beta * (top - med))) if beta > 0 else 0.0
    actual = float(nanmedian(np.max(np.where(np.isfinite(lc), lc, -np.inf), axis=0)))
    impact = max(0.0, min(lead, actual)) / ev.step_ns
    strength = logistic(ratio, MIN_EXPERT_RATIO, 0.04) * logistic(rho, 0.4, 0.08)
    heaviest = np.argmax(np.where(np.isfinite(et), et, -np.inf), axis=0)
    counts = np.bincount(heaviest, minlength=ev.window.world_size)
    ranks = tuple(int(r) for r in np.argsort(-counts)[:8] if counts[r] > 0)
    band = _expert_band(ev, et)
    if band is not None:
        ranks = band[1]
    evidence = [
        f"the busiest rank's experts get {ratio:.2f}x the median rank's tokens (median step)",
        f"local time follows expert tokens within steps (ρ {rho:.2f}); the token spread "
        f"predicts {pct(lead / ev.step_ns)} of the step for the busiest rank",
    ]
    if band is not None:
        evidence.append(
            f"a band along ep: the ranks at ep={band[0]} get {band[2]:.2f}x the median "
            "rank's expert tokens"
        )
    inst = ev.window.instances
    a2a = (inst.op == OP_INDEX["all_to_all"]) & (inst.n_arrived >= inst.n_members)
    if a2a.any() and ranks:
        share = float(np.isin(inst.last_rank[a2a], ranks).mean())
        evidence.append(
            f"ranks {', '.join(map(str, ranks[:4]))} arrive last at {pct(share)} of the all-to-alls"
        )
    return Candidate(
        float(impact), float(strength), ranks, hosts_of(ev, ranks), evidence=tuple(evidence)
    )


def _expert_band(ev: Evidence, et: np.ndarray) -> tuple[int, tuple[int, ...], float] | None:
    """The expert-parallel coordinate whose ranks get the most tokens, when one does by
    more than `MIN_EXPERT_RATIO`: ``(ep, its ranks, their tokens over the median)``."""
    ep = ev.window.ranks.mesh.get("ep")
    if ep is None or not (ep >= 0).all() or np.unique(ep).size < 2:
        return None
    per_rank = nanmedian(et, axis=1)
    ref = float(nanmedian(per_rank))
    if not ref > 0:
        return None
    values = np.unique(ep)
    level = np.array([nanmedian(per_rank[ep == v]) for v in values]) / ref
    if not np.isfinite(level).any():
        return None
    i = int(np.nanargmax(level))
    if level[i] < MIN_EXPERT_RATIO:
        return None
    return int(values[i]), tuple(int(r) for r in np.flatnonzero(ep == values[i])), float(level[i])
