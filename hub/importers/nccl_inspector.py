"""Import NCCL Inspector logs (``libnccl-profiler-inspector.so``, NVIDIA/nccl
``ext-profiler/inspector``).

The Inspector writes, per process, a growing file of JSON objects (output format v4.0),
one per collective per communicator::

    {"header": {"id": "0x7f8c...", "rank": 2, "n_ranks": 8, "nnodes": 1},
     "metadata": {"inspector_output_format_version": "v4.0", "dump_timestamp_us": ...,
                  "hostname": ..., "pid": ...},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": ...,
                   "coll_exec_time_us": 61974, "coll_timing_source": "kernel_gpu",
                   "coll_algobw_gbs": ..., "coll_busbw_gbs": ...,
                   "event_trace_ts": {"coll_start_ts": ..., "coll_stop_ts": ...,
                                      "kernel_events": [{"channel_id", "kernel_start_ts",
                                                         "kernel_stop_ts", ...}]}}}

``event_trace_ts`` (µs) is there with ``NCCL_INSPECTOR_DUMP_VERBOSE=1``. Objects may be
pretty-printed or one per line; they are read as a stream of concatenated JSON values, so
a partial last object (a file still being written) is left for later, not an error.

Rows: one collective row per object, matched across processes by ``(communicator id,
coll_sn)``. With verbose timestamps ``t_enter`` is the collective's start callback (host
issue), ``t_start``/``t_end`` the first channel kernel start and last kernel stop (device
time, ``FLAG_DEVICE_TIMED``), and ranks are aligned on one clock from matched kernel ends
(`hub.importers.align`). Without them only the GPU-timed duration and the dump thread's
write time are known: no entry time, which every collective row needs (a reader refuses
rows without one), and none could be made up without inventing an arrival order, so such
output is named (`NOT_VERBOSE`) and left out. What its kernel durations do tell is kept in
the report: who arrived last (`last_by_kernel`) and the transfer's bandwidth per message
size (`bandwidth_by_size`), both from each collective's shortest member kernel. A process's global rank is its rank in its
largest communicator. Steps: the source has none; one step is `STEP_COLLECTIVES`
collectives of the busiest communicator (others belong to the step open when they started).

Bad input is a problem of the report, never a traceback, and the rest of the file is
imported: an object that is not a record, misses a field a row needs or holds a value that
cannot be (a wrong type, a time or duration outside ``0..2**52`` µs, a rank outside the
hub's world, kernels ending before they start, a collective longer than the hub takes) is
left out and counted, one problem line per file and reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector import schema
from rankscope.hub.importers import (
    ImportReport,
    header,
    next_header,
    open_text,
    source_manifest,
)
from rankscope.hub.importers.align import estimate_offsets
from rankscope.hub.importers.kineto import op_name
from rankscope.hub.validate import Limits

KIND = "nccl-inspector"

STEP_COLLECTIVES = 10
"""Collectives of the busiest communicator that make one imported step."""

COLUMNS = (
    "comm",
    "comm_rank",
    "n_ranks",
    "seq",
    "op",
    "nbytes",
    "exec_ns",
    "dump_ns",
    "enter_ns",
    "kstart_ns",
    "kend_ns",
)
"""Columns `parse_records` returns (``comm`` indexes its list of communicator ids; times
are ns on the writing host's clock, -1 unknown)."""

NOT_VERBOSE = (
    "holds no verbose timestamps (event_trace_ts): a collective row needs each rank's entry "
    "time, which the Inspector writes only with NCCL_INSPECTOR_DUMP_VERBOSE=1; left out"
)
"""The problem of an import whose files hold no verbose record."""

MAX_US = 2**52
"""Times (µs since the epoch) and durations at or beyond this cannot be true (142 years):
a record holding one is left out. Below it every time fits ``schema.MAX_TIME_NS`` in ns."""

MAX_SN = schema.MAX_TIME_NS
"""Largest ``coll_sn`` and byte count taken (2**62, what every reader's columns hold)."""

MAX_RANKS = Limits.max_world_size
"""Ranks and communicator sizes must lie below this many (the hub's largest world)."""

MAX_DURATION_NS = int(Limits.max_duration_s * 1e9)
"""Longest collective or step the hub takes (7 days): longer ones are left out."""


def iter_objects(text: str, pos: int = 0) -> Iterator[tuple[Any, int]]:
    """JSON values in ``text`` from ``pos``, each with the offset after it; stops at the
    first value that is incomplete (the rest may still be being written).

    Raises:
        ValueError: text that is not JSON before the end (a corrupt record), with its offset.
    """
    dec = json.JSONDecoder()
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        if pos >= n:
            return
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            # An unfinished last value is the end of what is written so far.
            if _unbalanced(text, pos):
                return
            raise ValueError(f"not JSON at offset {pos}: {exc.msg}") from None
        except RecursionError:
            raise ValueError(f"JSON nested too deeply to read at offset {pos}") from None
        yield obj, end
        pos = end


def _unbalanced(text: str, pos: int) -> bool:
    """Whether the value starting at ``pos`` is an unfinished object (more ``{`` than ``}``
    outside strings up to the end)."""
    depth, i, n, in_str = 0, pos, len(text), False
    while i < n:
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return False
        i += 1
    return depth > 0


class Unusable(ValueError):
    """Why a record is left out; the text completes "N record(s) ... left out"."""


_ABSENT = object()


@dataclass
class Records:
    """Rows parsed from Inspector objects (`COLUMNS`), plus what they name."""

    comms: list[str] = field(default_factory=list)
    rows: list[tuple[int, ...]] = field(default_factory=list)
    host: str = ""
    pid: int = 0
    bad: int = 0
    """Objects left out (without the fields a row needs, or with values that cannot be)."""
    why: dict[str, int] = field(default_factory=dict)
    """Objects left out, by why (`Unusable`), in the order first met."""
    bad_pid: bool = False
    """Whether the ``metadata.pid`` read is not a process id (the pid is then unknown)."""

    def columns(self) -> dict[str, np.ndarray]:
        """The rows as int64 columns."""
        arr = np.array(self.rows, np.int64).reshape(len(self.rows), len(COLUMNS))
        return {c: arr[:, i].copy() for i, c in enumerate(COLUMNS)}


def _int(d: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    """``d[key]``, an integer (not a boolean) in ``lo..hi``; ``default`` when it is absent
    or null, and required when ``default`` is None.

    Raises:
        Unusable: absent and required, or not such an integer.
    """
    v = d.get(key, _ABSENT)
    if v is _ABSENT or v is None:
        if default is None:
            raise Unusable(f"without {key}")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise Unusable(f"whose {key} is not an integer in {lo}..{_power(hi)}")
    return v


def _us(d: dict[str, Any], key: str) -> float | None:
    """``d[key]``, a time or duration in µs (a finite number in ``0..MAX_US``); None when
    absent or null.

    Raises:
        Unusable: a value that is not such a number.
    """
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < MAX_US:
        raise Unusable(f"whose {key} is not a number of µs in 0..2**52")
    return v


def _power(n: int) -> str:
    """``n`` as the power of two it is (``2**62``), or as digits."""
    return f"2**{n.bit_length() - 1}" if n > 1 << 20 and n & (n - 1) == 0 else str(n)


def _object(d: dict[str, Any], key: str) -> dict[str, Any]:
    """``d[key]``, an object (empty when absent or null).

    Raises:
        Unusable: a value that is not an object.
    """
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise Unusable(f"whose {key} is not an object")
    return v


def _kernel_span(ts: dict[str, Any]) -> tuple[int, int]:
    """(first kernel start, last kernel stop) in ns of a record's ``event_trace_ts``, -1
    where unknown. Entries of ``kernel_events`` that are not objects are passed over.

    Raises:
        Unusable: ``kernel_events`` that is not a list, a time that cannot be, or a last
            stop before the first start.
    """
    events = ts.get("kernel_events")
    if events is None:
        events = []
    if not isinstance(events, list):
        raise Unusable("whose kernel_events is not a list")
    starts, stops = [], []
    for k in events:
        if isinstance(k, dict):
            start, stop = _us(k, "kernel_start_ts"), _us(k, "kernel_stop_ts")
            if start is not None:
                starts.append(int(start) * 1000)
            if stop is not None:
                stops.append(int(stop) * 1000)
    kstart, kend = min(starts, default=-1), max(stops, default=-1)
    if kstart >= 0 and kend >= 0 and kend < kstart:
        raise Unusable("whose last kernel stops before the first starts")
    return kstart, kend


def _times(perf: dict[str, Any], meta: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """``(exec_ns, dump_ns, enter_ns, kstart_ns, kend_ns)`` of one record (-1 unknown).

    Raises:
        Unusable: a time that cannot be, kernels ending before the collective started, or
            a collective longer than `MAX_DURATION_NS`.
    """
    exec_us = _us(perf, "coll_exec_time_us")
    dump_us = _us(meta, "dump_timestamp_us")
    ts = _object(perf, "event_trace_ts")
    enter_us = _us(ts, "coll_start_ts")
    kstart, kend = _kernel_span(ts)
    exec_ns = int(float(exec_us) * 1000) if exec_us is not None else -1
    dump_ns = int(dump_us) * 1000 if dump_us is not None else -1
    enter = int(enter_us) * 1000 if enter_us is not None else -1
    if enter >= 0 and kend >= 0 and kend < enter:
        raise Unusable("whose kernels end before coll_start_ts")
    first = min((t for t in (enter, kstart) if t >= 0), default=-1)
    if exec_ns > MAX_DURATION_NS or (first >= 0 and kend - first > MAX_DURATION_NS):
        raise Unusable("that last longer than 7 days")
    return exec_ns, dump_ns, enter, kstart, kend


def _parse_record(obj: Any) -> tuple[str, tuple[int, ...], dict[str, Any]]:
    """One Inspector object as ``(communicator id, row, metadata)``; the row holds the
    `COLUMNS` (its ``comm`` still 0).

    Raises:
        Unusable: the object is not a record, misses a field a row needs, or holds a value
            of the wrong type or one that cannot be (the text says which).
    """
    if not isinstance(obj, dict):
        raise Unusable("that are not JSON objects")
    h, perf = obj.get("header"), obj.get("coll_perf")
    if not isinstance(h, dict) or not isinstance(perf, dict):
        raise Unusable("without header/coll_perf fields")
    meta = _object(obj, "metadata")
    comm = h.get("id")
    if comm is None or "coll" not in perf:
        raise Unusable("without header/coll_perf fields")
    if isinstance(comm, bool) or not isinstance(comm, str | int):
        raise Unusable("whose header id is not a string or integer")
    if not isinstance(perf["coll"], str):
        raise Unusable("whose coll is not a string")
    row = (
        0,
        _int(h, "rank", 0, MAX_RANKS - 1),
        _int(h, "n_ranks", 1, MAX_RANKS, -1),
        _int(perf, "coll_sn", 0, MAX_SN),
        schema.OP_INDEX[op_name(perf["coll"])],
        _int(perf, "coll_msg_size_bytes", 0, MAX_SN, -1),
        *_times(perf, meta),
    )
    return str(comm), row, meta


def add_record(rec: Records, obj: Any) -> None:
    """Add one Inspector object to ``rec`` (counted in ``rec.bad``, by why in ``rec.why``,
    when unusable)."""
    try:
        comm, row, meta = _parse_record(obj)
    except Unusable as exc:
        rec.bad += 1
        rec.why[str(exc)] = rec.why.get(str(exc), 0) + 1
        return
    if comm not in rec.comms:
        rec.comms.append(comm)
    rec.rows.append((rec.comms.index(comm), *row[1:]))
    if not rec.host and isinstance(meta.get("hostname"), str):
        rec.host = meta["hostname"]
        pid = meta.get("pid", 0)
        if isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**63:
            rec.pid = pid
        else:
            rec.bad_pid = pid is not None


def parse_file(path: Path, report: ImportReport) -> Records | None:
    """All records of one Inspector file (a corrupt stretch ends the file's use there)."""
    rec = Records()
    try:
        with open_text(path) as f:
            text = f.read()
    except OSError as exc:
        report.problem(path, f"cannot be read ({exc.strerror or exc}); left out")
        return None
    end = 0
    try:
        for obj, after in iter_objects(text):
            add_record(rec, obj)
            end = after
    except ValueError as exc:
        report.problem(path, f"{exc}; the records before it are imported")
    if end < len(text.rstrip()) and not any(p[0] == str(path) for p in report.problems):
        report.problem(path, f"incomplete last record at offset {end} left out")
    for why, n in rec.why.items():
        report.problem(path, f"{n} record(s) {why} left out")
    if rec.bad_pid:
        report.problem(path, "metadata pid is not an integer in 0..2**63-1; pid unknown")
    if not rec.rows:
        report.problem(path, "holds no Inspector collective record; left out")
        return None
    return rec


def messages(files: list[Path], report: ImportReport, *, job: str, run: str) -> Iterator[bytes]:
    """Wire messages of a set of Inspector files, one per process (module docstring)."""
    procs: list[tuple[str, Records, dict[str, np.ndarray]]] = []
    for f in files:
        rec = parse_file(f, report)
        if rec is not None:
            procs.append((str(f), rec, rec.columns()))
    if not procs:
        return
    # Global rank: the rank in the process's largest communicator.
    ranked = []
    for file, rec, c in procs:
        big = int(np.argmax(c["n_ranks"]))
        ranked.append((int(c["comm_rank"][big]), file, rec, c))
    ranked.sort(key=lambda t: t[0])
    seen: set[int] = set()
    for i, (r, file, rec, c) in enumerate(ranked):
        if r in seen:
            r = max(seen) + 1
            report.problem(file, f"rank {ranked[i][0]} again; imported as rank {r}")
            ranked[i] = (r, file, rec, c)
        seen.add(r)
    gid: dict[str, int] = {}
    members: dict[str, dict[int, int]] = {}
    for r, _file, rec, c in ranked:
        local = np.array([gid.setdefault(k, len(gid)) for k in rec.comms], np.int64)
        c["group"] = local[c["comm"]]
        c["rank"] = np.full(c["seq"].shape[0], r, np.int64)
        for k, cr in zip(
            rec.comms, [int(c["comm_rank"][c["comm"] == j][0]) for j in range(len(rec.comms))]
        ):
            members.setdefault(k, {})[cr] = r
    imported = [r for r, *_ in ranked]
    world = max(imported[-1] + 1, int(max(int(c["n_ranks"].max()) for *_, c in ranked)))
    if not any(_verbose(c).any() for *_, c in ranked):
        # Every reader refuses a collective row without its entry time, and any entry time
        # made up from the dump thread's write times would invent an arrival order.
        for _, file, _, _ in ranked:
            report.problem(file, NOT_VERBOSE)
        names = {i: k for k, i in gid.items()}
        sizes = {gid[k]: len(m) for k, m in members.items()}
        last = last_by_kernel([c for *_, c in ranked], sizes)
        if last:
            report.details["last_by_kernel"] = [
                {**row, "comm": names[row["group"]]} for row in last
            ]
        bw = bandwidth_by_size([c for *_, c in ranked], sizes)
        if bw:
            report.details["bandwidth_by_size"] = [
                {**row, "comm": names[row["group"]]} for row in bw
            ]
        return
    for i, (r, file, rec, c) in enumerate(ranked):
        c = _timed(c, file, report)
        c["t_enter"] = c["enter_ns"]
        c["t_start"], c["t_end"] = c["kstart_ns"], c["kend_ns"]
        ranked[i] = (r, file, rec, c)
    offsets = {r: 0 for r in imported}
    if len(imported) > 1:
        al = estimate_offsets(
            np.concatenate([c["rank"] for *_, c in ranked]),
            np.concatenate([c["group"] for *_, c in ranked]),
            np.concatenate([c["seq"] for *_, c in ranked]),
            np.concatenate([c["t_end"] for *_, c in ranked]),
        )
        if al.max_error_ns is not None and (al.error_ns >= 0).sum() > 1:
            offsets.update(al.resolved())
            report.alignment_ns = al.max_error_ns
            report.details["clock_offsets_ns"] = {str(r): offsets[r] for r in imported}
    report.lack(
        f"steps (the Inspector has none: one step is {STEP_COLLECTIVES} collectives of the "
        "busiest communicator)"
    )
    report.lack("host collective completion times (t_exit is the kernel's end)")
    report.lack("phases, tokens and samples per step")
    report.lack("device samples (clocks, power, throttling)")
    counts = np.bincount(np.concatenate([c["group"] for *_, c in ranked]), minlength=len(gid))
    clock = int(np.argmax(counts))
    report.files_read = [file for _, file, _, _ in ranked]
    src = source_manifest(KIND, report.files_read, report.lacks)
    src["alignment_ns"] = report.alignment_ns
    headers = {r: header(job, run, r) for r in imported}
    for r, file, rec, _c in ranked:
        ident = {
            "rank": r,
            "world_size": world,
            "local_rank": 0,
            "host": (rec.host or "unknown")[: schema.MAX_NAME_CHARS],
            "node_rank": -1,
            "pid": max(0, rec.pid),
        }
        yield schema.hello_message(
            next_header(headers[r]),
            ident,
            manifest={"source": src, "inspector_file": Path(file).name},
        )
    groups = [
        {
            "id": i,
            "name": f"comm {k}"[: schema.MAX_NAME_CHARS],
            "ranks": sorted(members.get(k, {}).values()),
            "backend": "nccl",
            "desc": "NCCL communicator",
        }
        for k, i in gid.items()
    ]
    yield schema.groups_message(next_header(headers[imported[0]]), groups)
    for r in imported:
        stats = {
            "dropped_batches": 0,
            "dropped_events": 0,
            "errors": {},
            "clock_offset_ns": int(offsets[r]),
            "clock_error_ns": int(report.alignment_ns or 0),
        }
        yield schema.stats_message(next_header(headers[r]), stats)
    for r, file, _rec, c in ranked:
        yield steps_message(_placed_rows(c, clock, offsets[r], file, report), headers[r])


TIE_NS = 1_000
"""Kernel durations closer than this (the Inspector's µs resolution) tell no order."""


def _complete_instances(
    cols: list[dict[str, np.ndarray]], sizes: dict[int, int]
) -> Iterator[tuple[int, int, dict[str, np.ndarray], np.ndarray]]:
    """The collectives of each communicator whose every member was imported, with every
    member's record: ``(group, members, rows, first)``. ``rows`` holds the communicator's
    records (``seq``, ``rank``, ``exec_ns`` as float, ``op``, ``nbytes``) sorted by
    ``coll_sn`` and then kernel duration, so each instance's shortest kernel, the last
    arriver's, comes first; ``first`` is the row where each complete instance starts. A
    communicator with a member's file missing is left out: the shortest of the others'
    kernels tells nothing."""
    names = ("group", "seq", "rank", "exec_ns", "n_ranks", "op", "nbytes")
    cat = {k: np.concatenate([c[k] for c in cols]) for k in names}
    cat["exec_ns"] = cat["exec_ns"].astype(np.float64)
    ok = cat["exec_ns"] >= 0
    cat = {k: v[ok] for k, v in cat.items()}
    g = cat["group"]
    for gid in np.unique(g).tolist():
        n = sizes.get(int(gid), 0)
        at = g == gid
        if n < 2 or int(cat["n_ranks"][at].max()) != n:
            continue
        order = np.lexsort((cat["exec_ns"][at], cat["seq"][at]))
        rows = {k: cat[k][at][order] for k in ("seq", "rank", "exec_ns", "op", "nbytes")}
        s = rows["seq"]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        counts = np.diff(np.append(starts, s.shape[0]))
        first = starts[counts == n]
        if first.shape[0]:
            yield int(gid), n, rows, first


def last_by_kernel(
    cols: list[dict[str, np.ndarray]], sizes: dict[int, int]
) -> list[dict[str, Any]]:
    """Who arrived last, read from GPU kernel durations alone (what output without
    verbose timestamps still holds): a collective's kernel runs from its launch until the
    data of its last peer has come, so in each instance every member's kernel ends at
    about the same time and the last to arrive has the shortest one; the others' extra
    time is their wait.

    Args:
        cols: each process's `Records.columns` with ``group`` (the import's communicator
            index) and ``rank`` (its global rank) added.
        sizes: group -> how many of its members were imported.

    Returns:
        Per communicator whose every member was imported, with an instance whose shortest kernel
        is unique (by more than `TIE_NS`): ``group``, ``ranks``, ``collectives`` (instances
        with all members), ``ordered`` (those whose shortest kernel is unique), ``rank``
        (the one most often shortest), ``share`` (of ``ordered``), ``wait_us`` (median over
        its instances of the others' median kernel less its own) and ``counts`` (rank ->
        instances in which it was last).
    """
    out: list[dict[str, Any]] = []
    for gid, n, rows, full in _complete_instances(cols, sizes):
        r, e = rows["rank"], rows["exec_ns"]
        shortest, second = e[full], e[full + 1]
        ordered = second - shortest > TIE_NS
        if not ordered.any():
            continue
        who = r[full][ordered]
        mid = np.median(e[full[ordered][:, None] + np.arange(1, n)], axis=1)
        wait = mid - shortest[ordered]
        ranks, hits = np.unique(who, return_counts=True)
        top = int(ranks[np.argmax(hits)])
        out.append(
            {
                "group": gid,
                "ranks": n,
                "collectives": int(full.shape[0]),
                "ordered": int(ordered.sum()),
                "rank": top,
                "share": float(hits.max() / ordered.sum()),
                "wait_us": float(np.median(wait[who == top]) / 1e3),
                "counts": {str(int(k)): int(v) for k, v in zip(ranks, hits, strict=True)},
            }
        )
    return out


def bandwidth_by_size(
    cols: list[dict[str, np.ndarray]], sizes: dict[int, int]
) -> list[dict[str, Any]]:
    """The transfer's bus bandwidth per communicator, operation and message size, from GPU
    kernel durations alone: in each collective the shortest member kernel is the last
    arriver's, which waited for no one, so it times the transfer (as `last_by_kernel`
    reads it); the bandwidth follows nccl-tests' convention (`diagnosis.curves`).

    Args:
        cols: as for `last_by_kernel`.
        sizes: group -> how many of its members were imported.

    Returns:
        Per communicator whose every member was imported, operation and size (bytes per
        rank), smallest first: ``group``, ``ranks``, ``op``, ``nbytes``, ``collectives``
        (with every member and a kernel that took time), ``transfer_us`` (median shortest
        kernel) and ``busbw_gbs``.
    """
    from rankscope.diagnosis.curves import algbw_bytes, bus_factor

    out: list[dict[str, Any]] = []
    for gid, n, rows, full in _complete_instances(cols, sizes):
        shortest = rows["exec_ns"][full]
        i_op, i_nb = rows["op"][full].astype(np.int64), rows["nbytes"][full].astype(np.int64)
        timed = shortest > 0
        for k_op, k_nb in sorted({(int(x), int(y)) for x, y in zip(i_op, i_nb, strict=True)}):
            mine = timed & (i_op == k_op) & (i_nb == k_nb)
            if k_op < 0 or k_nb < 0 or not mine.any():
                continue
            t_ns = float(np.median(shortest[mine]))
            one, width = np.array([k_op]), np.array([n])
            moved = float(algbw_bytes(one, np.array([k_nb]), width)[0])
            out.append(
                {
                    "group": gid,
                    "ranks": n,
                    "op": schema.OPS[k_op],
                    "nbytes": k_nb,
                    "collectives": int(mine.sum()),
                    "transfer_us": t_ns / 1e3,
                    "busbw_gbs": moved / t_ns * float(bus_factor(one, width)[0]),
                }
            )
    out.sort(key=lambda r: (r["group"], r["op"], r["nbytes"]))
    return out


def _verbose(c: dict[str, np.ndarray]) -> np.ndarray:
    """Rows with verbose timestamps: the collective's start and a kernel stop."""
    return (c["enter_ns"] >= 0) & (c["kend_ns"] >= 0)


def _rows(c: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``keep`` selects, every column."""
    return {k: v[keep] for k, v in c.items()}


def _timed(c: dict[str, np.ndarray], file: str, report: ImportReport) -> dict[str, np.ndarray]:
    """The rows of verbose output that carry its timestamps; the others are left out and
    named (a row without its start would have no arrival, which the hub requires)."""
    keep = _verbose(c)
    lost = int((~keep).sum())
    if lost:
        report.problem(
            file,
            f"{lost} record(s) without coll_start_ts or a kernel stop in verbose output left out",
        )
    return _rows(c, keep)


def _placed_rows(
    c: dict[str, np.ndarray], clock: int, off: int, file: str, report: ImportReport
) -> dict[str, np.ndarray]:
    """One rank's rows in time order with their ``step``, times shifted by ``-off``.

    Rows whose times leave ``0..schema.MAX_TIME_NS`` once shifted, and steps spanning more
    than `MAX_DURATION_NS`, are left out and named: the hub would refuse the rank's whole
    message for one of them.
    """
    key = np.where(c["t_start"] >= 0, c["t_start"], c["t_end"])
    c = _rows(c, np.argsort(key, kind="stable"))
    inside = np.ones(c["seq"].shape[0], bool)
    for k in ("t_enter", "t_start", "t_end"):
        known = c[k] >= 0
        c[k] = np.where(known, c[k] - off, c[k])
        inside &= ~known | ((c[k] >= 0) & (c[k] <= schema.MAX_TIME_NS))
    if not inside.all():
        report.problem(
            file,
            f"{int((~inside).sum())} record(s) whose times leave 0..2**62 ns once aligned "
            f"(clock offset {off} ns) left out",
        )
        c = _rows(c, inside)
    c["step"] = _steps_of(c, clock)
    steps, t0, t1 = _step_bounds(c)
    long = steps[(t0 >= 0) & (t1 - t0 > MAX_DURATION_NS)]
    if long.shape[0]:
        out = np.isin(c["step"], long)
        report.problem(
            file,
            f"{long.shape[0]} step(s) longer than 7 days ({int(out.sum())} record(s) "
            "further apart than the hub takes) left out",
        )
        c = _rows(c, ~out)
    return c


def _steps_of(c: dict[str, np.ndarray], clock: int) -> np.ndarray:
    """Step of each row (rows in time order): `STEP_COLLECTIVES` collectives of the clock
    communicator by ``seq``; other rows belong to the step open when they started."""
    on = c["group"] == clock
    step = np.full(c["seq"].shape[0], 0, np.int64)
    step[on] = (c["seq"][on] - int(c["seq"][on].min())) // STEP_COLLECTIVES if on.any() else 0
    idx = np.maximum.accumulate(np.where(on, np.arange(step.shape[0]), -1))
    first = int(step[on][0]) if on.any() else 0
    return np.where(idx >= 0, step[np.clip(idx, 0, None)], first)


def _step_bounds(c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(steps, start, end)`` of placed rows: each step from its first entry (or device
    start) to its last device end."""
    step = c["step"]
    lo = np.where(c["t_enter"] >= 0, c["t_enter"], c["t_start"])
    steps = np.unique(step)
    t0 = np.array([lo[step == s].min() for s in steps.tolist()], np.int64)
    t1 = np.array([c["t_end"][step == s].max() for s in steps.tolist()], np.int64)
    return steps, t0, t1


def steps_message(c: dict[str, np.ndarray], h: dict[str, Any]) -> bytes:
    """One rank's placed rows (`_placed_rows`) as a ``steps`` message."""
    step = c["step"]
    steps, t0, t1 = _step_bounds(c)
    st = schema.empty_table("steps", steps.shape[0])
    st["step"], st["t_start"], st["t_end"] = steps, t0, t1
    n = step.shape[0]
    co = {
        "step": step,
        "op": c["op"].astype(np.int8),
        "group": c["group"].astype(np.int32),
        "seq": c["seq"],
        "nbytes": c["nbytes"],
        "t_enter": c["t_enter"],
        "t_start": c["t_start"],
        "t_end": c["t_end"],
        "t_exit": c["t_end"],
        "flags": np.full(n, schema.FLAG_DEVICE_TIMED, np.int32),
    }
    return schema.steps_message(next_header(h), st, None, co)
