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
    "experiments_dir",
    "list_experiments",
    "load_experiment",
    "record_experiment",
    "save_evaluation",
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
