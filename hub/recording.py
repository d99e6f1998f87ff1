"""The recording: an append-only log of every message the hub accepted.

A recording is a directory::

    DIR/
      meta.json               what wrote it: format, version, one entry per hub session
      segment-000000.rsrec    frames of the first hub session
      segment-000001.rsrec    the next session (a restarted hub), or a rotation
      lock                    held (flock) by the hub writing here

Each hub session starts a new segment, so a hub killed mid-frame leaves at most a truncated
tail in its own segment and a restarted hub never writes after garbage. A segment is also
rotated when it grows past ``max_segment_bytes``. Readers join segments in name order.

Segment file (format version ``FORMAT_VERSION``, little endian)::

    header   8 bytes  FILE_MAGIC  b"RSREC\\r\\n\\x1a" (detects text-mode mangling)
             u32      format version
             u32      reserved (0)
    frame    u32      FRAME_MAGIC  (bytes b"RSRF")
             u32      payload length in bytes (≤ schema.MAX_MESSAGE_BYTES)
             u32      CRC-32 of the 8 t_recv_ns bytes followed by the payload
             i64      t_recv_ns: hub wall clock when the message was received
             bytes    payload: the wire message exactly as received (collector.schema)

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
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from rankscope.collector.schema import MAX_MESSAGE_BYTES

FORMAT_VERSION = 1
FILE_MAGIC = b"RSREC\r\n\x1a"
FRAME_MAGIC = 0x46525352
_FRAME_MAGIC_BYTES = struct.pack("<I", FRAME_MAGIC)
_FILE_HEADER = struct.Struct("<8sII")
_FRAME_HEADER = struct.Struct("<IIIq")
_SEGMENT_RE = re.compile(r"^segment-(\d{6})\.rsrec$")
META_NAME = "meta.json"
_CHUNK = 16 << 20


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


@dataclass(frozen=True)
class Skip:
    """Bytes a reader could not use."""

    segment: str
    offset: int
    nbytes: int
    reason: str
    """``truncated`` (a partial frame at the end of a finished segment), ``corrupt`` (bad
    magic, length or checksum), or ``bad_header`` (not a segment file)."""


@dataclass
class ReadReport:
    """What a reader went through: frames returned and bytes skipped."""

    frames: int = 0
    bytes: int = 0
    skipped: list[Skip] = field(default_factory=list)

    @property
    def skipped_bytes(self) -> int:
        return sum(s.nbytes for s in self.skipped)


def segment_name(index: int) -> str:
    return f"segment-{index:06d}.rsrec"


def _segment_index(name: str) -> int:
    m = _SEGMENT_RE.match(name)
    return int(m.group(1)) if m else -1


def segments(path: str | os.PathLike[str]) -> list[Path]:
    """The segment files of a recording directory, in order (a file path is itself)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    return sorted(q for q in p.iterdir() if _SEGMENT_RE.match(q.name))


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of a recording directory ({} when absent or unreadable)."""
    p = Path(path)
    try:
        return json.loads((p / META_NAME).read_text())
    except (OSError, ValueError):
        return {}


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
    writer's own flushes every ``flush_s`` and whenever 8 MiB are buffered.
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

        Raises:
            RecordingError: another hub holds the directory, or it is not a recording.
        """
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
        meta = read_meta(self.path)
        if meta and meta.get("format") != "rankscope-recording":
            raise RecordingError(f"{self.path / META_NAME} does not describe a recording")
        if meta.get("version", FORMAT_VERSION) > FORMAT_VERSION:
            raise RecordingError(
                f"{self.path} is format version {meta['version']}, this hub writes {FORMAT_VERSION}"
            )
        self._meta = meta or {
            "format": "rankscope-recording",
            "version": FORMAT_VERSION,
            "created_ns": time.time_ns(),
            "sessions": [],
        }
        existing = segments(self.path)
        self._next_index = _segment_index(existing[-1].name) + 1 if existing else 0
        self._session: dict[str, Any] = {
            "first_segment": segment_name(self._next_index),
            "started_ns": time.time_ns(),
            "updated_ns": time.time_ns(),
            "stopped_ns": None,
            "messages": 0,
            "bytes": 0,
            "counters": {},
            **(info or {}),
        }
        self._meta.setdefault("sessions", []).append(self._session)
        self._chunks: list[bytes] = []
        """Frame headers and payloads not written yet, in order."""
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

    def _open_segment(self) -> None:
        if self._file is not None:
            self._file.close()
        name = segment_name(self._next_index)
        self._next_index += 1
        # Unbuffered: frames go to the kernel in one vectored write per flush. Closed on
        # rotation and in close().
        self._file = open(self.path / name, "xb", buffering=0)  # noqa: SIM115
        self._file.write(_FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0))
        self._size = _FILE_HEADER.size
        self._session["last_segment"] = name

    def append(self, payload: bytes, t_recv_ns: int) -> None:
        """Buffer one accepted message; written at the next flush.

        Raises:
            RecordingError: the recording is closed, or the background thread's last
                flush failed (its frames stay buffered and are tried again).
        """
        # The checksum here, while the payload is in cache (and a thread that took it
        # would trade the GIL with this one for every frame); the write is the thread's.
        head = _frame_header(payload, t_recv_ns)
        with self._lock:
            if self.closed:
                raise RecordingError("recording is closed")
            self._chunks.append(head)
            self._chunks.append(payload)
            self._buffered += len(head) + len(payload)
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
                size, self._buffered = self._buffered, 0
            if chunks:
                try:
                    if self._size + size > self.max_segment_bytes and self._size > 16:
                        self._open_segment()
                    assert self._file is not None
                    self._size += _write_all(self._file.fileno(), chunks)
                except BaseException:
                    with self._lock:  # ahead of what came meanwhile, in order
                        self._chunks[:0] = chunks
                        self._buffered += size
                    raise
            with self._lock:  # the text under the lock, the file after it
                self._session["updated_ns"] = time.time_ns()
                self._last_flush = time.monotonic()
                text = self._meta_text()
            self._write_meta(text)

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

    def close(self) -> None:
        self.f.close()

    def _skip(self, offset: int, nbytes: int, reason: str) -> None:
        if nbytes > 0:
            self.report.skipped.append(Skip(self.name, offset, nbytes, reason))

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
        more = self.f.read(_CHUNK)
        self.at_eof = len(more) < _CHUNK
        if more:
            self.buf += more
        final = final and self.at_eof
        if not self.header_checked:
            if len(self.buf) < _FILE_HEADER.size:
                if final:
                    self._skip(0, len(self.buf), "truncated")
                    self.dead = True
                return []
            magic, version, _ = _FILE_HEADER.unpack_from(self.buf, 0)
            if magic != FILE_MAGIC:
                self._skip(0, os.fstat(self.f.fileno()).st_size, "bad_header")
                self.dead = True
                return []
            if version > FORMAT_VERSION:
                raise RecordingError(
                    f"{self.path} is format version {version}; this reader knows {FORMAT_VERSION}"
                )
            self.header_checked = True
            self.buf = self.buf[_FILE_HEADER.size :]
            self.base = _FILE_HEADER.size
        out: list[Frame] = []
        i = 0
        while True:
            state, frame, nxt = self._frame_at(i)
            if state == "ok":
                assert frame is not None
                out.append(frame)
                i = nxt
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
                later = [s for s in segments(path) if s.name > cur.name]
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
