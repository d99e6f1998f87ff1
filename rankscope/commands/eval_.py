"""``rankscope eval``: score the diagnosis against the simulator's ground truth.

Every shipped fault scenario runs in-process (no hub, no sockets) at several scales and
seeds; each seed draws the scenario's magnitudes, noise, layout (tp) and fault targets
anew. Each run is diagnosed against a healthy baseline of the same job — the same resolved
configuration with no fault and its own noise (another seed stream) — and the top verdict
is compared with ``sim.truth``: a confusion matrix, top-1 accuracy, whether the implicated
ranks, hosts and rails are right where the mechanism has them, and the false-alarm rate on
runs whose truth is healthy. The section is written into ``benchmarks/RESULTS.md`` between
``<!-- eval:begin -->`` and ``<!-- eval:end -->``, leaving the rest of the file alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HELP = "Score the diagnosis on every simulated scenario at several scales and seeds"
DEFAULT_SCALES = "64,512"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- eval:begin -->", "<!-- eval:end -->"
BASELINE_SEED_OFFSET = 7919
"""The baseline run's noise streams use seed + this (its configuration is the scenario's)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scales",
        default=DEFAULT_SCALES,
        help=f"comma-separated world sizes (default {DEFAULT_SCALES}; up to 4096)",
    )
    p.add_argument(
        "--seeds",
        default="3",
        help="seeds per scenario and scale (default 3), or one value per scale, e.g. 5,5,2",
    )
    p.add_argument("--first-seed", type=int, default=1, help="first seed (default 1)")
    p.add_argument(
        "--steps",
        default="30",
        help="steps per run (default 30), or one value per scale, e.g. 30,30,16",
    )
    p.add_argument("--scenarios", default=None, help="comma-separated subset of scenarios")
    p.add_argument("--no-baseline", action="store_true", help="diagnose without a baseline")
    p.add_argument("--no-write", action="store_true", help="do not update benchmarks/RESULTS.md")
    p.add_argument("--results", default=str(RESULTS), help="results file to update")
    p.add_argument("--json", action="store_true", help="print the per-run records as JSON")


@dataclass(frozen=True)
class Case:
    """One scored run."""

    scenario: str
    scale: int
    seed: int
    truth: str
    predicted: str
    score: float
    runner_up: str
    rank_ok: bool | None
    """Implicated ranks right (None where the truth names no ranks or the verdict is wrong)."""
    host_ok: bool | None
    rail_ok: bool | None
    magnitude: float
    seconds: float
    baseline_alone: str = ""
    """The top verdict on the healthy baseline run diagnosed without any baseline (every
    run brings one more healthy sample for the false-alarm rate)."""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def correct(self) -> bool:
        return self.truth == self.predicted


def catalog() -> list[str]:
    """Shipped scenarios to score: every listed one except the worked-example pair."""
    from rankscope.sim.spec import list_scenarios

    return [n for n, _ in list_scenarios() if not n.startswith("seed-example")]


def simulate_window(
    scenario: Any, steps: int, run: str, scope: Any = None
) -> tuple[Any, dict[str, Any]]:
    """Run a scenario in-process and assemble its `Window` (no hub, no sockets).

    Args:
        scenario: a resolved `rankscope.sim.spec.Scenario`.
        steps: steps to simulate.
        run: run id.
        scope: reduced scope (a scope name or `rankscope.sim.topology.ScopeSpec`).

    Returns:
        ``(window, truth)``.
    """
    from rankscope.diagnosis.assemble import build_window
    from rankscope.sim.engine import Cluster

    cluster = Cluster(scenario, scope)
    tables = [cluster.step() for _ in range(steps)]

    def cat(name: str) -> dict[str, np.ndarray]:
        first = getattr(tables[0], name)
        return {k: np.concatenate([getattr(t, name)[k] for t in tables]) for k in first}

    window = build_window(
        job=scenario.job,
        run=run,
        scope=cluster.layout.scope,
        identities={int(i["rank"]): i for i in cluster.identities},
        groups=cluster.groups,
        steps=cat("steps"),
        phases=cat("phases"),
        colls=cat("colls"),
        samples=cat("samples"),
        manifest=cluster.manifest,
        clock_error_ns=np.full(cluster.layout.world_size, float(cluster.clock_error_ns)),
    )
    return window, dict(cluster.truth)


def baseline_of(scenario: Any) -> Any:
    """The same resolved job without its fault, on its own noise streams."""
    from rankscope.sim.spec import FaultSpec

    return dataclasses.replace(
        scenario, seed=scenario.seed + BASELINE_SEED_OFFSET, fault=FaultSpec(), name="baseline"
    )


def _set_ok(predicted: tuple, truth: list) -> bool | None:
    if not truth:
        return None
    return set(map(str, predicted)) == set(map(str, truth))


def score_case(diag: Any, truth: dict[str, Any]) -> tuple[bool | None, bool | None, bool | None]:
    """Whether the top hypothesis names the afflicted ranks, hosts and rails.

    Ranks: the first implicated rank is one of the truth's (a slow group drags its peers,
    so the verdict may name more). Hosts and rails: the same set as the truth's. None where
    the truth names none or the mechanism is wrong.
    """
    top = diag.verdict.top
    if top.mechanism != truth["mechanism"]:
        return None, None, None
    rank_ok = None
    if truth.get("ranks"):
        rank_ok = bool(top.ranks) and int(top.ranks[0]) in set(truth["ranks"])
    return (
        rank_ok,
        _set_ok(top.hosts, truth.get("hosts", [])),
        _set_ok(top.rails, truth.get("rails", [])),
    )


def cases(
    scenarios: list[str],
    scales: list[int],
    seeds: list[list[int]],
    steps: int | list[int],
    with_baseline: bool,
) -> Iterator[Case]:
    """Run and score every (scenario, scale, seed).

    Args:
        scenarios: scenario names.
        scales: world sizes.
        seeds: the seeds to run at each scale (one list per scale).
        steps: steps per run, one value or one per scale.
        with_baseline: diagnose against a healthy baseline of the same job.

    Yields:
        One `Case` per run, in order.
    """
    from rankscope.diagnosis.engine import diagnose
    from rankscope.sim.spec import load_scenario

    per_scale = steps if isinstance(steps, list) else [steps] * len(scales)
    for scale, n_steps, scale_seeds in zip(scales, per_scale, seeds):
        for name in scenarios:
            for seed in scale_seeds:
                t0 = time.perf_counter()
                sc = load_scenario(name, seed=seed, ranks=scale)
                window, truth = simulate_window(sc, n_steps, f"{name}-{seed}-{scale}")
                base = None
                if with_baseline:
                    base, _ = simulate_window(baseline_of(sc), n_steps, f"baseline-{seed}-{scale}")
                diag = diagnose(window, base)
                alone = diagnose(base).verdict.top.mechanism if base is not None else ""
                del window, base
                rank_ok, host_ok, rail_ok = score_case(diag, truth)
                hyps = diag.verdict.hypotheses
                yield Case(
                    scenario=name,
                    scale=scale,
                    seed=seed,
                    truth=truth["mechanism"],
                    predicted=hyps[0].mechanism,
                    score=hyps[0].score,
                    runner_up=hyps[1].mechanism if len(hyps) > 1 else "",
                    rank_ok=rank_ok,
                    host_ok=host_ok,
                    rail_ok=rail_ok,
                    magnitude=float(truth.get("magnitude", float("nan"))),
                    seconds=time.perf_counter() - t0,
                    baseline_alone=alone,
                    detail={
                        "truth": truth,
                        "top": {
                            "ranks": list(hyps[0].ranks[:16]),
                            "hosts": list(hyps[0].hosts),
                            "rails": list(hyps[0].rails),
                            "impact": hyps[0].impact,
                        },
                    },
                )


def _rate(flags: list[bool | None]) -> tuple[int, int]:
    known = [f for f in flags if f is not None]
    return sum(known), len(known)


def _frac(ok: int, n: int) -> str:
    return f"{ok}/{n} ({100 * ok / n:.1f} %)" if n else "n/a"


def summarize(results: list[Case], args_line: str, seconds: float) -> str:
    """The Markdown section: confusion matrix, accuracies, false alarms, misses.

    Args:
        results: scored runs.
        args_line: the command that produced them.
        seconds: wall time of the whole evaluation.

    Returns:
        Markdown text.
    """
    from rankscope.diagnosis.verdict import MECHANISMS

    n = len(results)
    correct = sum(c.correct for c in results)
    healthy = [c for c in results if c.truth == "healthy"]
    alarms = sum(c.predicted != "healthy" for c in healthy)
    alone = [c for c in results if c.baseline_alone]
    alone_alarms = sum(c.baseline_alone != "healthy" for c in alone)
    faults = [c for c in results if c.truth != "healthy"]
    missed = sum(c.predicted == "healthy" for c in faults)
    out = [
        "## Diagnosis accuracy (`rankscope eval`)",
        "",
        f"`{args_line}` — {n} runs in {seconds:.0f} s. Each run is diagnosed against a healthy "
        "baseline of the same job (same drawn configuration, no fault, its own noise). "
        "Seeds redraw magnitudes, noise, tensor-parallel degree and fault targets.",
        "",
        f"- **top-1 mechanism correct: {_frac(correct, n)}** (target ≥ 95 %)",
        f"- false alarms on healthy runs: {_frac(alarms, len(healthy))} (target ≤ 1 %)",
        f"- false alarms on the healthy baselines, each diagnosed alone (no baseline): "
        f"{_frac(alone_alarms, len(alone))}",
        f"- faults called healthy (missed): {_frac(missed, len(faults))}",
    ]
    for label, attr in (("ranks", "rank_ok"), ("hosts", "host_ok"), ("rails", "rail_ok")):
        ok, k = _rate([getattr(c, attr) for c in results])
        out.append(f"- implicated {label} correct (where the truth names them): {_frac(ok, k)}")
    out += [
        "",
        "Per scale:",
        "",
        "| ranks | runs | top-1 | false alarms |",
        "|---:|---:|---:|---:|",
    ]
    for scale in sorted({c.scale for c in results}):
        sub = [c for c in results if c.scale == scale]
        h = [c for c in sub if c.truth == "healthy"]
        out.append(
            f"| {scale} | {len(sub)} | {_frac(sum(c.correct for c in sub), len(sub))} | "
            f"{_frac(sum(c.predicted != 'healthy' for c in h), len(h))} |"
        )
    labels = [m for m in MECHANISMS if any(c.truth == m or c.predicted == m for c in results)]
    short = {m: "".join(w[0] for w in m.split("_")).upper() for m in labels}
    out += [
        "",
        "Confusion matrix (rows: truth, columns: top verdict; "
        + ", ".join(f"{short[m]} = {m}" for m in labels)
        + "):",
        "",
        "| truth \\ verdict | " + " | ".join(short[m] for m in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for t in labels:
        row = [sum(1 for c in results if c.truth == t and c.predicted == p) for p in labels]
        if sum(row):
            out.append(f"| {t} | " + " | ".join(str(v) if v else "·" for v in row) + " |")
    wrong = [c for c in results if not c.correct]
    noisy = [c for c in alone if c.baseline_alone != "healthy"]
    if noisy:
        out += ["", "Healthy baselines diagnosed alone that raised an alarm:", ""]
        for c in noisy[:20]:
            out.append(
                f"- baseline of {c.scenario} @ {c.scale} ranks, seed {c.seed}: {c.baseline_alone}"
            )
    if wrong:
        out += ["", "Misdiagnosed runs:", ""]
        for c in wrong[:30]:
            out.append(
                f"- {c.scenario} @ {c.scale} ranks, seed {c.seed}: truth {c.truth} "
                f"(magnitude {c.magnitude:.3g}) -> {c.predicted} (score {c.score:.2f})"
            )
    return "\n".join(out) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace the eval section of a results file (create the file or markers if absent)."""
    block = f"{BEGIN}\n{section.rstrip()}\n{END}"
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    try:
        scales = _ints(args.scales, "--scales")
        steps = _ints(str(args.steps), "--steps")
        if len(steps) == 1:
            steps = steps * len(scales)
        if len(steps) != len(scales):
            raise ValueError(f"--steps needs one value or one per scale ({len(scales)})")
        n_seeds = _ints(str(args.seeds), "--seeds")
        if len(n_seeds) == 1:
            n_seeds = n_seeds * len(scales)
        if len(n_seeds) != len(scales):
            raise ValueError(f"--seeds needs one value or one per scale ({len(scales)})")
        if min(steps) < 8:
            raise ValueError("--steps must be >= 8")
        known = catalog()
        scenarios = known
        if args.scenarios:
            scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
            bad = [s for s in scenarios if s not in known]
            if bad:
                raise ValueError(f"unknown scenario(s) {bad}; known: {', '.join(known)}")
    except ValueError as exc:
        print(f"rankscope eval: {exc}", file=sys.stderr)
        return 2
    seeds = [list(range(args.first_seed, args.first_seed + k)) for k in n_seeds]
    t0 = time.perf_counter()
    results = []
    total = len(scenarios) * sum(n_seeds)
    for i, c in enumerate(cases(scenarios, scales, seeds, steps, not args.no_baseline), 1):
        results.append(c)
        mark = "ok " if c.correct else "XX "
        print(
            f"[{i}/{total}] {mark}{c.scenario:24s} {c.scale:5d} ranks seed {c.seed}: "
            f"truth {c.truth} -> {c.predicted} ({c.score:.2f}) {c.seconds:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    cmd = f"rankscope eval --scales {','.join(map(str, scales))} --seeds {args.seeds}"
    cmd += f" --steps {','.join(map(str, steps))}" + (" --no-baseline" if args.no_baseline else "")
    section = summarize(results, cmd, time.perf_counter() - t0)
    if args.json:
        json.dump([dataclasses.asdict(c) for c in results], sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(section)
    if not args.no_write:
        write_section(Path(args.results), section)
    return 0
