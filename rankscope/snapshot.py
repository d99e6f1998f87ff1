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
``experiments``     experiment records of the recording (``launch.experiments``)
``view``            ``run``, ``metric``, ``group_by``, ``pins``, ``baseline_run``,
                    ``filter``, ``zoom``: what ``rankscope open DIR`` restores
``files``           name -> relative path of every file written; ``png_note`` when no PNG
``reopen``          the command that reopens the snapshot
==================  ==========================================================================

Times inside ``diagnosis`` are ns; the Markdown shows ms.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.diagnosis.window import Window
from rankscope.version import __version__

SCHEMA = "rankscope.snapshot/1"
DEFAULT_STEPS = 50
"""Steps in a snapshot's window unless told otherwise."""

HIGHLIGHT_SECTIONS = ("versions", "gpu", "job_config", "launcher.kind", "git")
"""Manifest fields (or whole sections) shown as highlights."""


class SnapshotError(ValueError):
    """A snapshot cannot be written or read as asked."""


@dataclass(frozen=True)
class View:
    """The view a snapshot restores: the TUI's choices when it was taken."""

    run: str | None = None
    metric: str = "step"
    group_by: str = "host"
    pins: tuple[int, ...] = ()
    baseline_run: str | None = None
    filter: str = ""
    zoom: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pins"] = list(self.pins)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> View:
        """Read a ``view`` map, rejecting wrongly typed fields by name.

        Raises:
            SnapshotError: naming the field.
        """

        def opt_str(key: str) -> str | None:
            v = data.get(key)
            if v is not None and not isinstance(v, str):
                raise SnapshotError(f"view.{key} must be a string, got {type(v).__name__}")
            return v

        pins = data.get("pins", [])
        if not isinstance(pins, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pins
        ):
            raise SnapshotError(f"view.pins must be a list of ranks, got {pins!r}")
        zoom = data.get("zoom")
        if zoom is not None and (not isinstance(zoom, int) or isinstance(zoom, bool)):
            raise SnapshotError(f"view.zoom must be an integer or null, got {zoom!r}")
        return cls(
            run=opt_str("run"),
            metric=opt_str("metric") or "step",
            group_by=opt_str("group_by") or "host",
            pins=tuple(pins),
            baseline_run=opt_str("baseline_run"),
            filter=opt_str("filter") or "",
            zoom=zoom,
        )


@dataclass(frozen=True)
class Bundle:
    """A written snapshot."""

    folder: Path
    content: dict[str, Any]
    """What ``snapshot.json`` holds."""
    tarball: Path | None = None
    files: dict[str, str] = field(default_factory=dict)


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
    view: View | None = None,
    source: dict[str, Any] | None = None,
    created_ns: int | None = None,
) -> dict[str, Any]:
    """Assemble ``snapshot.json`` (the module docstring documents every key).

    Args:
        window: the run's window.
        diagnosis: ``rankscope.diagnosis.serialize.to_dict`` of its diagnosis.
        baseline: the baseline window, when there is one.
        ladder: the ladder as plain data (``launch.report.ladder_dict``), when reruns exist.
        experiments: experiment records as plain data.
        view: the view to restore (default: the run with default metric and grouping).
        source: where the data came from (``kind``, ``path``).
        created_ns: when the snapshot was taken (default: now).

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
        "view": view.to_dict(),
        "files": {},
        "reopen": None,
    }


# -- writing and reading ------------------------------------------------------------------


def _safe_name(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run)[:120] or "run"


def _png(svg: Path, png: Path) -> str | None:
    """Convert with rsvg-convert; returns why not when it could not."""
    exe = shutil.which("rsvg-convert")
    if exe is None:
        return "rsvg-convert is not installed (apt-get install librsvg2-bin); screen.svg only"
    try:
        done = subprocess.run(
            [exe, "-o", str(png), str(svg)], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"rsvg-convert failed: {exc}"
    if done.returncode != 0 or not png.exists():
        return f"rsvg-convert failed: {done.stderr.strip()[:200]}"
    return None


def write_bundle(
    out: str | Path,
    content: dict[str, Any],
    *,
    manifests: Mapping[str, Mapping[str, Any]],
    frames: Iterable[tuple[bytes, int]] | None = None,
    window_note: str | None = None,
    screen_svg: str | Callable[[dict[str, Any]], str] | None = None,
    tar: bool = False,
) -> Bundle:
    """Write a bundle folder (and optionally ``<folder>.tar.gz``).

    The folder is assembled under a temporary name beside it and renamed at the end, so a
    failed snapshot never leaves half a bundle under the asked name.

    Args:
        out: the bundle folder; it must not exist yet (or be empty).
        content: from `build_content`; ``window``, ``files`` and ``reopen`` are filled here.
        manifests: run id -> manifest, for every run involved (the first is the snapshot's).
        frames: recorded messages for ``window/`` (see `window_frames`), or None.
        window_note: why there is no ``window/`` when ``frames`` is None.
        screen_svg: the screen as SVG text, or a function drawing it from the content.
        tar: also write ``<folder>.tar.gz``.

    Returns:
        The bundle.

    Raises:
        SnapshotError: the folder exists and is not empty, or cannot be written.
    """
    from rankscope.hub.recording import RecordingWriter
    from rankscope.snapshot_markdown import render_markdown

    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SnapshotError(f"snapshot folder {str(folder)!r} exists and is not empty")
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    content["reopen"] = f"rankscope open {folder}"
    try:
        files: dict[str, str] = {}
        win = content["window"]
        if frames is not None:
            writer = RecordingWriter(work / "window", info={"snapshot_of": content["run"]})
            n, runs = 0, set()
            try:
                for payload, t_recv in frames:
                    writer.append(payload, t_recv)
                    n += 1
            finally:
                writer.close()
            (work / "window" / "lock").unlink(missing_ok=True)
            runs = {content["run"]} | (
                {content["baseline"]["run"]} if content["baseline"] else set()
            )
            win.update(path="window", frames=n, runs=sorted(runs))
            files["window"] = "window/"
        else:
            win["note"] = window_note or "no recording was available to copy"
        run_manifests = dict(manifests)
        first = next(iter(run_manifests.values()), {})
        (work / "manifest.json").write_text(json.dumps(first, indent=1, default=str) + "\n")
        files["manifest"] = "manifest.json"
        (work / "manifests").mkdir()
        for run, man in run_manifests.items():
            name = f"manifests/{_safe_name(run)}.json"
            (work / name).write_text(json.dumps(man, indent=1, default=str) + "\n")
            files[f"manifest:{run}"] = name
        if callable(screen_svg):
            screen_svg = screen_svg(content)
        if screen_svg is not None:
            (work / "screen.svg").write_text(screen_svg, encoding="utf-8")
            files["svg"] = "screen.svg"
            why = _png(work / "screen.svg", work / "screen.png")
            if why is None:
                files["png"] = "screen.png"
            else:
                files["png_note"] = why
        else:
            files["png_note"] = "no screen was given"
        files["markdown"] = "snapshot.md"
        files["json"] = "snapshot.json"
        content["files"] = files
        (work / "snapshot.json").write_text(
            json.dumps(content, indent=1, allow_nan=False, default=str) + "\n"
        )
        (work / "snapshot.md").write_text(render_markdown(content), encoding="utf-8")
        if folder.exists():
            folder.rmdir()
        work.chmod(0o755)  # mkdtemp makes it private; a bundle is meant to be shared
        work.rename(folder)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    tarball = None
    if tar:
        tarball = folder.with_name(folder.name + ".tar.gz")
        with tarfile.open(tarball, "w:gz") as tf:
            tf.add(folder, arcname=folder.name)
    return Bundle(folder=folder, content=content, tarball=tarball, files=files)


def _extract(tarball: Path) -> Path:
    """Unpack a bundle archive into a temporary folder, refusing paths that leave it."""
    dest = Path(tempfile.mkdtemp(prefix="rankscope-snapshot-"))
    with tarfile.open(tarball, "r:gz") as tf:
        for m in tf.getmembers():
            target = (dest / m.name).resolve()
            if not (m.isfile() or m.isdir()) or not target.is_relative_to(dest.resolve()):
                shutil.rmtree(dest, ignore_errors=True)
                raise SnapshotError(f"{tarball}: refusing archive member {m.name!r}")
        tf.extractall(dest)  # every member was checked above
    tops = [p for p in dest.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else dest


def load_snapshot(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Read a snapshot: its folder, its ``snapshot.json`` or its ``.tar.gz``.

    Args:
        path: where the snapshot is.

    Returns:
        ``(content, folder)``; a ``.tar.gz`` is unpacked into a temporary folder.

    Raises:
        SnapshotError: naming what is wrong (missing, not a snapshot, other version).
    """
    p = Path(path)
    if not p.exists():
        raise SnapshotError(f"no snapshot at {str(p)!r}")
    if p.is_file() and p.name.endswith((".tar.gz", ".tgz")):
        p = _extract(p)
    folder = p.parent if p.is_file() else p
    doc = folder / "snapshot.json"
    try:
        content = json.loads(doc.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SnapshotError(f"{str(folder)!r} is not a snapshot (no snapshot.json)") from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{doc}: cannot be read: {exc}") from None
    if not isinstance(content, dict) or not str(content.get("schema", "")).startswith(
        "rankscope.snapshot/"
    ):
        raise SnapshotError(f"{doc}: not a rankscope snapshot (schema {content.get('schema')!r})")
    if content["schema"] != SCHEMA:
        raise SnapshotError(f"{doc}: schema {content['schema']!r}, this rankscope reads {SCHEMA}")
    return content, folder


@dataclass(frozen=True)
class OpenedSnapshot:
    """What a viewer needs to reopen a snapshot as it was taken."""

    content: dict[str, Any]
    folder: Path
    recording: Path | None
    """The ``window/`` recording, or None when the bundle has none."""
    view: View


def open_snapshot(path: str | Path) -> OpenedSnapshot:
    """Locate a snapshot's recording and view, for ``rankscope open SNAPSHOT``.

    Args:
        path: the snapshot folder, its ``snapshot.json`` or its ``.tar.gz``.

    Returns:
        The content, the ``window/`` recording and the `View` to restore.

    Raises:
        SnapshotError: naming what is wrong.
    """
    content, folder = load_snapshot(path)
    rel = (content.get("window") or {}).get("path")
    recording = folder / rel if rel else None
    if recording is not None and not recording.is_dir():
        raise SnapshotError(f"{folder}: snapshot.json names {rel!r}, which is missing")
    return OpenedSnapshot(content, folder, recording, View.from_dict(content.get("view") or {}))


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
) -> Bundle:
    """Diagnose (unless given), line up the ladder, and write the bundle: the one call
    behind ``rankscope snapshot`` and the TUI's ``ctrl+s``.

    Args:
        out: bundle folder (must not exist or be empty).
        window: the run's window.
        recording: the recording the window came from (for ``window/`` and experiments);
            None for a hub that is not recording.
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

    Returns:
        The bundle.

    Raises:
        SnapshotError: when the bundle cannot be written.
    """
    from rankscope.snapshot_window import window_frames

    if flush is not None:
        flush()

    if diagnosis is None:
        from rankscope.diagnosis.engine import diagnose
        from rankscope.diagnosis.serialize import to_dict

        diagnosis = to_dict(diagnose(window, baseline))
    reruns = [w for w in reruns if w.parent_run == window.run]
    ladder = None
    if reruns:
        from rankscope.launch.ladder import build_ladder
        from rankscope.launch.report import ladder_dict

        ladder = ladder_dict(build_ladder(window, reruns, baseline=baseline))
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
        view=view,
        source=source,
        created_ns=created_ns,
    )
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
        screen_svg=screen_svg,
        tar=tar,
    )
