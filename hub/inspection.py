"""What a recording holds, as one JSON-ready report (``rankscope inspect``).

The report replays the recording through the hub's own intake, then summarises each run
over its whole life (not only the store's window): step-time distribution, who arrived last
and how late, collector drops, clock-alignment error, and what the reader had to skip.

Step time of a step is the slowest rank's ``t_end - t_start``: synchronous training moves
at the pace of its slowest rank. Lateness of a rank in an instance is ``t_enter - first``
(ARCHITECTURE §6); its mean is over the complete instances the rank took part in.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rankscope.hub.recording import FORMAT_VERSION, ReadReport, read_meta
from rankscope.hub.replay import load
from rankscope.hub.store import Store


def _num(x: float) -> float | None:
    """JSON has no NaN: unknown numbers become null."""
    return None if x is None or not np.isfinite(x) else float(x)


def _dist(values: np.ndarray) -> dict[str, Any]:
    v = values[np.isfinite(values)]
    if v.shape[0] == 0:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {
        "n": int(v.shape[0]),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(v.max()),
        "mean": float(v.mean()),
    }


def run_report(store: Store, run: str) -> dict[str, Any]:
    """The report of one run of a (settled) store; see `inspect_recording` for the keys."""
    summary = next(s for s in store.runs() if s.run == run)
    totals = store.totals(run)
    w = store.window(run, last=1)
    R = summary.world_size
    health = store.health
    clock = health["clock_error_ns"].get(run, {})
    clock_arr = np.array([clock.get(r, np.nan) for r in range(R)], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        lateness = np.where(totals.done_rows > 0, totals.late_ns / totals.done_rows, np.nan)
    n_done = int(totals.instances_complete)
    order = np.argsort(-totals.times_last, kind="stable")
    top = [
        {
            "rank": int(r),
            "count": int(totals.times_last[r]),
            "share": (float(totals.times_last[r]) / n_done) if n_done else None,
        }
        for r in order[: min(5, R)]
        if totals.times_last[r] > 0
    ]
    info = w.ranks
    ranks = [
        {
            "rank": r,
            "host": info.hosts[info.host[r]] if info.host[r] >= 0 else None,
            "node_rank": int(info.node_rank[r]),
            "local_rank": int(info.local_rank[r]),
            "gpu_index": int(info.gpu_index[r]),
            "rail": int(info.rail[r]),
            "incarnation": int(info.incarnation[r]),
        }
        for r in range(R)
    ]
    run_health = store.run_health(run)
    return {
        "job": summary.job,
        "run": summary.run,
        "scope": summary.scope,
        "parent_run": summary.parent_run,
        "world_size": R,
        "ranks_seen": summary.n_ranks_seen,
        "hosts": list(summary.hosts),
        "ranks": ranks,
        "steps": {
            "first": summary.first_step,
            "last": summary.last_step,
            "count": int(totals.steps.shape[0]),
            "complete": int((totals.ranks_reporting == R).sum()),
        },
        "step_time_ns": _dist(totals.step_ns),
        "collectives": {
            "rows": int(totals.coll_rows.sum()),
            "instances_complete": n_done,
            "instances_incomplete": int(totals.instances_incomplete),
        },
        "last_arriver": {"counts": totals.times_last.astype(int).tolist(), "top": top},
        "lateness_mean_ns": [_num(x) for x in lateness],
        "drops": run_health["drops"],
        "collector_errors": run_health["collector_errors"],
        "clock_error_ns": {
            "max": _num(np.nanmax(clock_arr)) if np.isfinite(clock_arr).any() else None,
            "median": _num(np.nanmedian(clock_arr)) if np.isfinite(clock_arr).any() else None,
            "per_rank": [_num(x) for x in clock_arr],
        },
    }


def inspect_recording(
    path: str | os.PathLike[str], run: str | None = None, history_steps: int = 512
) -> dict[str, Any]:
    """Replay a recording and describe it.

    Args:
        path: recording directory (or one segment file).
        run: only this run id (all runs when None).
        history_steps: the store's dense window while replaying (lifetime figures do not
            depend on it).

    Returns:
        A JSON-ready dict (keys documented in the README's ``rankscope inspect`` table).

    Raises:
        RecordingError: no recording at ``path``.
        KeyError: ``run`` is not in the recording.
    """
    report = ReadReport()
    store = load(path, report=report, history_steps=history_steps)
    ids = store.run_ids()
    if run is not None:
        if run not in ids:
            raise KeyError(f"run {run!r} is not in {path} (runs: {', '.join(ids) or 'none'})")
        ids = [run]
    version = read_meta(path).get("version", FORMAT_VERSION)
    recorded = store.health["recorded"]
    return {
        "path": str(path),
        "format_version": version if isinstance(version, int) else FORMAT_VERSION,
        "sessions": recorded["sessions"],
        "frames": report.frames,
        "bytes": report.bytes,
        "skipped": store.health["recording"]["skipped"],
        "skipped_bytes": report.skipped_bytes,
        "rejects": recorded["rejects"],
        "replay_rejects": store.health["rejects"],
        "transport": recorded["transport"],
        "scopes": sorted({s.scope for s in store.runs() if s.run in ids}),
        "runs": [run_report(store, r) for r in ids],
    }
