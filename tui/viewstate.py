"""Pins and view choices persisted per job, so reopening a job shows the same ranks.

One small JSON file per job in the state folder (``Settings.state_dir()``). Files are
written atomically (temporary file, then rename), so two viewers of one job never leave a
half-written file; the last writer wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rankscope.tui.settings import GROUP_BY, METRICS

FORMAT = 1


@dataclass(frozen=True)
class SavedView:
    """What is remembered about one job's view."""

    metric: str = "lateness"
    group_by: str = "host"
    pins: tuple[int, ...] = ()
    baseline_run: str | None = None
    pins_run: str | None = None
    """The run the pins were made on. Ranks are numbers of one launch: rank 37 of a
    restarted or rescaled job may run on another host, so pins are only restored on that
    run (None, from an older file: restored on none)."""


def state_path(state_dir: Path, job: str) -> Path:
    """The file that holds ``job``'s view.

    Args:
        state_dir: the state folder.
        job: the job name (any text; it is sanitized and suffixed with a short hash so two
            names that sanitize alike never share a file).

    Returns:
        The path (it may not exist).
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", job)[:60] or "job"
    digest = hashlib.sha1(job.encode("utf-8")).hexdigest()[:8]
    return state_dir / "views" / f"{safe}-{digest}.json"


def load_view(state_dir: Path, job: str) -> SavedView | None:
    """Read a job's saved view.

    A missing, unreadable or malformed file yields None (the defaults apply); values that
    are no longer valid (a metric name from another version) are dropped one by one.

    Args:
        state_dir: the state folder.
        job: the job name.

    Returns:
        The saved view, or None.
    """
    path = state_path(state_dir, job)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    metric = data.get("metric")
    group_by = data.get("group_by")
    pins = data.get("pins")
    baseline = data.get("baseline_run")
    pins_run = data.get("pins_run")
    return SavedView(
        metric=metric if isinstance(metric, str) and metric in METRICS else "lateness",
        group_by=group_by if isinstance(group_by, str) and group_by in GROUP_BY else "host",
        pins=tuple(p for p in pins if isinstance(p, int) and not isinstance(p, bool) and p >= 0)
        if isinstance(pins, list)
        else (),
        baseline_run=baseline if isinstance(baseline, str) else None,
        pins_run=pins_run if isinstance(pins_run, str) else None,
    )


def save_view(state_dir: Path, job: str, view: SavedView) -> Path:
    """Write a job's view atomically.

    Args:
        state_dir: the state folder (created if needed).
        job: the job name.
        view: what to remember.

    Returns:
        The file written.
    """
    path = state_path(state_dir, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "job": job, **asdict(view)}
    data["pins"] = list(view.pins)
    fd, tmp = tempfile.mkstemp(prefix=".view-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
