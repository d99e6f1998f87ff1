"""The recording: an append-only log of every message the hub accepted.

A recording is a directory::

    DIR/
      meta.json               what wrote it: format, version, one entry per hub session
      segment-000000.rsrec    frames of the first hub session
      segment-000001.rsrec    the next session (a restarted hub), or a rotation
      lock                    held (flock) by the hub writing here

Each hub session starts a new segment, so a hub killed mid-frame leaves at most a truncated
tail in its own segment and a restarted hub never writes after garbage. A segment is also
rotated when it grows past ``max_segment_bytes``. Readers join segments in number order
(`segment_key`: ``segment-1000000`` follows ``segment-999999``; gaps and a number written
twice hide nothing), and a writer never opens a segment file someone else created.

A ``meta.json`` of the wrong shape (`meta_problem`) does not stop a hub: it is kept as
``meta.json.bad-<n>`` and rebuilt from the segments (`repair_meta`). Each session records
the hub's process (`process_identity`) and its heartbeat (``updated_ns``, refreshed at
every flush), so a reader tells a killed hub from a running one (`session_liveness`).

Segment file (little endian)::

    header   8 bytes  FILE_MAGIC  b"RSREC\\r\\n\\x1a" (detects text-mode mangling)
             u32      format version (1 or 2)
             u32      reserved (0)
    frame    u32      FRAME_MAGIC  (bytes b"RSRF")
             u32      payload length in bytes (≤ schema.MAX_MESSAGE_BYTES)
             u32      CRC-32 of the 8 t_recv_ns bytes followed by the payload
             i64      t_recv_ns: hub wall clock when the (first) message was received
             bytes    payload

In format 1 a frame's payload is one wire message exactly as received (collector.schema).
In format 2 (``FORMAT_VERSION``, what a writer writes unless told ``format_version=1``) it
is a zstd frame of the messages one flush buffered, their column tables first re-encoded in
their narrowest exact types (`hub.recording_codec`): about 8 bytes per collective row where
format 1 takes 70 to 85. Readers decode it back to the identical wire messages, so nothing
above the frame layer tells the formats apart; a frame whose body does not decode (within
``schema.MAX_MESSAGE_BYTES`` of output) is skipped as ``corrupt``. ``meta.json``'s
``version`` is the newest format of its segments and each session names its ``format``.

The writer buffers frames and writes them in whole-frame chunks every ``flush_s`` seconds
(and when the buffer is large, and on close), so a reader following the file sees either a
complete frame or a partial one it waits for. ``meta.json`` is replaced atomically at each
flush and carries the hub's counters (messages, rejects per reason) of each session. The
hub's writer works in a thread of its own (``background=True``): the receive loop only
checksums and queues each message, and the writes, whose time is the kernel's and the
disk's to decide, happen beside it. When the disk falls ``max_backlog_bytes`` behind, the
receive loop writes itself, and so slows to the disk's pace: ZeroMQ then holds what the
collectors send, up to its high-water mark, past which collectors drop and count.

Readers tolerate damage: a frame with a bad magic, length or checksum is skipped by scanning
for the next valid frame, and a truncated tail is reported; both become `Skip` records
(segment, offset, bytes, reason) instead of errors.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from rankscope.collector.schema import MAX_MESSAGE_BYTES

FORMAT_VERSION = 2
"""The format a writer writes by default and the newest a reader knows."""
FORMATS = (1, 2)
FILE_MAGIC = b"RSREC\r\n\x1a"
FRAME_MAGIC = 0x46525352
_FRAME_MAGIC_BYTES = struct.pack("<I", FRAME_MAGIC)
_FILE_HEADER = struct.Struct("<8sII")
_FRAME_HEADER = struct.Struct("<IIIq")
_SEGMENT_RE = re.compile(r"^segment-(\d+)\.rsrec$")
"""A segment file name: six digits or more (the writer pads to six, past 999999 it writes
seven); readers take any number of digits, so no name the writer could use is hidden."""
META_NAME = "meta.json"
_CHUNK = 16 << 20

log = logging.getLogger("rankscope.hub")


class RecordingError(RuntimeError):
    """The recording cannot be opened: not a recording, a newer format, or already being
    written by another hub."""


@dataclass(frozen=True)
class Frame:
    """One recorded message."""

    t_recv_ns: int
    payload: bytes
    segment: str
    offset: int
    """Byte offset of the frame header in its segment."""
    index: int = 0
    """Place of the message in its frame (format 2 frames hold several)."""
    nbytes: int = 0
    """Bytes of the recording the message stands for, when not its whole frame (a message
    of a format-2 frame: its wire size); 0 for a format-1 frame (header + payload)."""


@dataclass(frozen=True)
class Skip:
    """Bytes a reader could not use."""

    segment: str
    offset: int
    nbytes: int
    reason: str
    """``truncated`` (a partial frame at the end of a finished segment), ``corrupt`` (bad
    magic, length or checksum), ``bad_header`` (not a segment file), or ``bad_record`` (a
    whole frame whose message the replay refused: see ``detail``)."""
    detail: str = ""
    """For ``bad_record``: the reject reason tag and what was wrong, e.g. ``bad_hello:
    identity.rail 1099511627776 is outside 32 bits``."""


MAX_LISTED_BAD_RECORDS = 1000
"""Bad records a `ReadReport` lists one by one; past it they are only counted (a recording
of nothing but bad records must not fill memory with their descriptions)."""


@dataclass
class ReadReport:
    """What a reader went through: frames returned and bytes skipped."""

    frames: int = 0
    bytes: int = 0
    skipped: list[Skip] = field(default_factory=list)
    bad_records: int = 0
    """Frames read whole whose message the replay refused (listed in ``skipped`` as
    ``bad_record``, up to ``MAX_LISTED_BAD_RECORDS``)."""
    unlisted_bytes: int = 0
    """Bytes of the bad records past ``MAX_LISTED_BAD_RECORDS``."""

    @property
    def skipped_bytes(self) -> int:
        return sum(s.nbytes for s in self.skipped) + self.unlisted_bytes

    def bad_record(self, frame: Frame, reason: str, detail: str) -> Skip | None:
        """Count a frame whose message was refused; returns its `Skip` when listed."""
        self.bad_records += 1
        nbytes = frame.nbytes or _FRAME_HEADER.size + len(frame.payload)
        if self.bad_records > MAX_LISTED_BAD_RECORDS:
            self.unlisted_bytes += nbytes
            return None
        skip = Skip(frame.segment, frame.offset, nbytes, "bad_record", f"{reason}: {detail}")
        self.skipped.append(skip)
        return skip


def segment_name(index: int) -> str:
    return f"segment-{index:06d}.rsrec"


def _segment_index(name: str) -> int:
    m = _SEGMENT_RE.match(name)
    return int(m.group(1)) if m else -1


def segment_key(name: str) -> tuple[int, str]:
    """Order of segments: by number, not by name (``segment-1000000`` follows
    ``segment-999999``); two names of one number (``segment-000007``, ``segment-0000007``)
    both count, in name order."""
    return _segment_index(name), name


def segments(path: str | os.PathLike[str]) -> list[Path]:
    """The segment files of a recording directory, in order (a file path is itself).

    Gaps in the numbering are fine (a segment deleted by hand leaves the others readable)
    and a number written twice reads both files."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    found = [q for q in p.iterdir() if _SEGMENT_RE.match(q.name) and q.is_file()]
    return sorted(found, key=lambda q: segment_key(q.name))


def meta_problem(meta: Any) -> str | None:
    """What is wrong with the shape of a parsed ``meta.json``, or None when it is sound.

    Sound: a map whose ``format`` is ``"rankscope-recording"``, ``version`` an integer,
    ``sessions`` a list of maps, each with integer or null ``started_ns``, ``updated_ns``,
    ``stopped_ns``, ``messages``, ``bytes``, string or null segment names and a map of
    ``counters``."""
    if not isinstance(meta, dict):
        return f"the top level is a {type(meta).__name__}, not a map"
    if meta.get("format") != "rankscope-recording":
        return f"format is {meta.get('format')!r}, not 'rankscope-recording'"
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        return f"version is {version!r}, not an integer"
    sessions = meta.get("sessions")
    if not isinstance(sessions, list):
        return f"sessions is a {type(sessions).__name__}, not a list"
    for i, sess in enumerate(sessions):
        if not isinstance(sess, dict):
            return f"session {i} is a {type(sess).__name__}, not a map"
        for key in ("started_ns", "updated_ns", "stopped_ns", "messages", "bytes"):
            v = sess.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                return f"session {i} {key} is {v!r}, not an integer"
        for key in ("first_segment", "last_segment", "endpoint"):
            v = sess.get(key)
            if v is not None and not isinstance(v, str):
                return f"session {i} {key} is {v!r}, not a string"
        if not isinstance(sess.get("counters", {}), dict):
            return f"session {i} counters is not a map"
    return None


def _parse_meta(path: Path) -> tuple[Any, str | None]:
    """(parsed ``meta.json`` or None when absent, what is wrong with it or None)."""
    try:
        text = (path / META_NAME).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        meta = json.loads(text)
    except ValueError as exc:
        what = "empty" if not text.strip() else f"not JSON ({exc})"
        return None, f"is {what}"
    return meta, meta_problem(meta)


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of a recording directory as a map a reader can ``.get`` from: {} when
    absent, unreadable or not a map; ``sessions`` always a list, of its map entries only.
    Other fields are as written: check their types (`meta_problem` says what is off)."""
    meta, _ = _parse_meta(Path(path))
    if not isinstance(meta, dict):
        return {}
    sessions = meta.get("sessions")
    sessions = sessions if isinstance(sessions, list) else []
    return {**meta, "sessions": [s for s in sessions if isinstance(s, dict)]}


def _foreign_format(meta: Any) -> bool:
    """A map naming another format: some other tool's directory, not a broken recording."""
    fmt = meta.get("format") if isinstance(meta, dict) else None
    return isinstance(fmt, str) and fmt != "rankscope-recording"


def rebuild_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``meta.json`` rebuilt from the segment files alone: one stopped session per
    segment, its messages and bytes counted by reading it (what the hub counted, rejects
    and drops, is lost with the broken file)."""
    p = Path(path)
    sessions: list[dict[str, Any]] = []
    version = 1
    for seg in segments(p):
        version = max(version, _header_version(seg))
        report = ReadReport()
        with contextlib.suppress(RecordingError):
            for _ in read_frames(seg, report):
                pass
        mtime = seg.stat().st_mtime_ns
        sessions.append(
            {
                "first_segment": seg.name,
                "last_segment": seg.name,
                "started_ns": None,
                "updated_ns": mtime,
                "stopped_ns": mtime,
                "messages": report.frames,
                "bytes": report.bytes,
                "counters": {},
                "rebuilt": True,
            }
        )
    return {
        "format": "rankscope-recording",
        "version": version,
        "created_ns": time.time_ns(),
        "sessions": sessions,
    }


def _header_version(seg: Path) -> int:
    """The format version in a segment's header, or 1 when it cannot be read or is
    damaged (a reader says more)."""
    try:
        with open(seg, "rb") as f:
            head = f.read(_FILE_HEADER.size)
        magic, version, _ = _FILE_HEADER.unpack(head)
    except (OSError, struct.error):
        return 1
    return version if magic == FILE_MAGIC and version in FORMATS else 1


def _codec() -> Any:
    """`hub.recording_codec`, imported when a format-2 segment is first met (it needs the
    ``zstandard`` package, a dependency of rankscope).

    Raises:
        RecordingError: ``zstandard`` is not installed.
    """
    try:
        from rankscope.hub import recording_codec
    except ImportError as exc:
        raise RecordingError(
            f"format-2 recordings need the zstandard package ({exc}); pip install zstandard"
        ) from None
    return recording_codec


def repair_meta(path: str | os.PathLike[str], problem: str) -> dict[str, Any]:
    """Set a broken ``meta.json`` aside as ``meta.json.bad-<n>`` (the first unused n) and
    write one rebuilt from the segments (`rebuild_meta`), which records the repair under
    ``repairs``. Call it only while holding the directory's lock.

    Returns:
        The new meta.
    """
    p = Path(path)
    n = 1
    while (p / f"{META_NAME}.bad-{n}").exists():
        n += 1
    kept = f"{META_NAME}.bad-{n}"
    with contextlib.suppress(FileNotFoundError):
        os.replace(p / META_NAME, p / kept)
    meta = rebuild_meta(p)
    meta["repairs"] = [{"at_ns": time.time_ns(), "problem": problem, "kept_as": kept}]
    tmp = p / f".{META_NAME}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(tmp, p / META_NAME)
    log.warning(
        "%s %s: kept as %s, rebuilt from %d segment(s)",
        p / META_NAME,
        problem,
        kept,
        len(meta["sessions"]),
    )
    return meta


# -- liveness -------------------------------------------------------------------------------

STALE_AFTER_S = 30.0
"""A session whose heartbeat (``updated_ns``, refreshed at every flush) is older than
this, or than 20 of its flush intervals if that is longer, belongs to a hub that died."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Start time of a process (clock ticks since boot, ``/proc/PID/stat`` field 22):
    with the pid, names one process even after the pid is reused."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after it
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_identity() -> dict[str, Any]:
    """Who this process is, for a reader to tell whether it still runs: host name, boot
    id, pid namespace, pid and the process's start time (None where the system does not
    say)."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    return {
        "hub_host": socket.gethostname(),
        "boot_id": boot.strip() if boot else None,
        "pid_ns": _pid_namespace(),
        "pid": os.getpid(),
        "pid_start": _start_ticks(os.getpid()),
    }


@dataclass(frozen=True)
class Liveness:
    """Whether a hub writes a recording now, from its last ``meta.json`` session."""

    state: str
    """``live``; ``stopped`` (closed cleanly); ``dead`` (killed: its process is gone, or
    its heartbeat is stale); ``none`` (no session recorded yet: a hub may be starting)."""
    endpoint: str | None
    """The last session's endpoint, whatever its state."""
    why: str
    """One line saying how the state was told."""

    @property
    def live(self) -> bool:
        return self.state == "live"


def session_liveness(path: str | os.PathLike[str], now_ns: int | None = None) -> Liveness:
    """Whether the hub of a recording's last session is still writing it.

    A session not marked stopped is dead when its process is gone — same host, boot and
    pid namespace, and no process of its pid with its start time — or when its heartbeat
    is older than ``STALE_AFTER_S`` (or 20 flush intervals). A ``kill -9`` never marks
    the session stopped: this is how a reader tells it from a running hub.

    Args:
        path: recording directory.
        now_ns: the wall clock (for tests).

    Returns:
        The `Liveness`.
    """
    sessions = read_meta(path).get("sessions") or []
    if not sessions:
        return Liveness("none", None, "no hub session is recorded")
    last = sessions[-1]
    endpoint = last.get("endpoint")
    if last.get("stopped_ns") is not None:
        return Liveness("stopped", endpoint, "its last hub stopped")
    pid, started = last.get("pid"), last.get("pid_start")
    me = process_identity()
    local = all(
        last.get(k) is not None and last.get(k) == me[k] for k in ("hub_host", "boot_id", "pid_ns")
    )
    if local and isinstance(pid, int) and not isinstance(pid, bool):
        ticks = _start_ticks(pid)
        if ticks is None:
            return Liveness("dead", endpoint, f"its hub (pid {pid}) is not running")
        if isinstance(started, int) and ticks != started:
            return Liveness("dead", endpoint, f"its hub (pid {pid}) exited; the pid was reused")
    updated = last.get("updated_ns")
    if isinstance(updated, int) and not isinstance(updated, bool):
        beat = last.get("heartbeat_s")
        beat = float(beat) if isinstance(beat, (int, float)) and beat > 0 else 0.5
        stale_s = max(STALE_AFTER_S, 20 * beat)
        age_s = ((time.time_ns() if now_ns is None else now_ns) - updated) / 1e9
        if age_s > stale_s:
            return Liveness(
                "dead", endpoint, f"its hub's heartbeat is {age_s:.0f} s old (> {stale_s:.0f} s)"
            )
    return Liveness("live", endpoint, "its hub is running")


def _frame_header(payload: bytes, t_recv_ns: int) -> bytes:
    t = struct.pack("<q", t_recv_ns)
    crc = zlib.crc32(payload, zlib.crc32(t))
    return _FRAME_HEADER.pack(FRAME_MAGIC, len(payload), crc, t_recv_ns)


def _write_all(fd: int, chunks: list[bytes]) -> int:
    """Write ``chunks`` in order with vectored writes (no copy into a user buffer)."""
    total = 0
    limit = 512  # well under IOV_MAX
    for i in range(0, len(chunks), limit):
        group = chunks[i : i + limit]
        want = sum(len(c) for c in group)
        done = os.writev(fd, group)
        total += done
        if done < want:  # a short write: finish this group byte by byte of what is left
            rest = b"".join(group)[done:]
            while rest:
                n = os.write(fd, rest)
                total += n
                rest = rest[n:]
    return total


class RecordingWriter:
    """Appends frames to a recording directory, one new segment per writer.

    Not thread-safe: one thread appends (the hub's receive loop); ``flush`` and ``close``
    may be called from others, they take a lock. With ``background``, a thread of the
    writer's own flushes every ``flush_s`` and whenever 8 MiB are buffered. In format 2 the
    flush also encodes and compresses (`hub.recording_codec`): with ``background`` that
    work is the writer thread's, and `append` only queues the message.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flush_s: float = 0.5,
        max_segment_bytes: int = 1 << 30,
        info: dict[str, Any] | None = None,
        background: bool = False,
        max_backlog_bytes: int = 256 << 20,
        format_version: int = FORMAT_VERSION,
        level: int | None = None,
    ) -> None:
        """Open ``path`` (created if needed) for writing.

        Args:
            path: recording directory.
            flush_s: longest time a received message waits in memory.
            max_segment_bytes: rotate to a new segment past this size.
            info: extra fields for this session's entry in ``meta.json`` (e.g. endpoint).
            background: write from a thread of the writer's own; `append` only queues.
            max_backlog_bytes: with ``background``, past this many buffered bytes `append`
                writes them itself (the disk is behind: the caller slows to its pace).
            format_version: 2 (compressed frames) or 1 (one raw message a frame, what
                hubs wrote before format 2, for readers that know only format 1).
            level: zstd level of format 2 (default ``recording_codec.LEVEL``).

        Raises:
            RecordingError: another hub holds the directory, it is not a recording, the
                format is unknown, or format 2 lacks the zstandard package.
        """
        if format_version not in FORMATS:
            raise RecordingError(f"unknown recording format {format_version!r} (known: {FORMATS})")
        self.format_version = format_version
        self._encoder: Any = None
        if format_version >= 2:
            codec = _codec()
            self._encoder = codec.Encoder(level=codec.LEVEL if level is None else level)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.flush_s = flush_s
        self.max_segment_bytes = max_segment_bytes
        self._lock = threading.Lock()
        self._lockfile = open(self.path / "lock", "a+b")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(self._lockfile.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lockfile.close()
            raise RecordingError(f"{self.path} is being written by another hub") from None
        try:
            self._meta = self._open_meta()
        except BaseException:
            self._lockfile.close()
            raise
        existing = segments(self.path)
        self._next_index = max((_segment_index(q.name) for q in existing), default=-1) + 1
        self._session: dict[str, Any] = {
            "first_segment": segment_name(self._next_index),
            "started_ns": time.time_ns(),
            "updated_ns": time.time_ns(),
            "stopped_ns": None,
            "messages": 0,
            "bytes": 0,
            "counters": {},
            "format": format_version,
            "stored_bytes": 0,
            "heartbeat_s": flush_s,
            **process_identity(),
            **(info or {}),
        }
        self._meta.setdefault("sessions", []).append(self._session)
        if format_version > self._meta.get("version", 1):
            self._meta["version"] = format_version
        self._chunks: list[bytes] = []
        """Format 1: frame headers and payloads not written yet, in order."""
        self._pending: list[tuple[bytes, int]] = []
        """Format 2: messages (payload, t_recv_ns) not encoded yet, in order."""
        self._buffered = 0
        self._last_flush = time.monotonic()
        self._file: BinaryIO | None = None
        self._size = 0
        self.closed = False
        self.max_backlog_bytes = max_backlog_bytes
        self._io_lock = threading.Lock()
        """Held while frames go to the file: one flush at a time, in order."""
        self._wake = threading.Event()
        self._stopping = False
        self._error: Exception | None = None
        """The background thread's last failed flush, raised by the next `append`."""
        self._open_segment()
        self._write_meta()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._write_loop, name="rankscope-hub-recorder", daemon=True
            )
            self._thread.start()

    def _open_meta(self) -> dict[str, Any]:
        """The directory's meta, repaired first when it is broken (`repair_meta`).

        Raises:
            RecordingError: the meta names another format, or a newer version.
        """
        meta, problem = _parse_meta(self.path)
        if meta is None and problem is None:
            return {
                "format": "rankscope-recording",
                "version": self.format_version,
                "created_ns": time.time_ns(),
                "sessions": [],
            }
        if _foreign_format(meta):
            raise RecordingError(f"{self.path / META_NAME} does not describe a recording")
        if problem is not None:
            return repair_meta(self.path, problem)
        assert isinstance(meta, dict)
        if meta["version"] > FORMAT_VERSION:
            raise RecordingError(
                f"{self.path} is format version {meta['version']}, this hub writes {FORMAT_VERSION}"
            )
        return meta

    def _open_segment(self) -> None:
        if self._file is not None:
            self._file.close()
        while True:
            name = segment_name(self._next_index)
            self._next_index += 1
            # Unbuffered: frames go to the kernel in one vectored write per flush. Closed
            # on rotation and in close().
            try:
                self._file = open(self.path / name, "xb", buffering=0)  # noqa: SIM115
            except FileExistsError:
                # Someone put a segment there since we looked (a copy, a hub on a file
                # system without working locks): never write into it, take the next.
                later = max((_segment_index(q.name) for q in segments(self.path)), default=-1)
                self._next_index = max(self._next_index, later + 1)
                continue
            break
        self._file.write(_FILE_HEADER.pack(FILE_MAGIC, self.format_version, 0))
        self._size = _FILE_HEADER.size
        if "last_segment" not in self._session:  # the first: its number may have moved on
            self._session["first_segment"] = name
        self._session["last_segment"] = name

    def append(self, payload: bytes, t_recv_ns: int) -> None:
        """Buffer one accepted message; written at the next flush.

        Raises:
            RecordingError: the recording is closed, or the background thread's last
                flush failed (its frames stay buffered and are tried again).
        """
        if self._encoder is None:
            # The checksum here, while the payload is in cache (and a thread that took it
            # would trade the GIL with this one for every frame); the write is the thread's.
            head = _frame_header(payload, t_recv_ns)
        with self._lock:
            if self.closed:
                raise RecordingError("recording is closed")
            if self._encoder is None:
                self._chunks.append(head)
                self._chunks.append(payload)
                self._buffered += len(head) + len(payload)
            else:  # encoded, compressed and checksummed at the flush, a block at a time
                self._pending.append((payload, t_recv_ns))
                self._buffered += len(payload)
            self._session["messages"] += 1
            self._session["bytes"] += len(payload)
            big = self._buffered >= 8 << 20
            error, self._error = self._error, None
        if self._thread is None:
            if big or time.monotonic() - self._last_flush >= self.flush_s:
                self.flush()
        elif self._buffered >= self.max_backlog_bytes:
            self.flush()  # the disk is behind: write here, after the thread's write
        elif big:
            self._wake.set()
        if error is not None:
            raise RecordingError(f"writing {self.path} failed: {error!r}") from error

    @property
    def backlog_bytes(self) -> int:
        """Bytes received and not written yet (with ``background``, the disk's lag)."""
        return self._buffered

    def maybe_flush(self, counters: dict[str, Any] | None = None) -> bool:
        """Flush when ``flush_s`` has passed since the last flush. Returns whether it did.

        With ``background``, only hands ``counters`` to the thread's next flush (the
        caller never waits for the disk) and returns False."""
        if self._thread is not None:
            if counters is not None:
                with self._lock:
                    self._session["counters"] = counters
            return False
        if time.monotonic() - self._last_flush < self.flush_s:
            return False
        self.flush(counters)
        return True

    def flush(self, counters: dict[str, Any] | None = None) -> None:
        """Write buffered frames to the segment and refresh ``meta.json``.

        Args:
            counters: the hub's counters to store with this session (rejects, drops...).

        Raises:
            OSError: the write failed; the frames stay buffered for the next flush.
        """
        with self._io_lock:
            with self._lock:
                if self.closed:
                    return
                if counters is not None:
                    self._session["counters"] = counters
                chunks, self._chunks = self._chunks, []
                pending, self._pending = self._pending, []
                size, self._buffered = self._buffered, 0
            if chunks or pending:
                try:
                    if pending:
                        chunks = self._encode(pending)
                        stored = sum(len(c) for c in chunks)
                    else:
                        stored = size
                    if self._size + stored > self.max_segment_bytes and self._size > 16:
                        self._open_segment()
                    assert self._file is not None
                    self._size += _write_all(self._file.fileno(), chunks)
                    with self._lock:
                        self._session["stored_bytes"] += stored
                except BaseException:
                    with self._lock:  # ahead of what came meanwhile, in order
                        if pending:
                            self._pending[:0] = pending
                        else:
                            self._chunks[:0] = chunks
                        self._buffered += size
                    raise
            with self._lock:  # the text under the lock, the file after it
                self._session["updated_ns"] = time.time_ns()
                self._last_flush = time.monotonic()
                text = self._meta_text()
            self._write_meta(text)

    def _encode(self, pending: list[tuple[bytes, int]]) -> list[bytes]:
        """Format-2 frames (header, body, header, body...) for the pending messages."""
        out: list[bytes] = []
        for body, t in self._encoder.bodies(pending):
            out.append(_frame_header(body, t))
            out.append(body)
        return out

    def _write_loop(self) -> None:
        """The background thread: flush every ``flush_s``, or at once when woken."""
        while not self._stopping:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.flush()
            except Exception as exc:  # a full disk: `append` reports it, frames wait
                with self._lock:
                    self._error = exc

    def _meta_text(self) -> str:
        return json.dumps(self._meta, indent=1, sort_keys=True)

    def _write_meta(self, text: str | None = None) -> None:
        tmp = self.path / f".{META_NAME}.tmp"
        tmp.write_text(self._meta_text() if text is None else text)
        os.replace(tmp, self.path / META_NAME)

    def close(self, counters: dict[str, Any] | None = None) -> None:
        """Flush, mark the session stopped and release the directory. Idempotent."""
        if self.closed:
            return
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
        self.flush(counters)
        with self._lock:
            self._session["stopped_ns"] = time.time_ns()
            self._write_meta()
            self.closed = True
            if self._file is not None:
                self._file.close()
            with contextlib.suppress(OSError):
                fcntl.flock(self._lockfile.fileno(), fcntl.LOCK_UN)
            self._lockfile.close()


_IMPLAUSIBLE_VERSION = 256
"""A segment header version from here up is damage (a flipped bit), not a newer format:
formats are numbered 1, 2, 3..."""


class _SegmentCursor:
    """Incremental parser of one segment file; survives partial frames at the end."""

    def __init__(self, path: Path, report: ReadReport) -> None:
        self.path = path
        self.name = path.name
        self.report = report
        self.f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.buf = b""
        self.base = 0  # file offset of buf[0]
        self.header_checked = False
        self.dead = False
        self.at_eof = False
        self.version = 1
        self._decoder: Any = None
        self.held = False
        """The last `poll` stopped at its budget of decoded bytes with frames left in
        ``buf``: the next one parses them before it reads more."""

    def close(self) -> None:
        self.f.close()

    def _skip(self, offset: int, nbytes: int, reason: str, detail: str = "") -> None:
        if nbytes > 0:
            self.report.skipped.append(Skip(self.name, offset, nbytes, reason, detail))

    def _messages(self, frame: Frame, nbytes: int) -> list[Frame]:
        """The messages of a whole, checksummed frame: itself in format 1, its decoded
        body in format 2 (none, and a ``corrupt`` skip, when the body does not decode)."""
        if self.version < 2:
            return [frame]
        if self._decoder is None:
            self._decoder = _codec().Decoder()
        codec = _codec()
        try:
            got = self._decoder.messages(frame.payload, frame.t_recv_ns)
        except codec.CodecError as exc:
            self._skip(frame.offset, nbytes, "corrupt", f"frame body: {exc}")
            return []
        return [
            Frame(t, payload, frame.segment, frame.offset, index=i, nbytes=len(payload))
            for i, (t, payload) in enumerate(got)
        ]

    def _frame_at(self, i: int) -> tuple[str, Frame | None, int]:
        """Parse at ``i``: ('ok', frame, next), ('short', None, 0) or ('bad', None, 0)."""
        buf = self.buf
        if len(buf) - i < _FRAME_HEADER.size:
            return "short", None, 0
        magic, length, crc, t = _FRAME_HEADER.unpack_from(buf, i)
        if magic != FRAME_MAGIC or length > MAX_MESSAGE_BYTES:
            return "bad", None, 0
        end = i + _FRAME_HEADER.size + length
        if end > len(buf):
            return "short", None, 0
        payload = buf[i + _FRAME_HEADER.size : end]
        if zlib.crc32(payload, zlib.crc32(buf[i + 12 : i + 20])) != crc:
            return "bad", None, 0
        return "ok", Frame(t, bytes(payload), self.name, self.base + i), end

    def _resync(self, i: int) -> int | None:
        """Index of the next complete valid frame after ``i`` in the buffer, if any."""
        j = self.buf.find(_FRAME_MAGIC_BYTES, i + 1)
        while j >= 0:
            state, _, _ = self._frame_at(j)
            if state == "ok":
                return j
            j = self.buf.find(_FRAME_MAGIC_BYTES, j + 1)
        return None

    def poll(self, final: bool = False) -> list[Frame]:
        """Frames completed since the last call. With ``final`` the segment will not grow:
        whatever cannot be parsed is reported as skipped."""
        if self.dead:
            self.at_eof = True
            return []
        if self.held:
            # The last call stopped at its budget: what it left is parsed before reading on.
            self.held = False
            self.at_eof = False
        else:
            more = self.f.read(_CHUNK)
            self.at_eof = len(more) < _CHUNK
            if more:
                self.buf += more
        final = final and self.at_eof
        budget = _CHUNK
        if not self.header_checked:
            if len(self.buf) < _FILE_HEADER.size:
                if final:
                    self._skip(0, len(self.buf), "truncated")
                    self.dead = True
                return []
            magic, version, _ = _FILE_HEADER.unpack_from(self.buf, 0)
            damaged = magic != FILE_MAGIC or version >= _IMPLAUSIBLE_VERSION or version == 0
            if not damaged and version > FORMAT_VERSION:
                raise RecordingError(
                    f"{self.path} is format version {version}; this reader knows {FORMAT_VERSION}"
                )
            if not damaged:
                self.version = version
            else:
                # A damaged header: the version the recording's meta names (a segment of
                # a format-2 recording with a flipped header byte still decodes).
                meta_version = read_meta(self.path.parent).get("version")
                if isinstance(meta_version, int) and meta_version in FORMATS:
                    self.version = meta_version
            if damaged:
                # A flipped byte in the header must not cost the segment's frames, which
                # carry checksums of their own: with a valid frame behind it, only the
                # header is skipped. Without one the file is not a segment at all.
                if self._resync(_FILE_HEADER.size - 1) is None:
                    self._skip(0, os.fstat(self.f.fileno()).st_size, "bad_header")
                    self.dead = True
                    return []
                self._skip(0, _FILE_HEADER.size, "bad_header")
            self.header_checked = True
            self.buf = self.buf[_FILE_HEADER.size :]
            self.base = _FILE_HEADER.size
        out: list[Frame] = []
        i = 0
        while True:
            state, frame, nxt = self._frame_at(i)
            if state == "ok":
                assert frame is not None
                got = self._messages(frame, nxt - i)
                out.extend(got)
                i = nxt
                budget -= sum(len(f.payload) for f in got)
                if budget <= 0:  # a format-2 chunk inflates tenfold: hand these out first
                    self.held = True
                    break
                continue
            if state == "bad" or final:
                j = self._resync(i)
                if j is not None:
                    self._skip(self.base + i, j - i, "corrupt")
                    i = j
                    continue
                if state == "bad" and not final:
                    # Keep the tail: a valid frame may still be landing behind the damage.
                    break
                self._skip(
                    self.base + i, len(self.buf) - i, "corrupt" if state == "bad" else "truncated"
                )
                i = len(self.buf)
            break
        self.buf = self.buf[i:]
        self.base += i
        self.report.frames += len(out)
        self.report.bytes += sum(len(f.payload) for f in out)
        return out


def read_frames(path: str | os.PathLike[str], report: ReadReport | None = None) -> Iterator[Frame]:
    """Every frame of a recording (directory or single segment file), in order.

    Args:
        path: recording directory or segment file.
        report: filled with counts and skipped regions.

    Yields:
        `Frame` records.

    Raises:
        RecordingError: the path holds no segment, or a segment has a newer format version.
    """
    report = report if report is not None else ReadReport()
    segs = segments(path)
    if not segs:
        raise RecordingError(f"{path} holds no recording segments")
    for seg in segs:
        cur = _SegmentCursor(seg, report)
        try:
            while True:
                frames = cur.poll(final=True)
                yield from frames
                if cur.at_eof and not frames:
                    break
        finally:
            cur.close()


def follow(
    path: str | os.PathLike[str],
    *,
    poll_s: float = 0.2,
    stop: Callable[[], bool] | threading.Event | None = None,
    report: ReadReport | None = None,
) -> Iterator[Frame]:
    """Yield frames of a growing recording as they land, like ``tail -f`` from the start.

    Waits for the directory and its first segment to appear. A segment is finished (its
    partial tail reported as truncated) once a later segment exists.

    Args:
        path: recording directory.
        poll_s: sleep between looks at the file when nothing new arrived.
        stop: an Event or callable; following ends when it is set / returns True.
        report: filled with counts and skipped regions.

    Yields:
        `Frame` records, in order.
    """
    report = report if report is not None else ReadReport()
    should_stop: Callable[[], bool]
    if stop is None:
        should_stop = lambda: False  # noqa: E731
    elif isinstance(stop, threading.Event):
        should_stop = stop.is_set
    else:
        should_stop = stop
    done: set[str] = set()
    cur: _SegmentCursor | None = None
    try:
        while True:
            if cur is None:
                todo = [s for s in segments(path) if s.name not in done]
                if todo:
                    cur = _SegmentCursor(todo[0], report)
            if cur is not None:
                frames = cur.poll()
                yield from frames
                if frames or not cur.at_eof:
                    continue
                here = segment_key(cur.name)
                later = [s for s in segments(path) if segment_key(s.name) > here]
                if later:
                    while True:
                        frames = cur.poll(final=True)
                        yield from frames
                        if cur.at_eof and not frames:
                            break
                    done.add(cur.name)
                    cur.close()
                    cur = None
                    continue
            if should_stop():
                return
            time.sleep(poll_s)
    finally:
        if cur is not None:
            cur.close()
