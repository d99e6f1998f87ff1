"""Experiment records: a falsifiable perturbation written down before the run.

An experiment states the hypothesis, the one change, the diagnostic metric it should move
and in which direction, and the observation that would reject it — before the run, so the
prediction cannot be fitted to the result. Each record is one JSON file beside the
recording, ``<record>/experiments/<id>.json``. After the run, the evaluation (computed by
`rankscope.diagnosis.experiment`) is added to the same file; the prediction fields are
never rewritten.

**Validation over time.** A record may state the recurrence ``interval`` (steps) of the
original regression: a periodic stall's period, a drift's time scale. The evaluation then
compares the step-time distributions (p50, p99, max and tail stalls, as the ladder defines
them: `rankscope.diagnosis.baseline.distribution` of `job_step_ns`), flags "mean better,
tails worse" beyond `TAIL_P99_TOLERANCE` / `TAIL_STALL_TOLERANCE`, and calls an after-run
with fewer than ``COVER_INTERVALS`` × the interval steady steps too short to validate
(verdict ``too_short``; the measured verdict is kept as ``measured_verdict``). Two
intervals, not one: a window of one period holds a single occurrence of a periodic event
(none, when the period is not a whole number of steps or the first one falls in the
warm-up), so a rate or a tail read from it is a sample of one; two periods show at least
one recurrence, and a drift its continuation.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector.shards import SWAP_ENV
from rankscope.diagnosis.controlled import MIN_GAP
from rankscope.diagnosis.experiment import METRICS, evaluate
from rankscope.diagnosis.window import Window
from rankscope.launch.safety import UnsafeValueError, check_value

__all__ = [
    "COVER_INTERVALS",
    "DIRECTIONS",
    "TAIL_P99_TOLERANCE",
    "TAIL_RULE",
    "TAIL_STALL_TOLERANCE",
    "ExperimentError",
    "ExperimentRecord",
    "distribution_dict",
    "evaluate_experiment",
    "evaluate_swap",
    "experiments_dir",
    "interval_coverage",
    "list_experiments",
    "load_experiment",
    "record_experiment",
    "save_evaluation",
    "save_stages",
    "swap_from_argv",
    "tail_change",
]

DIRECTIONS = ("down", "up")
"""How the predicted metric should move."""


class ExperimentError(ValueError):
    """An experiment cannot be recorded, found or evaluated as asked."""


@dataclass(frozen=True)
class ExperimentRecord:
    """One experiment: the prediction, and once measured, its evaluation."""

    id: str
    hypothesis: str
    """The mechanism under test (a hypothesis name, e.g. ``data_imbalance``)."""
    change: str
    """The one change the after-run makes."""
    metric: str
    """The diagnostic metric the change should move."""
    direction: str
    """``down`` or ``up``."""
    rejection: str
    """The observation that would reject the hypothesis, stated in advance."""
    created: str
    """ISO-8601 UTC time the prediction was recorded."""
    created_ns: int
    """The same instant, epoch ns."""
    parent_run: str | None = None
    """The run the experiment starts from, when known."""
    scope: str | None = None
    """Scope the experiment is meant to run at."""
    before_run: str | None = None
    after_run: str | None = None
    evaluation: dict[str, Any] | None = None
    """The evaluation's plain-data form (verdict, distributions, accounting)."""
    evaluated: str | None = None
    interval: int | None = None
    """Recurrence interval (steps) of the original regression that the after-run must
    cover (periodic stall period, drift time scale); None: not stated."""
    stages: list[dict[str, Any]] | None = None
    """Staged scale-up attempts (`rankscope.launch.stage`), oldest first."""

    @property
    def status(self) -> str:
        """``recorded``, or the evaluation's verdict."""
        if self.evaluation is None:
            return "recorded"
        return str(self.evaluation.get("verdict", "evaluated"))


def experiments_dir(record: str | Path) -> Path:
    """``<record>/experiments``: where a recording's experiment records live."""
    return Path(record) / "experiments"


def _write(path: Path, rec: ExperimentRecord) -> None:
    # Write then rename, so a reader never sees half a record.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(rec), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def _read(path: Path) -> ExperimentRecord:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExperimentError(f"{path}: {exc}") from None
    known = {f.name for f in fields(ExperimentRecord)}
    if not isinstance(data, dict) or not {"id", "hypothesis", "metric"} <= set(data):
        raise ExperimentError(f"{path}: not an experiment record")
    try:
        return ExperimentRecord(**{k: v for k, v in data.items() if k in known})
    except TypeError as exc:
        raise ExperimentError(f"{path}: {exc}") from None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:40] or "experiment"


def record_experiment(
    record: str | Path,
    *,
    hypothesis: str,
    change: str,
    metric: str,
    direction: str,
    rejection: str,
    id: str | None = None,
    parent_run: str | None = None,
    scope: str | None = None,
    interval: int | None = None,
    now_ns: int | None = None,
) -> ExperimentRecord:
    """Write a new experiment record before its run.

    Args:
        record: the recording folder.
        hypothesis: mechanism under test.
        change: the one change.
        metric: diagnostic metric predicted to move (``diagnosis.experiment.METRICS``).
        direction: ``down`` or ``up``.
        rejection: the observation that would reject the hypothesis.
        id: record id (default ``NNN-<hypothesis>``, numbered after the existing ones).
        parent_run: the run the experiment starts from.
        scope: scope the experiment runs at.
        interval: recurrence interval (steps) of the regression the after-run must cover.
        now_ns: creation time (default: now), epoch ns.

    Returns:
        The stored record.

    Raises:
        ExperimentError: empty fields, a bad direction, id or interval, or an id already
            taken (a recorded prediction is never overwritten).
    """
    for name, value in (
        ("hypothesis", hypothesis),
        ("change", change),
        ("metric", metric),
        ("rejection", rejection),
    ):
        if not value or not value.strip():
            raise ExperimentError(f"{name} is empty: an experiment states it before the run")
    if direction not in DIRECTIONS:
        raise ExperimentError(f"direction {direction!r}: expected one of {', '.join(DIRECTIONS)}")
    if metric.strip() not in METRICS:
        # A prediction about something the diagnosis cannot measure can never be judged.
        raise ExperimentError(
            f"unknown metric {metric!r}; measurable: {', '.join(sorted(METRICS))}"
        )
    if interval is not None and (
        not isinstance(interval, int) or isinstance(interval, bool) or interval < 1
    ):
        raise ExperimentError(f"interval {interval!r}: expected a whole number of steps >= 1")
    folder = experiments_dir(record)
    folder.mkdir(parents=True, exist_ok=True)
    if id is None:
        taken = [p.stem for p in folder.glob("*.json")]
        n = 1 + max((int(t.split("-", 1)[0]) for t in taken if t[:3].isdigit()), default=0)
        id = f"{n:03d}-{_slug(hypothesis)}"
    try:
        check_value("id", id, "name")
    except UnsafeValueError as exc:
        raise ExperimentError(str(exc)) from None
    path = folder / f"{id}.json"
    if path.exists():
        raise ExperimentError(f"experiment {id!r} already exists in {folder}")
    t = time.time_ns() if now_ns is None else int(now_ns)
    rec = ExperimentRecord(
        id=id,
        hypothesis=hypothesis.strip(),
        change=change.strip(),
        metric=metric.strip(),
        direction=direction,
        rejection=rejection.strip(),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t / 1e9)),
        created_ns=t,
        parent_run=parent_run,
        scope=scope,
        interval=interval,
    )
    # O_EXCL: two recorders racing for the same id cannot both win.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ExperimentError(f"experiment {id!r} already exists in {folder}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(asdict(rec), indent=2) + "\n")
    return rec


def load_experiment(record: str | Path, id: str) -> ExperimentRecord:
    """Read one experiment record.

    Args:
        record: the recording folder.
        id: the record id.

    Returns:
        The record.

    Raises:
        ExperimentError: no such record (the message lists those that exist).
    """
    try:
        check_value("id", id, "name")
    except UnsafeValueError as exc:
        raise ExperimentError(str(exc)) from None
    path = experiments_dir(record) / f"{id}.json"
    if not path.exists():
        known = ", ".join(r.id for r in list_experiments(record)) or "none"
        raise ExperimentError(f"no experiment {id!r} in {record} (recorded: {known})")
    return _read(path)


def list_experiments(record: str | Path) -> list[ExperimentRecord]:
    """Every experiment record of a recording, oldest first.

    Args:
        record: the recording folder.

    Returns:
        Records sorted by creation time then id; unreadable files are skipped.
    """
    folder = experiments_dir(record)
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out.append(_read(path))
        except ExperimentError:
            continue
    return sorted(out, key=lambda r: (r.created_ns, r.id))


def save_evaluation(
    record: str | Path,
    id: str,
    *,
    before_run: str,
    after_run: str,
    evaluation: dict[str, Any],
    now_ns: int | None = None,
) -> ExperimentRecord:
    """Add the measured evaluation to a record; the prediction fields stay as recorded.

    Args:
        record: the recording folder.
        id: the record id.
        before_run: run measured before the change.
        after_run: run measured with the change.
        evaluation: plain data (JSON-serialisable) from the diagnosis.
        now_ns: evaluation time (default: now).

    Returns:
        The updated record.
    """
    rec = load_experiment(record, id)
    t = time.time_ns() if now_ns is None else int(now_ns)
    json.dumps(evaluation)  # refuse what cannot be stored before touching the file
    rec = replace(
        rec,
        before_run=before_run,
        after_run=after_run,
        evaluation=evaluation,
        evaluated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t / 1e9)),
    )
    _write(experiments_dir(record) / f"{id}.json", rec)
    return rec


def save_stages(record: str | Path, id: str, attempt: dict[str, Any]) -> ExperimentRecord:
    """Add one staged scale-up attempt to a record; the prediction and the evaluation stay
    as they are.

    Args:
        record: the recording folder.
        id: the record id.
        attempt: plain data (JSON-serialisable) from `rankscope.launch.stage`.

    Returns:
        The updated record.
    """
    rec = load_experiment(record, id)
    json.dumps(attempt, allow_nan=False)  # refuse what cannot be stored before touching the file
    rec = replace(rec, stages=[*(rec.stages or []), attempt])
    _write(experiments_dir(record) / f"{id}.json", rec)
    return rec


COVER_INTERVALS = 2
"""An after-run validates a change only when it holds at least this many recurrence
intervals of steady steps (module docstring: why two, not one)."""
TAIL_P99_TOLERANCE = 0.10
"""The after-run's p99 step may exceed the before-run's by this fraction before the tail
counts as worse (a p99 of a few dozen steps is close to their maximum, and noisy)."""
TAIL_STALL_TOLERANCE = 0.10
"""Tail stalls count as worse when the after-run has more than the before-run's stall rate,
scaled to the after-run's length, × (1 + this), plus `TAIL_STALL_SLACK`."""
TAIL_STALL_SLACK = 1
"""Stalls beyond the scaled expectation that still count as noise."""
TAIL_RULE = (
    f"tails worse = p99 > (1 + {TAIL_P99_TOLERANCE:g}) x before's p99, or tail stalls (steps > "
    f"2 x before's p50) > before's stall rate x after's steps x (1 + {TAIL_STALL_TOLERANCE:g}) "
    f"+ {TAIL_STALL_SLACK}"
)


def _get(d: Any, name: str) -> float:
    v = d.get(name) if isinstance(d, dict) else getattr(d, name, None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def distribution_dict(d: Any) -> dict[str, Any]:
    """The step-time summary an evaluation shows: ``n``, ``mean``, ``p50``, ``p90``,
    ``p99``, ``max`` (ns) and ``tail_stalls``.

    Args:
        d: a `rankscope.diagnosis.baseline.Distribution` or its plain-data form.

    Returns:
        Plain data (None for a value that is not finite).
    """
    out: dict[str, Any] = {}
    for k in ("n", "mean", "p50", "p90", "p99", "max", "tail_stalls"):
        v = _get(d, k)
        out[k] = None if not np.isfinite(v) else (int(v) if k in ("n", "tail_stalls") else v)
    return out


def tail_change(before: Any, after: Any) -> dict[str, Any]:
    """Whether the tail of the step-time distribution got worse beyond tolerance
    (`TAIL_RULE`), and whether the mean got better.

    Args:
        before: distribution of the reference run (its p50 defines a stall for both).
        after: distribution of the changed run, computed with ``reference_p50=before.p50``
            (`Distribution` or plain data).

    Returns:
        Plain data: ``mean_better``, ``p99_ratio``, ``p99_worse``, ``stalls_before``,
        ``stalls_after``, ``stalls_expected`` (before's rate at after's length),
        ``stalls_worse``, ``worse`` (p99 or stalls) and the ``rule``.
    """
    n_b, n_a = _get(before, "n"), _get(after, "n")
    p99_b, p99_a = _get(before, "p99"), _get(after, "p99")
    st_b, st_a = _get(before, "tail_stalls"), _get(after, "tail_stalls")
    ratio = p99_a / p99_b if np.isfinite(p99_b) and p99_b > 0 else float("nan")
    p99_worse = bool(np.isfinite(ratio) and ratio > 1.0 + TAIL_P99_TOLERANCE)
    expected = st_b / n_b * n_a if n_b > 0 and np.isfinite(n_a) else float("nan")
    stalls_worse = bool(
        np.isfinite(expected) and st_a > expected * (1.0 + TAIL_STALL_TOLERANCE) + TAIL_STALL_SLACK
    )
    m_b, m_a = _get(before, "mean"), _get(after, "mean")
    return {
        "mean_better": bool(np.isfinite(m_b) and np.isfinite(m_a) and m_a < m_b),
        "p99_ratio": ratio if np.isfinite(ratio) else None,
        "p99_worse": p99_worse,
        "stalls_before": int(st_b) if np.isfinite(st_b) else None,
        "stalls_after": int(st_a) if np.isfinite(st_a) else None,
        "stalls_expected": float(expected) if np.isfinite(expected) else None,
        "stalls_worse": stalls_worse,
        "worse": p99_worse or stalls_worse,
        "rule": TAIL_RULE,
    }


def interval_coverage(interval: int | None, before_steps: int, after_steps: int) -> dict[str, Any]:
    """Whether a before/after pair is long enough for a recurrence interval.

    Args:
        interval: the record's interval (steps), or None.
        before_steps: steady steps of the before-run that were analysed.
        after_steps: steady steps of the after-run that were analysed.

    Returns:
        Plain data: ``interval``, ``required_steps`` (`COVER_INTERVALS` × interval),
        ``before_steps``, ``after_steps``, ``covered`` (the after-run holds the required
        steps; None without an interval), ``before_covered`` and the ``rule``.
    """
    need = None if interval is None else COVER_INTERVALS * int(interval)
    return {
        "interval": interval,
        "required_steps": need,
        "before_steps": int(before_steps),
        "after_steps": int(after_steps),
        "covered": None if need is None else bool(after_steps >= need),
        "before_covered": None if need is None else bool(before_steps >= need),
        "rule": f"the after-run holds at least {COVER_INTERVALS} x the interval in steady steps",
    }


def _first_step_ns(window: Window) -> int | None:
    t = np.where(window.present, window.t_start, np.nan)
    if not np.isfinite(t).any():
        return None
    return int(window.t0_ns + float(np.nanmin(t)))


def evaluate_experiment(
    record: str | Path, id: str, before: Window, after: Window, *, now_ns: int | None = None
) -> ExperimentRecord:
    """Judge a recorded experiment from its before and after runs and save the result.

    The judgement is `rankscope.diagnosis.experiment.evaluate` (verdict supported /
    rejected / improved_other, distributions, closed accounting). Added here:

    - ``recorded_before_after_run``: whether the prediction was written before the first
      step of the after-run that was analysed, so a prediction fitted to its result shows;
    - ``distribution`` {``before``, ``after``}: the steady step-time distributions (p50,
      p90, p99, max, tail stalls; `distribution_dict`), ``tails`` (`tail_change`) and
      ``tails_worse``: the mean got better while p99 or the tail stalls got worse beyond
      tolerance ("mean better, tails worse");
    - ``covers_interval`` and ``interval_check`` (`interval_coverage`): with a recorded
      interval, an after-run shorter than `COVER_INTERVALS` intervals is too short to
      validate: ``verdict`` becomes ``too_short`` and the measured one is kept as
      ``measured_verdict``.

    Args:
        record: the recording folder.
        id: the experiment id.
        before: window of the run before the change.
        after: window of the run with the change.
        now_ns: evaluation time (default: now).

    Returns:
        The updated record (``evaluation`` holds the plain-data result).

    Raises:
        ExperimentError: unknown id, or the record cannot be judged.
    """
    rec = load_experiment(record, id)
    try:
        result = evaluate(before, after, rec)
    except ValueError as exc:
        raise ExperimentError(f"experiment {id!r}: {exc}") from None
    data = result.to_dict()
    first = _first_step_ns(after)
    data["recorded_before_after_run"] = None if first is None else bool(rec.created_ns < first)
    data["after_first_step_ns"] = first
    sb, sa = result.step_before, result.step_after
    data["distribution"] = {"before": distribution_dict(sb), "after": distribution_dict(sa)}
    tails = tail_change(sb, sa)
    data["tails"] = tails
    data["tails_worse"] = bool(tails["mean_better"] and tails["worse"])
    notes = list(data.get("notes") or ())
    if data["tails_worse"]:
        what = []
        if tails["p99_worse"]:
            what.append(f"p99 {tails['p99_ratio']:.2f}x")
        if tails["stalls_worse"]:
            what.append(f"tail stalls {tails['stalls_before']} -> {tails['stalls_after']}")
        notes.append(
            f"mean better, tails worse: {', '.join(what)} (tolerance: p99 "
            f"+{TAIL_P99_TOLERANCE:.0%}, stalls +{TAIL_STALL_TOLERANCE:.0%} + {TAIL_STALL_SLACK})"
        )
    cover = interval_coverage(rec.interval, sb.n, sa.n)
    data["interval_check"] = cover
    data["covers_interval"] = cover["covered"]
    if cover["covered"] is False:
        data["measured_verdict"] = data["verdict"]
        data["verdict"] = "too_short"
        notes.append(
            f"too short to validate: the after-run has {sa.n} steady steps, the recorded "
            f"interval of {rec.interval} steps needs {cover['required_steps']} "
            f"({COVER_INTERVALS} intervals); measured verdict {data['measured_verdict']}, "
            "not called supported"
        )
    elif cover["before_covered"] is False:
        notes.append(
            f"the before-run has {sb.n} steady steps, under {cover['required_steps']} "
            f"({COVER_INTERVALS} x the interval): its tail may miss the recurrence"
        )
    data["notes"] = notes
    return save_evaluation(
        record, id, before_run=before.run, after_run=after.run, evaluation=data, now_ns=now_ns
    )


SWAP_OUTCOMES = {
    "shards": ("follows the shard", "stays with the device", "neither"),
    "placement": ("follows the device", "stays with the rank", "moves with the placement"),
}
"""The three outcomes of a swap: the slowness moved with what was swapped, stayed with what
was kept, or left the pair (for a placement swap: the groups' placement, topology)."""
SWAP_MEANS = {
    "follows the shard": "data",
    "stays with the device": "hardware",
    "neither": "neither data nor device alone",
    "follows the device": "hardware",
    "stays with the rank": "data or role",
    "moves with the placement": "topology",
}
SWAP_MIN_GAP = MIN_GAP
"""The two ranks must differ by this fraction of the median busy time before the swap for
the swap to say anything (the diagnosis proposes a swap only above it)."""


def swap_from_argv(argv: Any, env: Any = None) -> tuple[str, tuple[int, int]] | None:
    """The swap a run was launched with, read from its recorded command line or, for a
    real workload, its environment.

    Args:
        argv: the run manifest's ``argv`` (the simulated launcher writes ``--swap-shards=R1,R2``).
        env: the run manifest's ``env`` (a real rerun's ``RANKSCOPE_SWAP_SHARDS=R1,R2``).

    Returns:
        ``(kind, (r1, r2))`` or None.
    """
    given: list[tuple[str, Any]] = []
    if isinstance(argv, (list, tuple)):
        for kind in ("shards", "placement"):
            flag = f"--swap-{kind}="
            given += [
                (kind, a[len(flag) :]) for a in argv if isinstance(a, str) and a.startswith(flag)
            ]
    if isinstance(env, dict) and env.get(SWAP_ENV):
        given.append(("shards", env[SWAP_ENV]))
    for kind, text in given:
        try:
            r1, r2 = (int(x) for x in str(text).split(","))
        except ValueError:
            return None
        return kind, (r1, r2)
    return None


WARMUP_FACTOR = 1.1
"""Steps whose median busy time (over ranks) exceeds this multiple of the window's median are
warm-up and left out of a swap's judgement (they are slow on every rank for the device's
reasons, not the data's)."""


def _busy_by_step(window: Window) -> dict[int, np.ndarray]:
    from rankscope.diagnosis.critical import busy_ns
    from rankscope.launch.ladder import decomposition

    busy = np.where(window.present, busy_ns(window, decomposition(window)), np.nan)
    return {int(k): busy[:, j] for j, k in enumerate(window.steps)}


def _mean_busy_ns(window: Window) -> np.ndarray:
    by_step = _busy_by_step(window)
    busy = np.stack(list(by_step.values()), axis=1) if by_step else np.zeros((0, 0))
    out = np.full(window.world_size, np.nan)
    seen = np.isfinite(busy).any(axis=1) if busy.size else np.zeros(window.world_size, bool)
    out[seen] = np.nanmean(busy[seen], axis=1)
    return out


def evaluate_swap(
    before: Window, after: Window, kind: str, ranks: tuple[int, int]
) -> dict[str, Any]:
    """Say where the slowness of a swapped pair went.

    The rerun replays the parent's seed and steps, so step by step the two ranks' gap in
    busy time (step time minus waiting) after the swap is regressed on their gap before it
    (warm-up steps left out): a coefficient near +1 means the gap stayed with the ranks'
    devices, near -1 that it followed what was swapped, near 0 that it left the pair.
    A data imbalance moves from step to step between ranks, so a step-aligned comparison
    sees it where a mean over the window would average it away.

    Args:
        before: the run without the swap (same rank numbering as ``after``).
        after: the rerun with the swap.
        kind: ``shards`` or ``placement``.
        ranks: the two swapped ranks.

    Returns:
        Plain data: ``outcome``, ``means`` (data / hardware / topology...), ``verdict``,
        ``slow_rank`` before (over the window), the rms gaps (ns), the ``ratio`` and the
        ``steps`` compared.

    Raises:
        ValueError: unknown kind, ranks outside either run, too few common steps, or no
            gap to follow.
    """
    if kind not in SWAP_OUTCOMES:
        raise ValueError(f"unknown swap {kind!r}")
    a, b = (int(r) for r in ranks)
    for w in (before, after):
        if not (0 <= a < w.world_size and 0 <= b < w.world_size) or a == b:
            raise ValueError(f"ranks {a},{b} are not two ranks of run {w.run!r}")
    s0, s1 = _busy_by_step(before), _busy_by_step(after)
    common = sorted(set(s0) & set(s1))
    common = [k for k in common if np.isfinite([s0[k][[a, b]], s1[k][[a, b]]]).all()]
    if common:
        med = np.array([np.nanmedian(s0[k]) for k in common])
        common = [k for k, m in zip(common, med) if m <= WARMUP_FACTOR * np.median(med)]
    if len(common) < 3:
        raise ValueError(
            f"runs {before.run!r} and {after.run!r} share {len(common)} steady steps where "
            f"ranks {a} and {b} both reported; the rerun must replay the parent's steps"
        )
    g0 = np.array([s0[k][a] - s0[k][b] for k in common])
    g1 = np.array([s1[k][a] - s1[k][b] for k in common])
    scale = float(np.median([np.nanmedian(s0[k]) for k in common]))
    rms0 = float(np.sqrt(np.mean(g0**2)))
    if rms0 < SWAP_MIN_GAP * scale:
        raise ValueError(
            f"ranks {a} and {b} differ by {rms0 / 1e6:.2f} ms of busy time before the swap "
            f"(under {SWAP_MIN_GAP:.0%} of {scale / 1e6:.1f} ms): nothing to follow; swap the "
            "slow rank with a healthy one"
        )
    ratio = float(np.sum(g0 * g1) / np.sum(g0**2))
    moved, stayed, other = SWAP_OUTCOMES[kind]
    outcome = stayed if ratio > 0.5 else moved if ratio < -0.5 else other
    return {
        "swap": kind,
        "ranks": [a, b],
        "before_run": before.run,
        "after_run": after.run,
        "slow_rank": a if float(np.mean(g0)) >= 0 else b,
        "gap_before_ns": rms0,
        "gap_after_ns": float(np.sqrt(np.mean(g1**2))),
        "ratio": ratio,
        "steps": common,
        "outcome": outcome,
        "means": SWAP_MEANS[outcome],
        "verdict": f"{outcome} → {SWAP_MEANS[outcome]}",
    }
