"""Experiment records: a falsifiable perturbation written down before the run.

An experiment states the hypothesis, the one change, the diagnostic metric it should move
and in which direction, and the observation that would reject it — before the run, so the
prediction cannot be fitted to the result. Each record is one JSON file beside the
recording, ``<record>/experiments/<id>.json``. After the run, the evaluation (computed by
`rankscope.diagnosis.experiment`) is added to the same file; the prediction fields are
never rewritten.
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

from rankscope.diagnosis.experiment import METRICS, evaluate
from rankscope.diagnosis.window import Window
from rankscope.launch.safety import UnsafeValueError, check_value

__all__ = [
    "DIRECTIONS",
    "ExperimentError",
    "ExperimentRecord",
    "evaluate_experiment",
    "evaluate_swap",
    "experiments_dir",
    "list_experiments",
    "load_experiment",
    "record_experiment",
    "save_evaluation",
    "swap_from_argv",
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
        now_ns: creation time (default: now), epoch ns.

    Returns:
        The stored record.

    Raises:
        ExperimentError: empty fields, a bad direction or id, or an id already taken (a
            recorded prediction is never overwritten).
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
    ``recorded_before_after_run`` — whether the prediction was written before the first
    step of the after-run that was analysed, so a prediction fitted to its result shows.

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
SWAP_MIN_GAP = 0.02
"""The two ranks must differ by this fraction of the median busy time before the swap for
the swap to say anything."""


def swap_from_argv(argv: Any) -> tuple[str, tuple[int, int]] | None:
    """The swap a run was launched with, read from its recorded command line.

    Args:
        argv: the run manifest's ``argv`` (the simulated launcher writes ``--swap-shards=R1,R2``).

    Returns:
        ``(kind, (r1, r2))`` or None.
    """
    if not isinstance(argv, (list, tuple)):
        return None
    for kind in ("shards", "placement"):
        flag = f"--swap-{kind}="
        for a in argv:
            if isinstance(a, str) and a.startswith(flag) and a[len(flag) :]:
                try:
                    r1, r2 = (int(x) for x in a[len(flag) :].split(","))
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
