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
(`hub.importers.align`). Without them only the GPU-timed duration is known: the row ends at
the dump thread's write time and starts ``coll_exec_time_us`` before it, ``t_enter`` is
unknown, and the report says arrival order is unknown. A process's global rank is its rank
in its largest communicator. Steps: the source has none; one step is `STEP_COLLECTIVES`
collectives of the busiest communicator (others belong to the step open when they started).
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


@dataclass
class Records:
    """Rows parsed from Inspector objects (`COLUMNS`), plus what they name."""

    comms: list[str] = field(default_factory=list)
    rows: list[tuple[int, ...]] = field(default_factory=list)
    host: str = ""
    pid: int = 0
    bad: int = 0
    """Objects without the fields a row needs."""

    def columns(self) -> dict[str, np.ndarray]:
        """The rows as int64 columns."""
        arr = np.array(self.rows, np.int64).reshape(len(self.rows), len(COLUMNS))
        return {c: arr[:, i].copy() for i, c in enumerate(COLUMNS)}


def add_record(rec: Records, obj: Any) -> None:
    """Add one Inspector object to ``rec`` (counted in ``rec.bad`` when unusable)."""
    try:
        h, meta, perf = obj["header"], obj.get("metadata", {}), obj["coll_perf"]
        comm = str(h["id"])
        seq = int(perf["coll_sn"])
        row_op = schema.OP_INDEX[op_name(str(perf["coll"]))]
        nbytes = int(perf.get("coll_msg_size_bytes", -1))
        exec_ns = int(float(perf.get("coll_exec_time_us", -1)) * 1000)
        dump_ns = int(meta.get("dump_timestamp_us", -1)) * 1000
        ts = perf.get("event_trace_ts") or {}
        enter = int(ts["coll_start_ts"]) * 1000 if "coll_start_ts" in ts else -1
        kev = [k for k in ts.get("kernel_events", []) if isinstance(k, dict)]
        kstart = min((int(k["kernel_start_ts"]) for k in kev if "kernel_start_ts" in k), default=-1)
        kend = max((int(k["kernel_stop_ts"]) for k in kev if "kernel_stop_ts" in k), default=-1)
        row = (
            0,
            int(h["rank"]),
            int(h.get("n_ranks", -1)),
            seq,
            row_op,
            nbytes,
            exec_ns,
            dump_ns,
            enter,
            kstart * 1000 if kstart >= 0 else -1,
            kend * 1000 if kend >= 0 else -1,
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        rec.bad += 1
        return
    if comm not in rec.comms:
        rec.comms.append(comm)
    rec.rows.append((rec.comms.index(comm), *row[1:]))
    if not rec.host and isinstance(meta.get("hostname"), str):
        rec.host = meta["hostname"]
        rec.pid = int(meta.get("pid", 0)) if isinstance(meta.get("pid"), int) else 0


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
    if rec.bad:
        report.problem(path, f"{rec.bad} record(s) without header/coll_perf fields left out")
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
    verbose = all((c["kend_ns"] >= 0).all() for *_, c in ranked)
    for *_, c in ranked:
        if verbose:
            c["t_enter"] = c["enter_ns"]
            c["t_start"], c["t_end"] = c["kstart_ns"], c["kend_ns"]
        else:
            c["t_enter"] = np.full(c["seq"].shape[0], schema.NO_TIME, np.int64)
            c["t_end"] = c["dump_ns"]
            c["t_start"] = np.where(c["dump_ns"] >= 0, c["dump_ns"] - c["exec_ns"], -1)
    offsets = {r: 0 for r in imported}
    if verbose and len(imported) > 1:
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
    if not verbose:
        report.lack(
            "arrival order (no verbose event_trace_ts: set NCCL_INSPECTOR_DUMP_VERBOSE=1); "
            "rows end at the dump thread's write time"
        )
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
    for r, _file, _rec, c in ranked:
        yield steps_message(c, clock, offsets[r], headers[r])


def steps_message(c: dict[str, np.ndarray], clock: int, off: int, h: dict[str, Any]) -> bytes:
    """One rank's rows as a ``steps`` message (times shifted by ``-off``)."""
    key = np.where(c["t_start"] >= 0, c["t_start"], c["t_end"])
    order = np.argsort(key, kind="stable")
    c = {k: v[order] for k, v in c.items()}
    for k in ("t_enter", "t_start", "t_end"):
        c[k] = np.where(c[k] >= 0, c[k] - off, c[k])
    on = c["group"] == clock
    step = np.full(c["seq"].shape[0], 0, np.int64)
    step[on] = (c["seq"][on] - int(c["seq"][on].min())) // STEP_COLLECTIVES if on.any() else 0
    idx = np.maximum.accumulate(np.where(on, np.arange(step.shape[0]), -1))
    first = int(step[on][0]) if on.any() else 0
    step = np.where(idx >= 0, step[np.clip(idx, 0, None)], first)
    lo = np.where(c["t_enter"] >= 0, c["t_enter"], c["t_start"])
    steps = np.unique(step)
    st = schema.empty_table("steps", steps.shape[0])
    st["step"] = steps
    st["t_start"] = np.array([lo[step == s].min() for s in steps.tolist()], np.int64)
    st["t_end"] = np.array([c["t_end"][step == s].max() for s in steps.tolist()], np.int64)
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
