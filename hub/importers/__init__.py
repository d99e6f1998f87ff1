"""Importers: turn another tool's files into a rankscope recording.

An importer reads a source (PyTorch profiler traces, NCCL Inspector logs, flight-recorder
dumps, nccl-tests output) and yields ordinary wire messages (`collector.schema`: per rank a
``hello``, the ``groups`` table, then ``steps`` batches), exactly what a live collector
would send. `write_recording` writes them with the hub's `RecordingWriter`, so every
command that reads a recording (``diagnose``, ``open``, ``inspect``, ``export``...) works on
an imported one unchanged.

Contract of an importer module (one per kind, named in `IMPORTERS`)::

    def messages(files: list[Path], report: ImportReport, *, job: str, run: str)
        -> Iterator[bytes | tuple[bytes, int]]

It yields encoded messages in sending order (a rank's hello before its data); a message
the source dates itself (a heartbeat that says where a rank stood when a dump was written)
comes as ``(message, time_ns)`` and is recorded as received at that time on the aligned
clock, every other one at the time of the import. It notes every
file it could not use, or used in part, in ``report.problems`` as ``(file, what was
wrong)`` and carries on with the rest; what the source cannot provide goes in
``report.lacks`` (e.g. ``"device times"``, ``"tokens"``), and the cross-rank clock
alignment error, when it estimated one (`hub.importers.align`), in ``report.alignment_ns``.

Where the data came from is recorded in the recording's ``meta.json`` session entry
(``source: {kind, files, lacks}``) and in each hello's manifest (``manifest["source"]``),
which ``inspect`` and ``diagnose`` show with the manifest.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import io
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rankscope.collector import schema

IMPORTERS: dict[str, str] = {
    "kineto": "rankscope.hub.importers.kineto",
    "nccl-inspector": "rankscope.hub.importers.nccl_inspector",
    "flight-recorder": "rankscope.hub.importers.flight_recorder",
    "nccl-tests": "rankscope.hub.importers.nccl_tests",
}
"""Kind -> module implementing ``messages(files, report, *, job, run)``."""


class ImportError_(ValueError):
    """An import that cannot run at all (unknown kind, missing module, no input file)."""


@dataclass
class ImportReport:
    """What an import did and what it could not do."""

    kind: str = ""
    files_read: list[str] = field(default_factory=list)
    """Files at least partly imported."""
    messages: int = 0
    """Wire messages written."""
    bytes: int = 0
    """Bytes of those messages."""
    ranks: int = 0
    steps: int = 0
    """Step rows over all ranks."""
    colls: int = 0
    """Collective rows over all ranks."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    """``(file, what was wrong)``: files skipped or read in part."""
    lacks: list[str] = field(default_factory=list)
    """What the source could not provide (kept in order, each once)."""
    alignment_ns: int | None = None
    """Estimated cross-rank clock alignment error (ns), when the importer aligned ranks."""
    input_bytes: int = 0
    """Bytes of the input files as stored (compressed where they are)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Kind-specific results kept with the source in ``meta.json`` (small: per rank and
    step at most), e.g. the Kineto importer's GPU time breakdown."""

    @property
    def alignment(self) -> int | None:
        """The cross-rank clock alignment error in ns (``alignment_ns``)."""
        return self.alignment_ns

    @alignment.setter
    def alignment(self, ns: int | None) -> None:
        self.alignment_ns = None if ns is None else int(ns)

    def problem(self, file: str | Path, what: str) -> None:
        """Note that ``file`` was skipped or read in part, and why."""
        self.problems.append((str(file), " ".join(str(what).split())))

    def lack(self, what: str) -> None:
        """Note something the source cannot provide (once)."""
        if what not in self.lacks:
            self.lacks.append(what)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values."""
        return {
            "kind": self.kind,
            "files_read": list(self.files_read),
            "messages": self.messages,
            "bytes": self.bytes,
            "ranks": self.ranks,
            "steps": self.steps,
            "colls": self.colls,
            "problems": [{"file": f, "problem": p} for f, p in self.problems],
            "lacks": list(self.lacks),
            "alignment_ns": self.alignment_ns,
            "input_bytes": self.input_bytes,
            "details": self.details,
        }


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files named by ``paths``: files as given, glob patterns, and directories searched
    recursively (hidden files left out). Sorted, each once.

    Args:
        paths: file names, glob patterns or directories.

    Returns:
        The files, sorted by path.
    """
    out: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            for q in p.rglob("*"):
                if q.is_file() and not any(part.startswith(".") for part in q.relative_to(p).parts):
                    out.add(q)
        elif p.is_file():
            out.add(p)
        elif any(c in str(raw) for c in "*?["):
            anchor = Path(p.anchor) if p.is_absolute() else Path(".")
            pattern = str(p.relative_to(p.anchor)) if p.is_absolute() else str(raw)
            out.update(q for q in anchor.glob(pattern) if q.is_file())
    return sorted(out)


def _is_gzip(path: Path) -> bool:
    if path.suffix == ".gz":
        return True
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _as_os_error(read: Callable[..., Any]) -> Callable[..., Any]:
    """``read`` raising `gzip.BadGzipFile` (an OSError) where the gzip data is cut short
    (EOFError) or corrupt (zlib.error)."""

    @functools.wraps(read)
    def guarded(self: gzip.GzipFile, *args: Any) -> Any:
        try:
            return read(self, *args)
        except (EOFError, zlib.error) as exc:
            raise gzip.BadGzipFile(f"gzip data cut short or corrupt: {exc}") from None

    return guarded


class _GzipStream(gzip.GzipFile):
    """A gzip file whose broken data reads as an OSError: every importer reports an
    OSError as a file that cannot be read (to its end), and knows no other error of
    decompression."""

    read = _as_os_error(gzip.GzipFile.read)
    read1 = _as_os_error(gzip.GzipFile.read1)
    peek = _as_os_error(gzip.GzipFile.peek)
    readline = _as_os_error(gzip.GzipFile.readline)


def open_binary(path: str | Path) -> IO[bytes]:
    """Open ``path`` for reading bytes, decompressing gzip (by suffix or magic) on the fly.
    Gzip data cut short or corrupt raises `gzip.BadGzipFile` (an OSError) when read."""
    p = Path(path)
    if _is_gzip(p):
        return _GzipStream(p, "rb")  # type: ignore[return-value]
    return open(p, "rb")


def open_text(path: str | Path) -> IO[str]:
    """Open ``path`` as UTF-8 text (undecodable bytes replaced), gzip handled."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace")


def load_importer(kind: str) -> Any:
    """The module of ``kind``.

    Raises:
        ImportError_: unknown kind (the message lists the kinds), or a kind whose module
            is not in this build.
    """
    module = IMPORTERS.get(kind)
    if module is None:
        raise ImportError_(f"unknown import kind {kind!r}; kinds: {', '.join(IMPORTERS)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise ImportError_(f"import kind {kind!r} is not available in this build yet") from None


def header(job: str, run: str, rank: int) -> dict[str, Any]:
    """A fresh message header for ``rank`` (batch counting from 0)."""
    return {"job": job, "run": run, "rank": int(rank), "inc": 0, "batch": 0}


def next_header(h: dict[str, Any]) -> dict[str, Any]:
    """``h`` with its batch number advanced (what each message of a sender carries)."""
    h["batch"] += 1
    return h


def count_message(report: ImportReport, data: bytes) -> None:
    """Add one encoded message to ``report``'s counters (its steps and colls rows too)."""
    report.messages += 1
    report.bytes += len(data)


def write_recording(
    kind: str,
    paths: Iterable[str | Path],
    record: str | Path,
    *,
    job: str = "imported",
    run: str | None = None,
    report: ImportReport | None = None,
) -> ImportReport:
    """Import ``paths`` of source ``kind`` into the recording directory ``record``.

    Each message is checked with the hub's own decode before it is written: what the hub
    would refuse is a problem of the report, never a record. The session entry of
    ``meta.json`` carries ``source: {kind, files, lacks}``.

    Args:
        kind: one of `IMPORTERS`.
        paths: files, globs or directories (`expand_paths`).
        record: recording directory (created; a new session is appended when it exists).
        job: job name of the imported run.
        run: run id (default ``<kind>-<UTC time>``).
        report: the report to fill (a new one when None).

    Returns:
        The report.

    Raises:
        ImportError_: unknown kind, a missing module, or no file to read.
        RecordingError: the recording directory cannot be written.
    """
    from rankscope.hub.recording import RecordingWriter

    rep = report if report is not None else ImportReport()
    rep.kind = kind
    mod = load_importer(kind)
    files = expand_paths(paths)
    if not files:
        raise ImportError_(f"no input file found in {', '.join(map(str, paths))}")
    rep.input_bytes = sum(f.stat().st_size for f in files)
    run_id = run or f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    # The session entry holds this very map: filled in below, written by the closing flush.
    source: dict[str, Any] = {"kind": kind, "files": [], "lacks": []}
    writer = RecordingWriter(record, info={"source": source})
    ranks: set[int] = set()
    try:
        now = time.time_ns()
        for item in mod.messages(files, rep, job=job, run=run_id):
            data, t_recv = item if isinstance(item, tuple) else (item, now)
            try:
                msg = schema.decode(data)
            except schema.SchemaError as exc:
                rep.problem(kind, f"a message the hub would refuse was left out: {exc}")
                continue
            if msg.kind == "hello":
                ranks.add(msg.header["rank"])
            elif msg.kind == "steps":
                rep.steps += int(msg.tables["steps"]["step"].shape[0])
                co = msg.tables.get("colls")
                if co is not None:
                    rep.colls += int(co["step"].shape[0])
            writer.append(data, t_recv)
            count_message(rep, data)
        rep.ranks = len(ranks)
        source["files"] = list(rep.files_read)
        source["lacks"] = list(rep.lacks)
        source["alignment_ns"] = rep.alignment_ns
        source["problems"] = [list(p) for p in rep.problems[:100]]
        source.update(rep.details)
    finally:
        writer.close()
    return rep


def source_manifest(kind: str, files: list[str], lacks: list[str]) -> dict[str, Any]:
    """The ``source`` entry an importer puts in each hello's manifest."""
    return {"kind": kind, "files": list(files)[:64], "lacks": list(lacks)}


__all__ = [
    "IMPORTERS",
    "ImportError_",
    "ImportReport",
    "count_message",
    "expand_paths",
    "header",
    "load_importer",
    "next_header",
    "open_binary",
    "open_text",
    "source_manifest",
    "write_recording",
]
