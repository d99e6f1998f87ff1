"""Export a window as CSV tables for spreadsheets, pandas and SQL.

`write_csv` writes into one folder:

``ranks.csv``
    One row per rank: identity and placement, to join on ``rank``.
``rank_steps.csv``
    One row per rank and step the rank reported: step time, phase totals (and their
    training-thread CPU time where reported), work, memory, GC pauses and thread CPU time,
    device samples and collective aggregates.
``collectives.csv``
    One row per collective instance ``(group, seq)``: arrivals, skew, the last-arriving rank,
    transfer and bandwidth (nccl-tests conventions).
``collective_calls.csv``
    One row per collective call on one rank (only when the window kept raw rows).
``columns.csv``
    ``table, column, unit, description`` of every column above, so the folder explains
    itself when attached to a ticket.

Times are absolute int64 nanoseconds on the hub-aligned clock (``*_ns``) or durations in
milliseconds / microseconds (``*_ms``, ``*_us``). An unknown value is an empty cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rankscope.collector.schema import MESH_DIMS, OPS
from rankscope.diagnosis.curves import CONVENTION, algbw_bytes, bus_factor, transfer_time
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    DEVICE_COLUMNS,
    HOST_COLUMNS,
    MEMORY_COLUMNS,
    WORK_COLUMNS,
    Window,
)
from rankscope.hub.export_perfetto import instance_index
from rankscope.sanitize import for_csv_cell

RANK_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rank", "", "global rank"),
    ("host", "", "host name"),
    ("node_rank", "", "node rank from the launcher"),
    ("local_rank", "", "rank within its host"),
    ("gpu_index", "", "GPU index on its host"),
    ("rail", "", "rail (NIC index on its host)"),
    ("rack", "", "rack name"),
    ("nic", "", "network interface name"),
    ("shard", "", "data shard"),
    *((dim, "", f"mesh coordinate {dim}") for dim in MESH_DIMS),
    ("incarnation", "", "restart count of the rank's current process"),
)

RANK_STEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("run", "", "run id"),
    ("rank", "", "global rank"),
    ("host", "", "host name"),
    ("step", "", "step id"),
    ("t_start_ns", "ns", "step start, hub-aligned clock"),
    ("t_end_ns", "ns", "step end, hub-aligned clock"),
    ("step_ms", "ms", "step wall time t_end - t_start"),
    ("phase_<name>_ms", "ms", "total time in phase <name> during the step (one column a phase)"),
    (
        "phase_<name>_cpu_ms",
        "ms",
        "training-thread CPU time in phase <name> (one column a phase that reports it)",
    ),
    ("tokens", "", "tokens processed"),
    ("valid_tokens", "", "tokens that are not padding"),
    ("samples", "", "samples processed"),
    ("attn_cost", "", "sum of squared sequence lengths of the local packed sequences"),
    ("flops", "", "executed floating-point operations, when reported"),
    ("expert_tokens", "", "tokens routed to the rank's local experts (MoE), when reported"),
    ("mem_allocated", "bytes", "allocated device memory"),
    ("mem_reserved", "bytes", "reserved device memory"),
    ("mem_peak", "bytes", "peak allocated device memory"),
    ("alloc_retries", "", "allocator retries"),
    ("gc_ms", "ms", "Python GC pauses inside the step"),
    ("gc_count", "", "Python GC collections in the step"),
    ("cpu_ms", "ms", "CPU time of the training thread over the step"),
    ("runq_ms", "ms", "time the training thread waited for a core (run-queue delay)"),
    ("sm_clock_mhz", "MHz", "mean SM clock during the step"),
    ("mem_clock_mhz", "MHz", "mean memory clock during the step"),
    ("power_w", "W", "mean board power during the step"),
    ("temp_c", "°C", "mean GPU temperature during the step"),
    ("gpu_util", "%", "mean GPU utilization during the step"),
    ("cpu_pct", "%", "mean host CPU use during the step"),
    ("load1", "", "mean host 1-minute load during the step"),
    ("rss_bytes", "bytes", "mean resident memory of the rank's process"),
    ("throttle", "", "bitwise OR of NVML throttle reasons during the step"),
    ("n_colls", "", "collectives the rank called in the step"),
    ("coll_ms", "ms", "host time inside collectives"),
    ("wait_ms", "ms", "arrival wait: time spent waiting for later ranks"),
    ("transfer_ms", "ms", "post-arrival time inside collectives"),
    ("late_ms", "ms", "sum of lateness (entry minus first entry of the instance)"),
    ("times_last", "", "instances where the rank arrived last"),
    ("exposed_wait_ms", "ms", "arrival wait not hidden under compute"),
    ("exposed_transfer_ms", "ms", "post-arrival time not hidden under compute"),
    ("overstay_ms", "ms", "exposed time in collectives after the first member had left them"),
)

INSTANCE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("group", "", "process group id"),
    ("group_name", "", "process group name"),
    ("op", "", "collective operation"),
    ("seq", "", "sequence number in the group (issue order)"),
    ("step", "", "step of the instance (as recorded by its last arriver)"),
    ("nbytes", "bytes", "bytes per rank (median over members)"),
    ("n_members", "", "ranks in the group"),
    ("n_arrived", "", "members whose row was received"),
    ("first_ns", "ns", "first entry, hub-aligned clock"),
    ("last_ns", "ns", "last entry, hub-aligned clock"),
    ("skew_us", "µs", "arrival skew: last entry minus first entry"),
    ("last_rank", "", "global rank that entered last"),
    ("margin_us", "µs", "how much later the last arriver came than the second last"),
    ("transfer_us", "µs", "median post-arrival service time (exit minus last entry)"),
    ("device_transfer_us", "µs", "post-arrival service from device times, when known"),
    ("algbw_gbps", "GB/s", f"algorithm bandwidth; {CONVENTION}"),
    ("busbw_gbps", "GB/s", "bus bandwidth algbw x f (same convention)"),
)

CALL_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rank", "", "global rank"),
    ("step", "", "step id"),
    ("op", "", "collective operation"),
    ("group", "", "process group id"),
    ("seq", "", "sequence number in the group"),
    ("nbytes", "bytes", "this rank's input size"),
    ("t_enter_ns", "ns", "host issue (arrival), hub-aligned clock"),
    ("t_start_ns", "ns", "device start, when device-timed"),
    ("t_end_ns", "ns", "device end, when device-timed"),
    ("t_exit_ns", "ns", "host sees completion"),
    ("lateness_us", "µs", "entry minus the instance's first entry"),
    ("wait_us", "µs", "time waiting for the last arriver"),
    ("transfer_us", "µs", "exit minus max(entry, last entry)"),
    ("last_arriver", "", "1 when this rank entered the instance last"),
    ("flags", "", "schema FLAG_* bit field"),
)

TABLE_COLUMNS = {
    "ranks.csv": RANK_COLUMNS,
    "rank_steps.csv": RANK_STEP_COLUMNS,
    "collectives.csv": INSTANCE_COLUMNS,
    "collective_calls.csv": CALL_COLUMNS,
}
"""Documented columns of every table (``phase_<name>_ms`` stands for one column a phase)."""


@dataclass(frozen=True)
class CsvSummary:
    """What `write_csv` wrote: file name -> data rows (header not counted)."""

    folder: str
    rows: dict[str, int]


def _text(values: list[str]) -> list[str]:
    # Names come from telemetry: a cell a spreadsheet would read as a formula is made text
    # (rankscope.sanitize.for_csv_cell), then RFC 4180 quoting, only where needed.
    out = []
    for v in map(for_csv_cell, values):
        if any(c in v for c in ',"\n\r'):
            v = '"' + v.replace('"', '""') + '"'
        out.append(v)
    return out


def _ints(arr: np.ndarray, unknown_below: int | None = 0) -> list[str]:
    """Integers as text; values below ``unknown_below`` (the schema's -1) are empty."""
    a = np.asarray(arr)
    if a.dtype.kind == "f":
        ok = np.isfinite(a)
        a = np.where(ok, a, -1).astype(np.int64)
    else:
        ok = np.ones(a.shape, dtype=bool)
        a = a.astype(np.int64)
    if unknown_below is not None:
        ok &= a >= unknown_below
    text = a.astype(str)
    return np.where(ok, text, "").tolist()


def _floats(arr: np.ndarray, scale: float = 1.0, decimals: int = 6) -> list[str]:
    """Fixed-point text with ``decimals`` digits; NaN is empty.

    Formatted through integer arithmetic and numpy's string ufuncs: per-element ``%``
    formatting costs ~10 µs a cell, which made a 4,096-rank export take tens of seconds.
    """
    a = np.asarray(arr, dtype=np.float64) / scale
    ok = np.isfinite(a)
    if not ok.any():  # a column the run does not report: skip the formatting
        return [""] * a.size
    unit = 10**decimals
    big = ok & (np.abs(a) >= 9e18 / unit)  # would overflow int64 as fixed point
    v = np.round(np.where(ok & ~big, a, 0.0) * unit).astype(np.int64)
    av = np.abs(v)
    text = np.char.add(
        np.char.add((av // unit).astype(str), "."), np.char.zfill((av % unit).astype(str), decimals)
    )
    text = np.where(v < 0, np.char.add("-", text), text)
    out = np.where(ok, text, "").astype(object)
    if big.any():
        out[big] = np.char.mod("%.17g", a[big]).astype(object)
    return out.tolist()


def _abs_ns(window: Window, rel: np.ndarray) -> list[str]:
    rel = np.asarray(rel, dtype=np.float64)
    ok = np.isfinite(rel)
    out = np.full(rel.shape, -1, dtype=np.int64)
    out[ok] = window.t0_ns + np.round(rel[ok]).astype(np.int64)
    return np.where(ok, out.astype(str), "").tolist()


def _names(codes: np.ndarray, names: tuple[str, ...]) -> list[str]:
    table = np.array([*_text(list(names)), ""], dtype=object)  # quote the few names once
    idx = np.where((codes >= 0) & (codes < len(names)), codes, len(names))
    return table[idx].tolist()


def _write(path: Path, columns: dict[str, list[str]]) -> int:
    header = ",".join(_text(list(columns)))  # phase names are telemetry too
    rows = zip(*columns.values())
    with path.open("w", encoding="utf-8", newline="") as fh:
        fh.write(header + "\n")
        n = 0
        for row in rows:
            fh.write(",".join(row) + "\n")
            n += 1
    return n


def rank_table(window: Window) -> dict[str, list[str]]:
    """Columns of ``ranks.csv``.

    Args:
        window: the run's window.

    Returns:
        Column name -> cell texts.
    """
    info = window.ranks
    n = window.world_size
    cols = {
        "rank": _ints(np.arange(n)),
        "host": _names(info.host, info.hosts),
        "node_rank": _ints(info.node_rank),
        "local_rank": _ints(info.local_rank),
        "gpu_index": _ints(info.gpu_index),
        "rail": _ints(info.rail),
        "rack": _names(info.rack, info.racks),
        "nic": _names(info.nic, info.nics),
        "shard": _ints(info.shard),
    }
    for dim in MESH_DIMS:
        cols[dim] = _ints(info.mesh.get(dim, np.full(n, -1)))
    cols["incarnation"] = _ints(info.incarnation)
    return cols


def rank_step_table(window: Window) -> dict[str, list[str]]:
    """Columns of ``rank_steps.csv``: one row per (rank, step) the rank reported.

    Args:
        window: the run's window.

    Returns:
        Column name -> cell texts.
    """
    r, j = np.nonzero(window.present)
    host_names = _names(window.ranks.host, window.ranks.hosts)
    cols = {
        "run": _text([window.run]) * r.shape[0],
        "rank": _ints(r),
        "host": [host_names[k] for k in r.tolist()],
        "step": _ints(window.steps[j], None),
        "t_start_ns": _abs_ns(window, window.t_start[r, j]),
        "t_end_ns": _abs_ns(window, window.t_end[r, j]),
        "step_ms": _floats(window.step_ns[r, j], 1e6),
    }
    for name, arr in window.phase_ns.items():
        cols[f"phase_{name}_ms"] = _floats(arr[r, j], 1e6)
    for name, arr in window.phase_cpu_ns.items():
        cols[f"phase_{name}_cpu_ms"] = _floats(arr[r, j], 1e6)
    nan = np.full(r.shape, np.nan)
    for name in WORK_COLUMNS:
        arr = window.work[name][r, j] if name in window.work else nan
        cols[name] = _floats(arr, 1.0, 3) if name in ("attn_cost", "flops") else _ints(arr)
    for name in MEMORY_COLUMNS:
        cols[name] = _ints(window.memory[name][r, j])
    host = {name: window.host[name][r, j] if name in window.host else nan for name in HOST_COLUMNS}
    cols["gc_ms"] = _floats(host["gc_ns"], 1e6)
    cols["gc_count"] = _ints(host["gc_count"])
    cols["cpu_ms"] = _floats(host["cpu_ns"], 1e6)
    cols["runq_ms"] = _floats(host["runq_ns"], 1e6)
    for name in DEVICE_COLUMNS:
        arr = window.device[name][r, j]
        cols[name] = _ints(arr) if name in ("throttle", "rss_bytes") else _floats(arr, 1.0, 3)
    for name in COLL_AGGREGATES:
        arr = window.coll[name][r, j]
        if name in ("n", "times_last"):
            cols["n_colls" if name == "n" else name] = _ints(arr)
        else:
            cols[name.replace("_ns", "_ms")] = _floats(arr, 1e6)
    return cols


def instance_table(window: Window) -> dict[str, list[str]]:
    """Columns of ``collectives.csv``: one row per collective instance.

    Args:
        window: the run's window.

    Returns:
        Column name -> cell texts.
    """
    inst = window.instances
    group_names = {gid: g.name for gid, g in window.groups.items()}
    t = transfer_time(inst)
    complete = inst.n_arrived >= inst.n_members
    ok = complete & np.isfinite(t) & (t > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = np.where(ok, algbw_bytes(inst.op, inst.nbytes, inst.n_members) / t, np.nan)
    bus = alg * bus_factor(inst.op, inst.n_members)
    return {
        "group": _ints(inst.group, None),
        "group_name": _text([group_names.get(g, f"g{g}") for g in inst.group.tolist()]),
        "op": _names(inst.op, OPS),
        "seq": _ints(inst.seq, None),
        "step": _ints(inst.step, None),
        "nbytes": _ints(inst.nbytes),
        "n_members": _ints(inst.n_members),
        "n_arrived": _ints(inst.n_arrived),
        "first_ns": _abs_ns(window, inst.first),
        "last_ns": _abs_ns(window, inst.last),
        "skew_us": _floats(inst.skew, 1e3, 3),
        "last_rank": _ints(np.where(complete, inst.last_rank, -1)),
        "margin_us": _floats(np.where(complete, inst.margin, np.nan), 1e3, 3),
        "transfer_us": _floats(inst.transfer, 1e3, 3),
        "device_transfer_us": _floats(inst.device_transfer, 1e3, 3),
        "algbw_gbps": _floats(alg, 1.0, 4),
        "busbw_gbps": _floats(bus, 1.0, 4),
    }


def call_table(window: Window) -> dict[str, list[str]] | None:
    """Columns of ``collective_calls.csv``, or None when the window kept no raw rows.

    Args:
        window: the run's window.

    Returns:
        Column name -> cell texts.
    """
    rows = window.rows
    if rows is None:
        return None
    inst = window.instances
    first = np.full(len(rows), np.nan)
    last = np.full(len(rows), np.nan)
    last_rank = np.full(len(rows), -1, dtype=np.int64)
    at = instance_index(window, rows.group, rows.seq)
    hit = at >= 0
    hit[hit] = inst.n_arrived[at[hit]] >= inst.n_members[at[hit]]
    first[hit] = inst.first[at[hit]]
    last[hit] = inst.last[at[hit]]
    last_rank[hit] = inst.last_rank[at[hit]]
    known = np.isfinite(last)
    exit_ = rows.t_exit
    return {
        "rank": _ints(rows.rank),
        "step": _ints(rows.step, None),
        "op": _names(rows.op, OPS),
        "group": _ints(rows.group, None),
        "seq": _ints(rows.seq, None),
        "nbytes": _ints(rows.nbytes),
        "t_enter_ns": _abs_ns(window, rows.t_enter),
        "t_start_ns": _abs_ns(window, rows.t_start),
        "t_end_ns": _abs_ns(window, rows.t_end),
        "t_exit_ns": _abs_ns(window, exit_),
        "lateness_us": _floats(rows.t_enter - first, 1e3, 3),
        "wait_us": _floats(np.clip(last - rows.t_enter, 0.0, exit_ - rows.t_enter), 1e3, 3),
        "transfer_us": _floats(exit_ - np.maximum(rows.t_enter, last), 1e3, 3),
        "last_arriver": np.where(
            known, (last_rank == rows.rank).astype(int).astype(str), ""
        ).tolist(),
        "flags": _ints(rows.flags, None),
    }


def write_csv(folder: str | Path, window: Window) -> CsvSummary:
    """Write the CSV tables of a window into a folder (created when missing).

    Args:
        folder: output folder; existing files of the same names are replaced.
        window: the run's window.

    Returns:
        Rows written per file.

    Raises:
        ValueError: when ``folder`` exists and is not a folder.
    """
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise ValueError(f"CSV output {str(out)!r} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, int] = {}
    tables = {
        "ranks.csv": rank_table(window),
        "rank_steps.csv": rank_step_table(window),
        "collectives.csv": instance_table(window),
        "collective_calls.csv": call_table(window),
    }
    step_cols = tables["rank_steps.csv"] or {}
    phase_cols = [c for c in step_cols if c.startswith("phase_") and not c.endswith("_cpu_ms")]
    cpu_cols = [c for c in step_cols if c.startswith("phase_") and c.endswith("_cpu_ms")]
    docs: dict[str, list[str]] = {"table": [], "column": [], "unit": [], "description": []}
    for name, cols in tables.items():
        if cols is None:
            continue
        written[name] = _write(out / name, cols)
        for col, unit, text in TABLE_COLUMNS[name]:
            if col == "phase_<name>_ms":
                expanded = [
                    (c, f"total time in phase {c[6:-3]} during the step") for c in phase_cols
                ]
            elif col == "phase_<name>_cpu_ms":
                expanded = [
                    (c, f"training-thread CPU time in phase {c[6:-7]} during the step")
                    for c in cpu_cols
                ]
            else:
                expanded = [(col, text)]
            for c, t in expanded:
                docs["table"].append(name)
                docs["column"].append(c)
                docs["unit"].append(unit)
                docs["description"].append(t)
    written["columns.csv"] = _write(out / "columns.csv", {k: _text(v) for k, v in docs.items()})
    return CsvSummary(folder=str(out), rows=written)
