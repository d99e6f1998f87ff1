"""A `Diagnosis` as readable plain text (``rankscope diagnose`` without ``--json``).

The order follows the seed's reduction: verdict first (what to do next), then the
numerator, where the missing time appears, who sets the pace, structure, curves,
distributions, time, and the hang view. Plain text only: snapshots paste it into tickets.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.controlled import Commands, Perturbation
from rankscope.diagnosis.curves import bucket_label
from rankscope.diagnosis.decomposition import CATEGORIES, COMPUTE_RULE
from rankscope.diagnosis.engine import Diagnosis
from rankscope.diagnosis.localise import MATERIAL
from rankscope.diagnosis.trends import describe_trend

_TREND_UNITS = {"mem_reserved": "bytes", "mem_allocated": "bytes", "alloc_retries": "count"}


def _ms(ns: float) -> str:
    return f"{ns / 1e6:9.2f} ms" if np.isfinite(ns) else "       n/a"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if np.isfinite(x) else "n/a"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if np.isfinite(x) else "n/a (not recorded)"


def render_text(
    diag: Diagnosis, hypotheses: int = 4, commands: Mapping[str, Commands] | None = None
) -> str:
    """Render a diagnosis as text.

    Args:
        diag: the diagnosis.
        hypotheses: how many ranked hypotheses to show in full.
        commands: the checked command lines of each mechanism's next experiment
            (``rankscope diagnose`` writes them for the recording path it was given); the
            top one's are shown as ``run:`` and ``then:`` lines.

    Returns:
        The report, lines joined by newlines.
    """
    w = diag.window
    out: list[str] = []
    steps = f"steps {int(w.steps[0])}-{int(w.steps[-1])}" if w.steps.size else "no steps"
    base = f" vs baseline {diag.baseline_run}" if diag.has_baseline else " (no baseline)"
    out.append(f"run {w.run} ({w.job}, {w.scope}, {w.world_size} ranks, {steps}){base}")
    if diag.warmup is not None:
        out.append(diag.warmup.describe())
    if diag.regime is not None:
        out.append(diag.regime.describe())
    out.append(headline(diag))
    out.append("")
    top = diag.verdict.top
    out.append(f"VERDICT: {top.mechanism}  (score {top.score:.2f}, ~{_pct(top.impact)} of step)")
    for i, h in enumerate(diag.verdict.hypotheses[:hypotheses], 1):
        out.append(f"  {i}. {h.mechanism:24s} score {h.score:.2f}  impact {_pct(h.impact)}")
        where = []
        if h.ranks:
            more = f" +{len(h.ranks) - 8}" if len(h.ranks) > 8 else ""
            where.append("ranks " + ",".join(map(str, h.ranks[:8])) + more)
        if h.hosts:
            where.append("hosts " + ",".join(h.hosts[:4]))
        if h.rails:
            where.append("rails " + ",".join(map(str, h.rails)))
        if where:
            out.append("       " + "; ".join(where))
        if h.score < 0.05 and i > 1:
            continue
        for e in h.evidence:
            out.append(f"       - {e}")
        for c in h.caveats:
            out.append(f"       ! {c}")
    nx = top.next_experiment
    out += [
        "",
        f"NEXT EXPERIMENT ({nx.scope}): {nx.change}",
        f"  watch {nx.metric} ({nx.direction})",
        f"  supports: {nx.supports}",
        f"  rejects:  {nx.rejects}",
    ]
    if nx.perturbation is not None:
        out += _controlled(nx.perturbation, (commands or {}).get(top.mechanism))
    out.append("")
    out += _localisation(diag)
    out += _numerator(diag)
    out += _decomposition(diag)
    out += _critical(diag)
    out += _structure(diag)
    out += _distributions(diag)
    out += _time(diag)
    if diag.stall.stalled or diag.stall.pending:
        out += _stall(diag)
    return "\n".join(out).rstrip() + "\n"


_DOES = {
    "swap_shards": "swap the data shards of ranks {a} and {b}",
    "swap_placement": "swap the devices of ranks {a} and {b}, every group keeping its members",
    "sweep_pairwise": "sweep each link of the suspect group alone",
}


def _controlled(p: Perturbation, cmds: Commands | None) -> list[str]:
    """The controlled experiment of the next-experiment block: what it changes, why these
    ranks, the command lines and how to read the outcome."""
    a, b = (*p.ranks, -1, -1)[:2]
    out = [
        f"  controlled: {_DOES[p.kind].format(a=a, b=b)}; separates {p.separates}",
        f"    {p.why}",
    ]
    if cmds is not None and cmds.command:
        out.append(f"  run:  {shlex.join(cmds.command)}")
        out += [f"  then: {shlex.join(t)}" for t in cmds.then]
    reads = "; ".join(f"{seen} -> {means}" for seen, means in p.outcomes)
    out.append(f"  reads: {reads}")
    if cmds is not None:
        out += [f"  note: {n}" for n in cmds.notes]
    return out


def headline(diag: Diagnosis) -> str:
    """The what-if line: what fixing the suspect would save, or that nothing would."""
    found = diag.finding
    if found is None:
        return "WHAT-IF: not computed"
    s = found.suspect
    if s is not None:
        where = f"; its extra time goes to {s.category}" if s.category else ""
        return f"WHAT-IF: {s.what_if()}{where}"
    if found.moving:
        return (
            f"WHAT-IF: step −{_pct(found.gain)} if each step's slowest rank behaved like the "
            "median rank (the slow rank moves)"
        )
    return (
        f"WHAT-IF: no rank, host or stage would save more than {_pct(MATERIAL)} of the step "
        f"beyond chance (best {_pct(found.gain)})"
    )


def _localisation(diag: Diagnosis) -> list[str]:
    loc = diag.localisation
    if loc is None:
        return []
    out = ["LOCALISATION (who sets the step; what-if: that entity behaving like the median rank)"]
    moves = "stays" if loc.stays else "moves"
    out.append(f"  the setting rank {moves}: {_pct(loc.stability)} of steps set by one rank")
    out.append(
        f"  every rank like the median would save {_pct(loc.imbalance)} of the step"
        + (
            f"; each step's outlier setter {_pct(loc.moving_gain)}"
            if np.isfinite(loc.moving_gain)
            else ""
        )
    )
    for s in loc.suspects[:5]:
        cat = f"  -> {s.category}" if s.category else ""
        out.append(
            f"  {s.label:18s} gain {_pct(s.gain):>6s} (net {_pct(max(s.net_gain, 0.0)):>6s},"
            f" noise {_pct(s.noise):>6s})  sets {_pct(s.sets):>6s}{cat}"
        )
    return [*out, ""]


def _numerator(diag: Diagnosis) -> list[str]:
    num = diag.numerator
    out = ["NUMERATOR (work per step, summed over ranks)"]
    if not num.has_baseline:
        out.append("  no baseline: work per step cannot be compared")
    for f in num.fields:
        if not np.isfinite(f.current):
            continue
        line = f"  {f.name:17s} {f.current:14.4g}"
        if num.has_baseline:
            flag = "  CHANGED" if f.changed else ""
            line += f"   baseline {f.baseline:14.4g}   x{f.ratio:.3f}{flag}"
        out.append(line)
    return [*out, ""]


def _decomposition(diag: Diagnosis) -> list[str]:
    cur = diag.decomposition.mean_per_step()
    mx = diag.decomposition.max_rank_per_step()
    delta = {r.category: r for r in diag.delta.rows} if diag.delta is not None else {}
    head = "WALL TIME per rank-step (mean; max rank)"
    out = [head + ("   baseline      delta" if delta else "")]
    for c in CATEGORIES:
        if cur[c] == 0 and (c not in delta or delta[c].baseline_ns == 0):
            continue
        line = f"  {c:14s}{_ms(cur[c])} ;{_ms(mx[c])}"
        if c in delta:
            line += f"  {_ms(delta[c].baseline_ns)} {delta[c].delta_ns / 1e6:+9.2f} ms"
        out.append(line)
    if diag.delta is not None and diag.delta.first_appears:
        out.append(f"  missing time first appears in: {diag.delta.first_appears}")
    out.append(f"  ({COMPUTE_RULE})")
    return [*out, ""]


def _critical(diag: Diagnosis) -> list[str]:
    cp = diag.critical
    out = ["CRITICAL PATH"]
    last = ", ".join(f"r{r}:{c}" for r, c in cp.top_last(6)) or "-"
    out.append(f"  last to arrive (of {cp.complete} collectives): {last}; ties {cp.ties}")
    crit = ", ".join(f"r{r}:{s}" for r, s in cp.top_critical(6)) or "-"
    out.append(f"  rank setting the step: {crit} (stability {_pct(cp.critical_stability)})")
    if cp.clock_error_ns > 0:
        note = "" if cp.skew_resolvable >= 0.5 else "  <- arrival order not resolvable"
        out.append(
            f"  clock error {cp.clock_error_ns / 1e3:.1f} us; skews above 2x error: "
            f"{_pct(cp.skew_resolvable)}{note}"
        )
    gs = cp.groups
    order = np.argsort(-np.nan_to_num(gs.skew_p99, nan=-1.0), kind="stable")[:5]
    for i in order:
        g = diag.window.groups.get(int(gs.group[i]))
        name = g.name if g is not None else f"group{int(gs.group[i])}"
        op = OPS[int(gs.op[i])] if 0 <= int(gs.op[i]) < len(OPS) else "other"
        out.append(
            f"  {name:12s} {op:14s} {bucket_label(int(gs.bucket[i])):>8s}  skew p50/p99 "
            f"{gs.skew_p50[i] / 1e3:8.1f}/{gs.skew_p99[i] / 1e3:8.1f} us  transfer p50 "
            f"{gs.transfer_p50[i] / 1e3:8.1f} us"
        )
    return [*out, ""]


def _structure(diag: Diagnosis) -> list[str]:
    corr = diag.correlations
    out = ["STRUCTURE (effect size ε² of each dimension; standout group)"]
    for metric in ("compute", "input", "lateness", "transfer_vs_peers", "step_time"):
        rows = corr.for_metric(metric)[:3]
        if not rows:
            continue
        parts = [f"{e.dimension} {e.epsilon2:.2f} ({e.standout})" for e in rows]
        out.append(f"  {metric:18s} " + "; ".join(parts))
    sr = corr.slow_rank
    kind = "stable (hardware-like)" if sr.stable else "moving (data-like)"
    out.append(
        f"  slowest rank: {kind}; rank {sr.modal_rank} in {_pct(sr.modal_share)} of steps, "
        f"{sr.distinct} distinct"
    )
    wc = corr.work
    out.append(
        f"  compute vs tokens {wc.rho_text('tokens')}, vs Σseq² {wc.rho_text('attn_cost')}; "
        f"max/median Σseq² {_ratio(wc.attn_max_ratio)}, tokens {_ratio(wc.tokens_max_ratio)}"
    )
    if diag.curve_shifts:
        s = diag.curve_shifts[0]
        out.append(
            f"  busbw vs baseline, worst: {s.group} {s.op} {bucket_label(s.bucket)} "
            f"{s.busbw_gbps:.1f} vs {s.baseline_busbw_gbps:.1f} GB/s (x{s.ratio:.2f})"
        )
    if diag.expected is not None:
        out.append(f"  busbw vs nccl-tests {diag.expected.source_run}: {diag.expected.summary}")
    return [*out, ""]


def _distributions(diag: Diagnosis) -> list[str]:
    cmp = diag.comparison
    out = ["STEP TIME DISTRIBUTION"]

    def row(name: str, d) -> str:
        return (
            f"  {name:9s} p50{_ms(d.p50)}  p90{_ms(d.p90)}  p99{_ms(d.p99)}  max{_ms(d.max)}"
            f"  stalls {d.tail_stalls}"
        )

    out.append(row("current", cmp.current))
    if cmp.baseline is not None:
        out.append(row("baseline", cmp.baseline))
        if cmp.mean_improved_tail_worse:
            out.append("  ! mean improved but the tail got worse")
        if cmp.manifest:
            out.append(f"  manifest differs in {len(cmp.manifest)} field(s):")
            for c in cmp.manifest[:12]:
                out.append(f"    {c.field}: {c.baseline!r} -> {c.current!r}")
    return [*out, ""]


def _time(diag: Diagnosis) -> list[str]:
    t = diag.trends
    out = ["OVER TIME"]
    n = int(diag.window.steps.shape[0])
    out.append(f"  step time trend {describe_trend(t.step_time, n)}")
    sp = t.spikes
    if sp.steps.size:
        period = f", every {sp.period:.0f} steps" if sp.periodic else ", irregular"
        out.append(
            f"  {sp.steps.size} spikes{period}, mostly {sp.dominant_category()}, "
            f"{_pct(sp.share_of_time)} of the time"
        )
    for m in t.memory:
        if np.isfinite(m.rho) and m.rho > 0.6:
            out.append(f"  {m.name} rising: {describe_trend(m, n, _TREND_UNITS.get(m.name, 'ns'))}")
    if t.thermal_ranks.size:
        out.append(f"  SM clock falling on ranks {', '.join(map(str, t.thermal_ranks[:8]))}")
    return [*out, ""]


def _stall(diag: Diagnosis) -> list[str]:
    st = diag.stall
    head = "STALLED" if st.stalled else "PENDING COLLECTIVES"
    out = [f"{head}: no step end for {st.idle_steps:.1f} median steps"]
    for p in st.pending[:8]:
        miss = ",".join(map(str, p.missing[:12])) or "?"
        out.append(
            f"  {p.group_name} seq {p.seq} {p.op}: {p.entered}/{p.members} in; missing {miss}"
        )
    if st.culprits():
        out.append(f"  likely culprits: ranks {', '.join(map(str, st.culprits()))}")
    return [*out, ""]
