"""Export a window as a Chrome / Perfetto trace-event JSON file (opens in ui.perfetto.dev).

Layout of the trace:

- one **process per host** (``process_name`` = host name), one **thread per rank**
  (``thread_name`` = ``rank N``), sorted by rank;
- every step, phase span and collective call is a complete slice (``"ph": "X"``); a
  collective slice runs from host issue (``t_enter``) to host completion (``t_exit``) and
  carries ``op``, ``group``, ``seq``, ``bytes``, ``lateness_us``, ``wait_us``,
  ``transfer_us`` and ``last_arriver``;
- the last-arriving rank of every complete collective instance gets
  ``"last_arriver": true`` on its slice and a thread-scoped instant event
  ``last arrival`` at its entry.

Timestamps are microseconds (with nanosecond decimals) relative to the window origin
``t0_ns``, which is written under ``otherData`` with the run's identity: epoch nanoseconds
do not fit a float64 microsecond value exactly.

The trace-event format requires slices on one thread to nest. Steps contain phases, and a
blocking collective sits inside the phase that issued it, so they share the rank's thread.
Asynchronous collectives (DDP buckets, ``async_op=True``) overlap each other and the phase
boundaries, so they get companion threads of the same rank, sorted right under it:

- ``rank N · stream``: device-timed asynchronous collectives drawn over their device
  interval (``t_start``..``t_end``), which a stream runs one after the other, as a GPU
  stream row of a profiler shows them; host issue and completion stay in the args;
- ``rank N · async``: asynchronous collectives without device times, over their host
  interval.

Whatever still overlaps without nesting is never clipped: it goes to one more thread of
that kind (``rank N · overlap K``, ``rank N · stream K``, ``rank N · async K``), so every
measured interval appears exactly as recorded. The last-arrival mark always sits on the
rank's own thread, at its host entry.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector.schema import (
    FLAG_ASYNC,
    FLAG_COALESCED,
    FLAG_DDP_BUCKET,
    FLAG_DDP_TAIL,
    FLAG_DEVICE_TIMED,
    FLAG_INSPECTOR,
    FLAG_INSPECTOR_OWN,
    FLAG_MANUAL,
    NO_TIME,
    OPS,
    PHASES,
)
from rankscope.diagnosis.window import Window
from rankscope.sanitize import for_terminal
from rankscope.version import __version__

_FLAG_NAMES = (
    (FLAG_DEVICE_TIMED, "device_timed"),
    (FLAG_ASYNC, "async"),
    (FLAG_COALESCED, "coalesced"),
    (FLAG_DDP_BUCKET, "ddp_bucket"),
    (FLAG_MANUAL, "manual"),
    (FLAG_DDP_TAIL, "ddp_tail"),
    (FLAG_INSPECTOR, "nccl_inspector"),
    (FLAG_INSPECTOR_OWN, "nccl_inspector_only"),
)

# Slice kinds, in the order a tie (same start and end) nests: the step holds its phases,
# a phase holds the collectives it issued.
_STEP, _PHASE, _COLL = 0, 1, 2
# Thread families of a rank, in display order.
_MAIN, _STREAM, _ASYNC = 0, 1, 2
_FAMILY = ("", "stream", "async")


def _thread_label(rank: int, family: int, lane: int) -> str:
    if family == _MAIN:
        return f"rank {rank}" if lane == 0 else f"rank {rank} · overlap {lane}"
    name = _FAMILY[family]
    return f"rank {rank} · {name}" if lane == 0 else f"rank {rank} · {name} {lane + 1}"


@dataclass(frozen=True)
class PhaseSpans:
    """Raw phase spans (one row per span), times float64 ns relative to the window's
    ``t0_ns``. The `Window` keeps only per-step phase totals; the spans come from the
    recording or the store's raw tables."""

    rank: np.ndarray
    """int global rank."""
    step: np.ndarray
    """int step id."""
    phase: np.ndarray
    """int index into ``names``."""
    t0: np.ndarray
    t1: np.ndarray
    names: tuple[str, ...]
    """Phase names: ``schema.PHASES`` followed by user phase names."""

    def __len__(self) -> int:
        return int(self.rank.shape[0])


def phase_spans(
    window: Window, phases: dict[str, np.ndarray], phase_names: tuple[str, ...] | list[str] = ()
) -> PhaseSpans:
    """Phase spans of a window from a raw ``phases`` table (schema columns plus ``rank``).

    Args:
        window: the window the spans belong to (its steps and time origin).
        phases: raw table: int64 hub-clock ``t0``/``t1`` (``NO_TIME`` unknown), ``step``,
            ``phase``, ``rank``.
        phase_names: user phase names indexed after ``schema.PHASES``.

    Returns:
        The spans of the window's steps, times relative to ``window.t0_ns``.

    Raises:
        ValueError: naming the column when the table misses one.
    """
    missing = [c for c in ("rank", "step", "phase", "t0", "t1") if c not in phases]
    if missing:
        raise ValueError(f"phases table misses columns {missing}")
    step = np.asarray(phases["step"], dtype=np.int64)
    keep = np.isin(step, window.steps)

    def rel(col: str) -> np.ndarray:
        raw = np.asarray(phases[col], dtype=np.int64)[keep]
        return np.where(raw == NO_TIME, np.nan, (raw - window.t0_ns).astype(np.float64))

    return PhaseSpans(
        rank=np.asarray(phases["rank"], dtype=np.int64)[keep],
        step=step[keep],
        phase=np.asarray(phases["phase"], dtype=np.int64)[keep],
        t0=rel("t0"),
        t1=rel("t1"),
        names=(*PHASES, *phase_names),
    )


@dataclass(frozen=True)
class TraceSummary:
    """What an export wrote."""

    path: str | None
    """File written, or None when only built in memory."""
    events: int
    """All trace events, metadata included."""
    slices: int
    """Complete ("X") slices: steps, phases and collectives."""
    collectives: int
    """Collective slices."""
    last_arrivals: int
    """Instant events marking a last-arriving rank."""
    hosts: int
    """Processes (one per host)."""
    ranks: int
    """Ranks with at least one slice."""
    threads: int
    """Rank threads, companions (stream, async, overlap) included."""


def _us(ns: np.ndarray) -> list[float]:
    # Round to whole nanoseconds first: the trace keeps ns as µs decimals, nothing finer.
    return (np.round(np.asarray(ns, dtype=np.float64)) / 1000.0).tolist()


@functools.lru_cache(maxsize=256)
def _flag_names(flags: int) -> tuple[str, ...]:
    # A trace holds millions of slices but only a handful of distinct flag words.
    return tuple(name for bit, name in _FLAG_NAMES if flags & bit)


def _assign_lanes(
    track: np.ndarray, start: np.ndarray, end: np.ndarray, kind: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Place slices on lanes of their track so each lane's slices nest properly.

    Args:
        track, start, end, kind: one entry per slice; a track is one rank's thread family.

    Returns:
        ``(order, lane)``: the slice indices sorted by track, start, longest first and kind,
        and the lane of each slice in that order (0 is the track's own thread).
    """
    order = np.lexsort((kind, -end, start, track))
    tracks = track[order].tolist()
    starts = start[order].tolist()
    ends = end[order].tolist()
    lanes = np.zeros(order.shape[0], dtype=np.int32)
    stacks: list[list[float]] = []
    current = None
    for i, (t, a, b) in enumerate(zip(tracks, starts, ends)):
        if t != current:
            current = t
            stacks = []
        placed = -1
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= a:
                stack.pop()
            if not stack or stack[-1] >= b:
                placed = k
                break
        if placed < 0:
            stacks.append([])
            placed = len(stacks) - 1
        stacks[placed].append(b)
        lanes[i] = placed
    return order, lanes


def instance_index(window: Window, group: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Row of ``window.instances`` naming each collective call.

    Args:
        window: the window whose instance table is searched.
        group, seq: the calls' group ids and sequence numbers.

    Returns:
        int64 index per call, -1 where the instance is not in the window.
    """
    inst = window.instances
    out = np.full(group.shape[0], -1, dtype=np.int64)
    if len(inst) == 0 or group.shape[0] == 0:
        return out
    span = int(max(inst.seq.max(), seq.max())) + 1
    key = inst.group.astype(np.int64) * span + inst.seq.astype(np.int64)
    sorter = np.argsort(key, kind="stable")
    want = group.astype(np.int64) * span + seq.astype(np.int64)
    pos = np.searchsorted(key, want, sorter=sorter)
    pos = np.minimum(pos, key.shape[0] - 1)
    hit = key[sorter[pos]] == want
    out[hit] = sorter[pos][hit]
    return out


def _collective_columns(window: Window, c_idx: np.ndarray) -> dict[str, list[Any]]:
    """Per-call columns of the kept collective rows, joined to their instance (as lists,
    ready for JSON): lateness, wait and transfer only where every member has arrived."""
    rows = window.rows
    assert rows is not None
    inst = window.instances
    t0 = rows.t_enter[c_idx]
    t1 = np.maximum(rows.t_exit[c_idx], t0)
    rank = rows.rank[c_idx]
    inst_i = instance_index(window, rows.group[c_idx], rows.seq[c_idx])
    found = inst_i >= 0
    nan = np.full(c_idx.shape[0], np.nan)
    if found.any():
        safe = np.where(found, inst_i, 0)
        complete = found & (inst.n_arrived[safe] >= inst.n_members[safe])
        first = np.where(complete, inst.first[safe], np.nan)
        last = np.where(complete, inst.last[safe], np.nan)
        is_last = complete & (inst.last_rank[safe] == rank)
        skew = np.where(is_last, inst.skew[safe], np.nan)
        margin = np.where(is_last, inst.margin[safe], np.nan)
    else:
        first = last = skew = margin = nan
        is_last = np.zeros(c_idx.shape[0], dtype=bool)
    return {
        "op": rows.op[c_idx].tolist(),
        "group": rows.group[c_idx].tolist(),
        "seq": rows.seq[c_idx].tolist(),
        "bytes": rows.nbytes[c_idx].tolist(),
        "step": rows.step[c_idx].tolist(),
        "flags": rows.flags[c_idx].tolist(),
        "device_us": _us(
            np.where(
                rows.t_end[c_idx] >= rows.t_start[c_idx],
                rows.t_end[c_idx] - rows.t_start[c_idx],
                np.nan,
            )
        ),
        "lateness_us": _us(t0 - first),
        "wait_us": _us(np.clip(last - t0, 0.0, t1 - t0)),
        "transfer_us": _us(t1 - np.maximum(t0, last)),
        "skew_us": _us(skew),
        "margin_us": _us(margin),
        "last_arriver": is_last.tolist(),
    }


def _step_args(window: Window, r: int, col: int, step_ms: float) -> dict[str, Any]:
    args: dict[str, Any] = {"step": int(window.steps[col]), "rank": r, "step_ms": step_ms}
    for name, arr in window.phase_ns.items():
        v = float(arr[r, col])
        if math.isfinite(v):
            args[f"{name}_ms"] = round(v / 1e6, 6)
    for name in ("gc_ns", "cpu_ns", "runq_ns"):
        arr = window.host.get(name)
        v = float(arr[r, col]) if arr is not None else math.nan
        if math.isfinite(v):
            args[name.replace("_ns", "_ms")] = round(v / 1e6, 6)
    for name in ("wait_ns", "transfer_ns", "late_ns", "times_last"):
        arr = window.coll.get(name)
        v = float(arr[r, col]) if arr is not None else math.nan
        if math.isfinite(v):
            args[name.replace("_ns", "_ms")] = int(v) if name == "times_last" else round(v / 1e6, 6)
    return args


def _collective_event(
    window: Window, cols: dict[str, list[Any]], c: int, r: int
) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """Name and args of one collective slice, and the args of its last-arrival mark."""
    op_code = cols["op"][c]
    op = OPS[op_code] if 0 <= op_code < len(OPS) else f"op{op_code}"
    gid = cols["group"][c]
    ginfo = window.groups.get(gid)
    args: dict[str, Any] = {
        "op": op,
        "group": gid,
        "group_name": for_terminal(ginfo.name) if ginfo else f"g{gid}",
        "seq": cols["seq"][c],
        "bytes": cols["bytes"][c],
        "step": cols["step"][c],
        "rank": r,
        "last_arriver": cols["last_arriver"][c],
    }
    if ginfo is not None:
        args["members"] = len(ginfo.ranks)
    for key in ("lateness_us", "wait_us", "transfer_us", "device_us"):
        v = cols[key][c]
        if math.isfinite(v):
            args[key] = v
    flag_list = _flag_names(cols["flags"][c])
    if flag_list:
        args["flags"] = list(flag_list)
    mark = None
    if args["last_arriver"]:
        mark = {"group": gid, "seq": args["seq"], "op": op, "rank": r}
        for key in ("skew_us", "margin_us"):
            if math.isfinite(cols[key][c]):
                mark[key] = cols[key][c]
    return op, args, mark


def build_trace(
    window: Window, phases: PhaseSpans | None = None, ranks: Sequence[int] | None = None
) -> dict[str, Any]:
    """Build the trace-event document of a window.

    Args:
        window: the run's window; collective slices need ``window.rows``.
        phases: raw phase spans; without them phases appear only as per-step totals in the
            step slices' args.
        ranks: only these ranks' slices (every rank by default). Collective args
            (lateness, wait, last arriver) still come from every member's rows.

    Returns:
        A JSON-ready dict ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
    """
    n_ranks = window.world_size
    hosts = [for_terminal(h) for h in window.ranks.hosts]  # telemetry: shown by the UI
    host_of = np.asarray(window.ranks.host, dtype=np.int64).copy()
    if (host_of < 0).any():
        host_of[host_of < 0] = len(hosts)
        hosts.append("unknown host")

    chosen = np.ones(n_ranks, dtype=bool)
    if ranks is not None:
        chosen[:] = False
        chosen[[r for r in ranks if 0 <= r < n_ranks]] = True

    # Every slice as columns: rank, start, end, kind and its row in its own table.
    ok = window.present & np.isfinite(window.t_start) & np.isfinite(window.t_end)
    ok &= chosen[:, None]
    st_rank, st_col = np.nonzero(ok)
    parts: list[tuple[Any, ...]] = [(st_rank, window.t_start[ok], window.t_end[ok], _STEP)]
    ph_idx = np.zeros(0, dtype=np.int64)
    if phases is not None and len(phases):
        p_rank = np.asarray(phases.rank, dtype=np.int64)
        p_t0 = np.asarray(phases.t0, dtype=np.float64)
        p_t1 = np.asarray(phases.t1, dtype=np.float64)
        keep = np.isfinite(p_t0) & np.isfinite(p_t1) & (p_rank >= 0) & (p_rank < n_ranks)
        keep[keep] = chosen[p_rank[keep]]
        ph_idx = np.nonzero(keep)[0]
        parts.append((p_rank[ph_idx], p_t0[ph_idx], p_t1[ph_idx], _PHASE))
    c_idx = np.zeros(0, dtype=np.int64)
    rows = window.rows
    if rows is not None and len(rows):
        keep = (
            np.isfinite(rows.t_enter)
            & np.isfinite(rows.t_exit)
            & (rows.rank >= 0)
            & (rows.rank < n_ranks)
        )
        keep[keep] = chosen[rows.rank[keep].astype(np.int64)]
        c_idx = np.nonzero(keep)[0]
        flags = rows.flags[c_idx].astype(np.int64)
        is_async = (flags & (FLAG_ASYNC | FLAG_DDP_BUCKET)) != 0
        d0, d1 = rows.t_start[c_idx], rows.t_end[c_idx]
        on_device = (
            is_async
            & ((flags & FLAG_DEVICE_TIMED) != 0)
            & np.isfinite(d0)
            & np.isfinite(d1)
            & (d1 >= d0)
        )
        fam = np.where(on_device, _STREAM, np.where(is_async, _ASYNC, _MAIN))
        c0 = np.where(on_device, d0, rows.t_enter[c_idx])
        c1 = np.where(on_device, d1, rows.t_exit[c_idx])
        parts.append((rows.rank[c_idx], c0, c1, _COLL, fam))
    rank = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in parts])
    start = np.concatenate([np.asarray(p[1], dtype=np.float64) for p in parts])
    end = np.maximum(np.concatenate([np.asarray(p[2], dtype=np.float64) for p in parts]), start)
    kind = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int8) for p in parts])
    family = np.concatenate(
        [p[4] if len(p) > 4 else np.full(len(p[0]), _MAIN) for p in parts]  # type: ignore[misc]
    ).astype(np.int64)
    src = np.concatenate([np.arange(len(p[0])) for p in parts])
    order, lanes = _assign_lanes(rank * 3 + family, start, end, kind)
    cols = _collective_columns(window, c_idx) if c_idx.shape[0] else {}

    # tids start above every pid, so no rank thread is taken for a host's main thread.
    threads: dict[tuple[int, int, int], int] = {}

    def tid_of(r: int, fam: int, lane: int) -> int:
        key = (r, fam, lane)
        if key not in threads:
            threads[key] = len(hosts) + 1 + len(threads)
        return threads[key]

    events: list[dict[str, Any]] = []
    ts_all = _us(start[order])
    dur_all = _us(end[order] - start[order])
    enter_us = _us(rows.t_enter[c_idx]) if rows is not None and c_idx.shape[0] else []
    exit_us = _us(rows.t_exit[c_idx]) if rows is not None and c_idx.shape[0] else []
    for j, (i, lane) in enumerate(zip(order.tolist(), lanes.tolist())):
        r = int(rank[i])
        pid = int(host_of[r]) + 1
        tid = tid_of(r, int(family[i]), lane)
        s = int(src[i])
        ev: dict[str, Any] = {"ph": "X", "pid": pid, "tid": tid, "ts": ts_all[j], "dur": dur_all[j]}
        k = int(kind[i])
        if k == _STEP:
            col = int(st_col[s])
            args = _step_args(window, r, col, round(dur_all[j] / 1000.0, 6))
            ev.update(name=f"step {args['step']}", cat="step", args=args)
        elif k == _PHASE:
            assert phases is not None
            row = int(ph_idx[s])
            code = int(phases.phase[row])
            name = (
                for_terminal(phases.names[code])
                if 0 <= code < len(phases.names)
                else f"phase {code}"
            )
            ev.update(name=name, cat="phase", args={"step": int(phases.step[row]), "rank": r})
        else:
            op, args, mark = _collective_event(window, cols, s, r)
            if family[i] == _STREAM:
                args["drawn"] = "device interval"
                args["host_enter_us"] = enter_us[s]
                args["host_exit_us"] = exit_us[s]
            ev.update(name=op, cat="collective", args=args)
            if mark is not None:
                events.append(ev)
                ev = {"ph": "i", "s": "t", "name": "last arrival", "cat": "collective"}
                ev.update(pid=pid, tid=tid_of(r, _MAIN, 0), ts=enter_us[s], args=mark)
        events.append(ev)

    meta: list[dict[str, Any]] = []
    for pid in sorted({int(host_of[r]) + 1 for r, _, _ in threads}):
        for key, value in (
            ("process_name", {"name": hosts[pid - 1]}),
            ("process_sort_index", {"sort_index": pid - 1}),
        ):
            meta.append({"ph": "M", "name": key, "pid": pid, "tid": 0, "args": value})
    for position, (r, fam_code, lane) in enumerate(sorted(threads)):
        pid = int(host_of[r]) + 1
        for key, value in (
            ("thread_name", {"name": _thread_label(r, fam_code, lane)}),
            ("thread_sort_index", {"sort_index": position}),
        ):
            meta.append(
                {
                    "ph": "M",
                    "name": key,
                    "pid": pid,
                    "tid": threads[(r, fam_code, lane)],
                    "args": value,
                }
            )

    other = {
        "producer": f"rankscope {__version__}",
        "job": window.job,
        "run": window.run,
        "scope": window.scope,
        "parent_run": window.parent_run,
        "t0_ns": int(window.t0_ns),
        "time_base": "microseconds relative to t0_ns on the hub-aligned clock",
        "steps": [int(window.steps[0]), int(window.steps[-1])] if window.steps.size else [],
        "world_size": n_ranks,
        "ranks_included": n_ranks if ranks is None else int(chosen.sum()),
        "collectives_included": bool(c_idx.shape[0]),
        "phase_spans_included": bool(ph_idx.shape[0]),
    }
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def summarize(doc: dict[str, Any], path: str | None = None) -> TraceSummary:
    """Count what a trace document holds.

    Args:
        doc: a document from `build_trace`.
        path: where it was written, if anywhere.

    Returns:
        The summary.
    """
    evs = doc["traceEvents"]
    slices = [e for e in evs if e["ph"] == "X"]
    names = [e for e in evs if e["ph"] == "M" and e["name"] == "thread_name"]
    return TraceSummary(
        path=path,
        events=len(evs),
        slices=len(slices),
        collectives=sum(1 for e in slices if e["cat"] == "collective"),
        last_arrivals=sum(1 for e in evs if e["ph"] == "i"),
        hosts=sum(1 for e in evs if e["ph"] == "M" and e["name"] == "process_name"),
        ranks=len({e["args"]["name"].split(" ·")[0] for e in names}),
        threads=len(names),
    )


def write_trace(
    path: str | Path,
    window: Window,
    phases: PhaseSpans | None = None,
    ranks: Sequence[int] | None = None,
) -> TraceSummary:
    """Write the trace of a window to a JSON file.

    Args:
        path: output file (``.json``); its folder must exist.
        window: the run's window.
        phases: raw phase spans, if known.
        ranks: only these ranks (every rank by default; see `build_trace`).

    Returns:
        What was written.

    Raises:
        ValueError: when the folder of ``path`` does not exist.
    """
    out = Path(path)
    if not out.parent.is_dir():
        raise ValueError(
            f"cannot write trace {str(out)!r}: folder {str(out.parent)!r} does not exist"
        )
    doc = build_trace(window, phases, ranks)
    # dumps, not dump: only the one-shot encoder runs in C (about 8x faster here).
    # allow_nan=False: a NaN would make the file unreadable by the trace viewers.
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    out.write_text(text, encoding="utf-8")
    return summarize(doc, str(out))
