"""Import PyTorch Flight Recorder dumps (one file per rank) and the hang they show.

torch's c10d Flight Recorder keeps a ring of the last collectives each rank issued and
writes it on a watchdog timeout (``TORCH_FR_BUFFER_SIZE`` > 0, ``TORCH_FR_DUMP_TEMP_FILE``
prefix, one file ``<prefix><rank>``) or on demand (``torch._C._distributed_c10d.
_dump_fr_trace()`` / ``_dump_fr_trace_json()``). The format is the one built by
``FlightRecorder<EventType>::dump`` / ``getCollectiveTrace`` in
``torch/csrc/distributed/c10d/FlightRecorderDetail.hpp`` (version ``"2.10"`` in torch
2.13): a map with ``version``, ``pg_config`` (pg name -> ``{name, desc, ranks}``, ranks as
the text ``"[0, 1]"``), ``pg_status`` and ``entries``, one per collective in record order::

    record_id, pg_id, process_group (name, desc), collective_seq_id, p2p_seq_id, op_id,
    profiling_name ("nccl:all_reduce"), time_created_ns, duration_ms (when timed),
    input_sizes, input_dtypes, output_sizes, output_dtypes,
    state ("scheduled" | "started" | "completed"),
    time_discovered_started_ns, time_discovered_completed_ns (None, or 0 in JSON),
    retired, timeout_ms, is_p2p, frames (when stack traces were taken)

Pickle is the default encoding; reading a pickle runs code, so it is loaded with an
unpickler that refuses every global (only builtin containers and scalars decode). The JSON
dump is read as well.

What is imported: one collective row per entry on its rank (``t_enter`` = created,
``t_start`` = discovered started, ``t_exit`` = discovered completed; unknown times stay
``NO_TIME``), matched across ranks by ``(process group, collective_seq_id)`` (``p2p_seq_id``
in a separate ``<pg>/p2p`` group for point-to-point entries). A dump has no step notion:
a *step* here is `STEP_COLLECTIVES` consecutive collectives of the busiest process group,
other groups' rows belonging to the step open when they were created; a step holding an
unfinished collective did not end. An entry is finished when it is ``completed`` or
``retired`` (gloo never discovers start and completion, but retires a finished work).

The hang: each rank's last position goes out as one heartbeat (``beat``): the oldest
unfinished collective it is inside (group, seq, op, since its creation), or outside
collectives after its last finished one. ``rankscope diagnose`` judges those beats as it
judges a live job's: a rank outside collectives while others wait in ``(group, seq)`` is
"not entered", every member inside and none finished is a transfer hang. The import
report's ``details["hang"]`` lists, per open instance, the ranks that entered and did not
finish and the members that never entered.

Bad input is a problem of the report, never a traceback, and the rest of the dump is
imported: an entry that is not a map, has no creation time or holds a value that cannot be
(a wrong type, a time outside ``0..2**62`` ns, a size or sequence number that is not a
count, a completion before its creation, a collective longer than the hub takes) is left
out and counted, one problem line per file and reason; ``pg_config`` members that are not
distinct ranks of the hub's world are left unknown.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from rankscope.collector import schema
from rankscope.hub.importers import (
    ImportReport,
    header,
    next_header,
    open_binary,
    source_manifest,
)
from rankscope.hub.importers.align import estimate_offsets
from rankscope.hub.importers.kineto import DTYPE_BYTES, op_name
from rankscope.hub.validate import Limits

KIND = "flight-recorder"

STEP_COLLECTIVES = 10
"""Collectives of the busiest process group that make one imported step."""

MAX_DUMP_BYTES = 2 << 30
"""Largest dump read (a ring of 2,000 entries with stacks is a few MB)."""

MAX_RANKS = Limits.max_world_size
"""Ranks must lie below this many (the hub's largest world)."""

MAX_DURATION_NS = int(Limits.max_duration_s * 1e9)
"""Longest collective or step the hub takes (7 days): longer ones are left out."""

MAX_COUNT = schema.MAX_TIME_NS
"""Largest sequence number and byte count taken (2**62, what every reader's columns hold)."""

_OP_PREFIX = (
    ("all_reduce", "all_reduce"),
    ("allreduce", "all_reduce"),
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("_allgather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("_reduce_scatter", "reduce_scatter"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("send", "send"),
    ("recv", "recv"),
)


class DumpError(ValueError):
    """A dump that cannot be read; the message says what was wrong."""


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Decodes builtin containers and scalars only: any global (class, function) is refused,
    so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedGlobal(f"refused global {module}.{name} (plain data only)")


def load_dump(path: Path) -> dict[str, Any]:
    """Read one Flight Recorder dump (pickle or JSON, gzip handled).

    Args:
        path: the dump file.

    Returns:
        The dump map.

    Raises:
        DumpError: unreadable, not a dump, or a pickle holding anything but plain data.
    """
    with open_binary(path) as f:
        raw = f.read(MAX_DUMP_BYTES + 1)
    if len(raw) > MAX_DUMP_BYTES:
        raise DumpError(f"larger than {MAX_DUMP_BYTES >> 20} MiB")
    if not raw:
        raise DumpError("empty file")
    head = raw.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise DumpError(f"not valid JSON ({exc})") from None
        except RecursionError:
            raise DumpError("JSON nested too deeply to read") from None
    else:
        try:
            obj = _PlainUnpickler(io.BytesIO(raw)).load()
        except _RefusedGlobal as exc:
            raise DumpError(f"not a plain-data pickle: {exc}") from None
        except (
            pickle.UnpicklingError,
            EOFError,
            ValueError,
            TypeError,
            IndexError,
            KeyError,
            AttributeError,
            # A corrupt length or memo index asks for more memory than there is.
            MemoryError,
            OverflowError,
        ) as exc:
            raise DumpError(f"truncated or corrupt pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", None), list):
        raise DumpError("not a Flight Recorder dump (no 'entries' list)")
    return obj


def _op(profiling_name: str) -> str:
    base = profiling_name.split(":")[-1].split(" ")[0]
    op = op_name(base)
    if op != "other":
        return op
    key = base.lower()
    for prefix, name in _OP_PREFIX:
        if key.startswith(prefix):
            return name
    return "other"


class Unusable(ValueError):
    """Why an entry is left out; the text completes "N entries ... left out"."""


def _is_int(v: Any, lo: int, hi: int) -> TypeGuard[int]:
    """Whether ``v`` is an integer (not a boolean) in ``lo..hi``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _nbytes(sizes: Any, dtypes: Any) -> int:
    """Bytes of an entry's input tensors; -1 when the sizes or a dtype are not known.

    Raises:
        Unusable: a shape holding something other than sizes, or more than `MAX_COUNT`
            bytes.
    """
    if not isinstance(sizes, list) or not isinstance(dtypes, list):
        return -1
    total = 0
    for shape, dt in zip(sizes, dtypes):
        size = DTYPE_BYTES.get(dt.lower().replace("torch.", "")) if isinstance(dt, str) else None
        if size is None or not isinstance(shape, list):
            return -1
        n = size
        for d in shape:
            if not _is_int(d, 0, MAX_COUNT):
                raise Unusable("whose input_sizes hold something other than sizes")
            n = min(n * d, MAX_COUNT + 1)
        total += n
    if total > MAX_COUNT:
        raise Unusable("whose input is larger than 2**62 bytes")
    return total


def _time(e: dict[str, Any], key: str) -> int:
    """``e[key]``, a time in ns, or ``NO_TIME`` where it is absent, null or 0 (not seen).

    Raises:
        Unusable: anything but an integer in ``0..schema.MAX_TIME_NS``.
    """
    v = e.get(key)
    if v is None or v == 0:
        return schema.NO_TIME
    if not _is_int(v, 1, schema.MAX_TIME_NS):
        raise Unusable(f"whose {key} is not a time in 0..2**62 ns")
    return v


def _ranks_of(value: Any) -> list[int] | None:
    """The member ranks of a ``pg_config`` entry (a list, or the text ``"[0, 1]"``);
    None when they are not distinct ranks in ``0..MAX_RANKS - 1``."""
    if isinstance(value, str):
        value = [int(r) for r in re.findall(r"-?\d{1,12}", value)]
    if not isinstance(value, list) or not value:
        return None
    if not all(_is_int(r, 0, MAX_RANKS - 1) for r in value) or len(set(value)) < len(value):
        return None
    return value


def _name(v: Any) -> str | None:
    """A process group's name or id as text (a string, or an int64); None otherwise."""
    if isinstance(v, str):
        return v
    return str(v) if _is_int(v, -(2**63), 2**63 - 1) else None


_RANK_IN_NAME = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?(?:\.gz)?$")


@dataclass
class RankDump:
    """One rank's dump as columns (times on its own clock)."""

    file: str
    rank: int
    version: str
    pg_ranks: dict[str, list[int]]
    pg_desc: dict[str, str]
    group_key: list[str] = field(default_factory=list)
    """Group key of each row (``pg name`` or ``pg name/p2p``)."""
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    """``seq, op, nbytes, t_enter, t_start, t_exit, finished, record``."""

    def keep(self, rows: np.ndarray) -> None:
        """Keep only the rows ``rows`` (a mask) selects."""
        self.cols = {k: v[rows] for k, v in self.cols.items()}
        self.group_key = [k for k, on in zip(self.group_key, rows.tolist()) if on]


def _bool(e: dict[str, Any], key: str) -> bool:
    """``e[key]``, a boolean (False when absent or null).

    Raises:
        Unusable: anything else.
    """
    v = e.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise Unusable(f"whose {key} is not a boolean")
    return v


def _text(e: dict[str, Any], key: str) -> str:
    """``e[key]``, a string ("" when absent or null).

    Raises:
        Unusable: anything else.
    """
    v = e.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise Unusable(f"whose {key} is not a string")
    return v


def _group(e: dict[str, Any]) -> tuple[str, str | None]:
    """``(process group name, its description or None)`` of an entry.

    Raises:
        Unusable: a ``process_group`` that is not ``[name, description]``, or a ``pg_id``
            that is not a name.
    """
    pg = e.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        name = _name(pg[0])
        desc = pg[1] if len(pg) > 1 else None
        if name is None or not isinstance(desc, str | None):
            raise Unusable("whose process_group is not [name, description]")
        return name, desc
    name = _name(_or(e.get("pg_id"), "0"))
    if name is None:
        raise Unusable("whose pg_id is not a name")
    return name, None


def _parse_entry(e: Any, position: int) -> tuple[str, str, tuple[int, ...], str | None]:
    """One ``entries`` item as ``(process group, group key, row, the group's description
    or None)``. The group key is the process group's name, ``<name>/p2p`` for
    point-to-point entries; the row holds ``seq, op, nbytes, t_enter, t_start, t_exit,
    finished, record`` (``record`` is ``position`` where the entry has no ``record_id``).

    Raises:
        Unusable: not a map, no creation time, or a value of the wrong type or one that
            cannot be (the text says which).
    """
    if not isinstance(e, dict):
        raise Unusable("that are not maps")
    created = e.get("time_created_ns")
    if created is None:
        raise Unusable("without time_created_ns")
    if not _is_int(created, 1, schema.MAX_TIME_NS):
        raise Unusable("whose time_created_ns is not a time in 0..2**62 ns")
    pg_name, desc = _group(e)
    p2p = _bool(e, "is_p2p")
    seq_key = "p2p_seq_id" if p2p else "collective_seq_id"
    seq = _or(e.get(seq_key), -1)
    if not _is_int(seq, -1, MAX_COUNT):
        raise Unusable(f"whose {seq_key} is not an integer in -1..2**62")
    record = _or(e.get("record_id"), position)
    if not _is_int(record, 0, 2**63 - 1):
        raise Unusable("whose record_id is not an integer in 0..2**63-1")
    started = _time(e, "time_discovered_started_ns")
    t_exit = _time(e, "time_discovered_completed_ns")
    if t_exit >= 0 and (t_exit < created or t_exit < started):
        raise Unusable("that complete before they were created or started")
    if t_exit - created > MAX_DURATION_NS:
        raise Unusable("that last longer than 7 days")
    finished = _text(e, "state") == "completed" or _bool(e, "retired") or t_exit >= 0
    row = (
        seq,
        schema.OP_INDEX[_op(_text(e, "profiling_name"))],
        _nbytes(e.get("input_sizes"), e.get("input_dtypes")),
        created,
        started,
        t_exit,
        int(finished),
        record,
    )
    return pg_name, (f"{pg_name}/p2p" if p2p else pg_name), row, desc


def _or(v: Any, default: Any) -> Any:
    """``v``, or ``default`` where it is absent or null."""
    return default if v is None else v


def _dump_rank(path: Path, obj: dict[str, Any], report: ImportReport) -> int:
    """The rank a dump names (its ``rank``, else a number ending the file name); -1 when
    neither is a rank (it is numbered after the others)."""
    v = obj.get("rank")
    if _is_int(v, 0, MAX_RANKS - 1):
        return v
    m = _RANK_IN_NAME.search(path.name)
    named = int(m.group(1)) if m else -1
    if v is not None:
        report.problem(
            path,
            f"rank is not an integer in 0..{MAX_RANKS - 1}; numbered by its file name "
            "(or after the others)",
        )
    return named if 0 <= named < MAX_RANKS else -1


def _pg_config(
    path: Path, obj: dict[str, Any], report: ImportReport
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """``(members, description)`` of each process group in ``pg_config``; a group whose
    name or members cannot be is named and passed over."""
    pg_ranks: dict[str, list[int]] = {}
    pg_desc: dict[str, str] = {}
    cfg = obj.get("pg_config")
    if not isinstance(cfg, dict):
        return pg_ranks, pg_desc
    for key, info in cfg.items():
        name = _name(key)
        if name is None or not isinstance(info, dict):
            report.problem(path, "a pg_config entry that is not a named map passed over")
            continue
        r = _ranks_of(info.get("ranks"))
        if r is not None:
            pg_ranks[name] = r
        elif info.get("ranks") is not None:
            report.problem(
                path,
                f"pg_config {name[:40]!r}: ranks are not distinct ranks in "
                f"0..{MAX_RANKS - 1}; members unknown",
            )
        desc = info.get("desc")
        pg_desc[name] = desc if isinstance(desc, str) else ""
    return pg_ranks, pg_desc


def parse_dump(path: Path, obj: dict[str, Any], report: ImportReport) -> RankDump | None:
    """Columns of one dump; entries that cannot be used are counted, by why, as problems."""
    rank = _dump_rank(path, obj, report)
    pg_ranks, pg_desc = _pg_config(path, obj, report)
    keys: list[str] = []
    rows: list[tuple[int, ...]] = []
    why: dict[str, int] = {}
    for e in obj["entries"]:
        try:
            pg_name, key, row, desc = _parse_entry(e, len(rows))
        except Unusable as exc:
            why[str(exc)] = why.get(str(exc), 0) + 1
            continue
        if desc is not None:
            pg_desc.setdefault(pg_name, desc)
        keys.append(key)
        rows.append(row)
    for text, n in why.items():
        report.problem(path, f"{n} entr{'y' if n == 1 else 'ies'} {text} left out")
    if not rows:
        report.problem(path, "holds no collective entry; left out")
        return None
    arr = np.array(rows, np.int64).reshape(len(rows), 8)
    order = np.argsort(arr[:, 7], kind="stable")
    arr = arr[order]
    keys = [keys[i] for i in order.tolist()]
    names = ("seq", "op", "nbytes", "t_enter", "t_start", "t_exit", "finished", "record")
    version = obj.get("version")
    dump = RankDump(
        str(path), rank, version if isinstance(version, str) else "", pg_ranks, pg_desc, keys
    )
    dump.cols = {n: arr[:, i].copy() for i, n in enumerate(names)}
    return dump


def _assign_ranks(dumps: list[RankDump], report: ImportReport) -> None:
    taken: set[int] = set()
    for d in dumps:
        if d.rank >= 0 and d.rank in taken:
            report.problem(d.file, f"rank {d.rank} again; numbered after the others")
            d.rank = -1
        if d.rank >= 0:
            taken.add(d.rank)
    nxt = 0
    for d in dumps:
        if d.rank < 0:
            while nxt in taken:
                nxt += 1
            d.rank = nxt
            taken.add(nxt)


def messages(
    files: list[Path], report: ImportReport, *, job: str, run: str
) -> Iterator[bytes | tuple[bytes, int]]:
    """Wire messages of a set of Flight Recorder dumps, one file per rank (module docstring)."""
    dumps: list[RankDump] = []
    for f in files:
        try:
            obj = load_dump(f)
        except DumpError as exc:
            report.problem(f, f"{exc}; left out")
            continue
        except OSError as exc:
            report.problem(f, f"cannot be read ({exc.strerror or exc}); left out")
            continue
        d = parse_dump(f, obj, report)
        if d is not None:
            dumps.append(d)
    if not dumps:
        return
    _assign_ranks(dumps, report)
    dumps.sort(key=lambda d: d.rank)
    imported = [d.rank for d in dumps]
    world = max(imported) + 1
    # Process groups: ids in first-seen order; members from pg_config.
    gid: dict[str, int] = {}
    members: dict[str, list[int]] = {}
    desc: dict[str, str] = {}
    for d in dumps:
        for k in d.group_key:
            if k not in gid:
                gid[k] = len(gid)
        for name, r in d.pg_ranks.items():
            members.setdefault(name, r)
        for name, t in d.pg_desc.items():
            desc.setdefault(name, t)
    for d in dumps:
        d.cols["group"] = np.array([gid[k] for k in d.group_key], np.int64)
    world = max([world, *(r + 1 for ranks in members.values() for r in ranks)])
    # Clock alignment from discovered completion times (NCCL; gloo has none).
    offsets = {r: 0 for r in imported}
    all_rank = np.concatenate([np.full(d.cols["seq"].shape[0], d.rank) for d in dumps])
    cat = {k: np.concatenate([d.cols[k] for d in dumps]) for k in ("group", "seq", "t_exit")}
    al = estimate_offsets(all_rank, cat["group"], cat["seq"], cat["t_exit"])
    if len(imported) > 1 and al.max_error_ns is not None and (al.error_ns >= 0).sum() > 1:
        offsets.update(al.resolved())
        report.alignment_ns = al.max_error_ns
        report.details["clock_offsets_ns"] = {str(r): offsets[r] for r in imported}
    elif len(imported) > 1:
        report.lack(
            "cross-rank clock alignment (no discovered completion times: host wall clocks "
            "as written)"
        )
    if not any((d.cols["t_exit"] >= 0).any() for d in dumps):
        report.lack(
            "collective completion times (the backend does not discover them; "
            "only whether each one finished)"
        )
    report.lack(
        f"steps (a dump has none: one step is {STEP_COLLECTIVES} collectives of the "
        "busiest process group)"
    )
    report.lack("phases, tokens and samples per step")
    report.lack("device samples (clocks, power, throttling)")
    for d in dumps:
        _align(d, offsets[d.rank], report)
    # Steps: STEP_COLLECTIVES consecutive seqs of the busiest group.
    counts = np.bincount(np.concatenate([d.cols["group"] for d in dumps]), minlength=len(gid))
    clock = int(np.argmax(counts))
    for d in dumps:
        d.cols["step"] = _steps_of(d.cols, clock)
        _drop_long_steps(d, report)
    report.details["hang"] = hang_summary(dumps, gid, members)
    report.files_read = [d.file for d in dumps]
    src = source_manifest(KIND, report.files_read, report.lacks)
    src["alignment_ns"] = report.alignment_ns
    headers = {d.rank: header(job, run, d.rank) for d in dumps}
    t_first = min(
        (int(d.cols["t_enter"].min()) for d in dumps if d.cols["seq"].shape[0]), default=0
    )
    for d in dumps:
        ident = {
            "rank": d.rank,
            "world_size": world,
            "local_rank": 0,
            "host": f"rank{d.rank}",
            "node_rank": -1,
            "pid": 0,
        }
        manifest = {
            "source": src,
            "flight_recorder_version": d.version,
            "dump_file": Path(d.file).name,
        }
        yield schema.hello_message(
            next_header(headers[d.rank]), ident, manifest=manifest, t_start_ns=max(0, t_first)
        )
    group_list = []
    for k, i in gid.items():
        pg = k.removesuffix("/p2p")
        ranks = [r for r in members.get(pg, imported) if 0 <= r < world] or list(imported)
        group_list.append(
            {
                "id": i,
                "name": (k if pg else f"pg{i}")[: schema.MAX_NAME_CHARS],
                "ranks": ranks,
                "backend": "nccl",
                "desc": desc.get(pg, "")[: schema.MAX_NAME_CHARS],
            }
        )
    yield schema.groups_message(next_header(headers[imported[0]]), group_list)
    for d in dumps:
        stats = {
            "dropped_batches": 0,
            "dropped_events": 0,
            "errors": {},
            "clock_offset_ns": int(offsets[d.rank]),
            "clock_error_ns": int(report.alignment_ns or 0),
        }
        yield schema.stats_message(next_header(headers[d.rank]), stats)
    for d in dumps:
        yield from _rank_messages(d, headers[d.rank], offsets[d.rank])


def _align(d: RankDump, off: int, report: ImportReport) -> None:
    """Shift ``d``'s times by ``-off``; rows whose times then leave
    ``0..schema.MAX_TIME_NS`` are left out and named (the hub would refuse the rank's
    whole message for one of them)."""
    inside = np.ones(d.cols["seq"].shape[0], bool)
    for k in ("t_enter", "t_start", "t_exit"):
        c = d.cols[k]
        known = c >= 0
        d.cols[k] = np.where(known, c - off, c)
        inside &= ~known | ((d.cols[k] >= 0) & (d.cols[k] <= schema.MAX_TIME_NS))
    if not inside.all():
        n = int((~inside).sum())
        report.problem(
            d.file,
            f"{n} entr{'y' if n == 1 else 'ies'} whose times leave 0..2**62 ns once aligned "
            f"(clock offset {off} ns) left out",
        )
        d.keep(inside)


def _drop_long_steps(d: RankDump, report: ImportReport) -> None:
    """Leave out the finished steps of ``d`` that last longer than `MAX_DURATION_NS`
    (entries further apart than the hub takes in one step), naming them."""
    c = d.cols
    known_end = np.where(c["t_exit"] >= 0, c["t_exit"], c["t_enter"])
    long = [
        s
        for s in np.unique(c["step"]).tolist()
        if c["finished"][c["step"] == s].all()
        and known_end[c["step"] == s].max() - c["t_enter"][c["step"] == s].min() > MAX_DURATION_NS
    ]
    if long:
        out = np.isin(c["step"], long)
        report.problem(
            d.file,
            f"{len(long)} step(s) longer than 7 days ({int(out.sum())} entries further apart "
            "than the hub takes) left out",
        )
        d.keep(~out)


def _steps_of(cols: dict[str, np.ndarray], clock: int) -> np.ndarray:
    """Step of each row: rows of the clock group by seq; others by the clock row open when
    they were created (record order)."""
    on = cols["group"] == clock
    step = np.full(cols["seq"].shape[0], -1, np.int64)
    seq = cols["seq"]
    step[on] = np.maximum(seq[on] - 1, 0) // STEP_COLLECTIVES
    # Carry the latest clock step forward in record order (rows are sorted by record).
    idx = np.where(on, np.arange(step.shape[0]), -1)
    idx = np.maximum.accumulate(idx)
    first = int(step[on][0]) if on.any() else 0
    return np.where(idx >= 0, step[np.clip(idx, 0, None)], first)


def _rank_messages(
    d: RankDump, h: dict[str, Any], offset_ns: int
) -> Iterator[bytes | tuple[bytes, int]]:
    c = d.cols
    n = c["seq"].shape[0]
    if n == 0:
        return  # every entry was left out once aligned (named then)
    known_end = np.where(c["t_exit"] >= 0, c["t_exit"], c["t_enter"])
    steps = np.unique(c["step"])
    done = np.array([bool(c["finished"][c["step"] == s].all()) for s in steps.tolist()])
    ended = steps[done]
    st = schema.empty_table("steps", ended.shape[0])
    st["step"] = ended
    st["t_start"] = np.array([c["t_enter"][c["step"] == s].min() for s in ended.tolist()], np.int64)
    st["t_end"] = np.array([known_end[c["step"] == s].max() for s in ended.tolist()], np.int64)
    co = {
        "step": c["step"],
        "op": c["op"].astype(np.int8),
        "group": c["group"].astype(np.int32),
        "seq": c["seq"],
        "nbytes": c["nbytes"],
        "t_enter": c["t_enter"],
        "t_start": c["t_start"],
        "t_end": c["t_exit"],
        "t_exit": c["t_exit"],
        "flags": np.zeros(n, np.int32),
    }
    yield schema.steps_message(next_header(h), st, None, co)
    # Where this rank stands: the oldest unfinished collective, or after the last finished.
    open_ = np.flatnonzero(c["finished"] == 0)
    fin = np.flatnonzero(c["finished"] == 1)
    exit_t = int(known_end[fin].max()) if fin.shape[0] else -1
    pos = dict.fromkeys(schema.BEAT_POS_FIELDS, -1)
    pos["t"] = int(max(known_end.max(), c["t_enter"].max()))
    if ended.shape[0]:
        pos["ended"] = int(ended[-1])
        pos["ended_t"] = int(st["t_end"][-1])
    pos["exit_t"] = exit_t
    if open_.shape[0]:
        i = int(open_[0])
        s = int(c["step"][i])
        pos["step"] = s
        pos["step_t0"] = int(c["t_enter"][c["step"] == s].min())
        pos["group"], pos["seq"], pos["op"] = int(c["group"][i]), int(c["seq"][i]), int(c["op"][i])
        pos["since"] = int(c["t_enter"][i])
    # The position holds when the dump was written (by the watchdog at its timeout, or on
    # request): that instant, on the aligned clock, is when this beat was heard, so the
    # stall judge measures the idle time the job had, not the time until the import.
    written = os.stat(d.file).st_mtime_ns - offset_ns
    yield schema.beat_message(next_header(h), pos), max(int(written), pos["t"])


def hang_summary(
    dumps: list[RankDump], gid: dict[str, int], members: dict[str, list[int]]
) -> list[dict[str, Any]]:
    """Per unfinished instance ``(group, seq)``: who entered and did not finish, and which
    members never entered (a member whose dump was not imported is named as not dumped).

    Args:
        dumps: the ranks' dumps (``group`` column set).
        gid: group key -> id.
        members: pg name -> member ranks (from ``pg_config``).

    Returns:
        Instances, oldest first (at most 64).
    """
    name_of = {i: k for k, i in gid.items()}
    have = {d.rank for d in dumps}
    last_seq: dict[tuple[int, int], int] = {}
    inside: dict[tuple[int, int], list[int]] = {}
    first_t: dict[tuple[int, int], int] = {}
    for d in dumps:
        c = d.cols
        for g in np.unique(c["group"]).tolist():
            sel = c["group"] == g
            last_seq[(d.rank, g)] = int(c["seq"][sel].max())
        for i in np.flatnonzero(c["finished"] == 0).tolist():
            key = (int(c["group"][i]), int(c["seq"][i]))
            inside.setdefault(key, []).append(d.rank)
            first_t[key] = min(first_t.get(key, 1 << 62), int(c["t_enter"][i]))
    out = []
    for key in sorted(inside, key=lambda k: first_t[k])[:64]:
        g, s = key
        pg = name_of[g].removesuffix("/p2p")
        mem = members.get(pg) or sorted(have)
        never = [r for r in mem if r in have and last_seq.get((r, g), -1) < s]
        out.append(
            {
                "group": name_of[g],
                "seq": s,
                "entered_not_finished": sorted(inside[key]),
                "never_entered": never,
                "not_dumped": [r for r in mem if r not in have],
            }
        )
    return out
