"""A real torch job (``examples/gpt_packing.py``, gloo on CPU): what the collector costs,
compared with ``torch.profiler`` recording the same steps, and what rankscope concludes
about each incident of the README (verdict, experiment, ladder).

    python benchmarks/run.py real            # full
    python benchmarks/run.py real --quick    # fewer rounds and steps

Overhead: paired, interleaved runs of the same job (same seed, same batches) in four modes
— plain, explicit API with a live hub, zero-code (``rankscope run``), and
``torch.profiler`` recording every op — in a rotated order each round so drift hits every
mode alike. Each run's step time is the per-step maximum over ranks (the job's step),
median over the steps after warm-up; its CPU time is the process CPU of every rank (all
threads) per step. Overheads are ratios to the same round's plain run; the table gives the
median over rounds and the range, so what the noise floor hides is visible.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

MODES = ("plain", "explicit", "zero-code", "profiler")
WARMUP = 5


def _job_time(timings: Path) -> tuple[float, float]:
    """(median job step ms, median CPU ms per rank-step) after warm-up."""
    ranks = [json.loads(p.read_text()) for p in sorted(timings.glob("rank*.json"))]
    step = np.array([r["step_ns"] for r in ranks], dtype=float)[:, WARMUP:]
    cpu = np.array([r["cpu_ns"] for r in ranks], dtype=float)[:, WARMUP:]
    return float(np.median(step.max(axis=0))) / 1e6, float(np.median(cpu)) / 1e6


def _run_mode(incidents, hub, mode: str, steps: int, work: Path, tag: str) -> tuple[float, float]:
    timings = work / f"{mode}-{tag}"
    flags = ["--tokens-per-rank=2048", f"--timings={timings}"]
    if mode == "profiler":
        flags.append("--profile")
    spec = incidents.RunSpec(
        f"overhead-{mode}-{tag}", tuple(flags), nproc=2, steps=steps, explicit=mode == "explicit"
    )
    prefix = [sys.executable, "-m", "rankscope", "run", "--"] if mode == "zero-code" else []
    incidents.run_local(hub.endpoint, spec, prefix=prefix)
    return _job_time(timings)


def _events_per_step(hub, run: str) -> tuple[float, float]:
    """(collectives, phase spans) the collector recorded per rank-step of one run."""
    w = hub.store.window(run)
    phases = sum((v > 0).astype(float) for v in w.phase_ns.values())
    return float(np.nanmean(w.coll["n"])), float(np.nanmean(phases))


def overhead(quick: bool, work: Path) -> list[str]:
    import incidents

    rounds, steps = (2, 25) if quick else (8, 45)
    step: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    crashed: list[str] = []
    with incidents.local_hub(work / "overhead-record") as hub:
        for k in range(rounds):
            order = MODES[k % len(MODES) :] + MODES[: k % len(MODES)]
            for mode in order:
                try:
                    s_ms, c_ms = _run_mode(incidents, hub, mode, steps, work, str(k))
                except incidents.WorkloadError:
                    # torch's gloo teardown aborts a job now and then, with or without
                    # rankscope ("terminate called without an active exception"): rerun once.
                    crashed.append(mode)
                    s_ms, c_ms = _run_mode(incidents, hub, mode, steps, work, f"{k}r")
                step[mode].append(s_ms)
                cpu[mode].append(c_ms)
        colls, spans = _events_per_step(hub, "overhead-explicit-0")
    lines = [
        "### Collector overhead on the GPT packing job",
        "",
        f"2 ranks (gloo, one thread each), 2,048 tokens per rank, attention packer; {rounds} "
        f"rounds x {len(MODES)} modes, {steps} steps per run ({WARMUP} warm-up left out)."
        + (
            f" Launches that aborted and were rerun: {', '.join(crashed)} (the job itself, "
            "also without rankscope: torch's gloo teardown)."
            if crashed
            else ""
        ),
        "",
        "| mode | job step p50 (ms) | step overhead vs plain | CPU per rank-step (ms) | "
        "CPU overhead vs plain |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        s = np.array(step[mode])
        c = np.array(cpu[mode])
        if mode == "plain":
            lines.append(f"| {mode} | {np.median(s):.1f} | — | {np.median(c):.1f} | — |")
            continue
        rs = s / np.array(step["plain"]) - 1
        rc = c / np.array(cpu["plain"]) - 1
        lines.append(
            f"| {mode} | {np.median(s):.1f} | {np.median(rs):+.1%} "
            f"[{rs.min():+.1%}, {rs.max():+.1%}] | {np.median(c):.1f} | "
            f"{np.median(rc):+.1%} [{rc.min():+.1%}, {rc.max():+.1%}] |"
        )
    lines.append("")
    lines.append(
        "- Ranges are the spread over rounds: on a shared two-core machine they, not the "
        "medians, bound what separate launches can resolve."
    )
    prof_lines, prof_med, prof_spread = profiler_blocks(quick, work)
    bound: dict[str, float] = {}
    measured: dict[str, float] = {}
    for mode in ("explicit", "zero-code"):
        rc = np.array(cpu[mode]) / np.array(cpu["plain"]) - 1
        q1, q3 = np.percentile(rc, [25, 75])
        bound[mode] = float(max(abs(q1), abs(q3)))
        resolved = q1 > 0 or q3 < 0
        if q1 > 0:
            measured[mode] = float(np.median(rc))
        lines.append(
            f"- {mode} collector, CPU per rank-step: {np.median(rc):+.2%}, quartiles over "
            f"rounds {q1:+.1%} .. {q3:+.1%}: "
            + ("resolved." if resolved else f"not resolved; within ±{bound[mode]:.1%}.")
        )
    lines.append(
        f"- What the collector records here per rank-step: {colls:.1f} collective(s) (DDP's "
        "all-reduce, timed by its tail: the default on CPU), "
        f"{spans:.1f} phase spans and one step row — a few rows per "
        f"{np.median(step['plain']):.0f} ms step, so its hot-path cost is far below the noise "
        "above; the per-row cost is in the collector section."
    )
    lines += ["", "#### torch.profiler on the same steps, inside one job", "", *prof_lines]
    resolved_prof = prof_med - prof_spread > 0
    for mode in ("explicit", "zero-code"):
        if resolved_prof and mode in measured:
            lines.append(
                f"- Ratio of overheads: torch.profiler {prof_med:+.1%} per step, the {mode} "
                f"collector {measured[mode]:+.2%}: {prof_med / measured[mode]:.0f}x."
            )
        elif resolved_prof and bound[mode] > 0:
            lines.append(
                f"- Ratio of overheads: torch.profiler {prof_med:+.1%} per step against the "
                f"{mode} collector's at most ±{bound[mode]:.1%} (not resolved above): the "
                f"profiler costs at least {prof_med / bound[mode]:.1f}x the {mode} collector "
                "on this job — a lower bound set by this machine's noise, not a measured ratio."
            )
        else:
            lines.append(
                f"- Ratio of overheads with the {mode} collector: not resolved (profiler "
                f"{prof_med:+.1%} ± {prof_spread:.1%}, collector within ±{bound[mode]:.1%})."
            )
    return lines


def profiler_blocks(quick: bool, work: Path) -> tuple[list[str], float, float]:
    """torch.profiler switched on and off inside one job: blocks of steps in the order off,
    on, on, off (repeated); each on-block is paired with the off-block next to it.

    Returns:
        The report lines, and the median and the spread (half the interquartile range) of
        the paired CPU overhead per step.
    """
    import incidents

    block = 5
    cycles = 4 if quick else 12
    steps = WARMUP + 4 * block * cycles
    timings = work / "profiler-blocks"
    flags = (
        "--tokens-per-rank=2048",
        f"--timings={timings}",
        "--profile",
        f"--profile-blocks={block}",
    )
    spec = incidents.RunSpec(
        "overhead-profiler-blocks", flags, nproc=2, steps=steps, explicit=False
    )
    with incidents.local_hub(work / "profiler-record") as hub:
        incidents.run_local(hub.endpoint, spec)
    ranks = [json.loads(p.read_text()) for p in sorted(timings.glob("rank*.json"))]
    cpu = np.mean([r["cpu_ns"] for r in ranks], axis=0)
    wall = np.max([r["step_ns"] for r in ranks], axis=0)
    on = np.asarray(ranks[0]["profiled"], dtype=bool)
    close = np.array([c for r in ranks for c in r["profiler_close_cpu_ns"]], dtype=float)
    # Whole blocks after warm-up only; block b pairs with its neighbour b ^ 1.
    first = -(-WARMUP // block)
    n_blocks = steps // block
    ratios_cpu, ratios_wall = [], []
    for b in range(first - first % 2, n_blocks - 1, 2):
        pair = [max(b, first), b + 1]
        if pair[0] == pair[1]:
            continue
        sel = [np.arange(k * block, (k + 1) * block) for k in pair]
        arm = {bool(on[s[0]]): s for s in sel}
        if set(arm) != {True, False}:
            continue
        ratios_cpu.append(cpu[arm[True]].mean() / cpu[arm[False]].mean() - 1)
        ratios_wall.append(np.median(wall[arm[True]]) / np.median(wall[arm[False]]) - 1)
    rc, rw = np.array(ratios_cpu), np.array(ratios_wall)
    q1, med, q3 = np.percentile(rc, [25, 50, 75])
    amortized = close.mean() / (2 * block) / np.median(cpu[~on]) if close.size else np.nan
    lines = [
        f"torch.profiler (CPU activities, every op) switched on and off inside one 2-rank job: "
        f"{steps} steps, blocks of {block} in the order off, on, on, off; {rc.size} pairs of "
        "neighbouring blocks.",
        "",
        f"- CPU per rank-step with the profiler recording: **{med:+.1%}** (median over pairs; "
        f"quartiles {q1:+.1%}, {q3:+.1%}; {np.mean(rc > 0):.0%} of pairs above zero); job "
        f"step wall time {np.median(rw):+.1%} (quartiles {np.percentile(rw, 25):+.1%}, "
        f"{np.percentile(rw, 75):+.1%}).",
        f"- Closing each profiler (building its event tree, outside the timed steps) costs "
        f"{close.mean() / 1e6:.0f} ms CPU a rank, {amortized:.1%} of a step per profiled step "
        f"at {2 * block} steps a session.",
    ]
    return lines, float(med), float((q3 - q1) / 2)


def _verdict_lines(d) -> list[str]:
    def who(h) -> str:
        parts = []
        if h.ranks:
            parts.append(f"ranks {list(h.ranks)}")
        if h.rails:
            parts.append(f"rails {list(h.rails)}")
        if h.hosts:
            parts.append(f"hosts {', '.join(h.hosts)}")
        return f" ({'; '.join(parts)})" if parts else ""

    top, *rest = d.verdict.hypotheses
    out = [
        f"  - verdict: `{top.mechanism}` score {top.score:.2f}, impact {top.impact:.1%}{who(top)}"
    ]
    out += [f"    - {e}" for e in top.evidence[:4]]
    out.append(
        "  - runners-up: "
        + ", ".join(f"`{h.mechanism}` {h.score:.2f} (impact {h.impact:.1%})" for h in rest[:2])
    )
    return out


def _steps(w) -> float:
    return float(np.nanmedian(np.nanmax(w.step_ns, axis=0))) / 1e6


def _packing_ladder(incidents, hub, rep, work: Path) -> list[str]:
    """One-rank rerun of the packing regression through the torchrun launcher."""
    from rankscope.launch.ladder import build_ladder
    from rankscope.launch.plan import propose
    from rankscope.launch.report import ladder_text
    from rankscope.launch.runner import LaunchSettings, prepare, start
    from rankscope.launch.templates import find_launcher

    fault = rep.windows["fault"]
    plan = propose(fault, rep.diagnosis.verdict.hypotheses, "one-rank")
    launch = prepare(
        plan,
        find_launcher("torchrun"),
        LaunchSettings(hub=hub.endpoint, master_port=29611),
        record=Path(hub.record_dir),
        manifest=fault.manifest,
    )
    if start(launch).wait(timeout=300) != 0:
        return [f"  - one-rank rerun failed; log: {launch.log}"]
    steps = fault.steps.shape[0] + incidents.WARMUP
    spec = incidents.RunSpec(launch.plan.run, (), nproc=1, steps=steps)
    rerun = incidents.settled_window(hub.store, spec)
    ladder = build_ladder(fault, [rerun], baseline=rep.windows["baseline"])
    return ["  - ladder:", "", "```", *ladder_text(ladder), "```", ""]


def incidents_section(quick: bool, work: Path) -> list[str]:
    import incidents

    from rankscope.diagnosis.experiment import evaluate, metric_value

    steps = 26 if quick else None
    lines = ["### Incidents: verdict, experiment, ladder", ""]
    with incidents.local_hub(work / "incidents-record") as hub:
        packing = incidents.reproduce(
            incidents.PACKING, hub, roles=("baseline", "fault", "after"), steps=steps
        )
        slow = incidents.reproduce(incidents.SLOW_RANK, hub, steps=steps)
        numerator = incidents.reproduce(
            incidents.NUMERATOR, hub, windows={"baseline": packing.windows["baseline"]}, steps=steps
        )
        for rep in (packing, slow, numerator):
            base, fault = rep.windows["baseline"], rep.windows["fault"]
            lines += [
                f"**{rep.incident.name}** — {rep.incident.title}; {fault.world_size} ranks. "
                f"Job step p50 {_steps(base):.1f} ms (baseline) -> {_steps(fault):.1f} ms; "
                f"expected `{rep.incident.mechanism}`.",
                "",
                *_verdict_lines(rep.diagnosis),
            ]
            if rep is packing:
                plan = incidents.PACKING.experiment
                res = evaluate(
                    fault,
                    rep.windows["after"],
                    {"hypothesis": "data_imbalance", "metric": plan.metric,
                     "direction": plan.direction, "change": plan.change},
                )  # fmt: skip
                t_b = metric_value(fault, "transfer") / 1e6
                t_a = metric_value(rep.windows["after"], "transfer") / 1e6
                lines.append(
                    f'  - experiment "{plan.change}": entry spread {res.before / 1e6:.1f} -> '
                    f"{res.after / 1e6:.1f} ms ({res.change:+.0%}), transfer {t_b:.2f} -> "
                    f"{t_a:.2f} ms, step p50 {res.step_before.p50 / 1e6:.1f} -> "
                    f"{res.step_after.p50 / 1e6:.1f} ms: **{res.verdict}**"
                    f"{', accounting closed' if res.accounting_closed else ''}"
                )
                lines += _packing_ladder(incidents, hub, rep, work)
            if rep is slow:
                lines.append(
                    "  - no one-rank rerun: on CPU the fault is bound to a rank number, not to "
                    "a device a rerun could keep, so a reduced rerun would drop it by "
                    "construction."
                )
            lines.append("")
    lines += network_lines(quick, work)
    return lines


def network_lines(quick: bool, work: Path) -> list[str]:
    import netns

    reason = netns.unsupported()
    if reason:
        return [f"**network** — skipped: {reason}."]
    import incident_network as net

    from rankscope.launch.ladder import Tolerances, build_ladder
    from rankscope.launch.report import ladder_text

    nodes = netns.create()
    try:
        inc = net.reproduce(nodes, work / "network", steps=26 if quick else 36)
    finally:
        nodes.destroy()
    t_b, t_f = net.transfer_by_group(inc.baseline), net.transfer_by_group(inc.fault)
    groups = ", ".join(
        f"{list(g)} {t_b[g] / 1e6:.1f} -> {t_f[g] / 1e6:.1f} ms" for g in sorted(t_f) if g in t_b
    )
    ladder = build_ladder(
        inc.fault,
        [inc.rerun],
        baseline=inc.baseline,
        tolerances=Tolerances(local=0.9, spread=0.5, comm=0.9),
    )
    return [
        f"**network** — rail {net.DEGRADED_RAIL} between two network namespaces limited to "
        f"{net.RATE} (tc tbf); 4 ranks, 2 per node, hierarchical gradient averaging. Job step "
        f"p50 {_steps(inc.baseline):.1f} -> {_steps(inc.fault):.1f} ms; expected "
        "`network_rail`.",
        "",
        f"  - median post-arrival transfer per group (ranks): {groups}",
        *_verdict_lines(inc.diagnosis),
        "  - ladder (one-node rerun through the torchrun launcher template; wide tolerances, "
        "see tests/test_real_network.py):",
        "",
        "```",
        *ladder_text(ladder),
        "```",
    ]


def run(quick: bool) -> str:
    """Measure and report (Markdown)."""
    if shutil.which("torchrun") is None:
        return "### Real torch workload\n\n_Skipped: torchrun is not installed._\n"
    work = Path(tempfile.mkdtemp(prefix="rankscope-bench-real-"))
    load = [os.getloadavg()[0]]
    try:
        lines = [*overhead(quick, work), ""]
        load.append(os.getloadavg()[0])
        lines += [*incidents_section(quick, work), ""]
        load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines.append(
        "_1-minute load average at the start, after the overhead runs and at the end: "
        + " / ".join(f"{x:.2f}" for x in load)
        + " (2 cores, shared)._"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
