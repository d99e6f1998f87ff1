"""The judges of devices, inputs, links and behaviour over time: how much of the step a
mechanism costs, and how specifically the data shows its signature (see `verdict` for how
the two make a score; `judges` holds the table of every judge).

Every judge reads relative, scale-free evidence: robust z-scores against the ranks' own
spread with a threshold that grows with the rank count, effect sizes, ratios to peers or
to the quiet level, and whether the slow rank stays or moves. Evidence strings carry the
numbers they rest on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.candidate import NONE, Candidate, hosts_of, ms, pct
from rankscope.diagnosis.decomposition import COMPUTE_PHASES, Decomposition
from rankscope.diagnosis.evidence import Evidence
from rankscope.diagnosis.fabric import PAIRED_Z, LinkFinding, is_pair
from rankscope.diagnosis.localise import MATERIAL
from rankscope.diagnosis.regime import job_step_ns
from rankscope.diagnosis.robust import (
    expected_max_z,
    logistic,
    nanmean,
    nanmedian,
    peer_median,
    quiet_z,
    robust_scale,
    robust_z,
)
from rankscope.diagnosis.straggler import heavy_ranks
from rankscope.diagnosis.trends import PERIODIC_CV, SPIKE_Z, describe_trend
from rankscope.diagnosis.window import Window

Z_MARGIN = 3.0
"""A rank (host, rail) stands out when its robust z exceeds the largest z that the same
number of healthy ranks reach by chance (``expected_max_z``) by this margin."""

BURST_FLOOR = 0.01
"""Cross-host transfer varies from step to step by at least ~1 % (log units) in any real
fabric; a tighter measured spread is not trusted for the burst test."""
MAD_SIGMA = 1.4826


def _times(x: float) -> str:
    return f"{x:.2f}x" if np.isfinite(x) else "n/a (not recorded)"


def judge_slow_device(ev: Evidence) -> Candidate:
    sr = ev.corr.slow_rank
    n = ev.window.world_size
    thr = expected_max_z(n) + Z_MARGIN
    z = np.nan_to_num(sr.residual_z, nan=-np.inf)
    cands = np.flatnonzero((z > thr) & (sr.residual > 0))
    if cands.size == 0 or cands.size > max(2, n // 4):
        return NONE
    cands = cands[np.argsort(-sr.residual[cands])][:16]
    top = int(cands[0])
    compute = nanmedian(ev.decomp.category("compute"))
    impact = float(sr.residual[top] * compute / ev.step_ns)
    # Is a candidate the most frequent slowest rank? (Compared by counts, not by the
    # modal rank's id, which a tie would make depend on rank numbering.)
    counts = np.bincount(sr.slowest[sr.slowest >= 0], minlength=n)
    stable = bool(counts.max() > 0 and counts[cands].max() >= counts.max())
    strength = logistic(float(z[top]), thr, 1.0) * (1.0 if stable else 0.8)
    evidence = [
        f"rank {top} computes {pct(sr.residual[top])} longer than its work predicts "
        f"(robust z {z[top]:.0f} across {n} ranks)",
        f"the slowest rank was rank {sr.modal_rank} in {pct(sr.modal_share)} of steps",
    ]
    caveats = []
    raw, adjusted = _raw_compute_lead(ev, top)
    own = _raw_vs_baseline(ev, top)
    if np.isfinite(own):
        # Its own compute phases in the healthy run are the cleanest reference.
        contradicted = own < 0.25 * sr.residual[top]
    else:
        contradicted = (
            np.isfinite(raw) and raw < 0.25 * sr.residual[top] and adjusted < 0.5 * sr.residual[top]
        )
    if contradicted:
        # A slow device is slower inside its own compute phases, wall time and all. When
        # they are not longer than the median rank's, even once that rank's waiting
        # inside its phases is left out, its larger compute is the peers' collective time
        # the decomposition took out of their phases, not its own work.
        strength *= 0.3
        caveats.append(
            f"rank {top}'s compute phases are {pct(raw)} longer than the median rank's in wall "
            "time, far less than its compute lead: the lead is its peers' waiting inside "
            "their phases, not a slower device"
        )
    dev = ev.window.device
    clock = nanmedian(dev["sm_clock_mhz"], axis=1)
    if np.isfinite(clock).sum() >= 3:
        cz = robust_z(clock)
        low = [int(r) for r in cands if np.isfinite(cz[r]) and cz[r] < -4]
        if low:
            evidence.append(
                f"SM clock of rank {low[0]} {clock[low[0]]:.0f} MHz vs median "
                f"{nanmedian(clock):.0f} MHz"
            )
    thr_bits = dev["throttle"]
    if np.isfinite(thr_bits).any():
        flagged = [int(r) for r in cands if np.nanmax(np.nan_to_num(thr_bits[r], nan=0)) > 0]
        if flagged:
            bits = int(np.nanmax(thr_bits[flagged[0]]))
            evidence.append(f"throttle reasons 0x{bits:x} reported on rank {flagged[0]}")
    temp = nanmedian(dev["temp_c"], axis=1)
    if np.isfinite(temp).sum() >= 3:
        tz = robust_z(temp)
        if np.isfinite(tz[top]) and tz[top] > 4:
            evidence.append(
                f"rank {top} runs at {temp[top]:.0f} °C vs median {nanmedian(temp):.0f} °C"
            )
    if ev.trends.thermal_ranks.size and set(ev.trends.thermal_ranks.tolist()) & set(cands.tolist()):
        evidence.append("its SM clock fell over the window (thermal drift)")
    ranks = tuple(int(r) for r in cands)
    rails = tuple(
        sorted({int(ev.window.ranks.rail[r]) for r in ranks if ev.window.ranks.rail[r] >= 0})
    )
    return Candidate(
        impact,
        strength,
        ranks,
        hosts_of(ev, ranks),
        rails=rails,
        evidence=tuple(evidence),
        caveats=tuple(caveats),
    )


def _compute_spans(window: Window) -> np.ndarray | None:
    spans = [window.phase_ns[p] for p in COMPUTE_PHASES if p in window.phase_ns]
    return np.where(window.present, sum(spans), np.nan) if spans else None


def _raw_vs_baseline(ev: Evidence, rank: int) -> float:
    """How much longer one rank's compute phases are than its own in the baseline run,
    median over steps (NaN without a baseline of the same ranks and equal work)."""
    base = ev.baseline
    if base is None or base.world_size != ev.window.world_size or not ev.numerator.comparable:
        return float("nan")
    now, then = _compute_spans(ev.window), _compute_spans(base)
    if now is None or then is None:
        return float("nan")
    ref = float(nanmedian(then[rank]))
    return float(nanmedian(now[rank])) / ref - 1.0 if ref > 0 else float("nan")


def _raw_compute_lead(ev: Evidence, rank: int) -> tuple[float, float]:
    """How much longer one rank's compute phases are than the median rank's in wall time
    as recorded, median over steps: against the median rank's phases as they are, and
    against them less the arrival wait the decomposition found inside them (NaN, NaN
    without compute phases).

    The median rank's phases may hold time it spent waiting in collectives for the slow
    rank (a tensor-parallel all-reduce inside forward), which the slow rank does not have:
    a slow device leads the second reference by about its compute lead even when its
    peers' phases are as long as its own."""
    raw = _compute_spans(ev.window)
    if raw is None:
        return float("nan"), float("nan")
    inside = np.maximum(raw - ev.decomp.category("compute"), 0.0)
    waited = np.minimum(inside, ev.decomp.category("arrival_wait"))

    def lead(ref: np.ndarray) -> float:
        with np.errstate(invalid="ignore", divide="ignore"):
            x = np.where(ref > 0, raw[rank] / ref - 1.0, np.nan)
        return float(nanmedian(x)) if np.isfinite(x).any() else float("nan")

    return lead(nanmedian(raw, axis=0)), lead(nanmedian(raw - waited, axis=0))


def judge_data_imbalance(ev: Evidence) -> Candidate:
    wc = ev.corr.work
    sr = ev.corr.slow_rank
    if not (np.isfinite(wc.work_excess) and np.isfinite(wc.compute_excess)):
        return NONE
    if wc.compute_excess <= 0:
        return NONE
    explained = float(np.clip(wc.work_excess / wc.compute_excess, 0.0, 1.0))
    impact = float(max(0.0, min(wc.work_excess, wc.compute_excess)))
    moving = sr.modal_share < 0.5
    # Work explaining a quarter of the slowest rank's lead is a material cause; healthy
    # runs, whose lead is noise, sit near zero.
    strength = logistic(explained, 0.25, 0.05) * (1.0 if moving else 0.7)
    evidence = [
        f"the slowest rank's compute leads the median rank by {pct(wc.compute_excess)} of "
        f"the step; its work alone predicts {pct(wc.work_excess)}",
        f"largest Σseq² is {_times(wc.attn_max_ratio)} the median rank's, tokens "
        f"{_times(wc.tokens_max_ratio)}",
        f"compute vs Σseq² {wc.rho_text('attn_cost')}, vs tokens {wc.rho_text('tokens')}",
        f"the slowest rank moved: {sr.distinct} distinct ranks over "
        f"{int((sr.slowest >= 0).sum())} steps (most frequent {pct(sr.modal_share)})",
    ]
    if np.isfinite(wc.slowest_is_heaviest):
        evidence.append(
            f"the slowest rank also had the most work in {pct(wc.slowest_is_heaviest)} of steps"
        )
    caveats = []
    if ev.crit.skew_resolvable < 0.5:
        caveats.append(
            f"arrival skews are mostly below twice the clock error ({ms(ev.crit.clock_error_ns)}); "
            "compute durations are local and unaffected"
        )
    ranks: tuple[int, ...] = ()
    heavy, level = heavy_ranks(ev.window)
    if heavy.size:
        # The same ranks carry the extra work step after step (a shard of longer
        # documents, a rank given a larger batch): the imbalance is localised, and named.
        ranks = tuple(int(r) for r in heavy[:16])
        shard = ev.window.ranks.shard
        top = ranks[0]
        of_shard = f" (shard {int(shard[top])})" if int(shard[top]) >= 0 else ""
        evidence.append(
            f"rank {top}{of_shard} had {level[top]:.2f}x its peers' work (median) in most steps"
            + (f", {len(ranks) - 1} more rank(s) above half that lead" if len(ranks) > 1 else "")
        )
    return Candidate(
        impact,
        strength,
        ranks,
        hosts_of(ev, ranks) if ranks else (),
        evidence=tuple(evidence),
        caveats=tuple(caveats),
    )


def judge_slow_host_input(ev: Evidence) -> Candidate:
    inp = ev.corr.relative.get("input")
    if inp is None or not np.isfinite(inp).any():
        return NONE
    n = ev.window.world_size
    thr = expected_max_z(n) + Z_MARGIN
    # Against the quiet ranks: with one slow host of two, half the ranks are affected.
    zq, ref = quiet_z(inp)
    if not np.isfinite(ref):
        return _slow_input_among_few(ev, inp)
    z = np.nan_to_num(zq, nan=-np.inf)
    med = float(nanmedian(inp))
    cands = np.flatnonzero((z > thr) & (inp > ref))
    if cands.size == 0 or cands.size > (3 * n) // 4:
        return NONE
    top = int(cands[np.argmax(inp[cands])])
    impact = float(inp[top] - ref)
    # Implicate the ranks that carry the loss: at least half the worst rank's excess. With
    # thousands of ranks a long-tailed loader puts a few stray ranks past the z threshold.
    cands = cands[inp[cands] - ref >= 0.5 * impact]
    cands = cands[np.argsort(-inp[cands], kind="stable")]
    # A host's input pipeline slows all of its ranks; scattered single ranks are weaker
    # evidence (one rank's loader, or noise in a long tail).
    host = ev.window.ranks.host
    codes, per_host = np.unique(host[cands], return_counts=True)
    size = np.array([np.count_nonzero(host == c) for c in codes])
    whole = bool(np.all(per_host * 2 >= size))
    strength = logistic(float(z[top]), thr, 1.0) * (1.0 if whole else 0.6)
    hosts = hosts_of(ev, cands)
    evidence = [
        f"input wait on {', '.join(hosts[:3])}: {pct(inp[top])} of the step vs "
        f"{pct(ref)} on the quiet ranks (median rank {pct(med)})",
        f"{cands.size} rank(s) affected, z up to {z[top]:.0f} against the quiet ranks",
    ]
    host_eff = [e for e in ev.corr.for_metric("input") if e.dimension == "host"]
    if host_eff:
        evidence.append(f"host explains ε² = {host_eff[0].epsilon2:.2f} of the input wait")
    ranks = tuple(int(r) for r in cands)
    return Candidate(impact, strength, ranks, hosts, evidence=tuple(evidence))


FEW_INPUT_RATIO = 4.0
"""Among too few ranks for a spread (under three with input measured), a rank whose input
wait is this many times its peers' (and material) has a slow input pipeline."""


def _slow_input_among_few(ev: Evidence, inp: np.ndarray) -> Candidate:
    """`judge_slow_host_input` for a job of one or two measured ranks: each against its
    peer, by how many times its input wait the rank's is, since no spread can be read
    from two values. Surer the further apart, never sure (at most 0.8)."""
    peers = peer_median(inp)
    excess = np.nan_to_num(inp - peers, nan=-np.inf)
    top = int(np.argmax(excess))
    impact = float(excess[top])
    if not impact >= MATERIAL:
        return NONE
    floor = 0.001  # a tenth of a percent of the step: a loader that keeps up
    times = float(inp[top] / max(float(peers[top]), floor))
    strength = 0.8 * logistic(times, FEW_INPUT_RATIO, 1.0)
    hosts = hosts_of(ev, (top,))
    evidence = (
        f"input wait on {', '.join(hosts)}: rank {top} {pct(inp[top])} of the step vs "
        f"{pct(peers[top])} on its peer(s), {times:.0f}x",
        "too few ranks to read a spread: judged against the peer(s) alone",
    )
    return Candidate(impact, strength, (top,), hosts, evidence=evidence)


MIN_PEERS = 3
"""Links needed before a link is judged against its peers in the same window (a robust
spread from fewer is meaningless); below it a baseline run, or with exactly two, the one
against the other step by step (`fabric.LinkFinding.paired`)."""


@dataclass(frozen=True)
class _LinkJudgement:
    worst: LinkFinding
    strength: float
    impact: float
    basis: str
    """``peers``, ``baseline``, ``pair`` (two links, one against the other) or ``none``
    (too few peers and no baseline run)."""
    n: int
    """How many links the worst one was judged among."""


def _link_candidate(
    ev: Evidence, peers: tuple[LinkFinding, ...], vs_base: tuple[LinkFinding, ...]
) -> _LinkJudgement | None:
    """The worst link, against its peers when there are enough of them, one against the
    other when there are two, else against the baseline run's same groups. Peers in the
    same window share its load and software, so they come first; the baseline is the only
    reference a one-host job has."""
    if len(peers) >= MIN_PEERS:
        worst = max(peers, key=lambda f: f.z if np.isfinite(f.z) else -np.inf)
        basis, n = "peers", len(peers)
    elif is_pair(peers):
        # Two links: one against the other, step by step, under the same load.
        worst = max(peers, key=lambda f: f.z)
        basis, n = "pair", 2
    elif vs_base:
        worst = max(vs_base, key=lambda f: f.z if np.isfinite(f.z) else -np.inf)
        basis, n = "baseline", len(vs_base)
    elif peers:
        worst = max(peers, key=lambda f: f.slowdown if np.isfinite(f.slowdown) else -np.inf)
        basis, n = "none", len(peers)
    else:
        return None
    strength = 0.0
    if basis == "pair":
        strength = logistic(worst.z, PAIRED_Z, 1.0)
    elif basis != "none":
        strength = logistic(worst.z, expected_max_z(n) + Z_MARGIN, 1.0)
    comm = nanmean(nanmax_ranks(ev.decomp, ("exposed_comm", "arrival_wait")))
    impact = min(worst.extra_ns_per_step, comm) / ev.step_ns
    return _LinkJudgement(worst, strength, float(max(impact, 0.0)), basis, n)


def _count(n: int, what: str) -> str:
    return f"one {what}" if n == 1 else f"{n} {what}s"


def _link_evidence(
    j: _LinkJudgement, scope: str, what: str, vs_base: tuple[LinkFinding, ...]
) -> list[str]:
    w = j.worst
    if j.basis in ("peers", "pair"):
        if j.basis == "peers":
            out = [
                f"{scope} collectives on {w.label} take {w.slowdown:.2f}x their peers' "
                f"transfer (robust z {w.z:.0f} across {_count(j.n, what)})"
            ]
        else:
            out = [
                f"{scope} collectives on {w.label} take {w.slowdown:.2f}x the median transfer "
                f"of the two {what}s, slower than the other's in step after step (paired t "
                f"{w.z:.1f} over {w.paired} steps)",
                f"two {what}s: judged one against the other, with no spread of peers to read",
            ]
        same = [f for f in vs_base if f.code == w.code]
        if same:
            out.append(
                f"against the baseline run: {same[0].slowdown:.2f}x its own transfer, "
                "relative to how the other groups moved"
            )
        return out
    if j.basis == "baseline":
        return [
            f"{scope} collectives on {w.label} take {w.slowdown:.2f}x their transfer in the "
            f"baseline run, relative to how the other {w.control} matched group rows moved "
            f"(shift z {w.z:.1f} against their run-to-run spread)",
            f"{_count(j.n, what)} compared: too few to judge against peers in the window",
        ]
    return [
        f"{scope} collectives on {w.label} take {w.slowdown:.2f}x the median transfer of "
        f"{_count(j.n, what)}"
    ]


def _not_compared(ev: Evidence, j: _LinkJudgement, scope: str, what: str) -> tuple[str, ...]:
    if j.basis != "none":
        return ()
    why = (
        "the baseline run has none of the same groups"
        if ev.numerator.has_baseline
        else "no baseline run was given"
    )
    return (
        f"{scope} links not judged: {_count(j.n, what)} with such groups (comparing with "
        f"peers needs {MIN_PEERS}) and {why}",
    )


def nanmax_ranks(decomp: Decomposition, cats: tuple[str, ...]) -> np.ndarray:
    """Per step, the largest rank's sum of the given categories.

    Args:
        decomp: the decomposition.
        cats: category names.

    Returns:
        float64 (S,) ns; NaN for a step no rank reported.
    """
    total = sum(decomp.category(c) for c in cats)
    assert isinstance(total, np.ndarray)
    top = np.max(np.where(np.isfinite(total), total, -np.inf), axis=0)
    return np.where(np.isfinite(total).any(axis=0), top, np.nan)


def judge_local_fabric(ev: Evidence) -> Candidate:
    j = _link_candidate(ev, ev.fabric.hosts, ev.fabric.hosts_vs_baseline)
    if j is None:
        return NONE
    w = j.worst
    evidence = [
        *_link_evidence(j, "intra-host", "host", ev.fabric.hosts_vs_baseline),
        f"{ms(w.extra_ns_per_step)} extra transfer per step in {len(w.groups)} group(s)",
    ]
    return Candidate(
        j.impact,
        j.strength,
        w.ranks,
        w.hosts,
        groups=w.groups,
        evidence=tuple(evidence),
        caveats=_not_compared(ev, j, "intra-host", "host"),
        unjudged=_not_compared(ev, j, "intra-host", "host"),
    )


def judge_network_rail(ev: Evidence) -> Candidate:
    j = _link_candidate(ev, ev.fabric.rails, ev.fabric.rails_vs_baseline)
    if j is None:
        return NONE
    w = j.worst
    evidence = [
        *_link_evidence(j, "cross-host", "rail", ev.fabric.rails_vs_baseline),
        f"{ms(w.extra_ns_per_step)} extra transfer per step in {_groups(w.groups)}",
    ]
    return Candidate(
        j.impact,
        j.strength,
        w.ranks,
        w.hosts,
        rails=(w.code,),
        groups=w.groups,
        evidence=tuple(evidence),
        caveats=_not_compared(ev, j, "cross-host", "rail"),
        unjudged=_not_compared(ev, j, "cross-host", "rail"),
    )


def _groups(names: tuple[str, ...]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else "")


def judge_placement(ev: Evidence) -> Candidate:
    if not ev.fabric.placement:
        return NONE
    worst = max(ev.fabric.placement, key=lambda f: f.extra_ns_per_step)
    comm = nanmean(nanmax_ranks(ev.decomp, ("exposed_comm", "arrival_wait")))
    impact = float(max(0.0, min(worst.extra_ns_per_step, comm) / ev.step_ns))
    # A group kind that normally stays inside a host but here crosses hosts is structural
    # evidence; how much it costs is the impact.
    strength = logistic(worst.slowdown, 1.2, 0.05)
    evidence = (
        f"{worst.label}: {_groups(worst.groups)} span {', '.join(worst.hosts[:4])} while the "
        "other groups of that kind stay inside one host",
        f"their transfer is {worst.slowdown:.2f}x that of intra-host peers, "
        f"{ms(worst.extra_ns_per_step)} extra per step",
    )
    return Candidate(
        impact, strength, worst.ranks, worst.hosts, groups=worst.groups, evidence=evidence
    )


def judge_checkpoint(ev: Evidence) -> Candidate:
    sp = ev.trends.spikes
    ck = float(nanmean(ev.decomp.category("checkpoint"))) / ev.step_ns
    cat = sp.dominant_category()
    if sp.steps.size == 0 and ck <= 0:
        return NONE
    spike_share = sp.share_of_time if (sp.periodic or cat == "checkpoint") else 0.0
    impact = max(spike_share, ck if np.isfinite(ck) else 0.0)
    # Where the spikes' time went: a checkpoint that is not instrumented as a phase lands
    # between the recorded phases; spikes of compute or communication are something else.
    fits = 1.0 if cat in ("checkpoint", None) else 0.6 if cat in ("host_gap", "other") else 0.3
    strength = (1.0 if sp.periodic else 0.5) * fits
    if sp.steps.size == 0:
        strength = 0.8  # checkpoint time on every step, no spike pattern
    evidence = [f"checkpoint phase: {pct(ck)} of the step time on average"]
    caveats = []
    if not ck > 0 and sp.steps.size:
        caveats.append(f"no checkpoint phase was recorded; the spikes' extra time went to '{cat}'")
    if sp.steps.size:
        evidence.append(
            f"{sp.steps.size} step spikes (robust z > {SPIKE_Z:.0f}) adding {pct(sp.share_of_time)} "
            f"of the window's time, most in '{cat}'"
        )
        if np.isfinite(sp.period):
            evidence.append(
                f"spikes every {sp.period:.0f} steps (interval CV {sp.interval_cv:.2f}; periodic "
                f"below {PERIODIC_CV})"
            )
    return Candidate(
        float(impact), float(strength), evidence=tuple(evidence), caveats=tuple(caveats)
    )


def judge_allocator_growth(ev: Evidence) -> Candidate:
    mem = {t.name: t for t in ev.trends.memory}
    n_steps = int(ev.window.steps.shape[0])
    phase = mem["memory_phase"]
    growth = (
        phase.slope_per_step * n_steps / ev.step_ns if np.isfinite(phase.slope_per_step) else 0.0
    )
    rising = [
        t for t in (mem["mem_reserved"], mem["alloc_retries"]) if np.isfinite(t.rho) and t.rho > 0.6
    ]
    st = ev.trends.step_time
    recorded = bool(np.nan_to_num(ev.decomp.category("memory"), nan=0.0).any())
    if not recorded and rising and np.isfinite(st.rho) and st.rho > 0.6 and _beyond_wobble(ev):
        # No memory phase recorded: the step-time growth that rises with the allocator's
        # footprint is the best available estimate, with less confidence.
        growth = max(st.relative_change, 0.0)
        strength = 0.7 * logistic(min(t.rho for t in rising), 0.8, 0.05)
        evidence = [
            f"step time {describe_trend(st, n_steps)} while "
            + ", ".join(f"{t.name} rises (ρ {t.rho:.2f})" for t in rising),
            "no memory-management phase was recorded to confirm allocator retries",
        ]
        return Candidate(float(growth), float(strength), evidence=tuple(evidence))
    if not np.isfinite(growth) or growth <= 0:
        return NONE
    rho = phase.rho if np.isfinite(phase.rho) else 0.0
    strength = logistic(rho, 0.6, 0.08) * (1.0 if rising else 0.7)
    evidence = [
        f"memory-management time grows by {pct(growth)} of the step over {n_steps} steps "
        f"(Spearman ρ with time {rho:.2f})",
    ]
    for t in rising:
        unit = "count" if t.name == "alloc_retries" else "bytes"
        evidence.append(f"{t.name} rises with time since start: {describe_trend(t, n_steps, unit)}")
    if np.isfinite(st.rho):
        evidence.append(f"step time {describe_trend(st, n_steps)}")
    return Candidate(float(growth), float(strength), evidence=tuple(evidence))


def _beyond_wobble(ev: Evidence) -> bool:
    """The job's step time grew over the window by more than twice the steps' own wobble
    around the trend line: a drift that the noise of a healthy run (whose reserved memory
    also rises while the allocator's pools fill) cannot make."""
    y = job_step_ns(ev.window)
    ok = np.isfinite(y)
    st = ev.trends.step_time
    if ok.sum() < 3 or not np.isfinite(st.slope_per_step):
        return False
    x = np.arange(y.size, dtype=np.float64)
    wobble = float(robust_scale(y[ok] - st.slope_per_step * x[ok]))
    return bool(st.slope_per_step * (y.size - 1) > 2.0 * wobble)


def judge_intermittent_congestion(ev: Evidence) -> Candidate:
    infl = ev.fabric.inflation_cross
    ok = np.isfinite(infl) & (infl > 0)
    if ok.sum() < 8:
        return NONE
    logi = np.log(np.where(ok, infl, 1.0))
    # The quiet level and its spread come from the quietest steps: bursts may hit more
    # than half of them, and then a median would call the quiet steps the outliers.
    ref = float(np.percentile(logi[ok], 10))
    quiet = logi[ok][logi[ok] <= np.percentile(logi[ok], 40)]
    spread = max(MAD_SIGMA * float(np.median(np.abs(quiet - ref))), BURST_FLOOR)
    z = (logi - ref) / spread
    burst = ok & (z > SPIKE_Z)
    idx = np.flatnonzero(burst)
    if idx.size == 0:
        return NONE
    comm = nanmean(ev.decomp.category("exposed_comm") + ev.decomp.category("arrival_wait"), axis=0)
    step = nanmedian(ev.decomp.step_ns, axis=0)
    calm = ~burst & ok
    extra = float(np.nansum(comm[idx] - (nanmedian(comm[calm]) if calm.any() else 0.0)))
    impact = max(0.0, extra / float(np.nansum(step)))
    periodic = False
    if idx.size >= 3:
        gaps = np.diff(ev.window.steps[idx]).astype(float)
        # Bursts in consecutive steps are a stretch of congestion, not a schedule.
        periodic = bool(gaps.mean() >= 2 and gaps.std() / gaps.mean() <= PERIODIC_CV)
    strength = (0.3 if periodic else 1.0) * (1.0 if idx.size >= 2 else 0.5)
    specific, intra_burst = _network_specific(infl, ev.fabric.inflation_intra, idx, calm)
    strength *= specific
    caveats = []
    if _one_trailing_run(idx, infl.shape[0]):
        # Bursts that are one run reaching the end of the window, with none before, are a
        # level that shifted (a link that degraded mid-run), not congestion that comes and
        # goes.
        strength *= 0.3
        caveats.append(
            "the bursts are one run up to the end of the window with none before: a level "
            "shift, not congestion that comes and goes"
        )
    evidence = [
        f"{idx.size} of {int(ok.sum())} steps had cross-host transfers "
        f"{nanmedian(infl[idx]) / np.exp(ref):.2f}x their quiet time (median burst), at "
        "irregular intervals"
        if not periodic
        else f"{idx.size} transfer bursts, but at a regular interval",
        f"bursts added {pct(impact)} of the window's time in exposed communication and wait",
        f"intra-host transfers in the same steps: {intra_burst:.2f}x their calm steps'",
    ]
    if specific < 0.5:
        evidence.append(
            "intra-host transfers burst as much in those steps: the stalls are on the hosts "
            "(scheduling, CPU contention), not in the network"
        )
    return Candidate(impact, strength, evidence=tuple(evidence), caveats=tuple(caveats))


def _one_trailing_run(idx: np.ndarray, n_steps: int) -> bool:
    """The burst steps ``idx`` (sorted columns) are one consecutive run of three or more
    that reaches the last step, with no burst before it."""
    if idx.size < 3 or idx[-1] < n_steps - 1:
        return False
    return bool(np.all(np.diff(idx) == 1))


def _network_specific(
    cross: np.ndarray, intra: np.ndarray, burst: np.ndarray, calm: np.ndarray
) -> tuple[float, float]:
    """Which share of the bursts' cross-host inflation intra-host transfers do not show in
    the same steps (log units, each against its own calm steps), and the intra-host ratio.

    Congestion in the network slows only transfers that cross it; a host that stalls (its
    CPU taken by other work) slows its intra-host transfers in the same steps too.
    """
    if not calm.any():
        return 1.0, float("nan")
    lc = float(np.log(nanmedian(cross[burst]) / nanmedian(cross[calm])))
    ib, ic = nanmedian(intra[burst]), nanmedian(intra[calm])
    if not (np.isfinite(ib) and np.isfinite(ic) and ib > 0 and ic > 0) or lc <= 0:
        return 1.0, float("nan")
    li = float(np.log(ib / ic))
    return float(np.clip((lc - li) / lc, 0.0, 1.0)), float(ib / ic)


def judge_numerator_change(ev: Evidence) -> Candidate:
    num = ev.numerator
    if not num.has_baseline or not num.numerator_changed:
        return NONE
    impact = float(abs(num.executed_ratio - 1.0))
    evidence = [
        f"{f.name}: {f.baseline:.4g} -> {f.current:.4g} per step ({f.ratio:.2f}x)"
        for f in num.fields
        if f.name in num.changed
    ]
    if np.isfinite(num.useful_ratio):
        evidence.append(
            f"useful work per step (valid tokens) {num.useful_ratio:.2f}x the baseline; "
            f"executed work per useful token {num.executed_ratio:.2f}x"
        )
    if ev.delta is not None:
        comp = next(r for r in ev.delta.rows if r.category == "compute")
        evidence.append(f"compute per rank-step {ms(comp.baseline_ns)} -> {ms(comp.current_ns)}")
    return Candidate(impact, 1.0, evidence=tuple(evidence))
