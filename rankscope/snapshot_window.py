"""The ``window/`` of a snapshot: the recorded messages of the window's steps.

Copied from the recording message by message, so ``rankscope open`` replays the very data
the hub received (through the same validation), not a reconstruction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from rankscope.collector import schema


def _slice_table(cols: Mapping[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v)[keep] for k, v in cols.items()}


def _span(
    st: Mapping[str, np.ndarray] | None, wanted: np.ndarray, lo: int | None, hi: int | None
) -> tuple[int | None, int | None]:
    """``(lo, hi)`` widened to the known starts and ends of the wanted steps of ``st``."""
    if st is None:
        return lo, hi
    keep = np.isin(st["step"], wanted)
    starts, ends = st["t_start"][keep], st["t_end"][keep]
    starts, ends = starts[starts != schema.NO_TIME], ends[ends != schema.NO_TIME]
    if starts.size:
        lo = int(starts.min()) if lo is None else min(lo, int(starts.min()))
    if ends.size:
        hi = int(ends.max()) if hi is None else max(hi, int(ends.max()))
    return lo, hi


def _cut_node(msg: schema.Message, wanted: np.ndarray) -> tuple[bytes | None, list[schema.Message]]:
    """A ``reduced`` message restricted to the wanted steps (None when none is left), and
    its samples as each rank's own samples message (judged with the others, by time)."""
    from rankscope.hub.reduce import unpack_node

    tables = {
        name: _slice_table(t, np.isin(t["step"], wanted))
        for name, t in msg.tables.items()
        if name != "samples"
    }
    samples = [m for m in unpack_node(msg) if m.kind == "samples"]
    if not any(next(iter(t.values())).shape[0] for t in tables.values()):
        return None, samples
    header = {k: v for k, v in msg.header.items() if k not in ("kind", "v", "phase_names")}
    payload = schema.reduced_message(header, tables, list(msg.header.get("phase_names") or []))
    return payload, samples


def window_frames(path: str | Path, run: str, steps: Iterable[int]) -> Iterator[tuple[bytes, int]]:
    """The recorded messages of one run restricted to some steps, as ``(payload, t_recv)``.

    ``hello``, ``groups`` and ``stats`` messages are kept whole; ``steps`` messages keep
    the rows of the wanted steps (re-encoded only when some rows go); ``samples`` keep the
    samples taken between the first wanted step's start and the last one's end; of the
    heartbeats (``beat``) each rank's latest is kept, last, so the stall judge reads of
    the window what it read of the run.

    Args:
        path: recording directory.
        run: run id.
        steps: step ids to keep.

    Returns:
        An iterator of messages in recorded order.
    """
    from rankscope.hub.recording import read_frames

    wanted = np.asarray(sorted(set(int(s) for s in steps)), dtype=np.int64)
    held: list[tuple[schema.Message, int]] = []
    beats: dict[int, tuple[bytes, int]] = {}
    t_lo, t_hi = None, None
    for frame in read_frames(path):
        try:
            msg = schema.decode(frame.payload)
        except schema.SchemaError:
            continue
        if msg.header.get("run") != run:
            continue
        if msg.kind in ("hello", "groups", "stats"):
            yield frame.payload, frame.t_recv_ns
            continue
        if msg.kind == "samples":
            held.append((msg, frame.t_recv_ns))  # judged once the window's time span is known
            continue
        if msg.kind == "beat":
            beats.pop(int(msg.header["rank"]), None)
            beats[int(msg.header["rank"])] = (frame.payload, frame.t_recv_ns)
            continue
        if msg.kind == "reduced":  # a relay's node message: every table cut by step
            cut, samples = _cut_node(msg, wanted)
            held += [(s, frame.t_recv_ns) for s in samples]
            if cut is not None:
                t_lo, t_hi = _span(msg.tables.get("steps"), wanted, t_lo, t_hi)
                yield cut, frame.t_recv_ns
            continue
        tables = msg.tables
        if "steps" not in tables:
            continue  # a kind this copy does not know how to cut
        keep = np.isin(tables["steps"]["step"], wanted)
        if not keep.any():
            continue
        st = tables["steps"]
        t_lo, t_hi = _span(st, wanted, t_lo, t_hi)
        if keep.all() and all(
            np.isin(tables[t]["step"], wanted).all() for t in ("phases", "colls") if t in tables
        ):
            yield frame.payload, frame.t_recv_ns
            continue
        header = {k: v for k, v in msg.header.items() if k not in ("kind", "v", "phase_names")}
        part = {
            t: _slice_table(tables[t], np.isin(tables[t]["step"], wanted))
            for t in ("phases", "colls")
            if t in tables
        }
        payload = schema.steps_message(
            header,
            _slice_table(st, keep),
            part.get("phases"),
            part.get("colls"),
            list(msg.header.get("phase_names") or []),
        )
        yield payload, frame.t_recv_ns
    for msg, t_recv in held:
        s = msg.tables["samples"]
        if t_lo is None or t_hi is None:
            break
        keep = (s["t"] >= t_lo) & (s["t"] <= t_hi)
        if keep.any():
            header = {k: v for k, v in msg.header.items() if k not in ("kind", "v")}
            yield schema.samples_message(header, _slice_table(s, keep)), t_recv
    yield from sorted(beats.values(), key=lambda b: b[1])
