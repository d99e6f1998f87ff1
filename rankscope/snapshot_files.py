"""A snapshot bundle on disk: writing it, reading it back, and opening it in a viewer.

What the bundle holds and what ``snapshot.json`` means are documented in
`rankscope.snapshot`; this module only moves the files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rankscope.sanitize import for_filename, xml_chars
from rankscope.tui.settings import ViewSettings

SCHEMA = "rankscope.snapshot/1"
"""Schema id of ``snapshot.json``."""


class SnapshotError(ValueError):
    """A snapshot cannot be written or read as asked."""


@dataclass(frozen=True)
class View:
    """The view a snapshot restores: the TUI's choices when it was taken. Defaults are
    the TUI's own (``rankscope.tui.settings.ViewSettings``)."""

    run: str | None = None
    metric: str = ViewSettings.metric
    group_by: str = ViewSettings.group_by
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
            metric=opt_str("metric") or ViewSettings.metric,
            group_by=opt_str("group_by") or ViewSettings.group_by,
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


def _safe_name(run: str) -> str:
    return for_filename(run, max_len=120)


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
    copies: Mapping[str, tuple[str, Path]] | None = None,
    screen_svg: str | Callable[[dict[str, Any]], str] | None = None,
    tar: bool = False,
    part: Mapping[str, str] | None = None,
) -> Bundle:
    """Write a bundle folder (and optionally ``<folder>.tar.gz``).

    The folder is assembled under a temporary name beside it and renamed at the end, so a
    failed snapshot never leaves half a bundle under the asked name. A folder that already
    holds a ``part`` (a hang bundle's ``hang/``, written first so the evidence exists
    whatever happens next) receives the rest beside it instead.

    Args:
        out: the bundle folder; it must not exist yet (or be empty).
        content: from `build_content`; ``window``, ``files`` and ``reopen`` are filled here.
        manifests: run id -> manifest, for every run involved (the first is the snapshot's).
        frames: recorded messages for ``window/`` (see `window_frames`), or None.
        window_note: why there is no ``window/`` when ``frames`` is None.
        copies: ``files`` key -> (path inside the bundle, source file) of files carried as
            they are (a run's sweep results); one that cannot be read is left out.
        screen_svg: the screen as SVG text, or a function drawing it from the content.
        tar: also write ``<folder>.tar.gz``.
        part: ``files`` key -> path inside the folder of files already there, kept as
            they are; the folder may hold nothing else.

    Returns:
        The bundle.

    Raises:
        SnapshotError: the folder exists and holds anything but ``part``, or cannot be
            written.
    """
    from rankscope.hub.recording import RecordingWriter
    from rankscope.snapshot_markdown import render_markdown

    folder = Path(out)
    kept = {Path(rel).parts[0] for rel in (part or {}).values() if Path(rel).parts}
    if folder.exists() and (
        not folder.is_dir() or any(p.name not in kept for p in folder.iterdir())
    ):
        raise SnapshotError(f"snapshot folder {str(folder)!r} exists and is not empty")
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    content["reopen"] = f"rankscope open {folder}"
    try:
        files: dict[str, str] = dict(part or {})
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
        for key, (rel, src) in (copies or {}).items():
            dest = work / rel
            if not dest.resolve().is_relative_to(work.resolve()):
                raise SnapshotError(f"refusing to copy {src} to {rel!r}, outside the bundle")
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(src, dest)
            except OSError:
                continue  # removed since it was read: the content still says what it found
            files[key] = rel
        if callable(screen_svg):
            screen_svg = screen_svg(content)
        if screen_svg is not None:
            # Names in the screen come from telemetry: a character XML 1.0 forbids (a
            # control character in a host name) would make the whole file unreadable.
            (work / "screen.svg").write_text(xml_chars(screen_svg), encoding="utf-8")
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
        work.chmod(0o755)  # mkdtemp makes it private; a bundle is meant to be shared
        if folder.exists() and any(folder.iterdir()):
            for item in work.iterdir():  # beside the part already there
                item.rename(folder / item.name)
            work.rmdir()
        else:
            if folder.exists():
                folder.rmdir()
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
