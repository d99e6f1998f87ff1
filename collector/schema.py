"""The wire schema shared by every collector and the hub.

A message is one msgpack map. Tables travel as columns of raw little-endian numpy bytes, so
a batch of thousands of collectives costs one ``frombuffer`` per column on the hub instead
of one Python object per event. Nothing is ever pickled.

An integer column of a table of `PACK_MIN_ROWS` rows or more travels *packed* when that
is smaller:
``[base, width, offsets]``, the values minus their minimum as unsigned integers of
``width`` bytes (0: every row holds ``base``, 1, 2 or 4). Times of one message span well
under 4.3 s, sequence numbers and steps a few thousand, and op, group, flags and byte
counts are mostly one value, so a collective row is ~11-20 bytes on the wire instead of
65. The hub's receive thread pays a widening per packed column; its ZeroMQ I/O thread
reads (and under CURVE decrypts) a sixth of the bytes, which costs it less than that buys
(benchmarks/RESULTS.md, hub ingest). A column that does not fit 4 bytes of span travels as
it is. Readers take either form (`decode`).

Message kinds (``"kind"``):

``hello``
    Sent once per rank incarnation: identity (rank, host, GPU, rail, mesh coordinates...),
    run (job, run id, scope, parent run) and the manifest (versions, env, job config).
``groups``
    The process-group table: ``{"groups": [{"id", "name", "ranks", "backend", "desc"}]}``.
    Collective rows refer to a group by ``id``; a group's ``ranks`` are global ranks.
``steps``
    Columnar tables for one or more steps: ``steps``, ``phases``, ``colls`` (and the names of
    user phases in ``phase_names``).
``samples``
    Columnar device (NVML) and host samples.
``stats``
    The collector's own health: drops, internal errors, clock offset and its uncertainty.

``beat``
    The heartbeat, from the collector's background thread about once a second: where the
    training thread is (``pos``: last step begun and ended, the collective it is inside)
    and, once per stuck episode, its Python stacks (``stacks``) and, where torch's Flight
    Recorder is enabled, its dump (``stacks.fr``). See `beat_message`.

All times are int64 nanoseconds on the hub-aligned clock (ARCHITECTURE §5). A device time
that is not known is ``NO_TIME``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 2
"""Bumped on any incompatible change; the hub rejects other versions with a counted reason.
2: integer columns may travel packed (module docstring); a hub of version 1 would have
refused them as malformed tables, a version-1 message reads as it always did."""

READ_VERSIONS = (1, 2)
"""Schema versions `decode` reads (recordings keep the version their messages came with)."""

PACK_MIN_ROWS = 256
"""Tables of fewer rows send every column unpacked. Packing a table costs its sender a
dozen numpy calls whatever its size (~40-90 µs in a collector's background thread on the
2-core machine of benchmarks/RESULTS.md), worth it where the bytes are: the hub's I/O
thread spends ~50 ns a row on a 65-byte row under CURVE, ~8 on a packed one."""

_PACK_WIDTHS = (1, 2, 4)
_UNSIGNED: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}

MAX_MESSAGE_BYTES = 32 * 1024 * 1024
"""Largest message the hub accepts (and the ZMQ ``MAXMSGSIZE`` it sets)."""

MAX_HEADER_BYTES = 8 * 1024 * 1024
"""Most bytes a message may hold outside its ``tables`` (identity, manifest, groups...).
Those fields decode into Python objects, up to ~60 times their packed size for maps of
tiny values; the columns of ``tables`` decode into one bytes object each. A larger
message is measured before it is decoded, so the bound holds before any object exists."""

MAX_ROWS = 1_000_000
"""Largest row count of one table in one message."""

NO_TIME = -1
"""Sentinel for a time that was not measured (e.g. device times without CUDA events)."""

KINDS = ("hello", "groups", "steps", "samples", "stats", "beat", "reduced")

SCOPES = ("full", "two-node", "one-node", "one-rank", "custom", "sweep")
"""Scope of a run (ARCHITECTURE §3). ``sweep`` is a run of the application's collectives
repeated outside the application (``rankscope sweep``), with the run it measures as its
``parent_run``; appended last so the index of every older scope stays the same."""

OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "barrier",
    "send",
    "recv",
    "gather",
    "scatter",
    "other",
)
"""Collective operation names; the ``op`` column holds an index into this tuple."""
OP_INDEX = {name: i for i, name in enumerate(OPS)}

PHASES = (
    "input",
    "forward",
    "backward",
    "optimizer",
    "checkpoint",
    "eval",
    "memory",
    "pp_wait",
    "recovery",
)
"""Built-in phase names; the ``phase`` column indexes ``PHASES + message["phase_names"]``."""
PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}

MECHANISMS = (
    "data_imbalance",
    "slow_device",
    "slow_host_input",
    "local_fabric",
    "network_rail",
    "placement",
    "checkpoint",
    "allocator_growth",
    "intermittent_congestion",
    "numerator_change",
    "pipeline_imbalance",
    "host_pause",
    "cpu_contention",
    "expert_imbalance",
    "unexplained_straggler",
    "healthy",
)
"""The hypothesis vocabulary (ARCHITECTURE §6): verdicts, the CLI's JSON, the TUI, snapshots
and the simulator's ground truth (``sim.truth.mechanism``) all use exactly these names."""

MESH_DIMS = ("dp", "tp", "pp", "cp", "ep")
"""Mesh coordinates a rank may report in its hello."""

# Collective flags (bit field in the ``flags`` column).
FLAG_DEVICE_TIMED = 1 << 0
"""``t_start``/``t_end`` come from device events (CUDA events or the NCCL completion hook)."""
FLAG_ASYNC = 1 << 1
"""Issued with ``async_op=True``; ``t_exit`` is when completion was observed."""
FLAG_COALESCED = 1 << 2
"""Part of a coalesced group of collectives."""
FLAG_DDP_BUCKET = 1 << 3
"""A DDP gradient bucket seen through the comm hook."""
FLAG_MANUAL = 1 << 4
"""Recorded through the explicit API rather than auto-instrumentation."""
FLAG_DDP_TAIL = 1 << 5
"""The tail of DDP's gradient all-reduce, one row per backward: entry when this rank's
backward finished (its last bucket launched), exit when every bucket was reduced. A
blocking row: the rank waits for it."""
FLAG_INSPECTOR = 1 << 6
"""``t_start``/``t_end`` come from the NCCL Inspector plugin (`collector.inspector_tail`)."""
FLAG_INSPECTOR_OWN = 1 << 7
"""An Inspector record no host row matched exactly, sent as a row of its own (its group is
the communicator's, its ``seq`` the Inspector's ``coll_sn``)."""

# Pipeline ids in the flags column: stage + 1 in bits 24..30 and micro-batch + 1 in bits
# 12..23, 0 meaning "not known" (rows of older collectors read as no pipeline row). Bits
# 6..11 stay free for flags.
PP_STAGE_SHIFT = 24
PP_STAGE_MASK = 0x7F
PP_MICRO_SHIFT = 12
PP_MICRO_MASK = 0xFFF


def pp_flags(stage: int, micro: int) -> int:
    """Flag bits naming a pipeline row's stage and micro-batch (-1, or an id past the
    field's width, leaves that field unknown)."""
    s = stage + 1 if 0 <= stage < PP_STAGE_MASK else 0
    m = micro + 1 if 0 <= micro < PP_MICRO_MASK else 0
    return (s << PP_STAGE_SHIFT) | (m << PP_MICRO_SHIFT)


def pp_ids(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(stage, micro_batch)`` columns of a flags column, -1 where unknown."""
    f = np.asarray(flags).astype(np.int64)
    stage = ((f >> PP_STAGE_SHIFT) & PP_STAGE_MASK) - 1
    micro = ((f >> PP_MICRO_SHIFT) & PP_MICRO_MASK) - 1
    return stage, micro


STEP_COLUMNS: dict[str, np.dtype] = {
    "step": np.dtype("<i8"),
    "t_start": np.dtype("<i8"),
    "t_end": np.dtype("<i8"),
    "tokens": np.dtype("<i8"),
    "valid_tokens": np.dtype("<i8"),
    "samples": np.dtype("<i8"),
    "attn_cost": np.dtype("<f8"),
    "flops": np.dtype("<f8"),
    "expert_tokens": np.dtype("<i8"),
    "mem_allocated": np.dtype("<i8"),
    "mem_reserved": np.dtype("<i8"),
    "mem_peak": np.dtype("<i8"),
    "alloc_retries": np.dtype("<i4"),
    "gc_ns": np.dtype("<i8"),
    "gc_count": np.dtype("<i4"),
    "cpu_ns": np.dtype("<i8"),
    "runq_ns": np.dtype("<i8"),
}
"""One row per rank and step. Work, memory and host columns are -1 (NaN for floats) when
unknown. ``expert_tokens``: tokens routed to this rank's local experts (MoE, reported by
the program). Host columns, measured by the collector: ``gc_ns`` Σ wall ns of Python GC
pauses inside the step and ``gc_count`` their number; ``cpu_ns`` CPU time of the training
thread over the step (``time.thread_time_ns``); ``runq_ns`` the time it spent runnable but
waiting for a core (the kernel's run-queue delay, `collector.runqueue`)."""

PHASE_COLUMNS: dict[str, np.dtype] = {
    "step": np.dtype("<i8"),
    "phase": np.dtype("<i2"),
    "t0": np.dtype("<i8"),
    "t1": np.dtype("<i8"),
    "cpu_ns": np.dtype("<i8"),
}
"""One row per phase span. ``cpu_ns``: CPU time of the training thread inside the span
(-1 unknown)."""

COLL_COLUMNS: dict[str, np.dtype] = {
    "step": np.dtype("<i8"),
    "op": np.dtype("<i1"),
    "group": np.dtype("<i4"),
    "seq": np.dtype("<i8"),
    "nbytes": np.dtype("<i8"),
    "t_enter": np.dtype("<i8"),
    "t_start": np.dtype("<i8"),
    "t_end": np.dtype("<i8"),
    "t_exit": np.dtype("<i8"),
    "flags": np.dtype("<i4"),
}
"""One row per collective call on this rank. ``seq`` counts calls per group in issue order;
``(group, seq)`` names the same collective instance on every member rank. ``nbytes`` is the
rank's input size in bytes."""

SAMPLE_COLUMNS: dict[str, np.dtype] = {
    "t": np.dtype("<i8"),
    "sm_clock_mhz": np.dtype("<f4"),
    "mem_clock_mhz": np.dtype("<f4"),
    "power_w": np.dtype("<f4"),
    "temp_c": np.dtype("<f4"),
    "throttle": np.dtype("<i8"),
    "gpu_util": np.dtype("<f4"),
    "cpu_pct": np.dtype("<f4"),
    "load1": np.dtype("<f4"),
    "rss_bytes": np.dtype("<i8"),
}
"""Device and host samples; device columns are NaN (throttle -1) without NVML."""

TABLES: dict[str, dict[str, np.dtype]] = {
    "steps": STEP_COLUMNS,
    "phases": PHASE_COLUMNS,
    "colls": COLL_COLUMNS,
    "samples": SAMPLE_COLUMNS,
}

CELL_COLUMNS: dict[str, np.dtype] = {
    "rank": np.dtype("<i4"),
    "inc": np.dtype("<i4"),
    "step": np.dtype("<i8"),
    "n": np.dtype("<i4"),
    "times_last": np.dtype("<i4"),
    "coll_ns": np.dtype("<f8"),
    "wait_ns": np.dtype("<f8"),
    "transfer_ns": np.dtype("<f8"),
    "late_ns": np.dtype("<f8"),
    "exposed_wait_ns": np.dtype("<f8"),
    "exposed_transfer_ns": np.dtype("<f8"),
    "overstay_ns": np.dtype("<f8"),
}
"""A ``reduced`` message's per rank-step sums over the collective instances a relay matched
(``diagnosis.window.COLL_AGGREGATES``, in ns; ``n`` calls and ``times_last`` the times the
rank arrived last), one row per (rank, incarnation, step) of those instances."""

CELL_SUMS = tuple(name for name, dt in CELL_COLUMNS.items() if dt.kind == "f")
"""The float sums of a cell (every column but its keys, ``n`` and ``times_last``)."""

INSTANCE_COLUMNS: dict[str, np.dtype] = {
    "group": np.dtype("<i4"),
    "seq": np.dtype("<i8"),
    "step": np.dtype("<i8"),
    "inc": np.dtype("<i4"),
    "op": np.dtype("<i1"),
    "nbytes": np.dtype("<i8"),
    "n_members": np.dtype("<i4"),
    "first": np.dtype("<i8"),
    "last": np.dtype("<i8"),
    "last_rank": np.dtype("<i4"),
    "margin": np.dtype("<f8"),
    "transfer": np.dtype("<f8"),
    "device_transfer": np.dtype("<f8"),
    "first_exit": np.dtype("<i8"),
    "last_exit": np.dtype("<i8"),
}
"""A ``reduced`` message's collective instances, every member arrived: ``first``/``last``
the first and last entry and ``first_exit``/``last_exit`` the first and last exit (int64 ns
on the hub's clock, as the rows' times), the rest as ``diagnosis.window.InstanceTable``
defines them (NaN where unknown)."""

PART_COLUMNS: dict[str, np.dtype] = {
    "group": np.dtype("<i4"),
    "seq": np.dtype("<i8"),
    "step": np.dtype("<i8"),
    "inc": np.dtype("<i4"),
    "op": np.dtype("<i1"),
    "nbytes": np.dtype("<i8"),
    "n_members": np.dtype("<i4"),
    "first": np.dtype("<i8"),
    "last": np.dtype("<i8"),
    "last_rank": np.dtype("<i4"),
    "runner_up": np.dtype("<i8"),
    "first_exit": np.dtype("<i8"),
    "last_exit": np.dtype("<i8"),
    "exit_median": np.dtype("<f8"),
    "n_device": np.dtype("<i4"),
    "start_max": np.dtype("<i8"),
    "end_median": np.dtype("<f8"),
}
"""A ``reduced`` message's *parts*: what a relay knows of a collective instance whose group
has members beyond it, from the ``n_members`` members it carries (`hub.partial`):
``first``/``last`` their first and last entry, ``last_rank`` the lowest rank at ``last``,
``runner_up`` the latest entry of the others (``NO_TIME`` for one member), ``first_exit``/
``last_exit`` their first and last exit (int64 ns on the hub's clock), ``exit_median`` the
median of their exits (ns after ``first``); of the ``n_device`` device-timed ones, the
latest kernel start (``start_max``, ``NO_TIME`` for none) and the median kernel end
(``end_median``, ns after ``first``, NaN for none)."""

PART_CELL_COLUMNS: dict[str, np.dtype] = {
    "rank": np.dtype("<i4"),
    "inc": np.dtype("<i4"),
    "step": np.dtype("<i8"),
    "group": np.dtype("<i4"),
    "n": np.dtype("<i4"),
    "origin": np.dtype("<i8"),
    "enter_ns": np.dtype("<f8"),
    "exit_ns": np.dtype("<f8"),
    "linear": np.dtype("<i1"),
    "start_ns": np.dtype("<f8"),
    "after_ns": np.dtype("<f8"),
}
"""Per (rank, incarnation, step, group) of a ``reduced`` message's parts, the rank's ``n``
calls of the group in the step: the sums of their entries and exits (an exit before its
entry counts as the entry), in ns after ``origin`` (int64 ns on the hub's clock; sums of
integers, exact below 2**53). Where ``linear`` is 1, every call's exposed time starts no
later than its instance's last entry can be (`hub.partial`), and ``start_ns`` sums where
each starts (after ``origin``); else ``after_ns`` sums the exposed time of the calls whose
cut comes after their instance's first exit can be, and the others are ``part_rows``."""

PART_ROW_COLUMNS: dict[str, np.dtype] = {
    "rank": np.dtype("<i4"),
    "inc": np.dtype("<i4"),
    "step": np.dtype("<i8"),
    "group": np.dtype("<i4"),
    "seq": np.dtype("<i8"),
    "start": np.dtype("<i8"),
    "exit": np.dtype("<i8"),
    "cut": np.dtype("<i8"),
}
"""The calls of a ``reduced`` message's parts whose exposed time the hub needs the
instance's last entry and first exit for (a part cell with ``linear`` 0): where the
exposed time may start (``start``: the later of the entry and the asynchronous cut),
the exit, and the cut (``NO_TIME`` for none), int64 ns on the hub's clock."""

_RANK = {"rank": np.dtype("<i4"), "inc": np.dtype("<i4")}

REDUCED_TABLES: dict[str, dict[str, np.dtype]] = {
    "cells": CELL_COLUMNS,
    "instances": INSTANCE_COLUMNS,
    "steps": {**STEP_COLUMNS, **_RANK},
    "phases": {**PHASE_COLUMNS, **_RANK},
    "colls": {**COLL_COLUMNS, **_RANK},
    "samples": {**SAMPLE_COLUMNS, **_RANK},
    "parts": PART_COLUMNS,
    "part_cells": PART_CELL_COLUMNS,
    "part_rows": PART_ROW_COLUMNS,
}
"""The tables of a ``reduced`` message: what a relay sends for its node's ranks in one
message per run and flush (`rankscope.hub.reduce`). ``cells`` and ``instances`` (always
present) hold what it matched itself; ``parts``, ``part_cells`` and ``part_rows``
(optional, together) its share of instances whose groups reach beyond it, which the hub combines
(`rankscope.hub.partial`); ``steps``, ``phases``, ``colls`` and ``samples`` (each
optional) are its ranks' own rows with their ``rank`` and ``inc`` (incarnation) added,
phase codes indexing the message's ``phase_names``."""

REDUCED_REQUIRED = frozenset({"cells", "instances"})
"""The tables every ``reduced`` message holds (maybe empty). Its header may also carry
``messages`` (the collectors' messages it stands for), ``stats``, the node's ranks'
``stats`` maps as ``[[rank, inc, map], ...]``, and ``unlisted``, ``[instances, calls]``:
the instances its cells sum that ``instances`` leaves out (a relay lists a share of them
at scale, `rankscope.hub.reduce`), and their members' calls."""

OPTIONAL_COLUMNS: dict[str, frozenset[str]] = {
    "steps": frozenset({"expert_tokens", "gc_ns", "gc_count", "cpu_ns", "runq_ns"}),
    "phases": frozenset({"cpu_ns"}),
}
"""Columns added after the first collectors shipped, without a version bump: a table that
lacks them (an older collector, the simulator of that time, an independent generator, an
old recording) decodes with them unknown, and `encode_table` fills them in the same way.
Every other column is required. Columns a hub does not know are ignored, so a newer sender
still talks to an older hub."""

HELLO_REQUIRED = {
    "rank": int,
    "world_size": int,
    "local_rank": int,
    "host": str,
    "node_rank": int,
    "pid": int,
}
"""Identity fields every hello must carry, with their types."""

INT32_MAX = 2**31 - 1
"""Largest rank, world size, GPU index, rail, node rank, mesh coordinate, incarnation...:
readers hold them in int32 columns."""

MAX_NAME_CHARS = 256
"""Longest job, run, host, rack, NIC, GPU UUID, PCI bus, group or phase name."""

MAX_MESH_DIMS = 16
"""Most entries of a hello's ``mesh`` map."""

MAX_PHASE_NAMES = 256
"""Most user phase names one message may carry."""

MAX_TIME_NS = 2**62
"""Latest time any column may hold (year 2116): every difference of two times fits int64.
A time is ``NO_TIME`` or in ``0..MAX_TIME_NS`` (the hub narrows this to a window around
its own clock, ``hub.validate.Limits``)."""

HELLO_OPTIONAL = {
    "local_world_size": int,
    "gpu_index": int,
    "gpu_uuid": str,
    "pci_bus": str,
    "numa_node": int,
    "nic": str,
    "rail": int,
    "rack": str,
    "mesh": dict,
    "shard": int,
}
"""Identity fields a hello may carry; absent means unknown."""


class SchemaError(ValueError):
    """A message does not follow the wire schema. ``reason`` is a short stable tag that the
    hub counts (``bad_msgpack``, ``bad_version``, ``bad_kind``, ``bad_header``, ``bad_type``,
    ``bad_table``, ``bad_size``, ``bad_hello``, ``bad_identity``, ``bad_groups``,
    ``bad_phase``, ``bad_time``, ``bad_beat``, ``bad_fr``, ``too_large``); ``detail`` names the field and its value."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def empty_table(name: str, n: int) -> dict[str, np.ndarray]:
    """Allocate a table of ``n`` rows with the schema's dtypes, filled with "unknown".

    Args:
        name: table name in ``TABLES``.
        n: number of rows.

    Returns:
        A dict column name -> array; ints are -1, floats NaN.
    """
    cols = {}
    for col, dt in TABLES[name].items():
        cols[col] = np.full(n, np.nan if dt.kind == "f" else -1, dtype=dt)
    return cols


def encode_table(
    name: str, cols: dict[str, np.ndarray], specs: dict[str, dict[str, np.dtype]] = TABLES
) -> dict[str, Any]:
    """Encode one table as ``{"n": rows, "cols": {name: bytes}}``.

    Every schema column must be present, except those of ``OPTIONAL_COLUMNS``, which are
    sent as unknown when absent; arrays are cast to the schema dtype.

    Args:
        name: table name in ``specs``.
        cols: column arrays of equal length.
        specs: ``TABLES``, or ``REDUCED_TABLES`` for a ``reduced`` message.

    Returns:
        The msgpack-ready table map.
    """
    spec = specs[name]
    optional = OPTIONAL_COLUMNS.get(name, frozenset())
    n = -1
    present: dict[str, np.ndarray] = {}
    absent = []
    for col, dt in spec.items():
        if col not in cols and col in optional:
            absent.append(col)
            continue
        arr = np.ascontiguousarray(cols[col], dtype=dt)
        if n < 0:
            n = arr.shape[0]
        elif arr.shape[0] != n:
            raise SchemaError("bad_table", f"{name}.{col} has {arr.shape[0]} rows, expected {n}")
        present[col] = arr
    n = max(n, 0)
    out = dict(zip(present, pack_columns(list(present.values())), strict=True))
    for col in absent:
        dt = spec[col]
        if dt.kind == "f" or n < PACK_MIN_ROWS:
            out[col] = np.full(n, np.nan if dt.kind == "f" else -1, dtype=dt).tobytes()
        else:
            out[col] = [-1, 0, b""]
    return {"n": n, "cols": out}


def _pack_fits(base: int, width: int, dt: np.dtype) -> bool:
    """Whether every offset of ``width`` bytes above ``base`` is a value of ``dt`` (the one
    rule both ends apply, so a packed column never overflows its dtype when unpacked)."""
    lo_hi = _LIMITS.get(dt.str)
    if lo_hi is None:
        info = np.iinfo(dt)
        lo_hi = _LIMITS[dt.str] = (int(info.min), int(info.max))
    return width < dt.itemsize and lo_hi[0] <= base and base + (1 << (8 * width)) - 1 <= lo_hi[1]


_LIMITS: dict[str, tuple[int, int]] = {}


def pack_column(arr: np.ndarray) -> bytes | list[Any]:
    """A column as it travels: its raw bytes, or, for an integer column of at least
    `PACK_MIN_ROWS` rows whose values span fewer than 2**32, ``[base, width, offsets]``
    (module docstring) when that is narrower. Exact: `decode` gives back the same values.
    """
    return pack_columns([arr])[0]


def pack_columns(arrays: list[np.ndarray]) -> list[bytes | list[Any]]:
    """`pack_column` of each array. The minima and maxima of the integer columns of one
    dtype are taken together, one reduction of the stacked columns each instead of two per
    column: the collector's background thread ships tables of ten columns, where the fixed
    cost of a numpy call is most of the work."""
    out: list[bytes | list[Any]] = [b""] * len(arrays)
    by_dtype: dict[str, list[int]] = {}
    for i, arr in enumerate(arrays):
        if arr.dtype.kind in "iu" and arr.shape[0] >= PACK_MIN_ROWS:
            by_dtype.setdefault(arr.dtype.str, []).append(i)
        else:
            out[i] = arr.tobytes()
    for idx in by_dtype.values():
        if len(idx) == 1:
            lows, highs = [arrays[idx[0]].min()], [arrays[idx[0]].max()]
        else:
            stacked = np.stack([arrays[i] for i in idx])
            lows, highs = stacked.min(axis=1), stacked.max(axis=1)
        for i, lo, hi in zip(idx, lows, highs, strict=True):
            out[i] = _packed(arrays[i], int(lo), int(hi))
    return out


def _packed(arr: np.ndarray, lo: int, hi: int) -> bytes | list[Any]:
    dt = arr.dtype
    span = hi - lo
    if span == 0:
        return [lo, 0, b""] if _pack_fits(lo, 0, dt) else arr.tobytes()
    for width in _PACK_WIDTHS:
        if span < 1 << (8 * width) and _pack_fits(lo, width, dt):
            # The difference fits the narrow type; it is taken in the column's own type
            # (no wrap: span < 2**32 and both ends are values of that type).
            return [lo, width, (arr - dt.type(lo)).astype(_UNSIGNED[width]).tobytes()]
    return arr.tobytes()


def _unpack_column(where: str, value: Any, n: int, dt: np.dtype) -> np.ndarray:
    """A column's values from either form; raises `SchemaError` naming ``where``."""
    if isinstance(value, bytes):
        if len(value) != n * dt.itemsize:
            raise SchemaError(
                "bad_size", f"{where} has {len(value)} bytes, expected {n} x {dt.itemsize}"
            )
        return np.frombuffer(value, dtype=dt)
    if not isinstance(value, list) or len(value) != 3:
        raise SchemaError(
            "bad_table", f"{where} is missing, or neither bytes nor [base, width, offsets]"
        )
    base, width, data = value
    if (
        dt.kind not in "iu"
        or type(base) is not int
        or not isinstance(width, int)
        or isinstance(width, bool)
    ):
        raise SchemaError(
            "bad_table", f"{where}: a packed column needs an integer column, int base and width"
        )
    if (width != 0 and width not in _PACK_WIDTHS) or not _pack_fits(base, width, dt):
        raise SchemaError(
            "bad_table", f"{where}: packed base {base} and width {width} do not fit {dt.name}"
        )
    if not isinstance(data, bytes) or len(data) != n * width:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise SchemaError(
            "bad_size", f"{where} packed offsets are {got}, expected {n} x {width} bytes"
        )
    if width == 0:
        return _constant(n, base, dt)
    out = np.frombuffer(data, dtype=_UNSIGNED[width]).astype(dt)
    out += dt.type(base)  # no wrap: base and base + 2**(8 width) - 1 are values of dt
    return out


_CONSTANTS: dict[tuple[int, int, str], np.ndarray] = {}
_CONSTANT_ROWS = 4096
_CONSTANTS_MAX = 256


def _constant(n: int, value: int, dt: np.dtype) -> np.ndarray:
    """A read-only column of ``n`` rows of ``value``: decoded columns are read-only (views
    of the message's bytes), so one array serves every message that repeats it (op,
    group, flags, unknown device times: most of a stream's columns). At most
    ``_CONSTANTS_MAX`` arrays of ``_CONSTANT_ROWS`` rows are kept (8 MiB), all dropped
    at once when full."""
    if n > _CONSTANT_ROWS:
        out = np.full(n, value, dtype=dt)
        out.flags.writeable = False
        return out
    key = (n, value, dt.str)
    got = _CONSTANTS.get(key)
    if got is None:
        if len(_CONSTANTS) >= _CONSTANTS_MAX:
            _CONSTANTS.clear()
        got = _CONSTANTS[key] = np.full(n, value, dtype=dt)
        got.flags.writeable = False
    return got


def encode(msg: dict[str, Any]) -> bytes:
    """Pack a message map (tables already encoded) with the schema version set."""
    msg["v"] = SCHEMA_VERSION
    return msgpack.packb(msg, use_bin_type=True)


def steps_message(
    header: dict[str, Any],
    steps: dict[str, np.ndarray],
    phases: dict[str, np.ndarray] | None = None,
    colls: dict[str, np.ndarray] | None = None,
    phase_names: list[str] | None = None,
) -> bytes:
    """Build a ``steps`` message from column arrays.

    Args:
        header: ``job``, ``run``, ``rank``, ``inc`` and ``batch`` (per-sender sequence number).
        steps: step table columns.
        phases: phase table columns (optional).
        colls: collective table columns (optional).
        phase_names: user phase names, indexed after ``PHASES``.

    Returns:
        Encoded bytes ready to send.
    """
    tables = {"steps": encode_table("steps", steps)}
    if phases is not None:
        tables["phases"] = encode_table("phases", phases)
    if colls is not None:
        tables["colls"] = encode_table("colls", colls)
    msg = dict(header)
    msg["kind"] = "steps"
    msg["tables"] = tables
    msg["phase_names"] = list(phase_names or [])
    return encode(msg)


def hello_message(
    header: dict[str, Any],
    identity: dict[str, Any],
    *,
    scope: str = "full",
    parent_run: str | None = None,
    manifest: dict[str, Any] | None = None,
    t_start_ns: int | None = None,
) -> bytes:
    """Build a ``hello``: who this rank is, which run it belongs to, and its manifest.

    Args:
        header: ``job``, ``run``, ``rank``, ``inc``, ``batch``.
        identity: ``HELLO_REQUIRED`` fields plus any of ``HELLO_OPTIONAL``.
        scope: one of ``SCOPES``.
        parent_run: the run this one is a reduced rerun of.
        manifest: versions, env, launcher argv, job config (free-form map of plain values).
        t_start_ns: hub-clock time the process started (for "time since start").
    """
    msg = dict(header)
    msg.update(
        kind="hello",
        identity=identity,
        scope=scope,
        parent_run=parent_run,
        manifest=manifest or {},
        t_start_ns=t_start_ns,
    )
    return encode(msg)


def groups_message(header: dict[str, Any], groups: list[dict[str, Any]]) -> bytes:
    """Build a ``groups`` message: ``[{"id", "name", "ranks", "backend", "desc"}]``."""
    msg = dict(header)
    msg.update(kind="groups", groups=groups)
    return encode(msg)


def samples_message(header: dict[str, Any], samples: dict[str, np.ndarray]) -> bytes:
    """Build a ``samples`` message from ``SAMPLE_COLUMNS`` arrays."""
    msg = dict(header)
    msg.update(kind="samples", tables={"samples": encode_table("samples", samples)})
    return encode(msg)


def reduced_message(
    header: dict[str, Any],
    tables: dict[str, dict[str, np.ndarray]],
    phase_names: list[str] | None = None,
) -> bytes:
    """Build a ``reduced`` message (`REDUCED_TABLES`): ``cells`` and ``instances`` (empty
    when absent) and whichever of the rank tables are given. The header names the run, and
    as its ``rank`` and ``inc`` one of the ranks it covers."""
    encoded = {}
    for name in REDUCED_TABLES:
        cols = tables.get(name)
        if cols is None and name in REDUCED_REQUIRED:
            cols = {c: np.zeros(0, dt) for c, dt in REDUCED_TABLES[name].items()}
        if cols is not None:
            encoded[name] = encode_table(name, cols, REDUCED_TABLES)
    msg = dict(header)
    msg.update(kind="reduced", tables=encoded, phase_names=list(phase_names or []))
    return encode(msg)


def stats_message(header: dict[str, Any], stats: dict[str, Any]) -> bytes:
    """Build a ``stats`` message: the collector's own counters.

    Conventional keys: ``dropped_batches``, ``dropped_events``, ``errors`` (map reason ->
    count), ``clock_offset_ns``, ``clock_error_ns`` (half the best round trip).
    """
    msg = dict(header)
    msg.update(kind="stats", stats=stats)
    return encode(msg)


BEAT_POS_FIELDS = (
    "t",
    "step",
    "step_t0",
    "ended",
    "ended_t",
    "exit_t",
    "group",
    "seq",
    "op",
    "since",
    "cpu_ns",
)
"""Int fields of a heartbeat's ``pos`` map, -1 when unknown: ``t`` when the beat was taken;
``step``/``step_t0`` the open step and its start (-1 between steps); ``ended``/``ended_t``
the newest step ended and its end; ``exit_t`` the latest collective exit; ``group``,
``seq``, ``op`` (index into ``OPS``) and ``since`` the collective the training thread is
inside now, and when it entered; ``cpu_ns`` the training thread's CPU clock. Times are
hub-clock ns."""
BEAT_STATES = ("run", "exit")
"""``state`` of a heartbeat: running, or the last beat of a process that is closing."""
MAX_STACK_CHARS = 64 * 1024
"""Longest text of one stack a heartbeat may carry."""
MAX_FR_CHARS = 256 * 1024
"""Longest Flight Recorder dump a heartbeat may carry (``stacks.fr``; a collector cuts a
longer one to its newest entries and says so in the dump's ``rankscope_note``)."""
BEAT_STACK_KEYS = ("py", "native", "why", "fr")
"""Keys of a heartbeat's ``stacks`` map: the Python stacks of every thread, native ones
(py-spy) when taken, why they were taken, and the process's Flight Recorder dump (torch's
``_dump_fr_trace_json`` text: a JSON object) where one is enabled. A bad ``fr`` is
refused as ``bad_fr``, the rest as ``bad_beat``."""


def beat_message(
    header: dict[str, Any],
    pos: dict[str, int],
    *,
    state: str = "run",
    stacks: dict[str, str] | None = None,
    error: str | None = None,
) -> bytes:
    """Build a ``beat``: this rank is alive, and where its training thread is.

    Args:
        header: ``job``, ``run``, ``rank``, ``inc``, ``batch``.
        pos: ``BEAT_POS_FIELDS`` ints (-1 unknown).
        state: one of ``BEAT_STATES``.
        stacks: ``BEAT_STACK_KEYS`` texts, at most ``MAX_STACK_CHARS`` each.
        error: on the closing beat of a process ended by an exception, what it was (at
            most ``MAX_NAME_CHARS``).
    """
    msg = dict(header)
    msg.update(kind="beat", pos=pos, state=state)
    if stacks:
        msg["stacks"] = stacks
    if error:
        msg["error"] = error[:MAX_NAME_CHARS]
    return encode(msg)


def _check_beat(obj: dict[str, Any]) -> None:
    pos = obj.get("pos")
    if not isinstance(pos, dict) or len(pos) > 2 * len(BEAT_POS_FIELDS):
        raise SchemaError("bad_beat", "beat without a pos map of at most 22 fields")
    for key in BEAT_POS_FIELDS:
        value = pos.get(key, -1)
        _check_int(f"pos.{key}", value, -1, MAX_TIME_NS, reason="bad_beat")
    for key in [k for k in pos if k not in BEAT_POS_FIELDS]:
        del pos[key]  # a newer collector's extra fields are dropped, not refused
    if not -1 <= pos.get("op", -1) < len(OPS):
        raise SchemaError("bad_beat", f"pos.op = {pos['op']} is not an index into OPS")
    if obj.get("state", "run") not in BEAT_STATES:
        raise SchemaError("bad_beat", f"unknown beat state {obj.get('state')!r}")
    if obj.get("error") is not None:
        _check_name("error", obj["error"], reason="bad_beat")
    stacks = obj.get("stacks")
    if stacks is not None:
        if not isinstance(stacks, dict) or not set(stacks) <= set(BEAT_STACK_KEYS):
            raise SchemaError("bad_beat", f"stacks must be a map with keys in {BEAT_STACK_KEYS}")
        for key, text in stacks.items():
            if key == "fr":
                _check_fr(text)
                continue
            _check_type(f"stacks.{key}", text, str)
            if len(text) > MAX_STACK_CHARS:
                raise SchemaError(
                    "bad_beat", f"stacks.{key} has {len(text)} characters (max {MAX_STACK_CHARS})"
                )


def _check_fr(text: Any) -> None:
    # Its JSON is parsed only when a bundle is written (once per stall, off the ingest
    # path): a beat could carry one every second.
    if not isinstance(text, str):
        raise SchemaError("bad_fr", f"stacks.fr must be str, got {type(text).__name__}")
    if len(text) > MAX_FR_CHARS:
        raise SchemaError("bad_fr", f"stacks.fr has {len(text)} characters (max {MAX_FR_CHARS})")
    if not text.lstrip().startswith("{"):
        raise SchemaError("bad_fr", f"stacks.fr is not a JSON object: {text[:40]!r}")


@dataclass
class Message:
    """A decoded, validated message. ``tables`` holds numpy columns (read-only views)."""

    kind: str
    header: dict[str, Any]
    tables: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    nbytes: int = 0


_HEADER_TYPES = {"job": str, "run": str, "rank": int, "inc": int}


def _check_type(where: str, value: Any, typ: type) -> None:
    # bool is an int subclass; a rank of True is a bug upstream, not a rank.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise SchemaError("bad_type", f"{where} must be {typ.__name__}, got {type(value).__name__}")


def _check_int(where: str, value: Any, lo: int, hi: int = INT32_MAX, *, reason: str) -> None:
    _check_type(where, value, int)
    if not lo <= value <= hi:
        raise SchemaError(reason, f"{where} = {value} outside {lo}..{hi}")


def _check_name(where: str, value: Any, *, reason: str, empty: bool = True) -> None:
    _check_type(where, value, str)
    if len(value) > MAX_NAME_CHARS or (not empty and not value):
        raise SchemaError(
            reason,
            f"{where} must be {int(not empty)}..{MAX_NAME_CHARS} characters, got {len(value)}",
        )


def _check_optional_name(where: str, value: Any, *, reason: str) -> None:
    if value is not None:
        _check_name(where, value, reason=reason)


_IDENTITY_LOW = {"rank": 0, "world_size": 1, "local_rank": 0, "pid": 0, "local_world_size": 1}
"""Lowest value of each int identity field; the others may be -1 (unknown)."""


def _check_identity(ident: dict[str, Any], header_rank: int) -> None:
    """Types and ranges of a hello's identity map (every value a reader will cast)."""
    for key, typ in HELLO_REQUIRED.items():
        if key not in ident:
            raise SchemaError("bad_hello", f"identity misses {key!r}")
        _check_type(f"identity.{key}", ident[key], typ)
    for key, typ in HELLO_OPTIONAL.items():
        if ident.get(key) is not None:
            _check_type(f"identity.{key}", ident[key], typ)
    for key, typ in (*HELLO_REQUIRED.items(), *HELLO_OPTIONAL.items()):
        value = ident.get(key)
        if value is None:
            continue
        if typ is int:
            _check_int(f"identity.{key}", value, _IDENTITY_LOW.get(key, -1), reason="bad_identity")
        elif typ is str:
            _check_name(f"identity.{key}", value, reason="bad_identity")
    mesh = ident.get("mesh")
    if mesh is not None:
        if len(mesh) > MAX_MESH_DIMS:
            raise SchemaError(
                "bad_identity", f"identity.mesh has {len(mesh)} entries (max {MAX_MESH_DIMS})"
            )
        for dim, coord in mesh.items():
            _check_name("identity.mesh key", dim, empty=False, reason="bad_identity")
            _check_int(f"identity.mesh.{dim}", coord, -1, reason="bad_identity")
    extra = [k for k in ident if k not in HELLO_REQUIRED and k not in HELLO_OPTIONAL]
    if extra:
        # Readers copy the identity map whole: a field this schema does not name could
        # hold anything. A newer collector's extra fields are dropped, not refused.
        for k in extra:
            del ident[k]
    if ident["rank"] != header_rank:
        raise SchemaError(
            "bad_hello", f"identity rank {ident['rank']} != header rank {header_rank}"
        )
    if not 0 <= ident["rank"] < ident["world_size"]:
        raise SchemaError(
            "bad_hello", f"rank {ident['rank']} outside world size {ident['world_size']}"
        )
    lws = ident.get("local_world_size")
    if lws is not None and not 0 <= ident["local_rank"] < lws:
        raise SchemaError(
            "bad_hello", f"local rank {ident['local_rank']} outside local world size {lws}"
        )


def _decode_table(
    name: str, raw: Any, specs: dict[str, dict[str, np.dtype]] = TABLES
) -> dict[str, np.ndarray]:
    spec = specs.get(name)
    if spec is None:
        raise SchemaError("bad_table", f"unknown table {name!r}")
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("n"), int)
        or not isinstance(raw.get("cols"), dict)
    ):
        raise SchemaError("bad_table", f"table {name!r} must be a map with int 'n' and map 'cols'")
    n = raw["n"]
    if n < 0 or n > MAX_ROWS:
        raise SchemaError("bad_size", f"table {name!r} has {n} rows (max {MAX_ROWS})")
    cols = {}
    optional = OPTIONAL_COLUMNS.get(name, frozenset())
    given = raw["cols"]
    for col, dt in spec.items():
        buf = given.get(col)
        if type(buf) is bytes and len(buf) == n * dt.itemsize:  # the usual form, at once
            cols[col] = np.frombuffer(buf, dtype=dt)
            continue
        if buf is None and col in optional:
            cols[col] = np.full(n, np.nan if dt.kind == "f" else -1, dtype=dt)
            continue
        cols[col] = _unpack_column(f"{name}.{col}", buf, n, dt)
    return cols


def _header_bytes(data: bytes) -> int:
    """Bytes of the top-level values other than ``tables``, measured without decoding
    them (``Unpacker.skip``); 0 when the top level is not a map (decode says why)."""
    unpacker = msgpack.Unpacker(max_buffer_size=len(data) + 1, raw=False)
    unpacker.feed(data)
    try:
        n = unpacker.read_map_header()
        total = 0
        for _ in range(n):
            start = unpacker.tell()
            key = unpacker.unpack() if n < 64 else None
            unpacker.skip()
            if key != "tables":
                total += unpacker.tell() - start
            if n >= 64:
                total = len(data)  # no message of this schema has that many fields
                break
        return total
    except Exception:
        return 0


def decode(data: bytes, max_header_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Decode and validate one message.

    Checks: size bound, msgpack, schema version, kind, header types and ranges (rank and
    incarnation in ``0..INT32_MAX``, job and run names of 1..``MAX_NAME_CHARS``), table
    shapes and, for ``hello``, every identity field: its type, and its range as a reader
    holds it (ints in int32, -1 for unknown where a field may be unknown; names of at most
    ``MAX_NAME_CHARS``; ``mesh`` a map of at most ``MAX_MESH_DIMS`` int coordinates), the
    manifest a map with string keys and ``t_start_ns`` within ``0..MAX_TIME_NS``. Identity
    fields this schema does not name are dropped (readers copy the identity map whole).
    Group ids and names, and user phase names, are checked the same way. A column of
    ``OPTIONAL_COLUMNS`` that is absent reads as unknown; unknown columns are ignored.
    Semantic checks that need hub state or its limits (known rank, world size, incarnation
    steps, manifest size, the values in the columns) are the hub's job (``hub.validate``).

    Args:
        data: raw message bytes.
        max_header_bytes: most bytes outside ``tables`` (see `MAX_HEADER_BYTES`).

    Returns:
        The decoded message.

    Raises:
        SchemaError: with a stable ``reason`` tag.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    if len(data) > max_header_bytes:
        head = _header_bytes(data)
        if head > max_header_bytes:
            raise SchemaError(
                "too_large",
                f"{head} bytes outside tables (identity, manifest, groups...) > {max_header_bytes}",
            )
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SchemaError("bad_msgpack", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError("bad_msgpack", f"top level is {type(obj).__name__}, not a map")
    version = obj.get("v")
    if type(version) is not int or version not in READ_VERSIONS:
        raise SchemaError(
            "bad_version",
            f"schema version {version!r}, this hub reads {', '.join(map(str, READ_VERSIONS))}",
        )
    kind = obj.get("kind")
    if kind not in KINDS:
        raise SchemaError("bad_kind", f"unknown kind {kind!r}")
    for key, typ in _HEADER_TYPES.items():
        if key not in obj:
            raise SchemaError("bad_header", f"missing {key!r}")
        _check_type(key, obj[key], typ)
    if obj["rank"] < 0:
        raise SchemaError("bad_header", f"rank {obj['rank']} < 0")
    if not (
        obj["rank"] <= INT32_MAX
        and 0 <= obj["inc"] <= INT32_MAX
        and 0 < len(obj["job"]) <= MAX_NAME_CHARS
        and 0 < len(obj["run"]) <= MAX_NAME_CHARS
    ):  # one test for the usual header; the checks below name what is wrong
        _check_int("rank", obj["rank"], 0, reason="bad_header")
        _check_int("inc", obj["inc"], 0, reason="bad_header")
        _check_name("job", obj["job"], empty=False, reason="bad_header")
        _check_name("run", obj["run"], empty=False, reason="bad_header")
    tables: dict[str, dict[str, np.ndarray]] = {}
    raw_tables = obj.pop("tables", None)
    if kind in ("steps", "samples"):
        if not isinstance(raw_tables, dict):
            raise SchemaError("bad_table", f"{kind} message without tables")
        for name, raw in raw_tables.items():
            tables[name] = _decode_table(name, raw)
        if kind == "steps" and "steps" not in tables:
            raise SchemaError("bad_table", "steps message without a steps table")
        if kind == "samples" and "samples" not in tables:
            raise SchemaError("bad_table", "samples message without a samples table")
    elif kind == "reduced":
        if (
            not isinstance(raw_tables, dict)
            or not set(raw_tables) >= REDUCED_REQUIRED
            or not set(raw_tables) <= set(REDUCED_TABLES)
        ):
            raise SchemaError(
                "bad_table",
                f"a reduced message holds the tables {sorted(REDUCED_REQUIRED)} and may hold "
                f"{sorted(set(REDUCED_TABLES) - REDUCED_REQUIRED)}",
            )
        for name, raw in raw_tables.items():
            tables[name] = _decode_table(name, raw, REDUCED_TABLES)
        if obj.get("messages") is not None:  # collector messages it stands for
            _check_int("messages", obj["messages"], 0, reason="bad_header")
        unlisted = obj.get("unlisted")  # [instances, calls] its sums cover and it leaves out
        if unlisted is not None and not (
            isinstance(unlisted, list)
            and len(unlisted) == 2
            and all(isinstance(v, int) and 0 <= v < 2**62 for v in unlisted)
        ):
            raise SchemaError(
                "bad_header", "a reduced message's unlisted must be [instances, calls] >= 0"
            )
        stats = obj.get("stats")  # [[rank, incarnation, the rank's stats map], ...]
        if stats is not None and (
            not isinstance(stats, list)
            or not all(
                isinstance(e, list)
                and len(e) == 3
                and isinstance(e[0], int)
                and isinstance(e[1], int)
                and isinstance(e[2], dict)
                for e in stats
            )
        ):
            raise SchemaError(
                "bad_stats", "a reduced message's stats must be [[rank, inc, {...}], ...]"
            )
    if kind == "hello":
        ident = obj.get("identity")
        if not isinstance(ident, dict):
            raise SchemaError("bad_hello", "hello without an identity map")
        _check_identity(ident, obj["rank"])
        scope = obj.get("scope", "full")
        if scope not in SCOPES:
            raise SchemaError("bad_hello", f"unknown scope {scope!r}")
        _check_optional_name("parent_run", obj.get("parent_run"), reason="bad_hello")
        started = obj.get("t_start_ns")
        if started is not None:
            _check_int("t_start_ns", started, 0, MAX_TIME_NS, reason="bad_time")
        manifest = obj.get("manifest")
        if manifest is not None and (
            not isinstance(manifest, dict) or not all(isinstance(k, str) for k in manifest)
        ):
            raise SchemaError("bad_hello", "manifest must be a map with string keys")
    if kind == "groups":
        groups = obj.get("groups")
        if not isinstance(groups, list):
            raise SchemaError("bad_groups", "groups message without a groups list")
        for g in groups:
            if (
                not isinstance(g, dict)
                or not isinstance(g.get("id"), int)
                or not isinstance(g.get("ranks"), list)
            ):
                raise SchemaError("bad_groups", "each group needs int 'id' and list 'ranks'")
            _check_int("group id", g["id"], 0, reason="bad_groups")
            for key in ("name", "backend", "desc"):
                _check_optional_name(f"group {g['id']} {key}", g.get(key), reason="bad_groups")
    if kind in ("steps", "reduced"):
        names = obj.get("phase_names")
        if names is not None:
            if not isinstance(names, list) or len(names) > MAX_PHASE_NAMES:
                raise SchemaError(
                    "bad_phase", f"phase_names must be a list of at most {MAX_PHASE_NAMES} names"
                )
            for name in names:
                _check_name("phase name", name, empty=False, reason="bad_phase")
    if kind == "beat":
        _check_beat(obj)
    if "batch" in obj and obj["batch"] is not None:
        _check_type("batch", obj["batch"], int)
    return Message(kind=kind, header=obj, tables=tables, nbytes=len(data))
