"""``rankscope eval``: score the diagnosis against ground truth.

Every shipped fault scenario runs in-process (no hub, no sockets) at several scales and
seeds; each seed draws the scenario's magnitudes, noise, layout (tp) and fault targets
anew. Each run is diagnosed against a healthy baseline of the same job — the same resolved
configuration with no fault and its own noise (another seed stream) — and the top verdict
is compared with ``sim.truth`` (`rankscope.commands.eval_scoring`: the full confusion
matrix, top-1 accuracy, missed faults, false alarms, wrong names, localised-but-unexplained
stragglers, localisation and warm-up).

With ``--real`` the real torchrun fault jobs of a source checkout (``examples/faultcases.py``:
``CASES`` and ``run_case(name, hub) -> (window, baseline_window | None, truth)``) run into
a local hub and are scored the same way, in a section of their own.

The report goes to stdout (``--json``: as data). Only ``--write-results [PATH]`` writes a
file: the section between ``<!-- eval:begin -->`` and ``<!-- eval:end -->`` of
``benchmarks/RESULTS.md`` (or PATH), leaving the rest of the file alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from rankscope.commands.eval_scoring import Case, make_case, render, score_case, to_json

__all__ = [
    "BEGIN",
    "END",
    "RESULTS",
    "Case",
    "baseline_of",
    "cases",
    "catalog",
    "load_faultcases",
    "real_cases",
    "score_case",
    "simulate_window",
    "summarize",
    "write_section",
]

HELP = "Score the diagnosis on every simulated scenario at several scales and seeds"
DEFAULT_SCALES = "64,512"
REPO = Path(__file__).resolve().parents[2]
"""The source checkout this package runs from (in an installed wheel: site-packages, where
neither file below exists)."""
RESULTS = REPO / "benchmarks" / "RESULTS.md"
FAULTJOBS = Path("examples") / "faultcases.py"
BEGIN, END = "<!-- eval:begin -->", "<!-- eval:end -->"
BASELINE_SEED_OFFSET = 7919
"""The baseline run's noise streams use seed + this (its configuration is the scenario's)."""
_DEFAULT_RESULTS = "\0results"
"""``--write-results`` given without a path."""


class EvalError(ValueError):
    """What eval was given cannot be used; `run` prints it as one line and exits 2."""


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
    p.add_argument(
        "--real",
        action="store_true",
        help="also run the real torchrun fault jobs of examples/faultcases.py (source checkout)",
    )
    p.add_argument(
        "--real-cases", default=None, help="comma-separated subset of the real jobs (--real)"
    )
    p.add_argument(
        "--no-sim", action="store_true", help="skip the simulated scenarios (with --real)"
    )
    p.add_argument(
        "--write-results",
        nargs="?",
        const=_DEFAULT_RESULTS,
        default=None,
        metavar="PATH",
        help="write the report into the eval section of PATH (default: benchmarks/RESULTS.md "
        "of this source checkout); without it nothing is written",
    )
    p.add_argument(
        "--json", action="store_true", help="print the scores and per-run records as JSON"
    )


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
                yield make_case(
                    diag,
                    truth,
                    scenario=name,
                    scale=scale,
                    seed=seed,
                    seconds=time.perf_counter() - t0,
                    baseline_alone=alone,
                )


def load_faultcases(root: Path | None = None) -> ModuleType:
    """Import ``examples/faultcases.py`` of the source checkout (the real fault jobs).

    Args:
        root: the checkout (default `REPO`, the one this package runs from).

    Returns:
        The module, with ``CASES`` and ``run_case``.

    Raises:
        EvalError: no ``examples/faultcases.py`` there (an installed package, or a
            checkout without the real jobs), or it lacks ``CASES`` / ``run_case``.
    """
    root = REPO if root is None else root
    path = root / FAULTJOBS
    if not path.is_file():
        raise EvalError(f"--real needs a source checkout with {FAULTJOBS}: {path} not found")
    # The examples import their siblings by name (``import incidents``).
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("faultcases", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["faultcases"] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        del sys.modules["faultcases"]
        raise EvalError(f"--real cannot import {path}: {exc}") from None
    if not isinstance(getattr(module, "CASES", None), dict) or not callable(
        getattr(module, "run_case", None)
    ):
        raise EvalError(f"{path} has no CASES dict and run_case(name, hub)")
    return module


def real_cases(
    module: ModuleType, names: list[str], with_baseline: bool
) -> Iterator[Case | tuple[str, str]]:
    """Run and score the real fault jobs, one hub for all of them.

    Args:
        module: `load_faultcases`'s module.
        names: the cases to run, keys of ``module.CASES``.
        with_baseline: diagnose against the baseline window the case brings.

    Yields:
        One `Case` per job that ran (``suite="real"``, seed 0), or ``(name, error)`` for a
        job that did not.
    """
    from rankscope.diagnosis.engine import diagnose
    from rankscope.hub.server import Hub

    with Hub("tcp://127.0.0.1:0") as hub:
        for name in names:
            t0 = time.perf_counter()
            try:
                window, base, truth = module.run_case(name, hub)
            except Exception as exc:  # one job failing to run must not hide the others
                yield name, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                continue
            if "mechanism" not in truth:
                yield name, f"its truth has no mechanism: {truth!r}"
                continue
            if not with_baseline:
                base = None
            diag = diagnose(window, base)
            alone = diagnose(base).verdict.top.mechanism if base is not None else ""
            yield make_case(
                diag,
                dict(truth),
                scenario=name,
                scale=window.world_size,
                seed=0,
                seconds=time.perf_counter() - t0,
                baseline_alone=alone,
                suite="real",
            )


SIM_INTRO = (
    "Each run is diagnosed against a healthy baseline of the same job (same drawn "
    "configuration, no fault, its own noise). Seeds redraw magnitudes, noise, "
    "tensor-parallel degree and fault targets."
)
REAL_INTRO = (
    "Real torchrun (gloo) jobs from `examples/faultcases.py`, each reporting to a local hub, "
    "diagnosed against the healthy run its case brings."
)


def summarize(
    results: list[Case],
    args_line: str,
    seconds: float,
    real: list[Case] | None = None,
    real_errors: list[tuple[str, str]] | None = None,
) -> str:
    """The Markdown section: one part for the simulated scenarios, one for real jobs.

    Args:
        results: scored simulated runs.
        args_line: the command that produced them.
        seconds: wall time of the whole evaluation.
        real: scored real jobs (None: ``--real`` was not asked for).
        real_errors: ``(case, error)`` for real jobs that did not run.

    Returns:
        Markdown text.
    """
    n = len(results) + len(real or [])
    out = [
        "## Diagnosis accuracy (`rankscope eval`)",
        "",
        f"`{args_line}` — {n} runs in {seconds:.0f} s.",
        "",
    ]
    if results:
        out.append(render(results, "Simulated scenarios", SIM_INTRO))
    if real is not None:
        text = render(real, "Real jobs", REAL_INTRO) if real else "### Real jobs\n"
        if real_errors:
            text += "\nJobs that did not run:\n\n"
            text += "".join(f"- {name}: {err}\n" for name, err in real_errors)
        out.append(text)
    return "\n".join(out).rstrip() + "\n"


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
        raise EvalError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise EvalError(f"{what} must be positive integers, got {text!r}")
    return vals


def _names(text: str | None, known: list[str], what: str) -> list[str]:
    if not text:
        return known
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad:
        raise EvalError(f"unknown {what} {bad}; known: {', '.join(known)}")
    return names


def _results_path(arg: str | None) -> Path | None:
    if arg is None:
        return None
    if arg != _DEFAULT_RESULTS:
        return Path(arg)
    if not RESULTS.is_file():
        raise EvalError(
            f"--write-results without a path needs a source checkout ({RESULTS} not found); "
            "give a path"
        )
    return RESULTS


def _progress(i: int, total: int, c: Case) -> None:
    mark = "ok " if c.correct else "XX "
    seed = f" seed {c.seed}" if c.suite == "sim" else ""
    print(
        f"[{i}/{total}] {mark}{c.scenario:24s} {c.scale:5d} ranks{seed}: "
        f"truth {c.truth} -> {c.predicted} ({c.score:.2f}) {c.seconds:.1f}s",
        file=sys.stderr,
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except EvalError as exc:
        print(f"rankscope eval: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    scales = _ints(args.scales, "--scales")
    steps = _ints(str(args.steps), "--steps")
    if len(steps) == 1:
        steps = steps * len(scales)
    if len(steps) != len(scales):
        raise EvalError(f"--steps needs one value or one per scale ({len(scales)})")
    n_seeds = _ints(str(args.seeds), "--seeds")
    if len(n_seeds) == 1:
        n_seeds = n_seeds * len(scales)
    if len(n_seeds) != len(scales):
        raise EvalError(f"--seeds needs one value or one per scale ({len(scales)})")
    if min(steps) < 8:
        raise EvalError("--steps must be >= 8")
    if args.no_sim and not args.real:
        raise EvalError("--no-sim leaves nothing to run without --real")
    if args.real_cases and not args.real:
        raise EvalError("--real-cases needs --real")
    scenarios = [] if args.no_sim else _names(args.scenarios, catalog(), "scenario(s)")
    results_path = _results_path(args.write_results)
    jobs: ModuleType | None = None
    real_names: list[str] = []
    if args.real:
        jobs = load_faultcases()
        real_names = _names(args.real_cases, list(jobs.CASES), "real case(s)")

    seeds = [list(range(args.first_seed, args.first_seed + k)) for k in n_seeds]
    t0 = time.perf_counter()
    total = len(scenarios) * sum(n_seeds) + len(real_names)
    results: list[Case] = []
    for c in cases(scenarios, scales, seeds, steps, not args.no_baseline):
        results.append(c)
        _progress(len(results), total, c)
    real: list[Case] | None = None
    errors: list[tuple[str, str]] = []
    if jobs is not None:
        real = []
        for item in real_cases(jobs, real_names, not args.no_baseline):
            if isinstance(item, Case):
                real.append(item)
                _progress(len(results) + len(real) + len(errors), total, item)
            else:
                errors.append(item)
                print(f"rankscope eval: real job {item[0]} did not run: {item[1]}", file=sys.stderr)
    cmd = "rankscope eval"
    if scenarios:
        cmd += f" --scales {','.join(map(str, scales))} --seeds {args.seeds}"
        cmd += f" --steps {','.join(map(str, steps))}"
    cmd += " --no-baseline" if args.no_baseline else ""
    cmd += " --real" if args.real else ""
    section = summarize(results, cmd, time.perf_counter() - t0, real, errors)
    if args.json:
        doc: dict[str, Any] = {"schema": "rankscope.eval/1", "command": cmd}
        if scenarios:
            doc["sim"] = to_json(results)
        if real is not None:
            doc["real"] = {**to_json(real), "errors": [list(e) for e in errors]}
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(section)
    if results_path is not None:
        write_section(results_path, section)
        print(f"rankscope eval: wrote the eval section of {results_path}", file=sys.stderr)
    return 1 if errors else 0
