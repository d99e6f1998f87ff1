"""Judges of the parallel layout: a heavier pipeline stage, and experts that get more tokens.

- **pipeline_imbalance**: one pipeline stage (the ``pp`` mesh coordinate) does more work
  per micro-batch than the others (an uneven layer split, the embedding or the loss head on
  one stage); the other stages idle in pipeline bubbles (``pp_wait``) waiting for it. Its
  signature is a band along ``pp``: the stage's *median* rank works longer than the other
  stages' in nearly every step, so one slow device inside a stage (which moves the stage's
  maximum, not its median) is not it. Work is the compute phases' CPU time on CPU ranks
  (`stage_work`), the ranks' own wall time on GPUs. Bubbles alone are not it: every stage
  of a balanced pipeline idles in them (the first stage at the end of a step, the last at
  its start, as much each); a heavier stage only moves them onto the others. Against a
  baseline with the same layout, a stage that was as heavy there is a loss in both runs,
  not the regression.
- **expert_imbalance**: mixture-of-experts routing sends more tokens to the experts of some
  ranks; they compute longer and the others wait at the all-to-all. Its signature is local
  time following ``expert_tokens`` (tokens routed to the rank's local experts) within each
  step, with the token spread to explain the lead.
"""

from __future__ import annotations

import numpy as np

from rankscope.collector.schema import OP_INDEX, pp_ids
from rankscope.diagnosis.candidate import NONE, Candidate, hosts_of, ms, pct
from rankscope.diagnosis.decomposition import COMPUTE_PHASES
from rankscope.diagnosis.evidence import Evidence
from rankscope.diagnosis.robust import logistic, nanmedian, spearman
from rankscope.diagnosis.window import Window

MIN_STAGE_RATIO = 1.1
"""A stage whose median rank works this many times the other stages' median rank is
heavier than its peers by more than a balanced split's wobble. One layer in seven more
(7 against 6, 1.17x) is above it; the loss head of ``examples/titan_like.py --vocab 128``
on the last of two two-block stages (1.0-1.1x in CPU time) sits at it, and the example's
default split (about 1.0x) below it."""
MIN_LEAD_SHARE = 0.7
"""Share of the steps in which the heavy stage must out-work every other stage. In a
balanced pipeline the stage that works longest changes from step to step (with two
stages, half the steps by chance); a heavier split leads in nearly all of them."""
MIN_STAGE_Z = 3.0
"""How many times the measure's own wobble (`_lead_over_wobble`: from step to step, and
between ranks that do the same work) the heavy stage's lead must be. On a shared CPU host
the training thread's CPU time itself wobbles (a vCPU the hypervisor takes away, caches
shared with other processes): 4-11 % between the two ranks of one balanced stage was
seen, and one balanced stage 0.93-1.43x the other from step to step. A layer split adds
the same work to every rank of the stage in every step."""
MIN_EXPERT_RATIO = 1.2
"""The busiest experts' tokens over the median rank's, below which routing is balanced."""


def stage_work(window: Window, local: np.ndarray | None) -> tuple[np.ndarray, str] | None:
    """Per rank and step, the work a pipeline rank does, and what it is measured in.

    On ranks without a GPU the model runs on the training thread, so the thread's CPU time
    in the compute phases *is* the work: other processes that take the cores lengthen a
    phase's wall time, not its CPU time (4 ranks on 2 busy cores ran their phases at 3-8x
    their CPU time, and which stage looked longest in wall time changed from step to
    step). On GPUs, or without CPU times, the work is the rank's own wall time: ``local``
    (`Evidence.local`), or the compute phases' wall time without it.

    Args:
        window: the window.
        local: per rank and step, the rank's own wall time, or None.

    Returns:
        ``(work, unit)``: float64 (R, S) ns, NaN unknown, and a phrase naming the measure;
        None when neither is known.
    """
    present = window.present
    if (window.ranks.gpu_index < 0).all():
        parts = [window.phase_cpu_ns[p] for p in COMPUTE_PHASES if p in window.phase_cpu_ns]
        if parts:
            cpu = np.stack(parts)
            known = np.isfinite(cpu).any(axis=0) & present
            total = np.where(known, np.nansum(np.where(cpu >= 0, cpu, np.nan), axis=0), np.nan)
            if known.sum() >= 0.5 * present.sum() and nanmedian(total) > 0:
                return total, "CPU time of its compute phases"
    if local is not None:
        return np.where(present, local, np.nan), "local time"
    parts = [window.phase_ns[p] for p in COMPUTE_PHASES if p in window.phase_ns]
    if not parts:
        return None
    return np.where(present, np.nansum(np.stack(parts), axis=0), np.nan), "compute phase time"


def _stage_ratio(
    work: np.ndarray, pp: np.ndarray, stages: np.ndarray, heavy: int
) -> tuple[float, float, float]:
    """The heavy stage's work over the other stages' (median over steps of the step's
    ratio of stage medians), the share of steps in which it out-works every other, and
    how much that step's ratio swings from step to step, as a factor: 1.4826 MAD of the
    log ratio (NaN under 3 steps). Contention stretches work by factors, so a ratio of
    3.5 wobbles by more ns than one of 1.2 under the same load, not by a larger factor."""
    per = np.stack([nanmedian(work[pp == s], axis=0) for s in stages])  # (P, S)
    others = per[np.arange(stages.size) != heavy]
    with np.errstate(invalid="ignore", divide="ignore"):
        each = per[heavy] / nanmedian(others, axis=0)
    each = each[np.isfinite(each) & (each > 0)]
    ratio = float(np.median(each)) if each.size else float("nan")
    log_each = np.log(each)
    swing = (
        1.4826 * float(np.median(np.abs(log_each - np.median(log_each))))
        if each.size >= 3
        else float("nan")
    )
    top = np.max(np.where(np.isfinite(others), others, -np.inf), axis=0)
    ok = np.isfinite(per[heavy]) & np.isfinite(top)
    lead = float((per[heavy][ok] > top[ok]).mean()) if ok.any() else float("nan")
    return ratio, lead, swing


def _lead_over_wobble(
    work: np.ndarray, pp: np.ndarray, stages: np.ndarray, ratio: float, swing: float
) -> float:
    """The heavy stage's lead (``log ratio``, about ``ratio - 1`` for the small leads the
    thresholds are set at) in units of the measure's own wobble, as factors too: the
    larger of the step-to-step swing of the log stage ratio (a split adds the same work
    every step; contention comes and goes) and the standard error of a difference of two
    log stage medians from the spread of each rank's median work around its stage's (dp
    peers do the same work; robust 1.4826 MAD, pooled over the stages). NaN where neither
    is known."""
    per_rank = nanmedian(work, axis=1)
    rel, sizes = [], []
    for s in stages:
        mine = per_rank[pp == s]
        mine = mine[np.isfinite(mine) & (mine > 0)]
        sizes.append(mine.size)
        mid = float(np.median(mine)) if mine.size else float("nan")
        if mine.size >= 2 and mid > 0:
            rel.append(np.log(mine / mid))
    se = float("nan")
    if rel:
        sigma = 1.4826 * float(np.median(np.abs(np.concatenate(rel))))
        se = sigma * float(np.sqrt(2.0 / max(1, int(np.median(sizes)))))
    wobble = float(np.nanmax([se, swing])) if np.isfinite([se, swing]).any() else float("nan")
    if not np.isfinite(wobble):
        return float("nan")
    return float(np.log(ratio) / wobble) if wobble > 0 else float("inf")


def _pipeline_shape(window: Window) -> tuple[int, int] | None:
    """``(stages, micro-batches)`` from the send/recv rows' pipeline ids (virtual stages
    of an interleaved schedule included), or None where the rows carry none."""
    rows = window.rows
    if rows is None or not len(rows):
        return None
    stage, micro = pp_ids(np.asarray(rows.flags, dtype=np.int32))
    if not (stage >= 0).any() or not (micro >= 0).any():
        return None
    return int(stage.max()) + 1, int(micro.max()) + 1


def _balanced_bubbles(physical: int, virtual: int, micro: int) -> str:
    """What a balanced split idles: (P-1) of the (v M + P-1) slots of a step, the same on
    every stage (P ranks in the pipeline, v model chunks a rank, M micro-batches)."""
    v = max(1, virtual // max(1, physical))
    share = (physical - 1) / (v * micro + physical - 1)
    kind = "GPipe, 1F1B" if v == 1 else f"interleaved, {v} chunks a rank"
    return f"; a balanced split idles every stage alike ({kind}: {pct(share)} of the step)"


def judge_pipeline_imbalance(ev: Evidence) -> Candidate:
    """The ``pipeline_imbalance`` candidate (module docstring).

    Args:
        ev: the window's evidence (its baseline, when there is one).

    Returns:
        The heaviest stage's ranks, its what-if gain as impact, and a strength that needs
        the stage's work at least `MIN_STAGE_RATIO` the others', in most steps
        (`MIN_LEAD_SHARE`), by `MIN_STAGE_Z` times the measure's wobble; NONE without a
        ``pp`` coordinate on every rank.
    """
    pp = ev.window.ranks.mesh.get("pp")
    if pp is None or not (pp >= 0).all() or np.unique(pp).size < 2:
        return NONE
    measured = stage_work(ev.window, ev.local)
    if measured is None:
        return NONE
    work, unit = measured
    stages = np.unique(pp)
    per_stage = np.array([nanmedian(nanmedian(work[pp == s], axis=0)) for s in stages])
    if not np.isfinite(per_stage).any():
        return NONE
    heavy = int(np.nanargmax(per_stage))
    ratio, lead, swing = _stage_ratio(work, pp, stages, heavy)
    if not np.isfinite(ratio) or ratio <= 1.0:
        return NONE
    z = _lead_over_wobble(work, pp, stages, ratio, swing)
    others = np.arange(stages.size) != heavy
    idle = ev.decomp.category("pipeline_idle")
    wait = np.stack([nanmedian(idle[pp == s], axis=0) for s in stages])
    idle_heavy = float(nanmedian(wait[heavy]))
    idle_others = float(nanmedian(nanmedian(wait[others], axis=0)))
    # A balanced split idles every stage alike (GPipe, 1F1B: (P-1) micro-batch slots each);
    # only a heavier stage moves the bubbles onto the others.
    bubbles = np.isfinite(idle_others) and idle_others > max(idle_heavy, 0.0)
    key = f"pp={int(stages[heavy])}"
    ref = float(nanmedian(per_stage[others]))
    strength = (
        logistic(ratio, MIN_STAGE_RATIO, 0.02)
        * logistic(lead, MIN_LEAD_SHARE, 0.06)
        * (logistic(z, MIN_STAGE_Z, 0.5) if np.isfinite(z) else 1.0)
        * (1.0 if bubbles else 0.6)
    )
    shape = _pipeline_shape(ev.window)
    per, every = (f" a micro-batch ({shape[1]} a step)", shape[1]) if shape else (" a step", 1)
    evidence = [
        f"pipeline stage {key} works {ratio:.2f}x the other stages ({unit}: "
        f"{ms(float(per_stage[heavy]) / every)} vs {ms(ref / every)}{per}), the most in "
        f"{pct(lead)} of the steps"
        + (f"; the lead is {z:.1f}x the measure's wobble" if np.isfinite(z) else ""),
        f"the other stages idle {ms(idle_others)} a step in pipeline bubbles, stage {key} "
        f"{ms(idle_heavy)}" + (_balanced_bubbles(stages.size, *shape) if shape else ""),
    ]
    caveats: list[str] = []
    base = _baseline_ratio(ev, int(stages[heavy]))
    if base is not None and base >= MIN_STAGE_RATIO and ratio <= base * MIN_STAGE_RATIO:
        # The healthy run had the same split: a loss in both runs, not what changed.
        strength *= 0.5
        caveats.append(
            f"the baseline run's stage {key} was heavy too ({base:.2f}x the others): "
            "no regression against it, a loss in both"
        )
    stage = ev.loc.of("stage", key)
    if stage is not None:
        impact = stage.gain
        evidence.append(f"what-if: {stage.what_if()}")
    else:
        impact = float(nanmedian(ev.local[pp == stages[heavy]] - nanmedian(ev.local, axis=0)))
        impact /= ev.step_ns
    ranks = tuple(int(r) for r in np.flatnonzero(pp == stages[heavy]))
    return Candidate(
        float(max(impact, 0.0)),
        float(strength),
        ranks,
        hosts_of(ev, ranks),
        evidence=tuple(evidence),
        caveats=tuple(caveats),
    )


def _baseline_ratio(ev: Evidence, stage: int) -> float | None:
    """The same stage's work over the others' in the baseline run (`stage_work` of its own
    rows: CPU time on CPU ranks; on GPUs the compute phases' wall time, the baseline's
    own-time decomposition not being at hand), when both runs have the same layout."""
    base = ev.baseline
    if base is None:
        return None
    pp, bpp = ev.window.ranks.mesh.get("pp"), base.ranks.mesh.get("pp")
    if pp is None or bpp is None or pp.shape != bpp.shape or not np.array_equal(pp, bpp):
        return None
    measured = stage_work(base, None)
    if measured is None:
        return None
    stages = np.unique(bpp)
    if stage not in stages:
        return None
    ratio, _, _ = _stage_ratio(measured[0], bpp, stages, int(np.flatnonzero(stages == stage)[0]))
    return ratio if np.isfinite(ratio) else None


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
