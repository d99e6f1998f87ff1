"""Snapshot bundles: the evidence of an incident in one folder, ready for a ticket.

A bundle is a folder (optionally also one ``.tar.gz``)::

    DIR/
      snapshot.md      paste into a ticket: verdict, next experiment, distributions, ...
      snapshot.json    the same content, machine-readable (schema below)
      screen.svg       the screen when it was taken (the TUI's, or the report as text)
      screen.png       the same as PNG, when ``rsvg-convert`` is installed
      window/          raw recording of the window's steps: ``rankscope open DIR``
      manifest.json    the snapshot's run manifest
      manifests/       one ``<run>.json`` per run involved (the run, baseline, ladder rungs)
      sweeps/          the run's sweep results (``rankscope sweep``), copied from the recording
      hang/            a stall's evidence, in the bundle the hub writes when a run hangs
                       (``rankscope.hub.hang``): verdict, stacks, Flight Recorder dumps

``snapshot.json``, schema ``rankscope.snapshot/1``:

==================  ==========================================================================
``schema``          ``"rankscope.snapshot/1"``
``created``         ISO-8601 UTC time the snapshot was taken
``created_ns``      the same instant, epoch ns
``producer``        ``rankscope <version>``
``job``             job name
``run``             run id
``scope``           ``full``, ``two-node``, ``one-node``, ``one-rank`` or ``custom``
``parent_run``      the run this one is a reduced rerun of, or null
``world_size``      ranks in the run
``hosts``           hosts in the run (count)
``source``          ``{"kind": "recording" | "live", "path"}`` where the data came from
``window``          ``steps`` [first, last], ``n_steps``, ``t0_ns``, ``path`` (``"window"``
                    or null), ``frames`` written, ``runs`` in it, ``note`` when it is missing
``baseline``        ``{"run", "scope", "steps"}`` or null
``manifest``        ``highlights`` (flat field -> value: versions, GPU, job config,
                    launcher) and ``diff`` [{``field``, ``baseline``, ``current``}]
``last_arrivers``   [{``rank``, ``host``, ``count``, ``decisive``}], most often last first
``pins``            [{``rank``, ``host``, ``step_p50_ms``, ``times_last``, ``late_mean_ms``}]
``diagnosis``       the full diagnosis, schema ``rankscope.diagnosis/1``
                    (``rankscope.diagnosis.serialize``): verdict with hypotheses and next
                    experiments, numerator, decomposition, critical path, correlations,
                    curves, distributions, trends, fabric, stall
``ladder``          ``rankscope ladder --json`` of the run and its reruns, or null
``sweeps``          the run's sweeps [{``run``, ``scope``, ``backend``, ``finding``, ``found``,
                    ``conclusion``, ``reproduces``, ``file``}] (``launch.ladder.SweepEntry``;
                    ``file`` is the result's copy in the bundle, ``sweeps/<run>.json``)
``experiments``     experiment records of the recording (``launch.experiments``)
``hang``            null, or in a stall bundle: ``verdict`` (``diagnosis.stall.Hang``:
                    ``stalled``, ``case``, ``culprits``, ``waiting``...), ``files`` (what
                    ``hang/`` holds: name -> path), ``flight_recorder`` (``dumps`` rank ->
                    path, ``note``), ``diagnosis_note`` (why the diagnosis is missing or
                    partial, else null), ``written_s`` (seconds the evidence took)
``view``            ``run``, ``metric``, ``group_by``, ``pins``, ``baseline_run``,
                    ``filter``, ``zoom``: what ``rankscope open DIR`` restores
``files``           name -> relative path of every file written; ``png_note`` when no PNG
``reopen``          the command that reopens the snapshot
==================  ==========================================================================

Times inside ``diagnosis`` are ns; the Markdown shows ms.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.diagnosis.window import Window
from rankscope.sanitize import for_filename
from rankscope.snapshot_files import (
    SCHEMA,
    Bundle,
    OpenedSnapshot,
    SnapshotError,
    View,
    load_snapshot,
    open_snapshot,
    write_bundle,
)
from rankscope.version import __version__

__all__ = [
    "DEFAULT_STEPS",
    "SCHEMA",
    "Bundle",
    "OpenedSnapshot",
    "SnapshotError",
    "View",
    "build_content",
    "load_snapshot",
    "manifest_highlights",
    "open_snapshot",
    "pin_rows",
    "snapshot_from_source",
    "take_snapshot",
    "write_bundle",
]

DEFAULT_STEPS = 50
"""Steps in a snapshot's window unless told otherwise."""

HIGHLIGHT_SECTIONS = ("versions", "gpu", "job_config", "launcher.kind", "git")
"""Manifest fields (or whole sections) shown as highlights."""


# -- content ------------------------------------------------------------------------------


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def manifest_highlights(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest fields a ticket reader wants first, flattened (``versions.torch``...).

    Args:
        manifest: a run manifest.

    Returns:
        Field -> value for ``HIGHLIGHT_SECTIONS`` that exist.
    """
    flat = _flatten(manifest, "")
    return {
        k: v
        for k, v in flat.items()
        if any(k == s or k.startswith(s + ".") for s in HIGHLIGHT_SECTIONS)
        and not isinstance(v, list)
    }


def _host(window: Window, rank: int) -> str:
    h = int(window.ranks.host[rank]) if 0 <= rank < window.world_size else -1
    return window.ranks.hosts[h] if 0 <= h < len(window.ranks.hosts) else "?"


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def pin_rows(window: Window, pins: Iterable[int]) -> list[dict[str, Any]]:
    """What the snapshot says about each pinned rank.

    Args:
        window: the window.
        pins: pinned ranks (ranks outside the run are left out).

    Returns:
        One map per pin: ``rank``, ``host``, ``step_p50_ms``, ``times_last``,
        ``late_mean_ms`` (mean lateness per collective it took part in).
    """
    out = []
    step = np.where(window.present, window.step_ns, np.nan)
    for r in pins:
        if not 0 <= r < window.world_size or not window.present[r].any():
            continue
        n = float(np.nansum(window.coll["n"][r]))
        late = float(np.nansum(window.coll["late_ns"][r]))
        out.append(
            {
                "rank": int(r),
                "host": _host(window, r),
                "step_p50_ms": _finite(float(np.nanmedian(step[r])) / 1e6),
                "times_last": int(np.nansum(window.coll["times_last"][r])),
                "late_mean_ms": late / n / 1e6 if n > 0 else None,
            }
        )
    return out


def build_content(
    window: Window,
    diagnosis: dict[str, Any],
    *,
    baseline: Window | None = None,
    ladder: dict[str, Any] | None = None,
    experiments: Iterable[dict[str, Any]] = (),
    sweeps: Iterable[dict[str, Any]] = (),
    view: View | None = None,
    source: dict[str, Any] | None = None,
    created_ns: int | None = None,
    hang: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble ``snapshot.json`` (the module docstring documents every key).

    Args:
        window: the run's window.
        diagnosis: ``rankscope.diagnosis.serialize.to_dict`` of its diagnosis.
        baseline: the baseline window, when there is one.
        ladder: the ladder as plain data (``launch.report.ladder_dict``), when reruns exist.
        experiments: experiment records as plain data.
        sweeps: the run's sweeps as plain data (``asdict`` of `SweepEntry`).
        view: the view to restore (default: the run with default metric and grouping).
        source: where the data came from (``kind``, ``path``).
        created_ns: when the snapshot was taken (default: now).
        hang: a stall bundle's ``hang`` section (module docstring), or None.

    Returns:
        The content; ``window`` and ``files`` are completed by `write_bundle`.
    """
    if created_ns is None:
        created_ns = time.time_ns()
    created = _dt.datetime.fromtimestamp(created_ns / 1e9, _dt.UTC)
    view = view if view is not None else View()
    if view.run is None:
        view = View(**{**asdict(view), "run": window.run})
    crit = diagnosis.get("critical_path", {})
    arrivers = [{**a, "host": _host(window, int(a["rank"]))} for a in crit.get("last_arrivers", [])]
    steps = window.steps
    return {
        "schema": SCHEMA,
        "created": created.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "created_ns": created_ns,
        "producer": f"rankscope {__version__}",
        "job": window.job,
        "run": window.run,
        "scope": window.scope,
        "parent_run": window.parent_run,
        "world_size": window.world_size,
        "hosts": len(window.ranks.hosts),
        "source": dict(source or {"kind": "live", "path": None}),
        "window": {
            "steps": [int(steps[0]), int(steps[-1])] if steps.size else [],
            "n_steps": int(steps.size),
            "t0_ns": int(window.t0_ns),
            "path": None,
            "frames": 0,
            "runs": [],
        },
        "baseline": None
        if baseline is None
        else {
            "run": baseline.run,
            "scope": baseline.scope,
            "steps": [int(baseline.steps[0]), int(baseline.steps[-1])]
            if baseline.steps.size
            else [],
        },
        "manifest": {
            "highlights": manifest_highlights(window.manifest),
            "diff": diagnosis.get("distributions", {}).get("manifest_diff", []),
        },
        "last_arrivers": arrivers,
        "pins": pin_rows(window, view.pins),
        "diagnosis": diagnosis,
        "ladder": ladder,
        "experiments": list(experiments),
        "sweeps": list(sweeps),
        "hang": hang,
        "view": view.to_dict(),
        "files": {},
        "reopen": None,
    }


def take_snapshot(
    out: str | Path,
    window: Window,
    *,
    recording: str | Path | None = None,
    baseline: Window | None = None,
    baseline_recording: str | Path | None = None,
    diagnosis: dict[str, Any] | None = None,
    reruns: Iterable[Window] = (),
    view: View | None = None,
    screen_svg: str | Callable[[dict[str, Any]], str] | None = None,
    tar: bool = False,
    created_ns: int | None = None,
    flush: Callable[[], None] | None = None,
    hang: dict[str, Any] | None = None,
    part: dict[str, str] | None = None,
) -> Bundle:
    """Diagnose (unless given), line up the ladder and the run's sweeps, and write the
    bundle: the one call behind ``rankscope snapshot`` and the TUI's ``ctrl+s``.

    Args:
        out: bundle folder (must not exist or be empty).
        window: the run's window.
        recording: the recording the window came from (for ``window/``, experiments and
            sweeps); None for a hub that is not recording.
        baseline: the healthy run's window.
        baseline_recording: where the baseline was recorded (default: ``recording``).
        diagnosis: the diagnosis already computed, as ``serialize.to_dict`` data.
        reruns: windows of the run's reduced-scope reruns (for the ladder).
        view: the view to restore.
        screen_svg: the screen as SVG text, or a function drawing it from the content.
        tar: also write ``<out>.tar.gz``.
        created_ns: when it was taken (default now).
        flush: called before the recording is copied. A live hub buffers what it records
            for a moment; pass ``hub.recorder.flush`` (after taking ``window``) so
            ``window/`` holds every step the window shows.
        hang: a stall bundle's ``hang`` section (the hub's `HangWatch`).
        part: files already in ``out`` that the bundle keeps (``files`` key -> path): the
            ``hang/`` evidence, written before the snapshot.

    Returns:
        The bundle.

    Raises:
        SnapshotError: when the bundle cannot be written.
    """
    from rankscope.snapshot_window import window_frames

    if flush is not None:
        flush()

    stalled = bool(hang and (hang.get("verdict") or {}).get("stalled"))
    if diagnosis is None and not window.has_complete_step() and not stalled:
        from rankscope.diagnosis.window import NO_COMPLETE_STEP

        diagnosis = {"verdict": {"top": None, "hypotheses": []}, "note": NO_COMPLETE_STEP}
    if diagnosis is None:
        from rankscope.diagnosis.engine import diagnose
        from rankscope.diagnosis.serialize import to_dict

        diagnosis = to_dict(diagnose(window, baseline))
    from rankscope.launch.ladder import read_sweeps

    reruns = [w for w in reruns if w.parent_run == window.run]
    sweeps = read_sweeps(recording, window.run) if recording is not None else ()
    ladder = None
    if reruns:
        from rankscope.launch.ladder import build_ladder
        from rankscope.launch.report import ladder_dict

        ladder = ladder_dict(build_ladder(window, reruns, baseline=baseline, sweeps=sweeps))
    experiments: list[dict[str, Any]] = []
    if recording is not None:
        from rankscope.launch.experiments import ExperimentError, list_experiments

        try:
            experiments = [asdict(e) for e in list_experiments(recording)]
        except (ExperimentError, OSError):
            experiments = []  # a damaged record must not cost the incident its snapshot
    source = {"kind": "recording" if recording is not None else "live", "path": None}
    if recording is not None:
        source["path"] = str(recording)
    content = build_content(
        window,
        diagnosis,
        baseline=baseline,
        ladder=ladder,
        experiments=experiments,
        sweeps=[asdict(e) for e in sweeps],
        view=view,
        source=source,
        created_ns=created_ns,
        hang=hang,
    )
    # A sweep's result keeps its name under the bundle, so ``file`` reads the same in both.
    copies = {f"sweep:{e.run}": (e.file, Path(str(recording), e.file)) for e in sweeps}
    manifests = {window.run: window.manifest}
    if baseline is not None:
        manifests[baseline.run] = baseline.manifest
    for w in reruns:
        manifests[w.run] = w.manifest

    def frames() -> Iterable[tuple[bytes, int]]:
        assert recording is not None
        yield from window_frames(recording, window.run, window.steps.tolist())
        if baseline is not None:
            where = baseline_recording if baseline_recording is not None else recording
            yield from window_frames(where, baseline.run, baseline.steps.tolist())

    return write_bundle(
        out,
        content,
        manifests=manifests,
        frames=frames() if recording is not None else None,
        window_note=None if recording is not None else "the hub was not recording",
        copies=copies,
        screen_svg=screen_svg,
        tar=tar,
        part=part,
    )


def snapshot_from_source(
    folder: str | Path,
    source: Any,
    view: View,
    *,
    last: int = DEFAULT_STEPS,
    screen_svg: str | Callable[[dict[str, Any]], str] | None = None,
    diagnosis: dict[str, Any] | None = None,
    tar: bool = False,
) -> Bundle:
    """The TUI's ``ctrl+s``: snapshot what a viewer shows into a new folder under ``folder``.

    Args:
        folder: where bundles go; the bundle is ``snapshot-<run>-<UTC time>`` inside it.
        source: the viewer's source (``runs()``, ``window(run, last)``); its recording is
            ``source.path`` (a replayed recording) or ``source.hub.record_dir`` (a live hub,
            whose recorder is flushed first).
        view: the view to restore; ``view.run`` (default: the newest run) is snapshotted and
            ``view.baseline_run`` is its baseline.
        last: steps in the window.
        screen_svg: the screen (``App.export_screenshot()``).
        diagnosis: the viewer's latest diagnosis as ``serialize.to_dict`` data, if current.
        tar: also write a ``.tar.gz``.

    Returns:
        The bundle.

    Raises:
        SnapshotError: no run to snapshot, or the bundle cannot be written.
    """
    runs = list(source.runs())
    run = view.run or (runs[-1].run if runs else None)
    window = source.window(run, last) if run is not None else None
    if run is None or window is None:
        raise SnapshotError("nothing to snapshot yet: no run has reported a step")
    baseline = source.window(view.baseline_run, last) if view.baseline_run else None
    reruns = [source.window(e.run, last) for e in runs if getattr(e, "parent_run", None) == run]
    hub = getattr(source, "hub", None)
    recording = getattr(source, "path", None) or getattr(hub, "record_dir", None)
    recorder = getattr(hub, "recorder", None)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return take_snapshot(
        Path(folder) / f"snapshot-{for_filename(run)}-{stamp}",
        window,
        recording=recording,
        baseline=baseline,
        diagnosis=diagnosis,
        reruns=[w for w in reruns if w is not None],
        view=View(**{**asdict(view), "run": run}),
        screen_svg=screen_svg,
        tar=tar,
        flush=recorder.flush if recorder is not None else None,
    )
