"""False alarms: how often the live view finds a regime or a fault in a healthy run.

The detection benchmark (`bench_detection`) measures how fast a real straggler is named;
this one reads simulated ``healthy`` jobs the same way, step by step, and counts every read
in which the regime rules (`diagnosis.regime`) or the verdict found something. Each read
is a chance for a false alarm: the live view diagnoses every few seconds.

Target (issue 15): ≤ 1 % of healthy runs called faulty.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bench_detection import AFTER, ONSET


@dataclass(frozen=True)
class Quiet:
    """A healthy run read as the live view reads it, step by step."""

    ranks: int
    seed: int
    reads: int
    """Windows read (one per step from `ONSET` on)."""
    step_regimes: int
    """Reads in which the step-time rule found a regime."""
    arrival_regimes: int
    """Reads in which the arrival rule did (the step time showing none)."""
    faulty: int
    """Reads whose verdict was not ``healthy``."""


def quiet(n_ranks: int, seed: int) -> Quiet:
    """Read a healthy job's window after each step from `ONSET` to `ONSET` + `AFTER`, as
    the main screen does, and count the reads where a regime or a fault was found (each is
    a false alarm).

    Args:
        n_ranks: world size.
        seed: scenario seed (the healthy scenario's warm-up, tails and hosts vary with it).

    Returns:
        The counts.
    """
    from rankscope.commands.eval_ import simulate_window
    from rankscope.diagnosis import diagnose
    from rankscope.diagnosis.regime import current_regime, since
    from rankscope.sim import load_scenario

    scenario = load_scenario("healthy", ranks=n_ranks, seed=seed)
    whole, _ = simulate_window(scenario, ONSET + AFTER, run=f"quiet-{seed}")
    step_hits = arrival_hits = faulty = reads = 0
    for stop in range(ONSET + 1, ONSET + AFTER + 1):
        w = since(whole, 0, stop)
        reads += 1
        regime = current_regime(w)
        if regime is not None:
            step_hits += regime.rank is None
            arrival_hits += regime.rank is not None
        faulty += diagnose(w).verdict.top.mechanism != "healthy"
    return Quiet(n_ranks, seed, reads, step_hits, arrival_hits, faulty)


def run(quick: bool) -> str:
    """Measure and report (Markdown)."""
    sizes = [512] if quick else [512, 4096]
    seeds = {512: range(1, 4 if quick else 11), 4096: range(1, 5)}
    rows = [quiet(n, s) for n in sizes for s in seeds[n]]
    lines = [
        "### False alarms on healthy runs",
        "",
        f"The detection benchmark's reads, of simulated `healthy` jobs (warm-up, heavy tails and hosts drawn per "
        f"seed): the window after each of steps {ONSET + 1}-{ONSET + AFTER}, each read a "
        "chance for a false alarm. *Regime*: the reads in which the step-time rule, or the "
        "arrival rule (each rank's lateness, asked when the step time shows no shift), "
        "found a new regime; *not healthy*: the reads whose verdict named a fault.",
        "",
        "| ranks | seeds | reads | step-time regime | arrival regime | not healthy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        mine = [q for q in rows if q.ranks == n]
        reads = sum(q.reads for q in mine)
        lines.append(
            f"| {n:,} | {len(mine)} | {reads} | {sum(q.step_regimes for q in mine)} | "
            f"{sum(q.arrival_regimes for q in mine)} | {sum(q.faulty for q in mine)} |"
        )
    total = sum(q.reads for q in rows)
    alarms = sum(q.step_regimes + q.arrival_regimes for q in rows)
    faulty = sum(q.faulty for q in rows)
    runs_alarmed = sum(1 for q in rows if q.faulty)
    lines += [
        "",
        f"Target ≤ 1 % of healthy runs called faulty: {runs_alarmed} of {len(rows)} runs "
        f"({faulty} of {total} reads) named a fault; a regime was found in {alarms} of "
        f"{total} reads.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
