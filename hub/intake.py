"""The path every message takes into the hub: decode, validate, record, store.

The live receive loop and :func:`rankscope.hub.replay.load` both feed bytes through an
`Intake`, so a replayed recording builds exactly the store the live hub built.
"""

from __future__ import annotations

import logging
import time

from rankscope.collector import schema
from rankscope.hub.recording import RecordingWriter
from rankscope.hub.store import Store
from rankscope.hub.validate import REPLAY_LIMITS, Limits, Reject, check, values_plausible

log = logging.getLogger("rankscope.hub")


class RejectLog:
    """Logs each reject reason once with its detail, then at most every ``every_s`` seconds
    with the count since, so a misbehaving sender cannot flood the log."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def __call__(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.every_s:
            self._since[reason] = self._since.get(reason, 0) + 1
            return
        more = self._since.pop(reason, 0)
        extra = f" (+{more} more since last report)" if more else ""
        log.warning("rejected message: %s: %s%s", reason, detail, extra)
        self._last[reason] = now


class Intake:
    """Feeds raw messages into a `Store` (and a recording, when given), within ``limits``
    (`hub.validate.Limits`; a replay's by default: no window around the hub's clock)."""

    def __init__(
        self,
        store: Store,
        recorder: RecordingWriter | None = None,
        reject_log: RejectLog | None = None,
        limits: Limits = REPLAY_LIMITS,
    ) -> None:
        self.store = store
        self.recorder = recorder
        self.reject_log = reject_log or RejectLog()
        self.limits = limits

    def _reject(self, reason: str, detail: str, n: int = 1) -> None:
        self.store.count_reject(reason, n)
        self.reject_log(reason, detail)

    def _decode(self, data: bytes) -> schema.Message | None:
        if len(data) > self.limits.max_message_bytes:
            self._reject(
                "too_large",
                f"{len(data)} bytes > Limits.max_message_bytes {self.limits.max_message_bytes}",
            )
            return None
        try:
            return schema.decode(data, self.limits.max_header_bytes)
        except schema.SchemaError as exc:
            self._reject(exc.reason, exc.detail)
            return None

    def feed(self, data: bytes, t_recv_ns: int | None = None) -> bool:
        """Process one message; never raises.

        Args:
            data: the raw message.
            t_recv_ns: receive time (now when None): for the recording, and the hub's
                clock its times and the identity rule are checked against.

        Returns:
            True when (some of) the message was accepted.
        """
        msg = self._decode(data)
        if msg is None:
            return False
        return self._take(data, msg, time.time_ns() if t_recv_ns is None else t_recv_ns)

    def feed_many(self, batch: list[bytes], t_recv_ns: int) -> int:
        """Process messages received together, in order, as `feed` would; never raises.

        The values of their small tables are checked together (`validate.values_plausible`:
        one numpy call per question for the whole batch, where `feed` makes a few per
        message); a batch with a doubtful value, and every large table, is checked message
        by message, so each reject still names its message's column and value.

        Args:
            batch: raw messages.
            t_recv_ns: their receive time.

        Returns:
            How many were (partly) accepted.
        """
        taken = 0
        for chunk in _chunks(batch):  # a chunk's messages stay in cache
            msgs = [self._decode(data) for data in chunk]
            small = [m is not None and m.kind == "steps" and _small(m) for m in msgs]
            try:
                plausible = values_plausible(
                    [m for m, ok in zip(msgs, small, strict=True) if ok and m is not None],
                    self.limits,
                )
            except Exception as exc:  # a validation bug must not stop the hub
                log.warning("batch value check failed: %r", exc)
                plausible = False
            for data, msg, ok in zip(chunk, msgs, small, strict=True):
                if msg is not None:
                    taken += self._take(data, msg, t_recv_ns, values=not (ok and plausible))
        return taken

    def _take(self, data: bytes, msg: schema.Message, now: int, values: bool = True) -> bool:
        try:
            verdict = check(msg, self.store, now, self.limits, values=values)
        except Reject as exc:
            self._reject(exc.reason, exc.detail)
            return False
        except Exception as exc:  # a validation bug must not stop the hub
            self._reject("internal_error", f"validating {msg.kind}: {exc!r}")
            return False
        if verdict.duplicate_steps:
            h = msg.header
            n = verdict.duplicate_steps
            self._reject(
                "duplicate_step", f"rank {h['rank']} of run {h['run']!r} sent {n} step(s) again", n
            )
        for reason, detail, n in verdict.rejects:
            self._reject(reason, detail, n)
        if verdict.empty:
            return False
        if self.recorder is not None:
            try:
                self.recorder.append(data, now)
            except Exception as exc:  # a full disk must not stop the live view
                self._reject("record_error", repr(exc))
        try:
            self.store.ingest(msg, verdict.keep_steps, now)
            if msg.kind == "beat":
                h = msg.header
                run = self.store.run_state(h["run"])
                if run is not None:
                    run.beats.add(h["rank"], h, now)
        except Exception as exc:
            self._reject("internal_error", f"ingesting {msg.kind}: {exc!r}")
            return False
        return True


CHUNK = 256
"""Most messages whose values `Intake.feed_many` checks together."""
CHUNK_BYTES = 1 << 20
"""Most bytes of messages checked together: their columns stay in cache between the
decode, the check and the ingest."""
SMALL_ROWS = 4096
"""Tables up to this many rows are checked in batches (`Intake.feed_many`): above it a
message's own reductions cost little per row, and concatenating a batch of large tables
would only stream them through the cache once more."""


def _small(msg: schema.Message) -> bool:
    return all(t["step"].shape[0] <= SMALL_ROWS for t in msg.tables.values())


def _chunks(batch: list[bytes]) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    chunk: list[bytes] = []
    size = 0
    for data in batch:
        if chunk and (len(chunk) >= CHUNK or size + len(data) > CHUNK_BYTES):
            out.append(chunk)
            chunk, size = [], 0
        chunk.append(data)
        size += len(data)
    if chunk:
        out.append(chunk)
    return out
