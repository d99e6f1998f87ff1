"""Scoring for ``rankscope eval``: one scored run per `Case`, and the tables over them.

A run's outcome is one of five, and they never overlap (ARCHITECTURE §9 names the targets):

- ``correct``: the top verdict is the truth (a healthy run called healthy included);
- ``missed``: an injected fault called ``healthy``, the worst error; each one is listed;
- ``false_alarm``: a healthy run called faulty;
- ``unexplained_localised``: a fault called ``unexplained_straggler`` whose implicated rank,
  host or pipeline stage is the truth's: found but not explained, reported apart and not
  counted as top-1 correct;
- ``wrong_name``: a fault called by another fault's name (an ``unexplained_straggler``
  that points at the wrong place included).

Localisation compares the top hypothesis with what the truth names: ranks (its first
implicated rank is one of the truth's; a slow group drags its peers, so it may name more),
hosts and rails (the same set), and the pipeline stage (``truth["stage"]`` against the
hypothesis's ``stage`` where it has one, else the ``pp`` mesh coordinate of its first
implicated rank). ``warmup_steps`` in the truth is checked against the diagnosis's
``warmup_steps`` where the diagnosis exposes one (n/a otherwise).

Nothing here runs a simulation or a job; `rankscope.commands.eval_` does, and the tests
score hand-made cases directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rankscope.collector.schema import MECHANISMS

HEALTHY = "healthy"
UNEXPLAINED = "unexplained_straggler"
OUTCOMES = ("correct", "missed", "false_alarm", "unexplained_localised", "wrong_name")
"""Every run has exactly one of these."""
WARMUP_TOLERANCE = 2
"""Steps by which a found warm-up may differ from the truth's and still count (or a quarter
of the truth's length, whichever is larger)."""


@dataclass(frozen=True)
class Case:
    """One scored run."""

    scenario: str
    """Scenario name (simulated) or case name (real job)."""
    scale: int
    """World size."""
    seed: int
    """Seed of the simulated run (0 for a real job)."""
    truth: str
    """The mechanism injected (``healthy`` where none acts in this run)."""
    predicted: str
    """The top verdict."""
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
    stage_ok: bool | None = None
    """Implicated pipeline stage right (None where the truth names no stage, the verdict
    is wrong, or nothing says which stage the verdict implicates)."""
    localised: bool | None = None
    """The top hypothesis names the truth's rank, host or stage, whatever its mechanism
    (None where the truth names none of them)."""
    warmup_truth: int | None = None
    """``truth["warmup_steps"]`` (None where the truth has none)."""
    warmup_found: int | None = None
    """``Diagnosis.warmup_steps`` (None where the diagnosis does not expose it)."""
    suite: str = "sim"
    """``sim`` (the simulated catalogue) or ``real`` (torchrun jobs)."""
    detail: dict[str, Any] = field(default_factory=dict)
    alternatives: tuple[str, ...] = ()
    """Mechanisms the truth counts as equally right (``truth["alternatives"]``: a real
    case whose machine cannot tell them apart, two CPU ranks and no device telemetry)."""

    @property
    def correct(self) -> bool:
        return self.predicted in (self.truth, *self.alternatives)

    @property
    def outcome(self) -> str:
        """One of `OUTCOMES`."""
        if self.correct:
            return "correct"
        if self.truth == HEALTHY:
            return "false_alarm"
        if self.predicted == HEALTHY:
            return "missed"
        if self.predicted == UNEXPLAINED and self.localised:
            return "unexplained_localised"
        return "wrong_name"

    @property
    def warmup_recognised(self) -> bool | None:
        """Whether the diagnosis found the truth's warm-up (None: no warm-up, or n/a)."""
        if not self.warmup_truth or self.warmup_found is None:
            return None
        tol = max(WARMUP_TOLERANCE, self.warmup_truth // 4)
        return self.warmup_found > 0 and abs(self.warmup_found - self.warmup_truth) <= tol

    @property
    def label(self) -> str:
        """Where the run came from, for lists: ``scenario @ N ranks, seed S``."""
        seed = f", seed {self.seed}" if self.suite == "sim" else ""
        return f"{self.scenario} @ {self.scale} ranks{seed}"


# --- one run -------------------------------------------------------------------------------


def _set_ok(predicted: Any, truth: list[Any]) -> bool | None:
    if not truth:
        return None
    return set(map(str, predicted)) == set(map(str, truth))


def _stage_of(diag: Any, hyp: Any) -> int | None:
    """The pipeline stage a hypothesis implicates: its own ``stage`` where it has one, else
    the ``pp`` coordinate of its first implicated rank in the diagnosed window."""
    stage = getattr(hyp, "stage", None)
    if stage is not None:
        return int(stage)
    if not hyp.ranks:
        return None
    window = getattr(diag, "window", None)
    mesh = getattr(getattr(window, "ranks", None), "mesh", None) or {}
    pp = mesh.get("pp")
    r = int(hyp.ranks[0])
    if pp is None or not 0 <= r < len(pp) or int(pp[r]) < 0:
        return None
    return int(pp[r])


def localise(diag: Any, truth: dict[str, Any]) -> dict[str, bool | None]:
    """Whether the top hypothesis points where the truth does, whatever its mechanism.

    Args:
        diag: a `rankscope.diagnosis.engine.Diagnosis`.
        truth: the run's ground truth (``mechanism``; optionally ``ranks``, ``hosts``,
            ``rails``, ``stage``).

    Returns:
        ``{"ranks", "hosts", "rails", "stage"}``, each True/False, or None where the truth
        names none (or, for the stage, nothing says which stage the verdict implicates).
    """
    top = diag.verdict.top
    ranks = None
    if truth.get("ranks"):
        ranks = bool(top.ranks) and int(top.ranks[0]) in {int(r) for r in truth["ranks"]}
    stage = None
    if truth.get("stage") is not None:
        found = _stage_of(diag, top)
        stage = None if found is None else found == int(truth["stage"])
    return {
        "ranks": ranks,
        "hosts": _set_ok(top.hosts, truth.get("hosts", [])),
        "rails": _set_ok(top.rails, truth.get("rails", [])),
        "stage": stage,
    }


def score_case(diag: Any, truth: dict[str, Any]) -> tuple[bool | None, bool | None, bool | None]:
    """Whether the top hypothesis names the afflicted ranks, hosts and rails.

    Ranks: the first implicated rank is one of the truth's (a slow group drags its peers,
    so the verdict may name more). Hosts and rails: the same set as the truth's. None where
    the truth names none or the mechanism is wrong.
    """
    if diag.verdict.top.mechanism not in (truth["mechanism"], *truth.get("alternatives", ())):
        return None, None, None
    loc = localise(diag, truth)
    return loc["ranks"], loc["hosts"], loc["rails"]


def make_case(
    diag: Any,
    truth: dict[str, Any],
    *,
    scenario: str,
    scale: int,
    seed: int,
    seconds: float,
    baseline_alone: str = "",
    suite: str = "sim",
) -> Case:
    """Score one diagnosis against its truth.

    Args:
        diag: the `Diagnosis` of the run (against its baseline where it has one).
        truth: the run's ground truth.
        scenario: scenario or case name.
        scale: world size.
        seed: the run's seed (0 for a real job).
        seconds: time the run and its diagnosis took.
        baseline_alone: the top verdict on the baseline diagnosed alone ("" if none).
        suite: ``sim`` or ``real``.

    Returns:
        The scored `Case`.
    """
    hyps = diag.verdict.hypotheses
    top = hyps[0]
    loc = localise(diag, truth)
    also = tuple(str(m) for m in truth.get("alternatives", ()))
    right = top.mechanism in (truth["mechanism"], *also)
    named = [loc[k] for k in ("ranks", "hosts", "stage") if loc[k] is not None]
    warm = truth.get("warmup_steps")
    found = getattr(diag, "warmup_steps", None)
    return Case(
        scenario=scenario,
        scale=scale,
        seed=seed,
        truth=truth["mechanism"],
        predicted=top.mechanism,
        score=float(top.score),
        runner_up=hyps[1].mechanism if len(hyps) > 1 else "",
        rank_ok=loc["ranks"] if right else None,
        host_ok=loc["hosts"] if right else None,
        rail_ok=loc["rails"] if right else None,
        stage_ok=loc["stage"] if right else None,
        localised=any(named) if named else None,
        magnitude=float(truth.get("magnitude", float("nan"))),
        seconds=seconds,
        baseline_alone=baseline_alone,
        warmup_truth=None if warm is None else int(warm),
        warmup_found=None if found is None else int(found),
        suite=suite,
        alternatives=also,
        detail={
            "truth": truth,
            "top": {
                "ranks": [int(r) for r in top.ranks[:16]],
                "hosts": list(top.hosts),
                "rails": [int(r) for r in top.rails],
                "impact": float(top.impact),
            },
        },
    )


# --- the tables ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fraction:
    """``ok`` of ``n`` (n = 0: not applicable)."""

    ok: int
    n: int

    @property
    def rate(self) -> float | None:
        return self.ok / self.n if self.n else None

    def __str__(self) -> str:
        return f"{self.ok}/{self.n} ({100 * self.ok / self.n:.1f} %)" if self.n else "n/a"


def _known(flags: list[bool | None]) -> Fraction:
    known = [f for f in flags if f is not None]
    return Fraction(sum(known), len(known))


@dataclass(frozen=True)
class Scores:
    """Every count the eval reports over a set of runs."""

    runs: int
    top1: Fraction
    """Runs whose top verdict is the truth, of all runs."""
    missed: Fraction
    """Faults called healthy, of fault runs."""
    false_alarms: Fraction
    """Healthy runs called faulty, of healthy runs."""
    wrong_name: Fraction
    """Faults called by another fault's name, of fault runs."""
    unexplained_localised: Fraction
    """Faults called ``unexplained_straggler`` at the right rank/host/stage, of fault runs."""
    baseline_alarms: Fraction
    """Healthy baselines diagnosed alone that raised an alarm, of baselines."""
    localisation: dict[str, Fraction]
    """``ranks``, ``hosts``, ``rails``, ``stage``: right where the truth names them and the
    mechanism is right."""
    warmup: Fraction | None
    """Warm-ups recognised, of runs whose truth has one; None where the diagnosis exposes
    no ``warmup_steps`` (n/a) or no truth has a warm-up."""
    warmup_runs: int
    """Runs whose truth has a warm-up."""
    labels: tuple[str, ...]
    """Rows and columns of ``confusion``: every mechanism of the vocabulary, then any
    other name seen."""
    confusion: tuple[tuple[int, ...], ...]
    """``confusion[i][j]``: runs of truth ``labels[i]`` whose top verdict is ``labels[j]``."""
    per_scale: tuple[tuple[int, int, Fraction, Fraction], ...]
    """``(scale, runs, top1, false_alarms)`` per world size."""


def confusion_matrix(
    results: list[Case],
) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """Truth × top verdict over every mechanism of the vocabulary.

    Args:
        results: scored runs.

    Returns:
        ``(labels, matrix)``: `MECHANISMS` (plus any name outside it that a run carries)
        and the counts, rows truth, columns verdict.
    """
    extra = sorted({m for c in results for m in (c.truth, c.predicted)} - set(MECHANISMS))
    labels = (*MECHANISMS, *extra)
    index = {m: i for i, m in enumerate(labels)}
    rows = [[0] * len(labels) for _ in labels]
    for c in results:
        rows[index[c.truth]][index[c.predicted]] += 1
    return labels, tuple(tuple(r) for r in rows)


def score(results: list[Case]) -> Scores:
    """Count everything the eval reports.

    Args:
        results: scored runs (one suite, or any mix).

    Returns:
        The `Scores`.
    """
    faults = [c for c in results if c.truth != HEALTHY]
    healthy = [c for c in results if c.truth == HEALTHY]
    alone = [c for c in results if c.baseline_alone]

    def count(sub: list[Case], outcome: str) -> Fraction:
        return Fraction(sum(c.outcome == outcome for c in sub), len(sub))

    warm = [c for c in results if c.warmup_truth]
    judged = [c.warmup_recognised for c in warm]
    warmup = _known(judged) if any(j is not None for j in judged) else None
    per_scale = []
    for s in sorted({c.scale for c in results}):
        sub = [c for c in results if c.scale == s]
        h = [c for c in sub if c.truth == HEALTHY]
        per_scale.append((s, len(sub), count(sub, "correct"), count(h, "false_alarm")))
    labels, matrix = confusion_matrix(results)
    return Scores(
        runs=len(results),
        top1=count(results, "correct"),
        missed=count(faults, "missed"),
        false_alarms=count(healthy, "false_alarm"),
        wrong_name=count(faults, "wrong_name"),
        unexplained_localised=count(faults, "unexplained_localised"),
        baseline_alarms=Fraction(sum(c.baseline_alone != HEALTHY for c in alone), len(alone)),
        localisation={
            "ranks": _known([c.rank_ok for c in results]),
            "hosts": _known([c.host_ok for c in results]),
            "rails": _known([c.rail_ok for c in results]),
            "stage": _known([c.stage_ok for c in results]),
        },
        warmup=warmup,
        warmup_runs=len(warm),
        labels=labels,
        confusion=matrix,
        per_scale=tuple(per_scale),
    )


def abbreviations(labels: tuple[str, ...]) -> dict[str, str]:
    """Column heads for the confusion matrix: initials (``slow_host_input`` → ``SHI``),
    numbered where two would clash."""
    out: dict[str, str] = {}
    for m in labels:
        base = "".join(w[0] for w in m.split("_") if w).upper() or m
        short, k = base, 2
        while short in out.values():
            short, k = f"{base}{k}", k + 1
        out[m] = short
    return out


def _listing(title: str, cases: list[Case], limit: int, line: Any) -> list[str]:
    if not cases:
        return []
    out = ["", f"{title}:", ""]
    out += [f"- {line(c)}" for c in cases[:limit]]
    if len(cases) > limit:
        out.append(f"- … and {len(cases) - limit} more")
    return out


def render(results: list[Case], heading: str, intro: str) -> str:
    """One suite's Markdown: counts, localisation, per-scale table, the full confusion
    matrix, and every missed fault, false alarm and wrong name listed.

    Args:
        results: the suite's scored runs.
        heading: the section heading (without ``#``).
        intro: a paragraph under the heading (the command, what was run).

    Returns:
        Markdown text.
    """
    s = score(results)
    missed = [c for c in results if c.outcome == "missed"]
    alarms = [c for c in results if c.outcome == "false_alarm"]
    wrong = [c for c in results if c.outcome == "wrong_name"]
    partial = [c for c in results if c.outcome == "unexplained_localised"]
    noisy = [c for c in results if c.baseline_alone and c.baseline_alone != HEALTHY]
    if s.warmup is not None:
        warm = str(s.warmup)
    elif s.warmup_runs:
        warm = f"n/a ({s.warmup_runs} runs have one; the diagnosis reports no warm-up)"
    else:
        warm = "n/a (no run has one)"
    out = [
        f"### {heading}",
        "",
        intro,
        "",
        f"- **top-1 mechanism correct: {s.top1}** (target ≥ 95 %)",
        f"- **faults called healthy (missed): {s.missed}** (target: none)",
        f"- false alarms on healthy runs: {s.false_alarms} (target ≤ 1 %)",
        f"- false alarms on the healthy baselines, each diagnosed alone (no baseline): "
        f"{s.baseline_alarms}",
        f"- faults called by another fault's name: {s.wrong_name}",
        f"- faults localised but unexplained (`unexplained_straggler` at the right "
        f"rank/host/stage; not counted as correct): {s.unexplained_localised}",
    ]
    for what, frac in s.localisation.items():
        out.append(f"- implicated {what} correct (where the truth names them): {frac}")
    out.append(f"- warm-up recognised (where the truth has one): {warm}")
    out += [
        "",
        "Per scale:",
        "",
        "| ranks | runs | top-1 | false alarms |",
        "|---:|---:|---:|---:|",
    ]
    for scale, n, top1, fa in s.per_scale:
        out.append(f"| {scale} | {n} | {top1} | {fa} |")
    short = abbreviations(s.labels)
    out += [
        "",
        "Confusion matrix (rows: truth, columns: top verdict; "
        + ", ".join(f"{short[m]} = {m}" for m in s.labels)
        + "):",
        "",
        "| truth \\ verdict | " + " | ".join(short[m] for m in s.labels) + " |",
        "|---|" + "---:|" * len(s.labels),
    ]
    for m, row in zip(s.labels, s.confusion):
        out.append(f"| {m} | " + " | ".join(str(v) if v else "·" for v in row) + " |")

    def verdict(c: Case) -> str:
        return (
            f"{c.label}: truth {c.truth} (magnitude {c.magnitude:.3g}) -> {c.predicted} "
            f"(score {c.score:.2f})"
        )

    out += _listing("Missed faults (injected, called healthy)", missed, len(missed), verdict)
    out += _listing("False alarms (healthy, called faulty)", alarms, 30, verdict)
    out += _listing("Faults called by another name", wrong, 30, verdict)
    out += _listing("Localised but unexplained", partial, 30, verdict)
    out += _listing(
        "Healthy baselines diagnosed alone that raised an alarm",
        noisy,
        20,
        lambda c: f"baseline of {c.label}: {c.baseline_alone}",
    )
    if not results:
        out += ["", "_No runs._"]
    return "\n".join(out) + "\n"


def to_json(results: list[Case]) -> dict[str, Any]:
    """One suite as plain data: the counts, the confusion matrix and every run.

    Args:
        results: the suite's scored runs.

    Returns:
        ``{"scores": {...}, "confusion": {"labels", "matrix"}, "cases": [...]}``.
    """
    s = score(results)

    def plain(v: Any) -> Any:
        # NaN (a magnitude the truth does not give) is null, as in the diagnosis JSON.
        if isinstance(v, float) and v != v:
            return None
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    def frac(f: Fraction | None) -> dict[str, Any] | None:
        return None if f is None else {"ok": f.ok, "n": f.n, "rate": f.rate}

    return {
        "scores": {
            "runs": s.runs,
            "top1": frac(s.top1),
            "missed": frac(s.missed),
            "false_alarms": frac(s.false_alarms),
            "wrong_name": frac(s.wrong_name),
            "unexplained_localised": frac(s.unexplained_localised),
            "baseline_alarms": frac(s.baseline_alarms),
            "localisation": {k: frac(v) for k, v in s.localisation.items()},
            "warmup": frac(s.warmup),
            "warmup_runs": s.warmup_runs,
        },
        "confusion": {"labels": list(s.labels), "matrix": [list(r) for r in s.confusion]},
        "missed": [c.label for c in results if c.outcome == "missed"],
        "cases": [plain({**asdict(c), "outcome": c.outcome}) for c in results],
    }
